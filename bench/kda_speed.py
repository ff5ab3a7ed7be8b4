"""Forward+backward time of the chunked KDA core vs the token-by-token recurrence; prints one JSON line.

    .venv/bin/python bench/kda_speed.py [--length 8192] [--repeats 2]

Shapes: B = 1, H = 4, K = V = 32, fp32, chunk 64, on CPU with 2 threads (the shared dev machine).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from genoctx.model.kda import chunk_kda
from genoctx.model.reference import recurrent_kda


def _fwd_bwd_seconds(fn, inputs, **kw) -> float:
    for x in inputs:
        x.grad = None
    t0 = time.perf_counter()
    o, S = fn(*inputs[:5], initial_state=inputs[5], **kw)
    (o.sum() + S.sum()).backward()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each (best of)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, T, H, K, V = 1, args.length, 4, 32, 32
    inputs = [
        torch.randn(B, T, H, K),
        F.normalize(torch.randn(B, T, H, K), dim=-1),
        torch.randn(B, T, H, V),
        -torch.rand(B, T, H, K),
        torch.rand(B, T, H),
        torch.randn(B, H, K, V),
    ]
    for x in inputs:
        x.requires_grad_(True)
    start = time.perf_counter()
    _fwd_bwd_seconds(chunk_kda, inputs, chunk_size=64)  # warm-up
    chunk_s = recurrent_s = float("inf")
    runs = 0
    # interleaved, best of each, so both see the same machine load; on a loaded machine stop after one
    # pair once a minute has passed (keeps the whole bench under ~3 minutes)
    while runs < args.repeats and (runs == 0 or time.perf_counter() - start < 60):
        chunk_s = min(chunk_s, _fwd_bwd_seconds(chunk_kda, inputs, chunk_size=64))
        recurrent_s = min(recurrent_s, _fwd_bwd_seconds(recurrent_kda, inputs))
        runs += 1
    print(
        json.dumps(
            {
                "bench": "kda_speed",
                "length": T,
                "batch": B,
                "heads": H,
                "head_dim": K,
                "dtype": "float32",
                "device": "cpu",
                "threads": args.threads,
                "runs": runs,
                "chunk_fwd_bwd_s": round(chunk_s, 4),
                "recurrent_fwd_bwd_s": round(recurrent_s, 4),
                "speedup": round(recurrent_s / chunk_s, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
