"""KV-cache events: what enters and leaves a worker's prefix cache, published on ZeroMQ in vLLM's format.

KV-aware routers (vllm-router ``--policy kv_aware``, llm-d's precise prefix-cache scorer, NVIDIA Dynamo's KV
router) keep an index of which server holds which prompt prefix from these events, and send a request to the
server that has most of its prefix cached. Each worker publishes its own events, as each data-parallel rank of
vLLM does: worker ``i`` binds the configured endpoint's port + ``i``
(:func:`ringstream.daemon.common.listen.offset_endpoint`), and its batches
carry ``data_parallel_rank = i``.

Wire format (vLLM ``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``), checked by decoding with vLLM's own
structs:

- a PUB socket (an XPUB: it hears subscriptions) sends multipart messages ``(topic, seq, payload)``:
  ``topic`` the configured bytes (empty by default), ``seq`` an 8-byte big-endian counter, +1 a batch, from
  the microseconds since the epoch at the publisher's start (vLLM's starts at 0; this one keeps increasing
  across a worker's restarts), ``payload`` one msgpack ``KVEventBatch``
  (an array ``[ts, events, data_parallel_rank]``; each event a map tagged by its ``type``: ``BlockStored``,
  ``BlockRemoved``, ``AllBlocksCleared``);
- an optional ROUTER replay socket answers a request ``(b"", start_seq)`` (8-byte big-endian) with every
  buffered ``(seq, payload)`` from ``start_seq`` on, then ``(-1, b"")``.

Block hashes are the engine's chained SHA-256 prefix keys (:mod:`ringstream.daemon.common.prefix_hash`) as the
unsigned 64-bit integer of their last 8 bytes, as vLLM sends its own (``maybe_convert_block_hash`` with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, its default). Consumers hash a request's tokens with their own scheme
and match it against the ``token_ids`` of stored blocks; the hashes name blocks in later removals. ``medium``
is ``GPU``: vLLM's name for the engine's own KV pool on every device (its CPU build says ``GPU`` too).

The engine loop never waits on a subscriber: :meth:`KVEventPublisher.publish` appends the step's events to a
bounded queue and returns; a thread encodes and sends them. ZeroMQ's PUB drops messages to a subscriber past
its high-water mark (a slow subscriber loses messages, and may ask the replay socket for them). When the queue
itself is full (the thread starved), the batches that do not fit are dropped and the next batch queued starts
with ``AllBlocksCleared``: a subscriber then knows less than the cache holds, never more. The first batch of
every publisher is an ``AllBlocksCleared`` too, so a subscriber that followed a previous worker on the same
endpoint (before a restart) forgets its blocks; batches wait up to ``FIRST_SUBSCRIBER_WAIT_S`` for a first
subscription, so that a subscriber reconnecting to a restarted worker receives that clear. A replay request is
served one a turn between live batches.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from itertools import count

import msgspec
import zmq

from ringstream.daemon.engine.block_manager import BlocksCleared, BlocksRemoved, BlocksStored
from ringstream.daemon.worker.spec import KVEventsSpec

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "KVEventPublisher",
    "MEDIUM",
    "END_SEQ",
    "external_block_hash",
]

log = logging.getLogger("ringstream.worker")

MEDIUM = "GPU"
"""The ``medium`` of every event: vLLM's name for the engine's own KV pool (``MEDIUM_GPU``), on any device."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence number that ends a replay answer (vLLM's ``ZmqEventPublisher.END_SEQ``)."""
MAX_QUEUED_BATCHES = 10_000
"""Batches (engine steps with cache changes) waiting for the publisher thread at most."""
REPLAY_BUFFER_BATCHES = 10_000
"""Batches kept for replay (vLLM's ``buffer_steps`` default)."""
SEND_HWM = 100_000
"""ZeroMQ send high-water mark of the PUB socket, messages per subscriber (vLLM's ``hwm`` default)."""
IDLE_WAKE_S = 0.1
"""The publisher thread checks the replay socket at least this often, seconds."""
SUBSCRIBER_POLL_S = 0.01
"""While no subscriber has joined, the thread looks for one this often, seconds."""
FIRST_SUBSCRIBER_WAIT_S = 5.0
"""Batches wait this long after the start for a first subscriber (a router reconnecting to a restarted
worker), so that it receives the opening clear; past it they go out to whoever listens."""
MAX_REPLAY_REQUEST_BYTES = 64
"""Largest frame the replay socket accepts (a request is 8 bytes); a peer sending more is disconnected."""
CLOSE_FLUSH_S = 1.0
"""On close, queued batches get this long to go out."""


class _Event(msgspec.Struct, tag=True, gc=False):
    """Base of the tagged events (vLLM's ``KVCacheEvent``: each encodes as a map with ``type`` = class name).

    Every field is encoded, defaults included: vLLM's structs declare ``lora_id``, ``medium`` and ``lora_name``
    without defaults, so its decoder needs them present."""


class BlockStored(_Event):
    """Consecutive full blocks of one sequence entered the cache. Field order and names are vLLM's."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    """``block_size`` token ids per block, in order."""
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM
    lora_name: str | None = None


class BlockRemoved(_Event):
    """Cached blocks were evicted."""

    block_hashes: list[int]
    medium: str | None = MEDIUM


class AllBlocksCleared(_Event):
    """Every cached block is gone (a reset, or events lost: see the module docstring)."""


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    """One engine step's events (vLLM's ``KVEventBatch``)."""

    ts: float
    """Wall-clock time of the step, seconds since the epoch."""
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()


def external_block_hash(key: bytes) -> int:
    """A prefix key as the unsigned 64-bit integer consumers index (its last 8 bytes, big-endian; vLLM's
    ``maybe_convert_block_hash``)."""
    return int.from_bytes(key[-8:], "big")


class KVEventPublisher:
    """Publishes a worker's prefix-cache events; see the module docstring.

    Binds its sockets in the constructor (on the caller's thread, so that an address in use fails the
    worker's start with a clear message), then hands them to its thread.

    Args:
        spec: endpoints, topic, rank and block size.
        ctx: the worker's ZeroMQ context.

    Raises:
        zmq.ZMQError: an endpoint cannot be bound (in use, bad host).
    """

    def __init__(self, spec: KVEventsSpec, ctx: zmq.Context) -> None:
        self.spec = spec
        self._topic = spec.topic.encode()
        # XPUB: a PUB that also hears subscriptions, so that the first batch waits for the first subscriber
        # (ZeroMQ drops what a PUB sends before a subscription arrives: the slow joiner).
        self._pub = ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            if _is_ipv6(spec.endpoint):
                self._pub.setsockopt(zmq.IPV6, 1)
            self._pub.bind(spec.endpoint)
            if spec.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.SNDHWM, REPLAY_BUFFER_BATCHES + 2)  # a whole answer, END included
                self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_REPLAY_REQUEST_BYTES)
                if _is_ipv6(spec.replay_endpoint):
                    self._replay.setsockopt(zmq.IPV6, 1)
                self._replay.bind(spec.replay_endpoint)
        except zmq.ZMQError:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()
            raise
        self._queue: deque[tuple[float, list]] = deque()
        self._wake = threading.Event()
        self._running = True
        self._dropping = False
        """The queue was full for the last batch (engine thread only): the next one queued starts with a clear."""
        self.dropped = 0
        """Batches dropped in all (counter; engine thread only)."""
        self._malformed = 0
        # Sequence numbers start at the microseconds since the epoch, not 0, so that they keep increasing
        # across a worker's restarts: a subscriber that checks for gaps sees one (and may replay it), never a
        # sequence going back that it would take for old news.
        self._seq = count(time.time_ns() // 1000)
        self._subscribed = False
        self._hold_until = time.monotonic() + FIRST_SUBSCRIBER_WAIT_S
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BUFFER_BATCHES)
        self._queue.append((time.time(), [BlocksCleared()]))
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list) -> None:
        """Queue one step's events (the block manager's, oldest first) and return at once. Called from the
        engine's thread only."""
        if len(self._queue) >= MAX_QUEUED_BATCHES:
            self.dropped += 1
            if not self._dropping:
                self._dropping = True
                log.warning("KV events: the publisher queue is full; dropping batches (the next one sent tells "
                            "subscribers to clear)")
            return
        if self._dropping:  # the gap lies before this batch: its clear must follow every dropped batch
            self._dropping = False
            events = [BlocksCleared(), *events]
        self._queue.append((time.time(), events))
        self._wake.set()

    def close(self) -> None:
        """Send what is queued (for up to ``CLOSE_FLUSH_S``), stop the thread, close the sockets."""
        self._running = False
        self._wake.set()
        self._thread.join(2 * CLOSE_FLUSH_S + IDLE_WAKE_S)
        if self._thread.is_alive():  # cannot happen short of a hung send; the context's term must not hang
            log.warning("KV events: the publisher thread did not stop; closing its sockets under it")
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        deadline = None
        while True:
            if not self._running:
                deadline = deadline or time.monotonic() + CLOSE_FLUSH_S
                if not self._queue or time.monotonic() >= deadline:
                    return
            self._read_subscriptions()
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()  # one request a turn: replays never starve the live events
            if not self._queue or not self._may_send():
                self._wake.wait(IDLE_WAKE_S if self._subscribed else SUBSCRIBER_POLL_S)
                self._wake.clear()
                continue
            ts, events = self._queue.popleft()
            try:
                self._send(ts, events)
            except Exception:  # a bug here must not end the worker's events for good
                log.exception("KV events: a batch could not be published")

    def _may_send(self) -> bool:
        """Whether batches may go out: a subscriber has joined, or none did within ``FIRST_SUBSCRIBER_WAIT_S``
        of the start (or the publisher is closing)."""
        return self._subscribed or not self._running or time.monotonic() >= self._hold_until

    def _read_subscriptions(self) -> None:
        while self._pub.poll(0):
            frame = self._pub.recv()
            if frame[:1] == b"\x01":
                self._subscribed = True

    def _send(self, ts: float, events: list) -> None:
        wire = [self._to_wire(event) for event in events]
        seq = next(self._seq)
        payload = _ENCODER.encode(KVEventBatch(ts=ts, events=wire, data_parallel_rank=self.spec.rank))
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
        self._buffer.append((seq, payload))

    def _to_wire(self, event) -> _Event:
        if isinstance(event, BlocksStored):
            return BlockStored(
                block_hashes=[external_block_hash(key) for key in event.block_hashes],
                parent_block_hash=None if event.parent_block_hash is None
                else external_block_hash(event.parent_block_hash),
                token_ids=event.token_ids, block_size=self.spec.block_size)
        if isinstance(event, BlocksRemoved):
            return BlockRemoved(block_hashes=[external_block_hash(key) for key in event.block_hashes])
        return AllBlocksCleared()

    def _serve_replay(self) -> None:
        replay = self._replay
        frames = replay.recv_multipart()
        if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
            self._malformed += 1
            if self._malformed & (self._malformed - 1) == 0:  # the 1st, 2nd, 4th, 8th...: never a flood
                log.warning("KV events: a replay request of %d frames (%s) ignored (%d so far): send "
                            "(b'', start_seq) from a DEALER, start_seq 8 bytes big-endian", len(frames) - 1,
                            ", ".join(f"{len(f)} bytes" for f in frames[1:4]), self._malformed)
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big", signed=True)
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))


def _is_ipv6(endpoint: str) -> bool:
    """Whether a ``tcp://`` endpoint names an IPv6 address (``tcp://[::1]:5557``), which ZeroMQ binds only
    with its IPV6 option set."""
    return endpoint.startswith("tcp://[")
