"""End-to-end: real daemon processes, real sockets, rings and the default model."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from ringstream.daemon.common.model_dir import load_tokenizer, resolve_model_dir
from ringstream.daemon.engine.loader import load_model
from ringstream.daemon.worker.faults import FAULT_INJECT_ENV
from ringstream.ipc import protocol as P
from ringstream.ipc.client import AsyncClient, Client, PromptTooLong, QueueFull
from tests.daemon_helpers import wait_exit, running_daemon

pytestmark = pytest.mark.e2e

MAX_TOKENS = 32
PROMPTS = [
    f"{head} {tail}"
    for head in ("Return the", "The socket module", "Create a new", "If the file", "This class provides",
                 "Raise an exception if", "Convert a string to", "A list of")
    for tail in ("value.", "object and", "number of bytes", "path", "data from the server", "name of the",
                 "current thread", "default encoding is")
]
assert len(PROMPTS) == 64


class RawClient:
    """A bare DEALER socket for protocol-level tests."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, msg) -> None:
        self.sock.send(msg if isinstance(msg, bytes) else P.encode(msg))

    def recv(self, timeout_s: float = 30.0):
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("no reply")
        return P.SERVER_DECODER.decode(self.sock.recv())

    def recv_until_terminal(self, rid: str, timeout_s: float = 60.0) -> list:
        out = []
        while True:
            msg = self.recv(timeout_s)
            if getattr(msg, "id", None) != rid:
                continue
            out.append(msg)
            if isinstance(msg, P.Error) or msg.finish_reason is not None:
                return out

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    """Every engine step sleeps 2 ms (the worker's test hook): a request that arrives while a 300-token stream
    decodes starts before that stream ends, however fast the engine is."""
    return start_module_daemon(env={FAULT_INJECT_ENV: "step_delay_ms=2"})


@pytest.fixture(scope="module")
def reference():
    """Greedy ``generate()`` of the default model on one prompt alone (EOS ignored, as the daemon's ignore_eos)."""
    import torch

    info = resolve_model_dir(None)
    model = load_model(info)
    model.generation_config.eos_token_id = None
    tokenizer = load_tokenizer(info)
    cache: dict[tuple[str, int], list[int]] = {}

    def run(prompt: str, max_tokens: int = MAX_TOKENS) -> list[int]:
        if (prompt, max_tokens) not in cache:
            ids = tokenizer.encode(prompt).ids
            with torch.inference_mode():
                out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                     pad_token_id=info.eos_token_ids[0])
            cache[(prompt, max_tokens)] = out[0, len(ids):].tolist()
        return cache[(prompt, max_tokens)]

    run.tokenizer = tokenizer
    return run


def _collect(address: str, prompts: list[str], **params) -> list[list[P.Chunk]]:
    """Run each prompt on its own client, all at once; return every stream's chunks."""

    async def one(prompt: str) -> list[P.Chunk]:
        async with AsyncClient(address) as client:
            return [chunk async for chunk in client.generate(prompt, **params)]

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(main())


def test_64_concurrent_clients_match_generate_alone(daemon, reference):
    streams = _collect(daemon.address, PROMPTS, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for prompt, chunks in zip(PROMPTS, streams):
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        assert chunks[-1].finish_reason == "length"
        ids = [t for c in chunks for t in c.token_ids]
        assert len(ids) == MAX_TOKENS == chunks[-1].usage.completion_tokens
        # Exact: the engine computes each row as generate() does; no tolerance needed.
        assert ids == reference(prompt), prompt
        assert "".join(c.text for c in chunks) == reference.tokenizer.decode(ids, skip_special_tokens=True)


def test_request_arriving_mid_decode_starts_before_the_running_one_ends(daemon):
    async def main():
        async with AsyncClient(daemon.address) as client:
            events: dict[str, float] = {}
            long_started = asyncio.Event()

            async def long_request():
                n = 0
                async for chunk in client.generate("The socket module", max_tokens=300, temperature=0.0, ignore_eos=True):
                    n += len(chunk.token_ids)
                    if n >= 5:
                        long_started.set()
                events["long_end"] = time.monotonic()
                return n

            async def short_request():
                await long_started.wait()
                async for chunk in client.generate("Return the", max_tokens=4, temperature=0.0):
                    events.setdefault("short_first", time.monotonic())
                events["short_end"] = time.monotonic()

            long_tokens, _ = await asyncio.gather(long_request(), short_request())
            return events, long_tokens

    events, long_tokens = asyncio.run(main())
    assert long_tokens == 300
    assert events["short_first"] < events["short_end"] < events["long_end"]


@pytest.fixture(scope="module")
def small_daemon(start_module_daemon):
    """One slot, one queue place: easy to saturate. Every engine step sleeps 2 ms (the worker's test hook), so a
    400-token stream holds the slot for at least 0.8 s and a 509-token one outlives a 0.4 s deadline however fast
    the engine is."""
    return start_module_daemon("--max-concurrency", "1", "--queue-size", "1",
                               env={FAULT_INJECT_ENV: "step_delay_ms=2"})


def test_cancel_mid_stream_stops_generation_and_frees_the_slot(small_daemon):
    d = small_daemon
    raw = RawClient(d.address)
    try:
        raw.send(P.make_generate(id="a", prompt="Return the", max_tokens=400, temperature=0.0, ignore_eos=True))
        seen = 0
        while seen < 3:
            msg = raw.recv()
            seen += len(msg.token_ids)
        raw.send(P.Cancel(id="a"))
        rest = raw.recv_until_terminal("a")
        final = rest[-1]
        assert final.finish_reason == "cancelled"
        after = sum(len(c.token_ids) for c in rest)
        assert final.usage.completion_tokens == seen + after
        assert after <= 8, f"{after} tokens arrived after the cancel"
        # the only slot is free again: a new request runs to completion
        raw.send(P.make_generate(id="b", prompt="Return the", max_tokens=5, temperature=0.0))
        assert raw.recv_until_terminal("b")[-1].finish_reason in ("length", "stop")
        raw.send(P.Cancel(id="zzz"))
        assert raw.recv().code == P.ErrorCode.UNKNOWN_REQUEST
    finally:
        raw.close()
    with Client(d.address) as client:
        status = client.status()
    assert status.running == 0 and status.workers[0].kv_cache_tokens_used == 0


def test_queue_full_is_immediate_and_the_daemon_keeps_serving(small_daemon):
    d = small_daemon
    raw = RawClient(d.address)
    try:
        raw.send(P.make_generate(id="run", prompt="Return the", max_tokens=400, temperature=0.0, ignore_eos=True))
        assert raw.recv().id == "run"  # running now
        raw.send(P.make_generate(id="wait", prompt="Return the", max_tokens=4))
        latencies = []
        for i in range(5):
            start = time.monotonic()
            raw.send(P.make_generate(id=f"full{i}", prompt="Return the", max_tokens=4))
            reply = raw.recv_until_terminal(f"full{i}")[-1]
            latencies.append(time.monotonic() - start)
            assert isinstance(reply, P.Error) and reply.code == P.ErrorCode.QUEUE_FULL
        assert statistics.median(latencies) < 0.050, latencies
        raw.send(P.Cancel(id="run"))
        assert raw.recv_until_terminal("run")[-1].finish_reason == "cancelled"
        assert raw.recv_until_terminal("wait")[-1].finish_reason in ("length", "stop")
    finally:
        raw.close()
    with Client(d.address) as client:
        with pytest.raises(PromptTooLong):
            client.complete("Return the", max_tokens=10**6)
        assert client.complete("Return the", max_tokens=3).usage.completion_tokens == 3
        assert QueueFull.code == P.ErrorCode.QUEUE_FULL


def test_deadlines_end_streams_and_waiting_requests(small_daemon):
    raw = RawClient(small_daemon.address)
    try:
        raw.send(P.make_generate(id="slow", prompt="Return the", max_tokens=509, temperature=0.0, ignore_eos=True,
                                 timeout_s=0.4))  # 509 steps of >= 2 ms each take longer
        # Sent at once: "slow" takes the one slot on arrival, so "queued" waits whatever slow's TTFT on a busy host.
        start = time.monotonic()
        raw.send(P.make_generate(id="queued", prompt="Return the", max_tokens=4, queue_timeout_s=0.2))
        error = raw.recv_until_terminal("queued")[-1]
        waited = time.monotonic() - start
        assert isinstance(error, P.Error) and error.code == P.ErrorCode.QUEUE_TIMEOUT
        assert 0.2 - 0.005 <= waited < 0.2 + 0.05, waited  # timers have ms resolution
        final = raw.recv_until_terminal("slow")[-1]
        assert final.finish_reason == "timeout", final.usage
        assert 0 < final.usage.completion_tokens < 509 and 0.4 - 0.005 <= final.usage.e2e_s < 1.4  # timers have ms resolution
    finally:
        raw.close()


BAD_FRAMES = [
    (b"\xc1 not msgpack", None, P.ErrorCode.INVALID_REQUEST),
    (msgspec.msgpack.encode(["generate", "t1", 123]), "t1", P.ErrorCode.INVALID_REQUEST),
    (msgspec.msgpack.encode(["generate"]), None, P.ErrorCode.INVALID_REQUEST),
    (msgspec.msgpack.encode(["generate", "m0", "x", None, [0]]), "m0", P.ErrorCode.INVALID_REQUEST),
    (msgspec.msgpack.encode(["generate", "m1", "x", None, [-1]]), "m1", P.ErrorCode.INVALID_REQUEST),
    (msgspec.msgpack.encode(["generate", "m2", "x", None, [2**40]]), "m2", P.ErrorCode.INVALID_REQUEST),
    (msgspec.msgpack.encode(["generate", "v1", "x", None, 4, 0.0]), "v1", P.ErrorCode.INVALID_REQUEST),  # version 1
    (P.encode(P.Generate(id="e", prompt="")), "e", P.ErrorCode.INVALID_REQUEST),
    (P.encode(P.Generate(id="long", prompt="word " * 5000)), "long", P.ErrorCode.PROMPT_TOO_LONG),
    (P.encode(P.Generate(id="ctx", prompt_token_ids=[5] * 600)), "ctx", P.ErrorCode.PROMPT_TOO_LONG),
    (msgspec.msgpack.encode(["generate", "nan", "x", None, [4, float("nan")]]), "nan", P.ErrorCode.INVALID_REQUEST),
    (msgspec.msgpack.encode(["frobnicate", "u1"]), "u1", P.ErrorCode.INVALID_REQUEST),
    (P.encode(P.Generate(id="vocab", prompt_token_ids=[10**6])), "vocab", P.ErrorCode.INVALID_REQUEST),
    (P.encode(P.make_generate("stopid", prompt="x", stop_token_ids=[10**6])), "stopid", P.ErrorCode.INVALID_REQUEST),
    (P.encode(P.Generate(id="both", prompt="x", prompt_token_ids=[1])), "both", P.ErrorCode.INVALID_REQUEST),
]


def test_bad_input_gets_typed_errors_and_harms_no_other_stream(daemon):
    with Client(daemon.address) as client:
        solo = client.complete("The default value", max_tokens=MAX_TOKENS, temperature=0.0)
    raw = RawClient(daemon.address)
    bystander = RawClient(daemon.address)
    bystander.send(P.Heartbeat())
    assert isinstance(bystander.recv(), P.HeartbeatAck)

    async def concurrent_stream():
        async with AsyncClient(daemon.address) as client:
            return await client.complete("The default value", max_tokens=MAX_TOKENS, temperature=0.0)

    async def main():
        task = asyncio.create_task(concurrent_stream())
        loop = asyncio.get_running_loop()
        replies = []
        for frame, rid, code in BAD_FRAMES:
            raw.send(frame)
            reply = await loop.run_in_executor(None, raw.recv, 10.0)
            replies.append((reply, rid, code))
        raw.sock.send_multipart([b"two", b"frames"])
        replies.append((await loop.run_in_executor(None, raw.recv, 10.0), None, P.ErrorCode.INVALID_REQUEST))
        return replies, await task

    try:
        replies, concurrent = asyncio.run(main())
        for reply, rid, code in replies:
            assert isinstance(reply, P.Error), reply
            assert (reply.id, reply.code) == (rid, code), reply
        assert concurrent.token_ids == solo.token_ids and concurrent.text == solo.text
        assert not bystander.sock.poll(200), "an error reached another client"
        assert not raw.sock.poll(200), "a request was refused twice"
    finally:
        raw.close()
        bystander.close()


@pytest.mark.parametrize("prompt", ["Привет, мир! Это тест", "日本語のテキストと漢字", "emoji 🎉🚀 and ünïcödé"])
def test_utf8_prompts_round_trip(daemon, reference, prompt):
    with Client(daemon.address) as client:
        chunks = list(client.generate(prompt, max_tokens=24, temperature=1.0, seed=7))
        ids = [t for c in chunks for t in c.token_ids]
        text = "".join(c.text for c in chunks)
        assert text == reference.tokenizer.decode(ids, skip_special_tokens=True)
        assert all(c.text.encode("utf-8").decode("utf-8") == c.text for c in chunks)
        again = client.complete(prompt_token_ids=reference.tokenizer.encode(prompt).ids, max_tokens=24,
                                temperature=1.0, seed=7)
        assert again.token_ids == ids


def test_two_cpu_workers_both_serve(tmp_path, reference):
    with running_daemon(tmp_path, "--devices", "cpu,cpu") as d:
        prompts = PROMPTS[:8]
        streams = _collect(d.address, prompts, max_tokens=8, temperature=0.0, ignore_eos=True)
        for prompt, chunks in zip(prompts, streams):
            assert [t for c in chunks for t in c.token_ids] == reference(prompt)[:8]
        with Client(d.address) as client:
            workers = client.status().workers
        assert len(workers) == 2 and all(w.requests_served > 0 for w in workers), workers


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_drains_and_leaves_nothing(tmp_path, sig):
    with running_daemon(tmp_path, env={FAULT_INJECT_ENV: "step_delay_ms=5"}) as d:  # a stream to drain
        workers = d.worker_pids()
        assert workers and d.segments()

        async def stream_during_stop():
            async with AsyncClient(d.address) as client:
                chunks = []
                async for chunk in client.generate("Return the", max_tokens=64, temperature=0.0, ignore_eos=True):
                    chunks.append(chunk)
                    if len(chunks) == 1:
                        d.proc.send_signal(sig)
                return chunks

        chunks = asyncio.run(stream_during_stop())
        assert chunks[-1].finish_reason == "length"  # drained, not cut
        assert d.stop() == 0
        assert not d.segments()
        assert not wait_exit(workers, 5.0)


@pytest.mark.parametrize("args,message,code", [
    (["--model", "/nonexistent/model"], "/nonexistent/model", 1),  # not there (yet): a retry may find it
    (["--devices", "cuda:7"], "cuda:7", 1),
    (["--max-model-len", "100000"], "exceeds the model's context of 512 tokens", 2),  # no retry fixes these
    (["--model", "{mamba}"], "state-space", 2),
])
def test_start_failure_exits_non_zero_with_a_clear_message(tmp_path, args, message, code):
    if "{mamba}" in args:
        mamba = tmp_path / "mamba"
        mamba.mkdir()
        (mamba / "config.json").write_text(json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}))
        args = [str(mamba) if a == "{mamba}" else a for a in args]
    with running_daemon(tmp_path, *args, ready=False) as d:
        assert d.proc.wait(120) == code
        assert message in d.log()
        assert not d.segments()


def test_workers_exit_when_the_front_is_killed(tmp_path):
    with running_daemon(tmp_path) as d:
        workers = d.worker_pids()
        d.proc.kill()
        d.proc.wait()
        assert not wait_exit(workers, 5.0), "workers outlived the front by 5 s"
        for path in d.segments():  # the owner died before it could unlink; the next start would reclaim it
            os.unlink(path)


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ringstream.daemon.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_cli_generate_and_status(daemon):
    out = _cli("generate", "--socket", daemon.address, "--max-tokens", "5", "--temperature", "0", "--json", "Return the")
    assert out.returncode == 0, out.stderr
    chunks = [json.loads(line) for line in out.stdout.splitlines()]
    assert [c["seq"] for c in chunks] == list(range(len(chunks)))
    assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 5
    out = _cli("generate", "--socket", daemon.address, "--max-tokens", "5", "--temperature", "0", "Return the")
    assert out.returncode == 0 and out.stdout == "".join(c["text"] for c in chunks)  # stdout: the text, exactly
    out = _cli("status", "--socket", daemon.address, "--json")
    status = json.loads(out.stdout)
    assert status["ready"] is True and status["workers"][0]["alive"] is True
    assert status["model"] == str(resolve_model_dir(None).path)
    assert status["ttft_p50_s"] > 0 and status["itl_p99_s"] > 0  # two streams of 5 tokens were served
    assert status["tokens_per_s_window_s"] > 0 and status["requests_open"] == 0 and status["requests"] == []
    out = _cli("status", "--socket", daemon.address)
    assert out.returncode == 0, out.stderr
    assert f"model {status['model']}" in out.stdout
    assert "tokens/s" in out.stdout and "TTFT p50 " in out.stdout and "ITL p50 " in out.stdout
    out = _cli("generate", "--socket", daemon.address, "--max-tokens", "0", "x")
    assert out.returncode == 1 and "max_tokens" in out.stderr


def test_demo_runs_streams_and_stops_cleanly():
    out = _cli("demo", "--requests", "4", "--max-tokens", "8", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "tok/s" in out.stdout and "TTFT" in out.stdout and "exit code 0" in out.stdout


def test_structured_outputs_over_zeromq(daemon):
    """A JSON schema constrains sampled output end to end; a schema that does not compile is INVALID_REQUEST,
    and the daemon serves on."""
    import json

    from ringstream.ipc.client import InvalidRequest

    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer",
              "minimum": 0, "maximum": 9}}, "required": ["answer", "score"], "additionalProperties": False}
    constraint = P.StructuredOutputs(json=json.dumps(schema))
    streams = _collect(daemon.address, PROMPTS[:8], max_tokens=64, temperature=1.0, structured_outputs=constraint)
    for chunks in streams:
        assert chunks[-1].finish_reason == "stop"
        value = json.loads("".join(c.text for c in chunks))
        assert value["answer"] in ("yes", "no") and 0 <= value["score"] <= 9 and set(value) == {"answer", "score"}
    with Client(daemon.address) as client:
        with pytest.raises(InvalidRequest, match="structured_outputs.json"):
            client.complete("Convert", max_tokens=8, structured_outputs=P.StructuredOutputs(json='{"type": 7}'))
        with pytest.raises(InvalidRequest, match="exactly one of"):
            client.complete("Convert", max_tokens=8, structured_outputs=P.StructuredOutputs())
        assert client.complete("Convert", max_tokens=4, ignore_eos=True).usage.completion_tokens == 4


def test_a_stop_signal_ends_a_start_that_hangs_on_a_download(tmp_path):
    """A hub id not cached, its download from an endpoint that accepts and never answers: SIGTERM ends the start
    at once, exit 0, nothing left behind."""
    import socket as sockets

    silent = sockets.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections (the kernel's backlog), never reads or answers
    try:
        env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_ENDPOINT=f"http://127.0.0.1:"
                   f"{silent.getsockname()[1]}", HF_HUB_ETAG_TIMEOUT="600", HF_HUB_DOWNLOAD_TIMEOUT="600")
        env.pop("HF_HUB_OFFLINE", None)
        with running_daemon(tmp_path, "--engine", "synthetic", "--model", "acme/silent", ready=False,
                            env=env) as d:
            deadline = time.monotonic() + 60
            while "asking the hub" not in d.log() and d.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert "asking the hub" in d.log(), d.log()
            time.sleep(0.5)
            started = time.monotonic()
            assert d.stop() == 0, d.log()
            assert time.monotonic() - started < 5.0
            assert "stopped while resolving the model acme/silent" in d.log()
    finally:
        silent.close()


def test_a_stop_signal_ends_a_start_whose_download_stalls(tmp_path):
    """The hub answers what the repo holds, then the weights' transfer stalls: SIGTERM still ends the process at
    once (huggingface_hub's download threads are not waited for), exit 0."""
    import threading

    from ringstream.daemon.common.model_dir import DEFAULT_MODEL_DIR
    from tests.daemon.hub_standin import hub_standin

    release = threading.Event()

    class Stalling(dict):
        def __getitem__(self, name):
            if name == "model.safetensors":
                release.wait(60)
            return super().__getitem__(name)

    files = Stalling({name: (DEFAULT_MODEL_DIR / name).read_bytes()
                      for name in ("config.json", "tokenizer.json", "model.safetensors")})
    try:
        with hub_standin("acme/stall", files) as (endpoint, requests):
            env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_ENDPOINT=endpoint)
            env.pop("HF_HUB_OFFLINE", None)
            with running_daemon(tmp_path, "--engine", "synthetic", "--model", "acme/stall", ready=False,
                                env=env) as d:
                deadline = time.monotonic() + 60
                while not any(p.endswith("model.safetensors") for _, p in requests) and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert any(p.endswith("model.safetensors") for _, p in requests), d.log()
                started = time.monotonic()
                assert d.stop(timeout_s=15) == 0, d.log()
                assert time.monotonic() - started < 10
                assert "stopped while resolving the model acme/stall" in d.log()
    finally:
        release.set()
