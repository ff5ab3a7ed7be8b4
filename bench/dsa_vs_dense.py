"""One DSA layer vs torch SDPA causal attention: forward+backward time and peak memory by sequence length.

Prints one JSON line per length L (default 8192, 16384, 32768)::

    {"bench": "dsa_vs_dense", "L": 8192, "device": "cpu", "dsa": {...}, "sdpa": {...},
     "mem_ratio_dsa_over_sdpa": ..., ...}

Both sides use the same shapes: d_model 1024, 16 query heads of 64, one shared key/value head (MQA), fp32,
batch 1, with the same q/k/v/o projections. The DSA side is ``DeepSeekSparseAttention`` (indexer 4 heads of
32, top-k 2048, indexer KL loss of the sparse stage included, as in training); the SDPA side replaces the
indexer + sparse attention by ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``.

Method:
- Each (side, L) runs in a fresh subprocess, so one run's allocations cannot hide in another's.
- Time: wall clock of one forward+backward (``y.sum() [+ aux_loss]).backward()``), after a warm-up
  forward+backward at a short length (256) that loads kernels. CPU threads: ``--threads`` (default 1 on
  CPU: on a machine shared with other jobs, 2+ OpenMP threads slow down 5-8x when a core is taken away).
  Lengths run in increasing order in order.
- Peak memory on CPU: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (the process's peak resident set, which
  torch allocations are part of; tracemalloc cannot see them) read after the step, minus the resident set
  read just before the step (inputs and weights already allocated). The warm-up is short (256 tokens) so
  that little freed-but-retained heap sits in the resident set before the step (it would hide part of the
  step's peak). Allocator retention and fragmentation make this a +-10% measure. On CUDA:
  ``torch.cuda.max_memory_allocated()`` minus the allocation before the step.
- Indexer share: time of the DSA forward+backward with the indexer's top-k and KL loss measured apart by
  wall clock (``indexer_topk`` once + the KL forward/backward) divided by the layer's total.

Targets (DESIGN.md performance rules): DSA peak memory within 2x of SDPA's; DSA time growth 16k -> 32k at most
2.5x (the indexer is O(L^2) but cheap per pair; attention is O(L x top-k)).

Usage: ``python bench/dsa_vs_dense.py [--lengths 8192 16384 32768] [--device cpu|cuda] [--topk 2048]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def _make(side: str, topk: int, device: str):
    import torch.nn.functional as F

    from genoctx.model.config import ModelConfig
    from genoctx.model.dsa import DeepSeekSparseAttention

    cfg = ModelConfig(
        d_model=1024, dsa_heads=16, dsa_kv_heads=1, dsa_head_dim=64, index_heads=4, index_head_dim=32,
        index_topk=topk, indexer_stage="sparse",
    )  # fmt: skip
    layer = DeepSeekSparseAttention(cfg).to(device)
    if side == "dsa":

        def step(x):
            y, _ = layer(x)
            (y.sum() + layer.aux_loss).backward()

        return layer, step

    def step(x):  # same projections, dense causal SDPA in place of indexer + sparse attention
        B, T, _ = x.shape
        q = layer.q_proj(x).view(B, T, 16, 64).transpose(1, 2)
        k = layer.k_proj(x).view(B, T, 1, 64).transpose(1, 2)
        v = layer.v_proj(x).view(B, T, 1, 64).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        layer.o_proj(o.transpose(1, 2).reshape(B, T, 1024)).sum().backward()

    return layer, step


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def worker(side: str, L: int, topk: int, device: str) -> dict:
    """Run one (side, L) measurement in this process and return its numbers."""
    import torch
    from _memory import peak_rss_mib, rss_now_mib  # bench/_memory.py, beside this script

    from genoctx.model.dsa import indexer_topk

    torch.manual_seed(0)
    layer, step = _make(side, topk, device)
    step(torch.randn(1, 256, 1024, device=device, requires_grad=True))  # warm-up
    layer.zero_grad(set_to_none=True)
    x = torch.randn(1, L, 1024, device=device, requires_grad=True)
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
    out = {"seconds": round(seconds, 3), "peak_mib": round(peak, 1)}
    if side == "dsa":
        out["stats"] = layer.stats
        iq, iw, ik = layer.indexer_inputs(x)
        t0 = time.perf_counter()
        idx = indexer_topk(iq, iw, ik, 0, topk, layer.tile_tokens)
        _sync(device)
        t_topk = time.perf_counter() - t0
        q = layer.q_proj(x).view(1, L, 16, 64).detach()
        k = layer.k_proj(x).view(1, L, 1, 64).detach()
        t0 = time.perf_counter()
        loss = layer._indexer_loss(q, k, idx, 0, iq, iw, ik, 64**-0.5)
        loss.backward()
        _sync(device)
        t_kl = time.perf_counter() - t0
        out["indexer_topk_seconds"] = round(t_topk, 3)
        out["indexer_kl_seconds"] = round(t_kl, 3)
        out["indexer_share"] = round((t_topk + t_kl) / seconds, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--worker", choices=["dsa", "sdpa"], help=argparse.SUPPRESS)
    ap.add_argument("--L", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        import torch

        torch.set_num_threads(a.threads)
        print(json.dumps(worker(a.worker, a.L, a.topk, a.device)))
        return
    prev = None
    for L in a.lengths:
        res = {}
        for side in ("dsa", "sdpa"):
            cmd = [sys.executable, __file__, "--worker", side, "--L", str(L), "--topk", str(a.topk)]
            cmd += ["--device", a.device, "--threads", str(a.threads)]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode:
                res[side] = {"error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}
            else:
                res[side] = json.loads(p.stdout.strip().splitlines()[-1])
        line = {"bench": "dsa_vs_dense", "L": L, "device": a.device, "threads": a.threads, "topk": a.topk}
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
