"""One import name: ringstream installs nothing but ``ringstream`` at the top of site-packages."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out), str(REPO)], check=True, capture_output=True, timeout=300,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    (found,) = out.glob("ringstream-*.whl")
    return found


def test_wheel_holds_only_the_ringstream_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"ringstream"}
    for module in ("ringstream/__init__.py", "ringstream/daemon/front/shell.py", "ringstream/ipc/client.py",
                   "ringstream/ipc/ring/walk.py", "ringstream/tools/ringtop.py",
                   "ringstream/daemon/default_model/config.json"):
        assert module in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "ringstream = ringstream.daemon.cli:main" in text


def test_a_foreign_daemon_module_changes_nothing(tmp_path):
    """python-daemon installs a top-level ``daemon`` package; it must not shadow any part of ringstream."""
    foreign = tmp_path / "site" / "daemon"
    foreign.mkdir(parents=True)
    (foreign / "__init__.py").write_text("raise ImportError('the foreign daemon package was imported')\n")
    (tmp_path / "site" / "tools").mkdir()
    (tmp_path / "site" / "tools" / "__init__.py").write_text("raise ImportError('foreign tools imported')\n")
    code = ("import ringstream, ringstream.daemon.front.shell, ringstream.daemon.cli, ringstream.tools.ringtop\n"
            "from ringstream import Client, AsyncClient, QueueFull\n"
            "print(ringstream.__version__, Client.__module__)")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [__import__("ringstream").__version__, "ringstream.ipc.client"]
    cli = subprocess.run([sys.executable, "-m", "ringstream.daemon.cli", "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0 and "serve" in cli.stdout, cli.stderr


def test_import_ringstream_loads_neither_the_client_nor_torch():
    code = "import sys, ringstream; print('zmq' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert out.stdout.split() == ["False", "False"], out.stderr
