"""tools/gpu_check.sh: valid bash, and its dry run lists every step within the 8-minute budget, running nothing."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu_check.sh"
BUDGET_S = 8 * 60
STEPS = ["install", "env", "cuda-tests", "compare-llama-3.2-1b", "write-llama-3.1-8b", "compare-llama-3.1-8b-b64",
         "compare-llama-3.1-8b-b256"]


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_dry_run_prints_every_step_within_the_budget(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--out", str(out), "--wheels", "wheels-dir"],
                         capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert [re.match(r"\[(.+?)\]", line).group(1) for line in lines] == STEPS
    assert sum(int(re.search(r"timeout (\d+)s", line).group(1)) for line in lines) <= BUDGET_S
    assert "--no-index --no-deps" in lines[0] and "wheels-dir/*.whl" in lines[0]
    assert "pytest -m cuda" in lines[2] and "-W ignore::pytest.PytestConfigWarning" in lines[2]
    text = run.stdout
    assert "--model-config llama-3.2-1b --concurrency 64 --prompt-len 512" in text
    assert "--concurrency 256" in text and "--max-model-len 32768 --capacity-tokens 2048" in text
    assert all("--device cuda:0" in line and ".parts.jsonl" in line for line in lines if "bench compare" in line)
    assert not out.exists()  # nothing ran


def test_unknown_argument_is_refused():
    run = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, timeout=30)
    assert run.returncode == 2 and "unknown argument" in run.stderr
