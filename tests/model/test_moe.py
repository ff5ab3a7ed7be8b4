"""MoE (DeepSeek-V3 routing as glm5_next): vectorised dispatch == token loop == transformers' module, group-limited
routing, clamped SwiGLU, chunked == unchunked, biased selection, balancing, aux loss, memory."""

import pytest
import torch
import torch.nn.functional as F

from genoctx.model.config import ModelConfig
from genoctx.model.moe import MLP, MoE


def _cfg(**kw) -> ModelConfig:
    base = dict(
        hidden_size=12, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=8, n_shared_experts=1,
        moe_chunk_tokens=4096, router_bias_rate=0.01, moe_aux_loss_coef=0.0, initializer_range=0.3,
        routed_scaling_factor=2.5, swiglu_limit=10.0,
    )  # fmt: skip
    base.update(kw)
    return ModelConfig(**base)


def _moe(dtype=torch.float32, bias_std=0.0, **kw) -> MoE:
    moe = MoE(_cfg(**kw)).to(dtype)
    if bias_std:
        with torch.no_grad():
            moe.gate.e_score_correction_bias.normal_(0, bias_std)
    return moe


def _swiglu(x, gate, up, down, limit):
    return F.linear(F.silu(F.linear(x, gate).clamp(max=limit)) * F.linear(x, up).clamp(-limit, limit), down)


def _reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Slow MoE (DeepSeek-V3 eq. 12-16, glm5_next's router): a python loop over tokens, groups and experts."""
    B, T, D = x.shape
    g = moe.gate
    E, k, G, I = g.n_experts, g.top_k, g.n_group, moe.experts.intermediate_size
    lim = moe.experts.swiglu_limit
    rows = []
    for xt in x.reshape(B * T, D):
        s = torch.sigmoid(g.weight.to(x.dtype) @ xt)  # [E] affinities
        c = [float(s[e] + g.e_score_correction_bias[e]) for e in range(E)]
        per = E // G
        group_score = [sum(sorted(c[j * per : (j + 1) * per], reverse=True)[:2]) for j in range(G)]
        groups = sorted(range(G), key=lambda j: -group_score[j])[: g.topk_group]
        allowed = [e for e in range(E) if e // per in groups]
        chosen = sorted(allowed, key=lambda e: -c[e])[:k]
        denom = sum(s[e] for e in chosen) + 1e-20 if g.norm_topk_prob else 1.0
        y = 0
        for e in chosen:
            gu = moe.experts.gate_up_proj[e]
            y = y + s[e] / denom * g.routed_scaling_factor * _swiglu(xt, gu[:I], gu[I:], moe.experts.down_proj[e], lim)
        sh = moe.shared_experts
        y = y + _swiglu(xt, sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight, lim)
        rows.append(y)
    return torch.stack(rows).view(B, T, D)


def test_mlp_is_clamped_swiglu():
    mlp = MLP(6, 10, swiglu_limit=0.5, init_std=0.5)
    x = torch.randn(3, 4, 6) * 3
    assert float(mlp.gate_proj(x).abs().max()) > 0.5  # the clamp is active
    ref = _swiglu(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, 0.5)
    torch.testing.assert_close(mlp(x), ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(n_group=3, topk_group=2),
        dict(n_group=2, topk_group=1, norm_topk_prob=False),
        dict(swiglu_limit=0.7),
    ],
)
def test_vectorised_dispatch_matches_token_loop_forward_and_backward(kw):
    """fp64: values and gradients of x and every parameter, with a router bias that changes the selection."""
    moe = _moe(torch.float64, bias_std=0.3, moe_chunk_tokens=5, **kw)
    x = torch.randn(2, 9, 12, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 9, 12, dtype=torch.float64)
    y = moe(x)
    grads = torch.autograd.grad((y * g).sum(), [x, *moe.parameters()])
    y_ref = _reference_moe(moe, x)
    grads_ref = torch.autograd.grad((y_ref * g).sum(), [x, *moe.parameters()])
    torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=1e-12)
    names = ["x"] + [n for n, _ in moe.named_parameters()]
    for name, a, r in zip(names, grads, grads_ref, strict=True):
        torch.testing.assert_close(a, r, atol=1e-12, rtol=1e-12, msg=f"grad of {name}")
    assert grads[names.index("gate.weight")].abs().sum() > 0  # the router learns through the weights


@pytest.mark.parametrize("kw", [dict(), dict(n_group=3, topk_group=2, norm_topk_prob=False)])
def test_equals_transformers_moe(kw):
    """The module equals transformers' ``Glm5NextTextMoE`` with the same weights (same names), fp32: relative error
    ``max |ours - ref| / max |ref|`` <= 1e-5 on the output and on the gradients of x and every parameter."""
    import transformers.models.glm5_next.modeling_glm5_next as M
    from transformers import Glm5NextTextConfig

    moe = _moe(bias_std=0.3, moe_chunk_tokens=7, **kw)
    ref = M.Glm5NextTextMoE(Glm5NextTextConfig(**moe_cfg_hf(moe)))
    ref.load_state_dict(moe.state_dict())
    x = torch.randn(2, 11, 12)
    names = [n for n, _ in moe.named_parameters()]
    outs = []
    for m in (moe, ref):
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        params = dict(m.named_parameters())
        outs.append((y, *torch.autograd.grad(y.square().sum(), [xi, *(params[n] for n in names)])))
    for name, a, r in zip(["y", "x", *names], *outs, strict=True):
        assert float((a - r).abs().max() / r.abs().max()) <= 1e-5, name


def moe_cfg_hf(moe: MoE) -> dict:
    """The config.json of a one-MoE-layer text model with this module's widths (for transformers' module)."""
    return _cfg(
        n_group=moe.gate.n_group, topk_group=moe.gate.topk_group, norm_topk_prob=moe.gate.norm_topk_prob
    ).to_hf_dict()


def test_group_limited_routing_by_hand():
    """Groups are ranked by the sum of their two best biased scores: the best single expert loses when its group's
    second expert is poor (6 experts in 3 groups, top-1 group, top-2 experts; zero router weight: s = 0.5)."""
    moe = _moe(n_group=3, topk_group=1)
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.e_score_correction_bias.copy_(torch.tensor([0.9, -0.9, 0.5, 0.5, 0.0, 0.0]))
    experts, weights, scores = moe.gate(torch.randn(4, 12))
    assert sorted(experts[0].tolist()) == [2, 3]  # group {2, 3}: 2.0 beats {0, 1}: 1.0 and {4, 5}: 1.0
    torch.testing.assert_close(weights, torch.full((4, 2), 2.5 / 2))  # 0.5 / (0.5 + 0.5) x routed_scaling_factor
    free = _moe()
    free.load_state_dict(moe.state_dict())
    assert 0 in free.gate(torch.randn(4, 12))[0][0].tolist()  # without groups expert 0 wins


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("chunk", [1, 7, 13, 26, 100])
def test_chunked_equals_unchunked(chunk, recompute):
    B, T = 2, 13  # 26 tokens; 7 does not divide them
    ref = MoE(_cfg(moe_chunk_tokens=10_000, moe_aux_loss_coef=0.1), recompute=False)
    moe = MoE(_cfg(moe_chunk_tokens=chunk, moe_aux_loss_coef=0.1), recompute=recompute)
    moe.load_state_dict(ref.state_dict())
    x = torch.randn(B, T, 12)
    g = torch.randn(B, T, 12)
    outs = []
    for m in (ref, moe):
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        loss = (y * g).sum() + m.aux_loss
        grads = torch.autograd.grad(loss, [xi, *m.parameters()])
        outs.append((y, m.aux_loss, grads, m.stats["tokens_per_expert"]))
    (y0, a0, g0, c0), (y1, a1, g1, c1) = outs
    torch.testing.assert_close(y1, y0, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(a1, a0, atol=1e-7, rtol=1e-6)
    assert torch.equal(c1, c0)
    for a, r in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, r, atol=1e-6, rtol=1e-5)


def test_bias_selects_but_does_not_weight():
    moe = _moe()
    x = torch.randn(40, 12)
    experts0, _, scores = moe.gate(x)
    with torch.no_grad():
        moe.gate.e_score_correction_bias[4] = 10.0  # expert 4 always selected
    experts, weights, scores1 = moe.gate(x)
    assert torch.equal(scores, scores1)  # the bias does not touch the affinities
    assert (experts == 4).any(-1).all() and not torch.equal(experts, experts0)
    sel = scores.gather(-1, experts)  # weights: the selected unbiased affinities, normalised, times 2.5
    torch.testing.assert_close(weights, sel / (sel.sum(-1, keepdim=True) + 1e-20) * 2.5, atol=0, rtol=0)
    masked = scores.clone()
    masked[:, 4] = -1
    assert torch.equal(experts[experts != 4].view(40), masked.argmax(-1))  # the other: best unbiased of the rest
    b = moe.gate.e_score_correction_bias
    assert not b.requires_grad and b.dtype == torch.float32 and "gate.e_score_correction_bias" in moe.state_dict()


def test_tokens_per_expert_and_load_counts_accumulate():
    moe = _moe(moe_chunk_tokens=4)
    x = torch.randn(3, 5, 12)
    moe(x)
    c1 = moe.stats["tokens_per_expert"]
    assert c1.dtype == torch.long and c1.shape == (6,) and int(c1.sum()) == 3 * 5 * 2
    experts, _, _ = moe.gate(x.view(-1, 12))
    assert torch.equal(c1, torch.bincount(experts.view(-1), minlength=6))
    assert moe.stats["load_max_over_mean"] == pytest.approx(c1.max().item() / c1.float().mean().item())
    moe(x[:1])
    assert torch.equal(moe.load_counts, c1 + moe.stats["tokens_per_expert"])
    before = moe.load_counts.clone()
    moe.eval()
    with torch.no_grad():
        moe(x)
    assert torch.equal(moe.load_counts, before)  # evaluation does not feed the balancer


def test_update_bias_moves_toward_underloaded_experts():
    moe = _moe(router_bias_rate=0.01)
    bias = moe.gate.e_score_correction_bias
    with torch.no_grad():
        bias[0] = 5.0  # skew: expert 0 takes every token
    moe(torch.randn(2, 16, 12))
    load = moe.load_counts.clone()
    assert load[0] == 32 and int(load.sum()) == 64
    before = bias.clone()
    out = moe.update_bias()
    mean = load.float().mean()
    torch.testing.assert_close(bias, before + 0.01 * torch.sign(mean - load.float()), atol=0, rtol=0)
    assert bias[0] < before[0]
    under = load.float() < mean
    assert (bias[under] > before[under]).all()
    assert out["tokens_per_expert"] == load.tolist()
    assert out["load_max_over_mean"] == pytest.approx(32 / mean.item())
    assert int(moe.load_counts.sum()) == 0
    frozen = bias.clone()
    moe.update_bias()  # no tokens since the reset: no change
    assert torch.equal(bias, frozen)


def test_aux_loss_matches_hand_computation():
    coef = 0.3
    moe = _moe(bias_std=0.2, moe_aux_loss_coef=coef, moe_chunk_tokens=3)
    B, T, E, k = 2, 5, 6, 2
    x = torch.randn(B, T, 12)
    moe(x)
    total = 0.0
    for b in range(B):
        f = [0.0] * E
        P = [0.0] * E
        for t in range(T):
            s = torch.sigmoid(moe.gate.weight @ x[b, t]).tolist()
            biased = [s[e] + moe.gate.e_score_correction_bias[e].item() for e in range(E)]
            for e in sorted(range(E), key=lambda e: -biased[e])[:k]:
                f[e] += E / (k * T)
            for e in range(E):
                P[e] += s[e] / sum(s) / T
        total += sum(f[e] * P[e] for e in range(E))
    assert moe.aux_loss is not None
    assert moe.aux_loss.item() == pytest.approx(coef * total / B, rel=1e-5)
    off = _moe()
    off(x)
    assert off.aux_loss is None


def test_bad_config_raises():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        _cfg(n_routed_experts=4, num_experts_per_tok=5)
    with pytest.raises(ValueError, match="n_group"):
        _cfg(n_group=4)  # does not divide 6 experts
    with pytest.raises(ValueError, match="moe_chunk_tokens"):
        _cfg(moe_chunk_tokens=0)


def _saved_numel(moe: MoE, x: torch.Tensor) -> int:
    """Elements autograd keeps alive for backward after one forward (activation memory, in elements)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        moe(x)
    return total


def test_recompute_keeps_only_chunk_inputs_alive():
    cfg = _cfg(moe_intermediate_size=64, moe_chunk_tokens=16)
    x = torch.randn(2, 64, 12, requires_grad=True)
    kept = _saved_numel(MoE(cfg, recompute=True), x)
    full = _saved_numel(MoE(cfg, recompute=False), x)
    # With recompute only each chunk's input (and its sequence ids) is saved; the expert activations
    # (hidden width 64 per selected slot) are rebuilt in backward one chunk at a time.
    assert kept <= x.numel() + 2 * 64
    assert full > 10 * kept


def test_bf16_autocast_close_to_fp32():
    moe = _moe(moe_chunk_tokens=8)
    x = torch.randn(2, 10, 12)
    y32 = moe(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16 = moe(x)
        experts, weights, _ = moe.gate(x.view(-1, 12))
    assert y16.dtype == torch.bfloat16 and weights.dtype == torch.float32  # routing in fp32
    torch.testing.assert_close(y16.float(), y32, atol=0.1, rtol=0.05)


def _count_ops(fn) -> int:
    """aten ops ``fn()`` dispatches (``genoctx.model.opcount.OpCounter``: what the planner's op counts are held to)."""
    from genoctx.model.opcount import OpCounter

    with OpCounter() as counter:
        fn()
    return counter.total


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("chunk, T", [(4, 4), (4, 13), (64, 193)])
def test_op_counts_per_chunk(chunk, T, grouped, monkeypatch):
    """cpu-small's MoE (8 experts, top-2, a shared expert; fp32, grad on, training mode) issues, for ``n`` token
    chunks: with the grouped products (``Experts.forward_grouped``) ``21 + 49 n`` aten ops forward, ``4 + 181 n``
    backward (the checkpointed chunks recomputed in it) and ``20 + 49 n`` in a no-grad eval forward, whatever the
    experts; with the per-expert loop (``forward_loop``) ``21 + 46 n + 10 A``, ``4 + 187 n + 50 A`` and
    ``20 + 46 n + 10 A`` for ``A`` experts with rows summed over the chunks: the formulas the planner counts with."""
    from genoctx.model.config import preset
    from genoctx.model.moe import Experts

    monkeypatch.setattr(Experts, "grouped", grouped)
    cfg = preset("cpu-small", moe_chunk_tokens=chunk)
    torch.manual_seed(0)
    moe = MoE(cfg)
    x = torch.randn(1, T, cfg.hidden_size, requires_grad=True)
    with torch.no_grad():
        active = [int(moe.gate(c)[0].flatten().unique().numel()) for c in x[0].split(chunk)]
    n, A = len(active), sum(active)
    fwd, bwd, ev = (21 + 49 * n, 4 + 181 * n, 20 + 49 * n) if grouped else (21 + 46 * n + 10 * A, 4 + 187 * n + 50 * A,
                                                                          20 + 46 * n + 10 * A)  # fmt: skip
    out = {}
    assert _count_ops(lambda: out.update(y=moe(x))) == fwd
    assert moe.stats["experts"] == ("grouped_mm" if grouped else "loop")
    g = torch.randn_like(out["y"])
    assert _count_ops(lambda: out["y"].backward(g)) == bwd
    moe.eval()
    with torch.no_grad():
        assert _count_ops(lambda: moe(x)) == ev
