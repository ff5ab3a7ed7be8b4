"""Percentile bootstrap over windows for position-binned losses, paired across models.

A window is the resampling unit: bases inside one window are strongly correlated (repeats, isochores), so
resampling tokens would give intervals that are far too narrow. Every model is scored on the same windows,
and one matrix of resampling weights is drawn per evaluation and applied to all of them, so the interval of
a difference between two models is a *paired* bootstrap interval (Efron & Tibshirani, "An Introduction to
the Bootstrap", 1993, ch. 13 for percentile intervals; the window is the block of a block bootstrap).

Estimates are ratios of sums (sum of losses / count of scored tokens) recomputed in each resample.
"""

from __future__ import annotations

import numpy as np


def resample_weights(n_windows: int, resamples: int, seed: int) -> np.ndarray | None:
    """Multiplicities of each window in each bootstrap resample.

    Args:
        n_windows: number of scored windows (n).
        resamples: number of bootstrap resamples (B).
        seed: seed of ``numpy.random.default_rng``; the same seed gives the same intervals.

    Returns:
        int64 [B, n], each row sums to n (a multinomial draw = n windows drawn with replacement), or None
        when an interval cannot be estimated (n < 2 or B < 1).
    """
    if n_windows < 2 or resamples < 1:
        return None
    rng = np.random.default_rng(seed)
    return rng.multinomial(n_windows, np.full(n_windows, 1.0 / n_windows), size=resamples).astype(np.int64)


def ratio_samples(weights: np.ndarray, loss_sum: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Bootstrap replicates of the mean loss per bin and overall.

    Args:
        weights: int64 [B, n] from :func:`resample_weights`.
        loss_sum: float64 [n, bins], sum of token losses (nats) per window and bin.
        count: int64 [n, bins], scored tokens per window and bin.

    Returns:
        float64 [B, bins + 1] mean loss in nats (last column = all bins together); NaN where a resample has
        no scored token in that bin.
    """
    w = weights.astype(np.float64)
    s = w @ loss_sum
    c = w @ count.astype(np.float64)
    s = np.concatenate([s, s.sum(1, keepdims=True)], axis=1)
    c = np.concatenate([c, c.sum(1, keepdims=True)], axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(c > 0, s / np.where(c > 0, c, 1), np.nan)


def percentile_interval(samples: np.ndarray, level: float = 0.95) -> list[list[float] | None]:
    """Two-sided percentile interval per column of ``samples`` [B, k]: ``[[low, high] or None] * k``.

    A column whose replicates are all NaN (no scored token in any resample) gives None.
    """
    alpha = (1.0 - level) / 2.0
    out: list[list[float] | None] = []
    for col in samples.T:
        col = col[np.isfinite(col)]
        if col.size == 0:
            out.append(None)
        else:
            lo, hi = np.quantile(col, [alpha, 1.0 - alpha])
            out.append([float(lo), float(hi)])
    return out
