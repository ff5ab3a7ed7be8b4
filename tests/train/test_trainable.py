"""``train.trainable`` (issue 44): the recipe key, the frozen groups (no gradient, no optimizer state, bit-identical
after several steps), the gradient norm over what trains, the log line and a resume of a run with frozen groups.
``genoctx train --dry-run``'s ``"trainable"``: ``tests/test_dryrun.py::test_cli_train_dry_run``.

The mesh (FSDP2 x folded EP=2, two gloo ranks) is ``tests/parallel/test_mesh.py::test_frozen_groups_on_a_mesh``."""

import json
from contextlib import nullcontext

import pytest
import torch
from cli_runner import run_genoctx  # tests/cli_runner.py: tests/ is on sys.path (its conftest.py)

from genoctx.errors import GenoctxError
from genoctx.model.config import preset
from genoctx.model.groups import GROUPS, group_of
from genoctx.model.model import HybridLM
from genoctx.recipes import TrainConfig, load_recipe
from genoctx.train.checkpoint import load_model
from genoctx.train.loop import build_optimizer, describe_trainable, train, train_step, trainable_counts

ATTENTION = "kda,dsa,indexer,router,mhc,norms"  # the sequence mixing, the router and the streams: the choice


def test_recipe_key_is_validated_and_canonical(prepared, tmp_path):
    assert TrainConfig().trainable == "all"
    rec = load_recipe("recipes/tiny.yaml", ["train.trainable=dsa, kda"])
    assert rec.train.trainable == "kda,dsa"  # GROUPS order: a resume compares like with like
    assert load_recipe("recipes/tiny.yaml", ["train.trainable=lora,embed"]).train.trainable == "embed,lora"
    with pytest.raises(GenoctxError, match=r"--set train.trainable=kda,attn.*train.trainable 'kda,attn': 'attn' is"):
        load_recipe("recipes/tiny.yaml", ["train.trainable=kda,attn"])
    for spec, line, more in (("kda,attn", "'attn' is not a group", ()),
                             ("lora", "train.trainable: lora with train.compile is not supported yet",
                              ("--set", "train.compile=true"))):  # fmt: skip
        r = run_genoctx("train", "--data", str(prepared), "--recipe", "recipes/tiny.yaml", "--out",
                        str(tmp_path / "run"), "--set", f"train.trainable={spec}", *more)  # fmt: skip
        assert r.returncode == 2 and line in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not (tmp_path / "run").exists()


def _model_and_batch():
    cfg = preset("tiny")
    model = HybridLM(cfg, seed=0)
    with torch.no_grad():  # re-draw the zero router biases, so that a bias update would show
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    tokens = torch.randint(0, 4, (2, 96), generator=torch.Generator().manual_seed(0))
    return model, tokens


@pytest.mark.parametrize("spec", [ATTENTION, "experts"])
def test_frozen_groups_get_no_gradient_no_optimizer_state_and_stay_bit_identical(spec):
    model, tokens = _model_and_batch()
    cfg = TrainConfig(steps=3, lr=1e-2, warmup_steps=0, grad_clip=1e9, trainable=spec)  # 1e9: no clipping
    opt, sched = build_optimizer(model, cfg, cfg.steps)
    names = dict(model.named_parameters())
    trained = {n for n in names if group_of(n, model.cfg.layer_types) in spec.split(",")}
    assert trained and len(trained) < len(names)
    assert {n for n, p in names.items() if p.requires_grad} == trained
    start = {n: p.detach().clone() for n, p in names.items()}
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    for _ in range(3):
        m = train_step(model, opt, sched, tokens, cfg, nullcontext())
        grads = {n for n, p in names.items() if p.grad is not None}
        assert grads == trained  # a frozen tensor gets no gradient
        # the step's norm (unclipped) is over the trainable gradients alone
        want = torch.sqrt(sum(names[n].grad.double().pow(2).sum() for n in trained))
        assert m["grad_norm"] == pytest.approx(float(want), rel=1e-6)
        assert m["moe_load_max_over_mean"] is not None  # read with the router frozen too
    # the optimizer holds the trainable tensors alone: in its groups and in its state
    held = [p for g in opt.param_groups for p in g["params"]]
    assert len(held) == len({id(p) for p in held}) == len(trained)
    assert {id(p) for p in held} == {id(names[n]) for n in trained} == {id(p) for p in opt.state}
    numel = trainable_counts(model, spec)
    assert sum(p.numel() for p in held) == numel["trainable_parameters"]
    assert numel["trainable_parameters"] == sum(v for g, v in numel["groups"].items() if g in spec.split(","))
    for n, p in names.items():
        if n in trained:
            assert not torch.equal(p, start[n]), n  # moved
        else:
            assert torch.equal(p, start[n]), n  # bit-identical
    for n, b in model.named_buffers():  # routing biases move with the router, stay with it frozen
        if n in biases:
            assert torch.equal(b, biases[n]) == ("router" not in spec), n


def test_all_freezes_nothing_and_the_line_says_what_trains():
    model, _ = _model_and_batch()
    opt, _ = build_optimizer(model, TrainConfig(), 1)
    assert all(p.requires_grad for p in model.parameters())
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    c = trainable_counts(model, "all")
    assert set(c["groups"]) == set(GROUPS) and c["trainable_parameters"] == c["parameters"]
    tied = HybridLM(preset("tiny", tie_word_embeddings=True), seed=0)
    with pytest.raises(GenoctxError, match="train.trainable head: no parameter of this model is left to train"):
        build_optimizer(tied, TrainConfig(trainable="head"), 1)
    counts = {"trainable": "kda,dsa", "trainable_parameters": 12_345_678, "parameters": 313_300_000_000}
    assert describe_trainable(counts) == "trainable: kda,dsa (12.3M of 313.3B parameters)"


def resumed_run(prepared, tmp_path, over: list[str], changed: str, refusal: str):
    """tiny with recipe overrides ``over`` trained whole (``full``), stopped after step 2 (``cut``) and resumed: a
    resume with ``changed`` (another value of a key the run must keep) is refused with ``refusal``; the resumed run's
    every step (step, lr, loss) equals the whole run's. Returns the recipe and the models of step 0 (``init``), the
    whole run and the resumed one."""
    rec = load_recipe("recipes/tiny.yaml", over)
    train(prepared, rec, tmp_path / "full")
    train(prepared, rec, tmp_path / "cut", stop_after=2)
    with pytest.raises(GenoctxError, match=refusal):
        train(prepared, load_recipe("recipes/tiny.yaml", [*over, changed]), tmp_path / "cut", resume=True)
    assert train(prepared, rec, tmp_path / "cut", resume=True)["resumed_from"] == 2
    full, cut = ([json.loads(x) for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()]
                 for r in ("full", "cut"))  # fmt: skip
    assert [r["step"] for r in full] == list(range(1, rec.train.steps + 1)) and rec.train.steps > 2
    assert [(r["step"], r["lr"], r["loss"]) for r in cut] == [(r["step"], r["lr"], r["loss"]) for r in full]
    train(prepared, load_recipe("recipes/tiny.yaml", [*over, "train.steps=0"]), tmp_path / "init")  # step 0's weights
    return rec, *(load_model(tmp_path / r)[0] for r in ("init", "full", "cut"))


def test_resume_of_a_run_with_frozen_groups_is_exact(prepared, tmp_path, caplog):
    over = ["train.seq_len=256", "train.checkpoint_every=2", "train.warmup_steps=1", "train.keep_checkpoints=0",
            f"train.trainable={ATTENTION}"]  # fmt: skip
    with caplog.at_level("INFO", logger="genoctx.train"):
        rec, init, a, b = resumed_run(prepared, tmp_path, over, "train.trainable=experts",
                                      "train.trainable is 'experts' but the run was trained with")  # fmt: skip
    assert any(r.getMessage().startswith(f"trainable: {ATTENTION} (") for r in caplog.records)
    b_params, init_params = dict(b.named_parameters()), dict(init.named_parameters())
    frozen = 0
    for name, t in a.named_parameters():
        assert torch.equal(t, b_params[name]), name
        if group_of(name, rec.model.layer_types) not in ATTENTION.split(","):
            assert torch.equal(t, init_params[name]), name
            frozen += 1
    assert frozen > 0
