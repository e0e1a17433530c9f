"""Keep freed memory in the process instead of handing it back to the kernel each step.

A step allocates and frees the same large per-example buffers every time (at b = 16,384 the
pooled rows and their gradients alone are 27 MB; the dense part's per-example gradients more).
glibc's malloc serves blocks above its mmap threshold (dynamic, at most 32 MB by default) with
fresh mmap()s and unmaps them when freed, and trims the heap's free top, so the next step
faults every page in again. Measured on the CTR model at b = 16,384 (docs/DESIGN.md §2.1):
the coordinator's dense forward/backward spent 30–350 ms of *system* time per step against a
steady 60–120 ms of user time (14–41 thousand minor faults); with both thresholds raised, 0–40
ms and 0–14 thousand. Nothing about the results changes — only where freed blocks wait.

`keep_freed_memory()` raises M_MMAP_THRESHOLD and M_TRIM_THRESHOLD to KEEP_BYTES with mallopt
(glibc only; elsewhere it does nothing). The price: a process keeps up to its peak heap, which
it reaches again the next step anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util

KEEP_BYTES = 1 << 30  # blocks up to 1 GiB from the heap; trim only a free top above 1 GiB
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
_applied = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds to KEEP_BYTES in this process, once; True if the
    allocator took both (False where the C library has no mallopt, e.g. not glibc)."""
    global _applied
    if _applied:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES))
    return _applied
