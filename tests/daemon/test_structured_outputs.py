"""Structured outputs in the engine: sampled at temperature 1.0, so only the constraint can make them valid."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
import torch

from ringstream.daemon.engine.engine import Engine, EngineConfig, EngineRequest, RequestError, SamplingParams
from ringstream.daemon.common.grammar import grammar_text
from ringstream.ipc.wire import StructuredOutputs
from tests.factories import load_model, load_tokenizer

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / "daemon" / "default_model"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,5}"
CHOICES = ["yes", "no", "maybe"]
LARK = 'start: "a" letter letter? letter? "d"\nletter: "b" | "c"'
GBNF = 'root ::= "x" [0-9] [0-9]? [0-9]? "y"'


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def default():
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        pytest.skip("daemon/default_model is not present")
    return load_model(DEFAULT_MODEL_DIR), load_tokenizer(DEFAULT_MODEL_DIR)


def engine_of(default, **config) -> Engine:
    model, tokenizer = default
    engine = Engine(model, tokenizer, EngineConfig(**{"max_num_seqs": 8, **config}), eos_token_ids=(1,))
    engine.warmup()
    return engine


def run(engine: Engine, requests: list[EngineRequest]) -> dict[int, list]:
    outputs: dict[int, list] = {}
    pending = list(requests)
    while pending or engine.has_unfinished():
        while pending and engine.stats().num_running + engine.stats().num_waiting < engine.max_num_seqs:
            engine.add(pending.pop(0))
        for out in engine.step():
            outputs.setdefault(out.handle, []).append(out)
    return outputs


def check_schema(value) -> None:
    assert isinstance(value, dict) and set(value) == {"name", "age", "tags"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "b"}


def check(kind: str, text: str) -> None:
    if kind == "json":
        check_schema(json.loads(text))
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    elif kind == "lark":
        assert re.fullmatch(r"a[bc]{1,3}d", text), text
    else:
        assert re.fullmatch(r"x[0-9]{1,3}y", text), text


CONSTRAINTS = {
    "json": StructuredOutputs(json=json.dumps(SCHEMA)),
    "json_object": StructuredOutputs(json_object=True),
    "regex": StructuredOutputs(regex=REGEX),
    "choice": StructuredOutputs(choice=CHOICES),
    "lark": StructuredOutputs(grammar=LARK),
    "gbnf": StructuredOutputs(grammar=GBNF),
}


def test_sampled_outputs_meet_their_constraint_beside_free_rows(default):
    model, tokenizer = default
    engine = engine_of(default)
    prompt = tokenizer.encode("Convert a string to a tuple").ids
    requests, kinds = [], {}
    for seed in range(3):
        for kind, constraint in CONSTRAINTS.items():
            if kind == "json_object":
                continue  # unbounded: a weak model wanders inside a key (the test below)
            handle = len(requests)
            kinds[handle] = kind
            requests.append(EngineRequest(handle, prompt, SamplingParams(
                max_tokens=120, temperature=1.0, seed=seed, structured_outputs=constraint)))
    free = EngineRequest(len(requests), prompt, SamplingParams(max_tokens=12, temperature=0.0))
    outputs = run(engine, requests + [free])
    for request in requests:
        outs = outputs[request.handle]
        assert outs[-1].finish_reason == "stop", (kinds[request.handle], outs[-1].finish_reason)
        check(kinds[request.handle], "".join(o.text for o in outs))
    # the unconstrained row is what generate() gives on its prompt alone
    with torch.inference_mode():
        want = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=12, do_sample=False, eos_token_id=1, pad_token_id=1)
    assert free.output_token_ids == want[0, len(prompt):].tolist()[:len(free.output_token_ids)]


def test_json_object_outputs_that_end_parse_as_objects(default):
    _, tokenizer = default
    engine = engine_of(default)
    prompt = tokenizer.encode("Convert a string to a tuple").ids
    requests = [EngineRequest(seed, prompt, SamplingParams(max_tokens=200, temperature=1.0, seed=seed,
                                                           structured_outputs=CONSTRAINTS["json_object"]))
                for seed in range(6)]
    outputs = run(engine, requests)
    ended = [r for r in requests if outputs[r.handle][-1].finish_reason == "stop"]
    assert ended  # seeded: the same ones end on every run
    for request in ended:
        assert isinstance(json.loads("".join(o.text for o in outputs[request.handle])), dict)
    for request in requests:  # the others were cut by max_tokens inside the object
        assert "".join(o.text for o in outputs[request.handle]).startswith("{")


def test_greedy_rows_are_constrained_too(default):
    _, tokenizer = default
    engine = engine_of(default)
    prompt = tokenizer.encode("Return the").ids
    kinds = [kind for kind in CONSTRAINTS if kind != "json_object"]
    requests = [EngineRequest(i, prompt, SamplingParams(max_tokens=120, temperature=0.0,
                                                        structured_outputs=CONSTRAINTS[kind]))
                for i, kind in enumerate(kinds)]
    outputs = run(engine, requests)
    for request, kind in zip(requests, kinds):
        assert outputs[request.handle][-1].finish_reason == "stop", kind
        check(kind, "".join(o.text for o in outputs[request.handle]))


@pytest.mark.parametrize("constraint,words", [
    (StructuredOutputs(regex="a", choice=["b"]), "exactly one of"),
    (StructuredOutputs(), "got none"),
])
def test_a_constraint_of_no_kind_or_several_is_refused_at_add(default, constraint, words):
    engine = engine_of(default)
    with pytest.raises(ValueError, match=re.escape(words)):
        engine.add(EngineRequest(0, [5, 6, 7], SamplingParams(max_tokens=8, structured_outputs=constraint)))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("constraint,words", [
    (StructuredOutputs(json='{"type": "objectx"}'), "structured_outputs.json"),
    (StructuredOutputs(json="{not json"), "structured_outputs.json: not JSON"),
    (StructuredOutputs(regex="[0-9"), "structured_outputs.regex"),
    (StructuredOutputs(grammar="start: undefined_rule"), "structured_outputs.grammar"),
])
def test_a_constraint_that_does_not_compile_ends_its_request_invalid_before_it_is_scheduled(default, constraint,
                                                                                           words):
    engine = engine_of(default)
    engine.add(EngineRequest(0, [5, 6, 7], SamplingParams(max_tokens=8, structured_outputs=constraint)))
    engine.add(EngineRequest(1, [5, 6, 7], SamplingParams(max_tokens=4)))  # the engine serves on
    outputs = run(engine, [])
    (error,) = outputs[0]
    assert isinstance(error, RequestError) and error.invalid and words in error.message
    assert len(outputs[1]) == 4 and not engine.has_unfinished()
    assert engine.stats().num_free_blocks == engine.stats().num_blocks  # nothing was allocated for it


def test_a_slow_compile_does_not_stall_other_streams_and_can_be_aborted(default, monkeypatch):
    engine = engine_of(default)
    release = threading.Event()
    real = engine._grammars.matcher

    def slow(constraint, output=()):
        release.wait(30)
        return real(constraint, output)

    monkeypatch.setattr(engine._grammars, "matcher", slow)
    engine.add(EngineRequest(0, [5, 6, 7], SamplingParams(max_tokens=20, structured_outputs=CONSTRAINTS["regex"])))
    engine.add(EngineRequest(1, [5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True)))
    engine.add(EngineRequest(2, [5, 6, 8], SamplingParams(max_tokens=6, structured_outputs=CONSTRAINTS["choice"])))
    free = []
    while len(free) < 6:  # the free stream runs to its end while both compiles wait
        free += [o for o in engine.step() if o.handle == 1]
    assert engine.stats().num_waiting == 2 and engine.abort(2) and not engine.abort(2)
    release.set()
    outputs = run(engine, [])
    assert 2 not in outputs and outputs[0][-1].finish_reason == "stop"
    check("regex", "".join(o.text for o in outputs[0]))


def test_a_resumed_request_continues_its_constraint(default):
    _, tokenizer = default
    engine = engine_of(default)
    prompt = tokenizer.encode("Convert a string").ids
    constraint = CONSTRAINTS["json"]
    first = EngineRequest(0, prompt, SamplingParams(max_tokens=120, temperature=1.0, seed=7,
                                                    structured_outputs=constraint))
    whole = run(engine, [first])[0]
    cut = len(whole) // 2
    resumed = EngineRequest(1, prompt, SamplingParams(max_tokens=120, temperature=1.0, seed=7,
                                                      structured_outputs=constraint),
                            output_token_ids=list(first.output_token_ids[:cut]))
    rest = run(engine, [resumed])[1]
    assert resumed.output_token_ids == first.output_token_ids  # seeded: the same tokens, resumed
    check_schema(json.loads("".join(o.text for o in whole[:cut] + rest)))
    stray = tokenizer.encode("hello").ids
    engine.add(EngineRequest(2, prompt, SamplingParams(max_tokens=50, structured_outputs=constraint),
                             output_token_ids=stray))
    (error,) = run(engine, [])[2]
    assert error.invalid and "do not meet structured_outputs.json" in error.message


def test_preempted_constrained_requests_stay_valid(default):
    _, tokenizer = default
    # a pool too small for every request at once: the newest are preempted and recomputed
    engine = engine_of(default, num_blocks=12, block_size=16, max_model_len=160)
    prompts = [tokenizer.encode(text).ids for text in ("Convert a string", "Return the value", "Parse a file")]
    requests = [EngineRequest(i, prompts[i % 3], SamplingParams(max_tokens=100, temperature=1.0, seed=i,
                                                                structured_outputs=CONSTRAINTS["json"]))
                for i in range(6)]
    outputs = run(engine, requests)
    assert engine.stats().num_preemptions > 0
    for request in requests:
        check_schema(json.loads("".join(o.text for o in outputs[request.handle])))


def test_grammar_texts_are_kept_per_constraint():
    grammar_text(CONSTRAINTS["choice"])
    from ringstream.daemon.common import grammar

    hits = grammar._grammar_text.cache_info().hits
    grammar_text(StructuredOutputs(choice=list(CHOICES)))  # equal constraint, another object
    assert grammar._grammar_text.cache_info().hits == hits + 1


def test_eos_before_the_constraint_is_complete_ends_with_error_not_stop(default):
    _, tokenizer = default
    engine = engine_of(default)
    eos_text = tokenizer.id_to_token(1)
    requests = [
        # a literal that is the EOS token's text: llguidance allows EOS there, mid-constraint
        EngineRequest(0, [5, 6, 7], SamplingParams(max_tokens=20, temperature=0.0,
                                                   structured_outputs=StructuredOutputs(regex=f"a{eos_text}b"))),
        # a grammar no output meets: its mask allows EOS alone
        EngineRequest(1, [5, 6, 7], SamplingParams(max_tokens=20, temperature=0.0,
                                                   structured_outputs=StructuredOutputs(grammar='start: start "a"'))),
        EngineRequest(2, [5, 6, 7], SamplingParams(max_tokens=20, temperature=0.0,
                                                   structured_outputs=StructuredOutputs(choice=["yes", "no"]))),
    ]
    outputs = run(engine, requests)
    assert outputs[0][-1].finish_reason == "error"
    # no output meets it: its first mask is EOS alone, an error the compile thread sees before scheduling
    assert len(outputs[1]) == 1 and isinstance(outputs[1][0], RequestError) and outputs[1][0].invalid
    assert outputs[2][-1].finish_reason == "stop"  # the others' streams are unharmed


def test_a_schema_too_complex_for_the_parser_ends_its_stream_alone_with_a_short_reason(default, caplog):
    # hundreds of optional properties: llguidance compiles it, then the mask after "{" exceeds its parser's
    # row limit (ParserTooComplex); that stream ends with error, its logged reason cut short, the other goes on
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}
    engine = engine_of(default)
    outputs = run(engine, [
        EngineRequest(0, [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0,
                                                   structured_outputs=StructuredOutputs(json=json.dumps(schema)))),
        EngineRequest(1, [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))])
    assert outputs[0][-1].finish_reason == "error"
    assert len(outputs[1]) == 4 and outputs[1][-1].finish_reason == "length"
    (record,) = [r for r in caplog.records if "dead end" in r.getMessage()]
    assert "ParserTooComplex" in record.getMessage() or "max is 2000" in record.getMessage()
    assert len(record.getMessage()) < 700


@pytest.mark.parametrize("schema,words", [("[" * 5000 + "]" * 5000, "nested too deeply"),
                                          ("false", "admits no value")])
def test_schemas_that_cannot_be_read_are_refused(schema, words):
    with pytest.raises(ValueError, match=words):
        grammar_text(StructuredOutputs(json=schema))


def test_the_schema_true_admits_any_json(default):
    _, tokenizer = default
    engine = engine_of(default)
    request = EngineRequest(0, [5, 6, 7], SamplingParams(max_tokens=60, temperature=0.0,
                                                         structured_outputs=StructuredOutputs(json="true")))
    outs = run(engine, [request])[0]  # accepted: not refused as "no object schema"
    assert outs[-1].finish_reason in ("stop", "length")
    if outs[-1].finish_reason == "stop":
        json.loads("".join(o.text for o in outs))
