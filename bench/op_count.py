"""Aten ops of a train step (and of an eval window), counted and planned, per component and pass.

    .venv/bin/python bench/op_count.py [--preset cpu-small] [--lengths 2048 8192] [--chunk N] [--eval]
    .venv/bin/python bench/op_count.py --fit   # derive genoctx.plan.ops' tables from counts (a maintainer's tool)

Prints one JSON line per case::

    {"bench": "op_count", "preset": "cpu-small", "seq_len": 2048, "mode": "train", "counted": 7000,
     "planned": 7000, "forward_backward": 6500, "by_pass": {...}, "components": {comp: {pass: [counted, planned]}}}

Counted: ``genoctx.model.opcount.OpCounter`` over one ``genoctx.train.loop.train_step`` of the preset (fp32, one
process, random tokens, after one warm-up step that creates AdamW's state), or one no-grad forward of the window
(``--eval``). Planned: ``genoctx.plan.ops.step_ops`` / ``eval_ops``. ``forward_backward``: the forward, recompute
and backward passes (the step without its optimizer pass).

``--fit`` counts each preset at several lengths (and chunked) and solves, per component and pass, for the ops of one
loop body of each unit (``genoctx.plan.ops.OPS``), printing the tables to paste into genoctx/plan/ops.py; the
other lengths then check them (``tests/plan/test_ops.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def count_step(preset: str, L: int, chunk: int | None = None, overrides: dict | None = None):
    """OpCounter of one train step of ``preset`` at ``L`` tokens (``chunk``: ``train.seq_chunk_tokens``)."""
    import torch

    from genoctx.model.config import preset as get_preset
    from genoctx.model.model import HybridLM
    from genoctx.model.opcount import count_train_step
    from genoctx.recipes import TrainConfig
    from genoctx.train.loop import build_optimizer, train_step

    torch.manual_seed(0)
    cfg = get_preset(preset, **(overrides or {}))
    model = HybridLM(cfg, seed=0)
    tc = TrainConfig(steps=4, lr=1e-3, warmup_steps=1, seq_chunk_tokens=chunk, dtype="fp32")
    opt, sched = build_optimizer(model, tc, tc.steps)
    g = torch.Generator().manual_seed(L)
    x = torch.randint(3, 7, (1, L), generator=g)
    train_step(model, opt, sched, x[:, : min(L, 64)], tc, nullcontext())
    return count_train_step(model, opt, lambda: train_step(model, opt, sched, x, tc, nullcontext()))


def count_eval(preset: str, L: int, overrides: dict | None = None):
    """OpCounter of one no-grad forward of ``preset`` over ``L`` tokens."""
    import torch

    from genoctx.model.config import preset as get_preset
    from genoctx.model.model import HybridLM
    from genoctx.model.opcount import OpCounter

    cfg = get_preset(preset, **(overrides or {}))
    model = HybridLM(cfg, seed=0).eval()
    x = torch.randint(3, 7, (1, L), generator=torch.Generator().manual_seed(L))
    counter = OpCounter(model)
    with torch.no_grad(), counter:
        model(x)
    return counter


def case(preset: str, L: int, chunk: int | None = None, mode: str = "train") -> dict:
    """One JSON line: counted and planned ops of ``preset`` at ``L`` tokens."""
    from genoctx.model.config import preset as get_preset
    from genoctx.plan.ops import COMPONENTS, PASSES, eval_ops, step_ops

    cfg = get_preset(preset)
    c = count_step(preset, L, chunk) if mode == "train" else count_eval(preset, L)
    p = step_ops(cfg, L, seq_chunk_tokens=chunk) if mode == "train" else eval_ops(cfg, L)
    by = c.by_pass()
    return {
        "bench": "op_count", "preset": preset, "seq_len": L, "seq_chunk_tokens": chunk, "mode": mode,
        "counted": c.total, "planned": p["total"],
        "forward_backward": by["forward"] + by["recompute"] + by["backward"],
        "by_pass": {k: [by[k], p["by_pass"][k]] for k in PASSES},
        "components": {k: {q: [c.counts[k][q], p["components"][k][q]] for q in PASSES} for k in COMPONENTS},
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--eval", action="store_true")
    a = ap.parse_args()
    for L in a.lengths:
        print(json.dumps(case(a.preset, L, a.chunk, "eval" if a.eval else "train")), flush=True)


if __name__ == "__main__":
    main()
