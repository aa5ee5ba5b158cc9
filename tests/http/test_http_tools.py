"""Tool calls over the OpenAI API (the openai SDK against ``serve --http`` on the built-in model, whose chat
template renders tools in Hermes' format), sampled at temperature 1.0: ``required`` and a named function must
give calls whose arguments validate however the model samples."""

from __future__ import annotations

import json

import openai
import pytest

from tests.daemon_helpers import running_daemon
from tests.http.helpers import running_http

pytestmark = pytest.mark.e2e

MODEL = "default_model"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                                 "maximum": 14}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def check_weather(arguments: str) -> None:
    value = json.loads(arguments)
    assert set(value) == {"city", "unit"} and value["unit"] in ("c", "f") and len(value["city"]) <= 12


def check_call(name: str, arguments: str) -> None:
    if name == "get_weather":
        check_weather(arguments)
    else:
        assert name == "get_time"
        value = json.loads(arguments)
        assert set(value) == {"zone"} and -12 <= value["zone"] <= 14


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools")
    with running_daemon(tmp, "--devices", "cpu") as daemon, running_http(daemon.address) as server:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
            yield client


def test_required_always_returns_calls_that_validate(api):
    out = api.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", n=4,
                                      temperature=1.0, seed=1, max_tokens=120)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            check_call(call.function.name, call.function.arguments)
    ids = [call.id for choice in out.choices for call in choice.message.tool_calls]
    assert len(set(ids)) == len(ids)


def test_named_function_streams_its_arguments(api):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        out = api.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                          temperature=1.0, seed=seed, max_tokens=80)
        choice = out.choices[0]
        assert choice.finish_reason == "stop" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather"
        check_weather(call.function.arguments)
    chunks = list(api.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                              temperature=1.0, seed=7, max_tokens=80, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert all(tc.index == 0 and tc.id is None for tc in calls[1:]) and len(calls) > 1  # arguments in pieces
    check_weather("".join(tc.function.arguments or "" for tc in calls))
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_required_streamed_and_parallel_off(api):
    chunks = list(api.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, temperature=1.0, seed=2,
                                              max_tokens=120, stream=True))
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert len(calls) == 1 and calls[0].index == 0
    check_call(calls[0].function.name, calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_and_none_give_text_or_parsed_calls_and_tool_results_are_accepted(api):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Oslo", "unit": "c"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 3}'},
    ]
    for choice in ("auto", "none"):
        out = api.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice=choice,
                                          temperature=1.0, seed=0, max_tokens=20)
        message = out.choices[0].message
        # the built-in model never learnt to call: auto reads its text as text (a call, had it written one)
        assert out.choices[0].finish_reason in ("stop", "length")
        assert isinstance(message.content, str) and not message.tool_calls


def test_legacy_functions_answer_with_function_call(api):
    out = api.chat.completions.create(model=MODEL, messages=ASK, functions=[WEATHER["function"]],
                                      function_call={"name": "get_weather"}, temperature=1.0, seed=4,
                                      max_tokens=80)
    choice = out.choices[0]
    assert choice.message.function_call.name == "get_weather" and not choice.message.tool_calls
    check_weather(choice.message.function_call.arguments)


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": 7}}}}}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "nosuch"}}}}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "functions": [CLOCK["function"]]}, "functions"),
    ({"max_token": 5}, "max_token"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        f"p{i}": {"type": "string", "description": "d" * 60} for i in range(1000)}}}}]}, "tools"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
])
def test_bad_tool_requests_are_400s_naming_the_field_and_the_server_serves_on(api, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        api.chat.completions.create(model=MODEL, messages=body.pop("messages", ASK), max_tokens=5,
                                    extra_body=body)
    assert err.value.body["param"] == param, err.value.body
    ok = api.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3)
    assert ok.choices[0].finish_reason == "length"


def test_auto_reads_hermes_calls_the_model_writes_whole_and_streamed(api):
    # a regex makes the model write a Hermes call, as a model trained for tools would: auto must read it
    forced = {"structured_outputs": {"regex": r'Let me check\.<tool_call>\{"name": "get_time", "arguments": '
                                              r'\{"zone": [1-9]\}\}</tool_call>'}}
    out = api.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0, seed=5,
                                      max_tokens=60, extra_body=forced)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and 1 <= json.loads(call.function.arguments)["zone"] <= 9
    chunks = list(api.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0, seed=5,
                                              max_tokens=60, stream=True, extra_body=forced))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    assert not any("<tool" in (d.content or "") for d in deltas)
    (streamed,) = [tc for d in deltas for tc in d.tool_calls or ()]
    assert streamed.function.name == "get_time" and json.loads(streamed.function.arguments) == json.loads(
        call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": "hi", "tool_calls": []},
    {"role": "tool", "content": "42", "tool_call_id": ""},
])
def test_empty_tool_fields_in_messages_are_served(api, message):
    # rendered here, not by the daemon (whose messages carry no tool fields), whatever their emptiness
    for stream in (False, True):
        out = api.chat.completions.create(model=MODEL, messages=[*ASK, message, {"role": "user", "content": "ok"}],
                                          max_tokens=3, stream=stream)
        if stream:
            assert [c for c in out if c.choices and c.choices[0].finish_reason][0].choices[0].finish_reason
        else:
            assert out.choices[0].finish_reason == "length"
