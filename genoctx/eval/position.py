"""Held-out loss binned by how much context each token had, with intervals, baselines and references.

Every window is scored as the model sees it in training: ``<bos>`` then the window, so the base at window
position p (0-based) is predicted from exactly p bases of preceding context. A token's *position* is that p.
N bases are never scored. Per bin we report the scored-token count, the mean loss in nats per base, the
same in bits per base (nats / ln 2), and a percentile-bootstrap interval over windows (``bootstrap.py``).

Several models are scored on the same windows: checkpoints (the first one is the baseline; every other model
gets its absolute and relative change against it, with a paired-bootstrap interval) and optionally an
order-K Markov chain fitted on the training split (``markov.py``), the reference a model that learned to use
long context must beat. Any object with the chunk contract ``model(inputs [B, T], cache) -> (logits
[B, T, V], cache)`` can be scored.

Views: with ``reverse_complement`` every window is also scored on its reverse-complement strand (positions
count from the start of that strand); with ``split_by="softmask"`` soft-masked (repeat) and unmasked bases
are reported separately, as well as together. View names are ``"{strand}/{mask}"`` with strand in forward,
reverse, both and mask in all, softmasked, unmasked; ``"forward/all"`` is the main result.

Windows longer than fit in memory are evaluated as consecutive chunks of ``chunk_tokens`` with the carried
cache (the chunk contract), which gives the same losses as one pass. The JSON document is described in
``docs/eval_schema.md`` and checked against :data:`genoctx.eval.schema.SCHEMA`.
"""

from __future__ import annotations

import csv
import io
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..data.dataset import WindowDataset, load_manifest, scored_mask
from ..data.tokenizer import BOS, PAD, VOCAB, reverse_complement
from ..errors import GenoctxError
from ..model.model import shift_inputs, token_losses
from ..train.checkpoint import load_model, resolve_checkpoint
from .bootstrap import percentile_interval, ratio_samples, resample_weights
from .copyprobe import REACH_GAIN, SEGMENT, TailScoreFn, copy_distances, probe_windows, summarize
from .markov import MAX_ORDER, MarkovModel, fit_markov
from .plot import plot

__all__ = [
    "BinnedLoss",
    "binned_losses",
    "compare",
    "evaluate",
    "load_eval_model",
    "parse_bins",
    "plot",
    "position_losses",
    "score_windows",
    "to_csv",
    "to_table",
]

log = logging.getLogger("genoctx.eval")
LN2 = math.log(2.0)
STRANDS = ("forward", "reverse", "both")
MASKS = ("all", "softmasked", "unmasked")
MAIN_VIEW = "forward/all"


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
        raise GenoctxError(f"--bins {spec!r}: expected log2, linear:N or comma-separated integer edges") from None
    if not edges or any(b <= a for a, b in zip(edges, edges[1:], strict=False)) or edges[0] < 0:
        raise GenoctxError(f"--bins {spec!r}: edges must be non-negative and strictly increasing")
    if edges[-1] > window:
        raise GenoctxError(f"--bins {spec!r}: edge {edges[-1]} is beyond the data's window of {window} tokens")
    if edges[0] != 0:
        edges = [0, *edges]
    if edges[-1] != window:
        edges.append(window)
    return edges


@torch.no_grad()
def position_losses(model, tokens: torch.Tensor, chunk_tokens: int | None = None) -> torch.Tensor:
    """Per-position next-token loss of one batch of windows, in nats, 0 where not scored.

    Args:
        model: any object with the chunk contract ``model(inputs [B, T] int64, cache) -> (logits [B, T, V],
            cache)`` (``HybridLM`` in eval mode; a plain object with ``forward`` works too). The first call
            gets ``cache=None``.
        tokens: [B, W] int64 window bases.
        chunk_tokens: feed the window in consecutive chunks of this many tokens with the carried cache
            (bounded memory); None = one pass.

    Returns:
        [B, W] float64 losses (nats).
    """
    forward = model if callable(model) else model.forward
    return _chunk_losses(forward, tokens, 0, tokens.shape[1], chunk_tokens, None)[0]


def _chunk_losses(forward, tokens: torch.Tensor, start: int, end: int, chunk_tokens: int | None, cache):
    """Losses [B, end - start] float64 of positions ``[start, end)`` of ``tokens`` [B, W] (each predicted from the
    tokens before it), fed in chunks of ``chunk_tokens`` after ``cache`` (the cache of positions ``[0, start)``;
    None when ``start == 0``) -> (losses, the cache of ``[0, end)``)."""
    inputs = shift_inputs(tokens, BOS)
    scored = scored_mask(tokens)
    step = chunk_tokens or (end - start)
    out = []
    for s in range(start, end, step):
        e = min(s + step, end)
        logits, cache = forward(inputs[:, s:e], cache)
        out.append(
            token_losses(
                logits.float() if logits.dtype == torch.float16 else logits, tokens[:, s:e], scored[:, s:e]
            ).double()
        )
    return torch.cat(out, dim=1), cache


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

    def __add__(self, other: BinnedLoss) -> BinnedLoss:
        return BinnedLoss(self.edges, self.loss_sum + other.loss_sum, self.count + other.count)


def view_names(reverse: bool = False, softmask: bool = False) -> list[str]:
    """The views an evaluation reports, main view first: ``"{strand}/{mask}"``."""
    strands = list(STRANDS) if reverse else ["forward"]
    masks = list(MASKS) if softmask else ["all"]
    return [f"{s}/{m}" for s in strands for m in masks]


def rc_window(tokens: np.ndarray, softmask: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Reverse-complement strand of a window whose first ``length`` entries are bases (the rest PAD).

    tokens int [W], softmask bool [W] -> (int64 [W], bool [W]); padding stays at the end, so position p of
    the result is predicted from the p bases before it on that strand.
    """
    t = np.full(tokens.shape[0], PAD, dtype=np.int64)
    m = np.zeros(tokens.shape[0], dtype=bool)
    t[:length] = reverse_complement(np.asarray(tokens[:length]).astype(np.uint8)).astype(np.int64)
    m[:length] = np.asarray(softmask[:length])[::-1]
    return t, m


ScoreFn = Callable[[np.ndarray], np.ndarray]
"""Scores one window: int64 [W] token ids -> float64 [W] loss in nats (0 where not scored)."""


def model_scorer(model, chunk_tokens: int | None = None, device: str | torch.device = "cpu") -> ScoreFn:
    """A :data:`ScoreFn` for a chunk-contract model (see :func:`position_losses`)."""
    if hasattr(model, "eval"):
        model.eval()

    def score(tokens: np.ndarray) -> np.ndarray:
        t = torch.as_tensor(tokens, dtype=torch.long)[None].to(device)
        return position_losses(model, t, chunk_tokens)[0].cpu().numpy()

    return score


def model_tail_scorer(model, chunk_tokens: int | None = None, device: str | torch.device = "cpu") -> TailScoreFn:
    """A :data:`genoctx.eval.copyprobe.TailScoreFn` for a chunk-contract model: the prefix ``[0, dst)`` is run once
    and every tail (the unedited one, then each edit) continues from its cache, as ``position_losses`` would score
    the whole edited window (the chunk contract: a chunk after the cache of the positions before it). For the copy
    probe this costs one window plus ``len(tails)`` tails instead of ``1 + len(tails)`` windows. The cache must not
    be changed by the forward that reads it (genoctx's layers build new caches)."""
    if hasattr(model, "eval"):
        model.eval()
    forward = model if callable(model) else model.forward

    @torch.no_grad()
    def score_tails(tokens: np.ndarray, dst: int, tails: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        t = torch.as_tensor(tokens, dtype=torch.long)[None].to(device)
        W = t.shape[1]
        prefix, cache = _chunk_losses(forward, t, 0, dst, chunk_tokens, None)
        out = []
        for tail in [tokens[dst:], *tails]:
            edited = t.clone()
            edited[0, dst:] = torch.as_tensor(tail, dtype=torch.long, device=t.device)
            out.append(_chunk_losses(forward, edited, dst, W, chunk_tokens, cache)[0][0].cpu().numpy())
        return np.concatenate([prefix[0].cpu().numpy(), out[0]]), out[1:]

    return score_tails


def markov_scorer(markov: MarkovModel) -> ScoreFn:
    """A :data:`ScoreFn` for a fitted :class:`MarkovModel`."""
    return markov.token_losses


def score_windows(
    score: ScoreFn,
    ds: WindowDataset,
    edges: list[int],
    max_windows: int | None = None,
    views: list[str] | None = None,
) -> dict[str, BinnedLoss]:
    """Score the windows of ``ds`` (or the first ``max_windows``) and sum losses per window, bin and view.

    Args:
        score: window scorer (:func:`model_scorer`, :func:`markov_scorer`).
        ds: the windows; ``ds[i]`` gives ``tokens`` [W], ``softmask`` [W], ``start``/``end``.
        edges: bin edges in tokens of context (:func:`parse_bins`).
        views: names from :func:`view_names`; default the main view only.

    Returns:
        ``{view: BinnedLoss}`` with arrays [windows, bins]; ``both/*`` views are forward + reverse sums.
    """
    views = views or [MAIN_VIEW]
    n = len(ds) if max_windows is None else min(len(ds), max_windows)
    nb = len(edges) - 1
    strands = ["forward"] + (["reverse"] if any(v.split("/")[0] in ("reverse", "both") for v in views) else [])
    masks = sorted({v.split("/")[1] for v in views}, key=MASKS.index)
    sums = {(s, m): np.zeros((n, nb)) for s in strands for m in masks}
    cnts = {(s, m): np.zeros((n, nb), dtype=np.int64) for s in strands for m in masks}
    bin_of = np.searchsorted(np.asarray(edges[1:-1]), np.arange(ds.window), side="right")
    for i in range(n):
        item = ds[i]
        tokens, soft = item["tokens"].numpy(), item["softmask"].numpy()
        for strand in strands:
            if strand == "reverse":
                tokens, soft = rc_window(tokens, soft, item["end"] - item["start"])
            losses = np.asarray(score(tokens), dtype=np.float64)
            scored = (tokens >= 0) & (tokens <= 3)
            for mask in masks:
                sel = scored if mask == "all" else scored & (soft if mask == "softmasked" else ~soft)
                b = bin_of[sel]
                sums[strand, mask][i] = np.bincount(b, weights=losses[sel], minlength=nb)
                cnts[strand, mask][i] = np.bincount(b, minlength=nb)
        log.debug("window %d/%d scored", i + 1, n)
    out = {}
    for v in views:
        strand, mask = v.split("/")
        if strand == "both":
            out[v] = BinnedLoss(edges, sums["forward", mask], cnts["forward", mask]) + BinnedLoss(
                edges, sums["reverse", mask], cnts["reverse", mask]
            )
        else:
            out[v] = BinnedLoss(edges, sums[strand, mask], cnts[strand, mask])
    return out


def binned_losses(
    model,
    ds: WindowDataset,
    edges: list[int],
    chunk_tokens: int | None = None,
    max_windows: int | None = None,
    device: str | torch.device = "cpu",
) -> BinnedLoss:
    """Score every window of ``ds`` (or the first ``max_windows``) with a chunk-contract ``model`` and sum
    losses into position bins (forward strand, all scored bases)."""
    return score_windows(model_scorer(model, chunk_tokens, device), ds, edges, max_windows)[MAIN_VIEW]


def _with_bits(d: dict) -> dict:
    d["bits_per_base"] = d["loss"] / LN2 if d["loss"] is not None else None
    return d


def compare(result: BinnedLoss, baseline: BinnedLoss | None) -> dict:
    """The core of the JSON document: ``{"bins": [...], "overall": {...}}`` of ``result`` with the baseline's
    loss and ``relative_change = loss / baseline_loss - 1`` when a baseline is given (no intervals; see
    :func:`evaluate` for the full document)."""
    bins = [_with_bits(b) for b in result.bins()]
    overall = _with_bits(result.overall())
    if baseline is not None:
        for b, bb in zip(bins, baseline.bins(), strict=True):
            b["baseline_loss"] = bb["loss"]
            b["relative_change"] = (b["loss"] / bb["loss"] - 1) if b["loss"] and bb["loss"] else None
        bo = baseline.overall()
        overall["baseline_loss"] = bo["loss"]
        overall["relative_change"] = (overall["loss"] / bo["loss"] - 1) if overall["loss"] and bo["loss"] else None
    return {"bins": bins, "overall": overall}


@dataclass
class _Scored:
    """One model's results: identity, ``{view: BinnedLoss}`` and its copy probe (``copyprobe.summarize``) or None."""

    entry: dict
    views: dict[str, BinnedLoss]
    copy_probe: dict | None = None


def _annotate(
    block: dict,
    res: BinnedLoss,
    samples: np.ndarray | None,
    level: float,
    refs: list[tuple[str, BinnedLoss, np.ndarray | None]],
) -> dict:
    """Add ``loss_ci`` and, per reference (prefix, result, samples), its loss, difference and relative change
    with paired-bootstrap intervals to the rows of ``block`` (bins then overall)."""
    rows = [*block["bins"], block["overall"]]
    ci = percentile_interval(samples, level) if samples is not None else [None] * len(rows)
    for row, c in zip(rows, ci, strict=True):
        row["loss_ci"] = c
        row["bits_per_base_ci"] = [c[0] / LN2, c[1] / LN2] if c else None
    for prefix, ref, ref_samples in refs:
        ref_rows = [*ref.bins(), ref.overall()]
        if samples is not None and ref_samples is not None:
            with np.errstate(invalid="ignore", divide="ignore"):
                d_ci = percentile_interval(samples - ref_samples, level)
                r_ci = percentile_interval(samples / ref_samples - 1.0, level)
        else:
            d_ci = r_ci = [None] * len(rows)
        for row, rr, dc, rc in zip(rows, ref_rows, d_ci, r_ci, strict=True):
            ok = row["loss"] is not None and rr["loss"]
            if prefix == "baseline":
                row["baseline_loss"] = rr["loss"]
                row["difference"] = row["loss"] - rr["loss"] if ok else None
                row["difference_ci"] = dc if ok else None
                row["relative_change"] = row["loss"] / rr["loss"] - 1 if ok else None
                row["relative_change_ci"] = rc if ok else None
            else:
                row[f"{prefix}_loss"] = rr["loss"]
                row[f"{prefix}_relative_change"] = row["loss"] / rr["loss"] - 1 if ok else None
                row[f"{prefix}_relative_change_ci"] = rc if ok else None
    return block


def last_vs_first_bin(
    res: BinnedLoss, base: BinnedLoss, samples: np.ndarray | None, base_samples: np.ndarray | None, level: float
) -> dict | None:
    """Is the change vs the baseline larger far into the window than near its start? The relative change in the last
    bin with scored tokens minus that in the first, with its paired percentile-bootstrap interval (the same
    resampled windows for both bins and both models: ``samples``, ``base_samples`` float64 [B, bins + 1] mean
    losses from ``bootstrap.ratio_samples``, or None for no interval).

    Returns:
        ``{"first_bin": [start, end], "last_bin": [start, end], "first_change", "last_change", "change_difference",
        "change_difference_ci"}`` (changes as fractions, ``loss / baseline_loss - 1``; a negative difference: the
        model gained more over the baseline in the last bin), or None with fewer than two such bins.
    """
    rows, base_rows = res.bins(), base.bins()
    idx = [i for i, (r, b) in enumerate(zip(rows, base_rows, strict=True)) if r["loss"] is not None and b["loss"]]
    if len(idx) < 2:
        return None
    i, j = idx[0], idx[-1]
    first = rows[i]["loss"] / base_rows[i]["loss"] - 1
    last = rows[j]["loss"] / base_rows[j]["loss"] - 1
    ci = None
    if samples is not None and base_samples is not None:
        with np.errstate(invalid="ignore", divide="ignore"):
            change = samples / base_samples - 1.0
            ci = percentile_interval((change[:, j] - change[:, i])[:, None], level)[0]
    return {
        "first_bin": [rows[i]["start"], rows[i]["end"]],
        "last_bin": [rows[j]["start"], rows[j]["end"]],
        "first_change": first,
        "last_change": last,
        "change_difference": last - first,
        "change_difference_ci": ci,
    }


def load_eval_model(path: str | Path, device: str | torch.device = "cpu", loss_vocab: str | None = None):
    """The model of a genoctx checkpoint (or run directory: its latest checkpoint) or of an HF model directory
    (``config.json`` + safetensors: ``genoctx.model.load_hf``), on ``device``, in eval mode, with the chunk contract
    of :func:`position_losses` over genoctx's ids.

    A model with the 8 nucleotide tokens is returned as is. A model with a text vocabulary (a pretrained base, or a
    run started from one with ``--init``) is wrapped in ``genoctx.model.vocab.MappedLM``: its token map is the run's
    (state.json) or, for an HF directory, built from its tokenizer.json; its loss vocabulary is ``loss_vocab`` when
    given, else the run's ``loss.vocab``, else ``full``. An HF model is loaded in fp32 on the CPU and in the
    checkpoint's dtype elsewhere.

    Raises:
        GenoctxError: no such checkpoint, unreadable files, a text vocabulary without a usable tokenizer.json.
    """
    from ..model.hf import load_hf
    from ..model.vocab import MappedLM, TokenMap, VocabHead

    ck = resolve_checkpoint(path)
    if not _is_hf(ck):
        model, recipe, state = load_model(ck, device)
        token_map = TokenMap.from_dict(state["token_map"]) if state.get("token_map") else None
        if token_map is None or token_map.is_identity:
            return model.eval()
        vocab = loss_vocab or state.get("loss_vocab") or recipe.loss.vocab
        return MappedLM(model, VocabHead(token_map, vocab, recipe.loss.chunk_tokens)).eval()
    token_map = _hf_token_map(ck)
    dtype = torch.float32 if torch.device(device).type == "cpu" else None
    model = load_hf(ck, dtype=dtype).to(device).eval()
    if token_map is None:
        return model
    return MappedLM(model, VocabHead(token_map, loss_vocab or "full")).eval()


def loss_vocab_of(model) -> str | None:
    """``full`` or ``nucleotide`` for a model read through a token map (``load_eval_model``), None for a model of
    the 8 nucleotide tokens."""
    head = getattr(model, "head", None)
    return getattr(head, "vocab", None)


def _is_hf(ck: Path) -> bool:
    from ..model.hf import is_hf_dir

    return is_hf_dir(ck) and not (ck / "state.json").is_file()


def _hf_token_map(ck: Path):
    """The token map of an HF model directory with a text vocabulary (from its tokenizer.json); None for a genoctx
    checkpoint or a nucleotide model. Reads config.json and tokenizer files only.

    Raises:
        GenoctxError: an unreadable config.json, or a text vocabulary without a usable tokenizer.json.
    """
    from ..model.hf import read_config
    from ..model.vocab import build_token_map

    if not _is_hf(ck):
        return None
    cfg, _ = read_config(ck)
    if cfg.vocab_size == len(VOCAB):
        return None
    return build_token_map(ck / "tokenizer.json", cfg.vocab_size)


def _label(ck: Path, taken: set[str]) -> str:
    name = f"{ck.parent.parent.name}:{ck.name}" if ck.parent.name == "checkpoints" else ck.name
    base, i = name, 2
    while name in taken:
        name, i = f"{base}#{i}", i + 1
    taken.add(name)
    return name


def evaluate(
    checkpoint: str | Path | list[str | Path] | None,
    data_dir: str | Path,
    split: str = "eval",
    bins: str = "log2",
    baseline: str | Path | None = None,
    chunk_tokens: int | None = None,
    max_windows: int | None = None,
    device: str = "cpu",
    *,
    markov: int | None = None,
    markov_alpha: float = 1.0,
    reverse_complement: bool = False,
    split_by: str | None = None,
    resamples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    models: list | None = None,
    loss_vocab: str | None = None,
    copy_probe: bool = False,
    copy_segment: int = SEGMENT,
    copy_distances_n: int = 8,
) -> dict:
    """Position-binned held-out loss of one or more checkpoints (and references) on ``split`` of ``data_dir``.

    Args:
        checkpoint: a checkpoint (a genoctx checkpoint, run directory or HF model directory:
            :func:`load_eval_model`), or a list of them. With a list of two or more, the
            first is the baseline. With ``baseline`` given (the older form), that is the baseline instead.
            The document's top-level ``bins``/``overall`` report the last checkpoint (the only one, or the
            one that is not the baseline in ``checkpoint=X, baseline=Y``); every model is in ``models``.
        baseline: checkpoint to compare against (alias of putting it first in the list).
        chunk_tokens: score windows in chunks of this many tokens with the carried cache (bounded memory).
        markov: also fit an order-K Markov chain on the ``train`` split and score the same tokens; with no
            checkpoint at all it is the only (reported) model.
        markov_alpha: its add-α pseudo-count.
        reverse_complement: also score the reverse-complement strand of every window (views ``reverse/*``,
            ``both/*``).
        split_by: ``"softmask"`` to report soft-masked and unmasked bases separately (views ``*/softmasked``,
            ``*/unmasked``); None for no split.
        resamples, seed, level: percentile bootstrap over windows (B resamples, numpy seed, two-sided level).
        models: extra ``(name, chunk-contract model)`` pairs scored after the checkpoints (tests, notebooks).
        loss_vocab: ``full`` or ``nucleotide`` for models with a text vocabulary (``genoctx.model.vocab``); None =
            each checkpoint's own (``full`` for an HF base). Each model entry records its ``loss_vocab``.
        copy_probe: also run the copy probe (``genoctx.eval.copyprobe``) on the same windows with every model: a
            ``copy_segment``-base segment copied to the window's end from ``copy_distances_n`` log-spaced distances;
            each model entry gets ``copy_probe`` (rows by distance, ``reach``), the document the distances.

    Returns:
        The document described in ``docs/eval_schema.md``: ``{"bins": [...], "overall": {...}, "checkpoint",
        "baseline", "split", "windows", "window", "edges", "confidence", "models", "views"?}``; losses in
        nats per scored base, ``relative_change = loss / baseline_loss - 1``.

    Raises:
        GenoctxError: no model to score, a missing checkpoint, an HF model whose vocabulary is not the
            nucleotide one, data prepared with another vocabulary or
            without a soft-mask channel (with ``split_by="softmask"``), an empty split, bins beyond the
            window, no scored token in the windows, bad bootstrap or Markov parameters.
    """
    data_dir = Path(data_dir)
    manifest = load_manifest(data_dir)
    if list(manifest.get("vocabulary", [])) != list(VOCAB):
        raise GenoctxError(
            f"{data_dir}/manifest.json: prepared with vocabulary {manifest.get('vocabulary')}, "
            f"genoctx uses {list(VOCAB)}"
        )
    if split_by not in (None, "softmask"):
        raise GenoctxError(f"--split-by {split_by!r}: the only split is 'softmask'")
    if split_by == "softmask" and manifest.get("policies", {}).get("case") == "uppercase":
        raise GenoctxError(f"--split-by softmask: {data_dir} was prepared with --uppercase-only (no soft-mask)")
    if not 0 < level < 1:
        raise GenoctxError(f"confidence level {level} must be between 0 and 1")
    if resamples < 0:
        raise GenoctxError(f"--resamples {resamples} must be >= 0")
    if max_windows is not None and max_windows < 1:
        raise GenoctxError(f"--max-windows {max_windows} must be >= 1")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise GenoctxError(f"--chunk-tokens {chunk_tokens} must be >= 1")
    if seed < 0:
        raise GenoctxError(f"--seed {seed} must be >= 0")
    if markov is not None and not 0 <= markov <= MAX_ORDER:  # checked again by MarkovModel.fit; fail before scoring
        raise GenoctxError(f"--markov {markov}: the order must be between 0 and {MAX_ORDER}")
    if not (math.isfinite(markov_alpha) and markov_alpha >= 0):
        raise GenoctxError(f"--markov-alpha {markov_alpha}: must be a finite number >= 0")
    ckpts_in = [] if checkpoint is None else list(checkpoint) if isinstance(checkpoint, list | tuple) else [checkpoint]
    if baseline is not None:
        ckpts_in = [baseline, *ckpts_in]
    ckpts = [resolve_checkpoint(c) for c in ckpts_in]
    for ck in ckpts:  # fail before scoring anything
        _hf_token_map(ck)
    if not ckpts and markov is None and not models:
        raise GenoctxError("nothing to evaluate: give --checkpoint (one or more) or --markov K")
    ds = WindowDataset(data_dir, split)
    edges = parse_bins(bins, ds.window)
    views = view_names(reverse_complement, split_by == "softmask")
    n = len(ds) if max_windows is None else min(len(ds), max_windows)
    distances: list[int] = []
    if copy_probe:
        try:
            distances = copy_distances(ds.window, copy_segment, copy_distances_n)
        except ValueError as e:
            raise GenoctxError(f"--copy-probe: {e}") from None
    probe_windows_ = [ds[i]["tokens"].numpy() for i in range(n)] if copy_probe else []

    def probe(score, score_tails=None) -> dict | None:
        if not copy_probe:
            return None
        sums = probe_windows(score, probe_windows_, distances, copy_segment, score_tails)
        return {"segment": copy_segment, **summarize(sums, distances, resamples, seed, level)}

    scored: list[_Scored] = []
    taken: set[str] = set()
    for ck in ckpts:
        model = load_eval_model(ck, device, loss_vocab)
        vocab = loss_vocab_of(model)
        log.info("scoring %d %s windows of %d tokens with %s%s", n, split, ds.window, ck,
                 f" (softmax over the {vocab} vocabulary)" if vocab else "")  # fmt: skip
        score = model_scorer(model, chunk_tokens, device)
        res = score_windows(score, ds, edges, max_windows, views)
        entry = {"name": _label(ck, taken), "kind": "checkpoint", "path": str(ck), "loss_vocab": vocab}
        scored.append(_Scored(entry, res, probe(score, model_tail_scorer(model, chunk_tokens, device))))
        del model, score
    for name, model in models or []:
        score = model_scorer(model, chunk_tokens, device)
        res = score_windows(score, ds, edges, max_windows, views)
        taken.add(name)
        tails = model_tail_scorer(model, chunk_tokens, device)
        scored.append(_Scored({"name": name, "kind": "model", "path": None}, res, probe(score, tails)))
    if scored and scored[0].views[MAIN_VIEW].count.sum() == 0:
        raise GenoctxError(f"{data_dir}: the {n} {split} windows scored have no A/C/G/T base")
    mk: _Scored | None = None
    if markov is not None:
        log.info("fitting an order-%d Markov chain on the train split of %s", markov, data_dir)
        chain = fit_markov(data_dir, markov, markov_alpha)
        res = score_windows(markov_scorer(chain), ds, edges, max_windows, views)
        mk = _Scored(
            {
                "name": f"markov-{markov}",
                "kind": "markov",
                "path": None,
                "order": markov,
                "alpha": markov_alpha,
                "train_tokens": chain.tokens_seen,
            },
            res,
            probe(markov_scorer(chain)),
        )
        if res[MAIN_VIEW].count.sum() == 0:
            raise GenoctxError(f"{data_dir}: the {n} {split} windows scored have no A/C/G/T base")

    all_models = scored + ([mk] if mk else [])
    base = scored[0] if len(scored) >= 2 else None
    reported = scored[-1] if scored else mk
    weights = resample_weights(n, resamples, seed)
    if weights is None and resamples:
        log.warning("%d window(s): no bootstrap interval (needs at least 2 windows)", n)
    samples = {
        (id(m), v): (ratio_samples(weights, r.loss_sum, r.count) if weights is not None else None)
        for m in all_models
        for v, r in m.views.items()
    }

    def block(m: _Scored, v: str) -> dict:
        b = compare(m.views[v], None)
        refs = []
        if base is not None and m is not base:
            refs.append(("baseline", base.views[v], samples[id(base), v]))
        if mk is not None and m is not mk:
            refs.append(("markov", mk.views[v], samples[id(mk), v]))
        return _annotate(b, m.views[v], samples[id(m), v], level, refs)

    entries = []
    for m in all_models:
        e = {**m.entry, "baseline": m is base, "reported": m is reported, **block(m, MAIN_VIEW)}
        if len(views) > 1:
            e["views"] = {v: block(m, v) for v in views[1:]}
        if base is not None and m is not base:
            e["last_vs_first_bin"] = last_vs_first_bin(
                m.views[MAIN_VIEW],
                base.views[MAIN_VIEW],
                samples[id(m), MAIN_VIEW],
                samples[id(base), MAIN_VIEW],
                level,
            )
        if m.copy_probe is not None:
            e["copy_probe"] = m.copy_probe
        entries.append(e)
    top = next(e for e in entries if e["reported"])
    doc = {"bins": top["bins"], "overall": top["overall"]}
    doc.update(
        {
            "checkpoint": top["path"] if top["kind"] == "checkpoint" else None,
            "baseline": base.entry["path"] if base is not None else None,
            "reported": top["name"],
            "split": split,
            "windows": n,
            "window": ds.window,
            "edges": list(edges),
            "confidence": {
                "level": level,
                "method": "percentile bootstrap over windows, paired across models",
                "resamples": resamples if weights is not None else 0,
                "seed": seed,
            },
            "models": entries,
        }
    )
    if len(views) > 1:
        doc["views"] = top["views"]
    if copy_probe:
        doc["copy_probe"] = {"segment": copy_segment, "distances": distances, "reach_gain": REACH_GAIN}
    return doc


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _fmt_ci(ci, spec: str, scale: float = 1.0, sign: str = "") -> str:
    return "" if not ci else f" [{format(scale * ci[0], sign + spec)}, {format(scale * ci[1], sign + spec)}]"


def _table(rows_by_model: list[tuple[dict, list[dict]]], has_base: bool, base_name: str | None) -> str:
    head = ["context (tokens)", "tokens"]
    for e, _ in rows_by_model:
        head += [f"{e['name']} nats [95% CI]", "bits/base"]
        if has_base and not e.get("baseline"):
            head.append(f"change vs {base_name}")
    first = rows_by_model[0][1]
    out_rows = []
    for i, r0 in enumerate(first):
        rng = "overall" if r0.get("start") is None else f"[{r0['start']}, {r0['end']})"
        row = [rng, str(r0["tokens"])]
        for e, rows in rows_by_model:
            r = rows[i]
            row += [_fmt(r["loss"], ".4f") + _fmt_ci(r.get("loss_ci"), ".4f"), _fmt(r.get("bits_per_base"), ".4f")]
            if has_base and not e.get("baseline"):
                rc = r.get("relative_change")
                row.append(
                    ("-" if rc is None else f"{100 * rc:+.2f}%") + _fmt_ci(r.get("relative_change_ci"), ".2f", 100, "+")
                )
        out_rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in out_rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in out_rows]
    return "\n".join(lines)


def to_table(doc: dict) -> str:
    """A plain-text table per view: one row per bin then the overall row; one loss column (with its interval)
    per model and one change-vs-baseline column per non-baseline model."""
    models = doc.get("models")
    if not models:  # a bare compare() document
        models = [{"name": "loss", "baseline": False, "bins": doc["bins"], "overall": doc["overall"]}]
    has_base = any(e.get("baseline") for e in models) or "baseline_loss" in doc["overall"]
    base_name = next((e["name"] for e in models if e.get("baseline")), "baseline")
    views = [MAIN_VIEW, *(models[0].get("views") or {})]
    parts = []
    for v in views:
        rows = []
        for e in models:
            blk = e if v == MAIN_VIEW else e["views"][v]
            rows.append((e, [*blk["bins"], {**blk["overall"], "start": None}]))
        title = f"# {v} ({doc.get('split', '?')} split, {doc.get('windows', '?')} windows)"
        parts.append((title + "\n" if len(views) > 1 else "") + _table(rows, has_base, base_name))
    trend = [e for e in models if e.get("last_vs_first_bin")]
    if trend:
        t = trend[0]["last_vs_first_bin"]
        lines = [f"# change vs {base_name}, last bin {_span(t['last_bin'])} minus first bin {_span(t['first_bin'])} "
                 "(percentage points; negative: a larger gain far into the window)"]  # fmt: skip
        for e in trend:
            t = e["last_vs_first_bin"]
            ci = _fmt_ci(t.get("change_difference_ci"), ".2f", 100, "+")
            lines.append(f"{e['name']}: {100 * t['change_difference']:+.2f}{ci}  "
                         f"({100 * t['last_change']:+.2f}% vs {100 * t['first_change']:+.2f}%)")  # fmt: skip
        parts.append("\n".join(lines))
    if doc.get("copy_probe"):
        parts.append(copy_table(doc))
    return "\n\n".join(parts)


def _span(b: list[int]) -> str:
    return f"[{b[0]}, {b[1]})"


def copy_table(doc: dict) -> str:
    """The copy probe as text: per distance, each model's loss on the copy, in place and the gain (nats per base,
    with intervals), then each model's reach."""
    models = [e for e in doc["models"] if e.get("copy_probe")]
    seg = doc["copy_probe"]["segment"]
    head = ["distance (bases)"]
    for e in models:
        head += [f"{e['name']} copied", "in place", "gain [95% CI]"]
    rows = []
    for i, d in enumerate(doc["copy_probe"]["distances"]):
        row = [str(d)]
        for e in models:
            r = e["copy_probe"]["rows"][i]
            row += [_fmt(r["copied_loss"], ".4f"), _fmt(r["in_place_loss"], ".4f"),
                    _fmt(r["gain"], "+.4f") + _fmt_ci(r.get("gain_ci"), ".4f", 1.0, "+")]  # fmt: skip
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = [f"# copy probe: a {seg}-base segment copied to the window's end from d bases before (nats per base)"]
    lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    gain = doc["copy_probe"].get("reach_gain", 0.1)
    for e in models:
        reach = e["copy_probe"]["reach"]
        lines.append(f"reach of {e['name']}: " + (f"{reach} bases" if reach is not None else "none")
                     + f" (largest distance whose gain interval is above {gain} nats)")  # fmt: skip
    return "\n".join(lines)


CSV_COLUMNS = [
    "start", "end", "tokens", "loss", "bits_per_base", "baseline_loss", "relative_change",
    "loss_ci_low", "loss_ci_high", "difference", "difference_ci_low", "difference_ci_high",
    "relative_change_ci_low", "relative_change_ci_high", "markov_loss", "markov_relative_change",
    "model", "view",
]  # fmt: skip


def _flat(row: dict, model: str, view: str) -> dict:
    r = {**row, "model": model, "view": view}
    for k in ("loss_ci", "difference_ci", "relative_change_ci"):
        ci = row.get(k)
        r[f"{k}_low"], r[f"{k}_high"] = (ci[0], ci[1]) if ci else (None, None)
    return r


def to_csv(doc: dict) -> str:
    """CSV, one row per (model, view, bin) and an ``overall`` row per (model, view) (``start`` = overall).

    The reported model's main view comes first (the rows of the single-model form); the columns
    ``start,end,tokens,loss,bits_per_base,baseline_loss,relative_change`` keep their order.
    """
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    models = doc.get("models") or [{"name": "", "reported": True, "bins": doc["bins"], "overall": doc["overall"]}]
    models = sorted(models, key=lambda e: not e.get("reported"))
    for e in models:
        for v, blk in [(MAIN_VIEW, e), *(e.get("views") or {}).items()]:
            for b in blk["bins"]:
                w.writerow(_flat(b, e["name"], v))
            w.writerow(_flat({**blk["overall"], "start": "overall"}, e["name"], v))
    return buf.getvalue()
