"""Wire protocol: round trips, limits, and messages written by older peers."""

import math
import re

import msgspec
import pytest

from ringstream.ipc import protocol as P

CLIENT_MESSAGES = [
    P.Generate(id="a", prompt="hello", sampling=P.SamplingParams(max_tokens=8, temperature=0.0, stop=["\n"], seed=3),
               priority=-2),
    P.Generate(id="b", prompt_token_ids=[1, 2, 3], stream=False, queue_timeout_s=0.5, timeout_s=2.0),
    P.Cancel(id="a"),
    P.Heartbeat(),
    P.Status(),
    P.Admin(settings={"max_concurrency": 8, "preemption": False, "aging_rate": 0.5, "policy": "evict"}),
]
SERVER_MESSAGES = [
    P.Chunk(id="a", seq=0, text="héllo 🎉", token_ids=[5, 6]),
    P.Chunk(id="a", seq=1, finish_reason=P.FinishReason.STOP, stop_reason="\n", usage=P.Usage(3, 2, 0.1, 0.2, 0.3)),
    P.Error(id=None, code=P.ErrorCode.INVALID_REQUEST, message="bad"),
    P.HeartbeatAck(),
]
WORKER_MESSAGES = [
    (P.COMMAND_DECODER, P.Assign(handle=1, prompt_token_ids=[1], sampling=P.SamplingParams(max_tokens=2, top_k=3),
                                 output_token_ids=[4])),
    (P.COMMAND_DECODER, P.Abort(handle=1)),
    (P.COMMAND_DECODER, P.Shutdown()),
    (P.EVENT_DECODER, P.WorkerReady(worker=0, pid=1, device="cpu", capacity=P.WorkerCapacity(
        max_num_seqs=4, max_model_len=512, kv_cache_tokens=2048, kv_cache_bytes=1 << 20, block_size=16,
        prefix_caching=True))),
    (P.EVENT_DECODER, P.Doorbell(worker=1)),
    (P.FINISH_DECODER, P.Finish(finish_reason=P.FinishReason.LENGTH, prompt_tokens=3, completion_tokens=4)),
]


@pytest.mark.parametrize("msg", CLIENT_MESSAGES)
def test_client_messages_round_trip(msg):
    assert P.CLIENT_DECODER.decode(P.encode(msg)) == msg


@pytest.mark.parametrize("msg", SERVER_MESSAGES)
def test_server_messages_round_trip(msg):
    assert P.SERVER_DECODER.decode(P.encode(msg)) == msg


@pytest.mark.parametrize("decoder,msg", WORKER_MESSAGES)
def test_worker_messages_round_trip(decoder, msg):
    assert decoder.decode(P.encode(msg)) == msg


def test_messages_of_an_older_peer_decode_with_defaults():
    # Older peers may send only the leading fields; newer fields take their defaults.
    old_generate = msgspec.msgpack.encode(["generate", "r1", "prompt text", None, [5]])
    msg = P.CLIENT_DECODER.decode(old_generate)
    assert (msg.id, msg.prompt, msg.sampling.max_tokens, msg.sampling.temperature, msg.stream) == (
        "r1", "prompt text", 5, 1.0, True)
    assert P.CLIENT_DECODER.decode(msgspec.msgpack.encode(["generate", "r1", None, [1, 2]])).sampling == (
        P.SamplingParams())
    old_chunk = msgspec.msgpack.encode(["chunk", "r1", 0, "text"])
    assert P.SERVER_DECODER.decode(old_chunk) == P.Chunk(id="r1", seq=0, text="text")
    old_status = msgspec.msgpack.encode(["status_reply", "0.1", True, "serving", 1.0, 0, 0, 10, 4, 0, 0, []])
    assert P.SERVER_DECODER.decode(old_status).counters == {}


def _status_reply(**fields) -> P.StatusReply:
    worker = P.WorkerStatus(index=0, device="cpu", pid=7, alive=True, running=1, max_num_seqs=4, max_model_len=512,
                            kv_cache_tokens=2048, kv_cache_tokens_used=64, ring_fill=0.0, requests_served=3,
                            waiting=2, tokens_per_s=95.5)
    return P.StatusReply(version="1", ready=True, state="serving", uptime_s=9.0, waiting=1, running=1, queue_size=10,
                         max_concurrency=4, requests_total=5, tokens_generated_total=80, workers=[worker], **fields)


def test_status_reply_with_requests_and_figures_round_trips():
    reply = _status_reply(
        model="/models/tiny", tokens_per_s=120.5, tokens_per_s_window_s=10.0, ttft_p50_s=0.01, ttft_p99_s=0.2,
        itl_p50_s=0.005, itl_p99_s=0.02, requests_open=2,
        requests=[P.RequestInfo(id="r1", priority=-1, state="running", worker=0, prompt_tokens=4,
                                completion_tokens=9, max_tokens=16, age_s=1.5, ttft_s=0.05),
                  P.RequestInfo(id="r2", priority=0, state="waiting", prompt_tokens=7, max_tokens=16, age_s=0.2)])
    decoded = P.SERVER_DECODER.decode(P.encode(reply))
    assert decoded == reply
    assert decoded.requests[1].worker is None and decoded.requests[1].ttft_s is None
    as_dict = P.to_dict(decoded)
    assert as_dict["model"] == "/models/tiny" and as_dict["requests"][0]["ttft_s"] == 0.05
    assert as_dict["workers"][0]["tokens_per_s"] == 95.5


def test_status_reply_of_the_previous_version_decodes_with_defaults():
    # The previous layout: StatusReply up to ``notes``, WorkerStatus up to ``preemptions_priority``.
    old_worker = ["cpu", 7, True, 1, 4, 512, 2048, 64, 0.25, 3, 16, 128, 120, 0.06, 1, 10, 4, 2]
    old_reply = ["status_reply", "1", True, "serving", 9.0, 1, 1, 10, 4, 5, 80, [[0, *old_worker]],
                 {"max_concurrency": 4}, {"requests_total": 5}, {"ringstream_requests_running": 1.0}, ["a note"]]
    reply = P.SERVER_DECODER.decode(msgspec.msgpack.encode(old_reply))
    assert reply.notes == ["a note"] and reply.workers[0].preemptions_priority == 2
    assert (reply.model, reply.tokens_per_s, reply.requests_open, reply.requests) == ("", 0.0, 0, [])
    assert reply.ttft_p50_s is None and reply.itl_p99_s is None
    assert (reply.workers[0].waiting, reply.workers[0].tokens_per_s) == (0, 0.0)



class _PreviousWorkerStatus(msgspec.Struct, array_like=True, omit_defaults=True):
    index: int
    device: str
    pid: int
    alive: bool
    running: int
    max_num_seqs: int
    max_model_len: int
    kv_cache_tokens: int
    kv_cache_tokens_used: int
    ring_fill: float
    requests_served: int
    block_size: int = 1
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_cache_usage: float = 0.0
    preemptions_kv_cache: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions_priority: int = 0


class _PreviousStatusReply(msgspec.Struct, tag="status_reply", array_like=True, omit_defaults=True):
    version: str
    ready: bool
    state: str
    uptime_s: float
    waiting: int
    running: int
    queue_size: int
    max_concurrency: int
    requests_total: int
    tokens_generated_total: int
    workers: list[_PreviousWorkerStatus]
    settings: dict = {}
    counters: dict[str, int] = {}
    metrics: dict[str, float] = {}
    notes: list[str] = []


def test_a_peer_of_the_previous_version_reads_a_status_reply():
    reply = _status_reply(model="m", tokens_per_s=1.0, requests_open=1,
                          requests=[P.RequestInfo(id="r", priority=0, state="waiting")], notes=["n"])
    old = msgspec.msgpack.decode(P.encode(reply), type=_PreviousStatusReply)
    assert (old.version, old.tokens_generated_total, old.notes) == ("1", 80, ["n"])
    assert old.workers[0].requests_served == 3


def test_newer_peer_fields_are_ignored():
    newer = msgspec.msgpack.encode(["cancel", "r1", "a field from the future"])
    assert P.CLIENT_DECODER.decode(newer) == P.Cancel(id="r1")


@pytest.mark.parametrize("fields", [
    dict(max_tokens=0), dict(max_tokens=-1), dict(max_tokens=2**40), dict(temperature=math.nan),
    dict(temperature=math.inf), dict(temperature=-0.5), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
    dict(stop=["x"] * (P.MAX_STOP_STRINGS + 1)), dict(stop=[""]), dict(stop_token_ids=[-1]),
    dict(queue_timeout_s=0.0), dict(timeout_s=-1.0), dict(seed=-1),
])
def test_out_of_range_fields_fail_to_decode(fields):
    frame = P.encode(P.make_generate("x", prompt="p", **fields))
    with pytest.raises(msgspec.ValidationError):
        P.CLIENT_DECODER.decode(frame)


@pytest.mark.parametrize("frame", [
    b"", b"\xc1", b"\x92", msgspec.msgpack.encode(["nope"]), msgspec.msgpack.encode({"id": "x"}),
    msgspec.msgpack.encode(["generate", "x" * (P.MAX_ID_CHARS + 1)]), msgspec.msgpack.encode(["generate", ""]),
    b"\xdd\xff\xff\xff\xff", msgspec.msgpack.encode(["cancel", [[[[[[[[[[1]]]]]]]]]]]),
])
def test_malformed_frames_raise_decode_error(frame):
    with pytest.raises(msgspec.DecodeError):
        P.CLIENT_DECODER.decode(frame)


def test_decode_errors_name_the_field():
    frame = msgspec.msgpack.encode(["generate", "r", "x", None, [5, 1.0, 1.0, 0, None, ["ok", 5]]])
    with pytest.raises(msgspec.ValidationError) as info:
        P.CLIENT_DECODER.decode(frame)
    assert P.explain(info.value, frame) == "Expected `str`, got `int` - at `sampling.stop[1]`"
    frame = msgspec.msgpack.encode(["generate", "r", "x", None, [], "high"])
    with pytest.raises(msgspec.ValidationError) as info:
        P.CLIENT_DECODER.decode(frame)
    assert P.explain(info.value, frame) == "Expected `int`, got `str` - at `priority`"
    assert P.explain(msgspec.DecodeError("boom"), b"\xc1") == "boom"


def test_to_dict_names_fields_recursively():
    chunk = P.Chunk(id="a", seq=1, finish_reason=P.FinishReason.LENGTH, usage=P.Usage(1, 2))
    as_dict = P.to_dict(chunk)
    assert as_dict["finish_reason"] == "length" and as_dict["usage"]["completion_tokens"] == 2


# --------------------------------------------------------------------------
# version 2: sampling parameters nested in one array


def test_a_version_1_generate_with_sampling_fields_is_refused_naming_sampling():
    # Version 1 laid max_tokens ... ignore_eos out flat from position 4; version 2 nests them there.
    old = ["generate", "r1", "prompt text", None, 5, 0.0, 1.0, 0, None, ["\n"], [], False, -3]
    frame = msgspec.msgpack.encode(old)
    with pytest.raises(msgspec.ValidationError) as info:
        P.CLIENT_DECODER.decode(frame)
    assert P.explain(info.value, frame) == "Expected `array`, got `int` - at `sampling`"
    assert P.PROTOCOL_VERSION == 2


def test_generate_carries_sampling_as_one_nested_array():
    sampling = P.SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=4, seed=11, stop=["a", "bc"],
                                stop_token_ids=[3], ignore_eos=True)
    frame = P.encode(P.Generate(id="r", prompt_token_ids=[1], sampling=sampling, priority=2))
    nested = [7, 0.5, 0.9, 4, 11, ["a", "bc"], [3], True, 0.0, 0.0, 1.0, 0.0, 0, None, None, None]
    assert msgspec.msgpack.decode(frame)[:6] == ["generate", "r", None, [1], nested, 2]
    assert P.CLIENT_DECODER.decode(frame).sampling == sampling


def test_sampling_params_of_a_newer_peer_decode_with_their_fields_ignored():
    fields = [4, 0.0, 1.0, 0, None, [], [], False, 0.5, 0.0, 1.2, 0.1, 2, 3, None, None, "future"]
    frame = msgspec.msgpack.encode(["generate", "r", "x", None, fields, 1])
    msg = P.CLIENT_DECODER.decode(frame)
    assert msg.sampling == P.SamplingParams(max_tokens=4, temperature=0.0, presence_penalty=0.5,
                                            repetition_penalty=1.2, min_p=0.1, min_tokens=2, logprobs=3)
    assert msg.priority == 1


def test_sampling_params_of_the_older_layout_decode_with_every_new_field_off():
    # The layout before the penalties, min_p, min_tokens and logprobs were appended: eight fields.
    frame = msgspec.msgpack.encode(["generate", "r", "x", None, [4, 0.0, 1.0, 0, 7, ["\n"], [2], True], 1])
    sampling = P.CLIENT_DECODER.decode(frame).sampling
    assert sampling == P.SamplingParams(max_tokens=4, temperature=0.0, seed=7, stop=["\n"], stop_token_ids=[2],
                                        ignore_eos=True)
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty, sampling.min_p,
            sampling.min_tokens, sampling.logprobs, sampling.prompt_logprobs) == (0.0, 0.0, 1.0, 0.0, 0, None, None)
    assert not sampling.penalized
    old_assign = msgspec.msgpack.encode(["assign", 3, [1, 2], [4, 1.0, 1.0, 0, None, [], [], False]])
    assert P.COMMAND_DECODER.decode(old_assign).sampling == P.SamplingParams(max_tokens=4)


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("repetition_penalty", 0.0), ("min_p", 1.5),
    ("min_tokens", -1), ("logprobs", P.MAX_LOGPROBS + 1), ("prompt_logprobs", -1),
])
def test_new_sampling_limits_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"`{field}`"):
        P.check_sampling(P.SamplingParams(**{field: value}))
    frame = P.encode(P.Generate(id="r", prompt="x", sampling=P.SamplingParams(**{field: value})))
    with pytest.raises(msgspec.ValidationError) as info:
        P.CLIENT_DECODER.decode(frame)
    assert f"sampling.{field}" in P.explain(info.value, frame)
    with pytest.raises(ValueError, match="min_tokens"):
        P.check_sampling(P.SamplingParams(max_tokens=2, min_tokens=3))


def test_chunk_logprobs_round_trip_and_an_older_chunk_has_none():
    top = [(5, -0.25), (9, -1.5)]
    chunk = P.Chunk(id="a", seq=0, text="x", token_ids=[5], logprobs=[P.TokenLogprob(5, -0.25, top)],
                    prompt_logprobs=[None, P.TokenLogprob(3, -2.0)], prompt_token_ids=[1, 3])
    assert P.SERVER_DECODER.decode(P.encode(chunk)) == chunk
    old = msgspec.msgpack.encode(["chunk", "a", 0, "x", [5], None, None, None])
    decoded = P.SERVER_DECODER.decode(old)
    assert decoded.logprobs is None and decoded.prompt_logprobs is None and decoded.token_ids == [5]


def test_make_generate_nests_the_flat_sampling_fields():
    msg = P.make_generate("r", prompt="hi", max_tokens=3, stop=["x"], seed=7, priority=-1, stream=False)
    assert msg == P.Generate(id="r", prompt="hi", sampling=P.SamplingParams(max_tokens=3, stop=["x"], seed=7),
                             priority=-1, stream=False)
    with pytest.raises(TypeError):
        P.make_generate("r", prompt="hi", max_token=3)
    with pytest.raises(TypeError):
        P.make_generate("r", prompt="hi", sampling=P.SamplingParams(), max_tokens=3)


@pytest.mark.parametrize("params, field", [
    (P.SamplingParams(max_tokens=0), "max_tokens"), (P.SamplingParams(temperature=math.nan), "temperature"),
    (P.SamplingParams(top_p=0.0), "top_p"), (P.SamplingParams(top_k=-1), "top_k"), (P.SamplingParams(seed=-1), "seed"),
    (P.SamplingParams(stop=[""]), "stop[0]"), (P.SamplingParams(stop="abc"), "stop"),
    (P.SamplingParams(stop_token_ids=[-2]), "stop_token_ids[0]"), (P.SamplingParams(stop_token_ids=[9]), "vocabulary"),
])
def test_check_sampling_applies_the_wire_limits_and_the_vocabulary(params, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        P.check_sampling(params, vocab_size=8)


def test_check_sampling_accepts_what_the_wire_accepts():
    P.check_sampling(P.SamplingParams(max_tokens=P.MAX_TOKENS_LIMIT, temperature=0, stop=("a",), stop_token_ids=[7]),
                     vocab_size=8)
    P.check_sampling(P.SamplingParams(stop_token_ids=[10**6]))  # no vocabulary given: only the wire's limits


def test_generate_messages_and_metrics_round_trip():
    msg = P.make_generate("c1", messages=[P.ChatMessage(role="user", content="hi")], max_tokens=3)
    decoded = P.CLIENT_DECODER.decode(P.encode(msg))
    assert decoded.messages == [P.ChatMessage(role="user", content="hi")] and decoded.prompt is None
    assert P.CLIENT_DECODER.decode(P.encode(P.make_generate("c2", prompt="x"))).messages is None
    frame = P.encode(P.Generate(id="c3", messages=[P.ChatMessage(role="")]))
    with pytest.raises(P.DecodeError) as info:  # a role is required and bounded
        P.CLIENT_DECODER.decode(frame)
    assert "`messages[0]" in P.explain(info.value, frame)
    assert isinstance(P.CLIENT_DECODER.decode(P.encode(P.Metrics())), P.Metrics)
    assert P.SERVER_DECODER.decode(P.encode(P.MetricsReply(text="a 1\n"))).text == "a 1\n"
    older = P.encode(P.StatusReply(version="v", ready=True, state="serving", uptime_s=0, waiting=0, running=0,
                                   queue_size=0, max_concurrency=0, requests_total=0, tokens_generated_total=0,
                                   workers=[]))
    assert P.SERVER_DECODER.decode(older).accepts_messages is False
