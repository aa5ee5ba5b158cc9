"""The time-based prompt-chunk budget: fitted from step times, bounded by the token budget."""

import pytest

from ringstream.daemon.common.engine_config import EngineConfig

from ringstream.daemon.engine.step_budget import (
    CPU_MIN_CHUNK_TOKENS, MIN_CHUNK_TOKENS, StepBudget, chunk_pairs, default_max_step_ms, default_min_chunk_tokens,
)


def step_time(rows: int, fixed_s: float = 0.020, row_s: float = 0.001) -> float:
    return fixed_s + row_s * rows


def test_unmeasured_budget_is_the_token_budget_less_the_decodes():
    budget = StepBudget(100, 2048)
    assert budget.fixed_s is None and budget.row_s is None
    assert budget.chunk_tokens(16) == 2032
    assert budget.chunk_tokens(5000) == 1


def test_chunk_fills_the_target_after_calibration():
    budget = StepBudget(100, 2048)
    budget.calibrate(decode_step_s=step_time(1), prompt_tokens=256, prompt_step_s=step_time(256))
    assert (budget.fixed_s, budget.row_s) == (pytest.approx(0.020), pytest.approx(0.001))
    assert budget.chunk_tokens(16) == 64  # 80 rows fill 100 ms: 16 decodes + 64 prompt tokens
    fast = StepBudget(100, 2048)
    fast.calibrate(decode_step_s=0.001, prompt_tokens=256, prompt_step_s=0.002)
    assert fast.chunk_tokens(16) == 2032  # the token setting stays the upper bound


def test_decode_rows_are_not_charged_to_the_prompt_tokens():
    # Steps that all carry 16 decodes and a chunk: the fit must see the rows' common cost, not blame the chunk.
    budget = StepBudget(100, 2048)
    budget.calibrate(decode_step_s=step_time(1), prompt_tokens=256, prompt_step_s=step_time(256))
    for _ in range(50):
        chunk = budget.chunk_tokens(16)
        budget.observe(decodes=16, prompt_tokens=chunk, seconds=step_time(16 + chunk))
    assert budget.chunk_tokens(16) == 64


def test_a_chunk_may_cost_as_much_as_the_decodes_past_the_target():
    budget = StepBudget(50, 2048)
    slow = dict(fixed_s=0.060, row_s=0.002)  # 16 decode rows alone take 92 ms
    budget.calibrate(step_time(1, **slow), 256, step_time(256, **slow))
    assert budget.chunk_tokens(16) == 46  # a step of 2 x 92 ms: 92 rows, 16 of them decodes
    tiny = StepBudget(50, 2048)
    tiny.calibrate(step_time(1, 0.0, 0.1), 2, step_time(2, 0.0, 0.1))
    assert tiny.chunk_tokens(1) == MIN_CHUNK_TOKENS


def test_without_decodes_the_token_budget_bounds_the_step():
    budget = StepBudget(100, 2048)
    budget.calibrate(step_time(1), 256, step_time(256))
    assert budget.chunk_tokens(0) == 2048 and budget.chunk_tokens(1) < 100


def test_the_fit_follows_a_dearer_context():
    budget = StepBudget(100, 2048)
    budget.calibrate(step_time(1), 256, step_time(256))
    for _ in range(60):  # later chunks of a long prompt attend more: 2 ms a row now
        chunk = budget.chunk_tokens(4)
        budget.observe(decodes=4, prompt_tokens=chunk, seconds=step_time(4 + chunk, row_s=0.002))
    assert budget.chunk_tokens(4) < 50


def chunk_time(start: int, tokens: int, decodes: int = 0, pair_s: float = 1e-6) -> float:
    """A step whose chunk attention costs pair_s a (query, key) pair besides the rows' 20 ms + 1 ms each."""
    return step_time(decodes + tokens) + pair_s * chunk_pairs(start, tokens)


def test_chunk_pairs_count_what_a_causal_chunk_attends():
    assert chunk_pairs(0, 1) == 1 and chunk_pairs(0, 4) == 10  # 1 + 2 + 3 + 4
    assert chunk_pairs(100, 4) == 410 and chunk_pairs(7, 0) == 0


def test_the_second_calibration_chunk_measures_attention_and_late_chunks_are_smaller():
    budget = StepBudget(100, 4096)
    budget.calibrate(step_time(1), 256, chunk_time(0, 256), second_chunk_s=chunk_time(256, 256))
    assert (budget.fixed_s, budget.row_s, budget.pair_s) == (
        pytest.approx(0.020), pytest.approx(0.001), pytest.approx(1e-6))
    early, late = budget.chunk_tokens(16, 0), budget.chunk_tokens(16, 1000)
    assert MIN_CHUNK_TOKENS < late < early <= 64
    for start, n in ((0, early), (1000, late)):  # each fills the target, and one more token would overrun it
        assert chunk_time(start, n, 16) <= 0.100 < chunk_time(start, n + 1, 16)


@pytest.mark.parametrize("target_ms,start", [(400, 3000), (100, 500)])
def test_the_fit_follows_attention_that_costs_more_than_measured(target_ms, start):
    # A long prompt's chunks at one depth, whose pairs cost twice the calibration's: deep (3,000) the pairs are
    # most of a step and their cost is refitted; shallower the rows' cost takes the difference. Either way the
    # chunks come to fill the target at that depth.
    budget = StepBudget(target_ms, 4096)
    budget.calibrate(step_time(1), 256, chunk_time(0, 256), second_chunk_s=chunk_time(256, 256))
    for _ in range(60):
        n = budget.chunk_tokens(4, start)
        budget.observe(4, n, chunk_time(start, n, 4, pair_s=2e-6), pairs=chunk_pairs(start, n))
    if start == 3000:
        assert budget.pair_s == pytest.approx(2e-6, rel=0.05)
    n = budget.chunk_tokens(4, start)
    assert n > MIN_CHUNK_TOKENS
    assert target_ms * 0.95e-3 <= chunk_time(start, n, 4, pair_s=2e-6) <= target_ms * 1.01e-3


def test_a_deep_second_chunk_gives_the_pair_cost_from_its_extra_pairs():
    # the calibration's second chunk of 256 tokens from position 1,024: 1,024 x 256 more pairs than the first
    budget = StepBudget(100, 4096)
    budget.calibrate(step_time(1), 256, chunk_time(0, 256, pair_s=2e-6),
                     second_chunk_s=chunk_time(1024, 256, pair_s=2e-6), second_start=1024)
    assert budget.pair_s == pytest.approx(2e-6, rel=1e-6)
    assert budget.row_s == pytest.approx(step_time(2) - step_time(1), rel=1e-6)


def test_a_pair_cost_measured_as_zero_is_refitted_by_deep_chunks():
    # timing noise made the second calibration chunk no slower than the first: no attention term at start
    budget = StepBudget(100, 4096)
    budget.calibrate(step_time(1), 256, chunk_time(0, 256), second_chunk_s=chunk_time(0, 256))
    assert budget.pair_s == 0
    for _ in range(60):
        n = budget.chunk_tokens(4, 1000)
        budget.observe(4, n, chunk_time(1000, n, 4), pairs=chunk_pairs(1000, n))
    assert budget.pair_s > 0.5e-6  # the rows kept the first chunk's pairs at start: a little less is left here
    assert 0.095 <= chunk_time(1000, budget.chunk_tokens(4, 1000), 4) <= 0.101


def test_defaults_and_bad_targets():
    assert default_max_step_ms("cpu") == 50 and default_max_step_ms("cuda") == 50
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="max_step_ms"):
            StepBudget(bad, 2048)
    huge = StepBudget(1e300, 2048)
    huge.calibrate(step_time(1), 256, chunk_time(0, 256), second_chunk_s=chunk_time(256, 256))
    assert huge.chunk_tokens(16, 5000) == 2032  # the token budget bounds any target


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -5.0])
def test_a_target_that_is_not_a_finite_duration_is_a_bad_setting(bad):
    with pytest.raises(ValueError, match="max_step_ms"):
        EngineConfig(max_step_ms=bad).check()
    assert EngineConfig(max_step_ms=0).check().max_step_ms == 0  # 0: the token budget alone


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1.0])
def test_a_burst_ratio_that_is_not_a_finite_ratio_is_a_bad_setting(bad):
    with pytest.raises(ValueError, match="prefill_burst_ratio"):
        EngineConfig(prefill_burst_ratio=bad).check()
    assert EngineConfig(prefill_burst_ratio=1.5).check().prefill_burst_ratio == 1.5


def test_the_engine_starts_and_serves_at_any_context_length_it_accepts(tmp_path):
    # the calibration's two prompt chunks and two output tokens need 5 positions; below that, one chunk or none
    from ringstream.daemon.engine.engine import Engine, EngineRequest, SamplingParams
    from tests.factories import load_model, load_tokenizer, make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path)
    tokenizer = load_tokenizer(model_dir)
    for max_model_len in (2, 3, 4, 5, 6):
        engine = Engine(load_model(model_dir), tokenizer, EngineConfig(num_blocks=16, max_model_len=max_model_len, max_num_seqs=1,
                                                       max_num_batched_tokens=8))
        engine.warmup()
        engine.add(EngineRequest(1, [5], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
        outputs = []
        while engine.has_unfinished():
            outputs += engine.step()
        assert [out.finish_reason for out in outputs] == ["length"]
        assert (engine._budget.fixed_s is not None) == (max_model_len >= 3)  # 2: a one-token prompt, one output


def test_the_burst_ratio_setting_reaches_the_scheduler(tmp_path, caplog):
    from ringstream.daemon.common.config import Config
    from ringstream.daemon.engine.engine import Engine
    from tests.factories import load_model, load_tokenizer, make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path)
    config = EngineConfig.from_settings(Config(prefill_burst_ratio=2.0), num_blocks=32, max_num_seqs=2,
                                        max_num_batched_tokens=8)
    engine = Engine(load_model(model_dir), load_tokenizer(model_dir), config)
    assert engine._scheduler.burst_ratio == 2.0
    assert "no effect" not in caplog.text
    untimed = EngineConfig.from_settings(Config(prefill_burst_ratio=2.0, max_step_ms=0), num_blocks=32,
                                         max_num_seqs=2, max_num_batched_tokens=8)
    Engine(load_model(model_dir), load_tokenizer(model_dir), untimed)
    assert "prefill_burst_ratio has no effect with max_step_ms = 0" in caplog.text  # no time bound to lift


def test_the_burst_ratio_defaults_to_the_devices_and_zero_turns_it_off(tmp_path, caplog):
    from ringstream.daemon.common.config import Config
    from ringstream.daemon.engine.engine import Engine
    from ringstream.daemon.engine.step_budget import CPU_PREFILL_BURST_RATIO, default_prefill_burst_ratio
    from tests.factories import load_model, load_tokenizer, make_tiny_model_dir

    assert (default_prefill_burst_ratio("cpu"), default_prefill_burst_ratio("cuda")) == (CPU_PREFILL_BURST_RATIO, 0)
    assert EngineConfig().check().prefill_burst_ratio is None and Config().prefill_burst_ratio is None
    model_dir = make_tiny_model_dir(tmp_path)
    ratios = {}
    for name, settings in {"unset": {}, "off": {"prefill_burst_ratio": 0.0}, "untimed": {"max_step_ms": 0}}.items():
        config = EngineConfig.from_settings(Config(**settings), num_blocks=32, max_num_seqs=2,
                                            max_num_batched_tokens=8)
        ratios[name] = Engine(load_model(model_dir), load_tokenizer(model_dir), config)._scheduler.burst_ratio
    assert ratios == {"unset": CPU_PREFILL_BURST_RATIO, "off": 0, "untimed": 0}
    assert "no effect" not in caplog.text  # the default says nothing where there is no time bound to lift


def test_a_step_is_observed_from_its_schedule():
    # a decode row (its last known token), a prompt's first chunk and a later chunk, as the engine schedules them
    from dataclasses import dataclass

    @dataclass(eq=False)
    class Seq:
        token_ids: list
        num_computed: int

    decode, first, later = Seq([1] * 40, 39), Seq([1] * 300, 0), Seq([1] * 300, 200)
    seen = []
    budget = StepBudget(100, 2048)
    budget.observe = lambda *args: seen.append(args)
    budget.observe_step({decode: 1, first: 50, later: 30}, 0.07)
    assert seen == [(1, 80, 0.07, chunk_pairs(0, 50) + chunk_pairs(200, 30))]
    assert "not measured" in budget.describe()
    budget = StepBudget(100, 2048)
    budget.calibrate(step_time(1), 256, chunk_time(0, 256), second_chunk_s=chunk_time(256, 256))
    assert budget.describe().startswith("100 ms a step") and "1.000 ms a row" in budget.describe()


def test_a_cpu_step_carries_at_least_its_floor_of_prompt_tokens():
    # a slow host: 16 decode rows alone take the target, so the time fit leaves a chunk of ~decode-step's worth
    slow = dict(fixed_s=0.030, row_s=0.001)
    fitted, floored = StepBudget(50, 2048), StepBudget(50, 2048, default_min_chunk_tokens("cpu"))
    for budget in (fitted, floored):
        budget.calibrate(step_time(1, **slow), 256, step_time(256, **slow))
    assert fitted.chunk_tokens(16) == 46  # 2 x 46 ms: the decodes' step again
    assert floored.chunk_tokens(16) == CPU_MIN_CHUNK_TOKENS == 64
    assert floored.chunk_tokens(16, 4000) == 64  # however deep the chunk
    fast = dict(fixed_s=0.010, row_s=0.0003)  # where the fit leaves more, the floor changes nothing
    fitted, floored = StepBudget(50, 2048), StepBudget(50, 2048, default_min_chunk_tokens("cpu"))
    for budget in (fitted, floored):
        budget.calibrate(step_time(1, **fast), 256, step_time(256, **fast))
    assert floored.chunk_tokens(16) == fitted.chunk_tokens(16) == 117
    assert StepBudget(50, 40, 64).chunk_tokens(16) == 24  # within the token budget still
    assert default_min_chunk_tokens("cuda") == MIN_CHUNK_TOKENS
    with pytest.raises(ValueError, match="min_chunk_tokens"):
        StepBudget(50, 2048, 0)
