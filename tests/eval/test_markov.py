"""Markov reference: counts against a slow dict-based reference, K = 0 = base-composition entropy."""

import math
from collections import Counter

import numpy as np
import pytest

from genoctx.data.dataset import WindowDataset
from genoctx.errors import GenoctxError
from genoctx.eval.markov import MarkovModel, clean_run, fit_markov, split_segments


def _slow_losses(train_segs, tokens, order, alpha):
    """Token-by-token reference: count every (context, base) with Python dicts, back off to the longest seen
    clean context of at most ``order`` bases."""
    counts = [Counter() for _ in range(order + 1)]
    ctx_tot = [Counter() for _ in range(order + 1)]
    for seg in train_segs:
        seg = [int(x) for x in seg]
        for i, x in enumerate(seg):
            if x > 3:
                continue
            for k in range(order + 1):
                ctx = tuple(seg[i - k : i])
                if i - k < 0 or any(c > 3 for c in ctx):
                    break
                counts[k][ctx, x] += 1
                ctx_tot[k][ctx] += 1
    out = []
    t = [int(x) for x in tokens]
    for i, x in enumerate(t):
        if x > 3:
            out.append(0.0)
            continue
        for k in range(order, -1, -1):
            ctx = tuple(t[i - k : i])
            if i - k < 0 or any(c > 3 for c in ctx) or ctx_tot[k][ctx] == 0:
                continue
            out.append(math.log(ctx_tot[k][ctx] + 4 * alpha) - math.log(counts[k][ctx, x] + alpha))
            break
    return np.array(out)


def test_clean_run():
    t = np.array([0, 1, 4, 2, 3, 3, 5, 0])
    assert clean_run(t).tolist() == [0, 1, 2, 0, 1, 2, 3, 0]


@pytest.mark.parametrize("order", [0, 1, 3, 6])
def test_losses_match_slow_reference_on_real_dna_with_n(prepared, order):
    train = split_segments(prepared, "train")
    # a real chrM piece with an N run and a soft-masked window of chr22 with its N policy applied
    train = [train[0][:3000].copy()]
    train[0][1000:1010] = 4
    ev = WindowDataset(prepared, "eval")[5]["tokens"].numpy()[:1500].copy()
    ev[700:703] = 4
    m = MarkovModel.fit(train, order, alpha=0.5)
    np.testing.assert_allclose(m.token_losses(ev), _slow_losses(train, ev, order, 0.5), rtol=1e-12, atol=1e-12)


def test_order0_is_base_composition_entropy(prepared, realdna):
    segs = split_segments(prepared, "train")
    bases = np.concatenate(segs)
    bases = bases[bases <= 3]
    p = np.bincount(bases, minlength=4) / bases.size
    entropy = -(p[p > 0] * np.log(p[p > 0])).sum()
    # maximum likelihood (alpha = 0) scored on the training split itself = its composition entropy
    m = fit_markov(prepared, 0, alpha=0.0)
    losses = np.concatenate([m.token_losses(s) for s in segs])
    assert losses[np.concatenate(segs) <= 3].mean() == pytest.approx(entropy, rel=1e-12)
    # independently, from the FASTA text: the train split is chrM's first 8 full windows of 2048 bases
    text = "".join((realdna / "hg38_chrM.fa").read_text().split("\n")[1:]).upper()[: 8 * 2048]
    counts = np.array([text.count(b) for b in "ACGT"])  # chrM has one N (position 3107), never scored
    freq = counts / counts.sum()
    assert entropy == pytest.approx(-(freq * np.log(freq)).sum(), rel=1e-12)
    # with add-one smoothing on held-out data: the cross-entropy against the smoothed composition
    m1 = fit_markov(prepared, 0, alpha=1.0)
    q = (np.bincount(bases, minlength=4) + 1.0) / (bases.size + 4.0)
    ev = WindowDataset(prepared, "eval")[0]["tokens"].numpy()
    ev_b = ev[ev <= 3]
    expect = -np.log(q[ev_b]).mean()
    assert m1.token_losses(ev)[ev <= 3].mean() == pytest.approx(expect, rel=1e-12)


def test_train_segments_merge_overlaps(realdna, tmp_path):
    from genoctx.data.windows import prepare

    out = tmp_path / "p"
    prepare([realdna / "hg38_chrM.fa"], out, window=4096, stride=1024, train_chroms=["chrM"], progress=False)
    segs = split_segments(out, "train")
    ds = WindowDataset(out, "train")
    assert len(ds) > 4 and len(segs) == 1
    assert segs[0].size == ds.windows[-1]["end"] - ds.windows[0]["start"]


def test_bad_order_and_empty_training():
    with pytest.raises(GenoctxError):
        MarkovModel.fit([np.zeros(10, np.uint8)], 99)
    with pytest.raises(GenoctxError):
        MarkovModel.fit([np.full(10, 4, np.uint8)], 2)


def test_fit_in_blocks_equals_one_pass(monkeypatch):
    """Counting in blocks (with the context carried over block edges, N runs inside) gives the same tables."""
    import genoctx.eval.markov as mk

    rng = np.random.default_rng(5)
    segs = [rng.integers(0, 5, n).astype(np.uint8) for n in (3000, 17, 9000)]
    whole = mk.MarkovModel.fit(segs, 12)
    monkeypatch.setattr(mk, "FIT_BLOCK", 7)
    monkeypatch.setattr(mk, "DENSE_MAX", 4**6)  # orders 6..12 through the sparse merge
    blocked = mk.MarkovModel.fit(segs, 12)
    assert blocked.tokens_seen == whole.tokens_seen == int(sum((s <= 3).sum() for s in segs))
    for k in range(13):
        np.testing.assert_array_equal(blocked.contexts[k], whole.contexts[k])
        np.testing.assert_array_equal(blocked.counts[k], whole.counts[k])
