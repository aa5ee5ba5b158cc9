"""``python -m ringstream.tools.bench_linears``: shapes, figures and errors (tiny weights: no timing asserted)."""

from __future__ import annotations

import json

import pytest

from ringstream.tools import bench_linears


def test_layer_shapes_are_the_engines_packed_groups():
    # 12 query / 4 KV heads of 64: q / k / v is 768 + 2 x 256 columns; gate / up is two intermediates
    assert bench_linears.layer_shapes(768, 2048, 12, 4) == [(1280, 768), (768, 768), (4096, 768), (768, 2048)]
    assert bench_linears.layer_shapes(64, 128, 4, 4) == [(192, 64), (64, 64), (256, 64), (64, 128)]


def test_the_command_prints_and_writes_each_row_count(tmp_path, capsys):
    out = tmp_path / "linears.json"
    assert bench_linears.main(["--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
                               "--layers", "2", "--rows", "1,5", "--repeats", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    weights = 2 * sum(n * k for n, k in bench_linears.layer_shapes(64, 128, 4, 2))
    assert result["weight_bytes"] == weights * 4 and result["plain_read_gb_s"] > 0
    assert [entry["rows"] for entry in result["rows"]] == [1, 5]
    for entry in result["rows"]:
        for name in ("packed", "torch"):
            figures = entry[name]
            assert figures["ms"] > 0
            # GFLOPS and GB/s are the same time read two ways: 2 x rows FLOPs per 4-byte weight
            assert figures["gflops"] == pytest.approx(figures["weights_gb_s"] * 2 * entry["rows"] / 4)
    printed = capsys.readouterr().out
    assert "plain read" in printed and "    1 rows: packed" in printed and "    5 rows: packed" in printed


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        bench_linears.main(["--rows", "16,x"])
    with pytest.raises(SystemExit):
        bench_linears.main(["--rows", "0", "--layers", "1", "--hidden", "64", "--intermediate", "64",
                            "--heads", "4", "--kv-heads", "4"])
    with pytest.raises(ValueError):
        bench_linears.measure([], 1, [16], bench_linears.torch.float32, 1)
