"""Hostile input: a seeded barrage of malformed and abusive frames while a greedy stream runs.

Every frame gets exactly one typed ``Error`` (and nothing else), the victim's
streams stay identical to a solo run, the front's RSS stays flat and its
event loop keeps answering heartbeats within 100 ms.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from ringstream.ipc import protocol as P
from ringstream.ipc.client import Client
from tests.reliability.helpers import MIB, rss, status
from ringstream.tools.soak import (
    HOSTILE_KINDS, VictimStreams, heartbeat_probe, hostile_frames, oversize_frames, raw_socket, run_barrage,
)

# Timed against a real daemon on a shared 2-core host: one rerun absorbs a host hiccup.
pytestmark = pytest.mark.flaky(reruns=2)

PROMPT = "The socket module"
GREEDY = dict(max_tokens=200, temperature=0.0, ignore_eos=True)
VICTIM_ID = "victim"
FRAMES = 1200
SEED = 20240601
PROBE_S = 6.0
MAX_STALL_S = 0.250
"""Round-trip bound for each probe. The target is 100 ms (met on a quiet host, see docs); on a 2-core
CI host shared with the daemon's worker a scheduler slice alone can take tens of ms, so CI allows 250."""
RSS_BOUND = 30 * MIB
NOT_COUNTED = ("bad_admin", "cancel_other_client", "cancel_flood")
"""Kinds answered with an Error but not counted as invalid requests (admin refusals, unknown ids)."""


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    d = start_module_daemon("--devices", "cpu", worker_threads=1)
    with Client(d.address) as client:
        d.solo = client.complete(PROMPT, **GREEDY)
    return d


@pytest.mark.e2e
def test_1000_hostile_frames_get_typed_errors_while_a_greedy_stream_runs_unchanged(daemon):
    run_barrage(daemon.address, hostile_frames(SEED - 1, 300, VICTIM_ID))  # warm-up: allocator, caches
    before = status(daemon.address).counters
    rss_before = rss(daemon.proc.pid)
    frames = hostile_frames(SEED, FRAMES, VICTIM_ID)
    with heartbeat_probe(daemon.address, PROBE_S) as probe, VictimStreams(daemon.address, PROMPT, GREEDY) as victim:
        time.sleep(0.5)  # the victim's first stream is running
        result = run_barrage(daemon.address, frames)
        rtts = probe()
    growth = rss(daemon.proc.pid) - rss_before
    counters = status(daemon.address).counters

    assert result.total == FRAMES >= 1000
    assert len(result.sent) == len(HOSTILE_KINDS), f"some kind never drawn: {result.sent}"
    assert result.unanswered == 0
    assert result.wrong == []
    counted = sum(n for kind, n in result.answered.items() if kind not in NOT_COUNTED)
    assert (counters["invalid_requests_total"] - before["invalid_requests_total"]
            + counters["dropped_frames_total"] - before["dropped_frames_total"]) == counted
    assert counters["internal_errors_total"] == before["internal_errors_total"] == 0
    assert counters["requests_total"] - before["requests_total"] == len(victim.results)

    assert len(victim.results) >= 3
    for completion in victim.results:  # none cancelled by the Cancels that named its id
        assert completion is not None
        assert (completion.text, completion.token_ids) == (daemon.solo.text, daemon.solo.token_ids)

    assert len(rtts) > PROBE_S / 0.05
    assert max(rtts) < MAX_STALL_S, f"event loop stalled {max(rtts) * 1000:.0f} ms"
    assert growth < RSS_BOUND, f"front RSS grew {growth / MIB:.1f} MiB"


@pytest.mark.e2e
def test_frames_over_the_size_limit_close_their_connection_and_nothing_else(daemon):
    answers, closed = oversize_frames(daemon.address, 3)
    assert (answers, closed) == (0, 3)
    with Client(daemon.address) as client:
        assert client.complete(PROMPT, **GREEDY).token_ids == daemon.solo.token_ids


@pytest.mark.e2e
def test_duplicate_borrowed_and_extended_messages(daemon):
    """A duplicate open id is refused; another client's id is its own; unknown trailing fields are ignored."""
    ctx = zmq.Context()
    first, second = raw_socket(ctx, daemon.address), raw_socket(ctx, daemon.address)
    try:
        generate = P.make_generate(id="dup", prompt=PROMPT, **GREEDY)
        first.send(P.encode(generate))
        first.send(P.encode(generate))  # while the first is open
        second.send(_with_extra_fields(P.encode(generate)))  # the same id from another client
        second.send(_with_extra_fields(P.encode(P.Heartbeat())))
        first_msgs, second_msgs = _until_terminal(first, "dup"), _until_terminal(second, "dup")
    finally:
        first.close(linger=0)
        second.close(linger=0)
        ctx.term()
    errors = [m for m in first_msgs if isinstance(m, P.Error)]
    assert len(errors) == 1 and errors[0].id is None and errors[0].code == P.ErrorCode.INVALID_REQUEST
    assert "duplicate request id" in errors[0].message
    for msgs in (first_msgs, second_msgs):
        chunks = [m for m in msgs if isinstance(m, P.Chunk)]
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        assert [t for c in chunks for t in c.token_ids] == daemon.solo.token_ids
    assert any(isinstance(m, P.HeartbeatAck) for m in second_msgs)


def _with_extra_fields(encoded: bytes) -> bytes:
    """``encoded`` (a message: a msgpack array) with two unknown trailing fields appended."""
    return msgspec.msgpack.encode([*msgspec.msgpack.decode(encoded), "unknown field", {"future": 1}])


def _until_terminal(sock: zmq.Socket, rid: str, timeout_s: float = 60.0) -> list:
    """Every message on ``sock`` until ``rid``'s terminal one, then whatever follows within 0.3 s."""
    msgs = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert sock.poll(int((deadline - time.monotonic()) * 1000) + 1)
        msgs.append(P.SERVER_DECODER.decode(sock.recv()))
        last = msgs[-1]
        if isinstance(last, P.Chunk) and last.id == rid and last.finish_reason is not None:
            while sock.poll(300):
                msgs.append(P.SERVER_DECODER.decode(sock.recv()))
            return msgs
    raise AssertionError(f"no terminal for {rid}")


@pytest.mark.e2e
def test_a_long_prompt_is_tokenised_off_the_loop_with_the_same_result(daemon):
    """Above INLINE_TOKENIZE_CHARS the front tokenises on a thread: same tokens, and Cancel still finds the id."""
    from ringstream.daemon.front.intake import INLINE_TOKENIZE_CHARS
    from ringstream.daemon.common.model_dir import load_tokenizer, resolve_model_dir

    prompt = "Return the table\n" + "-" * (INLINE_TOKENIZE_CHARS + 1000)  # 32 characters a token: fits the context
    ids = load_tokenizer(resolve_model_dir(None)).encode(prompt).ids
    params = dict(max_tokens=16, temperature=0.0, ignore_eos=True)
    with Client(daemon.address) as client:
        by_text = client.complete(prompt, **params)
        by_ids = client.complete(prompt_token_ids=ids, **params)
        assert by_text.usage.prompt_tokens == len(ids) < 512
        assert by_text.token_ids == by_ids.token_ids
    ctx = zmq.Context()
    sock = raw_socket(ctx, daemon.address)
    try:
        sock.send(P.encode(P.make_generate(id="long", prompt=prompt, max_tokens=400, ignore_eos=True)))
        sock.send(P.encode(P.Cancel(id="long")))  # arrives while the prompt is being tokenised
        msgs = _until_terminal(sock, "long")
    finally:
        sock.close(linger=0)
        ctx.term()
    assert [m.seq for m in msgs] == list(range(len(msgs)))
    assert msgs[-1].finish_reason == P.FinishReason.CANCELLED


@pytest.mark.e2e
def test_a_heartbeat_naming_every_possible_id_is_answered_briefly(daemon):
    """Open ids a daemon does not know get UNKNOWN_REQUEST, a bounded number per heartbeat (no amplification)."""
    from ringstream.daemon.front.intake import MAX_UNKNOWN_ANSWERS

    frame = P.encode(P.Heartbeat(open_ids=[f"{i:x}" for i in range(P.MAX_OPEN_IDS)]))
    ctx = zmq.Context()
    sock = raw_socket(ctx, daemon.address)
    try:
        with heartbeat_probe(daemon.address, 2.0) as probe:
            time.sleep(0.3)
            for _ in range(3):
                sock.send(frame)
                time.sleep(0.2)
            rtts = probe()
        answers = []
        while sock.poll(500):
            answers.append(P.SERVER_DECODER.decode(sock.recv()))
    finally:
        sock.close(linger=0)
        ctx.term()
    assert sum(isinstance(a, P.HeartbeatAck) for a in answers) == 3
    errors = [a for a in answers if isinstance(a, P.Error)]
    assert len(errors) == 3 * MAX_UNKNOWN_ANSWERS
    assert {e.code for e in errors} == {P.ErrorCode.UNKNOWN_REQUEST}
    assert max(rtts) < MAX_STALL_S, f"event loop stalled {max(rtts) * 1000:.0f} ms"


@pytest.mark.parametrize("frame, head", [
    (P.encode(P.Generate(id="abc", prompt="x")), ("generate", "abc")),
    (P.encode(P.Cancel(id="é" * 40)), ("cancel", "é" * 40)),
    (msgspec.msgpack.encode(["generate", 5, "x"]), ("generate", None)),
    (b"\xdd\x00\x00\x00\x02\xd9\x08generate\xda\x00\x01r", ("generate", "r")),
    (b"\x92\xa8generate\xa3\xff\xfe\xfd", ("generate", None)),  # not UTF-8
    (b"\x92\xa8generate\xdb\xff\xff\xff\xff", ("generate", None)),  # declares 4 GiB
    (b"\x91" * 100_000 + b"\xc0", (None, None)),
    (b"\xdd\xff\xff\xff\xff", (None, None)),
    (b"", (None, None)),
])
def test_the_head_of_a_hostile_frame_is_read_without_decoding_the_rest(frame, head):
    assert P.frame_head(frame) == head
