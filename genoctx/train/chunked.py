"""Exact, memory-bounded training of one long window by chunks (DESIGN.md's chunk contract, third use).

A window of ``L`` tokens is cut into consecutive chunks of ``seq_chunk_tokens`` (the last one shorter when ``L`` is
not a multiple). One training step is two sweeps:

1. **Forward, no graph.** The chunks run in order under ``torch.no_grad``, each taking the cache the previous one
   returned (``HybridLM.hidden(tokens, cache)``). What crosses each boundary is kept and nothing else: per KDA layer
   the recurrent state ``[B, H, K, V]`` fp32 and the short-convolution tail; per DSA layer the tail of the
   indexer's incomplete pool. The DSA latents ``[B, L, kv_lora_rank]`` and pooled indexer keys
   ``[B, L / kpool, d_I]`` of every token are kept once, from the last chunk's cache: the incoming cache of chunk
   ``c`` is their first ``start_c`` positions (views, no copy). This sweep also counts each MoE layer's router loads
   (once per token, as one pass does) and, with the sequence-wise balance loss on, each sequence's expert
   selections over the whole window.
2. **Backward, in reverse.** For ``c = n-1 .. 0`` the chunk is recomputed with grad from its stored incoming cache,
   whose floating tensors are made leaves (``requires_grad``). Its objective is
   ``loss_sum_c / count + aux_c x T_c / L`` (the auxiliary losses are means over a chunk's queries, so
   ``T_c / L`` weights make them the window's means), and ``torch.autograd.backward`` runs on the objective and on
   the chunk's outgoing cache tensors together, the latter with the gradient that chunk ``c + 1`` computed for its
   incoming leaves. The leaves' gradients are what chunk ``c - 1`` then hands on. A DSA layer's outgoing latents
   are ``cat(incoming, own)``, so the gradient that reaches chunk ``c``'s incoming latents already sums what every
   later chunk sent to those positions: the accumulation across chunks is autograd's own.

The sweep also records each full DSA layer's top-k selection per chunk (``DeepSeekSparseAttention.selection_memo``,
keyed by the chunk's positions): the grad pass attends over the recorded pools instead of scoring the indexer again
(the top-k is a deterministic function of the same inputs in both passes; the indexer KL still runs on its keys).
This keeps ``B L K 4`` bytes per full DSA layer (int32 pools, ``K = index_topk / index_kpool``) for the step, ``L``
this rank's tokens under CP (each CP piece's call is keyed by its own positions, so the same code serves CP).

Loss and every gradient equal one pass over the whole window (tests: fp64, window not a multiple of the chunk,
shared DSA layer, MoE with the balance loss, indexer KL stages "warmup" and "sparse", all-N chunks). The
sequence-wise MoE balance loss stays exact: its ``f`` (selection fraction) comes from the forward sweep over the
whole window (``MoE.window_selection``), its ``P`` is linear in the tokens and splits over chunks.

Memory: one chunk's activations (with ``train.activation_checkpointing``, one layer's inside the chunk) plus the
boundary state, which grows with ``L`` only through the DSA latents and pooled indexer keys and their gradients
(``genoctx.plan``: ``seq_chunk_tokens``). Cost: every chunk runs forward twice (three times with activation
checkpointing).

Under context parallelism (``cp=``) each rank chunks its piece: the window is cut into rounds of ``cp x
seq_chunk_tokens`` tokens, each round into the CP layout's pieces (``shard_sequence``), and a round is one chunk of
the two sweeps above on every rank at once. The CP mixers take the cache of the positions before the round and,
inside ``genoctx.parallel.context.carrying_cache``, return the cache after it, the same on every rank (built from
the gathered pieces); the reverse sweep enters that context too, so a layer recomputed by activation checkpointing
carries as its forward did, and every rank back-propagates the same roots (a missing gradient is a zero), so the
collectives stay in step. Each rank's incoming-cache gradient is its own uses'; the gathers' reduce-scatters sum them
for the pieces' owners (``docs/context_parallel.md``).

Router loads are counted in the forward sweep only (the backward sweep restores ``load_counts``); after the step each
layer's ``stats`` describe the whole window (counts summed over chunks, the indexer loss the window's mean).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from ..model.config import DSA
from ..model.dsa import DeepSeekSparseAttention, DSACache
from ..model.model import HybridLM, ModelCache
from ..model.moe import MoE
from ..model.precision import island
from ..progress import bar


def chunk_bounds(length: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: consecutive chunks covering ``length`` tokens, ``chunk_tokens`` each but the last.

    Raises:
        ValueError: ``chunk_tokens < 1``.
    """
    if chunk_tokens < 1:
        raise ValueError(f"seq_chunk_tokens must be >= 1, got {chunk_tokens}")
    return [(s, min(length, s + chunk_tokens)) for s in range(0, length, chunk_tokens)]


class _Boundaries:
    """The incoming cache of every chunk, with the DSA latents and pooled keys held once (prefix views)."""

    def __init__(self) -> None:
        # per chunk: None (chunk 0) or (per layer: KDACache | (tail_k, tail_gate, pools, positions), position)
        self.small: list = []
        self.final: ModelCache | None = None

    def add(self, cache: ModelCache | None) -> None:
        """Record chunk c's incoming cache (None for chunk 0): KDA caches whole, DSA tails only."""
        if cache is None:
            self.small.append(None)
            return
        row = []
        for c in cache.layers:
            if isinstance(c, DSACache):
                row.append((c.tail_k, c.tail_gate, None if c.pool_k is None else c.pool_k.shape[1], c.length))
            else:
                row.append(c)
        self.small.append((row, cache.position))

    def cache_in(self, c: int) -> ModelCache | None:
        """Chunk c's incoming cache, its DSA latents and pooled keys as views of the last chunk's."""
        entry = self.small[c]
        if entry is None:
            return None
        row, position = entry
        layers = []
        for small, last in zip(row, self.final.layers, strict=True):
            if isinstance(last, DSACache):
                tail_k, tail_gate, n_pools, length = small  # length: positions before the chunk (the round, CP)
                pool_k = None if n_pools is None else last.pool_k[:, :n_pools]
                layers.append(DSACache(last.latent[:, :length], pool_k, tail_k, tail_gate, window=last.latent))
            else:
                layers.append(small)
        return ModelCache(layers, position)


def _leaves(cache: ModelCache | None) -> tuple[ModelCache | None, list[Tensor]]:
    """A copy of ``cache`` whose floating tensors are fresh autograd leaves (detached, ``requires_grad``), and those
    leaves in ``ModelCache.tensors``' order."""
    if cache is None:
        return None, []
    leaves = cache.map_tensors(lambda t: t.detach().requires_grad_(True))
    return leaves, leaves.tensors()


# the cache fields whose gradient, handed back from chunk to chunk, sums the contributions of every later chunk: the
# KDA state (through the decays) and the DSA latents and pooled keys (``cat(incoming, own)``). fp32 islands
# (``genoctx.model.precision``): a bf16 sum would round once per chunk. The conv tail and the incomplete pool's keys
# and gates feed the next chunk only (one rounding, as any activation's gradient).
_SUMMED_GRADS = ("KDACache.state", "DSACache.latent", "DSACache.pool_k")


def _cache_fields(cache: ModelCache | None) -> list[str]:
    """``"<cache type>.<field>"`` of each tensor of ``cache.tensors()``, in that order (empty for None)."""
    if cache is None:
        return []
    return [f"{type(c).__name__}.{k}" for c in cache.layers if c is not None for k, v in vars(c).items()
            if torch.is_tensor(v) and v.is_floating_point() and k not in getattr(c, "views", ())]  # fmt: skip


@contextlib.contextmanager
def _memo_cleared_on_error(dsas: list[DeepSeekSparseAttention]):
    """Drop the layers' selection memos if the forward sweep raises (the backward sweep's ``finally`` drops them
    otherwise)."""
    try:
        yield
    except BaseException:
        for d in dsas:
            d.selection_memo = None
        raise


def _moes(model: HybridLM) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def _full_dsa(model: HybridLM) -> list[DeepSeekSparseAttention]:
    """The DSA layers with their own indexer (the ones whose top-k selections the step records)."""
    return [m for m in model.modules() if isinstance(m, DeepSeekSparseAttention) and m.indexer is not None]


_SUMMED = ("keys_scored", "keys_attended", "ep_received_rows", "ep_rounds")


def _merge_stats(parts: list[dict | None], weights: list[float]) -> dict | None:
    """One layer module's ``stats`` over the chunks of a window: counts summed, ``tokens_per_expert`` summed and
    ``load_max_over_mean`` recomputed from it, ``indexer_loss`` the ``weights``-weighted sum (T_c / L: the window's
    mean), ``ep_max_round_rows`` the max; anything else (path, kernel, indexer) as the chunks agree, else joined.
    Counts and losses may be device tensors: they are combined on the device (no host read per layer and chunk)."""
    parts_w = [(p, w) for p, w in zip(parts, weights, strict=True) if p]
    if not parts_w:
        return None
    out: dict = {}
    for key in parts_w[0][0]:
        vals = [p.get(key) for p, _ in parts_w]
        if key == "tokens_per_expert":
            out[key] = torch.stack([torch.as_tensor(v) for v in vals]).sum(0)
        elif key == "load_max_over_mean":
            continue
        elif key == "indexer_loss":
            ws = [w for _, w in parts_w]
            out[key] = None if any(v is None for v in vals) else sum(v * w for v, w in zip(vals, ws, strict=True))
        elif key in _SUMMED:
            out[key] = sum(vals)
        elif key == "ep_max_round_rows":
            out[key] = max(vals)
        else:
            uniq = list(dict.fromkeys(vals))
            out[key] = uniq[0] if len(uniq) == 1 else "+".join(map(str, uniq))
    if "tokens_per_expert" in out:  # on the device, read with the other layers' after the step (HybridLM.layer_stats)
        tpe = out["tokens_per_expert"]
        mean = tpe.float().mean()
        out["load_max_over_mean"] = torch.where(mean > 0, tpe.max() / mean, 0.0)
    return out


def chunked_forward_backward(
    model: HybridLM,
    inputs: Tensor,
    tokens: Tensor,
    scored: Tensor,
    chunk_tokens: int,
    count: Tensor,
    *,
    autocast=None,
    head=None,
    aux_scale: float = 1.0,
    cp=None,
) -> tuple[Tensor, Tensor | None]:
    """Loss and gradients of whole windows, computed chunk by chunk with bounded memory (module docstring).

    Args:
        model: the model (plain, or with FSDP2 / activation checkpointing applied); gradients accumulate into
            its parameters' ``.grad`` as one ``backward`` of the whole window would leave them.
        inputs, tokens: ``[B, L]`` int64: the ``<bos>``-shifted model inputs and the targets.
        scored: ``[B, L]`` bool: the positions whose loss counts.
        chunk_tokens: tokens per chunk (``train.seq_chunk_tokens``); ``>= L`` runs one chunk.
        count: the scored-token count the loss sum is divided by (clamped at 1): this batch's, or the global
            batch's under data parallelism.
        autocast: a context manager for each chunk's forward (bf16 autocast), or None.
        head: a ``genoctx.model.vocab.VocabHead`` (a base with a text vocabulary), or None for the model's logits.
        aux_scale: the auxiliary losses' weight in the objective (1 in one process; the rank's share of the global
            queries under data parallelism).
        cp: under context parallelism, this rank's ``genoctx.parallel.mesh.ParallelDims`` (``cp``, ``cp_rank``,
            ``cp_layout``; the model's mixers under ``apply_cp``), with ``inputs``, ``tokens``, ``scored`` the whole
            windows: the window is cut into rounds of ``cp x chunk_tokens`` tokens and each round into the CP pieces
            of its layout (``shard_sequence``), so each rank runs a chunk of ``chunk_tokens`` tokens per round, all
            ranks in step (their mixers' collectives, FSDP's), each round after the cache the previous round left
            (the same on every rank: ``carrying_cache``). None: no CP.

    Raises:
        ValueError: under CP, a round (the last one: ``L mod (cp x chunk_tokens)`` tokens) that does not split into
            the layout's pieces, or pieces shorter than the KDA conv tail.

    Returns:
        ``(loss_sum, aux)``: the sum of token losses in nats (fp64, detached) over the ``B x L`` positions, and the
        auxiliary loss of the whole window (detached, times ``aux_scale``) or None when the model has none.

    The objective back-propagated is ``loss_sum / max(count, 1) + aux_scale x aux``, the same as
    ``genoctx.train.loop.forward_backward`` builds from one pass.
    """
    from ..model.model import token_losses

    autocast = autocast if autocast is not None else contextlib.nullcontext()
    L = inputs.shape[1]
    if cp is None:
        bounds = chunk_bounds(L, chunk_tokens)
        carry = contextlib.nullcontext

        def cut(x: Tensor, s: int, e: int) -> Tensor:
            return x[:, s:e]
    else:
        from ..parallel.context import carrying_cache, shard_sequence
        from ..parallel.layout import uneven_seq_chunk_round

        bounds = chunk_bounds(L, chunk_tokens * cp.cp)
        tail = model.cfg.linear_conv_kernel_dim - 1 if any(t != DSA for t in model.cfg.layer_types) else 0
        bad = uneven_seq_chunk_round(L, chunk_tokens, cp.cp, cp.cp_layout, max(tail, 1))
        if bad is not None:
            raise ValueError(
                f"chunked training under CP: a round of {bad} tokens does not split into the {cp.cp_layout} "
                f"layout's pieces (cp={cp.cp}) of at least {max(tail, 1)} tokens"
            )
        carry = carrying_cache

        def cut(x: Tensor, s: int, e: int) -> Tensor:
            return shard_sequence(x[:, s:e], cp.cp, cp.cp_rank, cp.cp_layout)

    denom = count.clamp(min=1)
    moes = _moes(model)
    L_local = L if cp is None else L // cp.cp  # this rank's tokens (every round splits evenly over the CP ranks)

    def run(c: int, cache: ModelCache | None):
        s, e = bounds[c]
        x, y, m = (cut(t, s, e) for t in (inputs, tokens, scored))
        with autocast, carry():
            if head is not None:
                losses, cache = head.token_losses_cached(model, x, y, m, cache)
            else:
                logits, cache = model(x, cache)
                losses = token_losses(logits, y, m)
        return losses, cache

    # 1. forward, no graph: the boundaries, the router loads, each sequence's expert selections, the DSA top-k pools
    dsas = _full_dsa(model)
    for d in dsas:
        d.selection_memo = {}
    boundaries = _Boundaries()
    selections: list[Tensor | None] = [None] * len(moes)
    cache = None
    # progress (genoctx.progress): one task per sweep, its chunks; lines only in a sweep longer than the interval
    with (
        torch.no_grad(),
        _memo_cleared_on_error(dsas),
        bar("train step (forward sweep)", len(bounds), "chunks") as progress,
    ):
        for c in range(len(bounds)):
            boundaries.add(cache)
            _, cache = run(c, cache)
            for i, m in enumerate(moes):
                sel = m.last_selection
                if sel is not None:
                    selections[i] = sel if selections[i] is None else selections[i] + sel
            progress.advance(tokens=(bounds[c][1] - bounds[c][0]) * inputs.shape[0])
    boundaries.final = cache
    del cache
    for m, sel in zip(moes, selections, strict=True):
        m.window_selection = None if sel is None else (sel, L_local)
    saved_counts = [m.load_counts.clone() for m in moes]

    # 2. backward, in reverse
    loss_sum = torch.zeros((), dtype=torch.float64, device=inputs.device)
    aux_total: Tensor | None = None
    grads_out: list[Tensor | None] | None = None
    stats: dict[str, list] = {}
    weights = [(e - s) / L for s, e in reversed(bounds)]
    sweep = contextlib.ExitStack()
    try:
        progress = sweep.enter_context(bar("train step (backward sweep)", len(bounds), "chunks"))
        for c in reversed(range(len(bounds))):
            s, e = bounds[c]
            cache_in, leaves = _leaves(boundaries.cache_in(c))
            losses, cache_out = run(c, cache_in)
            part = island("loss.chunk_sum", losses.sum())
            objective = part / denom
            aux = model.aux_loss()
            if aux is not None:
                aux_c = aux * ((e - s) / L) * aux_scale
                objective = objective + aux_c
                aux_total = aux_c.detach() if aux_total is None else aux_total + aux_c.detach()
            outs, grads = [objective], [None]
            if grads_out is not None:
                for t, g in zip(cache_out.tensors(), grads_out, strict=True):
                    if g is None and cp is not None and t.requires_grad:
                        g = torch.zeros_like(t)  # under CP every rank back-propagates the same graph
                    if g is not None and t.requires_grad:
                        outs.append(t)
                        grads.append(g)
            with carry():  # a layer recomputed in backward (activation checkpointing) carries as its forward did
                torch.autograd.backward(outs, grads)
            grads_out = [x.grad for x in leaves]
            for name, g in zip(_cache_fields(cache_in), grads_out, strict=True):
                if name in _SUMMED_GRADS and g is not None:
                    island(f"chunked.grad.{name}", g)
            island("loss.window_sum", loss_sum.add_(part.detach().double()))
            for name, m in model.named_modules():
                st = m.__dict__.get("stats")
                if isinstance(st, dict):
                    stats.setdefault(name, []).append(st)
            del cache_in, leaves, cache_out, outs, grads, losses, part, objective, aux
            progress.advance(tokens=(e - s) * inputs.shape[0])
    finally:
        sweep.close()
        for d in dsas:
            d.selection_memo = None
        for m, counts in zip(moes, saved_counts, strict=True):
            m.window_selection = None
            m.load_counts.copy_(counts)
    for name, parts in stats.items():
        model.get_submodule(name).stats = _merge_stats(parts, weights)
    return loss_sum, aux_total
