"""Aten ops of a train step (and of an eval window), counted and planned, per component and pass.

    .venv/bin/python bench/op_count.py [--preset cpu-small] [--lengths 2048 8192] [--chunk N] [--eval]
    .venv/bin/python bench/op_count.py --fit-bytes   # fit genoctx.plan.eager's tables (a maintainer's tool)

Prints one JSON line per case::

    {"bench": "op_count", "preset": "cpu-small", "seq_len": 2048, "mode": "train", "counted": 7000,
     "planned": 7000, "forward_backward": 6500, "by_pass": {...}, "components": {comp: {pass: [counted, planned]}}}

Counted: ``genoctx.model.opcount.OpCounter`` over one ``genoctx.train.loop.train_step`` of the preset (fp32, one
process, random tokens, after one warm-up step that creates AdamW's state), or one no-grad forward of the window
(``--eval``). Planned: ``genoctx.plan.ops.step_ops`` / ``eval_ops``. ``forward_backward``: the forward, recompute
and backward passes (the step without its optimizer pass).

Each line also gives the bytes the eager ops move, ``"bytes": {kind: [counted, planned]}`` (OpCounter's
``bytes``, ``genoctx.plan.eager.step_bytes`` / ``eval_bytes``; kinds elementwise, gather, matmul).

``--fit-bytes`` counts train steps and no-grad forwards of ``--fit-configs`` random small configs (tiny with its
dims drawn from ``FIT_DIMS``, seeded) at 256, 1024 and 2048 tokens and solves, per component, pass and kind, for
``genoctx.plan.eager``'s coefficients (least squares on relative errors, by numpy), printing ``COEFS`` and
``EVAL_COEFS`` to paste into genoctx/plan/eager.py with the worst relative error of each fit on stderr; tiny and
cpu-small, not among the fitted configs, then check them (``tests/plan/test_ops.py``). About a minute.
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
    from genoctx.plan.eager import KINDS, eval_bytes, step_bytes

    b = step_bytes(cfg, L, seq_chunk_tokens=chunk) if mode == "train" else eval_bytes(cfg, L)
    moved = c.bytes_by_kind(("forward", "recompute", "backward"))
    by = c.by_pass()
    return {
        "bench": "op_count", "preset": preset, "seq_len": L, "seq_chunk_tokens": chunk, "mode": mode,
        "counted": c.total, "planned": p["total"],
        "forward_backward": by["forward"] + by["recompute"] + by["backward"],
        "by_pass": {k: [by[k], p["by_pass"][k]] for k in PASSES},
        "components": {k: {q: [c.counts[k][q], p["components"][k][q]] for q in PASSES} for k in COMPONENTS},
        "bytes": {k: [moved[k], round(b["by_kind"][k])] for k in KINDS},
    }  # fmt: skip


# the dims ``--fit-bytes`` draws a config's from (each uniformly), over tiny's
FIT_DIMS = {
    "hidden_size": [32, 48, 64, 96], "hc_mult": [1, 2, 3, 4], "linear_num_heads": [1, 2, 4],
    "linear_head_dim": [8, 16, 32], "kda_chunk_size": [16, 32, 64], "num_attention_heads": [1, 2, 4],
    "kv_lora_rank": [16, 32, 64], "q_lora_rank": [16, 24, 48], "qk_nope_head_dim": [8, 16], "v_head_dim": [8, 16],
    "index_topk": [16, 32, 64, 128], "index_kpool": [1, 2, 4, 8], "index_n_heads": [1, 2, 4],
    "index_head_dim": [8, 16], "n_routed_experts": [4, 8], "num_experts_per_tok": [1, 2],
    "moe_intermediate_size": [16, 32], "intermediate_size": [32, 64, 96], "hc_sinkhorn_iters": [5, 10, 20],
    "moe_chunk_tokens": [32, 64, 256, 1024, 4096], "n_shared_experts": [1, 2],
}  # fmt: skip
FIT_LENGTHS = (256, 1024, 2048)


def fit_bytes(n_configs: int, seed: int = 7) -> dict:
    """``{"train": COEFS, "eval": EVAL_COEFS}`` fitted to OpCounter's bytes of ``n_configs`` random configs (module
    docstring); the worst and median relative error of each fit on stderr."""
    import random

    import numpy as np

    from genoctx.model.config import preset as get_preset
    from genoctx.plan import eager

    rng = random.Random(seed)
    configs = []
    for _ in range(n_configs):
        ov = {k: rng.choice(v) for k, v in FIT_DIMS.items()}
        ov["num_key_value_heads"] = ov["num_attention_heads"]
        configs.append(ov)
    out = {}
    for mode, passes in (("train", ("forward", "recompute", "backward")), ("eval", ("forward",))):
        samples = []
        for ov in configs:
            for L in FIT_LENGTHS:
                c = count_step("tiny", L, overrides=ov) if mode == "train" else count_eval("tiny", L, overrides=ov)
                samples.append((get_preset("tiny", **ov), L, c.bytes))
        table: dict = {}
        for comp in eager.COMPONENTS:
            for p in passes:
                for kind in eager.KINDS:
                    X, y, names = [], [], []
                    for cfg, L, moved in samples:
                        n = dict(eager._instances(cfg))[comp]
                        if n:
                            f = eager.features(cfg, comp, L)
                            names = list(f)
                            X.append([f[k] for k in names])
                            y.append(moved[comp][p][kind] / (n * L))
                    X, y = np.array(X, float), np.array(y, float)
                    if not len(y) or y.max() == 0:
                        continue
                    w = 1 / np.maximum(y, y.max() * 1e-3)  # relative errors, near-zero samples not blown up
                    coef = np.linalg.lstsq(X * w[:, None], y * w, rcond=None)[0]
                    rel = np.abs(X @ coef - y) / np.maximum(y, 1e-9)
                    print(f"fit-bytes: {mode} {comp} {p} {kind}: worst {rel.max():.3f}, median {np.median(rel):.3f}",
                          file=sys.stderr)  # fmt: skip
                    kept = {k: float(f"{v:.4g}") for k, v in zip(names, coef, strict=True) if abs(v) > 1e-9}
                    table.setdefault(comp, {}).setdefault(p, {})[kind] = kept
        out[mode] = table
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--eval", action="store_true")
    ap.add_argument("--fit-bytes", action="store_true", help="fit genoctx.plan.eager's tables and print them")
    ap.add_argument("--fit-configs", type=int, default=30)
    a = ap.parse_args()
    if a.fit_bytes:
        t = fit_bytes(a.fit_configs)
        print(f"COEFS: dict = {t['train']!r}\nEVAL_COEFS: dict = {t['eval']!r}")
        return
    for L in a.lengths:
        print(json.dumps(case(a.preset, L, a.chunk, "eval" if a.eval else "train")), flush=True)


if __name__ == "__main__":
    main()
