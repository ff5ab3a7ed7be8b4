"""An order-K Markov chain over nucleotides: the no-neural-network reference for ``eval --by-position``.

Design choices:
- Fitted on the *training* split of the same prepared data (the windows' coverage of each shard, merged so
  that overlapping windows are not counted twice), scored on exactly the tokens the neural models score.
- ``P(x | c) = (n(c, x) + α) / (n(c) + 4α)`` (add-α / Lidstone smoothing) for the K bases ``c`` before x.
- N breaks context: a context never spans an N, and never reaches before the start of a training segment or
  of the scored window (the neural model sees the same window). Where fewer than K clean bases precede a
  token, or where the K-base context was never seen in training, the longest clean suffix context seen in
  training is used (orders K, K-1, ..., 0 are all fitted). The chosen order depends on the context only, so
  every prediction is a proper distribution over A C G T.
- Vectorised numpy: context codes are base-4 integers built by K shifted adds; counts are ``np.unique`` over
  ``code * 4 + base`` (sparse, so K = 12 needs memory proportional to the data, not 4^12 rows).

Its loss is flat in position (beyond the first K bases of a window) by construction: a model that uses
long context must beat it in the late bins. Reference: Durbin et al., "Biological Sequence Analysis"
(1998), ch. 3 (Markov chains for DNA); Chen & Goodman (1999) for additive smoothing and back-off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..data.dataset import WindowDataset
from ..errors import GenoctxError
from ..progress import bar

MAX_ORDER = 16  # codes of K + 1 bases fit in int64 up to K = 30; 16 keeps the count tables reasonable
FIT_BLOCK = 1 << 22  # bases counted at a time when fitting (memory: about 30 x 8 bytes x (K + 1) per base of a block)
DENSE_MAX = 1 << 24  # orders with at most this many (context, base) cells are counted in a dense table


def clean_run(tokens: np.ndarray) -> np.ndarray:
    """Number of consecutive A/C/G/T bases immediately before each position (capped by the segment start).

    tokens: integer [L] (A..T = 0..3; anything else breaks context) -> int64 [L].
    """
    t = np.asarray(tokens)
    L = t.shape[0]
    bad = ~((t >= 0) & (t <= 3))
    idx = np.arange(L)
    # index of the most recent bad position strictly before i (or -1)
    last_bad = np.where(bad, idx, -1)
    last_bad = np.maximum.accumulate(last_bad)
    prev_bad = np.concatenate([[-1], last_bad[:-1]]) if L else last_bad
    return (idx - 1 - prev_bad).astype(np.int64)


def context_codes(tokens: np.ndarray, order: int) -> list[np.ndarray]:
    """Base-4 codes of the k bases before each position, for k = 0..order.

    ``codes[k][i] = sum_{j=1..k} tokens[i-j] * 4**(j-1)`` (int64 [L]); only meaningful where
    ``clean_run(tokens)[i] >= k`` (other entries are arbitrary).
    """
    t = np.where((tokens >= 0) & (tokens <= 3), tokens, 0).astype(np.int64)
    L = t.shape[0]
    codes = [np.zeros(L, dtype=np.int64)]
    for k in range(1, order + 1):
        shifted = np.zeros(L, dtype=np.int64)
        if k < L:
            shifted[k:] = t[: L - k]
        codes.append(codes[-1] + (shifted << (2 * (k - 1))))
    return codes


@dataclass
class MarkovModel:
    """Counts of an order-K nucleotide Markov chain and all its lower orders.

    ``contexts[k]``: sorted int64 [m_k] context codes seen for order k; ``counts[k]``: int64 [m_k, 4] counts of
    the next base per context. ``alpha`` is the add-α pseudo-count (0 allowed: maximum likelihood).
    """

    order: int
    alpha: float = 1.0
    contexts: list[np.ndarray] = field(default_factory=list)
    counts: list[np.ndarray] = field(default_factory=list)
    tokens_seen: int = 0

    @classmethod
    def fit(cls, segments: list[np.ndarray], order: int, alpha: float = 1.0) -> MarkovModel:
        """Count contexts in ``segments`` (integer token arrays [L_i]; non-ACGT ids break context).

        Raises:
            GenoctxError: order outside 0..MAX_ORDER, negative alpha, or no A/C/G/T base in the segments.
        """
        if not 0 <= order <= MAX_ORDER:
            raise GenoctxError(f"--markov {order}: the order must be between 0 and {MAX_ORDER}")
        if alpha < 0 or not math.isfinite(alpha):
            raise GenoctxError(f"--markov-alpha {alpha}: must be a finite number >= 0")
        total = sum(len(seg) for seg in segments)
        # orders whose 4**(k+1) table is small (and not much larger than the data) are counted densely; higher ones
        # as sorted unique keys per block, merged at the end (memory: a block, the tables, the distinct contexts)
        dense = [np.zeros(4 ** (k + 1), dtype=np.int64) if 4 ** (k + 1) <= min(DENSE_MAX, 16 * total) else None
                 for k in range(order + 1)]  # fmt: skip
        parts: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(order + 1)]
        seen = 0
        # progress (genoctx.progress): bases counted; lines only when the fit takes longer than the interval
        with bar(f"markov-{order} fit", total, "bases") as progress:
            for seg in segments:
                for b0 in range(0, len(seg), FIT_BLOCK):
                    lo = max(0, b0 - order)  # the block's first bases take their context from the bases before it
                    piece = np.asarray(seg[lo : b0 + FIT_BLOCK]).astype(np.int64)
                    own = np.arange(piece.shape[0]) >= b0 - lo
                    ok = (piece >= 0) & (piece <= 3) & own
                    seen += int(ok.sum())
                    run = clean_run(piece)
                    codes = context_codes(piece, order)
                    for k in range(order + 1):
                        sel = ok & (run >= k)
                        key = codes[k][sel] * 4 + piece[sel]
                        if dense[k] is not None:
                            dense[k] += np.bincount(key, minlength=dense[k].shape[0])
                        else:
                            parts[k].append(np.unique(key, return_counts=True))
                    progress.advance(int(own.sum()))
        if seen == 0:
            raise GenoctxError("the training split has no A/C/G/T base to fit the Markov model on")
        model = cls(order=order, alpha=float(alpha), tokens_seen=seen)
        for k in range(order + 1):
            if dense[k] is not None:
                table = dense[k].reshape(-1, 4)
                contexts = np.flatnonzero(table.sum(1))
                model.contexts.append(contexts.astype(np.int64))
                model.counts.append(table[contexts])
                continue
            keys = np.concatenate([u for u, _ in parts[k]]) if parts[k] else np.zeros(0, np.int64)
            ns = np.concatenate([n for _, n in parts[k]]) if parts[k] else np.zeros(0, np.int64)
            uniq, inv = np.unique(keys, return_inverse=True)
            n = np.bincount(inv, weights=ns, minlength=uniq.shape[0]).astype(np.int64)
            ctx, sym = uniq >> 2, uniq & 3
            contexts, cinv = np.unique(ctx, return_inverse=True)
            table = np.zeros((contexts.shape[0], 4), dtype=np.int64)
            table[cinv, sym] = n
            model.contexts.append(contexts)
            model.counts.append(table)
        return model

    def token_probs(self, tokens: np.ndarray) -> np.ndarray:
        """Next-base distribution at every position of one window (the same back-off as :meth:`token_losses`).

        Args:
            tokens: integer [W] window token ids (context never reaches before position 0 nor across a non-ACGT id).

        Returns:
            float64 [W, 4] ``P(b | longest clean seen context of <= K bases)`` for b = A, C, G, T; every row sums to 1
            (rows of non-ACGT targets too: the distribution depends on the context only).
        """
        t = np.asarray(tokens).astype(np.int64, copy=False)
        out = np.zeros((t.shape[0], 4), dtype=np.float64)
        for hit, rows in self._backoff(t, np.ones(t.shape[0], dtype=bool)):
            rows = rows.astype(np.float64)
            out[hit] = (rows + self.alpha) / (rows.sum(1, keepdims=True) + 4 * self.alpha)
        return out

    def token_losses(self, tokens: np.ndarray) -> np.ndarray:
        """Next-base loss of every position of one window, in nats; 0 where not scored (non-ACGT target).

        Args:
            tokens: integer [W] window token ids (the window is scored on its own: context never reaches
                before position 0, as for the neural model).

        Returns:
            float64 [W] ``-ln P(tokens[i] | longest clean seen context of <= K bases)``.
        """
        t = np.asarray(tokens).astype(np.int64, copy=False)
        out = np.zeros(t.shape[0], dtype=np.float64)
        for hit, rows in self._backoff(t, (t >= 0) & (t <= 3)):
            num = rows[np.arange(hit.size), t[hit]] + self.alpha
            den = rows.sum(1) + 4 * self.alpha
            with np.errstate(divide="ignore"):
                out[hit] = np.log(den) - np.log(num)
        return out

    def _backoff(self, t: np.ndarray, todo: np.ndarray):
        """The back-off of :meth:`token_losses` and :meth:`token_probs`: for k = K..0, the positions of ``todo``
        (bool [W], consumed) whose k-base clean context was seen in training, and their count rows.

        Yields ``(positions int64 [m], counts int64 [m, 4])``; order 0 takes every position left.
        """
        run = clean_run(t)
        codes = context_codes(t, self.order)
        for k in range(self.order, -1, -1):
            sel = np.flatnonzero(todo & (run >= k))
            if sel.size == 0:
                continue
            ctx = self.contexts[k]
            code = codes[k][sel]
            j = np.searchsorted(ctx, code)
            j_ok = np.minimum(j, max(ctx.shape[0] - 1, 0))
            found = (j < ctx.shape[0]) & (ctx[j_ok] == code) if ctx.shape[0] else np.zeros(sel.size, bool)
            if k == 0:
                found[:] = True  # order 0 always exists after fit (tokens_seen > 0)
            hit = sel[found]
            yield hit, self.counts[k][j_ok[found]]
            todo[hit] = False

def split_segments(data_dir: str | Path, split: str) -> list[np.ndarray]:
    """The bases of ``split`` as contiguous segments: each shard's window coverage, overlaps merged.

    Returns:
        uint8 arrays (token ids) of the merged intervals, in manifest order.

    Raises:
        GenoctxError: the split has no windows, or a shard is missing (from :class:`WindowDataset`).
    """
    ds = WindowDataset(data_dir, split)
    by_shard: dict[int, list[tuple[int, int]]] = {}
    for w in ds.windows:
        by_shard.setdefault(w["shard"], []).append((w["offset"], w["offset"] + w["end"] - w["start"]))
    segments = []
    for shard, spans in by_shard.items():
        tok_map, _ = ds._open(shard)
        spans.sort()
        start, end = spans[0]
        for s, e in spans[1:]:
            if s <= end:
                end = max(end, e)
            else:
                segments.append(np.asarray(tok_map[start:end]))
                start, end = s, e
        segments.append(np.asarray(tok_map[start:end]))
    return segments


def fit_markov(data_dir: str | Path, order: int, alpha: float = 1.0, split: str = "train") -> MarkovModel:
    """Fit an order-``order`` Markov model on ``split`` (default: the training split) of a prepared directory.

    Raises:
        GenoctxError: bad order or alpha, an empty split, or a split without A/C/G/T bases.
    """
    return MarkovModel.fit(split_segments(data_dir, split), order, alpha)
