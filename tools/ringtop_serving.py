"""The serving view of ``ringstream-top``: what a daemon is doing, from its ``Status`` reply.

Per worker: running and waiting requests, KV-cache use, decode tokens per
second; per open request (the oldest first): id, priority, state, worker,
prompt and streamed tokens, age and TTFT; above them the daemon's state,
model, throughput and TTFT/ITL percentiles (fields of
:class:`ringstream.ipc.protocol.StatusReply`). Every line fits the console's
width (80 columns included): long values are cut with an ellipsis, never
wrapped.

Like the ring views of :mod:`ringstream.tools.ringtop`, it imports only
:mod:`ringstream.ipc` and rich: it speaks to the daemon through the client
socket (``Status`` is read-only) and runs without the daemon's code.
"""

from __future__ import annotations

from datetime import datetime

import zmq
from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from ringstream.ipc import protocol as P
from ringstream.ipc.client import Client, RingstreamError

__all__ = [
    "StatusPoller",
    "format_age",
    "format_latency",
    "render_serving",
]

STATUS_TIMEOUT_S = 2.0
"""Silence after which one ``Status`` call gives up, seconds."""
TABLE_LINES = 3
"""Lines a table takes besides its rows: its title, column headers and the rule under them."""
FOOTER_LINES = 2
"""The line under the requests (how many are shown) and the keys' help."""
ELLIPSIS = "\u2026"
MS_PER_S = 1000
S_PER_MIN = 60
S_PER_H = 3600
KV_BAR_CELLS = 10
"""Width of the KV-cache use bar, characters."""
CELL_PADDING = (0, 1, 0, 0)
"""One space after each cell; with the column rule's own space, two between columns."""
COLUMN_GAP = 2
MIN_FLEX_WIDTH = 4
"""The column that gives way keeps this many characters at least (the table then overflows the width)."""
STATE_STYLES = {"running": "green", "waiting": "yellow", "preempting": "magenta", "aborting": "red"}


def format_latency(seconds: float | None) -> str:
    """``12.3 ms``, ``1.50 s``; ``-`` for None (no sample yet)."""
    if seconds is None:
        return "-"
    return f"{seconds * MS_PER_S:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def format_age(seconds: float) -> str:
    """A duration in at most 6 characters: ``850ms``, ``12.3s``, ``5m03s``, ``2h05m``."""
    if seconds < 1:
        return f"{seconds * MS_PER_S:.0f}ms"
    if seconds < S_PER_MIN:
        return f"{seconds:.1f}s"
    if seconds < S_PER_H:
        minutes, rest = divmod(int(seconds), S_PER_MIN)
        return f"{minutes}m{rest:02d}s"
    hours, rest = divmod(int(seconds), S_PER_H)
    return f"{hours}h{rest // S_PER_MIN:02d}m"


def shorten_left(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters from the left (``…/models/tiny``): a path's end names it."""
    if len(text) <= width:
        return text
    return ELLIPSIS + text[len(text) - width + 1:] if width > 1 else ELLIPSIS[:width]


def _line(text: str | Text, style: str = "") -> Text:
    line = text if isinstance(text, Text) else Text(text, style=style)
    line.no_wrap = True
    line.overflow = "ellipsis"
    return line


def _kv_cell(usage: float) -> Text:
    filled = round(max(0.0, min(usage, 1.0)) * KV_BAR_CELLS)
    cell = Text("\u2588" * filled, style="cyan")
    cell.append("\u2591" * (KV_BAR_CELLS - filled), style="dim")
    cell.append(f" {usage:4.0%}")
    return cell


def _table(columns: tuple[tuple[str, str, int | None], ...], title: str, width: int) -> Table:
    """A table ``width`` characters wide at most whose cells never wrap (a longer value is cut with an
    ellipsis). ``columns``: (header, justify, width); one width is None: that column takes what is left."""
    table = Table(box=box.SIMPLE_HEAD, padding=CELL_PADDING, pad_edge=False, show_edge=False, title=title,
                  title_justify="left", title_style="bold")
    fixed = sum(size for _, _, size in columns if size is not None)
    rest = max(width - fixed - COLUMN_GAP * (len(columns) - 1), MIN_FLEX_WIDTH)
    for header, justify, size in columns:
        table.add_column(header, justify=justify, no_wrap=True, overflow="ellipsis",
                         width=rest if size is None else size)
    return table


WORKER_COLUMNS = (("worker", "right", 6), ("device", "left", None), ("pid", "right", 7), ("running", "right", 7),
                  ("waiting", "right", 7), ("KV cache", "left", KV_BAR_CELLS + 5), ("tok/s", "right", 8),
                  ("served", "right", 7))
REQUEST_COLUMNS = (("id", "left", None), ("pri", "right", 4), ("state", "left", 10), ("wkr", "right", 3),
                   ("prompt", "right", 6), ("tokens", "right", 9), ("age", "right", 6), ("TTFT", "right", 8))


PHASE_LABELS = {"importing torch": "import torch", "loading weights": "load weights",
                "sizing the KV cache": "size KV cache", "warming up": "warm-up"}
"""A worker's start phase (:data:`ringstream.ipc.worker_protocol.WORKER_PHASES`) as the KV cache cell shows it
until the worker is ready (there is no KV cache to show before): at most ``KV_BAR_CELLS + 5`` characters."""


def _workers_table(reply: P.StatusReply, width: int) -> Table:
    table = _table(WORKER_COLUMNS, "workers", width)
    for w in reply.workers:
        slots = min(w.max_num_seqs, reply.max_concurrency) if w.max_num_seqs else reply.max_concurrency
        kv = (_kv_cell(w.kv_cache_usage) if w.phase in ("", "ready")
              else Text(PHASE_LABELS.get(w.phase, w.phase), style="yellow"))
        table.add_row(
            str(w.index), w.device,
            Text(str(w.pid)) if w.alive else Text("dead", style="bold red"),
            f"{w.running}/{slots}", str(w.waiting), kv, f"{w.tokens_per_s:.1f}",
            str(w.requests_served),
        )
    return table


def _requests_table(requests: list[P.RequestInfo], width: int) -> Table:
    table = _table(REQUEST_COLUMNS, "requests (oldest first)", width)
    for r in requests:
        table.add_row(
            r.id, str(r.priority), Text(r.state, style=STATE_STYLES.get(r.state, "")),
            "-" if r.worker is None else str(r.worker), str(r.prompt_tokens),
            f"{r.completion_tokens}/{r.max_tokens}", format_age(r.age_s), format_latency(r.ttft_s),
        )
    return table


def render_serving(reply: P.StatusReply | None, *, width: int, clock: float, address: str, refresh_s: float,
                   height: int | None = None, error: str | None = None, keys_help: str = "") -> Group:
    """The serving view of one status ``reply``.

    Args:
        reply: the latest reply (None: no daemon answered yet).
        width: the console's width, characters (the model path is cut to it).
        clock: when the reply was taken, seconds since the epoch (shown as a time of day).
        address: the daemon's address, shown in the title.
        refresh_s: the refresh period shown in the title, seconds.
        height: the console's height, lines: the requests listed are cut to fit it (None: all in ``reply``).
        error: why the last ``Status`` call failed (shown in red; the figures are then the previous reply's).
        keys_help: the keys line at the bottom (empty: none).
    """
    stamp = datetime.fromtimestamp(clock).strftime("%H:%M:%S")
    title = f"ringstream-top  {stamp}  every {refresh_s:g} s  "
    parts: list = [_line(title + shorten_left(address, width - len(title)), "bold")]
    if reply is None:
        parts.append(_line(error or "waiting for the daemon's status", "red"))
    else:
        parts += _summary(reply, width)
        if error:
            parts.append(_line(f"no fresh status: {error}", "red"))
        parts.append(_workers_table(reply, width))
        requests = reply.requests
        if height is not None:
            used = len(parts) - 1 + TABLE_LINES + len(reply.workers) + FOOTER_LINES
            requests = requests[:max(height - used - TABLE_LINES, 0)]
        if requests:
            parts.append(_requests_table(requests, width))
        parts.append(_line(_shown_text(len(requests), reply), "dim"))
    if keys_help:
        parts.append(_line(keys_help, "dim"))
    return Group(*parts)


def _summary(reply: P.StatusReply, width: int) -> list[Text]:
    state = Text(reply.state, style="green" if reply.ready else "bold yellow")
    title = Text(f"ringstream {reply.version}  ")
    title.append_text(state)
    title.append(f"  up {format_age(reply.uptime_s)}")
    model_label = "model "
    return [
        _line(title),
        _line(model_label + shorten_left(reply.model or "unknown", width - len(model_label))),
        _line(f"requests {reply.running} running, {reply.waiting} waiting (queue {reply.queue_size}), "
              f"{reply.requests_total} in all"),
        _line(f"throughput {reply.tokens_per_s:.1f} tok/s (last {reply.tokens_per_s_window_s:.0f} s), "
              f"{reply.tokens_generated_total} tokens in all"),
        _line(f"latency TTFT p50 {format_latency(reply.ttft_p50_s)} p99 {format_latency(reply.ttft_p99_s)}"
              f"   ITL p50 {format_latency(reply.itl_p50_s)} p99 {format_latency(reply.itl_p99_s)}"),
    ]


def _shown_text(shown: int, reply: P.StatusReply) -> str:
    if not reply.requests_open:
        return "no open request"
    if shown == reply.requests_open:
        return f"{shown} open request(s)"
    return f"{shown} of {reply.requests_open} open requests shown (the oldest)"


class StatusPoller:
    """Asks one daemon for its status, reconnecting after a failure.

    Args:
        address: the daemon's client address (``ipc://PATH`` or ``tcp://HOST:PORT``).
        timeout_s: silence after which one call gives up, seconds.

    :meth:`poll` never raises for a daemon that is absent or silent: it
    returns None and sets :attr:`error`.
    """

    def __init__(self, address: str, timeout_s: float = STATUS_TIMEOUT_S) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.client: Client | None = None
        self.reply: P.StatusReply | None = None
        """The latest reply (kept across failures)."""
        self.error: str | None = None
        """Why the latest call failed; None after a success."""

    def poll(self) -> P.StatusReply | None:
        """One ``Status`` call; the reply, or None (see :attr:`error`)."""
        try:
            if self.client is None:
                self.client = Client(self.address, timeout_s=self.timeout_s)
            reply = self.client.status()
        except (RingstreamError, zmq.ZMQError) as exc:
            self.error = str(exc)
            self.close()  # a late answer must not be taken for the next call's
            return None
        self.reply, self.error = reply, None
        return reply

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
