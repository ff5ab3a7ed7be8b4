"""Memory planner: bytes per GPU, by component, of one training step (or of scoring one window in evaluation) of a
config x sequence length x parallel layout.

``plan_memory`` predicts the peak of one optimizer step (forward, backward, AdamW step) on the busiest rank;
``plan_eval`` the peak of scoring one window in evaluation (forward only, no gradients: its own phases and
components, section "evaluation" below); ``search_layouts`` plans every layout of a number of GPUs and sorts them;
``check_fits`` turns a plan that does not fit into a one-line ``GenoctxError``. Units: bytes inside, GiB (2^30
bytes) in the returned dicts.

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
- KDA runs genoctx's own chunked core (``chunk_kda``, ``kda_kernel="torch"``, what ``genoctx train`` runs by
  default, and what the CP state passing of ``genoctx.parallel.context`` always runs) in blocks of
  ``kda_block_tokens``, each recomputed in backward on its own (``_kda_core_recompute``). With
  ``kda_kernel="fla"`` on CUDA a training plan counts fla-core's Triton ``chunk_kda`` instead (``_fla_saved``,
  ``_fla_forward``, ``_fla_backward``: counted from fla-core 0.6's saved and allocated tensors, not measured until
  a GPU run; evaluation plans always count the PyTorch core). DSA runs
  sparse (``dsa_mode="sparse"``) with the indexer KL of the ``sparse`` stage (``indexer_stage="off"`` drops the KL
  terms); its tiles are those of the PyTorch path (``kernels="torch"``, and always on CPU): with the Triton kernels
  of ``kernels/`` on CUDA the tiles stay on chip and the tile terms are upper bounds.
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
from .parallel.layout import DIMS, LAYOUTS, Layout, cp_pieces

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
    "logits_loss", "cp_gather", "fsdp_reduce_scatter", "optimizer_step", "seq_chunk_boundary", "allocator_slack",
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
    """A DSA mixer with its input norm: ``norm(D) + norm(Q) + norm(R) + a Hm (dq + 2R + dv)`` (the query copy of
    the absorbed product, the latent queries, the output latents' copy, ``o_proj``'s input) ``+ f Hm`` (softmax
    log-sum-exp). A "full" layer adds its indexer: ``f (2 dI + 2) + a dI`` (the key LayerNorm in fp32: its input's
    copy, mean and rstd; the pooling softmax; the keys the pooling saves) ``+ f (HI dI + HI + dI / kp)``
    (the KL gradients, computed in forward) ``+ 4 topk / kp`` (int32 pool indices) ``+ 8`` (int64 query
    positions)."""
    D, Q, R = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank
    Hm, dq, dv = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
    out = _norm(s, D) + _norm(s, Q) + _norm(s, R) + s.a * Hm * (dq + 2 * R + dv) + s.f * Hm
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
    ``(w - 1) 3 H K a`` per chunk boundary, i.e. divided by ``chunk_tokens``.
    ``rows``: sequences per rank (batch size).

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
        else:
            H, K = cfg.linear_num_heads, cfg.linear_head_dim
            per += (4 * H * K * K + (cfg.linear_conv_kernel_dim - 1) * 3 * H * K * a) / chunk_tokens
    return rows * per


def _check_model_layout(cfg, layout, gpu_memory_gib, dtype, device, loss_vocab_rows, allocator_slack):
    """The checks ``plan_memory`` and ``plan_eval`` share: types, device and dtype, head rows, slack, EP."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a genoctx.parallel.layout.Layout, got {type(layout).__name__}")
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


def _check_args(cfg, seq_len, layout, gpu_memory_gib, batch_size, dtype, device, loss_chunk_tokens, loss_vocab_rows,
                allocator_slack, optimizer_offload):  # fmt: skip
    for name, v in (("seq_len", seq_len), ("batch_size", batch_size), ("loss_chunk_tokens", loss_chunk_tokens)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    _check_model_layout(cfg, layout, gpu_memory_gib, dtype, device, loss_vocab_rows, allocator_slack)
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
    seq_chunk_tokens: int | None = None,
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
        seq_chunk_tokens: ``train.seq_chunk_tokens``: each window trained as chunks of this many tokens by the exact
            chunked backward (``genoctx.train.chunked``; under CP each rank's part of a round of ``cp x`` this many
            tokens). The step's phases are one chunk's (``T`` = the chunk), its DSA layers seeing the whole window
            before it (indexer tiles over ``L``, the latents' gradient over ``L``; under CP the gathered tensors of
            one round), plus ``seq_chunk_boundary`` (``seq_chunk_boundary_bytes x L``, the same on every CP rank)
            until the end of backward. None, or not below ``L / cp``: one pass.

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
        "batch_size", "seq_len", "seq_chunk_tokens" (None: one pass), "device"}``. GiB are rounded to 6 decimals
        (1 KiB); the components add up to the
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
      Under CP, KDA layers also keep the state their checkpointed ``[L | M]`` pass leaves (``f H K 2K``) and DSA
      layers the whole-window tensors of ``_dsa_cp_saved``.
    - ``returned_caches``: until the loss, the caches the layers return: a KDA cache's conv state is a view of
      the whole pre-convolution input (``3 HK a`` per token, when not already saved), a DSA cache its latents
      and the incomplete pool's keys; none under CP (the mixers' CP forwards return no cache).
    - working sets (one sub-layer at a time): ``kda_core_recompute`` (``_kda_core_recompute``, one block of the core
      recomputed, minus the output path; under CP or the recomputed ``[L | M]`` pass, its projections, ``[v | 0]``
      and core blocks of width ``2K``, once the layer's own graph is freed, whichever is larger),
      ``dsa_indexer_tiles``, ``dsa_attention`` (tiles, the latents' and queries' gradient ``a Hm R + f R ctx / N``;
      under CP, once the tiles are freed, the gathered window's gradient instead of them), ``moe_dispatch`` (one
      chunk, forward
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
    chunked = seq_chunk_tokens is not None and seq_chunk_tokens < T
    if seq_chunk_tokens is not None and seq_chunk_tokens < 1:
        raise ValueError(f"seq_chunk_tokens must be >= 1, got {seq_chunk_tokens}")
    if chunked:
        T = seq_chunk_tokens  # under CP: this rank's part of a round of cp x T tokens
    N = batch_size * T
    windows = batch_size
    # keys a DSA query may see on the busiest rank: the window's last piece (CP) or last chunk
    ctx = seq_len if (cp > 1 or chunked) else T
    # tokens whose DSA latents/keys a CP layer gathers at once: the window, or (chunked) one round
    gather_len = cp * T if chunked else seq_len
    boundary = seq_len * seq_chunk_boundary_bytes(cfg, T * cp, batch_size, a) if chunked else 0.0
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
            core = _kda_core_recompute(cfg, batch_size, T, K)
            w_fwd["kda_core_recompute"] = _kda_core_fwd(cfg, s, batch_size, T, K)
            if cfg.kda_kernel == "fla" and device == "cuda":  # fla's Triton core: its own terms (counted, unmeasured)
                saved["kda"] += N * _fla_saved(cfg)
                core = N * _fla_backward(cfg, s)
                w_fwd["kda_core_recompute"] = N * _fla_forward(cfg, s)
            core -= N * _kda_out_part(cfg, s)
            if cp > 1:  # kda_cp_cache's [L | M] pass, checkpointed: it keeps its state, and is recomputed (the
                # projections again, [v | 0], the core block by block) after the layer's own graph is freed
                saved["kda"] += batch_size * f * H * K * 2 * K
                state_pass = N * (_kda_project(cfg, s) + 2 * H * K * s.a)
                core = max(core, state_pass + _kda_core_recompute(cfg, batch_size, T, 2 * K) - N * _kda(cfg, s))
                w_fwd["kda_core_recompute"] = max(
                    w_fwd["kda_core_recompute"], state_pass + _kda_core_fwd(cfg, s, batch_size, T, 2 * K)
                )
            w_bwd_mix["kda_core_recompute"] = max(0.0, core)
            # KDACache.conv_state is a view of the pre-convolution input (3 HK a), saved only in fp32 without AC
            cache = N * 3 * H * K * a if (recompute or a != f) else 0.0
        else:
            saved["dsa"] = N * _dsa(cfg, s, full)
            if cp > 1:
                saved["dsa"] += windows * gather_len * _dsa_cp_saved(cfg, s, full)
            tile_b = _dsa_tiles_bwd(cfg, T)
            grads = N * (a * cfg.num_attention_heads * cfg.kv_lora_rank - _dsa_out_part(cfg, s))
            grads += windows * ctx * f * cfg.kv_lora_rank if (cp > 1 or chunked) else N * f * cfg.kv_lora_rank
            w_bwd_mix["dsa_attention"] = tile_b + grads
            if cp > 1:  # after the attention's backward (its tiles freed): the gathered window's gradient
                W = _dsa_gather_width(cfg, full)
                window_grads = windows * gather_len * (2 * cfg.kv_lora_rank * a + 2 * W * a)
                w_bwd_mix["dsa_attention"] = max(tile_b, window_grads) + grads
            w_fwd["dsa_attention"] = _dsa_tiles_fwd(cfg, s, T) + N * a * cfg.num_attention_heads * cfg.kv_lora_rank
            if full:
                w_fwd["dsa_indexer_tiles"] = _indexer_tiles(cfg, T, ctx)
            if cp > 1:
                w_fwd["cp_gather"] = windows * gather_len * 2 * _dsa_gather_width(cfg, full) * a
            # DSACache: the latents (saved anyway without AC; under CP the concatenation with the earlier ones), the
            # incomplete pool's keys and gates (views of the whole chunk's) and the pooled keys (fp32)
            dI, R = cfg.index_head_dim, cfg.kv_lora_rank
            cache = N * (a * (R * recompute + full * dI * (1 + recompute)) + full * f * dI / cfg.index_kpool)
        if cp > 1:  # under CP the mixers return no cache (genoctx.parallel.context); chunked, the round's cache,
            # views of the kept boundary state (DSA latents: join_latents) and small copies (KDA state and tail)
            cache = 0.0
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

    def phase(name: str, comps: dict, carried: bool = True) -> None:
        base = {"weights": weights, "optimizer_state": optimizer_state}
        if carried:  # chunked: the state crossing chunk boundaries, kept until the last chunk's backward
            base["seq_chunk_boundary"] = boundary
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

    add = _add

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
    phase("end of backward (gradient reduction)", end, carried=False)
    step_tmp = 0.0 if offload else (f * P_local if device == "cuda" else 2 * f * pc["largest"] / (sd if fsdp else 1))
    phase("optimizer step", {"gradients": grad_bytes * P_local, "optimizer_step": step_tmp}, carried=False)

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
        "layout": _layout_dict(layout),
        "fits": total_gib <= gpu_memory_gib,
        "total_gib": total_gib,
        "components_gib": comps_gib,
        "peak_phase": peak_name,
        "next_phases_gib": [[totals[j][0], gib(totals[j][1] * (1 + slack))] for j in order[1:4]],
        "working_sets_gib": {k: gib(v) for k, v in working.items()},
        "tokens_per_rank": N,
        # chunked: every chunk's MoE layers also run in the forward sweep (2 more exchanges), over the whole window
        "all_to_all_gib": round(all_to_all_bytes(cfg, batch_size * seq_len // cp if chunked else N, layout, a,
                                                 passes=(8 if recompute else 6) + 2 * chunked) / GIB, 6),
        "params_per_rank": shard_numel(pc["shapes"], layout),
        "largest_layer_unsharded_gib": gib(max(x["block_bytes"] for x in layers) if fsdp and layers else 0.0),
        "persistent_gib": {
            "weights": gib(f * P_local),
            "gradients": gib(f * P_local),
            "optimizer_state": gib(2 * f * P_local),
            "on_host": offload,
        },  # fmt: skip
        "seq_len": seq_len,
        "seq_chunk_tokens": T if chunked else None,
        "batch_size": batch_size,
        "gpu_memory_gib": gpu_memory_gib,
        "dtype": dtype,
        "device": device,
        "recompute": recompute,
        "optimizer_offload": optimizer_offload,
    }


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
    its inputs at its peak, in ``_CausalDecayScores.forward`` (``s = 8`` tokens per sub-chunk, ``m = C / s - 1``):
    ``f H (3K + V + 2K)`` (padded q, k, g and v; cumulative and exponentiated decays) plus, at the end of
    ``_decay_factors``, ``K (2s + m / (m + 1) + 2m)`` (``Ed``, ``b_diag``, row decays, ``e``, ``b_off``), or, at the
    second score matrix (``Ed`` freed), ``K (s + m / (m + 1) + 2m) + C + s K + s`` (the first ``C x C`` matrix, the
    ``b_diag a`` product and its sum), whichever is larger (measured on tiny and cpu-small within 1%). The later
    steps (triangular solve, per-chunk state loop) hold less."""
    H, K, C = cfg.linear_num_heads, cfg.linear_head_dim, cfg.kda_chunk_size
    sub = SUB_CHUNK if C % SUB_CHUNK == 0 else C
    m = C // sub - 1
    base = 3 * K + V + 2 * K + K * (m / (m + 1) + 2 * m)
    return F32 * H * max(base + K * 2 * sub, base + K * sub + C + sub * K + sub)


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
        attn = T * (s.a * Hm * R + s.f * Hm) + _dsa_tiles_fwd(cfg, s, T)
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


def _add(*ds: dict) -> dict:
    """The sum of component dicts, key by key."""
    out: dict = {}
    for d in ds:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


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
    the feed-forward and the mHC after it. ``residual_streams`` (``DecoderLayer.forward`` without gradients): in the
    mixer the layer input and the normalised sub-layer input, ``N (nDa + Da)``; in the feed-forward half the input,
    the streams after the mixer and three ``[N, D]`` tensors alive as locals (the mixer output, the mHC's sub-layer
    input, its normalised copy), ``N (2 nDa + 3 Da)``; ``mhc``: the ``post`` of the feed-forward, ``3 N nDa`` (the
    mixed streams, the scaled output, their sum), more than any ``pre`` (``f (nD + D + (2 + n) n)`` per token)."""
    cfg, s = ev.cfg, ev.s
    nDa, Da = N * cfg.hc_mult * cfg.hidden_size * s.a, N * cfg.hidden_size * s.a
    head = f"forward layer {i} ({_layer_kind(cfg, i)})"
    out = [(f"{head}: {name}{where}", _add(base, {"residual_streams": nDa + Da}, c)) for name, c in mixer]
    mid = _add(base, {"residual_streams": 2 * nDa + 3 * Da})
    out.append((f"{head}: feed-forward{where}", _add(mid, _ffn_eval(cfg, s, i, N, ev.layout.ep))))
    out.append((f"{head}: mHC{where}", _add(mid, {"mhc": 3 * nDa})))
    return out


def _eval_head(ev: _EvalRun, N: int, caches: float, io: float, where: str = "") -> tuple:
    """The end of the forward: the final hidden states ``N D a`` and the head (``_head_eval``); the root's
    parameters."""
    p = ev.params
    return (f"end of forward (head){where}", {
        "weights": p["weights"], "unsharded_params": p["root"], "window_io": io, "carried_caches": caches,
        "residual_streams": N * ev.cfg.hidden_size * ev.s.a,
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
    slack = ALLOCATOR_SLACK if (allocator_slack is None and device == "cuda") else (allocator_slack or 0.0)
    out = _eval_summary(phases, slack)
    pc = param_counts(cfg)
    return {
        "layout": _layout_dict(layout),
        "fits": out["total_gib"] <= gpu_memory_gib,
        **out,
        "tokens_per_rank": seq_len // layout.cp,
        "all_to_all_gib": round(all_to_all_bytes(cfg, seq_len // layout.cp, layout, s.a, passes=2) / GIB, 6),
        "params_per_rank": shard_numel(pc["shapes"], layout),
        "largest_layer_unsharded_gib": round(max(ev.params["blocks"], default=0.0) / GIB, 6),
        "persistent_gib": {"weights": round(ev.params["weights"] / GIB, 6), "gradients": 0.0, "optimizer_state": 0.0,
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


def _eval_summary(phases: list, slack: float) -> dict:
    """``total_gib``, ``components_gib`` (of the largest phase, plus slack), ``peak_phase``, ``next_phases_gib`` and
    ``working_sets_gib`` (each working set's largest value over the phases) of ``plan_eval``'s phases."""
    totals = [sum(c.values()) for _, c in phases]
    order = sorted(range(len(phases)), key=lambda j: -totals[j])
    name, peak = phases[order[0]]
    comps = {k: peak.get(k, 0.0) for k in EVAL_COMPONENTS}
    comps["allocator_slack"] = slack * sum(comps.values())

    def gib(x: float) -> float:
        return round(x / GIB, 6)

    comps_gib = {k: gib(v) for k, v in comps.items()}
    return {
        "total_gib": round(sum(comps_gib.values()), 6),
        "components_gib": comps_gib,
        "peak_phase": name,
        "next_phases_gib": [[phases[j][0], gib(totals[j] * (1 + slack))] for j in order[1:4]],
        "working_sets_gib": {k: gib(max(c.get(k, 0.0) for _, c in phases)) for k in EVAL_WORKING_SETS},
    }


def _divisors(x: int) -> list[int]:
    return [d for d in range(1, x + 1) if x % d == 0]


def valid_layouts(cfg: ModelConfig, seq_len: int, gpus: int, *, optimizer_offload: bool = False, mode: str = "train",
                  cp_layout: str = "contiguous") -> list[Layout]:  # fmt: skip
    """Every layout of ``gpus`` ranks this model can run: ``dp_replicate x ep x dp_shard x cp == gpus``, ``ep``
    dividing ``n_routed_experts`` (1 without MoE layers), and the folded layouts (``Layout.ep_folded``:
    ``dp_replicate x dp_shard x cp == gpus``, ``ep > 1`` dividing both ``dp_shard x cp`` and the experts),
    ``cp`` dividing ``seq_len`` with pieces of at least one
    KDA chunk (``kda_chunk_size`` tokens), FSDP (``dp_shard > 1`` or ``cp > 1``) when ``optimizer_offload``. With
    ``mode="eval"`` (``plan_eval``: no optimizer) the window must split into the CP pieces of ``cp_layout`` (``cp``, or
    ``2 cp`` under zigzag) of at least ``linear_conv_kernel_dim - 1`` tokens, as ``genoctx eval`` requires.

    Raises:
        ValueError: ``gpus`` or ``seq_len`` not a positive integer, an unknown ``mode`` or ``cp_layout``.
    """
    for name, v in (("gpus", gpus), ("seq_len", seq_len)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if mode not in ("train", "eval"):
        raise ValueError(f"mode must be train or eval, got {mode!r}")
    if cp_layout not in LAYOUTS:
        raise ValueError(f"cp_layout must be one of {', '.join(LAYOUTS)}, got {cp_layout!r}")
    moe = "sparse" in cfg.mlp_layer_types
    out = []
    for cp in _divisors(gpus):
        if mode == "eval":
            pieces = cp * (2 if cp > 1 and cp_layout == "zigzag" else 1)
            if seq_len % pieces or seq_len // pieces < max(1, cfg.linear_conv_kernel_dim - 1):
                continue
        elif seq_len % cp or seq_len // cp < cfg.kda_chunk_size:
            continue
        for ep in _divisors(gpus // cp):
            if (moe and cfg.n_routed_experts % ep) or (not moe and ep > 1):
                continue
            for dp_shard in _divisors(gpus // (cp * ep)):
                lay = Layout(dp_replicate=gpus // (cp * ep * dp_shard), ep=ep, dp_shard=dp_shard, cp=cp)
                if optimizer_offload and not lay.fsdp:
                    continue
                out.append(lay)
        if not moe:
            continue
        for dp_shard in _divisors(gpus // cp):  # folded: the EP group drawn from dp_shard x cp (always FSDP)
            for ep in _divisors(dp_shard * cp):
                if ep > 1 and cfg.n_routed_experts % ep == 0:
                    out.append(Layout(dp_replicate=gpus // (cp * dp_shard), ep=ep, dp_shard=dp_shard, cp=cp,
                                      ep_folded=True))  # fmt: skip
    return out


def search_layouts(cfg: ModelConfig, seq_len: int, gpus: int, gpu_memory_gib: float, *, mode: str = "train",
                   **kwargs) -> list[dict]:  # fmt: skip
    """``plan_memory`` (``mode="eval"``: ``plan_eval``) of every layout of ``valid_layouts``, best first.

    Order: layouts that fit first; then ascending ``total_gib`` (the most headroom first); ties by fewer CP ranks,
    then fewer EP ranks, then more data-parallel replicas (less communication for the same memory).

    Args:
        cfg, seq_len, gpu_memory_gib: as ``plan_memory``.
        gpus: ranks (the layouts' world size).
        mode: ``"train"`` (one training step) or ``"eval"`` (scoring one window).
        **kwargs: the other keyword arguments of ``plan_memory`` (of ``plan_eval`` in eval). In train mode
            ``seq_chunk_tokens`` applies to every layout (under CP, to each rank's piece); ``"auto"`` plans each of
            them by ``best_seq_chunk`` (one pass when it fits), so the list says whether chunking a whole window per
            rank beats spreading it over CP ranks, or both together.

    Returns:
        The plans (``plan_memory`` or ``plan_eval`` dicts); empty when no layout is valid.

    Raises:
        ValueError: as ``plan_memory`` (``plan_eval``) and ``valid_layouts``.
    """
    if mode == "eval":
        lays = valid_layouts(cfg, seq_len, gpus, mode="eval", cp_layout=kwargs.get("cp_layout", "contiguous"))
        plans = [plan_eval(cfg, seq_len, lay, gpu_memory_gib=gpu_memory_gib, **kwargs) for lay in lays]
    else:
        chunk = kwargs.pop("seq_chunk_tokens", None)
        lays = valid_layouts(cfg, seq_len, gpus, optimizer_offload=kwargs.get("optimizer_offload", False), mode=mode)
        plans = []
        for lay in lays:
            if chunk is None:
                plans.append(plan_memory(cfg, seq_len, lay, gpu_memory_gib=gpu_memory_gib, **kwargs))
            elif chunk == "auto":
                plans.append(best_seq_chunk(cfg, seq_len, lay, gpu_memory_gib=gpu_memory_gib, **kwargs))
            else:
                plans.append(plan_memory(cfg, seq_len, lay, gpu_memory_gib=gpu_memory_gib, seq_chunk_tokens=chunk,
                                         **kwargs))  # fmt: skip
    plans.sort(key=lambda p: (not p["fits"], p["total_gib"], p["layout"]["cp"], p["layout"]["ep"],
                              -p["layout"]["dp_replicate"]))  # fmt: skip
    return plans


SEQ_CHUNK_CANDIDATES = tuple(1 << k for k in range(12, 19))  # 4k .. 256k tokens


def best_seq_chunk(cfg: ModelConfig, seq_len: int, layout: Layout, **kwargs) -> dict:
    """``plan_memory`` of ``layout`` in one pass if it fits, else with the largest ``seq_chunk_tokens`` of
    ``SEQ_CHUNK_CANDIDATES`` (below the window's ``L / cp`` tokens per rank) that fits (fewest chunks: the least
    boundary state and overhead); when none fits, the candidate with the smallest total.
    ``kwargs``: ``plan_memory``'s."""
    whole = plan_memory(cfg, seq_len, layout, **kwargs)
    if whole["fits"]:
        return whole
    tried = [plan_memory(cfg, seq_len, layout, seq_chunk_tokens=c, **kwargs)
             for c in SEQ_CHUNK_CANDIDATES if c < seq_len // layout.cp]  # fmt: skip
    fitting = [p for p in tried if p["fits"]]
    if fitting:
        return max(fitting, key=lambda p: p["seq_chunk_tokens"])
    return min(tried + [whole], key=lambda p: p["total_gib"])


def seq_chunk_hint(cfg: ModelConfig, seq_len: int, gpus: int, gpu_memory_gib: float, *, layout: Layout | None = None,
                   **kwargs) -> dict | None:  # fmt: skip
    """What ``genoctx plan`` says when a training step does not fit: the ``train.seq_chunk_tokens`` that would.

    The planner's own choice (``--seq-chunk auto``): ``best_seq_chunk`` of ``layout`` when one is given, else the
    first plan that fits of ``search_layouts(..., seq_chunk_tokens="auto")`` (the search's order: the most headroom
    first), kept only when it trains in chunks.

    Args:
        cfg, seq_len, gpu_memory_gib: as ``plan_memory``.
        gpus: ranks searched when ``layout`` is None (the layouts' world size).
        layout: the one layout to chunk, or None to search every layout of ``gpus`` ranks.
        **kwargs: ``plan_memory``'s other keyword arguments (a ``seq_chunk_tokens`` among them is ignored).

    Returns:
        None when no chunked plan fits (or one pass does), else ``{"seq_chunk_tokens": N, "flag": "--seq-chunk 64k",
        "layout": the plan's layout dict, "total_gib": GiB per GPU, "peak_phase": str}``.

    Raises:
        ValueError: as ``plan_memory`` and ``valid_layouts``.
    """
    kwargs.pop("seq_chunk_tokens", None)
    if layout is not None:
        plans = [best_seq_chunk(cfg, seq_len, layout, gpu_memory_gib=gpu_memory_gib, **kwargs)]
    else:
        plans = search_layouts(cfg, seq_len, gpus, gpu_memory_gib, seq_chunk_tokens="auto", **kwargs)
    fit = next((p for p in plans if p["fits"]), None)
    if fit is None or not fit.get("seq_chunk_tokens"):
        return None
    n = fit["seq_chunk_tokens"]
    size = f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n >> 10}k" if n % 1024 == 0 else str(n)
    return {"seq_chunk_tokens": n, "flag": f"--seq-chunk {size}", "layout": fit["layout"],
            "total_gib": fit["total_gib"], "peak_phase": fit["peak_phase"]}  # fmt: skip


def _layout_dict(layout: Layout) -> dict:
    """A plan's ``"layout"``: the four sizes, ``ep_folded`` and ``world``."""
    return {**{d: getattr(layout, d) for d in DIMS}, "ep_folded": layout.ep_folded, "world": layout.world}


def all_to_all_bytes(cfg: ModelConfig, tokens: int, layout: Layout, a: int, passes: int) -> float:
    """Bytes one rank sends by expert-parallel all-to-all in a step over ``tokens`` tokens, with balanced routing:
    per MoE layer, ``tokens x k`` rows of which ``(ep - 1) / ep`` belong to another rank's experts, ``D`` values of
    ``a`` bytes each per exchange, ``passes`` exchanges (``genoctx.parallel.experts``: a forward dispatches the hidden
    states and combines the outputs, 2; its backward sends hidden states and output gradients and returns input
    gradients and outputs, 4; a forward recomputed under activation checkpointing, 2 more; balanced, a rank sends
    as many rows as it receives). 0 without EP. Forced-imbalanced routing moves up to ``ep`` times more through the
    busiest rank (in more rounds of the same bounded size)."""
    if layout.ep == 1:
        return 0.0
    moe = sum(1 for t in cfg.mlp_layer_types if t == "sparse")
    rows = tokens * cfg.num_experts_per_tok * (layout.ep - 1) / layout.ep
    return moe * rows * cfg.hidden_size * a * passes


def describe_layout(plan: dict) -> str:
    """``"dp_replicate=1 ep=8 dp_shard=2 cp=4"`` of a plan (``ep=32 (folded)`` when folded: ``Layout.describe``)."""
    return Layout(**{k: v for k, v in plan["layout"].items() if k != "world"}).describe()


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
    if plan.get("mode") == "eval":
        ac = ", or stream it in chunks (--chunk-tokens)" if not plan.get("chunk_tokens") else ""
    flag = " --eval" if plan.get("mode") == "eval" else ""
    raise GenoctxError(
        f"memory plan: {describe_layout(plan)} needs {plan['total_gib']:.1f} GiB per GPU, more than "
        f"{plan['gpu_memory_gib']:g} GiB (largest: {top}; at {plan['peak_phase']}); choose another layout "
        f"(genoctx plan{flag} --gpus N lists those that fit){ac}, or pass --force"
    )


def format_table(plans: list[dict], limit: int = 10) -> str:
    """A human-readable breakdown of ``plans`` (best first): one line per layout (at most ``limit``), then the
    components of the first (the best) plan. Zero components are left out; GiB, or MiB when the best plan needs
    less than 1 GiB."""
    if not plans:
        return "no valid layout"
    p0 = plans[0]
    unit, scale = ("GiB", 1) if p0["total_gib"] >= 1 else ("MiB", 1024)
    chunks = any(p.get("seq_chunk_tokens") for p in plans[:limit])
    if p0.get("mode") == "eval":
        how = f"mode eval, chunk {p0['chunk_tokens'] or 'whole'}"
        how += f", cp layout {p0['cp_layout']}" if p0.get("cp_layout", "contiguous") != "contiguous" else ""
    else:
        how = f"recompute {p0['recompute']}  offload {p0['optimizer_offload']}"
    lines = [
        f"seq_len {p0['seq_len']}  batch {p0['batch_size']}  dtype {p0['dtype']}  {how}  "
        f"device memory {p0['gpu_memory_gib']:g} GiB",
        "",
        f"{'#':>3}  {'dp_replicate':>12} {'ep':>4} {'dp_shard':>8} {'cp':>4}  {'tokens/rank':>11}  "
        + (f"{'chunk':>7}  " if chunks else "")
        + f"{'a2a GiB':>8}  {unit + '/GPU':>9}  fits  peak at",
    ]
    for j, p in enumerate(plans[:limit], 1):
        lay = p["layout"]
        ep = f"{lay['ep']}{'f' if lay.get('ep_folded') else ''}"
        chunk = f"{p.get('seq_chunk_tokens') or '-':>7}  " if chunks else ""
        lines.append(
            f"{j:>3}  {lay['dp_replicate']:>12} {ep:>4} {lay['dp_shard']:>8} {lay['cp']:>4}  "
            f"{p['tokens_per_rank']:>11}  {chunk}{p.get('all_to_all_gib', 0.0):>8.2f}  {p['total_gib'] * scale:>9.2f}  "
            f"{'yes' if p['fits'] else 'no ':<4}  {p['peak_phase']}"
        )
    if len(plans) > limit:
        lines.append(f"     ({len(plans) - limit} more; --format json lists them)")
    lines.append("     (ep 32f: folded, the EP group drawn from dp_shard x cp; a2a GiB: expert all-to-all each rank "
                 "sends per step, balanced routing)")
    if chunks:
        lines.append("     (chunk: train.seq_chunk_tokens, the window trained in chunks of this many tokens by the "
                     "exact chunked backward; tokens/rank: one chunk's)")
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
    "ALLOCATOR_SLACK", "COMPONENTS", "EVAL_COMPONENTS", "GIB", "SEQ_CHUNK_CANDIDATES", "best_seq_chunk", "check_fits",
    "describe_layout", "format_table", "seq_chunk_boundary_bytes",
    "param_counts", "plan_eval", "plan_memory", "search_layouts", "seq_chunk_hint", "valid_layouts",
]  # fmt: skip
