"""Request decoding, parameter mapping, error mapping, listen checks and chat templates, without processes."""

from __future__ import annotations

import json

import msgspec

import pytest

from ringstream.daemon.http import openai_schema as S
from ringstream.daemon.common.chat_template import ChatTemplate, ChatTemplateError, render_chat_prompt
from ringstream.daemon.common.config import is_loopback_host as is_loopback
from ringstream.daemon.http.options import HttpOptions
from ringstream.daemon.http.server import HttpServer
from ringstream.daemon.common.listen import ConfigError, check_listen_auth, parse_listen
from ringstream.daemon.http.routes import authorized
from ringstream.ipc import errors as E

CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def decode(body: dict | bytes, kind=S.CompletionRequest):
    return S.decode_request(body if isinstance(body, bytes) else json.dumps(body).encode(), kind)


def test_prompt_forms():
    for prompt, expected in [("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]),
                             ([[1], [2, 3]], [[1], [2, 3]])]:
        assert S.completion_prompts(decode({"prompt": prompt})) == expected
    for prompt in [[], ["a", 1], [[1], "a"], [[]]]:
        with pytest.raises(S.ApiError) as info:
            S.completion_prompts(decode({"prompt": prompt}))
        assert (info.value.status, info.value.param) == (400, "prompt")
    with pytest.raises(S.ApiError, match="choices") as info:
        S.completion_prompts(decode({"prompt": ["a"] * 3, "n": 50}))
    assert info.value.param == "n"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": "8"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": 3}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "x", "logit_bias": {"5": 1.0}}, "logit_bias"),
])
def test_bad_values_are_400_naming_the_param(body, param):
    with pytest.raises(S.ApiError) as info:
        decode(body)
    assert (info.value.status, info.value.param, info.value.type) == (400, param, "invalid_request_error")


@pytest.mark.parametrize("body", [b"", b"{", b'{"prompt": "x"', b"[1, 2]", b"\xff\xfe", b"null"])
def test_bodies_that_are_not_a_json_object_are_400(body):
    with pytest.raises(S.ApiError) as info:
        decode(body)
    assert info.value.status == 400


def test_unknown_fields_are_400s_naming_them_or_with_warn_logged_and_ignored(caplog):
    body = {"prompt": "x", "max_token": 9}
    with pytest.raises(S.ApiError) as err:
        decode(body)
    assert err.value.status == 400 and err.value.param == "max_token" and "max_token" in err.value.message
    with pytest.raises(S.ApiError, match="arguments supplied: max_token, temprature"):
        decode({**body, "temprature": 1})
    with caplog.at_level("WARNING", "ringstream.http"):
        req = S.decode_request(msgspec.json.encode({**body, "zz": [1]}), S.CompletionRequest, "warn")
    assert req.prompt == "x" and req.max_tokens is None and "max_token, zz" in caplog.text
    assert isinstance(req, S.CompletionRequest)
    chat = {"messages": [{"role": "assistant", "content": "a", "refusal": None, "annotations": []}], "temprature": 1}
    with pytest.raises(S.ApiError) as err:  # a message's extra fields pass; a top-level one does not
        S.decode_request(msgspec.json.encode(chat), S.ChatCompletionRequest)
    assert err.value.param == "temprature"


def test_params_map_to_the_client():
    req = decode({"prompt": "x", "max_tokens": 9, "temperature": 0, "top_p": 0.5, "stop": "\n", "seed": 3,
                  "user": "u", "top_k": -1, "stop_token_ids": [2], "ignore_eos": True, "priority": -4,
                  "presence_penalty": 0, "best_of": 1})
    assert S.generate_params(req, req.max_tokens, stream=False) == {
        "stream": False, "max_tokens": 9, "temperature": 0.0, "top_p": 0.5, "seed": 3, "stop": ["\n"],
        "stop_token_ids": [2], "ignore_eos": True, "priority": -4, "presence_penalty": 0.0}
    assert S.generate_params(decode({"prompt": "x", "top_k": 5, "stop": ["a", "b"]}), None, True) == {
        "stream": True, "top_k": 5, "stop": ["a", "b"]}


def test_penalties_and_logprobs_map_to_the_client():
    req = decode({"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2,
                  "min_p": 0.05, "min_tokens": 3, "logprobs": 2, "echo": True})
    assert S.generate_params(req, None, stream=False) == {
        "stream": False, "presence_penalty": 0.5, "frequency_penalty": -1.0, "repetition_penalty": 1.2,
        "min_p": 0.05, "min_tokens": 3, "logprobs": 2, "prompt_logprobs": 2}
    assert S.generate_params(decode({"prompt": "x", "echo": True}), None, True) == {"stream": True}
    chat = S.decode_request(msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}],
                                                 "logprobs": True, "top_logprobs": 4}), S.ChatCompletionRequest)
    assert S.generate_params(chat, 5, True) == {"stream": True, "max_tokens": 5, "logprobs": 4}
    plain = S.decode_request(b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": false}',
                             S.ChatCompletionRequest)
    assert "logprobs" not in S.generate_params(plain, 5, True)
    with pytest.raises(S.ApiError) as info:
        S.decode_request(b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}',
                         S.ChatCompletionRequest)
    assert (info.value.status, info.value.param) == (400, "top_logprobs")


def test_errors_map_to_http_statuses():
    cases = [(E.InvalidRequest("INVALID_REQUEST: bad"), 400), (E.PromptTooLong("long"), 400),
             (E.QueueFull("full"), 503), (E.QueueTimeout("late"), 503), (E.ShuttingDown("bye"), 503),
             (E.DaemonUnavailable("gone"), 503), (E.WorkerFailed("dead"), 500), (E.InternalError("bug"), 500)]
    for exc, status in cases:
        err = S.api_error_from(exc)
        assert err.status == status, exc
        assert set(err.body()["error"]) == {"message", "type", "param", "code"}
        assert ("Retry-After" in err.headers()) == (status == 503)
    assert S.api_error_from(E.PromptTooLong("x")).code == "context_length_exceeded"
    assert [S.finish_reason(r) for r in ("stop", "length", "cancelled", "timeout", None)] == [
        "stop", "length", "abort", "timeout", None]


def test_non_loopback_listen_needs_a_key(tmp_path):
    for host in ("127.0.0.1", "127.3.4.5", "::1", "localhost", "LOCALHOST"):
        assert is_loopback(host)
        check_listen_auth(host, None)
    for host in ("0.0.0.0", "::", "192.168.1.4", "example.com", ""):
        assert not is_loopback(host)
        with pytest.raises(ConfigError, match="API key"):
            check_listen_auth(host, None)
        check_listen_auth(host, "k")
    check_listen_auth(None, None)  # a unix socket only
    with pytest.raises(ConfigError, match="API key"):
        HttpServer(HttpOptions("ipc:///nonexistent", "0.0.0.0:8000"))
    empty = tmp_path / "key"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        HttpServer(HttpOptions("ipc:///nonexistent", "0.0.0.0:8000", api_key_file=empty))
    with pytest.raises(ConfigError, match="cannot read"):
        HttpServer(HttpOptions("ipc:///nonexistent", "0.0.0.0:8000", api_key_file=tmp_path / "missing"))
    for bad in ("8000", "host:", ":80", "h:99999", "h:x"):
        with pytest.raises(ConfigError):
            parse_listen(bad)
    assert parse_listen("[::1]:0") == ("::1", 0)
    with pytest.raises(ConfigError, match="not HOST:PORT"):
        parse_listen("[]:8000")  # brackets around nothing


def test_bearer_token_check():
    assert authorized("Bearer s3cret", "s3cret")
    assert authorized("bearer s3cret", "s3cret")
    for header in (None, "", "s3cret", "Bearer", "Bearer s3cre", "Bearer s3cretx", "Basic s3cret"):
        assert not authorized(header, "s3cret")


def test_chat_template_renders_like_transformers(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    template = ChatTemplate.from_model_dir(tmp_path)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert template.render(messages) == "<|system|>be brief</s>\n<|user|>hi</s>\n<|assistant|>"
    assert template.render(messages, add_generation_prompt=False).endswith("hi</s>\n")
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}"
        "{% endif %}{{ m.content | tojson }}{% endfor %}")
    template = ChatTemplate.from_model_dir(tmp_path)
    assert template.render([{"role": "user", "content": "a<b>"}]) == '<s>"a<b>"'
    with pytest.raises(ChatTemplateError, match="no system"):
        template.render(messages)


def test_chat_template_is_sandboxed_and_missing_is_a_typed_error(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert ChatTemplate.from_model_dir(tmp_path) is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat_prompt(None, [{"role": "user", "content": "x"}])
    hostile = tmp_path / "t.jinja"
    hostile.write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        ChatTemplate.from_model_dir(tmp_path, hostile).render([{"role": "user", "content": "x"}])
    hostile.write_text("{% for x in %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate.from_model_dir(tmp_path, hostile)
    assert S.decode_request(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}',
                            S.ChatCompletionRequest).messages[0].content[0].text == "a"
    with pytest.raises(S.ApiError) as info:
        S.decode_request(b'{"messages": []}', S.ChatCompletionRequest)
    assert info.value.param == "messages"


def test_seeded_samples_of_one_prompt_get_their_own_seeds():
    from ringstream.daemon.http.generation import job_params, jobs_of
    jobs = jobs_of(["a", "b"], 3)
    assert [(j.index, j.prompt, j.sample) for j in jobs] == [
        (0, "a", 0), (1, "a", 1), (2, "a", 2), (3, "b", 0), (4, "b", 1), (5, "b", 2)]
    assert [job_params(j, {"seed": 7})["seed"] for j in jobs] == [7, 8, 9, 7, 8, 9]
    assert all("seed" not in job_params(j, {"max_tokens": 2}) for j in jobs)


def test_logprobs_bodies_from_token_logprobs():
    from ringstream.daemon.http import logprobs as L
    from ringstream.ipc import protocol as P

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(f"<{i}>" for i in ids)

    names = L.TokenStrings(Tok())
    body = L.completion_logprobs([None, P.TokenLogprob(5, -0.5, [(5, -0.5), (6, float("-inf"))])], [4, 5], names)
    assert (body.tokens, body.token_logprobs, body.text_offset) == (["<4>", "<5>"], [None, -0.5], [0, 3])
    assert body.top_logprobs == [None, {"<5>": -0.5, "<6>": L.MIN_LOGPROB}]
    chat = L.chat_logprobs([P.TokenLogprob(7, -1.0, [(7, -1.0)])], names)
    assert msgspec.json.decode(S.JSON_ENCODER.encode(chat)) == {"content": [{
        "token": "<7>", "logprob": -1.0, "bytes": list(b"<7>"),
        "top_logprobs": [{"token": "<7>", "logprob": -1.0, "bytes": list(b"<7>")}]}], "refusal": None}


@pytest.mark.parametrize("message, param", [
    ("INVALID_REQUEST: min_tokens (5) must be <= max_tokens (2)", "min_tokens"),
    ("INVALID_REQUEST: bad message: Expected `int` >= 1 - at `sampling.max_tokens`", "max_tokens"),
    ("INVALID_REQUEST: empty prompt", "prompt"),
    ("INVALID_REQUEST: the model has no chat template", None),
    ("INVALID_REQUEST: internal limits", None),
])
def test_a_daemon_refusal_names_the_param_it_is_about(message, param):
    error = S.api_error_from(E.InvalidRequest(message, "r1"))
    assert (error.status, error.body()["error"]["param"]) == (400, param)


def test_a_hub_snapshot_is_reported_by_its_hub_id():
    from ringstream.daemon.http.routes import ServedModel

    snapshot = "/c/hub/models--acme--tiny-chat/snapshots/" + "a" * 40
    assert ServedModel("acme/tiny-chat", snapshot, 64, None).root == "acme/tiny-chat"
    assert ServedModel("tiny", "/srv/models/tiny", 64, None).root == "/srv/models/tiny"
