"""One DSA layer vs dense SDPA attention: forward+backward time and peak memory by sequence length.

Prints one JSON line per length L (default 8192, 16384, 32768)::

    {"bench": "dsa_vs_dense", "L": 8192, "device": "cpu", "shape": "small", "dsa": {...}, "sdpa": {...},
     "mem_ratio_dsa_over_sdpa": ..., ...}

Both sides are the same GLM-5.3-Flash DSA layer (``DeepSeekSparseAttention``: NoPE MLA in the absorbed MQA
form, every head attending to the shared ``kv_lora_rank`` latent), fp32, batch 1, with the same projections.
The DSA side runs as in training: the KPool lightning indexer (pools of ``index_kpool`` tokens, top
``index_topk`` tokens plus the tail), sparse attention over the selection and the indexer KL loss of the sparse
stage. The SDPA side is the same layer with ``dsa_mode=dense``, no indexer, and one
``F.scaled_dot_product_attention(is_causal=True)`` over the latents in place of indexer + sparse attention.

Shapes (``--shape``): ``small`` (default, for a CPU) = hidden 1024, 16 MLA heads, q-LoRA 384, kv-LoRA 128,
qk_nope = v = 64, indexer 8 heads of 32, kpool 16, top-2048 tokens; ``glm-5.3-flash`` = the published layer
(hidden 4096, 64 heads, q-LoRA 1536, kv-LoRA 512, qk_nope = v = 256, indexer 32 heads of 128; for a GPU).

Method:
- Each (side, L) runs in a fresh subprocess, so one run's allocations cannot hide in another's.
- Time: wall clock of one forward+backward (``y.sum() [+ aux_loss]).backward()``), after a warm-up
  forward+backward at a short length (256) that loads kernels. CPU threads: ``--threads`` (default 1 on
  CPU: on a machine shared with other jobs, 2+ OpenMP threads slow down 5-8x when a core is taken away).
  Lengths run in increasing order.
- Peak memory on CPU: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (the process's peak resident set, which
  torch allocations are part of; tracemalloc cannot see them) read after the step, minus the resident set
  read just before the step (inputs and weights already allocated). The warm-up is short (256 tokens) so
  that little freed-but-retained heap sits in the resident set before the step (it would hide part of the
  step's peak). Allocator retention and fragmentation make this a +-10% measure. On CUDA:
  ``torch.cuda.max_memory_allocated()`` minus the allocation before the step.
- Indexer share: time of the DSA forward+backward with the indexer's top-k and KL loss measured apart by
  wall clock (``indexer_topk`` once + the KL forward/backward) divided by the layer's total.

Targets (DESIGN.md performance rules): DSA peak memory within 2x of SDPA's; DSA time growth 16k -> 32k at most
2.5x (the indexer is O(L^2 / kpool) but cheap per pair; attention is O(L x top-k)).

Usage: ``python bench/dsa_vs_dense.py [--lengths 8192 16384 32768] [--device cpu|cuda] [--topk 2048]
[--shape small|glm-5.3-flash]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

SHAPES = {
    "small": dict(
        hidden_size=1024, num_attention_heads=16, q_lora_rank=384, kv_lora_rank=128, qk_nope_head_dim=64,
        v_head_dim=64, index_n_heads=8, index_head_dim=32, index_kpool=16,
    ),
    "glm-5.3-flash": "preset",
}  # fmt: skip


def _config(shape: str, topk: int, side: str, L: int):
    """The one-layer ``ModelConfig`` of ``shape`` for ``side`` ("dsa": sparse, "sdpa": dense, one SDPA call)."""
    import dataclasses

    from genoctx.model.config import DSA, ModelConfig, preset

    one = dict(num_hidden_layers=1, layer_types=[DSA], mlp_layer_types=["dense"], indexer_types=["full"])
    if SHAPES[shape] == "preset":
        cfg = dataclasses.replace(preset("glm-5.3-flash"), **one)
    else:
        cfg = ModelConfig(**SHAPES[shape], **one)
    if side == "dsa":
        return dataclasses.replace(cfg, index_topk=topk, dsa_mode="sparse", indexer_stage="sparse")
    # dense: the tile budget covers the whole L x L causal product, so _dense makes one is_causal SDPA call
    return dataclasses.replace(cfg, index_topk=topk, dsa_mode="dense", indexer_stage="off", indexer_tile_tokens=L * L)


def _make(side: str, shape: str, topk: int, L: int, device: str):
    from genoctx.model.dsa import DeepSeekSparseAttention

    layer = DeepSeekSparseAttention(_config(shape, topk, side, L)).to(device)
    if side == "sdpa":
        layer.indexer = None  # same projections, no indexer: dense SDPA over the latents

    def step(x):
        y, _, _ = layer(x)
        (y.sum() + layer.aux_loss if layer.aux_loss is not None else y.sum()).backward()

    return layer, step


def _indexer_seconds(layer, x, device: str) -> tuple[float, float]:
    """Wall-clock seconds of the layer's indexer top-k (once) and of its sparse-stage KL forward+backward."""
    import torch

    from genoctx.model.dsa import DSASelection, indexer_topk

    L, H, kp = x.shape[1], layer.n_heads, layer.kpool
    xd = x.detach()
    with torch.no_grad():
        q_resid = layer.q_a_layernorm(layer.q_a_proj(xd))
        q = layer.q_b_proj(q_resid).view(1, L, H, layer.qk_head_dim)
        q_abs = torch.einsum("bthd,hdr->bthr", q, layer.absorbed()[0])
        latent = layer.latent(xd)
    ik, ig = layer.indexer.keys(xd)
    pool_k, _, _ = layer.indexer.extend(None, ik, ig)
    iq, iw = layer.indexer.queries(xd, q_resid)
    pos = torch.arange(L, device=x.device)
    visible = (pos + 1) // kp
    t0 = time.perf_counter()
    pools = indexer_topk(iq, iw, pool_k, visible, min(layer.topk // kp, pool_k.shape[1]), layer.tile_tokens,
                         index_dtype=torch.int32)  # fmt: skip
    _sync(device)
    t_topk = time.perf_counter() - t0
    sel = DSASelection(pools, pos, kp, layer.tail)
    t0 = time.perf_counter()
    layer._indexer_loss(q_abs, latent, sel, pos, iq, iw, pool_k).backward()
    _sync(device)
    return t_topk, time.perf_counter() - t0


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def worker(side: str, L: int, topk: int, shape: str, device: str) -> dict:
    """Run one (side, L) measurement in this process and return its numbers."""
    import torch
    from _memory import peak_rss_mib, rss_now_mib  # bench/_memory.py, beside this script

    from genoctx.model.stats import read_numbers

    torch.manual_seed(0)
    layer, step = _make(side, shape, topk, L, device)
    D = layer.o_proj.out_features
    step(torch.randn(1, 256, D, device=device, requires_grad=True))  # warm-up
    layer.zero_grad(set_to_none=True)
    x = torch.randn(1, L, D, device=device, requires_grad=True)
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = rss_now_mib()
    t0 = time.perf_counter()
    step(x)
    _sync(device)
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else peak_rss_mib()) - base
    stats = read_numbers([layer.stats])[0]  # device tensors until read (genoctx.model.stats)
    stats = stats if side == "dsa" else {**stats, "indexer": None}
    out = {"seconds": round(seconds, 3), "peak_mib": round(peak, 1), "stats": stats}
    if side == "dsa":
        t_topk, t_kl = _indexer_seconds(layer, x, device)
        out["indexer_topk_seconds"] = round(t_topk, 3)
        out["indexer_kl_seconds"] = round(t_kl, 3)
        out["indexer_share"] = round((t_topk + t_kl) / seconds, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--worker", choices=["dsa", "sdpa"], help=argparse.SUPPRESS)
    ap.add_argument("--L", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        import torch

        torch.set_num_threads(a.threads)
        print(json.dumps(worker(a.worker, a.L, a.topk, a.shape, a.device)))
        return
    prev = None
    for L in a.lengths:
        res = {}
        for side in ("dsa", "sdpa"):
            cmd = [sys.executable, __file__, "--worker", side, "--L", str(L), "--topk", str(a.topk)]
            cmd += ["--device", a.device, "--threads", str(a.threads), "--shape", a.shape]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode:
                res[side] = {"error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}
            else:
                res[side] = json.loads(p.stdout.strip().splitlines()[-1])
        line = {"bench": "dsa_vs_dense", "L": L, "device": a.device, "threads": a.threads, "shape": a.shape}
        line["topk"] = a.topk
        line.update(res)
        d, s = res["dsa"], res["sdpa"]
        if "peak_mib" in d and "peak_mib" in s and s["peak_mib"] > 0:
            line["mem_ratio_dsa_over_sdpa"] = round(d["peak_mib"] / s["peak_mib"], 2)
        if "seconds" in d and "seconds" in s:
            line["time_ratio_dsa_over_sdpa"] = round(d["seconds"] / s["seconds"], 2)
        if prev is not None and "seconds" in d and "seconds" in prev:
            line["dsa_time_growth_vs_prev_L"] = round(d["seconds"] / prev["seconds"], 2)
        prev = d
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
