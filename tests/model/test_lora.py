"""LoRA adapters (genoctx.model.lora, issue 44): exact against the merged weights W + s B A, forward and backward,
the routed experts included; fresh adapters change nothing; merge; counts; peft 0.21's expert layout."""

import copy
import math

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call

from genoctx.model.config import preset
from genoctx.model.lora import (
    DEFAULT_TARGETS,
    LoRALinear,
    apply_lora,
    expert_delta,
    from_peft_experts,
    is_lora_name,
    lora_parameters,
    merge_lora,
    merged_parameters,
    reset_lora,
    to_peft_experts,
)
from genoctx.model.model import HybridLM, cast_model
from genoctx.model.moe import Experts, MoE

RANK, ALPHA = 3, 6.0
TOL = dict(rtol=1e-9, atol=1e-12)


def _model():
    cfg = preset("tiny")
    model = cast_model(HybridLM(cfg, seed=0), torch.float64)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    return model, tokens


def _randomize_b(model, seed=2):
    """Nonzero B (and A redrawn) so the adapters matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)


def _check_against_merged(model, run, inp):
    """``run(module, params_or_None, inp)`` -> output. The LoRA model's output and the gradients of every parameter
    (adapters, base) and of a float input equal autograd through ``merged = W + s B A`` on the merged module."""
    ref = merge_lora(copy.deepcopy(model))  # the same module without adapters (its adapted weights overridden below)
    with torch.no_grad():
        weight = torch.randn_like(run(model, None, inp), generator=torch.Generator().manual_seed(3))
    leaves = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    ref_inp = inp.detach().clone().requires_grad_() if inp.is_floating_point() else inp
    overrides = merged_parameters(model, leaves)
    params = {n: overrides.get(n, leaves[n]) for n, _ in ref.named_parameters()}
    y_ref = run(ref, params, ref_inp)
    (y_ref * weight).sum().backward()

    if inp.is_floating_point():
        inp.requires_grad_()
    y = run(model, None, inp)
    (y * weight).sum().backward()
    torch.testing.assert_close(y, y_ref, **TOL)
    names = [n for n, p in model.named_parameters() if p.grad is not None or leaves[n].grad is not None]
    assert any("experts.gate_up_proj_lora_A" in n for n in names) and any("kv_b_proj.lora_B" in n for n in names)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, leaves[n].grad, **TOL, msg=lambda m, n=n: f"{n}: {m}")
    if inp.is_floating_point():
        torch.testing.assert_close(inp.grad, ref_inp.grad, **TOL)
    return y


def _hf(model, params, tokens):
    return (model(tokens) if params is None else functional_call(model, params, (tokens,)))[0]


def test_fresh_adapters_leave_the_output_bit_identical():
    model, tokens = _model()
    with torch.no_grad():
        before = model(tokens)[0]
    adapted = apply_lora(model, RANK, ALPHA, seed=0)
    assert "layers.1.self_attn.kv_b_proj" in adapted and "layers.1.mlp.experts.gate_up_proj" in adapted
    lora = lora_parameters(model)
    assert all(not p.any() for n, p in lora.items() if n.endswith("lora_B"))
    assert all(p.abs().max() > 0 for n, p in lora.items() if n.endswith("lora_A"))
    with torch.no_grad():
        after = model(tokens)[0]
    assert torch.equal(after, before)


def test_lora_forward_and_gradients_equal_the_merged_formulation_experts_included():
    model, tokens = _model()
    apply_lora(model, RANK, ALPHA, seed=0)
    _randomize_b(model)
    _check_against_merged(model, _hf, tokens)
    hit = model.layers[1].mlp.stats["tokens_per_expert"]
    assert int((hit > 0).sum()) >= 3  # several experts ran their adapters


def test_moe_layer_input_gradient_equals_the_merged_formulation():
    cfg = preset("tiny")
    torch.manual_seed(0)
    moe = MoE(cfg).double()
    apply_lora(moe, RANK, ALPHA, targets="experts.gate_up_proj,experts.down_proj,up_proj,down_proj", seed=0)
    assert isinstance(moe.shared_experts.up_proj, LoRALinear) and type(moe.shared_experts.gate_proj) is nn.Linear
    _randomize_b(moe)
    x = torch.randn(2, 20, cfg.hidden_size, dtype=torch.float64)

    def run(m, params, inp):
        return m(inp) if params is None else functional_call(m, params, (inp,))

    weight = torch.randn(2, 20, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ref = merge_lora(copy.deepcopy(moe))
    leaves = {n: p.detach().clone().requires_grad_() for n, p in moe.named_parameters()}
    overrides = merged_parameters(moe, leaves)
    params = {n: overrides.get(n, leaves[n]) for n, _ in ref.named_parameters()}
    xr = x.clone().requires_grad_()
    y_ref = run(ref, params, xr)
    (y_ref * weight).sum().backward()
    xl = x.clone().requires_grad_()
    y = run(moe, None, xl)
    (y * weight).sum().backward()
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(xl.grad, xr.grad, **TOL)
    for n, p in moe.named_parameters():
        torch.testing.assert_close(p.grad, leaves[n].grad, **TOL, msg=lambda m, n=n: f"{n}: {m}")
    assert moe.experts.down_proj_lora_B.grad.abs().sum() > 0
    assert int((moe.stats["tokens_per_expert"] > 0).sum()) >= 3


def test_merge_then_forward_equals_the_lora_forward():
    model, tokens = _model()
    apply_lora(model, RANK, ALPHA, seed=0)
    _randomize_b(model)
    with torch.no_grad():
        y = model(tokens)[0]
        merged = merge_lora(copy.deepcopy(model))
        assert not any(is_lora_name(n) for n, _ in merged.named_parameters())
        assert not any(isinstance(m, LoRALinear) for m in merged.modules())
        assert [n for n, _ in merged.named_parameters()] == [
            n for n, _ in HybridLM(preset("tiny"), 0).named_parameters()
        ]
        torch.testing.assert_close(merged(tokens)[0], y, **TOL)
        assert not torch.allclose(merged(tokens)[0], _model()[0](tokens)[0])  # the adapters did change the model


def test_adapter_count_is_r_times_in_plus_out_per_target_and_per_expert():
    base, _ = _model()
    want = 0
    for path, mod in base.named_modules():
        if type(mod) is nn.Linear and path.rsplit(".", 1)[-1] in DEFAULT_TARGETS:
            want += RANK * (mod.in_features + mod.out_features)
        if isinstance(mod, Experts):
            E, D, I = mod.n_experts, mod.hidden_size, mod.intermediate_size
            want += E * RANK * (D + 2 * I) + E * RANK * (I + D)
    apply_lora(base, RANK, ALPHA, seed=0)
    assert sum(p.numel() for p in lora_parameters(base).values()) == want > 0


def test_expert_layout_matches_peft_param_wrapper():
    """peft 0.21 ParamWrapper on [E, out, in] without is_transposed: A.weight [E·r, in], B.weight [out, r·E] and
    delta = scaling · einsum("o r e, e r i -> e o i", B.reshape(out, r, E), A.reshape(E, r, in))."""
    E, r, out, inp, s = 4, 3, 10, 7, 2.0
    g = torch.Generator().manual_seed(0)
    a, b = (
        torch.randn(E, r, inp, generator=g, dtype=torch.float64),
        torch.randn(E, out, r, generator=g, dtype=torch.float64),
    )
    pa, pb = to_peft_experts(a, b)
    assert pa.shape == (E * r, inp) and pb.shape == (out, r * E)
    peft_delta = torch.einsum("o r e, e r i -> e o i", pb.reshape(out, r, E), pa.reshape(E, r, inp)) * s
    torch.testing.assert_close(expert_delta(a, b, s, torch.float64), peft_delta, **TOL)
    a2, b2 = from_peft_experts(pa, pb, E)
    assert torch.equal(a2, a) and torch.equal(b2, b)


def test_init_as_peft_and_errors():
    model, _ = _model()
    apply_lora(model, RANK, ALPHA, seed=0)
    ex = model.layers[1].mlp.experts
    bound = 1 / math.sqrt(ex.hidden_size)  # kaiming-uniform(a=√5), fan-in D
    a = ex.gate_up_proj_lora_A
    assert a.abs().max() <= bound and a.abs().max() > 0.8 * bound and ex.lora_scale == ALPHA / RANK
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, RANK, ALPHA)
    with pytest.raises(ValueError, match="match no"):
        apply_lora(_model()[0], RANK, ALPHA, targets=["q_proj", "nope_proj"])
    from genoctx.parallel.experts import apply_ep

    split = _model()[0]
    apply_ep(split, None, 1, 0)  # adapters go on before expert parallelism (which splits them with the experts)
    with pytest.raises(ValueError, match="before expert parallelism"):
        apply_lora(split, RANK, ALPHA)


def test_meta_built_adapters_redrawn_by_reset_lora_equal_a_direct_apply():
    cfg = preset("tiny")
    direct = HybridLM(cfg, seed=0)
    apply_lora(direct, RANK, ALPHA, seed=5)
    with torch.device("meta"):
        meta = HybridLM(cfg, seed=0)
    apply_lora(meta, RANK, ALPHA, seed=5)
    meta.materialize("cpu")
    reset_lora(meta, seed=5)
    got, want = lora_parameters(meta), lora_parameters(direct)
    assert list(got) == list(want)
    assert all(torch.equal(got[n], want[n]) for n in want)
