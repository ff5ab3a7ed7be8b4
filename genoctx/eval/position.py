"""Held-out loss binned by how much context each token had.

Every window is scored as the model sees it in training: ``<bos>`` then the window, so the base at window
position p (0-based) is predicted from exactly p bases of preceding context. A token's *position* is that p.
N bases are never scored. Per bin we report the scored-token count, the mean loss in nats per base and the
same in bits per base (nats / ln 2).

Windows longer than fit in memory are evaluated as consecutive chunks of ``chunk_tokens`` with the carried
cache (the chunk contract), which gives the same losses as one pass.
"""

from __future__ import annotations

import csv
import io
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..data.dataset import WindowDataset, load_manifest, scored_mask
from ..data.tokenizer import BOS, VOCAB
from ..errors import GenoctxError
from ..model.model import HybridLM, shift_inputs, token_losses
from ..train.checkpoint import load_model, resolve_checkpoint

log = logging.getLogger("genoctx.eval")
LN2 = math.log(2.0)


def parse_bins(spec: str, window: int) -> list[int]:
    """Bin edges (tokens of context, increasing, first 0, last ``window``) from a spec.

    - ``log2``: [0, 1024), then doubling up to the window: 0, 1024, 2048, 4096, ..., window;
    - ``linear:N``: N equal-width bins over [0, window);
    - ``E1,E2,...``: explicit edges (0 and ``window`` are added when missing).

    Raises:
        GenoctxError: malformed spec, or edges beyond the window (data prepared with a shorter window).
    """
    spec = spec.strip()
    if spec == "log2":
        edges = [0]
        e = 1024
        while e < window:
            edges.append(e)
            e *= 2
        edges.append(window)
        return edges
    if spec.startswith("linear:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise GenoctxError(f"--bins {spec!r}: expected linear:N with an integer N") from None
        if n < 1 or n > window:
            raise GenoctxError(f"--bins {spec!r}: N must be between 1 and the window ({window})")
        return sorted({round(i * window / n) for i in range(n + 1)})
    try:
        edges = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise GenoctxError(
            f"--bins {spec!r}: expected log2, linear:N or comma-separated integer edges"
        ) from None
    if not edges or any(b <= a for a, b in zip(edges, edges[1:], strict=False)) or edges[0] < 0:
        raise GenoctxError(f"--bins {spec!r}: edges must be non-negative and strictly increasing")
    if edges[-1] > window:
        raise GenoctxError(
            f"--bins {spec!r}: edge {edges[-1]} is beyond the data's window of {window} tokens"
        )
    if edges[0] != 0:
        edges = [0, *edges]
    if edges[-1] != window:
        edges.append(window)
    return edges


@torch.no_grad()
def position_losses(model: HybridLM, tokens: torch.Tensor, chunk_tokens: int | None = None) -> torch.Tensor:
    """Per-position next-token loss of one batch of windows, in nats, 0 where not scored.

    Args:
        model: the language model (put in eval mode by the caller).
        tokens: [B, W] int64 window bases.
        chunk_tokens: feed the window in consecutive chunks of this many tokens with the carried cache
            (bounded memory); None = one pass.

    Returns:
        [B, W] float64 losses (nats).
    """
    inputs = shift_inputs(tokens, BOS)
    scored = scored_mask(tokens)
    W = tokens.shape[1]
    step = chunk_tokens or W
    cache = None
    out = []
    for s in range(0, W, step):
        logits, cache = model(inputs[:, s : s + step], cache)
        out.append(token_losses(logits, tokens[:, s : s + step], scored[:, s : s + step]).double())
    return torch.cat(out, dim=1)


@dataclass
class BinnedLoss:
    """Per-window, per-bin sums: ``loss_sum`` [windows, bins] float64 nats, ``count`` [windows, bins] int64."""

    edges: list[int]
    loss_sum: np.ndarray
    count: np.ndarray

    def bins(self) -> list[dict]:
        s, c = self.loss_sum.sum(0), self.count.sum(0)
        return [
            {
                "start": self.edges[i],
                "end": self.edges[i + 1],
                "tokens": int(c[i]),
                "loss": float(s[i] / c[i]) if c[i] else None,
            }
            for i in range(len(c))
        ]

    def overall(self) -> dict:
        s, c = float(self.loss_sum.sum()), int(self.count.sum())
        return {"tokens": c, "loss": s / c if c else None}


def binned_losses(
    model: HybridLM,
    ds: WindowDataset,
    edges: list[int],
    chunk_tokens: int | None = None,
    max_windows: int | None = None,
    device: str | torch.device = "cpu",
) -> BinnedLoss:
    """Score every window of ``ds`` (or the first ``max_windows``) and sum losses into position bins."""
    model.eval()
    n = len(ds) if max_windows is None else min(len(ds), max_windows)
    edges_t = torch.tensor(edges[1:-1], dtype=torch.long)
    nb = len(edges) - 1
    loss_sum = np.zeros((n, nb))
    count = np.zeros((n, nb), dtype=np.int64)
    for i in range(n):
        tokens = ds[i]["tokens"][None].to(device)
        losses = position_losses(model, tokens, chunk_tokens)[0].cpu()
        scored = scored_mask(tokens)[0].cpu()
        bin_of = torch.bucketize(torch.arange(tokens.shape[1]), edges_t, right=True)
        loss_sum[i] = torch.zeros(nb, dtype=torch.float64).index_add_(0, bin_of, losses).numpy()
        count[i] = torch.zeros(nb, dtype=torch.long).index_add_(0, bin_of, scored.long()).numpy()
        log.debug("window %d/%d: %.4f nats", i + 1, n, loss_sum[i].sum() / max(count[i].sum(), 1))
    return BinnedLoss(edges, loss_sum, count)


def _with_bits(d: dict) -> dict:
    d["bits_per_base"] = d["loss"] / LN2 if d["loss"] is not None else None
    return d


def compare(result: BinnedLoss, baseline: BinnedLoss | None) -> dict:
    """The JSON document of ``genoctx eval --by-position`` (shape documented in README)."""
    bins = [_with_bits(b) for b in result.bins()]
    overall = _with_bits(result.overall())
    if baseline is not None:
        for b, bb in zip(bins, baseline.bins(), strict=True):
            b["baseline_loss"] = bb["loss"]
            b["relative_change"] = (b["loss"] / bb["loss"] - 1) if b["loss"] and bb["loss"] else None
        bo = baseline.overall()
        overall["baseline_loss"] = bo["loss"]
        overall["relative_change"] = (
            (overall["loss"] / bo["loss"] - 1) if overall["loss"] and bo["loss"] else None
        )
    return {"bins": bins, "overall": overall}


def evaluate(
    checkpoint: str | Path,
    data_dir: str | Path,
    split: str = "eval",
    bins: str = "log2",
    baseline: str | Path | None = None,
    chunk_tokens: int | None = None,
    max_windows: int | None = None,
    device: str = "cpu",
) -> dict:
    """Position-binned held-out loss of ``checkpoint`` (and optionally ``baseline``) on ``split`` of ``data_dir``.

    Returns:
        ``{"bins": [...], "overall": {...}, "checkpoint", "baseline", "split", "windows", "window"}``; losses
        in nats per scored base, ``relative_change = loss / baseline_loss - 1``.

    Raises:
        GenoctxError: missing checkpoint, data prepared with another vocabulary, an empty split, bins
            beyond the window.
    """
    data_dir = Path(data_dir)
    manifest = load_manifest(data_dir)
    if list(manifest.get("vocabulary", [])) != list(VOCAB):
        raise GenoctxError(
            f"{data_dir}/manifest.json: prepared with vocabulary {manifest.get('vocabulary')}, "
            f"genoctx uses {list(VOCAB)}"
        )
    ckpts = [resolve_checkpoint(checkpoint)] + ([resolve_checkpoint(baseline)] if baseline else [])
    ds = WindowDataset(data_dir, split)
    edges = parse_bins(bins, ds.window)
    results = []
    for ck in ckpts:
        model, _, _ = load_model(ck, device)
        log.info(
            "scoring %d %s windows of %d tokens with %s",
            len(ds) if max_windows is None else min(len(ds), max_windows),
            split,
            ds.window,
            ck,
        )
        results.append(binned_losses(model, ds, edges, chunk_tokens, max_windows, device))
    doc = compare(results[0], results[1] if baseline else None)
    doc.update(
        {
            "checkpoint": str(ckpts[0]),
            "baseline": str(ckpts[1]) if baseline else None,
            "split": split,
            "windows": int(results[0].count.shape[0]),
            "window": ds.window,
        }
    )
    return doc


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def to_table(doc: dict) -> str:
    """A plain-text table of a result document (one row per bin, then the overall row)."""
    has_base = "baseline_loss" in doc["overall"]
    head = ["context (tokens)", "tokens", "loss (nats)", "bits/base"]
    if has_base:
        head += ["baseline (nats)", "change"]
    rows = []
    for b in [*doc["bins"], {**doc["overall"], "start": None}]:
        rng = "overall" if b.get("start") is None else f"[{b['start']}, {b['end']})"
        r = [rng, str(b["tokens"]), _fmt(b["loss"], ".4f"), _fmt(b["bits_per_base"], ".4f")]
        if has_base:
            rc = b.get("relative_change")
            r += [_fmt(b.get("baseline_loss"), ".4f"), "-" if rc is None else f"{100 * rc:+.2f}%"]
        rows.append(r)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def to_csv(doc: dict) -> str:
    """CSV with one row per bin and a final ``overall`` row (empty start/end)."""
    cols = ["start", "end", "tokens", "loss", "bits_per_base", "baseline_loss", "relative_change"]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for b in doc["bins"]:
        w.writerow(b)
    w.writerow({**doc["overall"], "start": "overall"})
    return buf.getvalue()


def plot(doc: dict, path: str | Path) -> Path:
    """Loss per position bin on a log-2 position axis (and the baseline when present), written as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = [b for b in doc["bins"] if b["tokens"]]
    mids = [max(1.0, math.sqrt(max(b["start"], 1) * b["end"])) for b in bins]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(mids, [b["loss"] for b in bins], "o-", label=Path(doc["checkpoint"]).name)
    if "baseline_loss" in doc["overall"]:
        ax.plot(
            mids, [b["baseline_loss"] for b in bins], "s--", label=f"baseline {Path(doc['baseline']).name}"
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context before the token (tokens = bases, bin geometric centre)")
    ax.set_ylabel("held-out loss (nats per base)")
    ax.set_title(f"loss by position, split {doc['split']} ({doc['windows']} windows of {doc['window']})")
    ax.grid(alpha=0.3)
    ax.legend()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.tight_layout()
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
    return path
