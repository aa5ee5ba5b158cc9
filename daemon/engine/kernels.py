"""The engine's native CPU kernels (``csrc/``), built on first use with the host's compiler and cached.

:func:`native_ops` builds ``csrc/paged_attention.cpp`` as a torch extension (``torch.utils.cpp_extension.load``,
ninja and a C++ compiler; cached under ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``, so only
the first start of a host pays the build, about half a minute on 2 cores) and returns ``torch.ops.ringstream``.
Where it cannot be built (no compiler, no ninja), it logs why once and returns None: the engine then takes its
pure-torch attention (float32 results equal to about 1e-6; the setting ``native_kernels = false`` chooses it).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

__all__ = ["native_ops"]

log = logging.getLogger("ringstream.engine")

SOURCES = [Path(__file__).parent / "csrc" / "paged_attention.cpp"]


@functools.cache
def native_ops():
    """``torch.ops.ringstream`` with the native CPU kernels loaded, or None where they cannot be built."""
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", ...
    flags = ["-O3", "-std=c++17"]
    if capability in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma", "-mf16c"]
    name = f"ringstream_kernels_{capability.lower()}"
    try:
        cpp_extension.load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=flags,
                           is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, no ninja, a failed build: serve without the kernels
        log.warning("native CPU kernels unavailable, using the pure-torch attention: %s", str(exc).splitlines()[0])
        return None
    return torch.ops.ringstream
