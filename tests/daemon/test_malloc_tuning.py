"""The CPU worker's malloc settings: a large freed block stays in the heap for the next step, unless the
environment tunes malloc itself."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from ringstream.daemon.worker.malloc_tuning import retain_freed_memory

pytestmark = pytest.mark.e2e  # each probe is a child process

GLIBC = platform.libc_ver()[0] == "glibc"

# In a child, so this process's allocator keeps its settings: malloc 40 MiB (above glibc's largest adaptive mmap
# threshold, 32 MiB) and report whether it came from a mapping of its own (mallinfo2's hblkhd, glibc >= 2.33).
PROBE = """
import ctypes, sys
from ringstream.daemon.worker.malloc_tuning import retain_freed_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
tuned = retain_freed_memory() if sys.argv[1] == "tune" else None
block = libc.malloc(40 << 20)
mapped = libc.mallinfo2().hblkhd >= 40 << 20
libc.free(block)
print(tuned, mapped, libc.mallinfo2().arena >= 40 << 20)
"""


def probe(mode: str, **env: str) -> list[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env={**environ, **env}, capture_output=True,
                         text=True, timeout=60, check=True)
    return out.stdout.split()


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_a_large_freed_block_stays_in_the_heap_once_tuned():
    assert probe("plain") == ["None", "True", "False"]  # glibc's default: its own mapping, unmapped when freed
    assert probe("tune") == ["True", "False", "True"]  # from the heap, and the heap keeps it after the free


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_the_environment_s_own_malloc_settings_win():
    assert probe("tune", MALLOC_MMAP_THRESHOLD_="131072") == ["False", "True", "False"]
    assert retain_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}) is False
    assert retain_freed_memory({"MALLOC_TRIM_THRESHOLD_": "1"}) is False
