"""mHC hyper-connections: Sinkhorn-Knopp, n = 1 == plain residual, loop reference, gradcheck."""

import pytest
import torch
from torch.func import functional_call

from genoctx.model.hyper import HyperConnection, expand_streams, reduce_streams, sinkhorn_knopp

ATOL = 1e-5


def _randomise(hc: HyperConnection, scale: float = 1.0) -> HyperConnection:
    """Move parameters away from init so every coefficient depends on the input."""
    with torch.no_grad():
        for p in hc.parameters():
            p.add_(torch.randn_like(p) * scale)
        hc.alpha_pre.fill_(0.7)
        hc.alpha_post.fill_(-0.4)
        hc.alpha_res.fill_(0.9)
    return hc


def _sinkhorn_loop(m: torch.Tensor, iters: int) -> torch.Tensor:
    """Plain (not log-space) Sinkhorn on one [n, n] matrix: exp, then alternate row / column division."""
    p = m.exp()
    n = p.shape[0]
    for _ in range(iters):
        p = torch.stack([p[i] / sum(p[i, j] for j in range(n)) for i in range(n)])
        p = torch.stack([p[:, j] / sum(p[i, j] for i in range(n)) for j in range(n)], dim=1)
    return p


def _reference(hc: HyperConnection, x: torch.Tensor, f_out: torch.Tensor):
    """Slow mHC (arXiv:2512.24880 eq. 7-8) with explicit loops over tokens and streams.

    Returns (h [B, T, D], next streams [B, T, n, D], H_res [B, T, n, n]).
    """
    B, T, n, D = x.shape
    phi = hc.phi
    h = torch.zeros(B, T, D, dtype=x.dtype)
    out = torch.zeros_like(x)
    hres_all = torch.zeros(B, T, n, n, dtype=x.dtype)
    for b in range(B):
        for t in range(T):
            v = torch.cat([x[b, t, i] for i in range(n)])  # vec(x_l), [n*D]
            v = v / torch.sqrt((v * v).mean() + hc.eps)  # RMSNorm without weight
            proj = phi @ v
            pre = torch.sigmoid(hc.alpha_pre * proj[:n] + hc.b_pre)
            post = 2 * torch.sigmoid(hc.alpha_post * proj[n : 2 * n] + hc.b_post)
            hres = _sinkhorn_loop(hc.alpha_res * proj[2 * n :].view(n, n) + hc.b_res, hc.sinkhorn_iters)
            hres_all[b, t] = hres
            hb = sum(pre[i] * x[b, t, i] for i in range(n))
            h[b, t] = hb
            for i in range(n):
                out[b, t, i] = sum(hres[i, j] * x[b, t, j] for j in range(n)) + post[i] * f_out[b, t]
    return h, out, hres_all


def test_sinkhorn_doubly_stochastic_and_matches_plain_loop():
    logits = torch.randn(6, 4, 4)  # unit-scale logits (mHC's are near b_res, with α = 0.01 at init)
    p = sinkhorn_knopp(logits, 20)
    assert (p >= 0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(6, 4), atol=1e-3, rtol=0)
    torch.testing.assert_close(p.sum(-2), torch.ones(6, 4), atol=1e-5, rtol=0)
    ref = torch.stack([_sinkhorn_loop(m.double(), 20) for m in logits]).float()
    torch.testing.assert_close(p, ref, atol=1e-5, rtol=1e-5)


def test_sinkhorn_stable_for_large_logits_and_bad_args():
    logits = torch.randn(3, 3, 3) * 200  # exp overflows fp32 unless done in log space; rows converge slowly
    p = sinkhorn_knopp(logits, 20)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.sum(-2), torch.ones(3, 3), atol=1e-4, rtol=0)
    with pytest.raises(ValueError):
        sinkhorn_knopp(torch.zeros(2, 3), 5)
    with pytest.raises(ValueError):
        sinkhorn_knopp(torch.zeros(3, 3), 0)


def test_expand_and_reduce_streams():
    h = torch.randn(2, 5, 8)
    x = expand_streams(h, 3)
    assert x.shape == (2, 5, 3, 8)
    for i in range(3):
        assert torch.equal(x[:, :, i], h)
    assert torch.equal(reduce_streams(x), h + h + h)


def test_single_stream_is_plain_residual_bit_exact():
    hc = HyperConnection(8, 1)
    assert len(list(hc.parameters())) == 0
    w = torch.randn(8, 8)
    x = torch.randn(2, 7, 1, 8, requires_grad=True)
    h, coeffs = hc.pre(x)
    out = hc.post(x, torch.tanh(h @ w), coeffs)

    x_ref = x.detach().clone().requires_grad_(True)
    r = x_ref[:, :, 0]
    out_ref = (r + torch.tanh(r @ w))[:, :, None]
    assert torch.equal(h, x[:, :, 0])
    assert torch.equal(out, out_ref)
    g = torch.randn_like(out)
    out.backward(g)
    out_ref.backward(g)
    assert torch.equal(x.grad, x_ref.grad)


@pytest.mark.parametrize("n", [2, 3])
def test_pre_post_match_loop_reference_forward_and_backward(n):
    B, T, D = 2, 3, 5
    hc = _randomise(HyperConnection(D, n, sinkhorn_iters=7).double())
    x = torch.randn(B, T, n, D, dtype=torch.float64, requires_grad=True)
    f = torch.randn(B, T, D, dtype=torch.float64, requires_grad=True)

    h, coeffs = hc.pre(x)
    out = hc.post(x, f, coeffs)
    gh, go = torch.randn_like(h), torch.randn_like(out)
    loss = (h * gh).sum() + (out * go).sum()
    grads = torch.autograd.grad(loss, [x, f, *hc.parameters()])

    h_ref, out_ref, _ = _reference(hc, x, f)
    loss_ref = (h_ref * gh).sum() + (out_ref * go).sum()
    grads_ref = torch.autograd.grad(loss_ref, [x, f, *hc.parameters()])

    torch.testing.assert_close(h, h_ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out, out_ref, atol=1e-10, rtol=1e-10)
    for (name, _), g, gr in zip([("x", 0), ("f_out", 0), *hc.named_parameters()], grads, grads_ref, strict=True):
        torch.testing.assert_close(g, gr, atol=1e-9, rtol=1e-9, msg=f"grad of {name}")


class _PrePost(torch.nn.Module):
    """pre and post of one hyper-connection as one forward, so functional_call can feed its parameters."""

    def __init__(self, hc: HyperConnection):
        super().__init__()
        self.hc = hc

    def forward(self, x, f):
        h, coeffs = self.hc.pre(x)
        return h, self.hc.post(x, f, coeffs)


def test_gradcheck_fp64():
    B, T, n, D = 1, 2, 3, 4
    mod = _PrePost(_randomise(HyperConnection(D, n, sinkhorn_iters=5).double(), scale=0.5))
    names = [k for k, _ in mod.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in mod.parameters()]
    x = torch.randn(B, T, n, D, dtype=torch.float64, requires_grad=True)
    f = torch.randn(B, T, D, dtype=torch.float64, requires_grad=True)

    def fn(x, f, *ps):
        return functional_call(mod, dict(zip(names, ps, strict=True)), (x, f))

    assert torch.autograd.gradcheck(fn, (x, f, *params), eps=1e-6, atol=1e-6)


def test_h_res_doubly_stochastic_in_forward_and_stream_sum_conserved():
    B, T, n, D = 2, 9, 4, 16
    hc = _randomise(HyperConnection(D, n), scale=0.3)
    with torch.no_grad():
        # res logits of order 1 without a dominant diagonal: the regime where 20 Sinkhorn iterations
        # reach 1e-3 on rows (near a permutation, convergence is slower; columns are exact either way).
        hc.alpha_res.fill_(0.1)
        hc.b_res.copy_(torch.randn(n, n) * 0.3)
    x = torch.randn(B, T, n, D)
    h_pre, h_post, h_res = hc.coefficients(x)
    assert h_res.shape == (B, T, n, n) and h_pre.shape == h_post.shape == (B, T, n)
    torch.testing.assert_close(h_res.sum(-1), torch.ones(B, T, n), atol=1e-3, rtol=0)
    torch.testing.assert_close(h_res.sum(-2), torch.ones(B, T, n), atol=1e-5, rtol=0)
    assert ((h_pre > 0) & (h_pre < 1)).all() and ((h_post > 0) & (h_post < 2)).all()
    # Column sums 1 => the sum over streams of H_res x equals the sum of x.
    _, coeffs = hc.pre(x)
    out = hc.post(x, torch.zeros(B, T, D), coeffs)
    torch.testing.assert_close(reduce_streams(out), reduce_streams(x), atol=1e-4, rtol=1e-4)


def test_init_is_close_to_plain_residual():
    D, n = 32, 4
    hc = HyperConnection(D, n)
    h = torch.randn(2, 6, D)
    f = torch.randn(2, 6, D)
    x = expand_streams(h, n)
    y, coeffs = hc.pre(x)
    out = hc.post(x, f, coeffs)
    torch.testing.assert_close(y, h, atol=0.05, rtol=0.05)
    for i in range(n):
        torch.testing.assert_close(out[:, :, i], h + f, atol=0.1, rtol=0.05)
    _, _, h_res = hc.coefficients(x)
    assert (h_res.diagonal(dim1=-2, dim2=-1) > 0.9).all()


def test_coefficients_fp32_under_bf16_autocast():
    hc = HyperConnection(16, 2)
    x = torch.randn(1, 4, 2, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h_pre, h_post, h_res = hc.coefficients(x)
        h, coeffs = hc.pre(x)
        out = hc.post(x, torch.randn(1, 4, 16, dtype=torch.bfloat16), coeffs)
    assert h_pre.dtype == h_post.dtype == h_res.dtype == torch.float32
    assert h.dtype == torch.float32 and out.dtype == torch.float32  # the residual is not downcast
    ref = hc.coefficients(x)
    for a, r in zip((h_pre, h_post, h_res), ref, strict=True):
        assert torch.equal(a, r)
