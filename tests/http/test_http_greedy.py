"""The HTTP API over the built-in model: greedy text equals the ZeroMQ client's; SIGTERM mid-stream stops cleanly."""

from __future__ import annotations

import json
import signal
import time

import openai
import pytest

from ringstream.ipc.client import Client
from tests.daemon_helpers import running_daemon
from tests.http.helpers import raw, running_http

pytestmark = pytest.mark.e2e

PROMPT = "The socket module"


def test_greedy_completion_equals_the_zmq_stream(tmp_path):
    with running_daemon(tmp_path, "--devices", "cpu") as daemon, running_http(daemon.address) as server:
        with Client(daemon.address) as client:
            expected = client.complete(PROMPT, max_tokens=24, temperature=0)
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as api:
            whole = api.completions.create(model="default_model", prompt=PROMPT, max_tokens=24, temperature=0)
            streamed = list(api.completions.create(model="default_model", prompt=PROMPT, max_tokens=24,
                                                   temperature=0, stream=True))
        assert expected.text and whole.choices[0].text == expected.text
        assert "".join(c.choices[0].text for c in streamed) == expected.text
        assert whole.choices[0].finish_reason == expected.finish_reason
        assert whole.usage.prompt_tokens == expected.usage.prompt_tokens
        assert whole.usage.completion_tokens == expected.usage.completion_tokens

        # n samples of one prompt share its prefill: the first computes it, the others hit the prefix cache
        prompt = list(range(10, 10 + 160))
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as api:
            many = api.completions.create(model="default_model", prompt=prompt, max_tokens=4, n=4, seed=1)
        assert len(many.choices) == 4 and many.usage.prompt_tokens == 160
        with Client(daemon.address) as client:
            deadline = time.monotonic() + 10
            while (hits := client.status().workers[0].prefix_cache_hits) < 3 * 128 and time.monotonic() < deadline:
                time.sleep(0.1)  # the worker reports its counters with its heartbeat
        assert hits >= 3 * 128  # three of the four reuse at least the prompt's whole blocks


def test_sigterm_mid_stream_closes_connections_and_cancels(tmp_path):
    args = ("--engine", "synthetic", "--devices", "cpu", "--synthetic-step-ms", "10")
    with running_daemon(tmp_path, *args) as daemon, running_http(daemon.address) as server:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as api:
            stream = api.completions.create(model="default_model", prompt="x", max_tokens=480, stream=True)
            assert next(stream).choices[0].text == " t0"
            started = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            assert server.proc.wait(10) == 0
            assert time.monotonic() - started < 4.0  # the 1 s grace, not the 4.8 s the stream had left
            rest = []
            try:
                rest = [c for c in stream]
            except openai.APIError:
                pass
            stream.close()
            assert len(rest) < 400
        with Client(daemon.address) as client:
            deadline = time.monotonic() + 2.0
            while client.status().requests_open and time.monotonic() < deadline:
                time.sleep(0.05)
            assert client.status().requests_open == 0


def test_health_and_shutting_down_while_the_daemon_drains(tmp_path):
    args = ("--engine", "synthetic", "--devices", "cpu", "--synthetic-step-ms", "10")
    with running_daemon(tmp_path, *args) as daemon, running_http(daemon.address) as server:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as api:
            assert api.with_raw_response.models.list().status_code == 200
            stream = api.completions.create(model="default_model", prompt="x", max_tokens=480, stream=True)
            assert next(stream).choices[0].text == " t0"
            daemon.proc.send_signal(signal.SIGTERM)  # drains: the running stream goes on, new requests are refused
            deadline = time.monotonic() + 5
            while True:
                status, headers, body = raw(server.url, "/health")
                if status == 503 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert status == 503 and json.loads(body)["status"] == "draining" and headers["Retry-After"] == "1"
            try:
                api.completions.create(model="default_model", prompt="y", max_tokens=2)
                raise AssertionError("a draining daemon took a new request")
            except openai.APIStatusError as exc:
                assert exc.status_code == 503 and exc.body["code"] == "SHUTTING_DOWN"
            stream.close()  # cancels the last stream: the daemon stops
            assert daemon.proc.wait(10) == 0
