"""Chunked fused LM head + cross-entropy: per-token losses without ever holding [N, V] logits.

The pretrained base has a 154,880-token text vocabulary; the logits of a 512k-token window would be
[524288, 154880] (fp32: 325 GB, and as much again for their gradient). ``head_token_losses`` computes

    z_t    = h_t · W_vᵀ                               logits of token t (never stored for all t at once)
    lse_t  = log Σ_v exp(z_{t,v})                      fp32, kept: [N]
    loss_t = lse_t − z_{t, y_t}    if scored_t, else 0  nats

and its gradient, for any incoming ``grad_out`` (per-token losses may be summed, weighted or binned):

    g_t        = grad_out_t if scored_t else 0
    dz_{t,v}   = g_t · (softmax(z_t)_v − [v = y_t])
    dh_t       = Σ_v dz_{t,v} W_v                       dW_v = Σ_t dz_{t,v} h_t

The math is the softmax cross-entropy gradient (e.g. Goodfellow et al., Deep Learning, eq. 6.30-6.33); the
chunked recompute-in-backward scheme is the one of "Cut Your Losses in Large-Vocabulary Language Models"
(Wijmans et al. 2024, arXiv:2411.09009) and Liger-Kernel's fused linear cross-entropy, written here in plain
torch over token chunks. The slow reference is ``head_token_losses_reference`` (full logits and
``F.cross_entropy``), tested against this in ``tests/model/test_head.py``.

Design choices:

- One ``torch.autograd.Function``. Forward loops over chunks of ``chunk_tokens`` tokens, computes that chunk's
  logits, reduces them to the target logit and the log-sum-exp in place, and drops them. It saves for backward
  only ``hidden``, ``weight`` (references to the caller's tensors, no copy), the targets, the mask, ``rows`` and
  the per-token log-sum-exp [N]; never logits. Backward recomputes each chunk's logits, turns them in place
  into ``dz`` and accumulates ``dh`` (disjoint rows per chunk) and ``dW``.
- Precision: the matmul runs in the weight's dtype (the hidden chunk is cast to it, as ``nn.Linear`` would under
  autocast) and its [C, V] output is upcast to fp32 for the log-sum-exp and the softmax. No fp32 copy of a
  low-precision weight is ever made ([154880, 4096] bf16 is 1.27 GB, fp32 would be 2.5 GB more), at the price of
  logits rounded to bf16 once (what ``lm_head`` in bf16 gives today). An fp32 or fp64 weight runs the whole
  path in its own dtype (fp64 in tests: equality to the reference to 1e-12).
- Gradient of the weight: for an fp32/fp64 weight it is accumulated in place (``addmm_``) into one buffer of the
  weight's shape that is returned as is. For a low-precision weight it is accumulated into an fp32 buffer of
  the weight's shape (2x the weight's bytes), each chunk's product computed in vocabulary slices of
  ``chunk_tokens`` rows so that no [V, D] low-precision temporary exists, and cast once at the end.
- Memory per chunk (beyond inputs and gradients): one [C, V] fp32 logits tensor (4·C·V bytes; 6·C·V for a
  low-precision weight, whose [C, V] matmul output briefly coexists with its fp32 copy). At V = 154,880:
  C = 2048 -> 1.18 GiB, C = 4096 -> 2.36 GiB. Choose ``chunk_tokens`` by that arithmetic, not by N.
- Restricted softmax (``rows``): the softmax runs over ``weight[rows]`` only and targets index into ``rows``.
  This is a different objective from the full-vocabulary one (the model is never penalised for mass on the
  other 154k tokens, and its loss is not comparable to a full-vocabulary loss). Only the selected rows get a
  gradient (``index_add``; a row listed twice gets both contributions); all other rows get exactly 0.
- Validation costs one host sync (the ranges of ``rows`` and of the scored targets, read in one copy), none with
  ``check_values=False`` (``VocabHead``, whose ids are in range by construction); errors are ``ValueError``: these
  are programming errors (the tokenizer and windows validate user data before this point).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .host import read


def _loss_dtype(weight: torch.Tensor) -> torch.dtype:
    """fp32 for a weight in fp32 or lower precision, fp64 for an fp64 weight."""
    return torch.promote_types(weight.dtype, torch.float32)


def _check(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    scored: torch.Tensor,
    chunk_tokens: int,
    rows: torch.Tensor | None,
    check_values: bool = True,
) -> None:
    """Raise ValueError, naming the argument, for anything ``head_token_losses`` cannot run on; the ranges of
    ``rows`` and the scored targets only with ``check_values`` (one host read)."""
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    if hidden.dim() != 2 or not hidden.is_floating_point():
        raise ValueError(f"hidden must be a float [N, D] tensor, got {hidden.dtype} {tuple(hidden.shape)}")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a float [V, D] tensor, got {weight.dtype} {tuple(weight.shape)}")
    N, D = hidden.shape
    if weight.shape[1] != D:
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden {tuple(hidden.shape)}: D differs")
    if weight.shape[0] < 1:
        raise ValueError("weight has no rows (V = 0)")
    if targets.shape != (N,) or targets.dtype != torch.int64:
        raise ValueError(f"targets must be int64 [{N}], got {targets.dtype} {tuple(targets.shape)}")
    if scored.shape != (N,) or scored.dtype != torch.bool:
        raise ValueError(f"scored must be bool [{N}], got {scored.dtype} {tuple(scored.shape)}")
    V = weight.shape[0]
    classes = V
    if rows is not None:
        if rows.dim() != 1 or rows.dtype != torch.int64 or rows.numel() < 1:
            raise ValueError(f"rows must be a non-empty int64 [R] tensor, got {rows.dtype} {tuple(rows.shape)}")
        classes = rows.numel()
    if not check_values:
        return
    # the ranges of rows and of the scored targets, read in one host copy (no boolean-mask index: no extra sync)
    big = torch.iinfo(torch.int64).max
    t_min = torch.where(scored, targets, big).amin() if N else targets.new_full((), big)
    t_max = torch.where(scored, targets, -big).amax() if N else targets.new_full((), -big)
    r = (rows.amin(), rows.amax()) if rows is not None else (t_min, t_min)
    r_min, r_max, t_min, t_max = read(torch.stack([r[0], r[1], t_min, t_max]), label="head.check")
    if rows is not None and (r_min < 0 or r_max >= V):
        raise ValueError(f"rows must lie in [0, {V}), got min {r_min} max {r_max}")
    if t_min <= t_max and (t_min < 0 or t_max >= classes):  # t_min > t_max: no scored token
        what = f"rows (R = {classes})" if rows is not None else f"weight rows (V = {classes})"
        raise ValueError(f"a scored target is out of range: targets must index {what}, got min {t_min} max {t_max}")


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Logits of one chunk: h [C, D] (any float) @ w [R, D]ᵀ in w's dtype -> [C, R] in ``dtype`` (fresh tensor)."""
    z = h.to(w.dtype) @ w.T
    return z if z.dtype == dtype else z.to(dtype)


class _ChunkedHeadLoss(torch.autograd.Function):
    """Autograd Function behind ``head_token_losses`` (arguments validated there)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, scored, chunk_tokens, rows):
        with torch.autocast(hidden.device.type, enabled=False):  # the precision policy above, not autocast's
            return _ChunkedHeadLoss._forward(ctx, hidden, weight, targets, scored, chunk_tokens, rows)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):
            return _ChunkedHeadLoss._backward(ctx, grad_out)

    @staticmethod
    def _forward(ctx, hidden, weight, targets, scored, chunk_tokens, rows):
        dtype = _loss_dtype(weight)
        w = weight if rows is None else weight.index_select(0, rows)
        safe = torch.where(scored, targets, torch.zeros_like(targets))  # unscored targets may be anything
        N = hidden.shape[0]
        lse = torch.empty(N, dtype=dtype, device=hidden.device)
        losses = torch.zeros(N, dtype=dtype, device=hidden.device)
        for s in range(0, N, chunk_tokens):
            e = min(s + chunk_tokens, N)
            z = _chunk_logits(hidden[s:e], w, dtype)  # [c, R]; the only [c, R] tensor alive
            target_logit = z.gather(1, safe[s:e, None]).squeeze(1)
            m = z.amax(dim=1)
            lse_c = m + z.sub_(m[:, None]).exp_().sum(dim=1).log()  # in place: no second [c, R] tensor
            del z
            lse[s:e] = lse_c
            losses[s:e] = torch.where(scored[s:e], lse_c - target_logit, 0.0)
        ctx.save_for_backward(hidden, weight, safe, scored, lse, rows)
        ctx.chunk_tokens = chunk_tokens
        return losses

    @staticmethod
    def _backward(ctx, grad_out):
        hidden, weight, safe, scored, lse, rows = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        C = ctx.chunk_tokens
        dtype = lse.dtype
        w = weight if rows is None else weight.index_select(0, rows)
        R = w.shape[0]
        g = torch.where(scored, grad_out.to(dtype), 0.0)  # [N]: unscored tokens give no gradient
        grad_hidden = torch.empty_like(hidden) if need_h else None
        gw = torch.zeros(R, w.shape[1], dtype=dtype, device=w.device) if need_w else None  # [R, D]
        N = hidden.shape[0]
        for s in range(0, N, C):
            e = min(s + C, N)
            h = hidden[s:e].to(w.dtype)
            dz = _chunk_logits(h, w, dtype)
            dz.sub_(lse[s:e, None]).exp_()  # softmax, in place
            dz.scatter_add_(1, safe[s:e, None], torch.full((e - s, 1), -1.0, dtype=dtype, device=dz.device))
            dz.mul_(g[s:e, None])
            dz = dz.to(w.dtype)  # no-op for an fp32/fp64 weight
            if need_h:
                grad_hidden[s:e] = dz @ w
            if need_w:
                if gw.dtype == w.dtype:
                    gw.addmm_(dz.T, h)
                else:  # low-precision weight: fp32 buffer, slices of C vocabulary rows (no [R, D] temporary)
                    for v in range(0, R, C):
                        gw[v : v + C].add_(dz[:, v : v + C].T @ h)
            del dz
        grad_weight = None
        if need_w:
            if rows is None:
                grad_weight = gw.to(weight.dtype)  # no-op (no copy) when weight is fp32/fp64
            else:
                grad_weight = torch.zeros_like(weight).index_add_(0, rows, gw.to(weight.dtype))
        return grad_hidden, grad_weight, None, None, None, None


def head_token_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    scored: torch.Tensor,
    chunk_tokens: int = 2048,
    rows: torch.Tensor | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """Per-token cross-entropy of ``hidden @ weight.T``, computed ``chunk_tokens`` tokens at a time.

    Full vocabulary (``rows`` None): ``loss_t = logsumexp_v(h_t · W_v) − h_t · W_{y_t}``.
    Restricted (``rows`` given, e.g. the 5 ids of A C G T N in the text vocabulary): the softmax is over
    ``weight[rows]`` only and ``targets`` index into ``rows`` (0..R-1). This is a different objective from the
    full-vocabulary loss (no penalty for probability on the other rows) and its values are not comparable to it;
    only the ``rows`` of ``weight`` receive gradient.

    Args:
        hidden: [N, D] final hidden states (after the final norm), any float dtype. Cast per chunk to
            ``weight``'s dtype for the matmul.
        weight: [V, D] the lm_head weight (``nn.Linear`` weight, no bias), any float dtype.
        targets: [N] int64 target ids: rows of ``weight`` (or indices into ``rows``). Unscored entries may hold
            anything (e.g. -100); they are never read.
        scored: [N] bool, which tokens have a loss; the others give exactly 0 and no gradient.
        chunk_tokens: tokens per chunk of logits. Memory beyond inputs and gradients is one [chunk_tokens, V]
            fp32 tensor (x1.5 for a low-precision weight): at V = 154,880, 2048 tokens -> 1.18 GiB.
        rows: optional [R] int64 rows of ``weight`` to restrict the softmax to.
        check_values: check that ``rows`` and the scored targets are in range (one host read per call, a sync on a
            GPU); False for a caller whose ids are in range by construction (``VocabHead``: mapped through a token map
            checked against the vocabulary when it was built).

    Returns:
        [N] per-token loss in nats: float32 (float64 when ``weight`` is float64); 0 where not scored.
        Differentiable w.r.t. ``hidden`` and ``weight`` for any incoming gradient (sums, weights, bins).

    Raises:
        ValueError: mismatched shapes or dtypes, ``chunk_tokens`` < 1, ``rows`` out of range, or a scored target
            outside [0, V) (or [0, R) with ``rows``).

    Reference: ``head_token_losses_reference`` (same math on the full [N, V] logits).
    """
    _check(hidden, weight, targets, scored, chunk_tokens, rows, check_values)
    return _ChunkedHeadLoss.apply(hidden, weight, targets, scored, chunk_tokens, rows)


def head_token_losses_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    scored: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slow, obviously-correct ``head_token_losses``: full [N, V] logits and ``F.cross_entropy``.

    Same arguments, dtypes, precision policy (matmul in the weight's dtype, cross-entropy in fp32, or fp64 for
    an fp64 weight) and errors as ``head_token_losses``; returns [N] losses in nats, 0 where not scored.
    Memory: [N, V] logits plus autograd's copies of them; only for tests and small N.
    """
    _check(hidden, weight, targets, scored, 1, rows)
    dtype = _loss_dtype(weight)
    w = weight if rows is None else weight[rows]
    logits = (hidden.to(w.dtype) @ w.T).to(dtype)  # [N, R]
    safe = torch.where(scored, targets, torch.zeros_like(targets))
    ce = F.cross_entropy(logits, safe, reduction="none")
    return torch.where(scored, ce, torch.zeros_like(ce))
