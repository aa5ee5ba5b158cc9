"""Tests of daemon.engine: greedy equality with ``generate``, continuous batching over the
paged KV cache (token budget and chunked prefill, prefix caching, recompute preemption, block
accounting), abort, resume, seeded sampling, failure isolation, stop conditions and request
validation.

The tiny random-init factory model is used throughout; the greedy-equality test
also runs on ``daemon/default_model`` when that checkpoint is present.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from ringstream.daemon.common.model_dir import ModelRefused
from ringstream.daemon.engine.engine import (
    CapacityError,
    Engine,
    EngineConfig,
    EngineError,
    EngineRequest,
    PromptTooLong,
    RequestError,
    SamplingParams,
    TokenOutput,
)
from tests.factories import TINY_VOCAB_SIZE, load_model, load_tokenizer, make_tiny_model_dir

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / "daemon" / "default_model"

CORPUS = (
    "The engine keeps keys and values in a paged cache of fixed-size blocks. Requests join and leave "
    "the batch at every step, so a short request never waits for a long one. Привет, мир! 你好，世界！ 🙂 "
    "Each greedy output must equal the model's own generate() on the prompt alone, token for token."
)


class Model:
    """A loaded model with its tokenizer and EOS ids."""

    def __init__(self, model, tokenizer, eos_token_ids: tuple[int, ...]) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._references: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def engine(self, **kwargs) -> Engine:
        eos_token_ids = kwargs.pop("eos_token_ids", self.eos_token_ids)
        return Engine(self.model, self.tokenizer, EngineConfig(**kwargs), eos_token_ids=eos_token_ids)

    def prompts(self, lengths: list[int]) -> list[list[int]]:
        """Prompts of the given token lengths: BOS then corpus tokens from varying offsets."""
        ids = self.tokenizer.encode(CORPUS).ids
        body = ids[1:]
        return [[ids[0]] + (body * 4)[offset : offset + n - 1] for offset, n in enumerate(lengths)]

    def reference(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Greedy ``model.generate`` on ``prompt`` alone; the generated ids (EOS included). Memoised."""
        key = (tuple(prompt), max_new_tokens)
        if key in self._references:
            return list(self._references[key])
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
        self._references[key] = out[0, len(prompt) :].tolist()
        return list(self._references[key])

    def check_greedy(self, request: EngineRequest, max_tokens: int | None = None) -> None:
        """``request`` (greedy) produced what ``generate`` produces on its prompt alone.

        ``max_tokens`` defaults to the request's. A request that ignores EOS is
        compared up to ``generate``'s EOS.
        """
        expected = self.reference(request.prompt_token_ids, max_tokens or request.params.max_tokens)
        got = request.output_token_ids
        if request.params.ignore_eos:
            got = got[: len(expected)]
        assert got == expected, f"request {request.handle}"


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
    from ringstream.daemon.engine.loader import load_model as load_daemon_model
    from ringstream.daemon.common.model_dir import load_tokenizer as load_daemon_tokenizer
    from ringstream.daemon.common.model_dir import resolve_model_dir

    info = resolve_model_dir(DEFAULT_MODEL_DIR)
    return Model(load_daemon_model(info), load_daemon_tokenizer(info), info.eos_token_ids)


@dataclass
class StepRecord:
    """What one ``engine.step()`` produced."""

    emitted: set[int]
    """Handles that got a token."""
    finished: set[int]
    """Handles whose last token it was."""
    failed: set[int]
    """Handles ended with a RequestError."""
    num_preemptions: int
    """``engine.stats().num_preemptions`` after the step."""


def run(engine: Engine, schedule: dict[int, list[EngineRequest]],
        trace: list[StepRecord] | None = None) -> dict[int, list[TokenOutput | RequestError]]:
    """Step until idle; outputs per handle.

    ``schedule[step]`` requests arrive before that step and are added as soon
    as the engine has capacity (as the worker does). When ``trace`` is given,
    one :class:`StepRecord` per step is appended to it.
    """
    outputs: dict[int, list[TokenOutput | RequestError]] = {}
    backlog: list[EngineRequest] = []
    step = 0
    while engine.has_unfinished() or backlog or any(s >= step for s in schedule):
        backlog.extend(schedule.get(step, []))
        while backlog and engine.stats().num_running + engine.stats().num_waiting < engine.max_num_seqs:
            request = backlog.pop(0)
            engine.add(request)
            outputs[request.handle] = []
        record = StepRecord(set(), set(), set(), 0)
        for out in engine.step():
            outputs.setdefault(out.handle, []).append(out)
            if isinstance(out, RequestError):
                record.failed.add(out.handle)
                continue
            assert out.handle not in record.emitted, "two tokens for one request in one step"
            record.emitted.add(out.handle)
            if out.finish_reason is not None:
                record.finished.add(out.handle)
        record.num_preemptions = engine.stats().num_preemptions
        if trace is not None:
            trace.append(record)
        step += 1
    return outputs


def preemption_events(trace: list[StepRecord]) -> list[tuple[int, set[int]]]:
    """``(step, victims)`` for each step that preempted, the victims read from the outputs.

    A victim emitted at the previous step, did not finish there, and emits
    nothing at this one. Valid when every running request is decoding (the
    step budget fits all prompts) and a victim is not re-admitted in the same step.
    """
    events = []
    for step in range(1, len(trace)):
        before, now = trace[step - 1], trace[step]
        if now.num_preemptions > before.num_preemptions:
            events.append((step, before.emitted - before.finished - now.emitted))
    return events


class ForwardLog:
    """Records the number of packed tokens of every forward of ``model`` (a forward pre-hook)."""

    def __init__(self, model) -> None:
        self.model = model
        self.tokens: list[int] = []

    def __enter__(self) -> ForwardLog:
        self._handle = self.model.register_forward_pre_hook(self._record, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()

    def _record(self, module, args, kwargs) -> None:
        self.tokens.append(kwargs["input_ids"].shape[1])


class FailingForward:
    """Makes ``model``'s forward raise RuntimeError whenever its packed input holds a trigger.

    Triggers: any token id in ``tokens``, or a ``(token id, position)`` pair of
    ``token_positions``. The error comes from the last decoder layer, after
    the earlier layers already wrote the step's keys and values to the cache.
    """

    def __init__(self, model, tokens=(), token_positions=()) -> None:
        self.model = model
        self.tokens = set(tokens)
        self.token_positions = set(token_positions)
        self.failures = 0
        self._armed = False

    def __enter__(self) -> FailingForward:
        self._handles = [
            self.model.register_forward_pre_hook(self._inspect, with_kwargs=True),
            self.model.model.layers[-1].register_forward_pre_hook(self._raise),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _inspect(self, module, args, kwargs) -> None:
        ids = kwargs["input_ids"][0].tolist()
        positions = kwargs["position_ids"][0].tolist()
        self._armed = any(t in self.tokens or (t, p) in self.token_positions for t, p in zip(ids, positions))

    def _raise(self, module, args) -> None:
        if self._armed:
            self.failures += 1
            raise RuntimeError("injected failure")


def block_table(engine: Engine, handle: int) -> list[int]:
    """The block ids a running request holds (engine internals)."""
    return engine._blocks.block_table(engine._scheduler.by_handle[handle].seq_id)


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
    assert engine.stats().num_running == engine.stats().num_waiting == 0
    assert engine.step() == []


def test_mid_stream_request_starts_early_and_reuses_blocks(tiny):
    # Without prefix caching every freed block goes back to the head of the free list.
    engine = tiny.engine(max_num_seqs=3, enable_prefix_caching=False, num_blocks=41, max_model_len=128)

    def check_accounting():
        running = [h for h, seq in engine._scheduler.by_handle.items() if seq.running]
        held = sum(len(block_table(engine, h)) for h in running)
        assert engine.stats().num_free_blocks == engine.stats().num_blocks - held

    long_a, long_b = (
        EngineRequest(h, p, greedy(30, ignore_eos=True)) for h, p in zip((0, 1), tiny.prompts([9, 14]))
    )
    engine.add(long_a)
    engine.add(long_b)
    for _ in range(3):
        assert {o.handle for o in engine.step()} == {0, 1}
        check_accounting()
    short = EngineRequest(2, tiny.prompts([5])[0], greedy(2, ignore_eos=True))
    engine.add(short)
    first = engine.step()
    # the new request is prefilled and gets its first token at once, next to the running decodes
    assert sorted(o.handle for o in first) == [0, 1, 2]
    short_blocks = block_table(engine, 2)
    assert len(short_blocks) == 1
    check_accounting()
    free_before = engine.stats().num_free_blocks
    second = engine.step()
    finished = {o.handle: o.finish_reason for o in second}
    assert finished == {0: None, 1: None, 2: "length"}
    assert engine.stats().num_running == 2
    # the finished request's block is free before the next step
    assert engine.stats().num_free_blocks == free_before + 1
    check_accounting()

    reuse = EngineRequest(3, tiny.prompts([11])[0], greedy(6, ignore_eos=True))
    engine.add(reuse)
    assert {o.handle for o in engine.step()} == {0, 1, 3}
    assert block_table(engine, 3)[0] == short_blocks[0]
    while engine.has_unfinished():
        engine.step()
        check_accounting()
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
    for request in (long_a, long_b, short, reuse):
        tiny.check_greedy(request)


def test_prefill_token_budget(tiny):
    """The budget bounds each step's new tokens; decodes come first, prompts are chunked."""
    engine = tiny.engine(max_num_seqs=4, max_num_batched_tokens=24)
    prompts = tiny.prompts([10, 10, 10, 40])
    requests = [EngineRequest(i, p, greedy(n, ignore_eos=True)) for i, (p, n) in enumerate(zip(prompts, (9, 9, 9, 3)))]
    for request in requests:
        engine.add(request)
    trace: list[StepRecord] = []
    with ForwardLog(tiny.model) as log:
        run(engine, {}, trace)
    # step 0: prompts 0 and 1 (10 + 10), a 4-token chunk of prompt 2;
    # step 1: 2 decodes, the last 6 tokens of prompt 2, a 16-token chunk of prompt 3;
    # step 2: 3 decodes and 21 more tokens of prompt 3; step 3: 3 decodes and its last 3 tokens.
    assert log.tokens[:4] == [24, 24, 24, 6]
    assert max(log.tokens) <= 24
    assert [r.emitted for r in trace[:4]] == [{0, 1}, {0, 1, 2}, {0, 1, 2}, {0, 1, 2, 3}]
    # running decodes get one token per step, chunked prefills or not
    for record in trace[1:9]:
        assert {0, 1} <= record.emitted
    # every token computed once: prompts, and each output but the last
    assert sum(log.tokens) == sum(len(r.prompt_token_ids) + len(r.output_token_ids) - 1 for r in requests)
    for request in requests:
        tiny.check_greedy(request)


def test_abort_frees_blocks_immediately(tiny):
    engine = tiny.engine(max_num_seqs=2, max_num_batched_tokens=16, block_size=4, num_blocks=33, max_model_len=128)
    total = engine.stats().num_blocks
    assert total == engine.stats().num_free_blocks == 32 and engine.stats().kv_cache_usage == 0.0
    a, b = (EngineRequest(h, p, greedy(20, ignore_eos=True)) for h, p in zip((0, 1), tiny.prompts([10, 10])))
    engine.add(a)
    engine.add(b)
    assert engine.stats().num_free_blocks == total  # queued requests hold no blocks
    outs = engine.step()
    # a is prefilled; b is admitted with a 6-token chunk: both hold blocks for their whole prompt
    assert [o.handle for o in outs] == [0]
    assert (engine.stats().num_running, engine.stats().num_waiting) == (2, 0)
    assert engine.stats().num_free_blocks == total - 6
    assert engine.stats().kv_cache_usage == pytest.approx(6 / total)
    assert engine.abort(1)
    assert engine.stats().num_free_blocks == total - 3
    assert engine.stats().num_running == 1
    engine.add(EngineRequest(5, [0, 1], greedy(2)))
    with pytest.raises(CapacityError):
        engine.add(EngineRequest(6, [0, 1], greedy(2)))
    assert engine.abort(5)
    assert engine.stats().num_waiting == 0
    assert [o.handle for o in engine.step()] == [0]
    assert engine.abort(0)
    assert engine.stats().num_running == 0
    assert engine.stats().num_free_blocks == total and engine.stats().kv_cache_usage == 0.0
    assert not engine.has_unfinished()
    assert not engine.abort(0)
    assert not engine.abort(1)
    assert not engine.abort(123)
    assert engine.step() == []
    c = EngineRequest(7, tiny.prompts([6])[0], greedy(4, ignore_eos=True))
    engine.add(c)
    outs = engine.step()
    assert [o.handle for o in outs] == [7]
    assert engine.stats().num_free_blocks == total - 2
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().num_free_blocks == total
    tiny.check_greedy(c)


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
    config = tiny.model.config
    head_dim = config.hidden_size // config.num_attention_heads

    def block_bytes(block_size: int) -> int:
        return block_size * 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4

    # Default pool (sized from memory): every running sequence at full length, rounded up to whole blocks.
    engine = tiny.engine(max_num_seqs=3, max_model_len=100)
    assert engine.block_size == 16
    assert engine.kv_cache_tokens % engine.block_size == 0
    assert 3 * 100 <= engine.kv_cache_tokens < 3 * 100 + engine.block_size
    assert engine.stats().num_blocks == engine.kv_cache_tokens // engine.block_size == engine.stats().num_free_blocks
    assert engine.kv_cache_bytes == (engine.stats().num_blocks + 1) * block_bytes(16)  # the null block included

    engine = tiny.engine(max_model_len=100, block_size=8, num_blocks=30)
    assert (engine.stats().num_blocks, engine.kv_cache_tokens) == (29, 29 * 8)
    assert engine.kv_cache_bytes == 30 * block_bytes(8)
    engine = tiny.engine(max_model_len=100, kv_cache_bytes=10 * block_bytes(16) + block_bytes(16) - 1)
    assert (engine.stats().num_blocks, engine.kv_cache_tokens) == (9, 9 * 16)
    assert engine.kv_cache_bytes == 10 * block_bytes(16)

    # Seven blocks (six usable) hold 96 tokens: too few for max_model_len=100.
    # Sized by a setting, the refusal is final (exit 2, ModelRefused); from the free memory it may pass later.
    with pytest.raises(ModelRefused, match=r"largest that fits is 96\b"):
        tiny.engine(max_model_len=100, num_blocks=7)
    with pytest.raises(ModelRefused, match=r"largest that fits is 96\b"):
        tiny.engine(max_model_len=100, kv_cache_bytes=8 * block_bytes(16) - 1)
    with pytest.raises(ModelRefused, match=r"largest that fits is 0\b"):
        tiny.engine(max_model_len=100, num_blocks=1)
    with pytest.raises(ModelRefused, match=r"largest that fits is 0\b"):
        tiny.engine(max_model_len=100, kv_cache_bytes=0)
    with pytest.raises(ValueError):
        tiny.engine(max_model_len=config.max_position_embeddings + 1)

    # The largest that fits does: one request runs to max_model_len in that pool.
    engine = tiny.engine(max_num_seqs=1, max_model_len=96, num_blocks=7)
    request = EngineRequest(0, tiny.prompts([50])[0], greedy(100, ignore_eos=True))
    outputs = run(engine, {0: [request]})
    assert (outputs[0][-1].finish_reason, len(request.output_token_ids)) == ("length", 46)
    assert engine.stats().num_preemptions == 0
    tiny.check_greedy(request, max_tokens=46)


# ---------------------------------------------------------------- paged KV cache


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_cache_hits_keep_outputs_exact(tiny, caching):
    """Requests sharing a prefix of whole blocks reuse its KV, during and after the first one's run."""
    base = tiny.prompts([64])[0]  # four full blocks of 16
    tail = tiny.prompts([1, 13])[1][1:]
    first = EngineRequest(0, base, greedy(20))
    reference = tiny.reference(base, 20)
    same = EngineRequest(1, list(base), greedy(10))  # all of it cached but the last block, recomputed for logits
    shared = EngineRequest(2, base[:50] + tail, greedy(10))  # three shared blocks, then its own tokens
    shorter = EngineRequest(3, base[:40], greedy(6))  # two shared blocks
    follow_up = EngineRequest(4, base + reference[:16] + tail[:3], greedy(8))  # five blocks, one of them output
    requests = [first, same, shared, shorter, follow_up]
    engine = tiny.engine(max_num_seqs=4, max_model_len=128, num_blocks=41, enable_prefix_caching=caching)
    trace: list[StepRecord] = []
    with ForwardLog(tiny.model) as log:
        outputs = run(engine, {0: [first], 2: [same, shared], 30: [shorter, follow_up]}, trace)
    assert 0 in trace[2].emitted and 0 in trace[3].emitted  # the first still runs when 1 and 2 arrive
    assert all(not record.emitted for record in trace[20:30])  # and everything finished before 3 and 4
    for request in requests:
        check_stream(outputs[request.handle], request)
        tiny.check_greedy(request)
    if caching:
        assert engine.stats().prefix_queries == sum(len(r.prompt_token_ids) for r in requests)
        assert engine.stats().prefix_hits == 48 + 48 + 32 + 80
    else:
        assert engine.stats().prefix_queries == engine.stats().prefix_hits == 0
    # cached tokens are not computed again
    computed = sum(len(r.prompt_token_ids) + len(r.output_token_ids) - 1 for r in requests)
    assert sum(log.tokens) == computed - engine.stats().prefix_hits
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


@pytest.mark.parametrize("block_size", [16, 4])
def test_chunked_prefill_keeps_outputs_exact(tiny, block_size):
    """A budget of 7 tokens (no multiple of the block size) with prompts many times longer, arriving over time."""
    lengths = [45, 60, 23, 1, 38, 2]
    prompts = tiny.prompts(lengths)
    prompts.append(prompts[0][:30] + prompts[4][1:20])  # shares the first prompt's head while it is prefilled
    max_tokens = [5, 9, 3, 6, 4, 8, 5]
    requests = [EngineRequest(i, p, greedy(n)) for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    engine = tiny.engine(max_num_seqs=4, max_num_batched_tokens=7, block_size=block_size, max_model_len=128,
                         num_blocks=1 + 512 // block_size)
    trace: list[StepRecord] = []
    schedule = {0: requests[:2], 2: [requests[2]], 4: [requests[6]], 7: requests[3:5], 12: [requests[5]]}
    with ForwardLog(tiny.model) as log:
        outputs = run(engine, schedule, trace)
    assert max(log.tokens) <= 7
    assert engine.stats().prefix_hits > 0
    for request in requests:
        check_stream(outputs[request.handle], request)
        tiny.check_greedy(request)
    # no output before the whole prompt is computed: at least len / 7 steps after its arrival
    first_step = {h: min(i for i, r in enumerate(trace) if h in r.emitted) for h in range(len(requests))}
    assert first_step[0] >= -(-45 // 7) - 1
    assert first_step[1] >= -(-(45 + 60) // 7) - 1
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


PREEMPTION_POOL = {"max_num_seqs": 3, "block_size": 4, "num_blocks": 9, "max_model_len": 24}
"""Eight blocks of 4 for three requests of 6 + 16 tokens: decodes run out of blocks."""


@pytest.mark.parametrize("priorities, victim", [((0, 0, 0), 2), ((5, 0, 0), 0), ((0, 3, 0), 1)])
def test_preemption_on_block_exhaustion(tiny, priorities, victim):
    """The least urgent (highest priority value), most recently started request is preempted; all streams stay whole."""
    requests = [
        EngineRequest(i, p, greedy(16), priority=priority)
        for i, (p, priority) in enumerate(zip(tiny.prompts([6, 6, 6]), priorities))
    ]
    engine = tiny.engine(**PREEMPTION_POOL)
    trace: list[StepRecord] = []
    outputs = run(engine, {0: requests}, trace)
    assert engine.stats().num_preemptions > 0
    events = preemption_events(trace)
    assert events, "no preemption seen in the outputs"
    # Step 3 decodes position 8: each request needs its third block, and only two are free.
    step, victims = events[0]
    assert (step, victims) == (3, {victim})
    assert trace[step].emitted == {0, 1, 2} - {victim}
    for request in requests:
        outs = outputs[request.handle]
        assert sum(o.finish_reason is not None for o in outs) == 1
        check_stream(outs, request)
        tiny.check_greedy(request)
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
    assert not engine.has_unfinished()


@pytest.mark.parametrize("priorities, num_blocks, arrivals, expected_victims", [
    ((0, 0, 0, 0), 9, (0, 0, 2, 5), [2, 1, 2, 3]),
    ((0, 1, 0, 1), 13, (0, 1, 3, 6), [3, 1, 3]),
    ((1, 0, 0, 1), 9, (0, 0, 2, 5), [0, 2, 3]),
])
def test_preemption_victim_rule_at_every_preemption(tiny, priorities, num_blocks, arrivals, expected_victims):
    """Each victim is the least urgent running request, ties going to the one (re)started last.

    A resumed request counts as started when it resumes. Starts are read from
    the outputs: with this budget a request emits in the step it is admitted.
    """
    prompts = tiny.prompts([6, 5, 7, 4])
    requests = [EngineRequest(i, p, greedy(16), priority=pr) for i, (p, pr) in enumerate(zip(prompts, priorities))]
    schedule: dict[int, list[EngineRequest]] = {}
    for request, step in zip(requests, arrivals):
        schedule.setdefault(step, []).append(request)
    engine = tiny.engine(max_num_seqs=4, block_size=4, num_blocks=num_blocks, max_model_len=24)
    trace: list[StepRecord] = []
    outputs = run(engine, schedule, trace)

    started: dict[int, tuple[int, int, int]] = {}
    events = dict(preemption_events(trace))
    assert [h for victims in events.values() for h in sorted(victims)] == expected_victims
    assert engine.stats().num_preemptions == len(expected_victims)
    for step, record in enumerate(trace):
        if step in events:
            running = {h for h in trace[step - 1].emitted - trace[step - 1].finished}
            victims = events[step]
            by_urgency = sorted(running, key=lambda h: (priorities[h], started[h]), reverse=True)
            assert victims == set(by_urgency[: len(victims)]), f"step {step}"
        before = trace[step - 1].emitted if step else set()
        for handle in record.emitted - before:
            # a resumed request is admitted from the head of the queue, before new arrivals
            started[handle] = (step, 0 if handle in started else 1, handle)
    for request in requests:
        check_stream(outputs[request.handle], request)
        tiny.check_greedy(request)
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_no_block_leak_after_finish_abort_and_preemption(tiny):
    engine = tiny.engine(max_num_seqs=4, block_size=4, num_blocks=13, max_model_len=24, max_num_batched_tokens=12)
    total = engine.stats().num_blocks
    requests = [EngineRequest(i, p, greedy(16)) for i, p in enumerate(tiny.prompts([6, 6, 6]))]
    for request in requests:
        engine.add(request)
    emitted: list[set[int]] = []
    while engine.stats().num_preemptions == 0:
        emitted.append({o.handle for o in engine.step()})
    assert engine.stats().num_preemptions == 1 and engine.stats().num_waiting == 1
    (victim,) = emitted[-2] - emitted[-1]
    decoding = sorted({0, 1, 2} - {victim})
    held = {h: len(block_table(engine, h)) for h in decoding}
    assert engine.stats().num_free_blocks == total - sum(held.values())

    free = engine.stats().num_free_blocks
    assert engine.abort(victim)  # preempted, waiting to resume: holds no blocks
    assert (engine.stats().num_waiting, engine.stats().num_free_blocks) == (0, free)
    engine.step()
    held = len(block_table(engine, decoding[0]))
    free = engine.stats().num_free_blocks
    assert engine.abort(decoding[0])  # mid-decode
    assert engine.stats().num_free_blocks == free + held

    chunked = EngineRequest(3, tiny.prompts([1, 1, 1, 14])[3], greedy(5))
    engine.add(chunked)
    outs = engine.step()  # one decode and an 11-token chunk of the 14-token prompt
    assert [o.handle for o in outs] == [decoding[1]]
    assert engine.stats().num_running == 2
    held = len(block_table(engine, 3))
    assert held == 4
    free = engine.stats().num_free_blocks
    assert engine.abort(3)  # mid-prefill
    assert engine.stats().num_free_blocks == free + held

    late = EngineRequest(4, tiny.prompts([1, 1, 1, 1, 9])[4], greedy(6))
    engine.add(late)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().num_free_blocks == total
    assert engine.stats().kv_cache_usage == 0.0
    for request in (requests[decoding[1]], late):
        tiny.check_greedy(request)


def test_prompt_too_long(tiny):
    engine = tiny.engine(max_num_seqs=2, max_model_len=24, block_size=4, num_blocks=7)
    assert issubclass(PromptTooLong, ValueError)
    prompt = tiny.prompts([30])[0]
    for n_prompt, n_output in ((24, 0), (30, 0), (20, 4), (23, 1)):
        request = EngineRequest(0, prompt[:n_prompt], greedy(8), output_token_ids=prompt[:n_output])
        with pytest.raises(PromptTooLong, match="max_model_len=24"):
            engine.add(request)
    assert not engine.has_unfinished()
    at_limit = EngineRequest(1, prompt[:22], greedy(8), output_token_ids=prompt[:1])
    engine.add(at_limit)
    run(engine, {})
    assert len(at_limit.output_token_ids) == 2  # one more token fills max_model_len
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_failing_request_does_not_fail_its_companions(tiny):
    lengths, max_tokens = [12, 30, 5, 21], [10, 8, 12, 6]
    good = [EngineRequest(i, p, greedy(n)) for i, (p, n) in enumerate(zip(tiny.prompts(lengths), max_tokens))]
    expected = {r.handle: tiny.reference(r.prompt_token_ids, r.params.max_tokens) for r in good}
    used = {t for r in good for t in r.prompt_token_ids + expected[r.handle]}
    bad_token = min(set(range(3, tiny.model.config.vocab_size)) - used)
    # fails in its prefill: its prompt holds the bad token
    in_prefill = EngineRequest(10, tiny.prompts([9])[0] + [bad_token] + tiny.prompts([4])[0][1:], greedy(8))
    # fails in its first decode: when its first output token is fed at its position
    late_prompt = tiny.prompts([1, 1, 17])[2]
    trigger = (tiny.reference(late_prompt, 1)[0], len(late_prompt))
    for r in good:
        tokens = r.prompt_token_ids + expected[r.handle]
        assert len(tokens) <= trigger[1] or tokens[trigger[1]] != trigger[0]
    in_decode = EngineRequest(11, late_prompt, greedy(8))

    engine = tiny.engine(max_num_seqs=6, block_size=4, num_blocks=65, max_model_len=128)
    trace: list[StepRecord] = []
    with FailingForward(tiny.model, tokens={bad_token}, token_positions={trigger}) as failing:
        outputs = run(engine, {0: [good[0], good[1], in_prefill], 2: [in_decode, good[2]], 4: [good[3]]}, trace)
        # alone in its step
        engine.add(EngineRequest(12, [0, bad_token, 5], greedy(3)))
        alone = engine.step()
    # each of 10 and 11 failed in a batch, then alone; 12 failed alone
    assert failing.failures == 5
    assert len(alone) == 1 and isinstance(alone[0], RequestError) and alone[0].handle == 12
    # the failures happened next to companions, which got their tokens in the same step
    failed_steps = [(r.failed, r.emitted) for r in trace if r.failed]
    assert [failed for failed, _ in failed_steps] == [{10}, {11}]
    assert failed_steps[0][1] == {0, 1}
    assert failed_steps[1][1] >= {0, 1, 2}

    errors = {h: [o for o in outs if isinstance(o, RequestError)] for h, outs in outputs.items()}
    assert {h for h, errs in errors.items() if errs} == {10, 11}
    for handle in (10, 11):
        (error,) = errors[handle]
        assert "RuntimeError" in error.message and "injected failure" in error.message
        assert outputs[handle][-1] is error  # nothing follows it
    assert outputs[10] == errors[10]  # no token before failing
    assert [o.seq for o in outputs[11][:-1]] == [0]  # one token, then the failed decode
    for request in good:
        check_stream(outputs[request.handle], request)
        assert request.output_token_ids == expected[request.handle]
    assert not engine.has_unfinished()
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
    # the engine goes on serving
    again = EngineRequest(13, good[0].prompt_token_ids, greedy(4))
    run(engine, {0: [again]})
    tiny.check_greedy(again)


def test_seeded_sampling_survives_preemption(tiny):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_k=50, seed=77)
    prompts = tiny.prompts([6, 6, 6])
    alone = EngineRequest(0, prompts[0], params)
    run(tiny.engine(max_num_seqs=1, max_model_len=24), {0: [alone]})

    seeded = EngineRequest(0, prompts[0], params, priority=5)
    companions = [
        EngineRequest(1, prompts[1], greedy(16)),
        EngineRequest(2, prompts[2], SamplingParams(max_tokens=16, temperature=1.2)),
    ]
    engine = tiny.engine(seed=3, **PREEMPTION_POOL)
    trace: list[StepRecord] = []
    outputs = run(engine, {0: [seeded, *companions]}, trace)
    assert preemption_events(trace)[0][1] == {0}
    check_stream(outputs[0], seeded)
    assert seeded.output_token_ids == alone.output_token_ids
    tiny.check_greedy(companions[0])


def test_pool_starts_zeroed_whatever_memory_it_reuses(tiny):
    """A decode row reads its last block whole, past its end too: those slots must hold zeros, not old memory.

    Buffers of the pool's size full of NaN are freed first, so the allocator
    has dirty memory to hand out (as a freed profiling or earlier pool buffer leaves).
    """
    config = tiny.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    junk = [torch.full((config.num_key_value_heads, 64 * 4, head_dim), float("nan")) for _ in range(8)]
    del junk
    engine = tiny.engine(max_num_seqs=3, block_size=4, num_blocks=64, max_model_len=128)
    for buf in engine._cache.key_cache + engine._cache.value_cache:
        assert torch.count_nonzero(buf) == 0  # NaN counts as non-zero
    requests = [EngineRequest(i, p, greedy(8)) for i, p in enumerate(tiny.prompts([10, 7, 3]))]
    run(engine, {0: requests})
    for request in requests:
        tiny.check_greedy(request)


@pytest.mark.parametrize("pool", [
    {},
    # 30 blocks of 4 for five requests of up to 65 tokens: preemptions, resumes from cached blocks
    {"block_size": 4, "num_blocks": 31, "max_model_len": 80},
], ids=["large-pool", "small-pool"])
def test_randomized_churn_keeps_outputs_exact(tiny, pool):
    """Random arrivals, aborts and mixed sampling: greedy and seeded requests
    still produce exactly what they produce alone, every stream is well formed,
    and every block comes back."""
    rng = random.Random(2024)
    engine = tiny.engine(max_num_seqs=5, max_num_batched_tokens=64, **pool)
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
        while pending and engine.stats().num_running + engine.stats().num_waiting < engine.max_num_seqs and rng.random() < 0.6:
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
        assert engine.stats().num_running <= engine.max_num_seqs

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
    assert not engine.has_unfinished()
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
    if pool:
        assert engine.stats().num_preemptions > 0 and engine.stats().prefix_hits > 0


@pytest.mark.parametrize("native", [False, True])
def test_a_reused_blocks_stale_nan_never_reaches_its_new_owner(tiny, native):
    engine = tiny.engine(max_num_seqs=2, num_blocks=80, block_size=4, max_model_len=128,
                         enable_prefix_caching=False, native_kernels=native)
    engine.warmup()
    first = [EngineRequest(i, prompt, greedy(8)) for i, prompt in enumerate(tiny.prompts([13, 22]))]
    run(engine, {0: first})
    # A sequence gone wrong (overflowed activations) leaves NaN in the blocks it held, now on the free list.
    cache, size = engine._cache, engine._cache.block_size
    used = [block.block_id for block in engine._blocks._blocks if block.handed_out]
    assert used
    with torch.inference_mode():
        for buffers in (cache.key_cache, cache.value_cache):
            for buffer in buffers:
                for block_id in used:
                    buffer[:, block_id * size:(block_id + 1) * size].fill_(float("nan"))
    # Two new requests of different lengths decode as one group: the shorter row's last block has positions
    # past its end, read by a gather and masked.
    second = [EngineRequest(10 + i, prompt, greedy(10)) for i, prompt in enumerate(tiny.prompts([5, 19]))]
    run(engine, {0: second})
    for request in second:
        tiny.check_greedy(request)
