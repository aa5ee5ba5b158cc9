"""KV events publisher: vLLM's wire format over real ZeroMQ sockets, replay, bounded queue, never blocking."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from ringstream.daemon.common.config import Config
from ringstream.daemon.common.listen import check_endpoints_free, offset_endpoint
from ringstream.daemon.engine.block_manager import BlocksCleared, BlocksRemoved, BlocksStored
from ringstream.daemon.front.worker_pool import kv_events_spec
from ringstream.daemon.worker import kv_events as K
from ringstream.daemon.worker.spec import KVEventsSpec

DECODER = msgspec.msgpack.Decoder(K.KVEventBatch)
KEY_A, KEY_B = bytes(range(32)), bytes(range(32, 64))


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)  # closes what a failed test left open


@pytest.fixture
def endpoints(tmp_path):
    return f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/kv-replay"


def subscriber(ctx, endpoint, topic=b""):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def receive(sub, timeout_s=5.0):
    assert sub.poll(int(timeout_s * 1000)), "no KV events message"
    topic, seq, payload = sub.recv_multipart()
    return topic, int.from_bytes(seq, "big"), DECODER.decode(payload)


def replayed(ctx, endpoint, start, count):
    """``count`` ``(seq, batch)`` of a replay from ``start`` (a DEALER: the answer is many messages)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    out = []
    deadline = time.monotonic() + 5
    try:
        while len(out) < count and time.monotonic() < deadline:  # batches still queued are not yet buffered
            out = []
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                assert dealer.poll(5000), "no replay answer"
                empty, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if seq == K.END_SEQ:
                    assert payload == b""
                    break
                out.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    finally:
        dealer.close()
    return out


def publisher(ctx, endpoints, replay=True, topic=""):
    spec = KVEventsSpec(endpoint=endpoints[0], replay_endpoint=endpoints[1] if replay else None, topic=topic,
                        rank=3, block_size=4)
    return K.KVEventPublisher(spec, ctx)


def test_batches_are_vllms_wire_format_in_sequence(ctx, endpoints):
    pub = publisher(ctx, endpoints, topic="kv")
    sub = subscriber(ctx, endpoints[0], b"kv")
    try:
        # the opening clear waits for the first subscriber (ZeroMQ's slow joiner would lose it)
        topic, first_seq, first = receive(sub)
        assert topic == b"kv" and first.events == [K.AllBlocksCleared()] and first.data_parallel_rank == 3
        assert abs(first_seq - time.time_ns() // 1000) < 60 * 10**6  # from the start's microseconds
        ((seq, _),) = replayed(ctx, endpoints[1], 0, 1)
        assert seq == first_seq
        pub.publish([BlocksStored([KEY_A, KEY_B], None, [1, 2, 3, 4, 5, 6, 7, 8]), BlocksRemoved([KEY_A])])
        topic, seq, batch = receive(sub)
        assert (topic, seq) == (b"kv", first_seq + 1)
        stored, removed = batch.events
        assert stored == K.BlockStored(block_hashes=[K.external_block_hash(KEY_A), K.external_block_hash(KEY_B)],
                                       parent_block_hash=None, token_ids=[1, 2, 3, 4, 5, 6, 7, 8], block_size=4)
        assert stored.medium == "GPU" and removed.block_hashes == [K.external_block_hash(KEY_A)]
        assert abs(batch.ts - time.time()) < 60
    finally:
        pub.close()
        sub.close()


def test_the_raw_encoding_is_an_array_batch_of_tagged_maps_with_every_field():
    # what vLLM's msgspec structs (array_like batch, tag=True events whose lora_id / medium / lora_name have
    # no defaults) and vllm-router's decoder read
    batch = K.KVEventBatch(ts=1.5, events=[K.BlockStored(block_hashes=[7], parent_block_hash=3, token_ids=[1],
                                                         block_size=1), K.BlockRemoved(block_hashes=[7]),
                                           K.AllBlocksCleared()], data_parallel_rank=0)
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert raw == [1.5, [{"type": "BlockStored", "block_hashes": [7], "parent_block_hash": 3, "token_ids": [1],
                          "block_size": 1, "lora_id": None, "medium": "GPU", "lora_name": None},
                         {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
                         {"type": "AllBlocksCleared"}], 0]


def test_external_hash_is_the_keys_last_eight_bytes_unsigned():
    assert K.external_block_hash(b"\x00" * 24 + b"\xff" * 8) == 2**64 - 1
    assert K.external_block_hash(KEY_A) == int.from_bytes(KEY_A, "big") & (2**64 - 1)


def test_replay_resends_buffered_batches_from_the_asked_sequence(ctx, endpoints):
    pub = publisher(ctx, endpoints)
    try:
        pub._hold_until = 0  # no subscriber: send at once
        for i in range(3):
            pub.publish([BlocksRemoved([bytes([i]) * 32])])
        first = replayed(ctx, endpoints[1], 0, 4)[0][0]
        answer = replayed(ctx, endpoints[1], first + 2, 2)
        assert [seq for seq, _ in answer] == [first + 2, first + 3]
        for seq, batch in answer:
            assert batch.events[0].block_hashes == [K.external_block_hash(bytes([seq - first - 1]) * 32)]
    finally:
        pub.close()


def test_publish_never_blocks_and_after_a_full_queue_the_next_batch_queued_clears_first(ctx, endpoints,
                                                                                      monkeypatch):
    monkeypatch.setattr(K, "MAX_QUEUED_BATCHES", 5)
    pub = publisher(ctx, endpoints, replay=False)
    pub._running = False  # the thread stops sending: the queue fills
    pub._wake.set()
    pub._thread.join(5)
    pub._queue.clear()  # the opening clear, if the thread stopped before sending it
    stored = BlocksStored([KEY_A], None, [1, 2, 3, 4])
    started = time.perf_counter()
    for _ in range(1000):  # no subscriber, no thread: each call returns at once
        pub.publish([stored])
    assert time.perf_counter() - started < 1.0
    assert len(pub._queue) == 5 and pub.dropped == 995
    queued = [events for _, events in pub._queue]
    assert all(events == [stored] for events in queued)  # batches queued before the loss are sent as they are
    pub._queue.clear()
    pub.publish([BlocksRemoved([KEY_A])])
    (_, events), = pub._queue
    assert events == [BlocksCleared(), BlocksRemoved([KEY_A])]  # the clear follows every dropped batch
    pub.publish([BlocksRemoved([KEY_B])])
    assert [e for _, e in pub._queue][-1] == [BlocksRemoved([KEY_B])]  # one clear per loss
    pub.close()


def test_a_replay_answer_is_whole_for_a_reader_that_starts_late(ctx, endpoints, monkeypatch):
    monkeypatch.setattr(K, "REPLAY_BUFFER_BATCHES", 3000)
    pub = publisher(ctx, endpoints)
    pub._hold_until = 0
    try:
        for i in range(2999):
            pub.publish([BlocksStored([i.to_bytes(32, "big")], None, list(range(4)))])
        deadline = time.monotonic() + 30
        while len(pub._buffer) < 3000 and time.monotonic() < deadline:
            time.sleep(0.05)
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoints[1])
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        time.sleep(1.5)  # a reader that starts late: the ROUTER holds the whole answer for it
        count = 0
        while dealer.poll(5000):
            _, seq, _ = dealer.recv_multipart()
            if seq == K.END_SEQ:
                break
            count += 1
        assert count == 3000
        dealer.close()
    finally:
        pub.close()


def test_a_tcp_endpoint_in_use_fails_the_second_publisher_with_zmq_error(ctx):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoints = (f"tcp://127.0.0.1:{port}", None)
    pub = publisher(ctx, endpoints, replay=False)
    try:
        with pytest.raises(zmq.ZMQError):
            publisher(ctx, endpoints, replay=False)
    finally:
        pub.close()


@pytest.mark.parametrize("endpoint,index,expected", [
    ("tcp://127.0.0.1:5557", 0, "tcp://127.0.0.1:5557"), ("tcp://*:5557", 2, "tcp://*:5559"),
    ("ipc:///run/kv", 1, "ipc:///run/kv.1"), ("ipc:///run/kv", 0, "ipc:///run/kv")])
def test_each_worker_gets_its_own_endpoint(endpoint, index, expected):
    assert offset_endpoint(endpoint, index) == expected


@pytest.mark.parametrize("settings,words", [
    ({"kv_events_endpoint": "udp://x:1"}, "tcp://HOST:PORT"),
    ({"kv_events_endpoint": "tcp://host"}, "tcp://HOST:PORT"),
    ({"kv_events_endpoint": "tcp://host:99999"}, "out of 1..65535"),
    ({"kv_events_replay_endpoint": "tcp://h:1"}, "kv_events_endpoint is not"),
    ({"kv_events_endpoint": "tcp://h:1", "kv_events_replay_endpoint": "tcp://h:1"}, "must differ"),
])
def test_bad_settings_are_refused_naming_them(settings, words):
    with pytest.raises(ValueError, match=words):
        Config(**settings).check()


def test_the_front_gives_each_worker_its_ports_and_rank():
    config = Config(kv_events_endpoint="tcp://*:6000", kv_events_replay_endpoint="tcp://*:7000",
                    kv_events_topic="t", block_size=32).check()
    spec = kv_events_spec(config, 1)
    assert spec == KVEventsSpec("tcp://*:6001", "tcp://*:7001", "t", 1, 32)
    assert kv_events_spec(Config(), 0) is None


def test_endpoints_that_cannot_be_bound_are_refused_before_any_worker_starts():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for endpoints, words in [
            ([f"tcp://127.0.0.1:{port}"], "cannot bind"),  # in use
            (["tcp://nosuchhost.invalid:5557"], "cannot bind"),
            (["tcp://127.0.0.1:5001", "tcp://127.0.0.1:5001"], "given twice"),  # worker 1's port = replay's
            (["ipc:///" + "x" * 120], "longer than a unix socket"),
        ]:
            with pytest.raises(ValueError, match=words):
                check_endpoints_free(endpoints)
    check_endpoints_free(["tcp://127.0.0.1:0", "tcp://*:0"])
