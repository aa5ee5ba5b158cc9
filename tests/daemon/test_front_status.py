"""What the front's status reply says of one open request (no process started)."""

from __future__ import annotations

import pytest

from ringstream.daemon.front.status import decode_rate, request_info
from ringstream.daemon.front.request import Request, RequestStatus
from ringstream.ipc import protocol as P

ARRIVAL = 100.0


def _request(**fields) -> Request:
    msg = P.make_generate(id="r1", prompt_token_ids=[1, 2, 3], max_tokens=16, priority=-2)
    return Request(client=b"c", id="r1", handle=1, msg=msg, prompt_token_ids=[1, 2, 3], arrival=ARRIVAL, **fields)


def test_a_waiting_request_has_no_worker_and_no_ttft():
    info = request_info(_request(last_worker=1), now=ARRIVAL + 2.0)  # back in the queue after a preemption
    assert info == P.RequestInfo(id="r1", priority=-2, state="waiting", worker=None, prompt_tokens=3,
                                 completion_tokens=0, max_tokens=16, age_s=2.0, ttft_s=None)


def test_a_running_request_names_its_worker_tokens_and_ttft():
    req = _request(status=RequestStatus.RUNNING, worker=0, first_token=ARRIVAL + 0.25, output_token_ids=[5] * 11)
    info = request_info(req, now=ARRIVAL + 1.25)
    assert (info.state, info.worker, info.completion_tokens, info.ttft_s) == ("running", 0, 11, 0.25)
    assert decode_rate(req, now=ARRIVAL + 1.25) == pytest.approx(10.0)  # 10 tokens after the first, in 1 s


def test_a_request_being_preempted_stays_on_its_last_worker():
    req = _request(status=RequestStatus.PREEMPTING, last_worker=1, first_token=ARRIVAL + 0.1)
    assert request_info(req, now=ARRIVAL + 1.0).worker == 1


def test_no_decode_rate_before_the_second_token():
    assert decode_rate(_request(), now=ARRIVAL + 1.0) == 0.0
    assert decode_rate(_request(first_token=ARRIVAL + 0.5, output_token_ids=[5]), now=ARRIVAL + 1.0) == 0.0
