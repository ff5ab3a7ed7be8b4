"""Lightning-indexer top-k on CPU: the pruned running top-k (default) vs the plain one; prints one JSON line.

``indexer_topk`` for the last ``--queries`` queries of a ``--tokens``-token sequence (the late chunk of a long
window, where the indexer's quadratic cost lives), with cpu-small's KPool indexer shape (4 heads of 32, pools of
16 tokens, top-256 tokens = 16 pools) on random Gaussian inputs (seeded): the keys are the sequence's pooled
keys and query ``t`` sees the ``(t + 1) // kpool`` complete pools before it, as in the DSA layer. Reports seconds
and nanoseconds per (query, pool) pair for ``prune=True`` and ``prune=False``, and checks that both select the
same pools (``same_selection``) in the same order. With ``--preset tiny`` (an indexer of at most
``dsa.INDEX_COMPILE_TERMS`` head x dim terms) a third case, ``compiled``: the compiled group maxima that long CPU calls
use (``dsa._grouped_topk``, forced here at any size), timed after one warm-up call that compiles it, with its own
``compiled_same_selection`` / ``compiled_same_order`` against the plain top-k (keys within fp32 rounding may swap)
and ``compiled_tiles``, the query tiles that took it (0, said on stderr too: ``--tokens`` too short for any tile to
see enough key blocks, and the case timed the eager tiles).

    .venv/bin/python bench/indexer_topk.py                 # 1024 queries at 512k tokens (32k pools), 1 thread
    .venv/bin/python bench/indexer_topk.py --preset tiny --tokens 1M --queries 4096 --threads 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import genoctx.model.dsa as dsa  # noqa: E402
from genoctx.data.windows import parse_size  # noqa: E402
from genoctx.model.config import preset  # noqa: E402
from genoctx.model.dsa import indexer_topk  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", "--keys", default="512k", help="sequence length in tokens (k/M suffixes, k = 1024)")
    ap.add_argument("--queries", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared machine)")
    ap.add_argument("--preset", default="cpu-small", help="the model whose indexer shape is timed")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = preset(args.preset)
    L, T, H, d, kp = parse_size(args.tokens), args.queries, cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
    if not 1 <= T <= L:
        ap.error(f"--queries must be in [1, --tokens={L}]")
    N = L // kp  # complete pools of the whole sequence
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, T, H, d, generator=g)
    w = torch.randn(1, T, H, generator=g)
    k = torch.randn(1, N, d, generator=g)
    visible = (torch.arange(L - T, L) + 1) // kp  # complete pools each query sees
    pairs = int(visible.sum())
    topk = cfg.index_topk // kp
    out, idx = {}, {}
    for name, prune in (("pruned", True), ("plain", False)):
        t0 = time.perf_counter()
        idx[name] = indexer_topk(q, w, k, visible, topk, cfg.indexer_tile_tokens, torch.int32, prune=prune)
        s = time.perf_counter() - t0
        out[name] = {"seconds": round(s, 3), "ns_per_pair": round(s / pairs * 1e9, 3)}
    extra = {}
    if H * d <= dsa.INDEX_COMPILE_TERMS:
        dsa.INDEX_COMPILE_PAIRS = 0
        indexer_topk(q[:, :256], w[:, :256], k, visible[:256], topk, cfg.indexer_tile_tokens, torch.int32)  # compiles
        grouped, tiles = dsa._grouped_topk, []

        def counted(*a, **kw):  # the query tiles that took the compiled path
            tiles.append(1)
            return grouped(*a, **kw)

        dsa._grouped_topk = counted
        try:
            t0 = time.perf_counter()
            idx["compiled"] = indexer_topk(q, w, k, visible, topk, cfg.indexer_tile_tokens, torch.int32)
            s = time.perf_counter() - t0
        finally:
            dsa._grouped_topk = grouped
        if not tiles:
            print("indexer_topk: no query tile was long enough for the compiled path (--tokens too short): the "
                  "'compiled' case timed the eager tiles", file=sys.stderr)
        out["compiled"] = {"seconds": round(s, 3), "ns_per_pair": round(s / pairs * 1e9, 3)}
        extra = {
            "compiled_tiles": len(tiles),
            "compiled_speedup": round(out["pruned"]["seconds"] / s, 2),
            "compiled_same_selection": bool(torch.equal(idx["compiled"].sort(-1).values, idx["plain"].sort(-1).values)),
            "compiled_same_order": bool(torch.equal(idx["compiled"], idx["plain"])),
        }
    print(
        json.dumps(
            {
                "bench": "indexer_topk",
                "tokens": L,
                "pools": N,
                "queries": T,
                "index_n_heads": H,
                "index_head_dim": d,
                "index_kpool": kp,
                "topk_pools": topk,
                "threads": torch.get_num_threads(),
                **out,
                "speedup": round(out["plain"]["seconds"] / out["pruned"]["seconds"], 2),
                "same_selection": bool(torch.equal(idx["pruned"].sort(-1).values, idx["plain"].sort(-1).values)),
                "same_order": bool(torch.equal(idx["pruned"], idx["plain"])),
                **extra,
            }
        )
    )


if __name__ == "__main__":
    main()
