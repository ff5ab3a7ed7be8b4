"""Checkpoints of a run from a base (``--init``) that trains a subset (issue 44, item 3): they hold what trains (the
trained groups, the LoRA adapters, the routing biases of a trained router) and its AdamW state, and name the base
by path and digest (``init.weights``: xxh3_64 of its weight files). Resume is exact, eval and export rebuild the
model from the base, ``--init`` of such a run follows its base, a changed base is refused (exit 2) by the loaders and
reported by ``genoctx verify`` (exit 1). The whole-model checkpoints (``train.trainable: all``, or no base) are
``tests/train/test_trainable.py`` and ``test_lora_train.py``."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_trainable import resumed_run  # tests/train/ is on sys.path (pytest's rootdir imports)
from typer.testing import CliRunner

import genoctx.train.loop as loop
from genoctx.cli import app
from genoctx.errors import GenoctxError
from genoctx.model.groups import group_of
from genoctx.model.hf import load_hf
from genoctx.model.lora import is_lora_name, merge_lora
from genoctx.recipes import load_recipe
from genoctx.train.checkpoint import held_names, latest_checkpoint, load_model, model_tensors
from genoctx.train.loop import train

# config.json holds no compute knobs: the tiny preset's, so that runs from the export compute as tiny does
KNOBS = ["model.preset=null", "model.kda_chunk_size=16", "model.indexer_tile_tokens=1048576",
         "model.moe_chunk_tokens=64"]  # fmt: skip
SPEC = "router,norms,lora"  # frozen groups, adapters and the routing biases (moving with the router) in one run
RUN = ["train.seq_len=256", "train.steps=4", "train.checkpoint_every=2", "train.warmup_steps=1",
       "train.keep_checkpoints=0", "train.lr=1e-2", f"train.trainable={SPEC}", "train.lora_rank=2"]  # fmt: skip


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _error_line(res) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and lines and lines[-1].startswith("genoctx: error:"), res.stderr[-3000:]
    assert "Traceback" not in res.stderr and [ln for ln in lines if ln.startswith("genoctx: error:")] == lines[-1:]
    return lines[-1]


def _recipe(init, *over):
    return load_recipe("recipes/tiny.yaml", [f"model.init={init}", *KNOBS, *over])


def _names(ckpt: Path) -> set[str]:
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def _loss(model, prepared) -> float:
    from genoctx.data.dataset import WindowDataset

    x = torch.as_tensor(WindowDataset(prepared, "eval")[0]["tokens"][None, :512])
    with torch.no_grad():
        logits = model.eval()(x)[0]
    return float(torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:].clamp(max=3)))


def test_partial_checkpoints_hold_what_trains_and_resume_exactly(prepared, hf_base, tmp_path, monkeypatch):
    over = [f"model.init={hf_base}", *KNOBS, *RUN]
    rec, init, a, b = resumed_run(prepared, tmp_path, over, "train.lora_rank=4",
                                  "train.lora_rank is 4 but the run was trained with 2")  # fmt: skip
    ckpt = latest_checkpoint(tmp_path / "full")
    state = json.loads((ckpt / "state.json").read_text())
    assert state["holds"] == "trainable" and state["init"]["path"] == str(hf_base.resolve())
    assert set(state["init"]["weights"]) == {"model.safetensors"}  # the base's content digest, recorded at start
    # model.safetensors: the trained names alone (the adapters, the router, its biases, the norms), nothing frozen
    names = _names(ckpt)
    assert names == held_names(a, SPEC) == _names(tmp_path / "cut" / "checkpoints" / "step_000002")
    groups = {n: "lora" if is_lora_name(n) else group_of(n, rec.model.layer_types) for n in model_tensors(a)}
    assert names == {n for n, g in groups.items() if g in SPEC.split(",")}
    assert any(n.endswith("e_score_correction_bias") for n in names) and any(is_lora_name(n) for n in names)
    # the same run writing whole checkpoints (what it did before this change)
    monkeypatch.setattr(loop, "partial_record", lambda *args, **kw: None)
    train(prepared, _recipe(hf_base, *RUN), tmp_path / "whole")
    whole = latest_checkpoint(tmp_path / "whole")
    assert "holds" not in json.loads((whole / "state.json").read_text())
    assert _names(whole) == set(model_tensors(a))
    ratio = (ckpt / "model.safetensors").stat().st_size / (whole / "model.safetensors").stat().st_size
    print(f"partial/whole model.safetensors: {ratio:.3f}, tensors {len(names)} of {len(_names(whole))}")
    assert ratio < 0.2  # tiny's LoRA adapters are large beside its tiny weights; at scale far smaller
    # eval's loader: base + overlay == the whole checkpoint's model, tensor for tensor and in loss
    w = load_model(whole)[0]
    assert set(a.state_dict()) == set(w.state_dict())
    assert all(torch.equal(t, w.state_dict()[k]) for k, t in a.state_dict().items())
    assert _loss(a, prepared) == _loss(w, prepared)
    # resume exact (resumed_run: every step's lr and loss): the trained weights equal, the frozen ones the base's
    base = dict(load_hf(hf_base).named_parameters())
    bp = dict(b.named_parameters())
    frozen = 0
    for name, t in a.named_parameters():
        assert torch.equal(t, bp[name]), name
        if name not in names:
            assert torch.equal(t, base[name]) and torch.equal(bp[name], base[name]), name
            frozen += 1
        else:
            assert not torch.equal(t, init.state_dict()[name]), name  # it trained
    assert frozen > 0
    # --init of a LoRA run starts from its merged model (W + alpha/r B A, as export --merge writes it): adapters
    # never silently dropped; from the partial checkpoint (base + overlay) and the whole one alike
    merged = merge_lora(load_model(whole)[0]).state_dict()
    assert any(not torch.equal(merged[k], t) for k, t in base.items())  # the merge moved the adapted weights
    for src, out in ((ckpt, "next"), (whole, "next-whole")):
        res = _cli("train", "--data", prepared, "--recipe", "recipes/tiny.yaml", "--out", tmp_path / out, "--init",
                   src, "--steps", 0, "--set", "model.preset=null", "--set", "train.seq_len=256")  # fmt: skip
        assert res.exit_code == 0, res.stderr[-3000:]
        s0 = load_model(tmp_path / out)[0].state_dict()
        assert set(s0) == set(merged) and all(torch.equal(s0[k], merged[k]) for k in merged), src
    for k in ("", "--no-verify"):  # eval of the partial checkpoint: the whole one's numbers
        res = [_cli("eval", "--by-position", "--data", prepared, "--checkpoint", c, "--max-windows", 1,
                    "--resamples", 0, "--format", "json", *([k] if k else [])) for c in (ckpt, whole)]  # fmt: skip
        assert [r.exit_code for r in res] == [0, 0], res[0].stderr[-2000:]
        one, two = (json.loads(r.stdout)["models"][0] for r in res)
        assert one["bins"] == two["bins"] and one["bins"], (one, two)


def test_a_run_from_scratch_with_a_frozen_subset_holds_everything(prepared, tmp_path):
    rec = load_recipe("recipes/tiny.yaml", ["train.steps=0", "train.seq_len=256", "train.trainable=norms"])
    train(prepared, rec, tmp_path / "run")
    ckpt = latest_checkpoint(tmp_path / "run")
    assert "holds" not in json.loads((ckpt / "state.json").read_text())  # no base to name
    assert _names(ckpt) == set(model_tensors(load_model(ckpt)[0]))


def _change_one_value(path: Path) -> None:
    """Rewrite the last 4 bytes of a safetensors file (a value of its last tensor): the header is unchanged."""
    data = bytearray(path.read_bytes())
    data[-4:] = bytes(b ^ 0x5A for b in data[-4:])
    path.write_bytes(bytes(data))


def test_a_changed_base_is_refused_by_loaders_and_flagged_by_verify(prepared, hf_base, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(hf_base, base)
    run = tmp_path / "run"
    train(prepared, _recipe(base, *RUN[:1], "train.steps=2", "train.checkpoint_every=1", "train.warmup_steps=1",
                            "train.trainable=norms"), run, stop_after=1)  # fmt: skip
    ok = _cli("verify", run)
    assert ok.exit_code == 0 and {c["base"]["status"] for c in json.loads(ok.stdout)["checkpoints"]} == {"ok"}
    header = (base / "model.safetensors").read_bytes()[:64]
    _change_one_value(base / "model.safetensors")
    assert (base / "model.safetensors").read_bytes()[:64] == header
    ckpt = latest_checkpoint(run)
    res = _cli("verify", run)
    doc = json.loads(res.stdout)["checkpoints"][0]
    assert res.exit_code == 1 and (doc["status"], doc["base"]["status"]) == ("base_changed", "changed"), res.stdout
    assert f"{ckpt}: its base {base.resolve()} changed since the run started: model.safetensors" in res.stderr
    want = f"{ckpt}: its base {base.resolve()} changed since the run started: model.safetensors xxh3_64"
    for how in (["eval", "--by-position", "--data", prepared, "--checkpoint", run, "--max-windows", 1,
                 "--resamples", 0], ["export", run, "--out", tmp_path / "hf"],
                ["train", "--data", prepared, "--recipe", "recipes/tiny.yaml", "--out", run, "--resume",
                 *[x for s in [f"model.init={base}", *KNOBS, *RUN[:1], "train.steps=2", "train.checkpoint_every=1",
                               "train.warmup_steps=1", "train.trainable=norms"] for x in ("--set", s)]],
                ["train", "--data", prepared, "--recipe", "recipes/tiny.yaml", "--out", tmp_path / "next", "--init",
                 run, "--steps", 0, "--set", "model.preset=null"]):  # fmt: skip
        assert want in _error_line(_cli(*how)), how
    assert not (tmp_path / "hf").exists() and not (tmp_path / "next").exists()
    assert latest_checkpoint(run) == ckpt  # the resume wrote nothing
    with pytest.raises(GenoctxError, match="changed since the run started"):
        load_model(ckpt)
    shutil.rmtree(base)  # a missing base: the same refusal, and verify's exit 1
    assert f"{ckpt}: its base {base.resolve()} is missing" in _error_line(_cli("export", run, "--out", tmp_path / "x"))
    assert _cli("verify", ckpt).exit_code == 1


def test_init_of_a_partial_run_follows_its_base(prepared, hf_base, tmp_path):
    first = tmp_path / "first"
    train(prepared, _recipe(hf_base, *RUN[:1], "train.steps=1", "train.warmup_steps=1", "train.trainable=norms"),
          first)  # fmt: skip
    m1 = load_model(first)[0].state_dict()
    # a whole run from it (--init RUN): starts from base + its norms
    train(prepared, load_recipe("recipes/tiny.yaml", [f"model.init={first}", *KNOBS, "train.steps=0",
                                                      "train.seq_len=256"]), tmp_path / "whole")  # fmt: skip
    s0 = load_model(tmp_path / "whole")[0].state_dict()
    assert set(s0) == set(m1) and all(torch.equal(s0[k], m1[k]) for k in m1)
    # a partial run from it: its own checkpoint holds only the router; its frozen tensors are first's (norms) and
    # the HF base's (the rest), read through the chain
    train(prepared, load_recipe("recipes/tiny.yaml", [f"model.init={first}", *KNOBS, "train.steps=1",
                                                      "train.seq_len=256", "train.warmup_steps=1",
                                                      "train.trainable=router"]), tmp_path / "second")  # fmt: skip
    ckpt = latest_checkpoint(tmp_path / "second")
    state = json.loads((ckpt / "state.json").read_text())
    assert state["holds"] == "trainable" and state["init"]["kind"] == "genoctx"
    assert all(".mlp.gate." in n for n in _names(ckpt))
    s2 = load_model(ckpt)[0].state_dict()
    moved = {k for k in m1 if not torch.equal(s2[k], m1[k])}
    assert moved and moved <= _names(ckpt)
