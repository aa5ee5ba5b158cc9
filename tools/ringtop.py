"""ringstream-top: a live view of a ringstream instance: what it serves, and its token rings.

Two views:

* **serving** (the default when a daemon answers on its client socket): per
  worker its running and waiting requests, KV-cache use and tokens per
  second; per open request its id, priority, state, tokens so far, age and
  TTFT; the daemon's model, throughput and latency percentiles. It asks the
  daemon (a read-only ``Status`` message, see
  :mod:`ringstream.tools.ringtop_serving`) and fits 80 columns;
* **rings**: a ring debugger.  Each worker process streams its tokens to the
  front through one shared-memory ring, ``/dev/shm/ringstream-<instance>-w<index>``
  (layout in :mod:`ringstream.ipc.ring`).  This view maps every ring of the
  instance read-only with :class:`ringstream.ipc.ring.RingObserver`, follows the
  records as the worker publishes them, and shows per worker: the ring header,
  the positions and fill level, records and bytes per second, the waiting
  flags, the requests in flight with their last ``seq``, and how the requests
  it saw ended.

It imports only :mod:`ringstream.ipc` (and its sibling view module, which does
the same), msgspec and rich, so it runs without the daemon's code or torch.  It
never writes to a ring, takes no lock the daemon uses and owns nothing, so it
can be killed at any moment without effect on the daemon.  What the ring view
reports is sampled: a follower that falls more than about half a ring behind
the worker is *lapped* and misses records (counted as ``laps``).

Usage::

    ringstream-top [--instance NAME] [--socket ADDR] [--view auto|serving|rings]
                   [--once] [--json] [--dump N] [--interval S]

* no option, stdout a terminal: a live full-screen view, refreshed every
  ``--interval`` seconds: the serving view if the daemon answers, else the
  rings.  Keys: ``s`` serving view, ``r`` rings view, ``q`` (or Ctrl-C) quit;
  the terminal is restored on the way out;
* ``--once`` (or stdout not a terminal): one ring summary after sampling for
  ``--interval`` seconds; with ``--json`` one JSON document instead;
* ``--dump N``: the last N ring records seen per worker, decoded, after
  following for up to ``--interval`` seconds (less once N records were seen);
* ``--view serving`` with ``--once`` (or stdout not a terminal): the serving
  view once, as text; with ``--json`` the daemon's status reply as JSON.

The daemon's address: ``--socket``; else that of ``--instance`` when given
(its per-user socket); else what every client uses (``$RINGSTREAM_SOCKET``,
the systemd service's socket, the per-user socket of instance ``default``).

Exit status: 0 on success (also on ``q`` or Ctrl-C in the live view), 1 when
nothing can be shown (no daemon answers and the instance has no ring that can
be read, ``/dev/shm`` cannot be listed, or ``--view serving`` and no daemon
answers), 2 for a usage error, 130 when a one-shot sample is interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ringstream.ipc import protocol as P
from ringstream.ipc.address import check_address, client_socket, default_socket
from ringstream.ipc.ring import (
    KIND_ERROR,
    KIND_FINISH,
    KIND_PROMPT_LOGPROBS,
    KIND_TOKEN,
    SHM_DIR,
    Record,
    RingError,
    RingObserver,
    validate_name,
)
from ringstream.tools.ringtop_keys import KEYS_HELP, VIEW_RINGS, VIEW_SERVING, KeyReader, handle_keys
from ringstream.tools.ringtop_serving import StatusPoller, render_serving

__all__ = [
    "Monitor",
    "RingWatch",
    "build_parser",
    "decode_record",
    "discover",
    "format_dump",
    "format_summary",
    "main",
    "render_live",
    "ring_name",
]

PROG = "ringstream-top"
DEFAULT_INSTANCE = "default"
DEFAULT_INTERVAL_S = 1.0
MIN_INTERVAL_S = 0.05
MAX_INTERVAL_S = 3600.0
POLL_PERIOD_S = 0.02
"""How often every ring is followed while sampling, seconds."""
RING_NAME_FORMAT = "ringstream-{instance}-w{index}"
"""Segment name of worker ``index``'s ring; must match the daemon's
``ringstream.daemon.front.worker_pool.ring_name`` (checked by the tests)."""
WORKER_INDEX_PATTERN = r"(\d+)"

EXIT_OK = 0
EXIT_NO_RINGS = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

NS_PER_S = 1_000_000_000
PERCENT = 100.0
BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
BYTE_UNIT_STEP = 1024
IN_FLIGHT_SHOWN = 6
"""Requests in flight listed per worker in the text and live views."""
JSON_INDENT = 2

VIEW_AUTO = "auto"
VIEWS = (VIEW_AUTO, VIEW_SERVING, VIEW_RINGS)
PROBE_TIMEOUT_S = 2.0
"""How long the start waits for the daemon's first status reply before it shows the rings, seconds."""

KIND_NAMES = {KIND_TOKEN: "TOKEN", KIND_FINISH: "FINISH", KIND_ERROR: "ERROR", KIND_PROMPT_LOGPROBS: "PROMPT_LOGPROBS"}
FINISH_REASONS = list(P.FinishReason)
"""A FINISH record's ``flags`` are the index of its reason in this list."""
UNKNOWN_REASON = "unknown"


def ring_name(instance: str, index: int) -> str:
    """Segment name of worker ``index``'s ring of daemon instance ``instance``."""
    return RING_NAME_FORMAT.format(instance=instance, index=index)


def ring_prefix(instance: str) -> str:
    """What every ring name of ``instance`` starts with (before the index)."""
    return RING_NAME_FORMAT.format(instance=instance, index="")


def discover(instance: str) -> list[tuple[int, str]]:
    """List the rings of ``instance`` as ``(worker index, segment name)``,
    ordered by index, by scanning ``/dev/shm``.

    Raises:
        ValueError: ``instance`` cannot be part of a segment name.
        OSError: ``/dev/shm`` cannot be listed.
    """
    validate_name(ring_name(instance, 0))
    pattern = re.compile(re.escape(ring_prefix(instance)) + WORKER_INDEX_PATTERN)
    found = []
    for entry in os.listdir(SHM_DIR):
        match = pattern.fullmatch(entry)
        if match is not None:
            found.append((int(match.group(1)), entry))
    return sorted(found)


def pid_alive(pid: int) -> bool:
    """True if process ``pid`` exists (a zombie or another user's process
    counts); False for ``pid <= 0``, which names no process."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True


def decode_record(record: Record) -> dict[str, Any]:
    """A record as a JSON-ready dict.

    Keys: ``kind`` (``TOKEN``, ``FINISH``, ``ERROR``), ``handle``, ``seq``,
    ``token_id``, ``flags``, and by kind: ``text`` (the UTF-8 text delta,
    undecodable bytes replaced); ``finish_reason``, ``stop_reason``,
    ``prompt_tokens``, ``completion_tokens``; ``code``, ``message``.  A
    FINISH or ERROR payload that does not decode gets ``payload_error``
    (and for FINISH the reason its ``flags`` name).
    """
    out: dict[str, Any] = {
        "kind": KIND_NAMES.get(record.kind, str(record.kind)),
        "handle": record.handle,
        "seq": record.seq,
        "token_id": record.token_id,
        "flags": record.flags,
    }
    if record.kind == KIND_TOKEN and record.flags & P.FLAG_LOGPROBS:
        try:
            token = P.TOKEN_PAYLOAD_DECODER.decode(record.payload)
        except msgspec.DecodeError as exc:
            out["payload_error"] = str(exc)
        else:
            out["text"], out["logprob"] = token.text, token.logprob
    elif record.kind == KIND_TOKEN:
        out["text"] = record.payload.decode("utf-8", errors="replace")
    elif record.kind == KIND_FINISH:
        try:
            finish = P.FINISH_DECODER.decode(record.payload)
        except msgspec.DecodeError as exc:
            out["finish_reason"] = _reason_from_flags(record.flags)
            out["payload_error"] = str(exc)
        else:
            out["finish_reason"] = str(finish.finish_reason)
            out["stop_reason"] = finish.stop_reason
            out["prompt_tokens"] = finish.prompt_tokens
            out["completion_tokens"] = finish.completion_tokens
    elif record.kind == KIND_ERROR:
        try:
            error = P.WORKER_ERROR_DECODER.decode(record.payload)
        except msgspec.DecodeError as exc:
            out["code"] = UNKNOWN_REASON
            out["payload_error"] = str(exc)
        else:
            out["code"] = str(error.code)
            out["message"] = error.message
    return out


def _reason_from_flags(flags: int) -> str:
    if flags < len(FINISH_REASONS):
        return str(FINISH_REASONS[flags])
    return UNKNOWN_REASON


@dataclass
class InFlight:
    """A request seen streaming tokens and not seen ending."""

    last_seq: int
    tokens_seen: int = 1


@dataclass
class RingWatch:
    """Follows one worker's ring and accumulates what the records say.

    Create with :meth:`open`.  Call :meth:`poll` often (every few
    milliseconds while the worker streams) so the worker does not lap the
    observer; :meth:`snapshot` reports and starts a new rate window.
    """

    index: int
    name: str
    observer: RingObserver
    identity: tuple[int, int]
    recent: deque[Record]
    cursor: int | None = None
    in_flight: dict[int, InFlight] = field(default_factory=dict)
    finish_reasons: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    records_seen: int = 0
    laps: int = 0
    error: str | None = None
    window_start_s: float = 0.0
    window_start_pos: int = 0
    window_records: int = 0

    @classmethod
    def open(cls, index: int, name: str, keep_recent: int = 0) -> RingWatch:
        """Map ring ``name`` read-only and read what is pending in it.

        Args:
            index: the worker index in the name.
            name: segment name under ``/dev/shm``.
            keep_recent: how many of the latest records to keep for
                :meth:`snapshot` (0: none).

        Raises:
            RingError: the segment is missing, unreadable or not a ring.
            OSError: the segment cannot be inspected.
        """
        path = os.path.join(SHM_DIR, name)
        st = os.stat(path, follow_symlinks=False)
        observer = RingObserver.attach(name)
        watch = cls(index, name, observer, (st.st_dev, st.st_ino), deque(maxlen=keep_recent))
        watch.poll()
        watch.start_window()
        return watch

    def start_window(self) -> None:
        """Start measuring rates from now."""
        self.window_start_s = time.monotonic()
        self.window_start_pos = self.observer.header()["write_pos"]
        self.window_records = 0

    def poll(self) -> int:
        """Follow the ring once; return how many records were new.

        A ring whose records cannot be parsed sets :attr:`error` (kept until
        the program ends) and is followed again from its ``read_pos`` next
        time.
        """
        try:
            records, self.cursor, lapped = self.observer.follow(self.cursor)
        except (RingError, ValueError) as exc:
            # Bytes that are not records, or a write_pos that went backwards:
            # the ring is corrupt; report it and start over from read_pos.
            self.error = str(exc)
            self.cursor = None
            return 0
        if lapped:
            self.laps += 1
            # Endings may have been missed: rebuild the set from new tokens.
            self.in_flight.clear()
        for record in records:
            self._account(record)
        self.recent.extend(records)
        self.records_seen += len(records)
        self.window_records += len(records)
        return len(records)

    def _account(self, record: Record) -> None:
        if record.kind == KIND_TOKEN:
            request = self.in_flight.get(record.handle)
            if request is None:
                self.in_flight[record.handle] = InFlight(record.seq)
            else:
                request.last_seq = record.seq
                request.tokens_seen += 1
        elif record.kind == KIND_FINISH:
            self.in_flight.pop(record.handle, None)
            self.finish_reasons[decode_record(record)["finish_reason"]] += 1
        elif record.kind == KIND_ERROR:
            self.in_flight.pop(record.handle, None)
            self.errors[decode_record(record)["code"]] += 1

    def snapshot(self, with_recent: bool = False) -> dict[str, Any]:
        """Report the ring and start a new rate window.

        Returns a JSON-ready dict: ``worker``, ``name``, ``path``, the header
        (``version``, ``capacity`` in bytes, ``owner_pid``, ``owner_alive``,
        ``producer_pid`` (0: none attached), ``producer_alive``,
        ``created_ns``, ``created`` (ISO 8601), ``instance_id``), the
        positions ``write_pos``, ``read_pos`` and ``pending_bytes`` (bytes),
        ``fill_percent``, ``consumer_waiting``, ``producer_waiting``
        (booleans), ``records_per_s`` and ``bytes_per_s`` over the last
        ``window_s`` seconds (since the previous snapshot, or since the ring
        was attached), ``records_seen`` and ``laps`` since it was attached,
        ``in_flight`` (``handle``, ``last_seq``, ``tokens_seen``, by handle),
        ``finish_reasons`` and ``errors`` (counts by reason or error code),
        ``error`` (the last parse error or None) and, if ``with_recent``,
        ``recent`` (the kept records, decoded, oldest first).
        """
        now = time.monotonic()
        header = self.observer.header()
        elapsed = now - self.window_start_s
        written = header["write_pos"] - self.window_start_pos
        created_ns = header["created_ns"]
        out: dict[str, Any] = {
            "worker": self.index,
            "name": self.name,
            "path": self.observer.path,
            "version": header["version"],
            "capacity": header["capacity"],
            "owner_pid": header["owner_pid"],
            "owner_alive": pid_alive(header["owner_pid"]),
            "producer_pid": header["producer_pid"],
            "producer_alive": pid_alive(header["producer_pid"]),
            "created_ns": created_ns,
            "created": datetime.fromtimestamp(created_ns / NS_PER_S).astimezone().isoformat(
                timespec="seconds"
            ),
            "instance_id": header["instance_id"],
            "write_pos": header["write_pos"],
            "read_pos": header["read_pos"],
            "pending_bytes": header["pending_bytes"],
            "fill_percent": round(header["fill"] * PERCENT, 3),
            "consumer_waiting": bool(header["consumer_waiting"]),
            "producer_waiting": bool(header["producer_waiting"]),
            "records_per_s": self.window_records / elapsed if elapsed > 0 else 0.0,
            "bytes_per_s": written / elapsed if elapsed > 0 else 0.0,
            "window_s": elapsed,
            "records_seen": self.records_seen,
            "laps": self.laps,
            "in_flight": [
                {"handle": handle, "last_seq": request.last_seq, "tokens_seen": request.tokens_seen}
                for handle, request in sorted(self.in_flight.items())
            ],
            "finish_reasons": dict(sorted(self.finish_reasons.items())),
            "errors": dict(sorted(self.errors.items())),
            "error": self.error,
        }
        if with_recent:
            out["recent"] = [decode_record(record) for record in self.recent]
        self.window_start_s = now
        self.window_start_pos = header["write_pos"]
        self.window_records = 0
        return out

    def close(self) -> None:
        """Unmap the ring (the segment itself is never touched)."""
        self.observer.close()


class Monitor:
    """Every ring of one instance, kept in step with ``/dev/shm``.

    Args:
        instance: the daemon instance name.
        keep_recent: records to keep per ring for dumps (0: none).

    Raises:
        ValueError: ``instance`` cannot be part of a segment name.
    """

    def __init__(self, instance: str, keep_recent: int = 0) -> None:
        validate_name(ring_name(instance, 0))
        self.instance = instance
        self.keep_recent = keep_recent
        self.watches: dict[str, RingWatch] = {}
        self.unreadable: dict[str, str] = {}

    def refresh(self) -> None:
        """Attach rings that appeared (or were recreated under the same
        name) and drop rings that were removed.

        Raises:
            OSError: ``/dev/shm`` cannot be listed.
        """
        present = {name: index for index, name in discover(self.instance)}
        for name in list(self.watches):
            if name not in present or self._replaced(name):
                self.watches.pop(name).close()
        self.unreadable = {name: error for name, error in self.unreadable.items() if name in present}
        for name, index in present.items():
            if name in self.watches:
                continue
            try:
                self.watches[name] = RingWatch.open(index, name, self.keep_recent)
            except (RingError, OSError) as exc:
                if os.path.lexists(os.path.join(SHM_DIR, name)):
                    self.unreadable[name] = str(exc)
                else:
                    self.unreadable.pop(name, None)
            else:
                self.unreadable.pop(name, None)

    def _replaced(self, name: str) -> bool:
        try:
            st = os.stat(os.path.join(SHM_DIR, name), follow_symlinks=False)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self.watches[name].identity

    def poll(self) -> int:
        """Follow every ring once; return how many records were new."""
        return sum(watch.poll() for watch in self.watches.values())

    def sample(self, duration_s: float, until_each_saw: int | None = None) -> float:
        """Follow every ring every :data:`POLL_PERIOD_S` for ``duration_s``
        seconds, or until each ring has seen ``until_each_saw`` records.

        Returns the seconds spent.
        """
        started = time.monotonic()
        deadline = started + duration_s
        while True:
            self.poll()
            now = time.monotonic()
            if until_each_saw is not None and all(
                watch.records_seen >= until_each_saw for watch in self.watches.values()
            ):
                break
            if now >= deadline:
                break
            time.sleep(min(POLL_PERIOD_S, deadline - now))
        return time.monotonic() - started

    def report(self, interval_s: float, with_recent: bool = False) -> dict[str, Any]:
        """One JSON-ready document: ``instance``, ``time`` (seconds since the
        epoch), ``interval_s`` (the sampling time), ``rings`` (one
        :meth:`RingWatch.snapshot` per ring, by worker index) and
        ``unreadable`` (``name`` and ``error`` of rings that could not be
        mapped)."""
        watches = sorted(self.watches.values(), key=lambda watch: watch.index)
        return {
            "instance": self.instance,
            "time": time.time(),
            "interval_s": interval_s,
            "rings": [watch.snapshot(with_recent) for watch in watches],
            "unreadable": [
                {"name": name, "error": error} for name, error in sorted(self.unreadable.items())
            ],
        }

    def close(self) -> None:
        """Unmap every ring."""
        for watch in self.watches.values():
            watch.close()
        self.watches.clear()


# ------------------------------------------------------------------ output


def format_bytes(count: float) -> str:
    """``count`` bytes in binary units, e.g. ``4.0 MiB``."""
    value = float(count)
    for unit in BYTE_UNITS[:-1]:
        if abs(value) < BYTE_UNIT_STEP:
            return f"{value:.0f} {unit}" if unit == BYTE_UNITS[0] else f"{value:.1f} {unit}"
        value /= BYTE_UNIT_STEP
    return f"{value:.1f} {BYTE_UNITS[-1]}"


def _pid_text(pid: int, alive: bool) -> str:
    if pid <= 0:
        return "none"
    return f"{pid} ({'alive' if alive else 'dead'})"


def _in_flight_text(ring: dict[str, Any]) -> str:
    requests = ring["in_flight"]
    if not requests:
        return "0"
    listed = ", ".join(
        f"handle {request['handle']} seq {request['last_seq']}"
        for request in requests[:IN_FLIGHT_SHOWN]
    )
    more = len(requests) - IN_FLIGHT_SHOWN
    return f"{len(requests)}: {listed}" + (f", and {more} more" if more > 0 else "")


def _counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{key} {value}" for key, value in counts.items()) or "none"


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def format_summary(document: dict[str, Any]) -> str:
    """The human-readable summary of a :meth:`Monitor.report` document."""
    rings = document["rings"]
    lines = [
        f"{PROG}: instance {document['instance']}, {len(rings)} ring(s), "
        f"sampled for {document['interval_s']:.2f} s"
    ]
    for ring in rings:
        lines += [
            "",
            f"worker {ring['worker']}  {ring['path']}  (layout v{ring['version']}, "
            f"capacity {format_bytes(ring['capacity'])}, instance id {ring['instance_id']:#x})",
            f"  owner pid {_pid_text(ring['owner_pid'], ring['owner_alive'])}, "
            f"producer pid {_pid_text(ring['producer_pid'], ring['producer_alive'])}, "
            f"created {ring['created']}",
            f"  write_pos {ring['write_pos']}, read_pos {ring['read_pos']}, "
            f"pending {format_bytes(ring['pending_bytes'])}, fill {ring['fill_percent']:.1f}%",
            f"  waiting: consumer {_yes_no(ring['consumer_waiting'])}, "
            f"producer {_yes_no(ring['producer_waiting'])}",
            f"  {ring['records_per_s']:.1f} records/s, {format_bytes(ring['bytes_per_s'])}/s; "
            f"{ring['records_seen']} records seen, lapped {ring['laps']} time(s)",
            f"  in flight {_in_flight_text(ring)}",
            f"  finished: {_counts_text(ring['finish_reasons'])}; "
            f"errors: {_counts_text(ring['errors'])}",
        ]
        if ring["error"]:
            lines.append(f"  unreadable records: {ring['error']}")
    for entry in document["unreadable"]:
        lines += ["", f"{entry['name']}: cannot read: {entry['error']}"]
    return "\n".join(lines)


def _record_line(record: dict[str, Any]) -> str:
    head = (
        f"  {record['kind']:<6} handle {record['handle']:<6} seq {record['seq']:<6} "
        f"token {record['token_id']:<6}"
    )
    if record["kind"] == "TOKEN":
        return f"{head} {record['text']!r}"
    if record["kind"] == "FINISH":
        detail = f"reason {record['finish_reason']}"
        if record.get("stop_reason") is not None:
            detail += f" (stop {record['stop_reason']!r})"
        if "completion_tokens" in record:
            detail += (
                f", {record['prompt_tokens']} prompt + "
                f"{record['completion_tokens']} completion tokens"
            )
        return f"{head} {detail}"
    if record["kind"] == "ERROR":
        return f"{head} {record['code']}: {record.get('message', '')}"
    return head


def format_dump(document: dict[str, Any]) -> str:
    """The decoded records of a :meth:`Monitor.report` document made with
    ``with_recent=True``, one line each, oldest first, per worker."""
    lines = []
    for ring in document["rings"]:
        recent = ring["recent"]
        lines.append(
            f"worker {ring['worker']} ({ring['name']}): last {len(recent)} record(s) "
            f"of {ring['records_seen']} seen"
        )
        lines += [_record_line(record) for record in recent]
    for entry in document["unreadable"]:
        lines.append(f"{entry['name']}: cannot read: {entry['error']}")
    return "\n".join(lines)


def render_live(document: dict[str, Any], refresh_s: float, keys_help: str = "Ctrl-C to quit") -> Group:
    """The live ring view of a :meth:`Monitor.report` document: a title line
    and one table row per worker; ``refresh_s`` is the refresh period shown
    in the title, in seconds, ``keys_help`` the keys it names."""
    clock = datetime.fromtimestamp(document["time"]).strftime("%H:%M:%S")
    title = Text(
        f"{PROG}  instance {document['instance']}  {clock}  "
        f"every {refresh_s:g} s  ({keys_help})",
        style="bold",
    )
    table = Table(expand=True)
    for column, justify in (
        ("worker", "right"),
        ("owner / producer pid", "left"),
        ("created", "left"),
        ("write_pos", "right"),
        ("read_pos", "right"),
        ("fill", "right"),
        ("records/s", "right"),
        ("bytes/s", "right"),
        ("waiting", "left"),
        ("in flight (handle seq)", "left"),
        ("finished", "left"),
        ("laps", "right"),
    ):
        table.add_column(column, justify=justify)
    for ring in document["rings"]:
        waiting = [side for side in ("consumer", "producer") if ring[f"{side}_waiting"]]
        table.add_row(
            str(ring["worker"]),
            f"{_pid_text(ring['owner_pid'], ring['owner_alive'])} / "
            f"{_pid_text(ring['producer_pid'], ring['producer_alive'])}",
            ring["created"],
            str(ring["write_pos"]),
            str(ring["read_pos"]),
            f"{ring['fill_percent']:.1f}%",
            f"{ring['records_per_s']:.0f}",
            format_bytes(ring["bytes_per_s"]),
            ", ".join(waiting) or "-",
            _in_flight_text(ring),
            _counts_text(ring["finish_reasons"]),
            str(ring["laps"]),
        )
    parts: list[Any] = [title, table]
    if not document["rings"]:
        parts.append(Text(f"no rings of instance {document['instance']} in {SHM_DIR}"))
    for entry in document["unreadable"]:
        parts.append(Text(f"{entry['name']}: cannot read: {entry['error']}", style="red"))
    return Group(*parts)


# ------------------------------------------------------------------ command line


def _interval(text: str) -> float:
    value = float(text)
    if not MIN_INTERVAL_S <= value <= MAX_INTERVAL_S:
        raise argparse.ArgumentTypeError(
            f"must be between {MIN_INTERVAL_S} and {MAX_INTERVAL_S:.0f} seconds"
        )
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``ringstream-top``."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Watch a ringstream instance: what it serves (from its status) and its "
        "shared-memory token rings (read-only).",
    )
    parser.add_argument(
        "--instance", help=f"daemon instance name (default: {DEFAULT_INSTANCE})"
    )
    parser.add_argument(
        "--socket", metavar="ADDR",
        help="the daemon's address, ipc://PATH or tcp://HOST:PORT (default: the instance's, "
        "else the clients' default)",
    )
    parser.add_argument(
        "--view", choices=VIEWS, default=VIEW_AUTO,
        help="serving: the daemon's requests and workers; rings: the token rings; auto: serving "
        "when the daemon answers in the live view, else rings (default: %(default)s)",
    )
    parser.add_argument("--once", action="store_true", help="print one summary and exit")
    parser.add_argument("--json", action="store_true", help="print one JSON document and exit")
    parser.add_argument(
        "--dump", type=_positive, metavar="N", help="print the last N records seen per worker"
    )
    parser.add_argument(
        "--interval",
        type=_interval,
        default=DEFAULT_INTERVAL_S,
        metavar="S",
        help="sampling time and live refresh period in seconds (default: %(default)s)",
    )
    return parser


def _no_rings(monitor: Monitor) -> int:
    for name, error in sorted(monitor.unreadable.items()):
        print(f"{PROG}: {name}: cannot read: {error}", file=sys.stderr)
    print(
        f"{PROG}: no readable ring of instance {monitor.instance!r} "
        f"({os.path.join(SHM_DIR, ring_prefix(monitor.instance))}*); "
        "is the daemon running?",
        file=sys.stderr,
    )
    return EXIT_NO_RINGS


def _one_shot(monitor: Monitor, args: argparse.Namespace) -> int:
    elapsed = monitor.sample(args.interval, until_each_saw=args.dump)
    document = monitor.report(elapsed, with_recent=args.dump is not None)
    if args.json:
        text = json.dumps(document, indent=JSON_INDENT)
    elif args.dump is not None:
        text = format_dump(document)
    else:
        text = format_summary(document)
    print(text, flush=True)
    return EXIT_OK


def _serving_once(poller: StatusPoller, args: argparse.Namespace) -> int:
    reply = poller.reply
    if args.json:
        print(json.dumps(P.to_dict(reply), indent=JSON_INDENT), flush=True)
        return EXIT_OK
    console = Console()
    console.print(render_serving(reply, width=console.width, clock=time.time(), address=poller.address,
                                 refresh_s=args.interval))
    return EXIT_OK


def _follow(monitor: Monitor, keys: KeyReader, duration_s: float) -> tuple[float, str]:
    """Follow the rings for ``duration_s`` seconds or until a key is typed; (seconds spent, keys typed)."""
    started = time.monotonic()
    deadline = started + duration_s
    while True:
        monitor.poll()
        now = time.monotonic()
        if now >= deadline:
            return now - started, ""
        typed = keys.read(min(POLL_PERIOD_S, deadline - now))
        if typed:
            return time.monotonic() - started, typed


def _live(monitor: Monitor, poller: StatusPoller, view: str, interval_s: float) -> int:
    console = Console()
    with KeyReader() as keys, Live(console=console, screen=True, auto_refresh=False) as live:
        while True:
            if view == VIEW_SERVING:
                poller.poll()
                width, height = console.size
                live.update(render_serving(poller.reply, width=width, height=height, clock=time.time(),
                                           address=poller.address, refresh_s=interval_s,
                                           error=poller.error, keys_help=KEYS_HELP), refresh=True)
                typed = keys.read(interval_s)
            else:
                monitor.refresh()
                live.update(render_live(monitor.report(0.0), interval_s, KEYS_HELP), refresh=True)
                elapsed, typed = _follow(monitor, keys, interval_s)
                while not typed:
                    monitor.refresh()
                    live.update(render_live(monitor.report(elapsed), interval_s, KEYS_HELP), refresh=True)
                    elapsed, typed = _follow(monitor, keys, interval_s)
            next_view = handle_keys(view, typed)
            if next_view is None:
                return EXIT_OK
            view = next_view


def _address(args: argparse.Namespace) -> str:
    """The daemon's address the options name (ValueError for a malformed one)."""
    if args.socket:
        return check_address(args.socket, "--socket")
    if args.instance is not None:
        return default_socket(args.instance)
    return client_socket()


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does
    not fail again after the reader closed the pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    """Run ``ringstream-top``; returns the exit status (see the module
    docstring)."""
    args = build_parser().parse_args(argv)
    try:
        monitor = Monitor(args.instance or DEFAULT_INSTANCE, keep_recent=args.dump or 0)
    except ValueError as exc:
        print(f"{PROG}: invalid instance name: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        poller = StatusPoller(_address(args), timeout_s=PROBE_TIMEOUT_S)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    one_shot = args.once or args.json or args.dump is not None or not sys.stdout.isatty()
    view = args.view
    try:
        if view == VIEW_SERVING or (view == VIEW_AUTO and not one_shot):
            if poller.poll() is not None:
                view = VIEW_SERVING
            elif view == VIEW_SERVING:
                print(f"{PROG}: {poller.error}", file=sys.stderr)
                return EXIT_NO_RINGS
        if view == VIEW_SERVING:
            return _serving_once(poller, args) if one_shot else _live(monitor, poller, view, args.interval)
        monitor.refresh()
        if not monitor.watches:
            return _no_rings(monitor)
        if one_shot:
            return _one_shot(monitor, args)
        return _live(monitor, poller, VIEW_RINGS, args.interval)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED if one_shot else EXIT_OK
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_OK
    except OSError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_NO_RINGS
    finally:
        poller.close()
        monitor.close()


if __name__ == "__main__":
    sys.exit(main())
