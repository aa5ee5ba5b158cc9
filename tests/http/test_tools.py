"""Reading tool calls from a model's output (Hermes and Llama 3 formats, ``required`` and named calls) and
planning a request's tools, without a daemon."""

from __future__ import annotations

import json

import msgspec
import pytest

from ringstream.daemon.common.grammar import grammar_text
from ringstream.daemon.http import tools as T

WEATHER = T.FunctionDef(name="get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]})
CLOCK = T.FunctionDef(name="get_time")
TOOLS = [T.ToolDef(type="function", function=WEATHER), T.ToolDef(type="function", function=CLOCK)]


def plan(choice="auto", parser="hermes", **kw):
    return T.plan_tools(TOOLS, choice, None, None, kw.get("parallel"), parser, kw.get("constrained", False))


def read(p: T.ToolPlan, text: str, split: int | None = None, finish="stop"):
    """Feed ``text`` (in two pieces at ``split``, else one character at a time); the content, calls, finish."""
    stream = T.ToolStream(p)
    parts = [text[:split], text[split:]] if split is not None else list(text)
    pieces = [piece for part in parts for piece in stream.feed(part)]
    more, finish = stream.finish(finish)
    pieces += more
    content = "".join(piece.content for piece in pieces)
    args = {}
    for piece in pieces:
        if piece.call is not None:
            args[piece.call.index] = piece.call.arguments if p.choice != "named" else ""
    calls = [(c.name, json.loads(c.arguments)) for c in stream.calls]
    return content, calls, finish


HERMES = 'I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n' \
         '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'


@pytest.mark.parametrize("split", [None] + list(range(0, len(HERMES) + 1, 7)))
def test_hermes_calls_are_read_wherever_the_text_splits(split):
    content, calls, finish = read(plan(), HERMES, split)
    assert content == "I will look." and finish == "tool_calls"
    assert calls == [("get_weather", {"city": "Oslo"}), ("get_time", {})]


def test_hermes_text_that_only_looks_like_a_call_stays_text():
    assert read(plan(), "a <tool and <tool_cal") == ("a <tool and <tool_cal", [], "stop")
    broken = 'x<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert read(plan(), broken) == (broken, [], "stop")
    unclosed = '<tool_call>{"name": "get_time", "arguments": {"a": 1}}'  # EOS before </tool_call>
    assert read(plan(), unclosed) == ("", [("get_time", {"a": 1})], "tool_calls")
    assert read(plan(), unclosed, finish="length")[2] == "length"
    assert read(plan(), "  \n") == ("  \n", [], "stop")  # white space alone is the answer


def test_a_call_to_a_tool_not_offered_stays_text():
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert read(plan(), text) == (text, [], "stop")
    assert read(plan(parser="llama3_json"), '{"name": "rm_rf", "parameters": {}}')[1] == []


def test_llama3_json_calls():
    p = plan(parser="llama3_json")
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", ' \
           '"parameters": {}}'
    assert read(p, text) == ("", [("get_weather", {"city": "Rome"}), ("get_time", {})], "tool_calls")
    assert read(p, '  {"name": "get_time", "parameters": {}}', 3)[1] == [("get_time", {})]
    assert read(p, "Hello {there}") == ("Hello {there}", [], "stop")
    assert read(p, '{"not": "a call"}') == ('{"not": "a call"}', [], "stop")


def test_required_and_named_constraints_and_their_reading():
    required = plan("required")
    schema = json.loads(required.constraint.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [item["properties"]["name"]["const"] for item in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert json.loads(plan("required", parallel=False).constraint.json)["maxItems"] == 1
    grammar_text(required.constraint)  # compiles
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "x"}}]'
    assert read(required, text) == ("", [("get_time", {}), ("get_weather", {"city": "x"})], "tool_calls")
    assert read(required, '[{"name": "get_ti', finish="length") == ('[{"name": "get_ti', [], "length")
    named = plan(T.NamedToolChoice(type="function", function=T._FunctionName("get_weather")))
    assert json.loads(named.constraint.json) == WEATHER.parameters
    assert read(named, '{"city": "Oslo"}') == ("", [("get_weather", {"city": "Oslo"})], "stop")


def test_plans_refuse_what_cannot_be_served():
    with pytest.raises(T.ToolRequestError, match="tool_call_parser") as err:
        plan(parser=None)
    assert err.value.param == "tool_choice"
    assert plan("required", parser=None).choice == "required"  # constrained: needs no parser
    assert plan("none", parser=None).choice == "none"
    with pytest.raises(T.ToolRequestError) as err:
        plan("required", constrained=True)
    assert err.value.param == "tool_choice"
    assert T.plan_tools(None, None, None, None, None, "hermes", False) is None
    assert T.plan_tools(None, "none", None, None, None, "hermes", False) is None
    with pytest.raises(T.ToolRequestError, match="object schema"):
        T.plan_tools([T.ToolDef(type="function", function=T.FunctionDef(name="f", parameters={"type": "string"}))],
                     None, None, None, None, "hermes", False)
    legacy = T.plan_tools(None, None, [WEATHER], T._FunctionName("get_weather"), None, None, False)
    assert legacy.legacy and legacy.choice == "named"
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"name": "has space"}, T.FunctionDef)


def test_the_call_format_is_read_from_the_template():
    assert T.parser_for_template("{% for t in tools %}<tool_call>{% endfor %}") == "hermes"
    assert T.parser_for_template("<|start_header_id|>ipython<|end_header_id|>") == "llama3_json"
    assert T.parser_for_template("{{ messages }}") is None and T.parser_for_template(None) is None


def test_message_tool_calls_hand_templates_arguments_as_objects():
    calls = T.message_tool_calls([{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
                                  {"type": "function", "function": {"name": "g", "arguments": "not json"}}])
    assert calls[0]["function"]["arguments"] == {"a": 1} and calls[1]["function"]["arguments"] == "not json"


def _matches(constraint, text: str) -> bool:
    """Whether ``text`` meets ``constraint`` whole (llguidance over the built-in model's tokenizer)."""
    import llguidance
    import llguidance.hf
    from transformers import PreTrainedTokenizerFast

    from ringstream.daemon.common.model_dir import DEFAULT_MODEL_DIR

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer), grammar_text(constraint), log_level=0)
    return bool(matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))) and matcher.is_accepting()


def tool(name: str, parameters) -> T.ToolDef:
    return T.ToolDef(type="function", function=T.FunctionDef(name=name, parameters=parameters))


def test_required_keeps_each_schemas_local_refs_and_holds_untyped_parameters_to_objects():
    recursive = {"type": "object", "properties": {"child": {"anyOf": [{"$ref": "#"}, {"type": "integer"}]}},
                 "required": ["child"], "additionalProperties": False}
    with_defs = {"$defs": {"Unit": {"type": "string", "enum": ["c", "f"]}}, "type": "object",
                 "properties": {"u": {"$ref": "#/$defs/Unit"}, "d": {"const": {"$ref": "#"}}}, "required": ["u"]}
    p = T.plan_tools([tool("f", recursive), tool("g", with_defs), tool("h", {})], "required", None, None, None,
                     "hermes", False)
    ok = ['[{"name":"f","parameters":{"child":{"child":1}}}]', '[{"name":"g","parameters":{"u":"c"}}]',
          '[{"name":"h","parameters":{}}]', '[{"name":"g","parameters":{"u":"f","d":{"$ref":"#"}}}]']
    bad = ['[{"name":"f","parameters":{"child":[{"name":"f","parameters":{"child":1}}]}}]',
           '[{"name":"g","parameters":{"u":"x"}}]', '[{"name":"h","parameters":"text"}]',
           '[{"name":"h","parameters":5}]']
    assert [_matches(p.constraint, t) for t in ok + bad] == [True] * len(ok) + [False] * len(bad)
    named = T.plan_tools([tool("h", {})], T.NamedToolChoice(type="function", function=T._FunctionName("h")),
                         None, None, None, "hermes", False)
    assert _matches(named.constraint, '{"a":1}') and not _matches(named.constraint, '"text"')


def test_tool_schemas_are_bounded_before_they_are_compiled():
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer", "description": "x" * 40}
                                            for i in range(1100)}}
    assert len(json.dumps(big)) > T.MAX_GRAMMAR_CHARS
    with pytest.raises(T.ToolRequestError, match="at most 65536") as err:
        T.plan_tools([tool("f", big)], "none", None, None, None, "hermes", False)
    assert err.value.param == "tools"
    half = {"type": "object", "properties": {f"p{i}": {"type": "integer", "description": "x" * 40}
                                             for i in range(600)}}
    three = [tool(name, half) for name in ("a", "b", "c")]
    with pytest.raises(T.ToolRequestError, match="together"):
        T.plan_tools(three, "none", None, None, None, "hermes", False)
    with pytest.raises(T.ToolRequestError, match="tool_choice required"):
        T.plan_tools(three[:2], "required", None, None, None, "hermes", False)
    assert T.plan_tools(three[:2], "auto", None, None, None, "hermes", False).choice == "auto"
