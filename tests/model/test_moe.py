"""MoE: chunked == unchunked, vectorised dispatch == token loop, biased selection, balancing, aux loss."""

import pytest
import torch
import torch.nn.functional as F

from genoctx.model.config import ModelConfig
from genoctx.model.moe import MLP, MoE


def _cfg(**kw) -> ModelConfig:
    base = dict(
        d_model=12,
        n_experts=6,
        experts_per_token=2,
        expert_hidden=8,
        shared_experts=1,
        moe_chunk_tokens=4096,
        router_bias_rate=0.01,
        moe_aux_loss_coef=0.0,
        init_std=0.3,
    )
    base.update(kw)
    return ModelConfig(**base)


def _swiglu(x, w1, w3, w2):
    return (F.silu(x @ w1) * (x @ w3)) @ w2


def _reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Slow MoE (DeepSeek-V3 eq. 12-16): a python loop over tokens and their selected experts."""
    B, T, D = x.shape
    rows = []
    for t in range(B * T):
        xt = x.reshape(B * T, D)[t]
        s = torch.sigmoid(moe.router @ xt)  # [E]
        chosen = sorted(range(moe.n_experts), key=lambda e: -(s[e] + moe.expert_bias[e]).item())[: moe.top_k]
        denom = sum(s[e] for e in chosen)
        y = sum((s[e] / denom) * _swiglu(xt, moe.w1[e], moe.w3[e], moe.w2[e]) for e in chosen)
        if moe.shared is not None:
            sh = moe.shared
            y = y + _swiglu(xt, sh.w1.weight.t(), sh.w3.weight.t(), sh.w2.weight.t())
        rows.append(y)
    return torch.stack(rows).view(B, T, D)


def test_mlp_is_swiglu():
    mlp = MLP(6, 10, init_std=0.5)
    x = torch.randn(3, 4, 6)
    ref = _swiglu(x, mlp.w1.weight.t(), mlp.w3.weight.t(), mlp.w2.weight.t())
    torch.testing.assert_close(mlp(x), ref, atol=1e-6, rtol=1e-6)


def test_vectorised_dispatch_matches_token_loop_forward_and_backward():
    moe = MoE(_cfg(moe_chunk_tokens=5))
    with torch.no_grad():
        moe.expert_bias.copy_(torch.randn(6) * 0.3)  # bias changes the selection
    x = torch.randn(2, 9, 12, requires_grad=True)
    g = torch.randn(2, 9, 12)
    y = moe(x)
    grads = torch.autograd.grad((y * g).sum(), [x, *moe.parameters()])

    y_ref = _reference_moe(moe, x)
    grads_ref = torch.autograd.grad((y_ref * g).sum(), [x, *moe.parameters()])
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    names = ["x"] + [n for n, _ in moe.named_parameters()]
    for name, a, r in zip(names, grads, grads_ref, strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5, msg=f"grad of {name}")
    assert grads[names.index("router")].abs().sum() > 0  # the router learns through the gates


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


def test_bias_selects_but_does_not_gate():
    moe = MoE(_cfg())
    x = torch.randn(40, 12)
    experts0, gates0, scores = moe.route(x)
    with torch.no_grad():
        moe.expert_bias[4] = 10.0  # expert 4 always selected
    experts, gates, scores1 = moe.route(x)
    assert torch.equal(scores, scores1)  # bias does not touch the affinities
    assert (experts == 4).any(-1).all()
    assert not torch.equal(experts, experts0)
    # Gates: the selected unbiased affinities, normalised to 1.
    sel = scores.gather(-1, experts)
    torch.testing.assert_close(gates, sel / sel.sum(-1, keepdim=True), atol=0, rtol=0)
    torch.testing.assert_close(gates.sum(-1), torch.ones(40), atol=1e-6, rtol=0)
    # The other selected expert is the best unbiased one among the rest.
    masked = scores.clone()
    masked[:, 4] = -1
    other = experts[experts != 4].view(40)
    assert torch.equal(other, masked.argmax(-1))
    assert not moe.expert_bias.requires_grad and "expert_bias" in moe.state_dict()


def test_tokens_per_expert_and_load_counts_accumulate():
    moe = MoE(_cfg(moe_chunk_tokens=4))
    x = torch.randn(3, 5, 12)
    moe(x)
    c1 = moe.stats["tokens_per_expert"]
    assert c1.dtype == torch.long and c1.shape == (6,) and int(c1.sum()) == 3 * 5 * 2
    experts, _, _ = moe.route(x.view(-1, 12))
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
    moe = MoE(_cfg(router_bias_rate=0.01))
    with torch.no_grad():
        moe.expert_bias[0] = 5.0  # skew: expert 0 takes every token
    moe(torch.randn(2, 16, 12))
    load = moe.load_counts.clone()
    assert load[0] == 32 and int(load.sum()) == 64
    bias_before = moe.expert_bias.clone()
    out = moe.update_bias()
    mean = load.float().mean()
    expected = bias_before + 0.01 * torch.sign(mean - load.float())
    torch.testing.assert_close(moe.expert_bias, expected, atol=0, rtol=0)
    assert moe.expert_bias[0] < bias_before[0]  # over-loaded goes down
    under = load.float() < mean
    assert (moe.expert_bias[under] > bias_before[under]).all()  # under-loaded go up
    assert out["tokens_per_expert"] == load.tolist()
    assert out["load_max_over_mean"] == pytest.approx(32 / mean.item())
    assert int(moe.load_counts.sum()) == 0
    frozen = moe.expert_bias.clone()
    moe.update_bias()  # no tokens since the reset: no change
    assert torch.equal(moe.expert_bias, frozen)


def test_aux_loss_matches_hand_computation():
    coef = 0.3
    moe = MoE(_cfg(moe_aux_loss_coef=coef, moe_chunk_tokens=3))
    B, T, E, k = 2, 5, 6, 2
    x = torch.randn(B, T, 12)
    moe(x)
    total = 0.0
    for b in range(B):
        f = [0.0] * E
        P = [0.0] * E
        for t in range(T):
            s = torch.sigmoid(moe.router @ x[b, t]).tolist()
            biased = [s[e] + moe.expert_bias[e].item() for e in range(E)]
            for e in sorted(range(E), key=lambda e: -biased[e])[:k]:
                f[e] += E / (k * T)
            for e in range(E):
                P[e] += s[e] / sum(s) / T
        total += sum(f[e] * P[e] for e in range(E))
    assert moe.aux_loss is not None
    assert moe.aux_loss.item() == pytest.approx(coef * total / B, rel=1e-5)
    assert MoE(_cfg()).aux_loss is None
    off = MoE(_cfg())
    off(x)
    assert off.aux_loss is None


def test_bad_config_raises():
    with pytest.raises(ValueError):
        MoE(_cfg(n_experts=0, experts_per_token=0))
    with pytest.raises(ValueError):
        MoE(_cfg(moe_chunk_tokens=0))


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
    cfg = _cfg(expert_hidden=64, moe_chunk_tokens=16)
    x = torch.randn(2, 64, 12, requires_grad=True)
    kept = _saved_numel(MoE(cfg, recompute=True), x)
    full = _saved_numel(MoE(cfg, recompute=False), x)
    # With recompute only each chunk's input (and its sequence ids) is saved; the expert activations
    # (hidden width 64 per selected slot) are rebuilt in backward one chunk at a time.
    assert kept <= x.numel() + 2 * 64
    assert full > 10 * kept


def test_bf16_autocast_close_to_fp32():
    moe = MoE(_cfg(moe_chunk_tokens=8))
    x = torch.randn(2, 10, 12)
    y32 = moe(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16 = moe(x)
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.float(), y32, atol=0.05, rtol=0.05)
