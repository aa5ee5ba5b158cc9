"""The HTTP cost benchmark runs both paths against a real daemon and reports CPU per token for each."""

from __future__ import annotations

import pytest

from ringstream.tools.bench_http import measure

pytestmark = pytest.mark.e2e


def test_both_paths_are_measured_and_only_http_costs_the_http_child():
    zmq_run, http_run = measure(streams=8, tokens=250, repeats=1)  # CPU time counts in 10 ms ticks: enough tokens
    assert (zmq_run["path"], http_run["path"]) == ("zmq", "http")
    assert zmq_run["front_us_per_token"] > 0 and http_run["front_us_per_token"] > 0
    assert http_run["http_us_per_token"] > 0 and zmq_run["http_us_per_token"] < http_run["http_us_per_token"]
    assert all(run["wall_s"] > 0 for run in (zmq_run, http_run))
