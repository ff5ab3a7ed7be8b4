"""eval --by-position with the repeat reference (``--reference repeat``): its entry, every other model's change vs it
(paired intervals), its own change vs the baseline and the Markov chain, views, table/CSV/plot, the mesh path, the
CLI and its bad flags. The numbers are checked with a fake reference whose losses are known exactly (the real one's
kernel has tests of its own); the plumbing also runs once with the real ``fit_repeat``."""

import inspect
import json
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest
from typer.testing import CliRunner

from genoctx.cli import app, eval_
from genoctx.data.dataset import WindowDataset
from genoctx.eval import position, repeat
from genoctx.eval.plot import _style, plot_panels
from genoctx.eval.position import evaluate, score_windows, to_csv, to_table, view_names
from genoctx.eval.schema import SCHEMA

NEAR, FAR = 1.0, 0.5  # the fake reference's loss before / from position 256 on (nats per base)


class FakeRepeat:
    """A :class:`genoctx.eval.repeat.RepeatModel` stand-in: ``NEAR`` nats on every scored base before position 256,
    ``FAR`` from there on (0 where not scored), whatever the bases."""

    name = "repeat"

    def __init__(self, order, kmer, experts):
        self.order, self.kmer, self.experts = order, kmer, experts

    def describe(self) -> dict:
        return {"order": self.order, "kmer": self.kmer, "experts": self.experts, "train_tokens": 123}

    def token_losses(self, tokens: np.ndarray) -> np.ndarray:
        t = np.asarray(tokens)
        return np.where((t >= 0) & (t <= 3), np.where(np.arange(t.shape[0]) < 256, NEAR, FAR), 0.0)


def _fake_fit(data_dir, order=repeat.ORDER, kmer=repeat.KMER, max_experts=repeat.EXPERTS, split="train"):
    return FakeRepeat(order, kmer, max_experts)


@pytest.fixture
def fake_repeat(monkeypatch):
    monkeypatch.setattr(position, "fit_repeat", _fake_fit)


@pytest.fixture(scope="module")
def doc(small_prepared, two_checkpoints):
    """Two checkpoints, the Markov chain and the fake reference on 4 windows of 512, both strands, soft-mask split."""
    run, init = two_checkpoints
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(position, "fit_repeat", _fake_fit)
        out = evaluate([init, run], small_prepared, bins="linear:2", max_windows=4, markov=2, reference="repeat",
                       repeat_order=5, repeat_kmer=10, repeat_experts=7, reverse_complement=True,
                       split_by="softmask", resamples=200, seed=3)  # fmt: skip
    return json.loads(json.dumps(out))


def _blocks(entry: dict):
    """(view, block) of a model entry: the main view, then its other views."""
    return [("forward/all", entry), *entry.get("views", {}).items()]


def test_document_validates_and_the_reference_entry(doc):
    jsonschema.validate(doc, SCHEMA)
    assert [m["kind"] for m in doc["models"]] == ["checkpoint", "checkpoint", "markov", "reference"]
    ref = doc["models"][-1]
    assert {k: ref[k] for k in ("name", "kind", "path", "order", "kmer", "experts", "train_tokens", "baseline",
                                "reported")} == {"name": "repeat", "kind": "reference", "path": None, "order": 5,
                                                 "kmer": 10, "experts": 7, "train_tokens": 123, "baseline": False,
                                                 "reported": False}  # fmt: skip
    assert doc["reported"] == doc["models"][1]["name"]  # the last checkpoint still


def test_every_other_model_carries_its_change_vs_the_reference(doc):
    checked = 0
    for m in doc["models"][:3]:  # the baseline, the checkpoint and the Markov chain
        for view, blk in _blocks(m):
            o = blk["overall"]
            near, far = (b["tokens"] for b in blk["bins"])
            if not near or not far:  # the eval piece of chr22 has no soft-masked base: rows of nulls
                assert all(r["reference_loss"] is None for r in [*blk["bins"], o]) and view.endswith("softmasked")
                continue
            for b in blk["bins"]:
                assert b["reference_loss"] == pytest.approx(NEAR if b["start"] < 256 else FAR), (m["name"], view)
            assert o["reference_loss"] == pytest.approx((NEAR * near + FAR * far) / (near + far))
            for row in [*blk["bins"], o]:
                assert row["reference_relative_change"] == pytest.approx(row["loss"] / row["reference_loss"] - 1)
                lo, hi = row["reference_relative_change_ci"]
                assert lo <= row["reference_relative_change"] <= hi
            checked += 1
    assert checked == 3 * 6  # all, unmasked x forward, reverse, both
    assert set(doc["views"]) == set(view_names(True, True)[1:])
    assert "reference_loss" in doc["views"]["both/softmasked"]["overall"]  # the reported model's views too


def test_the_reference_is_compared_like_any_non_baseline_model(doc):
    base, _, mk, ref = doc["models"]
    for view, blk in _blocks(ref):
        base_blk = base if view == "forward/all" else base["views"][view]
        mk_blk = mk if view == "forward/all" else mk["views"][view]
        for row, b, k in zip([*blk["bins"], blk["overall"]], [*base_blk["bins"], base_blk["overall"]],
                             [*mk_blk["bins"], mk_blk["overall"]], strict=True):  # fmt: skip
            assert "reference_loss" not in row
            if not row["tokens"]:
                assert row["relative_change"] is None and row["markov_relative_change"] is None
                continue
            assert row["baseline_loss"] == b["loss"] and row["markov_loss"] == k["loss"]
            assert row["relative_change"] == pytest.approx(row["loss"] / b["loss"] - 1)
            assert row["difference"] == pytest.approx(row["loss"] - b["loss"])
            assert row["markov_relative_change"] == pytest.approx(row["loss"] / k["loss"] - 1)
            assert row["relative_change_ci"] is not None and row["markov_relative_change_ci"] is not None
    t = ref["last_vs_first_bin"]
    assert t["first_bin"] == [0, 256] and t["last_bin"] == [256, 512]
    assert t["first_change"] == pytest.approx(NEAR / base["bins"][0]["loss"] - 1)
    assert t["last_change"] == pytest.approx(FAR / base["bins"][1]["loss"] - 1)
    assert "last_vs_first_bin" not in base


def test_table_csv_plot(doc, tmp_path):
    table = to_table(doc)
    assert "repeat nats [95% CI]" in table and table.count("bits/base") == 4 * len(view_names(True, True))
    assert "\nrepeat: " in table  # its last-vs-first-bin line
    rows = to_csv(doc).splitlines()
    head = rows[0].split(",")
    assert head[-4:] == ["reference_loss", "reference_relative_change", "model", "view"]
    assert len(rows) == 1 + 4 * 9 * 3  # header + models x views x (bins + overall)
    ref_rows = [r.split(",") for r in rows[1:] if r.split(",")[-2] == "repeat"]
    assert len(ref_rows) == 9 * 3 and all(r[head.index("reference_loss")] == "" for r in ref_rows)
    first = rows[1].split(",")  # the reported checkpoint's first bin
    assert float(first[head.index("reference_loss")]) == NEAR
    assert _style({"kind": "reference"}) == "^:" and _style({"kind": "markov"}) == "s--"
    assert plot_panels(doc) == ["loss", "relative_change"]
    assert position.plot(doc, tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reference_alone_and_with_the_markov_chain(small_prepared, fake_repeat):
    alone = evaluate(None, small_prepared, bins="linear:2", max_windows=3, reference="repeat", resamples=0)
    jsonschema.validate(alone, SCHEMA)
    assert alone["reported"] == "repeat" and alone["checkpoint"] is None and alone["baseline"] is None
    assert [b["loss"] for b in alone["bins"]] == pytest.approx([NEAR, FAR])
    assert "relative_change" not in alone["overall"] and "reference_loss" not in alone["overall"]
    both = evaluate(None, small_prepared, bins="linear:2", max_windows=3, markov=1, reference="repeat", resamples=50)
    jsonschema.validate(both, SCHEMA)
    mk, ref = both["models"]
    assert both["reported"] == "repeat" and ref["reported"] and not mk["reported"]
    m, r = mk["overall"], ref["overall"]
    assert m["reference_relative_change"] == pytest.approx(m["loss"] / r["loss"] - 1)
    assert r["markov_relative_change"] == pytest.approx(r["loss"] / m["loss"] - 1)
    assert "last_vs_first_bin" not in ref  # no baseline checkpoint


def test_copy_probe_scores_the_reference(small_prepared, fake_repeat):
    d = evaluate(None, small_prepared, max_windows=2, reference="repeat", resamples=0, copy_probe=True,
                 copy_distances_n=2)  # fmt: skip
    rows = d["models"][0]["copy_probe"]["rows"]
    assert [r["distance"] for r in rows] == d["copy_probe"]["distances"] == [64, 312]
    # the fake's losses depend on the position only: the copy [312, 512) costs FAR; its source 312 bases back,
    # [0, 200), cost NEAR in place
    far = rows[1]
    assert (far["copied_loss"], far["in_place_loss"], far["gain"]) == pytest.approx((FAR, NEAR, NEAR - FAR))


def test_with_a_mesh_the_reference_is_scored_here(small_prepared, two_checkpoints, fake_repeat, monkeypatch):
    """The checkpoints go to the mesh (faked: each scores 2 nats per base); the reference runs in this process."""
    import genoctx.eval.distributed as distributed

    def on_mesh(paths, data_dir, split, edges, views, n, window, chunk_tokens, loss_vocab, mesh, **kw):
        ds = WindowDataset(data_dir, split)
        two = lambda t: np.where(np.asarray(t) <= 3, 2.0, 0.0)  # noqa: E731
        return [(SimpleNamespace(path=p, loss_vocab=None), score_windows(two, ds, edges, n, views)) for p in paths]

    monkeypatch.setattr(distributed, "score_on_mesh", on_mesh)
    run, init = two_checkpoints
    d = evaluate([init, run], small_prepared, bins="linear:2", max_windows=2, reference="repeat", resamples=0,
                 mesh=object())  # fmt: skip
    assert [m["kind"] for m in d["models"]] == ["checkpoint", "checkpoint", "reference"]
    assert [b["reference_relative_change"] for b in d["bins"]] == pytest.approx([2 / NEAR - 1, 2 / FAR - 1])
    assert [b["relative_change"] for b in d["models"][2]["bins"]] == pytest.approx([NEAR / 2 - 1, FAR / 2 - 1])


def test_bad_arguments_are_one_line_errors(small_prepared):
    from genoctx.errors import GenoctxError

    with pytest.raises(GenoctxError, match=r"^--reference 'markov': the only reference is 'repeat'$"):
        evaluate(None, small_prepared, reference="markov")
    with pytest.raises(GenoctxError, match="^--repeat-kmer 3: "):
        evaluate(None, small_prepared, markov=1, repeat_kmer=3)  # checked without --reference too


runner = CliRunner()


@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--reference", "rpt"], "--reference"),
        (["--reference", "repeat", "--repeat-order", "17"], "--repeat-order"),
        (["--reference", "repeat", "--repeat-kmer", "2"], "--repeat-kmer"),
        (["--reference", "repeat", "--repeat-experts", "0"], "--repeat-experts"),
    ],
)
def test_cli_bad_flags_exit_2_naming_the_flag(small_prepared, flags, flag):
    r = runner.invoke(app, ["eval", "--by-position", "--data", str(small_prepared), "--max-windows", "1", *flags])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"genoctx: error: {flag} "), r.stderr
    assert r.stdout == "" and "Traceback" not in r.stderr


def test_cli_reference_alone_with_the_real_model(small_prepared):
    r = runner.invoke(app, ["eval", "--by-position", "--reference", "repeat", "--repeat-order", "3", "--data",
                            str(small_prepared), "--max-windows", "2", "--bins", "linear:2",
                            "--format", "json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    jsonschema.validate(d, SCHEMA)
    (ref,) = d["models"]
    assert d["reported"] == "repeat" and ref["kind"] == "reference" and ref["path"] is None
    assert (ref["order"], ref["kmer"], ref["experts"]) == (3, repeat.KMER, repeat.EXPERTS)
    assert ref["train_tokens"] > 0 and 0 < d["overall"]["loss"] < 2.0


def test_cli_defaults_are_the_module_constants():
    params = inspect.signature(eval_).parameters
    assert (params["repeat_order"].default, params["repeat_kmer"].default, params["repeat_experts"].default) == (
        repeat.ORDER, repeat.KMER, repeat.EXPERTS)  # fmt: skip
    assert params["reference"].default is None
