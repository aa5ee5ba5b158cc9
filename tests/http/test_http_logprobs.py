"""Logprobs and penalties end to end over the built-in model: the ZeroMQ client and the openai SDK.

The daemon's logprobs equal ``log_softmax`` of the model's own float32
forward, they reach ``Client`` (stream chunks and ``complete()``) and the
HTTP API's completions (with ``echo``) and chat shapes; penalties change
the greedy text.
"""

from __future__ import annotations

import openai
import pytest
import torch

from ringstream.daemon.common.model_dir import DEFAULT_MODEL_DIR, resolve_model_dir
from ringstream.daemon.engine.loader import load_model
from ringstream.ipc.client import Client
from tests.http.helpers import running_http

pytestmark = pytest.mark.e2e

PROMPT = "The socket module"
CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def served(start_module_daemon, tmp_path_factory):
    template = tmp_path_factory.mktemp("d") / "chat.jinja"
    template.write_text(CHATML)
    daemon = start_module_daemon("--devices", "cpu")
    with running_http(daemon.address, "--chat-template", str(template)) as server:
        yield daemon, server


@pytest.fixture(scope="module")
def reference_model():
    return load_model(resolve_model_dir(DEFAULT_MODEL_DIR))


def forward_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


def test_client_gets_logprobs_equal_to_the_models_forward(served, reference_model):
    daemon, _ = served
    with Client(daemon.address) as client:
        chunks = list(client.generate(PROMPT, max_tokens=8, temperature=0, logprobs=3, prompt_logprobs=2,
                                      ignore_eos=True))
        done = client.complete(PROMPT, max_tokens=8, temperature=0, logprobs=3, prompt_logprobs=2, ignore_eos=True)
        plain = client.complete(PROMPT, max_tokens=2, temperature=0)
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert chunks[0].prompt_logprobs is not None and all(c.prompt_logprobs is None for c in chunks[1:])
    assert plain.logprobs is None and plain.prompt_logprobs is None
    prompt = done.prompt_token_ids
    assert len(prompt) == len(done.prompt_logprobs) == done.usage.prompt_tokens and done.prompt_logprobs[0] is None
    assert [e.token_id for e in done.logprobs] == done.token_ids == [t for c in chunks for t in c.token_ids]
    reference = forward_logprobs(reference_model, prompt + done.token_ids)
    for j, entry in enumerate(done.logprobs):
        row = reference[len(prompt) - 1 + j]
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
    for i, entry in enumerate(done.prompt_logprobs[1:], start=1):
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(reference[i - 1][prompt[i]].item(), abs=1e-4)
        assert len(entry.top) == 2


def test_openai_sdk_gets_completion_and_chat_logprobs(served):
    daemon, server = served
    with Client(daemon.address) as client:
        expected = client.complete(PROMPT, max_tokens=6, temperature=0, logprobs=2, prompt_logprobs=2)
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as api:
        done = api.completions.create(model="default_model", prompt=PROMPT, max_tokens=6, temperature=0,
                                      logprobs=2, echo=True)
        choice = done.choices[0]
        assert choice.text == PROMPT + expected.text
        lp = choice.logprobs
        prompt_tokens = done.usage.prompt_tokens
        assert len(lp.tokens) == prompt_tokens + done.usage.completion_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:prompt_tokens] == pytest.approx(
            [e.logprob for e in expected.prompt_logprobs[1:]], abs=1e-5)
        assert lp.token_logprobs[prompt_tokens:] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-5)
        for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:]):
            assert token in top and len(top) <= 3  # the chosen token and the top 2, as vLLM answers
        chat = api.chat.completions.create(model="default_model", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=5, temperature=0, logprobs=True, top_logprobs=4)
        content = chat.choices[0].logprobs.content
        assert len(content) == chat.usage.completion_tokens
        assert all(len(c.top_logprobs) == 4 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
        assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy: the argmax


@pytest.mark.parametrize("penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
                                     {"extra_body": {"repetition_penalty": 2.0}}])
def test_penalties_change_the_greedy_text(served, penalty):
    _, server = served
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as api:
        args = dict(model="default_model", prompt=PROMPT, max_tokens=48, temperature=0)
        plain = api.completions.create(**args).choices[0].text
        penalized = api.completions.create(**args, **penalty).choices[0].text
    assert plain and penalized != plain
