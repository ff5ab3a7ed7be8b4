"""Process memory readings shared by the bench scripts (CPU, Linux), in MiB.

``peak_rss_mib`` is the same measurement the training metrics report (``genoctx.train.loop.peak_memory_bytes``):
the process's peak resident set size. ``rss_now_mib`` is the current resident set, read before a measured
step so that a bench can report the step's own peak as the difference.
"""

from __future__ import annotations

import os

import torch

from genoctx.train.loop import peak_memory_bytes


def rss_now_mib() -> float:
    """Current resident set size of this process in MiB (Linux /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB."""
    return peak_memory_bytes(torch.device("cpu")) / 2**20
