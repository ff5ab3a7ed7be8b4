"""A repeat-aware reference model for ``eval --by-position``: how much far context can give on this DNA.

The order-K Markov chain beside the models has no long context at all. DNA compressors show what far context is
worth: they mix order-k context models with *repeat models* that copy from earlier occurrences of the current k-mer,
on both strands, tolerant to substitutions (XM: Cao et al., "A simple statistical algorithm for biological sequence
compression", DCC 2007; GeCo2/GeCo3: Pratas et al., GigaScience 2020; JARVIS2: Silva et al.). This module is such a
model, scored exactly like a neural model: each base of a window is predicted from the bases of the same window
before it (never across a non-ACGT base for the context models, never from itself or a later base).

Components of the mixture at window position ``i`` (``t`` the window's ids, A C G T = 0 1 2 3):

- **static**: the order-``order`` chain fitted on the training split (``markov.MarkovModel.token_probs``, add-1,
  backing off to the longest context seen in training), and the same counts at the *low order* (:func:`low_order`:
  the highest order whose contexts hold :data:`LOW_COUNT` training bases each on average), a chain that is well
  estimated where the fitted order is not (order 10 on 1M training bases has one base per context);
- **adaptive** order-k context models for k in :data:`ADAPTIVE_ORDERS`, counted from zero in each window on the
  bases before ``i`` (``(n(c, b) + a_k) / (n(c) + 4 a_k)``, ``a_k`` from :data:`ADAPTIVE_ALPHAS`; uniform where
  fewer than k clean bases precede ``i``);
- **repeat experts**, at most ``max_experts`` alive: when the ``kmer`` bases before ``i`` are clean, each of the
  :data:`CANDIDATES` most recent earlier occurrences of that k-mer (ending at ``q <= i - 2``) spawns a *forward*
  expert that predicts ``t[q + 1]``, then ``t[q + 2]``, ...; each of the most recent earlier occurrences of its
  reverse complement (starting at ``s``) spawns a *reverse-complement* expert that predicts ``3 - t[s - 1]``, then
  ``3 - t[s - 2]``, ... An expert whose alignment an alive expert already follows is not spawned twice; new ones
  take the first free slot. An expert predicts its base with probability ``(hits + 1) / (predictions + 2)`` (the
  other three share the rest) and is dropped when more than :data:`MAX_MISSES` of its last :data:`HISTORY`
  predictions missed (substitution-tolerant: a copy with 5% substitutions keeps its expert), when its source is
  not a clean base or runs off the window, and at any non-ACGT base (which also resets the k-mer).

Weights: every component ``c`` keeps a score ``s_c <- DECAY * s_c + ln P_c(t[i])`` (a likelihood with a memory of
about ``1 / (1 - DECAY)`` bases, as XM's expert weights), and the mixture is ``P_mix = (1 - EPS) * sum_c w_c P_c +
EPS / 4`` with ``w_c`` the softmax of the scores. A new expert starts at the best context model's score minus
:data:`NEW_EXPERT_PENALTY` nats.

Final stage (GeCo3's "cooperation" of a mixture with its best single model, made a bound): such a fast-switching
mixture chases noise where no component is better than another, and loses to its own components on DNA with
nothing to take (on i.i.d. DNA, 0.7% above ln 4 in 2k windows with a uniform static chain). So the reference is a
*fixed-share* mixture (Herbster & Warmuth, "Tracking the best expert", 1998) of ``M = 1 + n_ctx`` predictors:
``P_mix`` and each context model alone (the static chains and the in-window orders). Weights start at ``1 / M``;
after each base ``v_m <- (1 - SHARE) * v_m P_m(t[i]) / P(t[i]) + SHARE / M``, ``P = sum_m v_m P_m``. Since ``v_m``
never falls below ``(1 - SHARE)`` times its Bayes update, the window's total loss is at most ``ln M + n ln(1 / (1 -
SHARE))`` nats above that of every one of them (``n`` scored bases: 0.065% of ln 4 per base at 2k windows, 0.015% at
16k, on any DNA), and a switch between them costs at most ``ln(M / SHARE)`` (~11 nats), so a copy late in a long
window is taken within a few bases. Loss at ``i``: ``-ln P(t[i])`` in nats; 0 where ``t[i]`` is not A/C/G/T (not
scored, as for every model).

:func:`score_window` is the fast path (numba, O(W * (experts + candidates)) per window, tables reused across windows
and reset by walking what the window touched: memory is bounded by the window plus fixed tables of ``4**kmer``
int32, 64 MiB at the default); :func:`score_window_reference` is the slow, obviously-correct one (plain Python, a
naive scan for occurrences), which the tests hold equal on small windows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numba
import numpy as np

from ..errors import GenoctxError
from .markov import MAX_ORDER, MarkovModel, fit_markov

ORDER = 10  # static context order (fitted on the training split)
KMER = 12  # seed length of repeat experts, bases (the occurrence table has 4**KMER int32 entries: 64 MiB)
MAX_KMER = 12
EXPERTS = 16  # most repeat experts alive at once
ADAPTIVE_ORDERS = (2, 4)  # in-window context models: the window's local composition
ADAPTIVE_ALPHAS = (1.0, 1.0)  # add-1, as GeCo's low orders
CANDIDATES = 4  # most recent occurrences considered per strand and position
HISTORY = 16  # predictions an expert's drop rule looks back on
MAX_MISSES = 6  # an expert with more misses among its last HISTORY predictions is dropped
DECAY = 0.9  # forgetting factor of the component scores (memory ~10 bases)
NEW_EXPERT_PENALTY = 3.0  # nats below the best context model a new expert starts at
EPS = 1e-3  # uniform floor of the mixture
LOW_COUNT = 1000  # training bases per context (on average) of the low-order static chain (:func:`low_order`)
SHARE = 1e-4  # fixed-share rate of the final stage (its cost: <= SHARE nats per base, ln((1 + n_ctx) / SHARE) a switch)


@numba.njit(cache=True, nogil=True)
def _score_window_nb(t, static_p, kmer, max_experts, orders, alphas, counts, head, prev, params):  # pragma: no cover
    """numba kernel of :func:`score_window` (see there); ``counts[a]`` and ``head`` are all zero / -1 on entry and
    on return."""
    decay, penalty, eps, share = params[0], params[1], params[2], params[3]
    n_static = static_p.shape[0]
    n_ctx = n_static + orders.shape[0]
    W = t.shape[0]
    out = np.zeros(W, dtype=np.float64)
    kmask = (1 << (2 * kmer)) - 1
    e_alive = np.zeros(max_experts, dtype=np.bool_)
    e_pos = np.zeros(max_experts, dtype=np.int64)
    e_dir = np.zeros(max_experts, dtype=np.int64)
    e_hits = np.zeros(max_experts, dtype=np.int64)
    e_n = np.zeros(max_experts, dtype=np.int64)
    e_miss = np.zeros(max_experts, dtype=np.int64)
    e_score = np.zeros(max_experts, dtype=np.float64)
    s_ctx = np.zeros(n_ctx, dtype=np.float64)
    w_top = np.full(1 + n_ctx, 1.0 / (1 + n_ctx))  # final stage's weights: the mixture (0), each context model
    p_ctx = np.zeros((n_ctx, 4), dtype=np.float64)
    p_exp = np.zeros(max_experts, dtype=np.float64)
    b_exp = np.zeros(max_experts, dtype=np.int64)
    hist_mask = (1 << HISTORY) - 1
    code = 0  # the last min(run, 32) bases, 2 bits each, the latest lowest
    rc = 0  # reverse complement of the last kmer bases
    run = 0
    inserted = np.full(W, -1, dtype=np.int64)  # head index written at each end position (to reset)
    for i in range(W):
        x = t[i]
        valid = x >= 0 and x <= 3
        # spawn experts from earlier occurrences (ending at <= i - 2) of the k-mer before i and of its reverse compl.
        if run >= kmer:
            fcode = code & kmask
            alive = 0
            for e in range(max_experts):
                if e_alive[e]:
                    alive += 1
            best = s_ctx[0]
            for c in range(1, n_ctx):
                if s_ctx[c] > best:
                    best = s_ctx[c]
            for strand in range(2):
                q = head[fcode] if strand == 0 else head[rc]
                seen = 0
                while valid and q >= 0 and seen < CANDIDATES and alive < max_experts:
                    seen += 1
                    if strand == 0:
                        j = q + 1
                        d = 1
                    else:
                        j = q - kmer
                        d = -1
                    if j >= 0:
                        dup = False
                        for e in range(max_experts):
                            if e_alive[e] and e_dir[e] == d and e_pos[e] == j:
                                dup = True
                                break
                        if not dup:
                            for e in range(max_experts):
                                if not e_alive[e]:
                                    e_alive[e] = True
                                    e_pos[e] = j
                                    e_dir[e] = d
                                    e_hits[e] = 0
                                    e_n[e] = 0
                                    e_miss[e] = 0
                                    e_score[e] = best - penalty
                                    alive += 1
                                    break
                    q = prev[q]
            # the k-mer ending at i - 1 becomes visible from i + 1 on
            prev[i - 1] = head[fcode]
            head[fcode] = i - 1
            inserted[i - 1] = fcode
        if not valid:
            run = 0
            code = 0
            rc = 0
            for e in range(max_experts):
                e_alive[e] = False
            continue
        # component distributions
        for c in range(n_static):
            for b in range(4):
                p_ctx[c, b] = static_p[c, i, b]
        for a in range(orders.shape[0]):
            k = orders[a]
            if run >= k:
                base = (code & ((1 << (2 * k)) - 1)) * 4
                tot = 0.0
                for b in range(4):
                    tot += counts[a, base + b]
                for b in range(4):
                    p_ctx[n_static + a, b] = (counts[a, base + b] + alphas[a]) / (tot + 4.0 * alphas[a])
            else:
                for b in range(4):
                    p_ctx[n_static + a, b] = 0.25
        top = s_ctx[0]
        for c in range(1, n_ctx):
            if s_ctx[c] > top:
                top = s_ctx[c]
        for e in range(max_experts):
            if e_alive[e]:
                y = t[e_pos[e]]
                if y < 0 or y > 3:
                    e_alive[e] = False
                    continue
                b_exp[e] = y if e_dir[e] == 1 else 3 - y
                p_exp[e] = (e_hits[e] + 1.0) / (e_n[e] + 2.0)
                if e_score[e] > top:
                    top = e_score[e]
        wsum = 0.0
        px = 0.0
        for c in range(n_ctx):
            w = math.exp(s_ctx[c] - top)
            wsum += w
            px += w * p_ctx[c, x]
        for e in range(max_experts):
            if e_alive[e]:
                w = math.exp(e_score[e] - top)
                wsum += w
                px += w * (p_exp[e] if b_exp[e] == x else (1.0 - p_exp[e]) / 3.0)
        p_mix = (1.0 - eps) * px / wsum + eps / 4.0
        # final stage: fixed-share mixture of the mixture above and each context model alone
        tp = w_top[0] * p_mix
        for c in range(n_ctx):
            tp += w_top[1 + c] * p_ctx[c, x]
        out[i] = -math.log(tp)
        w_top[0] = (1.0 - share) * w_top[0] * p_mix / tp + share / (1 + n_ctx)
        for c in range(n_ctx):
            w_top[1 + c] = (1.0 - share) * w_top[1 + c] * p_ctx[c, x] / tp + share / (1 + n_ctx)
        # updates: scores, expert records, adaptive counts, positions
        for c in range(n_ctx):
            s_ctx[c] = decay * s_ctx[c] + math.log(p_ctx[c, x])
        for e in range(max_experts):
            if e_alive[e]:
                hit = b_exp[e] == x
                pe = p_exp[e] if hit else (1.0 - p_exp[e]) / 3.0
                e_score[e] = decay * e_score[e] + math.log(pe)
                e_n[e] += 1
                if hit:
                    e_hits[e] += 1
                    e_miss[e] = (e_miss[e] << 1) & hist_mask
                else:
                    e_miss[e] = ((e_miss[e] << 1) | 1) & hist_mask
                m = e_miss[e]
                misses = 0
                while m:
                    misses += m & 1
                    m >>= 1
                e_pos[e] += e_dir[e]
                if misses > MAX_MISSES or e_pos[e] < 0:
                    e_alive[e] = False
        for a in range(orders.shape[0]):
            k = orders[a]
            if run >= k:
                counts[a, (code & ((1 << (2 * k)) - 1)) * 4 + x] += 1
        code = ((code << 2) | x) & 0xFFFFFFFFFFFFFFF
        rc = (rc >> 2) | ((3 - x) << (2 * (kmer - 1)))
        run += 1
    # reset the tables by walking what this window touched
    for p in range(W):
        if inserted[p] >= 0:
            head[inserted[p]] = -1
            prev[p] = -1
    code = 0
    run = 0
    for i in range(W):
        x = t[i]
        if x < 0 or x > 3:
            run = 0
            code = 0
            continue
        for a in range(orders.shape[0]):
            k = orders[a]
            if run >= k:
                counts[a, (code & ((1 << (2 * k)) - 1)) * 4 + x] = 0
        code = ((code << 2) | x) & 0xFFFFFFFFFFFFFFF
        run += 1
    return out


@dataclass
class RepeatModel:
    """A mixture of order-k context models and repeat experts (forward and reverse-complement copies).

    Attributes:
        static: the order-``order`` chain fitted on the training split (``markov.MarkovModel``).
        kmer: seed length of repeat experts (bases, 4..:data:`MAX_KMER`).
        max_experts: most repeat experts alive at once.
    """

    static: MarkovModel
    kmer: int = KMER
    max_experts: int = EXPERTS
    _tables: tuple | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return "repeat"

    @property
    def low_order(self) -> int:
        """The order of the second static chain (:func:`low_order`)."""
        return low_order(self.static.order, self.static.tokens_seen)

    def describe(self) -> dict:
        """The model's fields in the eval document's ``models`` entry (beside ``name``, ``kind``, ``path``)."""
        return {"order": self.static.order, "low_order": self.low_order, "kmer": self.kmer,
                "experts": self.max_experts, "train_tokens": self.static.tokens_seen}  # fmt: skip

    def static_probs(self, tokens: np.ndarray) -> np.ndarray:
        """The static chains' next-base distributions over one window: float64 [S, W, 4], the fitted order first,
        then the low order (S = 1 when they are equal). ``tokens``: integer [W] window ids."""
        st = self.static
        orders = [st.order] + [self.low_order] * (self.low_order < st.order)
        chains = [MarkovModel(k, st.alpha, st.contexts[: k + 1], st.counts[: k + 1], st.tokens_seen) for k in orders]
        return np.stack([c.token_probs(tokens) for c in chains])

    def token_losses(self, tokens: np.ndarray) -> np.ndarray:
        """Next-base loss of every position of one window, in nats (float64 [W]); 0 where not scored.

        ``tokens``: integer [W] window ids (A C G T = 0..3; anything else is not scored and breaks context).
        """
        t = np.ascontiguousarray(np.asarray(tokens), dtype=np.int64)
        if self._tables is None or self._tables[2].shape[0] < t.shape[0]:
            counts = np.zeros((len(ADAPTIVE_ORDERS), 4 ** max(ADAPTIVE_ORDERS) * 4), dtype=np.int32)
            head = np.full(4**self.kmer, -1, dtype=np.int32)
            prev = np.full(max(t.shape[0], 1), -1, dtype=np.int32)
            self._tables = (counts, head, prev)
        counts, head, prev = self._tables
        return score_window(t, self.static_probs(t), self.kmer, self.max_experts, counts, head, prev)


def score_window(tokens: np.ndarray, static_p: np.ndarray, kmer: int = KMER, max_experts: int = EXPERTS,
                 counts: np.ndarray | None = None, head: np.ndarray | None = None,
                 prev: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
    """Loss of the repeat reference at every position of one window (the fast path; module docstring for the model).

    Args:
        tokens: int64 [W] window ids (A C G T = 0..3; others not scored).
        static_p: float64 [W, 4] the static chain's distribution at each position (``MarkovModel.token_probs``), or
            [S, W, 4] for S static chains (:meth:`RepeatModel.static_probs`: the fitted order and the low order).
        kmer, max_experts: seed length (bases) and most experts alive.
        counts, head, prev: reusable tables (int32 [len(ADAPTIVE_ORDERS), 4**max(ADAPTIVE_ORDERS) * 4] zeros,
            int32 [4**kmer] -1, int32 [>= W] -1); left as given on return. None allocates them.

    Returns:
        float64 [W] losses in nats, 0 where the target is not A/C/G/T.
    """
    t = np.ascontiguousarray(tokens, dtype=np.int64)
    W = t.shape[0]
    static_p = _stack_static(static_p, W)
    if counts is None:
        counts = np.zeros((len(ADAPTIVE_ORDERS), 4 ** max(ADAPTIVE_ORDERS) * 4), dtype=np.int32)
    if head is None:
        head = np.full(4**kmer, -1, dtype=np.int32)
    if prev is None:
        prev = np.full(max(W, 1), -1, dtype=np.int32)
    params = np.array([DECAY, NEW_EXPERT_PENALTY, EPS, SHARE])
    return _score_window_nb(t, static_p, kmer, max_experts,
                            np.array(ADAPTIVE_ORDERS, dtype=np.int64), np.array(ADAPTIVE_ALPHAS), counts, head, prev,
                            params)  # fmt: skip


def _stack_static(static_p: np.ndarray, W: int) -> np.ndarray:
    """``static_p`` as contiguous float64 [S, W, 4] (a [W, 4] array is one chain)."""
    p = np.asarray(static_p, dtype=np.float64)
    p = p[None] if p.ndim == 2 else p
    if p.ndim != 3 or p.shape[1:] != (W, 4) or p.shape[0] < 1:
        raise ValueError(f"static_p: expected [W, 4] or [S, W, 4] with W = {W}, got {list(np.shape(static_p))}")
    return np.ascontiguousarray(p)


def score_window_reference(tokens: np.ndarray, static_p: np.ndarray, kmer: int = KMER,
                           max_experts: int = EXPERTS) -> np.ndarray:  # fmt: skip
    """The same losses as :func:`score_window`, computed the slow, obvious way (tests; windows of a few thousand bases).

    Occurrences are found by scanning every earlier position (most recent first) and comparing bases, adaptive
    counts are a dict, experts a list of slots: nothing is shared with the fast path but the module's constants.
    """
    t = [int(v) for v in np.asarray(tokens)]
    W = len(t)
    static_p = _stack_static(static_p, W)
    ok = [0 <= v <= 3 for v in t]
    out = [0.0] * W
    counts: list[dict] = [{} for _ in ADAPTIVE_ORDERS]
    s_ctx = [0.0] * (static_p.shape[0] + len(ADAPTIVE_ORDERS))
    w_top = [1 / (1 + len(s_ctx))] * (1 + len(s_ctx))  # the final stage: the mixture, then each context model
    slots: list[dict | None] = [None] * max_experts
    first = [0] * W  # first position of the clean run holding q (q + 1 where t[q] is not clean)
    for q in range(W):
        first[q] = (first[q - 1] if q and ok[q - 1] else q) if ok[q] else q + 1
    kmers = [tuple(t[q - kmer + 1 : q + 1]) if q - kmer + 1 >= first[q] else None for q in range(W)]
    start = 0  # first position of the current clean run
    for i in range(W):
        if not ok[i]:
            start = i + 1
            slots = [None] * max_experts
            continue
        run = i - start
        if run >= kmer:
            cur = tuple(t[i - kmer : i])
            rcur = tuple(3 - v for v in reversed(cur))
            best = max(s_ctx)
            for strand in range(2):
                want = cur if strand == 0 else rcur
                seen = 0
                for q in range(i - 2, kmer - 2, -1):  # clean occurrences ending at q <= i - 2, most recent first
                    if seen == CANDIDATES or None not in slots:
                        break
                    if kmers[q] != want:
                        continue
                    seen += 1
                    j, d = (q + 1, 1) if strand == 0 else (q - kmer, -1)
                    if j < 0 or any(s is not None and s["dir"] == d and s["pos"] == j for s in slots):
                        continue
                    free = slots.index(None)
                    score = best - NEW_EXPERT_PENALTY
                    slots[free] = {"pos": j, "dir": d, "hits": 0, "n": 0, "history": [], "score": score}
        x = t[i]
        p_ctx = [list(sp[i]) for sp in static_p]
        for a, k in enumerate(ADAPTIVE_ORDERS):
            if run >= k:
                row = counts[a].get(tuple(t[i - k : i]), [0, 0, 0, 0])
                p_ctx.append([(row[b] + ADAPTIVE_ALPHAS[a]) / (sum(row) + 4 * ADAPTIVE_ALPHAS[a]) for b in range(4)])
            else:
                p_ctx.append([0.25] * 4)
        for e, s in enumerate(slots):
            if s is not None and not ok[s["pos"]]:
                slots[e] = None
        preds = {}
        for e, s in enumerate(slots):
            if s is not None:
                y = t[s["pos"]]
                b = y if s["dir"] == 1 else 3 - y
                p = (s["hits"] + 1) / (s["n"] + 2)
                preds[e] = [p if c == b else (1 - p) / 3 for c in range(4)]
        scores = s_ctx + [slots[e]["score"] for e in preds]
        dists = p_ctx + [preds[e] for e in preds]
        top = max(scores)
        w = [math.exp(s - top) for s in scores]
        px = sum(wc * d[x] for wc, d in zip(w, dists, strict=True)) / sum(w)
        p_top = [(1 - EPS) * px + EPS / 4] + [d[x] for d in p_ctx]
        p = sum(wm * pm for wm, pm in zip(w_top, p_top, strict=True))
        out[i] = -math.log(p)
        w_top = [(1 - SHARE) * wm * pm / p + SHARE / len(w_top) for wm, pm in zip(w_top, p_top, strict=True)]
        s_ctx = [DECAY * s + math.log(p_ctx[c][x]) for c, s in enumerate(s_ctx)]
        for e, d in preds.items():
            s = slots[e]
            s["score"] = DECAY * s["score"] + math.log(d[x])
            y = t[s["pos"]]
            hit = (y if s["dir"] == 1 else 3 - y) == x
            s["n"] += 1
            s["hits"] += hit
            s["history"] = (s["history"] + [not hit])[-HISTORY:]
            s["pos"] += s["dir"]
            if sum(s["history"]) > MAX_MISSES or s["pos"] < 0:
                slots[e] = None
        for a, k in enumerate(ADAPTIVE_ORDERS):
            if run >= k:
                row = counts[a].setdefault(tuple(t[i - k : i]), [0, 0, 0, 0])
                row[x] += 1
    return np.array(out, dtype=np.float64)


def low_order(order: int, tokens_seen: int) -> int:
    """The order of the reference's second static chain: the highest ``k <= order`` whose ``4**k`` contexts hold at
    least :data:`LOW_COUNT` training bases each on average, ``floor(log4(tokens_seen / LOW_COUNT))`` (0 at least).

    An add-1 estimate from ``n`` counts costs about ``1.5 / n`` nats per base above the true distribution, so this
    chain is within ~0.1% of what its order can give, where the fitted order may be far from it (order 10 on 1M
    training bases: 1 base per context, 5.6% above ln 4 on i.i.d. DNA).
    """
    k = 0
    while k < order and 4 ** (k + 1) * LOW_COUNT <= tokens_seen:
        k += 1
    return k


def check_repeat_args(order: int, kmer: int, max_experts: int) -> None:
    """One-line errors for bad flags (before anything is fitted or scored).

    Raises:
        GenoctxError: ``--repeat-order`` outside 0..MAX_ORDER, ``--repeat-kmer`` outside 4..MAX_KMER,
            ``--repeat-experts`` outside 1..256.
    """
    if not 0 <= order <= MAX_ORDER:
        raise GenoctxError(f"--repeat-order {order}: the order must be between 0 and {MAX_ORDER}")
    if not 4 <= kmer <= MAX_KMER:
        raise GenoctxError(f"--repeat-kmer {kmer}: the seed length must be between 4 and {MAX_KMER} bases")
    if not 1 <= max_experts <= 256:
        raise GenoctxError(f"--repeat-experts {max_experts}: must be between 1 and 256")


def fit_repeat(data_dir: str | Path, order: int = ORDER, kmer: int = KMER, max_experts: int = EXPERTS,
               split: str = "train") -> RepeatModel:  # fmt: skip
    """The repeat reference with its static chain fitted on ``split`` (default: train) of a prepared directory.

    Raises:
        GenoctxError: bad parameters (:func:`check_repeat_args`), an empty split, a split without A/C/G/T.
    """
    check_repeat_args(order, kmer, max_experts)
    return RepeatModel(fit_markov(data_dir, order, 1.0, split), kmer, max_experts)
