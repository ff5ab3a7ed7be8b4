#!/usr/bin/env bash
# GPU check of the DSA Triton kernels (kernels/indexer_topk.py, kernels/sparse_mla.py): one H200-class GPU, at most
# 8 minutes, one JSON line per measurement on stdout (progress and errors on stderr).
#
#   bash bench/gpu_check.sh                # on the GPU machine, from the repository root
#   bash bench/gpu_check.sh --dry          # smoke test on a CPU: tiny sizes, kernels under TRITON_INTERPRET=1
#
# Sections (each under its own time limit, so one failure or hang does not hide the others):
#   1. equality (100 s): bf16, 128k-token context, the last 4096 queries; GLM-5.3-Flash's DSA shapes (64 heads,
#      latent 512, indexer 32 heads x 128, pools of 16, top-2048 tokens = 128 pools + tail). The Triton indexer
#      top-k against genoctx.model.dsa.indexer_topk (fraction of rows with the same indices in the same order, the
#      same set, and the indices equal); the Triton sparse MLA forward/backward (atomic and deterministic) against
#      genoctx.model.dsa.sparse_mla (max |error| / max |reference| of o, dq, dkv). bf16 products are exact in the
#      fp32 accumulators on both sides, so selections differ only where scores tie within fp32 rounding.
#   2. speed (140 s): at 128k, 512k and 1M-token contexts, the last Tq = 16384 queries: indexer top-k forward (its
#      top-k has no backward: the indexer learns from its KL loss, which stays PyTorch), sparse MLA forward,
#      backward (atomic) and backward (deterministic); median of 5 after a warm-up (which includes autotuning).
#      FLOPs: indexer 2 H_I d_I per (query, visible pool); sparse forward 4 H R per (query, attended token) (QK^T and
#      PV), backward 10 H R (QK^T again, dO V^T, dQ, and dKV = P^T dO + dS^T Q). "full_s" scales the measured time
#      to all L queries of the window (indexer: by the visible-pool pairs; attention: by the query count).
#      Random inputs.
#   3. train_step (230 s): one optimizer step (genoctx.train.loop.train_step: forward, backward, clip, AdamW) of a
#      scaled glm5_next preset (GLM-5.3-Flash widths, 4 layers K K K D, 8 routed experts top-2, nucleotide
#      vocabulary, every layer recomputed in backward, bf16 autocast) at the longest of 1M, 512k, 256k, 128k, 64k
#      tokens that fits (the planner's prediction first, then out-of-memory fallback), with tokens/s, peak memory
#      (torch.cuda.max_memory_allocated) and genoctx.plan.plan_memory's prediction when genoctx/plan/ exists.
# No number here is asserted: the script measures; README quotes only what it printed, with the command.
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python
DRY=0
if [ "${1:-}" = "--dry" ]; then
    DRY=1
    export TRITON_INTERPRET=1
fi
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

section() {  # section NAME SECONDS
    echo "gpu_check: $1 (limit $2 s)" >&2
    timeout "$2" "$PY" - "$1" "$DRY" <<'PY'
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))
import torch  # noqa: E402

NAME, DRY = sys.argv[1], sys.argv[2] == "1"
DEV = "cpu" if DRY else "cuda"
DTYPE = "fp16 (dry run)" if DRY else "bf16"
H, R, HI, DI, KPOOL, TOPK = 64, 512, 32, 128, 16, 2048
if DRY:  # the same code paths at interpreter sizes
    H, R, HI, DI, KPOOL, TOPK = 3, 16, 2, 16, 4, 16


def emit(**kw):
    print(json.dumps({"bench": "gpu_check", "section": NAME, **kw}), flush=True)


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps=5):
    """Median wall seconds of ``fn`` after one warm-up call (compilation, autotuning)."""
    fn()
    sync()
    ts = []
    for _ in range(1 if DRY else reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def inputs(L, Tq, seed=0):
    """The last Tq queries of an L-token window: indexer q/w, pooled keys, latents q/kv, grad, positions."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    bf = torch.float16 if DRY else torch.bfloat16  # the interpreter is wrong for bf16

    def rn(*s, scale=1.0):
        return (torch.randn(*s, generator=g, device=DEV) * scale).to(bf)

    pos = torch.arange(L - Tq, L, device=DEV)
    return dict(
        pos=pos, vis=(pos + 1) // KPOOL,
        iq=rn(1, Tq, HI, DI), iw=rn(1, Tq, HI, scale=(HI * DI) ** -0.5), pk=rn(1, L // KPOOL, DI),
        q=rn(1, Tq, H, R, scale=R**-0.25), kv=rn(1, L, R), do=rn(1, Tq, H, R),
    )  # fmt: skip


def rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def equality():
    from genoctx.model import dsa
    from kernels.indexer_topk import indexer_topk
    from kernels.sparse_mla import sparse_mla, sparse_mla_bwd, sparse_mla_fwd

    L, Tq = (131072, 4096) if not DRY else (96, 24)
    x = inputs(L, Tq)
    K = TOPK // KPOOL
    got = indexer_topk(x["iq"], x["iw"], x["pk"], x["vis"], K)
    want = dsa.indexer_topk(x["iq"], x["iw"], x["pk"], x["vis"], K, 1 << 22)
    emit(what="indexer_topk", dtype=DTYPE, context=L, queries=Tq, topk_pools=K,
         rows_identical=float((got == want).all(-1).float().mean()),
         rows_same_set=float((got.sort(-1).values == want.sort(-1).values).all(-1).float().mean()),
         indices_equal=float((got == want).float().mean()))  # fmt: skip
    sel = dsa.DSASelection(want.int(), x["pos"], KPOOL, True)
    scale = 1 / math.sqrt(256 if not DRY else 8)  # GLM-5.3-Flash: qk_head_dim 256
    q, kv = x["q"].requires_grad_(), x["kv"].requires_grad_()
    o = sparse_mla(q, kv, sel, scale)
    dq, dkv = torch.autograd.grad(o, (q, kv), x["do"])
    o_t = dsa.sparse_mla(q, kv, sel, scale)
    dq_t, dkv_t = torch.autograd.grad(o_t, (q, kv), x["do"])
    o2, lse = sparse_mla_fwd(q.detach(), kv.detach(), sel.pools, sel.pos, KPOOL, True, scale)
    dq_d, dkv_d = sparse_mla_bwd(q.detach(), kv.detach(), sel.pools, sel.pos, KPOOL, True, scale, o2, lse, x["do"],
                                 deterministic=True)  # fmt: skip
    emit(what="sparse_mla", dtype=DTYPE, context=L, queries=Tq, heads=H, latent=R,
         rel_err={"o": rel(o, o_t), "dq": rel(dq, dq_t), "dkv": rel(dkv, dkv_t), "dq_deterministic": rel(dq_d, dq_t),
                  "dkv_deterministic": rel(dkv_d, dkv_t)})  # fmt: skip


def speed():
    from kernels.indexer_topk import indexer_topk
    from kernels.sparse_mla import sparse_mla_bwd, sparse_mla_fwd

    lengths = (131072, 524288, 1048576) if not DRY else (64, 128)
    Tq_max = 16384 if not DRY else 16
    K = TOPK // KPOOL
    for L in lengths:
        Tq = min(L, Tq_max)
        x = inputs(L, Tq, seed=L)
        vis = x["vis"]
        pairs = float(vis.sum())
        pairs_all = float(((torch.arange(L, dtype=torch.float64) + 1) // KPOOL).sum())
        idx = None

        def run_indexer():
            nonlocal idx
            idx = indexer_topk(x["iq"], x["iw"], x["pk"], vis, K, index_dtype=torch.int32)

        t = timed(run_indexer)
        f = 2 * HI * DI * pairs
        emit(what="indexer_topk_fwd", context=L, queries=Tq, seconds=t, tflops=f / t / 1e12, full_s=t * pairs_all / pairs)
        args = (idx, x["pos"], KPOOL, True, 1 / 16)
        slots = float((idx >= 0).sum() * KPOOL + ((x["pos"] + 1) % KPOOL).sum())  # attended (query, token) pairs
        out = {}

        def fwd():
            out["o"], out["lse"] = sparse_mla_fwd(x["q"], x["kv"], *args)

        t = timed(fwd)
        emit(what="sparse_mla_fwd", context=L, queries=Tq, heads=H, latent=R, seconds=t,
             tflops=4 * H * R * slots / t / 1e12, full_s=t * L / Tq)  # fmt: skip
        for det in (False, True):
            t = timed(lambda d=det: sparse_mla_bwd(x["q"], x["kv"], *args, out["o"], out["lse"], x["do"], deterministic=d))
            emit(what="sparse_mla_bwd", deterministic=det, context=L, queries=Tq, heads=H, latent=R, seconds=t,
                 tflops=10 * H * R * slots / t / 1e12, full_s=t * L / Tq)  # fmt: skip
        del x, out, idx
        if DEV == "cuda":
            torch.cuda.empty_cache()


def train_step_check():
    import contextlib

    from genoctx.model.config import preset
    from genoctx.model.model import HybridLM
    from genoctx.parallel.fsdp import apply_ac
    from genoctx.recipes import TrainConfig
    from genoctx.train.loop import build_optimizer, train_step

    name = "glm-5.3-flash"
    kw = dict(num_hidden_layers=4, layer_types="KKKD", mlp_layer_types="DSSS", n_routed_experts=8,
              num_experts_per_tok=2, vocab_size=8, pad_token_id=None)  # fmt: skip
    if DRY:
        name, kw = "tiny", {}
    cfg = preset(name, **kw)
    lengths = [1 << 20, 1 << 19, 1 << 18, 1 << 17, 1 << 16] if not DRY else [256, 128]
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if DEV == "cuda" else 64.0
    plans = {}
    if Path("genoctx/plan").is_dir():
        try:
            from genoctx.parallel.layout import Layout
            from genoctx.plan import plan_memory

            for L in lengths:
                plans[L] = plan_memory(cfg, L, Layout(), gpu_memory_gib=gib, recompute=True, dtype="bf16", device=DEV)
            fitting = [L for L in lengths if plans[L]["fits"]]
            lengths = fitting + [L for L in lengths if L not in fitting] if fitting else lengths
        except Exception as e:  # noqa: BLE001 - the planner is optional here
            emit(what="plan_memory", error=repr(e)[:300])
    torch.manual_seed(0)
    model = HybridLM(cfg).to(DEV)
    apply_ac(model)
    tc = TrainConfig(steps=10, lr=1e-4, warmup_steps=0)
    opt, sched = build_optimizer(model, tc, tc.steps)
    autocast = torch.autocast(device_type=DEV, dtype=torch.bfloat16) if DEV == "cuda" else contextlib.nullcontext()
    train_step(model, opt, sched, torch.randint(0, 8, (1, 4096 if not DRY else 64), device=DEV), tc, autocast)
    for L in sorted(lengths, reverse=True):
        tokens = torch.randint(0, 8, (1, L), device=DEV)
        try:
            if DEV == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            sync()
            t0 = time.perf_counter()
            m = train_step(model, opt, sched, tokens, tc, autocast)
            sync()
            t = time.perf_counter() - t0
        except torch.OutOfMemoryError:
            emit(what="train_step", seq_len=L, fits=False)
            opt.zero_grad(set_to_none=True)
            continue
        peak = torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else None
        kernels = sorted({s.get("kernel") for s in model.layer_stats() if s["mixer"] == "dsa"})
        plan = plans.get(L)
        emit(what="train_step", preset=name, overrides=kw, seq_len=L, fits=True, seconds=t, tokens_per_s=L / t,
             peak_gib=peak, predicted_gib=plan["total_gib"] if plan else None,
             predicted_phase=plan["peak_phase"] if plan else None, dsa_kernel=kernels, loss=m["loss"])  # fmt: skip
        break


{"equality": equality, "speed": speed, "train_step": train_step_check}[NAME]()
PY
    local rc=$?
    if [ $rc -ne 0 ]; then
        printf '{"bench": "gpu_check", "section": "%s", "error": "exit %s (124 = time limit)"}\n' "$1" "$rc"
    fi
}

if [ "$DRY" = 0 ]; then
    "$PY" -c 'import json, torch, triton; print(json.dumps({"bench": "gpu_check", "section": "env",
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__}))' \
        || { echo '{"bench": "gpu_check", "error": "no CUDA device"}'; exit 1; }
fi
section equality 100
section speed 140
section train_step 230
