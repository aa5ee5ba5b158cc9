"""Client behaviour against real daemons: restarts, socket ownership, cancellation, leftovers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time

import pytest
import zmq

from ringstream.daemon import cli
from ringstream.daemon.worker.faults import FAULT_INJECT_ENV
from ringstream.ipc import protocol as P
from ringstream.ipc.client import (
    PROBE_AFTER_S, AsyncClient, Client, DaemonUnavailable, InvalidRequest, RingstreamError, UnknownRequest,
)
from ringstream.daemon.launcher import serve_command
from tests.daemon_helpers import running_daemon, wait_exit

SLOW_STEPS = {FAULT_INJECT_ENV: "step_delay_ms=2"}
"""The worker's test hook: every engine step sleeps 2 ms, so a 200- or 400-token stream is still running when the
test's timeout or crash comes, however fast the engine is."""


SYNTHETIC = ("--engine", "synthetic", "--synthetic-step-ms", "5", "--devices", "cpu")
HEARTBEAT_S = 0.5
GONE_NOTICED_S = HEARTBEAT_S + PROBE_AFTER_S + 1.0
"""A client notices a killed daemon within a heartbeat period and a probe's wait, plus slack for a busy host."""


def _assert_nothing_left_running(address: str, why: str, timeout_s: float = 10.0) -> None:
    """Wait until the daemon at ``address`` runs no request; fail with ``why`` after ``timeout_s``."""
    with Client(address) as client:
        deadline = time.monotonic() + timeout_s
        while client.status().running:
            assert time.monotonic() < deadline, why
            time.sleep(0.05)


@pytest.mark.e2e
def test_streams_of_a_crashed_daemon_end_after_its_restart(tmp_path):
    with running_daemon(tmp_path, env=SLOW_STEPS) as first:
        client = Client(first.address, heartbeat_s=0.3, timeout_s=60)
        try:
            stream = client.generate("Return the", max_tokens=400, temperature=0.0, ignore_eos=True)
            next(stream)
            workers = first.worker_pids()
            first.proc.kill()
            first.proc.wait()
            assert not wait_exit(workers, 5.0)
            with running_daemon(tmp_path, "--instance", first.instance):
                start = time.monotonic()
                with pytest.raises(UnknownRequest):
                    for _ in stream:
                        pass
                assert time.monotonic() - start < 10, "the lost stream waited too long"
        finally:
            client.close()


@pytest.mark.e2e
def test_a_second_daemon_cannot_take_over_a_live_socket(tmp_path):
    with running_daemon(tmp_path) as first:
        out = subprocess.run(serve_command("intruder", first.address), capture_output=True, text=True, timeout=120,
                             env={"XDG_RUNTIME_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"})
        assert out.returncode == 1 and "in use" in out.stderr, out.stderr
        with Client(first.address) as client:
            assert client.status().ready  # the first daemon still owns its socket


@pytest.mark.e2e
def test_cancelled_async_requests_leave_no_pending_tasks(tmp_path):
    with running_daemon(tmp_path, env=SLOW_STEPS) as d:

        async def main():
            async with AsyncClient(d.address) as client:
                for _ in range(20):
                    with pytest.raises(asyncio.TimeoutError):
                        await asyncio.wait_for(client.complete("Return the", max_tokens=200, ignore_eos=True), 0.05)
                await asyncio.sleep(0.1)
                mine = asyncio.current_task()
                pending = [t for t in asyncio.all_tasks() if t is not mine and not t.done()]
                assert len(pending) <= 2, pending  # the client's receiver and heartbeat tasks only
                status = await client.status()
            return status

        asyncio.run(main())
        _assert_nothing_left_running(d.address, "cancelled requests kept running")


@pytest.mark.e2e
def test_deeply_nested_frame_gets_an_error_and_the_daemon_keeps_answering(tmp_path):
    with running_daemon(tmp_path) as d:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(d.address)
        try:
            sock.send(b"\x91" * 100_000 + b"\xc0")
            assert sock.poll(10_000), "no reply to a deeply nested frame"
            reply = P.SERVER_DECODER.decode(sock.recv())
            assert isinstance(reply, P.Error) and reply.code == P.ErrorCode.INVALID_REQUEST
        finally:
            sock.close()
            ctx.term()
        with Client(d.address) as client:
            assert client.complete("Return the", max_tokens=2).usage.completion_tokens == 2


@pytest.mark.e2e
def test_a_clean_stop_leaves_no_socket_files(tmp_path):
    with running_daemon(tmp_path) as d:
        assert d.stop() == 0
    leftovers = [p.name for p in tmp_path.rglob("*") if p.suffix in (".sock", ".events", ".cmd", ".lock")]
    assert not leftovers, leftovers


@pytest.mark.e2e
def test_one_failed_request_of_a_gather_ends_the_others_quietly(tmp_path):
    """A failure inside ``async with`` closes the client under streams still running: they end, nothing is logged."""
    with running_daemon(tmp_path) as d:
        problems: list[dict] = []

        async def main():
            asyncio.get_running_loop().set_exception_handler(lambda loop, context: problems.append(context))
            async with AsyncClient(d.address) as client:
                with pytest.raises(InvalidRequest):
                    await asyncio.gather(*(client.complete("Return the", max_tokens=200, ignore_eos=True)
                                           for _ in range(5)), client.complete("The", max_tokens=-1))
            await asyncio.sleep(0.2)
            left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            results = await asyncio.gather(*left, return_exceptions=True)
            assert all(isinstance(r, RingstreamError) for r in results), results

        asyncio.run(main())
        assert problems == []
        _assert_nothing_left_running(d.address, "the closed client's requests kept running")


@pytest.mark.e2e
def test_what_cannot_be_sent_is_refused_by_the_client(tmp_path):
    with running_daemon(tmp_path) as d, Client(d.address) as client:
        with pytest.raises(InvalidRequest, match="at most 4,194,304"):
            client.complete("x" * (P.MAX_FRAME_BYTES + 1))
        with pytest.raises(InvalidRequest, match="serialize"):
            client.complete("Return the", priority=10**20)
        assert client.complete("Return the", max_tokens=3).usage.completion_tokens == 3


def test_the_cli_fails_fast_on_a_stale_socket_and_a_bad_address(tmp_path, capsys):
    stale = tmp_path / "stale.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(stale))
    listener.close()  # the file stays, nobody listens: a killed daemon's socket
    start = time.monotonic()
    assert cli.main(["generate", "--socket", f"ipc://{stale}", "hello"]) == 1
    assert cli.main(["status", "--socket", f"ipc://{stale}"]) == 1
    assert time.monotonic() - start < 2.0
    assert capsys.readouterr().err.count("a stale socket file") == 2
    assert cli.main(["status", "--socket", str(stale)]) == 1
    assert "use ipc://PATH or tcp://HOST:PORT" in capsys.readouterr().err


@pytest.mark.e2e
def test_async_client_routing_and_lifetime_edges(tmp_path):
    """Errors naming ended streams, cancelled status calls, use after close, a daemon that stops answering."""
    # 20 ms steps: the 500-token stream below outlasts the SIGSTOP by seconds even on a busy host
    with running_daemon(tmp_path, "--engine", "synthetic", "--synthetic-step-ms", "20", "--devices", "cpu") as d:
        problems: list[dict] = []

        async def main():
            asyncio.get_running_loop().set_exception_handler(lambda loop, context: problems.append(context))
            async with AsyncClient(d.address) as client:
                # the cancel of a stream whose last chunk was already on its way gets UNKNOWN_REQUEST: not status()'s
                stream = client.generate(prompt_token_ids=[5, 6], max_tokens=5, ignore_eos=True)
                await stream.__anext__()
                await asyncio.sleep(0.5)
                await stream.aclose()
                assert (await client.status()).ready
                assert [e.code for e in client.stray_errors] == [P.ErrorCode.UNKNOWN_REQUEST]
                # status() calls abandoned by their callers do not swallow the replies of later ones
                for delay in [0.0002, 0.0005, 0.001, 0.002] * 25:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(client.status(), delay)
                assert (await client.status()).ready
            with pytest.raises(RingstreamError, match="closed"):
                await client.complete(prompt_token_ids=[5], max_tokens=2)

            # a stopped daemon is noticed within timeout_s even while new requests keep starting
            async with AsyncClient(d.address, timeout_s=1.0, heartbeat_s=0.1) as client:
                first = client.generate(prompt_token_ids=[5, 6], max_tokens=500, ignore_eos=True)
                await first.__anext__()
                d.proc.send_signal(signal.SIGSTOP)
                starters: list[asyncio.Task] = []

                async def keep_starting() -> None:
                    while True:
                        starters.append(asyncio.create_task(client.complete(prompt_token_ids=[7], max_tokens=4)))
                        await asyncio.sleep(0.2)

                starter = asyncio.create_task(keep_starting())
                try:
                    with pytest.raises(DaemonUnavailable):
                        async with asyncio.timeout(10):  # without the silence clock: TimeoutError here
                            async for _ in first:
                                pass
                finally:
                    starter.cancel()
                    d.proc.send_signal(signal.SIGCONT)
                await asyncio.gather(*starters, return_exceptions=True)

        asyncio.run(main())
        assert problems == []


def _reap(d, workers: list[int]) -> None:
    """After the front was SIGKILLed: wait for its workers and remove the rings it could not."""
    d.proc.wait()
    assert not wait_exit(workers, 10.0), "workers outlived the front"
    for path in d.segments():  # the owner died before it could unlink them
        os.unlink(path)


@pytest.mark.e2e
def test_a_daemon_killed_mid_stream_fails_the_stream_within_the_heartbeat_window(tmp_path):
    """Both clients, default timeout_s (30 s): the dead socket is noticed, not waited out."""
    with running_daemon(tmp_path, *SYNTHETIC) as d, Client(d.address, heartbeat_s=HEARTBEAT_S) as client:
        workers = d.worker_pids()
        stream = client.generate(prompt_token_ids=[5, 6, 7], max_tokens=500, ignore_eos=True)
        next(stream)
        try:
            d.proc.kill()
            killed = time.monotonic()
            with pytest.raises(DaemonUnavailable, match="a stale socket file"):
                for _ in stream:
                    pass
            assert time.monotonic() - killed < GONE_NOTICED_S
        finally:
            _reap(d, workers)

    async def stream_async(d) -> float:
        async with AsyncClient(d.address, heartbeat_s=HEARTBEAT_S) as client:
            stream = client.generate(prompt_token_ids=[5, 6, 7], max_tokens=500, ignore_eos=True)
            await stream.__anext__()
            d.proc.kill()
            killed = time.monotonic()
            with pytest.raises(DaemonUnavailable, match="a stale socket file"):
                async for _ in stream:
                    pass
            return time.monotonic() - killed

    with running_daemon(tmp_path, *SYNTHETIC) as d:
        workers = d.worker_pids()
        try:
            assert asyncio.run(stream_async(d)) < GONE_NOTICED_S
        finally:
            _reap(d, workers)
