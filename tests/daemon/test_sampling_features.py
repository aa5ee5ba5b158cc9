"""Penalties, min_p, min_tokens and logprobs in the engine, each against a reference written here.

References: ``torch.log_softmax`` of the model's own float32 forward for the
logprobs (the raw logprobs vLLM returns by default), a plain Python loop over
the vocabulary for the presence / frequency penalties, Hugging Face's
``RepetitionPenaltyLogitsProcessor`` for the repetition penalty, and a
probability-space rule for min_p. A mixed batch gives every row what it gets alone.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from ringstream.daemon.engine.engine import Engine, EngineConfig, EngineRequest, SamplingParams
from ringstream.daemon.engine.sampler import SamplingTensors, apply_penalties, sample
from ringstream.daemon.common.stops import StopScanner
from tests.factories import load_model, load_tokenizer, make_tiny_model_dir

TEXT = "The engine keeps keys and values in a paged cache of fixed-size blocks. Requests join and leave"


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))
    return load_model(model_dir), load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def prompt(tiny) -> list[int]:
    return tiny[1].encode(TEXT).ids[:24]


def make_engine(tiny, **kwargs) -> Engine:
    model, tokenizer = tiny
    eos_token_ids = kwargs.pop("eos_token_ids", (1,))
    kwargs.setdefault("max_num_seqs", 8)
    return Engine(model, tokenizer, EngineConfig(**kwargs), eos_token_ids=eos_token_ids)


def run(engine: Engine, requests: list[EngineRequest]) -> dict[int, list]:
    for req in requests:
        engine.add(req)
    outputs: dict[int, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.handle, []).append(out)
    return outputs


def raw_logprobs(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]`` log_softmax of the model's own float32 forward over ``ids``."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(dim=-1)


def assert_logprob(entry, token_id: int, row: torch.Tensor, k: int) -> None:
    assert entry.token_id == token_id
    assert entry.logprob == pytest.approx(row[token_id].item(), abs=1e-4)
    values, indices = row.topk(k)
    assert [t for t, _ in entry.top] == indices.tolist()
    assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


# ----------------------------------------------------------------------- logprobs

def test_greedy_logprobs_equal_log_softmax_of_the_models_forward(tiny, prompt):
    model = tiny[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, ignore_eos=True)
    outputs = run(make_engine(tiny), [EngineRequest(1, prompt, params)])[1]
    output_ids = [o.token_id for o in outputs]
    reference = raw_logprobs(model, prompt + output_ids)
    for j, out in enumerate(outputs):
        row = reference[len(prompt) - 1 + j]
        assert out.token_id == int(row.argmax())
        assert_logprob(out.logprobs, out.token_id, row, 5)
    zero = run(make_engine(tiny), [EngineRequest(2, prompt, SamplingParams(max_tokens=2, temperature=0.0,
                                                                           logprobs=0, ignore_eos=True))])[2]
    assert zero[0].logprobs.top == [] and zero[0].logprobs.token_id == output_ids[0]
    plain = run(make_engine(tiny), [EngineRequest(3, prompt, SamplingParams(max_tokens=2, temperature=0.0))])[3]
    assert plain[0].logprobs is None and plain[0].prompt_logprobs is None


def test_sampled_tokens_get_their_raw_logprob_not_the_processed_one(tiny, prompt):
    model = tiny[0]
    params = SamplingParams(max_tokens=4, temperature=0.7, top_k=3, seed=5, logprobs=2, ignore_eos=True,
                            presence_penalty=1.0)
    outputs = run(make_engine(tiny), [EngineRequest(1, prompt, params)])[1]
    reference = raw_logprobs(model, prompt + [o.token_id for o in outputs])
    for j, out in enumerate(outputs):
        assert_logprob(out.logprobs, out.token_id, reference[len(prompt) - 1 + j], 2)


@pytest.mark.parametrize("budget", [64, 7])  # whole prompt in one step; chunked prefill over four steps
def test_prompt_logprobs_equal_the_forward_and_skip_the_prefix_cache(tiny, prompt, budget):
    model = tiny[0]
    engine = make_engine(tiny, max_num_seqs=4, max_num_batched_tokens=budget, block_size=4)
    run(engine, [EngineRequest(1, prompt, SamplingParams(max_tokens=1, temperature=0.0))])  # fills the cache
    hits = engine.stats().prefix_hits
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3, ignore_eos=True)
    outputs = run(engine, [EngineRequest(2, prompt, params)])[2]
    assert engine.stats().prefix_hits == hits  # every prompt position was computed again
    entries = outputs[0].prompt_logprobs
    assert len(entries) == len(prompt) - 1 and outputs[1].prompt_logprobs is None
    reference = raw_logprobs(model, prompt)
    for i, entry in enumerate(entries):
        assert_logprob(entry, prompt[i + 1], reference[i], 3)
    run(engine, [EngineRequest(3, prompt, SamplingParams(max_tokens=1, temperature=0.0))])
    assert engine.stats().prefix_hits > hits  # without prompt logprobs the cache serves again


# ---------------------------------------------------------------------- penalties

def penalized_reference(logits: torch.Tensor, prompt: list[int], output: list[int], presence: float,
                        frequency: float, repetition: float) -> torch.Tensor:
    """The penalties of vLLM / OpenAI written out token by token (repetition: Hugging Face's processor)."""
    logits = logits.clone()
    if repetition != 1.0:
        logits = RepetitionPenaltyLogitsProcessor(repetition)(torch.tensor([prompt + output]), logits[None])[0]
    for token in set(output):
        logits[token] -= frequency * output.count(token) + presence
    return logits


def greedy_reference(model, prompt: list[int], steps: int, eos: int | None = None, min_tokens: int = 0,
                     **penalties) -> list[int]:
    output: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + output])).logits[0, -1].float()
        if penalties:
            logits = penalized_reference(logits, prompt, output, penalties.get("presence", 0.0),
                                         penalties.get("frequency", 0.0), penalties.get("repetition", 1.0))
        if eos is not None and len(output) < min_tokens:
            logits[eos] = float("-inf")
        output.append(int(logits.argmax()))
        if output[-1] == eos:
            break
    return output


PENALTIES = [
    dict(presence=1.5),
    dict(frequency=0.8),
    dict(presence=-0.5, frequency=1.2),
    dict(repetition=1.8),
    dict(repetition=0.6),
    dict(presence=0.4, frequency=0.3, repetition=1.3),
]


@pytest.mark.parametrize("penalties", PENALTIES)
def test_greedy_penalties_equal_the_reference(tiny, prompt, penalties):
    model = tiny[0]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                            presence_penalty=penalties.get("presence", 0.0),
                            frequency_penalty=penalties.get("frequency", 0.0),
                            repetition_penalty=penalties.get("repetition", 1.0))
    got = [o.token_id for o in run(make_engine(tiny), [EngineRequest(1, prompt, params)])[1]]
    assert got == greedy_reference(model, prompt, 12, **penalties)


def test_penalties_change_the_output(tiny, prompt):
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    strong = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=3.0,
                            frequency_penalty=2.0)
    outputs = run(make_engine(tiny), [EngineRequest(1, prompt, plain), EngineRequest(2, prompt, strong)])
    first, second = ([o.token_id for o in outputs[h]] for h in (1, 2))
    assert first != second
    assert len(set(second)) == len(second)  # a frequency penalty of 2 on a near-flat model: no repeats


def test_apply_penalties_on_random_logits_equals_the_reference():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=generator) * 3
    prompts = [[1, 2, 3, 3], [5], [7, 8]]
    outputs = [[3, 3, 9, 10, 10, 10], [], [8, 8, 1]]
    presence, frequency, repetition = [0.5, -1.0, 2.0], [0.25, 0.0, -0.5], [1.5, 1.0, 0.7]
    got = apply_penalties(logits.clone(), prompts, outputs, torch.tensor(presence), torch.tensor(frequency),
                          torch.tensor(repetition))
    for row in range(3):
        expected = penalized_reference(logits[row], prompts[row], outputs[row], presence[row], frequency[row],
                                       repetition[row])
        assert torch.allclose(got[row], expected, atol=1e-6)


# -------------------------------------------------------------------------- min_p

def min_p_allowed(logits: torch.Tensor, temperature: float, min_p: float) -> set[int]:
    probs = torch.softmax(logits / temperature, dim=-1)
    return {i for i, p in enumerate(probs.tolist()) if p >= min_p * probs.max().item()}


def test_min_p_keeps_exactly_the_tokens_the_rule_keeps():
    logits = torch.tensor([[2.0, 1.9, 1.0, 0.0, -1.0, 1.5, -3.0, 1.95]])
    for temperature, min_p in [(1.0, 0.5), (0.5, 0.3), (2.0, 0.9)]:
        allowed = min_p_allowed(logits[0], temperature, min_p)
        assert 1 < len(allowed) < logits.shape[1]
        drawn = set()
        for seed in range(400):
            tensors = SamplingTensors(
                temperature=torch.tensor([temperature]), greedy=torch.tensor([False]),
                top_k=torch.tensor([8]), top_p=torch.tensor([1.0]), all_greedy=False, any_greedy=False,
                use_top_k=False, use_top_p=False, generator=torch.Generator().manual_seed(seed),
                min_p=torch.tensor([min_p]))
            drawn.add(int(sample(logits, tensors)))
        assert drawn == allowed, (temperature, min_p)


def test_min_p_of_one_samples_the_argmax(tiny, prompt):
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    min_p = SamplingParams(max_tokens=8, temperature=1.0, seed=3, min_p=1.0, ignore_eos=True)
    random = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    outputs = run(make_engine(tiny), [EngineRequest(h, prompt, p) for h, p in enumerate((greedy, min_p, random))])
    tokens = {h: [o.token_id for o in outs] for h, outs in outputs.items()}
    assert tokens[1] == tokens[0] and tokens[2] != tokens[0]


# ----------------------------------------------------------------------- min_tokens

def test_min_tokens_holds_back_eos_and_stop_token_ids(tiny, prompt):
    model = tiny[0]
    free = greedy_reference(model, prompt, 8)
    eos = free[2]  # greedy would end at its third token with this EOS
    plain = run(make_engine(tiny, eos_token_ids=(eos,)),
                [EngineRequest(1, prompt, SamplingParams(max_tokens=8, temperature=0.0))])[1]
    assert [o.token_id for o in plain] == free[:3] and plain[-1].finish_reason == "stop"
    held = run(make_engine(tiny, eos_token_ids=(eos,)),
               [EngineRequest(2, prompt, SamplingParams(max_tokens=12, temperature=0.0, min_tokens=6))])[2]
    got = [o.token_id for o in held]
    assert eos not in got[:6] and len(got) >= 7
    assert got == greedy_reference(model, prompt, 12, eos=eos, min_tokens=6)
    as_stop_id = run(make_engine(tiny, eos_token_ids=(2,)),
                     [EngineRequest(3, prompt, SamplingParams(max_tokens=12, temperature=0.0, min_tokens=6,
                                                              stop_token_ids=[eos]))])[3]
    assert eos not in [o.token_id for o in as_stop_id][:6]


def test_min_tokens_defers_stop_strings_as_vllm_does():
    scanner = StopScanner(["ab"])
    assert scanner.add("xab", check=False) == "xab" and scanner.stop_string is None  # within min_tokens
    assert scanner.add("a", check=False) == ""  # a stop string may start here...
    assert scanner.add("bc") == "" and scanner.stop_string == "ab"  # ...and end in a later token


def test_min_tokens_with_stop_strings_in_the_engine(tiny, prompt):
    free = run(make_engine(tiny), [EngineRequest(1, prompt, SamplingParams(max_tokens=10, temperature=0.0,
                                                                           ignore_eos=True))])[1]
    j = next(i for i, o in enumerate(free) if o.text)  # the first token that adds text; its text is the stop
    stop = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop=[free[j].text])
    stopped = run(make_engine(tiny), [EngineRequest(2, prompt, stop)])[2]
    assert len(stopped) == j + 1 and stopped[-1].stop_reason == free[j].text
    later = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop=[free[j].text], min_tokens=j + 1)
    outs = run(make_engine(tiny), [EngineRequest(3, prompt, later)])[3]
    assert len(outs) > j + 1 and "".join(o.text for o in outs).startswith(free[j].text)


# ------------------------------------------------------------------ mixed batches

def test_a_mixed_batch_gives_every_row_what_it_gets_alone(tiny, prompt):
    base = dict(max_tokens=6, ignore_eos=True)
    kinds = [
        SamplingParams(temperature=0.0, **base),
        SamplingParams(temperature=0.0, logprobs=3, **base),
        SamplingParams(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5, **base),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=1, **base),
        SamplingParams(temperature=0.9, seed=7, min_p=0.2, **base),
        SamplingParams(temperature=0.8, seed=8, top_k=5, **base),
        SamplingParams(temperature=0.0, prompt_logprobs=2, **base),
        SamplingParams(temperature=1.0, seed=9, min_tokens=4, logprobs=0, **base),
    ]
    prompts = [prompt[: 10 + 2 * i] for i in range(len(kinds))]
    alone = {}
    for h, (p, params) in enumerate(zip(prompts, kinds)):
        alone[h] = run(make_engine(tiny), [EngineRequest(h, p, params)])[h]
    together = run(make_engine(tiny, max_num_batched_tokens=64),
                   [EngineRequest(h, p, params) for h, (p, params) in enumerate(zip(prompts, kinds))])
    for h in alone:
        assert [o.token_id for o in together[h]] == [o.token_id for o in alone[h]], h
        for a, b in zip(alone[h], together[h]):
            assert (a.logprobs is None) == (b.logprobs is None) == (kinds[h].logprobs is None)
            if a.logprobs is not None:
                assert b.logprobs.logprob == pytest.approx(a.logprobs.logprob, abs=1e-4)
                assert [t for t, _ in b.logprobs.top] == [t for t, _ in a.logprobs.top]
            if a.prompt_logprobs is not None:
                assert [e.logprob for e in b.prompt_logprobs] == pytest.approx(
                    [e.logprob for e in a.prompt_logprobs], abs=1e-4)
    assert all(math.isfinite(e.logprob) for e in together[6][0].prompt_logprobs)


def test_prompt_logprobs_survive_a_preemption_mid_prefill(tiny, prompt):
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
    alone = run(make_engine(tiny), [EngineRequest(1, prompt, params)])[1]
    engine = make_engine(tiny, max_num_seqs=2, max_num_batched_tokens=3, block_size=4, num_blocks=12,
                         max_model_len=40)
    busy = EngineRequest(2, prompt[:10], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    both = run(engine, [busy, EngineRequest(1, prompt, params, priority=1)])
    assert engine.stats().num_preemptions > 0
    assert [o.token_id for o in both[1]] == [o.token_id for o in alone]
    got, expected = both[1][0].prompt_logprobs, alone[0].prompt_logprobs
    assert [e.token_id for e in got] == [e.token_id for e in expected] == prompt[1:]
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in expected], abs=1e-4)
