"""The front's metrics: recent throughput, latency percentiles from histogram buckets, and the status counters
read from the Prometheus counters (one source for both)."""

import pytest

from ringstream.daemon.front.metrics import Metrics, RecentRate, histogram_quantile


def test_recent_rate_counts_the_last_seconds_only():
    rate = RecentRate(10, now=100.0)
    assert rate.rate(100.0) == 0.0
    rate.add(50, 100.5)
    assert (rate.window(101.0), rate.rate(101.0)) == (1.0, 50.0)  # younger than its window
    rate.add(45, 108.2)
    assert rate.window(109.5) == 9.5 and rate.rate(109.5) == pytest.approx(95 / 9.5)
    assert rate.rate(115.0) == pytest.approx(45 / 9.0)  # the second 100 left the window
    assert rate.rate(130.0) == 0.0


def test_percentiles_interpolate_within_buckets():
    metrics = Metrics()
    assert metrics.latency_percentiles() == dict(ttft_p50_s=None, ttft_p99_s=None, itl_p50_s=None, itl_p99_s=None)
    for seconds in [0.004] * 50 + [0.02] * 49 + [0.2]:
        metrics.ttft.observe(seconds)
    figures = metrics.latency_percentiles()
    assert figures["ttft_p50_s"] == pytest.approx(0.005)  # rank 50 of 100: the top of the first bucket
    assert 0.01 < figures["ttft_p99_s"] <= 0.025
    assert figures["itl_p50_s"] is None
    metrics.itl.observe(1000.0)  # beyond the last finite bound
    assert histogram_quantile(metrics.itl, 0.5) == 2.5


def test_generation_tokens_feed_the_counter_and_the_rate():
    metrics = Metrics()
    metrics.generation_tokens.inc(7)
    assert metrics.snapshot()["ringstream_generation_tokens_total"] == 7
    assert sum(count for _, count in metrics.generation_tokens.recent.buckets) == 7


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
