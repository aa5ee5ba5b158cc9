"""The status counters are read from the Prometheus counters: one source for both."""

from __future__ import annotations

from ringstream.daemon.metrics import Metrics


def test_counters_are_sums_of_the_prometheus_samples():
    m = Metrics()
    assert set(m.counters().values()) == {0}
    m.admitted.inc(3)
    m.generation_tokens.inc(40)
    m.preemptions.labels("0", "priority").inc()
    m.preemptions.labels("1", "kv_cache").inc(2)
    m.dropped.labels("frame_count").inc()
    m.dropped.labels("worker_event").inc()
    m.dropped.labels("stale_record").inc(4)
    m.client_events.labels("stuck").inc()
    counters = m.counters()
    assert counters["requests_total"] == 3 and counters["tokens_generated_total"] == 40
    assert counters["preemptions_total"] == 3
    assert counters["dropped_frames_total"] == 2 and counters["stale_records_total"] == 4
    assert counters["clients_stuck_total"] == 1 and counters["clients_disconnected_total"] == 0
    snapshot = m.snapshot()
    assert snapshot["ringstream_requests_admitted_total"] == 3
    assert snapshot["ringstream_preemptions_total{cause=kv_cache,worker=1}"] == 2


def test_total_filters_by_label():
    m = Metrics()
    m.preemptions.labels("0", "priority").inc()
    m.preemptions.labels("0", "kv_cache").inc(5)
    assert m.total("ringstream_preemptions", cause="kv_cache") == 5
    assert m.total("ringstream_preemptions", worker="0") == 6
