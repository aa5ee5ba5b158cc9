"""Producer side of the two-process ring stress test, plus the doorbells.

Lives in an importable module so that a ``spawn``-started child can find
:func:`run_producer`.
"""

from __future__ import annotations

import os
import random
import select
import zlib

from ringstream.ipc.ring import KIND_FINISH, KIND_TOKEN, RingProducer

PAYLOAD_SEED = 20240601
PAYLOAD_POOL_SIZE = 4096
MAX_STRESS_PAYLOAD = 64
HANDLE_SHIFT = 10
FLAGS_MASK = 0xFFFF
_LENGTH_MULTIPLIER = 2654435761
_LENGTH_SHIFT = 7
_START_MULTIPLIER = 40503
_DRAIN_CHUNK = 4096
_MS_PER_S = 1000
_RING_BYTE = b"\x01"

_POOL = random.Random(PAYLOAD_SEED).randbytes(PAYLOAD_POOL_SIZE)


def payload_for(seq: int) -> bytes:
    """Deterministic pseudo-random payload of 0..MAX_STRESS_PAYLOAD bytes."""
    length = ((seq * _LENGTH_MULTIPLIER) >> _LENGTH_SHIFT) % (MAX_STRESS_PAYLOAD + 1)
    start = (seq * _START_MULTIPLIER) % (PAYLOAD_POOL_SIZE - MAX_STRESS_PAYLOAD)
    return _POOL[start : start + length]


class Doorbell:
    """A wake-up signal over a named pipe shared by two processes.

    Both sides open the FIFO read-write and non-blocking (Linux semantics),
    so opening never blocks and ringing never fails for lack of a reader.
    Rings coalesce: a full pipe already means "rung".
    """

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self._poller = select.poll()
        self._poller.register(self._fd, select.POLLIN)

    @staticmethod
    def make(path: str) -> None:
        """Create the FIFO at ``path``."""
        os.mkfifo(path, 0o600)

    def ring(self) -> None:
        """Wake the sleeper (or make its next wait return at once)."""
        try:
            os.write(self._fd, _RING_BYTE)
        except BlockingIOError:
            pass

    def wait(self, timeout_s: float) -> bool:
        """Sleep until rung; consume all pending rings.

        Returns False if ``timeout_s`` passed without a ring.
        """
        if not self._poller.poll(timeout_s * _MS_PER_S):
            return False
        while True:
            try:
                if len(os.read(self._fd, _DRAIN_CHUNK)) < _DRAIN_CHUNK:
                    return True
            except BlockingIOError:
                return True

    def close(self) -> None:
        """Close the FIFO descriptor."""
        os.close(self._fd)


def run_producer(
    name: str,
    instance_id: int,
    total: int,
    publish_every: int,
    data_bell_path: str,
    space_bell_path: str,
    wait_timeout_s: float,
) -> None:
    """Write records 0..total-1 (the last one FINISH) into ring ``name``.

    Publishes every ``publish_every`` records and, when the ring is full,
    sleeps on the space doorbell.  Raises TimeoutError if a wait exceeds
    ``wait_timeout_s`` (the parent then sees a non-zero exit code).
    """
    data_bell = Doorbell(data_bell_path)
    space_bell = Doorbell(space_bell_path)
    producer = RingProducer.attach(name, instance_id=instance_id)
    try:
        unpublished = 0
        last = total - 1
        for seq in range(total):
            payload = payload_for(seq)
            kind = KIND_FINISH if seq == last else KIND_TOKEN
            checksum = zlib.crc32(payload)
            handle = seq >> HANDLE_SHIFT
            flags = seq & FLAGS_MASK
            while not producer.try_write(kind, flags, handle, seq, checksum, payload):
                if producer.publish():
                    data_bell.ring()
                unpublished = 0
                if producer.arm_space(producer.record_size(len(payload))):
                    if not space_bell.wait(wait_timeout_s):
                        raise TimeoutError(
                            f"producer waited {wait_timeout_s} s for space at seq {seq}"
                        )
                producer.disarm_space()
            unpublished += 1
            if unpublished >= publish_every:
                if producer.publish():
                    data_bell.ring()
                unpublished = 0
        if producer.publish():
            data_bell.ring()
    finally:
        producer.close()
        data_bell.close()
        space_bell.close()
