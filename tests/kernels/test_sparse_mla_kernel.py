"""The Triton sparse MLA attention (``kernels.sparse_mla``) against the PyTorch path ``genoctx.model.dsa.sparse_mla``:
output, log-sum-exp and both gradients (queries, latent cache), with the atomic and the deterministic backward, at
awkward sizes, in fp32 and fp16, and with offsets past 2^31 elements. Without CUDA the kernels run under
TRITON_INTERPRET=1 (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

import kernels.sparse_mla as ksm
from genoctx.model import dsa

F64 = torch.float64
# fixed tolerances, relative to the largest reference value of each tensor
TOL = {torch.float32: 2e-5, torch.float16: 4e-3}

CASES = {  # B, S (cached positions), T (queries), H, R, kpool, tail, topk tokens
    "pools-tail": (2, 2, 13, 4, 6, 4, True, 12),  # R, T and widths (15 slots) not multiples of any block
    "tokens": (2, 3, 11, 3, 20, 1, False, 7),  # pools of one token: plain token indices
    "pools-no-tail": (2, 1, 12, 2, 16, 4, False, 8),  # first queries select nothing: o = 0, lse = 0
    "few-pools": (1, 14, 12, 17, 8, 16, True, 32),  # top-2 pools, at most one visible; 31 slots; 17 heads
}


def _selection(B, S, T, kpool, tail, topk, device) -> dsa.DSASelection:
    """The DSA layer's selection: the PyTorch indexer over random pooled keys, then pools + tail."""
    pos = torch.arange(S, S + T, device=device)
    P = (S + T) // kpool
    K = min(topk // kpool, P)
    iq, iw, pk = torch.randn(B, T, 3, 5), torch.randn(B, T, 3), torch.randn(B, P, 5)
    if K > 0:
        pools = dsa.indexer_topk(iq, iw, pk, (pos.cpu() + 1) // kpool, K, 64, torch.int32).to(device)
    else:
        pools = torch.full((B, T, 0), -1, dtype=torch.int32, device=device)
    return dsa.DSASelection(pools, pos, kpool, tail)


def _reference(q, kv, sel, scale, do):
    """The PyTorch path in fp64 on the same values: o, lse (from the selected tokens' logits), dq, dkv."""
    q64 = q.detach().to(F64).requires_grad_()
    kv64 = kv.detach().to(F64).requires_grad_()
    o = dsa.sparse_mla(q64, kv64, sel, scale)
    dq, dkv = torch.autograd.grad(o, (q64, kv64), do.to(F64))
    tok = sel.tokens()
    ks = kv64.detach()[torch.arange(q.shape[0], device=q.device)[:, None, None], tok.clamp_min(0)]  # [B, T, W, R]
    s = torch.einsum("bthr,btkr->bthk", q64.detach(), ks) * scale
    lse = s.masked_fill(tok[:, :, None, :] < 0, float("-inf")).logsumexp(-1)
    return o.detach(), lse.nan_to_num(neginf=0.0), dq, dkv


def _close(got, want, dtype, what):
    atol = TOL[dtype] * max(float(want.abs().max()), 1e-3)
    torch.testing.assert_close(got.to(F64), want, rtol=TOL[dtype], atol=atol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_backward_match_torch_path(case, dtype, device):
    """``sparse_mla`` (the op ``genoctx::sparse_mla_fwd`` and its autograd formula): o, lse, dq and dkv (cached
    latents included) equal the PyTorch path within fixed tolerances, with the atomic backward and (fp32) the
    deterministic one; queries with nothing selected get exactly 0 and so do latents nobody selected."""
    B, S, T, H, R, kpool, tail, topk = CASES[case]
    sel = _selection(B, S, T, kpool, tail, topk, device)
    q = torch.randn(B, T, H, R, device=device).to(dtype).requires_grad_()
    kv = torch.randn(B, S + T, R, device=device).to(dtype).requires_grad_()
    do = torch.randn(B, T, H, R, device=device).to(dtype)
    scale = R**-0.5
    o_ref, lse_ref, dq_ref, dkv_ref = _reference(q, kv, sel, scale, do)

    o = ksm.sparse_mla(q, kv, sel, scale)
    dq, dkv = torch.autograd.grad(o, (q, kv), do)
    assert o.dtype == dq.dtype == dkv.dtype == dtype
    o2, lse = ksm.sparse_mla_fwd(q.detach(), kv.detach(), sel.pools, sel.pos, kpool, tail, scale)
    assert torch.equal(o2, o)
    for got, want, what in ((o, o_ref, "o"), (lse, lse_ref, "lse"), (dq, dq_ref, "dq"), (dkv, dkv_ref, "dkv")):
        _close(got, want, dtype, what)

    dkv_d = dkv
    if dtype == torch.float32:  # the deterministic backward (in one dtype: the interpreter is slow)
        dq_d, dkv_d = ksm.sparse_mla_bwd(
            q.detach(), kv.detach(), sel.pools, sel.pos, kpool, tail, scale, o2, lse, do, deterministic=True
        )
        _close(dq_d, dq_ref, dtype, "dq (deterministic)")
        _close(dkv_d, dkv_ref, dtype, "dkv (deterministic)")

    keep = sel.tokens() >= 0  # [B, T, W]
    empty = ~keep.any(-1)
    assert bool((o[empty] == 0).all()) and bool((lse[empty] == 0).all()) and bool((dq[empty] == 0).all())
    chosen = torch.zeros(B, S + T, dtype=torch.bool, device=device)
    chosen[torch.arange(B, device=device)[:, None, None].expand_as(keep)[keep], sel.tokens()[keep]] = True
    assert bool((dkv[~chosen] == 0).all()) and bool((dkv_d[~chosen] == 0).all())
    if case == "pools-no-tail":
        assert bool(empty.any())


def test_deterministic_backward_is_bitwise_repeatable(device):
    """The atomic-free backward gives the same bits twice and agrees with the atomic one to fp32 rounding."""
    B, S, T, H, R = 2, 4, 9, 3, 12
    sel = _selection(B, S, T, 4, True, 12, device)
    q, kv, do = torch.randn(B, T, H, R, device=device), torch.randn(B, S + T, R, device=device), torch.randn(B, T, H, R)
    do = do.to(device)
    o, lse = ksm.sparse_mla_fwd(q, kv, sel.pools, sel.pos, 4, True, 0.3)
    args = (q, kv, sel.pools, sel.pos, 4, True, 0.3, o, lse, do)
    a = ksm.sparse_mla_bwd(*args, deterministic=True)
    b = ksm.sparse_mla_bwd(*args, deterministic=True)
    c = ksm.sparse_mla_bwd(*args, deterministic=False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    torch.testing.assert_close(a[1], c[1], rtol=1e-5, atol=1e-6)


def test_mixed_dtypes_as_under_autocast(device):
    """Under bf16 autocast the layer's queries are half and its latents fp32: products run in the queries' dtype,
    dkv comes back fp32. Checked with fp16 queries against the PyTorch path."""
    B, S, T, H, R = 1, 0, 16, 2, 16
    sel = _selection(B, S, T, 4, True, 8, device)
    q = torch.randn(B, T, H, R, device=device).half().requires_grad_()
    kv = torch.randn(B, T, R, device=device, requires_grad=True)
    do = torch.randn(B, T, H, R, device=device).half()
    o_ref, _, dq_ref, dkv_ref = _reference(q, kv, sel, 0.25, do)
    o = ksm.sparse_mla(q, kv, sel, 0.25)
    dq, dkv = torch.autograd.grad(o, (q, kv), do)
    assert o.dtype == dq.dtype == torch.float16 and dkv.dtype == torch.float32
    for got, want, what in ((o, o_ref, "o"), (dq, dq_ref, "dq"), (dkv, dkv_ref, "dkv")):
        _close(got, want, torch.float16, what)


@pytest.mark.parametrize("kpool,tail", [(2, True), (1, False)])
def test_offsets_past_2_31_elements(huge, device, kpool, tail):
    """q, kv, do, o and dq as views whose element offsets pass 2^31 (sparse memory-mapped files): forward, atomic
    and deterministic backward give the same bits as on compact copies (pools with a tail, and plain tokens)."""
    if device != "cpu":
        pytest.skip("the sparse-file views are CPU memory")
    B, S, T, H, R = 1, 2, 6, 2, 16
    sel = _selection(B, S, T, kpool, tail, 4, device)
    q, kv, do = torch.randn(B, T, H, R).half(), torch.randn(B, S + T, R).half(), torch.randn(B, T, H, R).half()
    st_q, st_kv = 2**29 + 3, 2**29 + 7
    qh, doh = huge(q, (T * st_q, st_q, R, 1)), huge(do, (T * st_q, st_q, R, 1))
    kvh = huge(kv, ((S + T) * st_kv, st_kv, 1))
    oh, dqh = huge(torch.zeros_like(q), (T * st_q, st_q, R, 1)), huge(torch.zeros_like(q), (T * st_q, st_q, R, 1))
    assert (T - 1) * st_q > 2**31 and (S + T - 1) * st_kv > 2**31
    args = (sel.pools, sel.pos, kpool, tail, 0.3)
    o, lse = ksm.sparse_mla_fwd(q, kv, *args)
    ksm.sparse_mla_fwd(qh, kvh, *args, o=oh)
    assert torch.equal(oh, o)
    for det in (False, True):
        dq, dkv = ksm.sparse_mla_bwd(q, kv, *args, o, lse, do, deterministic=det)
        _, dkv_h = ksm.sparse_mla_bwd(qh, kvh, *args, oh, lse, doh, deterministic=det, dq=dqh)
        assert torch.equal(dqh, dq) and torch.equal(dkv_h, dkv)


def test_raises():
    sel = _selection(1, 0, 8, 4, True, 8, "cpu")
    q, kv = torch.randn(1, 8, 2, 4), torch.randn(1, 8, 4)
    with pytest.raises(ValueError, match="bad shapes"):
        ksm.sparse_mla(q, kv[:, :, :3], sel, 0.5)
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        ksm.sparse_mla(q.double(), kv.double(), sel, 0.5)
