"""Tests of ringstream-bench: statistics, workload generation, and a smoke run of every comparison part."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from ringstream.tools import bench
from ringstream.tools.bench_serving import synthetic_engine_support, toml_value, zmq_ceiling
from ringstream.tools.bench_stats import (
    ERROR_ORDER,
    RequestRecord,
    cdf,
    itl_samples,
    latency_summary,
    order_violations,
    percentile,
    seq_violations,
    summarize,
    timeline,
)
from ringstream.tools.loadgen import Dist, LoadConfig, WorkloadError, WorkloadSpec, expected_synthetic_text, parse_priority_mix

SMOKE_TIMEOUT_S = 120


def record(start: float, times: list[float], tokens: list[int] | None = None, **kwargs) -> RequestRecord:
    tokens = tokens or [1] * len(times)
    rec = RequestRecord(start=start, chunk_times=list(times), chunk_tokens=tokens, **kwargs)
    rec.seqs = kwargs.get("seqs", list(range(len(times))))
    rec.end = rec.end or (times[-1] if times else start)
    return rec


# ------------------------------------------------------------------ statistics


def test_percentile_interpolates_linearly_like_numpy():
    values = [15, 20, 35, 40, 50]
    assert percentile(values, 0) == 15 and percentile(values, 100) == 50
    assert percentile(values, 50) == 35
    assert percentile(values, 40) == pytest.approx(29.0)  # numpy.percentile(values, 40)
    assert percentile(values, 99) == pytest.approx(49.6)
    assert percentile([3.0], 99) == 3.0
    assert percentile(list(range(101)), 90) == pytest.approx(90.0)
    rng = random.Random(0)
    shuffled = [rng.random() for _ in range(1000)]
    assert percentile(shuffled, 50) == pytest.approx(percentile(sorted(shuffled), 50))


def test_percentile_rejects_empty_and_out_of_range():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


@pytest.mark.parametrize(
    "seqs, violations",
    [
        ([], 0),
        ([0, 1, 2, 3], 0),
        ([0, 1, 3, 4], 1),  # one missing chunk counts once
        ([1, 2, 3], 1),  # the first must be 0
        ([0, 1, 1, 2], 1),  # the repeat breaks; counting resumes from it
        ([0, 2, 1, 3], 3),  # reordering breaks at every step
    ],
)
def test_seq_violations(seqs, violations):
    assert seq_violations(seqs) == violations


def test_order_violations_add_client_detected_errors():
    records = [record(0.0, [1.0, 2.0], seqs=[0, 1]), record(0.0, [1.0], seqs=[0, 2], order_errors=0)]
    records.append(RequestRecord(start=0.0, end=1.0, error=ERROR_ORDER, order_errors=1))
    records[1].seqs = [0, 2]
    assert order_violations(records) == 2


def test_itl_divides_chunk_gaps_by_tokens_and_weights_by_token():
    assert itl_samples([1.0, 1.006, 1.008], [1, 3, 1]) == pytest.approx([0.002, 0.002, 0.002, 0.002])
    assert itl_samples([5.0], [4]) == []
    assert itl_samples([1.0, 2.0], [1, 0]) == []


def test_summarize_on_known_data():
    records = [
        record(0.0, [0.1, 0.2, 0.3], end=0.35),
        record(0.0, [0.2, 0.4], [1, 2], end=0.4),
        record(0.1, [0.5, 0.6], end=0.6, priority=10),
        RequestRecord(start=0.2, end=0.25, error="QUEUE_FULL"),
    ]
    summary = summarize(records)
    assert summary["requests"] == 4 and summary["completed"] == 3
    assert summary["errors"] == {"QUEUE_FULL": 1}
    assert summary["wall_s"] == pytest.approx(0.6)
    assert summary["output_tokens"] == 3 + 3 + 2
    assert summary["tok_s"] == pytest.approx(8 / 0.6)
    assert summary["req_s"] == pytest.approx(3 / 0.6)
    assert summary["ttft_s"]["count"] == 3
    assert summary["ttft_s"]["p50"] == pytest.approx(0.2)
    assert summary["ttft_s"]["max"] == pytest.approx(0.4)
    assert summary["e2e_s"]["p50"] == pytest.approx(0.4)
    assert summary["itl_s"]["count"] == 2 + 2 + 1
    assert summary["order_violations"] == 0
    assert set(summary["by_priority"]) == {"0", "10"}
    assert summary["by_priority"]["10"]["ttft_s"]["p50"] == pytest.approx(0.4)
    assert summarize(records, wall_s=2.0)["tok_s"] == pytest.approx(4.0)


def test_latency_summary_of_nothing_is_none():
    summary = latency_summary([])
    assert summary["count"] == 0 and summary["p99"] is None and summary["mean"] is None


def test_timeline_and_cdf():
    records = [record(0.0, [0.1, 0.2, 1.1], [1, 1, 2]), record(0.5, [0.6])]
    points = timeline(records, bin_s=0.5)
    assert [t for t, _ in points] == [0.0, 0.5]
    assert [rate for _, rate in points] == pytest.approx([4.0, 3 / 0.6])  # the last bin spans 0.5-1.1 s
    assert timeline([record(0.0, [0.0], [2])], bin_s=0.5) == [(0.0, 4.0)]
    assert timeline([]) == []
    xs, ys = cdf([3.0, 1.0, 2.0])
    assert xs == [1.0, 2.0, 3.0] and ys == pytest.approx([1 / 3, 2 / 3, 1.0])


# ------------------------------------------------------------------ workload


def test_distributions_parse_and_sample():
    rng = random.Random(0)
    assert Dist.parse("64").sample(rng) == 64
    uniform = Dist.parse("uniform:10:20")
    assert all(10 <= uniform.sample(rng) <= 20 for _ in range(200))
    assert all(Dist.parse("normal:5:10").sample(rng) >= 1 for _ in range(200))
    exp = [Dist.parse("exp:50").sample(rng) for _ in range(4000)]
    assert 40 < sum(exp) / len(exp) < 60
    assert str(Dist.parse("uniform:10:20")) == "uniform:10:20" and str(Dist.parse("7")) == "7"
    for bad in ("", "x", "uniform:3", "uniform:5:1", "normal:1:-1", "exp:0", "poisson:3", "0"):
        with pytest.raises(WorkloadError):
            Dist.parse(bad)


def test_priority_mix():
    assert parse_priority_mix("0:0.8,10:0.2") == [(0, pytest.approx(0.8)), (10, pytest.approx(0.2))]
    assert parse_priority_mix("1:3,2:1") == [(1, 0.75), (2, 0.25)]
    assert parse_priority_mix(None) == [(0, 1.0)]
    for bad in ("a:1", "0:x", "0:0", "0:-1,1:2"):
        with pytest.raises(WorkloadError):
            parse_priority_mix(bad)


def test_workload_is_seeded_and_avoids_special_ids():
    spec = WorkloadSpec(prompt_len=Dist.parse("uniform:4:8"), vocab_size=50, exclude_ids=(7,),
                        priority_mix=((0, 0.5), (10, 0.5)))
    first = [next(spec.requests()) for _ in range(1)]
    stream_a, stream_b = spec.requests(), spec.requests()
    a = [next(stream_a) for _ in range(100)]
    b = [next(stream_b) for _ in range(100)]
    assert a == b and a[0] == first[0]
    ids = [i for r in a for i in r.prompt_token_ids]
    assert min(ids) >= 3 and max(ids) < 50 and 7 not in ids
    assert all(4 <= len(r.prompt_token_ids) <= 8 for r in a)
    assert {r.priority for r in a} == {0, 10}
    with pytest.raises(WorkloadError):
        next(WorkloadSpec(prompt_kind="text").requests())


def test_text_prompts_use_the_tokenizer():
    class Decoder:
        def decode(self, ids):
            return " ".join(f"w{i}" for i in ids)

    spec = WorkloadSpec(prompt_len=Dist.parse("3"), prompt_kind="mixed")
    stream = spec.requests(Decoder())
    first, second = next(stream), next(stream)
    assert first.prompt_token_ids is not None and first.prompt is None
    assert second.prompt is not None and len(second.prompt.split()) == 3


def test_load_config_checks():
    LoadConfig("ipc:///x").check()
    for kwargs in (dict(requests=None), dict(requests=0), dict(rate=0.0), dict(concurrency=0), dict(procs=0),
                   dict(duration_s=-1.0)):
        with pytest.raises(WorkloadError):
            LoadConfig("ipc:///x", **kwargs).check()


def test_expected_synthetic_text():
    assert expected_synthetic_text(3) == " t0 t1 t2"
    assert expected_synthetic_text(2, first_seq=5) == " t5 t6"


def test_toml_values():
    assert toml_value(True) == "true" and toml_value(3) == "3" and toml_value("a\"b") == '"a\\"b"'
    with pytest.raises(TypeError):
        toml_value([1])


# ------------------------------------------------------------------ serving layer


@pytest.mark.e2e
def test_zmq_ceiling_counts_every_message():
    result = zmq_ceiling(2_000)
    assert result["messages"] == 2_000 and result["msg_s"] > 0 and result["message_bytes"] < 64


@pytest.mark.e2e
def test_serve_has_the_synthetic_engine_flags():
    reason = synthetic_engine_support()
    if reason is not None:
        pytest.skip(f"synthetic serving-layer benchmark not runnable: {reason}")
    out = subprocess.run([sys.executable, "-m", "ringstream.daemon.cli", "serve", "--help"], capture_output=True, text=True).stdout
    assert "--synthetic-step-ms" in out


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(bench.PlotUnavailable, match="matplotlib"):
        bench.plot(tmp_path / "x.png", {"daemon": [record(0.0, [0.1])]})
    code = bench.main(["run", "--socket", "ipc:///nonexistent", "--requests", "1", "--plot", str(tmp_path / "x.png")])
    assert code == 2


def test_run_rejects_a_bad_distribution(capsys):
    assert bench.main(["run", "--socket", "ipc:///nonexistent", "--prompt-len", "uniform:9"]) == 2
    assert "uniform" in capsys.readouterr().err


# ------------------------------------------------------------------ end to end


@pytest.mark.e2e
@pytest.mark.timeout(SMOKE_TIMEOUT_S)
def test_compare_smoke_produces_every_key(tmp_path, capsys):
    """The compare code path on tiny settings: every part runs and every JSON key is there."""
    out = tmp_path / "bench.json"
    code = bench.main(["compare", "--smoke", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["errors"] == {}, report["errors"]
    assert code == 0
    synthetic_reason = synthetic_engine_support()
    for key in bench.REQUIRED_KEYS:
        assert key in report, key
        if synthetic_reason is not None and key.startswith("synthetic"):
            assert report[key] is None
            continue
        assert report[key] is not None, key
    for key in ("ceiling_tok_s", "engine_tok_s", "daemon_tok_s", "naive_tok_s", "seed_tok_s", "hf_cb_tok_s",
                "zmq_msg_s"):
        assert report[key] > 0, key
    assert report["daemon_order_violations"] == 0
    if synthetic_reason is None:
        assert report["synthetic_order_violations"] == 0 and report["synthetic_content_errors"] == 0
        assert report["synthetic_req_s"] > 0
    else:
        assert report["systems"]["synthetic"]["skipped"] == synthetic_reason
    assert report["ratio_daemon_over_engine"] == pytest.approx(report["daemon_tok_s"] / report["engine_tok_s"])
    assert report["command"] == f"ringstream-bench compare --smoke --json {out}"
    for key in ("cpu_model", "logical_cores", "torch_version"):
        assert report["machine"][key]
    assert report["settings"]["torch_threads"] >= 1
    printed = capsys.readouterr().out
    assert "daemon / engine" in printed and "zmq" in printed


@pytest.mark.e2e
@pytest.mark.timeout(SMOKE_TIMEOUT_S)
def test_compare_serves_a_model_config_everywhere_with_the_roofline(tmp_path, capsys):
    """A shrunk published shape reaches every system (the daemon too: no request is refused) and the roofline row."""
    out = tmp_path / "bench.json"
    code = bench.main(["compare", "--smoke", "--model-config", "llama-3.2-1b", "--layers", "1", "--hidden", "256",
                       "--max-model-len", "128", "--capacity-tokens", "64", "--threads", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["errors"] == {}, report["errors"]
    assert code == 0
    daemon = report["systems"]["daemon"]["summary"]
    assert daemon["errors"] == {} and daemon["completed"] == daemon["requests"] > 0
    assert report["daemon_tok_s"] > 0 and report["engine_tok_s"] > 0 and report["hf_cb_tok_s"] > 0
    roofline = report["systems"]["roofline"]
    # 1 layer at hidden 256 over Llama 3's 128,256-token tied embedding, float32
    assert roofline["weight_bytes"] > 128256 * 256 * 4
    assert roofline["bytes"] == roofline["weight_bytes"] + roofline["kv_bytes"] > 0
    assert roofline["tok_s"] == pytest.approx(4 / (roofline["bytes"] / (roofline["bandwidth_gb_s"] * 1e9)))
    assert report["ratio_engine_over_roofline"] == pytest.approx(report["engine_tok_s"] / report["roofline_tok_s"])
    capacity = report["systems"]["kv_capacity"]
    assert capacity["max_model_len"] == 128 and capacity["sequence_tokens"] == 64
    assert capacity["sequences"] == capacity["kv_cache_tokens"] // 64 >= 1
    assert report["settings"]["model_config"] == "llama-3.2-1b" and report["settings"]["device"] == "cpu"
    assert "roofline" in capsys.readouterr().out


def test_layers_without_a_model_config_is_an_error(capsys):
    assert bench.main(["compare", "--smoke", "--layers", "2"]) == 2
    assert "--model-config" in capsys.readouterr().err


def test_each_part_appends_its_json_line_as_it_ends(tmp_path):
    parts = tmp_path / "parts.jsonl"
    report = bench._Report(parts_path=str(parts))
    bench._guard(report, "engine", lambda: report.systems.update(engine={"tok_s": 12.5}))
    assert json.loads(parts.read_text())["result"] == {"tok_s": 12.5}  # written before the next part starts

    def fails():
        raise RuntimeError("out of memory")

    bench._guard(report, "daemon", fails)
    lines = [json.loads(line) for line in parts.read_text().splitlines()]
    assert [line["part"] for line in lines] == ["engine", "daemon"]
    assert lines[0]["error"] is None and lines[1]["result"] is None
    assert lines[1]["error"] == "RuntimeError: out of memory" and lines[1]["seconds"] >= 0
