"""The HTTP API end to end: the openai SDK against a real server process over a real (synthetic) daemon."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time

import openai
import pytest

try:  # the HTTP library the openai SDK is built on: httpx2 in newer releases
    import httpx2 as httpx
except ImportError:
    import httpx

from ringstream.ipc.client import Client
from tests.http.helpers import raw, running_http

pytestmark = pytest.mark.e2e

MODEL = "default_model"
"""The built-in model directory's name, under which the synthetic daemon's model is served."""
STEP_ARGS = ("--engine", "synthetic", "--devices", "cpu", "--synthetic-step-ms", "10")
CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    return start_module_daemon(*STEP_ARGS)


@pytest.fixture(scope="module")
def server(daemon):
    with running_http(daemon.address) as s:
        yield s


@pytest.fixture
def api(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        yield client


def open_requests(daemon) -> int:
    with Client(daemon.address) as client:
        return client.status().requests_open


def test_completion_whole_and_n(api):
    done = api.completions.create(model=MODEL, prompt="hello there", max_tokens=4, n=3, temperature=0.7, seed=1,
                                  user="someone", extra_body={"top_k": 5, "priority": -1})
    assert done.object == "text_completion" and done.id.startswith("cmpl-") and done.model == MODEL
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert all(c.text == " t0 t1 t2 t3" and c.finish_reason == "length" and c.logprobs is None
               for c in done.choices)
    assert done.usage.completion_tokens == 12 and done.usage.prompt_tokens > 0
    assert done.usage.total_tokens == done.usage.prompt_tokens + 12


def test_prompt_forms_and_stop_strings(api):
    batch = api.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.usage.prompt_tokens == 5 and batch.usage.completion_tokens == 12
    stopped = api.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=8, stop=[" t2", "zz"])
    assert stopped.choices[0].text == " t0 t1" and stopped.choices[0].finish_reason == "stop"
    one = api.completions.create(model=MODEL, prompt=["a b"], max_tokens=8, stop=" t1")
    assert one.choices[0].text == " t0"


def test_streaming_with_usage(api):
    chunks = list(api.completions.create(model=MODEL, prompt=["x", "y"], max_tokens=3, stream=True,
                                         stream_options={"include_usage": True}))
    *pieces, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 6
    assert all(c.usage is None and len(c.choices) == 1 for c in pieces)
    for index in (0, 1):
        mine = [c.choices[0] for c in pieces if c.choices[0].index == index]
        assert "".join(c.text for c in mine) == " t0 t1 t2"
        assert [c.finish_reason for c in mine][-1] == "length" and all(c.finish_reason is None for c in mine[:-1])
    assert len({c.id for c in chunks}) == 1
    no_usage = list(api.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True))
    assert all(c.usage is None for c in no_usage) and no_usage[-1].choices[0].finish_reason == "length"


def test_sse_wire_format(server):
    status, headers, body = raw(server.url, "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True,
         "stream_options": {"include_usage": True}}).encode(), {"Content-Type": "application/json"})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = body.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    first = json.loads(events[0].removeprefix("data: "))
    assert first["object"] == "text_completion" and first["choices"][0] == {
        "index": 0, "text": " t0", "finish_reason": None, "logprobs": None}
    assert json.loads(events[-3].removeprefix("data: "))["usage"]["total_tokens"] > 2


def test_models_and_health(api, server):
    models = api.models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].object == "model"
    assert api.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("other")
    status, _, body = raw(server.url, "/health")
    assert status == 200 and json.loads(body)["status"] == "serving"


def test_errors_as_openai_clients_expect(api, server, daemon):
    with pytest.raises(openai.NotFoundError) as info:
        api.completions.create(model="gpt-unknown", prompt="x")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model=MODEL, prompt="x", max_tokens=-3)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:  # the daemon's own check: prompt + max_tokens > context
        api.completions.create(model=MODEL, prompt="x", max_tokens=100_000)
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model=MODEL, prompt=[10**6])  # outside the vocabulary
    with Client(daemon.address) as client:
        before = client.status().settings
        client.admin(max_concurrency=1, queue_size=1)
        try:
            with pytest.raises(openai.APIStatusError) as info:
                api.completions.create(model=MODEL, prompt="x", max_tokens=50, n=4)
        finally:
            client.admin(max_concurrency=before["max_concurrency"], queue_size=before["queue_size"])
    assert info.value.status_code == 503 and info.value.response.headers["Retry-After"] == "1"
    assert info.value.body["code"] == "QUEUE_FULL"
    deadline = time.monotonic() + 5
    while open_requests(daemon) and time.monotonic() < deadline:  # the other choices were cancelled
        time.sleep(0.05)
    assert open_requests(daemon) == 0


def test_disconnect_cancels_generation(api, daemon):
    stream = api.completions.create(model=MODEL, prompt="long", max_tokens=480, stream=True)
    texts = [next(stream).choices[0].text for _ in range(3)]
    assert texts == [" t0", " t1", " t2"] and open_requests(daemon) == 1
    stream.close()
    deadline = time.monotonic() + 2.0  # far less than the 4.8 s the stream would still run
    while open_requests(daemon) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert open_requests(daemon) == 0


def test_hostile_input_harms_nothing(server, api):
    url, json_type = server.url, {"Content-Type": "application/json"}
    for body in (b'{"prompt": "x", "max_tok', b"\x00\xff" * 10, b"[]", b'{"prompt": {"a": 1}}',
                 b'{"prompt": "x", "n": "many"}', b'{"prompt": "x", "stop": [1, 2]}',
                 b'{"prompt": [[1, 2], "x"]}', b'{"prompt": "x", "temperature": NaN}'):
        status, _, reply = raw(url, "/v1/completions", body, json_type)
        assert status == 400, body
        assert set(json.loads(reply)["error"]) == {"message", "type", "param", "code"}
    status, _, reply = raw(url, "/v1/completions", b'{"prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}', json_type)
    assert status == 413 and "error" in json.loads(reply)
    status, _, reply = raw(url, "/v1/nothing", b"{}")
    assert status == 404 and "error" in json.loads(reply)
    with socket.create_connection(server.url.removeprefix("http://").split(":"), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    conn.request("GET", "/health", headers={"Content-Length": "abc"})
    assert conn.getresponse().status == 400
    conn.close()
    assert api.completions.create(model=MODEL, prompt="still", max_tokens=2).choices[0].text == " t0 t1"


def test_api_key_and_unix_socket(daemon, tmp_path):
    key = tmp_path / "key"
    key.write_text("k-123\n")
    unix = str(tmp_path / "http.sock")
    with running_http(daemon.address, "--api-key-file", str(key), "--unix", unix) as s:
        assert s.urls[1] == f"unix:{unix}"
        with openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError) as info:
                bad.completions.create(model=MODEL, prompt="x")
            assert info.value.body["type"] == "authentication_error"
        assert raw(s.url, "/health")[0] == 200  # open to health checkers
        transport = httpx.HTTPTransport(uds=unix)
        with openai.OpenAI(base_url="http://localhost/v1", api_key="k-123", max_retries=0,
                           http_client=httpx.Client(transport=transport)) as good:
            assert good.completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].text == " t0"


def test_non_loopback_refused_without_key(daemon):
    out = subprocess.run([sys.executable, "-P", "-m", "ringstream.daemon.http.server", "--socket", daemon.address,
                          "--listen", "0.0.0.0:0"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "needs an API key" in out.stderr


def test_chat_completions(daemon, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(CHATML)
    with running_http(daemon.address, "--chat-template", str(template), "--served-model-name", "chatty") as s:
        with openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0) as api:
            messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
            done = api.chat.completions.create(model="chatty", messages=messages, max_tokens=3, n=2)
            assert done.object == "chat.completion" and done.id.startswith("chatcmpl-")
            assert [(c.index, c.message.role, c.message.content, c.finish_reason) for c in done.choices] == [
                (0, "assistant", " t0 t1 t2", "length"), (1, "assistant", " t0 t1 t2", "length")]
            from tokenizers import Tokenizer
            tok = Tokenizer.from_file(f"{daemon_model_dir()}/tokenizer.json")
            rendered = "<|system|>be brief\n<|user|>hi\n<|assistant|>"
            assert done.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False).ids)
            chunks = list(api.chat.completions.create(model="chatty", messages=messages, max_tokens=2, stream=True,
                                                      stream_options={"include_usage": True}))
            assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
            assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == " t0 t1"
            assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 2
            unlimited = api.chat.completions.create(model="chatty", messages=messages,
                                                    extra_body={"stop": [" t3"]})
            assert unlimited.choices[0].message.content == " t0 t1 t2"  # max_tokens: the rest of the context
            with pytest.raises(openai.BadRequestError) as info:
                api.chat.completions.create(model="chatty", messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "x"}}]}])
            assert info.value.body["param"] == "messages"
            with pytest.raises(openai.BadRequestError) as info:  # tokenised off the loop: over the 512-token context
                api.chat.completions.create(model="chatty", messages=[{"role": "user", "content": "word " * 2000}])
            assert info.value.body["code"] == "context_length_exceeded"


def test_health_and_requests_without_a_daemon(tmp_path):
    with running_http(f"ipc://{tmp_path}/none.sock") as s:
        status, headers, body = raw(s.url, "/health")
        assert status == 503 and headers["Retry-After"] == "1" and json.loads(body)["status"] == "unavailable"
        with openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0) as api:
            with pytest.raises(openai.APIStatusError) as info:
                api.completions.create(model=MODEL, prompt="x")
            assert info.value.status_code == 503


def daemon_model_dir() -> str:
    from pathlib import Path
    import ringstream.daemon
    return str(Path(ringstream.daemon.__file__).parent / "default_model")


def test_logprobs_echo_and_penalties_over_the_synthetic_engine(api, daemon, tmp_path):
    # The synthetic engine's logprobs are fake and fixed: -0.5 for each token, then -1.5, -2.5 for the next ids.
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(f"{daemon_model_dir()}/tokenizer.json")
    prompt_ids = tok.encode("hello world").ids
    done = api.completions.create(model=MODEL, prompt="hello world", max_tokens=3, logprobs=2, echo=True,
                                  presence_penalty=0.5, frequency_penalty=0.5,
                                  extra_body={"repetition_penalty": 1.1, "min_p": 0.1, "min_tokens": 1})
    choice = done.choices[0]
    assert choice.text == "hello world t0 t1 t2"
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt_ids) + 3 == done.usage.prompt_tokens + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [-0.5] * (len(prompt_ids) + 2)
    assert all(max(top.values()) == -0.5 and set(top.values()) <= {-0.5, -1.5} for top in lp.top_logprobs[1:])
    assert lp.tokens[:len(prompt_ids)] == [tok.decode([i], skip_special_tokens=False) for i in prompt_ids]
    assert lp.tokens[0] == "<s>" and choice.text.startswith("hello")  # BOS is no text: the offsets skip it
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[1:i]) for i in range(len(lp.tokens))]
    prompt_tokens = range(1, len(prompt_ids))  # (the synthetic engine's text is not its tokens' decode)
    assert all(choice.text.startswith(lp.tokens[i], lp.text_offset[i]) for i in prompt_tokens)
    plain = api.completions.create(model=MODEL, prompt="hello world", max_tokens=2, logprobs=0)
    assert plain.choices[0].text == " t0 t1" and plain.choices[0].logprobs.token_logprobs == [-0.5, -0.5]
    chosen = plain.choices[0].logprobs.tokens
    assert plain.choices[0].logprobs.top_logprobs == [{chosen[0]: -0.5}, {chosen[1]: -0.5}]  # the chosen token only
    assert api.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].logprobs is None
    streamed = list(api.completions.create(model=MODEL, prompt="hello world", max_tokens=3, logprobs=1, echo=True,
                                           stream=True))
    assert "".join(c.choices[0].text for c in streamed) == "hello world t0 t1 t2"
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in streamed if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert len(tokens) == len(lp.tokens) and tokens[:len(prompt_ids)] == lp.tokens[:len(prompt_ids)]
    assert offsets == [sum(len(t) for t in tokens[1:i]) for i in range(len(tokens))]  # one running offset
    template = tmp_path / "chat.jinja"
    template.write_text(CHATML)
    with running_http(daemon.address, "--chat-template", str(template)) as s:
        with openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0) as chat_api:
            messages = [{"role": "user", "content": "hi"}]
            chat = chat_api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, logprobs=True,
                                                    top_logprobs=3)
            content = chat.choices[0].logprobs.content
            assert [c.logprob for c in content] == [-0.5, -0.5]
            assert [[t.logprob for t in c.top_logprobs] for c in content] == [[-0.5, -1.5, -2.5]] * 2
            assert all(c.bytes == list(c.token.encode()) for c in content)
            assert chat_api.chat.completions.create(model=MODEL, messages=messages,
                                                    max_tokens=1).choices[0].logprobs is None
            chunks = list(chat_api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                                           logprobs=True, stream=True))
            streamed_lps = [c.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
                            for c in ch.choices[0].logprobs.content]
            assert streamed_lps == [-0.5, -0.5]


def test_long_prompt_logprobs_cross_several_ring_records(daemon):
    prompt = [(7 * i) % 400 + 3 for i in range(450)]  # 449 entries of 20 tops: four PROMPT_LOGPROBS records
    with Client(daemon.address) as client:
        done = client.complete(prompt_token_ids=prompt, max_tokens=2, prompt_logprobs=20, logprobs=20)
    assert done.prompt_token_ids == prompt and done.prompt_logprobs[0] is None
    assert [e.token_id for e in done.prompt_logprobs[1:]] == prompt[1:]
    assert all(len(e.top) == 20 and e.top[0] == (e.token_id, -0.5) for e in done.prompt_logprobs[1:])
    assert [e.token_id for e in done.logprobs] == done.token_ids and len(done.logprobs) == 2
