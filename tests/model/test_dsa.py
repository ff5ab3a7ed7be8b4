"""DeepSeek Sparse Attention (NoPE MLA + KPool indexer): the tiled indexer top-k, the sparse attention Function, the
indexer KL and the layer, each against the slow references of ``genoctx.model.reference`` (fp64)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from genoctx.model.config import preset
from genoctx.model.dsa import (
    SENTINEL,
    DeepSeekSparseAttention,
    DSACache,
    DSASelection,
    indexer_topk,
    sparse_mla,
)
from genoctx.model.reference import (
    dense_causal_attention,
    dsa_layer_reference,
    masked_mla_attention,
    pool_keys_reference,
    pooled_indexer_scores_reference,
    selection_reference,
)

F64 = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)
D = 24  # hidden size of the test layers


def _cfg(**kw):
    base = dict(
        hidden_size=D, num_attention_heads=4, kv_lora_rank=12, q_lora_rank=16, qk_nope_head_dim=8, v_head_dim=6,
        index_n_heads=4, index_head_dim=8, index_topk=8, index_kpool=4, indexer_tile_tokens=4096,
    )  # fmt: skip
    base.update(kw)
    return preset("tiny", **base)


def _layer(dtype=F64, layer_idx: int = 1, **kw) -> DeepSeekSparseAttention:
    """A DSA layer (layer 1 of tiny: K D) with weights larger than the init so attention and indexer are far from
    uniform and the pooling gate/ape matter."""
    layer = DeepSeekSparseAttention(_cfg(**kw), layer_idx).to(dtype)
    for p in layer.parameters():
        nn.init.normal_(p, std=0.3)
    return layer


def _mask(tok: torch.Tensor, n: int) -> torch.Tensor:
    """Token indices [B, T, W] (-1 = empty) -> [B, T, n] bool."""
    m = torch.zeros(*tok.shape[:2], n + 1, dtype=torch.bool)
    m.scatter_(-1, torch.where(tok < 0, n, tok.long()), True)
    return m[..., :n]


def _indexer_inputs(B, T, N, H_I=3, d_I=5, dtype=F64):
    """Indexer queries [B, T, H_I, d_I], head weights [B, T, H_I] and N keys [B, N, d_I]."""
    q, w = torch.randn(B, T, H_I, d_I, dtype=dtype), torch.randn(B, T, H_I, dtype=dtype)
    return q, w, torch.randn(B, N, d_I, dtype=dtype)


# ---- indexer top-k ----


@pytest.mark.parametrize("kpool", [1, 4])
@pytest.mark.parametrize("S,T,topk,tile", [(0, 37, 8, 40), (0, 63, 16, 1), (11, 29, 9, 50), (0, 20, 64, 64)])
def test_indexer_topk_matches_full_matrix(S, T, topk, tile, kpool):
    """Queries at positions S .. S + T - 1 over pooled keys (pools of 1 = DeepSeek-V3.2's per-token indexer): the
    selected scores are the full matrix's top-k, sentinels exactly where fewer pools are visible, nothing unseen."""
    B = 2
    P = (S + T) // kpool
    iq, iw, ik = _indexer_inputs(B, T, P)
    pos = torch.arange(S, S + T)
    vis = (pos + 1) // kpool
    idx = indexer_topk(iq, iw, ik, vis, topk, tile)
    full = pooled_indexer_scores_reference(iq, iw, ik, pos, kpool)
    K = min(topk, P)
    assert idx.shape == (B, T, K) and idx.dtype == torch.long
    assert torch.equal(indexer_topk(iq, iw, ik, vis, topk, tile, index_dtype=torch.int32).long(), idx)
    ref_val, ref_idx = full.topk(K, dim=-1)
    got_val = full.gather(-1, idx.clamp_min(0)).masked_fill(idx < 0, float("-inf"))
    torch.testing.assert_close(got_val.sort(-1, descending=True).values, ref_val, **TOL)
    assert torch.equal((idx >= 0).sum(-1), vis.clamp(max=K).expand(B, T))
    assert bool(((idx < vis[None, :, None]) | (idx == SENTINEL)).all())
    # the sets are equal on rows without a tie at the top-k boundary (ReLU makes exact-zero scores common)
    ref_set = ref_idx.masked_fill(torch.isneginf(ref_val), SENTINEL).sort(-1).values
    nxt = full.topk(min(K + 1, P), dim=-1).values[..., -1]
    untied = (ref_val[..., -1] > nxt) | (K == P) | torch.isneginf(ref_val[..., -1])
    assert int(untied.sum()) > B * T // 2
    assert torch.equal(idx.sort(-1).values[untied], ref_set[untied])


def test_indexer_topk_raises():
    iq, iw, ik = _indexer_inputs(1, 4, 4)
    vis = torch.arange(1, 5)
    with pytest.raises(ValueError, match="topk >= 1"):
        indexer_topk(iq, iw, ik, vis, 0, 16)
    with pytest.raises(ValueError, match="tile_tokens >= 1"):
        indexer_topk(iq, iw, ik, vis, 2, 0)
    for bad in (torch.arange(1, 4), torch.tensor([1, 3, 2, 4]), torch.arange(2, 6), torch.tensor([-1, 0, 1, 2])):
        with pytest.raises(ValueError, match="visible"):
            indexer_topk(iq, iw, ik, bad, 2, 16)
    with pytest.raises(ValueError, match="index_dtype"):
        indexer_topk(iq, iw, ik, vis, 2, 16, index_dtype=torch.float32)


@pytest.mark.parametrize("prune", [True, False])
def test_indexer_topk_ties_go_to_the_most_recent_keys(prune):
    """All scores equal (zero head weights): each query keeps its most recent visible keys, newest first, however
    the keys are tiled (the selection is a fixed function of query and key, not of the tiling)."""
    iq, iw, ik = _indexer_inputs(1, 40, 300)
    vis = torch.arange(261, 301)
    idx = indexer_topk(iq, iw * 0, ik, vis, 5, 64, prune=prune)
    want = vis[:, None] - 1 - torch.arange(5)
    assert torch.equal(idx[0], want)


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
    iq, iw, ik = _indexer_inputs(B, T, S + T)
    pos = torch.arange(S, S + T)
    idx = indexer_topk(iq, iw, ik, pos + 1, 5, tile)
    assert len(seen) > 10 and max(seen) <= tile  # rows x columns never exceed the budget
    full = pooled_indexer_scores_reference(iq, iw, ik, pos, 1)
    got = full.gather(-1, idx).sort(-1, descending=True).values
    torch.testing.assert_close(got, full.topk(5, -1).values, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("ties", [False, True])
def test_indexer_pruning_equals_plain_running_topk(monkeypatch, dtype, ties):
    """The pruned fast path (threshold per row, key groups skipped, blocks visited newest first) selects exactly
    the keys of the plain running top-k, in the same order; with many exact ties (ReLU zeros) too."""
    import genoctx.model.dsa as dsa

    monkeypatch.setattr(dsa, "INDEX_COL_BLOCK", 128)  # many blocks and groups at test sizes
    monkeypatch.setattr(dsa, "INDEX_ROW_TILE", 24)
    monkeypatch.setattr(dsa, "INDEX_GROUP", 8)
    torch.manual_seed(3)
    B, S, T, topk = 2, 1500, 200, 16
    iq, iw, ik = _indexer_inputs(B, T, S + T, H_I=2, d_I=8, dtype=dtype)
    if ties:  # most scores exactly 0: ReLU of mostly negative dot products
        iq = iq.abs().neg()
        ik = ik.abs() + 0.0 * ik
        ik[:, ::7] = -ik[:, ::7]
    pos = torch.arange(S, S + T)
    fast = indexer_topk(iq, iw, ik, pos + 1, topk, 1 << 12)
    plain = indexer_topk(iq, iw, ik, pos + 1, topk, 1 << 12, prune=False)
    assert torch.equal(fast, plain)
    full = pooled_indexer_scores_reference(iq.double(), iw.double(), ik.double(), pos, 1)
    got = full.gather(-1, fast).sort(-1, descending=True).values
    torch.testing.assert_close(got, full.topk(topk, -1).values, rtol=1e-5, atol=1e-6)



def _grouped_setup(monkeypatch):
    """Small blocks and groups, the compiled group-maximum path on at any size; returns the list the spy on
    ``_grouped_topk`` appends each tile's row count to."""
    import genoctx.model.dsa as dsa

    monkeypatch.setattr(dsa, "INDEX_COL_BLOCK", 128)
    monkeypatch.setattr(dsa, "INDEX_ROW_TILE", 24)
    monkeypatch.setattr(dsa, "INDEX_GROUP", 8)
    monkeypatch.setattr(dsa, "INDEX_COMPILE_PAIRS", 0)
    tiles, real = [], dsa._grouped_topk

    def spy(*args):
        tiles.append(args[1].shape[0])
        return real(*args)

    monkeypatch.setattr(dsa, "_grouped_topk", spy)
    return tiles


@pytest.mark.parametrize("topk", [4, 64])
@pytest.mark.parametrize("ties", [False, True, "autocast"])
def test_indexer_compiled_group_maxima_equal_plain_running_topk(monkeypatch, topk, ties):
    """A CPU call large enough for the compiled path (``INDEX_COMPILE_PAIRS``, here 0) selects the keys of the plain
    running top-k in the same order, with many exact ties (ReLU zeros) too, and under bf16 autocast (as
    ``train.dtype: bf16`` runs the layer on a CPU: the rescoring's products stay fp32, as the bounds need); with a
    threshold from whole groups (topk 4) and without one (64: more than the groups a tile sees whole), the causal
    tail masked per row. A call shorter than the row tile stays eager (one compiled shape per indexer)."""
    import contextlib

    import genoctx.model.dsa as dsa

    tiles = _grouped_setup(monkeypatch)
    torch.manual_seed(5)
    B, S, T = 2, 2600, 130  # rows see 650-683 keys: 5 blocks of 128; 130 rows = 5 tiles of 24 and an eager 10
    iq, iw, ik = _indexer_inputs(B, T, (S + T) // 4, H_I=2, d_I=8, dtype=torch.float32)
    if ties is True:
        iq = iq.abs().neg()
        ik = ik.abs()
        ik[:, ::7] = -ik[:, ::7]
    vis = (torch.arange(S, S + T) + 1) // 4
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if ties == "autocast" else contextlib.nullcontext()
    with amp:
        fast = indexer_topk(iq, iw, ik, vis, topk, 1 << 12)
        assert tiles == [24] * 10 and dsa._COMPILED["group_max"] is not None  # 5 tiles a batch row, compiled
        plain = indexer_topk(iq, iw, ik, vis, topk, 1 << 12, prune=False)
        assert len(tiles) == 10  # prune=False stays the plain running top-k
        assert torch.equal(fast, plain)
        short = indexer_topk(iq[:, :20], iw[:, :20], ik, vis[:20], topk, 1 << 12)
    assert len(tiles) == 10 and torch.equal(short, plain[:, :20])  # 20 rows < the tile's 24: eager


def test_indexer_compiled_group_maxima_rank_equal_scores_by_recency(monkeypatch):
    """Keys repeated exactly (real DNA's runs give equal pool keys): every group holds the best score, and the groups
    are ranked by their tie-breaks, so each tile scores again about 2 k groups, not all of them, and keeps the most
    recent keys of the best score, as the plain running top-k."""
    import genoctx.model.dsa as dsa

    tiles = _grouped_setup(monkeypatch)
    widths, real_island = [], dsa.island

    def spy(name, t):
        if name == "dsa.indexer.scores" and t.dim() == 2:
            widths.append(t.shape[1])
        return real_island(name, t)

    monkeypatch.setattr(dsa, "island", spy)
    torch.manual_seed(7)
    S, T, topk = 2600, 48, 4
    iq, iw, ik = _indexer_inputs(1, T, (S + T) // 4, H_I=2, d_I=8, dtype=torch.float32)
    ik = ik[:, :3][:, torch.randint(0, 3, (ik.shape[1],))]  # three distinct keys, repeated at random
    iw = iw.abs() * 1e-6  # scores ~1e-6: the tie-break (pool x 2^-40) stays representable
    vis = (torch.arange(S, S + T) + 1) // 4
    fast = indexer_topk(iq, iw, ik, vis, topk, 1 << 12)
    assert tiles == [24, 24] and max(widths) <= (3 * topk + 2) * 8  # 83 groups of 8 seen, at most 14 scored again
    assert torch.equal(fast, indexer_topk(iq, iw, ik, vis, topk, 1 << 12, prune=False))


def test_indexer_compiled_scorer_falls_back_once(monkeypatch, caplog):
    """A compile that fails (no C++ compiler) is logged once and the call goes on with eager scores: same keys."""
    import genoctx.model.dsa as dsa

    tiles = _grouped_setup(monkeypatch)
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("InductorError: no C++ compiler\nmore")

    monkeypatch.setitem(dsa._COMPILED, "group_max", broken)
    torch.manual_seed(6)
    iq, iw, ik = _indexer_inputs(1, 48, 700, H_I=2, d_I=8, dtype=torch.float32)
    vis = (torch.arange(2600, 2648) + 1) // 4
    with caplog.at_level("WARNING", logger="genoctx"):
        fast = indexer_topk(iq, iw, ik, vis, 8, 1 << 12)
    assert len(calls) == 1 and len(tiles) == 2 and dsa._COMPILED["group_max"] is None
    assert [r.getMessage() for r in caplog.records] == [
        "indexer_topk: the compiled CPU scorer failed (InductorError: no C++ compiler); scoring eagerly"
    ]
    assert torch.equal(fast, indexer_topk(iq, iw, ik, vis, 8, 1 << 12, prune=False))
    tiles.clear()
    indexer_topk(iq, iw, ik, vis, 8, 1 << 12)
    assert tiles == []  # no second try in this process: the eager tiles from then on


# ---- selections, pooling ----


def test_selection_tokens_by_hand():
    """Pools expanded to their tokens, empty slots -1, then the visible tokens of the query's incomplete pool."""
    pools = torch.tensor([[[2, 0, -1], [1, -1, -1]]], dtype=torch.int32)
    sel = DSASelection(pools, torch.tensor([13, 4]), kpool=4, tail=True)
    assert sel.width == 3 * 4 + 3
    want = [
        [8, 9, 10, 11, 0, 1, 2, 3, -1, -1, -1, -1, 12, 13, -1],  # pos 13: tail 12, 13
        [4, 5, 6, 7, -1, -1, -1, -1, -1, -1, -1, -1, 4, -1, -1],  # pos 4: tail 4
    ]
    assert sel.tokens().tolist() == [want]
    off = DSASelection(pools, torch.tensor([13, 4]), kpool=4, tail=False)
    assert off.width == 12 and off.tokens().tolist() == [[w[:12] for w in want]]
    assert sel.rows(1, 2).tokens().tolist() == [[want[1]]]


def test_pool_keys_and_extend_across_chunks():
    """``Indexer.pool`` equals the loop reference; extending the pooled keys chunk by chunk (carrying the incomplete
    pool's keys and gates) equals pooling the whole sequence."""
    layer = _layer(index_kpool=4)
    ind = layer.indexer
    x = torch.randn(2, 23, D, dtype=F64)
    k, g = ind.keys(x)
    torch.testing.assert_close(ind.pool(k[:, :20], g[:, :20]), pool_keys_reference(k[:, :20], g[:, :20],
                               ind.index_kpool_compress_ape, 4), **TOL)  # fmt: skip
    cache = None
    for a, b in ((0, 3), (3, 9), (9, 10), (10, 23)):
        pk, tk, tg = ind.extend(cache, k[:, a:b], g[:, a:b])
        cache = DSACache(torch.zeros(2, b, 12, dtype=F64), pk, tk, tg)
        assert pk.shape[1] == b // 4 and tk.shape[1] == b % 4
    torch.testing.assert_close(cache.pool_k, ind.pool(k[:, :20], g[:, :20]), **TOL)
    torch.testing.assert_close(cache.tail_k, k[:, 20:], **TOL)
    # the carried tail is a copy: a view would keep the chunk's keys alive as long as the cache (the chunked backward
    # keeps every boundary's tail to the end of the step)
    assert cache.tail_k.untyped_storage().nbytes() == cache.tail_k.numel() * cache.tail_k.element_size()
    assert cache.tail_gate.untyped_storage().nbytes() == cache.tail_gate.numel() * cache.tail_gate.element_size()


def test_gather_rows_reads_a_batch_strided_view_without_copying_it(monkeypatch):
    """``_gather_rows`` on a prefix view ``window[:, :n]`` of a longer batched window (``join_latents``): the same rows
    as on a contiguous copy, and no reshape of the whole view (which would copy it on every query tile)."""
    from genoctx.model import dsa

    window = torch.randn(3, 40, 5, dtype=F64)
    view = window[:, :25]
    idx = torch.randint(0, 25, (3, 7, 4))
    want = dsa._gather_rows(view.contiguous(), idx)
    torch.testing.assert_close(want[1, 2, 3], view[1, idx[1, 2, 3]], rtol=0, atol=0)
    reshape = torch.Tensor.reshape

    def no_copy(t, *a, **k):
        if t.untyped_storage().data_ptr() == window.untyped_storage().data_ptr():
            pytest.fail("reshape of the view (a copy of all its rows)")
        return reshape(t, *a, **k)

    monkeypatch.setattr(torch.Tensor, "reshape", no_copy)
    got = dsa._gather_rows(view, idx)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---- sparse attention ----


@pytest.mark.parametrize("kpool,tail", [(1, False), (4, True), (4, False), (16, True)])
@pytest.mark.parametrize("tile", [1, 7, 1 << 16])
def test_sparse_mla_matches_masked_reference(kpool, tail, tile):
    """``sparse_mla`` over a selection (queries after 5 cached positions) equals the dense masked softmax, values and
    gradients w.r.t. queries and every latent (cached ones included); latents never selected get exactly zero
    gradient; a query with nothing selected (tail off, no complete pool seen yet) gets 0."""
    B, S, T, H, R = 2, 2, 43, 4, 6
    pos = torch.arange(S, S + T)
    iq, iw, pk = _indexer_inputs(B, T, (S + T) // kpool)
    pools = indexer_topk(iq, iw, pk, (pos + 1) // kpool, 12 // kpool if kpool < 16 else 1, 64, torch.int32)
    sel = DSASelection(pools, pos, kpool, tail)
    keep = _mask(sel.tokens(), S + T)
    assert bool((keep.sum(-1) < pos + 1)[:, -10:].all())  # later queries skip visible keys
    q = torch.randn(B, T, H, R, dtype=F64, requires_grad=True)
    kv = torch.randn(B, S + T, R, dtype=F64, requires_grad=True)
    do = torch.randn(B, T, H, R, dtype=F64)
    o = sparse_mla(q, kv, sel, 0.4, tile_tokens=tile)
    g = torch.autograd.grad(o, (q, kv), do)
    o_ref = masked_mla_attention(q, kv, keep, 0.4)
    g_ref = torch.autograd.grad(o_ref, (q, kv), do)
    torch.testing.assert_close(o, o_ref, **TOL)
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    chosen = keep.any(1)  # [B, N]
    assert bool((g[1][~chosen] == 0).all()) and (kpool == 16 or bool((~chosen).any()))
    empty = ~keep.any(-1)  # [B, T]
    if not tail and kpool > 1:
        assert bool(empty.any()) and bool((o[empty] == 0).all())


def test_sparse_mla_fp32_close_to_fp64_and_raises():
    B, T, H, R = 1, 17, 2, 4
    pos = torch.arange(T)
    iq, iw, pk = _indexer_inputs(B, T, T // 4)
    sel = DSASelection(indexer_topk(iq, iw, pk, (pos + 1) // 4, 2, 32, torch.int32), pos, 4, True)
    q, kv = torch.randn(B, T, H, R), torch.randn(B, T, R)
    o = sparse_mla(q, kv, sel, 0.5)
    assert o.dtype == torch.float32
    ref = masked_mla_attention(q.double(), kv.double(), _mask(sel.tokens(), T), 0.5)
    torch.testing.assert_close(o.double(), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="bad shapes"):
        sparse_mla(q, kv[..., :3], sel, 0.5)


# ---- the layer ----


@pytest.mark.parametrize("kpool,tail", [(1, False), (4, True), (4, False), (16, True), (16, False)])
def test_layer_sparse_matches_dsa_layer_reference(kpool, tail):
    """The layer (absorbed MLA, tiled indexer, gathered attention) equals the obvious computation: expanded per-head
    keys and values, the full pooled score matrix, an L x L mask (values and gradients w.r.t. x and the main
    parameters); the selected tokens are the reference's and far fewer than dense."""
    B, T = 2, 77
    layer = _layer(index_kpool=kpool, index_topk=16 if kpool < 16 else 32, index_kpool_always_select_tail=tail,
                   indexer_tile_tokens=40)  # fmt: skip
    x = torch.randn(B, T, D, dtype=F64, requires_grad=True)
    y, cache, sel = layer(x)
    y_ref, keep = dsa_layer_reference(layer, x)
    assert torch.equal(_mask(sel.tokens(), T), keep)
    torch.testing.assert_close(y, y_ref, **TOL)
    main = [p for n, p in layer.named_parameters() if not n.startswith("indexer.")]
    gy = torch.randn_like(y)
    g = torch.autograd.grad(y, [x, *main], gy)
    g_ref = torch.autograd.grad(y_ref, [x, *main], gy)
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    pos = torch.arange(T)
    assert layer.stats["path"] == "sparse" and layer.stats["indexer"] == "full"
    assert layer.stats["keys_scored"] == B * int(((pos + 1) // kpool).sum())
    assert layer.stats["keys_attended"] == int(keep.sum())
    assert bool((keep.sum(-1) < pos + 1)[:, -20:].all())  # later queries skip visible keys
    loss = layer.stats["indexer_loss"]  # kept on the device until read (genoctx.model.host): no sync per layer
    assert loss.dim() == 0 and loss.dtype.is_floating_point and not loss.requires_grad
    assert cache.latent.shape == (B, T, 12) and cache.pool_k.shape == (B, T // kpool, 8)


def test_layer_topk_ge_length_equals_dense():
    """A selection that covers every visible token (top-k pools >= all complete pools, plus the tail) equals dense
    causal attention: the sparse layer, the same layer in ``dsa_mode="dense"`` and the plain reference."""
    B, T = 2, 23
    sparse = _layer(index_topk=64)
    dense = _layer(index_topk=64, dsa_mode="dense", indexer_stage="off", indexer_tile_tokens=50)
    dense.load_state_dict(sparse.state_dict())
    x = torch.randn(B, T, D, dtype=F64, requires_grad=True)
    dy = torch.randn(B, T, D, dtype=F64)
    outs = []
    for layer in (sparse, dense):
        y, _, sel = layer(x)
        outs.append((y, *torch.autograd.grad(y, (x, layer.q_b_proj.weight, layer.kv_b_proj.weight), dy)))
    assert sel is None and dense.stats["path"] == "dense" and dense.stats["keys_scored"] == 0
    assert sparse.stats["path"] == "sparse" and sparse.stats["keys_attended"] == B * T * (T + 1) // 2
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    L = sparse
    q = L.q_b_proj(L.q_a_layernorm(L.q_a_proj(x))).view(B, T, 4, 8)
    W_UK, W_UV = L.absorbed()
    o = dense_causal_attention(torch.einsum("bthd,hdr->bthr", q, W_UK), L.latent(x), L.scale)
    ref = L.o_proj(torch.einsum("bthr,hvr->bthv", o, W_UV).reshape(B, T, 4 * 6))
    torch.testing.assert_close(outs[0][0], ref, **TOL)


def test_shared_layer_uses_the_selection_before_it():
    """A "shared" layer (no indexer) attends to the tokens the full layer before it selected."""
    kw = dict(num_hidden_layers=2, layer_types="DD", mlp_layer_types="DD", indexer_types="FS", index_topk=8)
    full, shared = _layer(layer_idx=0, **kw), _layer(layer_idx=1, **kw)
    assert shared.indexer is None and "indexer.wk.weight" not in shared.state_dict()
    x = torch.randn(2, 41, D, dtype=F64)
    _, _, sel = full(x)
    _, keep = dsa_layer_reference(full, x)
    y, cache, sel2 = shared(x, None, sel)
    assert sel2 is sel and cache.pool_k is None and shared.stats["indexer"] == "shared"
    torch.testing.assert_close(y, dsa_layer_reference(shared, x, keep)[0], **TOL)
    assert shared.stats["keys_attended"] == full.stats["keys_attended"] and shared.stats["keys_scored"] == 0
    with pytest.raises(ValueError, match="needs the selection"):
        shared(x)
    with pytest.raises(ValueError, match="selection of"):
        shared(x[:, :40], None, sel)


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_two_chunks_with_cache_equal_one_pass(mode):
    """Chunks of 19 and 26 tokens (neither a multiple of the pool of 4) with the carried cache equal one pass: the
    output, the indexer KL (weighted by chunk length), every gradient and the final cache."""
    B, T1, T2 = 2, 19, 26
    layer = _layer(index_topk=8, indexer_tile_tokens=40, dsa_mode=mode)
    x = torch.randn(B, T1 + T2, D, dtype=F64, requires_grad=True)
    dy = torch.randn(B, T1 + T2, D, dtype=F64)
    params = [x, *layer.parameters()]

    y_full, c_full, _ = layer(x)
    aux_full = layer.aux_loss
    g_full = torch.autograd.grad((y_full * dy).sum() + aux_full, params)

    y1, c1, _ = layer(x[:, :T1])
    aux1 = layer.aux_loss
    y2, c2, _ = layer(x[:, T1:], c1)
    aux2 = layer.aux_loss
    assert c1.length == T1 and c2.length == T1 + T2 and c1.tail_k.shape[1] == T1 % 4
    y = torch.cat([y1, y2], 1)
    aux = (aux1 * T1 + aux2 * T2) / (T1 + T2)  # each chunk's KL is a mean over its queries
    g = torch.autograd.grad((y * dy).sum() + aux, params)
    torch.testing.assert_close(y, y_full, **TOL)
    torch.testing.assert_close(aux, aux_full, **TOL)
    for name in ("latent", "pool_k", "tail_k", "tail_gate"):
        torch.testing.assert_close(getattr(c2, name), getattr(c_full, name), **TOL)
    for a, b in zip(g, g_full, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_cache_of_zero_length_is_no_cache():
    layer = _layer()
    x = torch.randn(1, 9, D, dtype=F64)
    z = torch.zeros(1, 0, 8, dtype=F64)
    empty = DSACache(torch.zeros(1, 0, 12, dtype=F64), z, z, z)
    torch.testing.assert_close(layer(x, empty)[0], layer(x)[0], **TOL)
    _, cache, _ = layer(x)
    k, g = layer.indexer.keys(x)
    built = layer.cache_of(layer.latent(x), k, g)
    for name in ("latent", "pool_k", "tail_k", "tail_gate"):
        torch.testing.assert_close(getattr(built, name), getattr(cache, name), **TOL)


# ---- the indexer's KL loss ----


def _kl_reference(layer, x, stage):
    """Pooled indexer KL of DeepSeek-V3.2 from full matrices (mean over the B x T queries): target = the main
    attention (heads summed) summed per pool and renormalised over the pools compared (stage "sparse": the selected
    pools, attention over the selected tokens and the tail; "warmup": every visible complete pool, dense attention),
    model = softmax of the pooled indexer scores over the same pools. Differentiable w.r.t. the indexer only."""
    B, T, _ = x.shape
    ind, kp = layer.indexer, layer.kpool
    xd = x.detach()
    with torch.no_grad():
        q = layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(xd))).view(B, T, layer.n_heads, layer.qk_head_dim)
        W_UK, _ = layer.absorbed()
        s = torch.einsum("bthr,bsr->bhts", torch.einsum("bthd,hdr->bthr", q, W_UK), layer.latent(xd)) * layer.scale
    k, g = ind.keys(xd)
    P = T // kp
    pk = ind.pool(k[:, : P * kp], g[:, : P * kp])
    iq, iw = ind.queries(xd, layer.q_a_layernorm(layer.q_a_proj(xd)).detach())
    pos = torch.arange(T)
    logits = pooled_indexer_scores_reference(iq, iw, pk, pos, kp)  # [B, T, P], -inf where not visible
    if stage == "sparse":
        keep = selection_reference(iq.detach(), iw.detach(), pk.detach(), pos, kp, layer.topk, layer.tail)
        valid = keep[..., : P * kp].view(B, T, P, kp).all(-1)
    else:
        keep = (torch.arange(T)[None, :] <= pos[:, None]).expand(B, T, T)
        valid = ~torch.isneginf(logits)
    att = torch.nan_to_num(torch.softmax(s.masked_fill(~keep[:, None], float("-inf")), -1)).sum(1)  # [B, T, T]
    p = att[..., : P * kp].view(B, T, P, kp).sum(-1) * valid
    rows = valid.any(-1, keepdim=True)
    p = torch.where(rows, p / p.sum(-1, keepdim=True).clamp_min(1e-300), 0.0)
    logq = torch.log_softmax(logits.masked_fill(~valid, float("-inf")).masked_fill(~rows, 0.0), -1)
    return (torch.xlogy(p, p) - p * logq.masked_fill(~valid, 0.0)).sum() / (B * T)


@pytest.mark.parametrize("stage", ["sparse", "warmup"])
@pytest.mark.parametrize("kpool", [1, 4])
def test_indexer_loss_value_and_gradient_isolation(stage, kpool):
    """The indexer KL (hand-written gradient in stage "sparse", checkpointed tiles in "warmup") equals the reference
    value and gradients; it reaches only the indexer, and the LM path never reaches the indexer."""
    B, T = 2, 30
    mode = "dense" if stage == "warmup" else "sparse"
    layer = _layer(index_kpool=kpool, index_topk=8, indexer_stage=stage, indexer_loss_coef=0.5, dsa_mode=mode,
                   indexer_tile_tokens=300)  # fmt: skip
    x = torch.randn(B, T, D, dtype=F64, requires_grad=True)
    y, _, _ = layer(x)
    assert layer.aux_loss is not None
    kl_ref = _kl_reference(layer, x, stage)
    torch.testing.assert_close(layer.aux_loss, 0.5 * kl_ref, **TOL)
    indexer = list(layer.indexer.parameters())
    g = torch.autograd.grad(layer.aux_loss, indexer, retain_graph=True)
    g_ref = torch.autograd.grad(0.5 * kl_ref, indexer)
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    assert layer.stats["indexer_loss"] == pytest.approx(float(layer.aux_loss.detach()) / 0.5, rel=1e-12)
    main = [p for n, p in layer.named_parameters() if not n.startswith("indexer.")]
    g = torch.autograd.grad(layer.aux_loss, main + indexer + [x], allow_unused=True)
    assert all(t is None or bool((t == 0).all()) for t in g[: len(main)] + (g[-1],))
    assert sum(t is not None and float(t.abs().sum()) > 0 for t in g[len(main) : -1]) >= 5
    g = torch.autograd.grad(y.sum(), main + indexer, allow_unused=True)
    assert all(t is not None and float(t.abs().sum()) > 0 for t in g[: len(main)])
    assert all(t is None for t in g[len(main) :])


def test_indexer_loss_finite_on_first_tokens_and_off_when_no_grad():
    """Chunks shorter than a pool (no pool to compare yet) give KL 0 with finite gradients; no grad -> no loss."""
    layer = _layer(index_topk=8, dtype=torch.float32)
    for T in (1, 2, 3, 5):
        layer(torch.randn(1, T, D))
        assert torch.isfinite(layer.aux_loss)
        gs = torch.autograd.grad(layer.aux_loss, list(layer.parameters()), allow_unused=True)
        assert all(g is None or bool(torch.isfinite(g).all()) for g in gs)
        if T < 8:  # at most one complete pool: nothing to rank (one pool: both distributions one-hot)
            assert float(layer.aux_loss.detach()) == 0.0
    with torch.no_grad():
        layer(torch.randn(1, 5, D))
    assert layer.aux_loss is None and layer.stats["indexer_loss"] is None
    off = _layer(indexer_stage="off")
    off(torch.randn(1, 5, D, dtype=F64))
    assert off.aux_loss is None and off.stats["path"] == "sparse"


def test_layer_saves_no_quadratic_tensor():
    """What autograd keeps for backward (LM loss and indexer KL) is O(T x selected tokens): no [T, T] tensor."""
    T = 512
    layer = _layer(dtype=torch.float32, index_topk=8, indexer_tile_tokens=4096)
    x = torch.randn(1, T, D, requires_grad=True)
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, _, _ = layer(x)
        (y.sum() + layer.aux_loss).backward()
    widest = 4 * 12  # q_abs: 4 heads x kv_lora_rank 12 per token
    assert max(sizes) <= T * widest < T * T // 8
    assert layer.indexer.wq_b.weight.grad is not None


def _chr22_tokens(realdna, n):
    seq = (realdna / "hg38_chr22_32000001-32300000.fa").read_text().split("\n", 1)[1][: n + 1000]
    table = {c: i for i, c in enumerate("ACGTN")}
    return torch.tensor([table[c] for c in seq.upper()[1000 : 1000 + n]])


def test_real_dna_chr22(realdna):
    """chr22 bases -> embedding -> the layer: equal to the reference (values, embedding gradients, selection), and two
    chunks over the real sequence equal one pass."""
    T1, T2 = 96, 64
    tokens = _chr22_tokens(realdna, T1 + T2)[None]
    emb = nn.Embedding(5, D).to(F64)
    layer = _layer(index_topk=24, indexer_tile_tokens=500)
    x = emb(tokens)
    y_full, _, sel = layer(x)
    y_ref, keep = dsa_layer_reference(layer, x)
    torch.testing.assert_close(y_full, y_ref, **TOL)
    assert torch.equal(_mask(sel.tokens(), T1 + T2), keep)
    ge = torch.autograd.grad(y_full.square().sum(), emb.weight, retain_graph=True)[0]
    ge_ref = torch.autograd.grad(y_ref.square().sum(), emb.weight)[0]
    torch.testing.assert_close(ge, ge_ref, **TOL)
    y1, c1, _ = layer(x[:, :T1])
    y2, _, _ = layer(x[:, T1:], c1)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y_full, **TOL)
