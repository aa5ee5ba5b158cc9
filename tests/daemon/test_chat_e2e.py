"""Chat over the client socket: ``Generate.messages`` rendered by the daemon with the model's chat template."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import openai
import pytest
from tokenizers import Tokenizer

from ringstream.daemon.common.chat_template import ChatTemplate
from ringstream.daemon.common.model_dir import DEFAULT_MODEL_DIR
from ringstream.ipc.client import Client, InvalidRequest, PromptTooLong
from tests.daemon_helpers import running_daemon
from tests.http.helpers import http_url

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What does the socket module do?"}]
BOS_ID = 0


def rendered_ids(messages: list[dict]) -> list[int]:
    """The built-in model's template rendered by hand, tokenised without special tokens."""
    text = ChatTemplate.from_model_dir(DEFAULT_MODEL_DIR).render(messages, add_generation_prompt=True)
    return Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def test_chat_on_the_built_in_model_equals_the_template_rendered_by_hand(tmp_path):
    ids = rendered_ids(MESSAGES)
    assert ids[0] == BOS_ID and ids[1] != BOS_ID  # one BOS: the template's
    with running_daemon(tmp_path, "--devices", "cpu") as daemon, Client(daemon.address) as client:
        chat = client.complete(messages=MESSAGES, temperature=0, max_tokens=8, ignore_eos=True)
        by_hand = client.complete(prompt_token_ids=ids, temperature=0, max_tokens=8, ignore_eos=True)
        assert chat.token_ids == by_hand.token_ids and chat.text == by_hand.text
        assert chat.usage.prompt_tokens == len(ids) and len(chat.token_ids) == 8
        with pytest.raises(PromptTooLong):  # over INLINE_TOKENIZE_CHARS: rendered on the tokenizer thread
            client.complete(messages=[{"role": "user", "content": "socket " * 1000}], max_tokens=4)
        out = subprocess.run([sys.executable, "-P", "-m", "ringstream.daemon.cli", "generate", "--socket",
                              daemon.address, "--chat", "hi", "--system", "be brief", "--temperature", "0",
                              "--max-tokens", "4", "--ignore-eos", "--json"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        cli_ids = [t for line in out.stdout.splitlines() for t in json.loads(line)["token_ids"]]
        short = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        assert cli_ids == client.complete(prompt_token_ids=rendered_ids(short), temperature=0, max_tokens=4,
                                          ignore_eos=True).token_ids


def test_a_model_without_a_template_refuses_messages(tmp_path):
    model = tmp_path / "plain"
    model.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, model / name)
    config = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with running_daemon(tmp_path, "--engine", "synthetic", "--devices", "cpu", "--model", str(model),
                        "--http", "127.0.0.1:0") as daemon:
        with Client(daemon.address) as client:
            with pytest.raises(InvalidRequest, match=f"{model}.*no chat template"):
                client.complete(messages=[{"role": "user", "content": "hi"}])
            assert client.complete(prompt="hi", max_tokens=2).text == " t0 t1"  # prompts still work
        with openai.OpenAI(base_url=http_url(daemon) + "/v1", api_key="x", max_retries=0, timeout=30) as api:
            with pytest.raises(openai.BadRequestError) as info:
                api.chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=2)
        assert info.value.body["code"] == "chat_template_error" and "no chat template" in info.value.body["message"]
