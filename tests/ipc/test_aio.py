"""SocketPump: every message delivered from an asyncio loop, also after sends took the read edge."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from ringstream.ipc.aio import SocketPump


@pytest.fixture
def pair():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://aio-test")
    b.connect("inproc://aio-test")
    yield a, b
    a.close(linger=0)
    b.close(linger=0)
    ctx.term()


async def _until(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.001)


def test_messages_sent_before_and_after_start_arrive_in_order(pair):
    a, b = pair
    got: list[bytes] = []

    async def main():
        b.send(b"early")
        pump = SocketPump(a, got.append, batch=4)
        pump.start()
        for i in range(100):
            b.send(str(i).encode())
        await _until(lambda: len(got) == 101)
        pump.stop()

    asyncio.run(main())
    assert got == [b"early"] + [str(i).encode() for i in range(100)]


def test_a_batch_limit_yields_the_loop_between_batches(pair):
    a, b = pair
    got: list[bytes] = []
    ticks: list[int] = []

    async def ticker():
        while True:
            ticks.append(len(got))
            await asyncio.sleep(0)

    async def main():
        for i in range(50):
            b.send(b"x")
        pump = SocketPump(a, got.append, batch=10)
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        pump.start()
        await _until(lambda: len(got) == 50)
        task.cancel()
        pump.stop()

    asyncio.run(main())
    assert any(0 < n < 50 for n in ticks), ticks  # other tasks ran while the pump was part-way


def test_replies_to_sends_keep_flowing_with_kicks(pair):
    """Ping-pong: each reply is sent from the handler, the pattern that consumes the socket's read edge."""
    a, b = pair
    got: list[bytes] = []
    pump: SocketPump

    def on_message(msg: bytes) -> None:
        got.append(msg)
        a.send(msg + b"!")
        pump.kick()

    async def main():
        nonlocal pump
        pump = SocketPump(a, on_message)
        pump.start()
        for i in range(200):
            b.send(str(i).encode())
            while not b.poll(0):
                await asyncio.sleep(0)
            assert b.recv() == str(i).encode() + b"!"
        pump.stop()

    asyncio.run(main())
    assert len(got) == 200


def test_a_handler_exception_loses_no_later_message(pair):
    a, b = pair
    got: list[bytes] = []
    errors: list[BaseException] = []

    def on_message(msg: bytes) -> None:
        if msg == b"bad":
            raise ValueError("boom")
        got.append(msg)

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx.get("exception")))
        for msg in (b"1", b"bad", b"2", b"3"):
            b.send(msg)
        pump = SocketPump(a, on_message)
        pump.start()
        await _until(lambda: len(got) == 3)
        pump.stop()

    asyncio.run(main())
    assert got == [b"1", b"2", b"3"]
    assert len(errors) == 1 and isinstance(errors[0], ValueError)


def test_multipart_messages_come_as_frames(pair):
    a, b = pair
    got = []

    async def main():
        pump = SocketPump(a, got.append, multipart=True)
        pump.start()
        b.send_multipart([b"id", b"payload"])
        await _until(lambda: got)
        pump.stop()

    asyncio.run(main())
    assert [frame.bytes for frame in got[0]] == [b"id", b"payload"]
