"""KPool lightning indexer: pooled scores and per-query top-k in one Triton kernel (DeepSeek-V3.2 DSA, pooled).

PyTorch reference: ``genoctx.model.dsa.indexer_topk`` (same arguments, same result); the slow full-matrix oracle is
``genoctx.model.reference.pooled_indexer_scores_reference``.

For query ``t`` and key (pool) ``s < visible[t]``::

    I[t, s] = sum_j index_w[t, j] * ReLU(index_q[t, j] . index_k[s])          (fp32 accumulation)
    v[t, s] = fl32(I[t, s] + s * TIE_BREAK)                                    (TIE_BREAK = 2^-40)

and the result is, per query, the ``K = min(topk, N)`` keys of largest ``v``, in descending ``v``, equal ``v`` broken
toward the larger key index (the most recent pool), ``-1`` in slots beyond the query's visible keys: exactly
``dsa.indexer_topk`` (its tie-break term, its final sort: index descending, then a stable sort by value descending).
With pools, ``visible[t] = (pos_t + 1) // index_kpool``: only complete pools are visible (causality).

Design:

- One program per ``BLOCK_M`` queries of one batch row. Its ``BLOCK_M x H_I`` query rows form one matrix, so a key
  block ``[BLOCK_N, d_I]`` costs one ``tl.dot`` for every head; ReLU, head weights and the head sum follow in
  registers. Key blocks are visited from the most recent backwards (the threshold rises early).
- Each ``(v, s)`` is packed into one int64 ``key = (ord32(v) << 32) | s`` where ``ord32`` maps fp32 to int32
  monotonically. Sorting keys descending sorts by value, then by index descending: the reference's tie rule, with
  no separate index array. Invisible keys get ``EMPTY`` (below every real key) and come out as ``-1``.
- A running top-``KP`` (``KP`` = next power of two >= K) per query lives in registers: a block is merged only if
  one of its keys beats some row's current ``KP``-th best, otherwise skipped. The merge (``_merge``) is a bitonic
  ``tl.topk`` on a GPU and a rank merge under the interpreter (each bitonic stage costs milliseconds there); both
  are exact, both are tested, and the result does not depend on the block sizes.
- The ``[T, N]`` score matrix is never written: per program only a ``[BLOCK_M, BLOCK_N]`` tile exists.
- Offsets are int64 (batch, query, head, key indices are widened before they meet a stride): 1M queries x 32
  heads x 128 channels pass 2^31 elements.

Equality with the PyTorch path: the products are those of the reference (the dot runs in the promoted dtype of
``index_q`` and ``index_k``: fp32 ``ieee`` when either is fp32; fp16/bf16 products are exact in the fp32
accumulator). Only the order of the fp32 sums differs, so the selection is identical whenever scores are computed
exactly (tested with dyadic inputs, ties included) and otherwise can differ only where two scores are within fp32
rounding of each other. Where two keys tie exactly at the k-th place the PyTorch path may keep either (its
docstring); the kernel keeps the more recent one. ``dot_dtype=torch.bfloat16`` trades exact products for
tensor-core speed when the keys are fp32 (as under bf16 autocast, where pooled keys come out of an fp32 LayerNorm).

Shapes and dtypes: ``index_q [B, T, H_I, d_I]``, ``index_w [B, T, H_I]``, ``index_k [B, N, d_I]`` (fp32, fp16 or bf16;
any strides), ``visible [T]`` int64 (non-decreasing, in ``[0, N]``), ``N < 2^31``. Returns ``[B, T, min(topk, N)]``
int64 or int32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.launch import on_device

TIE_BREAK = 2.0**-40  # as genoctx.model.dsa.TIE_BREAK (checked by the tests)
SENTINEL = -1
_EMPTY = -(2**63) + 1  # below every packed key of a finite score


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _pack(v, cols):
    """fp32 values ``v`` and int column indices -> int64 keys ordered by (value, column)."""
    vb = v.to(tl.int32, bitcast=True)
    ordv = tl.where(vb >= 0, vb, vb ^ 0x7FFFFFFF)  # fp32 order as int32 order (v is never -0.0 here)
    return (ordv.to(tl.int64) << 32) | cols.to(tl.int64)


@triton.jit
def _merge(run, keys, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KP: tl.constexpr, MERGE_SORT: tl.constexpr):
    """Top ``KP`` of ``run [BM, KP]`` (sorted descending) and ``keys [BM, BLOCK_N]``, sorted descending.

    ``MERGE_SORT`` (GPU): bitonic ``tl.topk`` of the block, then of the ``2 KP`` union. Otherwise (the interpreter,
    where each bitonic stage costs milliseconds): ``KP == BLOCK_N`` and every element of the union goes to slot
    ``#{larger} + #{equal before it}`` (a permutation; keys are distinct but for ``EMPTY``). Both are exact; the
    tests run both.
    """
    if MERGE_SORT:
        if BLOCK_N > KP:
            cand = tl.topk(keys, KP)
        else:
            cand = keys
        out = tl.topk(tl.reshape(tl.join(run, cand), [BLOCK_M, 2 * KP]), KP)
    else:
        u = tl.reshape(tl.join(run, keys), [BLOCK_M, 2 * KP])  # [BM, U]
        i = tl.arange(0, 2 * KP)
        x = u[:, :, None]
        y = u[:, None, :]
        beats = (y > x) | ((y == x) & (i[None, None, :] < i[None, :, None]))  # [BM, U(x), U(y)]
        rank = tl.sum(beats.to(tl.int32), axis=2)  # [BM, U]
        slot = tl.arange(0, KP)
        out = tl.sum(tl.where(rank[:, :, None] == slot[None, None, :], x, 0), axis=1)  # [BM, KP]
    return out


@triton.jit
def _indexer_topk_kernel(
    q_ptr, w_ptr, k_ptr, vis_ptr, out_ptr,
    T, H, D, K_OUT,
    sq_b, sq_t, sq_h, sq_d,
    sw_b, sw_t, sw_h,
    sk_b, sk_n, sk_d,
    so_b, so_t, so_k,
    tie,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    KP: tl.constexpr, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr, EMPTY: tl.constexpr,
    MERGE_SORT: tl.constexpr, D_CHUNKS: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)  # [BM] query rows
    row_ok = rows < T
    vis = tl.load(vis_ptr + rows, mask=row_ok, other=0).to(tl.int64)  # keys visible to each row
    n_vis = tl.max(vis, axis=0)
    # the tile's queries as one matrix: row r = (query r // BLOCK_H, head r % BLOCK_H)
    r = tl.arange(0, BLOCK_M * BLOCK_H)
    t2 = pid_m.to(tl.int64) * BLOCK_M + (r // BLOCK_H).to(tl.int64)
    h2 = (r % BLOCK_H).to(tl.int64)
    ok2 = (t2 < T) & (h2 < H)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    q_off = b * sq_b + t2 * sq_t + h2 * sq_h
    if D_CHUNKS == 1:  # the whole query tile stays in registers across key blocks
        q = tl.load(q_ptr + q_off[:, None] + d[None, :] * sq_d, mask=ok2[:, None] & (d < D)[None, :], other=0.0)
        q = q.to(DOT_DTYPE)
    w = tl.load(w_ptr + b * sw_b + t2 * sw_t + h2 * sw_h, mask=ok2, other=0.0).to(tl.float32)
    run = tl.full([BLOCK_M, KP], EMPTY, tl.int64)  # running top-KP keys per row, sorted descending
    n_blk = tl.cdiv(n_vis, BLOCK_N)
    for i in range(0, n_blk):
        c0 = (n_blk - 1 - i) * BLOCK_N  # newest block first
        cols = c0 + tl.arange(0, BLOCK_N).to(tl.int64)
        if D_CHUNKS == 1:
            kb = tl.load(
                k_ptr + b * sk_b + cols[:, None] * sk_n + d[None, :] * sk_d,
                mask=(cols < n_vis)[:, None] & (d < D)[None, :],
                other=0.0,
            ).to(DOT_DTYPE)
            s2 = tl.dot(q, tl.trans(kb), input_precision=PREC)  # [BM * BH, BN] fp32
        else:  # channels in chunks: fp32 tiles of the full width do not fit in registers (bench/kernel_compile.py)
            s2 = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_N], tl.float32)
            for c in range(0, D_CHUNKS):
                dc = c * BLOCK_D + d
                dc_ok = dc < D
                qc = tl.load(q_ptr + q_off[:, None] + dc[None, :] * sq_d, mask=ok2[:, None] & dc_ok[None, :],
                             other=0.0).to(DOT_DTYPE)  # fmt: skip
                kc = tl.load(
                    k_ptr + b * sk_b + cols[:, None] * sk_n + dc[None, :] * sk_d,
                    mask=(cols < n_vis)[:, None] & dc_ok[None, :],
                    other=0.0,
                ).to(DOT_DTYPE)
                s2 = tl.dot(qc, tl.trans(kc), s2, input_precision=PREC)
        s2 = tl.maximum(s2, 0.0) * w[:, None]
        s = tl.sum(tl.reshape(s2, [BLOCK_M, BLOCK_H, BLOCK_N]), axis=1)  # [BM, BN] summed over heads
        v = s + cols.to(tl.float32)[None, :] * tie
        keys = tl.where(cols[None, :] < vis[:, None], _pack(v, cols[None, :]), EMPTY)
        kth = tl.min(run, axis=1)  # each row's KP-th best so far
        n_better = tl.sum((keys > kth[:, None]).to(tl.int32), axis=1)
        if tl.max(n_better, axis=0) > 0:
            run = _merge(run, keys, BLOCK_M, BLOCK_N, KP, MERGE_SORT)
    idx = tl.where(run > EMPTY, run.to(tl.int32).to(tl.int64), -1)  # the low 32 bits: the key index (< 2^31)
    j = tl.arange(0, KP).to(tl.int64)
    optr = out_ptr + b * so_b + rows[:, None] * so_t + j[None, :] * so_k
    tl.store(optr, idx.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (j < K_OUT)[None, :])


MERGE_SORT: bool | None = None  # None: bitonic merge on a GPU, rank merge under the interpreter (``_merge``)


def _blocks(H: int, D: int, K: int, dot_bytes: int = 2) -> dict:
    """Block sizes and warps of one launch (``dot_bytes``: 4 for an fp32 dot, 2 for fp16/bf16).

    ``tl.dot`` needs every dimension >= 16; the interpreter gets small blocks (several per test). On a GPU the
    choice is the one ``bench/kernel_compile.py`` shows compiling without spills on sm_90 and sm_100 at
    GLM-5.3-Flash's indexer (32 heads x 128, top-128 pools): ``BM H = 32`` query rows per program (64 spill on
    sm_100), 16-bit dots over the whole channel width in one ``[BM H, D] x [D, BN]`` product, fp32 (``ieee``, no
    tensor cores) dots over channels in chunks of 32 (full-width fp32 tiles spill kilobytes).
    """
    interp = _interpreting()
    merge_sort = (not interp) if MERGE_SORT is None else MERGE_SORT
    BH = triton.next_power_of_2(H)
    BD = max(16, triton.next_power_of_2(D))
    KP = triton.next_power_of_2(K)
    if interp:  # fp32 channels in chunks of 16 here, so that tests with d_I > 16 run the chunked loop
        BM, BN, warps = max(2, 16 // BH), max(16, KP), 1
        if dot_bytes > 2:
            BD = 16
    else:
        BM = max(1, 32 // BH)  # 32 query rows (queries x heads) in one program's dot
        BN = max(64, KP)
        warps = 8
        if dot_bytes > 2:
            BD = min(BD, 32)
    if not merge_sort:
        KP = BN  # the rank merge joins two lists of one width
    return dict(BLOCK_M=BM, BLOCK_H=BH, BLOCK_D=BD, BLOCK_N=BN, KP=KP, MERGE_SORT=merge_sort, num_warps=warps,
                num_stages=2, D_CHUNKS=triton.cdiv(D, BD))


_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _check_static(index_q, index_w, index_k, visible, index_dtype) -> tuple:
    """The checks of ``indexer_topk_launch`` that need no data (shapes, dtypes, sizes; not ``visible``'s values),
    shared with the op's fake kernel. Returns ``(B, T, H_I, d_I, N)``; raises ValueError naming what is wrong."""
    if index_q.dim() != 4 or index_w.shape != index_q.shape[:3] or index_k.dim() != 3:
        raise ValueError(
            f"indexer_topk: bad shapes q {tuple(index_q.shape)}, w {tuple(index_w.shape)}, k {tuple(index_k.shape)}"
        )
    B, T, H, D = index_q.shape
    N = index_k.shape[1]
    if index_k.shape[0] != B or index_k.shape[2] != D:
        raise ValueError(f"indexer_topk: keys {tuple(index_k.shape)} do not fit queries {tuple(index_q.shape)}")
    if visible.shape != (T,) or visible.dtype.is_floating_point:
        raise ValueError(f"indexer_topk: visible must be {T} non-decreasing counts in [0, {N}]")
    if index_dtype not in (torch.long, torch.int32) or (index_dtype == torch.int32 and N >= 2**31):
        raise ValueError(f"indexer_topk: index_dtype must be int64 or int32 (N < 2^31), got {index_dtype}")
    if N >= 2**31:
        raise ValueError(f"indexer_topk (Triton): at most 2^31 - 1 keys (packed in 32 bits), got {N}")
    for name, x in (("index_q", index_q), ("index_w", index_w), ("index_k", index_k)):
        if x.dtype not in _TL:
            raise ValueError(f"indexer_topk (Triton): {name} must be fp32, fp16 or bf16, got {x.dtype}")
    return B, T, H, D, N


def _check_visible_host(vis: list[int], T: int, N: int) -> None:
    """``visible``'s checks on its host copy (no device read). Raises ValueError as ``indexer_topk_launch``."""
    if len(vis) != T or any(b < a for a, b in zip(vis, vis[1:], strict=False)) or (T and (vis[0] < 0 or vis[-1] > N)):
        raise ValueError(f"indexer_topk: visible must be {T} non-decreasing counts in [0, {N}]")


def indexer_topk_launch(
    index_q: torch.Tensor,
    index_w: torch.Tensor,
    index_k: torch.Tensor,
    visible: torch.Tensor,
    topk: int,
    tile_tokens: int | None = None,
    index_dtype: torch.dtype = torch.long,
    prune: bool = True,
    *,
    dot_dtype: torch.dtype | None = None,
    visible_host: list[int] | None = None,
    check_visible: bool = True,
) -> torch.Tensor:
    """Top-k keys (pools) per query by the lightning indexer, fused in one Triton kernel.

    Same call and result as ``genoctx.model.dsa.indexer_topk`` (module docstring: what "same" means).

    Args:
        index_q: ``[B, T, H_I, d_I]`` indexer queries (fp32, fp16 or bf16; any strides).
        index_w: ``[B, T, H_I]`` per-head weights (already scaled).
        index_k: ``[B, N, d_I]`` keys (cache first).
        visible: ``[T]`` integer, keys visible to each query row (non-decreasing, in ``[0, N]``).
        topk: keys kept per query (>= 1).
        tile_tokens, prune: accepted for the reference's signature; the kernel tiles and prunes by itself.
        index_dtype: int64 (default) or int32.
        dot_dtype: dtype of the score products; default the promoted dtype of ``index_q`` and ``index_k`` (exact
            products, as the reference). ``torch.bfloat16`` rounds fp32 keys for tensor-core speed.
        visible_host: ``visible``'s values as a host list, when the caller has them (the DSA layer computes them from
            its positions): checked on the host. Without it ``visible`` is checked on the device and the verdict read
            back: one host sync per call (``genoctx.model.host``).
        check_visible: False skips the value checks of ``visible`` (the op does, after ``indexer_topk`` checked
            ``visible_host``).

    Returns:
        ``[B, T, min(topk, N)]`` (``index_dtype``): key indices in descending score, ``-1`` in empty slots.

    Raises:
        ValueError: ``topk < 1``, a bad ``visible``, ``index_dtype``, shape or dtype.
    """
    if topk < 1 or (tile_tokens is not None and tile_tokens < 1):
        raise ValueError(f"indexer_topk needs topk >= 1 and tile_tokens >= 1, got {topk}, {tile_tokens}")
    B, T, H, D, N = _check_static(index_q, index_w, index_k, visible, index_dtype)
    if visible_host is not None:
        _check_visible_host(visible_host, T, N)
    elif T > 0 and check_visible:
        vis = visible.to(torch.long)
        bad = (vis[0] < 0) | (vis[-1] > N)
        if T > 1:
            bad = bad | (vis[1:] < vis[:-1]).any()
        if bool(bad):  # a host sync: callers that know ``visible`` pass ``visible_host``
            raise ValueError(f"indexer_topk: visible must be {T} non-decreasing counts in [0, {N}]")
    K = min(topk, N)
    out = torch.empty(B, T, K, dtype=index_dtype, device=index_q.device)
    if out.numel() == 0:
        return out
    if dot_dtype is None:
        dot_dtype = torch.promote_types(index_q.dtype, index_k.dtype)
    if dot_dtype not in _TL:
        raise ValueError(f"indexer_topk (Triton): dot_dtype must be fp32, fp16 or bf16, got {dot_dtype}")
    cfg = _blocks(H, D, K, torch.empty((), dtype=dot_dtype).element_size())
    vis_dev = visible.to(device=index_q.device)
    grid = (triton.cdiv(T, cfg["BLOCK_M"]), B)
    with on_device(index_q):  # the tensors' device, not the current one (kernels.on_device)
        _indexer_topk_kernel[grid](
            index_q, index_w, index_k, vis_dev, out,
            T, H, D, K,
            *index_q.stride(), *index_w.stride(), *index_k.stride(), *out.stride(),
            TIE_BREAK,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_H=cfg["BLOCK_H"], BLOCK_D=cfg["BLOCK_D"], BLOCK_N=cfg["BLOCK_N"],
            KP=cfg["KP"], DOT_DTYPE=_TL[dot_dtype], PREC="ieee" if dot_dtype == torch.float32 else None,
            EMPTY=_EMPTY, MERGE_SORT=cfg["MERGE_SORT"], D_CHUNKS=cfg["D_CHUNKS"], num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )  # fmt: skip
    return out


# ---------------------------------------------------------------- the PyTorch op: genoctx::indexer_topk
#
# ``indexer_topk_launch`` above (checks, then one launch) is the op's kernel on every real device: CPU under the
# interpreter, CUDA compiled. The fake kernel gives the output's shape and dtype without data, so FakeTensorMode, the
# meta device and torch.compile (AOTAutograd) trace through the op; the result is integer (no autograd formula).
# ``torch.library.custom_op`` rather than ``triton_op``: a triton_op's body is traced by make_fx (its fake kernel and
# its decomposition under AOTAutograd), which needs ``wrap_triton`` launches that the interpreter does not provide
# (an interpreted kernel reads the data pointers of fake tensors) and a body free of data-dependent checks.


@torch.library.custom_op("genoctx::indexer_topk", mutates_args=())
def _indexer_topk_op(
    index_q: torch.Tensor,
    index_w: torch.Tensor,
    index_k: torch.Tensor,
    visible: torch.Tensor,
    topk: int,
    index_dtype: torch.dtype,
    dot_dtype: torch.dtype | None,
    check_visible: bool = True,
) -> torch.Tensor:
    return indexer_topk_launch(
        index_q, index_w, index_k, visible, topk, None, index_dtype, dot_dtype=dot_dtype, check_visible=check_visible
    )


@_indexer_topk_op.register_fake
def _indexer_topk_fake(index_q, index_w, index_k, visible, topk, index_dtype, dot_dtype, check_visible=True):
    """The checks of ``indexer_topk_launch`` that need no data (not ``visible``'s values), then the empty result."""
    B, T = _check_static(index_q, index_w, index_k, visible, index_dtype)[:2]
    return index_q.new_empty((B, T, torch.sym_min(topk, index_k.shape[1])), dtype=index_dtype)


def indexer_topk(
    index_q: torch.Tensor,
    index_w: torch.Tensor,
    index_k: torch.Tensor,
    visible: torch.Tensor,
    topk: int,
    tile_tokens: int | None = None,
    index_dtype: torch.dtype = torch.long,
    prune: bool = True,
    *,
    dot_dtype: torch.dtype | None = None,
    visible_host: list[int] | None = None,
) -> torch.Tensor:
    """Top-k keys (pools) per query by the lightning indexer: the op ``torch.ops.genoctx.indexer_topk``.

    Same call and result as ``genoctx.model.dsa.indexer_topk`` (module docstring: what "same" means). On CPU and
    CUDA tensors the op runs ``indexer_topk_launch`` (the Triton kernel; arguments, errors and result documented
    there); on fake or meta tensors it returns an empty ``[B, T, min(topk, N)]`` tensor of ``index_dtype`` after the
    checks that need no data, so ``torch.compile(fullgraph=True)`` and meta-device runs trace through it.
    ``tile_tokens`` and ``prune`` are accepted for the reference's signature. Not differentiable (integer output).
    ``visible_host`` (``visible``'s values on the host, as the DSA layer knows them from its positions) is checked
    here and the op skips its device check: no host sync per call.

    Raises:
        ValueError: ``topk < 1`` or ``tile_tokens < 1``, and the errors of ``indexer_topk_launch``.
    """
    if topk < 1 or (tile_tokens is not None and tile_tokens < 1):
        raise ValueError(f"indexer_topk needs topk >= 1 and tile_tokens >= 1, got {topk}, {tile_tokens}")
    if visible_host is not None:
        _check_visible_host(visible_host, index_q.shape[1], index_k.shape[1])
    return torch.ops.genoctx.indexer_topk(
        index_q, index_w, index_k, visible, topk, index_dtype, dot_dtype, visible_host is None
    )


__all__ = ["SENTINEL", "TIE_BREAK", "indexer_topk", "indexer_topk_launch"]
