"""Request and daemon states: one ordered field each."""

from __future__ import annotations

import pytest

from ringstream.daemon.front.request import DaemonState, RequestStatus
from ringstream.ipc import protocol as P


@pytest.mark.parametrize("final, status", [
    (P.Chunk(id="a", seq=0, finish_reason=P.FinishReason.STOP), RequestStatus.FINISHED_STOPPED),
    (P.Chunk(id="a", seq=0, finish_reason=P.FinishReason.LENGTH), RequestStatus.FINISHED_LENGTH),
    (P.Chunk(id="a", seq=0, finish_reason=P.FinishReason.CANCELLED), RequestStatus.FINISHED_ABORTED),
    (P.Chunk(id="a", seq=0, finish_reason=P.FinishReason.TIMEOUT), RequestStatus.FINISHED_ABORTED),
    (P.Error(id="a", code=P.ErrorCode.QUEUE_FULL, message="full"), RequestStatus.FINISHED_ERROR),
])
def test_a_terminal_message_names_its_finished_status(final, status):
    assert RequestStatus.of(final) is status
    assert status.is_finished


def test_statuses_are_ordered_so_that_ending_compares_once():
    live = [RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTING]
    assert all(s < RequestStatus.ABORTING and not s.is_finished for s in live)
    assert not RequestStatus.ABORTING.is_finished
    assert sorted(RequestStatus) == list(RequestStatus)


def test_only_starting_and_serving_accept_requests():
    assert [s for s in DaemonState if s.accepts_requests] == [DaemonState.STARTING, DaemonState.SERVING]
    assert DaemonState.SERVING == "serving"  # the wire's StatusReply.state
