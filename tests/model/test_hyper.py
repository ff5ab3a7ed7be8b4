"""mHC hyper-connections as glm5_next runs them: Sinkhorn in the reference's order, a loop reference (values and
gradients, fp64), transformers' module, gradcheck, fp32 coefficients under autocast."""

import pytest
import torch
from torch.func import functional_call

from genoctx.model.hyper import (
    HyperConnection,
    _comb_reference,
    comb_map,
    expand_streams,
    reduce_streams,
    sinkhorn,
    sinkhorn_reference,
)


def _randomise(hc: HyperConnection, scale: float = 1.0) -> HyperConnection:
    """Move every parameter away from its init (base 0, scale 1) so each coefficient depends on all of them."""
    with torch.no_grad():
        hc.fn.normal_(0, 0.3 * scale)
        hc.base.normal_(0, scale)
        hc.scale.uniform_(0.5, 1.5)
    return hc


def _sinkhorn_loop(m: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """One positive [n, n] matrix: divide by column sums (+ eps), then iters - 1 times rows then columns."""
    n = m.shape[0]
    p = m.clone()

    def cols(p):
        return torch.stack([p[:, j] / (sum(p[i, j] for i in range(n)) + eps) for j in range(n)], dim=1)

    def rows(p):
        return torch.stack([p[i] / (sum(p[i, j] for j in range(n)) + eps) for i in range(n)])

    p = cols(p)
    for _ in range(iters - 1):
        p = cols(rows(p))
    return p


def _reference(hc: HyperConnection, x: torch.Tensor, f_out: torch.Tensor):
    """Slow mHC (``Glm5NextTextHyperConnection`` + the decoder layer's update) with loops over tokens and streams.

    Returns (h [B, T, D], next streams [B, T, n, D], comb [B, T, n, n]).
    """
    B, T, n, D = x.shape
    h = torch.zeros(B, T, D, dtype=x.dtype)
    out = torch.zeros_like(x)
    combs = torch.zeros(B, T, n, n, dtype=x.dtype)
    s0, s1, s2 = hc.scale
    base = hc.base
    for b in range(B):
        for t in range(T):
            v = torch.cat([x[b, t, i] for i in range(n)])
            v = v / torch.sqrt((v * v).mean() + hc.norm_eps)  # RMSNorm without weight
            a = hc.fn @ v
            pre = torch.sigmoid(s0 * a[:n] + base[:n]) + hc.hc_eps
            post = 2 * torch.sigmoid(s1 * a[n : 2 * n] + base[n : 2 * n])
            logits = (s2 * a[2 * n :] + base[2 * n :]).view(n, n)
            comb = _sinkhorn_loop(torch.softmax(logits, -1) + hc.hc_eps, hc.sinkhorn_iters, hc.hc_eps)
            combs[b, t] = comb
            h[b, t] = sum(pre[j] * x[b, t, j] for j in range(n))
            for i in range(n):
                out[b, t, i] = post[i] * f_out[b, t] + sum(comb[j, i] * x[b, t, j] for j in range(n))
    return h, out, combs


def test_sinkhorn_matches_loop_and_is_doubly_stochastic():
    m = torch.softmax(torch.randn(6, 4, 4, dtype=torch.float64), -1) + 1e-6
    p = sinkhorn(m, 20, 1e-6)
    ref = torch.stack([_sinkhorn_loop(a, 20, 1e-6) for a in m])
    torch.testing.assert_close(p, ref, atol=1e-12, rtol=1e-12)
    assert (p >= 0).all()
    torch.testing.assert_close(p.sum(-2), torch.ones(6, 4, dtype=torch.float64), atol=1e-5, rtol=0)  # columns last
    torch.testing.assert_close(p.sum(-1), torch.ones(6, 4, dtype=torch.float64), atol=1e-3, rtol=0)
    with pytest.raises(ValueError, match="square"):
        sinkhorn(torch.ones(2, 3), 5, 1e-6)
    with pytest.raises(ValueError, match="hc_sinkhorn_iters"):
        sinkhorn(torch.ones(3, 3), 0, 1e-6)


def test_expand_and_reduce_streams():
    h = torch.randn(2, 5, 8)
    x = expand_streams(h, 3)
    assert x.shape == (2, 5, 3, 8) and x.is_contiguous()
    for i in range(3):
        assert torch.equal(x[:, :, i], h)
    x = torch.randn(2, 5, 3, 8)
    torch.testing.assert_close(reduce_streams(x), (x[:, :, 0] + x[:, :, 1] + x[:, :, 2]) / 3)  # the mean


@pytest.mark.parametrize("n", [1, 2, 3])
def test_pre_post_match_loop_reference_forward_and_backward(n):
    B, T, D = 2, 3, 5
    hc = _randomise(HyperConnection(D, n, sinkhorn_iters=7, hc_eps=1e-3, norm_eps=1e-4).double())
    x = torch.randn(B, T, n, D, dtype=torch.float64, requires_grad=True)
    f = torch.randn(B, T, D, dtype=torch.float64, requires_grad=True)

    h, coeffs = hc.pre(x)
    out = hc.post(x, f, coeffs)
    gh, go = torch.randn_like(h), torch.randn_like(out)
    grads = torch.autograd.grad((h * gh).sum() + (out * go).sum(), [x, f, *hc.parameters()])

    h_ref, out_ref, comb_ref = _reference(hc, x, f)
    grads_ref = torch.autograd.grad((h_ref * gh).sum() + (out_ref * go).sum(), [x, f, *hc.parameters()])

    torch.testing.assert_close(coeffs[1], comb_ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(h, h_ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out, out_ref, atol=1e-10, rtol=1e-10)
    for (name, _), g, gr in zip([("x", 0), ("f_out", 0), *hc.named_parameters()], grads, grads_ref, strict=True):
        torch.testing.assert_close(g, gr, atol=1e-9, rtol=1e-9, msg=f"grad of {name}")


def test_equals_transformers_hyper_connection():
    """``pre``/``post`` equal transformers' ``Glm5NextTextHyperConnection`` (post, comb, collapsed) and the decoder
    layer's update ``post * f + comb^T x`` with the same fn/base/scale, fp32."""
    import transformers.models.glm5_next.modeling_glm5_next as M
    from transformers import Glm5NextTextConfig

    n, D = 4, 16
    hc = _randomise(HyperConnection(D, n, sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-5))
    ref = M.Glm5NextTextHyperConnection(Glm5NextTextConfig(hidden_size=D, hc_mult=n))
    ref.load_state_dict(hc.state_dict())
    x = torch.randn(2, 7, n, D)
    f = torch.randn(2, 7, D)
    post_r, comb_r, collapsed_r = ref(x)
    h, (post, comb) = hc.pre(x)
    torch.testing.assert_close(h, collapsed_r, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(post, post_r, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(comb, comb_r, atol=1e-6, rtol=1e-5)
    want = post_r.unsqueeze(-1) * f.unsqueeze(-2) + torch.matmul(comb_r.transpose(-1, -2), x)
    torch.testing.assert_close(hc.post(x, f, (post, comb)), want, atol=1e-6, rtol=1e-5)


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
    mod = _PrePost(_randomise(HyperConnection(D, n, sinkhorn_iters=5, hc_eps=1e-3).double(), scale=0.5))
    names = [k for k, _ in mod.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in mod.parameters()]
    x = torch.randn(B, T, n, D, dtype=torch.float64, requires_grad=True)
    f = torch.randn(B, T, D, dtype=torch.float64, requires_grad=True)

    def fn(x, f, *ps):
        return functional_call(mod, dict(zip(names, ps, strict=True)), (x, f))

    assert torch.autograd.gradcheck(fn, (x, f, *params), eps=1e-6, atol=1e-6)


def test_coefficients_in_range_and_stream_mean_nearly_conserved():
    B, T, n, D = 2, 9, 4, 16
    hc = _randomise(HyperConnection(D, n), scale=0.3)
    x = torch.randn(B, T, n, D)
    pre, post, comb = hc.coefficients(x)
    assert comb.shape == (B, T, n, n) and pre.shape == post.shape == (B, T, n)
    torch.testing.assert_close(comb.sum(-2), torch.ones(B, T, n), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-1), torch.ones(B, T, n), atol=1e-3, rtol=0)
    assert ((pre > 0) & (pre < 1 + 1e-5)).all() and ((post > 0) & (post < 2)).all()
    # rows of comb sum to ~1, so with f = 0 the mean over streams is (nearly) what it was
    _, coeffs = hc.pre(x)
    out = hc.post(x, torch.zeros(B, T, D), coeffs)
    torch.testing.assert_close(reduce_streams(out), reduce_streams(x), atol=5e-3, rtol=0)


def test_extreme_logits_stay_finite():
    """Mixing logits of order 1e3 (softmax saturates to one-hot + eps): the coefficients stay finite, columns of comb
    still sum to 1, and so do the gradients."""
    hc = _randomise(HyperConnection(8, 3), scale=0.3)
    with torch.no_grad():
        hc.fn.mul_(1e4)
    x = torch.randn(2, 5, 3, 8, requires_grad=True)
    pre, post, comb = hc.coefficients(x)
    assert all(bool(torch.isfinite(t).all()) for t in (pre, post, comb))
    torch.testing.assert_close(comb.sum(-2), torch.ones(2, 5, 3), atol=1e-4, rtol=0)
    h, coeffs = hc.pre(x)
    (h.sum() + hc.post(x, h, coeffs).sum()).backward()
    assert bool(torch.isfinite(x.grad).all()) and all(bool(torch.isfinite(p.grad).all()) for p in hc.parameters())


def test_init_as_the_reference():
    hc = HyperConnection(256, 4)
    assert hc.fn.shape == (6 * 4, 4 * 256) and hc.base.shape == (24,) and hc.scale.shape == (3,)
    assert abs(float(hc.fn.std()) - 0.02) < 0.002
    assert torch.equal(hc.base, torch.zeros(24)) and torch.equal(hc.scale, torch.ones(3))


def test_coefficients_fp32_under_bf16_autocast():
    hc = _randomise(HyperConnection(16, 2), scale=0.3)
    x = torch.randn(1, 4, 2, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pre, post, comb = hc.coefficients(x)
        h, coeffs = hc.pre(x)
        out = hc.post(x, torch.randn(1, 4, 16, dtype=torch.bfloat16), coeffs)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    assert h.dtype == torch.float32 and out.dtype == torch.float32  # the residual is not downcast
    for a, r in zip((pre, post, comb), hc.coefficients(x), strict=True):
        assert torch.equal(a, r)


@pytest.mark.parametrize("iters", [1, 2, 20])
@pytest.mark.parametrize("softmax", [True, False])
def test_fast_sinkhorn_equals_the_autograd_reference(iters, softmax):
    """``comb_map`` / ``sinkhorn`` (one Function, hand-written backward) equal ``_comb_reference`` /
    ``sinkhorn_reference`` (autograd's graph) on random [B, T, n, n] input: fp64 to 1e-12, and in fp32 the fast
    form is as close to the fp64 reference as the fp32 reference is (values and every input gradient)."""
    torch.manual_seed(iters)
    fast, ref = (comb_map, _comb_reference) if softmax else (sinkhorn, sinkhorn_reference)
    x64 = torch.randn(2, 9, 4, 4, dtype=torch.float64) * 2
    if not softmax:
        x64 = x64.exp()  # a positive matrix
    g64 = torch.randn(2, 9, 4, 4, dtype=torch.float64)

    def run(f, dtype):
        x = x64.to(dtype).requires_grad_(True)
        y = f(x, iters, 1e-6)
        (gx,) = torch.autograd.grad(y, x, g64.to(dtype))
        return y.double(), gx.double()

    y_ref, g_ref = run(ref, torch.float64)
    y, g = run(fast, torch.float64)
    torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(g, g_ref, atol=1e-12 * float(g_ref.abs().max()), rtol=1e-10)
    y32, g32 = run(fast, torch.float32)
    y32_ref, g32_ref = run(ref, torch.float32)
    torch.testing.assert_close(y32, y_ref, atol=1e-6, rtol=1e-5)
    scale = float(g_ref.abs().max())
    assert float((g32 - g_ref).abs().max()) <= 4 * float((g32_ref - g_ref).abs().max()) + 1e-7 * scale
    torch.testing.assert_close(g32, g_ref, atol=1e-6 * scale, rtol=1e-5)


def test_fast_sinkhorn_rejects_what_the_reference_rejects():
    for f in (sinkhorn, comb_map, sinkhorn_reference):
        with pytest.raises(ValueError, match="square"):
            f(torch.ones(2, 3), 5, 1e-6)
        with pytest.raises(ValueError, match="hc_sinkhorn_iters"):
            f(torch.ones(3, 3), 0, 1e-6)


def _count_ops(fn) -> int:
    """aten ops ``fn()`` dispatches (``genoctx.model.opcount.OpCounter``: what the planner's op counts are held to)."""
    from genoctx.model.opcount import OpCounter

    with OpCounter() as counter:
        fn()
    return counter.total


@pytest.mark.parametrize("n, iters, T", [(4, 20, 7), (4, 20, 33), (2, 10, 5), (3, 1, 4), (3, 2, 4)])
def test_op_counts_per_call(n, iters, T):
    """One mHC call (``pre`` + ``post``) issues ``4 iters + 49`` aten ops forward (``4 iters + 45`` without grad) and
    ``6 iters + 88`` backward, for any token count (the module docstring's formula; the Sinkhorn alone
    ``4 iters + 11`` and ``6 iters + 11``, where autograd's reference needs ``3 (2 iters - 1) + 2`` forward, the same
    again recomputed and about ``10 (2 iters - 1)`` backward)."""
    hc = _randomise(HyperConnection(16, n, sinkhorn_iters=iters))
    x = torch.randn(2, T, n, 16, requires_grad=True)
    f = torch.randn(2, T, 16, requires_grad=True)
    out = {}

    def fwd():
        h, coeffs = hc.pre(x)
        out["h, out"] = h, hc.post(x, f, coeffs)

    assert _count_ops(fwd) == 4 * iters + 49
    grads = [torch.randn_like(t) for t in out["h, out"]]
    assert _count_ops(lambda: torch.autograd.backward(out["h, out"], grads)) == 6 * iters + 88
    with torch.no_grad():
        assert _count_ops(lambda: hc.post(x, f, hc.pre(x)[1])) == 4 * iters + 45
    logits = torch.randn(2, T, n, n, requires_grad=True)
    assert _count_ops(lambda: out.update(y=comb_map(logits, iters, 1e-6))) == 4 * iters + 11
    gy = torch.randn(2, T, n, n)
    assert _count_ops(lambda: out["y"].backward(gy)) == 6 * iters + 11
