"""The time-based prompt-chunk budget: sized from measured costs, bounded by the token budget."""

import pytest

from ringstream.daemon.engine.step_budget import MIN_CHUNK_TOKENS, StepBudget, default_max_step_ms


def test_unmeasured_budget_is_the_token_budget_less_the_decodes():
    budget = StepBudget(250, 2048)
    assert budget.chunk_tokens(16) == 2032
    assert budget.chunk_tokens(5000) == 1


def test_chunk_fills_the_target_after_calibration():
    budget = StepBudget(250, 2048)
    budget.calibrate(decode_step_s=0.050, prompt_tokens=256, prompt_step_s=0.050 + 256 * 0.002)
    assert budget.token_s == pytest.approx(0.002)
    assert budget.chunk_tokens(16) == 100  # (0.250 - 0.050) / 0.002
    fast = StepBudget(250, 2048)
    fast.calibrate(decode_step_s=0.001, prompt_tokens=256, prompt_step_s=0.002)
    assert fast.chunk_tokens(16) == 2032  # the token setting stays the upper bound


def test_a_chunk_may_cost_as_much_as_the_decodes_past_the_target():
    budget = StepBudget(50, 2048)
    budget.calibrate(decode_step_s=0.080, prompt_tokens=100, prompt_step_s=0.280)
    assert budget.chunk_tokens(16) == 40  # 0.080 s of 2 ms tokens: the step takes 2 x 80 ms, not 50 ms
    slow = StepBudget(50, 2048)
    slow.calibrate(decode_step_s=0.001, prompt_tokens=1, prompt_step_s=1.0)
    assert slow.chunk_tokens(16) == MIN_CHUNK_TOKENS


def test_observations_follow_a_dearer_context():
    budget = StepBudget(250, 2048)
    budget.calibrate(decode_step_s=0.050, prompt_tokens=256, prompt_step_s=0.050 + 256 * 0.002)
    first = budget.chunk_tokens(16)
    for _ in range(30):  # later chunks of a long prompt attend more context: 4 ms a token
        budget.observe(decodes=16, prompt_tokens=50, seconds=0.050 + 50 * 0.004)
    assert budget.token_s == pytest.approx(0.004, rel=0.01)
    assert budget.chunk_tokens(16) == pytest.approx(first / 2, abs=2)
    budget.observe(decodes=16, prompt_tokens=0, seconds=0.090)
    assert 0.050 < budget.base_s < 0.090


def test_defaults_and_bad_targets():
    assert default_max_step_ms("cpu") > default_max_step_ms("cuda") > 0
    with pytest.raises(ValueError, match="max_step_ms"):
        StepBudget(0, 2048)
