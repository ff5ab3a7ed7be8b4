"""Streaming evaluation of one long window in bounded memory: prints one JSON line.

Prepares the embedded real hg38 chr2 piece (chr2:1-2,333,275) into windows of ``--window`` tokens (default
1M = 1,048,576 bases) in a temporary directory, builds the ``--preset`` model (default ``cpu-small``, random init; or
``--checkpoint``: a genoctx checkpoint or an HF model directory), and scores the first window with
``genoctx.eval.position.score_windows`` in chunks of ``--seq-chunk`` tokens (as ``genoctx eval --seq-chunk``; old
name ``--chunk-tokens``) with the carried cache (the chunk contract). Reports wall time, tokens/s, the process's
peak resident memory (``ru_maxrss``) and its resident memory before scoring, and the loss.

    .venv/bin/python bench/eval_long.py                      # the README number (a long run on a CPU)
    .venv/bin/python bench/eval_long.py --window 64k         # a quick check
    .venv/bin/python bench/eval_long.py --preset tiny --seq-chunk 64k   # tiny's 1M-token eval window
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _memory import peak_rss_mib, rss_now_mib  # noqa: E402  (bench/_memory.py, beside this script)

from genoctx.data.dataset import WindowDataset  # noqa: E402
from genoctx.data.windows import parse_size, prepare  # noqa: E402
from genoctx.eval.position import load_eval_model, model_scorer, parse_bins, score_windows  # noqa: E402
from genoctx.model.config import preset  # noqa: E402
from genoctx.model.model import HybridLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", default="1M", help="window length (k/M suffixes, k = 1024)")
    ap.add_argument("--seq-chunk", "--chunk-tokens", dest="chunk_tokens", default="16k", metavar="N",
                    help="tokens per chunk (carried cache), as genoctx eval --seq-chunk")
    ap.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="a genoctx checkpoint or HF model directory (nucleotide vocabulary); default cpu-small, random init",
    )
    ap.add_argument("--preset", default="cpu-small", help="the model preset (random init) without --checkpoint")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = ap.parse_args()
    from genoctx.heap import keep_freed_memory

    keep_freed_memory()  # as genoctx's CLI on a CPU (genoctx.heap)
    if args.threads:
        torch.set_num_threads(args.threads)
    window, chunk = parse_size(args.window), parse_size(args.chunk_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "chr2"
        prepare([REPO / "data/hg38/hg38_chr2_1-2333275.fa.gz"], data, window=window, train_chroms=[],
                eval_chroms=["chr2"], progress=False)  # fmt: skip
        ds = WindowDataset(data, "eval")
        if args.checkpoint:
            model = load_eval_model(args.checkpoint)
        else:
            torch.manual_seed(0)
            model = HybridLM(preset(args.preset))
        edges = parse_bins("log2", window)
        model.eval()
        rss_before = rss_now_mib() / 1024
        t0 = time.perf_counter()
        done = [0]

        def forward(x, cache):  # the model, with a progress line per chunk on stderr
            out = model(x, cache)
            done[0] += x.shape[1]
            print(f"{done[0]}/{window} tokens  {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            return out

        res = score_windows(model_scorer(forward, chunk), ds, edges, max_windows=1)["forward/all"]
        seconds = time.perf_counter() - t0
    overall = res.overall()
    print(
        json.dumps(
            {
                "bench": "eval_long",
                "model": str(args.checkpoint) if args.checkpoint else f"{args.preset} (random init)",
                "window": window,
                "chunk_tokens": chunk,
                "source": f"hg38 {ds.windows[0]['chrom']}:{ds.windows[0]['start'] + 1}-{ds.windows[0]['end']}",
                "scored_tokens": overall["tokens"],
                "seconds": round(seconds, 1),
                "tokens_per_s": round(window / seconds, 1),
                "rss_before_gib": round(rss_before, 3),
                "peak_rss_gib": round(peak_rss_mib() / 1024, 3),
                "loss": overall["loss"],
                "last_bin": res.bins()[-1],
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
