"""``train.deterministic`` (issue 43 item 14): the recipe key, the kernels it selects (recorded in each step's
metrics) and two deterministic runs equal bit for bit. On a CPU every run gives the same bits; on a GPU only the
deterministic mode does (float atomics in the MoE combine and the sparse MLA backward otherwise)."""

import pytest
import torch

from genoctx.errors import GenoctxError
from genoctx.model.config import preset
from genoctx.model.model import HybridLM
from genoctx.recipes import TrainConfig, load_recipe
from genoctx.train.loop import build_optimizer, train_autocast, train_step


def test_recipe_key_and_set():
    assert TrainConfig().deterministic is False
    assert load_recipe(None, ["train.deterministic=true"]).train.deterministic is True
    with pytest.raises(GenoctxError, match="train.deterministic"):
        load_recipe(None, ["train.deterministic=maybe"])


def _two_steps(deterministic: bool):
    torch.manual_seed(0)
    model = HybridLM(preset("tiny", moe_chunk_tokens=16), seed=0)  # KDA + DSA, a dense MLP and a MoE (4 experts)
    cfg = TrainConfig(steps=2, lr=1e-2, warmup_steps=0, deterministic=deterministic)
    opt, sched = build_optimizer(model, cfg, cfg.steps)
    tokens = torch.randint(0, 4, (2, 48), generator=torch.Generator().manual_seed(3))
    metrics = [train_step(model, opt, sched, tokens, cfg, train_autocast("fp32", "cpu")) for _ in range(2)]
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return metrics, grads, [p.detach().clone() for p in model.parameters()]


def test_deterministic_steps_equal_bit_for_bit_and_record_the_path():
    """Two deterministic runs of two steps: the same losses, gradients and parameters bit for bit; the metrics name
    the mode and the combine that ran (``slot_sum``; the Triton sparse MLA backward never runs on a CPU: None). A
    default run records ``index_add`` and agrees to fp32 rounding. The global torch flag is restored after a step."""
    a, b, default = _two_steps(True), _two_steps(True), _two_steps(False)
    assert not torch.are_deterministic_algorithms_enabled()
    assert [m["loss"] for m in a[0]] == [m["loss"] for m in b[0]]
    for x, y in zip(a[1] + a[2], b[1] + b[2], strict=True):
        assert torch.equal(x, y)
    for m in a[0]:
        assert (m["deterministic"], m["moe_combine"], m["sparse_mla_backward"]) == (True, "slot_sum", None)
    for m in default[0]:
        assert (m["deterministic"], m["moe_combine"]) == (False, "index_add")
    for x, y in zip([m["loss"] for m in a[0]], [m["loss"] for m in default[0]], strict=True):
        assert x == pytest.approx(y, rel=1e-5)
