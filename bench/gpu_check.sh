#!/usr/bin/env bash
# GPU check: the DSA Triton kernels (kernels/indexer_topk.py, kernels/sparse_mla.py), one training step, and the
# NCCL/Ray paths at world size 1 with fla's KDA core: one H100/H200-class GPU, at most 8 minutes, one JSON line per
# measurement on stdout (progress and errors on stderr).
#
#   bash bench/gpu_check.sh                # on the GPU machine, from the repository root
#   bash bench/gpu_check.sh --dry          # smoke test on a CPU: tiny sizes, kernels under TRITON_INTERPRET=1, gloo
#   bash bench/gpu_check.sh [--dry] mesh   # only the named sections (equality, speed, train_step, mesh)
#
# Sections (each under its own time limit, so one failure or hang does not hide the others; 60 + 100 + 130 + 180 s
# = 7 min 50 s at most, Python's start-ups included; twice each with --dry, which shares a CPU with other work):
#   1. equality (60 s): bf16, 128k-token context, the last 4096 queries; GLM-5.3-Flash's DSA shapes (64 heads,
#      latent 512, indexer 32 heads x 128, pools of 16, top-2048 tokens = 128 pools + tail). The Triton indexer
#      top-k against genoctx.model.dsa.indexer_topk (fraction of rows with the same indices in the same order, the
#      same set, and the indices equal); the Triton sparse MLA forward/backward (atomic and deterministic) against
#      genoctx.model.dsa.sparse_mla (max |error| / max |reference| of o, dq, dkv). bf16 products are exact in the
#      fp32 accumulators on both sides, so selections differ only where scores tie within fp32 rounding.
#   2. speed (100 s): at 128k, 512k and 1M-token contexts, the last Tq = 16384 queries: indexer top-k forward (its
#      top-k has no backward: the indexer learns from its KL loss, which stays PyTorch), sparse MLA forward,
#      backward (atomic) and backward (deterministic); median of 5 after a warm-up (which includes autotuning).
#      FLOPs: indexer 2 H_I d_I per (query, visible pool); sparse forward 4 H R per (query, attended token) (QK^T and
#      PV), backward 10 H R (QK^T again, dO V^T, dQ, and dKV = P^T dO + dS^T Q). "full_s" scales the measured time
#      to all L queries of the window (indexer: by the visible-pool pairs; attention: by the query count).
#      Random inputs.
#   3. train_step (130 s): one optimizer step (genoctx.train.loop.train_step: forward, backward, clip, AdamW) of a
#      scaled glm5_next preset (GLM-5.3-Flash widths, 4 layers K K K D, 8 routed experts top-2, nucleotide
#      vocabulary, every layer recomputed in backward, bf16 autocast) at the longest of 1M, 512k, 256k, 128k, 64k
#      tokens that fits (the planner's prediction first, then out-of-memory fallback), with tokens/s, peak memory
#      (torch.cuda.max_memory_allocated) and genoctx.plan.plan_memory's prediction when genoctx/plan/ exists.
#   4. mesh (180 s): what only a GPU with NCCL runs, at world size 1 (issue 43), then fla's KDA core:
#      - mesh_train, mesh_resume: genoctx train --num-workers 1 --gpus-per-worker 1 through a Ray started here
#        (--address) of recipes/gpu-check.yaml (GLM-5.3-Flash scaled to ~83M parameters; 64k-token windows of
#        data/hg38, prepared here: mesh_prepare) with FSDP2 on the one worker (--fsdp-one: fully_shard over a
#        1-rank mesh, Layout.fsdp_one) and its bf16 MixedPrecisionPolicy, train.offload_optimizer (CPUOffloadPolicy:
#        parameters, gradients and AdamW state in pinned host memory, the gradient norm all-reduced over NCCL),
#        activation checkpointing with offload_activations, --seq-chunk 16k and a DCP checkpoint every step:
#        --stop-after 1, then --resume for step 2 (mesh_metrics: each step's loss and the attempt that ran it;
#        mesh_offload_optimizer: the layout and the planner's verdict; mesh_train: the checkpoint's format and
#        layout). Where two or more GPUs are visible (or GPU_CHECK_MESH_WORKERS=2), train and eval run on 2 workers
#        with --fsdp 2 instead: the same, with parameters sharded and reduce-scattered over NCCL.
#      - mesh_eval, mesh_eval_one_process, mesh_eval_vs_one_process: genoctx eval --num-workers 1 of the run on the
#        mesh (NCCL), the same eval in one process (--device cuda), and the two losses, which should agree.
#      - mesh_plan, mesh_host: the run's peak memory against genoctx.plan.plan_memory; then one step of the same
#        recipe in this process on a world-1 mesh (its own NCCL group) with FSDP2 (fsdp_one, bf16 parameters),
#        offload_optimizer and offload_activations, for the pinned host bytes (torch.cuda.host_memory_stats: the
#        pinned allocator's blocks, power-of-two rounded, and the bytes in use) against the plan's host_gib.
#      - kda_fla (last, in the time the Ray parts leave, at least 60 s; a process of its own compiles and
#        autotunes fla's ~160 kernel configurations at the same shapes while the Ray parts run: kda_fla_warmup):
#        fla-core's Triton chunk_kda as kda_kernel: fla calls it (genoctx.model.kda.fla_chunk_kda: bf16 q/k/v, fp32
#        gate, beta and initial state, safe_gate) against genoctx's PyTorch core chunk_kda on the same inputs,
#        forward and backward (every input's gradient, the initial state's included), at GLM-5.3-Flash's KDA heads
#        (64 x 128), 8192 tokens; then a KimiDeltaAttention layer with kda_kernel fla vs torch under bf16 autocast
#        over two chunks of 2048 tokens, the state carried in bf16 (as a cast forward input). Max |error| / max
#        |reference| per tensor, and seconds. Skipped, with a JSON line saying why, without CUDA or fla-core.
#      With --dry: the tiny recipe, 256-token crops in chunks of 128, --gpus-per-worker 0 (gloo), CPU eval.
# No number here is asserted: the script measures; README quotes only what it printed, with the command.
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python
DRY=0
if [ "${1:-}" = "--dry" ]; then
    DRY=1
    export TRITON_INTERPRET=1
    shift
fi
declare -A LIMIT=([equality]=60 [speed]=100 [train_step]=130 [mesh]=180)
if [ "$DRY" = 1 ]; then  # a dry run shares a small CPU with whatever else runs (CI's other tests): the limits
    for s in "${!LIMIT[@]}"; do LIMIT[$s]=$((2 * LIMIT[$s])); done  # guard against hangs, not the GPU's budget
fi
SECTIONS=("$@")
[ ${#SECTIONS[@]} -gt 0 ] || SECTIONS=(equality speed train_step mesh)
for s in "${SECTIONS[@]}"; do
    [ -n "${LIMIT[$s]:-}" ] || { echo "gpu_check: unknown section $s (equality, speed, train_step, mesh)" >&2; exit 2; }
done
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

section() {  # section NAME SECONDS
    echo "gpu_check: $1 (limit $2 s)" >&2
    # SIGTERM at the limit (the mesh section then stops its Ray), SIGKILL 10 s later
    timeout -k 10 "$2" "$PY" - "$1" "$DRY" "$2" <<'PY'
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))
import torch  # noqa: E402

NAME, DRY, LIMIT = sys.argv[1], sys.argv[2] == "1", float(sys.argv[3])
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


def kda_fla_check():
    """fla's chunk_kda as kda_kernel: fla calls it against genoctx's torch core, forward and backward (header, 4)."""
    from genoctx.model.config import preset

    if DEV != "cuda":
        emit(what="kda_fla", skipped="no CUDA: fla-core's chunk_kda runs only on CUDA (dry run)")
        return
    try:
        import fla.ops.kda  # noqa: F401
    except ImportError as e:
        emit(what="kda_fla", skipped=f"fla-core is not installed ({e})")
        return
    from genoctx.model.kda import ForgetGate, KDACache, KimiDeltaAttention, chunk_kda, fla_chunk_kda, l2norm

    cfg = preset("glm-5.3-flash")
    B, T, H, K = 1, 8192, cfg.linear_num_heads, cfg.linear_head_dim
    g0 = torch.Generator(device=DEV).manual_seed(0)

    def rn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g0, device=DEV) * scale

    gate = ForgetGate(cfg).to(DEV)
    gate.reset_parameters(cfg.initializer_range)
    with torch.no_grad():
        gate.A_log.normal_(0.0, 0.5, generator=g0)  # decays of every strength, not the init's uniform one
        g = gate(rn(B, T, cfg.hidden_size)).float()
        q, k = (l2norm(rn(B, T, H, K)).bfloat16() for _ in range(2))
    v, beta, h0 = rn(B, T, H, K).bfloat16(), torch.sigmoid(rn(B, T, H)), rn(B, H, K, K, scale=0.1)
    ins = [t.detach().requires_grad_() for t in (q, k, v, g, beta, h0)]
    do, ds = rn(B, T, H, K).bfloat16(), rn(B, H, K, K)
    res, first = {}, {}
    for name, fn in (("fla", lambda *a: fla_chunk_kda(*a, gate)),
                     ("torch", lambda *a: chunk_kda(*a[:5], initial_state=a[5], chunk_size=cfg.kda_chunk_size))):  # fmt: skip
        for rep in range(2):  # the first: fla's autotuning and compilation (forward and backward kernels)
            sync()
            t0 = time.perf_counter()
            o, s = fn(*ins)
            sync()
            t1 = time.perf_counter()
            grads = torch.autograd.grad((o.float() * do.float()).sum() + (s * ds).sum(), ins)
            sync()
            if rep == 0:
                first[name] = time.perf_counter() - t0
        res[name] = (o, s, grads, t1 - t0, time.perf_counter() - t1)
    (o, s, gr, tf, tb), (o_t, s_t, gr_t, tf_t, tb_t) = res["fla"], res["torch"]
    err = {"o": rel(o, o_t), "state": rel(s, s_t)}
    err.update({f"d{n}": rel(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta", "h0"), gr, gr_t, strict=True)})
    emit(what="kda_fla", form="core", tokens=T, heads=H, head_dim=K, dtypes="q k v bf16; g beta h0 fp32",
         safe_gate=True, rel_err=err, o_dtype=str(o.dtype), state_dtype=str(s.dtype),
         seconds={"fla_fwd": tf, "fla_bwd": tb, "torch_fwd": tf_t, "torch_bwd": tb_t, "fla_first_call": first["fla"],
                  "torch_first_call": first["torch"]})  # fmt: skip
    del res, ins, gr, gr_t
    # the layer as training calls it: bf16 autocast, two chunks, the state carried (in bf16, as a cast input)
    torch.manual_seed(0)
    ours = KimiDeltaAttention(cfg).to(DEV)
    theirs = KimiDeltaAttention(cfg, use_fla=True).to(DEV)
    theirs.load_state_dict(ours.state_dict())
    x, w = rn(B, 2 * 2048, cfg.hidden_size), rn(B, 2 * 2048, cfg.hidden_size)
    out = {}
    for name, layer in (("fla", theirs), ("torch", ours)):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y1, c1 = layer(x[:, :2048])
            y2, c2 = layer(x[:, 2048:], KDACache(state=c1.state.bfloat16(), conv_state=c1.conv_state))
        loss = (torch.cat([y1, y2], 1).float() * w).sum() + c2.state.float().sum()
        out[name] = (y1, y2, c2.state, torch.autograd.grad(loss, list(layer.parameters())), layer.stats["path"])
    a, b = out["fla"], out["torch"]
    names = [n for n, _ in ours.named_parameters()]
    emit(what="kda_fla", form="layer", tokens=[2048, 2048], paths=[a[4], b[4]],
         rel_err={"y1": rel(a[0], b[0]), "y2": rel(a[1], b[1]), "state": rel(a[2], b[2]),
                  "grads_max": max(rel(p, q) for p, q in zip(a[3], b[3], strict=True)),
                  "grads": {n: rel(p, q) for n, p, q in zip(names, a[3], b[3], strict=True)}})  # fmt: skip
    del out, ours, theirs
    torch.cuda.empty_cache()


def mesh_check():
    """The NCCL/Ray paths at world size 1, then fla's KDA core (header, section 4)."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # the section's limit: unwind (Ray stops) on the way out
    start = time.monotonic()
    # fla's first chunk_kda calls autotune and compile ~160 kernel configurations (bench/kernel_compile.py), minutes
    # of one CPU core: a process of its own does that at the shapes of kda_fla_check while the Ray parts run, and
    # leaves the compiled kernels and the autotuning results in Triton's cache for the check
    warm = fla_warmup()
    # the Ray parts within the limit less what fla's check needs and Ray's stop; then fla's check in the time left
    end = start + LIMIT - (15 if DRY else 60)
    try:
        mesh_ray_parts(end)
    except Exception as e:  # noqa: BLE001 - one failed measurement must not hide the others
        emit(what="mesh", error=repr(e)[:500])
    try:
        if warm is not None:
            try:
                rc = warm.wait(timeout=max(1.0, start + LIMIT - 40 - time.monotonic()))
            except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: the check compiles what is left itself
                warm.kill()  # (what it compiled stays in Triton's cache)
                rc = None
            emit(what="kda_fla_warmup", rc=rc, seconds=time.monotonic() - start, finished=rc is not None)
        kda_fla_check()
    except Exception as e:  # noqa: BLE001
        emit(what="kda_fla", error=repr(e)[:500])
    finally:
        if warm is not None and warm.poll() is None:
            warm.kill()


FLA_WARMUP = """
import sys, torch
sys.path.insert(0, ".")
from genoctx.model.config import preset
from genoctx.model.kda import ForgetGate, fla_chunk_kda
cfg = preset("glm-5.3-flash")
gate = ForgetGate(cfg)
H, K = cfg.linear_num_heads, cfg.linear_head_dim
for T, state in ((8192, True), (2048, False), (2048, True)):  # kda_fla_check's core, then its layer's two chunks
    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_()
    q = torch.nn.functional.normalize(torch.randn(1, T, H, K, device="cuda"), dim=-1).bfloat16().requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device="cuda"), dim=-1).bfloat16().requires_grad_()
    g = (-5 * torch.sigmoid(torch.randn(1, T, H, K, device="cuda"))).requires_grad_()
    beta = torch.rand(1, T, H, device="cuda").requires_grad_()
    o, s = fla_chunk_kda(q, k, t(1, T, H, K, dtype=torch.bfloat16), g, beta, t(1, H, K, K) if state else None, gate)
    (o.float().sum() + s.sum()).backward()
torch.cuda.synchronize()
"""


def fla_warmup():
    """A process that compiles and autotunes fla's KDA kernels at kda_fla_check's shapes (mesh_check), or None."""
    import subprocess

    if DEV != "cuda":
        return None
    try:
        import fla.ops.kda  # noqa: F401
    except ImportError:
        return None
    return subprocess.Popen([sys.executable, "-c", FLA_WARMUP], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip


def mesh_ray_parts(end):
    """Prepare data, start Ray here, then ``mesh_runs``; Ray stopped and the files removed on the way out."""
    import os
    import shutil
    import subprocess
    import tempfile

    root = Path.cwd()
    paths = [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)  # the CLI and the Ray workers import this tree's genoctx
    work = Path(tempfile.mkdtemp(prefix="gpu_check_mesh."))
    gpus = 0 if DRY else 1
    if DRY:
        recipe, window, seq, chunk = "recipes/tiny.yaml", 2048, 256, 128
        fasta, train_chroms = ["hg38_chrM.fa", "hg38_chr22_32000001-32300000.fa"], "chrM"
    else:
        recipe, window, seq, chunk = "recipes/gpu-check.yaml", 65536, 65536, 16384
        fasta, train_chroms = ["hg38_chr1_1-1000000.fa.gz", "hg38_chr22_32000001-32300000.fa"], "chr1"
    sets = [f"train.seq_len={seq}", "train.dtype=bf16", "train.activation_checkpointing=true",
            "train.offload_activations=true", "train.checkpoint_every=1", "train.keep_checkpoints=0",
            "train.log_every=1", "train.warmup_steps=0"]  # fmt: skip
    # FSDP2 (bf16 MixedPrecisionPolicy on CUDA) with offload_optimizer: on one worker over a 1-rank mesh
    # (train.fsdp_one), with two or more GPUs sharded over 2 workers
    n_gpu = torch.cuda.device_count() if DEV == "cuda" else 0
    workers = int(os.environ.get("GPU_CHECK_MESH_WORKERS") or (2 if n_gpu >= 2 else 1))
    sets += ["train.offload_optimizer=true", f"train.fsdp={workers}" if workers > 1 else "train.fsdp_one=true"]
    sets_args = [x for kv in sets for x in ("--set", kv)]

    def cli(what, *args, cap):
        """``python -m genoctx ARGS`` within the section's time left (at most ``cap`` s): (rc, stdout JSON, s)."""
        limit = max(5.0, min(cap, end - time.monotonic()))
        t0 = time.perf_counter()
        with open(work / f"{what}.log", "w") as log:
            try:
                p = subprocess.run([sys.executable, "-m", "genoctx", *args], stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=log, text=True, timeout=limit)  # fmt: skip
                rc, out = p.returncode, p.stdout
            except subprocess.TimeoutExpired as e:
                rc, out = 124, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        dt = time.perf_counter() - t0
        doc = None
        for line in reversed(out.strip().splitlines()):
            try:
                doc = json.loads(line) if line.lstrip().startswith("{") else None
            except ValueError:
                doc = None
            if doc is not None:
                break
        if doc is None and out.strip().startswith("{"):
            try:
                doc = json.loads(out)
            except ValueError:
                doc = None
        if rc != 0:
            tail = [ln for ln in (work / f"{what}.log").read_text(errors="replace").splitlines() if ln.strip()]
            sys.stderr.write("\n".join(tail[-40:]) + "\n")
            emit(what=what, rc=rc, seconds=dt, error=(tail[-1] if tail else "")[-400:], limit_s=limit)
        return rc, doc, dt

    import ray

    data = work / "data"
    fastas = [x for f in fasta for x in ("--fasta", f"data/hg38/{f}")]
    rc, _, dt = cli("mesh_prepare", "prepare", "--out", str(data), "--window", str(window), "--chroms", train_chroms,
                    "--eval-chroms", "chr22", *fastas, cap=60)  # fmt: skip
    if rc != 0:
        return
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    t0 = time.perf_counter()
    cpus = max(4, 2 * workers) if DRY else max(4, os.cpu_count() or 4)
    ctx = ray.init(num_cpus=cpus, num_gpus=gpus * workers, include_dashboard=False, _temp_dir=temp,
                   object_store_memory=256 << 20, configure_logging=False,
                   logging_config=ray.LoggingConfig(log_level="ERROR"))  # fmt: skip
    address = ctx.address_info["gcs_address"]
    emit(what="mesh_ray", seconds=time.perf_counter() - t0, gpus=gpus * workers, workers=workers, prepare_s=dt)
    try:
        mesh_runs(cli, work, recipe, sets, sets_args, seq, chunk, gpus, workers, address, end)
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
        if os.environ.get("GPU_CHECK_KEEP"):
            print(f"gpu_check: kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def mesh_runs(cli, work, recipe, sets, sets_args, seq, chunk, gpus, workers, address, end):
    """Train (stop after step 1, resume), eval on the mesh and in one process, the plan (mesh_check)."""
    import re

    from genoctx.parallel.layout import Layout
    from genoctx.plan import plan_memory
    from genoctx.recipes import load_recipe

    data, run = work / "data", work / "run"
    rec = load_recipe(recipe, sets)
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if DEV == "cuda" else 64.0
    plan_kw = dict(gpu_memory_gib=gib, recompute=True, dtype="bf16", device=DEV, seq_chunk_tokens=chunk,
                   offload_activations=True, batch_size=rec.train.batch_size)  # fmt: skip
    layout = Layout.for_world(workers, dp_shard=workers, fsdp_one=rec.train.fsdp_one)
    plan_kw["optimizer_offload"] = rec.train.offload_optimizer
    one = plan_memory(rec.model, seq, Layout(fsdp_one=True), **plan_kw)  # the in-process step's (host_step)
    try:
        plan, why = plan_memory(rec.model, seq, layout, **plan_kw), None
    except ValueError as e:
        plan, why = one, str(e)
    emit(what="mesh_offload_optimizer", world=workers, layout=layout.describe(), fsdp2_applied=layout.fsdp,
         offload_optimizer=rec.train.offload_optimizer, planner=why or "accepted",
         predicted_host_gib=plan["host_gib"])  # fmt: skip
    mesh = ["--num-workers", str(workers), "--gpus-per-worker", str(gpus), "--address", address]
    mesh += ["--fsdp", str(workers)] if workers > 1 else []
    common = ["--data", str(data), "--out", str(run), "--recipe", recipe, *mesh, "--seq-chunk", str(chunk),
              "--steps", "2", *sets_args]  # fmt: skip
    peaks = []
    for what, extra, cap in (("mesh_train", ["--stop-after", "1"], 70 if not DRY else 300),
                             ("mesh_resume", ["--resume"], 55 if not DRY else 300)):  # fmt: skip
        rc, doc, dt = cli(what, "train", *common, *extra, cap=cap)
        if rc != 0 or not doc:
            return
        peaks.append(doc.get("peak_memory_bytes") or 0)
        ckpt = run / "checkpoints" / f"step_{doc.get('step') or 0:06d}" / "state.json"  # what the run saved
        state = json.loads(ckpt.read_text()) if ckpt.is_file() else {}
        emit(what=what, rc=rc, seconds=dt, step=doc.get("step"), resumed_from=doc.get("resumed_from"),
             checkpoint_format=state.get("format"), checkpoint_layout=state.get("layout"),
             loss=doc.get("final_loss"), tokens_per_s=doc.get("tokens_per_s"), workers=doc.get("workers"),
             peak_gib=(doc.get("peak_memory_bytes") or 0) / 2**30, seq_len=seq, seq_chunk=chunk,
             attempts=[(a["attempt"], a["resumed_from"], a["steps_run"], a["status"])
                       for a in doc.get("attempts", [])])  # fmt: skip
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    emit(what="mesh_metrics", steps=[(r["step"], r.get("attempt"), r["loss"]) for r in rows],
         kda_paths=sorted({s.get("path") for r in rows for s in r.get("layers", [])
                           if s.get("mixer") == "kda"}))  # fmt: skip
    losses = {}
    ev = ["--data", str(data), "--checkpoint", str(run), "--max-windows", "2", "--resamples", "0",
          "--format", "json", "--seq-chunk", str(chunk)]  # fmt: skip
    for what, extra, cap in (("mesh_eval", mesh, 50 if not DRY else 300),
                             ("mesh_eval_one_process", ["--device", DEV], 30 if not DRY else 120)):  # fmt: skip
        rc, doc, dt = cli(what, "eval", *ev, *extra, cap=cap)
        if rc != 0 or not doc:
            continue
        model = doc["models"][-1]
        losses[what] = model.get("overall", {}).get("loss") if isinstance(model.get("overall"), dict) else None
        busiest = re.findall(r"busiest rank's peak memory ([0-9.]+) MiB", (work / f"{what}.log").read_text())
        emit(what=what, rc=rc, seconds=dt, windows=doc.get("windows"), window=doc.get("window"), loss=losses[what],
             peak_gib=float(busiest[-1]) / 1024 if busiest else None)  # fmt: skip
    if len(losses) == 2 and None not in losses.values():
        a, b = losses["mesh_eval"], losses["mesh_eval_one_process"]
        emit(what="mesh_eval_vs_one_process", mesh=a, one_process=b, rel_diff=abs(a - b) / max(abs(b), 1e-30))
    emit(what="mesh_plan", seq_len=seq, seq_chunk=chunk, measured_peak_gib=max(peaks, default=0) / 2**30,
         predicted_gib=plan["total_gib"], predicted_phase=plan["peak_phase"], predicted_host_gib=plan["host_gib"],
         measured="torch.cuda.max_memory_allocated of the Ray worker" if DEV == "cuda" else "peak RSS (CPU)",
         )  # fmt: skip
    if time.monotonic() > end - 20:
        emit(what="mesh_host", skipped="the section's time is spent")
        return
    host_step(rec, seq, chunk, one)


def host_step(rec, seq, chunk, plan):
    """One step of the mesh recipe in this process on a world-1 mesh (NCCL on a GPU) with FSDP2 (``fsdp_one``; bf16
    parameters on CUDA), ``offload_optimizer`` and ``offload_activations``: the pinned host bytes (the pinned
    allocator's blocks and the bytes asked) and the peak against the plan."""
    import tempfile

    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from genoctx.parallel.build import Fresh, build_model
    from genoctx.parallel.mesh import init_parallel, leaving_mesh
    from genoctx.parallel.offload import OffloadStats
    from genoctx.train.loop import build_optimizer, train_autocast, train_step

    init = tempfile.mktemp(prefix="gpu_check_pg.")
    dist.init_process_group("nccl" if DEV == "cuda" else "gloo", init_method=f"file://{init}", rank=0, world_size=1,
                            device_id=torch.device(DEV, 0) if DEV == "cuda" else None)  # fmt: skip
    try:
        with leaving_mesh():
            dims = init_parallel(1, fsdp_one=True)
            cfg = rec.train
            cfg.seq_chunk_tokens = chunk
            torch.manual_seed(0)
            model = build_model(rec.model, dims, source=Fresh(), device=DEV, activation_checkpointing=True,
                                offload_activations=True, offload_optimizer=True,
                                param_dtype=torch.bfloat16 if DEV == "cuda" else None)  # fmt: skip
            opt, sched = build_optimizer(model, cfg, cfg.steps)
            tokens = torch.randint(0, 4, (1, seq), device=DEV)
            OffloadStats.reset()
            if DEV == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.reset_peak_host_memory_stats()
            t0 = time.perf_counter()
            m = train_step(model, opt, sched, tokens, cfg, train_autocast(cfg.dtype, DEV), dims)
            sync()
            dt = time.perf_counter() - t0
            host = torch.cuda.host_memory_stats() if DEV == "cuda" else {}
            emit(what="mesh_host", seq_len=seq, seq_chunk=cfg.seq_chunk_tokens, seconds=dt, loss=m["loss"],
                 layout=dims.layout.describe(), fsdp2_applied=isinstance(model, FSDPModule), offload_optimizer=True,
                 peak_gib=torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else None,
                 predicted_gib=plan["total_gib"], offloaded_bytes=OffloadStats.to_host_bytes,
                 offloaded_copies=OffloadStats.to_host,
                 pinned_allocated_peak_bytes=host.get("allocated_bytes.all.peak", host.get("allocated_bytes.peak")),
                 pinned_active_peak_bytes=host.get("active_bytes.all.peak", host.get("active_bytes.peak")),
                 predicted_host_bytes=int(plan["host_gib"] * 2**30))  # fmt: skip
    finally:
        if dist.is_initialized():  # leaving_mesh destroys it on the way out
            dist.destroy_process_group()


{"equality": equality, "speed": speed, "train_step": train_step_check, "mesh": mesh_check}[NAME]()
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
for s in "${SECTIONS[@]}"; do
    section "$s" "${LIMIT[$s]}"
done
