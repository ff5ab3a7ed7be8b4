"""Compile genoctx's Triton kernels for sm_90 at small shapes, without a GPU (run by test_compile_targets.py).

Runs in its own process with ``TRITON_INTERPRET=0`` (the test session imports the kernels under the interpreter).
Calls each kernel launcher on ``meta`` tensors (``kernels.aot.dsa_launches``, as the bench does at the real shapes),
records its launches and compiles the first autotune configuration of each for sm_90
(``kernels.aot.compile_one``: the path of ``bench/kernel_compile.py``). Prints one JSON line per launch: name,
compile row, and the integer type of every pointer offset in the kernel's Triton IR.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.aot import addptr_offset_types, compile_one, dsa_launches  # noqa: E402


def launches() -> list:
    """The launches of one DSA layer's training step at small shapes; d_I = 48 runs the fp32 indexer's channel
    chunks."""
    shapes = dict(heads=4, latent=32, index_heads=4, index_dim=48, kpool=4, topk_pools=4)
    return [launch for _op, _dtypes, launch in dsa_launches(64, **shapes)]


def main() -> None:
    for launch in launches():
        row, kernel = compile_one(launch, "sm_90", launch.config_kwargs()[0])
        offsets = addptr_offset_types(kernel.asm["ttir"]) if kernel is not None else []
        n_addptr = kernel.asm["ttir"].count("tt.addptr") if kernel is not None else 0
        print(json.dumps({"kernel": launch.name, **row, "offsets": offsets, "addptr": n_addptr}))


if __name__ == "__main__":
    main()
