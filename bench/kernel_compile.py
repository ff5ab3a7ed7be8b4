"""Every Triton kernel genoctx launches on CUDA, compiled for H100/H200 (sm_90) and B200 (sm_100) without a GPU.

For each target, in its own process: genoctx's kernels (indexer top-k; sparse MLA forward, backward with atomic dKV,
deterministic backward = dQ kernel + dKV kernel) and fla-core's ``chunk_kda`` (forward and backward, as
``genoctx.model.kda`` calls it with ``kda_kernel: fla``) are called at GLM-5.3-Flash's shapes (``glm-5.3-flash``
preset: 64 MLA heads, latent 512, indexer 32 x 128, pools of 16, top-2048 tokens = 128 pools; KDA 64 heads of 128)
on ``meta`` tensors of ``--tokens`` tokens, their launches recorded (``kernels.aot.captured_launches``) and every
autotune configuration compiled for the target (``kernels.aot.compile_one``). One JSON line per kernel x
configuration x target (compiled or the compiler's one-line error, shared memory, tensor memory, registers,
spills, fits), then one summary line per target: for each kernel, how many configurations fit.

fla picks its configuration lists at import from the device it sees (shared memory, Hopper or Blackwell); the
worker answers those questions as the target GPU would (``_emulate``: triton's active driver and
``torch.cuda.get_device_capability``/``get_device_name``, in this bench process only), so the lists are the ones
fla would use on that GPU. (It found that fla's kernels refuse fp32 q, k with bf16 v, what genoctx passed under
bf16 autocast until ``genoctx.model.kda.fla_core_inputs``; ``--fla-raw-dtypes`` shows that refusal.)

Dtypes are those of a bf16-autocast training step: MLA query/latent bf16; indexer queries bf16, weights fp32, pooled
keys fp32 (an fp32 LayerNorm), so the default indexer dot runs in fp32 (``dot=fp32``) and the ``dot=bf16``
variant is listed too; KDA q, k, v bf16 (``fla_core_inputs``), g, beta and the state fp32.

    .venv/bin/python bench/kernel_compile.py                        # both targets, genoctx + fla, 1M tokens
    .venv/bin/python bench/kernel_compile.py --targets sm_90 --only genoctx
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default; set to silence its warning


def _emulate(target: str) -> None:
    """Make fla's import-time hardware queries answer as the target GPU (this process only; nothing runs)."""
    import torch
    import triton
    from triton.runtime import driver

    from kernels.aot import SHARED_LIMIT, TARGETS

    cc = TARGETS[target].arch
    name = {90: "NVIDIA H100 80GB HBM3", 100: "NVIDIA B200"}[cc]

    class _Utils:
        @staticmethod
        def get_device_properties(_i=0):
            return {"max_shared_mem": SHARED_LIMIT, "multiprocessor_count": 132 if cc == 90 else 148}

    class _Driver:
        utils = _Utils()

        def get_current_target(self):
            return TARGETS[target]

        def get_current_device(self):
            return 0

        def is_active(self):
            return True

    driver.set_active(_Driver())
    torch.cuda.get_device_capability = lambda *_a, **_k: (cc // 10, cc % 10)
    torch.cuda.get_device_name = lambda *_a, **_k: name
    torch.cuda.device_count = lambda: 1
    assert triton.runtime.driver.active.get_current_target().arch == cc


def _genoctx_launches(tokens: int) -> list[tuple[str, str, object]]:
    """``(op, dtypes, Launch)`` for every launch genoctx's DSA kernels make in one training step of one layer of
    GLM-5.3-Flash (``kernels.aot.dsa_launches`` at the preset's shapes)."""
    from genoctx.model.config import PRESETS
    from kernels.aot import dsa_launches

    cfg = PRESETS["glm-5.3-flash"]
    return dsa_launches(
        tokens, heads=cfg.num_attention_heads, latent=cfg.kv_lora_rank, index_heads=cfg.index_n_heads,
        index_dim=cfg.index_head_dim, kpool=cfg.index_kpool, topk_pools=cfg.index_topk // cfg.index_kpool,
    )  # fmt: skip


def _fla_launches(tokens: int, raw_dtypes: bool = False) -> list[tuple[str, str, object]]:
    """``(op, dtypes, Launch)`` for fla's ``chunk_kda`` forward and backward as ``genoctx.model.kda`` calls it
    (``raw_dtypes``: with ``project``'s dtypes as they were before ``fla_core_inputs``, fp32 q, k and bf16 v)."""
    import torch
    from fla.ops.kda import chunk_kda

    from genoctx.model.config import PRESETS
    from genoctx.model.kda import FLA_SAFE_GATE_RANGE, fla_core_inputs
    from kernels.aot import captured_launches

    cfg = PRESETS["glm-5.3-flash"]
    B, T, H, K = 1, tokens, cfg.linear_num_heads, cfg.linear_head_dim

    def t(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=True)

    q, k, g, v = t(B, T, H, K), t(B, T, H, K), t(B, T, H, K), t(B, T, H, K, dtype=torch.bfloat16)
    beta, s0 = t(B, T, H), t(B, H, K, K)
    safe = FLA_SAFE_GATE_RANGE[0] <= cfg.linear_lower_bound < FLA_SAFE_GATE_RANGE[1]
    if not raw_dtypes:  # what KimiDeltaAttention hands fla (project's fp32 q, k and bf16 v, made one dtype)
        q, k, v = fla_core_inputs(q, k, v)
    with captured_launches() as fwd:
        o, s = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, safe_gate=safe)
    with captured_launches() as bwd:
        (o.float().sum() + s.sum()).backward()
    label = ", ".join(f"{n} {str(x.dtype)[6:]}" for n, x in (("q", q), ("k", k), ("v", v))) + "; g beta state fp32"
    return [("kda fla fwd", label, x) for x in fwd] + [("kda fla bwd", label, x) for x in bwd]


def _worker(target: str, tokens: int, only: str, raw_dtypes: bool = False) -> None:
    sys.path.insert(0, str(ROOT))
    if only in ("all", "fla"):
        _emulate(target)
    from kernels.aot import GPUS, compile_one

    launches = []
    if only in ("all", "genoctx"):
        launches += [("genoctx", *x) for x in _genoctx_launches(tokens)]
    if only in ("all", "fla"):
        launches += [("fla", *x) for x in _fla_launches(tokens, raw_dtypes)]
    summary: dict = {}
    for source, op, dtypes, launch in launches:
        key = f"{op}: {launch.name}"
        for config in launch.config_kwargs():
            row, _ = compile_one(launch, target, config)
            meta = {k: v for k, v in config.items() if k not in ("num_ctas", "maxnreg") or v not in (1, None)}
            line = {"bench": "kernel_compile", "source": source, "op": op, "kernel": launch.name, "target": target,
                    "gpu": GPUS[target], "tokens": tokens, "dtypes": dtypes, "config": meta, **row}  # fmt: skip
            print(json.dumps(line), flush=True)
            s = summary.setdefault(key, {"configs": 0, "compiled": 0, "fit": 0})
            s["configs"] += 1
            s["compiled"] += row["compiled"]
            s["fit"] += bool(row.get("fits"))
    ok = all(s["fit"] > 0 for s in summary.values())
    print(json.dumps({"bench": "kernel_compile", "summary": True, "target": target, "gpu": GPUS[target],
                      "tokens": tokens, "every_kernel_fits": ok, "kernels": summary}), flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="sm_90,sm_100", help="comma-separated: sm_90 (H100/H200), sm_100 (B200)")
    ap.add_argument("--only", choices=("all", "genoctx", "fla"), default="all")
    ap.add_argument("--tokens", type=int, default=1 << 20, help="sequence length of the shapes (tokens)")
    ap.add_argument("--fla-raw-dtypes", action="store_true", help="fla with fp32 q, k and bf16 v (does not compile)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        _worker(a.worker, a.tokens, a.only, a.fla_raw_dtypes)
        return
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    rc = 0
    for target in a.targets.split(","):  # one process per target: fla's import-time choices differ by GPU
        cmd = [sys.executable, __file__, "--worker", target, "--only", a.only, "--tokens", str(a.tokens)]
        cmd += ["--fla-raw-dtypes"] if a.fla_raw_dtypes else []
        rc = max(rc, subprocess.run(cmd, env=env, cwd=ROOT).returncode)
    sys.exit(rc)


if __name__ == "__main__":
    main()
