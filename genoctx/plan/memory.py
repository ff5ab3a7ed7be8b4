"""Memory planner: bytes per GPU, by component, of one training step of a config x sequence length x parallel
layout.

``plan_memory`` predicts the peak of one optimizer step (forward, backward, AdamW step) on the busiest rank. Its
neighbours in ``genoctx.plan``: ``eval_memory.plan_eval``, the peak of scoring one window in evaluation (forward
only, no gradients: its own phases and components, its module docstring); ``search.search_layouts`` plans every
layout of a number of GPUs and sorts them; ``report.check_fits`` turns a plan that does not fit into a one-line
``GenoctxError``. Units: bytes inside, GiB (2^30 bytes) in the returned dicts.

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

Components (bytes; ``P_d``, ``P_e`` dense and routed-expert parameters, ``s_d = layout.dense_shard``,
``s_e = layout.expert_shard``; local parameters ``P`` = ``shard_numel`` of every parameter, each dim 0 in
``ceil(rows / s)`` rows as FSDP2 allocates it, about ``P_d / s_d + P_e / (ep s_e)``):

- ``weights`` ``4 P`` (fp32 masters, sharded), ``gradients`` ``4 x`` the local parameters whose gradient
  exists in that phase (backward fills them layer by layer), ``optimizer_state`` ``8 P`` (AdamW ``exp_avg``,
  ``exp_avg_sq``); all three 0 with ``optimizer_offload`` (``_held``).
- ``unsharded_params``: FSDP's all-gathered blocks in ``a`` bytes (the fp32 islands in 4): the root (kept from
  forward to the end of backward, FSDP2's root default), the current and the prefetched decoder layer (a layer's
  routed experts: its ``E / ep`` local ones), and in backward the current layer's unsharded gradient; without FSDP
  and with bf16, a bf16 copy of the local parameters.
- ``activations_*``: what the layers alive in the phase keep for backward, by layer type (the per-token sizes
  of ``_kda``, ``_dsa``, ``_moe``, ``_mlp``, ``_hc`` (two per layer, plus the ``n D r`` residual streams each
  saves), ``activations_head`` the embedding's ids, final norm and loss). With ``recompute`` only the layer
  being recomputed counts, and ``layer_inputs`` holds the other layers' inputs (``n D r`` per token).
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
  chunk, forward or backward), ``stream_gradients`` (the residual streams' gradients, mHC and dense-MLP backward),
  ``logits_loss`` (an 8-token model: ``[N, 8]`` fp32 logits and log-softmax; a text head: one
  ``[chunk, rows]`` fp32 logits chunk and the fp32 ``[V, D]`` weight-gradient buffer), ``cp_gather`` (a DSA
  layer's all-gather output and its concatenation, ``2 L W a`` per window), ``fsdp_reduce_scatter`` (a
  layer's gradient in fp32 for the reduce-scatter; at the end of backward the root's; without FSDP the
  flat all-reduce buffer), ``optimizer_step`` (foreach AdamW's temporaries, ``4 P``, on CUDA; two of the
  largest parameter on CPU).
- ``allocator_slack``: ``allocator_slack x`` the sum of the others.

Per-token sizes (bytes per token of the rank's ``N = batch_size x seq_len / cp`` tokens) are counted from the
code, tensor by tensor: what autograd saves in ``genoctx.model`` with its recompute knobs as they are (KDA core,
MoE chunks always recomputed in backward; the Sinkhorn map saves its denominators). ``a``: activation element size (2
for bf16, 4 for fp32), ``f = 4`` (the fp32 islands: KDA core and gates, norms, mHC coefficients, DSA softmax
statistics, the loss), ``c = f`` when ``a != f`` else 0 (an fp32 copy of a low-precision tensor), ``c_a = a``
when ``a != f`` else 0 (a low-precision copy of an fp32 tensor), ``r = f`` (the mHC residual streams, fp32 in every
layout: ``sizes._Sizes.r``; with them the sub-layers' inputs and their norms, ``sizes._norm_in``). Model widths:
``D`` hidden, ``n`` mHC streams, ``H``/``K`` KDA heads/head dim (``HK = H K``), ``C`` ``kda_chunk_size``,
``Q``/``R`` q-/kv-LoRA ranks, ``Hm`` MLA heads with ``dq``/``dv`` head dims, ``HI``/``dI`` indexer heads/dim, ``kp``
``index_kpool``, ``E``/``k`` routed experts/top-k, ``I`` expert width, ``Is`` shared-expert width, ``Id`` dense-MLP
width, ``V`` vocabulary.

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

The code follows the step: ``_check_args``; ``_step`` (the rank's tokens); ``_held`` (parameter, gradient and
optimizer bytes); ``_layer`` (one decoder layer's kept activations, cache and working sets: ``_kda_mixer``,
``_dsa_mixer``, ``_feed_forward``) and ``_head``; the phases (``_forward_phases``, ``_backward_phases`` with
``_layer_backward``, ``_step_end_phases``); ``_summary`` (the peak, shared with ``plan_eval``).
"""

from __future__ import annotations

import dataclasses
import math

from ..model.config import DSA, KDA, ModelConfig
from ..parallel.layout import Layout
from .comms import all_to_all_bytes
from .sizes import (
    ALLOCATOR_SLACK,
    COMPONENTS,
    DEVICES,
    DTYPE_BYTES,
    GIB,
    INPUT_CASTS,
    NUCLEOTIDE_VOCAB,
    WORKING_SETS,
    _add,
    _dsa,
    _dsa_cp_saved,
    _dsa_gather_width,
    _dsa_out_part,
    _dsa_tiles_bwd,
    _dsa_tiles_fwd,
    _fla_backward,
    _fla_forward,
    _fla_saved,
    _hc,
    _hc_bwd,
    _indexer_tiles,
    _is_island,
    _kda,
    _kda_core_fwd,
    _kda_core_recompute,
    _kda_out_part,
    _kda_project,
    _layout_dict,
    _mlp,
    _moe,
    _moe_bwd,
    _moe_fwd,
    _norm_in,
    _Sizes,
    param_counts,
    seq_chunk_boundary_bytes,
    shard_numel,
)  # fmt: skip
from .trainable import Trainable, check_trainable, counts, param_entries

MOMENT_BYTES = {"fp32": 4, "bf16": 2}  # train.optimizer_state_dtype -> bytes per AdamW moment element
MOMENT_DTYPE = {v: k for k, v in MOMENT_BYTES.items()}

# ---------------------------------------------------------------- argument checks


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
                allocator_slack, optimizer_offload, seq_chunk_tokens):  # fmt: skip
    """``plan_memory``'s checks: ``_check_model_layout``'s, then the lengths, CP pieces, offload, DSA mode and the
    sequence chunk (``ValueError``, one line naming the argument)."""
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
        raise ValueError("optimizer_offload needs FSDP (dp_shard > 1, cp > 1, or fsdp_one on one rank): it is FSDP2's "
                         "CPUOffloadPolicy")  # fmt: skip
    if cfg.dsa_mode != "sparse" or cfg.indexer_stage == "warmup":
        raise ValueError("plan_memory models sparse DSA (dsa_mode='sparse', indexer_stage 'sparse' or 'off'), not the "
                         "dense indexer warm-up")  # fmt: skip
    if seq_chunk_tokens is not None and seq_chunk_tokens < 1:
        raise ValueError(f"seq_chunk_tokens must be >= 1, got {seq_chunk_tokens}")


# ---------------------------------------------------------------- the step: tokens and parameters


@dataclasses.dataclass(frozen=True)
class _Step:
    """One ``plan_memory`` call: the model, layout, knobs and the token counts its phases read.

    ``T``: tokens of a window on this rank in one pass (``L / cp``; chunked, one chunk's, under CP this rank's part
    of a round of ``cp x T`` tokens); ``N = windows x T``; ``ctx``: the keys a DSA query may see on the busiest rank
    (the window's last piece under CP or its last chunk: ``L``; else ``T``); ``gather_len``: the tokens whose DSA
    latents/keys a CP layer gathers at once (the window, or chunked one round); ``boundary``: bytes of the state
    crossing chunk boundaries (``seq_chunk_boundary``, 0 in one pass); ``pc``: ``param_counts(cfg)``."""

    cfg: ModelConfig
    layout: Layout
    s: _Sizes
    dtype: str
    device: str
    recompute: bool
    offload: bool
    seq_len: int
    windows: int
    T: int
    N: int
    chunked: bool
    ctx: int
    gather_len: int
    boundary: float
    pc: dict
    moment_bytes: int = 4  # bytes of each AdamW moment element (train.optimizer_state_dtype)
    offload_act: bool = False  # train.offload_activations
    tr: Trainable | None = None  # what trains (None: every parameter, no adapters: full training)
    entries: tuple = ()  # trainable.param_entries when ``tr`` is set


def _step(cfg, seq_len, layout, recompute, optimizer_offload, batch_size, dtype, device, seq_chunk_tokens) -> _Step:
    """The ``_Step`` of checked arguments: one pass over ``L / cp`` tokens, or chunks of ``seq_chunk_tokens`` when
    it is below that."""
    s = _Sizes(a=DTYPE_BYTES[dtype])
    cp = layout.cp
    T = seq_len // cp
    chunked = seq_chunk_tokens is not None and seq_chunk_tokens < T
    if chunked:
        T = seq_chunk_tokens  # under CP: this rank's part of a round of cp x T tokens
    boundary = seq_len * seq_chunk_boundary_bytes(cfg, T * cp, batch_size, s.a) if chunked else 0.0
    return _Step(
        cfg=cfg, layout=layout, s=s, dtype=dtype, device=device, recompute=recompute, offload=optimizer_offload,
        seq_len=seq_len, windows=batch_size, T=T, N=batch_size * T, chunked=chunked,
        ctx=seq_len if (cp > 1 or chunked) else T, gather_len=cp * T if chunked else seq_len, boundary=boundary,
        pc=param_counts(cfg),
    )  # fmt: skip


def _local(block: dict, layout: Layout) -> float:
    """Parameters of a block held on this rank: its shapes sharded and padded as FSDP2 allocates them
    (``shard_numel``), or, for a block given by counts only, ``dense / s_d + expert / (ep s_e)``."""
    if "shapes" in block:
        return sum(shard_numel(block["shapes"], layout).values())
    return block["dense"] / layout.dense_shard + block["expert"] / (layout.ep * layout.expert_shard)


def _gathered(block: dict, layout: Layout) -> float:
    """Parameters of a block once all-gathered on this rank: its dense ones and its ``E / ep`` routed experts'."""
    return block["dense"] + block["expert"] / layout.ep


@dataclasses.dataclass(frozen=True)
class _Held:
    """Parameter bytes the phases hold besides the layers' blocks (module docstring: ``weights`` to
    ``unsharded_params``). ``P_local``: local parameters (``shard_numel``); ``weights`` ``f P`` and
    ``optimizer_state`` ``2 f P`` (0 with offload); ``grad_bytes``: bytes per local parameter's gradient (``f``, 0
    with offload); ``head_local``: local parameters of the final norm and ``lm_head`` (the embedding too when tied);
    under FSDP ``root_unsharded`` (the all-gathered root in ``a``), ``root_grad`` (its head's unsharded gradient,
    ``a``) and ``rs_root`` (the root's fp32 gradient for the reduce-scatter); without FSDP and with bf16
    ``compute_copy`` (``a P``)."""

    P_local: float
    weights: float
    optimizer_state: float
    grad_bytes: float
    head_local: float
    root_unsharded: float
    root_grad: float
    rs_root: float
    compute_copy: float
    frozen: float = 0.0  # bytes of the frozen weights (and fp8 scales) on this rank (``trainable``)
    fp8_held: float = 0.0  # of ``frozen``: the fp8 holders' bytes and scales (whole / EP slice, never sharded)


def _numel(sh: tuple, lay: Layout, gathered: bool) -> float:
    """Elements of one tensor (``shard_numel``'s tuple) on this rank: its padded shard, or all-gathered (a routed
    expert's ``E / ep`` block)."""
    if gathered:
        return sh[1] * sh[2] / (lay.ep if sh[0] == "expert" else 1)
    return sum(shard_numel([sh], lay).values())


def _split(st: _Step, entries) -> dict:
    """What tensors ``entries`` (``trainable.param_entries``) hold on this rank: ``local`` (trainable parameters,
    sharded), ``frozen`` (frozen bytes: bf16 sharded, fp8 held), ``gathered`` (trainable parameters all-gathered),
    ``gathered_frozen`` (frozen bf16 bytes all-gathered), ``island`` (trainable fp32-island parameters all-gathered),
    ``fp8_held`` (frozen fp8 bytes and scales: ``genoctx.model.fp8.FP8Weight`` buffers, never FSDP-sharded nor
    all-gathered: a dense matrix whole, the routed experts their ``E / ep`` EP slice), ``fp8_use`` and
    ``fp8_use_bytes`` (elements, and fp8 bytes with scales, of the largest matrix one use dequantizes: a dense
    linear's weight or one expert's ``[out, in]``)."""
    lay, cfg = st.layout, st.cfg
    keys = ("local", "frozen", "gathered", "gathered_frozen", "island", "fp8_held", "fp8_use", "fp8_use_bytes")
    out = dict.fromkeys(keys, 0.0)
    for e in entries:
        if e["train"]:
            out["local"] += _numel(e["shape"], lay, False)
            g = _numel(e["shape"], lay, True)
            out["gathered"] += g
            if e["layer"] is not None and _is_island(cfg, e["layer"], e["name"]):  # adapters of a KDA mixer too
                out["island"] += g
        elif e["fp8"]:  # a buffer: whole (dense) or its E / ep experts (EP slices dim 0), on every rank
            held = sum(_numel(sh, lay, True) * b for sh, b in e["store"])
            out["fp8_held"] += held
            out["frozen"] += held
            one = [sh[2] if sh[0] == "expert" else sh[1] * sh[2] for sh, _ in e["store"]]  # one use's elements
            if one[0] > out["fp8_use"]:
                out["fp8_use"] = one[0]
                out["fp8_use_bytes"] = sum(n * b for n, (_, b) in zip(one, e["store"], strict=True))
        else:
            out["frozen"] += sum(_numel(sh, lay, False) * b for sh, b in e["store"])
            out["gathered_frozen"] += sum(_numel(sh, lay, True) * b for sh, b in e["store"])
    return out


def _held_split(st: _Step) -> _Held:
    """``_held`` when not every parameter trains (``trainable``): masters, gradients and AdamW state of the trainable
    tensors only; the frozen ones as their weights in the frozen dtype (``frozen``, held all through; on the host
    with ``optimizer_offload``, as FSDP2 offloads every parameter of a group); the root all-gathered at each
    tensor's dtype, its gradients and reduce-scatter the trainable ones'."""
    a, f, fsdp = st.s.a, st.s.f, st.layout.fsdp
    whole = _split(st, st.entries)
    root = _split(st, [e for e in st.entries if e["layer"] is None])
    head_names = ("embed_tokens.",) if st.cfg.tie_word_embeddings else ()
    head = _split(st, [e for e in st.entries if e["layer"] is None
                       and (not e["name"].startswith("embed_tokens.") or head_names)])  # fmt: skip
    P = whole["local"]
    return _Held(
        P_local=P,
        weights=0.0 if st.offload else f * P + whole["frozen"],
        optimizer_state=0.0 if st.offload else 2 * st.moment_bytes * P,
        grad_bytes=0.0 if st.offload else f,
        head_local=head["local"],
        root_unsharded=a * root["gathered"] + root["gathered_frozen"] if fsdp else 0.0,
        root_grad=a * head["gathered"] if fsdp else 0.0,
        rs_root=f * root["gathered"] if fsdp else 0.0,
        compute_copy=a * P if (not fsdp and a != f) else 0.0,
        frozen=whole["frozen"],
        fp8_held=whole["fp8_held"],
    )


def _held(st: _Step) -> _Held:
    """The ``_Held`` bytes of the step's layout."""
    if st.tr is not None:
        return _held_split(st)
    a, f, fsdp, pc, lay = st.s.a, st.s.f, st.layout.fsdp, st.pc, st.layout
    P_local = _local(pc, lay)
    root = pc["root"]
    head = {"dense": root["dense"] - pc["embed"], "expert": 0}  # final norm, lm_head (untied)
    if st.cfg.tie_word_embeddings:
        head["dense"] += pc["embed"]
    return _Held(
        P_local=P_local,
        weights=0.0 if st.offload else f * P_local,
        optimizer_state=0.0 if st.offload else 2 * st.moment_bytes * P_local,
        grad_bytes=0.0 if st.offload else f,  # per local parameter
        head_local=_local(head, lay),
        root_unsharded=a * _gathered(root, lay) if fsdp else 0.0,
        root_grad=a * _gathered(head, lay) if fsdp else 0.0,  # the root's unsharded gradient, lm_head's first
        rs_root=f * _gathered(root, lay) if fsdp else 0.0,
        compute_copy=a * P_local if (not fsdp and a != f) else 0.0,  # replicated bf16 compute copy
    )


# ---------------------------------------------------------------- one decoder layer, the head


def _kda_mixer(st: _Step) -> tuple:
    """A KDA mixer: ``(saved, w_fwd, w_bwd_mix, cache)``, bytes on this rank. ``saved``: ``_kda`` per token (fla's
    core: plus ``_fla_saved``; under CP plus the ``[L | M]`` pass's state, ``f H K 2K`` per window); ``w_fwd``:
    ``kda_core_recompute`` (one block of the core forward); ``w_bwd_mix``: the core recomputed in backward minus the
    output path (under CP: or the recomputed ``[L | M]`` pass, whichever is larger); ``cache``: the conv state, a view
    of the pre-convolution input ``3 HK a`` per token (saved anyway in fp32 without recomputation)."""
    cfg, s, N, windows, T = st.cfg, st.s, st.N, st.windows, st.T
    a, f = s.a, s.f
    H, K = cfg.linear_num_heads, cfg.linear_head_dim
    saved = N * _kda(cfg, s)
    core = _kda_core_recompute(cfg, windows, T, K)
    w_core = _kda_core_fwd(cfg, s, windows, T, K)
    if cfg.kda_kernel == "fla" and st.device == "cuda":  # fla's Triton core: its own terms (counted, unmeasured)
        saved += N * _fla_saved(cfg)
        core = N * _fla_backward(cfg, s)
        w_core = N * _fla_forward(cfg, s)
    core -= N * _kda_out_part(cfg, s)
    if st.layout.cp > 1:  # kda_cp_cache's [L | M] pass, checkpointed: it keeps its state, and is recomputed (the
        # projections again, [v | 0], the core block by block) after the layer's own graph is freed
        saved += windows * f * H * K * 2 * K
        # ... and its projections' bf16 copies of the fp32 layer input (INPUT_CASTS: all but g_a, which is not run)
        state_pass = N * (_kda_project(cfg, s) + 2 * H * K * s.a + (INPUT_CASTS["kda"] - 1) * s.ca * cfg.hidden_size)
        core = max(core, state_pass + _kda_core_recompute(cfg, windows, T, 2 * K) - N * _kda(cfg, s))
        w_core = max(w_core, state_pass + _kda_core_fwd(cfg, s, windows, T, 2 * K))
    # KDACache.conv_state is a view of the pre-convolution input (3 HK a), saved only in fp32 without AC
    cache = N * 3 * H * K * a if (st.recompute or a != f) else 0.0
    return saved, {"kda_core_recompute": w_core}, {"kda_core_recompute": max(0.0, core)}, cache


def _dsa_mixer(st: _Step, full: bool) -> tuple:
    """A DSA mixer (``full``: with its own indexer): ``(saved, w_fwd, w_bwd_mix, cache)``, bytes on this rank.
    ``saved``: ``_dsa`` per token (under CP plus ``_dsa_cp_saved`` over the gathered tokens); ``w_fwd``:
    ``dsa_attention`` (tiles and output latents), ``dsa_indexer_tiles`` (full), ``cp_gather`` (CP: the all-gather's
    output and its concatenation, ``2 W a`` per gathered token); ``w_bwd_mix``: ``dsa_attention`` (tiles and the
    latents' and queries' gradient ``a Hm R + f R ctx / N``; under CP, once the tiles are freed, the gathered
    window's gradient if larger); ``cache``: the latents, the incomplete pool's keys and gates, the pooled keys."""
    cfg, s, N, windows, T = st.cfg, st.s, st.N, st.windows, st.T
    a, f, cp = s.a, s.f, st.layout.cp
    Hm, R = cfg.num_attention_heads, cfg.kv_lora_rank
    saved = N * _dsa(cfg, s, full)
    if cp > 1:
        saved += windows * st.gather_len * _dsa_cp_saved(cfg, s, full)
    S = max(0, st.ctx - T)  # the last chunk's (rank's) cache: the fewest dense rows, the largest gathering tiles
    tile_b = _dsa_tiles_bwd(cfg, T, S)
    grads = N * (a * Hm * R - _dsa_out_part(cfg, s))
    grads += windows * st.ctx * f * R if (cp > 1 or st.chunked) else N * f * R
    w_bwd = {"dsa_attention": tile_b + grads}
    if cp > 1:  # after the attention's backward (its tiles freed): the gathered window's gradient
        W = _dsa_gather_width(cfg, full)
        window_grads = windows * st.gather_len * (2 * R * a + 2 * W * a)
        w_bwd["dsa_attention"] = max(tile_b, window_grads) + grads
    w_fwd = {"dsa_attention": _dsa_tiles_fwd(cfg, s, T, S) + N * a * Hm * R}
    if full:
        w_fwd["dsa_indexer_tiles"] = _indexer_tiles(cfg, T, st.ctx)
    if cp > 1:
        w_fwd["cp_gather"] = windows * st.gather_len * 2 * _dsa_gather_width(cfg, full) * a
    # DSACache: the latents (saved anyway without AC; under CP the concatenation with the earlier ones), the
    # incomplete pool's keys and gates (views of the whole chunk's) and the pooled keys (fp32)
    dI, rc = cfg.index_head_dim, st.recompute
    cache = N * (a * (R * rc + full * dI * (1 + rc)) + full * f * dI / cfg.index_kpool)
    return saved, w_fwd, w_bwd, cache


def _feed_forward(st: _Step, moe: bool) -> tuple:
    """The feed-forward half (MoE or dense MLP): ``(saved, w_fwd, w_bwd_ffn)``. ``saved``: ``_moe`` or ``_mlp`` per
    token; ``w_fwd``: one MoE dispatch chunk (``_moe_fwd``); ``w_bwd_ffn``: one chunk's backward (``_moe_bwd``) or the
    dense MLP's ``(2 Id + D) a``, and ``stream_gradients``: the streams' gradients (two of ``n D r``) and the layer
    output's gradient (``D a``), on top of the sub-layer's working set."""
    cfg, s, N, ep = st.cfg, st.s, st.N, st.layout.ep
    D, a = cfg.hidden_size, s.a
    if moe:
        saved = N * _moe(cfg, s)
        w_fwd = {"moe_dispatch": _moe_fwd(cfg, s, N, ep)}
        w_bwd = {"moe_dispatch": _moe_bwd(cfg, s, N, ep)}
    else:
        saved = N * _mlp(cfg, s)
        w_fwd = {}
        w_bwd = {"stream_gradients": N * (2 * cfg.intermediate_size + D) * a}
    stream = cfg.hc_mult * D * s.r
    w_bwd["stream_gradients"] = w_bwd.get("stream_gradients", 0.0) + N * (2 * stream + D * a)
    return saved, w_fwd, w_bwd


def _layer(st: _Step, i: int, mixer: str, ffn: str, indexer: str) -> dict:
    """Decoder layer ``i``, bytes on this rank: ``saved`` (what it keeps for backward, by layer type: ``kda``,
    ``dsa``, ``moe``, ``dense_mlp``, ``mhc``, two mHC maps ``_hc`` and their ``n D r`` streams), ``ffn_part`` (what
    the mixer's backward no longer holds: the feed-forward half's mHC, streams, norm, MLP/MoE), ``input`` (``n D r``
    per token: all it keeps under recomputation), ``cache`` (what it returns; none under CP), the working sets of its
    forward (``w_fwd``) and of the backward of its feed-forward (``w_bwd_ffn``), mHC (``w_bwd_hc``, ``_hc_bwd``) and
    mixer (``w_bwd_mix``, plus the streams' gradient ``n D r`` and the mixer output's ``D a``), and its parameters:
    ``block`` all-gathered, ``local``, ``block_bytes`` (all-gathered bytes, the fp32 islands in ``f``)."""
    cfg, s, N, lay = st.cfg, st.s, st.N, st.layout
    stream, hc = cfg.hc_mult * cfg.hidden_size * s.r, _hc(cfg, s)  # the streams are fp32 (``_Sizes.r``)
    saved = dict.fromkeys(("kda", "dsa", "moe", "dense_mlp", "mhc"), 0.0)
    saved["mhc"] = N * 2 * (stream + hc)
    if mixer == KDA:
        saved["kda"], w_fwd, w_bwd_mix, cache = _kda_mixer(st)
    else:
        saved["dsa"], w_fwd, w_bwd_mix, cache = _dsa_mixer(st, mixer == DSA and indexer == "full")
    if lay.cp > 1:  # under CP the mixers return no cache (genoctx.parallel.context); chunked, the round's cache,
        # views of the kept boundary state (DSA latents: join_latents) and small copies (KDA state and tail)
        cache = 0.0
    ffn_saved, ffn_fwd, w_bwd_ffn = _feed_forward(st, ffn == "sparse")
    saved["moe" if ffn == "sparse" else "dense_mlp"] = ffn_saved
    w_fwd.update(ffn_fwd)
    w_bwd_mix["stream_gradients"] = N * (stream + cfg.hidden_size * s.a)
    params = st.pc["layers"][i]
    if st.tr is not None:  # what trains (trainable): the layer's trainable tensors, frozen ones at their dtype
        own = [e for e in st.entries if e["layer"] == i]
        sp = _split(st, own)
        r = st.tr.lora_rank  # LoRA's x A^T: r values per token per target (per routed row for experts)
        n_t = {k: sum(1 for e in own if e["lora"] == k and e["name"].endswith("lora_A"))
               for k in ("mixer", "mlp", "experts")}  # fmt: skip
        saved["kda" if mixer == KDA else "dsa"] += N * s.a * r * n_t["mixer"]
        lora_ffn = N * s.a * r * (n_t["mlp"] + cfg.num_experts_per_tok * n_t["experts"])
        saved["moe" if ffn == "sparse" else "dense_mlp"] += lora_ffn
        ffn_saved += lora_ffn
        return {
            "index": i, "kind": ("kda" if mixer == KDA else "dsa") + "+" + ("moe" if ffn == "sparse" else "mlp"),
            "saved": saved, "ffn_part": ffn_saved + N * (stream + hc), "input": N * stream, "cache": cache,
            "w_fwd": w_fwd, "w_bwd_ffn": w_bwd_ffn, "w_bwd_mix": w_bwd_mix, "w_bwd_hc": N * _hc_bwd(cfg, s),
            "block": sp["gathered"], "local": sp["local"],
            "block_bytes": s.a * sp["gathered"] + (s.f - s.a) * sp["island"] + sp["gathered_frozen"],
            "dequant": s.a * sp["fp8_use"] + (sp["fp8_use_bytes"] if st.offload else 0.0),
        }  # fmt: skip
    return {
        "index": i, "kind": ("kda" if mixer == KDA else "dsa") + "+" + ("moe" if ffn == "sparse" else "mlp"),
        "saved": saved, "ffn_part": ffn_saved + N * (stream + hc), "input": N * stream, "cache": cache,
        "w_fwd": w_fwd, "w_bwd_ffn": w_bwd_ffn, "w_bwd_mix": w_bwd_mix, "w_bwd_hc": N * _hc_bwd(cfg, s),
        "block": _gathered(params, lay), "local": _local(params, lay),
        "block_bytes": s.a * _gathered(params, lay) + (s.f - s.a) * params["island"], "dequant": 0.0,
    }  # fmt: skip


def _layers(st: _Step) -> list[dict]:
    """Every decoder layer's ``_layer``."""
    cfg = st.cfg
    kinds = zip(cfg.layer_types, cfg.mlp_layer_types, cfg.indexer_types, strict=True)
    return [_layer(st, i, mixer, ffn, ind) for i, (mixer, ffn, ind) in enumerate(kinds)]


def _head(st: _Step, loss_vocab_rows: int | None, loss_chunk_tokens: int) -> dict:
    """The head (embedding ids, final norm, loss): ``saved`` (kept until its backward), ``fwd`` and ``bwd`` (its
    ``logits_loss`` working set in forward and backward). An 8-token model: its own ``[N, V]`` logits; a text
    vocabulary: ``genoctx.model.head``'s chunks of ``loss_chunk_tokens`` over ``loss_vocab_rows`` rows, the fp32
    weight-gradient buffer ``rows D f`` and (bf16 or nucleotide rows) a ``[V, D]`` gradient in ``a``."""
    cfg, s, N = st.cfg, st.s, st.N
    a, f, V, D = s.a, s.f, cfg.vocab_size, cfg.hidden_size
    # embedding indices; the final RMSNorm of the streams' mean (fp32, ``_norm_in``): its output feeds lm_head (one
    # autocast copy) or the chunked head, which keeps it as it is
    saved = N * (8 + _norm_in(s, D, 1 if V <= NUCLEOTIDE_VOCAB else 0))
    if V <= NUCLEOTIDE_VOCAB:  # the model's own logits
        saved += N * (f * (V + 2) + 8)  # log-softmax, targets, masked losses
        fwd = N * V * (a + s.c)  # logits and their fp32 copy (the log-softmax is saved)
        bwd = N * (2 * V * f + D * a + D * f)  # logits and log-softmax gradients, the hidden state's
    else:  # genoctx.model.head: chunked logits, fp32 weight-gradient buffer
        rows = loss_vocab_rows or V
        C_head = min(loss_chunk_tokens, N)
        saved += N * (8 + 1 + 2 * f)  # targets, mask, log-sum-exp, losses
        fwd = C_head * rows * (f + s.ca)
        bwd = C_head * rows * (f + s.ca) + rows * D * f + (V * D * a if (a != f or rows != V) else 0) + N * D * a
    return {"saved": saved, "fwd": fwd, "bwd": bwd}


# ---------------------------------------------------------------- the phases of the step


def _phase(st: _Step, p: _Held, name: str, comps: dict, carried: bool = True) -> tuple[str, dict]:
    """A phase ``(name, components)``: the sharded ``weights`` and ``optimizer_state`` held all through, the state
    crossing chunk boundaries (``seq_chunk_boundary``, kept until the last chunk's backward) when ``carried``, then
    the phase's own non-zero components."""
    base = {"weights": p.weights, "optimizer_state": p.optimizer_state}
    if carried:
        base["seq_chunk_boundary"] = st.boundary
    return name, {**base, **{k: v for k, v in comps.items() if v}}


def _kept(st: _Step, layers: list, upto: int) -> dict:
    """Activations layers ``0..upto-1`` keep until their backward: by type, or under recomputation their inputs (with
    ``offload_activations`` only layer ``upto - 1``'s: its copy to host, or from host for the next recompute, in
    flight)."""
    out = dict.fromkeys(("activations_kda", "activations_dsa", "activations_moe", "activations_dense_mlp",
                         "activations_mhc", "layer_inputs"), 0.0)  # fmt: skip
    for j, x in enumerate(layers[:upto]):
        if st.recompute:  # offloaded: on the device only the copy in flight, the last layer's before the phase
            out["layer_inputs"] += x["input"] if (not st.offload_act or j == upto - 1) else 0.0
        else:
            for k, v in x["saved"].items():
                out[f"activations_{k}"] += v
    return out


def _own(x: dict, minus: float = 0.0) -> dict:
    """Layer ``x``'s own activations (all of them; under recomputation rebuilt), less ``minus`` bytes of its consumed
    feed-forward half (taken from its MoE/MLP, the rest from its mHC)."""
    out = {f"activations_{k}": v for k, v in x["saved"].items()}
    if minus:
        ffn_key = "activations_moe" if x["kind"].endswith("moe") else "activations_dense_mlp"
        ffn_amt = x["saved"]["moe" if x["kind"].endswith("moe") else "dense_mlp"]
        out[ffn_key] -= ffn_amt
        out["activations_mhc"] -= minus - ffn_amt
    return out


def _largest(w: dict) -> dict:
    """The largest of a forward's working sets (a forward phase counts only that one), as a one-entry dict."""
    return dict([max(w.items(), key=lambda kv: kv[1])]) if w else {}


def _blocks(st: _Step, layers: list, i: int, j: int | None) -> float:
    """Under FSDP, layer ``i``'s all-gathered block and the prefetched layer ``j``'s (if any); else 0. Plus layer
    ``i``'s frozen fp8 weights dequantized to bf16 (``dequant``, 0 unless ``frozen_dtype="fp8"``)."""
    if not st.layout.fsdp:
        return layers[i]["dequant"]
    L = len(layers)
    return layers[i]["block_bytes"] + layers[i]["dequant"] + (layers[j]["block_bytes"] if j is not None and 0 <= j < L
                                                              else 0.0)


def _grads_after(st: _Step, p: _Held, layers: list, i: int) -> float:
    """Gradients of layers i+1.. (sharded ones under FSDP) and of the head (without FSDP: lm_head and the final
    norm get theirs first; under FSDP the root's stays unsharded until the end of backward)."""
    done = sum(x["local"] for x in layers[i + 1 :])
    return p.grad_bytes * (done + (0.0 if st.layout.fsdp else p.head_local))


def _forward_phases(st: _Step, p: _Held, layers: list, head: dict) -> list:
    """Forward of each layer ``i`` (the activations of layers ``0..i-1`` and the caches they returned, layer ``i``'s
    activations, or under recomputation its input and the streams alive, its largest working set, the root and the
    current and prefetched block), then the end of forward (every layer's, the head's logits and loss)."""
    a, D = st.s.a, st.cfg.hidden_size
    stream = st.cfg.hc_mult * D * st.s.r
    out, caches = [], 0.0
    for i, x in enumerate(layers):
        # under AC only the input stays, plus the streams alive while the layer runs (the mid stream, a sub-layer's
        # output)
        this = {"layer_inputs": x["input"], "activations_mhc": st.N * (stream + D * a)} if st.recompute else _own(x)
        params = p.root_unsharded + p.compute_copy + _blocks(st, layers, i, i + 1)
        comps = _add(_kept(st, layers, i), this, {"returned_caches": caches, "unsharded_params": params},
                     _largest(x["w_fwd"]))  # fmt: skip
        out.append(_phase(st, p, f"forward layer {i} ({x['kind']})", comps))
        caches += x["cache"]
    out.append(_phase(st, p, "end of forward (logits, loss)", _add(_kept(st, layers, len(layers)), {
        "returned_caches": caches, "activations_head": head["saved"], "logits_loss": head["fwd"],
        "unsharded_params": p.root_unsharded + p.compute_copy})))  # fmt: skip
    return out


def _layer_backward(st: _Step, p: _Held, layers: list, i: int) -> list:
    """Backward of layer ``i``: (under recomputation its forward again, activations kept), its feed-forward, its mHC
    and its mixer, each over the activations of layers ``0..i-1``, the gradients of the layers done, the root, the
    current and prefetched (``i - 1``) block and the current one's unsharded gradient, the fp32 gradient of layer
    ``i + 1`` in its reduce-scatter."""
    x, fsdp = layers[i], st.layout.fsdp
    common = {
        "gradients": _grads_after(st, p, layers, i),
        "unsharded_params": p.root_unsharded + p.compute_copy + _blocks(st, layers, i, i - 1)
        + (x["block_bytes"] if fsdp else 0),
        "fsdp_reduce_scatter": st.s.f * layers[i + 1]["block"] if (fsdp and i + 1 < len(layers)) else 0.0,
    }
    common["unsharded_params"] += p.root_grad  # waits for the end of backward
    base = _add(_kept(st, layers, i), common)
    name = f"backward layer {i} ({x['kind']})"
    out = []
    if st.recompute:  # the layer's forward again, its activations kept this time
        out.append(_phase(st, p, f"{name}: recompute", _add(base, _own(x), _largest(x["w_fwd"]))))
    out.append(_phase(st, p, f"{name}: feed-forward", _add(base, _own(x), x["w_bwd_ffn"])))
    out.append(_phase(st, p, f"{name}: mHC", _add(base, _own(x), {"stream_gradients": x["w_bwd_hc"]})))
    out.append(_phase(st, p, f"{name}: mixer", _add(base, _own(x, x["ffn_part"]), x["w_bwd_mix"])))
    return out


def _backward_phases(st: _Step, p: _Held, layers: list, head: dict) -> list:
    """The head's backward (every layer's activations, the head's, its logits' gradients), then each layer's
    (``_layer_backward``), last to first."""
    out = [_phase(st, p, "head backward", _add(_kept(st, layers, len(layers)), {
        "activations_head": head["saved"], "logits_loss": head["bwd"], "gradients": _grads_after(st, p, layers,
        len(layers) - 1), "unsharded_params": p.root_unsharded + p.compute_copy + p.root_grad}))]  # fmt: skip
    for i in reversed(range(len(layers))):
        out += _layer_backward(st, p, layers, i)
    return out


def _step_end_phases(st: _Step, p: _Held, layers: list) -> list:
    """The end of backward (every gradient; under FSDP the root's all-gathered parameters and unsharded gradient and
    its fp32 reduce-scatter; without FSDP on several ranks the flat all-reduce buffer ``f P``) and the optimizer step
    (foreach AdamW's temporaries ``f P`` on CUDA, two of the largest parameter on CPU; none with offload)."""
    fsdp, f, P_local = st.layout.fsdp, st.s.f, p.P_local
    end = {"gradients": p.grad_bytes * P_local if not fsdp else _grads_after(st, p, layers, -1)}
    if fsdp:
        end.update(unsharded_params=2 * p.root_unsharded, fsdp_reduce_scatter=p.rs_root)
    else:
        end["unsharded_params"] = p.compute_copy
        if st.layout.world > 1:
            end["fsdp_reduce_scatter"] = f * P_local  # reduce_gradients' flat all-reduce buffer
    per_tensor = 2 * f * st.pc["largest"] / (st.layout.dense_shard if fsdp else 1)  # CPU: two of the largest
    step_tmp = 0.0 if st.offload else (f * P_local if st.device == "cuda" else per_tensor)
    if st.moment_bytes != f and not st.offload:  # low-precision moments: one parameter's upcast at a time
        step_tmp = 3 * f * st.pc["largest"] / (st.layout.dense_shard if fsdp else 1)
    return [_phase(st, p, "end of backward (gradient reduction)", end, carried=False),
            _phase(st, p, "optimizer step", {"gradients": p.grad_bytes * P_local, "optimizer_step": step_tmp},
                   carried=False)]  # fmt: skip


# ---------------------------------------------------------------- the peak


def _gib(x: float) -> float:
    """Bytes in GiB, rounded to 6 decimals (1 KiB)."""
    return round(x / GIB, 6)


def _slack(allocator_slack: float | None, device: str) -> float:
    """The allocator slack fraction: as given, or ``ALLOCATOR_SLACK`` on CUDA and 0 on CPU when None."""
    return ALLOCATOR_SLACK if (allocator_slack is None and device == "cuda") else (allocator_slack or 0.0)


def _summary(phases: list, slack: float, components: tuple, working: dict) -> dict:
    """``total_gib``, ``components_gib`` (of the largest phase, over ``components``, plus slack), ``peak_phase``,
    ``next_phases_gib`` (the three next largest, slack included) and ``working_sets_gib`` (``working``: bytes by
    name) of a plan's phases; the rounded components add up to the total. ``plan_memory`` and ``plan_eval`` share
    it."""
    totals = [sum(c.values()) for _, c in phases]
    order = sorted(range(len(phases)), key=lambda j: -totals[j])
    name, peak = phases[order[0]]
    comps = {k: peak.get(k, 0.0) for k in components}
    comps["allocator_slack"] = slack * sum(comps.values())
    comps_gib = {k: _gib(v) for k, v in comps.items()}
    return {
        "total_gib": round(sum(comps_gib.values()), 6),
        "components_gib": comps_gib,
        "peak_phase": name,
        "next_phases_gib": [[phases[j][0], _gib(totals[j] * (1 + slack))] for j in order[1:4]],
        "working_sets_gib": {k: _gib(v) for k, v in working.items()},
    }


def _working_sets(phases: list, layers: list) -> dict:
    """Each training working set's largest value over the phases and (a forward phase counts only its largest) over
    every layer's forward and backward working sets, in bytes."""
    working = {name: max(c.get(name, 0.0) for _, c in phases) for name in WORKING_SETS}
    for x in layers:
        for d in (x["w_fwd"], x["w_bwd_ffn"], x["w_bwd_mix"]):
            for name, v in d.items():
                if name in working:
                    working[name] = max(working[name], v)
    return working


# ---------------------------------------------------------------- the plan


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
    optimizer_state_dtype: str = "fp32",
    offload_activations: bool = False,
    host_memory_gib: float | None = None,
    trainable: str = "all",
    lora_rank: int = 0,
    frozen_dtype: str = "bf16",
    lora_targets: tuple[str, ...] | None = None,
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
        optimizer_state_dtype: ``train.optimizer_state_dtype``: AdamW's ``exp_avg`` and ``exp_avg_sq`` in ``"fp32"``
            (8 bytes per local parameter) or ``"bf16"`` (4; DeepSeek-V3 section 3.3; the step upcasts one parameter's
            moments at a time: ``optimizer_step`` ``3 f`` x the largest local parameter).
        offload_activations: ``train.offload_activations`` (needs ``recompute``): each checkpointed decoder layer's
            input is copied to host memory after its forward and back before its recompute; on the device only the
            copy in flight stays (the last layer's input before the phase: ``layer_inputs`` of one layer), on the
            host all of them (``host_gib``).
        host_memory_gib: host memory per GPU (the node's, divided by its GPUs); with it, ``fits`` also needs
            ``host_gib`` to fit there. None: the host is not checked.
        trainable: ``train.trainable``: ``"all"``, or a comma list of ``genoctx.model.groups.GROUPS`` and ``lora``
            (``genoctx.plan.trainable``: frozen tensors hold only their weight in ``frozen_dtype``: bf16 sharded and
            all-gathered as FSDP2 parameters, fp8 holders whole or EP-sliced and never gathered; no gradient,
            optimizer state, master or reduce-scatter).
        lora_rank: ``train.lora_rank`` (> 0 exactly when ``lora`` is in ``trainable``): adapters of ``r (in + out)``
            trainable parameters per target, their ``x A^T`` activations (``r`` per token per target).
        frozen_dtype: ``train.frozen_dtype``: ``"bf16"`` or ``"fp8"`` (block-scaled e4m3 matmul weights with fp32
            scales per 128 x 128 block, ``FP8Weight`` buffers: a dense matrix whole on every rank, the routed
            experts their ``E / ep`` EP slice; the largest matrix one use dequantizes, in bf16, a working set counted
            in ``unsharded_params``). With ``optimizer_offload`` the holders sit in pinned host memory (``host_gib``)
            and each use fetches its matrix (fp8 and scales, added to that working set): ``fp8_fetches`` copies of
            every holder per step (``host_device_bytes["frozen_fp8"]``).
        lora_targets: ``train.lora_targets``: name suffixes of the target modules / expert parameters; None for
            the targets training adapts by default (``genoctx.model.lora.DEFAULT_TARGETS``).

    Returns:
        ``{"layout": {dp_replicate, ep, dp_shard, cp, world}, "fits": bool, "total_gib": float,
        "components_gib": {name: GiB at the peak, for every name in COMPONENTS}, "peak_phase": str,
        "next_phases_gib": [[phase, GiB], ...] (the three next largest phases, slack included),
        "working_sets_gib": {name: the largest value over all phases}, "tokens_per_rank": N,
        "params_per_rank": {"dense", "expert"} (what one rank allocates: ``shard_numel``, about ``P_d / s_d`` and
        ``P_e / (ep s_e)``, FSDP2's padding of uneven shards included), "persistent_gib": {"weights",
        "gradients", "optimizer_state", "on_host"} (the sharded state of a whole step: 4, 4 and 8 bytes per local
        parameter; ``on_host`` with offload), "largest_layer_unsharded_gib" (the largest decoder layer's FSDP
        all-gathered parameters, routed experts: the rank's ``E / ep``; 0 without FSDP), "all_to_all_gib" (what
        one rank sends by expert all-to-all in the step, ``comms.all_to_all_bytes``), "gpu_memory_gib", "dtype",
        "recompute", "optimizer_offload", "batch_size", "seq_len", "seq_chunk_tokens" (None: one pass),
        "device", "optimizer_state_dtype", "offload_activations", "knobs" (the memory knobs on, by recipe name),
        "host_gib" (host memory the step holds per GPU: the
        offloaded layer inputs, and with ``optimizer_offload`` the sharded masters, gradients and AdamW state; on
        CUDA each pinned block at its power-of-two size, ``pinned_block_bytes``),
        "host_fits" (``host_gib <= host_memory_gib``, None without it), with ``trainable`` other than ``"all"`` (or
        LoRA) also "trainable" (``Trainable.to_dict`` plus ``trainable.counts``: whole-model parameters) and
        "trainable_params_per_rank" (``persistent_gib`` then has "frozen": the frozen weights' GiB, included in
        "weights"), "host_device_bytes" ({"to_host",
        "to_device"}: bytes one step copies between host and device: the layer inputs once each way, and with
        ``optimizer_offload`` the fp32 shards read at each all-gather (forward, backward) and the gradients
        written back, and the frozen fp8 holders at each use; "activations": the layer inputs' part, each way;
        "frozen_fp8": the fp8 holders' part of "to_device", ``fp8_fetches`` copies of each)}``. GiB are rounded
        to 6 decimals (1 KiB);
        the components add up to the total.

    Components (bytes) and phases: the module docstring.

    Raises:
        ValueError: a bad argument or a layout this model cannot run (``ep`` not dividing the experts, ``cp`` not
            dividing ``seq_len`` or leaving less than one KDA chunk per piece, offload without FSDP), or dense DSA
            (the indexer warm-up), which is not modelled.
    """
    _check_args(cfg, seq_len, layout, gpu_memory_gib, batch_size, dtype, device, loss_chunk_tokens, loss_vocab_rows,
                allocator_slack, optimizer_offload, seq_chunk_tokens)  # fmt: skip
    _check_knobs(optimizer_state_dtype, offload_activations, recompute, host_memory_gib)
    tr = check_trainable(trainable, lora_rank, frozen_dtype, lora_targets)
    st = _step(cfg, seq_len, layout, recompute, optimizer_offload, batch_size, dtype, device, seq_chunk_tokens)
    st = dataclasses.replace(st, moment_bytes=MOMENT_BYTES[optimizer_state_dtype], offload_act=offload_activations)
    if not tr.default:
        st = dataclasses.replace(st, tr=tr, entries=tuple(param_entries(cfg, tr)))
    p, layers, head = _held(st), _layers(st), _head(st, loss_vocab_rows, loss_chunk_tokens)
    phases = _forward_phases(st, p, layers, head) + _backward_phases(st, p, layers, head)
    phases += _step_end_phases(st, p, layers)
    out = _summary(phases, _slack(allocator_slack, device), COMPONENTS, _working_sets(phases, layers))
    return _result(st, p, layers, out, gpu_memory_gib, host_memory_gib)


def _result(st: _Step, p: _Held, layers: list, out: dict, gpu_memory_gib: float,
            host_memory_gib: float | None = None) -> dict:  # fmt: skip
    """``plan_memory``'s dict (its Returns): the layout, ``fits``, the peak (``_summary``), and what the plan counted
    (tokens, all-to-all bytes, local parameters, the largest all-gathered layer, the persistent state, the knobs)."""
    lay, f, P_local = st.layout, st.s.f, p.P_local
    # chunked: every chunk's MoE layers also run in the forward sweep (2 more exchanges), over the whole window
    a2a = all_to_all_bytes(st.cfg, st.windows * st.seq_len // lay.cp if st.chunked else st.N, lay, st.s.a,
                           passes=(8 if st.recompute else 6) + 2 * st.chunked)  # fmt: skip
    host, moved = _host(st, layers, P_local, p.frozen, p.fp8_held)
    host_fits = None if host_memory_gib is None else _gib(host) <= host_memory_gib
    split = {} if st.tr is None else {
        "trainable": {**st.tr.to_dict(), **counts(st.cfg, st.tr)}, "trainable_params_per_rank": P_local}
    return {
        "layout": _layout_dict(lay),
        "fits": out["total_gib"] <= gpu_memory_gib and host_fits is not False,
        **out,
        "tokens_per_rank": st.N,
        "all_to_all_gib": _gib(a2a),
        "params_per_rank": shard_numel(st.pc["shapes"], lay),
        "largest_layer_unsharded_gib": _gib(max(x["block_bytes"] for x in layers) if lay.fsdp and layers else 0.0),
        **split,
        "persistent_gib": {
            **({"frozen": _gib(p.frozen)} if st.tr is not None else {}),
            "weights": _gib(f * P_local + p.frozen),
            "gradients": _gib(f * P_local),
            "optimizer_state": _gib(2 * st.moment_bytes * P_local),
            "on_host": st.offload,
        },
        "seq_len": st.seq_len,
        "seq_chunk_tokens": st.T if st.chunked else None,
        "batch_size": st.windows,
        "gpu_memory_gib": gpu_memory_gib,
        "dtype": st.dtype,
        "device": st.device,
        "recompute": st.recompute,
        "optimizer_offload": st.offload,
        "optimizer_state_dtype": MOMENT_DTYPE[st.moment_bytes],
        "offload_activations": st.offload_act,
        "knobs": [k for k, on in (("offload_activations", st.offload_act), ("optimizer_state_dtype=bf16",
                  st.moment_bytes == 2), ("optimizer_offload", st.offload)) if on],  # fmt: skip
        "host_gib": _gib(host),
        "host_memory_gib": host_memory_gib,
        "host_fits": host_fits,
        "host_device_bytes": moved,
    }


def pinned_block_bytes(nbytes: float) -> float:
    """Host bytes PyTorch's CUDA caching host allocator takes for one pinned tensor of ``nbytes`` bytes: the size
    rounded up to the next power of two (``at::CachingHostAllocator``: ``c10::llvm::PowerOf2Ceil``, for every size
    while ``pinned_max_round_threshold_mb`` is unset, as genoctx leaves it), so up to 2x. 0 for 0 bytes."""
    n = math.ceil(nbytes)
    return float(1 << (n - 1).bit_length()) if n > 0 else 0.0


def _pinned_optimizer_offload(st: _Step) -> float:
    """Pinned host bytes of FSDP2's ``CPUOffloadPolicy(pin_memory=True)`` (``genoctx.parallel.fsdp.apply_fsdp`` on
    CUDA): every parameter's padded local shard (fp32, ``shard_numel`` of that parameter) is one pinned block as the
    master (``FSDPParam``: ``.pin_memory()``) and one as its gradient (the reduce-scatter output copied
    ``non_blocking`` to the host: a pinned tensor), each rounded by ``pinned_block_bytes``. The AdamW moments are
    plain (pageable) host tensors: not rounded. A frozen bf16 weight: its shard, one block; a frozen fp8 holder
    (``genoctx.model.fp8.hold_on_host``): its ``weight`` and its ``scale_inv`` one block each, at the size this rank
    holds (whole, or the experts' ``[E / ep, out, in]`` stack)."""
    f, lay = st.s.f, st.layout
    if st.tr is not None:  # trainable tensors: master and gradient; frozen ones: their weight (and scales)
        return sum(2 * pinned_block_bytes(f * _numel(e["shape"], lay, False)) if e["train"] else
                   sum(pinned_block_bytes(b * _numel(sh, lay, e["fp8"])) for sh, b in e["store"])
                   for e in st.entries)  # fmt: skip
    return sum(2 * pinned_block_bytes(f * sum(shard_numel([sh], lay).values())) for sh in st.pc["shapes"])


def fp8_fetches(st: _Step) -> int:
    """How many times one step copies each host-held fp8 holder to the device (``optimizer_offload`` with
    ``frozen_dtype="fp8"``: ``genoctx.model.fp8.fetch`` per use, never kept): per model call once in forward, once
    in the recompute (``recompute``) and once in backward (the input gradient needs ``W``); chunked
    (``seq_chunk_tokens``), every chunk's call, plus its forward without graph (the forward sweep). An upper bound
    for layers before the first trainable tensor (no backward there)."""
    calls = -(-(st.seq_len // st.layout.cp) // st.T) if st.chunked else 1
    return calls * (2 + int(st.recompute) + int(st.chunked))


def _host(st: _Step, layers: list, P_local: float, frozen: float = 0.0, fp8_held: float = 0.0) -> tuple[float, dict]:
    """Host bytes per GPU the step holds and the bytes it copies each way (``plan_memory``'s Returns).

    Held: the offloaded layer inputs (``offload_activations``: each layer's input one pinned block on CUDA,
    ``genoctx.parallel.offload.to_host``) and, with ``optimizer_offload``, the masters and gradients (pinned, per
    parameter: ``_pinned_optimizer_offload``), the AdamW moments (pageable) and the frozen weights (bf16 shards and
    fp8 holders, pinned). On CUDA every pinned block counts at its power-of-two rounded size (``pinned_block_bytes``:
    what the pinned allocator takes; up to 2x the tensor); on a CPU nothing is pinned (exact sizes). The bytes copied
    are the tensors' own: the layer inputs once each way; with ``optimizer_offload`` the fp32 shards and frozen bf16
    shards read at each all-gather (forward, backward), the gradients written back, and the fp8 holders
    (``fp8_held`` bytes) ``fp8_fetches`` times (``"frozen_fp8"``: their part of ``to_device``)."""
    f, acts = st.s.f, [x["input"] for x in layers] if (st.offload_act and st.recompute) else []
    pinned = pinned_block_bytes if st.device == "cuda" else float
    held = sum(pinned(b) for b in acts)
    if st.offload:
        params = _pinned_optimizer_offload(st) if st.device == "cuda" else 2 * f * P_local + frozen
        held += params + 2 * st.moment_bytes * P_local
    acts = sum(acts)
    fp8 = fp8_held * fp8_fetches(st) if st.offload else 0.0
    # shards read at each all-gather (fwd, bwd); the fp8 holders at each use
    to_device = acts + fp8 + (2 * (f * P_local + frozen - fp8_held) if st.offload else 0.0)
    to_host = acts + (f * P_local if st.offload else 0.0)  # the reduced gradients
    return held, {"to_host": to_host, "to_device": to_device, "activations": acts, "frozen_fp8": fp8}


def _check_knobs(optimizer_state_dtype, offload_activations, recompute, host_memory_gib) -> None:
    """The memory knobs' checks (``ValueError``, one line naming the argument)."""
    if optimizer_state_dtype not in MOMENT_BYTES:
        raise ValueError(f"optimizer_state_dtype must be one of {', '.join(MOMENT_BYTES)}, "
                         f"got {optimizer_state_dtype!r}")  # fmt: skip
    if offload_activations and not recompute:
        raise ValueError("offload_activations needs recompute (it offloads the checkpointed layers' inputs)")
    if host_memory_gib is not None and not host_memory_gib > 0:
        raise ValueError(f"host_memory_gib must be > 0, got {host_memory_gib!r}")
