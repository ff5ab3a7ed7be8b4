"""`genoctx prepare` speed and memory on a >= 200 Mb gzip FASTA built from real hg38; prints one JSON line.

    .venv/bin/python bench/prepare.py [--copies 108] [--window 512k] [--repeat 3] [--keep DIR]

The input is one record ``chrBig`` made of ``--copies`` copies of the real chr2:1-2,333,275 piece
(data/hg38), 108 copies = 252 Mb, about the size of chr1 (248.96 Mb). It is a plain gzip file
(one member for the header, then the same compressed body member repeated; ``gzip -dc`` and genoctx
read it as one stream). In the same run it times ``gzip -dc FILE > /dev/null``, genoctx's own decompression
of the same file (the reader of ``genoctx.data.fasta.FastaStream``: ISA-L, ``gzip_backend``, and the standard
library's zlib, its fallback) and then ``prepare`` in a child process, whose peak resident memory (ru_maxrss via
wait4) is reported. Every time is the best of ``--repeat`` runs (the machine may be shared). Targets:
``decompress_ratio = decompress_s / gunzip_s <= 0.7`` (issue 24), ``ratio = prepare_s / gunzip_s <= 1.5`` and
``peak_rss_mib < 1024`` (issue 3).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHR2 = REPO / "data" / "hg38" / "hg38_chr2_1-2333275.fa.gz"

_CHILD = """
import json, sys, time
from genoctx.data.windows import prepare
t0 = time.perf_counter()
m = prepare([sys.argv[1]], sys.argv[2], window=sys.argv[3], train_chroms=["chrBig"], eval_chroms=[], progress=False)
dt = time.perf_counter() - t0
print(json.dumps({"prepare_s": dt, "windows": len(m["windows"]), "length": m["shards"][0]["length"]}))
"""


def build(path: Path, copies: int) -> int:
    """Write the benchmark FASTA; returns the number of bases."""
    with gzip.open(CHR2, "rb") as f:
        text = f.read()
    body = text[text.index(b"\n") + 1 :]
    if not body.endswith(b"\n"):
        body += b"\n"
    member = gzip.compress(body, compresslevel=6, mtime=0)
    with open(path, "wb") as f:
        f.write(gzip.compress(b">chrBig hg38 chr2:1-2333275 repeated\n", mtime=0))
        for _ in range(copies):
            f.write(member)
    return copies * (len(body) - body.count(b"\n"))


def decompress_seconds(path: Path, backend) -> float:
    """Seconds to inflate ``path`` through genoctx's reader (``_decompressed_blocks``) with ``backend``'s
    ``decompressobj`` (``isal.isal_zlib`` or ``zlib``), the blocks discarded."""
    from genoctx.data import fasta

    saved, fasta._zlib = fasta._zlib, backend
    try:
        t0 = time.perf_counter()
        for _ in fasta._decompressed_blocks(path, True, 1 << 23, threading.Event()):
            pass
        return time.perf_counter() - t0
    finally:
        fasta._zlib = saved


def best(repeat: int, fn) -> float:
    """The least of ``repeat`` timings ``fn()`` returns (seconds)."""
    return min(fn() for _ in range(repeat))


def timed_shell(cmd: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, shell=True, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=108)
    ap.add_argument("--window", default="512k")
    ap.add_argument("--repeat", type=int, default=3, help="time each step this many times; report the best")
    ap.add_argument("--keep", type=Path, default=None, help="build the input here and keep it")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from genoctx.data import fasta as fasta_mod

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        fasta = folder / "big.fa.gz"
        bases = build(fasta, args.copies)
        subprocess.run(["gzip", "-dc", str(fasta)], stdout=subprocess.DEVNULL, check=True)  # warm the cache
        gunzip_s = best(args.repeat, lambda: timed_shell(f"gzip -dc '{fasta}' > /dev/null"))
        decompress_s = best(args.repeat, lambda: decompress_seconds(fasta, fasta_mod._zlib))
        zlib_s = best(args.repeat, lambda: decompress_seconds(fasta, zlib))
        runs = [run_prepare(fasta, folder / f"prepared{i}", args.window) for i in range(args.repeat)]
        result, process_s, usage = min(runs, key=lambda r: r[0]["prepare_s"])
        print(
            json.dumps(
                {
                    "bench": "prepare",
                    "bases": bases,
                    "gzip_bytes": fasta.stat().st_size,
                    "window": args.window,
                    "gzip_backend": fasta_mod.GZIP_BACKEND,
                    "gunzip_s": round(gunzip_s, 3),
                    "decompress_s": round(decompress_s, 3),
                    "decompress_ratio": round(decompress_s / gunzip_s, 3),
                    "decompress_zlib_s": round(zlib_s, 3),
                    "prepare_s": round(result["prepare_s"], 3),
                    "process_s": round(process_s, 3),
                    "ratio": round(result["prepare_s"] / gunzip_s, 3),
                    "ratio_process": round(process_s / gunzip_s, 3),
                    "mbases_per_s": round(bases / result["prepare_s"] / 1e6, 1),
                    "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
                    "windows": result["windows"],
                    "cpus": os.cpu_count(),
                    "repeat": args.repeat,
                    "load_avg_1m": round(os.getloadavg()[0], 2),
                }
            )
        )


def run_prepare(fasta: Path, out: Path, window: str) -> tuple[dict, float, os.struct_rusage]:
    """``prepare`` of ``fasta`` into ``out`` in a child process: its JSON line, wall seconds and resource usage
    (``out`` is removed after)."""
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(fasta), str(out), window], stdout=subprocess.PIPE,
                             cwd=REPO)  # fmt: skip
    stdout = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    process_s = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    if status != 0:
        raise SystemExit(f"prepare failed with status {status}")
    return json.loads(stdout), process_s, usage


if __name__ == "__main__":
    main()
