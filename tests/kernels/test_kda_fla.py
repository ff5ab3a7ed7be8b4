"""fla-core's KDA with GLM-5.3-Flash's forget gate: the argument mapping ``genoctx.model.kda.fla_gate_kwargs`` against
fla's naive references (``fla.ops.kda.gate.naive_kda_lowerbound_gate`` / ``naive_kda_gate``,
``fla.ops.kda.naive.naive_recurrent_kda`` / ``naive_chunk_kda``), fla's Triton ``fused_recurrent_kda`` (the same gate
arguments, fused in the kernel; under TRITON_INTERPRET=1 without CUDA) and our ``chunk_kda``. fla's ``chunk_kda``
itself runs only on CUDA (under the interpreter a loop index of its kernels is a Python int), so it is checked only
when CUDA is present (here and in ``bench/gpu_check.sh``'s ``mesh`` section); on the CPU, the call genoctx makes
(``genoctx.model.kda.fla_chunk_kda``) goes through fla's own ``chunk_kda`` argument checks with a stand-in for its
kernels (fla's naive recurrent form), as training calls it: bf16 q/k/v, a carried initial state, the backward."""

from __future__ import annotations

import pytest
import torch

from genoctx.errors import GenoctxError
from genoctx.model import kda
from genoctx.model.config import preset
from genoctx.model.kda import ForgetGate, KDACache, KimiDeltaAttention, chunk_kda, fla_gate_kwargs

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
    assert fla_gate_kwargs(gate) == ({"safe_gate": True, "lower_bound": -5.0} if lower_bound == -5.0 else {})
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


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _stand_in_kernels(calls: list):
    """A stand-in for fla's ``ChunkKDAFunction`` (its Triton kernels, CUDA only): records the arguments that passed
    fla's own checks in ``fla.ops.kda.chunk_kda``, checks what its kernels need beyond them, and computes with fla's
    naive recurrent form (CPU, differentiable), returning ``o`` in q's dtype and the fp32 state as fla does."""
    import inspect

    from fla.ops.kda.chunk import ChunkKDAFunction

    sig = inspect.signature(ChunkKDAFunction.forward)

    class StandIn:
        @staticmethod
        def apply(*args):
            a = sig.bind(None, *args).arguments
            calls.append(a)
            q, k, v, g, beta, h0 = (a[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
            assert q.dtype == k.dtype == v.dtype, "fla's tl.dot of q/k with v tiles needs one dtype"
            if a["safe_gate"] and not a["use_gate_in_kernel"]:  # fla: "the caller must provide bounded gates"
                assert a["lower_bound"] is not None and -5 <= a["lower_bound"] < 0
                assert bool((g >= a["lower_bound"]).all() and (g <= 0).all())
            if not a["use_qk_l2norm_in_kernel"]:
                torch.testing.assert_close(q.float().norm(dim=-1), torch.ones(q.shape[:-1]), rtol=0, atol=1e-2)
            if not a["use_beta_sigmoid_in_kernel"]:
                assert bool(((beta >= 0) & (beta <= 1)).all())
            o, s = fla_naive.naive_recurrent_kda(q, k, v, g, beta, scale=a["scale"], initial_state=h0,
                                                 output_final_state=a["output_final_state"])  # fmt: skip
            return o.to(q.dtype), s

    return StandIn


def _run_two_chunks(layer, x, split, w):
    """The layer on ``x[:, :split]`` then ``x[:, split:]`` under CPU bf16 autocast, the carried state handed over
    in bf16 (as an FSDP2 ``MixedPrecisionPolicy`` that casts forward inputs hands a dataclass cache to a block);
    returns both outputs, the final state and the gradients of a weighted sum of them."""
    params = [p for p in layer.parameters()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y1, c1 = layer(x[:, :split])
        carried = KDACache(state=c1.state.bfloat16(), conv_state=c1.conv_state)
        y2, c2 = layer(x[:, split:], carried)
    loss = (y1.float() * w[0][:, :split]).sum() + (y2.float() * w[0][:, split:]).sum() + (c2.state * w[1]).sum()
    return y1, y2, c2.state, torch.autograd.grad(loss, params)


def test_layer_calls_fla_as_fla_documents_and_matches_the_torch_core(monkeypatch):
    """``kda_kernel: fla`` as training calls it (bf16 autocast, two chunks with the state carried in bf16, the
    backward), on the CPU: fla's ``chunk_kda`` checks the call (an initial state that is not fp32 fails there) and a
    stand-in for its kernels computes; q, k, v reach fla in bf16, g, beta and the state in fp32, with safe_gate and
    its lower bound, scale K^-1/2 and no cu_seqlens; outputs, final state and every gradient match our torch core on
    the same input to bf16 precision (fla gets q, k rounded to bf16, ours keeps them fp32)."""
    from fla.ops.kda import chunk as fla_chunk

    calls: list = []
    monkeypatch.setattr(kda, "FLA_DEVICES", ("cpu",))
    monkeypatch.setattr(fla_chunk, "ChunkKDAFunction", _stand_in_kernels(calls))
    cfg = _cfg(-5.0)
    ours = KimiDeltaAttention(cfg)
    with torch.no_grad():
        ours.forget_gate.A_log.normal_(0.0, 0.5)
    theirs = KimiDeltaAttention(cfg, use_fla=True)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 37, 24)
    w = (torch.randn(2, 37, 24), torch.randn(2, 2, 16, 16))
    want = _run_two_chunks(ours, x, 20, w)
    got = _run_two_chunks(theirs, x, 20, w)
    assert theirs.stats["path"] == "fla" and ours.stats["path"] == "chunk"
    assert len(calls) == 2  # one per chunk (fla's backward recomputes inside its own autograd Function)
    for a, h0 in zip(calls, (None, torch.float32), strict=True):
        assert (a["q"].dtype, a["k"].dtype, a["v"].dtype) == (torch.bfloat16,) * 3
        assert (a["g"].dtype, a["beta"].dtype) == (torch.float32, torch.float32)
        assert (None if a["initial_state"] is None else a["initial_state"].dtype) == h0
        assert a["safe_gate"] and a["lower_bound"] == -5.0 and not a["use_gate_in_kernel"]
        assert a["output_final_state"] and a["cu_seqlens"] is None and a["cp_context"] is None
        assert a["scale"] == 16**-0.5 and a["chunk_size"] == 64 and not a["state_v_first"]
    for name, a, b in zip(("y1", "y2", "state"), got[:3], want[:3], strict=True):
        assert _rel(a, b) < 2e-2, (name, _rel(a, b))
    assert got[2].dtype == torch.float32
    names = [n for n, _ in ours.named_parameters()]
    for n, a, b in zip(names, got[3], want[3], strict=True):
        assert _rel(a, b) < 5e-2, (n, _rel(a, b))


def test_torch_core_on_fla_shaped_inputs_matches_fla_naive_forward_and_backward():
    """What ``fla_chunk_kda`` hands fla (q, k, v bf16; g, beta, initial state fp32), given to our ``chunk_kda``:
    outputs, final state and the gradients of q, k, v, g, beta and the initial state equal fla's naive recurrent
    form's (both compute in fp32 from the same bf16 inputs)."""
    _, (q, k, v, g, beta), _ = _core_inputs(-5.0, T=37)
    q, k, v = kda.fla_core_inputs(q, k, v.bfloat16())
    h0 = torch.randn(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
    do, ds = torch.randn(v.shape), torch.randn(h0.shape)
    res = []
    ours = lambda *a: chunk_kda(*a[:5], initial_state=a[5], chunk_size=16)  # noqa: E731
    naive = lambda *a: fla_naive.naive_recurrent_kda(*a[:5], initial_state=a[5], output_final_state=True)  # noqa: E731
    for fn in (ours, naive):
        o, s = fn(*inputs)
        assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
        res.append((o, s, torch.autograd.grad((o.float() * do).sum() + (s * ds).sum(), inputs)))
    (o, s, grads), (o_f, s_f, grads_f) = res
    assert _rel(o, o_f) < 1e-2  # one bf16 rounding of each output
    torch.testing.assert_close(s, s_f, **TOL)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "h0"), grads, grads_f, strict=True):
        assert a.dtype == b.dtype, name
        assert _rel(a, b) < (1e-2 if a.dtype == torch.bfloat16 else 1e-4), (name, _rel(a, b))


def test_safe_gate_stays_in_fla_bounds_at_saturation():
    """fla's safe-gate kernels take precomputed gates in ``[lower_bound, 0]`` with ``lower_bound >= -5`` (its
    diagonal-block exponentials stay within fp32 only then): our gate stays there even where its sigmoid saturates."""
    gate = _gate(-5.0)
    with torch.no_grad():
        g = gate(torch.randn(2, 11, 24) * 1e4)
    assert bool((g >= -5.0).all() and (g <= 0).all()) and float(g.min()) == -5.0


def test_fla_path_refuses_fp64(monkeypatch):
    """fla's kernels take bf16, fp16 or fp32: an fp64 run with ``kda_kernel: fla`` is one error, not a crash inside
    fla."""
    monkeypatch.setattr(kda, "FLA_DEVICES", ("cpu",))
    layer = KimiDeltaAttention(_cfg(-5.0), use_fla=True).double()
    with pytest.raises(GenoctxError, match="fp64|float64"):
        layer(torch.randn(1, 5, 24, dtype=torch.float64))
