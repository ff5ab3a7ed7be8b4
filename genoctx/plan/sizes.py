"""The planner's units and shared terms: parameter counts and shard sizes, the per-token activation sizes of
each layer kind (bytes per token, counted from the code tensor by tensor: see ``genoctx.plan.memory``), the
sequence-chunk boundary state, and a plan's layout record."""

from __future__ import annotations

import dataclasses
import functools
import json

from ..model.config import DSA, KDA, ModelConfig
from ..parallel.layout import DIMS, Layout

GIB = 2**30  # bytes in a GiB
F32 = 4  # bytes of an fp32 element (``f``)
DTYPE_BYTES = {"bf16": 2, "fp32": 4}  # activation element size ``a`` by ``dtype``
ALLOCATOR_SLACK = 0.05  # CUDA caching-allocator slack, a fraction of the peak (expandable segments)
DEVICES = ("cuda", "cpu")

# Copied from the code they describe (tests/test_plan.py checks that they still match):
ATTN_TILE_TOKENS = 1 << 16  # genoctx.model.dsa.ATTN_TILE_TOKENS: sparse-attention query rows x selected tokens
ATTN_TILE_BYTES = ATTN_TILE_TOKENS * (512 + 64) * 4  # genoctx.model.dsa.ATTN_TILE_BYTES: a tile's byte budget
DENSE_RATIO = 2.0  # genoctx.model.dsa.DENSE_RATIO: queries seeing <= ratio x width keys attend densely
INDEX_ROW_TILE = 256  # genoctx.model.dsa.INDEX_ROW_TILE: indexer query rows per tile
INDEX_COL_BLOCK = 4096  # genoctx.model.dsa.INDEX_COL_BLOCK: indexer key columns per block
INDEX_GROUP = 32  # genoctx.model.dsa.INDEX_GROUP
SUB_CHUNK = 8  # genoctx.model.kda._SUB_CHUNK: KDA decay sub-chunk (tokens)
NUCLEOTIDE_VOCAB = 8  # len(genoctx.data.tokenizer.VOCAB): a model with this vocabulary trains on its own logits

COMPONENTS = (
    "weights", "gradients", "optimizer_state", "unsharded_params",
    "activations_kda", "activations_dsa", "activations_moe", "activations_dense_mlp", "activations_mhc",
    "activations_head", "layer_inputs", "returned_caches",
    "kda_core_recompute", "dsa_indexer_tiles", "dsa_attention", "moe_dispatch", "stream_gradients",
    "logits_loss", "cp_gather", "fsdp_reduce_scatter", "optimizer_step", "seq_chunk_boundary", "allocator_slack",
)  # fmt: skip
WORKING_SETS = ("kda_core_recompute", "dsa_indexer_tiles", "dsa_attention", "moe_dispatch", "logits_loss",
                "cp_gather", "fsdp_reduce_scatter", "optimizer_step")  # fmt: skip


# ---------------------------------------------------------------- parameters


@functools.lru_cache(maxsize=8)
def _param_counts_cached(key: str) -> dict:
    import torch

    from ..model.model import HybridLM

    cfg = ModelConfig.from_dict(json.loads(key))
    with torch.device("meta"):
        model = HybridLM(cfg)
    root = {"dense": 0, "expert": 0, "shapes": []}
    layers = [{"dense": 0, "expert": 0, "island": 0, "shapes": []} for _ in range(cfg.num_hidden_layers)]
    largest = embed = 0
    for name, p in model.named_parameters():  # shared (tied) parameters are listed once
        n = p.numel()
        largest = max(largest, n)
        kind = "expert" if ".mlp.experts." in f".{name}" else "dense"
        shape = (kind, p.shape[0] if p.dim() else 1, n // max(1, p.shape[0]) if p.dim() else 1,
                 p.shape[1] if p.dim() > 1 else 1)
        if name.startswith("layers."):
            i = int(name.split(".")[1])
            layers[i][kind] += n
            layers[i]["island"] += n if _is_island(cfg, i, name) else 0
            layers[i]["shapes"].append(shape)
        else:
            root[kind] += n
            root["shapes"].append(shape)
            embed += n if name.startswith("embed_tokens.") else 0
    dense = root["dense"] + sum(x["dense"] for x in layers)
    expert = root["expert"] + sum(x["expert"] for x in layers)
    shapes = root["shapes"] + [sh for x in layers for sh in x["shapes"]]
    return {"dense": dense, "expert": expert, "total": dense + expert, "root": root, "embed": embed,
            "layers": layers, "largest": largest, "shapes": shapes}  # fmt: skip


def shard_numel(shapes: list[tuple[str, int, int, int]], layout: Layout) -> dict:
    """Parameters one rank allocates for ``shapes`` (``(kind, rows, numel per row, size of dim 1)``,
    ``param_counts``) under ``layout``: ``{"dense", "expert"}``.

    FSDP2 shards dim 0 in ``torch.chunk`` pieces of ``ceil(rows / shards)`` rows and pads every rank's piece to
    that size (``FSDPParam._sharded_param_data``; gradients are reduce-scattered into the same padded size), so
    every rank allocates ``ceil(rows / s_d)`` rows of a dense parameter and ``ceil((rows / ep) / s_e)`` rows of a
    routed expert's (its ``E / ep`` block); rank 0's own piece is that large too (its AdamW moments, which are not
    padded, are the largest there). Without FSDP (``s_d = s_e = 1``) the whole tensor, or the EP block. Folded EP
    shards a block whose experts do not split evenly over ``s_e`` on dim 1 instead (``genoctx.parallel.fsdp.
    expert_placement``): ``(rows / ep) x numel per row / s_e``.
    """
    sd, se, ep = layout.dense_shard, layout.expert_shard, layout.ep
    out = {"dense": 0, "expert": 0}
    for kind, rows, rest, dim1 in shapes:
        if kind == "expert":
            block = rows // ep
            if layout.ep_folded and block % se and dim1 % se == 0:
                out[kind] += block * rest // se
            else:
                out[kind] += -(-block // se) * rest
        else:
            out[kind] += -(-rows // sd) * rest
    return out


def _is_island(cfg: ModelConfig, i: int, name: str) -> bool:
    """A parameter of decoder layer ``i`` that FSDP2 all-gathers in fp32 under a bf16 ``MixedPrecisionPolicy``
    (``genoctx.parallel.fsdp._islands``): a KDA layer's whole mixer, the MoE router, the mHC mixings."""
    part = name.split(".")[2]
    if part == "self_attn":
        return cfg.layer_types[i] == KDA
    return part in ("attn_hc", "ffn_hc") or name.split(".")[2:4] == ["mlp", "gate"]


def param_counts(cfg: ModelConfig) -> dict:
    """The model's own parameter counts (``HybridLM(cfg)`` built on the meta device: no memory).

    Returns:
        ``{"dense", "expert", "total", "largest"}`` (parameters; ``expert`` = names containing ``.mlp.experts.``,
        the routed experts; ``largest`` = the biggest single tensor), ``"root"`` (embedding, final norm,
        ``lm_head``: ``{"dense", "expert"}``), ``"embed"`` (the embedding's parameters; with tied embeddings also
        ``lm_head``'s) and ``"layers"`` (one ``{"dense", "expert", "island"}`` per decoder layer; ``island``: its
        dense parameters all-gathered in fp32 under bf16 mixed precision, ``_is_island``).
    """
    return _param_counts_cached(json.dumps(cfg.to_dict(), sort_keys=True))


# ---------------------------------------------------------------- per-token sizes


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """Element sizes (bytes) of one plan: ``a`` activations, ``f`` fp32, ``c`` fp32 copies of activations,
    ``ca`` activation copies of fp32 tensors, ``r`` the residual streams."""

    a: int
    f: int = F32

    @property
    def c(self) -> int:
        return self.f if self.a != self.f else 0

    @property
    def ca(self) -> int:
        return self.a if self.a != self.f else 0

    @property
    def r(self) -> int:
        """The mHC residual streams ``[B, T, n, D]`` and what ``HyperConnection`` returns in their dtype (the sub-layer
        input ``h``, the next streams): fp32 whatever ``a`` is. One process runs fp32 parameters under bf16
        autocast (``nn.Embedding`` gives fp32, ``genoctx.model.hyper`` keeps x's dtype); FSDP2 with bf16 parameters
        casts no forward input and upcasts the embedding's output (``genoctx.parallel.fsdp._dtype_boundaries``)."""
        return self.f


# Matmuls that read a sub-layer's normalised input (``DecoderLayer``: ``input_layernorm`` / ``post_attention_layernorm``
# output, fp32 as the streams): under bf16 autocast each saves its own bf16 copy (autocast caches the casts of
# parameters, not of activations). KDA: q, k, v, f_a, b and g_a projections; a "full" DSA layer: q_a, kv_a, the
# indexer's wk, compress gate and weights_proj; a "shared" DSA layer: q_a, kv_a; a dense MLP: gate and up. An MoE
# checkpoints its chunks, which keep the fp32 input itself (0 casts).
INPUT_CASTS = {"kda": 6, "dsa_full": 5, "dsa_shared": 2, "mlp": 2, "moe": 0}


def _norm(s: _Sizes, W: int) -> float:
    """RMSNorm of width W of an input in the activation dtype (DSA's q/kv latent norms): ``f W`` (its input in fp32:
    the input itself in fp32, a copy otherwise) ``+ f`` (rsqrt) ``+ 2 a W`` (the normalised tensor and the weighted
    output, which the next op saves)."""
    return s.f * W + s.f + 2 * s.a * W


def _norm_in(s: _Sizes, W: int, casts: int) -> float:
    """RMSNorm of width W of a sub-layer's input ``h`` (the mHC collapse, in the streams' dtype ``r``: fp32) and what
    its consumers keep of its output: ``f W`` (h itself) ``+ f`` (rsqrt) ``+ r W`` (the normalised h, cast back to
    h's dtype) ``+`` the weighted output (fp32: the weight times the fp32 normalised h) as its consumers keep it:
    under bf16 autocast ``casts`` bf16 copies (``casts c_a W``, ``INPUT_CASTS``), or the fp32 tensor itself
    (``f W``: when ``a`` is fp32, or ``casts == 0``, a consumer that keeps it as it is). With ``a = f`` this is
    ``_norm``'s ``3 f W + f``."""
    kept = s.f * W if (s.ca == 0 or casts == 0) else casts * s.ca * W
    return s.f * W + s.f + s.r * W + kept


def _hc(cfg: ModelConfig, s: _Sizes) -> float:
    """One mHC call (``pre`` + ``post``), besides its input streams (``r nD``, fp32: ``_Sizes.r``, so no copy of
    them for the coefficients): ``f (nD + 1 + (2+n) n + 3n + n^2 + (2 iters - 1) n)`` (RMS-normalised streams,
    rsqrt, the projection, pre/post sigmoids, the Sinkhorn's softmax and its ``2 iters - 1`` denominators:
    ``hyper.comb_map``) ``+ r (n + n^2 + D)`` (``post`` and ``comb`` cast to the streams' dtype: themselves, saved by
    ``comb^T x`` and ``post ⊗ f_out``, and the sub-layer output's copy in that dtype; the bf16 output of a sub-layer
    is freed)."""
    n, D, iters = cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters
    return s.f * (n * D + 1 + (2 + n) * n + 3 * n + n * n + (2 * iters - 1) * n) + s.r * (n + n * n + D)


def _kda_project(cfg: ModelConfig, s: _Sizes) -> float:
    """``KimiDeltaAttention.project``: ``HK (6f + 3a)`` (short conv: its fp32 input, output and the SiLU output in
    ``a``) ``+ 3f HK`` (forget gate) ``+ HK (2c + 2f)`` (q, k: fp32 copies and L2-normalised) ``+ K a`` (gate
    LoRA) ``+ H (a + c + 2f)`` (beta, its fp32 copy, the two L2 norms)."""
    H, K = cfg.linear_num_heads, cfg.linear_head_dim
    HK = H * K
    return HK * (6 * s.f + 3 * s.a) + 3 * s.f * HK + HK * (2 * s.c + 2 * s.f) + K * s.a + H * (s.a + s.c + 2 * s.f)


def _kda(cfg: ModelConfig, s: _Sizes) -> float:
    """A KDA mixer with its input norm: ``_norm_in(D, 6) + project + HK (4f + a) + K a + f H`` (the output: fp32 core
    output, normalised, gated, the gate's sigmoid; ``o_proj``'s input; the gate LoRA; the output norm's rsqrt).
    Altogether ``HK (15f + 4a + 2c) + 2 K a + H (a + c + 3f)`` besides the norm (19 HK fp32 elements in fp32)."""
    H, K = cfg.linear_num_heads, cfg.linear_head_dim
    norm = _norm_in(s, cfg.hidden_size, INPUT_CASTS["kda"])
    return norm + _kda_project(cfg, s) + H * K * (4 * s.f + s.a) + K * s.a + H * s.f


def _kda_out_part(cfg: ModelConfig, s: _Sizes) -> float:
    """What the KDA output path saved (freed before the core's backward): ``HK (4f + a) + K a + f H``."""
    H, K = cfg.linear_num_heads, cfg.linear_head_dim
    return H * K * (4 * s.f + s.a) + K * s.a + H * s.f


def _kda_core_saved(cfg: ModelConfig, V: int) -> float:
    """``chunk_kda`` under autograd (fp32 whatever the model's dtype), values of width V:
    ``f H (9K + 3V + K V / C + 3C)`` (padded q, k; cumulative and exponentiated decays; ``[eG k | v]``, ``W|U``,
    ``Q eG``, decayed keys and their decay factors, ``V'``; the per-chunk states that ``_KDABlock`` keeps;
    three ``C x C`` matrices per chunk; measured within 1% on tiny and cpu-small)."""
    H, K, C = cfg.linear_num_heads, cfg.linear_head_dim, cfg.kda_chunk_size
    return F32 * H * (9 * K + 3 * V + K * V / C + 3 * C)


def _kda_core_backward(cfg: ModelConfig) -> float:
    """Working set of ``chunk_kda``'s backward above its saved tensors, peaking in ``_CausalDecayScores.backward``
    (decay factors recomputed for every chunk at once): ``f HK (3s + 3m + max(s, m) + m s / K + 2 C / K - 3)``
    with ``s = 8`` (``_SUB_CHUNK``) tokens per sub-chunk and ``m = C / s - 1``: ``Ed``, ``b_diag``, their
    gradient (``s`` each), ``e``, ``b_off``, their gradient (``m`` each), a temporary of ``max(s, m)``, the
    gradients of the two ``C x C`` score matrices (measured within 5% on tiny and cpu-small, C = 16..128)."""
    H, K, C = cfg.linear_num_heads, cfg.linear_head_dim, cfg.kda_chunk_size
    sub = SUB_CHUNK if C % SUB_CHUNK == 0 else C
    m = C // sub - 1
    return F32 * H * K * (3 * sub + 3 * m + max(sub, m) + m * sub / K + 2 * C / K - 3)


def _kda_core_forward(cfg: ModelConfig) -> float:
    """Working set of ``chunk_kda``'s forward when nothing is saved (the layer's forward under the core's
    checkpoint): about ``f HK (14 + 2m + (C / K)(1 + C / 64))`` (``m`` as ``_kda_core_backward``); fitted to
    measurements of tiny and cpu-small at C = 16..128 (within 15%), not counted tensor by tensor."""
    H, K, C = cfg.linear_num_heads, cfg.linear_head_dim, cfg.kda_chunk_size
    sub = SUB_CHUNK if C % SUB_CHUNK == 0 else C
    m = C // sub - 1
    return F32 * H * K * (14 + 2 * m + (C / K) * (1 + C / 64))


def _kda_block(cfg: ModelConfig, T: int) -> tuple[int, int]:
    """``(Tb, blocks)``: tokens per block of ``chunk_kda`` over a sequence of ``T`` tokens (``kda_block_tokens``
    rounded down to whole chunks, at least one chunk, at most ``T``) and the number of blocks."""
    C = cfg.kda_chunk_size
    Tb = min(T, max(C, cfg.kda_block_tokens // C * C))
    return Tb, -(-T // Tb)


def _kda_core_recompute(cfg: ModelConfig, rows: int, T: int, V: int) -> float:
    """Backward working set of ``chunk_kda(recompute=True)`` over ``rows`` sequences of ``T`` tokens, values of width
    V: one block recomputed with its graph (``Tb`` tokens: ``_kda_core_saved + _kda_core_backward``), the states
    entering the blocks (``f H K V`` each) and, with several blocks, the gradients of the core's inputs
    (``f H (3K + V + 1)`` per token: q, k, v, g, beta) of the blocks done, concatenated once at the end (split's
    backward), whichever is larger."""
    H, K = cfg.linear_num_heads, cfg.linear_head_dim
    Tb, blocks = _kda_block(cfg, T)
    one = rows * Tb * (_kda_core_saved(cfg, V) + _kda_core_backward(cfg))
    if blocks == 1:
        return one
    grads = F32 * H * (3 * K + V + 1)
    states = rows * blocks * F32 * H * K * V
    return states + max(one + rows * (T - Tb) * grads, 2 * rows * T * grads)


def _kda_core_fwd(cfg: ModelConfig, s: _Sizes, rows: int, T: int, V: int) -> float:
    """Forward working set of ``chunk_kda(recompute=True)`` (nothing saved but block inputs and states): one block's
    ``_kda_core_forward`` and the outputs of the blocks before (``a H V`` per token)."""
    Tb, _ = _kda_block(cfg, T)
    return rows * Tb * _kda_core_forward(cfg) + rows * (T - Tb) * s.a * cfg.linear_num_heads * V


def _fla_saved(cfg: ModelConfig) -> float:
    """What fla-core's ``chunk_kda`` (``kda_kernel="fla"``, CUDA) saves per token beyond the layer's q, k, v, g,
    beta: the chunk-local cumulative decays ``f H K`` and the two intra-chunk score matrices ``Aqk``, ``Akk``
    (``H C`` each, in k's dtype: fp32, as the layer hands fla its normalised q, k). Counted from fla-core 0.6's
    ``ChunkKDAFunction.forward`` (``save_for_backward``; w, u, qg, kg, h and v_new are freed and recomputed in
    backward); not measured (no GPU run yet)."""
    H, K, C = cfg.linear_num_heads, cfg.linear_head_dim, cfg.kda_chunk_size
    return F32 * H * (K + 2 * C)


def _fla_forward(cfg: ModelConfig, s: _Sizes) -> float:
    """fla's ``chunk_kda`` forward working set per token (``chunk_kda_fwd``): w, qg, kg ``3 f H K``, the chunk states h
    ``f H K V / C``, u, v_new and the output ``3 a H V`` (V = K). Counted, not measured."""
    H, K, C = cfg.linear_num_heads, cfg.linear_head_dim, cfg.kda_chunk_size
    return F32 * H * (3 * K + K * K / C) + s.a * H * 3 * K


def _fla_backward(cfg: ModelConfig, s: _Sizes) -> float:
    """fla's ``chunk_kda_bwd`` working set per token: the recomputed w, u, qg, kg, h, v_new (as ``_fla_forward``) and
    the gradients it allocates: dAqk, dAkk ``2 f H C``, dh ``f H K V / C``, dq, dk, dg ``3 f H K``, dbeta ``f H``,
    dv twice ``2 a H V``: ``f H (6K + 2 K V / C + 2C + 1) + 4 a H V`` (V = K). Counted from fla-core 0.6, not
    measured (no GPU run yet)."""
    H, K, C = cfg.linear_num_heads, cfg.linear_head_dim, cfg.kda_chunk_size
    return F32 * H * (6 * K + 2 * K * K / C + 2 * C + 1) + s.a * H * 4 * K


def _dsa(cfg: ModelConfig, s: _Sizes, full: bool) -> float:
    """A DSA mixer with its input norm: ``_norm_in(D, 5 full / 2 shared) + norm(Q) + norm(R) + a Hm (dq + 2R + dv)``
    (the query copy of the absorbed product, the latent queries, the output latents' copy, ``o_proj``'s input)
    ``+ f Hm`` (softmax log-sum-exp). A "full" layer adds its indexer: ``f (2 dI + 2) + a dI`` (the key LayerNorm in
    fp32: its input's copy, mean and rstd; the pooling softmax; the keys the pooling saves) ``+ f (HI dI + HI + dI /
    kp)`` (the KL gradients, computed in forward) ``+ 4 topk / kp`` (int32 pool indices) ``+ 8`` (int64 query
    positions)."""
    D, Q, R = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank
    Hm, dq, dv = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
    out = _norm_in(s, D, INPUT_CASTS["dsa_full" if full else "dsa_shared"]) + _norm(s, Q) + _norm(s, R)
    out += s.a * Hm * (dq + 2 * R + dv) + s.f * Hm
    if full:
        dI, HI, kp = cfg.index_head_dim, cfg.index_n_heads, cfg.index_kpool
        out += s.f * (2 * dI + 2) + s.a * dI + 4 * cfg.index_topk / kp + 8
        if cfg.indexer_stage != "off":
            out += s.f * (HI * dI + HI + dI / kp)
    return out


def _dsa_out_part(cfg: ModelConfig, s: _Sizes) -> float:
    """What the DSA output path saved (freed before the sparse attention's backward): ``a Hm (R + dv)``."""
    return s.a * cfg.num_attention_heads * (cfg.kv_lora_rank + cfg.v_head_dim)


def _dsa_gather_width(cfg: ModelConfig, full: bool) -> int:
    """Elements per token of a DSA layer's CP all-gather: ``R`` latents, plus ``2 dI`` indexer keys and gates."""
    return cfg.kv_lora_rank + (2 * cfg.index_head_dim if full else 0)


def _dsa_cp_saved(cfg: ModelConfig, s: _Sizes, full: bool) -> float:
    """Per token of the window, what a DSA layer keeps under CP on the rank with the last piece:
    ``a W`` (the gathered window, ``W = R + 2 dI`` on a full layer, ``R`` on a shared one) ``+ a R`` (earlier
    latents concatenated with the piece's) ``+ full (f dI + f dI / kp)`` (the pooling softmax of the earlier keys, KL
    gradient of every visible pool)."""
    dI, kp = cfg.index_head_dim, cfg.index_kpool
    out = s.a * _dsa_gather_width(cfg, full) + s.a * cfg.kv_lora_rank
    if full:
        out += s.f * dI + s.f * dI / kp
    return out


def _dense_part(cfg: ModelConfig, tokens: int, cached: int) -> tuple[int, int]:
    """The short-window dense tiles of sparse attention (``genoctx.model.dsa._dense_split``) over ``tokens`` queries
    after ``cached`` positions: ``(split, DD)``, the first ``split`` queries attend densely, ``DD = rows x n`` (query
    rows x keys) elements of the largest dense tile (``n = cached + split``)."""
    width = cfg.index_topk + (cfg.index_kpool - 1 if cfg.index_kpool_always_select_tail else 0)
    H, R = cfg.num_attention_heads, cfg.kv_lora_rank
    split = min(tokens, max(0, int(DENSE_RATIO * width) - cached))
    if split == 0:
        return 0, 0
    tile = max(1, ATTN_TILE_BYTES // ((R + H) * F32))
    rows = max(1, tile * (R + H) // ((cached + split) * (H + 1)))
    return split, min(split, rows) * (cached + split)


def _attn_tiles(cfg: ModelConfig, tokens: int, cached: int = 0) -> tuple[int, int, int]:
    """Sparse-attention (gathering) tiles over ``tokens`` queries after ``cached`` positions, less the dense ones
    (``_dense_part``): ``(TT, TT_last, count)``, ``TT = rows x width`` elements of a full tile (query rows x selected
    tokens, ``width = topk + kp - 1`` with the visible tail, ``rows = max(1, min(tokens, tile // width))``,
    ``tile = ATTN_TILE_BYTES // ((R + H) 4)``: ``genoctx.model.dsa.attn_tile_tokens``), the last tile's and the
    number of tiles (``(0, 0, 0)`` when every query attends densely)."""
    width = cfg.index_topk + (cfg.index_kpool - 1 if cfg.index_kpool_always_select_tail else 0)
    tile = max(1, ATTN_TILE_BYTES // ((cfg.kv_lora_rank + cfg.num_attention_heads) * F32))
    tokens -= _dense_part(cfg, tokens, cached)[0]
    if tokens <= 0:
        return 0, 0, 0
    rows = max(1, min(tokens, tile // width))
    count = -(-tokens // rows)
    return rows * width, (tokens - (count - 1) * rows) * width, count


def _carried(TT: int, last: int, count: int, fresh: int) -> int:
    """Largest ``previous tile + fresh x this tile``: a tile loop's variables hold the previous tile's tensors
    until the new ones are assigned."""
    if count <= 1:
        return fresh * TT
    return max(fresh * TT, (1 + fresh) * TT if count > 2 else 0, TT + fresh * last)


def _dsa_tiles_bwd(cfg: ModelConfig, tokens: int, cached: int = 0) -> float:
    """Sparse-attention backward tiles: ``carried(2) R f + TT (2 Hm f + 17)`` bytes: the latents' gradient of the
    previous tile (``dks``, still referenced) and two ``TT x R`` fp32 products of this one, probabilities and their
    gradients, int64 token indices and a mask (``carried(k)`` = ``_carried``: ``3 TT`` with three tiles or more,
    ``2 TT`` with one); or, if larger, a dense tile's ``DD (2 Hm + 1) f`` (probabilities, their gradients, the
    bias)."""
    TT, last, count = _attn_tiles(cfg, tokens, cached)
    sparse = _carried(TT, last, count, 2) * cfg.kv_lora_rank * F32 + TT * (2 * cfg.num_attention_heads * F32 + 17)
    return max(sparse, _dense_part(cfg, tokens, cached)[1] * (2 * cfg.num_attention_heads + 1) * F32)


def _dsa_tiles_fwd(cfg: ModelConfig, s: _Sizes, tokens: int, cached: int = 0) -> float:
    """Sparse-attention forward tiles: ``carried(1) (R (a + c) + Hm f) + 17 TT`` (gathered latents and their fp32
    copy, scores/probabilities, for the previous and this tile; indices); or, if larger, a dense tile's
    ``DD (Hm + 1) f`` (scores/probabilities, the bias)."""
    TT, last, count = _attn_tiles(cfg, tokens, cached)
    per = cfg.kv_lora_rank * (s.a + s.c) + cfg.num_attention_heads * F32
    sparse = _carried(TT, last, count, 1) * per + 17 * TT
    return max(sparse, _dense_part(cfg, tokens, cached)[1] * (cfg.num_attention_heads + 1) * F32)


def _indexer_tiles(cfg: ModelConfig, tokens: int, ctx: int) -> float:
    """``indexer_topk`` (no grad): ``Rt Cb (HI + 2) f + Rt Cb (f + 8)`` (one score tile, its head sum and the
    candidates of a block) ``+ P (dI f + f + 8)`` (the ``P = ctx / kp`` visible pooled keys in fp32, column ids
    and tie-breaks), with ``Cb = min(INDEX_COL_BLOCK, indexer_tile_tokens, P rounded up to INDEX_GROUP)`` columns and
    ``Rt = min(INDEX_ROW_TILE, tokens, indexer_tile_tokens // Cb)`` rows."""
    g, HI, dI = INDEX_GROUP, cfg.index_n_heads, cfg.index_head_dim
    pools = max(1, ctx // cfg.index_kpool)
    Cb = max(g, min(INDEX_COL_BLOCK, cfg.indexer_tile_tokens) // g * g)
    Cb = max(g, min(Cb, -(-pools // g) * g))
    Rt = max(1, min(INDEX_ROW_TILE, tokens, cfg.indexer_tile_tokens // Cb))
    return Rt * Cb * ((HI + 2) * F32 + F32 + 8) + pools * (dI * F32 + F32 + 8)


def _mlp(cfg: ModelConfig, s: _Sizes) -> float:
    """Dense SwiGLU MLP with its input norm: ``_norm_in(D, 2) + 3 Id a`` (gate and up outputs, which
    ``moe.swiglu_fused`` saves instead of its internals, and the down projection's input)."""
    return _norm_in(s, cfg.hidden_size, INPUT_CASTS["mlp"]) + 3 * cfg.intermediate_size * s.a


def _moe(cfg: ModelConfig, s: _Sizes) -> float:
    """MoE with its input norm: ``_norm_in(D, 0) + 8`` (each chunk is checkpointed: its input is the norm's fp32
    output, kept as it is; int64 sequence ids)."""
    return _norm_in(s, cfg.hidden_size, INPUT_CASTS["moe"]) + 8


def _moe_rows(cfg: ModelConfig, tokens: int) -> tuple[int, int]:
    """``(Nc, rows)``: tokens of one dispatch chunk ``min(moe_chunk_tokens, tokens)`` and its ``Nc k`` rows."""
    Nc = min(cfg.moe_chunk_tokens, tokens)
    return Nc, Nc * cfg.num_experts_per_tok


def _moe_fwd(cfg: ModelConfig, s: _Sizes, tokens: int, ep: int) -> float:
    """One dispatch chunk in forward (recomputed in backward): ``rows (max(D (a + f), (D + 2I) a, 4 I a) + 24)``
    (the largest phase of ``Experts.forward_grouped``, each temporary freed once the next exists: gathered rows and
    the gate/up product; that product and the in-place SwiGLU's two ``I``-wide temporaries; expert outputs and the
    weighted fp32 rows; the loop ``forward_loop`` holds the same; sort ids, order and token indices) ``+ Nc D (f +
    c_a + a + c)`` (combined output and its cast, shared expert, router input) ``+ Nc (2E f + k (f + 8))``
    (router); ``+ 4 rows D a`` under EP (dispatch and combine, send and receive)."""
    D, E, k, I = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    Nc, rows = _moe_rows(cfg, tokens)
    out = rows * (max(D * (s.a + s.f), (D + 2 * I) * s.a, 4 * I * s.a) + 24)
    out += Nc * D * (s.f + s.ca + s.a + s.c) + Nc * (2 * E * s.f + k * (s.f + 8))
    return out + (4 * rows * D * s.a if ep > 1 else 0)


def _moe_bwd(cfg: ModelConfig, s: _Sizes, tokens: int, ep: int) -> float:
    """One chunk in backward: the recomputed chunk's saved tensors ``rows ((2D + 3I) a + f + 8) + Nc (c D + E f +
    k (f + 8) + 3 Is a)`` (rows and expert outputs, the SwiGLU's input and output (``moe.swiglu_packed`` /
    ``swiglu_fused`` save only their inputs), routing weights; the router; the shared expert) and the gradients
    ``rows D (f + 2a) + Nc D a``; ``+ 4 rows D a`` under EP."""
    D, E, k, I = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    Is = cfg.moe_intermediate_size * cfg.n_shared_experts
    Nc, rows = _moe_rows(cfg, tokens)
    saved = rows * ((2 * D + 3 * I) * s.a + s.f + 8) + Nc * (s.c * D + E * s.f + k * (s.f + 8) + 3 * Is * s.a)
    out = saved + rows * D * (s.f + 2 * s.a) + Nc * D * s.a
    return out + (4 * rows * D * s.a if ep > 1 else 0)


def _hc_bwd(cfg: ModelConfig, s: _Sizes) -> float:
    """One mHC call's backward: about ``nD (3f + r) + f (4 n^2 + n)`` (the streams' (``r``) and normalised streams'
    gradients and their temporaries, fitted to measurements of tiny and cpu-small within 20%; the Sinkhorn's
    backward, ``hyper._Sinkhorn``: its carried gradient, the rebuilt iterate, the input and the softmax's gradient,
    ``n^2`` each, and one sum; a small term at GLM-5.3-Flash's width)."""
    n, D = cfg.hc_mult, cfg.hidden_size
    return n * D * (3 * s.f + s.r) + s.f * (4 * n * n + n)


# ---------------------------------------------------------------- the plan


# copies of the DSA boundary state at the chunked backward's peak (``genoctx.train.chunked``): the latents and pooled
# keys of every token kept once from the forward sweep, the gradient later chunks sent into the chunk's outgoing
# cache, and the gradient of the incoming leaves it hands on; the pooled keys have a fourth, the outgoing cache
# (``cat(incoming, own)``), which the latents do not (``DSACache.window``: a view of the kept latents)
_LATENT_COPIES = 3
_POOL_COPIES = 4


def seq_chunk_boundary_bytes(cfg: ModelConfig, chunk_tokens: int, rows: int = 1, a: int = 2) -> float:
    """Bytes per token of the window that ``train.seq_chunk_tokens`` keeps across chunk boundaries (grows with L).

    Per DSA layer, the normalised latents ``R = kv_lora_rank`` of every token and, on a "full" layer, the pooled
    indexer keys ``d_I / kpool`` (fp32: their cross-chunk gradient sums are an fp32 island), the latents ``a`` bytes
    each, three times (kept, the gradient into the outgoing cache, the incoming gradient; four for the pooled keys,
    whose outgoing cache is a copy); per KDA layer, one recurrent state ``H K V`` fp32 and conv tail
    ``(w - 1) 3 H K a`` per chunk boundary, i.e. divided by ``chunk_tokens``. Per "full" DSA layer (sparse mode or
    the sparse-stage indexer KL) also the top-k selections the grad pass reuses (``selection_memo``): ``K = index_topk /
    index_kpool`` int32 pools per token. ``rows``: sequences per rank (batch size).

    Args:
        cfg: the architecture.
        chunk_tokens: tokens per chunk (``train.seq_chunk_tokens``).
        rows: windows per rank trained together.
        a: activation element size in bytes (2 for bf16, 4 for fp32).

    Returns:
        bytes per token of the window (multiply by L for the boundary state of a window).
    """
    per = 0.0
    for i, kind in enumerate(cfg.layer_types):
        if kind == DSA:
            per += _LATENT_COPIES * a * cfg.kv_lora_rank
            if cfg.indexer_types[i] == "full":
                per += _POOL_COPIES * F32 * cfg.index_head_dim / cfg.index_kpool
                if cfg.dsa_mode == "sparse" or cfg.indexer_stage == "sparse":  # the kept selections
                    per += 4 * (cfg.index_topk // cfg.index_kpool)
        else:
            H, K = cfg.linear_num_heads, cfg.linear_head_dim
            per += (4 * H * K * K + (cfg.linear_conv_kernel_dim - 1) * 3 * H * K * a) / chunk_tokens
    return rows * per


def _layout_dict(layout: Layout) -> dict:
    """A plan's ``"layout"``: the four sizes, ``ep_folded``, ``world`` (and ``fsdp_one: true`` when set)."""
    return {**{d: getattr(layout, d) for d in DIMS}, "ep_folded": layout.ep_folded, "world": layout.world,
            **({"fsdp_one": True} if layout.fsdp_one else {})}  # fmt: skip

def _add(*ds: dict) -> dict:
    """The sum of component dicts, key by key."""
    out: dict = {}
    for d in ds:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out
