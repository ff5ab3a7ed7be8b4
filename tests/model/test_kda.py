"""Kimi Delta Attention: chunked form vs the token-by-token recurrence (and fla's naive), the layer vs transformers'
glm5_next, gates and init, and the layer's chunk contract."""

import pytest
import torch
import torch.nn.functional as F

from genoctx.model.config import preset
from genoctx.model.kda import KDACache, KimiDeltaAttention, chunk_kda
from genoctx.model.reference import recurrent_kda

CHR22 = "hg38_chr22_32000001-32300000.fa"


def _inputs(B, T, H, K, V, dtype=torch.float64, g_range=(0.0, 2.0), requires_grad=True):
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, dtype=dtype)
    g = -torch.empty(B, T, H, K, dtype=dtype).uniform_(*g_range)
    beta = torch.rand(B, T, H, dtype=dtype)
    s0 = torch.randn(B, H, K, V, dtype=dtype)
    xs = [q, k, v, g, beta, s0]
    for x in xs:
        x.requires_grad_(requires_grad)
    return xs


def _run_with_grads(fn, xs, do, dS, **kw):
    for x in xs:
        x.grad = None
    o, S = fn(*xs[:5], initial_state=xs[5], **kw)
    ((o * do).sum() + (S * dS).sum()).backward()
    return o.detach(), S.detach(), [x.grad.clone() for x in xs]


@pytest.mark.parametrize("T,chunk", [(1, 16), (63, 16), (130, 64), (64, 64), (45, 12)])
def test_chunk_equals_recurrent_fp64(T, chunk):
    B, H, K, V = 2, 2, 8, 6
    xs = _inputs(B, T, H, K, V)
    do = torch.randn(B, T, H, V, dtype=torch.float64)
    dS = torch.randn(B, H, K, V, dtype=torch.float64)
    o1, S1, g1 = _run_with_grads(chunk_kda, xs, do, dS, chunk_size=chunk)
    o2, S2, g2 = _run_with_grads(recurrent_kda, xs, do, dS)
    assert o1.dtype == torch.float64 and S1.dtype == torch.float64
    torch.testing.assert_close(o1, o2, atol=1e-6, rtol=0)
    torch.testing.assert_close(S1, S2, atol=1e-6, rtol=0)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], g1, g2, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=f"grad of {name}")


def test_no_initial_state_and_no_final_state():
    q, k, v, g, beta, _ = _inputs(1, 20, 2, 4, 4, requires_grad=False)
    o1, S1 = chunk_kda(q, k, v, g, beta, chunk_size=8, output_final_state=False)
    o2, _ = recurrent_kda(q, k, v, g, beta)
    assert S1 is None
    torch.testing.assert_close(o1, o2, atol=1e-10, rtol=0)


def test_fp32_dtypes_and_bf16_values():
    q, k, v, g, beta, s0 = _inputs(1, 40, 2, 8, 8, dtype=torch.float32, requires_grad=False)
    o, S = chunk_kda(q, k, v.bfloat16(), g, beta, initial_state=s0, chunk_size=16)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    o_ref, S_ref = recurrent_kda(q, k, v.bfloat16(), g, beta, initial_state=s0)
    torch.testing.assert_close(S, S_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(o.float(), o_ref.float(), atol=2e-2, rtol=0)


def test_reference_matches_fla_naive():
    naive = pytest.importorskip("fla.ops.kda.naive")
    q, k, v, g, beta, s0 = _inputs(2, 37, 2, 8, 6, dtype=torch.float32, requires_grad=False)
    o1, S1 = recurrent_kda(q, k, v, g, beta, scale=0.3, initial_state=s0)
    o2, S2 = naive.naive_recurrent_kda(q, k, v, g, beta, scale=0.3, initial_state=s0, output_final_state=True)
    torch.testing.assert_close(o1, o2, atol=1e-5, rtol=0)
    torch.testing.assert_close(S1, S2, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float64, 1e-6)])
def test_strong_decay_is_finite_and_exact(dtype, tol):
    """g = -20 .. -50 per channel step: the span of Gamma in a chunk of 64 is ~3000, far past exp's range."""
    B, T, H, K, V = 1, 130, 2, 8, 8
    xs = _inputs(B, T, H, K, V, dtype=dtype, g_range=(20.0, 50.0))
    # a few channels with weak decay, so the state is not trivially reset each step
    with torch.no_grad():
        xs[3][..., :2] = -0.01
    do = torch.randn(B, T, H, V, dtype=dtype)
    dS = torch.randn(B, H, K, V, dtype=dtype)
    o1, S1, g1 = _run_with_grads(chunk_kda, xs, do, dS, chunk_size=64)
    o2, S2, g2 = _run_with_grads(recurrent_kda, xs, do, dS)
    assert torch.isfinite(o1).all() and torch.isfinite(S1).all()
    assert all(torch.isfinite(gr).all() for gr in g1)
    torch.testing.assert_close(o1, o2, atol=tol, rtol=0)
    torch.testing.assert_close(S1, S2, atol=tol, rtol=0)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], g1, g2, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=0, msg=f"grad of {name}")


def test_shape_errors():
    q, k, v, g, beta, s0 = _inputs(1, 8, 2, 4, 4, requires_grad=False)
    with pytest.raises(ValueError, match="beta"):
        chunk_kda(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda(q, k, v, g, beta, initial_state=s0[:, :1])


def _layer(dtype=torch.float64, **over):
    cfg = preset("tiny", **over)  # hidden 32, 2 heads of 8, conv 4, chunk 16, safe gate (lower bound -5)
    return KimiDeltaAttention(cfg).to(dtype), cfg


def _param_grads(layer):
    return {n: p.grad.clone() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("splits", [(37,), (18, 19), (1, 2, 34), (17, 20)])
def test_layer_chunks_equal_one_pass(splits):
    """One forward over T tokens == consecutive forwards with the carried KDACache (values and gradients); chunks of
    1 and 2 tokens are shorter than the conv tail (3 inputs)."""
    layer, cfg = _layer()
    T = sum(splits)
    H, K = cfg.linear_num_heads, cfg.linear_head_dim
    x = torch.randn(2, T, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, T, cfg.hidden_size, dtype=torch.float64)

    y_full, cache_full = layer(x)
    assert layer.stats["path"] == "chunk"
    (y_full * dy).sum().backward()
    g_full, gx_full = _param_grads(layer), x.grad.clone()
    layer.zero_grad()
    x.grad = None

    ys, cache, start = [], None, 0
    for n in splits:
        y, cache = layer(x[:, start : start + n], cache)
        ys.append(y)
        start += n
    assert isinstance(cache, KDACache)
    assert cache.state.shape == (2, H, K, K) and cache.state.dtype == torch.float64
    assert cache.conv_state.shape == (2, cfg.linear_conv_kernel_dim - 1, 3 * H * K)
    y_split = torch.cat(ys, dim=1)
    (y_split * dy).sum().backward()

    torch.testing.assert_close(y_split, y_full, atol=1e-10, rtol=0)
    torch.testing.assert_close(cache.state, cache_full.state, atol=1e-10, rtol=0)
    torch.testing.assert_close(cache.conv_state, cache_full.conv_state, atol=1e-12, rtol=0)
    torch.testing.assert_close(x.grad, gx_full, atol=1e-10, rtol=0)
    for name, gr in _param_grads(layer).items():
        torch.testing.assert_close(gr, g_full[name], atol=1e-10, rtol=0, msg=f"grad of {name}")


def test_layer_init_and_gate():
    """Init as the reference's ``_init_weights``; with the safe gate ``g = -5 sigmoid(exp(A_log) f)`` lies in
    [-5, 0], without it ``g = -exp(A_log) softplus(f)`` <= 0; beta in (0, 1); q and k unit norm (l2norm)."""
    layer, cfg = _layer(torch.float32)
    fg = layer.forget_gate
    assert bool((fg.A_log == 0).all())  # safe gate: A = 1
    dt = F.softplus(fg.dt_bias)
    assert ((dt >= 1e-3 - 1e-7) & (dt <= 0.1 + 1e-7)).all()
    x = torch.randn(1, 5, cfg.hidden_size) * 10
    q, k, v, g, beta, _ = layer.project(x)
    f = fg.f_b_proj(fg.f_a_proj(x)) + fg.dt_bias
    torch.testing.assert_close(g, -5.0 * torch.sigmoid(f).view_as(g), atol=1e-6, rtol=0)
    assert (g <= 0).all() and (g >= -5).all() and ((beta > 0) & (beta < 1)).all()
    torch.testing.assert_close(q.norm(dim=-1), torch.ones(1, 5, cfg.linear_num_heads), atol=1e-3, rtol=0)
    torch.testing.assert_close(k.norm(dim=-1), torch.ones(1, 5, cfg.linear_num_heads), atol=1e-3, rtol=0)

    layer, cfg = _layer(torch.float32, linear_lower_bound=None)
    fg = layer.forget_gate
    a = fg.A_log.exp()
    assert ((a >= 1) & (a <= 16)).all()
    with torch.no_grad():
        fg.dt_bias.fill_(10.0)  # softplus(f) ~ 10: far below the safe gate's bound
    _, _, _, g, _, _ = layer.project(x)
    f = (fg.f_b_proj(fg.f_a_proj(x)) + fg.dt_bias).view_as(g)
    torch.testing.assert_close(g, -a.view(1, 1, -1, 1) * F.softplus(f), atol=1e-5, rtol=1e-6)
    assert (g < -5).all()  # no lower bound


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_layer_equals_transformers_linear_attention(lower_bound):
    """The layer (conv, gates, l2norm, chunked core, gated o_norm) equals transformers'
    ``Glm5NextTextLinearAttention`` with the same weights (same in-memory names), fp32, relative error
    ``max |ours - ref| / max |ref|`` <= 1e-5, on a length that is not a multiple of either chunk size."""
    from glm5_reference import reference_modules
    from transformers import Glm5NextTextConfig

    reference_modules()  # the reference's PyTorch KDA (no Triton on CPU)
    import transformers.models.glm5_next.modeling_glm5_next as M

    layer, cfg = _layer(torch.float32, linear_lower_bound=lower_bound)
    with torch.no_grad():  # away from init: every gate and norm weight matters
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    hf = Glm5NextTextConfig(**cfg.to_hf_dict())
    ref = M.Glm5NextTextLinearAttention(hf, 0)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(2, 83, cfg.hidden_size)
    with torch.no_grad():
        y, _ = layer(x)
        y_ref = ref(x)
    assert float((y - y_ref).abs().max() / y_ref.abs().max()) <= 1e-5


def test_layer_bf16_autocast_keeps_gates_fp32():
    layer, cfg = _layer(torch.float32)
    x = torch.randn(1, 20, cfg.hidden_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, _, v, g, beta, _ = layer.project(x)
        y, cache = layer(x)
    assert v.dtype == torch.bfloat16
    assert g.dtype == torch.float32 and beta.dtype == torch.float32 and cache.state.dtype == torch.float32
    y_ref, _ = layer(x)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), y_ref, atol=5e-3, rtol=5e-2)


def _chr22_tokens(realdna, n):
    with open(realdna / CHR22) as f:
        header = f.readline()
        seq = f.readline()[:n]
    assert header.startswith(">") and len(seq) == n
    table = {c: i for i, c in enumerate("ACGTN")}
    return torch.tensor([table[c] for c in seq.upper()])


def test_layer_on_real_dna_chunk_vs_recurrent(realdna):
    """chr22 bases -> embedding -> KDA layer: the chunked core equals the recurrence (values, gradients)."""
    layer, cfg = _layer()
    tokens = _chr22_tokens(realdna, 300)
    emb = torch.nn.Embedding(5, cfg.hidden_size, dtype=torch.float64)
    dy = torch.randn(1, 300, cfg.hidden_size, dtype=torch.float64)

    x = emb(tokens)[None]  # [1, 300, hidden_size]
    y_chunk, cache = layer(x)
    (y_chunk * dy).sum().backward()
    g_chunk = _param_grads(layer) | {"emb": emb.weight.grad.clone()}
    layer.zero_grad()
    emb.zero_grad()

    x = emb(tokens)[None]
    q, k, v, g, beta, _ = layer.project(x)
    assert g.min() < 0
    o, state = recurrent_kda(q, k, v, g, beta)
    y_rec = layer.output(o, x)
    (y_rec * dy).sum().backward()
    g_rec = _param_grads(layer) | {"emb": emb.weight.grad.clone()}

    torch.testing.assert_close(y_chunk, y_rec, atol=1e-9, rtol=0)
    torch.testing.assert_close(cache.state, state, atol=1e-9, rtol=0)
    for name, gr in g_chunk.items():
        torch.testing.assert_close(gr, g_rec[name], atol=1e-9, rtol=0, msg=f"grad of {name}")


@pytest.mark.parametrize("C", [24, 12])
def test_causal_decay_scores_hand_backward_gradcheck(C):
    """The hand-written backward of the intra-chunk scores equals finite differences (fp64), across sub-chunks
    (C = 24: three sub-chunks of 8) and within one (C = 12), with a strong gate (g down to -50 per token in
    one head) so that the anchored factors are exercised."""
    from genoctx.model.kda import _CausalDecayScores

    torch.manual_seed(0)
    k = torch.randn(1, 2, 1, C, 3, dtype=torch.float64, requires_grad=True)
    q = torch.randn(1, 2, 1, C, 3, dtype=torch.float64, requires_grad=True)
    strength = torch.tensor([0.1, 50.0], dtype=torch.float64)[:, None, None, None]
    G = (-torch.rand(1, 2, 1, C, 3, dtype=torch.float64) * strength).cumsum(-2).requires_grad_(True)
    w = torch.randn(2, 1, 2, 1, C, C, dtype=torch.float64)

    def f(k, q, G):
        a_kk, a_qk = _CausalDecayScores.apply(k, G, k, q)
        return (a_kk * w[0]).sum() + (a_qk * w[1]).sum()

    assert torch.autograd.gradcheck(f, (k, q, G))


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("T,chunk,block", [(130, 16, 48), (130, 16, 40), (64, 16, 16), (45, 12, 1000), (97, 8, 8)])
def test_blocks_equal_one_pass_and_the_recurrence_fp64(T, chunk, block, recompute):
    """``chunk_kda`` in blocks of whole chunks (``block_tokens`` rounded down to chunks: 40 -> 32 tokens), with and
    without each block checkpointed, equals one pass over the sequence and the token recurrence, forward and the
    gradient of every input, the initial state included (T not a multiple of the block or the chunk)."""
    torch.manual_seed(T + block)
    B, H, K, V = 2, 2, 8, 6
    xs = _inputs(B, T, H, K, V)
    do = torch.randn(B, T, H, V, dtype=torch.float64)
    dS = torch.randn(B, H, K, V, dtype=torch.float64)
    o1, S1, g1 = _run_with_grads(chunk_kda, xs, do, dS, chunk_size=chunk, block_tokens=block, recompute=recompute)
    o0, S0, g0 = _run_with_grads(chunk_kda, xs, do, dS, chunk_size=chunk)
    o2, S2, g2 = _run_with_grads(recurrent_kda, xs, do, dS)
    torch.testing.assert_close(o1, o0, atol=1e-12, rtol=0)
    torch.testing.assert_close(S1, S0, atol=1e-12, rtol=0)
    torch.testing.assert_close(o1, o2, atol=1e-6, rtol=0)
    torch.testing.assert_close(S1, S2, atol=1e-6, rtol=0)
    for name, a, b, c in zip(["q", "k", "v", "g", "beta", "initial_state"], g1, g0, g2, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=f"grad of {name} vs one pass")
        torch.testing.assert_close(a, c, atol=1e-6, rtol=0, msg=f"grad of {name} vs the recurrence")


def test_recomputed_backward_runs_one_block_at_a_time(monkeypatch):
    """With ``recompute`` the forward keeps no block's graph and backward recomputes the blocks one at a time, last
    first: every ``_kda_block`` call sees at most ``block_tokens`` tokens, the forward saves for backward only the
    block inputs (views) and the states between blocks, and the saved bytes do not grow with the block's work."""
    import genoctx.model.kda as kda

    calls = []
    real = kda._kda_block

    def spy(q, *args):
        calls.append((q.shape[1], torch.is_grad_enabled()))
        return real(q, *args)

    monkeypatch.setattr(kda, "_kda_block", spy)
    B, T, H, K, V, C, block = 1, 200, 2, 8, 8, 16, 64
    xs = _inputs(B, T, H, K, V)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size() if t.untyped_storage().data_ptr() not in ptrs else 0)
        return t

    ptrs = {x.untyped_storage().data_ptr() for x in xs}  # views of the inputs cost nothing
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, S = chunk_kda(*xs[:5], initial_state=xs[5], chunk_size=C, block_tokens=block, recompute=True)
    n_blocks = -(-T // block)
    assert [t for t, _ in calls] == [64, 64, 64, 8]
    state_bytes = B * H * K * V * 8
    assert sum(saved) <= n_blocks * state_bytes  # the states entering blocks 2..n (and the initial state's copy)
    calls.clear()
    (o.sum() + S.sum()).backward()
    assert [t for t, _ in calls] == [8, 64, 64, 64]  # recomputed last block first, one at a time
