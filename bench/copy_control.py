"""A positive control for context use: can the model learn to copy when copying is easy? Prints one JSON line.

Writes synthetic DNA in which half the bases are copies (segments of 100-300 bases, each either fresh uniform random
bases or a copy of the bases 64-1000 positions before it, tandem when the distance is shorter than the segment): a
model that copies predicts the copied half almost free, so its loss can fall from ln 4 = 1.386 nats towards 0.7;
a model without context stays at ln 4. Prepares it into 2k windows (train chrS, 1 Mb; held out chrT, 128 kb),
trains ``cpu-small`` with the demo's recipe on whole windows (``--steps``, 2 windows per step), then runs
``genoctx eval --copy-probe`` on the held-out windows. Reports the training loss over the last 10 steps, the
held-out loss and the probe's reach; everything is seeded.

    .venv/bin/python bench/copy_control.py              # 150 steps, about 8 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
GENOCTX = [sys.executable, "-m", "genoctx"]


def synthetic(n: int, seed: int, copy_fraction: float = 0.5) -> str:
    """``n`` bases: segments of 100-300 bases, each a copy of the bases 64-1000 before it with probability
    ``copy_fraction`` (once 1,100 bases exist), else uniform random."""
    rng = np.random.default_rng(seed)
    buf = np.zeros(n + 300, dtype=np.int8)
    at = 0
    while at < n:
        length = int(rng.integers(100, 300))
        if at > 1100 and rng.random() < copy_fraction:
            d = int(rng.integers(64, 1000))
            for i in range(length):  # base by base: a distance shorter than the segment continues the copy
                buf[at + i] = buf[at + i - d]
        else:
            buf[at : at + length] = rng.integers(0, 4, length)
        at += length
    return "".join("ACGT"[x] for x in buf[:n])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="genoctx-copy-control-") as tmp:
        tmp = Path(tmp)
        fasta = tmp / "synthetic.fa"
        with fasta.open("w") as f:
            for name, n, seed in (("chrS", 1_000_000, 1), ("chrT", 64 * 2048, 2)):
                seq = synthetic(n, seed)
                f.write(f">{name}\n" + "\n".join(seq[i : i + 60] for i in range(0, n, 60)) + "\n")
        run = dict(cwd=REPO, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        subprocess.run([*GENOCTX, "prepare", "--out", str(tmp / "data"), "--window", "2k", "--chroms", "chrS",
                        "--eval-chroms", "chrT", "--fasta", str(fasta)], **run)  # fmt: skip
        t0 = time.perf_counter()
        subprocess.run([*GENOCTX, "train", "--data", str(tmp / "data"), "--recipe", "recipes/cpu-small.yaml",
                        "--out", str(tmp / "run"), "--steps", str(args.steps), "--set", "train.seq_len=null",
                        "--set", "train.batch_size=2", "--set", f"train.seed={args.seed}",
                        "--set", f"train.checkpoint_every={args.steps}"], **run)  # fmt: skip
        train_s = time.perf_counter() - t0
        metrics = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
        losses = [m["loss"] for m in metrics if "loss" in m and "step" in m]
        probe = [*GENOCTX, "eval", "--by-position", "--data", str(tmp / "data"), "--checkpoint", str(tmp / "run"),
                 "--copy-probe", "--copy-distances", "6", "--format", "json"]  # fmt: skip
        doc = json.loads(subprocess.run(probe, **run).stdout)
    model = doc["models"][0]
    print(json.dumps({
        "bench": "copy_control", "model": "cpu-small", "copy_fraction": 0.5, "window": 2048, "steps": args.steps,
        "tokens_trained": args.steps * 2 * 2048, "train_seconds": round(train_s, 1),
        "train_loss_last10": round(float(np.mean(losses[-10:])), 4), "uniform_loss": round(float(np.log(4)), 4),
        "eval_loss": round(doc["overall"]["loss"], 4), "reach": model["copy_probe"]["reach"],
        "gain_by_distance": {r["distance"]: round(r["gain"], 4) for r in model["copy_probe"]["rows"]},
    }))  # fmt: skip


if __name__ == "__main__":
    main()
