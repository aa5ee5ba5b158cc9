"""glibc's malloc settings of a CPU worker: a step's large activations reused from the heap, not mapped anew.

A step allocates its activations and frees them at its end; the next step allocates them again. glibc serves an
allocation above ``M_MMAP_THRESHOLD`` with a fresh ``mmap`` and gives it back with ``munmap`` when it is freed, so
the next step faults every page of it in again (and the kernel zeroes each one). The threshold adapts upward to
the largest block freed, but never past 32 MiB on 64-bit hosts (``DEFAULT_MMAP_THRESHOLD_MAX``, mallopt(3)): a
step of 2,048 prompt tokens of a Llama with intermediate size 2,048 makes a 32 MiB gate / up output in float32,
and every such step paid those faults. Fixed thresholds keep blocks up to :data:`MMAP_THRESHOLD` in the heap and
the heap's freed top up to :data:`TRIM_THRESHOLD` in the process, so a step reuses the pages of the last.
vLLM's CPU backend gets the same from tcmalloc (its docs preload it).

Measured on a 2-core AMD EPYC, float32, the 82M-parameter Llama of ``ringstream-bench vllm``, eight 256-token
prompts in one step with the worker's transparent huge pages on: 805-875 ms before, 749-754 ms after (the same
tokens one prompt a step: 92-94 ms each, 0.36 ms a token, before and after).

The cost: up to :data:`TRIM_THRESHOLD` bytes freed by a burst of large steps stay resident until reused (the KV
pool and the weights, allocated once, are not affected). Where the environment already tunes malloc
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or ``GLIBC_TUNABLES``), or the C library is not glibc
(musl, or an allocator preloaded in its place that ignores ``mallopt``), nothing is changed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "retain_freed_memory"]

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""``mallopt`` parameter numbers (glibc's ``malloc.h``)."""
MMAP_THRESHOLD = 256 << 20
"""Blocks up to this many bytes come from the heap (bytes): above any one activation of the models a CPU worker
serves at its default step budget; the KV pool, larger, stays a mapping of its own."""
TRIM_THRESHOLD = 512 << 20
"""Freed bytes at the heap's top that the process keeps for reuse (bytes)."""
ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
"""Variables by which a deployment tunes glibc's malloc itself: where one is set, it wins."""


def retain_freed_memory(environ: os._Environ | dict[str, str] = os.environ) -> bool:
    """Set glibc's mmap and trim thresholds (:data:`MMAP_THRESHOLD`, :data:`TRIM_THRESHOLD`) for this process.

    Call it once, before the weights load. Returns True when both were set; False (and logs why at debug) where
    the environment tunes malloc already, the C library is not glibc or ``mallopt`` refused a value. Never raises.
    """
    tuned = [name for name in ENVIRONMENT if environ.get(name)]
    if tuned:
        log.debug("malloc left as %s sets it", ", ".join(tuned))
        return False
    if platform.libc_ver()[0] != "glibc":
        log.debug("malloc left as it is: the C library is not glibc")
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")  # glibc's soname on Linux (find_library would run ldconfig)
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD,
                                                                                 TRIM_THRESHOLD) == 1
    except (OSError, AttributeError) as exc:
        log.debug("malloc left as it is: %s", exc)
        return False
    if not ok:
        log.debug("malloc left as it is: mallopt refused the thresholds")
    return ok
