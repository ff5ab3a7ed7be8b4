"""Compile genoctx's Triton kernels for sm_90 at small shapes, without a GPU (run by test_compile_targets.py).

Runs in its own process with ``TRITON_INTERPRET=0`` (the test session imports the kernels under the interpreter).
Calls each public entry point as ``genoctx.model.dsa`` does, on ``meta`` tensors, records its launches
(``kernels.aot.captured_launches``) and compiles the first autotune configuration of each for sm_90
(``kernels.aot.compile_one``: the path of ``bench/kernel_compile.py``). Prints one JSON line per launch: name,
compile row, and the integer type of every pointer offset in the kernel's Triton IR.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import kernels.sparse_mla as sm  # noqa: E402
from kernels.aot import addptr_offset_types, captured_launches, compile_one  # noqa: E402
from kernels.indexer_topk import indexer_topk_launch as indexer_topk  # noqa: E402  (the op runs its fake on meta)


def launches() -> list:
    B, T, H, R, HI, DI, kp, Kp = 1, 64, 4, 32, 4, 48, 4, 4  # d_I = 48: the fp32 indexer runs channels in chunks
    meta = dict(device="meta")
    out = []
    vis = (torch.arange(T) + 1) // kp
    for kdt, qdt in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)):
        with captured_launches() as got:
            indexer_topk(torch.empty(B, T, HI, DI, dtype=qdt, **meta), torch.empty(B, T, HI, **meta),
                         torch.empty(B, T // kp, DI, dtype=kdt, **meta), vis, Kp, index_dtype=torch.int32)  # fmt: skip
        out += got
    q = torch.empty(B, T, H, R, dtype=torch.bfloat16, **meta)
    kv = torch.empty(B, T, R, dtype=torch.bfloat16, **meta)
    pools = torch.empty(B, T, Kp, dtype=torch.int32, **meta)
    pos = torch.empty(T, dtype=torch.long, **meta)
    with captured_launches() as got:
        o, lse = sm.sparse_mla_fwd(q, kv, pools, pos, kp, True, 0.125)
        sm.sparse_mla_bwd(q, kv, pools, pos, kp, True, 0.125, o, lse, torch.empty_like(o))
    out += got
    saved = sm._inverse_selection
    sm._inverse_selection = lambda *_a: (torch.empty(B * T // kp + 1, dtype=torch.long, **meta),
                                         torch.empty(T * Kp, dtype=torch.int32, **meta), T // kp)  # fmt: skip
    try:
        with captured_launches() as got:
            sm.sparse_mla_bwd(q, kv, pools, pos, kp, True, 0.125, o, lse, torch.empty_like(o), deterministic=True)
    finally:
        sm._inverse_selection = saved
    return out + got


def main() -> None:
    for launch in launches():
        row, kernel = compile_one(launch, "sm_90", launch.config_kwargs()[0])
        offsets = addptr_offset_types(kernel.asm["ttir"]) if kernel is not None else []
        n_addptr = kernel.asm["ttir"].count("tt.addptr") if kernel is not None else 0
        print(json.dumps({"kernel": launch.name, **row, "offsets": offsets, "addptr": n_addptr}))


if __name__ == "__main__":
    main()
