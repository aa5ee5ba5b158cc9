"""The engine's native CPU kernels (``csrc/``), built on first use with the host's compiler and cached.

:func:`native_ops` builds ``csrc/paged_attention.cpp`` (paged decode attention), ``csrc/gemm.cpp`` (float32
linear layers over panel-packed weights) and ``csrc/elementwise.cpp`` (RMSNorm, SiLU-and-mul) as one torch
extension (``torch.utils.cpp_extension.load``,
ninja and a C++ compiler), keeps the library under :func:`cache_dir` keyed by a hash of its sources, flags and
torch version, and loads it from there on later starts, so only the first start of a host pays the build, about half a minute on 2 cores) and returns ``torch.ops.ringstream``.
Where it cannot be built (no compiler, no ninja), it logs why once and returns None: the engine then takes its
pure-torch attention and oneDNN's linear layers (float32 results equal to about 1e-6; the setting
``native_kernels = false`` chooses them).

The kernels split their work with ``at::parallel_for``, which runs on torch's OpenMP threads only when the
extension is compiled with ``-fopenmp`` (without it, ATen's header runs the loop on the calling thread); where
the compiler has no OpenMP, they are built without it and run on one thread.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
from pathlib import Path

import torch

__all__ = ["cache_dir", "native_ops"]

log = logging.getLogger("ringstream.engine")

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "paged_attention.cpp", CSRC / "paged_prefill.cpp", CSRC / "gemm.cpp", CSRC / "elementwise.cpp",
           CSRC / "rope_store.cpp"]
HEADERS = [CSRC / "exp_avx2.h", CSRC / "exp_poly.h", CSRC / "cpu_features.h", CSRC / "pool_checks.h", CSRC / "vec512.h"]
OPENMP_FLAGS = ("-fopenmp",)


def cache_dir() -> Path:
    """Where built kernels are kept: ``$XDG_CACHE_HOME/ringstream/kernels`` (``~/.cache/ringstream/kernels``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ringstream" / "kernels"


@functools.cache
def native_ops():
    """``torch.ops.ringstream`` with the native CPU kernels loaded, or None where they cannot be built.

    A library built before from the same sources, flags and torch version is loaded directly (milliseconds, no
    compiler run); otherwise it is built (``torch.utils.cpp_extension.load``) and kept in :func:`cache_dir`.
    """
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", ...
    flags = ["-O3", "-std=c++17"]
    if capability in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma", "-mf16c"]
    try:
        try:
            _load(capability, flags + list(OPENMP_FLAGS), list(OPENMP_FLAGS))
        except Exception as exc:
            message = str(exc).lower()
            if not any(word in message for word in ("openmp", "fopenmp", "omp.h", "gomp")):
                raise  # not OpenMP's fault: a second build would fail the same way
            log.warning("native CPU kernels built without OpenMP (one thread): %s", build_error(exc))
            _load(capability, flags, [])
    except Exception as exc:  # no compiler, no ninja, a failed build: serve without the kernels
        log.warning("native CPU kernels unavailable, serving with PyTorch's attention and oneDNN's linears: %s",
                    build_error(exc))
        return None
    return torch.ops.ringstream


def build_error(exc: Exception, most: int = 6) -> str:
    """What a failed build says that matters: the compiler's ``error:`` lines (at most ``most``), else the last
    line of the message (``cpp_extension`` puts the command line first, the compiler's words after it)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"\berror:", line, re.IGNORECASE)]
    return " | ".join(errors[:most]) if errors else (lines[-1] if lines else type(exc).__name__)


def _registered() -> bool:
    """Whether this process has the kernels' operators registered already (a library loaded before)."""
    try:
        torch.ops.ringstream.paged_decode
    except (AttributeError, RuntimeError):
        return False
    return True


def _load(capability: str, cflags: list[str], ldflags: list[str]) -> None:
    """Load the kept library for these sources and flags, or build and keep it (raises what the build raises)."""
    name = f"ringstream_kernels_{capability.lower()}{'_omp' if ldflags else ''}"
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES + HEADERS) + " ".join(cflags + ldflags).encode()
                            + torch.__version__.encode()).hexdigest()[:16]
    kept = cache_dir() / f"{name}-{digest}.so"
    if kept.is_file():
        if not _registered():  # a second library registering the same operators aborts the process
            torch.ops.load_library(str(kept))
        return
    from torch.utils import cpp_extension

    # copies: load() appends torch's own flags to the lists it is given
    cpp_extension.load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=list(cflags),
                       extra_ldflags=list(ldflags), is_python_module=False, verbose=False)
    built = Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so"
    kept.parent.mkdir(parents=True, exist_ok=True)
    partial = kept.with_suffix(f".{os.getpid()}.tmp")
    shutil.copyfile(built, partial)
    os.replace(partial, kept)  # atomic: a concurrent worker sees the whole file or none
