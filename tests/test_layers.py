"""The daemon's packages import one way: common -> ipc; engine, http -> common, ipc; worker -> engine; front ->
worker, http, common, ipc (never engine); ipc -> nothing of the daemon. Read from the source (every import
statement, function-level ones included), so a lazy import against the grain is caught too."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

ALLOWED = {
    "ipc": {"ipc"},
    "common": {"common", "ipc"},
    "engine": {"engine", "common", "ipc"},
    "http": {"http", "common", "ipc"},
    "worker": {"worker", "engine", "common", "ipc"},
    "front": {"front", "worker", "http", "common", "ipc"},
}
"""Layer -> the layers its modules may import (``ringstream`` itself, for ``__version__``, is open to all)."""
DAEMON_PACKAGES = ("common", "front", "worker", "engine", "http")
ENTRY_MODULES = {"__init__", "cli", "demo", "launcher"}
"""What ``daemon/`` holds besides its five packages: the entry points, which may import anything."""


def layer_of(module: str) -> str | None:
    """``ringstream.daemon.front.core`` -> ``front``; ``ringstream.ipc.ring`` -> ``ipc``; the daemon's entry
    modules -> ``entry``; ``ringstream.tools.*`` -> ``tools``; anything outside ringstream, or a name of
    ringstream's own ``__init__`` (``__version__``, the client names), -> None."""
    parts = module.split(".")
    if parts[0] != "ringstream" or len(parts) == 1:
        return None
    if parts[1] == "ipc":
        return "ipc"
    if parts[1] == "daemon":
        if len(parts) == 2:
            return "entry"
        return parts[2] if parts[2] in DAEMON_PACKAGES else "entry"
    return "tools" if parts[1] == "tools" else None


def imports(path: Path) -> list[tuple[int, str]]:
    """Every module an import statement of ``path`` names: ``(line, dotted name)``; ``from P import m`` yields
    ``P.m`` so that importing a sibling module through its package counts as importing it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom) and node.level:
            found.append((node.lineno, "." * node.level + (node.module or "")))
    return found


def modules() -> list[tuple[str, Path]]:
    """``(layer, path)`` for every module of ipc/ and the daemon's five packages."""
    out = [("ipc", p) for p in sorted((REPO_ROOT / "ipc").rglob("*.py"))]
    for package in DAEMON_PACKAGES:
        out += [(package, p) for p in sorted((REPO_ROOT / "daemon" / package).rglob("*.py"))]
    return out


def test_daemon_holds_only_its_packages_and_entry_modules():
    daemon = REPO_ROOT / "daemon"
    assert {p.stem for p in daemon.glob("*.py")} <= ENTRY_MODULES
    assert {p.name for p in daemon.iterdir() if (p / "__init__.py").is_file()} == set(DAEMON_PACKAGES)


@pytest.mark.parametrize(("layer", "path"), modules(), ids=lambda v: str(v.relative_to(REPO_ROOT)) if isinstance(v, Path) else v)
def test_imports_point_one_way(layer, path):
    wrong = []
    for line, name in imports(path):
        if name.startswith("."):
            wrong.append(f"{path.name}:{line}: relative import {name!r} (use ringstream.*)")
            continue
        target = layer_of(name)
        if target is not None and target not in ALLOWED[layer]:
            wrong.append(f"{path.name}:{line}: {layer} imports {name} ({target})")
    assert not wrong, "\n".join(wrong)


def test_layer_rule_catches_a_wrong_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from ringstream.daemon.engine import sampler\n")
    assert [name for _, name in imports(bad)] == ["ringstream.daemon.engine.sampler", "ringstream.daemon.engine"]
    assert layer_of("ringstream.daemon.engine.sampler") not in ALLOWED["front"]
    assert layer_of("ringstream.daemon.cli") == "entry" and layer_of("ringstream") is None
    assert layer_of("ringstream.tools.bench") == "tools" and layer_of("ringstream.__version__") is None


def loaded_after_importing(names: list[str], prefixes: tuple[str, ...]) -> list[str]:
    """The modules starting with one of ``prefixes`` that a fresh interpreter holds after importing ``names``."""
    code = ("import importlib, sys\n"
            f"for name in {names!r}: importlib.import_module(name)\n"
            f"print(sorted(m for m in sys.modules if m.startswith({prefixes!r})))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return ast.literal_eval(result.stdout.strip())


FRONT_AND_HTTP = [f"ringstream.daemon.{layer}.{p.stem}" for layer, p in modules()
                  if layer in ("front", "http") and p.stem != "__init__"] + ["ringstream.daemon.cli"]


@pytest.mark.e2e
def test_the_front_process_loads_no_engine_module():
    """Through the worker package too: the front builds a worker's spec and spawns it, and nothing more."""
    assert loaded_after_importing(FRONT_AND_HTTP, ("ringstream.daemon.engine",)) == []


@pytest.mark.e2e
def test_front_and_http_modules_load_neither_torch_nor_transformers():
    common = (REPO_ROOT / "daemon" / "common").glob("*.py")
    names = FRONT_AND_HTTP + ["ringstream.daemon.common." + p.stem for p in common]
    names += ["ringstream.daemon.engine.interface", "ringstream.daemon.engine.scheduler",
              "ringstream.daemon.engine.block_manager"]
    assert loaded_after_importing(names, ("torch", "transformers")) == []
