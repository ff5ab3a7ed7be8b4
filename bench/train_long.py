"""Training speed on one long window of real DNA: tokens/s of train steps, one JSON line per case.

    .venv/bin/python bench/train_long.py --preset tiny --window 64k --steps 3          # tiny at 64k
    .venv/bin/python bench/train_long.py --preset tiny --window 1M --seq-chunk 64k --steps 1   # a 1M-token step

Prepares the embedded hg38 chr2 piece (chr2:1-2,333,275) into one window of ``--window`` tokens (k = 1024) in a
temporary directory, builds the preset (random init, fp32, one process, torch's default threads) and its AdamW
(``genoctx.train.loop.build_optimizer``), and runs ``--steps`` train steps (``genoctx.train.loop.train_step``: forward,
backward, clip, optimizer) on that window after one warm-up step on its first 1k tokens; with ``--seq-chunk`` the
window trains by the exact chunked backward (``train.seq_chunk_tokens``). Prints::

    {"bench": "train_long", "preset": "tiny", "window": 65536, "seq_chunk_tokens": null, "steps_s": [...],
     "step_s": <median>, "tokens_per_s": ..., "loss": ..., "planned_ops": ..., "threads": 2, "loadavg_1m": ...}

Progress lines go to stderr every step. ``planned_ops``: ``genoctx.plan.ops.step_ops`` of the step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--window", default="64k")
    ap.add_argument("--seq-chunk", default=None, help="train.seq_chunk_tokens (k/M suffixes)")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    from genoctx.heap import keep_freed_memory

    keep_freed_memory()  # as genoctx's CLI on a CPU (genoctx.heap)

    import torch

    from genoctx.data.dataset import WindowDataset
    from genoctx.data.windows import parse_size, prepare
    from genoctx.model.config import preset
    from genoctx.model.model import HybridLM
    from genoctx.plan.ops import step_ops
    from genoctx.recipes import TrainConfig
    from genoctx.train.loop import build_optimizer, train_step

    window = parse_size(a.window)
    chunk = parse_size(a.seq_chunk) if a.seq_chunk else None
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "chr2"
        prepare([REPO / "data/hg38/hg38_chr2_1-2333275.fa.gz"], data, window=window, train_chroms=[],
                eval_chroms=["chr2"], progress=False)  # fmt: skip
        x = WindowDataset(data, "eval")[0]["tokens"].long()[None, :window]
    cfg = preset(a.preset)
    torch.manual_seed(0)
    model = HybridLM(cfg, seed=0)
    tc = TrainConfig(steps=a.steps + 1, lr=1e-3, warmup_steps=1, seq_chunk_tokens=chunk, dtype="fp32")
    opt, sched = build_optimizer(model, tc, tc.steps)
    train_step(model, opt, sched, x[:, :1024], tc, nullcontext())
    steps, loss = [], None
    for i in range(a.steps):
        t0 = time.perf_counter()
        loss = train_step(model, opt, sched, x, tc, nullcontext())["loss"]
        steps.append(time.perf_counter() - t0)
        print(f"train_long: step {i + 1}/{a.steps} {steps[-1]:.1f} s", file=sys.stderr, flush=True)
    s = statistics.median(steps)
    print(json.dumps({"bench": "train_long", "preset": a.preset, "window": window, "seq_chunk_tokens": chunk,
                      "steps_s": [round(t, 2) for t in steps], "step_s": round(s, 2),
                      "tokens_per_s": round(window / s, 1), "loss": loss,
                      "planned_ops": step_ops(cfg, window, seq_chunk_tokens=chunk)["total"],
                      "threads": torch.get_num_threads(), "loadavg_1m": os.getloadavg()[0]}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
