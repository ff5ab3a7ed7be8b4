"""What only the GPU compiler sees, checked without a GPU: genoctx's Triton kernels compile for sm_90 (H100/H200).

``compile_worker.py`` (its own process, ``TRITON_INTERPRET=0``) calls each kernel entry point on ``meta`` tensors at
small shapes, records the launches and compiles the first autotune configuration of each through the path of
``bench/kernel_compile.py`` (``kernels.aot``). A kernel edit that the interpreter accepts but the compiler refuses
(``tl.dot`` shapes or dtypes, an op the backend lacks) fails here; so does one that no longer fits (shared memory,
registers, spills). The real shapes and sm_100 are the bench's (README "Kernels on H100/H200 and B200").

Offsets: every ``tt.addptr`` in each kernel's Triton IR adds an int64 offset. The small shapes pass int32 sizes and
strides, so the IR is int64 only where the kernel widens its indices itself, which is what keeps 1M queries x 64
heads x 512 latent channels (2^35 elements) addressable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("compile_worker.py")
KERNELS = {"_indexer_topk_kernel": 2, "_fwd_kernel": 1, "_bwd_kernel": 2, "_bwd_dkv_kernel": 1}


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    out = subprocess.run([sys.executable, str(WORKER)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_every_kernel_compiles_and_fits_on_sm90(compiled):
    """Each launch (indexer top-k with fp32 and bf16 keys, sparse MLA forward, atomic and deterministic backward,
    deterministic dKV) compiles to a cubin whose shared memory, registers and spills fit an H100."""
    names = [r["kernel"] for r in compiled]
    assert {n: names.count(n) for n in KERNELS} == KERNELS
    for r in compiled:
        assert r["compiled"], f"{r['kernel']}: {r['error']}"
        assert r["fits"], r
        assert 0 < r["registers"] <= 255 and r["spill_stores"] == 0 and r["shared_bytes"] <= 227 * 1024


def test_every_pointer_offset_is_int64(compiled):
    """No kernel adds a 32-bit offset to a pointer: at 1M tokens offsets pass 2^31 elements."""
    for r in compiled:
        assert r["addptr"] > 0 and len(r["offsets"]) == r["addptr"], r  # every tt.addptr was read
        assert set(r["offsets"]) == {"i64"}, f"{r['kernel']}: {r['offsets']}"
