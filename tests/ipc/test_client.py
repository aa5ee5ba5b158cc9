"""Both clients on their shared base, against a scripted in-process daemon or none at all.

Each behaviour is checked for :class:`Client` and :class:`AsyncClient` by one
test body: an AsyncClient is driven from plain code through :class:`Blocking`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from ringstream.ipc import address
from ringstream.ipc import protocol as P
from ringstream.ipc.client import (
    GENERATE_DEFAULTS, PROBE_AFTER_S, AsyncClient, Client, DaemonUnavailable, InvalidRequest, Liveness,
    RingstreamError,
)
from tests.other_uid import as_other_user

FAST_FAIL_S = 1.0
"""A client must give up on a missing or stale ipc socket within this (the brief: 1 s)."""
POLL_MS = 20
"""The fake daemon's poll period: how long it takes at most to notice that it should stop."""


class FakeDaemon:
    """A ROUTER on an ipc socket in a thread, answering as the front does; records every client message.

    Generate -> two chunks (``"a"``, then an empty one with ``finish_reason`` length); Status -> a
    StatusReply; Admin -> a StatusReply with the settings, or ``Error(id=None)`` for ``max_concurrency`` < 1;
    Heartbeat -> HeartbeatAck. Messages are recorded as decoded structs in ``received``.
    """

    def __init__(self, path: str) -> None:
        self.address = f"ipc://{path}"
        self.received: list = []
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.address)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(POLL_MS):
                continue
            identity, frame = self._sock.recv_multipart()
            msg = P.CLIENT_DECODER.decode(frame)
            self.received.append(msg)
            for reply in self._answer(msg):
                self._sock.send_multipart([identity, P.encode(reply)])

    @staticmethod
    def _answer(msg) -> list:
        status = dict(version="fake", ready=True, state="serving", uptime_s=0.0, waiting=0, running=0,
                      queue_size=10, max_concurrency=4, requests_total=0, tokens_generated_total=0, workers=[])
        match msg:
            case P.Generate(id=rid):
                usage = P.Usage(prompt_tokens=1, completion_tokens=1)
                return [P.Chunk(id=rid, seq=0, text="a", token_ids=[1]),
                        P.Chunk(id=rid, seq=1, finish_reason=P.FinishReason.LENGTH, usage=usage)]
            case P.Status():
                return [P.StatusReply(**status)]
            case P.Admin(settings=settings) if settings.get("max_concurrency", 1) < 1:
                return [P.Error(id=None, code=P.ErrorCode.INVALID_REQUEST, message="max_concurrency: must be >= 1")]
            case P.Admin(settings=settings):
                return [P.StatusReply(**status, settings=settings)]
            case P.Heartbeat():
                return [P.HeartbeatAck()]
        return []

    def generates(self) -> list[P.Generate]:
        return [m for m in self.received if isinstance(m, P.Generate)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive(), "the fake daemon did not stop"
        self._sock.close(linger=0)
        self._ctx.term()


class Blocking:
    """An :class:`AsyncClient` called from plain code, with the blocking client's methods."""

    def __init__(self, *args, **kwargs) -> None:
        self._runner = asyncio.Runner()
        self.client = AsyncClient(*args, **kwargs)
        self.address = self.client.address

    def complete(self, *args, **kwargs):
        return self._runner.run(self.client.complete(*args, **kwargs))

    def status(self):
        return self._runner.run(self.client.status())

    def admin(self, **settings):
        return self._runner.run(self.client.admin(**settings))

    def close(self) -> None:
        self._runner.run(self.client.close())

    def shutdown(self) -> None:
        """Close the client (again, if need be) and the event loop."""
        try:
            self.close()
        finally:
            self._runner.close()

    def __enter__(self) -> "Blocking":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


CLIENTS = {"Client": Client, "AsyncClient": Blocking}


@pytest.fixture(params=sorted(CLIENTS))
def make_client(request):
    """``make_client(address=None, **kwargs)``: a client of each kind in turn, closed after the test."""
    made = []

    def make(*args, **kwargs):
        made.append(CLIENTS[request.param](*args, **kwargs))
        return made[-1]

    yield make
    for client in made:
        getattr(client, "shutdown", client.close)()


@pytest.fixture
def fake(tmp_path):
    daemon = FakeDaemon(str(tmp_path / "fake.sock"))
    yield daemon
    daemon.close()


def test_both_clients_send_the_same_request_and_read_the_same_answer(fake):
    results = []
    for kind in sorted(CLIENTS):
        with CLIENTS[kind](fake.address) as client:
            results.append(client.complete("hi", id="r", max_tokens=3, seed=7, stop=["x"]))
    assert results[0] == results[1] and results[0].text == "a" and results[0].finish_reason == "length"
    first, second = fake.generates()
    assert first == second == P.make_generate("r", prompt="hi", max_tokens=3, seed=7, stop=["x"])


def test_a_stop_string_is_sent_as_a_list_of_one(fake, make_client):
    client = make_client(fake.address)
    client.complete("hi", stop="\n")
    client.complete("hi", stop=("\n", "."))
    client.complete("hi", stop=None)
    assert [g.sampling.stop for g in fake.generates()] == [["\n"], ["\n", "."], []]


def test_a_list_prompt_is_sent_as_token_ids(fake, make_client):
    client = make_client(fake.address)
    client.complete([5, 6, 7])
    client.complete(prompt_token_ids=[8])
    assert [(g.prompt, g.prompt_token_ids) for g in fake.generates()] == [(None, [5, 6, 7]), (None, [8])]


def test_defaults_are_the_wire_defaults(fake, make_client):
    make_client(fake.address).complete("hi")
    [sent] = fake.generates()
    flat = msgspec.structs.asdict(sent) | msgspec.structs.asdict(sent.sampling)
    assert sent.sampling == P.SamplingParams()
    assert {name: flat[name] for name in GENERATE_DEFAULTS} == GENERATE_DEFAULTS
    assert (GENERATE_DEFAULTS["max_tokens"], GENERATE_DEFAULTS["temperature"], GENERATE_DEFAULTS["top_p"]) == (
        16, 1.0, 1.0)


def test_admin_answers_and_refusals(fake, make_client):
    client = make_client(fake.address)
    assert client.admin(max_concurrency=8).settings == {"max_concurrency": 8}
    with pytest.raises(InvalidRequest, match="max_concurrency"):
        client.admin(max_concurrency=0)
    assert client.status().ready


def test_arguments_are_checked_before_anything_is_sent(tmp_path, make_client):
    client = make_client(f"ipc://{tmp_path}/none.sock")  # no daemon: the checks come first
    with pytest.raises(TypeError, match="generate"):
        client.complete("hi", max_token=3)
    with pytest.raises(InvalidRequest, match="at most 4,194,304"):
        client.complete("x" * (P.MAX_FRAME_BYTES + 1))


def test_the_client_uses_ringstream_socket(fake, make_client, monkeypatch):
    monkeypatch.setenv(address.SOCKET_ENV, fake.address)
    client = make_client()
    assert client.address == fake.address and client.status().ready


@pytest.mark.parametrize("call", ["status", "complete", "admin"])
def test_a_missing_socket_fails_at_once(tmp_path, make_client, call):
    client = make_client(f"ipc://{tmp_path}/none.sock")
    start = time.monotonic()
    with pytest.raises(DaemonUnavailable, match="the socket file does not exist"):
        {"status": lambda: client.status(), "complete": lambda: client.complete("hi"),
         "admin": lambda: client.admin(max_concurrency=2)}[call]()
    assert time.monotonic() - start < FAST_FAIL_S


def test_a_stale_socket_fails_at_once(tmp_path, make_client):
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(stale))  # the file stays, nobody listens: a killed daemon's socket
    client = make_client(f"ipc://{stale}")
    start = time.monotonic()
    with pytest.raises(DaemonUnavailable, match="a stale socket file"):
        client.complete("hi")
    with pytest.raises(DaemonUnavailable, match="a stale socket file"):
        client.status()
    assert time.monotonic() - start < FAST_FAIL_S


def test_a_daemon_that_goes_away_is_noticed_at_the_next_request(tmp_path, make_client):
    daemon = FakeDaemon(str(tmp_path / "gone.sock"))
    heartbeat_s = 0.2
    client = make_client(daemon.address, heartbeat_s=heartbeat_s)
    try:
        assert client.status().ready
    finally:
        daemon.close()  # unbinds: the socket file goes
    time.sleep(1.5 * heartbeat_s)  # a heartbeat period passes without a word from the daemon
    start = time.monotonic()
    with pytest.raises(DaemonUnavailable, match="does not exist|a stale socket file"):
        client.status()
    assert time.monotonic() - start < FAST_FAIL_S


@pytest.mark.e2e
def test_a_socket_in_a_closed_folder_says_permission_denied():
    top = Path(tempfile.mkdtemp(prefix="ringstream-client-"))
    try:
        top.chmod(0o755)
        closed = top / "closed"
        closed.mkdir(mode=0o700)
        fake = FakeDaemon(str(closed / "d.sock"))
        try:
            if os.geteuid() != 0:
                closed.chmod(0o000)

            def action() -> str:
                out = []
                for kind in sorted(CLIENTS):
                    with CLIENTS[kind](fake.address) as client:
                        start = time.monotonic()
                        try:
                            client.status()
                            out.append(f"{kind}: answered")
                        except DaemonUnavailable as exc:
                            out.append(f"{kind}: {exc} in {time.monotonic() - start:.2f} s")
                return "\n".join(out)

            report = as_other_user(action)
        finally:
            closed.chmod(0o700)
            fake.close()
    finally:
        shutil.rmtree(top)
    lines = report.splitlines()
    assert len(lines) == 2, report
    for line in lines:
        assert "permission denied" in line and "does not exist" not in line, report
        assert float(line.rsplit(" in ", 1)[1].split()[0]) < FAST_FAIL_S, report


def test_use_after_close_is_refused(fake, make_client):
    client = make_client(fake.address)
    client.close()
    with pytest.raises(RingstreamError, match="closed"):
        client.complete("hi")


class TestLiveness:
    """The bookkeeping that decides heartbeats, socket probes and giving up, on scripted times."""

    def test_a_request_probes_first_unless_the_daemon_spoke_within_a_heartbeat(self):
        live = Liveness(heartbeat_s=1.0, timeout_s=30.0)
        assert live.probe_before_request(0.0)  # never heard
        live.heard(10.0)
        assert not live.probe_before_request(10.5)
        assert live.probe_before_request(11.5)

    def test_an_unanswered_ping_makes_a_probe_due(self):
        live = Liveness(heartbeat_s=1.0, timeout_s=30.0)
        live.pinged(5.0)
        assert not live.probe_due(5.0 + PROBE_AFTER_S / 2)
        assert live.probe_due(5.0 + PROBE_AFTER_S)
        live.probed()
        assert not live.probe_due(9.0)
        live.pinged(10.0)
        live.heard(10.001)  # answered
        assert not live.probe_due(11.0)

    def test_the_probe_waits_at_most_a_heartbeat_period(self):
        live = Liveness(heartbeat_s=0.1, timeout_s=30.0)
        live.pinged(0.0)
        assert live.probe_due(0.1)

    def test_heartbeats_and_wakes_follow_the_period(self):
        live = Liveness(heartbeat_s=1.0, timeout_s=30.0)
        live.start_clock(0.0)
        live.first_stream(0.0)
        assert not live.heartbeat_due(0.9) and live.heartbeat_due(1.0)
        live.heartbeat_sent(1.0)
        live.pinged(1.0)
        assert live.next_wake_s(1.0, streaming=True) == pytest.approx(PROBE_AFTER_S)
        live.heard(1.001)
        assert live.next_wake_s(1.5, streaming=True) == pytest.approx(0.5)

    def test_silence_counts_from_the_clock_or_the_last_word(self):
        live = Liveness(heartbeat_s=1.0, timeout_s=30.0)
        live.heard(0.0)
        live.start_clock(100.0)
        assert live.silent_s(130.0) == pytest.approx(30.0)
        live.heard(120.0)
        assert live.silent_s(130.0) == pytest.approx(10.0)
        assert live.next_wake_s(149.9995, streaming=False) >= 0.001  # never a busy loop
        assert live.next_wake_s(200.0, streaming=False) == pytest.approx(1.0)  # past the limit: once a period


def test_generate_defaults_match_the_protocol():
    fields = {f.name: f.default for cls in (P.Generate, P.SamplingParams) for f in msgspec.structs.fields(cls)}
    assert all(fields[name] == value for name, value in GENERATE_DEFAULTS.items())
    assert GENERATE_DEFAULTS.keys() >= {"max_tokens", "temperature", "top_p", "top_k", "ignore_eos", "priority"}
