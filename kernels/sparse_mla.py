"""Sparse MLA attention over the indexer's selection, absorbed MQA form: Triton forward and backward.

PyTorch reference: ``genoctx.model.dsa.sparse_mla`` / ``genoctx.model.dsa._SparseMLA`` (same call, same result up
to rounding); the slow dense oracle is ``genoctx.model.reference.masked_mla_attention``.

For query ``t`` of batch row ``b`` and head ``h``, over the selected tokens ``sel(t)``::

    s[h, k] = scale * q[b, t, h] . kv[b, tok_k]            o[b, t, h] = sum_k softmax_k(s[h, k]) kv[b, tok_k]
    lse[b, t, h] = logsumexp_k s[h, k]                      (0 and o = 0 when nothing is selected)

MLA's absorbed form: ``q`` is the query mapped into the kv-LoRA latent (``q W_UK``, ``R = kv_lora_rank`` wide; no
RoPE part in GLM-5.3-Flash), ``kv`` is the one latent per token that serves as key and value of every head, and all
heads of a query share its selection.

The selection is the DSA layer's, kept as pools (``genoctx.model.dsa.DSASelection``): ``pools [B, T, Kp]`` (int32
or int64, ``-1`` = empty), ``pos [T]`` absolute positions, ``kpool`` tokens per pool and ``tail``. Slot ``j < Kp *
kpool`` is token ``pools[t, j // kpool] * kpool + j % kpool``; with ``tail`` (and ``kpool > 1``), ``kpool - 1`` more
slots hold the visible tokens of the query's incomplete pool, ``pos + 1 - (pos + 1) % kpool`` up to ``pos``. Token
indices are expanded in registers, never in memory. Pools of one token (``kpool=1``, ``tail=False``) make ``pools``
plain token indices (any order, ``-1`` = empty).

Kernels:

- ``_fwd_kernel``: one program per (query, batch row, head block); selected latents are gathered ``BLOCK_N`` at a
  time (one ``[BLOCK_N, R]`` tile serves every head of the block), online softmax in fp32, ``o`` and ``lse`` stored.
- ``_bwd_kernel``: same walk; recomputes ``p = exp(s - lse)``, ``dp = do . kv``, ``ds = p (dp - delta) scale``
  (``delta = sum_r o do``), accumulates ``dq`` in fp32 and, unless deterministic, adds
  ``dkv[tok] += p^T do + ds^T q`` with fp32 atomics.
- ``_bwd_dkv_kernel`` (deterministic mode): one program per (pool, batch row) owns that pool's latents and walks
  the queries that selected it (an inverse index built by a stable sort), summing in a fixed order: no atomics,
  bitwise reproducible. ``dq`` then comes from ``_bwd_kernel`` without atomics.
- Mode selection: the backward is deterministic while ``torch.are_deterministic_algorithms_enabled()`` (the recipe's
  ``train.deterministic``, ``genoctx.train.loop.deterministic_mode``); ``LAST_BACKWARD`` records the mode the last
  backward ran (``"dq_dkv_split"`` / ``"atomic_dkv"``; None before any), which each training step reports.

Dtypes: ``q`` fp32, fp16 or bf16 (the matrix products run in ``q``'s dtype, fp32 ``ieee`` for fp32, accumulating in
fp32); ``kv`` fp32, fp16 or bf16 (cast to ``q``'s dtype in registers). ``o``/``dq`` in ``q``'s dtype, ``dkv`` in
``kv``'s (accumulated in fp32), ``lse`` fp32 ``[B, T, H]``. Any strides; every offset is int64 (1M queries x 64
heads x 512 latent channels pass 2^31 elements).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.launch import on_device

ATTN_TILE_TOKENS = 1 << 16  # the reference's tile knob; accepted and unused (the kernels tile by themselves)
_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _slot_tokens(pool_row, sp_k, slots, pos, KSLOTS, kpool, W, TAIL: tl.constexpr):
    """Token index (int64, -1 = empty) of each slot of one query: its pools expanded, then its tail."""
    in_pools = slots < KSLOTS * kpool
    j = (slots // kpool).to(tl.int64)
    pool = tl.load(pool_row + j * sp_k, mask=in_pools & (slots < W), other=-1).to(tl.int64)
    tok = tl.where(pool >= 0, pool * kpool + (slots % kpool).to(tl.int64), -1)
    if TAIL:
        i = (slots - KSLOTS * kpool).to(tl.int64)
        count = (pos + 1) % kpool  # visible tokens of the incomplete pool
        tail_tok = pos + 1 - count + i
        tok = tl.where(in_pools, tok, tl.where((i >= 0) & (i < count), tail_tok, -1))
    return tl.where(slots < W, tok, -1)


@triton.jit
def _fwd_kernel(
    q_ptr, kv_ptr, pools_ptr, pos_ptr, o_ptr, lse_ptr,
    H, R, KSLOTS, kpool, W, scale,
    sq_b, sq_t, sq_h, sq_r,
    skv_b, skv_n, skv_r,
    sp_b, sp_t, sp_k,
    so_b, so_t, so_h, so_r,
    sl_b, sl_t, sl_h,
    TAIL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
    h_ok = h < H
    r = tl.arange(0, BLOCK_R).to(tl.int64)
    r_ok = r < R
    q = tl.load(
        q_ptr + b * sq_b + t * sq_t + h[:, None] * sq_h + r[None, :] * sq_r,
        mask=h_ok[:, None] & r_ok[None, :],
        other=0.0,
    )
    cdt = q.dtype
    pos = tl.load(pos_ptr + t).to(tl.int64)
    pool_row = pools_ptr + b * sp_b + t * sp_t
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for s0 in range(0, W, BLOCK_N):
        slots = s0 + tl.arange(0, BLOCK_N)
        tok = _slot_tokens(pool_row, sp_k, slots, pos, KSLOTS, kpool, W, TAIL)
        valid = tok >= 0
        kvb = tl.load(
            kv_ptr + b * skv_b + tok[:, None] * skv_n + r[None, :] * skv_r,
            mask=valid[:, None] & r_ok[None, :],
            other=0.0,
        ).to(cdt)
        s = tl.dot(q, tl.trans(kvb), input_precision=PREC) * scale  # [BH, BN] fp32
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: keep p = 0, no NaN
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(cdt), kvb, input_precision=PREC)
        m_i = m_new
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, 0.0, m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(
        o_ptr + b * so_b + t * so_t + h[:, None] * so_h + r[None, :] * so_r,
        o.to(o_ptr.dtype.element_ty),
        mask=h_ok[:, None] & r_ok[None, :],
    )
    tl.store(lse_ptr + b * sl_b + t * sl_t + h * sl_h, lse, mask=h_ok)


@triton.jit
def _bwd_kernel(
    q_ptr, kv_ptr, pools_ptr, pos_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr,
    H, R, KSLOTS, kpool, W, scale,
    sq_b, sq_t, sq_h, sq_r,
    skv_b, skv_n, skv_r,
    sp_b, sp_t, sp_k,
    sdo_b, sdo_t, sdo_h, sdo_r,
    sl_b, sl_t, sl_h,
    sdq_b, sdq_t, sdq_h, sdq_r,
    sdkv_b, sdkv_n, sdkv_r,
    TAIL: tl.constexpr, ATOMIC_DKV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
    h_ok = h < H
    r = tl.arange(0, BLOCK_R).to(tl.int64)
    r_ok = r < R
    hr_ok = h_ok[:, None] & r_ok[None, :]
    q = tl.load(q_ptr + b * sq_b + t * sq_t + h[:, None] * sq_h + r[None, :] * sq_r, mask=hr_ok, other=0.0)
    cdt = q.dtype
    do = tl.load(do_ptr + b * sdo_b + t * sdo_t + h[:, None] * sdo_h + r[None, :] * sdo_r, mask=hr_ok, other=0.0)
    do = do.to(cdt)
    lse = tl.load(lse_ptr + b * sl_b + t * sl_t + h * sl_h, mask=h_ok, other=0.0)
    delta = tl.load(delta_ptr + b * sl_b + t * sl_t + h * sl_h, mask=h_ok, other=0.0)  # same layout as lse
    pos = tl.load(pos_ptr + t).to(tl.int64)
    pool_row = pools_ptr + b * sp_b + t * sp_t
    dq = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for s0 in range(0, W, BLOCK_N):
        slots = s0 + tl.arange(0, BLOCK_N)
        tok = _slot_tokens(pool_row, sp_k, slots, pos, KSLOTS, kpool, W, TAIL)
        valid = tok >= 0
        kvb = tl.load(
            kv_ptr + b * skv_b + tok[:, None] * skv_n + r[None, :] * skv_r,
            mask=valid[:, None] & r_ok[None, :],
            other=0.0,
        ).to(cdt)
        s = tl.dot(q, tl.trans(kvb), input_precision=PREC) * scale
        p = tl.exp(s - lse[:, None])
        p = tl.where(valid[None, :] & h_ok[:, None], p, 0.0)  # [BH, BN]
        dp = tl.dot(do, tl.trans(kvb), input_precision=PREC)
        ds = p * (dp - delta[:, None]) * scale
        dq += tl.dot(ds.to(cdt), kvb, input_precision=PREC)
        if ATOMIC_DKV:
            dkv = tl.dot(tl.trans(p.to(cdt)), do, input_precision=PREC)
            dkv += tl.dot(tl.trans(ds.to(cdt)), q, input_precision=PREC)  # [BN, BR] fp32
            tl.atomic_add(
                dkv_ptr + b * sdkv_b + tok[:, None] * sdkv_n + r[None, :] * sdkv_r,
                dkv,
                mask=valid[:, None] & r_ok[None, :],
                sem="relaxed",
            )
    tl.store(dq_ptr + b * sdq_b + t * sdq_t + h[:, None] * sdq_h + r[None, :] * sdq_r,
             dq.to(dq_ptr.dtype.element_ty), mask=hr_ok)  # fmt: skip


@triton.jit
def _bwd_dkv_kernel(
    q_ptr, kv_ptr, pos_ptr, do_ptr, lse_ptr, delta_ptr, dkv_ptr, off_ptr, ent_ptr,
    N, NP, H, R, kpool, scale,
    sq_b, sq_t, sq_h, sq_r,
    skv_b, skv_n, skv_r,
    sdo_b, sdo_t, sdo_h, sdo_r,
    sl_b, sl_t, sl_h,
    sdkv_b, sdkv_n, sdkv_r,
    BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    pool = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, BLOCK_P).to(tl.int64)
    tok = pool * kpool + i
    tok_ok = (i < kpool) & (tok < N)
    r = tl.arange(0, BLOCK_R).to(tl.int64)
    r_ok = r < R
    kvb = tl.load(kv_ptr + b * skv_b + tok[:, None] * skv_n + r[None, :] * skv_r,
                  mask=tok_ok[:, None] & r_ok[None, :], other=0.0)  # fmt: skip
    cdt = q_ptr.dtype.element_ty
    kvb = kvb.to(cdt)
    acc = tl.zeros([BLOCK_P, BLOCK_R], tl.float32)
    e0 = tl.load(off_ptr + (b * NP + pool))
    e1 = tl.load(off_ptr + (b * NP + pool + 1))  # one i64 offset (the test reads the IR)
    for e in range(e0, e1):  # the queries that selected this pool, in a fixed order
        code = tl.load(ent_ptr + e).to(tl.int64)
        t = tl.where(code < 0, -code - 1, code)  # -(t + 1): the pool is t's incomplete tail
        last = tl.where(code < 0, tl.load(pos_ptr + t).to(tl.int64), pool * kpool + kpool - 1)
        ok = tok_ok & (tok <= last)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H).to(tl.int64)
            h_ok = h < H
            hr_ok = h_ok[:, None] & r_ok[None, :]
            q = tl.load(q_ptr + b * sq_b + t * sq_t + h[:, None] * sq_h + r[None, :] * sq_r, mask=hr_ok, other=0.0)
            do = tl.load(do_ptr + b * sdo_b + t * sdo_t + h[:, None] * sdo_h + r[None, :] * sdo_r, mask=hr_ok,
                         other=0.0).to(cdt)  # fmt: skip
            lse = tl.load(lse_ptr + b * sl_b + t * sl_t + h * sl_h, mask=h_ok, other=0.0)
            delta = tl.load(delta_ptr + b * sl_b + t * sl_t + h * sl_h, mask=h_ok, other=0.0)
            s = tl.dot(kvb, tl.trans(q), input_precision=PREC) * scale  # [BP, BH]
            p = tl.exp(s - lse[None, :])
            p = tl.where(ok[:, None] & h_ok[None, :], p, 0.0)
            dp = tl.dot(kvb, tl.trans(do), input_precision=PREC)
            ds = p * (dp - delta[None, :]) * scale
            acc += tl.dot(p.to(cdt), do, input_precision=PREC)
            acc += tl.dot(ds.to(cdt), q, input_precision=PREC)
    tl.store(dkv_ptr + b * sdkv_b + tok[:, None] * sdkv_n + r[None, :] * sdkv_r,
             acc.to(dkv_ptr.dtype.element_ty), mask=tok_ok[:, None] & r_ok[None, :])  # fmt: skip


def _configs(pairs) -> list:
    return [triton.Config({"BLOCK_H": bh, "BLOCK_N": bn}, num_warps=w, num_stages=st) for bh, bn, w, st in pairs]


# CUDA: a few configurations, tried once per (H, R, Kp, kpool) by triton.autotune. Each one listed compiles for sm_90
# and sm_100 at GLM-5.3-Flash's shapes (64 heads, latent 512, 128 pools of 16; bf16) without spilling unless its
# comment says otherwise (bench/kernel_compile.py; README "Kernels on H100/H200 and B200"). Removed because they
# spill on both targets: BLOCK_H=64 in every kernel (a [64, 512] fp32 accumulator per program), BLOCK_N=32 with the
# atomic dKV (a second [BLOCK_N, 512] fp32 tile), num_stages > 1 in the dKV kernel. The interpreter runs the single
# _INTERPRET one.
_FWD_CONFIGS = _configs([(16, 32, 4, 2), (32, 32, 8, 2), (32, 64, 8, 1)])
_BWD_CONFIGS = _configs([(32, 16, 8, 1), (16, 16, 4, 1)])  # atomic dKV; 16x16: fits sm_90, spills 48 B on sm_100
_BWD_DQ_CONFIGS = _configs([(16, 16, 4, 1), (16, 32, 4, 1), (32, 16, 8, 1), (32, 32, 8, 1)])  # deterministic: dQ
_DKV_CONFIGS = [triton.Config({"BLOCK_H": bh}, num_warps=w, num_stages=1) for bh, w in ((16, 4), (16, 8), (32, 8))]
_KEY = ["H", "R", "KSLOTS", "kpool"]
_INTERPRET = dict(BLOCK_H=16, BLOCK_N=16)
_fwd_tuned = triton.autotune(_FWD_CONFIGS, key=_KEY)(_fwd_kernel)
_bwd_tuned = triton.autotune(_BWD_CONFIGS, key=_KEY, reset_to_zero=["dkv_ptr"])(_bwd_kernel)
_bwd_dq_tuned = triton.autotune(_BWD_DQ_CONFIGS, key=_KEY)(_bwd_kernel)
_dkv_tuned = triton.autotune(_DKV_CONFIGS, key=["H", "R", "kpool"])(_bwd_dkv_kernel)


def _launch(kernel, tuned, grid, *args, **constexprs) -> None:
    """``tuned`` (autotuned) on a GPU; ``kernel`` with the one interpreter configuration under TRITON_INTERPRET."""
    with on_device(args[0]):  # the tensors' device, not the current one (kernels.on_device)
        if _interpreting():
            cfg = {k: v for k, v in _INTERPRET.items() if k in kernel.arg_names}
            kernel[grid](*args, **constexprs, **cfg)
        else:
            tuned[grid](*args, **constexprs)


def _check(q: torch.Tensor, kv: torch.Tensor, pools: torch.Tensor, pos: torch.Tensor, kpool: int) -> None:
    B, T, H, R = q.shape
    if kv.dim() != 3 or kv.shape[0] != B or kv.shape[2] != R or pools.dim() != 3 or pools.shape[:2] != (B, T):
        raise ValueError(f"sparse_mla: bad shapes q {tuple(q.shape)}, kv {tuple(kv.shape)}, pools {tuple(pools.shape)}")
    if pos.shape != (T,) or kpool < 1:
        raise ValueError(f"sparse_mla: pos must be [{T}] and kpool >= 1, got {tuple(pos.shape)}, {kpool}")
    if q.dtype not in _TL or kv.dtype not in _TL:
        raise ValueError(f"sparse_mla (Triton): q and kv must be fp32, fp16 or bf16, got {q.dtype}, {kv.dtype}")
    if pools.dtype not in (torch.int32, torch.int64) or pos.dtype.is_floating_point:
        raise ValueError(f"sparse_mla (Triton): pools must be int32/int64 and pos integer, got {pools.dtype}")


def _block_r(R: int) -> int:
    """The latent width padded to a power of two (``tl.dot`` needs >= 16)."""
    return max(16, triton.next_power_of_2(R))


def _width(pools: torch.Tensor, kpool: int, tail: bool) -> int:
    return pools.shape[-1] * kpool + (kpool - 1 if tail and kpool > 1 else 0)


def sparse_mla_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    pools: torch.Tensor,
    pos: torch.Tensor,
    kpool: int,
    tail: bool,
    scale: float,
    o: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward: ``q [B, T, H, R]``, ``kv [B, N, R]``, the selection (``pools [B, T, Kp]``, ``pos [T]``, ``kpool``,
    ``tail``; module docstring) and the logit scale -> ``(o [B, T, H, R]`` in q's dtype, ``lse [B, T, H]`` fp32).

    ``o`` may be given (any strides) to be written in place. Raises ValueError on shapes or dtypes that do not fit.
    """
    _check(q, kv, pools, pos, kpool)
    B, T, H, R = q.shape
    if o is None:
        o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    pos = pos.to(q.device)
    _launch(
        _fwd_kernel, _fwd_tuned, lambda meta: (T, B, triton.cdiv(H, meta["BLOCK_H"])),
        q, kv, pools, pos, o, lse,
        H, R, pools.shape[-1], kpool, _width(pools, kpool, tail), float(scale),
        *q.stride(), *kv.stride(), *pools.stride(), *o.stride(), *lse.stride(),
        TAIL=bool(tail and kpool > 1), BLOCK_R=_block_r(R), PREC="ieee" if q.dtype == torch.float32 else None,
    )  # fmt: skip
    return o, lse


def _inverse_selection(
    pools: torch.Tensor, pos: torch.Tensor, kpool: int, tail: bool, N: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Which queries attend each pool: ``(offsets [B * NP + 1] int64, entries [E] int32, NP)``.

    Entries of pool ``p`` of batch row ``b`` are ``entries[offsets[b NP + p] : offsets[b NP + p + 1]]``: the query
    ``t`` of each selection of ``p`` (in query order), then ``-(t + 1)`` for each query whose incomplete tail pool is
    ``p`` (its tokens up to ``pos[t]``). A stable sort: the order, hence every fp32 sum over it, is fixed.
    """
    B, T, Kp = pools.shape
    dev = pools.device
    NP = -(-N // kpool)
    p = pools.long()
    valid = p >= 0
    tt = torch.arange(T, device=dev, dtype=torch.int32)
    rowb = torch.arange(B, device=dev)[:, None, None] * NP
    keys = [(rowb + p)[valid]]
    codes = [tt[None, :, None].expand(B, T, Kp)[valid]]
    if tail and kpool > 1:
        has = (pos + 1) % kpool > 0
        tp = (pos.to(dev) // kpool)[has]  # the tail pool of each query that has one
        keys.append((torch.arange(B, device=dev)[:, None] * NP + tp[None, :]).reshape(-1))
        codes.append((-tt[has] - 1).repeat(B))
    key = torch.cat(keys)
    code = torch.cat(codes)
    key, order = torch.sort(key, stable=True)
    ent = code[order].contiguous()
    offsets = torch.searchsorted(key, torch.arange(B * NP + 1, device=dev))
    return offsets, ent, NP


def sparse_mla_bwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    pools: torch.Tensor,
    pos: torch.Tensor,
    kpool: int,
    tail: bool,
    scale: float,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    deterministic: bool = False,
    dq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of ``sparse_mla_fwd``: ``(dq [B, T, H, R]`` in q's dtype, ``dkv [B, N, R]`` in kv's dtype``)``,
    both accumulated in fp32. ``deterministic``: no atomics (``_bwd_dkv_kernel`` over an inverse index of the
    selection, about 16 bytes per (query, pool) pair while it runs); otherwise fp32 atomic adds into a
    ``[B, N, R]`` fp32 buffer. ``dq`` may be given (any strides) to be written in place.
    """
    _check(q, kv, pools, pos, kpool)
    B, T, H, R = q.shape
    N = kv.shape[1]
    if dq is None:
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.numel() == 0 or N == 0:
        return dq.zero_(), torch.zeros_like(kv, memory_format=torch.contiguous_format)
    delta = (o.float() * do.float()).sum(-1)  # [B, T, H] = sum_k p dp
    lse = lse.contiguous()
    delta = delta.contiguous()
    pos = pos.to(q.device)
    prec = "ieee" if q.dtype == torch.float32 else None
    dkv32 = None if deterministic else torch.zeros(B, N, R, dtype=torch.float32, device=q.device)
    dkv_arg = dkv32 if dkv32 is not None else dq  # unused pointer when deterministic
    _launch(
        _bwd_kernel, _bwd_dq_tuned if deterministic else _bwd_tuned,
        lambda meta: (T, B, triton.cdiv(H, meta["BLOCK_H"])),
        q, kv, pools, pos, do, lse, delta, dq, dkv_arg,
        H, R, pools.shape[-1], kpool, _width(pools, kpool, tail), float(scale),
        *q.stride(), *kv.stride(), *pools.stride(), *do.stride(), *lse.stride(), *dq.stride(),
        *(dkv32.stride() if dkv32 is not None else (0, 0, 0)),
        TAIL=bool(tail and kpool > 1), ATOMIC_DKV=not deterministic, BLOCK_R=_block_r(R), PREC=prec,
    )  # fmt: skip
    if not deterministic:
        return dq, dkv32.to(kv.dtype)
    dkv = torch.empty(B, N, R, dtype=kv.dtype, device=kv.device)
    offsets, ent, NP = _inverse_selection(pools, pos, kpool, tail, N)
    _launch(
        _bwd_dkv_kernel, _dkv_tuned, (NP, B),
        q, kv, pos, do, lse, delta, dkv, offsets, ent,
        N, NP, H, R, kpool, float(scale),
        *q.stride(), *kv.stride(), *do.stride(), *lse.stride(), *dkv.stride(),
        BLOCK_P=max(16, triton.next_power_of_2(kpool)), BLOCK_R=_block_r(R), PREC=prec,
    )  # fmt: skip
    return dq, dkv


# ---------------------------------------------------------------- the PyTorch ops: genoctx::sparse_mla_fwd / _bwd
#
# ``sparse_mla_fwd`` and ``sparse_mla_bwd`` above (checks, then the launches) are the ops' kernels on every real
# device: CPU under the interpreter, CUDA compiled. The fake kernels give the outputs' shapes and dtypes without data,
# so FakeTensorMode, the meta device and torch.compile (AOTAutograd, forward and backward) trace through the ops; the
# forward op's autograd formula calls the backward op. ``torch.library.custom_op`` rather than ``triton_op``: a
# triton_op's body is traced by make_fx (its fake kernel and its decomposition under AOTAutograd), which needs
# ``wrap_triton`` launches that the interpreter does not provide (an interpreted kernel reads the data pointers of
# fake tensors) and a body free of data-dependent shapes (the deterministic backward's inverse index).


@torch.library.custom_op("genoctx::sparse_mla_fwd", mutates_args=())
def _sparse_mla_fwd_op(
    q: torch.Tensor,
    kv: torch.Tensor,
    pools: torch.Tensor,
    pos: torch.Tensor,
    kpool: int,
    tail: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return sparse_mla_fwd(q, kv, pools, pos, kpool, tail, scale)


@_sparse_mla_fwd_op.register_fake
def _sparse_mla_fwd_fake(q, kv, pools, pos, kpool, tail, scale):
    _check(q, kv, pools, pos, kpool)
    B, T, H, _ = q.shape
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    return o, q.new_empty((B, T, H), dtype=torch.float32)


@torch.library.custom_op("genoctx::sparse_mla_bwd", mutates_args=())
def _sparse_mla_bwd_op(
    q: torch.Tensor,
    kv: torch.Tensor,
    pools: torch.Tensor,
    pos: torch.Tensor,
    kpool: int,
    tail: bool,
    scale: float,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return sparse_mla_bwd(q, kv, pools, pos, kpool, tail, scale, o, lse, do, deterministic)


@_sparse_mla_bwd_op.register_fake
def _sparse_mla_bwd_fake(q, kv, pools, pos, kpool, tail, scale, o, lse, do, deterministic):
    _check(q, kv, pools, pos, kpool)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(kv, memory_format=torch.contiguous_format))  # fmt: skip


def _sparse_mla_setup_context(ctx, inputs, output) -> None:
    q, kv, pools, pos, kpool, tail, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, kv, pools, pos, o, lse)
    ctx.args = (kpool, tail, scale)
    ctx.mark_non_differentiable(lse)


LAST_BACKWARD: str | None = None  # the mode the last backward ran (backward_path), None before any


def backward_path(deterministic: bool) -> str:
    """The backward ``deterministic`` selects: ``"dq_dkv_split"`` (``_bwd_kernel`` for dQ, then ``_bwd_dkv_kernel``
    over an inverse index: no atomics) or ``"atomic_dkv"`` (one ``_bwd_kernel`` adding dKV with fp32 atomics)."""
    return "dq_dkv_split" if deterministic else "atomic_dkv"


def _sparse_mla_backward(ctx, do, _dlse):
    """Gradients of q and kv (lse is not differentiable); deterministic when
    ``torch.are_deterministic_algorithms_enabled()`` as the backward runs (under torch.compile: as it is traced)."""
    q, kv, pools, pos, o, lse = ctx.saved_tensors
    kpool, tail, scale = ctx.args
    global LAST_BACKWARD
    det = torch.are_deterministic_algorithms_enabled()
    LAST_BACKWARD = backward_path(det)
    dq, dkv = torch.ops.genoctx.sparse_mla_bwd(q, kv, pools, pos, kpool, tail, scale, o, lse, do, det)
    return dq, dkv, None, None, None, None, None


_sparse_mla_fwd_op.register_autograd(_sparse_mla_backward, setup_context=_sparse_mla_setup_context)


def sparse_mla(
    q: torch.Tensor, kv: torch.Tensor, sel, scale: float, tile_tokens: int = ATTN_TILE_TOKENS
) -> torch.Tensor:
    """Drop-in for ``genoctx.model.dsa.sparse_mla`` (same arguments, same result up to rounding), through the op
    ``torch.ops.genoctx.sparse_mla_fwd`` (its autograd formula: ``torch.ops.genoctx.sparse_mla_bwd``).

    Args:
        q: ``[B, T, H, R]`` queries in the latent (``q W_UK``).
        kv: ``[B, N, R]`` latents of all positions (cache first).
        sel: a ``DSASelection`` (``pools``, ``pos``, ``kpool``, ``tail``), token indices < N; unpacked here, the ops
            take tensors and numbers only.
        scale: logit scale.
        tile_tokens: accepted for the reference's signature (unused).

    Returns:
        ``o [B, T, H, R]`` (contiguous) in q's dtype; differentiable w.r.t. q and kv, the backward deterministic
        when ``torch.are_deterministic_algorithms_enabled()``. On fake or meta tensors: the empty result, after the
        shape and dtype checks.

    Raises:
        ValueError: shapes or dtypes that do not fit (``_check``).
    """
    _check(q, kv, sel.pools, sel.pos, sel.kpool)
    o, _ = torch.ops.genoctx.sparse_mla_fwd(q, kv, sel.pools, sel.pos, sel.kpool, bool(sel.tail), float(scale))
    return o


__all__ = ["sparse_mla", "sparse_mla_bwd", "sparse_mla_fwd"]
