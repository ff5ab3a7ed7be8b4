"""MoE fast paths against their references: the grouped-product dispatch (``Experts.forward_grouped``) equals the
per-expert loop (``forward_loop``) forward and backward, and the fused SwiGLU Functions equal ``swiglu`` bit for bit;
which dispatch runs where (``Experts.path``)."""

import pytest
import torch

from genoctx.model.config import ModelConfig
from genoctx.model.moe import Experts, MoE, swiglu, swiglu_fused, swiglu_packed


def _cfg(**kw) -> ModelConfig:
    base = dict(
        hidden_size=12, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=8, n_shared_experts=1,
        moe_chunk_tokens=7, router_bias_rate=0.01, moe_aux_loss_coef=0.0, initializer_range=0.3,
        routed_scaling_factor=2.5, swiglu_limit=10.0,
    )  # fmt: skip
    base.update(kw)
    return ModelConfig(**base)


def _run(moe: MoE, x: torch.Tensor, g: torch.Tensor, grouped: bool, monkeypatch):
    monkeypatch.setattr(Experts, "grouped", grouped)
    xi = x.clone().requires_grad_(True)
    y = moe(xi)
    grads = torch.autograd.grad((y * g).sum(), [xi, *moe.parameters()])
    return y, grads, moe.stats["experts"]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("kw", [dict(), dict(n_group=3, topk_group=2, swiglu_limit=0.4), dict(moe_chunk_tokens=100)])
def test_grouped_equals_loop_forward_and_backward(kw, deterministic, monkeypatch):
    """fp32, today's tolerances (atol 1e-6, rtol 1e-5): output and the gradients of x and every parameter, with a
    router bias that leaves experts without rows (empty groups) in some chunks; the path that ran is recorded."""
    torch.manual_seed(0)
    moe = MoE(_cfg(**kw))
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(torch.tensor([0.6, 0.5, 0.0, 0.0, -1.0, -1.0]))
    x, g = torch.randn(2, 13, 12), torch.randn(2, 13, 12)
    with torch.no_grad():
        assert moe.gate(x.view(-1, 12))[0].unique().numel() < 6  # some expert gets no row
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        y0, g0, p0 = _run(moe, x, g, False, monkeypatch)
        y1, g1, p1 = _run(moe, x, g, True, monkeypatch)
    finally:
        torch.use_deterministic_algorithms(prev)
    assert (p0, p1) == ("loop", "grouped_mm")
    torch.testing.assert_close(y1, y0, atol=1e-6, rtol=1e-5)
    names = ["x"] + [n for n, _ in moe.named_parameters()]
    for name, a, r in zip(names, g1, g0, strict=True):
        torch.testing.assert_close(a, r, atol=1e-6, rtol=1e-5, msg=f"grad of {name}")
    assert g1[names.index("experts.gate_up_proj")][4:].abs().sum() == 0  # the empty experts get a zero gradient
    assert g1[names.index("experts.down_proj")].abs().sum() > 0


def test_grouped_bf16_autocast_close_to_loop(monkeypatch):
    """Under bf16 autocast both paths run the experts in bf16 (rows and weights cast as ``F.linear`` casts them)."""
    torch.manual_seed(0)
    moe = MoE(_cfg(hidden_size=16))
    x, g = torch.randn(2, 10, 16), torch.randn(2, 10, 16)
    outs = []
    for grouped in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(_run(moe, x, g, grouped, monkeypatch))
    (y0, g0, p0), (y1, g1, p1) = outs
    assert (p0, p1) == ("loop", "grouped_mm") and y1.dtype == y0.dtype == torch.bfloat16
    torch.testing.assert_close(y1.float(), y0.float(), atol=0.05, rtol=0.02)
    for a, r in zip(g1, g0, strict=True):
        torch.testing.assert_close(a.float(), r.float(), atol=0.05, rtol=0.02)


def test_path_falls_back_to_the_loop():
    """fp64 (``torch._grouped_mm`` refuses it), rows not a multiple of 16 bytes, LoRA adapters: the loop."""
    ex = MoE(_cfg()).experts
    assert ex.path(torch.randn(3, 12)) == "grouped_mm"
    assert ex.path(torch.randn(3, 12, dtype=torch.float64)) == "loop"
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's dtype decides: 12 bf16 channels are 24 bytes
        assert ex.path(torch.randn(3, 12)) == "loop"
        assert MoE(_cfg(hidden_size=16)).experts.path(torch.randn(3, 16)) == "grouped_mm"
    assert MoE(_cfg(hidden_size=10)).experts.path(torch.randn(3, 10)) == "loop"  # 40-byte rows
    assert MoE(_cfg(moe_intermediate_size=6)).experts.path(torch.randn(3, 12)) == "loop"
    ex.lora_scale = 2.0
    assert ex.path(torch.randn(3, 12)) == "loop"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_swiglu_equals_reference_bit_for_bit(dtype):
    """``swiglu_fused`` and ``swiglu_packed``: the reference's values and input gradients exactly, with inputs
    on both sides of the limits and exactly at them (clamp's gradient passes at the bound)."""
    torch.manual_seed(0)
    lim = 0.5
    gate, up = torch.randn(7, 9, dtype=dtype) * 2, torch.randn(7, 9, dtype=dtype) * 2
    gate[0, :3] = up[0, :3] = lim
    up[1, :3] = -lim
    dh = torch.randn(7, 9, dtype=dtype)

    def grads(fn, *ins):
        ins = [t.clone().requires_grad_(True) for t in ins]
        y = fn(*ins)
        return (y, *torch.autograd.grad(y, ins, dh))

    y, dg, du = grads(lambda a, b: swiglu(a, b, lim), gate, up)
    assert 0 < int((gate > lim).sum()) < gate.numel() and int((up.abs() > lim).sum()) > 0  # clamps active
    got = grads(lambda a, b: swiglu_fused(a, b, lim), gate, up)
    assert all(torch.equal(a, b) for a, b in zip(got, (y, dg, du), strict=True))
    yp, dgu = grads(lambda t: swiglu_packed(t, lim), torch.cat([gate, up], -1))
    assert torch.equal(yp, y) and torch.equal(dgu, torch.cat([dg, du], -1))
