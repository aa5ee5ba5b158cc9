"""Fake ports for the front's core: what it sends is recorded, its timers fire when the test moves the clock."""

from __future__ import annotations

import heapq
import itertools

from ringstream.daemon.common.config import Config
from ringstream.daemon.front.core import FrontCore
from ringstream.ipc import protocol as P

CLIENT = b"app-1"


class FakeTimer:
    def __init__(self, ports: FakePorts, due: float, callback, args) -> None:
        self.ports, self.due, self.callback, self.args, self.cancelled = ports, due, callback, args, False

    def cancel(self) -> None:
        self.cancelled = True


class FakePorts:
    """Records what the core sends; ``advance(dt)`` moves the clock and fires the timers that fall due."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sent: list[tuple[bytes, object]] = []
        self.commands: list[tuple[int, object]] = []
        self.send_results: dict[bytes, str] = {}
        self._timers: list[tuple[float, int, FakeTimer]] = []
        self._order = itertools.count()
        self.milestones: list[str] = []

    def clock(self) -> float:
        return self.now

    def send(self, identity: bytes, msg) -> str:
        result = self.send_results.get(identity, "sent")
        if result == "sent":
            self.sent.append((identity, msg))
        return result

    def send_worker(self, index: int, command) -> None:
        self.commands.append((index, command))

    def call_later(self, delay_s: float, callback, *args) -> FakeTimer:
        timer = FakeTimer(self, self.now + delay_s, callback, args)
        heapq.heappush(self._timers, (timer.due, next(self._order), timer))
        return timer

    def advance(self, seconds: float) -> None:
        end = self.now + seconds
        while self._timers and self._timers[0][0] <= end:
            due, _, timer = heapq.heappop(self._timers)
            self.now = max(self.now, due)
            if not timer.cancelled:
                timer.callback(*timer.args)
        self.now = end

    def poll_connections(self) -> None:
        self.milestones.append("poll")

    def ready(self) -> None:
        self.milestones.append("ready")

    def stopping(self) -> None:
        self.milestones.append("stopping")

    def stopped(self) -> None:
        self.milestones.append("stopped")

    # ---- views

    def to_client(self, identity: bytes = CLIENT) -> list:
        return [msg for who, msg in self.sent if who == identity]

    def take_commands(self) -> list[tuple[int, object]]:
        commands, self.commands = self.commands, []
        return commands


def make_core(num_workers: int = 1, **settings) -> tuple[FrontCore, FakePorts]:
    config = Config(**{"drain_timeout_s": 5.0, "timeout_s": 60.0, **settings})
    ports = FakePorts()
    return FrontCore(config, ports, num_workers, clock=ports.clock), ports


def worker_ready(core: FrontCore, index: int = 0, max_num_seqs: int = 4, kv_cache_tokens: int = 4096) -> None:
    core.on_worker_ready(P.WorkerReady(worker=index, pid=100 + index, device="cpu", capacity=P.WorkerCapacity(
        max_num_seqs=max_num_seqs, max_model_len=1024, kv_cache_tokens=kv_cache_tokens, kv_cache_bytes=1 << 20,
        block_size=16)))


