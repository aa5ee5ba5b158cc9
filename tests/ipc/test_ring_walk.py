"""Tests for ipc.ring.walk, the one record walk behind RingConsumer.read and RingObserver."""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from contextlib import closing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringstream.ipc.ring import (
    HEADER_SIZE,
    KIND_ERROR,
    KIND_FINISH,
    KIND_PAD,
    KIND_TOKEN,
    RECORD_ALIGN,
    RECORD_HEADER_SIZE,
    Record,
)
from ringstream.ipc.ring.layout import record_size
from ringstream.ipc.ring.walk import walk

CAPACITY = 4096
RECORD = struct.Struct("<IHHQII")
PAD_PREFIX = struct.Struct("<IHH")
SHORT_TAIL = 16
GARBAGE = 0xA5


class Writer:
    """Writes records the way RingProducer lays them out, into an anonymous mapping."""

    def __init__(self, mm: mmap.mmap, position: int = 0) -> None:
        self.mm = mm
        self.position = position
        self.positions: list[int] = []
        self.records: list[Record] = []

    def room(self) -> int:
        return CAPACITY - self.position % CAPACITY

    def pad(self) -> None:
        start = HEADER_SIZE + self.position % CAPACITY
        room = self.room()
        if room >= RECORD_HEADER_SIZE:
            RECORD.pack_into(self.mm, start, room, KIND_PAD, 0, 0, 0, 0)
        else:
            PAD_PREFIX.pack_into(self.mm, start, room, KIND_PAD, 0)
        self.position += room

    def write(self, seq: int, payload: bytes, kind: int = KIND_TOKEN) -> None:
        if record_size(len(payload)) > self.room():
            self.pad()
        start = HEADER_SIZE + self.position % CAPACITY
        RECORD.pack_into(self.mm, start, RECORD_HEADER_SIZE + len(payload), kind, 1, 7, seq, 3)
        self.mm[start + RECORD_HEADER_SIZE : start + RECORD_HEADER_SIZE + len(payload)] = payload
        self.records.append(Record(kind, 1, 7, seq, 3, payload))
        self.positions.append(self.position)
        self.position += record_size(len(payload))


@pytest.fixture
def mm() -> Iterator[mmap.mmap]:
    with closing(mmap.mmap(-1, HEADER_SIZE + CAPACITY)) as mapping:
        mapping[:] = bytes([GARBAGE]) * len(mapping)
        yield mapping


def test_empty_walk(mm: mmap.mmap) -> None:
    assert walk(mm, CAPACITY, 0, 0) == ([], 0, None)
    assert walk(mm, CAPACITY, 5 * CAPACITY, 5 * CAPACITY) == ([], 5 * CAPACITY, None)


def test_all_kinds_and_positions(mm: mmap.mmap) -> None:
    writer = Writer(mm)
    for seq, (kind, payload) in enumerate(
        [(KIND_TOKEN, b""), (KIND_TOKEN, b"x" * 7), (KIND_FINISH, b"y" * 8), (KIND_ERROR, b"z" * 9)]
    ):
        writer.write(seq, payload, kind)
    positions: list[int] = []
    records, stopped, invalid_at = walk(mm, CAPACITY, 0, writer.position, positions=positions)
    assert records == writer.records
    assert positions == writer.positions == [0, 24, 56, 88]
    assert (stopped, invalid_at) == (writer.position, None)
    assert all(isinstance(record.payload, bytes) for record in records)


def test_wrap_around_skips_the_pad_and_continues_at_offset_zero(mm: mmap.mmap) -> None:
    lap = 3 * CAPACITY
    writer = Writer(mm, lap + CAPACITY - 100)
    writer.write(0, b"a" * 40)
    writer.write(1, b"b" * 40)  # 64 + 64 > 100: a 36-byte PAD, then offset 0 of the next lap
    assert writer.positions == [lap + CAPACITY - 100, lap + CAPACITY]
    positions: list[int] = []
    records, stopped, invalid_at = walk(mm, CAPACITY, writer.positions[0], writer.position,
                                        positions=positions)
    assert records == writer.records
    assert positions == writer.positions
    assert (stopped, invalid_at) == (writer.position, None)


def test_short_tail_is_skipped_without_reading_it(mm: mmap.mmap) -> None:
    writer = Writer(mm, CAPACITY - SHORT_TAIL - 32)
    writer.write(0, b"a" * 8)
    assert writer.room() == SHORT_TAIL
    writer.pad()
    mm[HEADER_SIZE + CAPACITY - SHORT_TAIL : HEADER_SIZE + CAPACITY] = bytes([GARBAGE]) * SHORT_TAIL
    writer.write(1, b"b")
    records, stopped, invalid_at = walk(mm, CAPACITY, CAPACITY - SHORT_TAIL - 32, writer.position)
    assert [record.seq for record in records] == [0, 1]
    assert (stopped, invalid_at) == (writer.position, None)


def test_a_pad_at_the_end_is_passed(mm: mmap.mmap) -> None:
    """The producer writes the PAD before the wrapping record when only the tail is free."""
    writer = Writer(mm, CAPACITY - 64)
    writer.pad()
    assert walk(mm, CAPACITY, CAPACITY - 64, CAPACITY) == ([], CAPACITY, None)


def test_limit_stops_right_after_the_last_record_it_returns(mm: mmap.mmap) -> None:
    writer = Writer(mm, CAPACITY - 64)
    writer.write(0, b"a" * 16)
    writer.write(1, b"b" * 40)
    first_end = CAPACITY - 64 + record_size(16)
    end = writer.position
    assert walk(mm, CAPACITY, CAPACITY - 64, end, 1) == (writer.records[:1], first_end, None)
    assert walk(mm, CAPACITY, first_end, end, 1) == (writer.records[1:], end, None)
    assert walk(mm, CAPACITY, 0, 0, 0) == ([], 0, None)


def test_end_before_an_unpublished_record_stops_there(mm: mmap.mmap) -> None:
    writer = Writer(mm)
    writer.write(0, b"a" * 8)
    published = writer.position
    writer.write(1, b"b" * 8)
    assert walk(mm, CAPACITY, 0, published) == (writer.records[:1], published, None)


def test_partial_record_is_invalid(mm: mmap.mmap) -> None:
    """An end that cuts a record in two is not a record boundary."""
    writer = Writer(mm)
    writer.write(0, b"a" * 8)
    writer.write(1, b"b" * 61)
    second = writer.positions[1]
    for cut in (second + RECORD_HEADER_SIZE, writer.position - RECORD_ALIGN):
        assert walk(mm, CAPACITY, 0, cut) == (writer.records[:1], second, second)


@pytest.mark.parametrize(
    "header",
    [
        (RECORD_HEADER_SIZE - 1, KIND_TOKEN),  # shorter than a header
        (RECORD_HEADER_SIZE, 7),  # unknown kind
        (RECORD_HEADER_SIZE, 0),
        (32, KIND_PAD),  # a PAD that does not fill the 64-byte tail
        (72, KIND_TOKEN),  # a record crossing the end of the data area
    ],
)
def test_invalid_header_stops_the_walk(mm: mmap.mmap, header: tuple[int, int]) -> None:
    writer = Writer(mm, CAPACITY - 128)
    writer.write(0, b"a" * 40)
    bad = writer.position
    RECORD.pack_into(mm, HEADER_SIZE + bad, *header, 0, 0, 0, 0)
    end = bad + CAPACITY // 2
    positions: list[int] = []
    found = walk(mm, CAPACITY, CAPACITY - 128, end, positions=positions)
    assert found == (writer.records, bad, bad)
    assert positions == writer.positions


PAYLOAD_LENGTHS = st.lists(st.integers(0, 1200), min_size=1, max_size=30)


@settings(max_examples=200, deadline=None, database=None)
@given(
    start=st.integers(0, 4 * CAPACITY).map(lambda p: p & ~7),
    lengths=PAYLOAD_LENGTHS,
    limit=st.integers(1, 5),
)
def test_walks_in_pieces_equal_one_walk(start: int, lengths: list[int], limit: int) -> None:
    """Whatever the start and the record sizes (so wherever the wraps fall),
    walking ``limit`` records at a time from each stop yields the records
    and positions written, exactly once."""
    with closing(mmap.mmap(-1, HEADER_SIZE + CAPACITY)) as mapping:
        writer = Writer(mapping, start)
        total = 0
        for seq, length in enumerate(lengths):
            size = record_size(length)
            total += size + (writer.room() if size > writer.room() else 0)
            if total > CAPACITY:
                break
            writer.write(seq, bytes([seq]) * length)
        position, records, positions = start, [], []
        while position < writer.position:
            piece, position, invalid_at = walk(mapping, CAPACITY, position, writer.position, limit,
                                               positions)
            assert invalid_at is None
            assert 1 <= len(piece) <= limit
            records += piece
        assert position == writer.position
        assert records == writer.records
        assert positions == writer.positions
