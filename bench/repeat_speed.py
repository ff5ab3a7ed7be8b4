"""How fast does the repeat reference (``eval --reference repeat``) score real DNA? One JSON line per window size.

Prepares the embedded hg38 pieces (``data/hg38/``) with chr2:1-2,333,275 held out (the only soft-masked piece, 36%
repeats) and chr1 + chr22 as the training split, at 16k and 512k windows, fits the reference (its static
order-10 chain on the training split) and times ``RepeatModel.token_losses`` over every held-out window, one
process, one core (numba compiles once before the clock starts). Prints bases per second, the time it implies for
chr22's ~39M scored bases, and the process's peak resident memory (bounded by the window: the kernel's tables are
fixed, 64 MiB of occurrence heads at k = 12 plus 4 bytes per base of the window).

    .venv/bin/python bench/repeat_speed.py            # about 1 minute on a laptop core
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from genoctx.data.dataset import WindowDataset  # noqa: E402
from genoctx.eval.repeat import fit_repeat, score_window  # noqa: E402

CHR22_BASES = 39_159_782  # hg38 chr22 ungapped (non-N) length, of 50,818,468
FASTA = ["hg38_chr1_1-1000000.fa.gz", "hg38_chr2_1-2333275.fa.gz", "hg38_chr22_32000001-32300000.fa"]


def prepare(out: Path, window: str) -> None:
    """``genoctx prepare`` of the embedded pieces: chr1 + chr22 train, chr2 held out (partial last windows kept:
    chr22's piece is shorter than 512k)."""
    cmd = [sys.executable, "-m", "genoctx", "prepare", "--out", str(out), "--window", window, "--chroms",
           "chr1,chr22", "--eval-chroms", "chr2", "--keep-partial"]  # fmt: skip
    for f in FASTA:
        cmd += ["--fasta", str(ROOT / "data" / "hg38" / f)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", default="16k,512k", help="window sizes to prepare and time")
    args = ap.parse_args()
    score_window(np.zeros(64, dtype=np.int64), np.full((64, 4), 0.25))  # compile (or load the cache) first
    with tempfile.TemporaryDirectory() as tmp:
        for window in args.windows.split(","):
            data = Path(tmp) / window
            prepare(data, window)
            model = fit_repeat(data)
            ds = WindowDataset(data, "eval")
            wins = [ds[i]["tokens"].numpy() for i in range(len(ds))]
            bases = int(sum(((w >= 0) & (w <= 3)).sum() for w in wins))
            t0 = time.perf_counter()
            for w in wins:
                model.token_losses(w)
            dt = time.perf_counter() - t0
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            print(json.dumps({"bench": "repeat_speed", "window": ds.window, "windows": len(wins), "bases": bases,
                              "seconds": round(dt, 2), "bases_per_s": round(bases / dt),
                              "chr22_minutes": round(CHR22_BASES / (bases / dt) / 60, 1),
                              "max_rss_mib": round(rss)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
