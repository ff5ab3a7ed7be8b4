"""``build_optimizer`` runs torch's foreach AdamW on the CPU (one ``_foreach_*`` op per update term, not ~10 ops per
parameter tensor): the same parameters and moments, bit for bit, as the single-tensor path over several steps, in a
handful of aten ops."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from genoctx.model.config import preset
from genoctx.model.model import HybridLM
from genoctx.model.opcount import OpCounter
from genoctx.recipes import TrainConfig
from genoctx.train.loop import build_optimizer, train_step


def _run(foreach: bool | None):
    torch.manual_seed(0)
    model = HybridLM(preset("tiny"), seed=0)
    cfg = TrainConfig(steps=4, lr=3e-3, warmup_steps=1, weight_decay=0.1)
    opt, sched = build_optimizer(model, cfg, cfg.steps)
    for g in opt.param_groups:
        g["foreach"] = g["foreach"] if foreach is None else foreach
    tokens = torch.randint(3, 7, (1, 96), generator=torch.Generator().manual_seed(1))
    ops = []
    for _ in range(3):
        counter = OpCounter()
        opt.register_step_pre_hook(lambda *a, c=counter: (c.__enter__(), None)[1])
        opt.register_step_post_hook(lambda *a, c=counter: (c.__exit__(None, None, None), None)[1])
        train_step(model, opt, sched, tokens, cfg, nullcontext())
        opt._optimizer_step_pre_hooks.clear()
        opt._optimizer_step_post_hooks.clear()
        ops.append(counter.total)
    return model, opt, ops


def test_foreach_adamw_on_the_cpu_equals_single_tensor_in_few_ops():
    fe_model, fe_opt, fe_ops = _run(foreach=None)  # what build_optimizer chose
    st_model, st_opt, st_ops = _run(foreach=False)
    assert all(g["foreach"] for g in fe_opt.param_groups)  # chosen on the CPU, not torch's single-tensor default
    for (name, a), b in zip(fe_model.named_parameters(), st_model.parameters(), strict=True):
        assert torch.equal(a, b), name
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(fe_opt.state[a][k], st_opt.state[b][k]), (name, k)
    n_params = sum(len(g["params"]) for g in st_opt.param_groups)
    assert st_ops[-1] >= 8 * n_params  # single-tensor: about ten ops per parameter tensor
    # foreach: a few ops per group and term, plus two host reads of each tensor's step count (bias corrections)
    assert fe_ops[-1] <= 2 * n_params + 40


def test_offloaded_optimizer_keeps_the_single_tensor_path():
    model = HybridLM(preset("tiny"), seed=0)
    opt, _ = build_optimizer(model, TrainConfig(steps=2, offload_optimizer=True), 2)
    assert not any(g["foreach"] for g in opt.param_groups)
