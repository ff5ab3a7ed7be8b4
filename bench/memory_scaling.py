"""Peak memory of one forward+backward of the ``cpu-small`` model by sequence length; one JSON line per L.

    .venv/bin/python bench/memory_scaling.py [--lengths 8192 16384 32768 65536] [--threads 2]
        [--recompute] [--kda-block-tokens N] [--seq-chunk N]

Prints, per length L::

    {"bench": "memory_scaling", "L": 65536, "preset": "cpu-small", "peak_mib": ..., "seconds": ...,
     "mib_per_1k_tokens": ..., "growth_vs_prev_L": ...}

Method (as ``bench/dsa_vs_dense.py``):

- Input: real DNA (the embedded hg38 chr22 piece, ``data/hg38``), ``<bos>`` + the first L - 1 bases, batch 1.
- Step: ``HybridLM(preset("cpu-small"))`` forward over the whole L tokens in one pass (no chunking, no
  activation checkpointing beyond the model's own: MoE chunks are recomputed in backward), next-token
  cross-entropy + the auxiliary losses (indexer KL), backward. fp32.
- ``--recompute``: each decoder layer recomputed in backward (``apply_ac``, as ``train.activation_checkpointing``).
  ``--kda-block-tokens N``: the KDA core's block (``ModelConfig.kda_block_tokens``; 0 = the whole sequence in one
  block, the core before blocks): the core's working set, forward and recomputed backward, is one block's.
- ``--seq-chunk N``: the window trained as chunks of N tokens by the exact chunked backward
  (``genoctx.train.chunked``, as ``train.seq_chunk_tokens``). The line adds ``growth_bytes_per_token``: the
  peak's growth per added token since the previous L (``(peak_L - peak_prev) / (L - L_prev)``), which is the
  state crossing chunk boundaries once the chunk's own working set is the same, and
  ``planned_boundary_bytes_per_token``, the planner's formula for that state (``genoctx.plan.seq_chunk_boundary_bytes``:
  the DSA latents and pooled indexer keys of every token with their gradient buffers, the KDA states per boundary).
  Its workers run with ``MALLOC_MMAP_THRESHOLD_=131072``: with glibc's dynamic threshold the growing caches of
  successive chunks are freed into the heap and the peak RSS counts that fragmentation (measured: 3382 instead of
  1117 bytes per token from 32k to 64k with 8k chunks).
- Each L runs in a fresh subprocess. Peak memory on CPU is ``ru_maxrss`` (the process's peak resident set)
  after the step minus the resident set just before it (model, optimizer-free, inputs allocated; a warm-up
  step at 512 tokens has loaded kernels). On CUDA: ``torch.cuda.max_memory_allocated()`` minus the
  allocation before the step.

Target (issue 4, DESIGN.md performance rules): memory grows linearly with L: 32k -> 64k at most 2.2x.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]



def _tokens(L: int):
    import torch

    from genoctx.data.tokenizer import BOS, encode

    text = (REPO / "data" / "hg38" / "hg38_chr22_32000001-32300000.fa").read_text().split("\n", 1)[1]
    seq = text.replace("\n", "")
    seq = (seq * (L // len(seq) + 1))[:L]
    tokens = torch.from_numpy(encode(seq)[0].astype("int64"))[None]
    inputs = torch.cat([torch.full_like(tokens[:, :1], BOS), tokens[:, :-1]], dim=1)
    return inputs, tokens


def worker(L: int, preset_name: str, device: str, recompute: bool = False, kda_block_tokens: int | None = None,
           seq_chunk: int | None = None) -> dict:
    """One forward+backward at length L in this process; returns its time and peak memory."""
    import torch
    import torch.nn.functional as F
    from _memory import peak_rss_mib, rss_now_mib  # bench/_memory.py, beside this script

    from genoctx.model.config import preset
    from genoctx.model.model import HybridLM
    from genoctx.parallel.fsdp import apply_ac

    torch.manual_seed(0)
    cfg = preset(preset_name)
    if kda_block_tokens is not None:
        cfg.kda_block_tokens = kda_block_tokens or 1 << 40  # 0: one block
    model = HybridLM(cfg).to(device)
    if recompute:
        apply_ac(model)

    def step(inputs, targets):
        if seq_chunk:
            from genoctx.train.chunked import chunked_forward_backward

            scored = torch.ones_like(targets, dtype=torch.bool)
            chunked_forward_backward(model, inputs.to(device), targets.to(device), scored.to(device), seq_chunk,
                                     scored.sum())  # fmt: skip
            return
        logits, _ = model(inputs.to(device))
        loss = F.cross_entropy(logits.flatten(0, 1), targets.to(device).flatten())
        aux = model.aux_loss()
        (loss if aux is None else loss + aux).backward()

    step(*_tokens(512))  # warm-up: loads kernels
    model.zero_grad(set_to_none=False)  # gradient buffers stay allocated: they are not part of the peak
    inputs, targets = _tokens(L)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = rss_now_mib()
    t0 = time.perf_counter()
    step(inputs, targets)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else peak_rss_mib()) - base
    out = {"seconds": round(seconds, 2), "peak_mib": round(peak, 1)}
    if seq_chunk:
        from genoctx.plan import seq_chunk_boundary_bytes

        out["planned_boundary_bytes_per_token"] = round(seq_chunk_boundary_bytes(cfg, seq_chunk, rows=1, a=4), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--recompute", action="store_true", help="recompute each decoder layer in backward")
    ap.add_argument("--kda-block-tokens", type=int, help="KDA core block in tokens (0: one block); default: model's")
    ap.add_argument("--seq-chunk", type=int, help="train the window in chunks of N tokens (train.seq_chunk_tokens)")
    ap.add_argument("--worker-L", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker_L:
        import torch

        torch.set_num_threads(a.threads)
        print(json.dumps(worker(a.worker_L, a.preset, a.device, a.recompute, a.kda_block_tokens, a.seq_chunk)))
        return
    prev = None
    for L in a.lengths:
        cmd = [sys.executable, __file__, "--worker-L", str(L), "--preset", a.preset, "--device", a.device]
        cmd += ["--threads", str(a.threads)] + (["--recompute"] if a.recompute else [])
        if a.kda_block_tokens is not None:
            cmd += ["--kda-block-tokens", str(a.kda_block_tokens)]
        if a.seq_chunk:
            cmd += ["--seq-chunk", str(a.seq_chunk)]
        env = dict(os.environ)
        if a.seq_chunk:  # a fixed mmap threshold: freed large blocks go back to the OS, so RSS tracks live bytes
            env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = {"bench": "memory_scaling", "L": L, "preset": a.preset, "device": a.device, "threads": a.threads,
                "recompute": a.recompute, "kda_block_tokens": a.kda_block_tokens, "seq_chunk": a.seq_chunk}
        if p.returncode:
            err = p.stderr.strip().splitlines()
            line["error"] = err[-1] if err else p.returncode
        else:
            res = json.loads(p.stdout.strip().splitlines()[-1])
            line.update(res)
            line["mib_per_1k_tokens"] = round(res["peak_mib"] / (L / 1024), 2)
            if prev is not None:
                line["growth_vs_prev_L"] = round(res["peak_mib"] / prev["peak_mib"], 2)
                if a.seq_chunk:
                    grown = (res["peak_mib"] - prev["peak_mib"]) * 2**20 / (L - prev["L"])
                    line["growth_bytes_per_token"] = round(grown, 1)
            prev = {**res, "L": L}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
