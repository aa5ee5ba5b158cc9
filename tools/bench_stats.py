"""Per-request benchmark records and the statistics computed from them.

Every system the benchmark measures (the daemon through its socket, the
in-process baselines) produces one :class:`RequestRecord` per request, on one
clock (seconds, any origin, the same for all records of a run). From those
records :func:`summarize` derives the figures the benchmark reports:

* TTFT (time to first token): arrival of the first chunk carrying a token,
  minus the time the request was sent;
* ITL (inter-token latency): the gap between two consecutive token-carrying
  chunks divided by the number of tokens in the later chunk, counted once per
  token (a chunk of 3 tokens after 6 ms gives three samples of 2 ms), as
  GenAI-Perf and vLLM's benchmark_serving count streamed chunks;
* E2E: end of the request (terminal message) minus the time it was sent;
* throughput: completed requests and output tokens per second of wall time
  (first send to last end);
* errors by code, and order violations: chunk ``seq`` numbers that do not go
  0, 1, 2... without gap or repeat, plus order errors the client itself
  detected (it raises before handing such a chunk over).

Percentiles use linear interpolation between closest ranks (Hyndman and Fan
definition 7, the default of numpy.percentile and of Excel's PERCENTILE.INC).
This module is pure Python: no torch, no sockets.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Sequence

PERCENTILES = (50.0, 90.0, 99.0)
"""Percentiles reported for each latency, in percent."""
DEFAULT_TIMELINE_BINS = 40
"""Number of bins of the tokens-per-second timeline when no bin width is given."""
MIN_TIMELINE_BIN_S = 0.05
"""Narrowest timeline bin, seconds."""
ERROR_ORDER = "ORDER"
"""Error code recorded when the client raised ``StreamOrderError``."""


@dataclass(slots=True)
class RequestRecord:
    """What one request did, as seen where it was measured.

    Attributes:
        start: when the request was sent (or submitted), seconds.
        end: when its terminal message arrived, seconds (0 while unfinished).
        chunk_times: arrival time of each chunk that carried at least one token.
        chunk_tokens: tokens in each of those chunks (parallel to ``chunk_times``).
        seqs: ``seq`` of every chunk received, terminal one included.
        priority: the request's priority.
        error: error code if the request failed (``ringstream.ipc.protocol.ErrorCode``
            value, :data:`ERROR_ORDER`, or an exception class name), else None.
        finish_reason: finish reason of the terminal chunk, if any.
        order_errors: order errors detected before a chunk was handed over
            (by the client library), added to the ``seqs`` check.
        content_errors: streams whose content failed a check (token count
            against ``usage``, or expected text), 0 or 1.
    """

    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    priority: int = 0
    error: str | None = None
    finish_reason: str | None = None
    order_errors: int = 0
    content_errors: int = 0

    @property
    def output_tokens(self) -> int:
        """Tokens received."""
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds; None if no token arrived."""
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        """Send to terminal message, seconds; None if unfinished."""
        return self.end - self.start if self.end else None


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linear interpolation (Hyndman-Fan 7).

    Raises:
        ValueError: ``values`` is empty or ``q`` is outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} is outside [0, 100]")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def seq_violations(seqs: Sequence[int]) -> int:
    """Places where a stream's chunk ``seq`` is not the previous one plus 1 (the first must be 0).

    One missing chunk counts once (the stream resumes counting from the seq
    that arrived), a repeated or reordered chunk counts at each break.
    """
    violations = 0
    expected = 0
    for seq in seqs:
        if seq != expected:
            violations += 1
        expected = seq + 1
    return violations


def itl_samples(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """Inter-token latencies of one stream, seconds: each chunk gap divided by its tokens, once per token.

    The first chunk (its gap is the TTFT) gives no sample.
    """
    samples: list[float] = []
    for i in range(1, len(chunk_times)):
        tokens = chunk_tokens[i]
        if tokens > 0:
            samples.extend([(chunk_times[i] - chunk_times[i - 1]) / tokens] * tokens)
    return samples


def latency_summary(values: Sequence[float]) -> dict[str, float | int | None]:
    """``count``, ``mean``, ``max`` and the :data:`PERCENTILES` (keys ``p50``...) of ``values``, seconds.

    All figures are None when ``values`` is empty.
    """
    summary: dict[str, float | int | None] = {"count": len(values)}
    if not values:
        summary.update(mean=None, max=None, **{f"p{q:g}": None for q in PERCENTILES})
        return summary
    summary.update(mean=sum(values) / len(values), max=max(values))
    summary.update({f"p{q:g}": percentile(values, q) for q in PERCENTILES})
    return summary


def order_violations(records: Iterable[RequestRecord]) -> int:
    """Seq breaks plus client-detected order errors over all ``records``."""
    return sum(seq_violations(r.seqs) + r.order_errors for r in records)


def summarize(records: Sequence[RequestRecord], wall_s: float | None = None) -> dict:
    """Figures of one run (see the module docstring); JSON-ready.

    Args:
        records: every request of the run.
        wall_s: the run's wall time, seconds; default: first start to last end.

    Returns:
        A dict with ``requests``, ``completed``, ``errors`` (count per code),
        ``wall_s``, ``req_s``, ``tok_s``, ``output_tokens``, ``ttft_s``,
        ``itl_s``, ``e2e_s`` (each a :func:`latency_summary`),
        ``order_violations``, ``content_errors`` and ``by_priority`` (TTFT and
        E2E summaries per priority, when there is more than one).
    """
    completed = [r for r in records if r.error is None and r.end]
    if wall_s is None:
        ends = [r.end for r in records if r.end]
        wall_s = (max(ends) - min(r.start for r in records)) if ends else 0.0
    tokens = sum(r.output_tokens for r in records)
    ttfts = [r.ttft for r in completed if r.ttft is not None]
    itls = [s for r in completed for s in itl_samples(r.chunk_times, r.chunk_tokens)]
    e2es = [r.e2e for r in completed]
    summary = {
        "requests": len(records),
        "completed": len(completed),
        "errors": dict(Counter(r.error for r in records if r.error is not None)),
        "wall_s": wall_s,
        "req_s": len(completed) / wall_s if wall_s > 0 else 0.0,
        "tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "output_tokens": tokens,
        "ttft_s": latency_summary(ttfts),
        "itl_s": latency_summary(itls),
        "e2e_s": latency_summary(e2es),
        "order_violations": order_violations(records),
        "content_errors": sum(r.content_errors for r in records),
    }
    priorities = sorted({r.priority for r in records})
    if len(priorities) > 1:
        summary["by_priority"] = {
            str(p): {
                "requests": sum(1 for r in records if r.priority == p),
                "ttft_s": latency_summary([r.ttft for r in completed if r.priority == p and r.ttft is not None]),
                "e2e_s": latency_summary([r.e2e for r in completed if r.priority == p]),
            }
            for p in priorities
        }
    return summary


def timeline(records: Sequence[RequestRecord], bin_s: float | None = None) -> list[tuple[float, float]]:
    """Output tokens per second over the run: ``[(bin start, tokens/s), ...]``, time from the first start.

    ``bin_s``: bin width, seconds; default: the run split into
    :data:`DEFAULT_TIMELINE_BINS` bins, at least :data:`MIN_TIMELINE_BIN_S`.
    The remainder of the run past the last whole bin is folded into that bin
    (so the curve does not end in a spuriously low, partly empty bin).
    """
    times = [(t, n) for r in records for t, n in zip(r.chunk_times, r.chunk_tokens)]
    if not times:
        return []
    origin = min(r.start for r in records)
    span = max(t for t, _ in times) - origin
    width = bin_s or max(MIN_TIMELINE_BIN_S, span / DEFAULT_TIMELINE_BINS)
    count = max(1, int(span / width))
    bins = [0] * count
    for t, n in times:
        bins[min(int((t - origin) / width), count - 1)] += n
    last_width = max(width, span - (count - 1) * width)
    widths = [width] * (count - 1) + [last_width]
    return [(i * width, tokens / w) for i, (tokens, w) in enumerate(zip(bins, widths))]


def cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """Empirical CDF points ``(sorted values, cumulative fractions)`` for plotting."""
    ordered = sorted(values)
    n = len(ordered)
    return ordered, [(i + 1) / n for i in range(n)]
