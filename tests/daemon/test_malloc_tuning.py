"""The CPU worker's malloc settings: a large freed block stays in the heap for the next step and goes back to the
system on release, unless the environment tunes malloc or preloads another allocator."""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys

import pytest

from ringstream.daemon.worker import malloc_tuning
from ringstream.daemon.worker.malloc_tuning import release_free_memory, retain_freed_memory

pytestmark = pytest.mark.e2e  # each probe is a child process


def _glibc_takes_a_256_mib_threshold() -> bool:
    """glibc >= 2.35 with mallinfo2 (2.33): older ones refuse an mmap threshold above 32 MiB."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION") or ""
        ctypes.CDLL("libc.so.6").mallinfo2  # noqa: B018 (raises AttributeError where missing)
    except (OSError, ValueError, AttributeError):
        return False
    major, _, minor = version.removeprefix("glibc ").partition(".")
    return version.startswith("glibc ") and (int(major), int(minor.split(".")[0])) >= (2, 35)


GLIBC_235 = _glibc_takes_a_256_mib_threshold()

# In a child, so this process's allocator keeps its settings: malloc 40 MiB (above glibc's largest adaptive mmap
# threshold, 32 MiB) and report whether it came from a mapping of its own (mallinfo2's hblkhd) and whether the heap
# kept it once freed; then with a small block allocated above it (the heap's top cannot shrink past it), whether
# release_free_memory gives its touched pages back (resident set, /proc/self/statm).
PROBE = """
import ctypes, sys
from ringstream.daemon.worker.malloc_tuning import release_free_memory, retain_freed_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
tuned = retain_freed_memory() if sys.argv[1] == "tune" else None
block = libc.malloc(40 << 20)
mapped = libc.mallinfo2().hblkhd >= 40 << 20
ctypes.memset(block, 1, 40 << 20)
above = libc.malloc(1024)
libc.free(block)
kept = libc.mallinfo2().arena >= 40 << 20
before = rss()
release_free_memory()
print(tuned, mapped, kept, before - rss() >= 30 << 20)
"""


def probe(mode: str, **env: str) -> list[str]:
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env={**environ, **env}, capture_output=True,
                         text=True, timeout=60, check=True)
    return out.stdout.split()


@pytest.mark.skipif(not GLIBC_235, reason="glibc >= 2.35: older ones refuse the 256 MiB threshold")
def test_a_large_freed_block_stays_in_the_heap_once_tuned_and_goes_back_on_release():
    # glibc's default: its own mapping, unmapped when freed (nothing left to release)
    assert probe("plain") == ["None", "True", "False", "False"]
    # tuned: from the heap, kept there after the free, its pages given back by the release
    assert probe("tune") == ["True", "False", "True", "True"]


@pytest.mark.skipif(not GLIBC_235, reason="glibc >= 2.35: older ones refuse the 256 MiB threshold")
def test_the_environment_s_own_malloc_settings_win():
    assert probe("tune", MALLOC_MMAP_THRESHOLD_="131072") == ["False", "True", "False", "False"]
    assert retain_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}) is False
    assert retain_freed_memory({"MALLOC_TRIM_THRESHOLD_": "1"}) is False
    assert retain_freed_memory({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}) is False


def test_an_unrelated_tunable_does_not_turn_it_off_and_a_missing_glibc_never_raises(monkeypatch, caplog):
    calls = []

    class FakeLibc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

        def malloc_trim(self, pad):
            return 1

    monkeypatch.setattr(malloc_tuning, "_glibc", lambda: FakeLibc())
    with caplog.at_level(logging.INFO, logger=malloc_tuning.__name__):
        assert retain_freed_memory({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}) is True
    assert calls == [(malloc_tuning.M_MMAP_THRESHOLD, malloc_tuning.MMAP_THRESHOLD),
                     (malloc_tuning.M_TRIM_THRESHOLD, malloc_tuning.TRIM_THRESHOLD)]
    assert "blocks up to 256 MiB from the heap" in caplog.text
    assert release_free_memory() is True

    class OldGlibc(FakeLibc):  # 2.26-2.34: an mmap threshold above 32 MiB refused, the trim threshold taken
        def mallopt(self, param, value):
            return 0 if param == malloc_tuning.M_MMAP_THRESHOLD else 1

    monkeypatch.setattr(malloc_tuning, "_glibc", lambda: OldGlibc())
    with caplog.at_level(logging.INFO, logger=malloc_tuning.__name__):
        assert retain_freed_memory({}) is True
    assert "refuses an mmap threshold above 32 MiB" in caplog.text

    monkeypatch.setattr(malloc_tuning, "_glibc", lambda: None)  # musl, or no libc.so.6
    assert retain_freed_memory({}) is False and release_free_memory() is False
