"""Tests of daemon.sampler: greedy fast path, top-k / top-p filtering, seeded draws."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringstream.daemon.engine.sampler import (SamplingTensors, greedy_tokens, sample, token_seed,
                                               top_k_top_p_threshold)

VOCAB = 32


def make_params(
    n: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: list[bool] | None = None,
    seeded_rows: list[tuple[int, torch.Generator]] | None = None,
    generator: torch.Generator | None = None,
    vocab: int = VOCAB,
) -> SamplingTensors:
    greedy = greedy if greedy is not None else [False] * n
    return SamplingTensors(
        temperature=torch.tensor([1.0 if g else temperature for g in greedy]),
        greedy=torch.tensor(greedy),
        top_k=torch.full((n,), top_k if top_k else vocab),
        top_p=torch.full((n,), top_p),
        all_greedy=all(greedy),
        any_greedy=any(greedy),
        use_top_k=bool(top_k),
        use_top_p=top_p < 1.0,
        seeded_rows=seeded_rows or [],
        generator=generator,
    )


def seeded(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def test_all_greedy_is_argmax():
    logits = torch.randn(5, VOCAB, generator=seeded(0))
    assert torch.equal(sample(logits, make_params(5, greedy=[True] * 5)), logits.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_tokens_of_reduced_logits_equal_their_own_argmax(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(64, 4096) * 4).to(dtype)
    logits[0, 7] = logits[0, 3] = logits[0].max() + 1  # a tie: the lowest index
    logits[1, 9] = float("nan")  # NaN above all
    logits[2] = float("-inf")  # every value equal
    logits[3, 100] = float("inf")
    want = logits.argmax(dim=-1)
    assert want[:4].tolist() == [3, 9, 0, 100]
    got = greedy_tokens(logits)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(sample(logits, make_params(64, greedy=[True] * 64)), want)


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = torch.randn(6, VOCAB, generator=seeded(1))
    greedy = [True, False, True, False, True, False]
    tokens = sample(logits, make_params(6, greedy=greedy, temperature=5.0, generator=seeded(2)))
    for row, is_greedy in enumerate(greedy):
        if is_greedy:
            assert tokens[row] == logits[row].argmax()


def test_top_k_one_equals_greedy_at_any_temperature():
    logits = torch.randn(16, VOCAB, generator=seeded(3))
    tokens = sample(logits, make_params(16, temperature=10.0, top_k=1, generator=seeded(4)))
    assert torch.equal(tokens, logits.argmax(-1))


def naive_keep_set(row: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """Reference: HF TopKLogitsWarper then TopPLogitsWarper semantics, written plainly."""
    order = sorted(range(len(row)), key=lambda i: -row[i].item())
    kept = order[:top_k] if top_k else order
    top_p = float(torch.tensor(top_p, dtype=torch.float32))  # the precision the sampler sees
    if top_p >= 1.0:
        return set(kept)  # top_p = 1 switches the filter off (float sums of the tail may stop short of 1)
    probs = torch.softmax(row[kept], dim=0).tolist()
    result, mass = [], 0.0
    for token, prob in zip(kept, probs):
        result.append(token)
        mass += prob
        if mass >= top_p - 1e-6:
            break
    return set(result)


def kept_sets(logits, top_k, top_p, candidates=None) -> list[set[int]]:
    threshold = top_k_top_p_threshold(logits, top_k, top_p, candidates=candidates)
    kept = logits >= threshold.unsqueeze(1)
    return [set(torch.nonzero(row).flatten().tolist()) for row in kept]


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.lists(st.tuples(st.integers(0, VOCAB), st.floats(0.05, 1.0)), min_size=1, max_size=6),
    scale=st.sampled_from([0.3, 1.0, 4.0]),
    candidates=st.sampled_from([None, 2, 5]),
)
def test_top_k_top_p_matches_reference(seed, rows, scale, candidates):
    logits = torch.randn(len(rows), VOCAB, generator=seeded(seed)) * scale
    top_k = torch.tensor([k if k else VOCAB for k, _ in rows])
    top_p = torch.tensor([p for _, p in rows])
    for (k, p), kept, row in zip(rows, kept_sets(logits, top_k, top_p, candidates), logits):
        expected = naive_keep_set(row, k, p)
        # Only tokens whose cumulative mass sits on the top_p boundary within
        # float rounding may differ: one token, or tail tokens of negligible probability.
        probs = torch.softmax(row, dim=0)
        differ = kept ^ expected
        assert len(differ) <= 1 or all(probs[t].item() < 1e-5 for t in differ), differ
        assert row.argmax().item() in kept


def test_threshold_with_only_top_k_or_only_top_p():
    logits = torch.randn(3, VOCAB, generator=seeded(10))
    top_k = torch.tensor([1, 4, VOCAB])
    assert [len(s) for s in kept_sets(logits, top_k, None)] == [1, 4, VOCAB]
    top_p = torch.tensor([1.0, 1.0, 1.0])
    assert [len(s) for s in kept_sets(logits, None, top_p)] == [VOCAB] * 3


def test_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))

    def keep(p: float) -> set[int]:
        return kept_sets(logits, None, torch.tensor([p]))[0]

    assert keep(0.45) == {0}
    assert keep(0.6) == {0, 1}
    assert keep(0.95) == {0, 1, 2}
    assert keep(5e-324) == keep(1e-300) == {0}  # below float32's range: still the most likely token


def test_top_k_then_top_p_renormalises():
    # After top-2 the distribution is (0.625, 0.375): top_p 0.6 keeps one token.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    assert kept_sets(logits, torch.tensor([2]), torch.tensor([0.6]))[0] == {0}
    assert kept_sets(logits, torch.tensor([3]), torch.tensor([0.6]))[0] == {0, 1}


def test_sampled_frequencies_follow_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    n = 20000
    logits = torch.log(probs).expand(n, -1).contiguous()
    tokens = sample(logits, make_params(n, vocab=3, generator=seeded(5)))
    freq = torch.bincount(tokens, minlength=3).double() / n
    # 5 standard errors of a binomial proportion.
    tolerance = 5 * math.sqrt(0.25 / n)
    assert torch.allclose(freq, probs.double(), atol=tolerance)


def test_top_p_sampling_renormalises_nucleus():
    n = 20000
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2])).expand(n, -1).contiguous()
    tokens = sample(logits, make_params(n, vocab=3, top_p=0.6, generator=seeded(11)))
    freq = torch.bincount(tokens, minlength=3).double() / n
    tolerance = 5 * math.sqrt(0.25 / n)
    assert torch.allclose(freq, torch.tensor([0.625, 0.375, 0.0], dtype=torch.float64), atol=tolerance)


def test_temperature_sharpens_distribution():
    logits = torch.log(torch.tensor([0.6, 0.4])).expand(4000, -1).contiguous()
    cold = sample(logits, make_params(4000, vocab=2, temperature=0.2, generator=seeded(6)))
    hot = sample(logits, make_params(4000, vocab=2, temperature=5.0, generator=seeded(6)))
    assert (cold == 0).float().mean() > 0.85
    assert 0.4 < (hot == 0).float().mean() < 0.6


def test_seeded_row_ignores_batch_companions():
    target = torch.randn(VOCAB, generator=seeded(7))
    results = set()
    for batch_size, row in [(1, 0), (4, 2), (9, 8)]:
        logits = torch.randn(batch_size, VOCAB, generator=seeded(batch_size))
        logits[row] = target
        params = make_params(
            batch_size,
            temperature=1.5,
            seeded_rows=[(row, seeded(token_seed(42, 3)))],
            generator=seeded(batch_size + 100),
        )
        results.add(sample(logits, params)[row].item())
    assert len(results) == 1


def test_unseeded_rows_vary():
    logits = torch.zeros(1, 1000)
    draws = {sample(logits, make_params(1, vocab=1000, generator=seeded(i))).item() for i in range(10)}
    assert len(draws) > 5


def test_masked_tokens_are_never_sampled():
    logits = torch.randn(2000, VOCAB, generator=seeded(8))
    tokens = sample(logits, make_params(2000, temperature=3.0, top_k=3, generator=seeded(9)))
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == tokens.unsqueeze(1)).any(dim=1).all()


@pytest.mark.parametrize("seed", [0, 1, 2**63 - 1])
def test_token_seed_is_distinct_and_in_range(seed):
    values = {token_seed(seed, seq) for seq in range(1000)}
    assert len(values) == 1000
    assert all(0 <= v < 2**64 for v in values)
    assert token_seed(seed, 0) != token_seed(seed + 1, 0)


def test_known_limits_read_nothing_back_for_top_k_rows(monkeypatch):
    # rows with top-k (some with top-p too) and no top-p row without top-k: on a device every host read is a sync
    logits = torch.randn(4, VOCAB, generator=seeded(7))
    top_k = torch.tensor([3, 5, 2, 4])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.7])
    want = top_k_top_p_threshold(logits, top_k, top_p)

    def no_host_read(self):
        raise AssertionError("a tensor was read back on the host")

    monkeypatch.setattr(torch.Tensor, "__bool__", no_host_read)
    got = top_k_top_p_threshold(logits, top_k, top_p, limits=(5, False))
    monkeypatch.undo()
    assert torch.equal(got, want)
