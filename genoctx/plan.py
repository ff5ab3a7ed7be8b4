"""Memory planner: bytes per GPU, by component, of one training step of a config x sequence length x parallel layout.

``plan_memory`` predicts the peak of one optimizer step (forward, backward, AdamW step) on the busiest rank;
``search_layouts`` plans every layout of a number of GPUs and sorts them; ``check_fits`` turns a plan that does not
fit into a one-line ``GenoctxError``. Units: bytes inside, GiB (2^30 bytes) in the returned dicts.

How the peak is found. Memory is followed through the step as a sequence of phases, and the plan reports the
phase with the most bytes alive (``peak_phase``), broken down by component (``components_gib``; they add up to
``total_gib``):

- forward of layer i: the activations kept by layers 0..i-1, the caches they returned, layer i's activations and
  its forward working set (the largest of: DSA indexer tiles, DSA attention/KL tiles, one MoE dispatch chunk);
- end of forward: every layer's kept activations and returned caches, the head's logits and loss;
- head backward, then backward of layer i (its feed-forward part, then its mixer): the activations of layers
  0..i-1, layer i's own (plus, under recomputation, rebuilt in full), the backward working set of the sub-layer
  (KDA core recompute, DSA tiles and key gradients, MoE chunk recompute), gradients of the residual streams,
  and the parameter gradients of the layers already done (i+1..L-1 and the head);
- the end of backward (FSDP reduce-scatter of the root module) and the optimizer step.

Per-token sizes (bytes per token of the rank's ``N = batch_size x seq_len / cp`` tokens) are counted from the
code, tensor by tensor: what autograd saves in ``genoctx.model`` with its recompute knobs as they are (KDA core,
MoE chunks and the Sinkhorn map are always recomputed in backward). ``a`` is the activation element size (2 for
bf16, 4 for fp32), ``f = 4`` (the fp32 islands: KDA core and gates, norms, mHC coefficients, DSA softmax
statistics, the loss), ``c = f`` when ``a != f`` else 0 (an fp32 copy of a low-precision tensor), ``c_a = a``
when ``a != f`` else 0 (a low-precision copy of an fp32 tensor). Model widths: ``D`` hidden, ``n`` mHC streams,
``H``/``K`` KDA heads/head dim (``HK = H K``), ``C`` ``kda_chunk_size``, ``Q``/``R`` q-/kv-LoRA ranks, ``Hm``
MLA heads with ``dq``/``dv`` head dims, ``HI``/``dI`` indexer heads/dim, ``kp`` ``index_kpool``, ``E``/``k``
routed experts/top-k, ``I`` expert width, ``Is`` shared-expert width, ``Id`` dense-MLP width, ``V`` vocabulary.

Assumptions (each one is a place where a measurement can disagree):

- Training as ``genoctx.parallel.fsdp`` applies it: FSDP2 ``fully_shard`` per decoder layer (routed experts a group
  of their own) and the root (embedding, final norm, ``lm_head``), ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)`` for ``dtype="bf16"``: fp32 sharded masters, fp32 sharded gradients, fp32 AdamW
  ``exp_avg`` + ``exp_avg_sq`` (16 bytes per sharded parameter); all-gathered parameters in bf16, the fp32 islands
  (a KDA layer's whole mixer, the MoE router, the mHC mixings: ``genoctx.parallel.fsdp._islands``) in fp32, as the
  dry run (``genoctx.train.dryrun``) counts them from the built model. Sharded sizes are what a rank allocates
  (``shard_numel``): FSDP2 cuts dim 0 of every parameter in ``torch.chunk`` pieces and pads each rank's to the first
  one's ``ceil(rows / shards)`` rows, so with fewer rows than ranks (288 experts over 64, ``A_log`` of 64 heads over
  128) a rank holds more than ``P / shards``. With ``recompute`` each decoder layer is checkpointed (``apply_ac``).
  Without FSDP (``dp_shard == cp == 1``) parameters are replicated, and ``dtype="bf16"`` keeps a bf16 compute copy
  of the local parameters for the step.
- The busiest rank: under context parallelism the rank holding the window's last piece (its DSA layers attend
  over the whole window); under expert parallelism a rank receives at most ``moe_chunk_tokens x k`` rows per
  dispatch round (the bound of ``genoctx.parallel.layout``'s expert parallelism).
- KDA runs genoctx's own chunked core (``chunk_kda``, ``use_fla=False``, what ``genoctx train`` runs, and what the
  CP state passing of ``genoctx.parallel.context`` always runs); fla's Triton kernel would need far less. DSA runs
  sparse (``dsa_mode="sparse"``) with the indexer KL of the ``sparse`` stage (``indexer_stage="off"`` drops the KL
  terms); its tiles are those of the PyTorch path (``kernels="torch"``, and always on CPU): with the Triton kernels
  of ``kernels/`` on CUDA the tiles stay on chip and the tile terms are upper bounds.
- Not modelled (a defect to fix, not a cost to plan for): under recomputation a DSA layer's recomputed forward sets
  ``aux_loss`` again, and that tensor keeps the recomputation's graph, with the saved tensors of the indexer's
  branch (on the rank holding the window's last piece also the all-gathered window), alive after the layer's
  backward. Measured with tiny at 4k tokens, CP=2: about 650 bytes per window token on the last-piece rank, gone
  when ``aux_loss`` is cleared after each layer's backward (``bench/plan_vs_measured.py``, layout ``fsdp2-cp2``).
- CUDA: the caching allocator's slack is ``allocator_slack`` (default ``ALLOCATOR_SLACK`` = 5% of the peak, with
  ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``); the CUDA context and NCCL's own buffers (outside
  PyTorch's allocator, about 1 GiB) are not counted. CPU (``device="cpu"``): no slack, AdamW's per-tensor loop.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math

from .errors import GenoctxError
from .model.config import DSA, KDA, ModelConfig
from .parallel.layout import DIMS, Layout

GIB = 2**30  # bytes in a GiB
F32 = 4  # bytes of an fp32 element (``f``)
DTYPE_BYTES = {"bf16": 2, "fp32": 4}  # activation element size ``a`` by ``dtype``
ALLOCATOR_SLACK = 0.05  # CUDA caching-allocator slack, a fraction of the peak (expandable segments)
DEVICES = ("cuda", "cpu")

# Copied from the code they describe (tests/test_plan.py checks that they still match):
ATTN_TILE_TOKENS = 1 << 16  # genoctx.model.dsa.ATTN_TILE_TOKENS: sparse-attention query rows x selected tokens
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
    "logits_loss", "cp_gather", "fsdp_reduce_scatter", "optimizer_step", "allocator_slack",
)  # fmt: skip
WORKING_SETS = ("kda_core_recompute", "dsa_indexer_tiles", "dsa_attention", "moe_dispatch", "logits_loss",
                "cp_gather", "fsdp_reduce_scatter", "optimizer_step")  # fmt: skip


# ---------------------------------------------------------------- parameters


@functools.lru_cache(maxsize=8)
def _param_counts_cached(key: str) -> dict:
    import torch

    from .model.model import HybridLM

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
        shape = (kind, p.shape[0] if p.dim() else 1, n // max(1, p.shape[0]) if p.dim() else 1)
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


def shard_numel(shapes: list[tuple[str, int, int]], layout: Layout) -> dict:
    """Parameters one rank allocates for ``shapes`` (``(kind, rows, numel per row)`` of dim 0, ``param_counts``)
    under ``layout``: ``{"dense", "expert"}``.

    FSDP2 shards dim 0 in ``torch.chunk`` pieces of ``ceil(rows / shards)`` rows and pads every rank's piece to
    that size (``FSDPParam._sharded_param_data``; gradients are reduce-scattered into the same padded size), so
    every rank allocates ``ceil(rows / s_d)`` rows of a dense parameter and ``ceil((rows / ep) / s_e)`` rows of a
    routed expert's (its ``E / ep`` block); rank 0's own piece is that large too (its AdamW moments, which are not
    padded, are the largest there). Without FSDP (``s_d = s_e = 1``) the whole tensor, or the EP block.
    """
    sd, se, ep = layout.dense_shard, layout.expert_shard, layout.ep
    out = {"dense": 0, "expert": 0}
    for kind, rows, rest in shapes:
        if kind == "expert":
            out[kind] += -(-(rows // ep) // se) * rest
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
    ``ca`` activation copies of fp32 tensors."""

    a: int
    f: int = F32

    @property
    def c(self) -> int:
        return self.f if self.a != self.f else 0

    @property
    def ca(self) -> int:
        return self.a if self.a != self.f else 0


def _norm(s: _Sizes, W: int) -> float:
    """RMSNorm of width W: ``f W`` (its input in fp32: the input itself in fp32, a copy otherwise) ``+ f`` (rsqrt)
    ``+ 2 a W`` (the normalised tensor and the weighted output, which the next op saves)."""
    return s.f * W + s.f + 2 * s.a * W


def _hc(cfg: ModelConfig, s: _Sizes) -> float:
    """One mHC call (``pre`` + ``post``), besides its input streams: ``c nD`` (fp32 copy of the streams) ``+ f (nD +
    1 + (2+n) n + 3n + n^2)`` (RMS-normalised streams, rsqrt, the projection, pre/post sigmoids, Sinkhorn input)
    ``+ a (n + n^2 + D)`` (post, the transposed comb copy of ``comb^T x``, the sub-layer output)."""
    n, D = cfg.hc_mult, cfg.hidden_size
    return s.c * n * D + s.f * (n * D + 1 + (2 + n) * n + 3 * n + n * n) + s.a * (n + n * n + D)


def _kda_project(cfg: ModelConfig, s: _Sizes) -> float:
    """``KimiDeltaAttention.project``: ``HK (6f + 3a)`` (short conv: its fp32 input, output and the SiLU output in
    ``a``) ``+ 3f HK`` (forget gate) ``+ HK (2c + 2f)`` (q, k: fp32 copies and L2-normalised) ``+ K a`` (gate
    LoRA) ``+ H (a + c + 2f)`` (beta, its fp32 copy, the two L2 norms)."""
    H, K = cfg.linear_num_heads, cfg.linear_head_dim
    HK = H * K
    return HK * (6 * s.f + 3 * s.a) + 3 * s.f * HK + HK * (2 * s.c + 2 * s.f) + K * s.a + H * (s.a + s.c + 2 * s.f)


def _kda(cfg: ModelConfig, s: _Sizes) -> float:
    """A KDA mixer with its input norm: ``norm(D) + project + HK (4f + a) + K a + f H`` (the output: fp32 core
    output, normalised, gated, the gate's sigmoid; ``o_proj``'s input; the gate LoRA; the output norm's rsqrt).
    Altogether ``HK (15f + 4a + 2c) + 2 K a + H (a + c + 3f)`` besides the norm (19 HK fp32 elements in fp32)."""
    H, K = cfg.linear_num_heads, cfg.linear_head_dim
    return _norm(s, cfg.hidden_size) + _kda_project(cfg, s) + H * K * (4 * s.f + s.a) + K * s.a + H * s.f


def _kda_out_part(cfg: ModelConfig, s: _Sizes) -> float:
    """What the KDA output path saved (freed before the core's backward): ``HK (4f + a) + K a + f H``."""
    H, K = cfg.linear_num_heads, cfg.linear_head_dim
    return H * K * (4 * s.f + s.a) + K * s.a + H * s.f


def _kda_core_saved(cfg: ModelConfig, V: int) -> float:
    """``chunk_kda`` under autograd (fp32 whatever the model's dtype), values of width V:
    ``f H (10K + 3V + K V / C + 3C)`` (padded q, k; cumulative and exponentiated decays; ``[eG k | v]``, ``W|U``,
    ``[W | Q eG]``, decayed keys, ``V'``; the per-chunk states; three ``C x C`` matrices per chunk)."""
    H, K, C = cfg.linear_num_heads, cfg.linear_head_dim, cfg.kda_chunk_size
    return F32 * H * (10 * K + 3 * V + K * V / C + 3 * C)


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


def _dsa(cfg: ModelConfig, s: _Sizes, full: bool) -> float:
    """A DSA mixer with its input norm: ``norm(D) + norm(Q) + norm(R) + a Hm (dq + 2R + dv)`` (the query copy of
    the absorbed product, the latent queries, the output latents' copy, ``o_proj``'s input) ``+ f Hm`` (softmax
    log-sum-exp). A "full" layer adds its indexer: ``a (2 dI + 2) + f dI + c_a dI`` (key LayerNorm, pooling
    softmax) ``+ f (HI dI + HI + dI / kp)`` (the KL gradients, computed in forward) ``+ 4 topk / kp`` (int32 pool
    indices) ``+ 8`` (int64 query positions)."""
    D, Q, R = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank
    Hm, dq, dv = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
    out = _norm(s, D) + _norm(s, Q) + _norm(s, R) + s.a * Hm * (dq + 2 * R + dv) + s.f * Hm
    if full:
        dI, HI, kp = cfg.index_head_dim, cfg.index_n_heads, cfg.index_kpool
        out += s.a * (2 * dI + 2) + s.f * dI + s.ca * dI + 4 * cfg.index_topk / kp + 8
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
    latents concatenated with the piece's) ``+ full (dI (f + c_a) + f dI / kp)`` (pooling of the earlier keys, KL
    gradient of every visible pool)."""
    dI, kp = cfg.index_head_dim, cfg.index_kpool
    out = s.a * _dsa_gather_width(cfg, full) + s.a * cfg.kv_lora_rank
    if full:
        out += dI * (s.f + s.ca) + s.f * dI / kp
    return out


def _attn_tiles(cfg: ModelConfig, tokens: int) -> tuple[int, int, int]:
    """Sparse-attention tiles over ``tokens`` queries: ``(TT, TT_last, count)``, ``TT = rows x width`` elements of a
    full tile (query rows x selected tokens, ``width = topk + kp - 1`` with the visible tail,
    ``rows = max(1, min(tokens, ATTN_TILE_TOKENS // width))``), the last tile's and the number of tiles."""
    width = cfg.index_topk + (cfg.index_kpool - 1 if cfg.index_kpool_always_select_tail else 0)
    rows = max(1, min(tokens, ATTN_TILE_TOKENS // width))
    count = -(-tokens // rows)
    return rows * width, (tokens - (count - 1) * rows) * width, count


def _carried(TT: int, last: int, count: int, fresh: int) -> int:
    """Largest ``previous tile + fresh x this tile``: a tile loop's variables hold the previous tile's tensors
    until the new ones are assigned."""
    if count == 1:
        return fresh * TT
    return max(fresh * TT, (1 + fresh) * TT if count > 2 else 0, TT + fresh * last)


def _dsa_tiles_bwd(cfg: ModelConfig, tokens: int) -> float:
    """Sparse-attention backward tiles: ``carried(2) R f + TT (2 Hm f + 17)`` bytes: the latents' gradient of the
    previous tile (``dks``, still referenced) and two ``TT x R`` fp32 products of this one, probabilities and their
    gradients, int64 token indices and a mask (``carried(k)`` = ``_carried``: ``3 TT`` with three tiles or more,
    ``2 TT`` with one)."""
    TT, last, count = _attn_tiles(cfg, tokens)
    return _carried(TT, last, count, 2) * cfg.kv_lora_rank * F32 + TT * (2 * cfg.num_attention_heads * F32 + 17)


def _dsa_tiles_fwd(cfg: ModelConfig, s: _Sizes, tokens: int) -> float:
    """Sparse-attention forward tiles: ``carried(1) (R (a + c) + Hm f) + 17 TT`` (gathered latents and their fp32
    copy, scores/probabilities, for the previous and this tile; indices)."""
    TT, last, count = _attn_tiles(cfg, tokens)
    per = cfg.kv_lora_rank * (s.a + s.c) + cfg.num_attention_heads * F32
    return _carried(TT, last, count, 1) * per + 17 * TT


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
    """Dense SwiGLU MLP with its input norm: ``norm(D) + 6 Id a`` (gate and up outputs, the clamped gate, SiLU
    output, the clamped up, the down projection's input)."""
    return _norm(s, cfg.hidden_size) + 6 * cfg.intermediate_size * s.a


def _moe(cfg: ModelConfig, s: _Sizes) -> float:
    """MoE with its input norm: ``norm(D) + 8`` (each chunk is checkpointed: its input is the norm's output; int64
    sequence ids)."""
    return _norm(s, cfg.hidden_size) + 8


def _moe_rows(cfg: ModelConfig, tokens: int) -> tuple[int, int]:
    """``(Nc, rows)``: tokens of one dispatch chunk ``min(moe_chunk_tokens, tokens)`` and its ``Nc k`` rows."""
    Nc = min(cfg.moe_chunk_tokens, tokens)
    return Nc, Nc * cfg.num_experts_per_tok


def _moe_fwd(cfg: ModelConfig, s: _Sizes, tokens: int, ep: int) -> float:
    """One dispatch chunk in forward (recomputed in backward): ``rows D (3a + f) + 16 rows`` (gathered rows,
    expert outputs and their concatenation, weighted fp32 rows, sort indices) ``+ Nc D (f + c_a + a + c)``
    (combined output and its cast, shared expert, router input) ``+ Nc (2E f + k (f + 8))`` (router);
    ``+ 4 rows D a`` under EP (dispatch and combine, send and receive)."""
    D, E, k = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    Nc, rows = _moe_rows(cfg, tokens)
    out = rows * D * (3 * s.a + s.f) + 16 * rows
    out += Nc * D * (s.f + s.ca + s.a + s.c) + Nc * (2 * E * s.f + k * (s.f + 8))
    return out + (4 * rows * D * s.a if ep > 1 else 0)


def _moe_bwd(cfg: ModelConfig, s: _Sizes, tokens: int, ep: int) -> float:
    """One chunk in backward: the recomputed chunk's saved tensors ``rows ((2D + 6I) a + f + 8) + Nc (c D + E f +
    k (f + 8) + 6 Is a)`` (rows and expert outputs, the SwiGLU internals, routing weights; the router; the shared
    expert) and the gradients ``rows D (f + 2a) + Nc D a``; ``+ 4 rows D a`` under EP."""
    D, E, k, I = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    Is = cfg.moe_intermediate_size * cfg.n_shared_experts
    Nc, rows = _moe_rows(cfg, tokens)
    saved = rows * ((2 * D + 6 * I) * s.a + s.f + 8) + Nc * (s.c * D + E * s.f + k * (s.f + 8) + 6 * Is * s.a)
    out = saved + rows * D * (s.f + 2 * s.a) + Nc * D * s.a
    return out + (4 * rows * D * s.a if ep > 1 else 0)


def _hc_bwd(cfg: ModelConfig, s: _Sizes) -> float:
    """One mHC call's backward: about ``nD (3f + a) + f iters (n^2 + n)`` (the streams' and normalised streams'
    gradients and their temporaries; the Sinkhorn iterations recomputed, each division saving its input and
    denominator); fitted to measurements of tiny and cpu-small (within 20%; a small term at GLM-5.3-Flash's width)."""
    n, D = cfg.hc_mult, cfg.hidden_size
    return n * D * (3 * s.f + s.a) + s.f * cfg.hc_sinkhorn_iters * (n * n + n)


# ---------------------------------------------------------------- the plan


def _check_args(cfg, seq_len, layout, gpu_memory_gib, batch_size, dtype, device, loss_chunk_tokens, loss_vocab_rows,
                allocator_slack, optimizer_offload):  # fmt: skip
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a genoctx.parallel.layout.Layout, got {type(layout).__name__}")
    for name, v in (("seq_len", seq_len), ("batch_size", batch_size), ("loss_chunk_tokens", loss_chunk_tokens)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if not (isinstance(gpu_memory_gib, int | float) and math.isfinite(gpu_memory_gib) and gpu_memory_gib > 0):
        raise ValueError(f"gpu_memory_gib must be a positive number, got {gpu_memory_gib!r}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    rows = loss_vocab_rows
    if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or not 1 <= rows <= cfg.vocab_size):
        raise ValueError(f"loss_vocab_rows must be in [1, vocab_size={cfg.vocab_size}], got {loss_vocab_rows!r}")
    if allocator_slack is not None and not 0 <= allocator_slack < 1:
        raise ValueError(f"allocator_slack must be in [0, 1), got {allocator_slack!r}")
    if "sparse" in cfg.mlp_layer_types and cfg.n_routed_experts % layout.ep:
        raise ValueError(f"ep={layout.ep} does not divide n_routed_experts={cfg.n_routed_experts}")
    if "sparse" not in cfg.mlp_layer_types and layout.ep > 1:
        raise ValueError(f"ep={layout.ep} needs MoE layers; the model has none")
    if seq_len % layout.cp:
        raise ValueError(f"seq_len {seq_len} is not a multiple of cp={layout.cp}")
    if seq_len // layout.cp < cfg.kda_chunk_size:
        raise ValueError(
            f"cp={layout.cp} leaves pieces of {seq_len // layout.cp} tokens, less than one KDA chunk "
            f"({cfg.kda_chunk_size})"
        )
    if optimizer_offload and not layout.fsdp:
        raise ValueError("optimizer_offload needs FSDP (dp_shard > 1 or cp > 1): it is FSDP2's CPUOffloadPolicy")
    if cfg.dsa_mode != "sparse" or cfg.indexer_stage == "warmup":
        raise ValueError("plan_memory models sparse DSA (dsa_mode='sparse', indexer_stage 'sparse' or 'off'), not the "
                         "dense indexer warm-up")  # fmt: skip


def plan_memory(
    cfg: ModelConfig,
    seq_len: int,
    layout: Layout,
    *,
    gpu_memory_gib: float,
    recompute: bool = True,
    optimizer_offload: bool = False,
    batch_size: int = 1,
    dtype: str = "bf16",
    loss_vocab_rows: int | None = None,
    loss_chunk_tokens: int = 2048,
    device: str = "cuda",
    allocator_slack: float | None = None,
) -> dict:
    """Predicted peak memory of one training step on the busiest rank of ``layout``.

    Args:
        cfg: the model (``ModelConfig``; its compute knobs ``kda_chunk_size``, ``indexer_tile_tokens``,
            ``moe_chunk_tokens``, ``indexer_stage`` count).
        seq_len: tokens per window (``L``); each rank holds ``T = L / cp`` of them per window.
        layout: ``dp_replicate x ep x dp_shard x cp`` (``genoctx.parallel.layout.Layout``).
        gpu_memory_gib: memory of one device in GiB; ``fits`` is ``total_gib <= gpu_memory_gib``.
        recompute: activation checkpointing of every decoder layer (``genoctx.parallel.fsdp.apply_ac``).
        optimizer_offload: FSDP2 ``CPUOffloadPolicy``: sharded masters, gradients and AdamW state in host memory.
        batch_size: windows per data-parallel rank per step (``N = batch_size x T`` tokens on the rank).
        dtype: ``"bf16"`` (bf16 compute, fp32 masters) or ``"fp32"`` (everything fp32).
        loss_vocab_rows: rows of the softmax of the chunked head (``genoctx.model.head``; 5 for
            ``loss.vocab: nucleotide``); None = ``vocab_size``. Used when ``vocab_size`` is not the 8 nucleotide
            tokens (a text base); an 8-token model trains on its own ``[N, 8]`` logits.
        loss_chunk_tokens: tokens per logits chunk of the chunked head (``loss.chunk_tokens``).
        device: ``"cuda"`` (allocator slack, foreach AdamW) or ``"cpu"`` (no slack, per-tensor AdamW).
        allocator_slack: fraction of the peak added for the caching allocator; None = ``ALLOCATOR_SLACK`` on CUDA,
            0 on CPU.

    Returns:
        ``{"layout": {dp_replicate, ep, dp_shard, cp, world}, "fits": bool, "total_gib": float,
        "components_gib": {name: GiB at the peak, for every name in COMPONENTS}, "peak_phase": str,
        "next_phases_gib": [[phase, GiB], ...] (the three next largest phases, slack included),
        "working_sets_gib": {name: the largest value over all phases}, "tokens_per_rank": N,
        "params_per_rank": {"dense", "expert"} (what one rank allocates: ``shard_numel``, about ``P_d / s_d`` and
        ``P_e / (ep s_e)``, FSDP2's padding of uneven shards included), "persistent_gib": {"weights",
        "gradients", "optimizer_state", "on_host"} (the sharded state of a whole step: 4, 4 and 8 bytes per local
        parameter; ``on_host`` with offload), "largest_layer_unsharded_gib" (the largest decoder layer's FSDP
        all-gathered parameters, routed experts: the rank's ``E / ep``; 0 without FSDP), "gpu_memory_gib", "dtype",
        "recompute", "optimizer_offload",
        "batch_size", "seq_len", "device"}``. GiB are rounded to 6 decimals (1 KiB); the components add up to the
        total.

    Components (bytes; ``P_d``, ``P_e`` dense and routed-expert parameters, ``s_d = layout.dense_shard``,
    ``s_e = layout.expert_shard``; local parameters ``P`` = ``shard_numel`` of every parameter, each dim 0 in
    ``ceil(rows / s)`` rows as FSDP2 allocates it, about ``P_d / s_d + P_e / (ep s_e)``):

    - ``weights`` ``4 P`` (fp32 masters, sharded), ``gradients`` ``4 x`` the local parameters whose gradient
      exists in that phase (backward fills them layer by layer), ``optimizer_state`` ``8 P`` (AdamW ``exp_avg``,
      ``exp_avg_sq``); all three 0 with ``optimizer_offload``.
    - ``unsharded_params``: FSDP's all-gathered blocks in ``a`` bytes (the fp32 islands in 4): the root (kept from
    forward to the end of
      backward, FSDP2's root default), the current and the prefetched decoder layer (a layer's routed experts:
      its ``E / ep`` local ones), and in backward the current layer's unsharded gradient; without FSDP and with
      bf16, a bf16 copy of the local parameters.
    - ``activations_*``: what the layers alive in the phase keep for backward, by layer type (the per-token sizes
      of ``_kda``, ``_dsa``, ``_moe``, ``_mlp``, ``_hc`` (two per layer, plus the ``n D a`` residual streams each
      saves), ``activations_head`` the embedding's ids, final norm and loss). With ``recompute`` only the layer
      being recomputed counts, and ``layer_inputs`` holds the other layers' inputs (``n D a`` per token).
      Under CP, KDA layers also keep their state-passing core (``_kda_project + _kda_core_saved(V + K)``) and
      DSA layers the whole-window tensors of ``_dsa_cp_saved``.
    - ``returned_caches``: until the loss, the caches the layers return: a KDA cache's conv state is a view of
      the whole pre-convolution input (``3 HK a`` per token, when not already saved), a DSA cache its latents
      and the incomplete pool's keys.
    - working sets (one sub-layer at a time): ``kda_core_recompute`` (``_kda_core_saved + _kda_core_backward``
      minus the output path), ``dsa_indexer_tiles``, ``dsa_attention`` (tiles, the latents' and queries' gradient
      ``a Hm R + f R ctx / N``, under CP the gathered window's gradient), ``moe_dispatch`` (one chunk, forward
      or backward), ``stream_gradients`` (the residual streams' gradients, mHC and dense-MLP backward),
      ``logits_loss`` (an 8-token model: ``[N, 8]`` fp32 logits and log-softmax; a text head: one
      ``[chunk, rows]`` fp32 logits chunk and the fp32 ``[V, D]`` weight-gradient buffer), ``cp_gather`` (a DSA
      layer's all-gather output and its concatenation, ``2 L W a`` per window), ``fsdp_reduce_scatter`` (a
      layer's gradient in fp32 for the reduce-scatter; at the end of backward the root's; without FSDP the
      flat all-reduce buffer), ``optimizer_step`` (foreach AdamW's temporaries, ``4 P``, on CUDA; two of the
      largest parameter on CPU).
    - ``allocator_slack``: ``allocator_slack x`` the sum of the others.

    Raises:
        ValueError: a bad argument or a layout this model cannot run (``ep`` not dividing the experts, ``cp`` not
            dividing ``seq_len`` or leaving less than one KDA chunk per piece, offload without FSDP), or dense DSA
            (the indexer warm-up), which is not modelled.
    """
    _check_args(cfg, seq_len, layout, gpu_memory_gib, batch_size, dtype, device, loss_chunk_tokens, loss_vocab_rows,
                allocator_slack, optimizer_offload)  # fmt: skip
    s = _Sizes(a=DTYPE_BYTES[dtype])
    a, f = s.a, s.f
    ep, cp = layout.ep, layout.cp
    T = seq_len // cp
    N = batch_size * T
    windows = batch_size
    ctx = seq_len if cp > 1 else T  # keys a DSA query may see on the busiest rank (the window's last piece)
    fsdp = layout.fsdp
    pc = param_counts(cfg)
    sd, se = layout.dense_shard, layout.expert_shard

    def local(block: dict) -> float:  # parameters of a block held (sharded, padded: shard_numel) on this rank
        if "shapes" in block:
            return sum(shard_numel(block["shapes"], layout).values())
        return block["dense"] / sd + block["expert"] / (ep * se)

    def gathered(block: dict) -> float:  # parameters of a block once all-gathered on this rank
        return block["dense"] + block["expert"] / ep

    P_local = local(pc)
    offload = optimizer_offload
    weights = 0.0 if offload else f * P_local
    optimizer_state = 0.0 if offload else 2 * f * P_local
    grad_bytes = 0.0 if offload else f  # per local parameter

    # ---- per-layer sizes
    n, D = cfg.hc_mult, cfg.hidden_size
    stream = n * D * a
    hc = _hc(cfg, s)
    layers = []
    for i, (mixer, ffn, ind) in enumerate(zip(cfg.layer_types, cfg.mlp_layer_types, cfg.indexer_types, strict=True)):
        full = mixer == DSA and ind == "full"
        saved = dict.fromkeys(("kda", "dsa", "moe", "dense_mlp", "mhc"), 0.0)
        saved["mhc"] = N * 2 * (stream + hc)
        w_fwd, w_bwd_mix = {}, {}
        cache = 0.0
        if mixer == KDA:
            H, K = cfg.linear_num_heads, cfg.linear_head_dim
            saved["kda"] = N * _kda(cfg, s)
            if cp > 1:  # kda_cp_cache: the layer's projections again and the [L | M] core, not checkpointed
                saved["kda"] += N * (_kda_project(cfg, s) + _kda_core_saved(cfg, 2 * K))
            w_bwd_mix["kda_core_recompute"] = N * (
                _kda_core_saved(cfg, K) + _kda_core_backward(cfg) - _kda_out_part(cfg, s)
            )
            w_fwd["kda_core_recompute"] = N * _kda_core_forward(cfg)
            # KDACache.conv_state is a view of the pre-convolution input (3 HK a), saved only in fp32 without AC
            cache = N * 3 * H * K * a if (recompute or a != f) else 0.0
        else:
            saved["dsa"] = N * _dsa(cfg, s, full)
            if cp > 1:
                saved["dsa"] += windows * seq_len * _dsa_cp_saved(cfg, s, full)
            tile_b = _dsa_tiles_bwd(cfg, T)
            grads = N * (a * cfg.num_attention_heads * cfg.kv_lora_rank - _dsa_out_part(cfg, s))
            grads += windows * ctx * f * cfg.kv_lora_rank if cp > 1 else N * f * cfg.kv_lora_rank
            if cp > 1:
                W = _dsa_gather_width(cfg, full)
                grads += windows * seq_len * (2 * cfg.kv_lora_rank * a + 2 * W * a)
            w_bwd_mix["dsa_attention"] = tile_b + grads
            w_fwd["dsa_attention"] = _dsa_tiles_fwd(cfg, s, T) + N * a * cfg.num_attention_heads * cfg.kv_lora_rank
            if full:
                w_fwd["dsa_indexer_tiles"] = _indexer_tiles(cfg, T, ctx)
            if cp > 1:
                w_fwd["cp_gather"] = windows * seq_len * 2 * _dsa_gather_width(cfg, full) * a
            # DSACache: the latents (saved anyway without AC; under CP the concatenation with the earlier ones), the
            # incomplete pool's keys and gates (views of the whole chunk's) and the pooled keys
            dI, R = cfg.index_head_dim, cfg.kv_lora_rank
            cache = N * a * (R * recompute + full * dI * (1 + recompute + 1 / cfg.index_kpool))
            if cp > 1 and recompute:
                cache += windows * seq_len * a * R
        if ffn == "sparse":
            saved["moe"] = N * _moe(cfg, s)
            w_fwd["moe_dispatch"] = _moe_fwd(cfg, s, N, ep)
            w_bwd_ffn = {"moe_dispatch": _moe_bwd(cfg, s, N, ep)}
            ffn_saved = saved["moe"]
        else:
            saved["dense_mlp"] = N * _mlp(cfg, s)
            w_bwd_ffn = {"stream_gradients": N * (2 * cfg.intermediate_size + D) * a}
            ffn_saved = saved["dense_mlp"]
        # backward of the feed-forward half: the streams' gradients (two of n D a) and the layer output's
        # gradient come on top of the sub-layer's working set
        w_bwd_ffn["stream_gradients"] = w_bwd_ffn.get("stream_gradients", 0.0) + N * (2 * stream + D * a)
        w_bwd_mix["stream_gradients"] = N * (stream + D * a)
        # what the mixer's backward no longer holds: the feed-forward half (its mHC, streams, norm, MLP/MoE)
        ffn_part = ffn_saved + N * (stream + hc)
        w_bwd_hc = N * _hc_bwd(cfg, s)
        layers.append({
            "index": i, "kind": ("kda" if mixer == KDA else "dsa") + "+" + ("moe" if ffn == "sparse" else "mlp"),
            "saved": saved, "ffn_part": ffn_part, "input": N * stream, "cache": cache,
            "w_fwd": w_fwd, "w_bwd_ffn": w_bwd_ffn, "w_bwd_mix": w_bwd_mix, "w_bwd_hc": w_bwd_hc,
            "block": gathered(pc["layers"][i]), "local": local(pc["layers"][i]),
            "block_bytes": a * gathered(pc["layers"][i]) + (f - a) * pc["layers"][i]["island"],
        })  # fmt: skip
    L = len(layers)

    # ---- head (embedding ids, final norm, loss)
    V = cfg.vocab_size
    head_saved = N * (8 + _norm(s, D))  # embedding indices; final RMSNorm (its output feeds lm_head)
    if V <= NUCLEOTIDE_VOCAB:  # the model's own logits
        head_saved += N * (f * (V + 2) + 8)  # log-softmax, targets, masked losses
        head_fwd = N * V * (a + s.c)  # logits and their fp32 copy (the log-softmax is saved)
        head_bwd = N * (2 * V * f + D * a + D * f)  # logits and log-softmax gradients, the hidden state's
    else:  # genoctx.model.head: chunked logits, fp32 weight-gradient buffer
        rows = loss_vocab_rows or V
        C_head = min(loss_chunk_tokens, N)
        head_saved += N * (8 + 1 + 2 * f)  # targets, mask, log-sum-exp, losses
        head_fwd = C_head * rows * (f + s.ca)
        head_bwd = C_head * rows * (f + s.ca) + rows * D * f + (V * D * a if (a != f or rows != V) else 0) + N * D * a
    root = pc["root"]
    head_params = {"dense": root["dense"] - pc["embed"], "expert": 0}  # final norm, lm_head (untied)
    if cfg.tie_word_embeddings:
        head_params["dense"] += pc["embed"]
    root_unsharded = a * gathered(root) if fsdp else 0.0
    compute_copy = a * P_local if (not fsdp and a != f) else 0.0  # replicated bf16 compute copy

    def fsdp_params(i: int, j: int | None) -> float:  # current and prefetched block, all-gathered
        if not fsdp:
            return 0.0
        return layers[i]["block_bytes"] + (layers[j]["block_bytes"] if j is not None and 0 <= j < L else 0.0)

    def grads_after(i: int) -> float:
        """Gradients of layers i+1.. (sharded ones under FSDP) and of the head (without FSDP: lm_head and the final
        norm get theirs first; under FSDP the root's stays unsharded until the end of backward)."""
        done = sum(x["local"] for x in layers[i + 1 :])
        return grad_bytes * (done + (0.0 if fsdp else local(head_params)))

    # ---- phases
    phases = []

    def phase(name: str, comps: dict) -> None:
        base = {"weights": weights, "optimizer_state": optimizer_state}
        phases.append((name, {**base, **{k: v for k, v in comps.items() if v}}))

    def kept(upto: int) -> dict:  # activations layers 0..upto-1 keep until their backward
        out = dict.fromkeys(("activations_kda", "activations_dsa", "activations_moe", "activations_dense_mlp",
                             "activations_mhc", "layer_inputs"), 0.0)  # fmt: skip
        for x in layers[:upto]:
            if recompute:
                out["layer_inputs"] += x["input"]
            else:
                for k, v in x["saved"].items():
                    out[f"activations_{k}"] += v
        return out

    def own(x: dict, minus: float = 0.0) -> dict:  # layer x's own activations (all of them; under AC rebuilt)
        out = {f"activations_{k}": v for k, v in x["saved"].items()}
        if minus:  # take the consumed feed-forward half out of its owners, mHC first
            ffn_key = "activations_moe" if x["kind"].endswith("moe") else "activations_dense_mlp"
            ffn_amt = x["saved"]["moe" if x["kind"].endswith("moe") else "dense_mlp"]
            out[ffn_key] -= ffn_amt
            out["activations_mhc"] -= minus - ffn_amt
        return out

    def add(*ds: dict) -> dict:
        out: dict = {}
        for d in ds:
            for k, v in d.items():
                out[k] = out.get(k, 0.0) + v
        return out

    caches = 0.0
    for i, x in enumerate(layers):
        w = max(x["w_fwd"].items(), key=lambda kv: kv[1]) if x["w_fwd"] else None
        # under AC only the input stays, plus the streams alive while the layer runs (the mid stream, a sub-layer's
        # output)
        this = {"layer_inputs": x["input"], "activations_mhc": N * (stream + D * a)} if recompute else own(x)
        comps = add(kept(i), this, {"returned_caches": caches, "unsharded_params": root_unsharded + compute_copy
                                    + fsdp_params(i, i + 1)}, dict([w]) if w else {})  # fmt: skip
        phase(f"forward layer {i} ({x['kind']})", comps)
        caches += x["cache"]
    phase("end of forward (logits, loss)", add(kept(L), {
        "returned_caches": caches, "activations_head": head_saved, "logits_loss": head_fwd,
        "unsharded_params": root_unsharded + compute_copy}))  # fmt: skip
    root_grad = a * gathered(head_params) if fsdp else 0.0  # the root's unsharded gradient, lm_head's first
    phase("head backward", add(kept(L), {
        "activations_head": head_saved, "logits_loss": head_bwd, "gradients": grads_after(L - 1),
        "unsharded_params": root_unsharded + compute_copy + root_grad}))  # fmt: skip
    rs_root = f * gathered(root) if fsdp else 0.0
    for i in reversed(range(L)):
        x = layers[i]
        common = {
            "gradients": grads_after(i),
            "unsharded_params": root_unsharded + compute_copy + fsdp_params(i, i - 1)
            + (x["block_bytes"] if fsdp else 0),
            "fsdp_reduce_scatter": f * layers[i + 1]["block"] if (fsdp and i + 1 < L) else 0.0,
        }
        common["unsharded_params"] += root_grad  # waits for the end of backward
        base_i = add(kept(i), common)
        if recompute:  # the layer's forward again, its activations kept this time
            w = max(x["w_fwd"].items(), key=lambda kv: kv[1]) if x["w_fwd"] else None
            phase(f"backward layer {i} ({x['kind']}): recompute", add(base_i, own(x), dict([w]) if w else {}))
        phase(f"backward layer {i} ({x['kind']}): feed-forward", add(base_i, own(x), x["w_bwd_ffn"]))
        phase(f"backward layer {i} ({x['kind']}): mHC", add(base_i, own(x), {"stream_gradients": x["w_bwd_hc"]}))
        phase(f"backward layer {i} ({x['kind']}): mixer", add(base_i, own(x, x["ffn_part"]), x["w_bwd_mix"]))
    end = {"gradients": grad_bytes * P_local if not fsdp else grads_after(-1)}
    if fsdp:
        end.update(unsharded_params=2 * root_unsharded, fsdp_reduce_scatter=rs_root)
    else:
        end["unsharded_params"] = compute_copy
        if layout.world > 1:
            end["fsdp_reduce_scatter"] = f * P_local  # reduce_gradients' flat all-reduce buffer
    phase("end of backward (gradient reduction)", end)
    step_tmp = 0.0 if offload else (f * P_local if device == "cuda" else 2 * f * pc["largest"] / (sd if fsdp else 1))
    phase("optimizer step", {"gradients": grad_bytes * P_local, "optimizer_step": step_tmp})

    totals = [(name, sum(c.values())) for name, c in phases]
    order = sorted(range(len(phases)), key=lambda j: -totals[j][1])
    k = order[0]
    peak_name, peak = phases[k]
    slack = ALLOCATOR_SLACK if (allocator_slack is None and device == "cuda") else (allocator_slack or 0.0)
    comps = {name: peak.get(name, 0.0) for name in COMPONENTS}
    comps["allocator_slack"] = slack * sum(comps.values())
    working = {name: max(c.get(name, 0.0) for _, c in phases) for name in WORKING_SETS}
    for x in layers:  # a forward phase counts only its largest working set: list every one
        for d in (x["w_fwd"], x["w_bwd_ffn"], x["w_bwd_mix"]):
            for name, v in d.items():
                if name in working:
                    working[name] = max(working[name], v)

    def gib(x: float) -> float:
        return round(x / GIB, 6)

    comps_gib = {k: gib(v) for k, v in comps.items()}
    total_gib = round(sum(comps_gib.values()), 6)  # the rounded components add up to the total
    return {
        "layout": {**{d: getattr(layout, d) for d in DIMS}, "world": layout.world},
        "fits": total_gib <= gpu_memory_gib,
        "total_gib": total_gib,
        "components_gib": comps_gib,
        "peak_phase": peak_name,
        "next_phases_gib": [[totals[j][0], gib(totals[j][1] * (1 + slack))] for j in order[1:4]],
        "working_sets_gib": {k: gib(v) for k, v in working.items()},
        "tokens_per_rank": N,
        "params_per_rank": shard_numel(pc["shapes"], layout),
        "largest_layer_unsharded_gib": gib(max(x["block_bytes"] for x in layers) if fsdp and layers else 0.0),
        "persistent_gib": {
            "weights": gib(f * P_local),
            "gradients": gib(f * P_local),
            "optimizer_state": gib(2 * f * P_local),
            "on_host": offload,
        },  # fmt: skip
        "seq_len": seq_len,
        "batch_size": batch_size,
        "gpu_memory_gib": gpu_memory_gib,
        "dtype": dtype,
        "device": device,
        "recompute": recompute,
        "optimizer_offload": optimizer_offload,
    }


def _divisors(x: int) -> list[int]:
    return [d for d in range(1, x + 1) if x % d == 0]


def valid_layouts(cfg: ModelConfig, seq_len: int, gpus: int, *, optimizer_offload: bool = False) -> list[Layout]:
    """Every layout of ``gpus`` ranks this model can run: ``dp_replicate x ep x dp_shard x cp == gpus``, ``ep``
    dividing ``n_routed_experts`` (1 without MoE layers), ``cp`` dividing ``seq_len`` with pieces of at least one
    KDA chunk (``kda_chunk_size`` tokens), FSDP (``dp_shard > 1`` or ``cp > 1``) when ``optimizer_offload``.

    Raises:
        ValueError: ``gpus`` or ``seq_len`` not a positive integer.
    """
    for name, v in (("gpus", gpus), ("seq_len", seq_len)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    moe = "sparse" in cfg.mlp_layer_types
    out = []
    for cp in _divisors(gpus):
        if seq_len % cp or seq_len // cp < cfg.kda_chunk_size:
            continue
        for ep in _divisors(gpus // cp):
            if (moe and cfg.n_routed_experts % ep) or (not moe and ep > 1):
                continue
            for dp_shard in _divisors(gpus // (cp * ep)):
                lay = Layout(dp_replicate=gpus // (cp * ep * dp_shard), ep=ep, dp_shard=dp_shard, cp=cp)
                if optimizer_offload and not lay.fsdp:
                    continue
                out.append(lay)
    return out


def search_layouts(cfg: ModelConfig, seq_len: int, gpus: int, gpu_memory_gib: float, **kwargs) -> list[dict]:
    """``plan_memory`` of every layout of ``valid_layouts``, best first.

    Order: layouts that fit first; then ascending ``total_gib`` (the most headroom first); ties by fewer CP ranks,
    then fewer EP ranks, then more data-parallel replicas (less communication for the same memory).

    Args:
        cfg, seq_len, gpu_memory_gib: as ``plan_memory``.
        gpus: ranks (the layouts' world size).
        **kwargs: the other keyword arguments of ``plan_memory``.

    Returns:
        The plans (``plan_memory`` dicts); empty when no layout is valid.

    Raises:
        ValueError: as ``plan_memory`` and ``valid_layouts``.
    """
    plans = [
        plan_memory(cfg, seq_len, lay, gpu_memory_gib=gpu_memory_gib, **kwargs)
        for lay in valid_layouts(cfg, seq_len, gpus, optimizer_offload=kwargs.get("optimizer_offload", False))
    ]
    plans.sort(key=lambda p: (not p["fits"], p["total_gib"], p["layout"]["cp"], p["layout"]["ep"],
                              -p["layout"]["dp_replicate"]))  # fmt: skip
    return plans


def describe_layout(plan: dict) -> str:
    """``"dp_replicate=1 ep=8 dp_shard=2 cp=4"`` of a plan."""
    return " ".join(f"{d}={plan['layout'][d]}" for d in DIMS)


def check_fits(plan: dict) -> None:
    """Raise when a plan does not fit its device.

    Raises:
        GenoctxError: ``plan["fits"]`` is False; one line with the layout, the predicted and available GiB, the
            largest components and the peak phase (``genoctx train --force`` overrides it).
    """
    if plan.get("fits", True):
        return
    comps = sorted(plan["components_gib"].items(), key=lambda kv: -kv[1])
    top = ", ".join(f"{k} {v:.1f}" for k, v in comps[:4] if v > 0)
    ac = "" if plan.get("recompute", True) else ", recompute the layers (train.activation_checkpointing)"
    raise GenoctxError(
        f"memory plan: {describe_layout(plan)} needs {plan['total_gib']:.1f} GiB per GPU, more than "
        f"{plan['gpu_memory_gib']:g} GiB (largest: {top}; at {plan['peak_phase']}); choose another layout "
        f"(genoctx plan --gpus N lists those that fit){ac}, or pass --force"
    )


def format_table(plans: list[dict], limit: int = 10) -> str:
    """A human-readable breakdown of ``plans`` (best first): one line per layout (at most ``limit``), then the
    components of the first (the best) plan. Zero components are left out; GiB, or MiB when the best plan needs
    less than 1 GiB."""
    if not plans:
        return "no valid layout"
    p0 = plans[0]
    unit, scale = ("GiB", 1) if p0["total_gib"] >= 1 else ("MiB", 1024)
    lines = [
        f"seq_len {p0['seq_len']}  batch {p0['batch_size']}  dtype {p0['dtype']}  recompute {p0['recompute']}  "
        f"offload {p0['optimizer_offload']}  device memory {p0['gpu_memory_gib']:g} GiB",
        "",
        f"{'#':>3}  {'dp_replicate':>12} {'ep':>4} {'dp_shard':>8} {'cp':>4}  {'tokens/rank':>11}  "
        f"{unit + '/GPU':>9}  fits  peak at",
    ]
    for j, p in enumerate(plans[:limit], 1):
        lay = p["layout"]
        lines.append(
            f"{j:>3}  {lay['dp_replicate']:>12} {lay['ep']:>4} {lay['dp_shard']:>8} {lay['cp']:>4}  "
            f"{p['tokens_per_rank']:>11}  {p['total_gib'] * scale:>9.2f}  {'yes' if p['fits'] else 'no ':<4}  "
            f"{p['peak_phase']}"
        )
    if len(plans) > limit:
        lines.append(f"     ({len(plans) - limit} more; --format json lists them)")
    lines += ["", f"components of #1 ({describe_layout(p0)}), {unit} per GPU at {p0['peak_phase']}:"]
    for k, v in p0["components_gib"].items():
        if v:
            lines.append(f"  {k:<24} {v * scale:>9.3f}")
    lines.append(f"  {'total':<24} {p0['total_gib'] * scale:>9.3f}")
    others = {k: v for k, v in p0["working_sets_gib"].items() if v and not p0["components_gib"].get(k)}
    if others:
        lines.append(f"largest working sets of other phases ({unit}): "
                     + ", ".join(f"{k} {v * scale:.3f}" for k, v in others.items()))  # fmt: skip
    return "\n".join(lines)


__all__ = [
    "ALLOCATOR_SLACK", "COMPONENTS", "GIB", "check_fits", "describe_layout", "format_table", "param_counts",
    "plan_memory", "search_layouts", "valid_layouts",
]  # fmt: skip
