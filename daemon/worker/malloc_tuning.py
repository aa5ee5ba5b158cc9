"""glibc's malloc settings of a CPU worker: a step's large activations reused from the heap, not mapped anew; the
heap's free pages given back when the worker goes idle.

A step allocates its activations and frees them at its end; the next step allocates them again. glibc serves an
allocation above ``M_MMAP_THRESHOLD`` with a fresh ``mmap`` and gives it back with ``munmap`` when it is freed, so
the next step faults every page of it in again (and the kernel zeroes each one). The threshold adapts upward to
the largest block freed, but never past 32 MiB on 64-bit hosts (``DEFAULT_MMAP_THRESHOLD_MAX``, mallopt(3)): a
step of 2,048 prompt tokens of a Llama with intermediate size 2,048 makes a 32 MiB gate / up output in float32,
and every such step paid those faults. A fixed threshold of :data:`MMAP_THRESHOLD` keeps such blocks in the heap
and a trim threshold of :data:`TRIM_THRESHOLD` keeps the heap's freed top, so a step reuses the pages of the
last. vLLM's CPU backend gets the same from tcmalloc (its docs preload it).

Measured on a 2-core AMD EPYC, float32, the 82M-parameter Llama of ``ringstream-bench vllm``, eight 256-token
prompts in one step with the worker's transparent huge pages on: 805-875 ms before, 749-754 ms after (the same
tokens one prompt a step: 92-94 ms each, 0.36 ms a token, before and after).

The cost: the worker's blocks below 256 MiB (its packed weights, each layer's keys or values of the KV pool,
every activation) now live in the heap, and a burst leaves the heap at its high-water mark, fragments included
(+130 MiB resident after bursts of 1,900-token prompts at the default step budget for that model, +390 MiB with
8,192-token steps). :func:`release_free_memory` (``malloc_trim``) hands the free pages back; the worker calls it
when it goes idle (a few milliseconds), so an idle worker is back near where it started.

Nothing is changed where the environment tunes malloc (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, or
``glibc.malloc.*`` in ``GLIBC_TUNABLES``), where an allocator is preloaded in glibc's place (``LD_PRELOAD`` naming
jemalloc, tcmalloc or mimalloc, which ignore these settings), or where the C library is not glibc. glibc 2.26-2.34
refuse an mmap threshold above 32 MiB: there the trim threshold is set alone (the release when idle still
applies) and the log says so.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "release_free_memory", "retain_freed_memory"]

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""``mallopt`` parameter numbers (glibc's ``malloc.h``)."""
MMAP_THRESHOLD = 256 << 20
"""Blocks up to this many bytes come from the heap (bytes): above any one activation of the models a CPU worker
serves at its default step budget."""
TRIM_THRESHOLD = 512 << 20
"""Freed bytes at the heap's top that the process keeps for reuse between steps (bytes)."""
ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
"""Variables by which a deployment tunes glibc's malloc itself: where one is set (or ``GLIBC_TUNABLES`` names a
``glibc.malloc.`` tunable), it wins."""
PRELOADED_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
"""Allocators that, preloaded, serve malloc in glibc's place and ignore its settings."""


@functools.cache
def _glibc():
    """glibc's handle, or None where the C library is not glibc (``os.confstr`` answers only under glibc)."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        return ctypes.CDLL("libc.so.6")  # glibc's soname on Linux (ctypes.util.find_library would run ldconfig)
    except (OSError, ValueError, AttributeError):
        return None


def retain_freed_memory(environ: os._Environ | dict[str, str] = os.environ) -> bool:
    """Set glibc's mmap and trim thresholds (:data:`MMAP_THRESHOLD`, :data:`TRIM_THRESHOLD`) for this process and
    log (info) what was set or why nothing was.

    Call it once, before the weights load. Returns True when at least one threshold was set (then
    :func:`release_free_memory` is worth calling when idle); False where the environment tunes malloc, another
    allocator is preloaded or the C library is not glibc. Never raises.
    """
    tuned = [name for name in ENVIRONMENT if environ.get(name)]
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        tuned.append("GLIBC_TUNABLES")
    preload = [name for name in PRELOADED_ALLOCATORS if name in environ.get("LD_PRELOAD", "")]
    libc = None if tuned or preload else _glibc()
    if libc is None:
        why = (f"{', '.join(tuned)} set" if tuned else f"{preload[0]} preloaded" if preload
               else "the C library is not glibc")
        log.info("malloc left as it is (%s)", why)
        return False
    try:
        mmap_set = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        trim_set = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    except (OSError, AttributeError) as exc:
        log.info("malloc left as it is (%s)", exc)
        return False
    log.info("malloc: %s; free heap pages given back when idle",
             f"blocks up to {MMAP_THRESHOLD >> 20} MiB from the heap, {TRIM_THRESHOLD >> 20} MiB of its top kept"
             if mmap_set and trim_set else
             f"{TRIM_THRESHOLD >> 20} MiB of the heap's top kept (this glibc refuses an mmap threshold above 32 MiB)"
             if trim_set else "glibc refused both thresholds")
    return mmap_set or trim_set


def release_free_memory() -> bool:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim(0)``; a few milliseconds for hundreds
    of MiB). Returns whether any memory was released; False where the C library is not glibc. Never raises."""
    libc = _glibc()
    try:
        return libc is not None and libc.malloc_trim(0) == 1
    except (OSError, AttributeError):
        return False
