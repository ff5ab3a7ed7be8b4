"""The host heap kept between eager ops: glibc's malloc told not to hand freed memory back to the kernel.

Why: an eager PyTorch step on a CPU allocates and frees its activations op by op, and glibc's defaults return most
of them to the kernel: a buffer above the mmap threshold (128 KiB, raised dynamically up to 32 MiB) is its own
``mmap`` and is unmapped when freed, and the heap's free top above the trim threshold is trimmed. The next buffer
then arrives as new pages that the kernel faults in and zeroes 4 KiB at a time. ``cpu-small`` at 2k tokens: ~150k
page faults and 0.3-0.4 s of system time in a 0.8-0.9 s train step; 8k tokens: ~650k faults. With the mmap threshold
at 1 GiB and the trim threshold at 2 GiB (``keep_freed_memory``), freed buffers stay in the heap and the next step
reuses them: a handful of faults, 0.6 s and 2.3-2.9 s (2 cores; ``resource.getrusage``'s ``ru_minflt`` around a step
shows the faults). What it costs: the process keeps up to 2 GiB of freed heap mapped beyond its live tensors (its
peak is unchanged: the same buffers are live at once), and buffers of 1 GiB or more are still mapped and unmapped
each time.

Used where genoctx computes on a CPU: the CLI's ``--device cpu`` (``genoctx.cli.common._device``), the distributed
workers without a GPU, the benches and the tests. A GPU's tensors come from CUDA's caching allocator: nothing to do.
"""

from __future__ import annotations

import ctypes
import functools

# glibc <malloc.h>: mallopt's parameters (a C int value each)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 30  # buffers below it come from the heap
TRIM_THRESHOLD_BYTES = (1 << 31) - 1  # free heap top kept up to this (the largest C int)


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's mmap threshold to ``MMAP_THRESHOLD_BYTES`` and its trim threshold to ``TRIM_THRESHOLD_BYTES`` for
    this process (module docstring), once. Returns whether glibc took both (False on another C library: nothing
    changes). Call it before the run allocates its activations; later calls do nothing."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap_ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)) and mmap_ok
