"""trainer/engine/memory.py: glibc keeps a step's freed large buffers in the heap instead of unmapping them."""

from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
import sys

import pytest

from widedp.trainer.engine import memory

FAULTS = """
import resource, sys, numpy as np
if sys.argv[1] == "keep":
    from widedp.trainer.engine.memory import keep_freed_memory
    assert keep_freed_memory()
for _ in range(3):  # warm-up: the first allocation faults in either way
    a = np.ones(48 << 20, dtype=np.uint8); del a
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):  # a step's buffer above glibc's default mmap threshold, allocated and freed
    a = np.ones(48 << 20, dtype=np.uint8); del a
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], check=True, capture_output=True, text=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not ctypes.util.find_library("c") or not hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallopt"),
                    reason="mallopt is glibc's")
def test_a_freed_large_buffer_is_reused_without_faulting_its_pages_again():
    default, keep = _faults("default"), _faults("keep")
    assert default >= 20  # each of the 20 allocations maps fresh pages (huge pages, where the kernel gives them)
    assert keep * 10 < default  # the freed block stays in the heap and is reused: measured 0 against 10,720


def test_applying_twice_is_a_no_op_that_still_answers():
    first = memory.keep_freed_memory()
    assert memory.keep_freed_memory() == first
