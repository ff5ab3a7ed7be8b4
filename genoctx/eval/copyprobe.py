"""A probe of reach: does the model copy a segment it saw ``d`` bases earlier?

In each held-out window of W bases a segment of ``segment`` bases (default 200) is copied from an earlier position
to the end of the window: the destination is always ``[W - segment, W)`` and the source ``[W - segment - d,
W - d)``, so that the copy has the same amount of context at every distance ``d`` and only the distance to its
source changes (a distance shorter than the segment continues the copy periodically: ``copy_sources``). Distances
are log-spaced from 64 bases to ``W - segment`` (the farthest copy that fits).

For every distance the probe reports, over the windows (percentile bootstrap over windows, as ``bootstrap.py``):

- ``copied_loss``: the mean loss (nats per base) on the copied bases at the destination, in the edited window;
- ``in_place_loss``: the mean loss on the same bases at their sources, in the unedited window (what predicting
  those bases costs without a copy to look back at);
- ``gain = in_place_loss - copied_loss`` with a paired interval (the same windows resampled for both).

A model that uses its context has ``copied_loss`` near zero (a gain near the in-place loss) at every distance
within its reach; an order-K Markov chain and an untrained model show no gain at any distance beyond K. The
``reach`` of a model is the largest distance whose gain interval lies above ``REACH_GAIN`` nats (None when no
distance qualifies). N bases are never scored (a copied N stays unscored).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..progress import bar
from .bootstrap import percentile_interval, resample_weights

SEGMENT = 200  # bases copied
MIN_DISTANCE = 64  # bases between the source's start and the copy's start
REACH_GAIN = 0.1  # nats per base: a gain whose interval is above this counts as "within reach"


def copy_distances(window: int, segment: int = SEGMENT, n: int = 8, lowest: int = MIN_DISTANCE) -> list[int]:
    """Log-spaced distances in bases, ``lowest`` .. ``window - segment`` (``n`` values at most; duplicates after
    rounding dropped), ascending.

    Raises:
        ValueError: a window too short for one copy at ``lowest`` (``window < segment + lowest``), ``n < 1``,
            ``segment < 1``.
    """
    if segment < 1 or n < 1:
        raise ValueError(f"copy probe: segment ({segment}) and the number of distances ({n}) must be >= 1")
    top = window - segment
    if top < lowest:
        raise ValueError(
            f"copy probe: a {window}-base window has no room for a {segment}-base copy {lowest} bases after its "
            f"source (needs at least {segment + lowest} bases)"
        )
    if n == 1:
        return [top]
    d = np.unique(np.round(np.geomspace(lowest, top, n)).astype(np.int64))
    return [int(x) for x in d]


def copy_sources(window: int, distance: int, segment: int = SEGMENT) -> np.ndarray:
    """For each base of the copy (window positions ``[W - segment, W)``), the position of its original in the
    unedited window: ``src + (i mod distance)`` for the copy's i-th base, ``src = W - segment - distance``.

    With ``distance >= segment`` this is the plain copy of ``[src, src + segment)``. A shorter distance makes the
    copy overlap its own source, so the copy continues periodically (a tandem repeat of period ``distance``, each
    copied base equal to the one ``distance`` before it): every copied base still has an identical base exactly
    ``distance`` bases earlier in the edited window.

    Returns:
        int64 [segment] positions in ``[src, src + min(segment, distance))``.

    Raises:
        ValueError: the copy does not fit (``window < segment + distance``) or ``distance < 1``.
    """
    dst = window - segment
    src = dst - distance
    if src < 0 or distance < 1:
        raise ValueError(f"copy probe: distance {distance} does not fit a {segment}-base copy in {window} bases")
    return src + np.arange(segment) % distance


def copied_window(tokens: np.ndarray, distance: int, segment: int = SEGMENT) -> tuple[np.ndarray, np.ndarray, int]:
    """The window with its last ``segment`` bases replaced by the copy (``copy_sources``).

    Args:
        tokens: int64 [W] window token ids.

    Returns:
        (edited copy of ``tokens`` [W], the sources of the copied bases int64 [segment], the destination start).
    """
    W = tokens.shape[0]
    sources = copy_sources(W, distance, segment)
    out = tokens.copy()
    out[W - segment :] = tokens[sources]
    return out, sources, W - segment


TailScoreFn = Callable[[np.ndarray, int, list[np.ndarray]], tuple[np.ndarray, list[np.ndarray]]]
"""Scores one window and alternative endings of it: ``(tokens int64 [W], dst, tails: list of int64 [W - dst])`` ->
``(float64 [W] losses of the unedited window, list of float64 [W - dst] losses of each tail put at [dst, W))``,
nats, 0 where not scored. A model scores the shared prefix ``[0, dst)`` once and each tail after it from the carried
cache (``genoctx.eval.position.model_tail_scorer``); ``rescoring_tails`` is the slow reference for any scorer."""


def rescoring_tails(score) -> TailScoreFn:
    """A :data:`TailScoreFn` from a plain ``ScoreFn`` (int64 [W] -> float64 [W] nats): every edited window is scored
    whole. The reference the cached fast path is tested against, and the path of the Markov chain (cheap anyway)."""

    def score_tails(tokens: np.ndarray, dst: int, tails: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        base = np.asarray(score(tokens), dtype=np.float64)
        out = []
        for tail in tails:
            edited = tokens.copy()
            edited[dst:] = tail
            out.append(np.asarray(score(edited), dtype=np.float64)[dst:])
        return base, out

    return score_tails


def probe_windows(
    score,
    windows: list[np.ndarray],
    distances: list[int],
    segment: int = SEGMENT,
    score_tails: TailScoreFn | None = None,
) -> dict:
    """Score the copies of every window at every distance.

    Args:
        score: a ``genoctx.eval.position.ScoreFn`` (int64 [W] -> float64 [W] nats, 0 where not scored); used through
            ``rescoring_tails`` unless ``score_tails`` is given.
        windows: int64 [W] token ids each. distances: bases (``copy_distances``). segment: bases copied.
        score_tails: a faster :data:`TailScoreFn` computing the same losses (a model's cached prefix), or None.

    Returns:
        ``{"copied_sum", "in_place_sum"}`` float64 [windows, distances] nats and ``{"copied_count",
        "in_place_count"}`` int64 [windows, distances] scored bases (equal unless the edit moved an N).
    """
    score_tails = score_tails or rescoring_tails(score)
    n, k = len(windows), len(distances)
    out = {key: np.zeros((n, k)) for key in ("copied_sum", "in_place_sum")}
    out.update({key: np.zeros((n, k), dtype=np.int64) for key in ("copied_count", "in_place_count")})
    with bar("copy probe", n, "windows") as progress:  # genoctx.progress
        for i, tokens in enumerate(windows):
            tokens = np.asarray(tokens, dtype=np.int64)
            scored = (tokens >= 0) & (tokens <= 3)
            edits = [copied_window(tokens, d, segment) for d in distances]
            dst = edits[0][2]
            base, tail_losses = score_tails(tokens, dst, [edited[dst:] for edited, _, _ in edits])
            for j, ((_, sources, _), losses) in enumerate(zip(edits, tail_losses, strict=True)):
                ok = scored[sources]  # the copied bases that are scored (the same ones in both places)
                out["copied_sum"][i, j] = np.asarray(losses)[ok].sum()
                out["copied_count"][i, j] = int(ok.sum())
                out["in_place_sum"][i, j] = base[sources][ok].sum()
                out["in_place_count"][i, j] = int(ok.sum())
            progress.advance()
    return out


def summarize(sums: dict, distances: list[int], resamples: int = 1000, seed: int = 0, level: float = 0.95) -> dict:
    """Per distance: mean copied and in-place loss, the gain, their intervals and the reach (module docstring).

    Returns:
        ``{"rows": [{"distance", "tokens", "copied_loss", "copied_ci", "in_place_loss", "in_place_ci", "gain",
        "gain_ci"}, ...], "reach": int | None}``; losses in nats per base, intervals ``[low, high]`` or None.
    """
    cs, cc = sums["copied_sum"], sums["copied_count"]
    ps, pc = sums["in_place_sum"], sums["in_place_count"]
    n = cs.shape[0]
    weights = resample_weights(n, resamples, seed)

    def mean(s, c, w=None):
        if w is None:
            tot = c.sum(0)
            return np.where(tot > 0, s.sum(0) / np.maximum(tot, 1), np.nan)
        tot = w @ c
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(tot > 0, (w @ s) / np.maximum(tot, 1), np.nan)

    copied, in_place = mean(cs, cc), mean(ps, pc)
    cis = {"copied": None, "in_place": None, "gain": None}
    if weights is not None:
        w = weights.astype(np.float64)
        rc, rp = mean(cs, cc, w), mean(ps, pc, w)
        cis = {
            "copied": percentile_interval(rc, level),
            "in_place": percentile_interval(rp, level),
            "gain": percentile_interval(rp - rc, level),
        }
    rows, reach = [], None
    for j, d in enumerate(distances):

        def f(x):
            return None if not np.isfinite(x) else float(x)

        row = {
            "distance": int(d),
            "tokens": int(cc[:, j].sum()),
            "copied_loss": f(copied[j]),
            "copied_ci": cis["copied"][j] if cis["copied"] else None,
            "in_place_loss": f(in_place[j]),
            "in_place_ci": cis["in_place"][j] if cis["in_place"] else None,
            "gain": f(in_place[j] - copied[j]),
            "gain_ci": cis["gain"][j] if cis["gain"] else None,
        }
        rows.append(row)
        lo = row["gain_ci"][0] if row["gain_ci"] else row["gain"]
        if lo is not None and lo > REACH_GAIN:
            reach = int(d)
    return {"rows": rows, "reach": reach}
