"""``ringstream demo``: a daemon on the built-in model, a batch of live streams, a summary.

Starts ``ringstream serve`` as a child process on a private socket
(:class:`ringstream.daemon.launcher.DaemonProcess`), waits for it to be
ready, streams a batch of concurrent prompts (live in a terminal, plain text
otherwise), prints throughput and latency (TTFT and E2E percentiles), then
stops the daemon and checks it exited cleanly.

Ctrl-C cancels the streams, stops the daemon and exits with 130 after one
line. The daemon runs in a session of its own, so the terminal's SIGINT
reaches the demo alone (never a daemon still importing its modules) and the
demo stops it on its one stop path; it gets SIGTERM if the demo dies.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.live import Live
from rich.table import Table

from ringstream.ipc.client import AsyncClient, RingstreamError
from ringstream.daemon.launcher import DaemonProcess, DaemonStartError

PROMPTS = [
    "The socket module provides", "Return the number of", "Create a new instance of", "This function is used to",
    "If the file does not", "The default value is", "Raise an exception if the", "Convert a string to a",
    "The object is a", "A list of all the", "This class provides a", "Set the value of the",
    "Return True if the", "The path to the file", "When the server is", "Read the data from the",
]
DEMO_SEED = 1234
TAIL_CHARS = 70
REFRESH_S = 0.1
"""The live table is redrawn this often."""
INTERRUPTED_EXIT = 130
"""Exit code after Ctrl-C (128 + SIGINT), as a shell reports it."""


@dataclass
class Streams:
    """What the demo's streams produced."""

    outputs: list[str]
    stats: list[tuple[float, float, int]] = field(default_factory=list)
    """``(TTFT s, E2E s, tokens)`` of each completed stream."""
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def _stream_all(address: str, requests: int, max_tokens: int, console: Console) -> Streams:
    """Run ``requests`` concurrent streams with a live table. Cancelled (Ctrl-C under ``asyncio.run``), it
    cancels every stream (each cancels its request on the daemon) before the client closes."""
    streams = Streams(outputs=[""] * requests)

    async def one(i: int, client: AsyncClient) -> None:
        start = time.monotonic()
        ttft = 0.0
        tokens = 0
        try:
            async for chunk in client.generate(PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens,
                                               temperature=0.7, top_p=0.95, seed=DEMO_SEED + i):
                if chunk.token_ids and not ttft:
                    ttft = time.monotonic() - start
                tokens += len(chunk.token_ids)
                streams.outputs[i] += chunk.text
        except RingstreamError as exc:
            streams.errors.append(f"stream {i}: {exc}")
            return
        streams.stats.append((ttft, time.monotonic() - start, tokens))

    def table() -> Table:
        view = Table(show_header=True, header_style="bold", expand=True)
        view.add_column("#", width=3)
        view.add_column("stream")
        for i, text in enumerate(streams.outputs):
            shown = (PROMPTS[i % len(PROMPTS)] + text).replace("\n", " ")
            view.add_row(str(i), shown[-TAIL_CHARS:])
        return view

    async with AsyncClient(address) as client:
        start = time.monotonic()
        with Live(table(), console=console, refresh_per_second=1 / REFRESH_S,
                  transient=not console.is_terminal) as live:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(i, client)) for i in range(requests)]
                while not all(t.done() for t in tasks):
                    await asyncio.wait(tasks, timeout=REFRESH_S)
                    live.update(table())
        streams.wall_s = time.monotonic() - start
    return streams


def _summary(streams: Streams, requests: int, console: Console) -> None:
    if not console.is_terminal:
        for i, text in enumerate(streams.outputs):
            print(f"[{i}] {PROMPTS[i % len(PROMPTS)]}{text}".replace("\n", " "))
    if not streams.stats:
        return
    total = sum(s[2] for s in streams.stats)
    ttfts = [s[0] for s in streams.stats]
    e2es = [s[1] for s in streams.stats]
    wall = streams.wall_s
    console.print(
        f"\n{len(streams.stats)} streams, {total} tokens in {wall:.2f} s: [bold]{total / wall:.0f} tok/s[/], "
        f"{len(streams.stats) / wall:.1f} req/s\n"
        f"TTFT  p50 {statistics.median(ttfts) * 1000:.0f} ms  p99 {_percentile(ttfts, 0.99) * 1000:.0f} ms\n"
        f"E2E   p50 {statistics.median(e2es) * 1000:.0f} ms  p99 {_percentile(e2es, 0.99) * 1000:.0f} ms"
    )
    for error in streams.errors:
        console.print(f"[red]{error}[/]")


def run_demo(model: str | None, devices: str, requests: int, max_tokens: int) -> int:
    """Run the demo; returns the process exit code: 0 when every stream completed and the daemon stopped
    cleanly, 1 otherwise, 130 after Ctrl-C."""
    console = Console()
    args = ["--devices", devices, "--log-level", "warning", *(["--model", model] if model else [])]
    daemon = DaemonProcess(*args, instance=f"demo-{os.getpid()}", log=False, own_session=True,
                           die_with_parent=True)
    streams, failure, interrupted = None, None, False
    try:
        console.print(f"[bold]ringstream demo[/]: starting the daemon ({devices}, "
                      f"{'model ' + model if model else 'built-in model'})")
        status = daemon.start()
        console.print(f"ready: {len(status.workers)} worker(s), {status.workers[0].max_num_seqs} slots each; "
                      f"streaming {requests} prompts x {max_tokens} tokens")
        streams = asyncio.run(_stream_all(daemon.address, requests, max_tokens, console))
    except KeyboardInterrupt:
        interrupted = True
    except DaemonStartError as exc:
        failure = str(exc)
    finally:
        daemon.close()
    code = daemon.proc.returncode if daemon.proc is not None else None
    if interrupted:
        console.print(f"interrupted: streams cancelled, daemon stopped (exit code {code})")
        return INTERRUPTED_EXIT
    if failure is not None:
        console.print(f"[red]demo failed[/]: {failure}")
        return 1
    _summary(streams, requests, console)
    console.print(f"daemon stopped (exit code {code})")
    return 0 if code == 0 and daemon.leftovers.clean and len(streams.stats) == requests else 1
