"""End-to-end: the paged KV cache seen through a real daemon (settings, status, metrics, limits)."""

from __future__ import annotations

import time

import pytest

from ringstream.ipc.client import Client, PromptTooLong

pytestmark = pytest.mark.e2e

BLOCK_SIZE = 8
MAX_MODEL_LEN = 256
SHARED = list(range(10, 10 + 6 * BLOCK_SIZE))  # six full blocks
STREAM_TOKENS = 100


def _worker(client: Client):
    (worker,) = client.status().workers
    return worker


def _wait_report(client: Client, check, timeout_s: float = 10.0):
    """The worker's KV figures arrive with its heartbeat: wait for one that satisfies ``check``."""
    deadline = time.monotonic() + timeout_s
    while True:
        worker = _worker(client)
        if check(worker) or time.monotonic() > deadline:
            return worker
        time.sleep(0.05)


@pytest.fixture(scope="module")
def kv_events(tmp_path_factory):
    """The KV events endpoint of the module's daemon."""
    return f"ipc://{tmp_path_factory.mktemp('kv')}/events"


@pytest.fixture(scope="module")
def daemon(start_module_daemon, kv_events):
    return start_module_daemon("--devices", "cpu", "--block-size", str(BLOCK_SIZE), "--max-model-len",
                               str(MAX_MODEL_LEN), "--kv-cache-bytes", str(4 * 2**20), "--max-num-batched-tokens", "64",
                               "--kv-events", kv_events)


def test_kv_events_name_the_prompts_blocks_by_their_tokens_and_keys(daemon, kv_events):
    import msgspec
    import zmq

    from ringstream.daemon.common.prefix_hash import block_hashes
    from ringstream.daemon.worker.kv_events import KVEventBatch, external_block_hash

    prompt = list(range(3000, 3000 + 5 * BLOCK_SIZE + 3))  # five full blocks and a partial one
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(kv_events)
    try:
        time.sleep(0.3)  # the subscription reaches the daemon's PUB socket
        with Client(daemon.address) as client:
            client.complete(prompt_token_ids=prompt, max_tokens=1, temperature=0.0)
        stored, raw = [], None
        while sub.poll(5000):
            _, _, payload = sub.recv_multipart()
            batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
            assert batch.data_parallel_rank == 0
            stored += [e for e in batch.events if type(e).__name__ == "BlockStored"]
            raw = payload
            if sum(len(e.block_hashes) for e in stored) >= 5:
                break
    finally:
        sub.close(linger=0)
        ctx.term()
    keys = [external_block_hash(k) for k in block_hashes(prompt, BLOCK_SIZE)]
    assert [h for e in stored for h in e.block_hashes] == keys
    assert [t for e in stored for t in e.token_ids] == prompt[:5 * BLOCK_SIZE]
    assert stored[0].parent_block_hash is None and {e.block_size for e in stored} == {BLOCK_SIZE}
    _decode_with_vllms_structs(raw)


def _decode_with_vllms_structs(payload: bytes) -> None:
    """Decode ``payload`` with vLLM's own ``KVEventBatch`` where its CPU build's venv is at hand."""
    import subprocess

    from ringstream.tools.bench_vllm import default_vllm_python

    python = default_vllm_python()
    if python is None:
        return
    code = ("import sys, msgspec; from vllm.distributed.kv_events import KVEventBatch; "
            "b = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=KVEventBatch); "
            "print(type(b.events[0]).__name__, b.events[0].block_size)")
    out = subprocess.run([python, "-c", code], input=payload, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().split()[-2:] == ["BlockStored", str(BLOCK_SIZE)]


def test_settings_reach_the_worker_and_status_shows_the_pool(daemon):
    with Client(daemon.address) as client:
        worker = _wait_report(client, lambda w: w.kv_blocks_total > 0)
    # 4 MiB / (8 tokens * 2 * 4 layers * 8 heads * 32 dims * 4 bytes) = 64 blocks, one of them the null block
    assert worker.block_size == BLOCK_SIZE
    assert worker.kv_blocks_total == 63 and worker.kv_cache_tokens == 63 * BLOCK_SIZE
    assert worker.max_model_len == MAX_MODEL_LEN
    assert worker.kv_blocks_free == worker.kv_blocks_total and worker.kv_cache_usage == 0.0


def test_a_shared_prefix_is_served_from_the_cache_with_the_same_tokens(daemon):
    with Client(daemon.address) as client:
        first = client.complete(prompt_token_ids=SHARED + [200], max_tokens=8, temperature=0, ignore_eos=True)
        before = _wait_report(client, lambda w: w.prefix_cache_queries > 0)
        again = client.complete(prompt_token_ids=SHARED + [200], max_tokens=8, temperature=0, ignore_eos=True)
        after = _wait_report(client, lambda w: w.prefix_cache_hits >= before.prefix_cache_hits + len(SHARED))
        metrics = client.status().metrics
    assert again.token_ids == first.token_ids
    assert after.prefix_cache_hits - before.prefix_cache_hits == len(SHARED)
    assert metrics['ringstream_prefix_cache_hits_total{worker=0}'] == after.prefix_cache_hits
    assert metrics['ringstream_kv_cache_blocks{state=total,worker=0}'] == 63


def test_a_request_longer_than_max_model_len_is_refused_and_harms_nothing(daemon):
    with Client(daemon.address) as client:
        with pytest.raises(PromptTooLong):
            client.complete(prompt_token_ids=[5] * (MAX_MODEL_LEN - 4), max_tokens=16)
        done = client.complete(prompt_token_ids=[5, 6, 7], max_tokens=4, temperature=0, ignore_eos=True)
    assert len(done.token_ids) == 4


def test_more_streams_than_the_pool_holds_all_finish_whole(daemon):
    """8 streams of 104 tokens need 104 blocks of a 63-block pool: the worker preempts and resumes."""
    import asyncio

    from ringstream.ipc.client import AsyncClient

    async def main():
        async with AsyncClient(daemon.address) as client:
            return await asyncio.gather(*(
                client.complete(prompt_token_ids=[20 + i, 21, 22, 23], max_tokens=STREAM_TOKENS, temperature=0,
                                ignore_eos=True)
                for i in range(8)
            ))

    with Client(daemon.address) as client:
        preempted_before = _worker(client).preemptions_kv_cache
    results = asyncio.run(main())
    assert [(r.finish_reason, len(r.token_ids)) for r in results] == [("length", STREAM_TOKENS)] * 8
    with Client(daemon.address) as client:
        worker = _wait_report(client, lambda w: w.preemptions_kv_cache > preempted_before
                              and w.kv_blocks_free == w.kv_blocks_total)
        alone = client.complete(prompt_token_ids=[20, 21, 22, 23], max_tokens=STREAM_TOKENS, temperature=0,
                                ignore_eos=True)
        metrics = client.status().metrics
    assert worker.preemptions_kv_cache > preempted_before
    assert worker.kv_blocks_free == worker.kv_blocks_total  # no leaked block
    assert alone.token_ids == results[0].token_ids  # preempted and resumed: the same greedy tokens
    assert metrics["ringstream_preemptions_total{cause=kv_cache,worker=0}"] >= worker.preemptions_kv_cache


def test_a_restarted_worker_tells_a_subscriber_that_stayed_connected_to_clear(daemon, kv_events):
    # last in this module: it kills the daemon's worker. The subscriber's connection breaks and ZeroMQ
    # reconnects it to the new worker, whose opening clear waits for it; its sequence goes on increasing.
    import os
    import signal

    import msgspec
    import zmq

    from ringstream.daemon.worker.kv_events import AllBlocksCleared, KVEventBatch

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(kv_events)
    try:
        time.sleep(0.3)
        with Client(daemon.address) as client:
            client.complete(prompt_token_ids=list(range(3100, 3100 + 2 * BLOCK_SIZE)), max_tokens=1)
        assert sub.poll(5000)
        before = int.from_bytes(sub.recv_multipart()[1], "big")
        (worker_pid,) = daemon.worker_pids()
        os.kill(worker_pid, signal.SIGKILL)
        assert sub.poll(60_000), "no batch from the restarted worker"
        _, seq, payload = sub.recv_multipart()
        batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
        assert batch.events == [AllBlocksCleared()] and int.from_bytes(seq, "big") > before
    finally:
        sub.close(linger=0)
        ctx.term()
    with Client(daemon.address) as client:  # the daemon serves on with its new worker
        _wait_report(client, lambda w: w.alive)
        assert client.complete(prompt_token_ids=[5, 6, 7], max_tokens=2).usage.completion_tokens == 2
