"""Sharded (DCP) checkpoints of mesh runs that train a subset or LoRA (issue 44, item 3 on a mesh).

``genoctx export`` of a 2-rank LoRA run's DCP checkpoint (folded EP=2 x FSDP=2: the experts' adapters split with
their experts) writes the PEFT adapter that the same model saved in one process writes, tensor for tensor, reading
only the adapters and the modules saved whole; ``--merge`` writes the merged model one weight at a time, equal to
``merge_lora`` of the whole model. The ranks are spawned gloo processes (``mesh_runner.spawn_workers``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import genoctx.train.sharded as sharded
from genoctx.cli import app
from genoctx.model.groups import parse_trainable
from genoctx.model.hf import save_hf
from genoctx.model.lora import is_lora_name, merge_lora
from genoctx.model.peft_export import save_peft
from genoctx.recipes import load_recipe
from genoctx.train.checkpoint import list_checkpoints, load_model, read_state
from genoctx.train.distributed import train_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
from mesh_runner import spawn_workers  # noqa: E402  (kept on sys.path: the spawned ranks import it too)

SPEC = "lora,router"  # adapters (linears and experts) and a group saved whole (peft modules_to_save)
LORA_RUN = ["train.seq_len=128", "train.steps=2", "train.checkpoint_every=2", "train.warmup_steps=1",
            "train.keep_checkpoints=0", "train.lr=1e-2", f"train.trainable={SPEC}", "train.lora_rank=4",
            "train.lora_alpha=8"]  # fmt: skip


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _mesh(prepared, recipe, out, workers=2, **kw):
    return train_distributed(prepared, recipe, out, run_workers=spawn_workers, num_workers=workers, **kw)


@pytest.fixture(scope="module")
def lora_mesh_run(prepared, tmp_path_factory) -> Path:
    """2 steps of a LoRA run on folded EP=2 x FSDP=2 (2 ranks), its checkpoint in DCP."""
    run = tmp_path_factory.mktemp("sharded-lora") / "run"
    _mesh(prepared, load_recipe("recipes/tiny.yaml", LORA_RUN), run, fsdp=2, ep=2, ep_folded=True)
    assert read_state(list_checkpoints(run)[-1])["format"] == "dcp"
    return run


def test_peft_export_of_a_sharded_lora_checkpoint_equals_one_process(lora_mesh_run, tmp_path, monkeypatch):
    ckpt = list_checkpoints(lora_mesh_run)[-1]
    read = []
    real = sharded.read_full_tensors

    def spy(c, prefix="model.", names=None):
        read.extend(names or ["<all>"])
        return real(c, prefix, names)

    monkeypatch.setattr(sharded, "read_full_tensors", spy)
    res = _cli("export", lora_mesh_run, "--out", tmp_path / "mesh")
    assert res.exit_code == 0, res.stderr[-3000:]
    monkeypatch.undo()
    summary = json.loads(res.stdout)
    assert summary["format"] == "peft" and summary["expert_adapters"] > 0 and summary["modules_to_save"] > 0
    # only the adapters and the router (saved whole) were read from dcp/, never a frozen weight
    assert read and all(is_lora_name(n) or ".mlp.gate." in n for n in read), read
    # the same model, read whole in one process and saved by save_peft
    model, recipe, _ = load_model(ckpt)
    t = recipe.train
    save_peft(model, tmp_path / "one", parse_trainable(t.trainable), rank=t.lora_rank, alpha=t.lora_alpha)
    a = load_file(tmp_path / "mesh" / "adapter_model.safetensors")
    b = load_file(tmp_path / "one" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and len(a) == summary["tensors"]
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert any("experts.lora_A" in k for k in a) and any(".mlp.gate." in k for k in a)
    assert any(b[k].abs().max() > 0 for k in b if k.endswith("lora_B.weight"))  # the adapters trained
    ca, cb = (json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("mesh", "one"))
    assert ca == cb


def test_merge_export_of_a_sharded_lora_checkpoint_equals_one_process(lora_mesh_run, tmp_path):
    ckpt = list_checkpoints(lora_mesh_run)[-1]
    res = _cli("export", lora_mesh_run, "--out", tmp_path / "mesh", "--merge")
    assert res.exit_code == 0, res.stderr[-3000:]
    assert "--merge: writing the merged model" in res.stderr
    model = load_model(ckpt)[0]
    raw = {k: v.clone() for k, v in model.state_dict().items()}
    save_hf(merge_lora(model), tmp_path / "one")
    a, b = load_file(tmp_path / "mesh" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    assert a.keys() == b.keys() and not any("lora" in k for k in a)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    merged = merge_lora(load_model(ckpt)[0]).state_dict()
    moved = [k for k in merged if not torch.equal(merged[k], raw[k])]
    assert any(k.endswith("experts.gate_up_proj") for k in moved) and any(k.endswith("q_proj.weight") for k in moved)
