"""The copy probe (genoctx.eval.copyprobe): controlled scorers whose reach is known.

- ``CopyModel(period)`` (conftest) predicts the base ``period`` back: only a copy at exactly that distance is free.
- ``InductionScorer(reach)`` finds the most recent earlier occurrence, at most ``reach`` bases back, of the 12 bases
  before each position and predicts what followed it: copies within its reach are nearly free, copies beyond it
  cost what the bases cost in place (a model that cannot see far).
- An order-8 Markov chain has no reach at all.
"""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from genoctx.eval.copyprobe import REACH_GAIN, copied_window, copy_distances, probe_windows, summarize
from genoctx.eval.markov import MarkovModel
from genoctx.eval.position import markov_scorer, model_scorer

W = 4096
CHR22 = Path(__file__).resolve().parents[2] / "data" / "hg38" / "hg38_chr22_32000001-32300000.fa"


def _real_bases(n: int, skip: int = 0) -> str:
    """``n`` real bases of the shipped chr22 piece from ``skip`` on, N removed."""
    seq = "".join(ln.strip() for ln in CHR22.read_text().splitlines()[1:])[skip:]
    return seq.replace("N", "").replace("n", "")[:n]


def _encode(s: str) -> np.ndarray:
    from genoctx.data.tokenizer import encode

    return encode(s)[0].astype(np.int64)


@pytest.fixture(scope="module")
def windows() -> list[np.ndarray]:
    """Six windows of real chr22 bases without N (no copy of anything inside them at these distances by chance)."""
    bases = _encode(_real_bases(6 * W, skip=10_000))
    return [bases[i * W : (i + 1) * W] for i in range(6)]


class InductionScorer:
    """Loss of a match-and-copy predictor that sees ``reach`` bases back (a :data:`ScoreFn`): with ``k`` = 12, the base
    after the latest earlier occurrence of the preceding 12-mer (within ``reach`` bases) gets probability 0.99, the
    other three 0.01 / 3; without a match all four get 1/4."""

    def __init__(self, reach: int, k: int = 12):
        self.reach, self.k = reach, k

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        last: dict[bytes, int] = {}
        out = np.zeros(tokens.shape[0])
        hit, miss = -math.log(0.99), -math.log(0.01 / 3)
        for p in range(tokens.shape[0]):
            j = None
            if p >= self.k:
                key = tokens[p - self.k : p].tobytes()
                j = last.get(key)
                last[key] = p
            if j is not None and p - j <= self.reach:
                out[p] = hit if tokens[j] == tokens[p] else miss
            else:
                out[p] = math.log(4)
        return out


def test_distances_are_log_spaced_and_fit_the_window():
    d = copy_distances(4096, 200, n=8)
    assert d[0] == 64 and d[-1] == 3896 and d == sorted(set(d)) and len(d) == 8
    ratios = np.diff(np.log(d))
    assert np.allclose(ratios, ratios.mean(), atol=0.02)
    assert copy_distances(270, 200, n=8) == [64, 65, 66, 67, 68, 69, 70]  # duplicates after rounding dropped
    with pytest.raises(ValueError, match="no room for a 200-base copy 64 bases after its source"):
        copy_distances(263, 200)


def test_copied_window_writes_the_source_over_the_end():
    t = np.arange(1000) % 4
    t[:300] = np.arange(300) % 3
    e, sources, dst = copied_window(t, 400, 200)
    assert dst == 800 and sources.tolist() == list(range(400, 600))
    assert (e[800:] == t[400:600]).all() and (e[:800] == t[:800]).all()
    # shorter than the segment: a tandem repeat, every copied base equal to the base 64 before it
    e, sources, dst = copied_window(t, 64, 200)
    assert sources.tolist() == [736 + i % 64 for i in range(200)]
    assert (e[800:] == e[736:936]).all() and (e[:800] == t[:800]).all()


def test_copy_model_gains_only_at_its_period(windows, copy_model):
    assert copy_model.period == 1536
    distances = [100, 1000, 1536, 2500]
    sums = probe_windows(model_scorer(copy_model), windows, distances)
    rows = summarize(sums, distances, resamples=200)["rows"]
    at = {r["distance"]: r for r in rows}
    assert at[1536]["copied_loss"] < 1e-6 and at[1536]["gain"] > 10  # confident and right only there
    for d in (100, 1000, 2500):
        assert at[d]["copied_loss"] > 5  # confidently wrong, as in place
    assert all(r["tokens"] == 6 * 200 for r in rows)


def test_induction_scorer_shows_its_reach_and_no_gain_past_it(windows):
    distances = copy_distances(W, 200, n=8)  # 64 .. 3896
    reach = 1000
    out = summarize(probe_windows(InductionScorer(reach), windows, distances), distances, resamples=200)
    for r in out["rows"]:
        if r["distance"] + 200 <= reach:  # the whole copy sees its source
            assert r["copied_loss"] < 0.1 and r["gain_ci"][0] > 1.0, r
        elif r["distance"] > reach:  # no base of the copy sees its source
            assert abs(r["gain"]) < 0.05 and r["gain_ci"][0] <= REACH_GAIN, r
    assert out["reach"] == max(d for d in distances if d <= reach)
    assert out["rows"][0]["in_place_loss"] == pytest.approx(math.log(4), abs=0.1)  # real DNA: few 12-mer repeats


def test_markov_chain_has_no_reach(windows):
    train = [_encode(_real_bases(50_000, skip=100_000))]
    markov = MarkovModel.fit(train, 8, 1.0)
    distances = copy_distances(W, 200, n=5)
    out = summarize(probe_windows(markov_scorer(markov), windows, distances), distances, resamples=200)
    assert out["reach"] is None
    for r in out["rows"]:
        assert abs(r["gain"]) < 0.1


def test_untrained_model_has_no_reach(windows):
    from genoctx.model.config import preset
    from genoctx.model.model import HybridLM

    torch.manual_seed(0)
    model = HybridLM(preset("tiny"))
    distances = [64, 600]
    short = [w[:1024] for w in windows[:3]]
    out = summarize(probe_windows(model_scorer(model), short, distances), distances, resamples=100)
    assert out["reach"] is None and all(abs(r["gain"]) < 0.05 for r in out["rows"])


def test_eval_copy_probe_in_json_table_and_plot(repeat_prepared, copy_model, tmp_path):
    """``evaluate(copy_probe=True)``: every model entry carries its rows and reach, the document validates against
    the schema, the table prints the probe and the plot gets its panel; the order-2 Markov chain has no reach."""
    import jsonschema

    from genoctx.eval.position import evaluate, plot, to_table
    from genoctx.eval.schema import SCHEMA

    doc = evaluate(None, repeat_prepared, bins="0,2048,4096", models=[("copy", copy_model)], markov=2,
                   resamples=50, copy_probe=True, copy_distances_n=3)  # fmt: skip
    jsonschema.validate(doc, SCHEMA)
    assert doc["copy_probe"] == {"segment": 200, "distances": [64, 499, 3896], "reach_gain": REACH_GAIN}
    by_name = {e["name"]: e["copy_probe"] for e in doc["models"]}
    assert set(by_name) == {"copy", "markov-2"} and by_name["markov-2"]["reach"] is None
    assert [r["distance"] for r in by_name["copy"]["rows"]] == [64, 499, 3896]
    text = to_table(doc)
    assert "# copy probe: a 200-base segment" in text and "reach of markov-2: none" in text
    from genoctx.eval.plot import plot_panels

    assert plot_panels(doc) == ["loss", "copy_probe"]  # no baseline among these models: no change panel
    out = plot(doc, tmp_path / "p.png")
    assert out.stat().st_size > 0


@pytest.mark.parametrize("chunk_tokens", [None, 300])
def test_cached_tails_equal_rescoring_whole_windows(windows, chunk_tokens):
    """The model's fast path (prefix once, each copy from its cache: ``model_tail_scorer``) gives the losses of
    scoring every edited window whole (``rescoring_tails``), with KDA and sparse DSA (top-16 of 4-token pools) on
    1024 bases, whole or in 300-token chunks; so the probe's sums are the same as well."""
    from genoctx.eval.copyprobe import rescoring_tails
    from genoctx.eval.position import model_tail_scorer
    from genoctx.model.config import preset
    from genoctx.model.model import HybridLM

    torch.manual_seed(0)
    model = HybridLM(preset("tiny"))
    with torch.no_grad():  # re-draw the zero-initialised parameters so that every path matters
        for p in model.parameters():
            if (p == 0).all():
                p.normal_(0, 0.5)
    tokens = windows[0][:1024].copy()
    tokens[500:510] = 4  # an N run: unscored in place and where it is copied
    tails = [copied_window(tokens, d, 200)[0][824:] for d in (64, 300, 600)]
    fast_base, fast = model_tail_scorer(model, chunk_tokens)(tokens, 824, tails)
    slow_base, slow = rescoring_tails(model_scorer(model, chunk_tokens))(tokens, 824, tails)
    np.testing.assert_allclose(fast_base, slow_base, rtol=0, atol=2e-5)
    assert fast_base[500:510].tolist() == [0.0] * 10 and fast_base[10] > 0
    for f, s in zip(fast, slow, strict=True):
        assert f.shape == (200,)
        np.testing.assert_allclose(f, s, rtol=0, atol=2e-5)
    assert not np.allclose(fast[0], fast[2], atol=1e-3)  # different edits, different losses
