"""Rules of the test suite: the ``e2e`` guard of ``tests/conftest.py`` (a test not marked e2e cannot start a
process), and test modules import only helper modules, never one another."""

from __future__ import annotations

import ast
import asyncio
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _refused(excinfo) -> None:
    message = str(excinfo.value)
    assert "test_suite_rules.py::" in message and "not marked e2e" in message


def test_subprocess_is_refused_outside_e2e():
    with pytest.raises(AssertionError) as excinfo:
        subprocess.run([sys.executable, "-c", ""], check=False)
    _refused(excinfo)


def test_multiprocessing_is_refused_outside_e2e():
    for method in ("spawn", "fork"):
        with pytest.raises(AssertionError) as excinfo:
            multiprocessing.get_context(method).Process(target=print).start()
        _refused(excinfo)


def test_fork_spawn_and_system_are_refused_outside_e2e():
    for start in (os.fork, lambda: os.posix_spawn(sys.executable, [sys.executable, "-c", ""], os.environ),
                  lambda: os.system("true")):
        with pytest.raises(AssertionError) as excinfo:
            start()
        _refused(excinfo)


def test_asyncio_subprocesses_are_refused_outside_e2e():
    async def main():
        await asyncio.create_subprocess_exec(sys.executable, "-c", "")

    with pytest.raises(AssertionError) as excinfo:
        asyncio.run(main())
    _refused(excinfo)


@pytest.fixture(scope="module")
def module_process():
    """A module-scoped fixture that starts a process: caught for the (unmarked) test it is set up for."""
    with pytest.raises(AssertionError) as excinfo:
        subprocess.run([sys.executable, "-c", ""], check=False)
    return excinfo


def test_a_wider_scoped_fixture_is_refused_for_a_test_outside_e2e(module_process):
    _refused(module_process)


@pytest.mark.e2e
def test_an_e2e_test_may_start_a_process():
    assert subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True,
                          timeout=60).stdout == "42\n"


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.ImportFrom):  # relative: from . import x, from .test_x import y
            names |= {f".{node.module or ''}", *(f".{alias.name}" for alias in node.names)}
    return names


def test_no_test_module_imports_another():
    """Code shared by test modules lives in helper modules (tests/daemon_helpers.py, tests/*/helpers.py...)."""
    offenders = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        imported = [name for name in _imported_modules(path) if name.rpartition(".")[2].startswith("test_")
                    and (name.startswith(("tests.", ".")))]
        if imported:
            offenders[str(path.relative_to(TESTS))] = sorted(imported)
    assert not offenders, offenders
