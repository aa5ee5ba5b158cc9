"""Structured outputs over the OpenAI API (the openai SDK against ``serve --http`` on the built-in model), sampled at
temperature 1.0 so that only the constraint can make the output valid."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.daemon_helpers import running_daemon
from tests.http.helpers import running_http

pytestmark = pytest.mark.e2e

MODEL = "default_model"
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9},
                   "note": {"type": "string", "maxLength": 10}},
    "required": ["answer", "score", "note"],
    "additionalProperties": False,
}


def check_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"answer", "score", "note"}
    assert value["answer"] in ("yes", "no") and 0 <= value["score"] <= 9 and len(value["note"]) <= 10


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("structured")
    with running_daemon(tmp, "--devices", "cpu") as daemon, running_http(daemon.address) as server:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
            yield client


def test_json_schema_response_format_on_chat_and_completions(api):
    response_format = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}
    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Judge it"}],
                                       max_tokens=60, temperature=1.0, n=3, seed=3, response_format=response_format)
    assert len(chat.choices) == 3
    for choice in chat.choices:
        assert choice.finish_reason == "stop"
        check_schema(choice.message.content)
    streamed = api.completions.create(model=MODEL, prompt="Convert a string", max_tokens=60, temperature=1.0,
                                      stream=True, extra_body={"response_format": response_format})
    check_schema("".join(chunk.choices[0].text for chunk in streamed))


@pytest.mark.parametrize("body,check", [
    ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2,4}"}}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
    ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
    ({"guided_regex": r"(ab|cd){1,3}"}, lambda t: re.fullmatch(r"(ab|cd){1,3}", t)),
    ({"structured_outputs": {"json": SCHEMA}}, lambda t: check_schema(t) is None),
    ({"guided_json": SCHEMA}, lambda t: check_schema(t) is None),
    ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]? "y"'}}, lambda t: re.fullmatch(r"x[0-9]{1,2}y", t)),
])
def test_vllm_structured_outputs_and_guided_fields(api, body, check):
    for seed in range(3):
        out = api.completions.create(model=MODEL, prompt="Return the", max_tokens=60, temperature=1.0, seed=seed,
                                     extra_body=body)
        assert out.choices[0].finish_reason == "stop"
        assert check(out.choices[0].text), out.choices[0].text


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ({"guided_regex": "a+", "structured_outputs": {"regex": "b+"}}, "guided_regex"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["x" * 100] * 700}}}},
     "response_format"),
    ({"structured_outputs": {"json": "[" * 1000 + "]" * 1000}}, "structured_outputs"),
])
def test_a_bad_constraint_is_a_400_naming_its_field_and_the_daemon_serves_on(api, body, param):
    with pytest.raises(openai.BadRequestError) as raised:
        api.completions.create(model=MODEL, prompt="Return the", max_tokens=8, extra_body=body)
    assert raised.value.body["param"] == param, raised.value.body
    out = api.completions.create(model=MODEL, prompt="Return the", max_tokens=4, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4


def test_tokenize_detokenize_and_version_as_vllm_serves_them(api):
    http = api._client  # the SDK's httpx client, at the server's /v1
    root = str(api.base_url).removesuffix("/v1/")
    prompt = "Convert a string to a tuple"
    done = api.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    tokens = http.post(f"{root}/tokenize", json={"model": MODEL, "prompt": prompt, "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == done.usage.prompt_tokens
    assert len(tokens["token_strs"]) == tokens["count"] and tokens["max_model_len"] > 0
    text = http.post(f"{root}/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()["prompt"]
    assert prompt in text
    messages = [{"role": "user", "content": "Judge it"}]
    chat = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    counted = http.post(f"{root}/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert counted["count"] == chat.usage.prompt_tokens
    bad = http.post(f"{root}/detokenize", json={"model": MODEL, "tokens": [10 ** 8]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    neither = http.post(f"{root}/tokenize", json={"model": MODEL})
    assert neither.status_code == 400
    import ringstream

    assert http.get(f"{root}/version").json() == {"version": ringstream.__version__}
