"""Freed tensor memory stays in the process: glibc's malloc told to reuse blocks instead of giving them back.

torch allocates CPU tensors with the C library's ``malloc``. glibc serves a block above its mmap threshold (128
KiB at start, raised on the fly up to 32 MiB) with fresh pages from the kernel, and gives the top of its heap
back once more than its trim threshold (twice the mmap threshold) lies free there. A training step allocates
and frees the same activation-sized blocks (a 1,200 x 256 float32 activation is 1.2 MB) again and again, so
the pages go back to the kernel and every step faults them in anew: hundreds of page faults a step in a
2 x 256 MLP's forward and backward on 1,200 rows (``benchmarks/allocator_faults.py`` counts them and times it).
Fixing both thresholds (mmap above :data:`MMAP_THRESHOLD`, trim only beyond :data:`TRIM_THRESHOLD` free)
keeps those pages mapped, the effect of ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` set in the
environment, in-process. Peak memory is unchanged (the pages kept are pages the process used); between
peaks, up to :data:`TRIM_THRESHOLD` of freed heap stays resident.

Left alone: a C library other than glibc (musl, macOS: nothing to tune through ``mallopt``), a user who set
either ``MALLOC_*_`` variable, and ``SHOAL_KEEP_FREED_MEMORY=0``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

#: Blocks below this come from the heap (glibc's own ceiling for its moving threshold on 64-bit).
MMAP_THRESHOLD = 32 << 20
#: Free memory at the top of the heap kept before any is given back.
TRIM_THRESHOLD = 128 << 20

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_done: bool | None = None


def keep_freed_memory() -> bool:
    """Sets glibc's thresholds (module docstring) once per process; whether they are now set by this call or an
    earlier one. Safe to call from every entry point, in any process."""
    global _done
    if _done is None:
        _done = _tune()
    return _done


def _tune() -> bool:
    if os.environ.get("SHOAL_KEEP_FREED_MEMORY", "1") == "0" or any(v in os.environ for v in _USER_SETTINGS):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # mallopt returns 1 on success; the mmap threshold first, so the heap never serves a block above it
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
