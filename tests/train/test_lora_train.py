"""``train.trainable: lora`` in one process (issue 44): the recipe keys, the optimizer holding exactly the adapters (and
the named groups), the base bit-identical after steps, the adapters moving, a resume exact, eval rebuilding the
adapters from the checkpoint's recipe and export --merge writing the merged model. The mesh refusal (one line, exit 2)
is ``tests/train/test_trainable.py::test_recipe_key_is_validated_and_canonical``. The adapters' maths (forward and
gradients equal to the merged formulation) is ``tests/model/test_lora.py``."""

from contextlib import nullcontext

import pytest
import torch
from cli_runner import run_genoctx  # tests/cli_runner.py: tests/ is on sys.path (its conftest.py)
from test_trainable import resumed_run  # tests/train/ is on sys.path (pytest's rootdir imports)

from genoctx.errors import GenoctxError
from genoctx.model.config import preset
from genoctx.model.groups import group_of
from genoctx.model.hf import load_hf
from genoctx.model.lora import DEFAULT_TARGETS, apply_lora, is_lora_name
from genoctx.model.model import HybridLM
from genoctx.recipes import TrainConfig, load_recipe
from genoctx.train.loop import build_optimizer, train_step, trainable_counts


def test_lora_keys_are_validated():
    t = TrainConfig()
    assert (t.lora_rank, t.lora_alpha, t.lora_targets) == (16, 32.0, ",".join(DEFAULT_TARGETS))
    rec = load_recipe("recipes/tiny.yaml", ["train.lora_targets=q_proj, experts.down_proj", "train.lora_rank=4"])
    assert (rec.train.lora_targets, rec.train.lora_rank) == ("q_proj,experts.down_proj", 4)
    for over, key in (("train.lora_rank=0", "train.lora_rank must be >= 1"),
                      ("train.lora_alpha=-1", "train.lora_alpha must be > 0"),
                      ("train.lora_targets=q_proj,,k_proj", "train.lora_targets must be a comma list"),
                      ("train.lora_targets=q_proj,q_proj", "train.lora_targets must be a comma list")):  # fmt: skip
        with pytest.raises(GenoctxError, match=key):
            load_recipe("recipes/tiny.yaml", [over])


@pytest.mark.parametrize("spec", ["lora", "embed,norms,lora"])
def test_lora_trains_the_adapters_and_named_groups_alone(spec):
    model = HybridLM(preset("tiny"), seed=0)
    tokens = torch.randint(0, 4, (2, 96), generator=torch.Generator().manual_seed(0))
    cfg = TrainConfig(steps=3, lr=1e-2, warmup_steps=0, grad_clip=1e9, trainable=spec)
    with pytest.raises(GenoctxError, match="the model has no LoRA adapters"):  # a mesh run, or apply_lora forgotten
        build_optimizer(HybridLM(preset("tiny"), seed=0), cfg, cfg.steps)
    apply_lora(model, 4, 8.0, DEFAULT_TARGETS, seed=0)
    opt, sched = build_optimizer(model, cfg, cfg.steps)
    names = dict(model.named_parameters())
    groups = spec.split(",")
    trained = {n for n in names if is_lora_name(n) or group_of(n, model.cfg.layer_types) in groups}
    assert any(is_lora_name(n) for n in trained) and len(trained) < len(names)
    assert any("experts.gate_up_proj_lora_A" in n for n in trained)  # one adapter per routed expert
    assert ("embed_tokens.weight" in trained) == ("embed" in groups)
    held = [p for g in opt.param_groups for p in g["params"]]
    assert len(held) == len({id(p) for p in held}) == len(trained)
    assert {id(p) for p in held} == {id(names[n]) for n in trained}
    c = trainable_counts(model, spec)
    assert c["trainable_parameters"] == sum(names[n].numel() for n in trained) and c["groups"]["lora"] > 0
    start = {n: p.detach().clone() for n, p in names.items()}
    for _ in range(3):
        train_step(model, opt, sched, tokens, cfg, nullcontext())
        assert {n for n, p in names.items() if p.grad is not None} == trained
    assert {id(p) for p in opt.state} == {id(names[n]) for n in trained}
    for n, p in names.items():
        assert torch.equal(p, start[n]) == (n not in trained), n  # the base bit-identical; adapters, groups move


def test_lora_resume_is_exact_and_eval_and_export_rebuild_the_adapters(prepared, tmp_path):
    over = ["train.seq_len=256", "train.steps=4", "train.checkpoint_every=2", "train.warmup_steps=1",
            "train.keep_checkpoints=0", "train.lr=1e-2", "train.trainable=lora,norms", "train.lora_rank=4"]  # fmt: skip
    # eval's loader (load_model) rebuilds the adapters of each checkpoint
    rec, init, a, b = resumed_run(prepared, tmp_path, over, "train.lora_rank=8",
                                  "train.lora_rank is 8 but the run was trained with 4")  # fmt: skip
    b_params, init_params = dict(b.named_parameters()), dict(init.named_parameters())
    assert any(is_lora_name(n) for n in b_params)
    for name, t in a.named_parameters():
        assert torch.equal(t, b_params[name]), name
        moves = is_lora_name(name) or group_of(name, rec.model.layer_types) == "norms"
        assert torch.equal(t, init_params[name]) != moves, name  # base frozen; adapters (B from zero) and norms move
    r = run_genoctx("eval", "--by-position", "--data", str(prepared), "--checkpoint", str(tmp_path / "full"),
                    "--max-windows", "1", "--resamples", "0", "--format", "json")  # fmt: skip
    assert r.returncode == 0, r.stderr  # eval of a LoRA checkpoint: the adapters rebuilt from its recipe
    # export --merge of a LoRA run: the merged model, whose forward is the adapted one's (the PEFT adapter export:
    # tests/model/test_peft_export.py)
    r = run_genoctx("export", str(tmp_path / "full"), "--out", str(tmp_path / "hf"), "--merge")
    assert r.returncode == 0 and "writing the merged model" in r.stderr, r.stderr
    merged = load_hf(tmp_path / "hf")
    assert not any(is_lora_name(n) for n, _ in merged.named_parameters())
    x = torch.randint(0, 4, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got, base = a.eval()(x)[0], merged.eval()(x)[0], init.eval()(x)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(base, want, atol=1e-4)  # the adapters changed the output
