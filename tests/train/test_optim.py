"""AdamW with bf16 moments (``train.optimizer_state_dtype``, ``genoctx.train.optim.AdamW``): the same update as
``torch.optim.AdamW`` (bit for bit with fp32 moments), bf16 moments at half the bytes and within a stated band of
fp32 AdamW's parameters, checkpoints that resume exactly and convert between the two dtypes."""

from __future__ import annotations

import contextlib

import pytest
import torch

from genoctx.model.config import preset
from genoctx.model.model import HybridLM
from genoctx.recipes import RecipeValueError, TrainConfig, load_recipe
from genoctx.train.checkpoint import (
    latest_checkpoint,
    load_training_state,
    read_optimizer,
    read_tensors,
    save_checkpoint,
)
from genoctx.train.loop import build_optimizer, forward_backward, train, train_step
from genoctx.train.optim import AdamW

STEPS = 5


def _tiny(seed: int = 0) -> HybridLM:
    torch.manual_seed(seed)
    return HybridLM(preset("tiny"))


def _run(model: HybridLM, cfg: TrainConfig, steps: int = STEPS, opt_sched=None):
    """``steps`` real training steps (forward, backward, clip, AdamW, schedule) on fixed random windows."""
    opt, sched = opt_sched or build_optimizer(model, cfg, 10)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, 4, (1, 96), generator=g)
        train_step(model, opt, sched, tokens, cfg, contextlib.nullcontext())
    return opt, sched


def _cfg(state: str = "fp32") -> TrainConfig:
    return TrainConfig(lr=1e-2, warmup_steps=1, optimizer_state_dtype=state)


def test_fp32_moments_equal_torch_adamw_bit_for_bit():
    model = torch.nn.Linear(6, 5)
    ref = torch.nn.Linear(6, 5)
    ref.load_state_dict(model.state_dict())
    groups = lambda m: [{"params": [m.weight], "weight_decay": 0.1}, {"params": [m.bias], "weight_decay": 0.0}]  # noqa: E731
    ours = AdamW(groups(model), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, state_dtype=torch.float32)
    theirs = torch.optim.AdamW(groups(ref), lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (s + 1)) for o in (ours, theirs)]
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        x = torch.randn(4, 6, generator=g)
        for m, o, s in ((model, ours, scheds[0]), (ref, theirs, scheds[1])):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
            s.step()
    for a, b in ((model.weight, ref.weight), (model.bias, ref.bias)):
        assert torch.equal(a, b)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ours.state[a][k], theirs.state[b][k])
    assert ours.param_groups[0]["lr"] == theirs.param_groups[0]["lr"]


def test_bf16_moments_halve_the_bytes_and_stay_near_fp32_adamw():
    """5 steps of the tiny model, both optimizers fed the same (fp32 run's, clipped) gradients, so that only the
    moments' rounding separates them. Band, per element: ``|p_bf16 - p_fp32| <= 2^-7 sum_k lr_k``: each step's
    update ``m_hat / (sqrt(v_hat) + eps)`` (of magnitude about 1 or less) carries the rounding of the stored ``m``
    (<= 2^-9 relative, round to nearest) and half that of ``v``, and those of earlier steps through ``beta1``, ``beta2``
    (measured over 4 seeds: at most 0.0195 lr_0 after 5 steps, 0.54 of the band's 0.036 lr_0); step 1 is equal
    (fresh moments are used in fp32 before they are stored)."""
    a, b = _tiny(), _tiny()
    opt_a, sched_a = build_optimizer(a, _cfg("fp32"), 10)
    opt_b, sched_b = build_optimizer(b, _cfg("bf16"), 10)
    assert type(opt_a) is torch.optim.AdamW and type(opt_b) is AdamW
    g = torch.Generator().manual_seed(1)
    rates = []
    for step in range(STEPS):
        opt_a.zero_grad(set_to_none=True)
        forward_backward(a, torch.randint(0, 4, (1, 96), generator=g), contextlib.nullcontext())
        torch.nn.utils.clip_grad_norm_(a.parameters(), 1.0)
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
            pb.grad = None if pa.grad is None else pa.grad.clone()
        rates.append(opt_a.param_groups[0]["lr"])
        for opt, sched in ((opt_a, sched_a), (opt_b, sched_b)):
            opt.step()
            sched.step()
        worst = max((pb - pa).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters(), strict=True))
        assert worst <= 2**-7 * sum(rates) and (worst == 0) == (step == 0), (step, worst)
    moment_bytes = {"fp32": 0, "bf16": 0}
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert pb.dtype == torch.float32 and sb["exp_avg"].dtype == sb["exp_avg_sq"].dtype == torch.bfloat16
        assert torch.equal(sa["step"], sb["step"])
        moment_bytes["fp32"] += sum(sa[k].nbytes for k in ("exp_avg", "exp_avg_sq"))
        moment_bytes["bf16"] += sum(sb[k].nbytes for k in ("exp_avg", "exp_avg_sq"))
    n = sum(p.numel() for p in a.parameters())
    assert moment_bytes == {"fp32": 8 * n, "bf16": 4 * n}


def test_the_knob_is_checked():
    assert TrainConfig().optimizer_state_dtype == "fp32"
    with pytest.raises(RecipeValueError, match="train.optimizer_state_dtype must be 'fp32' or 'bf16', got 'fp16'") as e:
        TrainConfig(optimizer_state_dtype="fp16")
    assert e.value.key == "train.optimizer_state_dtype"


@pytest.mark.parametrize(("saved", "resumed"), [("bf16", "fp32"), ("fp32", "bf16"), ("bf16", "bf16")])
def test_a_checkpoint_resumes_with_either_moment_dtype(tmp_path, saved, resumed):
    """One process: the moments come back cast (bf16 -> fp32 exactly; fp32 -> bf16 rounded to nearest), the
    weights, step and learning rate exactly; bf16 -> bf16 then trains on as the uninterrupted run, bit for bit."""
    recipe = load_recipe("recipes/tiny.yaml", [f"train.optimizer_state_dtype={saved}"])
    model = _tiny()
    opt, sched = _run(model, _cfg(saved), steps=2)
    ckpt = save_checkpoint(tmp_path, 2, model, opt, sched, recipe, {})
    model2 = _tiny(seed=5)
    opt2, sched2 = build_optimizer(model2, _cfg(resumed), 10)
    load_training_state(ckpt, model2, opt2, sched2)
    want = torch.float32 if resumed == "fp32" else torch.bfloat16
    for p, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, p2)
        for k in ("exp_avg", "exp_avg_sq"):
            got = opt2.state[p2][k]
            assert got.dtype == want
            assert torch.equal(got, opt.state[p][k].to(want))
        assert torch.equal(opt2.state[p2]["step"], opt.state[p]["step"])
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]
    if saved == resumed:
        _run(model, _cfg(saved), steps=2, opt_sched=(opt, sched))
        _run(model2, _cfg(resumed), steps=2, opt_sched=(opt2, sched2))
        for p, p2 in zip(model.parameters(), model2.parameters(), strict=True):
            assert torch.equal(p, p2)
            assert all(torch.equal(opt.state[p][k], opt2.state[p2][k]) for k in ("exp_avg", "exp_avg_sq"))


def test_a_one_process_run_with_bf16_moments_resumes_exactly(prepared, tmp_path, caplog):
    """``genoctx train`` in one process: 4 steps, against 2 steps, ``--resume``, 2 more; weights, moments, step
    and rate equal. Then resumed with fp32 moments (a warning says so) for 2 more steps."""
    recipe = load_recipe("recipes/tiny.yaml", ["train.optimizer_state_dtype=bf16", "train.checkpoint_every=2"])
    train(prepared, recipe, tmp_path / "full")
    train(prepared, recipe, tmp_path / "part", stop_after=2)
    assert train(prepared, recipe, tmp_path / "part", resume=True)["resumed_from"] == 2
    a, b = (latest_checkpoint(tmp_path / r) for r in ("full", "part"))
    assert a.name == b.name == "step_000004"
    ta, tb = read_tensors(a / "model.safetensors"), read_tensors(b / "model.safetensors")
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    oa, ob = read_optimizer(a / "optimizer.pt"), read_optimizer(b / "optimizer.pt")
    assert oa["scheduler"] == ob["scheduler"]
    assert [g["lr"] for g in oa["optimizer"]["param_groups"]] == [g["lr"] for g in ob["optimizer"]["param_groups"]]
    sa, sb = oa["optimizer"]["state"], ob["optimizer"]["state"]
    assert sa and sa.keys() == sb.keys()
    for i in sa:
        assert sa[i]["exp_avg"].dtype == torch.bfloat16
        assert all(torch.equal(sa[i][k], sb[i][k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    fp32 = load_recipe("recipes/tiny.yaml", ["train.checkpoint_every=2", "train.steps=6"])
    with caplog.at_level("WARNING", logger="genoctx"):
        assert train(prepared, fp32, tmp_path / "part", resume=True)["resumed_from"] == 4
    assert "train.optimizer_state_dtype changed from bf16 to fp32: the AdamW moments are cast" in caplog.text
    last = read_optimizer(latest_checkpoint(tmp_path / "part") / "optimizer.pt")["optimizer"]["state"]
    assert all(st["exp_avg"].dtype == torch.float32 and st["step"].item() == 6 for st in last.values())
