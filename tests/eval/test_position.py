"""eval --by-position: bins, counts, chunked scoring, output shapes."""

import json

import numpy as np
import pytest
import torch

from genoctx.data.dataset import WindowDataset, scored_mask
from genoctx.errors import GenoctxError
from genoctx.eval.position import binned_losses, evaluate, parse_bins, plot, position_losses, to_csv, to_table
from genoctx.model.config import preset
from genoctx.model.model import HybridLM


def test_parse_bins():
    assert parse_bins("log2", 8192) == [0, 1024, 2048, 4096, 8192]
    assert parse_bins("log2", 1000) == [0, 1000]
    assert parse_bins("linear:4", 100) == [0, 25, 50, 75, 100]
    assert parse_bins("10,100", 1000) == [0, 10, 100, 1000]
    for bad in ("linear:x", "5,3", "0,5000", "abc"):
        with pytest.raises(GenoctxError):
            parse_bins(bad, 2048)


def test_bin_counts_add_up_to_scored_tokens(prepared):
    ds = WindowDataset(prepared, "eval")
    model = HybridLM(preset("tiny"))
    res = binned_losses(model, ds, parse_bins("linear:5", ds.window), max_windows=3)
    scored = sum(int(scored_mask(ds[i]["tokens"]).sum()) for i in range(3))
    assert res.count.sum() == scored
    assert sum(b["tokens"] for b in res.bins()) == res.overall()["tokens"] == scored
    # the overall loss is the token-weighted mean of the bins
    bins = res.bins()
    weighted = sum(b["loss"] * b["tokens"] for b in bins) / scored
    assert res.overall()["loss"] == pytest.approx(weighted, rel=1e-12)


def test_chunked_scoring_equals_one_pass(prepared):
    ds = WindowDataset(prepared, "eval")
    model = HybridLM(preset("tiny")).double().eval()
    tokens = ds[0]["tokens"][None]
    one = position_losses(model, tokens)
    chunked = position_losses(model, tokens, chunk_tokens=700)
    torch.testing.assert_close(chunked, one, rtol=1e-9, atol=1e-9)


def test_n_is_never_scored():
    tokens = torch.tensor([[0, 1, 4, 4, 2, 3]])
    model = HybridLM(preset("tiny")).eval()
    losses = position_losses(model, tokens)
    assert (losses[0, 2:4] == 0).all() and (losses[0, [0, 1, 4, 5]] > 0).all()


def test_json_document_shape_and_baseline(prepared, two_checkpoints, tmp_path):
    run, init = two_checkpoints
    doc = evaluate(run, prepared, bins="log2", baseline=init, max_windows=2)
    doc = json.loads(json.dumps(doc))
    assert [(b["start"], b["end"]) for b in doc["bins"]] == [(0, 1024), (1024, 2048)]
    for b in [*doc["bins"], doc["overall"]]:
        assert set(b) >= {"tokens", "loss", "bits_per_base", "baseline_loss", "relative_change"}
        assert b["bits_per_base"] == pytest.approx(b["loss"] / np.log(2))
        assert b["relative_change"] == pytest.approx(b["loss"] / b["baseline_loss"] - 1)
    no_base = evaluate(run, prepared, max_windows=1)
    assert "baseline_loss" not in no_base["overall"]
    table, trend = to_table(doc).split("\n\n")  # the table ends with its overall row; then last vs first bin
    assert table.splitlines()[-1].lstrip().startswith("overall")
    t = doc["models"][1]["last_vs_first_bin"]
    assert trend.splitlines()[1].startswith(f"{doc['models'][1]['name']}: {100 * t['change_difference']:+.2f} [")
    assert to_csv(doc).splitlines()[0].startswith("start,end,tokens,loss")
    png = plot(doc, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_checkpoint_and_empty_split_are_user_errors(prepared, two_checkpoints, tmp_path):
    run, _ = two_checkpoints
    with pytest.raises(GenoctxError, match="not found"):
        evaluate(tmp_path / "nope", prepared)
    with pytest.raises(GenoctxError):
        evaluate(run, prepared, split="validation")
