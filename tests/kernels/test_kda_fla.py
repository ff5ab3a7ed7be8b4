"""fla-core's KDA with GLM-5.3-Flash's forget gate: the argument mapping ``genoctx.model.kda.fla_gate_kwargs`` against
fla's naive references (``fla.ops.kda.gate.naive_kda_lowerbound_gate`` / ``naive_kda_gate``,
``fla.ops.kda.naive.naive_recurrent_kda`` / ``naive_chunk_kda``), fla's Triton ``fused_recurrent_kda`` (the same gate
arguments, fused in the kernel; under TRITON_INTERPRET=1 without CUDA) and our ``chunk_kda``. fla's ``chunk_kda``
itself runs only on CUDA (under the interpreter a loop index of its kernels is a Python int), so it is checked only
when CUDA is present."""

from __future__ import annotations

import pytest
import torch

from genoctx.model.config import preset
from genoctx.model.kda import ForgetGate, KimiDeltaAttention, chunk_kda, fla_gate_kwargs

fla_gate = pytest.importorskip("fla.ops.kda.gate")
fla_naive = pytest.importorskip("fla.ops.kda.naive")

TOL = dict(rtol=1e-5, atol=1e-5)
BOUNDS = [-5.0, None, -8.0]  # GLM-5.3-Flash's safe gate; the softplus gate; a bound outside fla's safe range


def _cfg(lower_bound):
    return preset("tiny", hidden_size=24, linear_num_heads=2, linear_head_dim=16, linear_lower_bound=lower_bound)


def _gate(lower_bound) -> ForgetGate:
    gate = ForgetGate(_cfg(lower_bound))
    gate.reset_parameters(0.3)
    with torch.no_grad():
        gate.A_log.normal_(0.0, 0.5)  # not the init's 0: exp(A_log) must reach the gate
    return gate


def _fla_gate(kw: dict) -> torch.Tensor:
    """fla's naive gate with the mapped arguments."""
    if kw["lower_bound"] is None:
        return fla_gate.naive_kda_gate(kw["g"], kw["A_log"], kw["dt_bias"])
    return fla_gate.naive_kda_lowerbound_gate(kw["g"], kw["A_log"], kw["dt_bias"], lower_bound=kw["lower_bound"])


@pytest.mark.parametrize("lower_bound", BOUNDS)
def test_gate_mapping_matches_fla_naive_gate(lower_bound):
    """fla's gate on ``fla_gate_kwargs(gate, gate.pre_activation(x))`` is our ``ForgetGate(x)``, value and gradients
    (A_log, dt_bias, the projections); ``safe_gate`` only where fla allows it (bound in [-5, 0))."""
    gate = _gate(lower_bound)
    x = torch.randn(2, 11, 24)
    g = gate(x)
    kw = fla_gate_kwargs(gate, gate.pre_activation(x))
    assert kw["use_gate_in_kernel"] and kw["lower_bound"] == lower_bound
    assert kw.get("safe_gate", False) == (lower_bound == -5.0)
    assert fla_gate_kwargs(gate) == ({"safe_gate": True} if lower_bound == -5.0 else {})
    g_fla = _fla_gate(kw)
    torch.testing.assert_close(g_fla, g, rtol=1e-6, atol=1e-6)
    if lower_bound is not None:
        assert bool((g > lower_bound).all() and (g < 0).all())
    params = [gate.A_log, gate.dt_bias, gate.f_a_proj.weight, gate.f_b_proj.weight]
    dg = torch.randn_like(g)
    for a, b in zip(torch.autograd.grad(g, params, dg), torch.autograd.grad(g_fla, params, dg), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _core_inputs(lower_bound, B=2, T=37):
    """q, k, v, g, beta of a KDA layer (the layer's own projections, conv, norms and gate) and its raw gate."""
    layer = KimiDeltaAttention(_cfg(lower_bound))
    with torch.no_grad():
        layer.forget_gate.A_log.normal_(0.0, 0.5)
    x = torch.randn(B, T, 24)
    with torch.no_grad():
        q, k, v, g, beta, _ = layer.project(x)
        raw = layer.forget_gate.pre_activation(x)
    return layer.forget_gate, (q, k, v.float(), g, beta), raw


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_fla_naive_kda_on_our_gate_matches_chunk_kda(lower_bound):
    """With our precomputed g, fla's naive recurrent form (T = 37) and naive chunked form (T = 48, chunks of 16) give
    our chunk_kda's outputs and final states, from a non-zero initial state."""
    for T, form in ((37, "recurrent"), (48, "chunk")):
        _, (q, k, v, g, beta), _ = _core_inputs(lower_bound, T=T)
        h0 = torch.randn(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
        o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, chunk_size=16)
        if form == "recurrent":
            o_f, s_f = fla_naive.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        else:
            o_f, s_f = fla_naive.naive_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                 chunk_size=16)  # fmt: skip
        torch.testing.assert_close(o_f, o, **TOL)
        torch.testing.assert_close(s_f, s, **TOL)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_fla_triton_fused_gate_matches_chunk_kda(lower_bound, device):
    """fla's Triton ``fused_recurrent_kda`` computing the gate in its kernel from ``fla_gate_kwargs(gate, raw)`` gives
    our chunk_kda on our gate (under the interpreter without CUDA)."""
    fused = pytest.importorskip("fla.ops.kda").fused_recurrent_kda
    gate, (q, k, v, g, beta), raw = _core_inputs(lower_bound, B=1, T=21)
    o, s = chunk_kda(q, k, v, g, beta, chunk_size=16)
    kw = fla_gate_kwargs(gate, raw)
    kw = {n: (t.detach().to(device) if torch.is_tensor(t) else t) for n, t in kw.items()}
    o_f, s_f = fused(q.to(device), k.to(device), v.to(device), beta=beta.to(device), output_final_state=True, **kw)
    torch.testing.assert_close(o_f.cpu(), o, **TOL)
    torch.testing.assert_close(s_f.cpu(), s, **TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's chunk_kda runs on CUDA only")
@pytest.mark.parametrize("fused_gate", [False, True])
def test_fla_chunk_kda_on_cuda(fused_gate):
    """On CUDA: fla's ``chunk_kda`` with either mapping (our g with ``safe_gate``, or the gate in its kernel) gives our
    chunk_kda (GLM-5.3-Flash's lower bound -5)."""
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    gate, (q, k, v, g, beta), raw = _core_inputs(-5.0, T=100)
    o, s = chunk_kda(q, k, v, g, beta)
    kw = fla_gate_kwargs(gate, raw) if fused_gate else {"g": g, **fla_gate_kwargs(gate)}
    kw = {n: (t.detach().cuda() if torch.is_tensor(t) else t) for n, t in kw.items()}
    o_f, s_f = fla_chunk_kda(q.cuda(), k.cuda(), v.cuda(), beta=beta.cuda(), output_final_state=True, **kw)
    torch.testing.assert_close(o_f.cpu(), o, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(s_f.cpu(), s, rtol=2e-3, atol=2e-3)


def test_fla_core_inputs_one_dtype():
    """fla's kernels need q, k and v in one dtype (``tl.dot`` of q/k with v tiles): project's fp32 q, k and the
    compute dtype's v (bf16 under autocast) go to fla as v's dtype; an fp32 run is unchanged."""
    from genoctx.model.kda import fla_core_inputs

    q, k = torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)
    v = torch.randn(1, 5, 2, 8).bfloat16()
    q2, k2, v2 = fla_core_inputs(q, k, v)
    assert (q2.dtype, k2.dtype, v2.dtype) == (torch.bfloat16,) * 3 and v2 is v
    assert torch.equal(q2, q.bfloat16()) and torch.equal(k2, k.bfloat16())
    q3, k3, v3 = fla_core_inputs(q, k, v.float())
    assert q3 is q and k3 is k and v3.dtype == torch.float32
