"""DeepSeek Sparse Attention: tiled indexer, sparse attention Function and the layer vs the references."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from genoctx.model.config import preset
from genoctx.model.dsa import SENTINEL, DeepSeekSparseAttention, DSACache, indexer_topk, sparse_attention
from genoctx.model.reference import (
    dense_causal_attention,
    dsa_reference,
    indexer_scores_reference,
    sparse_attention_reference,
)

F64 = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)


def _cfg(**kw):
    base = dict(d_model=24, dsa_heads=4, dsa_kv_heads=1, dsa_head_dim=8, index_heads=4, index_head_dim=8)
    base.update(kw)
    return preset("tiny", **base)


def _layer(dtype=F64, **kw) -> DeepSeekSparseAttention:
    layer = DeepSeekSparseAttention(_cfg(**kw)).to(dtype)
    for p in layer.parameters():  # larger weights than init_std so attention and indexer are far from uniform
        nn.init.normal_(p, std=0.3)
    return layer


def _indexer_inputs(B, T, S, H_I=3, d_I=5, dtype=F64):
    iq = torch.randn(B, T, H_I, d_I, dtype=dtype)
    iw = torch.randn(B, T, H_I, dtype=dtype)
    ik = torch.randn(B, S + T, d_I, dtype=dtype)
    return iq, iw, ik


@pytest.mark.parametrize("S,T,topk,tile", [(0, 37, 8, 40), (0, 63, 16, 1), (11, 29, 9, 50), (0, 20, 64, 64)])
def test_indexer_topk_matches_full_matrix(S, T, topk, tile):
    B = 2
    iq, iw, ik = _indexer_inputs(B, T, S)
    idx = indexer_topk(iq, iw, ik, S, topk, tile)
    full = indexer_scores_reference(iq, iw, ik, q_offset=S)
    K = min(topk, S + T)
    assert idx.shape == (B, T, K) and idx.dtype == torch.long
    assert torch.equal(indexer_topk(iq, iw, ik, S, topk, tile, index_dtype=torch.int32).long(), idx)
    ref_val, ref_idx = full.topk(K, dim=-1)
    # the selected score values (ties aside, the set) are those of the full matrix
    got_val = full.gather(-1, idx.clamp_min(0)).masked_fill(idx < 0, float("-inf"))
    torch.testing.assert_close(got_val.sort(-1, descending=True).values, ref_val, **TOL)
    # sentinels exactly where a query sees fewer than K keys, and no selected key is in the future
    n_vis = torch.arange(T) + S + 1
    assert torch.equal((idx >= 0).sum(-1), n_vis.clamp(max=K).expand(B, T))
    assert bool(((idx < n_vis[None, :, None]) | (idx == SENTINEL)).all())
    # the sets are equal on rows without a tie at the top-k boundary (ReLU makes exact-zero scores common)
    ref_set = ref_idx.masked_fill(torch.isneginf(ref_val), SENTINEL).sort(-1).values
    nxt = full.topk(min(K + 1, S + T), dim=-1).values[..., -1]
    untied = (ref_val[..., -1] > nxt) | (K == S + T) | torch.isneginf(ref_val[..., -1])
    assert int(untied.sum()) > B * T // 2
    assert torch.equal(idx.sort(-1).values[untied], ref_set[untied])


def test_indexer_topk_raises():
    iq, iw, ik = _indexer_inputs(1, 4, 0)
    with pytest.raises(ValueError):
        indexer_topk(iq, iw, ik, 0, 0, 16)
    with pytest.raises(ValueError):
        indexer_topk(iq, iw, ik, 3, 2, 16)  # queries past the keys


@pytest.mark.parametrize("H,KVH", [(4, 1), (4, 2)])
@pytest.mark.parametrize("tile", [1, 7, 1 << 16])
def test_sparse_attention_matches_reference(H, KVH, tile):
    B, S, T, Dh, topk = 2, 5, 31, 6, 12
    iq, iw, ik = _indexer_inputs(B, T, S)
    idx = indexer_topk(iq, iw, ik, S, topk, 64)
    assert bool((idx == SENTINEL).any())  # early queries have fewer than top-k keys
    q = torch.randn(B, T, H, Dh, dtype=F64, requires_grad=True)
    k = torch.randn(B, S + T, KVH, Dh, dtype=F64, requires_grad=True)
    v = torch.randn(B, S + T, KVH, Dh, dtype=F64, requires_grad=True)
    do = torch.randn(B, T, H, Dh, dtype=F64)
    o = sparse_attention(q, k, v, idx, 0.4, tile_tokens=tile)
    g = torch.autograd.grad(o, (q, k, v), do)
    o_ref = sparse_attention_reference(q, k, v, idx, 0.4)
    g_ref = torch.autograd.grad(o_ref, (q, k, v), do)
    torch.testing.assert_close(o, o_ref, **TOL)
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    # keys never selected get exactly zero gradient (sentinels scatter nothing)
    chosen = torch.zeros(B, S + T, dtype=torch.bool)
    for b in range(B):
        chosen[b, idx[b][idx[b] >= 0]] = True
    assert bool((g[1][~chosen] == 0).all()) and bool((g[2][~chosen] == 0).all())


def test_sparse_attention_fp32_close_to_fp64():
    """fp32 inputs give fp32 outputs close to the fp64 reference."""
    B, T, H, Dh = 1, 17, 2, 4
    idx = indexer_topk(*_indexer_inputs(B, T, 0), 0, 5, 32)
    q, k, v = torch.randn(B, T, H, Dh), torch.randn(B, T, 1, Dh), torch.randn(B, T, 1, Dh)
    o = sparse_attention(q, k, v, idx, 0.5)
    assert o.dtype == torch.float32
    ref = sparse_attention_reference(q.double(), k.double(), v.double(), idx, 0.5)
    torch.testing.assert_close(o.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kvh", [1, 2])
def test_layer_topk_ge_length_equals_dense(kvh):
    B, T = 2, 23
    sparse = _layer(index_topk=64, dsa_kv_heads=kvh)
    dense = _layer(index_topk=64, dsa_kv_heads=kvh, dsa_mode="dense", indexer_tile_tokens=50)
    dense.load_state_dict(sparse.state_dict())
    x = torch.randn(B, T, 24, dtype=F64, requires_grad=True)
    dy = torch.randn(B, T, 24, dtype=F64)
    outs = []
    for layer in (sparse, dense):
        y, _ = layer(x)
        gx, gq, gk, gv = torch.autograd.grad(y, (x, layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight), dy)
        outs.append((y, gx, gq, gk, gv))
    assert sparse.stats["path"] == "sparse" and dense.stats["path"] == "dense"
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    # and both equal the plain reference
    L = sparse
    q = L.q_proj(x).view(B, T, 4, 8)
    k = L.k_proj(x).view(B, T, kvh, 8)
    v = L.v_proj(x).view(B, T, kvh, 8)
    ref = L.o_proj(dense_causal_attention(q, k, v, 8**-0.5).reshape(B, T, 32))
    torch.testing.assert_close(outs[0][0], ref, **TOL)
    assert sparse.stats["keys_attended"] == B * T * (T + 1) // 2


def test_layer_sparse_matches_dsa_reference():
    B, T, topk = 2, 40, 7
    layer = _layer(index_topk=topk, indexer_tile_tokens=30)
    x = torch.randn(B, T, 24, dtype=F64, requires_grad=True)
    y, cache = layer(x)
    q = layer.q_proj(x).view(B, T, 4, 8)
    iq, iw, ik = layer.indexer_inputs(x)
    o_ref, idx_ref = dsa_reference(q, cache.k, cache.v, iq, iw, ik, topk, 8**-0.5)
    y_ref = layer.o_proj(o_ref.reshape(B, T, 32))
    # ReLU makes exact-zero indexer scores common: rows with a tie at the top-k boundary may pick a different
    # (equally scored) key. Compare those rows through the layer's own selection instead.
    full = indexer_scores_reference(iq, iw, ik)
    top = full.topk(min(topk + 1, T), -1).values
    untied = (top[..., topk - 1] > top[..., topk]) | torch.isneginf(top[..., topk - 1])
    assert int(untied.sum()) > B * T * 3 // 4
    torch.testing.assert_close(y[untied], y_ref[untied], **TOL)
    idx = indexer_topk(iq, iw, ik, 0, topk, 30)
    y_sel = layer.o_proj(sparse_attention_reference(q, cache.k, cache.v, idx, 8**-0.5).reshape(B, T, 32))
    torch.testing.assert_close(y, y_sel, **TOL)
    gy = torch.randn_like(y)
    wrt = (x, layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight)
    g = torch.autograd.grad(y, wrt, gy, retain_graph=True)
    g_ref = torch.autograd.grad(y_sel, wrt, gy)
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    assert layer.stats == {
        "path": "sparse",
        "keys_scored": B * T * (T + 1) // 2,
        "keys_attended": int((idx_ref >= 0).sum()),
        "indexer_loss": layer.stats["indexer_loss"],
    }
    assert isinstance(layer.stats["indexer_loss"], float)


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_two_chunks_with_cache_equal_one_pass(mode):
    B, T1, T2 = 2, 19, 26
    layer = _layer(index_topk=9, indexer_tile_tokens=40, dsa_mode=mode)
    x = torch.randn(B, T1 + T2, 24, dtype=F64, requires_grad=True)
    dy = torch.randn(B, T1 + T2, 24, dtype=F64)
    params = (x, layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight, layer.o_proj.weight)

    y_full, c_full = layer(x)
    aux_full = layer.aux_loss
    g_full = torch.autograd.grad((y_full * dy).sum() + aux_full, params + (layer.index_q_proj.weight,))

    y1, c1 = layer(x[:, :T1])
    aux1 = layer.aux_loss
    y2, c2 = layer(x[:, T1:], c1)
    aux2 = layer.aux_loss
    assert c1.length == T1 and c2.length == T1 + T2
    y = torch.cat([y1, y2], 1)
    # aux loss is a mean over each chunk's queries: weight chunks by their length to compare with one pass
    aux = (aux1 * T1 + aux2 * T2) / (T1 + T2)
    g = torch.autograd.grad((y * dy).sum() + aux, params + (layer.index_q_proj.weight,))
    torch.testing.assert_close(y, y_full, **TOL)
    torch.testing.assert_close(aux, aux_full, **TOL)
    for a, b in zip(c2.__dict__.values(), c_full.__dict__.values(), strict=True):
        torch.testing.assert_close(a, b, **TOL)
    for a, b in zip(g, g_full, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_cache_of_zero_length_is_no_cache():
    layer = _layer(index_topk=5)
    x = torch.randn(1, 9, 24, dtype=F64)
    empty = DSACache(
        torch.zeros(1, 0, 1, 8, dtype=F64),
        torch.zeros(1, 0, 1, 8, dtype=F64),
        torch.zeros(1, 0, 8, dtype=F64),
    )
    torch.testing.assert_close(layer(x, empty)[0], layer(x)[0], **TOL)


def _kl_reference(layer, x, stage):
    """Indexer KL of DeepSeek-V3.2 from full matrices (mean over queries)."""
    B, T, _ = x.shape
    q = layer.q_proj(x).view(B, T, 4, 8).detach()
    k = layer.k_proj(x).view(B, T, 1, 8).detach()
    iq, iw, ik = layer.indexer_inputs(x)
    logits = indexer_scores_reference(iq, iw, ik)  # [B, T, N]
    att = torch.softmax(
        (torch.einsum("bthd,bsd->bhts", q, k[:, :, 0]) * 8**-0.5).masked_fill(
            torch.isneginf(logits)[:, None], -torch.inf
        ),
        -1,
    )
    if stage == "sparse":
        _, idx = dsa_reference(q, k, k, iq, iw, ik, layer.topk, 8**-0.5)
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep.scatter_(2, torch.where(idx < 0, 0, idx), True)
        keep &= ~torch.isneginf(logits)
        s = (torch.einsum("bthd,bsd->bhts", q, k[:, :, 0]) * 8**-0.5).masked_fill(~keep[:, None], -torch.inf)
        att = torch.softmax(s, -1)
    else:
        keep = ~torch.isneginf(logits)
    p = att.sum(1)
    p = p / p.sum(-1, keepdim=True)
    logq = torch.log_softmax(logits.masked_fill(~keep, -torch.inf), -1).masked_fill(~keep, 0)
    return (torch.xlogy(p, p) - p * logq).sum() / (B * T)


@pytest.mark.parametrize("stage", ["sparse", "warmup"])
def test_indexer_loss_value_and_gradient_isolation(stage):
    B, T = 2, 30
    layer = _layer(index_topk=6, indexer_stage=stage, indexer_loss_coef=0.5, indexer_tile_tokens=64)
    x = torch.randn(B, T, 24, dtype=F64, requires_grad=True)
    y, _ = layer(x)
    assert layer.aux_loss is not None
    kl_ref = _kl_reference(layer, x, stage)
    torch.testing.assert_close(layer.aux_loss, 0.5 * kl_ref, **TOL)
    indexer = [layer.index_q_proj.weight, layer.index_k_proj.weight, layer.index_w_proj.weight]
    g = torch.autograd.grad(layer.aux_loss, indexer, retain_graph=True)
    g_ref = torch.autograd.grad(0.5 * kl_ref, indexer)
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    assert layer.stats["indexer_loss"] == pytest.approx(float(layer.aux_loss.detach()) / 0.5, rel=1e-12)
    main = [layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight, layer.o_proj.weight]
    # aux loss reaches only the indexer (and not x: the indexer's input is detached)
    g = torch.autograd.grad(layer.aux_loss, main + indexer + [x], allow_unused=True)
    assert all(t is None or bool((t == 0).all()) for t in g[:4] + (g[-1],))
    assert all(t is not None and float(t.abs().sum()) > 0 for t in g[4:7])
    # the LM path reaches only the main projections
    g = torch.autograd.grad(y.sum(), main + indexer, allow_unused=True)
    assert all(t is not None and float(t.abs().sum()) > 0 for t in g[:4])
    assert all(t is None for t in g[4:])


def test_indexer_loss_finite_on_first_tokens_and_off_when_no_grad():
    layer = _layer(index_topk=4, dtype=torch.float32)
    for T in (1, 2, 3):
        x = torch.randn(1, T, 24)
        layer(x)
        assert torch.isfinite(layer.aux_loss)
        gs = torch.autograd.grad(layer.aux_loss, list(layer.parameters()), allow_unused=True)
        assert all(g is None or bool(torch.isfinite(g).all()) for g in gs)
        if T == 1:  # one visible key: the indexer's distribution and the target are both one-hot
            assert float(layer.aux_loss.detach()) == 0.0
    with torch.no_grad():
        layer(torch.randn(1, 5, 24))
    assert layer.aux_loss is None and layer.stats["indexer_loss"] is None
    off = _layer(index_topk=4, indexer_stage="off")
    off(torch.randn(1, 5, 24, dtype=F64))
    assert off.aux_loss is None and off.stats["path"] == "sparse"


def test_indexer_tiles_stay_within_budget(monkeypatch):
    import genoctx.model.dsa as dsa

    seen = []
    real = dsa._index_scores_tile

    def spy(*args):
        out = real(*args)
        seen.append(out.numel())
        return out

    monkeypatch.setattr(dsa, "_index_scores_tile", spy)
    B, S, T, tile = 2, 40, 100, 64
    iq, iw, ik = _indexer_inputs(B, T, S)
    idx = indexer_topk(iq, iw, ik, S, 5, tile)
    assert len(seen) > 10 and max(seen) <= tile  # rows x columns never exceed the budget
    full = indexer_scores_reference(iq, iw, ik, q_offset=S)
    got = full.gather(-1, idx).sort(-1, descending=True).values
    torch.testing.assert_close(got, full.topk(5, -1).values, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("ties", [False, True])
def test_indexer_pruning_equals_plain_running_topk(monkeypatch, dtype, ties):
    """The pruned fast path (threshold per row, key groups skipped, blocks visited newest first) selects
    exactly the keys of the plain running top-k, in the same order; with many exact ties (ReLU zeros) too."""
    import genoctx.model.dsa as dsa

    monkeypatch.setattr(dsa, "INDEX_COL_BLOCK", 128)  # many blocks and groups at test sizes
    monkeypatch.setattr(dsa, "INDEX_ROW_TILE", 24)
    monkeypatch.setattr(dsa, "INDEX_GROUP", 8)
    torch.manual_seed(3)
    B, S, T, topk = 2, 1500, 200, 16
    iq, iw, ik = _indexer_inputs(B, T, S, H_I=2, d_I=8, dtype=dtype)
    if ties:  # most scores exactly 0: ReLU of mostly negative dot products
        iq = iq.abs().neg()
        ik = ik.abs() + 0.0 * ik
        ik[:, ::7] = -ik[:, ::7]
    fast = indexer_topk(iq, iw, ik, S, topk, 1 << 12)
    plain = indexer_topk(iq, iw, ik, S, topk, 1 << 12, prune=False)
    assert torch.equal(fast, plain)
    full = indexer_scores_reference(iq.double(), iw.double(), ik.double(), q_offset=S)
    got = full.gather(-1, fast).sort(-1, descending=True).values
    torch.testing.assert_close(got, full.topk(topk, -1).values, rtol=1e-5, atol=1e-6)


def test_layer_saves_no_quadratic_tensor():
    """What autograd keeps for backward is O(T x top-k): no [T, T] score or probability tensor."""
    T, topk = 512, 8
    layer = _layer(dtype=torch.float32, index_topk=topk, indexer_tile_tokens=4096)
    x = torch.randn(1, T, 24, requires_grad=True)
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, _ = layer(x)
        (y.sum() + layer.aux_loss).backward()
    assert max(sizes) <= T * 32  # the widest per-token activation (4 heads x 8); T x T would be 16x that
    assert layer.index_q_proj.weight.grad is not None


def test_config_that_cannot_run_sparse_raises():
    with pytest.raises(ValueError, match="sparse"):
        DeepSeekSparseAttention(_cfg(index_topk=0))
    with pytest.raises(ValueError):
        DeepSeekSparseAttention(_cfg(indexer_tile_tokens=0))
    bad = dataclasses.replace(_cfg(), index_topk=4)
    bad.dsa_mode = "auto"  # bypasses the config's own check: the layer still refuses
    with pytest.raises(ValueError):
        DeepSeekSparseAttention(bad)
    # dense only when asked: index_topk 0 is fine then, and the path says so
    layer = DeepSeekSparseAttention(_cfg(index_topk=0, dsa_mode="dense", indexer_stage="off"))
    layer(torch.randn(1, 6, 24))
    assert layer.stats["path"] == "dense" and layer.stats["keys_scored"] == 0


def _chr22_tokens(realdna, n):
    seq = (realdna / "hg38_chr22_32000001-32300000.fa").read_text().split("\n", 1)[1][: n + 1000]
    table = {c: i for i, c in enumerate("ACGTN")}
    return torch.tensor([table[c] for c in seq.upper()[1000 : 1000 + n]])


def test_real_dna_chr22(realdna):
    B, T1, T2, topk = 1, 96, 64, 24
    tokens = _chr22_tokens(realdna, T1 + T2)[None]
    emb = nn.Embedding(5, 24).to(F64)
    layer = _layer(index_topk=topk, indexer_tile_tokens=500)
    x = emb(tokens)
    y_full, c_full = layer(x)
    idx = indexer_topk(*layer.indexer_inputs(x), 0, topk, 500)
    q = layer.q_proj(x).view(B, T1 + T2, 4, 8)
    o_ref = sparse_attention_reference(q, c_full.k, c_full.v, idx, 8**-0.5)
    y_ref = layer.o_proj(o_ref.reshape(B, T1 + T2, 32))
    torch.testing.assert_close(y_full, y_ref, **TOL)
    # selected indexer scores = the full matrix's top-k values (DNA has repeats: compare values, not sets)
    full = indexer_scores_reference(*layer.indexer_inputs(x))
    got = full.gather(-1, idx.clamp_min(0)).masked_fill(idx < 0, -torch.inf).sort(-1, descending=True).values
    torch.testing.assert_close(got, full.topk(topk, -1).values, **TOL)
    # gradients into the embedding, fast vs reference
    ge = torch.autograd.grad(y_full.square().sum(), emb.weight, retain_graph=True)[0]
    ge_ref = torch.autograd.grad(y_ref.square().sum(), emb.weight)[0]
    torch.testing.assert_close(ge, ge_ref, **TOL)
    # chunked over the real sequence == one pass
    y1, c1 = layer(x[:, :T1])
    y2, _ = layer(x[:, T1:], c1)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y_full, **TOL)
