"""What the HTTP API costs the front: its CPU per streamed token, ZeroMQ clients vs the same load over HTTP.

One daemon (synthetic engine, so no model compute hides the serving layer)
with ``--http``; the same load, ``--streams`` concurrent streams of
``--tokens`` tokens, runs alternately through :class:`ringstream.AsyncClient`
and through the HTTP child (SSE, aiohttp client), ``--repeats`` times each.
For each run: the front's CPU seconds (user + system, ``psutil``) per
generated token, the HTTP child's, and the wall time. The HTTP server runs in
its own process so that its parsing and JSON encoding never run on the
front's event loop; this shows what that choice leaves on the front::

    python -m ringstream.tools.bench_http [--streams 32] [--tokens 200] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time

import psutil

from ringstream.daemon.common.proctitle import http_title
from ringstream.ipc.client import AsyncClient
from ringstream.daemon.launcher import DaemonProcess

STEP_MS = 2
"""Synthetic engine step, milliseconds."""
SETTLE_S = 2.0
"""Wait after the start, so the start's own CPU is not counted."""
HTTP_TITLE = http_title()
"""The HTTP child's process title."""


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _zmq_load(address: str, streams: int, tokens: int) -> None:
    async with AsyncClient(address) as client:
        await asyncio.gather(*(client.complete(prompt_token_ids=[5, 6], max_tokens=tokens, ignore_eos=True)
                               for _ in range(streams)))


async def _http_load(url: str, streams: int, tokens: int) -> None:
    import aiohttp

    body = {"model": "default_model", "prompt": [5, 6], "max_tokens": tokens, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        async def one() -> None:
            async with session.post(url + "/v1/completions", json=body) as response:
                response.raise_for_status()
                async for _ in response.content:
                    pass

        await asyncio.gather(*(one() for _ in range(streams)))


def measure(streams: int, tokens: int, repeats: int) -> list[dict]:
    """Run the comparison; one dict per run: ``path`` ("zmq" or "http"), ``front_us_per_token``,
    ``http_us_per_token``, ``wall_s``."""
    port = _free_port()
    daemon = DaemonProcess("--engine", "synthetic", "--synthetic-step-ms", str(STEP_MS), "--devices", "cpu",
                           "--http", f"127.0.0.1:{port}")
    daemon.start()
    try:
        front = psutil.Process(daemon.proc.pid)
        time.sleep(SETTLE_S)
        http_child = [p for p in front.children() if HTTP_TITLE in " ".join(p.cmdline())]
        if not http_child:
            raise RuntimeError(f"no child process titled {HTTP_TITLE!r} under the front (pid {front.pid})")
        runs = []
        loads = {"zmq": lambda: _zmq_load(daemon.address, streams, tokens),
                 "http": lambda: _http_load(f"http://127.0.0.1:{port}", streams, tokens)}
        for _ in range(repeats):
            for path, load in loads.items():
                front_0, http_0, wall_0 = _cpu_s(front), sum(map(_cpu_s, http_child)), time.monotonic()
                asyncio.run(load())
                front_1, http_1, wall_1 = _cpu_s(front), sum(map(_cpu_s, http_child)), time.monotonic()
                count = streams * tokens
                runs.append(dict(path=path, front_us_per_token=1e6 * (front_1 - front_0) / count,
                                 http_us_per_token=1e6 * (http_1 - http_0) / count, wall_s=wall_1 - wall_0))
        return runs
    finally:
        daemon.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringstream.tools.bench_http", description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=32, help="concurrent streams (default 32)")
    parser.add_argument("--tokens", type=int, default=200, help="tokens per stream (default 200)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each path, alternating (default 2)")
    args = parser.parse_args(argv)
    for run in measure(args.streams, args.tokens, args.repeats):
        print(f"{run['path']:>4}: front {run['front_us_per_token']:5.1f} us/token, "
              f"HTTP child {run['http_us_per_token']:5.1f} us/token, wall {run['wall_s']:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
