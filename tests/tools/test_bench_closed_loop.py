"""``python -m ringstream.tools.bench_closed_loop``: the closed loop's counts and figures on a tiny model (no timing
asserted), and its refusals."""

from __future__ import annotations

import json

import pytest

from ringstream.tools import bench_closed_loop
from ringstream.tools.bench_vllm import ModelShape, build_model_dir

TINY = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, max_positions=256)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_model_dir(TINY, tmp_path_factory.mktemp("closed-loop"))


def test_every_request_gets_its_tokens_and_the_figures_add_up(tiny_model, tmp_path, capsys):
    out = tmp_path / "loop.json"
    assert bench_closed_loop.main(["--model", str(tiny_model), "--workloads", "long=40:6,short=3:9",
                                   "--num-prompts", "7", "--concurrency", "3", "--threads", "1",
                                   "--setting", "max_step_ms=0", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["settings"] == {"max_step_ms": 0} and report["concurrency"] == 3
    for name, output_len in (("long", 6), ("short", 9)):
        result = report["workloads"][name]
        assert result["requests"] == 7 and result["output_tokens"] == 7 * output_len  # EOS ignored
        assert result["tok_s"] == pytest.approx(result["output_tokens"] / result["duration_s"])
        assert result["ttft_p50_ms"] > 0 and result["tpot_p50_ms"] > 0
        # three in flight: the first step takes the first prompts; 7 requests of n tokens need >= 7 n / 3 steps
        assert result["prompt_steps"] >= 1 and result["decode_only_steps"] >= 1
        assert result["prompt_steps"] + result["decode_only_steps"] >= 7 * output_len / 3
    printed = capsys.readouterr().out
    assert "long 40/6: " in printed and "short 3/9: " in printed and "decode-only steps" in printed


@pytest.mark.parametrize("argv", [
    ["--workloads", "nonsense"],
    ["--workloads", "x=0:4"],
    ["--num-prompts", "0"],
    ["--setting", "no_such_setting=1"],
    ["--setting", "max_step_ms=-5"],
])
def test_bad_arguments_are_refused_before_any_work(tiny_model, argv):
    with pytest.raises(SystemExit) as exc:
        bench_closed_loop.main(["--model", str(tiny_model), "--threads", "1", *argv])
    assert exc.value.code == 2
