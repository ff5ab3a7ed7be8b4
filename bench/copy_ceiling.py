"""How much could copying from earlier in the window gain, by position bin? Prints one JSON line.

For every scored base of a prepared split (``genoctx prepare`` output), looks for an exact earlier occurrence, in the
same window, of the ``k`` bases before it (default 16); where there is one, the base that followed the latest such
occurrence is the copy's guess. Per position bin (``--bins``, as ``genoctx eval``): the fraction of bases with a
match (``matched``), how often the guess is right there (``agree``), the order-8 Markov chain's loss (fitted on the
train split, add-one, as ``eval --markov 8``) overall and on the matched bases, and the gain over the Markov chain
of a copier that is right with probability ``agree`` on every matched base and leaves the others alone:
``matched x (markov loss on them - copy loss)``, ``copy loss = -(a ln a + (1 - a) ln((1 - a) / 3))``.

That is a rough ceiling of what in-context copying of exact repeats adds to a model of Markov-8 quality; diverged
repeats (most Alus) are not counted. It says where in the window the repeats of a piece of DNA lie: a model that
copies perfectly gains most where they are.

    .venv/bin/python bench/copy_ceiling.py --data reproduce-small/data --split eval
    .venv/bin/python bench/copy_ceiling.py --data reproduce-small/data --split train
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from genoctx.data.dataset import WindowDataset  # noqa: E402
from genoctx.eval.markov import fit_markov  # noqa: E402
from genoctx.eval.position import parse_bins  # noqa: E402


def copy_loss(agree: float) -> float:
    """Nats per base of a guess right with probability ``agree``, the rest spread over the 3 other bases."""
    a = min(max(agree, 1e-6), 1 - 1e-6)
    return -(a * math.log(a) + (1 - a) * math.log((1 - a) / 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="prepared data directory")
    ap.add_argument("--split", default="eval")
    ap.add_argument("--k", type=int, default=16, help="bases that must match before a copy is guessed")
    ap.add_argument("--bins", default="log2")
    args = ap.parse_args()
    ds = WindowDataset(args.data, args.split)
    edges = parse_bins(args.bins, ds.window)
    markov = fit_markov(args.data, 8, 1.0)
    nb = len(edges) - 1
    acc = {key: np.zeros(nb) for key in ("tokens", "matched", "agree", "markov", "markov_matched")}
    for i in range(len(ds)):
        t = ds[i]["tokens"].numpy().astype(np.int64)
        losses = markov.token_losses(t)
        bin_of = np.searchsorted(edges, np.arange(len(t)), side="right") - 1
        last: dict[bytes, int] = {}
        for p in range(len(t)):
            j = None
            if p >= args.k:
                key = t[p - args.k : p].tobytes()
                j = last.get(key)
                last[key] = p
            if t[p] > 3:  # N and padding are not scored
                continue
            b = bin_of[p]
            acc["tokens"][b] += 1
            acc["markov"][b] += losses[p]
            if j is not None:
                acc["matched"][b] += 1
                acc["markov_matched"][b] += losses[p]
                acc["agree"][b] += t[j] == t[p]

    def row(sl) -> dict:
        n, m = acc["tokens"][sl].sum(), acc["matched"][sl].sum()
        agree = acc["agree"][sl].sum() / m if m else None
        mk = acc["markov"][sl].sum() / n if n else None
        mk_m = acc["markov_matched"][sl].sum() / m if m else None
        gain = (m / n) * (mk_m - copy_loss(agree)) if m else 0.0
        return {
            "tokens": int(n),
            "matched": round(m / n, 5) if n else None,
            "agree": None if agree is None else round(agree, 4),
            "markov_loss": None if mk is None else round(mk, 4),
            "markov_loss_matched": None if mk_m is None else round(mk_m, 4),
            "copy_loss": None if agree is None else round(copy_loss(agree), 4),
            "ceiling_gain_nats": round(gain, 5),
            "ceiling_gain_rel": round(gain / mk, 5) if mk else None,
        }

    bins = [{"start": edges[b], "end": edges[b + 1], **row(slice(b, b + 1))} for b in range(nb)]
    out = {"bench": "copy_ceiling", "data": args.data, "split": args.split, "windows": len(ds), "window": ds.window,
           "k": args.k, "bins": bins, "overall": row(slice(0, nb))}  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
