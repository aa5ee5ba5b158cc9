"""Tests of daemon.engine: greedy equality with ``generate``, continuous batching,
abort, resume, seeded sampling, stop conditions and request validation.

The tiny random-init factory model is used throughout; the greedy-equality test
also runs on ``daemon/default_model`` when that checkpoint is present.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from daemon.engine import (
    CapacityError,
    Engine,
    EngineError,
    EngineRequest,
    SamplingParams,
    TokenOutput,
)
from tests.factories import load_model, load_tokenizer, make_tiny_model_dir

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / "daemon" / "default_model"

CORPUS = (
    "The engine keeps a static cache with one row per slot. Requests join and leave the batch "
    "at every step, so a short request never waits for a long one. Привет, мир! 你好，世界！ 🙂 "
    "Each greedy output must equal the model's own generate() on the prompt alone, token for token."
)


class Model:
    """A loaded model with its tokenizer and EOS ids."""

    def __init__(self, model, tokenizer, eos_token_ids: tuple[int, ...]) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids

    def engine(self, **kwargs) -> Engine:
        kwargs.setdefault("eos_token_ids", self.eos_token_ids)
        return Engine(self.model, self.tokenizer, **kwargs)

    def prompts(self, lengths: list[int]) -> list[list[int]]:
        """Prompts of the given token lengths: BOS then corpus tokens from varying offsets."""
        ids = self.tokenizer.encode(CORPUS).ids
        body = ids[1:]
        return [[ids[0]] + (body * 4)[offset : offset + n - 1] for offset, n in enumerate(lengths)]

    def reference(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Greedy ``model.generate`` on ``prompt`` alone; the generated ids (EOS included)."""
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=list(self.eos_token_ids),
            pad_token_id=self.eos_token_ids[0],
        )
        input_ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = self.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
            )
        return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """Run this module's tiny models on one intra-op thread.

    Their matrices are too small to gain from more, and on a busy host extra
    OpenMP threads that wait for each other slow every forward down by orders
    of magnitude.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Model:
    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))
    model = load_model(model_dir)
    return Model(model, load_tokenizer(model_dir), (model.generation_config.eos_token_id,))


def load_default_model() -> Model:
    from daemon.model import load_model as load_daemon_model
    from daemon.model import load_tokenizer as load_daemon_tokenizer
    from daemon.model import resolve_model_dir

    info = resolve_model_dir(DEFAULT_MODEL_DIR)
    return Model(load_daemon_model(info), load_daemon_tokenizer(info), info.eos_token_ids)


def run(engine: Engine, schedule: dict[int, list[EngineRequest]]) -> dict[int, list[TokenOutput]]:
    """Step until idle; outputs per handle.

    ``schedule[step]`` requests arrive before that step and are added as soon
    as the engine has capacity (as the worker does).
    """
    outputs: dict[int, list[TokenOutput]] = {}
    backlog: list[EngineRequest] = []
    step = 0
    while engine.has_unfinished() or backlog or any(s >= step for s in schedule):
        backlog.extend(schedule.get(step, []))
        while backlog and engine.num_running + engine.num_waiting < engine.max_num_seqs:
            request = backlog.pop(0)
            engine.add(request)
            outputs[request.handle] = []
        for out in engine.step():
            outputs[out.handle].append(out)
        step += 1
    return outputs


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def check_stream(outs: list[TokenOutput], request: EngineRequest, first_seq: int = 0) -> None:
    """Sequence numbers are contiguous and only the last output carries a finish reason."""
    assert [o.seq for o in outs] == list(range(first_seq, first_seq + len(outs)))
    assert [o.token_id for o in outs] == request.output_token_ids[first_seq:]
    assert all(o.finish_reason is None for o in outs[:-1])
    assert outs[-1].finish_reason in ("stop", "length")
    assert outs[-1].num_output_tokens == len(request.output_token_ids)
    assert outs[-1].num_prompt_tokens == len(request.prompt_token_ids)


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_greedy_matches_generate_alone(which, tiny):
    if which == "default":
        if not (DEFAULT_MODEL_DIR / "config.json").is_file():
            pytest.skip("daemon/default_model is not present")
        model = load_default_model()
    else:
        model = tiny
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 55, 7, 12, 40, 4, 30, 17, 9, 60, 25]
    max_tokens = [6 + (3 * i) % 19 for i in range(len(lengths))]
    requests = [
        EngineRequest(i, prompt, greedy(n)) for i, (prompt, n) in enumerate(zip(model.prompts(lengths), max_tokens))
    ]
    # Six slots for 18 requests, added over several steps: requests wait, join
    # while others decode, and reuse freed slots.
    schedule = {0: requests[:4], 1: requests[4:7], 3: requests[7:12], 6: requests[12:15], 9: requests[15:]}
    engine = model.engine(max_num_seqs=6)
    engine.warmup()
    outputs = run(engine, schedule)
    for request in requests:
        expected = model.reference(request.prompt_token_ids, request.params.max_tokens)
        assert request.output_token_ids == expected, f"request {request.handle}"
        outs = outputs[request.handle]
        check_stream(outs, request)
        last = outs[-1]
        if expected[-1] in model.eos_token_ids:
            assert (last.finish_reason, last.stop_reason) == ("stop", None)
        else:
            assert last.finish_reason == "length"
        text = "".join(o.text for o in outs)
        assert text == model.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
    assert engine.num_running == engine.num_waiting == 0
    assert engine.step() == []


def test_mid_stream_request_starts_early_and_reuses_slot(tiny):
    engine = tiny.engine(max_num_seqs=3)
    long_a, long_b = (
        EngineRequest(h, p, greedy(30, ignore_eos=True)) for h, p in zip((0, 1), tiny.prompts([9, 14]))
    )
    engine.add(long_a)
    engine.add(long_b)
    for _ in range(3):
        engine.step()
    short = EngineRequest(2, tiny.prompts([5])[0], greedy(2, ignore_eos=True))
    engine.add(short)
    first = engine.step()
    assert [o.handle for o in first if o.handle == 2] == [2]
    short_slot = engine._by_handle[2].slot
    second = engine.step()
    finished = {o.handle: o.finish_reason for o in second}
    assert finished == {0: None, 1: None, 2: "length"}
    assert engine.num_running == 2

    reuse = EngineRequest(3, tiny.prompts([11])[0], greedy(6, ignore_eos=True))
    engine.add(reuse)
    engine.step()
    assert engine._by_handle[3].slot == short_slot
    while engine.has_unfinished():
        engine.step()
    for request in (long_a, long_b, short, reuse):
        expected = tiny.reference(request.prompt_token_ids, request.params.max_tokens)
        n = len(request.output_token_ids)
        # EOS is ignored by the engine here, so compare up to generate's EOS.
        assert request.output_token_ids[: len(expected)] == expected[:n]


def test_prefill_token_budget(tiny):
    engine = tiny.engine(max_num_seqs=4, max_num_batched_tokens=24)
    prompts = tiny.prompts([10, 10, 10, 40])
    requests = [EngineRequest(i, p, greedy(3, ignore_eos=True)) for i, p in enumerate(prompts)]
    for request in requests:
        engine.add(request)
    admitted = []
    while engine.has_unfinished():
        engine.step()
        admitted.append(engine.num_running + sum(1 for r in requests if len(r.output_token_ids) == 3))
    # 2 rows x 10 tokens fit in 24, a third does not; the 40-token prompt exceeds the
    # budget on its own and is prefilled alone.
    assert admitted[:3] == [2, 3, 4]


def test_abort_frees_slot_immediately(tiny):
    engine = tiny.engine(max_num_seqs=2, max_num_batched_tokens=16)
    a, b = (EngineRequest(h, p, greedy(20, ignore_eos=True)) for h, p in zip((0, 1), tiny.prompts([10, 10])))
    engine.add(a)
    engine.add(b)
    engine.step()
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    assert engine.abort(1)
    assert engine.num_waiting == 0
    engine.add(EngineRequest(5, [0, 1], greedy(2)))
    with pytest.raises(CapacityError):
        engine.add(EngineRequest(6, [0, 1], greedy(2)))
    assert engine.abort(5)
    engine.step()
    assert engine.abort(0)
    assert engine.num_running == 0
    assert not engine.has_unfinished()
    assert not engine.abort(0)
    assert not engine.abort(123)
    assert engine.step() == []
    c = EngineRequest(7, tiny.prompts([6])[0], greedy(4, ignore_eos=True))
    engine.add(c)
    outs = engine.step()
    assert [o.handle for o in outs] == [7]
    assert engine._by_handle[7].slot == 0


@pytest.mark.parametrize("params", [greedy(12, ignore_eos=True), SamplingParams(12, 0.9, seed=7, ignore_eos=True)])
def test_resume_continues_exactly(tiny, params):
    prompt = tiny.prompts([15])[0]
    full = EngineRequest(0, prompt, params)
    full_outs = run(tiny.engine(max_num_seqs=2), {0: [full]})[0]
    for k in (1, 5, 11):
        resumed = EngineRequest(1, prompt, params, output_token_ids=full.output_token_ids[:k])
        outs = run(tiny.engine(max_num_seqs=2), {0: [resumed]})[1]
        assert resumed.output_token_ids == full.output_token_ids
        check_stream(outs, resumed, first_seq=k)
        before = "".join(o.text for o in full_outs[:k])
        assert before + "".join(o.text for o in outs) == "".join(o.text for o in full_outs)


def test_seeded_sampling_ignores_batch_companions(tiny):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    prompt = tiny.prompts([12])[0]
    alone = EngineRequest(0, prompt, params)
    run(tiny.engine(max_num_seqs=4), {0: [alone]})

    companions = [
        EngineRequest(10, tiny.prompts([30])[0], greedy(20, ignore_eos=True)),
        EngineRequest(11, tiny.prompts([7])[0], SamplingParams(max_tokens=20, temperature=1.3, ignore_eos=True)),
        EngineRequest(12, tiny.prompts([3])[0], SamplingParams(max_tokens=5, top_k=5, seed=9, ignore_eos=True)),
    ]
    crowded = EngineRequest(1, prompt, params)
    run(tiny.engine(max_num_seqs=4, seed=99), {0: companions, 2: [crowded]})
    assert crowded.output_token_ids == alone.output_token_ids


def test_top_k_one_equals_greedy(tiny):
    prompt = tiny.prompts([20])[0]
    reference = EngineRequest(0, prompt, greedy(12, ignore_eos=True))
    top1 = EngineRequest(1, prompt, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, ignore_eos=True))
    run(tiny.engine(max_num_seqs=2), {0: [reference, top1]})
    assert top1.output_token_ids == reference.output_token_ids


def test_unseeded_sampling_varies(tiny):
    engine = tiny.engine(max_num_seqs=8)
    prompt = tiny.prompts([10])[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    first = [EngineRequest(i, prompt, params) for i in range(4)]
    second = [EngineRequest(i + 4, prompt, params) for i in range(4)]
    run(engine, {0: first})
    run(engine, {0: second})
    sequences = {tuple(r.output_token_ids) for r in first + second}
    assert len(sequences) >= 7


def test_same_engine_seed_reproduces_unseeded_sampling(tiny):
    prompt = tiny.prompts([10])[0]
    results = []
    for _ in range(2):
        request = EngineRequest(0, prompt, SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True))
        run(tiny.engine(max_num_seqs=2, seed=5), {0: [request]})
        results.append(request.output_token_ids)
    assert results[0] == results[1]


def free_run(tiny, n: int = 24) -> tuple[EngineRequest, list[TokenOutput]]:
    request = EngineRequest(0, tiny.prompts([18])[0], greedy(n, ignore_eos=True))
    return request, run(tiny.engine(max_num_seqs=2), {0: [request]})[0]


def test_stop_string_across_tokens(tiny):
    request, outs = free_run(tiny)
    texts = [o.text for o in outs]
    full = "".join(texts)
    offset = 0
    for i in range(len(texts) - 1):
        offset += len(texts[i])
        if texts[i] and texts[i + 1]:
            stop = texts[i][-1] + texts[i + 1][0]
            if full.find(stop) == offset - 1:
                break
    else:
        pytest.fail("no token boundary with text on both sides")
    stopped = EngineRequest(1, request.prompt_token_ids, greedy(24, ignore_eos=True, stop=(stop,)))
    stop_outs = run(tiny.engine(max_num_seqs=2), {0: [stopped]})[1]
    check_stream(stop_outs, stopped)
    assert (stop_outs[-1].finish_reason, stop_outs[-1].stop_reason) == ("stop", stop)
    assert len(stop_outs) == i + 2
    assert "".join(o.text for o in stop_outs) == full[: offset - 1]


def test_stop_token_id_and_eos(tiny):
    request, _ = free_run(tiny)
    ids = request.output_token_ids
    index = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    stop_id = ids[index]
    expected_text = tiny.tokenizer.decode(ids[:index], skip_special_tokens=True)

    by_stop = EngineRequest(1, request.prompt_token_ids, greedy(24, ignore_eos=True, stop_token_ids=(stop_id,)))
    outs = run(tiny.engine(max_num_seqs=2), {0: [by_stop]})[1]
    assert by_stop.output_token_ids == ids[: index + 1]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", stop_id)
    assert "".join(o.text for o in outs) == expected_text

    by_eos = EngineRequest(2, request.prompt_token_ids, greedy(24))
    outs = run(tiny.engine(max_num_seqs=2, eos_token_ids=(stop_id,)), {0: [by_eos]})[2]
    assert by_eos.output_token_ids == ids[: index + 1]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", None)
    assert "".join(o.text for o in outs) == expected_text

    ignoring = EngineRequest(3, request.prompt_token_ids, greedy(24, ignore_eos=True))
    run(tiny.engine(max_num_seqs=2, eos_token_ids=(stop_id,)), {0: [ignoring]})
    assert ignoring.output_token_ids == ids


def test_max_tokens_and_context_limit(tiny):
    engine = tiny.engine(max_num_seqs=4, max_model_len=24)
    capped = EngineRequest(0, tiny.prompts([5])[0], greedy(3, ignore_eos=True))
    by_context = EngineRequest(1, tiny.prompts([20])[0], greedy(100, ignore_eos=True))
    last_slot = EngineRequest(2, tiny.prompts([23])[0], greedy(100, ignore_eos=True))
    outputs = run(engine, {0: [capped, by_context, last_slot]})
    assert [(o[-1].finish_reason, o[-1].num_output_tokens) for o in outputs.values()] == [
        ("length", 3),
        ("length", 4),
        ("length", 1),
    ]
    with pytest.raises(ValueError):
        engine.add(EngineRequest(3, tiny.prompts([24])[0], greedy(1)))
    with pytest.raises(ValueError):
        engine.add(EngineRequest(4, tiny.prompts([20])[0], greedy(5), output_token_ids=[5, 6, 7, 8]))


def test_add_validation(tiny):
    engine = tiny.engine(max_num_seqs=2)
    vocab = tiny.model.config.vocab_size
    bad = [
        EngineRequest(0, [], greedy(4)),
        EngineRequest(0, [0, vocab], greedy(4)),
        EngineRequest(0, [0, -1], greedy(4)),
        EngineRequest(0, [0, 5], greedy(0)),
        EngineRequest(0, [0, 5], SamplingParams(temperature=-1.0)),
        EngineRequest(0, [0, 5], SamplingParams(top_p=0.0)),
        EngineRequest(0, [0, 5], SamplingParams(top_k=-2)),
        EngineRequest(0, [0, 5], greedy(2), output_token_ids=[7, 8]),
    ]
    for request in bad:
        with pytest.raises(ValueError):
            engine.add(request)
    engine.add(EngineRequest(0, [0, 5], greedy(4)))
    with pytest.raises(ValueError):
        engine.add(EngineRequest(0, [0, 6], greedy(4)))
    engine.add(EngineRequest(1, [0, 6], greedy(4)))
    with pytest.raises(CapacityError):
        engine.add(EngineRequest(2, [0, 7], greedy(4)))
    with pytest.raises(EngineError):
        engine.warmup()


def test_cache_geometry(tiny):
    engine = tiny.engine(max_num_seqs=3, max_model_len=100)
    config = tiny.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert engine.kv_cache_tokens == 300
    per_layer = 3 * config.num_key_value_heads * 101 * head_dim * 4
    assert engine.kv_cache_bytes == 2 * config.num_hidden_layers * per_layer
    with pytest.raises(ValueError):
        tiny.engine(max_model_len=config.max_position_embeddings + 1)


def test_randomized_churn_keeps_outputs_exact(tiny):
    """Random arrivals, aborts and mixed sampling: greedy and seeded requests
    still produce exactly what they produce alone, and every stream is well formed."""
    rng = random.Random(2024)
    engine = tiny.engine(max_num_seqs=5, max_num_batched_tokens=64)
    lengths = [rng.randrange(1, 50) for _ in range(30)]
    requests = []
    for handle, prompt in enumerate(tiny.prompts(lengths)):
        kind = rng.choice(["greedy", "seeded", "random"])
        n = rng.randrange(1, 16)
        if kind == "greedy":
            params = greedy(n)
        elif kind == "seeded":
            params = SamplingParams(max_tokens=n, temperature=0.7, top_k=rng.choice([0, 20]), seed=handle)
        else:
            params = SamplingParams(max_tokens=n, temperature=1.2, top_p=0.8)
        requests.append((kind, EngineRequest(handle, prompt, params)))

    outputs: dict[int, list[TokenOutput]] = {}
    aborted: set[int] = set()
    pending = list(requests)
    while pending or engine.has_unfinished():
        while pending and engine.num_running + engine.num_waiting < engine.max_num_seqs and rng.random() < 0.6:
            _, request = pending.pop(0)
            engine.add(request)
            outputs[request.handle] = []
        unfinished = [
            h for h, outs in outputs.items() if h not in aborted and (not outs or outs[-1].finish_reason is None)
        ]
        if unfinished and rng.random() < 0.1:
            victim = rng.choice(unfinished)
            assert engine.abort(victim)
            aborted.add(victim)
        for out in engine.step():
            assert out.handle not in aborted
            outputs[out.handle].append(out)
        assert engine.num_running <= engine.max_num_seqs

    for kind, request in requests:
        if request.handle in aborted:
            continue
        check_stream(outputs[request.handle], request)
        if kind == "greedy":
            expected = tiny.reference(request.prompt_token_ids, request.params.max_tokens)
            assert request.output_token_ids == expected
        elif kind == "seeded":
            alone = EngineRequest(request.handle, request.prompt_token_ids, request.params)
            run(tiny.engine(max_num_seqs=1), {0: [alone]})
            assert request.output_token_ids == alone.output_token_ids
