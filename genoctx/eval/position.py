"""Held-out loss binned by how much context each token had, with intervals, baselines and references.

Every window is scored as the model sees it in training: ``<bos>`` then the window, so the base at window
position p (0-based) is predicted from exactly p bases of preceding context. A token's *position* is that p.
N bases are never scored. Per bin we report the scored-token count, the mean loss in nats per base, the
same in bits per base (nats / ln 2), and a percentile-bootstrap interval over windows (``bootstrap.py``).

Several models are scored on the same windows: checkpoints (the first one is the baseline; every other model
gets its absolute and relative change against it, with a paired-bootstrap interval) and optionally an
order-K Markov chain fitted on the training split (``markov.py``), the reference a model that learned to use
long context must beat, and optionally the repeat reference (``repeat.py``: context models mixed with experts that
copy earlier forward and reverse-complement occurrences in the window), how much far context can give on this DNA
without a network. Every other model's rows carry its change vs each reference (``markov_*``, ``reference_*``). Any
object with the chunk contract ``model(inputs [B, T], cache) -> (logits [B, T, V], cache)`` can be scored.

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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data.dataset import WindowDataset, load_manifest
from ..data.tokenizer import VOCAB
from ..errors import GenoctxError
from ..train.checkpoint import check_base, read_state, resolve_checkpoint
from ..train.integrity import refuse_unverified, run_of
from .bootstrap import percentile_interval, ratio_samples, resample_weights
from .copyprobe import REACH_GAIN, SEGMENT, copy_distances, probe_windows, summarize
from .markov import MAX_ORDER, fit_markov
from .plot import plot
from .repeat import EXPERTS, KMER, ORDER, check_repeat_args, fit_repeat
from .scoring import (  # noqa: F401 -- the scoring names stay importable from here
    MAIN_VIEW,
    MASKS,
    STRANDS,
    BinnedLoss,
    EvalCheckpoint,
    ScoreFn,
    _hf_token_map,
    binned_losses,
    eval_checkpoint,
    load_eval_model,
    loss_vocab_of,
    markov_scorer,
    model_scorer,
    model_tail_scorer,
    position_losses,
    rc_window,
    score_windows,
    view_names,
    with_head,
)

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
    mesh=None,
    verify: bool = True,
    reference: str | None = None,
    repeat_order: int = ORDER,
    repeat_kmer: int = KMER,
    repeat_experts: int = EXPERTS,
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
        reference: ``"repeat"`` to also score the repeat reference (``genoctx.eval.repeat``: its static context
            models fitted on the ``train`` split with ``repeat_order``, repeat experts of ``repeat_kmer``-base seeds,
            at most ``repeat_experts`` alive) on the same windows, views and copy probe, in this process (also with
            ``mesh``); None for none. With no checkpoint it is the reported model (rather than the Markov chain).
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
        mesh: a ``genoctx.eval.distributed.MeshEval``: score the checkpoints on Ray workers on that mesh (FSDP, EP,
            CP; no rank holds a model) instead of in this process; every statistic is then computed here from the
            sums the workers reduced, exactly as for one process. ``models`` and ``copy_probe`` need one process.
        verify: check each genoctx checkpoint's weight files against the sizes and digests recorded when it was
            written (``genoctx.train.integrity``) before anything is scored (on a mesh: by the workers, the hashing
            spread over them). A run directory whose newest checkpoint does not verify is refused, naming the newest
            one that does: an eval measures one specific model.

    Returns:
        The document described in ``docs/eval_schema.md``: ``{"bins": [...], "overall": {...}, "checkpoint",
        "baseline", "split", "windows", "window", "edges", "confidence", "models", "views"?}``; losses in
        nats per scored base, ``relative_change = loss / baseline_loss - 1``.

    Raises:
        GenoctxError: no model to score, a missing checkpoint, an HF model whose vocabulary is not the
            nucleotide one, data prepared with another vocabulary or
            without a soft-mask channel (with ``split_by="softmask"``), an empty split, bins beyond the
            window, no scored token in the windows, bad bootstrap, Markov or repeat-reference parameters (an unknown
            ``reference``); with ``mesh``, a layout the models or the window cannot take, a plan that does not fit,
            the copy probe, a failed worker group.
    """
    data_dir = Path(data_dir)
    _check_eval_args(data_dir, split_by, level, resamples, max_windows, chunk_tokens, seed, markov, markov_alpha)
    _check_reference_args(reference, repeat_order, repeat_kmer, repeat_experts)
    if mesh is not None and (copy_probe or models):
        raise GenoctxError(
            "--copy-probe needs one process (omit --num-workers): it continues every edited tail from a cached "
            "prefix, which the context-parallel mesh does not carry" if copy_probe else
            "evaluate(models=...) scores in-process models: not with a mesh"
        )  # fmt: skip
    ckpts_in = [] if checkpoint is None else list(checkpoint) if isinstance(checkpoint, list | tuple) else [checkpoint]
    if baseline is not None:
        ckpts_in = [baseline, *ckpts_in]
    ckpts = [resolve_checkpoint(c) for c in ckpts_in]
    for ck in ckpts:  # fail before scoring anything
        _hf_token_map(ck)
    if verify and mesh is None:  # (on a mesh the workers check, each hashing its share)
        for given, ck in zip(ckpts_in, ckpts, strict=True):
            if (ck / "state.json").is_file():
                refuse_unverified(ck, given, run_of(given), "--checkpoint", "evaluate it")
    if mesh is not None:  # a checkpoint holding only what trains: its base checked here (one process: load_model)
        for ck in ckpts:
            if (ck / "state.json").is_file():
                check_base(read_state(ck), ck)
    if not ckpts and markov is None and reference is None and not models:
        raise GenoctxError("nothing to evaluate: give --checkpoint (one or more), --markov K or --reference repeat")
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

    taken: set[str] = set()
    if mesh is not None:
        from .distributed import score_on_mesh

        results = score_on_mesh(ckpts, data_dir, split, edges, views, n, ds.window, chunk_tokens, loss_vocab, mesh,
                                verify=verify, given=ckpts_in)  # fmt: skip
        scored = [_Scored(_entry(spec.path, taken, spec.loss_vocab), res) for spec, res in results]
    else:
        scored = _score_in_process(ckpts, ds, edges, views, max_windows, chunk_tokens, device, loss_vocab, taken,
                                   probe)  # fmt: skip
    for name, model in models or []:
        score = model_scorer(model, chunk_tokens, device)
        res = score_windows(score, ds, edges, max_windows, views, label=name)
        taken.add(name)
        tails = model_tail_scorer(model, chunk_tokens, device)
        scored.append(_Scored({"name": name, "kind": "model", "path": None}, res, probe(score, tails)))
    if scored and scored[0].views[MAIN_VIEW].count.sum() == 0:
        raise GenoctxError(f"{data_dir}: the {n} {split} windows scored have no A/C/G/T base")
    # the references are scored here whatever the checkpoints ran on (with a mesh too): numpy on the host
    mk = ref = None
    if markov is not None:
        mk = _score_markov(data_dir, markov, markov_alpha, ds, edges, max_windows, views, probe)
    if reference is not None:
        ref = _score_repeat(data_dir, repeat_order, repeat_kmer, repeat_experts, ds, edges, max_windows, views, probe)
    for r in (mk, ref):
        if r is not None and r.views[MAIN_VIEW].count.sum() == 0:
            raise GenoctxError(f"{data_dir}: the {n} {split} windows scored have no A/C/G/T base")
    doc = _document(scored, mk, views, n, resamples, seed, level, ref)
    doc.update(split=split, windows=n, window=ds.window, edges=list(edges))
    doc = {k: doc[k] for k in _DOC_ORDER if k in doc}
    if copy_probe:
        doc["copy_probe"] = {"segment": copy_segment, "distances": distances, "reach_gain": REACH_GAIN}
    return doc


_DOC_ORDER = ("bins", "overall", "checkpoint", "baseline", "reported", "split", "windows", "window", "edges",
              "confidence", "models", "views")  # fmt: skip


def _check_eval_args(data_dir, split_by, level, resamples, max_windows, chunk_tokens, seed, markov, markov_alpha):
    """``evaluate``'s argument checks, before anything is loaded or scored (one-line ``GenoctxError``)."""
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


def _check_reference_args(reference, repeat_order, repeat_kmer, repeat_experts):
    """The reference flags' checks (one-line ``GenoctxError`` naming the flag), before anything is loaded; the repeat
    reference's parameters are checked even without ``reference`` (as ``--markov-alpha`` without ``--markov``)."""
    if reference not in (None, "repeat"):
        raise GenoctxError(f"--reference {reference!r}: the only reference is 'repeat'")
    check_repeat_args(repeat_order, repeat_kmer, repeat_experts)


def _entry(path: Path, taken: set[str], vocab: str | None) -> dict:
    """A checkpoint's identity in the document's ``models``."""
    return {"name": _label(path, taken), "kind": "checkpoint", "path": str(path), "loss_vocab": vocab}


def _score_in_process(ckpts, ds, edges, views, max_windows, chunk_tokens, device, loss_vocab, taken, probe):
    """Every checkpoint loaded in turn in this process and scored on the windows (and by the copy probe)."""
    n = len(ds) if max_windows is None else min(len(ds), max_windows)
    scored = []
    for ck in ckpts:
        model = load_eval_model(ck, device, loss_vocab)
        vocab = loss_vocab_of(model)
        log.info("scoring %d %s windows of %d tokens with %s%s", n, ds.split, ds.window, ck,
                 f" (softmax over the {vocab} vocabulary)" if vocab else "")  # fmt: skip
        score = model_scorer(model, chunk_tokens, device)
        entry = _entry(ck, taken, vocab)
        res = score_windows(score, ds, edges, max_windows, views, label=entry["name"])
        scored.append(_Scored(entry, res, probe(score, model_tail_scorer(model, chunk_tokens, device))))
        del model, score
    return scored


def _score_markov(data_dir, markov, markov_alpha, ds, edges, max_windows, views, probe) -> _Scored:
    """The order-``markov`` chain fitted on the train split, scored on the same windows."""
    log.info("fitting an order-%d Markov chain on the train split of %s", markov, data_dir)
    chain = fit_markov(data_dir, markov, markov_alpha)
    res = score_windows(markov_scorer(chain), ds, edges, max_windows, views, label=f"markov-{markov}")
    entry = {"name": f"markov-{markov}", "kind": "markov", "path": None, "order": markov, "alpha": markov_alpha,
             "train_tokens": chain.tokens_seen}  # fmt: skip
    return _Scored(entry, res, probe(markov_scorer(chain)))


def _score_repeat(data_dir, order, kmer, experts, ds, edges, max_windows, views, probe) -> _Scored:
    """The repeat reference (static part fitted on the train split), scored on the same windows from the preceding
    bases of each window only, and by the copy probe."""
    log.info("fitting the repeat reference (order %d, %d-base seeds, %d experts) on the train split of %s", order,
             kmer, experts, data_dir)  # fmt: skip
    model = fit_repeat(data_dir, order, kmer, experts)
    res = score_windows(model.token_losses, ds, edges, max_windows, views, label=model.name)
    entry = {"name": model.name, "kind": "reference", "path": None, **model.describe()}
    return _Scored(entry, res, probe(model.token_losses))


def _document(scored: list[_Scored], mk: _Scored | None, views: list[str], n: int, resamples: int, seed: int,
              level: float, ref: _Scored | None = None) -> dict:  # fmt: skip
    """The statistics of every model from its per-window sums: intervals (bootstrap over the ``n`` windows, paired
    across models), changes vs the baseline (the first checkpoint when there are two or more), vs the Markov
    chain ``mk`` and vs the repeat reference ``ref``, ``last_vs_first_bin``; the top-level ``bins``/``overall``
    report the last checkpoint (without one: the repeat reference, else the Markov chain)."""
    all_models = scored + [m for m in (mk, ref) if m is not None]
    base = scored[0] if len(scored) >= 2 else None
    reported = scored[-1] if scored else ref or mk
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
        if ref is not None and m is not ref:
            refs.append(("reference", ref.views[v], samples[id(ref), v]))
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
    doc = {
        "bins": top["bins"],
        "overall": top["overall"],
        "checkpoint": top["path"] if top["kind"] == "checkpoint" else None,
        "baseline": base.entry["path"] if base is not None else None,
        "reported": top["name"],
        "confidence": {
            "level": level,
            "method": "percentile bootstrap over windows, paired across models",
            "resamples": resamples if weights is not None else 0,
            "seed": seed,
        },
        "models": entries,
    }
    if len(views) > 1:
        doc["views"] = top["views"]
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
    "reference_loss", "reference_relative_change", "model", "view",
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
