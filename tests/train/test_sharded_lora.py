"""Sharded (DCP) checkpoints of mesh runs that train a subset or LoRA (issue 44, item 3 on a mesh).

``genoctx export`` of a 2-rank LoRA run's DCP checkpoint (folded EP=2 x FSDP=2: the experts' adapters split with
their experts) writes the PEFT adapter that the same model saved in one process writes, tensor for tensor, reading
only the adapters and the modules saved whole; ``--merge`` writes the merged model one weight at a time, equal to
``merge_lora`` of the whole model. A mesh run from an HF base training ``router,norms,lora`` writes partial DCP
checkpoints (what trains, its AdamW state, the base named by digest) that resume on the mesh exactly, in one process,
and that mesh eval and export read; a one-process partial checkpoint resumes on the mesh. The ranks are spawned gloo
processes (``mesh_runner.spawn_workers``).
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
from genoctx.model.hf import load_hf, save_hf
from genoctx.model.lora import is_lora_name, merge_lora
from genoctx.model.peft_export import save_peft
from genoctx.recipes import load_recipe
from genoctx.train.checkpoint import checkpoint_keys, held_names, list_checkpoints, load_model, read_state
from genoctx.train.distributed import train_distributed
from genoctx.train.loop import train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
from mesh_runner import spawn_workers  # noqa: E402  (kept on sys.path: the spawned ranks import it too)
from test_partial_checkpoints import KNOBS  # noqa: E402  (tests/train/ is on sys.path)

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


# --- B: mesh runs from a base that train a subset write partial DCP checkpoints ---------------------------------
SUBSET = "router,norms,lora"
PARTIAL_RUN = ["train.seq_len=256", "train.steps=4", "train.checkpoint_every=1", "train.warmup_steps=1",
               "train.keep_checkpoints=0", "train.lr=1e-2", f"train.trainable={SUBSET}",
               "train.lora_rank=2"]  # fmt: skip
FEP2 = dict(fsdp=2, ep=2, ep_folded=True)


def test_a_mesh_run_from_a_base_writes_partial_dcp_checkpoints_and_resumes_exactly(prepared, hf_base, tmp_path):
    from test_resume_mesh import _cut_back, _same_run

    recipe = load_recipe("recipes/tiny.yaml", [f"model.init={hf_base}", *KNOBS, *PARTIAL_RUN])
    full = tmp_path / "full"
    _mesh(prepared, recipe, full, **FEP2)
    ckpt = list_checkpoints(full)[-1]
    state = read_state(ckpt)
    assert state["format"] == "dcp" and state["holds"] == "trainable"
    assert state["init"]["path"] == str(hf_base.resolve()) and set(state["init"]["weights"]) == {"model.safetensors"}
    model, _, _ = load_model(ckpt)  # base + overlay, in one process
    held = held_names(model, SUBSET)
    keys = checkpoint_keys(ckpt)
    assert {k[6:] for k in keys if k.startswith("model.")} == held  # what trains alone
    params = dict(model.named_parameters())
    assert {k.split(".", 1)[1].rsplit(".", 1)[0] for k in keys if k.startswith("optim.")} == held & set(params)
    whole = sum(p.numel() for p in model.parameters())
    stored = sum(s.numel() for k, (s, _) in keys.items() if k.startswith("model."))
    print(f"partial DCP checkpoint: {len(held)} of {len(model.state_dict())} tensors, {stored / whole:.3f} of the "
          "parameters")  # fmt: skip
    assert stored < 0.5 * whole
    # the frozen tensors are the base's, bit for bit; the trained ones moved
    base = dict(load_hf(hf_base).named_parameters())
    assert all(torch.equal(params[n], base[n]) for n in base if n not in held)
    assert all(not torch.equal(params[n], base[n]) for n in base if n in held and "norm" not in n or ".gate." in n)
    # resumed on the mesh from step 2 == uninterrupted: every step's lr and loss, the held weights
    part = _cut_back(full, tmp_path / "part", 2)
    summary = _mesh(prepared, recipe, part, resume=True, **FEP2)
    assert summary["resumed_from"] == 2 and summary["step"] == 4
    _same_run(part, full)
    assert read_state(list_checkpoints(part)[-1])["holds"] == "trainable"
    a, b = load_model(list_checkpoints(part)[-1])[0].state_dict(), model.state_dict()
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-7) for k in a)
    # eval on the mesh (each rank builds from the base, then reads its pieces of what trains) == one process
    from genoctx.eval.distributed import MeshEval
    from genoctx.eval.position import evaluate

    args = dict(bins="linear:2", max_windows=1, resamples=0, chunk_tokens=128)
    mesh = MeshEval(spawn_workers, 2, fsdp=2, ep=2, cp=1, cp_layout="contiguous", ep_folded=True)
    got, want = evaluate([ckpt], prepared, mesh=mesh, **args), evaluate([ckpt], prepared, **args)
    lg, lw = ([b["loss"] for b in d["models"][0]["bins"]] for d in (got, want))
    assert lw and lg == pytest.approx(lw, rel=1e-6)
    # a one-process resume of the mesh's partial checkpoint: the base, then what trains over it
    one = _cut_back(full, tmp_path / "one", 2)
    res = _cli("train", "--data", prepared, "--recipe", "recipes/tiny.yaml", "--out", one, "--resume",
               *[x for s in [f"model.init={hf_base}", *KNOBS, *PARTIAL_RUN] for x in ("--set", s)],
               "--allow-batch-change")  # fmt: skip
    assert res.exit_code == 0, res.stderr[-3000:]
    # export reads it: PEFT adapter (the adapters and the router, saved whole) equal to one process's save_peft
    res = _cli("export", full, "--out", tmp_path / "adapter")
    assert res.exit_code == 0, res.stderr[-3000:]
    save_peft(model, tmp_path / "adapter-one", parse_trainable(SUBSET), rank=2, alpha=recipe.train.lora_alpha)
    x, y = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("adapter", "adapter-one"))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    # --merge: base + overlay, merged (load_model + merge_lora), as transformers would load it
    res = _cli("export", full, "--out", tmp_path / "merged", "--merge")
    assert res.exit_code == 0, res.stderr[-3000:]
    merged = load_hf(tmp_path / "merged").state_dict()
    want = merge_lora(load_model(ckpt)[0]).state_dict()
    assert merged.keys() == want.keys() and all(torch.equal(merged[k], want[k]) for k in want)


def test_a_one_process_partial_checkpoint_resumes_on_the_mesh(prepared, hf_base, tmp_path):
    """One process -> CP=2 x folded EP=2 (one data-parallel rank, as one process): the ranks build from the base and
    read their slices of what trains and of its moments."""
    from test_resume_mesh import _cut_back, _same_run

    recipe = load_recipe("recipes/tiny.yaml", [f"model.init={hf_base}", *KNOBS, *PARTIAL_RUN])
    full = tmp_path / "full"
    train(prepared, recipe, full)
    assert read_state(list_checkpoints(full)[-1])["holds"] == "trainable"
    part = _cut_back(full, tmp_path / "part", 2)
    assert _mesh(prepared, recipe, part, cp=2, ep=2, ep_folded=True, resume=True)["resumed_from"] == 2
    _same_run(part, full, rel=1e-5, atol=1e-4)  # the tolerances of test_resume_mesh's CP=2 resumes
    ckpt = list_checkpoints(part)[-1]
    assert read_state(ckpt)["format"] == "dcp" and read_state(ckpt)["holds"] == "trainable"
