"""Aten ops of a train step (and of an eval window), counted and planned, per component and pass.

    .venv/bin/python bench/op_count.py [--preset cpu-small] [--lengths 2048 8192] [--chunk N] [--eval] [--cp 2 --fsdp 2]
    .venv/bin/python bench/op_count.py --fit-bytes      # fit genoctx.plan.eager's tables (a maintainer's tool)
    .venv/bin/python bench/op_count.py --fit-cp-bytes   # ... and its CP_COEFS (the KDA layers' CP state pass)

Prints one JSON line per case::

    {"bench": "op_count", "preset": "cpu-small", "seq_len": 2048, "mode": "train", "counted": 7000,
     "planned": 7000, "forward_backward": 6500, "by_pass": {...}, "components": {comp: {pass: [counted, planned]}}}

Counted: ``genoctx.model.opcount.OpCounter`` over one ``genoctx.train.loop.train_step`` of the preset (fp32, one
process, random tokens, after one warm-up step that creates AdamW's state), or one no-grad forward of the window
(``--eval``); with ``--cp`` / ``--fsdp`` the busiest rank (the window's last piece) of that many gloo ranks
(``count_mesh``: FSDP2 over ``dp_shard x cp``, the CP scorer for ``--eval``). Planned: ``genoctx.plan.ops.step_ops`` /
``eval_ops``. ``forward_backward``: the forward, recompute
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


def mesh_rank(rank: int, world: int, init_file: str, out: str, preset: str, L: int, cp: int, dp_shard: int,
              mode: str = "train", overrides: dict | None = None) -> None:
    """One gloo rank of a ``dp_shard x cp`` mesh (``genoctx.parallel.mesh.init_parallel``, FSDP2 when ``dp_shard >
    1``): after a warm-up, one ``train_step`` under ``count_train_step`` (``mode`` "train") or one no-grad CP forward
    of the window (``genoctx.eval.distributed.mesh_scorer``, "eval") of ``preset`` at ``L`` tokens; the busiest rank
    (the last CP piece of data rank 0: rank ``cp - 1``) writes ``{"counts", "bytes", "total"}`` to ``out``."""
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from genoctx.model.config import preset as get_preset
    from genoctx.model.model import HybridLM
    from genoctx.model.opcount import OpCounter, count_train_step
    from genoctx.parallel.fsdp import apply_parallel
    from genoctx.parallel.mesh import init_parallel, leaving_mesh
    from genoctx.recipes import TrainConfig
    from genoctx.train.loop import build_optimizer, train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with leaving_mesh():
        dims = init_parallel(cp=cp, dp_shard=dp_shard)
        torch.manual_seed(0)
        model = HybridLM(get_preset(preset, **(overrides or {})), seed=0)
        apply_parallel(model, dims)
        x = torch.randint(3, 7, (dp_shard, L), generator=torch.Generator().manual_seed(L))[dims.dp_rank][None]
        if mode == "train":
            tc = TrainConfig(steps=4, lr=1e-3, warmup_steps=1, dtype="fp32")
            opt, sched = build_optimizer(model, tc, tc.steps)
            train_step(model, opt, sched, x[:, : 16 * cp], tc, nullcontext(), dims)
            c = count_train_step(model, opt, lambda: train_step(model, opt, sched, x, tc, nullcontext(), dims))
        else:
            from genoctx.eval.distributed import mesh_scorer

            score = mesh_scorer(model.eval(), dims, None, torch.device("cpu"))
            score(x[0, : 16 * cp].numpy())
            c = OpCounter(model)
            with c:
                score(x[0].numpy())
    if rank == cp - 1:
        counts = {k: dict(v) for k, v in c.counts.items()}
        moved = {k: {p: dict(kinds) for p, kinds in v.items()} for k, v in c.bytes.items()}
        torch.save({"counts": counts, "bytes": moved, "total": c.total}, Path(out))


def count_mesh(preset: str, L: int, cp: int, dp_shard: int = 1, mode: str = "train",
               overrides: dict | None = None) -> dict:  # fmt: skip
    """``mesh_rank``'s record of the busiest rank, its ``cp x dp_shard`` ranks spawned here (gloo, one thread each)."""
    import tempfile

    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "counted.pt")
        mp.start_processes(mesh_rank, args=(cp * dp_shard, str(Path(d) / "init"), out, preset, L, cp, dp_shard, mode,
                                            overrides), nprocs=cp * dp_shard, start_method="spawn")  # fmt: skip
        return torch.load(out)


def case(preset: str, L: int, chunk: int | None = None, mode: str = "train", cp: int = 1, fsdp: int = 1) -> dict:
    """One JSON line: counted and planned ops of ``preset`` at ``L`` tokens (``cp x fsdp`` > 1: the busiest rank of
    that mesh, ``count_mesh``; no ``chunk`` there)."""
    from genoctx.model.config import preset as get_preset
    from genoctx.parallel.layout import Layout
    from genoctx.plan.eager import KINDS, eval_bytes, step_bytes
    from genoctx.plan.ops import COMPONENTS, PASSES, eval_ops, step_ops

    cfg = get_preset(preset)
    lay = Layout(cp=cp, dp_shard=fsdp)
    if cp * fsdp > 1:
        r = count_mesh(preset, L, cp, fsdp, mode)
        counts = {k: {q: r["counts"].get(k, {}).get(q, 0) for q in PASSES} for k in COMPONENTS}
        moved = {k: sum(r["bytes"].get(x, {}).get(q, {}).get(k, 0) for x in COMPONENTS
                        for q in ("forward", "recompute", "backward")) for k in KINDS}  # fmt: skip
        total = r["total"]
    else:
        c = count_step(preset, L, chunk) if mode == "train" else count_eval(preset, L)
        counts, moved, total = c.counts, c.bytes_by_kind(("forward", "recompute", "backward")), c.total
    p = step_ops(cfg, L, lay, seq_chunk_tokens=chunk) if mode == "train" else eval_ops(cfg, L, lay)
    b = step_bytes(cfg, L, lay, seq_chunk_tokens=chunk) if mode == "train" else eval_bytes(cfg, L, lay)
    by = {q: sum(counts[k][q] for k in COMPONENTS) for q in PASSES}
    return {
        "bench": "op_count", "preset": preset, "seq_len": L, "seq_chunk_tokens": chunk, "mode": mode,
        "layout": lay.describe(), "counted": total, "planned": p["total"],
        "forward_backward": by["forward"] + by["recompute"] + by["backward"],
        "by_pass": {k: [by[k], p["by_pass"][k]] for k in PASSES},
        "components": {k: {q: [counts[k][q], p["components"][k][q]] for q in PASSES} for k in COMPONENTS},
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


def fit_cp_bytes(n_configs: int, seed: int = 11, cp: int = 2) -> dict:
    """``genoctx.plan.eager.CP_COEFS``: the bytes a KDA layer under CP moves beyond a one-process call over the same
    piece (its ``[L | M]`` state pass), per KDA layer and token of the piece, fitted over the KDA features to
    OpCounter's bytes of the busiest rank (``count_mesh``) of ``n_configs`` random configs at ``FIT_LENGTHS`` on
    ``cp`` ranks (least squares on relative errors); the worst and median relative error on stderr."""
    import random

    import numpy as np

    from genoctx.model.config import KDA
    from genoctx.model.config import preset as get_preset
    from genoctx.parallel.layout import Layout
    from genoctx.plan import eager

    rng = random.Random(seed)
    samples = []
    for _ in range(n_configs):
        ov = {k: rng.choice(v) for k, v in FIT_DIMS.items()}
        ov["num_key_value_heads"] = ov["num_attention_heads"]
        cfg = get_preset("tiny", **ov)
        for L in FIT_LENGTHS:
            moved = count_mesh("tiny", L, cp, 1, "train", ov)["bytes"]["kda"]
            base = eager.step_bytes(cfg, L, Layout(cp=cp), cp_state=False)["components"]["kda"]
            samples.append((cfg, L // cp, cfg.layer_types.count(KDA), moved, base))
            print(f"fit-cp-bytes: {ov} L={L}", file=sys.stderr, flush=True)
    table: dict = {}
    for p in eager.PASSES:
        for kind in eager.KINDS:
            X, y, names = [], [], []
            for cfg, T, n, moved, base in samples:
                f = eager.features(cfg, "kda", T)
                names = list(f)
                X.append([f[k] for k in names])
                y.append((moved.get(p, {}).get(kind, 0.0) - base[p][kind]) / (n * T))
            X, y = np.array(X, float), np.array(y, float)
            if not len(y) or np.abs(y).max() == 0:
                continue
            w = 1 / np.maximum(np.abs(y), np.abs(y).max() * 1e-3)
            coef = np.linalg.lstsq(X * w[:, None], y * w, rcond=None)[0]
            rel = np.abs(X @ coef - y) / np.maximum(np.abs(y), 1e-9)
            print(f"fit-cp-bytes: kda {p} {kind}: worst {rel.max():.3f}, median {np.median(rel):.3f}", file=sys.stderr)
            table.setdefault("kda", {}).setdefault(p, {})[kind] = {
                k: float(f"{v:.4g}") for k, v in zip(names, coef, strict=True) if abs(v) > 1e-9}
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--eval", action="store_true")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel ranks (gloo, spawned here): the busiest one")
    ap.add_argument("--fsdp", type=int, default=1, help="FSDP2 data-parallel shards (with --cp: dp_shard x cp ranks)")
    ap.add_argument("--fit-bytes", action="store_true", help="fit genoctx.plan.eager's tables and print them")
    ap.add_argument("--fit-configs", type=int, default=30)
    ap.add_argument("--fit-cp-bytes", action="store_true", help="fit genoctx.plan.eager.CP_COEFS and print it")
    a = ap.parse_args()
    if a.fit_cp_bytes:
        print(f"CP_COEFS: dict = {fit_cp_bytes(a.fit_configs)!r}")
        return
    if a.fit_bytes:
        t = fit_bytes(a.fit_configs)
        print(f"COEFS: dict = {t['train']!r}\nEVAL_COEFS: dict = {t['eval']!r}")
        return
    if a.chunk and a.cp * a.fsdp > 1:
        ap.error("--chunk with --cp/--fsdp: a mesh is counted unchunked (count_mesh)")
    for L in a.lengths:
        print(json.dumps(case(a.preset, L, a.chunk, "eval" if a.eval else "train", a.cp, a.fsdp)), flush=True)


if __name__ == "__main__":
    main()
