"""What checkpoint digests cost: xxh3_64 hashing of a checkpoint's files vs the time to save it; prints one JSON line.

A cpu-small model widened to a few hundred MB of fp32 weights (``--experts`` routed experts of
``--moe-intermediate-size`` channels in each of its 3 MoE layers), its AdamW state filled by one step (exp_avg and
exp_avg_sq: twice the weights again), is saved with ``genoctx.train.checkpoint.save_checkpoint`` into a temporary run
directory, ``--repeats`` times:

- ``save_s``: the save as genoctx does it (safetensors, optimizer.pt, recipe.yaml, each file read back and hashed,
  state.json, rename), median (after one warm-up save);
- ``save_without_digests_s``: the same save with the hashing left out (``digest_files`` replaced by a no-op), median,
  interleaved with the former;
- ``hash_s``: ``digest_files`` of the saved files alone (the read-back: from the page cache, as right after a save),
  median, and ``hash_gb_per_s`` (10^9 bytes);
- ``verify_s``: ``genoctx verify``'s check of the saved checkpoint (``genoctx.train.integrity.check_checkpoint``);
- ``sha256_s``: hashlib's sha256 of the same files, for scale (a cryptographic hash, not used).

``hash_over_save`` = ``hash_s / save_without_digests_s``: the share of a save the digests add (the target: well
under 1).

    .venv/bin/python bench/verify.py                   # 32 experts x 1024: ~150 MB of weights, ~450 MB on disk
    .venv/bin/python bench/verify.py --experts 64      # twice that
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import genoctx.train.checkpoint as checkpoint  # noqa: E402
from genoctx.model.config import preset  # noqa: E402
from genoctx.parallel.build import build_model  # noqa: E402
from genoctx.recipes import Recipe, TrainConfig  # noqa: E402
from genoctx.train.integrity import check_checkpoint  # noqa: E402
from genoctx.train.loop import build_optimizer  # noqa: E402

FILES = ("model.safetensors", "optimizer.pt", "recipe.yaml")


def _sha256(paths) -> None:
    for p in paths:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while block := f.read(checkpoint.BLOCK):
                h.update(block)


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=32, help="routed experts per MoE layer")
    ap.add_argument("--moe-intermediate-size", type=int, default=1024, help="channels of each routed expert")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = dataclasses.replace(preset("cpu-small"), n_routed_experts=args.experts,
                              moe_intermediate_size=args.moe_intermediate_size)  # fmt: skip
    model = build_model(cfg)
    tc = TrainConfig(steps=1)
    opt, sched = build_optimizer(model, tc, 1)
    for p in model.parameters():  # one step of zero gradients: AdamW's exp_avg and exp_avg_sq exist
        p.grad = torch.zeros_like(p)
    opt.step()
    recipe = Recipe(model=cfg, train=tc)
    real = checkpoint.digest_files
    with tempfile.TemporaryDirectory(prefix="genoctx-verify-bench-") as tmp:
        run = Path(tmp) / "run"
        step = iter(range(1, 10_000))

        def save():
            return checkpoint.save_checkpoint(run, next(step), model, opt, sched, recipe, {}, keep=1)

        def bare():
            checkpoint.digest_files = lambda root, names: {}
            try:
                return save()
            finally:
                checkpoint.digest_files = real

        save()  # warm-up (first writes, lazy imports)
        times = {"save": [], "bare": []}
        for _ in range(args.repeats):  # interleaved: a busy machine slows both alike
            for name, fn in (("save", save), ("bare", bare)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        save_s, bare_s = statistics.median(times["save"]), statistics.median(times["bare"])
        ck = save()
        paths = [ck / n for n in FILES]
        total = sum(p.stat().st_size for p in paths)
        hash_s = _median_time(lambda: real(ck, FILES), args.repeats)
        verify_s = _median_time(lambda: check_checkpoint(ck), args.repeats)
        sha_s = _median_time(lambda: _sha256(paths), args.repeats)
        assert check_checkpoint(ck)["ok"]
    weights = sum(t.numel() * t.element_size() for t in checkpoint.model_tensors(model).values())
    print(json.dumps({
        "bench": "verify",
        "model": f"cpu-small, {args.experts} experts x {args.moe_intermediate_size}",
        "weights_mb": round(weights / 1e6, 1),
        "checkpoint_mb": round(total / 1e6, 1),
        "save_s": round(save_s, 3),
        "save_without_digests_s": round(bare_s, 3),
        "hash_s": round(hash_s, 3),
        "hash_gb_per_s": round(total / 1e9 / hash_s, 2),
        "verify_s": round(verify_s, 3),
        "sha256_s": round(sha_s, 3),
        "hash_over_save": round(hash_s / bare_s, 3),
        "repeats": args.repeats,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
