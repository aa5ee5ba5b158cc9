"""The engine's native CPU kernels (``csrc/``), built on first use with the host's compiler and cached.

:func:`native_ops` builds ``csrc/paged_attention.cpp`` as a torch extension (``torch.utils.cpp_extension.load``,
ninja and a C++ compiler), keeps the library under :func:`cache_dir` keyed by a hash of its sources, flags and
torch version, and loads it from there on later starts, so only the first start of a host pays the build, about half a minute on 2 cores) and returns ``torch.ops.ringstream``.
Where it cannot be built (no compiler, no ninja), it logs why once and returns None: the engine then takes its
pure-torch attention (float32 results equal to about 1e-6; the setting ``native_kernels = false`` chooses it).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

__all__ = ["cache_dir", "native_ops"]

log = logging.getLogger("ringstream.engine")

SOURCES = [Path(__file__).parent / "csrc" / "paged_attention.cpp"]


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
    name = f"ringstream_kernels_{capability.lower()}"
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES) + " ".join(flags).encode()
                            + torch.__version__.encode()).hexdigest()[:16]
    kept = cache_dir() / f"{name}-{digest}.so"
    try:
        if not kept.is_file():
            from torch.utils import cpp_extension

            cpp_extension.load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=flags,
                               is_python_module=False, verbose=False)
            built = Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so"
            kept.parent.mkdir(parents=True, exist_ok=True)
            partial = kept.with_suffix(f".{os.getpid()}.tmp")
            shutil.copyfile(built, partial)
            os.replace(partial, kept)  # atomic: a concurrent worker sees the whole file or none
        else:
            torch.ops.load_library(str(kept))
    except Exception as exc:  # no compiler, no ninja, a failed build: serve without the kernels
        log.warning("native CPU kernels unavailable, using the pure-torch attention: %s", str(exc).splitlines()[0])
        return None
    return torch.ops.ringstream
