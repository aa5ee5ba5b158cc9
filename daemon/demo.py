"""``ringstream demo``: a daemon on the built-in model, a batch of live streams, a summary.

Starts ``ringstream serve`` as a child process on a private socket, waits for
it to be ready, streams a batch of concurrent prompts (live in a terminal,
plain text otherwise), prints throughput and latency (TTFT and E2E
percentiles), then stops the daemon with SIGTERM and checks it exited cleanly.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table

from ringstream.ipc.client import AsyncClient, RingstreamError

PROMPTS = [
    "The socket module provides", "Return the number of", "Create a new instance of", "This function is used to",
    "If the file does not", "The default value is", "Raise an exception if the", "Convert a string to a",
    "The object is a", "A list of all the", "This class provides a", "Set the value of the",
    "Return True if the", "The path to the file", "When the server is", "Read the data from the",
]
DEMO_SEED = 1234
STOP_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 300.0
TAIL_CHARS = 70


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def _wait_ready(client: AsyncClient, daemon: subprocess.Popen):
    """Wait for the daemon's ready handshake; fail at once if the daemon process exits."""
    ready = asyncio.ensure_future(client.wait_ready(READY_TIMEOUT_S))
    while not ready.done():
        await asyncio.wait({ready}, timeout=0.2)
        if daemon.poll() is not None and not ready.done():
            ready.cancel()
            raise RuntimeError(f"the daemon exited with code {daemon.returncode} before it was ready")
    return ready.result()


async def run_demo(model: str | None, devices: str, requests: int, max_tokens: int) -> int:
    """Run the demo; returns the process exit code (0 when every stream completed and the daemon stopped cleanly)."""
    console = Console()
    tmp = tempfile.mkdtemp(prefix="ringstream-demo-")
    instance = f"demo-{os.getpid()}"
    address = f"ipc://{tmp}/demo.sock"
    # -P: the daemon never imports modules from the current directory
    cmd = [sys.executable, "-P", "-m", "ringstream.daemon.cli", "serve", "--instance", instance, "--socket", address,
           "--devices", devices, "--log-level", "warning"]
    if model:
        cmd += ["--model", model]
    console.print(f"[bold]ringstream demo[/]: starting the daemon ({devices}, {'model ' + model if model else 'built-in model'})")
    daemon = subprocess.Popen(cmd)
    outputs = [""] * requests
    stats: list[tuple[float, float, int]] = []
    failure = None
    try:
        async with AsyncClient(address) as client:
            try:
                status = await _wait_ready(client, daemon)
            except (RuntimeError, RingstreamError) as exc:
                failure = str(exc)
                return 1
            console.print(f"ready: {len(status.workers)} worker(s), {status.workers[0].max_num_seqs} slots each; "
                          f"streaming {requests} prompts x {max_tokens} tokens")

            async def one(i: int) -> None:
                start = time.monotonic()
                ttft = 0.0
                tokens = 0
                async for chunk in client.generate(PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens,
                                                   temperature=0.7, top_p=0.95, seed=DEMO_SEED + i):
                    if chunk.token_ids and not ttft:
                        ttft = time.monotonic() - start
                    tokens += len(chunk.token_ids)
                    outputs[i] += chunk.text
                stats.append((ttft, time.monotonic() - start, tokens))

            def table() -> Table:
                view = Table(show_header=True, header_style="bold", expand=True)
                view.add_column("#", width=3)
                view.add_column("stream")
                for i, text in enumerate(outputs):
                    shown = (PROMPTS[i % len(PROMPTS)] + text).replace("\n", " ")
                    view.add_row(str(i), shown[-TAIL_CHARS:])
                return view

            start = time.monotonic()
            tasks = [asyncio.create_task(one(i)) for i in range(requests)]
            with Live(table(), console=console, refresh_per_second=10, transient=not console.is_terminal) as live:
                while not all(t.done() for t in tasks):
                    await asyncio.wait(tasks, timeout=0.1)
                    live.update(table())
            await asyncio.gather(*tasks)
            wall = time.monotonic() - start
        if not console.is_terminal:
            for i, text in enumerate(outputs):
                print(f"[{i}] {PROMPTS[i % len(PROMPTS)]}{text}".replace("\n", " "))
        total = sum(s[2] for s in stats)
        ttfts = [s[0] for s in stats]
        e2es = [s[1] for s in stats]
        console.print(
            f"\n{requests} streams, {total} tokens in {wall:.2f} s: [bold]{total / wall:.0f} tok/s[/], "
            f"{requests / wall:.1f} req/s\n"
            f"TTFT  p50 {statistics.median(ttfts) * 1000:.0f} ms  p99 {_percentile(ttfts, 0.99) * 1000:.0f} ms\n"
            f"E2E   p50 {statistics.median(e2es) * 1000:.0f} ms  p99 {_percentile(e2es, 0.99) * 1000:.0f} ms"
        )
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
        try:
            code = daemon.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            daemon.kill()
            code = daemon.wait()
        shutil.rmtree(tmp, ignore_errors=True)
        if failure is not None:
            console.print(f"[red]demo failed[/]: {failure}")
    console.print(f"daemon stopped (exit code {code})")
    return 0 if code == 0 and len(stats) == requests else 1
