"""``ringstream serve --http``: the front's HTTP API child, end to end with the openai SDK (synthetic engine)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
import urllib.error
import urllib.request

import openai
import psutil
import pytest

from ringstream.ipc import protocol as P
from ringstream.ipc.client import Client
from tests.daemon_helpers import running_daemon, wait_exit
from tests.http.helpers import http_url

MODEL = "default_model"
STEP_ARGS = ("--engine", "synthetic", "--devices", "cpu", "--synthetic-step-ms", "10")
HTTP_TITLE = "ringstream: http"
WAIT_S = 20.0
GATEWAY_GAUGES = ("ringstream_num_requests_waiting", "ringstream_num_requests_running",
                  "ringstream_kv_cache_usage_perc")


def http_pid(daemon) -> int | None:
    """Pid of the daemon's HTTP child (by its process title), or None."""
    for proc in daemon.processes()[1:]:
        try:
            if HTTP_TITLE in " ".join(proc.cmdline()):
                return proc.pid
        except psutil.NoSuchProcess:
            pass
    return None


def get(url: str, timeout_s: float = 10) -> tuple[int, dict, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def gauge(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, f"{name} missing from the exposition"
    return float(match.group(1))


@pytest.fixture(scope="module")
def daemon(start_module_daemon):
    d = start_module_daemon(*STEP_ARGS, "--http", "127.0.0.1:0")
    d.url = http_url(d)
    return d


@pytest.mark.e2e
def test_completions_health_metrics_and_chat(daemon):
    assert http_pid(daemon) is not None
    assert get(daemon.url + "/health")[0] == 200
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=30) as api:
        done = api.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0)
        assert done.choices[0].text == " t0 t1 t2 t3" and done.choices[0].finish_reason == "length"
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        chat = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
        assert chat.choices[0].message.content == " t0 t1 t2"
    from tokenizers import Tokenizer

    from ringstream.daemon.common.model_dir import DEFAULT_MODEL_DIR
    rendered = "<s><|system|>\nbe brief</s>\n<|user|>\nhi</s>\n<|assistant|>\n"  # the built-in model's template
    tokenizer = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    assert chat.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False).ids)

    status, headers, text = get(daemon.url + "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert gauge(text, "ringstream_requests_admitted_total") >= 2
    for name in GATEWAY_GAUGES:
        assert gauge(text, name) >= 0
    assert gauge(text, "ringstream_kv_cache_usage_perc") <= 1
    with Client(daemon.address) as client:  # the same exposition over the client socket
        assert "ringstream_num_requests_running" in client.metrics()
        stream = client.generate(prompt_token_ids=[5, 6, 7], max_tokens=400, ignore_eos=True)
        next(stream)
        deadline = time.monotonic() + WAIT_S
        while gauge(get(daemon.url + "/metrics")[2], "ringstream_num_requests_running") != 1:
            assert time.monotonic() < deadline, "the running gauge never showed the open stream"
            time.sleep(0.1)
        text = get(daemon.url + "/metrics")[2]
        for name in GATEWAY_GAUGES:  # the gateway's default names (vLLM's) carry the same figures
            assert gauge(text, name.replace("ringstream_", "vllm:")) == gauge(text, name)
        status, _, body = get(daemon.url + "/get_load")  # what vllm-router's power_of_two polls
        assert status == 200 and json.loads(body) == {"load": 1, "num_reqs": 1, "num_waiting_reqs": 0}
        stream.close()
    status, _, body = get(daemon.url + "/v1/models")
    assert json.loads(body)["data"][0]["max_model_len"] > 0


@pytest.mark.e2e
def test_killed_http_child_is_restarted(daemon):
    first = http_pid(daemon)
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + WAIT_S
    while (pid := http_pid(daemon)) in (None, first):
        assert time.monotonic() < deadline, f"no new HTTP child:\n{daemon.log_tail()}"
        time.sleep(0.1)
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=30) as api:
        assert api.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text == " t0 t1"
    assert http_pid(daemon) == pid


def requests_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.e2e
def test_sigterm_finishes_the_http_stream_in_flight_then_stops(tmp_path):
    with running_daemon(tmp_path, *STEP_ARGS, "--http", "127.0.0.1:0", "--api-key", "s3cret",
                        "--http-access-log") as daemon:
        url = http_url(daemon)
        child = http_pid(daemon)
        assert get(url + "/v1/models")[0] == 401  # the inline key guards the API; /health stays open
        deadline = time.monotonic() + WAIT_S
        while '"GET /v1/models HTTP/1.1" 401' not in daemon.log():  # the access log's line for it
            assert time.monotonic() < deadline, daemon.log_tail()
            time.sleep(0.05)
        with openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0, timeout=30) as api:
            stream = api.completions.create(model=MODEL, prompt="x", max_tokens=80, stream=True,
                                            extra_body={"ignore_eos": True})
            texts = [next(stream).choices[0].text]
            daemon.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + WAIT_S
            while True:  # during the drain: /health says so, new requests get 503 SHUTTING_DOWN
                health = requests_get(url + "/health")
                if health[0] == 503 and b"draining" in health[1]:
                    break
                assert time.monotonic() < deadline, f"/health during the drain: {health}"
                time.sleep(0.05)
            with pytest.raises(openai.InternalServerError) as refused:
                api.completions.create(model=MODEL, prompt="x", max_tokens=2)
            assert refused.value.status_code == 503 and "SHUTTING_DOWN" in str(refused.value)
            finish = None
            for chunk in stream:
                if chunk.choices:
                    texts.append(chunk.choices[0].text)
                    finish = chunk.choices[0].finish_reason or finish
        assert "".join(texts) == "".join(f" t{i}" for i in range(80)) and finish == "length"
        assert daemon.proc.wait(30) == 0
        assert wait_exit([child], 5) == []


@pytest.mark.e2e
def test_a_taken_port_fails_the_start(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with running_daemon(tmp_path, *STEP_ARGS, "--http", f"127.0.0.1:{port}", ready=False) as daemon:
            assert daemon.proc.wait(60) == 1
            log = daemon.log()
            assert f"http 127.0.0.1:{port}" in log and "Address already in use" in log
            assert "worker 0" not in log  # refused before any worker was spawned


def test_http_settings_are_checked():
    from ringstream.daemon.common.config import load_config
    assert load_config(None, http="127.0.0.1:8000").serves_http and not load_config(None).serves_http
    assert load_config(None, http="[::1]:8000", served_model_name="m").http == "[::1]:8000"
    for bad, message in ((dict(http="0.0.0.0:8000"), "needs an API key: api_key_file or api_key"), (dict(http="8000"), "HOST:PORT"),
                         (dict(http="localhost:99999"), "HOST:PORT"), (dict(http="[]:8000", api_key_file="k"), "HOST:PORT"),
                         (dict(api_key_file="k"), "no HTTP server")):
        with pytest.raises(ValueError, match=message):
            load_config(None, **bad)
    assert load_config(None, http="0.0.0.0:8000", api_key_file="k").api_key_file == "k"


@pytest.mark.e2e
def test_requests_before_the_workers_are_ready_get_503_over_http_and_wait_over_zeromq(tmp_path):
    # the built-in model's worker takes seconds to import torch and load: the HTTP child is up long before
    import concurrent.futures

    with running_daemon(tmp_path, "--devices", "cpu", "--http", "127.0.0.1:0", ready=False) as daemon:
        url = http_url(daemon)
        status, headers, body = get(url + "/v1/models")
        assert status == 503 and json.loads(body)["error"]["code"] == "starting" and headers["Retry-After"]
        with concurrent.futures.ThreadPoolExecutor(1) as pool, Client(daemon.address) as client:
            starting = client.status().workers[0]
            assert starting.phase in P.WORKER_PHASES[:5] and starting.phase_s >= 0  # e.g. "importing torch"
            early = pool.submit(client.complete, prompt_token_ids=[5, 6, 7], max_tokens=2, ignore_eos=True)
            assert early.result(timeout=120).usage.completion_tokens == 2  # it waited for the worker
            assert client.status().workers[0].phase == "ready"
        assert "starting: requests wait in the queue until a worker is ready" in daemon.log()
        assert get(url + "/v1/models")[0] == 200
