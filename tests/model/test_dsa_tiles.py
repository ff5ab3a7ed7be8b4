"""The sparse-attention tiles of the DSA layer (issue 46): ``_SparseMLA`` and ``_IndexerKLSparse`` (tiles of flattened
query rows, one bmm per product) equal their references ``_SparseMLARef`` / ``_IndexerKLSparseRef`` forward and
backward; their aten op counts are the formulas reported to the planner; tiles are sized in bytes."""

from __future__ import annotations

import pytest
import torch

from genoctx.model import dsa
from genoctx.model.config import preset
from genoctx.model.opcount import OpCounter

F64 = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)


def _case(B, T, kp, K, tail, dtype=F64, S=3, window=0):
    """Queries after ``S`` cached positions; random pools (``-1`` = empty; visible or not); ``kv`` a prefix view of a
    longer window when ``window`` (the chunked backward's ``join_latents``)."""
    g = torch.Generator().manual_seed(B * 100 + T + kp + K + tail)
    pos = torch.arange(S, S + T)
    pools = torch.randint(-1, (S + T) // kp, (B, T, K), generator=g, dtype=torch.int32)
    sel = dsa.DSASelection(pools, pos, kp, tail)
    q = torch.randn(B, T, 4, 6, generator=g, dtype=dtype).requires_grad_()
    kvw = torch.randn(B, S + T + window, 6, generator=g, dtype=dtype).requires_grad_()
    iq = torch.randn(B, T, 3, 5, generator=g, dtype=dtype).requires_grad_()
    iw = torch.randn(B, T, 3, generator=g, dtype=dtype).requires_grad_()
    pk = torch.randn(B, (S + T) // kp, 5, generator=g, dtype=dtype).requires_grad_()
    return sel, q, kvw, iq, iw, pk


def _assert_equal_references(sel, q, kvw, kv, iq, iw, pk, args, K, *ratio):
    """``_SparseMLA`` and ``_IndexerKLSparse`` (with ``ratio``: their dense-tile ratio) equal their gathering
    references in value and every gradient (q and the latents ``kvw`` of which ``kv`` is a prefix; index_q,
    index_w, pooled keys); ``args`` = ``(pools, pos, kpool, tail, scale, tile)``."""
    o, o_ref = dsa._SparseMLA.apply(q, kv, *args, *ratio), dsa._SparseMLARef.apply(q, kv, *args)
    torch.testing.assert_close(o, o_ref, **TOL)
    do = torch.randn_like(o)
    g, g_ref = torch.autograd.grad(o, (q, kvw), do), torch.autograd.grad(o_ref, (q, kvw), do)
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    rows = max(1, args[-1] // max(1, sel.width))
    kl = dsa._IndexerKLSparse.apply(iq, iw, pk, q.detach(), kv.detach(), *args, *ratio)
    kl_ref = dsa._IndexerKLSparseRef.apply(iq, iw, pk, q.detach(), kv.detach(), *args[:-1], rows)
    assert K == 1 or float(kl_ref.detach()) > 0  # one pool: both distributions one-hot
    torch.testing.assert_close(kl, kl_ref, **TOL)
    g, g_ref = torch.autograd.grad(2 * kl, (iq, iw, pk)), torch.autograd.grad(2 * kl_ref, (iq, iw, pk))
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("kp,K,tail", [(1, 5, False), (4, 3, True), (4, 3, False), (16, 1, True)])
@pytest.mark.parametrize("B,window", [(1, 0), (2, 0), (2, 7)])
@pytest.mark.parametrize("tile", [1, 29, 1 << 20])
def test_sparse_mla_and_kl_equal_their_references(kp, K, tail, B, window, tile):
    """Values and every gradient (q, the latents incl. a strided window prefix; index_q, index_w, pooled keys) of the
    tiled Functions equal the per-tile-expanding references, for one row per tile, a few tiles and one tile."""
    sel, q, kvw, iq, iw, pk = _case(B, 21, kp, K, tail, window=window)
    n = sel.pos[-1] + 1
    kv = kvw[:, :n]
    _assert_equal_references(sel, q, kvw, kv, iq, iw, pk, (sel.pools, sel.pos, kp, tail, 0.4, tile), K)


# fp32, one process: ops of a call with t tiles, (per call, per tile); batch > 1 adds a few per call
OPS = {  # (tail on, B): {pass: (a, b)} -> a + b t
    (True, 1): {"fwd": (27, 21), "bwd": (31, 33), "kl": (41, 61), "kl_bwd": (7, 0)},
    (False, 1): {"fwd": (16, 19), "bwd": (20, 31), "kl": (30, 59), "kl_bwd": (7, 0)},
    (True, 2): {"fwd": (32, 21), "bwd": (36, 33), "kl": (50, 61), "kl_bwd": (7, 0)},
}


@pytest.mark.parametrize("tail,B", list(OPS))
@pytest.mark.parametrize("tiles", [1, 3])
def test_op_counts_are_the_formula(tail, B, tiles):
    """The aten ops (TorchDispatchMode) of sparse attention forward/backward and of the indexer KL forward/backward
    are ``a + b x tiles`` (``OPS``), independent of the tokens per tile."""
    T = 24
    sel, q, kv, iq, iw, pk = _case(B, T, 4, 3, tail, dtype=torch.float32, S=0)
    tile = sel.width * (T // tiles)
    args = (sel.pools, sel.pos, 4, tail, 0.5, tile)
    got = {}
    with OpCounter() as c:
        o = dsa._SparseMLA.apply(q, kv, *args)
    do = torch.randn_like(o)  # contiguous (a ones_like gradient may arrive expanded: one copy more)
    got["fwd"] = c.total
    with OpCounter() as c:
        o.backward(do)
    got["bwd"] = c.total
    with OpCounter() as c:
        kl = dsa._IndexerKLSparse.apply(iq, iw, pk, q.detach(), kv.detach(), *args)
    got["kl"] = c.total
    with OpCounter() as c:
        kl.backward()
    got["kl_bwd"] = c.total
    assert got == {k: a + b * tiles for k, (a, b) in OPS[(tail, B)].items()}


def test_attention_tiles_are_sized_in_bytes():
    """glm-5.3-flash keeps its tile (ATTN_TILE_TOKENS, 31 query rows of 2063 tokens); cpu-small (latent 64, 4 heads)
    gets 2048 rows per tile: one tile at 2k tokens, four at 8k (today 9 and 34)."""
    big, small = preset("glm-5.3-flash"), preset("cpu-small")
    assert dsa.attn_tile_tokens(big.kv_lora_rank, big.num_attention_heads) == dsa.ATTN_TILE_TOKENS
    width = small.index_topk + small.index_kpool - 1
    tile = dsa.attn_tile_tokens(small.kv_lora_rank, small.num_attention_heads)
    assert tile // width == 2048
    layer = dsa.DeepSeekSparseAttention(small, 3)
    assert layer.attn_tile_tokens == tile
    assert tile * (small.kv_lora_rank + small.num_attention_heads) * 4 <= dsa.ATTN_TILE_BYTES


def _valid(sel, *rest):
    """``_case`` with a selection the indexer can make (the dense path's precondition): each query's pools distinct
    and complete at its position, in random order, some slots empty."""
    g = torch.Generator().manual_seed(7)
    B, T, K = sel.pools.shape
    pools = torch.full((B, T, K), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(T):
            vis = torch.randperm(int(sel.pos[t] + 1) // sel.kpool, generator=g)[:K]
            keep = vis[torch.rand(len(vis), generator=g) < 0.8]
            pools[b, t, : len(keep)] = keep.int()
    return dsa.DSASelection(pools, sel.pos, sel.kpool, sel.tail), *rest


@pytest.mark.parametrize("kp,K,tail", [(1, 5, False), (4, 3, True), (4, 3, False), (16, 1, True)])
@pytest.mark.parametrize("B,window,S", [(1, 0, 3), (2, 7, 3), (1, 0, 0), (2, 0, 9)])
@pytest.mark.parametrize("dense,tile", [(21, 1 << 20), (21, 40), (12, 1 << 20), (5, 29)])
def test_dense_tiles_equal_the_references(kp, K, tail, B, window, S, dense, tile, monkeypatch):
    """Short windows: tiles that attend densely (all visible keys, the selection as a 0/-inf bias) give the values
    and every gradient of the gathering references, in fp64 at 1e-9: all rows dense (one or several dense tiles), or
    a dense prefix then sparse tiles; with a cache, tail on/off, B = 2 and a strided window prefix."""
    sel, q, kvw, iq, iw, pk = _valid(*_case(B, 21, kp, K, tail, S=S, window=window))
    kv = kvw[:, : S + 21]
    ratio = (S + dense + 0.5) / sel.width  # the first ``dense`` query rows attend densely
    assert dsa._dense_split(sel.width, S + 21, 21, 4, 6, tile, ratio)[0] == dense
    calls = []
    scores = dsa._dense_scores
    monkeypatch.setattr(dsa, "_dense_scores", lambda *a: calls.append(1) or scores(*a))
    _assert_equal_references(sel, q, kvw, kv, iq, iw, pk, (sel.pools, sel.pos, kp, tail, 0.4, tile), K, ratio)
    assert len(calls) >= 3  # forward, backward and the KL each ran a dense tile


def test_dense_tiles_fp32_and_sizes():
    """fp32: the dense path equals the fp32 sparse path at fp32 tolerance; dense tiles fit the sparse tile's bytes."""
    sel, q, kv, iq, iw, pk = _valid(*_case(2, 40, 4, 3, True, dtype=torch.float32, S=5))
    args = (sel.pools, sel.pos, 4, True, 0.4, 1 << 20)
    o, o_ref = dsa._SparseMLA.apply(q, kv, *args, 100.0), dsa._SparseMLA.apply(q, kv, *args)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)
    do = torch.randn_like(o)
    for a, b in zip(torch.autograd.grad(o, (q, kv), do), torch.autograd.grad(o_ref, (q, kv), do), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    kl = dsa._IndexerKLSparse.apply(iq, iw, pk, q.detach(), kv.detach(), *args, 100.0)
    torch.testing.assert_close(kl, dsa._IndexerKLSparse.apply(iq, iw, pk, q.detach(), kv.detach(), *args))
    W, H, R, tile = 271, 4, 64, dsa.attn_tile_tokens(64, 4)  # cpu-small
    split, rows = dsa._dense_split(W, 4096, 4096, H, R, tile, dsa.DENSE_RATIO)
    assert split == 542 and rows * (split * (H + 1)) <= tile * (R + H)
    assert dsa._dense_split(W, 4096 + 600, 4096, H, R, tile, dsa.DENSE_RATIO) == (0, 1)  # cache past 2 W: sparse
    assert dsa._dense_split(W, 100, 100, H, R, 300, dsa.DENSE_RATIO) == (100, 300 * 68 // (100 * 5))


def test_planner_mirrors_the_dense_rule():
    """genoctx.plan.sizes mirrors the dense split (it imports no torch): same ratio, same rows for tiny and cpu-small,
    with and without a cache."""
    from genoctx.plan import sizes

    assert sizes.DENSE_RATIO == dsa.DENSE_RATIO
    for name in ("tiny", "cpu-small"):
        cfg = preset(name)
        W, H, R = cfg.index_topk + cfg.index_kpool - 1, cfg.num_attention_heads, cfg.kv_lora_rank
        for T, S in ((64, 0), (2048, 0), (300, 100), (2048, 1024)):
            split, rows = dsa._dense_split(W, S + T, T, H, R, dsa.attn_tile_tokens(R, H), dsa.DENSE_RATIO)
            assert sizes._dense_part(cfg, T, S) == (split, min(split, rows) * (S + split) if split else 0)
