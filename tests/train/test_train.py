"""Training loop: checkpoints, resume equals an uninterrupted run, metrics."""

import json

import pytest

from genoctx.errors import GenoctxError
from genoctx.recipes import load_recipe
from genoctx.train.checkpoint import latest_checkpoint, list_checkpoints, load_model
from genoctx.train.loop import lr_lambda, train


def _recipe(steps, **kw):
    over = [
        f"train.steps={steps}",
        "train.seq_len=256",
        "train.checkpoint_every=3",
        "train.warmup_steps=1",
        "train.keep_checkpoints=0",
    ] + [f"train.{k}={v}" for k, v in kw.items()]
    return load_recipe("recipes/tiny.yaml", over)


def _metrics(run):
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def test_resume_gives_the_same_loss_as_an_uninterrupted_run(prepared, tmp_path):
    full = tmp_path / "full"
    train(prepared, _recipe(4), full)
    part = tmp_path / "part"
    train(prepared, _recipe(4), part, stop_after=2)  # stops after step 2 (checkpoint at 2)
    train(prepared, _recipe(4), part, resume=True)
    a, b = _metrics(full), _metrics(part)
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for ma, mb in zip(a, b, strict=True):
        assert mb["loss"] == pytest.approx(ma["loss"], rel=1e-6, abs=1e-7)
    assert [c.name for c in list_checkpoints(part)] == ["step_000002", "step_000003", "step_000004"]


def test_steps_zero_writes_the_untrained_model(prepared, tmp_path):
    summary = train(prepared, _recipe(0), tmp_path / "init")
    ck = latest_checkpoint(tmp_path / "init")
    assert ck.name == "step_000000" and summary["checkpoint"] == str(ck)
    model, recipe, state = load_model(tmp_path / "init")
    assert state["step"] == 0 and recipe.preset == "tiny"
    # recipe.yaml holds every ModelConfig field (architecture and compute knobs), the glm5_next names
    import dataclasses

    import yaml

    from genoctx.model.config import ModelConfig

    raw = yaml.safe_load((ck / "recipe.yaml").read_text())
    assert set(raw["model"]) == {f.name for f in dataclasses.fields(ModelConfig)} | {"preset", "init"}
    assert raw["model"]["layer_types"] == ["linear_attention", "indexed_attention"]
    assert recipe.model == model.cfg == load_recipe("recipes/tiny.yaml").model
    # model.safetensors is the state dict: persistent buffers (router biases) included
    from safetensors.torch import load_file

    assert set(load_file(str(ck / "model.safetensors"))) == set(model.state_dict())
    assert "layers.1.mlp.gate.e_score_correction_bias" in model.state_dict()


def test_metrics_record_paths_and_loss_in_nats(prepared, tmp_path):
    train(prepared, _recipe(2), tmp_path / "r")
    m = _metrics(tmp_path / "r")
    assert len(m) == 2
    for row in m:
        assert 0.5 < row["loss"] < 3.0  # nats/token on 4 bases: ln 4 = 1.386 at chance
        assert row["tokens"] == 256 and row["tokens_per_s"] > 0 and row["peak_memory_bytes"] > 0
        paths = [(s["mixer"], s["path"]) for s in row["layers"]]
        assert ("dsa", "sparse") in paths
        assert row["moe_load_max_over_mean"] >= 1.0


def test_existing_run_without_resume_is_refused(prepared, tmp_path):
    train(prepared, _recipe(0), tmp_path / "r")
    with pytest.raises(GenoctxError, match="--resume"):
        train(prepared, _recipe(0), tmp_path / "r")


def test_schedule_warms_up_then_decays_to_min():
    cfg = _recipe(100, warmup_steps=10, min_lr_ratio=0.1).train
    f = lr_lambda(cfg, 100)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(100) == pytest.approx(0.1)
    assert f(55) == pytest.approx(0.55)


def test_indexer_warmup_trains_only_the_indexer(prepared, tmp_path):
    """DeepSeek-V3.2 stage 1: dense attention, everything but the lightning indexer frozen."""
    import torch

    from genoctx.model.model import HybridLM

    over = ["train.steps=2", "train.seq_len=256", "train.warmup_steps=1"]
    with pytest.raises(GenoctxError, match="dsa_mode=dense"):
        train(prepared, load_recipe("recipes/tiny.yaml", [*over, "model.indexer_stage=warmup"]), tmp_path / "a")
    rec = load_recipe("recipes/tiny.yaml", [*over, "model.indexer_stage=warmup", "model.dsa_mode=dense"])
    train(prepared, rec, tmp_path / "b")
    torch.manual_seed(rec.train.seed)
    init = HybridLM(rec.model).state_dict()
    trained, _, _ = load_model(tmp_path / "b")
    assert set(trained.state_dict()) == set(init)
    changed = {k for k, v in trained.state_dict().items() if not torch.equal(v, init[k])}
    # only the lightning indexer's tensors moved: not the MLA projections it reads, not the router biases
    assert changed and all(k.startswith("layers.1.self_attn.indexer.") for k in changed), changed
    assert {"layers.1.self_attn.indexer.wq_b.weight", "layers.1.self_attn.indexer.wk.weight",
            "layers.1.self_attn.indexer.weights_proj.weight"} <= changed  # fmt: skip
    assert "layers.1.mlp.gate.e_score_correction_bias" in init
    rows = _metrics(tmp_path / "b")
    dsa = [s for s in rows[-1]["layers"] if s["mixer"] == "dsa"]
    assert dsa and all(s["path"] == "dense" and s["indexer_loss"] > 0 for s in dsa)


def test_seq_chunk_trains_as_one_pass_and_records_the_path(prepared, tmp_path):
    """train.seq_chunk_tokens: the same losses and final weights as one pass over each window (fp32), and each
    metrics line says which path ran (chunk size and number of chunks; None and 1 for one pass)."""
    import torch
    from safetensors.torch import load_file

    train(prepared, _recipe(3), tmp_path / "whole")
    train(prepared, _recipe(3, seq_chunk_tokens=96), tmp_path / "chunked")  # 256 = 96 + 96 + 64
    a, b = _metrics(tmp_path / "whole"), _metrics(tmp_path / "chunked")
    assert [(m["seq_chunk_tokens"], m["seq_chunks"]) for m in a] == [(None, 1)] * 3
    assert [(m["seq_chunk_tokens"], m["seq_chunks"]) for m in b] == [(96, 3)] * 3
    for ma, mb in zip(a, b, strict=True):
        assert mb["loss"] == pytest.approx(ma["loss"], rel=1e-5)
        assert mb["grad_norm"] == pytest.approx(ma["grad_norm"], rel=1e-4)
    wa = load_file(latest_checkpoint(tmp_path / "whole") / "model.safetensors")
    wb = load_file(latest_checkpoint(tmp_path / "chunked") / "model.safetensors")
    for name, t in wa.items():  # Adam turns fp32 rounding of near-zero gradients into up to ~lr/200 (lr 3e-3)
        torch.testing.assert_close(wb[name], t, rtol=1e-4, atol=5e-5, msg=name)
