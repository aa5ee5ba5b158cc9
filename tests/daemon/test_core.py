"""The front's core driven by events alone: fake ports, fake ring records, a hand-moved clock.

No socket, process or event loop: what the core sends to clients and workers
is recorded by :class:`FakePorts`, its timers fire when the test moves the
clock, and worker output arrives as ring records built here.
"""

from __future__ import annotations

import itertools

import pytest

from ringstream.daemon.front.core import ABORT_GRACE_S, MAX_RESUMES, FrontCore
from ringstream.daemon.front.intake import Intake
from ringstream.daemon.front.outbox import RETRY_SEND_S
from ringstream.daemon.front.request import DaemonState, Request, RequestStatus
from ringstream.ipc import protocol as P
from ringstream.ipc.ring import KIND_ERROR, KIND_FINISH, KIND_TOKEN, Record
from tests.daemon.fake_ports import CLIENT, make_core, worker_ready

_handles = itertools.count(1)


def submit(core: FrontCore, rid: str, prompt=(1, 2, 3), client: bytes = CLIENT, **fields) -> Request:
    """A validated request admitted to the core, as the intake does it."""
    msg = P.make_generate(rid, prompt_token_ids=list(prompt), **fields)
    req = Request(client, rid, next(_handles), msg, list(prompt), core.clock(), queued_at=core.clock())
    core.admit(req, connection=None)
    return req


def tokens(req: Request, *token_ids: int, start: int | None = None) -> list[Record]:
    first = req.next_token_seq if start is None else start
    return [Record(KIND_TOKEN, 0, req.handle, first + i, t, f"<{t}>".encode()) for i, t in enumerate(token_ids)]


def finish(req: Request, reason: P.FinishReason = P.FinishReason.LENGTH) -> Record:
    return Record(KIND_FINISH, 0, req.handle, 0, 0, P.encode(P.Finish(finish_reason=reason)))


def assigns(commands) -> list[P.Assign]:
    return [c for _, c in commands if isinstance(c, P.Assign)]


def aborts(commands) -> list[int]:
    return [c.handle for _, c in commands if isinstance(c, P.Abort)]


# ---------------------------------------------------------------- lifecycle


def test_a_request_waits_for_a_ready_worker_then_streams_and_ends_with_its_usage():
    core, ports = make_core()
    req = submit(core, "r1", max_tokens=3)
    assert req.status == RequestStatus.WAITING and not ports.commands  # accepted, queued: no worker yet
    ports.advance(0.5)
    worker_ready(core)
    assert core.state == DaemonState.SERVING and ports.milestones == ["ready"]
    [(index, assign)] = ports.take_commands()
    assert (index, assign.handle, assign.prompt_token_ids, assign.sampling.max_tokens) == (0, req.handle, [1, 2, 3], 3)
    assert req.status == RequestStatus.RUNNING

    ports.advance(0.1)
    core.on_ring([tokens(req, 7, 8)])  # two tokens read together: one chunk
    ports.advance(0.1)
    core.on_ring([tokens(req, 9), [finish(req)]])
    first, last = ports.to_client()
    assert (first.seq, first.text, first.token_ids, first.finish_reason) == (0, "<7><8>", [7, 8], None)
    assert (last.seq, last.text, last.token_ids, last.finish_reason) == (1, "<9>", [9], P.FinishReason.LENGTH)
    assert last.usage.prompt_tokens == 3 and last.usage.completion_tokens == 3
    assert last.usage.queue_time_s == pytest.approx(0.5) and last.usage.ttft_s == pytest.approx(0.6)
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert not core.by_handle and not len(core.clients)  # delivered: in no table any more
    assert core.scheduler.num_running == 0


def test_a_non_streaming_request_gets_all_its_text_in_the_terminal_chunk():
    core, ports = make_core()
    worker_ready(core)
    req = submit(core, "r1", stream=False)
    core.on_ring([tokens(req, 5)])
    core.on_ring([tokens(req, 6), [finish(req, P.FinishReason.STOP)]])
    [only] = ports.to_client()
    assert (only.text, only.token_ids, only.finish_reason) == ("<5><6>", [5, 6], P.FinishReason.STOP)


def test_the_queue_bound_refuses_with_queue_full_and_counts_nothing_as_invalid():
    core, ports = make_core(queue_size=1)
    submit(core, "r1")
    refused = submit(core, "r2")
    [error] = ports.to_client()
    assert (error.id, error.code) == ("r2", P.ErrorCode.QUEUE_FULL)
    assert refused.handle not in core.by_handle
    assert core.metrics.total("ringstream_invalid_requests") == 0


def test_a_token_out_of_sequence_ends_the_stream_instead_of_streaming_a_gap():
    core, ports = make_core()
    worker_ready(core)
    req = submit(core, "r1")
    ports.take_commands()
    core.on_ring([tokens(req, 5, start=1)])  # seq 1 before seq 0
    assert aborts(ports.take_commands()) == [req.handle] and req.status == RequestStatus.ABORTING
    core.on_ring([[finish(req, P.FinishReason.CANCELLED)]])
    [last] = ports.to_client()
    assert last.finish_reason == P.FinishReason.ERROR and last.token_ids == []


def test_a_worker_error_record_ends_the_request_with_its_error():
    core, ports = make_core()
    worker_ready(core)
    req = submit(core, "r1")
    error = P.WorkerError(code=P.ErrorCode.INTERNAL, message="step failed")
    core.on_ring([[Record(KIND_ERROR, 0, req.handle, 0, 0, P.encode(error))]])
    [sent] = ports.to_client()
    assert isinstance(sent, P.Error) and (sent.id, sent.code, sent.message) == ("r1", P.ErrorCode.INTERNAL, "step failed")
    assert req.status == RequestStatus.FINISHED_ERROR


def test_records_of_an_ended_request_are_dropped_and_counted():
    core, ports = make_core()
    worker_ready(core)
    core.on_ring([[Record(KIND_TOKEN, 0, 999, 0, 5, b"x")]])
    assert ports.to_client() == []
    assert core.metrics.total("ringstream_dropped_messages", reason="stale_record") == 1


# ---------------------------------------------------------------- preemption


def test_a_more_urgent_request_preempts_and_the_victim_resumes_with_its_tokens():
    core, ports = make_core(max_concurrency=1)
    worker_ready(core, max_num_seqs=1)
    low = submit(core, "low", priority=5)
    core.on_ring([tokens(low, 11, 12)])
    ports.take_commands()
    ports.advance(1.0)
    high = submit(core, "high", priority=-5)
    commands = ports.take_commands()  # the victim's slot is the newcomer's at once
    assert aborts(commands) == [low.handle] and low.status == RequestStatus.PREEMPTING
    assert [a.handle for a in assigns(commands)] == [high.handle]
    core.on_ring([[finish(low, P.FinishReason.CANCELLED)]])  # the worker confirms the preemption
    assert low.status == RequestStatus.WAITING and not ports.commands
    ports.advance(2.0)
    core.on_ring([tokens(high, 1), [finish(high)]])
    [resume] = assigns(ports.take_commands())
    assert (resume.handle, resume.output_token_ids) == (low.handle, [11, 12])  # continues where it stopped
    core.on_ring([tokens(low, 13), [finish(low)]])
    low_chunks = [m for m in ports.to_client() if m.id == "low"]
    assert [m.token_ids for m in low_chunks] == [[11, 12], [13]]  # no token lost or repeated
    last = low_chunks[-1]
    assert last.finish_reason == P.FinishReason.LENGTH and last.usage.completion_tokens == 3
    assert last.usage.queue_time_s == pytest.approx(2.0)  # the wait after the preemption counts


def test_a_cancelled_request_is_never_preempted_back_to_life():
    core, ports = make_core(max_concurrency=1)
    worker_ready(core, max_num_seqs=1)
    low = submit(core, "low", priority=5)
    ports.take_commands()
    core.abort(low, P.FinishReason.CANCELLED)
    high = submit(core, "high", priority=-5)
    commands = ports.take_commands()
    assert aborts(commands) == [low.handle] and not assigns(commands)  # the cancel's abort, no preemption
    assert low.status == RequestStatus.ABORTING
    core.on_ring([[finish(low, P.FinishReason.CANCELLED)]])
    assert ports.to_client()[-1].finish_reason == P.FinishReason.CANCELLED and low.status.is_finished
    assert [a.handle for a in assigns(ports.take_commands())] == [high.handle]


def test_a_request_that_finished_before_its_cancel_reached_the_worker_keeps_its_finish_reason():
    core, ports = make_core()
    worker_ready(core)
    req = submit(core, "r1", max_tokens=1)
    core.abort(req, P.FinishReason.CANCELLED)
    core.on_ring([tokens(req, 3), [finish(req, P.FinishReason.LENGTH)]])
    assert ports.to_client()[-1].finish_reason == P.FinishReason.LENGTH


def test_a_preempted_request_that_finished_first_ends_normally():
    core, ports = make_core(max_concurrency=1)
    worker_ready(core, max_num_seqs=1)
    low = submit(core, "low", priority=5)
    submit(core, "high", priority=-5)
    assert low.status == RequestStatus.PREEMPTING
    core.on_ring([tokens(low, 4), [finish(low, P.FinishReason.STOP)]])  # its last step raced the abort
    assert ports.to_client()[-1].finish_reason == P.FinishReason.STOP
    assert low.status == RequestStatus.FINISHED_STOPPED


# ---------------------------------------------------------------- cancel and deadlines


def test_cancel_while_waiting_ends_at_once_and_while_running_after_the_worker_confirms():
    core, ports = make_core()
    waiting = submit(core, "w")
    core.abort(waiting, P.FinishReason.CANCELLED)
    assert ports.to_client()[-1].finish_reason == P.FinishReason.CANCELLED and not ports.commands
    worker_ready(core)
    running = submit(core, "r")
    ports.take_commands()
    core.abort(running, P.FinishReason.CANCELLED)
    assert aborts(ports.take_commands()) == [running.handle]
    assert running.status == RequestStatus.ABORTING and running.handle in core.by_handle
    core.abort(running, P.FinishReason.TIMEOUT)  # a second abort changes nothing
    assert not ports.commands
    core.on_ring([tokens(running, 3), [finish(running, P.FinishReason.CANCELLED)]])
    last = ports.to_client()[-1]
    assert (last.id, last.token_ids, last.finish_reason) == ("r", [3], P.FinishReason.CANCELLED)
    assert not core.by_handle


def test_the_request_timeout_aborts_a_running_request():
    core, ports = make_core()
    worker_ready(core)
    req = submit(core, "r1", timeout_s=2.0)
    ports.take_commands()
    ports.advance(1.9)
    assert not ports.commands
    ports.advance(0.2)
    assert aborts(ports.take_commands()) == [req.handle]
    core.on_ring([[finish(req, P.FinishReason.CANCELLED)]])
    assert ports.to_client()[-1].finish_reason == P.FinishReason.TIMEOUT


def test_the_queue_timeout_refuses_a_request_never_scheduled():
    core, ports = make_core(queue_timeout_s=1.0)
    req = submit(core, "r1")
    ports.advance(1.5)
    [error] = ports.to_client()
    assert error.code == P.ErrorCode.QUEUE_TIMEOUT and req.status == RequestStatus.FINISHED_ERROR
    worker_ready(core)
    assert not ports.commands  # nothing left to assign


def test_timers_of_an_ended_request_never_fire():
    core, ports = make_core(queue_timeout_s=1.0)
    worker_ready(core)
    req = submit(core, "r1", timeout_s=2.0)
    core.on_ring([tokens(req, 1), [finish(req)]])
    ports.take_commands()
    sent = len(ports.sent)
    ports.advance(10.0)
    assert not ports.commands and len(ports.sent) == sent


# ---------------------------------------------------------------- workers


def test_a_worker_death_resumes_its_requests_on_another_worker():
    core, ports = make_core(num_workers=2)
    worker_ready(core, 0)
    worker_ready(core, 1)
    req = submit(core, "r1")
    [(index, _)] = ports.take_commands()
    core.on_ring([tokens(req, 5, 6)])
    assert core.on_worker_exit(index) is True  # serving: restart it
    [(other, resume)] = ports.take_commands()
    assert other == 1 - index and resume.output_token_ids == [5, 6]
    assert req.status == RequestStatus.RUNNING and req.worker_failures == 1


def test_what_a_dead_worker_published_last_is_streamed_and_no_new_work_goes_to_it():
    core, ports = make_core(max_concurrency=1)
    worker_ready(core, max_num_seqs=1)
    done = submit(core, "done")
    waiting = submit(core, "waiting")
    ports.take_commands()
    assert core.on_worker_exit(0, [tokens(done, 4), [finish(done)]]) is True
    assert ports.to_client()[-1].finish_reason == P.FinishReason.LENGTH  # its last record was not lost
    assert not assigns(ports.take_commands())  # the slot it freed is not on the dead worker
    assert waiting.status == RequestStatus.WAITING and waiting.worker_failures == 0


def test_a_request_whose_workers_keep_dying_ends_with_worker_failed():
    core, ports = make_core()
    worker_ready(core)
    req = submit(core, "r1")
    for _ in range(MAX_RESUMES):
        core.on_worker_exit(0)
        assert req.status == RequestStatus.WAITING  # no live worker: back in the queue
        worker_ready(core)  # restarted
        assert req.status == RequestStatus.RUNNING
    core.on_worker_exit(0)
    [error] = ports.to_client()
    assert error.code == P.ErrorCode.WORKER_FAILED and not core.by_handle


def test_a_worker_dying_while_starting_stops_the_daemon_with_exit_code_1():
    core, ports = make_core(num_workers=2)
    worker_ready(core, 0)
    assert core.on_worker_exit(1) is False
    assert core.exit_code == 1 and core.state == DaemonState.STOPPED
    assert ports.milestones == ["stopping", "stopped"]


@pytest.mark.parametrize("refused,code", [(False, 1), (True, 2)])
def test_a_worker_failing_its_start_stops_the_daemon_with_2_when_the_model_was_refused(refused, code):
    core, _ = make_core(num_workers=2)
    worker_ready(core, 0)
    core.on_worker_start_failed(refused)
    assert core.exit_code == code and core.state != DaemonState.SERVING


def test_a_worker_failing_its_start_once_serving_leaves_the_daemon_serving():
    core, _ = make_core(num_workers=2)
    worker_ready(core, 0)
    worker_ready(core, 1)
    core.on_worker_start_failed(True)
    assert core.state == DaemonState.SERVING and core.exit_code == 0


def test_an_aborted_request_on_a_dead_worker_ends_with_its_abort_reason():
    core, ports = make_core()
    worker_ready(core)
    req = submit(core, "r1")
    core.abort(req, P.FinishReason.CANCELLED)
    core.on_worker_exit(0)
    assert ports.to_client()[-1].finish_reason == P.FinishReason.CANCELLED


def test_worker_load_reports_feed_the_kv_counters_as_deltas_across_a_restart():
    core, _ = make_core()
    worker_ready(core)
    core.on_worker_load(P.WorkerHeartbeat(worker=0, running=1, waiting=0, steps=5, prefix_cache_hits=30))
    core.on_worker_load(P.WorkerHeartbeat(worker=0, running=1, waiting=0, steps=9, prefix_cache_hits=50))
    core.on_worker_load(P.WorkerHeartbeat(worker=0, running=0, waiting=0, steps=1, prefix_cache_hits=4))  # restarted
    assert core.metrics.total("ringstream_prefix_cache_hits") == 54


# ---------------------------------------------------------------- clients


def test_a_client_found_gone_has_its_requests_cancelled_and_nothing_more_sent():
    core, ports = make_core()
    worker_ready(core)
    req = submit(core, "r1")
    ports.take_commands()
    ports.send_results[CLIENT] = "gone"
    core.on_ring([tokens(req, 5)])
    assert aborts(ports.take_commands()) == [req.handle] and req.client == b""
    core.on_ring([[finish(req, P.FinishReason.CANCELLED)]])
    assert ports.sent == [] and not core.by_handle and not len(core.clients)


def test_a_blocked_client_gets_its_tokens_coalesced_once_it_reads_again():
    core, ports = make_core()
    worker_ready(core)
    req = submit(core, "r1")
    ports.send_results[CLIENT] = "blocked"
    core.on_ring([tokens(req, 5)])
    core.on_ring([tokens(req, 6)])
    assert core.outbox.blocked == {req.handle: req}
    ports.advance(RETRY_SEND_S)  # still blocked: retried, still pending
    del ports.send_results[CLIENT]
    ports.advance(RETRY_SEND_S)
    [chunk] = ports.to_client()
    assert chunk.token_ids == [5, 6] and not core.outbox.blocked
    assert "poll" in ports.milestones  # connection events applied before the retry sends
    assert core.metrics.total("ringstream_client_events", event="send_blocked") == 1


def test_a_refusal_waits_for_a_client_whose_queue_is_full():
    core, ports = make_core(queue_size=1)
    submit(core, "r1")
    ports.send_results[CLIENT] = "blocked"
    submit(core, "r2")  # QUEUE_FULL, but the client is not reading
    assert ports.to_client() == [] and len(core.outbox.blocked) == 1
    del ports.send_results[CLIENT]
    ports.advance(RETRY_SEND_S)
    [error] = ports.to_client()
    assert (error.id, error.code) == ("r2", P.ErrorCode.QUEUE_FULL) and not core.outbox.blocked
    assert list(core.clients.get(CLIENT).requests) == ["r1"]  # the refused one left the table


def test_a_client_that_stops_reading_has_its_requests_cancelled_after_client_timeout():
    core, ports = make_core(client_timeout_s=1.0)
    worker_ready(core)
    req = submit(core, "r1")
    ports.take_commands()
    ports.send_results[CLIENT] = "blocked"
    core.on_ring([tokens(req, 5)])
    core.clients.get(CLIENT).last_seen = ports.now + 10  # it keeps sending heartbeats
    ports.advance(1.5)
    core.expire_clients(ports.now)
    assert aborts(ports.take_commands()) == [req.handle]
    assert core.metrics.total("ringstream_client_events", event="stuck") == 1


# ---------------------------------------------------------------- shutdown


def test_drain_refuses_the_waiting_lets_the_running_finish_then_stops():
    core, ports = make_core(max_concurrency=1)
    worker_ready(core, max_num_seqs=1)
    running = submit(core, "run")
    waiting = submit(core, "wait")
    core.request_stop()
    assert core.state == DaemonState.DRAINING and ports.milestones[-1] == "stopping"
    assert ports.to_client()[-1].code == P.ErrorCode.SHUTTING_DOWN and waiting.status.is_finished
    submit(core, "late")
    assert (ports.to_client()[-1].id, ports.to_client()[-1].code) == ("late", P.ErrorCode.SHUTTING_DOWN)
    core.on_ring([tokens(running, 1), [finish(running)]])
    assert core.state == DaemonState.STOPPED and ports.milestones[-1] == "stopped"


def test_drain_deadline_aborts_the_running_and_flush_delivers_before_the_stop():
    core, ports = make_core(drain_timeout_s=3.0)
    worker_ready(core)
    req = submit(core, "r1")
    ports.take_commands()
    core.request_stop()
    ports.advance(3.0)
    assert core.state == DaemonState.ABORTING and aborts(ports.take_commands()) == [req.handle]
    ports.send_results[CLIENT] = "blocked"
    core.on_ring([[finish(req, P.FinishReason.CANCELLED)]])  # confirmed; its last chunk cannot be sent yet
    assert core.state == DaemonState.FLUSHING
    del ports.send_results[CLIENT]
    ports.advance(RETRY_SEND_S)
    assert ports.to_client()[-1].finish_reason == P.FinishReason.SHUTDOWN
    # it lagged: what its socket still queues reaches it only as it reads, so the flush keeps its grace
    assert core.state == DaemonState.FLUSHING
    ports.advance(ABORT_GRACE_S)
    assert core.state == DaemonState.STOPPED


def test_a_stop_with_no_lagging_client_ends_as_soon_as_all_is_delivered():
    core, ports = make_core()
    worker_ready(core)
    req = submit(core, "r1")
    core.request_stop()
    core.on_ring([tokens(req, 1), [finish(req)]])
    assert core.state == DaemonState.STOPPED and ports.to_client()[-1].finish_reason == P.FinishReason.LENGTH


def test_an_abort_never_confirmed_is_ended_after_the_grace():
    core, ports = make_core(drain_timeout_s=1.0)
    worker_ready(core)
    req = submit(core, "r1")
    core.request_stop()
    ports.advance(1.0 + ABORT_GRACE_S)
    assert ports.to_client()[-1].finish_reason == P.FinishReason.SHUTDOWN and req.status.is_finished
    assert core.state == DaemonState.STOPPED


def test_a_second_stop_while_draining_aborts_at_once():
    core, ports = make_core(drain_timeout_s=30.0)
    worker_ready(core)
    req = submit(core, "r1")
    ports.take_commands()
    core.request_stop()
    assert core.state == DaemonState.DRAINING and not ports.commands
    core.request_stop()
    assert core.state == DaemonState.ABORTING and aborts(ports.take_commands()) == [req.handle]
    core.on_ring([tokens(req, 2), [finish(req, P.FinishReason.CANCELLED)]])
    assert ports.to_client()[-1].finish_reason == P.FinishReason.SHUTDOWN and core.state == DaemonState.STOPPED


def test_a_stop_while_starting_stops_at_once():
    core, ports = make_core()
    core.request_stop()
    assert core.state == DaemonState.STOPPED and ports.milestones == ["stopping", "stopped"]
    core.request_stop()  # a second signal changes nothing
    assert ports.milestones == ["stopping", "stopped"]


# ---------------------------------------------------------------- settings and intake


def test_live_settings_apply_at_once_and_unknown_names_change_nothing():
    core, ports = make_core(max_concurrency=1)
    worker_ready(core, max_num_seqs=4)
    submit(core, "a")
    submit(core, "b")
    assert len(assigns(ports.take_commands())) == 1
    assert core.apply_settings({"max_concurrency": 2}) == []
    assert len(assigns(ports.take_commands())) == 1  # the second one starts now
    with pytest.raises(ValueError, match="not a live setting"):
        core.apply_settings({"max_concurrency": 3, "model": "x"})
    assert core.config.max_concurrency == 2


class _Validator:
    """Token ids as given; text prompts are refused (no tokenizer in these tests)."""

    def check(self, msg: P.Generate, limit: int) -> list[int]:
        from ringstream.daemon.front.validate import RequestRejected
        if msg.prompt_token_ids is None:
            raise RequestRejected(P.ErrorCode.INVALID_REQUEST, "text prompts need a tokenizer")
        return list(msg.prompt_token_ids)


def test_the_intake_admits_answers_cancels_and_refuses_without_any_socket():
    core, ports = make_core()
    worker_ready(core)
    intake = Intake(core, _Validator(), run_off_loop=None, status=lambda notes: P.StatusReply(
        version="x", ready=True, state="serving", uptime_s=0, waiting=0, running=0, queue_size=0, max_concurrency=0,
        requests_total=0, tokens_generated_total=0, workers=[]), admin_allowed=False)
    intake.on_frames([CLIENT, P.encode(P.Generate(id="r1", prompt_token_ids=[4, 5]))])
    [assign] = assigns(ports.take_commands())
    assert assign.prompt_token_ids == [4, 5]
    intake.on_frames([CLIENT, P.encode(P.Generate(id="r1", prompt_token_ids=[4]))])
    assert "duplicate request id" in ports.to_client()[-1].message
    intake.on_frames([CLIENT, P.encode(P.Cancel(id="r1"))])
    assert aborts(ports.take_commands()) == [assign.handle]
    intake.on_frames([CLIENT, P.encode(P.Heartbeat(open_ids=["r1", "ghost"]))])
    assert isinstance(ports.to_client()[-2], P.HeartbeatAck)
    assert (ports.to_client()[-1].id, ports.to_client()[-1].code) == ("ghost", P.ErrorCode.UNKNOWN_REQUEST)
    deep = b"\x9b\xa8generate\xa4deep\xa2hi\xc0\x91\x03\x00\xc0\xc0\xc3\xc0" + b"\x91" * 100_000 + b"\xc0"
    intake.on_frames([CLIENT, deep])  # an 11th, unknown field nested past the stack: skipped by recursion
    assert (ports.to_client()[-1].id, ports.to_client()[-1].code) == ("deep", P.ErrorCode.INVALID_REQUEST)
    intake.on_frames([CLIENT, b"\x93garbage"])
    assert ports.to_client()[-1].code == P.ErrorCode.INVALID_REQUEST
    intake.on_frames([CLIENT, P.encode(P.Admin(settings={"max_concurrency": 2}))])
    assert "only on an ipc socket" in ports.to_client()[-1].message
    assert core.config.max_concurrency != 2
    intake.on_frames([CLIENT, P.encode(P.Generate(id="r2", prompt="text"))])
    assert (ports.to_client()[-1].id, ports.to_client()[-1].code) == ("r2", P.ErrorCode.INVALID_REQUEST)
    core.request_stop()
    intake.on_frames([CLIENT, P.encode(P.Generate(id="r3", prompt_token_ids=[4]))])
    assert (ports.to_client()[-1].id, ports.to_client()[-1].code) == ("r3", P.ErrorCode.SHUTTING_DOWN)
