"""Reliability drivers and the soak run: hostile input, client and worker faults, overload, restarts.

The drivers below are shared by the CI tests (``tests/reliability/``, seconds
each) and by the soak run (minutes; not run in CI)::

    python -m ringstream.tools.soak                       # every phase, about 6 minutes on 2 cores
    python -m ringstream.tools.soak --phase-s 60 --json soak.json
    python -m ringstream.tools.soak probe ADDRESS SECONDS # heartbeat round-trip probe, JSON on stdout

Each phase starts its own daemon (``ringstream serve`` in a child process,
private socket, unique instance name), drives it, stops it, and checks that
no /dev/shm segment and no process of it is left. The summary reports
requests lost (no terminal message), hung streams (a terminal message later
than the request's deadline allows), leaked segments and processes, the P99
round trip of ``QUEUE_FULL`` answers and the front's RSS before and after.

Drivers:

* :func:`hostile_frames` builds a seeded list of malformed or abusive client
  frames, each with the error codes it must be answered with;
  :func:`run_barrage` sends them over raw DEALER sockets and checks every
  answer in order;
* :func:`probe_heartbeats` measures Heartbeat round trips (the front's event
  loop responsiveness) and runs as a separate process (``probe``) so the
  measuring side shares no interpreter lock with the load;
* :func:`offer_load` offers Generate requests at a fixed rate and records
  how and when each was answered;
* :func:`check_synthetic_stream` checks one stream of the synthetic engine
  (contiguous ``seq``, consecutive text and token ids, a single terminal).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import psutil
import zmq

from ringstream.ipc import protocol as P
from ringstream.ipc.client import AsyncClient, Client, ServerError
from ringstream.tools.bench_serving import private_rss_bytes
from ringstream.daemon.launcher import DaemonProcess

REPLY_TIMEOUT_S = 30.0
"""A barrage frame that gets no answer within this long counts as unanswered."""
SEND_TIMEOUT_MS = 30_000
"""A raw socket's send blocks at most this long at the high-water mark."""
PROBE_INTERVAL_S = 0.01
SYNTHETIC_VOCAB = 4096
"""Vocabulary of the built-in model, which the synthetic engine's token ids wrap around."""
SYNTHETIC_TEXT = " t{}"
"""Text of synthetic token number ``seq`` (see ringstream.daemon.engine.synthetic.synthetic_text)."""
MIB = 2**20
RSS_SAMPLES = 4
"""The overload and hostile phases sample the front's RSS this many times (plus once before)."""
FAULT_INTERVAL_S = (3.0, 8.0)
"""Seconds between two worker faults in the soak (uniform): a few a minute, so that the restart backoff
(doubling per failure of a worker) leaves both workers up most of the time."""

_GENERATE_FIELDS = P.Generate.__struct_fields__
_SAMPLING_FIELDS = P.SamplingParams.__struct_fields__


# --------------------------------------------------------------------------- daemons


def soak_daemon(workdir: Path, *args: str, config: str = "", env: dict | None = None,
                instance: str | None = None) -> DaemonProcess:
    """A daemon of ``ringstream serve ARGS`` with TOML ``config`` text, in ``workdir``; use it as a context manager.

    ``instance``: the instance name (default: a fresh one). After the block,
    ``leftovers`` of the returned :class:`DaemonProcess` lists what the
    stopped daemon left (and was removed).
    """
    instance = instance or f"soak{uuid.uuid4().hex[:8]}"
    config_path = workdir / f"{instance}.toml"
    config_path.write_text(config)
    return DaemonProcess("--config", str(config_path), *args, runtime_dir=workdir, instance=instance, env=env)


def wait_for(predicate, timeout_s: float, interval_s: float = 0.05):
    """Poll ``predicate()`` until it returns a truthy value; return it, or None after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value or None
        time.sleep(interval_s)


def gauges_idle(address: str) -> bool:
    """True when the daemon has nothing running or waiting and no KV-cache tokens in use."""
    with Client(address, timeout_s=5.0) as client:
        status = client.status()
    return status.running == 0 and status.waiting == 0 and all(w.kv_cache_tokens_used == 0 for w in status.workers)


# --------------------------------------------------------------------------- hostile frames


@dataclass
class HostileFrame:
    """One abusive message (``parts``: its ZeroMQ frames) and the error codes it may be answered with."""

    kind: str
    parts: list[bytes]
    codes: frozenset[str]
    deferred_id: str | None = None
    """Request id of a frame whose answer may come after later frames' (a long prompt tokenised off the loop)."""


INVALID = frozenset({P.ErrorCode.INVALID_REQUEST.value})
TOO_LONG = frozenset({P.ErrorCode.PROMPT_TOO_LONG.value})
UNKNOWN = frozenset({P.ErrorCode.UNKNOWN_REQUEST.value})


def generate_array(**fields) -> list:
    """A Generate message as the raw msgpack array (tag, then fields in wire order, the sampling fields
    nested as ``sampling``), any values allowed; ``fields`` by flat name (``max_tokens=...``)."""
    values = {"id": "h", "prompt": "The socket module", "max_tokens": 4, **fields}
    sampling, message = P.SamplingParams(), P.Generate(id="x")
    values["sampling"] = [values.get(name, getattr(sampling, name)) for name in _SAMPLING_FIELDS]
    return ["generate", *[values.get(name, getattr(message, name)) for name in _GENERATE_FIELDS]]


def _pack(value) -> bytes:
    return msgspec.msgpack.encode(value)


def _frame(kind: str, payload: bytes, codes: frozenset[str] = INVALID) -> HostileFrame:
    return HostileFrame(kind, [payload], codes)


def _random_bytes(rng: random.Random, victim: str) -> HostileFrame:
    return _frame("random_bytes", rng.randbytes(rng.choice([0, 1, 7, 64, 512, 4096])))


def _truncated(rng: random.Random, victim: str) -> HostileFrame:
    full = _pack(generate_array(id=f"t{rng.randrange(10**6)}", prompt="x" * rng.randrange(1, 200)))
    return _frame("truncated_msgpack", full[: rng.randrange(len(full))])


WRONG_TYPES = [
    ("id", 123), ("id", ["a"]), ("prompt", b"bytes"), ("prompt", 5), ("max_tokens", "16"), ("max_tokens", 1.5),
    ("temperature", "0"), ("temperature", [0.0]), ("top_k", 2.5), ("seed", 1.0), ("stop", "abc"),
    ("stop", [1, 2]), ("stop_token_ids", ["1"]), ("ignore_eos", 1), ("priority", 1.5), ("stream", "yes"),
    ("timeout_s", "10"), ("prompt_token_ids", "123"), ("prompt_token_ids", [1.5]),
]


def _wrong_type(rng: random.Random, victim: str) -> HostileFrame:
    name, value = rng.choice(WRONG_TYPES)
    return _frame("wrong_type", _pack(generate_array(**{name: value})))


LENGTH_HEADERS = [b"\xdb\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff",
                  b"\xc6\xff\xff\xff\xff", b"\xda\xff\xff", b"\xdc\xff\xff", b"\xd9\xff"]
"""msgpack headers declaring far more bytes or elements (str32, array32, map32, bin32, ...) than follow."""


def _declared_length(rng: random.Random, victim: str) -> HostileFrame:
    header = rng.choice(LENGTH_HEADERS)
    prefix = rng.choice([b"", b"\x92\xa8generate", b"\x93\xa6cancel", b"\x9f\xa8generate\xa1a"])
    return _frame("declared_length", prefix + header + rng.randbytes(rng.randrange(0, 16)))


def _deep_nesting(rng: random.Random, victim: str) -> HostileFrame:
    depth = rng.choice([100, 1_000, 10_000, 100_000])
    opener = rng.choice([b"\x91", b"\x81\xa1k"])
    nested = opener * depth + b"\xc0"
    prefix = rng.choice([b"", b"\x92\xa8generate", b"\x93\xa8generate\xa1a", b"\x92\xa5admin"])
    return _frame("deep_nesting", prefix + nested)


def _oversized(rng: random.Random, victim: str) -> HostileFrame:
    choice = rng.randrange(9)
    rid = f"o{rng.randrange(10**6)}"
    if choice == 0:
        payload, codes = generate_array(id=rid, prompt="x" * (P.MAX_PROMPT_CHARS + 1)), INVALID
    elif choice == 1:
        ids = [7] * (P.MAX_PROMPT_TOKEN_IDS + 1)
        payload, codes = generate_array(id=rid, prompt=None, prompt_token_ids=ids), INVALID
    elif choice == 2:
        payload, codes = generate_array(id=rid, stop=["s"] * (P.MAX_STOP_STRINGS + 1)), INVALID
    elif choice == 3:
        payload, codes = generate_array(id=rid, stop=["s" * (P.MAX_STOP_CHARS + 1)]), INVALID
    elif choice == 4:
        payload, codes = generate_array(id=rid, stop_token_ids=[1] * (P.MAX_STOP_TOKEN_IDS + 1)), INVALID
    elif choice == 5:
        payload, codes = generate_array(id=rid, max_tokens=2**40), INVALID
    elif choice == 6:
        payload, codes = generate_array(id="i" * (P.MAX_ID_CHARS + 1)), INVALID
    elif choice == 7:
        payload, codes = generate_array(id=rid, max_tokens=P.MAX_TOKENS_LIMIT), TOO_LONG
    else:
        payload, codes = generate_array(id=rid, prompt="The socket module " * 3000), TOO_LONG
    return _frame("oversized", _pack(payload), codes)


BAD_NUMBERS = [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -math.inf), ("temperature", -1.0),
    ("temperature", 1e308), ("top_p", math.nan), ("top_p", 0.0), ("top_p", -0.5), ("top_p", 1.0000001),
    ("timeout_s", math.nan), ("timeout_s", math.inf), ("timeout_s", -1.0), ("timeout_s", 0.0),
    ("queue_timeout_s", math.nan), ("queue_timeout_s", -math.inf), ("seed", -1), ("seed", 2**64 - 1),
    ("top_k", -1), ("max_tokens", 0), ("max_tokens", -5), ("priority", 2**40), ("priority", -(2**40)),
    ("prompt_token_ids", [-1]), ("prompt_token_ids", [2**31]), ("stop_token_ids", [-3]),
]


def _bad_number(rng: random.Random, victim: str) -> HostileFrame:
    name, value = rng.choice(BAD_NUMBERS)
    fields = {name: value}
    if name == "prompt_token_ids":
        fields["prompt"] = None
    return _frame("bad_number", _pack(generate_array(**fields)))


UNKNOWN_MESSAGES = [
    ["bogus"], ["bogus", "id", 1], [], [1, 2, 3], [None], ["GENERATE", "a", "x"], ["chunk", "a", 0],
    ["status_reply"], ["abort", 1], ["shutdown"], {"type": "generate", "id": "a"}, "generate", 42, None,
]


def _unknown_type(rng: random.Random, victim: str) -> HostileFrame:
    return _frame("unknown_type", _pack(rng.choice(UNKNOWN_MESSAGES)))


BAD_ADMIN = [{"max_concurrency": -1}, {"no_such_setting": 1}, {"queue_size": "big"}, {"timeout_s": math.nan},
             {"log_level": "loud"}, {"aging_rate": -1.0}]


def _bad_admin(rng: random.Random, victim: str) -> HostileFrame:
    return _frame("bad_admin", _pack(["admin", rng.choice(BAD_ADMIN)]))


def _cancel_victim(rng: random.Random, victim: str) -> HostileFrame:
    return _frame("cancel_other_client", _pack(["cancel", victim]), UNKNOWN)


def _cancel_unknown(rng: random.Random, victim: str) -> HostileFrame:
    return _frame("cancel_flood", _pack(["cancel", f"nope-{rng.randrange(10**9)}"]), UNKNOWN)


def _costly_prompt(rng: random.Random, victim: str) -> HostileFrame:
    """A prompt just under the daemon's character bound: it must be tokenised before it is refused."""
    text = "".join(rng.choices(COSTLY_ALPHABET, k=COSTLY_PROMPT_CHARS))
    rid = f"c{rng.randrange(10**9)}"
    return HostileFrame("costly_prompt", [_pack(generate_array(id=rid, prompt=text))], TOO_LONG, deferred_id=rid)


COSTLY_PROMPT_CHARS = 30_000
"""Under the built-in model's bound (512 tokens x 64 characters), far over its context once tokenised."""
COSTLY_ALPHABET = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(0x4E00, 0x4E80)]


def _frame_count(rng: random.Random, victim: str) -> HostileFrame:
    heartbeat = _pack(["heartbeat"])
    parts = [rng.choice([heartbeat, b"", rng.randbytes(8)]) for _ in range(rng.randrange(2, 12))]
    return HostileFrame("wrong_frame_count", parts, INVALID)


HOSTILE_KINDS = [
    (_random_bytes, 12), (_truncated, 10), (_wrong_type, 10), (_declared_length, 8), (_deep_nesting, 6),
    (_oversized, 3), (_bad_number, 12), (_unknown_type, 8), (_bad_admin, 3), (_cancel_victim, 8),
    (_cancel_unknown, 12), (_frame_count, 8), (_costly_prompt, 1),
]
"""Frame builders and their relative frequency."""


def hostile_frames(seed: int, count: int, victim_id: str) -> list[HostileFrame]:
    """``count`` abusive frames drawn with ``random.Random(seed)``; ``victim_id``: another client's open request.

    Every frame is one a daemon must answer with exactly one ``Error`` whose
    code is in the frame's ``codes`` (and no other message).
    """
    rng = random.Random(seed)
    builders = [b for b, _ in HOSTILE_KINDS]
    weights = [w for _, w in HOSTILE_KINDS]
    return [rng.choices(builders, weights)[0](rng, victim_id) for _ in range(count)]


@dataclass
class BarrageResult:
    """How a daemon answered a barrage: counts per kind, and every answer that broke the rules."""

    sent: Counter = field(default_factory=Counter)
    answered: Counter = field(default_factory=Counter)
    codes: Counter = field(default_factory=Counter)
    wrong: list[str] = field(default_factory=list)
    unanswered: int = 0
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.sent.values())


def raw_socket(ctx: zmq.Context, address: str, identity: bytes | None = None, **options: int) -> zmq.Socket:
    """A DEALER socket for protocol-level abuse (sends block at most SEND_TIMEOUT_MS)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(address)
    return sock


def run_barrage(address: str, frames: list[HostileFrame], sockets: int = 4) -> BarrageResult:
    """Send ``frames`` round-robin over ``sockets`` DEALER sockets; check each answer in order.

    The front answers one connection's frames in the order it read them, so
    the i-th answer on a socket belongs to the i-th frame sent on it, except
    for long prompts (tokenised off the loop), matched by their request id.
    """
    result = BarrageResult()
    ctx = zmq.Context()
    socks = [raw_socket(ctx, address) for _ in range(sockets)]
    pending: list[list[HostileFrame]] = [[] for _ in socks]
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    start = time.monotonic()

    def take(timeout_ms: int) -> bool:
        got = False
        for sock, _ in poller.poll(timeout_ms):
            index = socks.index(sock)
            while True:
                try:
                    reply = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                got = True
                _check_answer(result, pending[index], reply)
        return got

    try:
        for i, frame in enumerate(frames):
            index = i % sockets
            socks[index].send_multipart(frame.parts)
            pending[index].append(frame)
            result.sent[frame.kind] += 1
            take(0)
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while any(pending) and time.monotonic() < deadline:
            take(100)
        result.unanswered = sum(len(p) for p in pending)
        take(200)  # anything beyond one answer per frame is a violation
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()
    result.seconds = time.monotonic() - start
    return result


def _check_answer(result: BarrageResult, pending: list[HostileFrame], reply: bytes) -> None:
    try:
        msg = P.SERVER_DECODER.decode(reply)
    except msgspec.DecodeError as exc:
        result.wrong.append(f"undecodable answer ({exc})")
        return
    rid = getattr(msg, "id", None)
    matches = [f for f in pending if f.deferred_id is not None and f.deferred_id == rid]
    matches = matches or [f for f in pending if f.deferred_id is None][:1]
    if not matches:
        result.wrong.append(f"extra answer {msg}")
        return
    frame = matches[0]
    pending.remove(frame)
    if not isinstance(msg, P.Error):
        result.wrong.append(f"{frame.kind}: answered with {type(msg).__name__}, not an Error")
        return
    result.answered[frame.kind] += 1
    result.codes[msg.code.value] += 1
    if msg.code.value not in frame.codes:
        result.wrong.append(f"{frame.kind}: {msg.code.value} ({msg.message[:100]}), expected {sorted(frame.codes)}")


def oversize_frames(address: str, count: int, frame_bytes: int = P.MAX_FRAME_BYTES + 1) -> tuple[int, int]:
    """Send ``count`` frames over the daemon's size limit, one per fresh connection.

    Returns ``(answers, closed)``: answers received (0 expected) and
    connections the daemon closed (``count`` expected: ZeroMQ refuses such a
    frame, ``MAXMSGSIZE``, by closing the connection before the front sees it).
    """
    ctx = zmq.Context()
    answers = closed = 0
    try:
        for _ in range(count):
            sock = raw_socket(ctx, address)
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            try:
                sock.send(b"\x00" * frame_bytes)
                if monitor.poll(int(REPLY_TIMEOUT_S * 1000)):
                    closed += 1
                if sock.poll(100):
                    answers += 1
            finally:
                sock.disable_monitor()
                monitor.close(linger=0)
                sock.close(linger=0)
    finally:
        ctx.term()
    return answers, closed


# --------------------------------------------------------------------------- probes and load


def probe_heartbeats(address: str, duration_s: float, interval_s: float = PROBE_INTERVAL_S) -> list[float]:
    """Heartbeat round trips (seconds) measured for ``duration_s``, one every ``interval_s``.

    A round trip that gets no answer within 10 s is recorded as 10 s.
    """
    ctx = zmq.Context()
    sock = raw_socket(ctx, address)
    heartbeat = P.encode(P.Heartbeat())
    rtts = []
    try:
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            sent = time.perf_counter()
            sock.send(heartbeat)
            while True:
                if not sock.poll(10_000):
                    rtts.append(10.0)
                    break
                if isinstance(P.SERVER_DECODER.decode(sock.recv()), P.HeartbeatAck):
                    rtts.append(time.perf_counter() - sent)
                    break
            time.sleep(interval_s)
    finally:
        sock.close(linger=0)
        ctx.term()
    return rtts


@contextlib.contextmanager
def heartbeat_probe(address: str, duration_s: float):
    """Run :func:`probe_heartbeats` in a child process; yields a callable returning its round trips (s)."""
    proc = subprocess.Popen([sys.executable, "-m", "ringstream.tools.soak", "probe", address, str(duration_s)],
                            stdout=subprocess.PIPE, text=True)
    out: list[float] = []

    def result() -> list[float]:
        if not out:
            stdout, _ = proc.communicate(timeout=duration_s + 60)
            out.extend(json.loads(stdout))
        return out

    try:
        yield result
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100, nearest rank) of ``values``; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


@dataclass
class Outcome:
    """How one offered request ended, as its client saw it (times from ``time.perf_counter``)."""

    sent: float
    answered: float = 0.0
    kind: str = ""
    """``length``/``stop``/... for a finished stream, else the error code."""
    chunks: list = field(default_factory=list)


def offer_load(address: str, rate_hz: float, duration_s: float, make_request, drain_s: float = 30.0,
               identity: bytes | None = None) -> dict[str, Outcome]:
    """Offer ``make_request(i) -> Generate`` at ``rate_hz`` for ``duration_s``; wait up to ``drain_s`` for the rest.

    One DEALER socket, one thread: sends follow a fixed schedule (late sends
    go at once, none are skipped) and every answer is read as soon as it
    arrives. Returns each request's :class:`Outcome` by id; one with an empty
    ``kind`` never got its terminal message.
    """
    ctx = zmq.Context()
    sock = raw_socket(ctx, address, identity)
    outcomes: dict[str, Outcome] = {}
    open_ids: set[str] = set()
    heartbeat = P.encode(P.Heartbeat())
    try:
        start = time.perf_counter()
        next_heartbeat = start
        i = 0
        end = start + duration_s
        while True:
            now = time.perf_counter()
            if now < end:
                due = start + i / rate_hz
                if now >= due:
                    msg = make_request(i)
                    outcomes[msg.id] = Outcome(sent=time.perf_counter())
                    open_ids.add(msg.id)
                    sock.send(P.encode(msg))
                    i += 1
                    continue
                wait_s = due - now
            else:
                if not open_ids or now > end + drain_s:
                    break
                wait_s = 0.1
            if now >= next_heartbeat:
                sock.send(heartbeat)
                next_heartbeat = now + 0.5
            if sock.poll(max(0, int(wait_s * 1000))):
                _take_answers(sock, outcomes, open_ids)
    finally:
        sock.close(linger=0)
        ctx.term()
    return outcomes


def _take_answers(sock: zmq.Socket, outcomes: dict[str, Outcome], open_ids: set[str]) -> None:
    while True:
        try:
            frame = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        now = time.perf_counter()
        msg = P.SERVER_DECODER.decode(frame)
        if not isinstance(msg, (P.Chunk, P.Error)) or msg.id not in open_ids:
            continue
        outcome = outcomes[msg.id]
        if isinstance(msg, P.Error):
            outcome.kind, outcome.answered = msg.code.value, now
            open_ids.discard(msg.id)
            continue
        outcome.chunks.append(msg)
        if msg.finish_reason is not None:
            outcome.kind, outcome.answered = msg.finish_reason.value, now
            open_ids.discard(msg.id)


def check_synthetic_stream(chunks: list[P.Chunk], expected_tokens: int | None = None) -> str | None:
    """What is wrong with one synthetic-engine stream (None if nothing).

    Checks ``seq`` 0, 1, 2..., at most one terminal chunk (the last), text
    ``" t0 t1 ..."`` with no gap or repeat, token ids consecutive modulo the
    vocabulary, and with ``expected_tokens`` that the stream holds exactly
    that many tokens and ended on ``length``.
    """
    if [c.seq for c in chunks] != list(range(len(chunks))):
        return f"seq {[c.seq for c in chunks][:20]}... not contiguous"
    if any(c.finish_reason is not None for c in chunks[:-1]):
        return "a terminal chunk before the last"
    ids = [t for c in chunks for t in c.token_ids]
    text = "".join(c.text for c in chunks)
    if text != "".join(SYNTHETIC_TEXT.format(i) for i in range(len(ids))):
        return f"text {text[:60]!r}... is not ' t0 t1 ...' for {len(ids)} tokens"
    if any((b - a) % SYNTHETIC_VOCAB != 1 for a, b in zip(ids, ids[1:])):
        return "token ids not consecutive"
    if expected_tokens is not None:
        if not chunks or chunks[-1].finish_reason != P.FinishReason.LENGTH or len(ids) != expected_tokens:
            end = chunks[-1].finish_reason if chunks else None
            return f"{len(ids)} tokens, end {end}; expected {expected_tokens} and length"
    return None


async def run_streams(address: str, count: int, concurrency: int, params: dict, deadline_s: float,
                      on_started=None, duration_s: float | None = None) -> list[tuple[str, list[P.Chunk], float]]:
    """Run ``count`` generations, ``concurrency`` at a time, all over one AsyncClient.

    With ``duration_s``, no generation starts after that many seconds (fewer than ``count`` may run).
    Returns ``(outcome, chunks, seconds)`` per request: outcome is the
    finish reason, an error code, ``"lost"`` (DaemonUnavailable: no answer for
    the client's timeout) or ``"hung"`` (no terminal within ``deadline_s``).
    ``on_started`` is awaited once, when the first stream has a token.
    """
    results = []
    started = asyncio.Event()
    remaining = count
    end = time.monotonic() + duration_s if duration_s is not None else math.inf

    async with AsyncClient(address, timeout_s=deadline_s) as client:
        async def one() -> tuple[str, list[P.Chunk], float]:
            chunks = []
            t0 = time.monotonic()
            try:
                async with asyncio.timeout(deadline_s):
                    async for chunk in client.generate(prompt_token_ids=[5, 6, 7], **params):
                        chunks.append(chunk)
                        started.set()
                return chunks[-1].finish_reason.value, chunks, time.monotonic() - t0
            except ServerError as exc:
                return exc.code.value, chunks, time.monotonic() - t0
            except TimeoutError:
                return "hung", chunks, time.monotonic() - t0
            except Exception as exc:  # DaemonUnavailable, StreamOrderError: recorded, checked by the caller
                return f"lost:{type(exc).__name__}", chunks, time.monotonic() - t0

        async def lane() -> None:
            nonlocal remaining
            while remaining > 0 and time.monotonic() < end:
                remaining -= 1
                results.append(await one())

        lanes = [asyncio.create_task(lane()) for _ in range(concurrency)]
        if on_started is not None:
            await started.wait()
            await on_started()
        await asyncio.gather(*lanes)
    return results


# --------------------------------------------------------------------------- soak phases


def _rss_mib(daemon: DaemonProcess) -> list[float]:
    """The front's resident memory, MiB: ``[total, private]``. The difference is mostly the rings, shared
    with the workers: a ring's pages become resident as records first reach them (at most ``ring_bytes``)."""
    total = psutil.Process(daemon.pid).memory_info().rss
    return [round(total / MIB, 1), round(private_rss_bytes(daemon.pid) / MIB, 1)]


def soak_overload(workdir: Path, seconds: float) -> dict:
    """Offer ~10x capacity for ``seconds``; QUEUE_FULL latency, deadlines, RSS, gauges afterwards."""
    config = ("engine = \"synthetic\"\nsynthetic_step_ms = 2.0\nmax_num_seqs = 4\nmax_concurrency = 4\n"
              "queue_size = 16\ndevices = \"cpu\"\n")
    max_tokens, timeout_s = 16, 2.0
    capacity_hz = 4 / (max_tokens * 0.002)
    rate_hz = 10 * capacity_hz

    def request(i: int) -> P.Generate:
        return P.make_generate(id=f"l{i}", prompt_token_ids=[5, 6, 7], max_tokens=max_tokens, ignore_eos=True,
                               stream=False, timeout_s=timeout_s)

    with soak_daemon(workdir, config=config) as daemon:
        offer_load(daemon.address, rate_hz, 2.0, request)  # warm-up: allocator and caches at steady state
        rss = [_rss_mib(daemon)]
        outcomes: dict[str, Outcome] = {}
        for part in range(RSS_SAMPLES):  # one connection per part; RSS sampled between them
            outcomes.update(offer_load(daemon.address, rate_hz, seconds / RSS_SAMPLES,
                                       lambda i: request(part * 10**9 + i)))
            rss.append(_rss_mib(daemon))
        idle = wait_for(lambda: gauges_idle(daemon.address), 10.0)
    full = [o.answered - o.sent for o in outcomes.values() if o.kind == "QUEUE_FULL"]
    admitted = [o for o in outcomes.values() if o.kind not in ("QUEUE_FULL", "")]
    late = [o for o in admitted if o.answered - o.sent > timeout_s + 0.5]
    return dict(
        phase="overload", seconds=seconds, offered_hz=round(rate_hz), capacity_hz=round(capacity_hz),
        requests=len(outcomes), queue_full=len(full), admitted=len(admitted),
        admitted_ok=sum(o.kind == "length" for o in admitted),
        lost=sum(o.kind == "" for o in outcomes.values()), hung=len(late),
        queue_full_p50_ms=round(percentile(full, 50) * 1000, 2),
        queue_full_p99_ms=round(percentile(full, 99) * 1000, 2),
        queue_full_max_ms=round(max(full, default=math.nan) * 1000, 2),
        rss_before_mib=rss[0], rss_after_mib=rss[-1], rss_samples_mib=rss, gauges_idle=bool(idle),
        leftovers=daemon.leftovers.as_dict(),
    )


def soak_hostile(workdir: Path, seconds: float) -> dict:
    """Barrages of hostile frames for ``seconds`` while greedy streams run; every answer, stream and RTT checked."""
    prompt, params = "The socket module", dict(max_tokens=200, temperature=0.0, ignore_eos=True)
    with soak_daemon(workdir, config="devices = \"cpu\"\nworker_threads = 1\n") as daemon:
        with Client(daemon.address) as client:
            solo = client.complete(prompt, **params)
        run_barrage(daemon.address, hostile_frames(0, 200, "victim"))  # warm-up
        rss = [_rss_mib(daemon)]
        victim = VictimStreams(daemon.address, prompt, params)
        results = BarrageResult()
        with heartbeat_probe(daemon.address, seconds) as probe, victim:
            start, seed = time.monotonic(), 1
            while time.monotonic() < start + seconds:
                batch = run_barrage(daemon.address, hostile_frames(seed, 1000, "victim"))
                for name in ("sent", "answered", "codes"):
                    getattr(results, name).update(getattr(batch, name))
                results.wrong += batch.wrong
                results.unanswered += batch.unanswered
                seed += 1
                if time.monotonic() - start > len(rss) * seconds / RSS_SAMPLES:
                    rss.append(_rss_mib(daemon))
            rtts = probe()
        oversize_answers, oversize_closed = oversize_frames(daemon.address, 5)
        rss.append(_rss_mib(daemon))
    differing = [r for r in victim.results if r is None or (r.text, r.token_ids) != (solo.text, solo.token_ids)]
    return dict(
        phase="hostile", seconds=seconds, frames=results.total, answered=sum(results.answered.values()),
        wrong_answers=len(results.wrong), unanswered=results.unanswered, examples=results.wrong[:5],
        oversize_answers=oversize_answers, oversize_connections_closed=oversize_closed,
        victim_streams=len(victim.results), victim_streams_differing=len(differing),
        heartbeat_rtt_p99_ms=round(percentile(rtts, 99) * 1000, 2), heartbeat_rtt_max_ms=round(max(rtts) * 1000, 2),
        rss_before_mib=rss[0], rss_after_mib=rss[-1], rss_samples_mib=rss, leftovers=daemon.leftovers.as_dict(),
    )


class VictimStreams:
    """A thread streaming one request after another (request id ``victim``) until stopped; results in ``results``
    (a Completion, or None for a stream that failed)."""

    def __init__(self, address: str, prompt: str, params: dict) -> None:
        import threading

        self.address, self.prompt, self.params = address, prompt, params
        self.results: list = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with Client(self.address) as client:
            while not self.stop.is_set():
                try:
                    self.results.append(client.complete(self.prompt, id="victim", **self.params))
                except Exception:  # any failure of the victim stream is a finding: recorded as None
                    self.results.append(None)

    def __enter__(self) -> "VictimStreams":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(120)


def soak_worker_faults(workdir: Path, seconds: float) -> dict:
    """Streams on two workers for ``seconds`` while workers are SIGKILLed and SIGSTOPped in turn."""
    config = ("engine = \"synthetic\"\nsynthetic_step_ms = 5.0\ndevices = \"cpu,cpu\"\n"
              "worker_stall_timeout_s = 1.5\nworker_heartbeat_s = 0.25\nworker_start_timeout_s = 10.0\n")
    max_tokens = 200
    faults = Counter()
    with soak_daemon(workdir, config=config) as daemon:
        rss_before = _rss_mib(daemon)
        stop = asyncio.Event()

        async def inject() -> None:
            rng = random.Random(7)
            hit: set[int] = set()
            while not stop.is_set():
                await asyncio.sleep(rng.uniform(*FAULT_INTERVAL_S))
                pids = [pid for pid in daemon.worker_pids() if pid not in hit]  # not one already stopped
                if not pids:
                    continue
                pid = rng.choice(pids)
                sig = rng.choice([signal.SIGKILL, signal.SIGKILL, signal.SIGSTOP])
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                hit.add(pid)
                faults[sig.name] += 1

        async def main():
            injector = asyncio.create_task(inject())
            try:
                return await run_streams(daemon.address, 10**9, 16, dict(max_tokens=max_tokens, ignore_eos=True),
                                         deadline_s=120.0, duration_s=seconds)
            finally:
                stop.set()
                await injector

        results = asyncio.run(main())
        idle = wait_for(lambda: gauges_idle(daemon.address), 30.0)
        with Client(daemon.address) as client:
            status = client.status()
        rss_after = _rss_mib(daemon)
        delays = [float(d) for d in re.findall(r"restarting worker \d+ in ([0-9.]+) s", daemon.log())]
        for pid in daemon.worker_pids():  # a stopped worker the front has not killed yet
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    outcomes = Counter(r[0] for r in results)
    broken = [check_synthetic_stream(chunks, max_tokens if outcome == "length" else None)
              for outcome, chunks, _ in results]
    return dict(
        phase="worker_faults", seconds=seconds, requests=len(results), outcomes=dict(outcomes),
        faults=dict(faults), restarts=status.counters["worker_restarts_total"],
        lost=sum(o.startswith("lost") for o in outcomes.elements()), hung=outcomes["hung"],
        deadline_ends=outcomes["timeout"], broken_streams=sum(b is not None for b in broken), gauges_idle=bool(idle),
        rss_before_mib=rss_before, rss_after_mib=rss_after, leftovers=daemon.leftovers.as_dict(),
        max_restart_backoff_s=max(delays, default=0.0),
    )


def soak_step_exceptions(workdir: Path, seconds: float) -> dict:
    """Worker 0's engine fails every 50th step for ``seconds``; worker 1 must be unaffected."""
    config = "engine = \"synthetic\"\nsynthetic_step_ms = 2.0\ndevices = \"cpu,cpu\"\n"
    max_tokens = 100
    env = {"RINGSTREAM_FAULT_INJECT": "step_exception_every=50,worker=0"}
    with soak_daemon(workdir, config=config, env=env) as daemon:
        with Client(daemon.address) as client:
            before = client.status()
        results = asyncio.run(run_streams(daemon.address, 10**9, 16, dict(max_tokens=max_tokens, ignore_eos=True),
                                          deadline_s=60.0, duration_s=seconds))
        with Client(daemon.address) as client:
            after = client.status()
    outcomes = Counter(r[0] for r in results)
    broken = [check_synthetic_stream(chunks, max_tokens if outcome == "length" else None)
              for outcome, chunks, _ in results]
    return dict(
        phase="step_exceptions", seconds=seconds, requests=len(results), outcomes=dict(outcomes),
        lost=sum(o.startswith("lost") for o in outcomes.elements()), hung=outcomes["hung"],
        broken_streams=sum(b is not None for b in broken),
        worker_pids_unchanged=[w.pid for w in before.workers] == [w.pid for w in after.workers],
        served_by_worker=[w.requests_served for w in after.workers], leftovers=daemon.leftovers.as_dict(),
    )


def soak_client_kills(workdir: Path, rounds: int) -> dict:
    """``rounds`` times: a client process streams 8 requests and is SIGKILLed; its requests must stop."""
    config = "engine = \"synthetic\"\nsynthetic_step_ms = 5.0\ndevices = \"cpu\"\nclient_timeout_s = 1.0\n"
    stop_times = []
    with soak_daemon(workdir, config=config) as daemon:
        for _ in range(rounds):
            child = start_streaming_client(daemon.address, streams=8, max_tokens=400)
            try:
                t0 = time.monotonic()
                child.kill()
                child.wait()
                stopped = wait_for(lambda: gauges_idle(daemon.address), 10.0)
                stop_times.append(time.monotonic() - t0 if stopped else math.inf)
            finally:
                if child.poll() is None:
                    child.kill()
                    child.wait()
    return dict(phase="client_kills", rounds=rounds, max_stop_s=round(max(stop_times), 3),
                hung=sum(t == math.inf for t in stop_times), leftovers=daemon.leftovers.as_dict())


STREAMING_CLIENT = """
import sys
from ringstream.ipc.client import AsyncClient
import asyncio

async def main(address, streams, max_tokens):
    async with AsyncClient(address) as client:
        started = 0
        async def one():
            nonlocal started
            async for chunk in client.generate(prompt_token_ids=[5, 6, 7], max_tokens=max_tokens, ignore_eos=True):
                if chunk.seq == 0:
                    started += 1
                    if started == streams:
                        print("streaming", flush=True)
        await asyncio.gather(*(one() for _ in range(streams)))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


def start_streaming_client(address: str, streams: int, max_tokens: int) -> subprocess.Popen:
    """A child process streaming ``streams`` requests; returns once every stream has its first chunk.

    Raises RuntimeError if it does not get there within 60 s (the child is killed).
    """
    child = subprocess.Popen([sys.executable, "-c", STREAMING_CLIENT, address, str(streams), str(max_tokens)],
                             stdout=subprocess.PIPE, text=True)
    readable, _, _ = select.select([child.stdout], [], [], 60.0)
    if not readable or child.stdout.readline().strip() != "streaming" or child.poll() is not None:
        child.kill()
        child.wait()
        raise RuntimeError("streaming client did not start streaming")
    return child


def soak_restarts(workdir: Path, cycles: int) -> dict:
    """``cycles`` times: start a daemon of one instance name, SIGKILL its front once its rings exist."""
    instance = f"soak{uuid.uuid4().hex[:8]}"
    counts = []
    leaked_pids = []
    for _ in range(cycles):
        # the rings outlive each killed front, for the next start to reclaim
        with contextlib.closing(DaemonProcess("--engine", "synthetic", "--devices", "cpu", runtime_dir=workdir,
                                              instance=instance, remove_segments=False)) as daemon:
            daemon.start(wait_ready=False)
            wait_for(lambda: daemon.segments() or daemon.proc.poll() is not None, 60.0, 0.01)
            daemon.stop(signal.SIGKILL)
        leaked_pids += daemon.leftovers.processes
        counts.append(len(daemon.segments()))
    with soak_daemon(workdir, "--engine", "synthetic", "--devices", "cpu", instance=instance) as last:
        with Client(last.address) as client:
            client.complete(prompt_token_ids=[5, 6, 7], max_tokens=3)
    leaked_pids += last.leftovers.processes
    return dict(phase="restarts", cycles=cycles, max_segments=max(counts), leaked_processes=len(leaked_pids),
                segments_left=len(last.leftovers.segments))


# --------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """``python -m ringstream.tools.soak``: run the soak phases and print their figures (exit 1 if any check failed)."""
    parser = argparse.ArgumentParser(prog="python -m ringstream.tools.soak", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    probe = sub.add_parser("probe", help="heartbeat round trips for SECONDS, as a JSON list on stdout")
    probe.add_argument("address")
    probe.add_argument("seconds", type=float)
    parser.add_argument("--phase-s", type=float, default=60.0, help="seconds of each timed phase (default 60)")
    parser.add_argument("--client-kills", type=int, default=20)
    parser.add_argument("--restarts", type=int, default=20)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.command == "probe":
        print(json.dumps(probe_heartbeats(args.address, args.seconds)))
        return 0
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so that every phase stops its daemon on the way out
    started = time.monotonic()
    phases = []
    with tempfile.TemporaryDirectory(prefix="ringstream-soak-") as tmp:
        workdir = Path(tmp)
        for run in (lambda: soak_overload(workdir, args.phase_s), lambda: soak_hostile(workdir, args.phase_s),
                    lambda: soak_worker_faults(workdir, args.phase_s),
                    lambda: soak_step_exceptions(workdir, args.phase_s),
                    lambda: soak_client_kills(workdir, args.client_kills),
                    lambda: soak_restarts(workdir, args.restarts)):
            figures = run()
            phases.append(figures)
            print(json.dumps(figures), flush=True)
    summary = summarise(phases, time.monotonic() - started)
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "phases": phases}, indent=2))
    return 0 if summary["ok"] else 1


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def summarise(phases: list[dict], seconds: float) -> dict:
    """The headline figures over every phase, and whether each met its target."""
    by_name = {p["phase"]: p for p in phases}
    leaked_segments = sum(len(p.get("leftovers", {}).get("segments", [])) for p in phases)
    leaked_processes = sum(len(p.get("leftovers", {}).get("processes", [])) for p in phases)
    restarts = by_name["restarts"]
    summary = dict(
        seconds=round(seconds),
        requests_lost=sum(p.get("lost", 0) for p in phases),
        hung_streams=sum(p.get("hung", 0) for p in phases),
        deadline_ends=by_name["worker_faults"]["deadline_ends"],
        max_restart_backoff_s=by_name["worker_faults"]["max_restart_backoff_s"],
        broken_streams=sum(p.get("broken_streams", 0) for p in phases) + by_name["hostile"]["victim_streams_differing"],
        wrong_answers=by_name["hostile"]["wrong_answers"] + by_name["hostile"]["unanswered"],
        leaked_segments=leaked_segments + restarts["segments_left"],
        leaked_processes=leaked_processes + restarts["leaked_processes"],
        queue_full_p99_ms=by_name["overload"]["queue_full_p99_ms"],
        heartbeat_rtt_max_ms=by_name["hostile"]["heartbeat_rtt_max_ms"],
        rss_mib={p["phase"]: [p["rss_before_mib"], p["rss_after_mib"]] for p in phases if "rss_before_mib" in p},
    )
    # deadline_ends (finish_reason "timeout") are explicit ends, not losses: with a fault every few seconds the
    # restart backoff reaches its 30 s cap, and a request waiting while every worker backs off meets its deadline.
    summary["ok"] = (
        summary["requests_lost"] == summary["hung_streams"] == summary["broken_streams"] == 0
        and summary["wrong_answers"] == summary["leaked_segments"] == summary["leaked_processes"] == 0
        and summary["queue_full_p99_ms"] < 10 and by_name["overload"]["gauges_idle"]
        and by_name["worker_faults"]["gauges_idle"]
    )
    return summary


if __name__ == "__main__":
    sys.exit(main())
