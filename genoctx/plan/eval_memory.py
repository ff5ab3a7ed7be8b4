"""Evaluation plans: the peak bytes of scoring one window, forward only (``plan_eval``).

Phases, followed as ``plan_memory`` follows a step, the largest one reported: without CP, for the window's last
chunk (and the one before a shorter last chunk), each decoder layer's mixer, feed-forward and mHC, then the head
(``_eval_phases_chunks``); under CP, each layer's state pass, gather, pooling and streamed mixer, then the
feed-forward, mHC and head over the rank's ``T`` tokens (``_eval_phases_cp``). Components (bytes):

- ``weights`` ``4 P`` (the local fp32 parameters as ``build_model`` makes them: ``shard_numel`` under FSDP, the
  whole model or its EP block without); ``unsharded_params``: under FSDP the all-gathered root (kept after
  forward) and the current and prefetched decoder layer (``_eval_params``).
- ``window_io``: the window's ids, positions and masks, and its float64 losses.
- ``residual_streams``: the mHC streams and sub-layer inputs and outputs alive (``_eval_layer``); at the head the
  final hidden states.
- ``carried_caches``: without CP the cache handed to the chunk and the one being built (``_eval_cache``); under
  CP a DSA layer's streamed cache (the mixers return none).
- working sets: ``kda_forward`` (``_kda_eval``), ``dsa_attention`` and ``dsa_indexer_tiles`` (``_dsa_eval``),
  ``moe_dispatch`` and ``dense_mlp`` (``_ffn_eval``), ``mhc``, ``logits_loss`` (``_head_eval``), ``cp_gather``
  (``_kda_cp_phases``, ``_dsa_cp_phases``).
- ``allocator_slack``: as ``plan_memory``'s.

Measured on the CPU (``bench/plan_vs_measured.py``, layouts ``single-eval`` and ``fsdp2-cp2-eval``). On CUDA the
Triton kernels keep DSA's tiles on chip: the tile terms are upper bounds there.

The code: the sizes of one layer without gradients (``_kda_eval``, ``_dsa_eval``, ``_eval_cache``, ``_ffn_eval``,
``_head_eval``), then the phases of one layer (``_eval_layer``), of the model-level chunks (``_eval_phases_chunks``,
``_eval_chunk_call``) and under CP (``_eval_phases_cp``, ``_kda_cp_phases``, ``_dsa_cp_phases``); the peak is
``plan_memory``'s ``_summary``.
"""

from __future__ import annotations

import dataclasses

from ..model.config import KDA, ModelConfig
from ..parallel.layout import LAYOUTS, Layout, cp_pieces
from .comms import all_to_all_bytes
from .memory import _check_model_layout, _gib, _slack, _summary
from .sizes import (
    DTYPE_BYTES,
    F32,
    NUCLEOTIDE_VOCAB,
    SUB_CHUNK,
    _add,
    _dsa_gather_width,
    _dsa_tiles_fwd,
    _indexer_tiles,
    _kda_block,
    _layout_dict,
    _moe_fwd,
    _Sizes,
    param_counts,
    shard_numel,
)  # fmt: skip

# ---------------------------------------------------------------- evaluation: forward only, one window

EVAL_COMPONENTS = (
    "weights", "unsharded_params", "window_io", "residual_streams", "carried_caches",
    "kda_forward", "dsa_attention", "dsa_indexer_tiles", "moe_dispatch", "dense_mlp", "mhc", "logits_loss",
    "cp_gather", "allocator_slack",
)  # fmt: skip
EVAL_WORKING_SETS = ("kda_forward", "dsa_attention", "dsa_indexer_tiles", "moe_dispatch", "dense_mlp", "mhc",
                     "logits_loss", "cp_gather")  # fmt: skip


def _eval_params(cfg: ModelConfig, layout: Layout, s: _Sizes, device: str) -> dict:
    """Parameter bytes of one rank in eval: ``weights`` ``f P`` (the local fp32 parameters ``build_model`` makes,
    ``shard_numel``); under FSDP the all-gathered ``root`` (kept after forward) and each decoder layer's ``blocks``
    (``a`` bytes per parameter, its fp32 islands ``f``: what ``plan_memory`` counts). Eval's bf16 autocast keeps no
    weight-cast cache (``cache_enabled=False``): a cast copy lives only for its matmul and is not counted."""
    pc = param_counts(cfg)
    fsdp, a, f, ep = layout.fsdp, s.a, s.f, layout.ep
    gathered = [x["dense"] + x["expert"] / ep for x in pc["layers"]]
    blocks = [a * g + (f - a) * x["island"] if fsdp else 0.0 for g, x in zip(gathered, pc["layers"], strict=True)]
    root = pc["root"]["dense"] + pc["root"]["expert"] / ep
    return {
        "weights": f * sum(shard_numel(pc["shapes"], layout).values()),
        "root": a * root if fsdp else 0.0,
        "blocks": blocks,
    }


def _kda_core_eval(cfg: ModelConfig, V: int) -> float:
    """``chunk_kda`` under ``torch.no_grad`` (fp32 whatever the model's dtype), values of width V: bytes per token above
    its inputs at its peak, in ``genoctx.model.kda._fused_scores`` (``s = 8`` tokens per sub-chunk, ``n = C / s``):
    ``f H (F + 2K)`` (the packed block ``[k | q | g | v | beta]``, ``F = 3K + V + 1``; cumulative and exponentiated
    decays) plus, inside sub-chunks, ``2 s K + 2 s`` (``Ed``, ``b_diag``, the two rows' scores), or, between them
    (``n > 1``, the factors inside freed), ``2 s + 3K + 2 n K + 2C`` (the scores inside, row decays, ``e``, ``b_off``,
    the decayed rows, the fused ``C x 2C`` scores), whichever is larger (measured on tiny and cpu-small within 1%).
    The later steps (triangular solve, per-chunk state loop) hold less."""
    H, K, C = cfg.linear_num_heads, cfg.linear_head_dim, cfg.kda_chunk_size
    sub = SUB_CHUNK if C % SUB_CHUNK == 0 else C
    n = C // sub
    base = 3 * K + V + 1 + 2 * K + 2 * sub
    off = base + 3 * K + 2 * n * K + 2 * C if n > 1 else 0
    return F32 * H * max(base + 2 * sub * K, off)


def _kda_eval(cfg: ModelConfig, s: _Sizes, rows: int, T: int, V: int | None = None) -> float:
    """A KDA layer's forward without gradients over ``rows`` sequences of ``T`` tokens (``N = rows T``), bytes above
    its input: the larger of ``KimiDeltaAttention.project`` (``N HK (6a + 9f)``: q|k|v, the conv input with its tail,
    the fp32 conv input, output and SiLU; 15 HK fp32 elements measured in fp32) and the core (``N (HK (3a + 3f) +
    H f)``: the SiLU output that v is a view of, the fp32 normalised q, k and the decay g, beta; plus one block's
    ``_kda_core_eval(V)`` (``Tb`` tokens, ``_kda_block``) and the outputs of the blocks before, ``a H V`` per token,
    or at the end, with several blocks, the outputs and their concatenation). ``V`` (default ``K``) is ``2K`` in
    the CP state pass, whose values ``[v | 0]`` add ``2 HK a`` per token."""
    H, K = cfg.linear_num_heads, cfg.linear_head_dim
    V = K if V is None else V
    HK, N = H * K, rows * T
    Tb, blocks = _kda_block(cfg, T)
    ext = 2 * HK * s.a if V > K else 0  # [v | 0]
    core = N * (HK * (3 * s.a + 3 * s.f) + H * s.f + ext) + rows * Tb * _kda_core_eval(cfg, V)
    if blocks > 1:
        out = s.a * H * V
        core = max(core + rows * (T - Tb) * out, N * (HK * (3 * s.a + 3 * s.f) + H * s.f + ext) + 2 * N * out)
    return max(N * HK * (6 * s.a + 9 * s.f), core)


def _dsa_eval(cfg: ModelConfig, s: _Sizes, full: bool, T: int, S: int) -> dict:
    """A DSA layer's forward without gradients over a chunk of ``T`` queries after ``S`` cached positions: its two
    phases, ``{"indexer": {component: bytes}, "attention": {component: bytes}}``, besides the input, the cache it
    returns (``_eval_cache``) and the cache it was given.

    Kept through both (``dsa_attention``), per query: ``a (Q + Hm dq + Hm R)`` (q-LoRA residual, queries, absorbed
    queries) ``+ 16`` (positions, visible pools, int64) and on a full layer ``a (HI dI + HI) + 4 topk / kp`` (indexer
    queries and weights, the int32 selection); with a cache (``S > 0``) also ``a R`` (the chunk's latents, concatenated
    with the cached ones into the returned cache) and, full, ``dI (f + a)`` (the chunk's indexer keys, fp32 after the
    LayerNorm under autocast, and gates; the concatenations with the cached tail are the returned cache's).
    ``indexer``: ``_indexer_tiles(T, S + T)``. ``attention``: ``a Hm R + f Hm`` (output latents, log-sum-exp) and
    ``_dsa_tiles_fwd(T)`` (sparse), or in ``dsa_mode="dense"`` the causal mask of one tile of ``rows = max(1,
    indexer_tile_tokens // n)`` queries over ``n = S + T`` keys and its additive fp32 form, ``rows n (1 + f)`` (none
    when all ``T`` rows fit that budget in one causal call, ``S = 0``), and the tiles' outputs with their
    concatenation ``2 a Hm R`` per query (SDPA's fused kernels hold no score matrix). Measured on tiny and cpu-small
    (fp32) within 10% (sparse; dense on cpu-small, 8k tokens)."""
    Q, R, Hm, dq = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.num_attention_heads, cfg.qk_head_dim
    HI, dI, kp = cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
    per = s.a * (Q + Hm * dq + Hm * R) + 16
    if full:
        per += s.a * (HI * dI + HI) + 4 * (cfg.index_topk // kp)
    if S > 0:
        per += s.a * R + (dI * (s.f + s.a) if full else 0)
    base = T * per
    if cfg.dsa_mode == "sparse":
        attn = T * (s.a * Hm * R + s.f * Hm) + _dsa_tiles_fwd(cfg, s, T, S)
    else:
        n = S + T
        masked = not (S == 0 and T * n <= cfg.indexer_tile_tokens)
        rows = max(1, min(T, cfg.indexer_tile_tokens // n))
        attn = masked * rows * n * (1 + s.f) + 2 * T * s.a * Hm * R
    out = {}
    if full and cfg.dsa_mode == "sparse":
        out["indexer"] = {"dsa_attention": base, "dsa_indexer_tiles": _indexer_tiles(cfg, T, S + T)}
    out["attention"] = {"dsa_attention": base + attn}
    return out


def _eval_cache(cfg: ModelConfig, s: _Sizes, i: int, positions: int, tokens: int) -> float:
    """Bytes of the cache layer ``i`` returns after ``positions`` positions, the last call over ``tokens`` of them.
    KDA: ``f H K V`` (the state) ``+ a (w) 3 HK`` (the conv tail, ``w = linear_conv_kernel_dim - 1``). DSA: ``a R``
    per position (latents) and on a full layer ``f dI / kp`` (pooled keys, fp32) plus ``2 a dI`` per token of the
    last call (the incomplete pool's keys and gates are views of that call's)."""
    if cfg.layer_types[i] == KDA:
        H, K = cfg.linear_num_heads, cfg.linear_head_dim
        return s.f * H * K * K + s.a * (cfg.linear_conv_kernel_dim - 1) * 3 * H * K
    out = s.a * cfg.kv_lora_rank * positions
    if cfg.indexer_types[i] == "full":
        dI = cfg.index_head_dim
        out += s.f * dI * (positions // cfg.index_kpool) + tokens * dI * 2 * s.a
    return out


def _ffn_eval(cfg: ModelConfig, s: _Sizes, i: int, N: int, ep: int) -> dict:
    """The feed-forward of layer ``i`` over ``N`` tokens, no gradients. MoE (``moe_dispatch``): one dispatch chunk
    (``_moe_fwd``, what its recomputation holds in training; under EP its send and receive buffers), the outputs of
    the chunks before it ``(N - Nc) D a`` and the int64 sequence ids ``8 N``; at the end the outputs and their
    concatenation ``2 N D a``. Dense MLP (``dense_mlp``): ``5 Id a`` (gate and up outputs, the SiLU, the clamped up,
    their product). Measured on tiny and cpu-small within 2%."""
    D = cfg.hidden_size
    if cfg.mlp_layer_types[i] != "sparse":
        return {"dense_mlp": N * 5 * cfg.intermediate_size * s.a}
    Nc = min(cfg.moe_chunk_tokens, N)
    chunk = _moe_fwd(cfg, s, N, ep) + (N - Nc) * D * s.a
    return {"moe_dispatch": 8 * N + max(chunk, 2 * N * D * s.a)}


def _head_eval(cfg: ModelConfig, s: _Sizes, N: int, rows: int | None, chunk: int) -> float:
    """The head over ``N`` tokens, no gradients (``logits_loss``). The 8-token model: ``N V (a + c + f) + 24 N``
    (logits, their fp32 copy, the log-softmax; the fp32 losses and their float64 copy). A text vocabulary
    (``VocabHead.log_probs``): per chunk of ``chunk`` tokens the fp32 hidden states ``f D`` and their copy in the
    weight's dtype, then ``2 f V`` (the logits in fp32 and logsumexp's temporary) over the full vocabulary, or
    ``3 f rows`` over ``rows`` nucleotide rows; plus the ``[N, 8]`` fp32 output and the float64 losses."""
    V, D = cfg.vocab_size, cfg.hidden_size
    if V <= NUCLEOTIDE_VOCAB:
        return N * (V * (s.a + s.c + s.f) + 24)
    C = min(chunk, N)
    per = 2 * s.f * V if rows is None else 3 * s.f * rows
    return C * (D * (s.f + s.ca) + per) + N * (8 * s.f + 16)


@dataclasses.dataclass(frozen=True)
class _EvalRun:
    """What the phases of one ``plan_eval`` call read: the model, sizes, layout, window ``L``, chunk, head and the
    parameter bytes of ``_eval_params``."""

    cfg: ModelConfig
    s: _Sizes
    layout: Layout
    L: int
    chunk: int | None
    rows: int | None
    head_chunk: int
    cp_layout: str
    params: dict


def _eval_base(ev: _EvalRun, i: int, caches: float, io: float) -> dict:
    """What every phase of decoder layer ``i`` holds besides its own tensors: the weights, under FSDP the root's and
    the current and prefetched layer's all-gathered parameters, the window's ids and losses (``window_io``) and the
    caches alive."""
    p = ev.params
    blocks = p["blocks"]
    nxt = blocks[i + 1] if i + 1 < len(blocks) else 0.0
    return {"weights": p["weights"], "unsharded_params": p["root"] + blocks[i] + nxt, "window_io": io,
            "carried_caches": caches}  # fmt: skip


def _layer_kind(cfg: ModelConfig, i: int) -> str:
    return ("kda" if cfg.layer_types[i] == KDA else "dsa") + "+" + ("moe" if cfg.mlp_layer_types[i] == "sparse"
                                                                    else "mlp")  # fmt: skip


def _eval_layer(ev: _EvalRun, i: int, N: int, base: dict, mixer: list, where: str = "") -> list:
    """The phases of decoder layer ``i`` over ``N`` tokens: the mixer's (``mixer``: ``[(name, components)]``), then
    the feed-forward and the mHC after it. The streams and what ``HyperConnection`` returns in their dtype are fp32
    (``r`` bytes, ``_Sizes.r``), and so is a sub-layer's normalised input (the norm's weight times its fp32
    normalised input); the sub-layers' outputs are in ``a``. ``residual_streams`` (``DecoderLayer.forward`` without
    gradients): in the mixer the layer input and the normalised sub-layer input, ``N (nDr + Dr)``; in the
    feed-forward half the input, the streams after the mixer and three ``[N, D]`` tensors alive as locals (the mixer
    output, the mHC's sub-layer input, its normalised copy), ``N (2 nDr + Da + 2 Dr)``; ``mhc``: the ``post`` of the
    feed-forward, ``3 N nDr`` (the mixed streams, the scaled output, their sum), more than any ``pre`` (``f (nD + D +
    (2 + n) n)`` per token)."""
    cfg, s = ev.cfg, ev.s
    nDr, Dr, Da = N * cfg.hc_mult * cfg.hidden_size * s.r, N * cfg.hidden_size * s.r, N * cfg.hidden_size * s.a
    head = f"forward layer {i} ({_layer_kind(cfg, i)})"
    out = [(f"{head}: {name}{where}", _add(base, {"residual_streams": nDr + Dr}, c)) for name, c in mixer]
    mid = _add(base, {"residual_streams": 2 * nDr + Da + 2 * Dr})
    out.append((f"{head}: feed-forward{where}", _add(mid, _ffn_eval(cfg, s, i, N, ev.layout.ep))))
    out.append((f"{head}: mHC{where}", _add(mid, {"mhc": 3 * nDr})))
    return out


def _eval_head(ev: _EvalRun, N: int, caches: float, io: float, where: str = "") -> tuple:
    """The end of the forward: the final hidden states ``N D r`` (the final norm of the fp32 streams' mean: fp32) and
    the head (``_head_eval``); the root's parameters."""
    p = ev.params
    return (f"end of forward (head){where}", {
        "weights": p["weights"], "unsharded_params": p["root"], "window_io": io, "carried_caches": caches,
        "residual_streams": N * ev.cfg.hidden_size * ev.s.r,
        "logits_loss": _head_eval(ev.cfg, ev.s, N, ev.rows, ev.head_chunk)})  # fmt: skip


def _eval_phases_chunks(ev: _EvalRun) -> list:
    """Without CP: the window as model-level chunks of ``Nc = chunk or L`` tokens (``_chunk_losses``). The last chunk
    is the largest moment (its caches are the window's); when it is shorter than ``Nc``, the one before it too."""
    L = ev.L
    Nc = min(ev.chunk or L, L)
    last = (L - 1) // Nc * Nc
    calls = [(last, L - last)] + ([(last - Nc, Nc)] if L - last < Nc and last >= Nc else [])
    return [ph for S, N in calls for ph in _eval_chunk_call(ev, S, N, Nc)]


def _eval_chunk_call(ev: _EvalRun, S: int, N: int, Nc: int) -> list:
    """The phases of one model call over positions ``[S, S + N)`` after the cache of ``[0, S)``. ``carried_caches``:
    the cache handed in (every layer's, ``_eval_cache`` after ``S`` positions) and the new one built layer by layer;
    both are alive until the call returns (a DSA layer concatenates the cached latents with the chunk's: the last
    chunk holds the window's latents twice). ``window_io``: ``17 L`` (the window's and the inputs' int64 ids, the
    scored mask) and the float64 losses of the positions done, ``8 S``."""
    cfg, s = ev.cfg, ev.s
    n_layers = cfg.num_hidden_layers
    old = sum(_eval_cache(cfg, s, j, S, Nc) for j in range(n_layers)) if S else 0.0
    io = 17 * ev.L + 8 * S
    where = f", chunk [{S}, {S + N})" if N < ev.L else ""
    phases, new = [], 0.0
    for i in range(n_layers):
        new += _eval_cache(cfg, s, i, S + N, N)
        base = _eval_base(ev, i, old + new, io)
        if cfg.layer_types[i] == KDA:
            mixer = [("mixer", {"kda_forward": _kda_eval(cfg, s, 1, N)})]
        else:
            mixer = list(_dsa_eval(cfg, s, cfg.indexer_types[i] == "full", N, S).items())
        phases += _eval_layer(ev, i, N, base, mixer, where)
    phases.append(_eval_head(ev, N, old + new, io + 8 * N, where))
    return phases


def _kda_cp_phases(ev: _EvalRun, i: int, T: int, n_local: int, span: int, spans: int, pieces: int) -> list:
    """A KDA layer under CP (``genoctx.parallel.context._kda_forward``) on the busiest rank, its ``T`` tokens in
    ``n_local`` pieces batched, streamed in calls of ``Ns = n_local x span`` tokens: the state pass
    (``kda_cp_cache``: ``_kda_eval`` with values ``[v | 0]`` of width ``2K``); the gather and fold of every piece's
    ``[L | M]`` (``cp_gather``: ``f P H K (V + K)`` twice, the all-gather's output and its concatenation, then the
    natural-order copy; folding, ``[L | M]`` with the ``P`` states and their stack, ``2 f P H K V``); the layer over
    its pieces from their caches (states and conv tails), ``_kda_eval`` per call, the outputs of the calls before,
    ``(T - Ns) D a``; at the end the outputs and their concatenation, ``2 T D a``, or ``T D a`` in one call (no CP
    tie-in sum without gradients). Returns the phases (the layer returns no cache under CP)."""
    cfg, s = ev.cfg, ev.s
    H, K, D = cfg.linear_num_heads, cfg.linear_head_dim, cfg.hidden_size
    Ns = n_local * span
    state = n_local * _eval_cache(cfg, s, i, 0, 0)
    gather = s.f * pieces * H * K * max(2 * (K + K), (K + K) + 2 * K)
    out = (2 if spans > 1 else 1) * T * D * s.a
    return [
        ("CP state pass", {"kda_forward": _kda_eval(cfg, s, n_local, span, 2 * K)}),
        ("CP state gather", {"cp_gather": gather}),
        ("mixer", {"kda_forward": state + max(_kda_eval(cfg, s, n_local, span) + (T - Ns) * D * s.a, out)}),
    ]


def _dsa_cp_phases(ev: _EvalRun, i: int, T: int, span: int, spans: int, piece: int) -> list:
    """A DSA layer under CP (``_dsa_forward``, ``dsa_cp_cache``) on the rank holding the window's last piece.

    ``cp_gather``: the latents and indexer keys and gates of the rank's ``T`` tokens, packed (``W = R + 2 dI``
    elements, fp32 on a full layer: the LayerNorm's fp32 keys promote the pack; ``a`` on a shared one), then the
    all-gather's output and its concatenation, ``2 L W``; kept while the layer runs, the natural-order window ``L W``
    (with bf16, copies of its latents and gates in ``a``) and the pooled keys of the positions before each local
    piece (``f dI (L - c) / kp``), computed through ``2 f dI (L - c)`` of pooling softmax. Streaming the last piece,
    its last call (``span`` queries after ``S = L - span`` positions): ``_dsa_eval``, the cached latents and pooled keys
    it was given (the previous call's concatenation; a view of the window in the piece's first call) and the new ones
    (``carried_caches``), the earlier calls' outputs ``(T - span) D a``. At the end the last call's cache
    (``_eval_cache`` of all ``L`` positions, freed when the layer returns: no cache is returned under CP), the outputs
    and their concatenation (no CP tie-in sum without gradients), and the selections (``4 topk / kp + 8`` per token,
    listed and concatenated). Returns the phases."""
    cfg, s, L = ev.cfg, ev.s, ev.L
    full = cfg.indexer_types[i] == "full"
    R, dI, kp, D = cfg.kv_lora_rank, cfg.index_head_dim, cfg.index_kpool, cfg.hidden_size
    p = s.f if full else s.a
    W = _dsa_gather_width(cfg, full)
    window = L * W * p + (L * (R + (dI if full else 0)) * s.a if p != s.a else 0)
    pools = s.f * dI * ((L - piece) // kp) if full else 0.0
    own = T * (R * s.a + (dI * (s.f + s.a) if full else 0))
    phases = [("CP gather", {"cp_gather": own + T * W * p + 2 * L * W * p})]
    if full:
        phases.append(("CP pooling", {"cp_gather": window + pools + 2 * s.f * dI * (L - piece)}))
    S = L - span
    kept = _eval_cache(cfg, s, i, L, span)
    given = (s.a * R * S + (s.f * dI * (S // kp) if full else 0)) if spans > 1 else 0.0
    sel = (4 * (cfg.index_topk // kp) + 8) if cfg.dsa_mode == "sparse" else 0
    stream = {"cp_gather": window + pools, "carried_caches": given + kept, "dsa_attention": (T - span) * D * s.a}
    for name, comps in _dsa_eval(cfg, s, full, span, S).items():
        phases.append((name, _add(stream, comps)))
    out = (2 if spans > 1 else 1) * T * D * s.a + (2 if full else 1) * T * sel
    phases.append(("mixer output", {"cp_gather": window + pools, "carried_caches": kept, "dsa_attention": out}))
    return phases


def _eval_phases_cp(ev: _EvalRun) -> list:
    """Under CP: the busiest rank (the window's last piece) runs its ``T = L / cp`` tokens in one model call; each
    mixing layer streams its pieces of ``c = L / pieces`` tokens in calls of ``span = min(chunk, c)`` tokens; a
    mixer returns no cache under CP, so only the one being streamed is alive (``carried_caches``). ``window_io``:
    ``25 L`` (the window's ids, positions, inputs as int64 and scored mask, sliced to the rank's pieces: views, copies
    ``25 T`` under zigzag); at the head the float64 losses ``8 T``."""
    cfg, L, cp = ev.cfg, ev.L, ev.layout.cp
    pieces = sum(len(x) for x in cp_pieces(cp, ev.cp_layout))
    n_local, c, T = pieces // cp, L // pieces, L // cp
    span = min(ev.chunk or c, c)
    spans = -(-c // span)
    io = 25 * L + (25 * T if n_local > 1 else 0)
    phases = []
    for i in range(cfg.num_hidden_layers):
        base = _eval_base(ev, i, 0.0, io)
        if cfg.layer_types[i] == KDA:
            mixer = _kda_cp_phases(ev, i, T, n_local, span, spans, pieces)
        else:
            mixer = _dsa_cp_phases(ev, i, T, span, spans, c)
        phases += _eval_layer(ev, i, T, base, mixer)
    phases.append(_eval_head(ev, T, 0.0, io + 8 * T))
    return phases


def _check_eval_args(cfg, seq_len, layout, gpu_memory_gib, chunk_tokens, dtype, device, loss_chunk_tokens,
                     loss_vocab_rows, allocator_slack, cp_layout):  # fmt: skip
    _check_model_layout(cfg, layout, gpu_memory_gib, dtype, device, loss_vocab_rows, allocator_slack)
    for name, v in (("seq_len", seq_len), ("loss_chunk_tokens", loss_chunk_tokens), ("chunk_tokens", chunk_tokens)):
        if v is None and name == "chunk_tokens":
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if cp_layout not in LAYOUTS:
        raise ValueError(f"cp_layout must be one of {', '.join(LAYOUTS)}, got {cp_layout!r}")
    if layout.cp > 1:
        pieces = sum(len(x) for x in cp_pieces(layout.cp, cp_layout))
        tail = max(1, cfg.linear_conv_kernel_dim - 1)
        if seq_len % pieces or seq_len // pieces < tail:
            raise ValueError(f"cp={layout.cp} ({cp_layout}): seq_len {seq_len} does not split into {pieces} equal "
                             f"pieces of at least {tail} tokens")  # fmt: skip


def plan_eval(
    cfg: ModelConfig,
    seq_len: int,
    layout: Layout,
    *,
    gpu_memory_gib: float,
    chunk_tokens: int | None = None,
    dtype: str = "bf16",
    loss_vocab_rows: int | None = None,
    loss_chunk_tokens: int = 2048,
    device: str = "cuda",
    allocator_slack: float | None = None,
    cp_layout: str = "contiguous",
) -> dict:
    """Predicted peak memory on the busiest rank of ``layout`` while it scores one window of ``seq_len`` tokens in
    evaluation (``genoctx eval``, one process or on the mesh: ``genoctx.eval.distributed``): forward only, under
    ``torch.no_grad``, no gradient, no optimizer.

    Args:
        cfg: the model (its compute knobs ``kda_chunk_size``, ``indexer_tile_tokens``, ``moe_chunk_tokens``,
            ``dsa_mode`` count; ``indexer_stage`` does not: no KL without gradients).
        seq_len: the window ``L`` (batch 1: a rank scores one window at a time).
        layout: ``dp_replicate x ep x dp_shard x cp``; every rank of a CP group holds ``T = L / cp`` of the window.
        gpu_memory_gib: memory of one device in GiB; ``fits`` is ``total_gib <= gpu_memory_gib``.
        chunk_tokens: ``genoctx eval --chunk-tokens``: without CP the window is fed as model-level chunks of this
            many tokens with the carried cache (``genoctx.eval.scoring._chunk_losses``); under CP each piece is
            streamed through every mixing layer in chunks of this many tokens (``CPLayout.spans``). None = whole
            windows (pieces).
        dtype: ``"bf16"`` (what eval runs on CUDA: FSDP2 all-gathers bf16, bf16 autocast) or ``"fp32"`` (the CPU).
        loss_vocab_rows, loss_chunk_tokens: the head of a model with a text vocabulary (``VocabHead``: 5 rows for
            ``loss.vocab: nucleotide``, None = the full vocabulary; logits in chunks of ``loss_chunk_tokens``).
        device: ``"cuda"`` (allocator slack; the autocast weight cache) or ``"cpu"``.
        allocator_slack: as ``plan_memory``'s.
        cp_layout: ``contiguous`` or ``zigzag`` (``genoctx.parallel.layout.cp_pieces``); the busiest rank is the one
            holding the window's last piece (rank ``cp - 1``, or rank 0 under zigzag), whose DSA layers attend over
            the whole window.

    Returns:
        ``plan_memory``'s keys (``components_gib`` over ``EVAL_COMPONENTS``; ``persistent_gib`` with ``gradients``
        and ``optimizer_state`` 0; ``batch_size`` 1; no ``recompute``/``optimizer_offload``) plus ``"mode": "eval"``,
        ``"chunk_tokens"`` and ``"cp_layout"``.

    Phases and components (bytes): the module docstring.

    Raises:
        ValueError: a bad argument, or a layout this model cannot run (``ep`` not dividing the experts, a window that
            does not split into the CP pieces of at least ``linear_conv_kernel_dim - 1`` tokens).
    """
    _check_eval_args(cfg, seq_len, layout, gpu_memory_gib, chunk_tokens, dtype, device, loss_chunk_tokens,
                     loss_vocab_rows, allocator_slack, cp_layout)  # fmt: skip
    s = _Sizes(a=DTYPE_BYTES[dtype])
    cp_layout = cp_layout if layout.cp > 1 else "contiguous"
    ev = _EvalRun(cfg, s, layout, seq_len, chunk_tokens, loss_vocab_rows, loss_chunk_tokens, cp_layout,
                  _eval_params(cfg, layout, s, device))  # fmt: skip
    phases = _eval_phases_cp(ev) if layout.cp > 1 else _eval_phases_chunks(ev)
    working = {k: max(c.get(k, 0.0) for _, c in phases) for k in EVAL_WORKING_SETS}
    out = _summary(phases, _slack(allocator_slack, device), EVAL_COMPONENTS, working)
    pc = param_counts(cfg)
    return {
        "layout": _layout_dict(layout),
        "fits": out["total_gib"] <= gpu_memory_gib,
        **out,
        "tokens_per_rank": seq_len // layout.cp,
        "all_to_all_gib": _gib(all_to_all_bytes(cfg, seq_len // layout.cp, layout, s.a, passes=2)),
        "params_per_rank": shard_numel(pc["shapes"], layout),
        "largest_layer_unsharded_gib": _gib(max(ev.params["blocks"], default=0.0)),
        "persistent_gib": {"weights": _gib(ev.params["weights"]), "gradients": 0.0, "optimizer_state": 0.0,
                           "on_host": False},  # fmt: skip
        "seq_len": seq_len,
        "batch_size": 1,
        "gpu_memory_gib": gpu_memory_gib,
        "dtype": dtype,
        "device": device,
        "mode": "eval",
        "chunk_tokens": chunk_tokens,
        "cp_layout": cp_layout,
    }

