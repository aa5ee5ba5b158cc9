"""Tests for ipc.ring, the shared-memory SPSC ring."""

from __future__ import annotations

import errno
import fcntl
import multiprocessing
import os
import struct
import subprocess
import sys
import threading
import time
import uuid
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringstream.ipc.ring import segment as ring_module
from ringstream.ipc.ring import (
    HEADER_SIZE,
    KIND_ERROR,
    KIND_FINISH,
    KIND_PAD,
    KIND_TOKEN,
    MAGIC,
    MAX_PAYLOAD,
    RECORD_HEADER_SIZE,
    Record,
    RingConsumer,
    RingError,
    RingExistsError,
    RingObserver,
    RingProducer,
    RingSpaceError,
    segment_path,
    validate_name,
)
from tests.ipc import ring_stress_child
from tests.ipc.ring_stress_child import Doorbell

REPO_ROOT = Path(__file__).resolve().parents[2]
NAME_PREFIX = "ringstream-test-"
SMALL_CAPACITY = 4096
SMALL_MAX_PAYLOAD = SMALL_CAPACITY - RECORD_HEADER_SIZE
OWNER_PID_OFFSET = 24
WRITE_POS_OFFSET = 64
READ_POS_OFFSET = 128
U64 = struct.Struct("<Q")
RECORD = struct.Struct("<IHHQII")
HUGE_CAPACITY = 2**50
INIT_PID = 1

STRESS_RECORDS = 1_000_000
STRESS_CAPACITY = 64 * 1024
STRESS_PUBLISH_EVERY = 64
STRESS_WAIT_TIMEOUT_S = 10.0
STRESS_DEADLINE_S = 60.0
STRESS_JOIN_TIMEOUT_S = 10.0
STRESS_KILL_TIMEOUT_S = 5.0
OBSERVED_RECORDS = 200_000
OBSERVED_TAIL = 16
OBSERVER_SWITCH_INTERVAL_S = 1e-5

PROPERTY_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture
def make_name() -> Iterator[Callable[[], str]]:
    """Hand out unique segment names; remove every such segment afterwards."""
    names: list[str] = []

    def make() -> str:
        name = f"{NAME_PREFIX}{uuid.uuid4().hex}"
        names.append(name)
        return name

    yield make
    for name in names:
        path = segment_path(name)
        if os.path.lexists(path):
            os.unlink(path)


@pytest.fixture
def pair(make_name: Callable[[], str]) -> Iterator[tuple[RingConsumer, RingProducer]]:
    consumer = RingConsumer.create(make_name(), SMALL_CAPACITY)
    producer = RingProducer.attach(consumer.name, instance_id=consumer.instance_id)
    try:
        yield consumer, producer
    finally:
        producer.close()
        consumer.close()
        consumer.unlink()


def read_segment(path: str) -> bytes:
    with open(path, "rb") as segment:
        return segment.read()


def record_size(payload_len: int) -> int:
    return RingProducer.record_size(payload_len)


def write_u64(path: str, offset: int, value: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, U64.pack(value), offset)
    finally:
        os.close(fd)


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


# -- names and creation ------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["", "a/b", "/abs", "x" * 201, ".", "..", ".hidden", "a\0b", "sp ace", "-dash"]
)
def test_bad_names_rejected(name: str) -> None:
    with pytest.raises(ValueError):
        validate_name(name)
    with pytest.raises(ValueError):
        RingConsumer.create(name, SMALL_CAPACITY)
    with pytest.raises(ValueError):
        RingProducer.attach(name)
    with pytest.raises(ValueError):
        RingObserver.attach(name)


def test_name_type_checked() -> None:
    with pytest.raises(TypeError):
        validate_name(b"ringstream")  # type: ignore[arg-type]


def test_good_names_and_path() -> None:
    validate_name("ringstream-3f2a9c-w0")
    validate_name("x" * 200)
    assert segment_path("ringstream-1-w0") == "/dev/shm/ringstream-1-w0"


@pytest.mark.parametrize("capacity", [0, 1, 2048, 4095, 4097, 6144, -4096])
def test_bad_capacity_rejected(make_name: Callable[[], str], capacity: int) -> None:
    name = make_name()
    with pytest.raises(ValueError):
        RingConsumer.create(name, capacity)
    assert not os.path.exists(segment_path(name))


def test_create_default_mode_is_0600(make_name: Callable[[], str]) -> None:
    with RingConsumer.create(make_name(), SMALL_CAPACITY) as consumer:
        st_ = os.stat(consumer.path)
        assert st_.st_mode & 0o777 == 0o600
        assert st_.st_size == HEADER_SIZE + SMALL_CAPACITY
        assert consumer.capacity == SMALL_CAPACITY
        assert consumer.name.startswith(NAME_PREFIX)
        assert consumer.path == segment_path(consumer.name)


def test_create_mode_ignores_umask(make_name: Callable[[], str]) -> None:
    previous = os.umask(0o077)
    try:
        consumer = RingConsumer.create(make_name(), SMALL_CAPACITY, mode=0o640)
    finally:
        os.umask(previous)
    with consumer:
        assert os.stat(consumer.path).st_mode & 0o777 == 0o640


def test_create_writes_header(make_name: Callable[[], str]) -> None:
    before = time.time_ns()
    with RingConsumer.create(make_name(), SMALL_CAPACITY, instance_id=0xDEADBEEF) as consumer:
        with closing(RingObserver.attach(consumer.name)) as observer:
            header = observer.header()
        raw = read_segment(consumer.path)
    assert raw[:8] == MAGIC
    assert header["version"] == 1
    assert header["header_size"] == HEADER_SIZE
    assert header["capacity"] == SMALL_CAPACITY
    assert header["owner_pid"] == os.getpid()
    assert header["producer_pid"] == 0
    assert before <= header["created_ns"] <= time.time_ns()
    assert header["instance_id"] == consumer.instance_id == 0xDEADBEEF
    assert header["write_pos"] == header["read_pos"] == 0
    assert header["consumer_waiting"] == header["producer_waiting"] == 0
    assert header["fill"] == 0.0


def test_random_instance_ids_differ(make_name: Callable[[], str]) -> None:
    with RingConsumer.create(make_name(), SMALL_CAPACITY) as first:
        with RingConsumer.create(make_name(), SMALL_CAPACITY) as second:
            assert first.instance_id != second.instance_id


def test_context_manager_unlinks(make_name: Callable[[], str]) -> None:
    with RingConsumer.create(make_name(), SMALL_CAPACITY) as consumer:
        assert os.path.exists(consumer.path)
    assert consumer.closed
    assert not os.path.exists(consumer.path)


def test_unlink_is_idempotent(make_name: Callable[[], str]) -> None:
    consumer = RingConsumer.create(make_name(), SMALL_CAPACITY)
    consumer.close()
    consumer.unlink()
    consumer.unlink()
    consumer.close()
    assert not os.path.exists(consumer.path)


def test_unlink_spares_a_replacement_segment(make_name: Callable[[], str]) -> None:
    name = make_name()
    first = RingConsumer.create(name, SMALL_CAPACITY)
    first.close()
    os.unlink(first.path)
    with RingConsumer.create(name, SMALL_CAPACITY) as second:
        first.unlink()
        assert os.path.exists(second.path)


def test_existing_live_segment_is_not_touched(make_name: Callable[[], str]) -> None:
    with RingConsumer.create(make_name(), SMALL_CAPACITY) as owner:
        before = read_segment(owner.path)
        with pytest.raises(RingExistsError, match="alive"):
            RingConsumer.create(owner.name, SMALL_CAPACITY)
        assert read_segment(owner.path) == before


def test_segment_of_other_live_process_is_not_touched(make_name: Callable[[], str]) -> None:
    owner = RingConsumer.create(make_name(), SMALL_CAPACITY)
    owner.close()
    write_u64(owner.path, OWNER_PID_OFFSET, INIT_PID)
    before = read_segment(owner.path)
    with pytest.raises(RingExistsError, match=f"pid {INIT_PID} is alive"):
        RingConsumer.create(owner.name, SMALL_CAPACITY)
    assert read_segment(owner.path) == before


@pytest.mark.e2e
def test_stale_segment_of_dead_owner_is_reclaimed(make_name: Callable[[], str]) -> None:
    name = make_name()
    script = (
        "from ipc.ring import RingConsumer, RingProducer\n"
        f"ring = RingConsumer.create({name!r}, {SMALL_CAPACITY}, instance_id=7)\n"
        f"producer = RingProducer.attach({name!r})\n"
        "assert producer.try_write(1, 0, 1, 1, 1, b'stale')\n"
        "producer.publish()\n"
    )
    subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, check=True)
    path = segment_path(name)
    assert os.path.exists(path), "a process exiting must not remove its segment"
    with closing(RingObserver.attach(name)) as observer:
        assert observer.header()["instance_id"] == 7
        assert [r.payload for r in observer.tail(1)] == [b"stale"]
    with pytest.raises(RingExistsError):
        RingConsumer.create(name, SMALL_CAPACITY, reclaim_stale=False)
    with RingConsumer.create(name, SMALL_CAPACITY * 2, instance_id=8) as reclaimed:
        assert reclaimed.capacity == SMALL_CAPACITY * 2
        assert reclaimed.read() == []
        with closing(RingObserver.attach(name)) as observer:
            header = observer.header()
        assert header["owner_pid"] == os.getpid()
        assert header["instance_id"] == 8
        assert header["write_pos"] == 0


@pytest.mark.e2e
def test_stale_segment_with_dead_pid_written_in_header(make_name: Callable[[], str]) -> None:
    owner = RingConsumer.create(make_name(), SMALL_CAPACITY)
    owner.close()
    write_u64(owner.path, OWNER_PID_OFFSET, dead_pid())
    with RingConsumer.create(owner.name, SMALL_CAPACITY) as reclaimed:
        assert reclaimed.instance_id != owner.instance_id


@pytest.mark.e2e
def test_stale_segment_of_a_zombie_owner_is_reclaimed(make_name: Callable[[], str]) -> None:
    """A SIGKILLed owner not yet reaped by its parent must not block the next owner."""
    name = make_name()
    script = (
        "import os, signal\n"
        "from ipc.ring import RingConsumer\n"
        f"ring = RingConsumer.create({name!r}, {SMALL_CAPACITY}, instance_id=7)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 30
        while True:  # wait for the zombie without reaping it
            with open(f"/proc/{child.pid}/stat", "rb") as stat_file:
                if stat_file.read().rsplit(b")", 1)[1][1:2] == b"Z":
                    break
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.01)
        os.kill(child.pid, 0)  # still a process as far as kill(2) can tell
        with RingConsumer.create(name, SMALL_CAPACITY, instance_id=8) as reclaimed:
            assert reclaimed.instance_id == 8
    finally:
        child.wait()


@pytest.mark.e2e
def test_stale_segment_being_reclaimed_elsewhere_is_not_touched(
    make_name: Callable[[], str],
) -> None:
    owner = RingConsumer.create(make_name(), SMALL_CAPACITY)
    owner.close()
    write_u64(owner.path, OWNER_PID_OFFSET, dead_pid())
    fd = os.open(owner.path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(RingExistsError, match="being reclaimed"):
            RingConsumer.create(owner.name, SMALL_CAPACITY)
    finally:
        os.close(fd)
    with RingConsumer.create(owner.name, SMALL_CAPACITY) as reclaimed:
        assert reclaimed.instance_id != owner.instance_id


def test_empty_segment_of_a_creator_killed_before_its_header_is_reclaimed(
    make_name: Callable[[], str],
) -> None:
    """A front SIGKILLed between creating its segment and writing the magic leaves an empty file, unlocked."""
    path = segment_path(make_name())
    Path(path).write_bytes(b"")
    with RingConsumer.create(os.path.basename(path), SMALL_CAPACITY, instance_id=5) as reclaimed:
        assert reclaimed.instance_id == 5


def test_empty_segment_whose_creator_still_holds_it_is_not_touched(make_name: Callable[[], str]) -> None:
    path = segment_path(make_name())
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a creator does until its magic is written
        with pytest.raises(RingExistsError, match="being reclaimed"):
            RingConsumer.create(os.path.basename(path), SMALL_CAPACITY)
        assert os.path.exists(path)
    finally:
        os.close(fd)
        os.unlink(path)


def test_foreign_file_is_not_touched(make_name: Callable[[], str]) -> None:
    path = segment_path(make_name())
    junk = b"not a ring at all" * 40
    with open(path, "wb") as foreign:
        foreign.write(junk)
    with pytest.raises(RingExistsError, match="not a ringstream ring segment"):
        RingConsumer.create(os.path.basename(path), SMALL_CAPACITY)
    assert read_segment(path) == junk


def test_short_foreign_file_is_not_touched(make_name: Callable[[], str]) -> None:
    path = segment_path(make_name())
    Path(path).write_bytes(MAGIC)
    with pytest.raises(RingExistsError):
        RingConsumer.create(os.path.basename(path), SMALL_CAPACITY)
    assert read_segment(path) == MAGIC


def test_symlink_is_not_followed(make_name: Callable[[], str], tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"precious")
    name = make_name()
    os.symlink(target, segment_path(name))
    with pytest.raises(RingExistsError):
        RingConsumer.create(name, SMALL_CAPACITY)
    assert target.read_bytes() == b"precious"
    with pytest.raises(RingError):
        RingProducer.attach(name)


@pytest.mark.e2e
def test_segment_of_other_user_is_not_touched(
    make_name: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    owner = RingConsumer.create(make_name(), SMALL_CAPACITY)
    owner.close()
    write_u64(owner.path, OWNER_PID_OFFSET, dead_pid())
    other_uid = os.stat(owner.path).st_uid + 1
    monkeypatch.setattr(ring_module.os, "geteuid", lambda: other_uid)
    before = read_segment(owner.path)
    with pytest.raises(RingExistsError, match="belongs to uid"):
        RingConsumer.create(owner.name, SMALL_CAPACITY)
    assert read_segment(owner.path) == before


def test_space_error_when_shm_too_small(make_name: Callable[[], str]) -> None:
    name = make_name()
    with pytest.raises(RingSpaceError):
        RingConsumer.create(name, HUGE_CAPACITY)
    assert not os.path.exists(segment_path(name))


def test_fallocate_enospc_maps_to_space_error(
    make_name: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ring_module.os, "posix_fallocate", no_space)
    name = make_name()
    with pytest.raises(RingSpaceError):
        RingConsumer.create(name, SMALL_CAPACITY)
    assert not os.path.exists(segment_path(name))


# -- attaching -----------------------------------------------------------------


def test_attach_missing_segment(make_name: Callable[[], str]) -> None:
    name = make_name()
    with pytest.raises(RingError):
        RingProducer.attach(name)
    with pytest.raises(RingError):
        RingObserver.attach(name)


def test_attach_checks_instance_id(make_name: Callable[[], str]) -> None:
    with RingConsumer.create(make_name(), SMALL_CAPACITY, instance_id=41) as consumer:
        with pytest.raises(RingError, match="instance id"):
            RingProducer.attach(consumer.name, instance_id=42)
        with closing(RingProducer.attach(consumer.name, instance_id=41)) as producer:
            assert producer.instance_id == 41
            assert producer.capacity == SMALL_CAPACITY


def test_attach_rejects_foreign_and_truncated_files(make_name: Callable[[], str]) -> None:
    path = segment_path(make_name())
    Path(path).write_bytes(b"\0" * (HEADER_SIZE + SMALL_CAPACITY))
    with pytest.raises(RingError, match="magic"):
        RingProducer.attach(os.path.basename(path))
    with RingConsumer.create(make_name(), SMALL_CAPACITY) as consumer:
        os.truncate(consumer.path, HEADER_SIZE + SMALL_CAPACITY // 2)
        with pytest.raises(RingError, match="bytes"):
            RingObserver.attach(consumer.name)


def test_producer_records_its_pid_and_close_keeps_segment(
    pair: tuple[RingConsumer, RingProducer],
) -> None:
    consumer, producer = pair
    with closing(RingObserver.attach(consumer.name)) as observer:
        assert observer.header()["producer_pid"] == os.getpid()
    producer.close()
    producer.close()
    assert os.path.exists(consumer.path)


# -- writing and reading -------------------------------------------------------


def test_roundtrip_all_kinds(pair: tuple[RingConsumer, RingProducer]) -> None:
    consumer, producer = pair
    assert producer.try_write(KIND_TOKEN, 1, 2**64 - 1, 2**32 - 1, 2**32 - 1, b"tok")
    assert producer.try_write(KIND_FINISH, 0xFFFF, 0, 0, 0)
    assert producer.try_write(KIND_ERROR, 0, 5, 6, 7, bytearray(b"boom"))
    assert consumer.read() == []
    assert consumer.pending_bytes() == 0
    producer.publish()
    assert consumer.pending_bytes() == record_size(3) + record_size(0) + record_size(4)
    assert consumer.read() == [
        Record(KIND_TOKEN, 1, 2**64 - 1, 2**32 - 1, 2**32 - 1, b"tok"),
        Record(KIND_FINISH, 0xFFFF, 0, 0, 0, b""),
        Record(KIND_ERROR, 0, 5, 6, 7, b"boom"),
    ]
    assert consumer.pending_bytes() == 0
    assert consumer.read() == []


def test_read_max_records(pair: tuple[RingConsumer, RingProducer]) -> None:
    consumer, producer = pair
    for seq in range(5):
        assert producer.try_write(KIND_TOKEN, 0, 0, seq, 0)
    producer.publish()
    assert consumer.read(0) == []
    assert [r.seq for r in consumer.read(2)] == [0, 1]
    assert [r.seq for r in consumer.read(2)] == [2, 3]
    assert [r.seq for r in consumer.read(2)] == [4]
    with pytest.raises(ValueError):
        consumer.read(-1)


def test_record_size() -> None:
    assert RECORD_HEADER_SIZE == 24
    assert RingProducer.record_size(0) == 24
    assert RingProducer.record_size(1) == 32
    assert RingProducer.record_size(8) == 32
    assert RingProducer.record_size(9) == 40


def test_invalid_writes_raise_and_write_nothing(pair: tuple[RingConsumer, RingProducer]) -> None:
    consumer, producer = pair
    assert producer.max_payload == min(MAX_PAYLOAD, SMALL_MAX_PAYLOAD)
    free = producer.free_bytes()
    bad_calls: list[tuple[object, ...]] = [
        (KIND_TOKEN, 0, 0, 0, 0, b"x" * (SMALL_MAX_PAYLOAD + 1)),
        (KIND_PAD, 0, 0, 0, 0, b""),
        (0, 0, 0, 0, 0, b""),
        (KIND_TOKEN, -1, 0, 0, 0, b""),
        (KIND_TOKEN, 0x10000, 0, 0, 0, b""),
        (KIND_TOKEN, 0, -1, 0, 0, b""),
        (KIND_TOKEN, 0, 2**64, 0, 0, b""),
        (KIND_TOKEN, 0, 0, 2**32, 0, b""),
        (KIND_TOKEN, 0, 0, 0, -1, b""),
        (KIND_TOKEN, 0, 0, 0, 1.5, b""),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            producer.try_write(*call)  # type: ignore[arg-type]
    assert producer.free_bytes() == free
    producer.publish()
    assert consumer.read() == []
    assert producer.try_write(KIND_TOKEN, 0, 0, 0, 0, b"y" * SMALL_MAX_PAYLOAD)


def test_full_ring_refuses_without_overwriting(pair: tuple[RingConsumer, RingProducer]) -> None:
    consumer, producer = pair
    payload = b"z" * 40
    count = SMALL_CAPACITY // record_size(len(payload))
    for seq in range(count):
        assert producer.try_write(KIND_TOKEN, 0, 0, seq, 0, payload)
    assert producer.free_bytes() == 0
    assert not producer.try_write(KIND_TOKEN, 0, 0, count, 0, payload)
    assert not producer.try_write(KIND_TOKEN, 0, 0, count, 0)
    producer.publish()
    assert not producer.try_write(KIND_TOKEN, 0, 0, count, 0)
    records = consumer.read()
    assert not producer.try_write(KIND_TOKEN, 0, 0, count, 0), "read alone frees nothing"
    assert [r.seq for r in records] == list(range(count))
    consumer.commit()
    assert producer.free_bytes() == SMALL_CAPACITY
    assert producer.try_write(KIND_TOKEN, 0, 0, count, 0, payload)


def test_wrap_inserts_pad_and_record_starts_at_zero(
    pair: tuple[RingConsumer, RingProducer],
) -> None:
    consumer, producer = pair
    first = SMALL_CAPACITY - RECORD_HEADER_SIZE - 8 - RECORD_HEADER_SIZE
    assert producer.try_write(KIND_TOKEN, 0, 0, 0, 0, b"a" * first)
    producer.publish()
    consumer.read()
    consumer.commit()
    tail = SMALL_CAPACITY - record_size(first)
    assert tail == 8 + RECORD_HEADER_SIZE
    assert producer.try_write(KIND_TOKEN, 0, 0, 1, 0, b"b" * 16)
    producer.publish()
    raw = read_segment(consumer.path)
    pad = RECORD.unpack_from(raw, HEADER_SIZE + record_size(first))
    assert pad[:2] == (tail, KIND_PAD)
    record_header = RECORD.unpack_from(raw, HEADER_SIZE)
    assert record_header[:5] == (RECORD_HEADER_SIZE + 16, KIND_TOKEN, 0, 0, 1)
    assert consumer.read() == [Record(KIND_TOKEN, 0, 0, 1, 0, b"b" * 16)]


def test_short_tail_pad(pair: tuple[RingConsumer, RingProducer]) -> None:
    consumer, producer = pair
    first = SMALL_CAPACITY - 8 - RECORD_HEADER_SIZE
    assert producer.try_write(KIND_TOKEN, 0, 0, 0, 0, b"a" * first)
    producer.publish()
    assert len(consumer.read()) == 1
    consumer.commit()
    assert producer.try_write(KIND_TOKEN, 0, 0, 1, 0)
    producer.publish()
    assert consumer.read() == [Record(KIND_TOKEN, 0, 0, 1, 0, b"")]
    consumer.commit()
    assert producer.free_bytes() == SMALL_CAPACITY


def test_pad_is_written_when_only_the_tail_is_free(
    pair: tuple[RingConsumer, RingProducer],
) -> None:
    """A record larger than the space left before the wrap point cannot
    deadlock: the tail is padded as soon as it is free."""
    consumer, producer = pair
    assert producer.try_write(KIND_TOKEN, 0, 0, 0, 0, b"a" * 8)
    producer.publish()
    consumer.read()
    consumer.commit()
    big = SMALL_MAX_PAYLOAD
    assert record_size(big) == SMALL_CAPACITY
    assert producer.free_bytes() == SMALL_CAPACITY
    assert producer.try_write(KIND_TOKEN, 0, 0, 1, 0, b"b" * big) is False
    assert producer.free_bytes() == record_size(8), "the tail was padded"
    assert producer.arm_space(record_size(big)) is True
    producer.publish()
    assert consumer.read() == []
    assert consumer.commit() is True
    assert producer.arm_space(record_size(big)) is False
    assert consumer.commit() is False
    assert producer.try_write(KIND_TOKEN, 0, 0, 1, 0, b"b" * big)
    producer.publish()
    assert consumer.read() == [Record(KIND_TOKEN, 0, 0, 1, 0, b"b" * big)]


def test_corrupt_record_raises(pair: tuple[RingConsumer, RingProducer]) -> None:
    consumer, producer = pair
    assert producer.try_write(KIND_TOKEN, 0, 0, 0, 0, b"abc")
    producer.publish()
    fd = os.open(consumer.path, os.O_WRONLY)
    try:
        os.pwrite(fd, struct.pack("<I", SMALL_CAPACITY * 2), HEADER_SIZE)
    finally:
        os.close(fd)
    with pytest.raises(RingError):
        consumer.read()


def test_unknown_kind_raises(pair: tuple[RingConsumer, RingProducer]) -> None:
    consumer, producer = pair
    assert producer.try_write(KIND_TOKEN, 0, 0, 0, 0)
    producer.publish()
    fd = os.open(consumer.path, os.O_WRONLY)
    try:
        os.pwrite(fd, struct.pack("<H", 7), HEADER_SIZE + 4)
    finally:
        os.close(fd)
    with pytest.raises(RingError, match="kind 7"):
        consumer.read()


def test_impossible_write_pos_raises(pair: tuple[RingConsumer, RingProducer]) -> None:
    consumer, _producer = pair
    write_u64(consumer.path, WRITE_POS_OFFSET, SMALL_CAPACITY * 3)
    with pytest.raises(RingError):
        consumer.read()


def test_closed_ring_raises(make_name: Callable[[], str]) -> None:
    with RingConsumer.create(make_name(), SMALL_CAPACITY) as consumer:
        producer = RingProducer.attach(consumer.name)
        producer.close()
        with pytest.raises(ValueError):
            producer.try_write(KIND_TOKEN, 0, 0, 0, 0)
        with pytest.raises(ValueError):
            producer.publish()
    with pytest.raises(ValueError):
        consumer.read()


# -- doorbell flags --------------------------------------------------------------


def test_publish_reports_armed_consumer(pair: tuple[RingConsumer, RingProducer]) -> None:
    consumer, producer = pair
    assert producer.publish() is False
    assert consumer.arm() is True
    assert producer.publish() is True
    assert producer.try_write(KIND_TOKEN, 0, 0, 0, 0), "unpublished data does not disarm"
    assert consumer.arm() is True
    assert producer.publish() is True
    consumer.disarm()
    assert producer.publish() is False
    assert consumer.arm() is False, "published, unread data is pending"
    assert producer.publish() is False, "arm() cleared the flag again"
    assert len(consumer.read()) == 1
    assert consumer.arm() is True
    consumer.disarm()


def test_commit_reports_armed_producer(pair: tuple[RingConsumer, RingProducer]) -> None:
    consumer, producer = pair
    assert consumer.commit() is False
    assert producer.arm_space(SMALL_CAPACITY) is False, "an empty ring has all the space"
    assert consumer.commit() is False, "arm_space() cleared the flag again"
    payload = b"p" * (SMALL_CAPACITY // 2 - RECORD_HEADER_SIZE)
    assert producer.try_write(KIND_TOKEN, 0, 0, 0, 0, payload)
    assert producer.try_write(KIND_TOKEN, 0, 0, 1, 0, payload)
    assert not producer.try_write(KIND_TOKEN, 0, 0, 2, 0, payload)
    needed = record_size(len(payload))
    assert producer.arm_space(needed) is True
    producer.publish()
    assert consumer.commit() is True
    assert len(consumer.read(1)) == 1
    assert consumer.commit() is True
    producer.disarm_space()
    assert consumer.commit() is False
    assert producer.arm_space(needed) is False
    with pytest.raises(ValueError):
        producer.arm_space(0)
    with pytest.raises(ValueError):
        producer.arm_space(SMALL_CAPACITY + 1)


def test_pending_and_fill(pair: tuple[RingConsumer, RingProducer]) -> None:
    consumer, producer = pair
    payload = b"f" * (SMALL_CAPACITY // 4 - RECORD_HEADER_SIZE)
    assert producer.try_write(KIND_TOKEN, 0, 0, 0, 0, payload)
    assert consumer.fill() == 0.0
    producer.publish()
    assert consumer.fill() == 0.25
    assert consumer.pending_bytes() == SMALL_CAPACITY // 4
    consumer.read()
    assert consumer.pending_bytes() == 0
    assert consumer.fill() == 0.25
    consumer.commit()
    assert consumer.fill() == 0.0
    assert producer.free_bytes() == SMALL_CAPACITY


# -- observer --------------------------------------------------------------------


def mappings_of(path: str) -> dict[str, str]:
    """Address range -> permissions of this process's mappings of ``path``."""
    with open("/proc/self/maps") as maps:
        fields = [line.split() for line in maps if line.rstrip().endswith(path)]
    return {entry[0]: entry[1] for entry in fields}


def test_observer_is_read_only(pair: tuple[RingConsumer, RingProducer]) -> None:
    consumer, producer = pair
    for seq in range(10):
        assert producer.try_write(KIND_TOKEN, 0, 3, seq, seq * 2, bytes([seq]) * seq)
    producer.publish()
    consumer.read(4)
    consumer.commit()
    os.chmod(consumer.path, 0o400)
    before = read_segment(consumer.path)
    writable_maps = mappings_of(consumer.path)
    assert all(perms.startswith("rw") for perms in writable_maps.values())
    with closing(RingObserver.attach(consumer.name)) as observer:
        new_maps = {
            span: perms
            for span, perms in mappings_of(consumer.path).items()
            if span not in writable_maps
        }
        assert list(new_maps.values()) == ["r--s"]
        observer.header()
        observer.tail(100)
        assert read_segment(consumer.path) == before
        assert observer.capacity == SMALL_CAPACITY
        assert observer.name == consumer.name
    assert read_segment(consumer.path) == before
    assert os.path.exists(consumer.path)


def test_observer_header_and_tail(pair: tuple[RingConsumer, RingProducer]) -> None:
    consumer, producer = pair
    with closing(RingObserver.attach(consumer.name)) as observer:
        assert observer.tail(5) == []
        written = [Record(KIND_TOKEN, 0, 9, seq, seq + 100, b"q" * (seq % 50)) for seq in range(40)]
        for record in written[:30]:
            assert producer.try_write(*record)
        assert observer.tail(5) == [], "unpublished records are invisible"
        producer.publish()
        assert observer.tail(5) == written[25:30]
        assert observer.tail(0) == []
        assert observer.tail(1000) == written[:30]
        consumer.read(20)
        consumer.commit()
        assert observer.tail(1000) == written[20:30]
        for record in written[30:]:
            assert producer.try_write(*record)
        producer.publish()
        assert consumer.arm() is False
        header = observer.header()
        assert header["read_pos"] == sum(record_size(len(r.payload)) for r in written[:20])
        assert header["write_pos"] == sum(record_size(len(r.payload)) for r in written)
        assert header["pending_bytes"] == header["write_pos"] - header["read_pos"]
        assert header["fill"] == header["pending_bytes"] / SMALL_CAPACITY
        assert observer.tail(3) == written[37:]
        with pytest.raises(ValueError):
            observer.tail(-1)
    consumer.read()
    consumer.commit()
    assert consumer.arm() is True
    with closing(RingObserver.attach(consumer.name)) as observer:
        header = observer.header()
        assert header["consumer_waiting"] == 1
        assert header["producer_waiting"] == 0
        assert observer.tail(10) == []
    consumer.disarm()


def test_observer_tail_across_wrap(pair: tuple[RingConsumer, RingProducer]) -> None:
    consumer, producer = pair
    seq = 0
    payload = b"w" * 1000
    with closing(RingObserver.attach(consumer.name)) as observer:
        for _round in range(5):
            written = []
            while producer.try_write(KIND_TOKEN, 0, 0, seq, 0, payload):
                written.append(seq)
                seq += 1
            producer.publish()
            assert [r.seq for r in observer.tail(10)] == written
            assert [r.seq for r in consumer.read()] == written
            consumer.commit()


# -- property tests --------------------------------------------------------------

payload_sizes = st.one_of(
    st.integers(0, 64),
    st.integers(0, 3000),
    st.sampled_from([SMALL_MAX_PAYLOAD, SMALL_MAX_PAYLOAD - 7, SMALL_CAPACITY // 2]),
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("write"), payload_sizes),
        st.tuples(st.just("write"), payload_sizes),
        st.tuples(st.just("publish"), st.none()),
        st.tuples(st.just("read"), st.one_of(st.none(), st.integers(0, 4))),
        st.tuples(st.just("commit"), st.none()),
    ),
    max_size=120,
)


class RingModel:
    """Reference model of the ring's positions and contents."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.write_pos = 0
        self.published_pos = 0
        self.read_cursor = 0
        self.committed = 0
        self.unpublished: list[tuple[int, Record]] = []
        self.published: deque[tuple[int, Record]] = deque()
        self.uncommitted: list[tuple[int, Record]] = []

    def live_records(self) -> list[tuple[int, Record]]:
        """(end position, record) of every record the producer must not touch."""
        return [*self.uncommitted, *self.published, *self.unpublished]

    def expect_write(self, payload_len: int) -> tuple[bool, int | None]:
        """Apply a write to the model; return (success, record position)."""
        size = record_size(payload_len)
        room = self.capacity - self.write_pos % self.capacity
        if size > room:
            if self.write_pos + room - self.committed > self.capacity:
                return False, None
            self.write_pos += room
        if self.write_pos + size - self.committed > self.capacity:
            return False, None
        position = self.write_pos
        self.write_pos += size
        return True, position


def payload_of(seq: int, size: int) -> bytes:
    return (seq.to_bytes(4, "little") * (size // 4 + 1))[:size]


def assert_intact(fd: int, items: list[tuple[int, Record]]) -> None:
    """Check that each (end position, record) is still in the segment."""
    for end, record in items:
        length = RECORD_HEADER_SIZE + len(record.payload)
        offset = (end - record_size(len(record.payload))) % SMALL_CAPACITY
        raw = os.pread(fd, length, HEADER_SIZE + offset)
        assert RECORD.unpack_from(raw) == (length, *record[:5]), "a live record was overwritten"
        assert raw[RECORD_HEADER_SIZE:] == record.payload, "a live payload was overwritten"


@PROPERTY_SETTINGS
@given(ops=operations)
def test_property_random_operations(
    make_name: Callable[[], str], ops: list[tuple[str, int | None]]
) -> None:
    with RingConsumer.create(make_name(), SMALL_CAPACITY) as consumer:
        with closing(RingProducer.attach(consumer.name)) as producer:
            check_operations(consumer, producer, ops)


def check_operations(
    consumer: RingConsumer, producer: RingProducer, ops: list[tuple[str, int | None]]
) -> None:
    model = RingModel(SMALL_CAPACITY)
    fd = os.open(consumer.path, os.O_RDONLY)
    try:
        seq = 0
        for op, argument in ops:
            if op == "write":
                assert argument is not None
                payload = payload_of(seq, argument)
                record = Record(KIND_TOKEN, seq & 0xFFFF, seq * 3, seq, zlib.crc32(payload), payload)
                expected, position = model.expect_write(argument)
                assert producer.try_write(*record) is expected
                if expected:
                    assert position is not None
                    offset = position % SMALL_CAPACITY
                    size = record_size(argument)
                    assert offset + size <= SMALL_CAPACITY, "record straddles the wrap point"
                    raw = os.pread(fd, RECORD_HEADER_SIZE + argument, HEADER_SIZE + offset)
                    assert RECORD.unpack_from(raw) == (RECORD_HEADER_SIZE + argument, *record[:5])
                    assert raw[RECORD_HEADER_SIZE:] == record.payload
                    model.unpublished.append((position + size, record))
                    seq += 1
                else:
                    assert producer.arm_space(record_size(argument)) is True
                    producer.disarm_space()
                assert_intact(fd, model.live_records())
                assert producer.free_bytes() == SMALL_CAPACITY - (model.write_pos - model.committed)
            elif op == "publish":
                assert producer.publish() is False
                model.published.extend(model.unpublished)
                model.unpublished.clear()
                model.published_pos = model.write_pos
                assert U64.unpack(os.pread(fd, 8, WRITE_POS_OFFSET))[0] == model.published_pos
            elif op == "read":
                records = consumer.read(argument)
                limit = len(model.published) if argument is None else argument
                count = min(limit, len(model.published))
                expected_items = [model.published.popleft() for _ in range(count)]
                assert records == [record for _end, record in expected_items]
                model.uncommitted.extend(expected_items)
                if argument is not None and len(records) == argument and records:
                    model.read_cursor = expected_items[-1][0]
                elif argument != 0:
                    model.read_cursor = model.published_pos
                assert consumer.pending_bytes() == model.published_pos - model.read_cursor
            else:
                assert consumer.commit() is False
                model.committed = model.read_cursor
                model.uncommitted.clear()
                assert U64.unpack(os.pread(fd, 8, READ_POS_OFFSET))[0] == model.committed
        producer.publish()
        model.published.extend(model.unpublished)
        assert consumer.read() == [record for _end, record in model.published]
        consumer.commit()
        assert producer.free_bytes() == SMALL_CAPACITY
    finally:
        os.close(fd)


@PROPERTY_SETTINGS
@given(
    sizes=st.lists(
        st.one_of(st.integers(0, 3000), st.integers(0, SMALL_MAX_PAYLOAD)), min_size=1, max_size=200
    )
)
def test_property_drain_on_full(make_name: Callable[[], str], sizes: list[int]) -> None:
    """try_write fails exactly when the free space is short of the record
    (plus the tail padding it needs), and a drained ring accepts any record."""
    with RingConsumer.create(make_name(), SMALL_CAPACITY) as consumer:
        with closing(RingProducer.attach(consumer.name)) as producer:
            received: list[Record] = []
            written: list[Record] = []
            position = 0
            committed = 0
            for seq, size in enumerate(sizes):
                record = Record(KIND_TOKEN, 0, seq, seq, size, payload_of(seq, size))
                size_in_ring = record_size(size)
                room = SMALL_CAPACITY - position % SMALL_CAPACITY
                pad = room if size_in_ring > room else 0
                free = producer.free_bytes()
                accepted = producer.try_write(*record)
                assert accepted is (free >= pad + size_in_ring)
                if accepted:
                    position += pad + size_in_ring
                else:
                    if pad and free >= pad:
                        position += pad
                    assert producer.arm_space(size_in_ring) is True
                    producer.disarm_space()
                    producer.publish()
                    received.extend(consumer.read())
                    assert consumer.commit() is False
                    assert producer.free_bytes() == SMALL_CAPACITY
                    assert producer.try_write(*record), "a drained ring must accept any record"
                    room = SMALL_CAPACITY - position % SMALL_CAPACITY
                    position += (room if size_in_ring > room else 0) + size_in_ring
                    committed = position - record_size(size)
                written.append(record)
                assert producer.free_bytes() == SMALL_CAPACITY - (position - committed)
            producer.publish()
            received.extend(consumer.read())
            assert received == written
            consumer.commit()
            with closing(RingObserver.attach(consumer.name)) as observer:
                assert observer.header()["write_pos"] == position


# -- two processes ---------------------------------------------------------------


@contextmanager
def producer_process(
    consumer: RingConsumer, total: int, tmp_path: Path
) -> Iterator[tuple[Doorbell, Doorbell]]:
    """Run ring_stress_child.run_producer in a spawned process.

    Yields the (data, space) doorbells; on exit the child must have finished
    cleanly, and it is killed if it is still running.
    """
    data_bell_path = str(tmp_path / "data.bell")
    space_bell_path = str(tmp_path / "space.bell")
    Doorbell.make(data_bell_path)
    Doorbell.make(space_bell_path)
    data_bell = Doorbell(data_bell_path)
    space_bell = Doorbell(space_bell_path)
    child = multiprocessing.get_context("spawn").Process(
        target=ring_stress_child.run_producer,
        args=(
            consumer.name,
            consumer.instance_id,
            total,
            STRESS_PUBLISH_EVERY,
            data_bell_path,
            space_bell_path,
            STRESS_WAIT_TIMEOUT_S,
        ),
        name="ring-stress-producer",
    )
    child.start()
    try:
        yield data_bell, space_bell
        child.join(STRESS_JOIN_TIMEOUT_S)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
            child.join(STRESS_KILL_TIMEOUT_S)
        child.close()
        data_bell.close()
        space_bell.close()


def check_stress_record(record: Record, seq: int, last: int) -> None:
    payload = ring_stress_child.payload_for(seq)
    if (
        record.seq != seq
        or record.payload != payload
        or record.token_id != zlib.crc32(payload)
        or record.handle != seq >> ring_stress_child.HANDLE_SHIFT
        or record.flags != seq & ring_stress_child.FLAGS_MASK
        or record.kind != (KIND_FINISH if seq == last else KIND_TOKEN)
    ):
        pytest.fail(f"record {seq} is wrong: {record!r}")


def consume(consumer: RingConsumer, total: int, data_bell: Doorbell, space_bell: Doorbell) -> int:
    """Read and verify records 0..total-1 with the doorbell protocol.

    Returns how often the consumer went to sleep.
    """
    last = total - 1
    expected = 0
    waits = 0
    deadline = time.monotonic() + STRESS_DEADLINE_S
    while expected < total:
        records = consumer.read()
        if records:
            for record in records:
                check_stress_record(record, expected, last)
                expected += 1
            if consumer.commit():
                space_bell.ring()
            continue
        if time.monotonic() > deadline:
            pytest.fail(f"consumer exceeded {STRESS_DEADLINE_S} s at record {expected}")
        if consumer.arm():
            waits += 1
            if not data_bell.wait(STRESS_WAIT_TIMEOUT_S):
                pytest.fail(f"consumer waited {STRESS_WAIT_TIMEOUT_S} s for record {expected}")
            consumer.disarm()
    assert consumer.read() == []
    return waits


@pytest.mark.e2e
def test_two_process_stress(make_name: Callable[[], str], tmp_path: Path) -> None:
    with RingConsumer.create(make_name(), STRESS_CAPACITY) as consumer:
        with producer_process(consumer, STRESS_RECORDS, tmp_path) as (data_bell, space_bell):
            started = time.monotonic()
            waits = consume(consumer, STRESS_RECORDS, data_bell, space_bell)
            elapsed = time.monotonic() - started
        assert os.path.exists(consumer.path), "the producer's exit must not remove the segment"
    assert elapsed < STRESS_DEADLINE_S
    print(
        f"\nring stress: {STRESS_RECORDS} records in {elapsed:.2f} s = "
        f"{STRESS_RECORDS / elapsed:,.0f} records/s; the consumer slept {waits} times"
    )


@pytest.mark.e2e
def test_observer_tail_while_ring_runs(make_name: Callable[[], str], tmp_path: Path) -> None:
    """tail() returns only intact, consecutive records while the producer
    keeps overwriting the space the consumer frees."""
    results: list[int] = []
    failures: list[BaseException] = []
    stop = threading.Event()
    last = OBSERVED_RECORDS - 1

    def observe(name: str) -> None:
        try:
            with closing(RingObserver.attach(name)) as observer:
                while not stop.is_set():
                    records = observer.tail(OBSERVED_TAIL)
                    for previous, record in zip(records, records[1:]):
                        assert record.seq == previous.seq + 1
                    for record in records:
                        check_stress_record(record, record.seq, last)
                    results.append(len(records))
        except BaseException as exc:  # pytest.fail raises a BaseException; re-raised below
            failures.append(exc)

    previous_interval = sys.getswitchinterval()
    sys.setswitchinterval(OBSERVER_SWITCH_INTERVAL_S)
    try:
        with RingConsumer.create(make_name(), STRESS_CAPACITY) as consumer:
            observer_thread = threading.Thread(target=observe, args=(consumer.name,))
            observer_thread.start()
            try:
                with producer_process(consumer, OBSERVED_RECORDS, tmp_path) as bells:
                    consume(consumer, OBSERVED_RECORDS, *bells)
            finally:
                stop.set()
                observer_thread.join(STRESS_JOIN_TIMEOUT_S)
    finally:
        sys.setswitchinterval(previous_interval)
    assert not observer_thread.is_alive()
    if failures:
        raise failures[0]
    assert results, "the observer never ran"
    assert any(results), "the observer never saw a record"


# -- observer follow -------------------------------------------------------------

FOLLOW_SIZES = (0, 1, 7, 8, 100, 999, None, 1500, 13, 2000, 3, 64, 4000, None, 40)
FOLLOW_SHORT_TAIL = 16
RECORD_ALIGN_BYTES = 8
FOLLOW_ROUNDS = 120
FOLLOW_BATCH = 3
FOLLOW_MIN_LAPS = 10
LAP_PAYLOAD = 100
LAP_RECORDS = SMALL_CAPACITY // record_size(LAP_PAYLOAD)
FOLLOWED_RECORDS = 200_000
FOLLOWER_PAUSE_EVERY = 25
FOLLOWER_PAUSE_S = 0.01


def write_published(producer: RingProducer, seqs: range, size: int = 0) -> None:
    for seq in seqs:
        assert producer.try_write(KIND_TOKEN, 0, seq % 5, seq, seq * 3, payload_of(seq, size))
    producer.publish()


def drain(consumer: RingConsumer) -> list[Record]:
    records = consumer.read()
    consumer.commit()
    return records


def test_follow_starts_at_read_pos_and_keeps_committed_records(
    pair: tuple[RingConsumer, RingProducer],
) -> None:
    consumer, producer = pair
    written = [Record(KIND_TOKEN, 0, 7, seq, seq + 1, b"t" * seq) for seq in range(10)]
    for record in written[:6]:
        assert producer.try_write(*record)
    producer.publish()
    consumer.read(2)
    consumer.commit()
    with closing(RingObserver.attach(consumer.name)) as observer:
        records, cursor, lapped = observer.follow()
        assert (records, lapped) == (written[2:6], False)
        assert cursor == observer.header()["write_pos"]
        assert observer.follow(cursor) == ([], cursor, False)
        drain(consumer)
        for record in written[6:]:
            assert producer.try_write(*record)
        assert observer.follow(cursor) == ([], cursor, False), "unpublished records are invisible"
        producer.publish()
        drain(consumer)
        records, end, lapped = observer.follow(cursor)
        assert (records, lapped) == (written[6:], False), "committed records stay visible"
        assert end == observer.header()["write_pos"] == observer.header()["read_pos"]
        assert observer.follow(0) == (written, end, False)
        first, middle, lapped = observer.follow(0, max_records=3)
        assert (first, lapped) == (written[:3], False)
        assert observer.follow(middle) == (written[3:], end, False)
        assert observer.follow(middle, max_records=0) == ([], middle, False)


def test_follow_rejects_bad_arguments(make_name: Callable[[], str]) -> None:
    with RingConsumer.create(make_name(), SMALL_CAPACITY) as consumer:
        with closing(RingProducer.attach(consumer.name)) as producer:
            write_published(producer, range(1), size=1)
        observer = RingObserver.attach(consumer.name)
        with closing(observer):
            end = observer.header()["write_pos"]
            with pytest.raises(ValueError, match="ahead of write_pos"):
                observer.follow(end + RECORD_HEADER_SIZE)
            with pytest.raises(ValueError):
                observer.follow(-1)
            with pytest.raises(TypeError):
                observer.follow("0")  # type: ignore[arg-type]
            with pytest.raises(ValueError):
                observer.follow(max_records=-1)
            with pytest.raises(TypeError):
                observer.follow(max_records=1.0)  # type: ignore[arg-type]
            for bad in (-1, SMALL_CAPACITY + 1):
                with pytest.raises(ValueError):
                    observer.follow(unpublished_bytes=bad)
            with pytest.raises(TypeError):
                observer.follow(unpublished_bytes=0.5)  # type: ignore[arg-type]
            with pytest.raises(RingError, match="no valid record"):
                observer.follow(RECORD_ALIGN_BYTES)
        with pytest.raises(ValueError):
            observer.follow()


def follow_payload_size(round_number: int, room: int) -> int:
    """Payload size for the next record; every few rounds, one that leaves
    a tail too short for a PAD header before the end of the data area."""
    size = FOLLOW_SIZES[round_number % len(FOLLOW_SIZES)]
    if size is None:
        return max(room - FOLLOW_SHORT_TAIL - RECORD_HEADER_SIZE, 0)
    return size


def test_follow_across_wrap(pair: tuple[RingConsumer, RingProducer]) -> None:
    """Every record is seen once, through PADs and short tails, while the
    consumer commits everything before the observer looks."""
    consumer, producer = pair
    model = RingModel(SMALL_CAPACITY)
    sizes: dict[int, int] = {}
    pads = short_tails = 0
    seq = 0
    with closing(RingObserver.attach(consumer.name)) as observer:
        _, cursor, _ = observer.follow()
        for round_number in range(FOLLOW_ROUNDS):
            written = []
            for _ in range(FOLLOW_BATCH):
                room = SMALL_CAPACITY - model.write_pos % SMALL_CAPACITY
                size = follow_payload_size(round_number, room)
                before = model.write_pos
                expected, _position = model.expect_write(size)
                if record_size(size) > room and model.write_pos > before:
                    pads += room >= RECORD_HEADER_SIZE
                    short_tails += room < RECORD_HEADER_SIZE
                written_now = producer.try_write(
                    KIND_TOKEN, 0, round_number, seq, 0, payload_of(seq, size)
                )
                assert written_now == expected
                if not written_now:
                    break
                sizes[seq] = size
                written.append(seq)
                seq += 1
            producer.publish()
            assert [record.seq for record in drain(consumer)] == written
            model.committed = model.write_pos
            # Every record is published before follow runs: nothing is unpublished.
            records, cursor, lapped = observer.follow(cursor, unpublished_bytes=0)
            assert not lapped
            assert [record.seq for record in records] == written
            assert all(record.payload == payload_of(record.seq, sizes[record.seq]) for record in records)
            assert cursor == observer.header()["write_pos"] == model.write_pos
        assert model.write_pos > FOLLOW_MIN_LAPS * SMALL_CAPACITY
    assert pads and short_tails, "the sizes must exercise both kinds of wrap"


def test_follow_detects_a_lap_and_resyncs_to_read_pos(
    pair: tuple[RingConsumer, RingProducer],
) -> None:
    consumer, producer = pair
    with closing(RingObserver.attach(consumer.name)) as observer:
        _, cursor, _ = observer.follow()
        assert cursor == 0
        write_published(producer, range(LAP_RECORDS), LAP_PAYLOAD)
        drain(consumer)
        write_published(producer, range(LAP_RECORDS, LAP_RECORDS + 3), LAP_PAYLOAD)
        drain(consumer)
        write_published(producer, range(LAP_RECORDS + 3, LAP_RECORDS + 6), LAP_PAYLOAD)
        records, end, lapped = observer.follow(cursor)
        assert lapped
        assert [record.seq for record in records] == list(range(LAP_RECORDS + 3, LAP_RECORDS + 6))
        assert end == observer.header()["write_pos"]
        write_published(producer, range(LAP_RECORDS + 6, LAP_RECORDS + 7), LAP_PAYLOAD)
        records, _, lapped = observer.follow(end)
        assert not lapped
        assert [record.seq for record in records] == [LAP_RECORDS + 6]


def test_follow_horizon_depends_on_unpublished_bytes(
    pair: tuple[RingConsumer, RingProducer],
) -> None:
    """After exactly one lap every byte may still be intact; how much of it
    follow trusts depends on how far the producer may run unpublished."""
    consumer, producer = pair
    assert LAP_RECORDS * record_size(LAP_PAYLOAD) == SMALL_CAPACITY
    write_published(producer, range(LAP_RECORDS), LAP_PAYLOAD)
    drain(consumer)
    with closing(RingObserver.attach(consumer.name)) as observer:
        records, end, lapped = observer.follow(0, unpublished_bytes=0)
        assert (len(records), end, lapped) == (LAP_RECORDS, SMALL_CAPACITY, False)
        half = SMALL_CAPACITY // 2
        records, _, lapped = observer.follow(half, unpublished_bytes=half)
        assert (len(records), lapped) == (LAP_RECORDS // 2, False)
        assert observer.follow(0) == ([], SMALL_CAPACITY, True)
        assert observer.follow(half - 1, unpublished_bytes=half) == ([], SMALL_CAPACITY, True)
        assert observer.follow(0, unpublished_bytes=SMALL_CAPACITY) == ([], SMALL_CAPACITY, True)


def test_follow_discards_copies_overwritten_while_copying(
    pair: tuple[RingConsumer, RingProducer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The producer laps the observer between its copy and its re-check:
    the copies are dropped and the observer resyncs to read_pos."""
    consumer, producer = pair
    write_published(producer, range(5), LAP_PAYLOAD)
    with closing(RingObserver.attach(consumer.name)) as observer:
        collect = observer._collect
        starts: list[int] = []

        def collect_while_lapped(position: int, end: int, limit: int):
            copied = collect(position, end, limit)
            if not starts:
                drain(consumer)
                write_published(producer, range(5, LAP_RECORDS + 5), LAP_PAYLOAD)
                drain(consumer)
                write_published(producer, range(LAP_RECORDS + 5, LAP_RECORDS + 7), LAP_PAYLOAD)
            starts.append(position)
            return copied

        monkeypatch.setattr(observer, "_collect", collect_while_lapped)
        records, end, lapped = observer.follow(0)
        assert lapped
        assert [record.seq for record in records] == [LAP_RECORDS + 5, LAP_RECORDS + 6]
        header = observer.header()
        assert starts == [0, header["read_pos"]]
        assert end == header["write_pos"]


def test_follow_is_read_only(pair: tuple[RingConsumer, RingProducer]) -> None:
    consumer, producer = pair
    write_published(producer, range(20), size=40)
    drain(consumer)
    write_published(producer, range(20, 25), size=40)
    os.chmod(consumer.path, 0o400)
    before = read_segment(consumer.path)
    writable_maps = mappings_of(consumer.path)
    with closing(RingObserver.attach(consumer.name)) as observer:
        new_maps = {
            span: perms
            for span, perms in mappings_of(consumer.path).items()
            if span not in writable_maps
        }
        assert list(new_maps.values()) == ["r--s"]
        records, cursor, lapped = observer.follow()
        assert [record.seq for record in records] == list(range(20, 25))
        assert len(observer.follow(0)[0]) == 25
        assert read_segment(consumer.path) == before
    assert read_segment(consumer.path) == before
    assert os.path.exists(consumer.path)


@pytest.mark.e2e
def test_follow_while_a_fast_writer_laps_the_observer(
    make_name: Callable[[], str], tmp_path: Path
) -> None:
    """A follower that sometimes pauses gets lapped by a producer process
    running flat out; it must say so and never return a damaged or
    out-of-order record.  (Whether it keeps up between pauses depends on
    scheduling; the single-process tests check that it does.)"""
    calls: list[tuple[int, bool]] = []
    failures: list[BaseException] = []
    stop = threading.Event()
    last = FOLLOWED_RECORDS - 1

    def follow(name: str) -> None:
        try:
            with closing(RingObserver.attach(name)) as observer:
                cursor = None
                previous = -1
                gap_allowed = False
                while not stop.is_set():
                    records, cursor, lapped = observer.follow(cursor)
                    for record in records:
                        check_stress_record(record, record.seq, last)
                    gap_allowed = gap_allowed or lapped
                    if records:
                        seqs = [record.seq for record in records]
                        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
                        if previous >= 0:
                            assert seqs[0] > previous if gap_allowed else seqs[0] == previous + 1
                        previous = seqs[-1]
                        gap_allowed = False
                    calls.append((len(records), lapped))
                    if len(calls) % FOLLOWER_PAUSE_EVERY == 0:
                        time.sleep(FOLLOWER_PAUSE_S)
        except BaseException as exc:  # pytest.fail raises a BaseException; re-raised below
            failures.append(exc)

    previous_interval = sys.getswitchinterval()
    sys.setswitchinterval(OBSERVER_SWITCH_INTERVAL_S)
    try:
        with RingConsumer.create(make_name(), STRESS_CAPACITY) as consumer:
            follower = threading.Thread(target=follow, args=(consumer.name,))
            follower.start()
            try:
                with producer_process(consumer, FOLLOWED_RECORDS, tmp_path) as bells:
                    consume(consumer, FOLLOWED_RECORDS, *bells)
            finally:
                stop.set()
                follower.join(STRESS_JOIN_TIMEOUT_S)
    finally:
        sys.setswitchinterval(previous_interval)
    assert not follower.is_alive()
    if failures:
        raise failures[0]
    assert any(lapped for _count, lapped in calls), "the writer never lapped the follower"
    assert any(count for count, _lapped in calls), "the follower never saw a record"
