"""Tests of daemon.synthetic: Engine's serving semantics without a model, and step pacing."""

from __future__ import annotations

import time

import pytest

from ringstream.daemon.engine.engine import (
    BaseEngine, CapacityError, Engine, EngineConfig, EngineError, EngineRequest, SamplingParams,
)
from ringstream.daemon.engine.synthetic import SyntheticEngine, synthetic_text, synthetic_token_id
from tests.factories import load_model, load_tokenizer, make_tiny_model_dir

VOCAB = 4096
EOS = 1


def engine(**kwargs) -> SyntheticEngine:
    kwargs.setdefault("step_time_s", 0.0)
    kwargs.setdefault("vocab_size", VOCAB)
    return SyntheticEngine(**kwargs)


def request(handle: int, max_tokens: int = 4, prompt_len: int = 3, **params) -> EngineRequest:
    return EngineRequest(handle, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens, **params))


def run(eng: SyntheticEngine, max_steps: int = 10_000) -> list[list]:
    """Step until idle; the outputs of each step."""
    steps = []
    while eng.has_unfinished():
        steps.append(eng.step())
        assert len(steps) <= max_steps
    return steps


def by_handle(steps: list[list]) -> dict[int, list]:
    outs: dict[int, list] = {}
    for step in steps:
        for out in step:
            outs.setdefault(out.handle, []).append(out)
    return outs


def test_is_a_base_engine_with_engine_capacity_figures():
    eng = engine(max_num_seqs=8, max_model_len=128)
    assert isinstance(eng, BaseEngine)
    assert (eng.max_num_seqs, eng.max_model_len, eng.kv_cache_tokens, eng.kv_cache_bytes) == (8, 128, 1024, 0)
    assert not eng.has_unfinished() and eng.step() == []
    eng.warmup()


def test_deterministic_tokens_text_and_length_finish():
    eng = engine()
    req = request(7, max_tokens=5, prompt_len=4)
    eng.add(req)
    outs = by_handle(run(eng))[7]
    assert [o.seq for o in outs] == [0, 1, 2, 3, 4]
    assert [o.token_id for o in outs] == [synthetic_token_id(7, s, VOCAB) for s in range(5)]
    assert [o.token_id for o in outs] == [(7 * 31 + s) % VOCAB for s in range(5)]
    assert "".join(o.text for o in outs) == " t0 t1 t2 t3 t4"
    assert all(o.text.isascii() for o in outs)
    assert [o.finish_reason for o in outs] == [None] * 4 + ["length"]
    assert (outs[-1].num_prompt_tokens, outs[-1].num_output_tokens) == (4, 5)
    assert req.output_token_ids == [o.token_id for o in outs]


def test_continuous_batching_one_output_per_running_request_per_step():
    eng = engine(max_num_seqs=2)
    eng.add(request(1, max_tokens=1))
    eng.add(request(2, max_tokens=3))
    steps = [eng.step()]
    assert {o.handle for o in steps[0]} == {1, 2}
    assert (eng.stats().num_running, eng.stats().num_waiting) == (1, 0)
    eng.add(request(3, max_tokens=2))  # takes the slot handle 1 freed
    steps.append(eng.step())
    assert sorted(o.handle for o in steps[1]) == [2, 3]
    steps += run(eng)
    outs = by_handle(steps)
    for handle, expected in ((1, 1), (2, 3), (3, 2)):
        assert [o.seq for o in outs[handle]] == list(range(expected))
    for step in steps:
        assert len({o.handle for o in step}) == len(step)


def test_waiting_requests_are_admitted_fifo_when_slots_free():
    eng = engine(max_num_seqs=2)
    for handle in (1, 2):
        eng.add(request(handle, max_tokens=2))
    eng.step()
    assert eng.stats().num_running == 2
    with pytest.raises(CapacityError):
        eng.add(request(3))
    run(eng)
    eng.add(request(3, max_tokens=1))
    assert by_handle(run(eng))[3][0].finish_reason == "length"


def test_slot_freed_this_step_is_reused_in_the_same_step():
    eng = engine(max_num_seqs=1)
    eng.add(request(1, max_tokens=1))
    assert [o.handle for o in eng.step()] == [1]
    eng.add(request(2, max_tokens=2))
    eng.step()
    eng.abort(2)
    eng.add(request(3, max_tokens=1))
    assert [(o.handle, o.finish_reason) for o in eng.step()] == [(3, "length")]


def test_eos_stop_tokens_and_ignore_eos():
    first = synthetic_token_id(0, 2, VOCAB)
    eng = engine(eos_token_ids=(first,))
    eng.add(request(0, max_tokens=10))
    outs = by_handle(run(eng))[0]
    assert [o.seq for o in outs] == [0, 1, 2]
    assert (outs[-1].finish_reason, outs[-1].stop_reason, outs[-1].text) == ("stop", None, "")

    eng.add(request(0, max_tokens=4, ignore_eos=True))
    assert by_handle(run(eng))[0][-1].finish_reason == "length"

    user = synthetic_token_id(5, 1, VOCAB)
    eng.add(request(5, max_tokens=10, stop_token_ids=(user,)))
    outs = by_handle(run(eng))[5]
    assert (outs[-1].seq, outs[-1].finish_reason, outs[-1].stop_reason) == (1, "stop", user)


def test_stop_strings_end_before_the_match_and_never_leak():
    eng = engine()
    eng.add(request(1, max_tokens=20, stop=("t3 t",)))
    outs = by_handle(run(eng))[1]
    text = "".join(o.text for o in outs)
    assert text == " t0 t1 t2 "
    assert (outs[-1].seq, outs[-1].finish_reason, outs[-1].stop_reason) == (4, "stop", "t3 t")


def test_held_back_prefix_is_released_at_length():
    eng = engine()
    eng.add(request(1, max_tokens=3, stop=(" t2 never",)))
    outs = by_handle(run(eng))[1]
    assert outs[-1].finish_reason == "length"
    assert "".join(o.text for o in outs) == " t0 t1 t2"


def test_abort_waiting_and_running_requests():
    eng = engine(max_num_seqs=2)
    eng.add(request(1, max_tokens=10))
    eng.add(request(2, max_tokens=10))
    assert eng.abort(2) and eng.stats().num_waiting == 1
    eng.step()
    assert eng.stats().num_running == 1
    assert eng.abort(1) and not eng.has_unfinished()
    assert not eng.abort(1)
    assert eng.step() == []


def test_resume_continues_at_the_next_seq_without_repeating_text():
    eng = engine()
    prior = [synthetic_token_id(9, s, VOCAB) for s in range(3)]
    req = EngineRequest(9, [5, 6], SamplingParams(max_tokens=5), output_token_ids=list(prior))
    eng.add(req)
    outs = by_handle(run(eng))[9]
    assert [o.seq for o in outs] == [3, 4]
    assert "".join(o.text for o in outs) == " t3 t4"
    assert outs[-1].num_output_tokens == 5
    assert req.output_token_ids[:3] == prior


@pytest.mark.parametrize(
    "req, message",
    [
        (EngineRequest(1, [], SamplingParams()), "empty"),
        (EngineRequest(1, [VOCAB], SamplingParams()), "token ids"),
        (EngineRequest(1, [-1], SamplingParams()), "token ids"),
        (EngineRequest(1, [3] * 64, SamplingParams()), "max_model_len"),
        (EngineRequest(1, [3], SamplingParams(max_tokens=0)), "max_tokens"),
        (EngineRequest(1, [3], SamplingParams(max_tokens=2), [4, 5]), "already hold"),
        (EngineRequest(1, [3], SamplingParams(temperature=-1.0)), "temperature"),
        (EngineRequest(1, [3], SamplingParams(top_p=0.0)), "top_p"),
        (EngineRequest(1, [3], SamplingParams(top_k=-1)), "top_k"),
        (EngineRequest(1, [3], SamplingParams(max_tokens=9, stop_token_ids=(7,)), [7]), "stop token"),
        (EngineRequest(1, [3], SamplingParams(max_tokens=9, stop=("t0",)), [4]), "stop string"),
    ],
)
def test_invalid_requests_raise_value_error(req, message):
    eng = engine(max_model_len=64)
    with pytest.raises(ValueError, match=message):
        eng.add(req)
    assert not eng.has_unfinished()


def test_duplicate_handle_and_bad_constructor_arguments():
    eng = engine()
    eng.add(request(1))
    with pytest.raises(ValueError, match="in use"):
        eng.add(request(1))
    with pytest.raises(EngineError):
        eng.warmup()
    for kwargs in (dict(max_num_seqs=0), dict(max_model_len=1), dict(step_time_s=-1.0), dict(vocab_size=0)):
        with pytest.raises(ValueError):
            SyntheticEngine(**kwargs)


def test_context_limit_finishes_with_length():
    eng = engine(max_model_len=8)
    eng.add(request(1, max_tokens=100, prompt_len=5))
    outs = by_handle(run(eng))[1]
    assert len(outs) == 3 and outs[-1].finish_reason == "length"


def test_steps_with_work_are_paced_and_idle_steps_return_at_once():
    step_time_s = 0.01
    steps = 10
    eng = SyntheticEngine(step_time_s=step_time_s)
    eng.add(request(1, max_tokens=steps))
    start = time.perf_counter()
    run(eng)
    elapsed = time.perf_counter() - start
    assert elapsed >= steps * step_time_s * 0.99
    start = time.perf_counter()
    assert eng.step() == []
    assert time.perf_counter() - start < step_time_s


def test_synthetic_text_format():
    assert synthetic_text(0) == " t0" and synthetic_text(123) == " t123"


def scripted(eng: BaseEngine) -> list:
    """A fixed scenario of adds, an abort and a capacity overflow; per step, what each request got."""
    def req(handle: int, max_tokens: int) -> EngineRequest:
        return EngineRequest(handle, [5, 6, 7, 8][: 2 + handle % 3], SamplingParams(max_tokens=max_tokens,
                                                                                   temperature=0.0, ignore_eos=True))

    plan = {0: [(1, 3), (2, 5), (3, 2)], 1: [(4, 4)], 2: [(5, 1)], 4: [(6, 3), (7, 2)]}
    trace = []
    for step in range(12):
        for handle, max_tokens in plan.get(step, []):
            try:
                eng.add(req(handle, max_tokens))
            except CapacityError:
                trace.append(("full", handle))
        if step == 3:
            trace.append(("abort", eng.abort(2), eng.abort(99)))
        outputs = eng.step()
        trace.append(sorted((o.handle, o.seq, o.finish_reason) for o in outputs))
        trace.append((eng.stats().num_running, eng.stats().num_waiting))
    return trace


def test_same_batching_semantics_as_engine(tmp_path):
    """Step by step, the synthetic engine emits for the same requests and seqs as ``Engine`` on a real model."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model_dir = make_tiny_model_dir(tmp_path / "tiny")
        model = load_model(model_dir)
        engine = Engine(model, load_tokenizer(model_dir), EngineConfig(max_num_seqs=3))
        synthetic = SyntheticEngine(max_num_seqs=3, step_time_s=0.0, vocab_size=model.config.vocab_size)
        assert scripted(synthetic) == scripted(engine)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.e2e
def test_daemon_streams_synthetic_tokens(start_daemon):
    """End to end through a daemon started with ``--engine synthetic``."""
    from ringstream.ipc.client import Client
    from ringstream.tools.bench_serving import synthetic_engine_support

    reason = synthetic_engine_support()
    if reason is not None:
        pytest.skip(reason)
    d = start_daemon("--engine", "synthetic", "--synthetic-step-ms", "0.5", "--devices", "cpu")
    with Client(d.address) as client:
        chunks = list(client.generate(prompt_token_ids=[5, 6, 7], max_tokens=6, ignore_eos=True))
        stopped = client.complete("Return the", max_tokens=50, ignore_eos=True, stop=[" t4"])
    assert "".join(c.text for c in chunks) == " t0 t1 t2 t3 t4 t5"
    assert len([t for c in chunks for t in c.token_ids]) == 6 and chunks[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 6
    assert (stopped.text, stopped.finish_reason, stopped.stop_reason) == (" t0 t1 t2 t3", "stop", " t4")


def test_new_sampling_fields_are_accepted_min_tokens_holds_stops_and_logprobs_are_fixed():
    from ringstream.daemon.engine.synthetic import SYNTHETIC_LOGPROB
    eos = synthetic_token_id(0, 2, VOCAB)
    eng = engine(eos_token_ids=(eos,))
    eng.add(request(0, max_tokens=10, min_tokens=4, presence_penalty=1.0, frequency_penalty=-1.0,
                    repetition_penalty=1.5, min_p=0.2, stop=(" t1",), logprobs=2, prompt_logprobs=1))
    outs = by_handle(run(eng))[0]
    # EOS at seq 2 and the stop string at seq 1 fall within min_tokens=4: neither ends the request.
    assert len(outs) == 10 and outs[-1].finish_reason == "length"
    assert all(o.logprobs.logprob == SYNTHETIC_LOGPROB and len(o.logprobs.top) == 2 for o in outs)
    assert [e.token_id for e in outs[0].prompt_logprobs] == [11, 12] and outs[1].prompt_logprobs is None
    eng.add(request(1, max_tokens=10, min_tokens=1, stop=(" t1",)))
    assert "".join(o.text for o in by_handle(run(eng))[1]) == " t0"
    eng.add(request(2, max_tokens=4))
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in by_handle(run(eng))[2])
