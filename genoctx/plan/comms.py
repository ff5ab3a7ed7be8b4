"""Bytes that cross the network in one step, by collective (``step_comms``), each term counted from the code that
issues the collective.

One dict per kind of collective call of one training step (``mode="train"``: forward, backward, optimizer step) or
of scoring one window (``mode="eval"``: forward only under ``torch.no_grad``), on the busiest rank:

- FSDP2 (``genoctx.parallel.fsdp.apply_fsdp``, when ``dp_shard > 1`` or ``cp > 1``): groups are each decoder layer,
  its routed experts under EP (over the expert mesh), under a bf16 ``MixedPrecisionPolicy`` each of its fp32 island
  modules (``_island_groups``: a KDA mixer ``self_attn``, the MoE router ``mlp.gate``, the mHC mixings ``attn_hc``
  and ``ffn_hc``, one group each), and the root (embedding, final norm, ``lm_head``). Each group's all-gather input
  is the concatenation of its parameters' padded shards (``ceil(rows / s)`` rows, ``sizes.shard_numel``) in the
  parameter dtype (bf16, fp32 for the islands; fp32 with ``dtype="fp32"``); its reduce-scatter input the unsharded
  padded gradients in fp32 (``reduce_dtype``); HSDP all-reduces the reduce-scatter's output (one shard, fp32) over
  ``dp_replicate`` (FSDP2 on the 2-D mesh issues it over a ``dp_replicate`` group of one rank too: a call, no wire
  bytes). Calls per model call, as counted in real gloo steps (torch 2.13, ``tests/plan/test_comms.py``): every
  layer group, experts group, KDA island and the root one all-gather in forward and one in backward (the root is
  resharded after forward too); activation checkpointing adds none (the recompute runs inside the layer's backward,
  on the parameters its pre-backward gathered). A router is all-gathered once per ``moe_chunk_tokens`` chunk of
  the call, in forward and again in backward (each chunk is checkpointed); an mHC module ``HC_CALLS = 2`` times in
  each (its ``pre`` and ``post`` are registered FSDP forward methods: each call unshards and reshards). Every group
  is reduce-scattered (and HSDP all-reduced) once per backward. A group over one rank (folded EP with
  ``efsdp = 1``) issues no all-gather or reduce-scatter.
- Without FSDP (replicas and EP only): after backward, one all-reduce (sum, fp32) of the dense gradients over the
  mesh and one of the routed experts' over the ranks holding the same block (``reduce_gradients``).
- Chunked training (``seq_chunk_tokens``): every chunk runs a forward without graph (the forward sweep), a forward
  with graph and a backward, each with the FSDP calls above (reduce-scatters per chunk); EP and CP move the same
  bytes per token per pass, in per-chunk calls (the KDA tails and states once per call).
- EP (``genoctx.parallel.experts``), per MoE layer and pass: one all-gather of the ``[E]`` int64 counts, then ``R``
  rounds of two ``all_to_all_single``: dispatch (the rank's ``N k`` rows of ``D`` activations, ``a`` bytes each)
  and combine (the outputs of the rows its experts received back to their owners). Backward: the same rounds with
  two tensors per row each way (``2 D a``). With activation checkpointing the forward exchange runs again in the
  recompute. ``skew`` = rows the busiest EP rank's experts receive / the mean (1 balanced, at most ``ep``): that
  rank sends its ``N k`` rows and returns ``skew N k``.
- CP (``genoctx.parallel.context``), per pass: a KDA layer all-gathers its pieces' pre-convolution tails
  (``(w - 1) 3 H K`` values per piece in ``a``) and ``[L | M]`` states (``H K 2K`` fp32 per piece); a DSA layer its
  latents and, on a full layer, indexer keys and gates (``R + 2 d_I`` values per token in ``a``). Backward: an
  ``all_to_all_single`` of the whole gathered gradient (``cp`` times the rank's input). Recomputed with the layer.
- Loss and statistics (train, over the whole mesh): the scored count (int64), the loss and aux sums (2 fp64), the
  MoE loads (``[E]`` int64 per MoE layer), the gradient norm (fp64).

Conventions. ``payload_bytes``: the sum over calls of the rank's input buffer of the collective (what a wrapper around
it sees: all-gather its shard, reduce-scatter and all-to-all the whole input, all-reduce the buffer).
``dims``: the mesh dimensions the group spans (``genoctx.parallel.layout.DIMS``, those of size > 1); under folded EP
``("ep",)`` names the folded EP group (``ep`` consecutive ranks of ``dp_shard x cp``) and ``("efsdp",)`` the ranks
sharding one block of experts (every ``ep``-th rank of ``dp_shard x cp``), as ``genoctx.parallel.mesh`` builds them.
``wire_bytes``: what the rank puts on the wire with ring / pairwise algorithms: all-gather ``(g - 1)`` x its input
(``(g - 1) / g`` of the gathered buffer), reduce-scatter ``(g - 1) / g`` of its input, all-reduce ``2 (g - 1) / g``
of the buffer, all-to-all the rows it does not keep (balanced ``(g - 1) / g``; the busiest rank under ``skew``: its
sends keep ``skew / ep`` of its rows, its returns ``1 / ep``; an all-to-all entry of EP also has
``recv_wire_bytes``, what the rank receives: ``skew`` x the mean in dispatch, the time model takes the larger of the
two). Not counted: the per-step ``all_gather_object`` of rank metrics (a few hundred bytes of pickled statistics per
rank, ``genoctx.train.distributed``), eval's final all-reduce of the binned sums (once per evaluation, not per
window).
"""

from __future__ import annotations

import functools
import json
import math

from ..model.config import DSA, ModelConfig
from ..parallel.layout import DIMS, Layout
from .sizes import DTYPE_BYTES, F32, _is_island, shard_numel
from .trainable import Trainable, param_entries

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv", "broadcast")
PHASES = ("forward", "recompute", "backward", "step")
I64 = 8  # bytes of an int64 / fp64 element
HC_CALLS = 2  # calls of one mHC module per layer forward (pre, post: registered FSDP forward methods), each a gather
ISLANDS = ("self_attn", "mlp.gate", "attn_hc", "ffn_hc")  # a layer's island modules (fsdp._islands), in its order


def all_to_all_bytes(cfg: ModelConfig, tokens: int, layout: Layout, a: int, passes: int) -> float:
    """Bytes one rank sends by expert-parallel all-to-all in a step over ``tokens`` tokens, with balanced routing:
    per MoE layer, ``tokens x k`` rows of which ``(ep - 1) / ep`` belong to another rank's experts, ``D`` values of
    ``a`` bytes each per exchange, ``passes`` exchanges (``genoctx.parallel.experts``: a forward dispatches the hidden
    states and combines the outputs, 2; its backward sends hidden states and output gradients and returns input
    gradients and outputs, 4; a forward recomputed under activation checkpointing, 2 more; balanced, a rank sends
    as many rows as it receives). 0 without EP. Forced-imbalanced routing moves up to ``ep`` times more through the
    busiest rank (in more rounds of the same bounded size). The wire bytes of ``step_comms``'s ``ep_*`` entries at
    ``skew=1``."""
    if layout.ep == 1:
        return 0.0
    moe = sum(1 for t in cfg.mlp_layer_types if t == "sparse")
    rows = tokens * cfg.num_experts_per_tok * (layout.ep - 1) / layout.ep
    return moe * rows * cfg.hidden_size * a * passes


def wire_bytes(collective: str, group_size: int, payload: float, kept: float | None = None) -> float:
    """Bytes a rank puts on the wire for ``payload`` input bytes (module docstring, conventions).

    ``kept``: for ``all_to_all``, the fraction of the input the rank keeps (default ``1 / group_size``).

    Raises:
        ValueError: an unknown collective or ``group_size < 1``.
    """
    g = group_size
    if g < 1:
        raise ValueError(f"group_size must be >= 1, got {g}")
    if collective == "all_gather":
        return (g - 1) * payload
    if collective == "reduce_scatter":
        return (g - 1) / g * payload
    if collective == "all_reduce":
        return 2 * (g - 1) / g * payload
    if collective == "all_to_all":
        return (1 - (1 / g if kept is None else kept)) * payload if g > 1 else 0.0
    if collective in ("send_recv", "broadcast"):
        return payload if g > 1 else 0.0
    raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")


def _entry(name: str, collective: str, dims: tuple, g: int, phase: str, calls: int, payload: float,
           kept: float | None = None, ranks: str | None = None) -> dict:  # fmt: skip
    out = {"name": name, "collective": collective, "dims": dims, "group_size": g, "phase": phase, "calls": calls,
           "payload_bytes": float(payload), "wire_bytes": float(wire_bytes(collective, g, payload, kept))}  # fmt: skip
    if ranks:
        out["ranks"] = ranks
    return out


def _dims(layout: Layout, names: tuple) -> tuple:
    """The names among ``names`` whose size is > 1 (the EP axis counts only when not folded)."""
    size = {"dp_replicate": layout.dp_replicate, "ep": layout.ep_axis, "dp_shard": layout.dp_shard, "cp": layout.cp}
    return tuple(d for d in names if size[d] > 1)


# ---------------------------------------------------------------- FSDP groups


@functools.lru_cache(maxsize=8)
def _param_shapes(key: str) -> tuple:
    """``(name, rows, numel per row, size of dim 1)`` of every parameter of ``HybridLM(cfg)`` (meta device)."""
    import torch

    from ..model.model import HybridLM

    cfg = ModelConfig.from_dict(json.loads(key))
    with torch.device("meta"):
        model = HybridLM(cfg)
    out = []
    for name, p in model.named_parameters():
        rows = p.shape[0] if p.dim() else 1
        out.append((name, rows, p.numel() // max(1, rows), p.shape[1] if p.dim() > 1 else 1))
    return tuple(out)


def _island_module(name: str) -> str:
    """The island module (``ISLANDS``) of an island parameter ``layers.i.<module>.<...>``."""
    rest = name.split(".", 2)[2]
    return next(m for m in ISLANDS if rest.startswith(m + "."))


def fsdp_groups(cfg: ModelConfig, layout: Layout, dtype: str = "bf16",
                entries: tuple | list | None = None) -> list[dict]:  # fmt: skip
    """FSDP2's parameter groups as ``apply_fsdp`` makes them, innermost first, with what their collectives carry.

    ``entries``: ``genoctx.plan.trainable.param_entries`` when not every parameter trains (issue 44): a frozen
    tensor is all-gathered at its frozen dtype (bf16) and has no gradient (``grad_shard_bytes`` counts the trainable
    tensors only: a group with none is not reduce-scattered); a frozen fp8 matmul weight is no FSDP parameter at all
    (``genoctx.model.fp8.FP8Weight`` buffers, held whole or EP-sliced on every rank: never all-gathered), and a
    module left with no parameter (the routed experts when all are fp8) forms no group; LoRA adapters join their
    target's group. None: every parameter trains (as before).

    Returns:
        ``[{"name", "mesh" ("dense" | "expert"), "shards" (ranks of the shard group), "nested" (called inside a
        decoder layer: experts, islands), "root", "island" (under bf16, a group of one fp32 island module:
        ``"kda"`` (a KDA layer's ``self_attn``), ``"router"`` (``mlp.gate``), ``"mhc"`` (``attn_hc``, ``ffn_hc``);
        None otherwise), "layer" (decoder layer index; None for the root), "gather_bytes" (all-gather input:
        padded shards in the parameter dtype), "grad_shard_bytes" (padded shard numel x 4: reduce-scatter output,
        HSDP all-reduce buffer)}]``; empty without FSDP. Named as FSDP2 names them: ``layers.i``,
        ``layers.i.experts``, ``layers.i.<island module>``, ``root``.
    """
    if not layout.fsdp:
        return []
    shapes = _param_shapes(json.dumps(cfg.to_dict(), sort_keys=True))
    if entries is not None:
        shapes = tuple((e["name"], *e["shape"][1:], e) for e in entries)
    else:
        shapes = tuple((*x, None) for x in shapes)
    bf16 = dtype == "bf16"
    groups: dict[str, dict] = {}
    order = []
    for name, rows, rest, dim1, entry in shapes:
        if entry is not None and entry["fp8"]:  # an FP8Weight's buffers: not FSDP's (never gathered nor reduced)
            continue
        if name.startswith("layers."):
            i = int(name.split(".")[1])
            expert = ".mlp.experts." in f".{name}"
            if expert and layout.ep > 1:
                key, mesh, nested = f"layers.{i}.experts", "expert", True
            elif bf16 and _is_island(cfg, i, name):
                key, mesh, nested = f"layers.{i}.{_island_module(name)}", "dense", True
            else:
                key, mesh, nested = f"layers.{i}", "dense", False
        else:
            expert, key, mesh, nested = False, "root", "dense", False
        if key not in groups:
            groups[key] = {"name": key, "mesh": mesh, "nested": nested, "root": key == "root",
                           "shards": layout.expert_shard if mesh == "expert" else layout.dense_shard,
                           "numel": 0, "frozen_bytes": 0, "grad_numel": 0,
                           "param_bytes": 4 if (not bf16 or nested and mesh == "dense") else 2}  # fmt: skip
            order.append(key)
        kind = "expert" if (expert and mesh == "expert") else "dense"
        if entry is not None and not entry["train"]:  # frozen: its weight (and fp8 scales) at the frozen dtype
            groups[key]["frozen_bytes"] += sum(b * shard_numel([(kind, *sh[1:])], layout)[kind]
                                               for sh, b in entry["store"])  # fmt: skip
            continue
        n = shard_numel([(kind, rows, rest, dim1)], layout)[kind]
        groups[key]["numel"] += n
        groups[key]["grad_numel"] += n
    # innermost first (apply_fsdp's order): experts, the island modules, the layer; the root last
    rank = {"experts": 0, **{m: 1 + j for j, m in enumerate(ISLANDS)}}
    kinds = {"self_attn": "kda", "mlp.gate": "router", "attn_hc": "mhc", "ffn_hc": "mhc"}

    def sub(k: str) -> str:  # what follows "layers.i." ("" for the layer itself and the root)
        return k.split(".", 2)[2] if k.count(".") >= 2 else ""

    keyed = sorted(order, key=lambda k: (k == "root", int(k.split(".")[1]) if k != "root" else 0,
                                         rank.get(sub(k), len(rank))))  # fmt: skip
    out = []
    for k in keyed:
        g = groups[k]
        island = kinds[sub(k)] if (g["nested"] and g["mesh"] == "dense") else None
        out.append({**{x: g[x] for x in ("name", "mesh", "shards", "nested", "root")},
                    "island": island, "layer": None if k == "root" else int(k.split(".")[1]),
                    "gather_bytes": g["numel"] * g["param_bytes"] + g["frozen_bytes"],
                    "grad_shard_bytes": g["grad_numel"] * F32})  # fmt: skip
    return out


def _fsdp(cfg: ModelConfig, layout: Layout, dtype: str, mode: str, window: dict,
          call_tokens: list[int], entries: tuple | list | None = None) -> list[dict]:  # fmt: skip
    """FSDP2's all-gathers, reduce-scatters and HSDP all-reduces (module docstring). ``window``: forwards with a
    graph (``fwd``), forwards without (``nograd``), backwards (``bwd``) of the step, each one model call per entry
    of ``call_tokens`` (the rank's tokens, all windows, of each call: one, or one per chunk)."""
    groups = fsdp_groups(cfg, layout, dtype, entries)
    if not groups:
        return []
    dense_dims = _dims(layout, ("ep", "dp_shard", "cp"))
    exp_dims = ("efsdp",) if layout.ep_folded else _dims(layout, ("dp_shard", "cp"))
    folded = "stride ep inside dp_shard x cp (ranks holding the same expert block)" if layout.ep_folded else None
    calls = len(call_tokens)
    router = sum(math.ceil(n / cfg.moe_chunk_tokens) for n in call_tokens)  # MoE chunks of one pass's calls

    def gathers(g: dict) -> int:  # all-gathers of group g per pass, forward or backward (module docstring)
        if g["island"] == "router":  # one per MoE chunk (in backward too: each chunk is checkpointed)
            return router
        return calls * (HC_CALLS if g["island"] == "mhc" else 1)

    n_phase = {"forward": window["fwd"] + window["nograd"], "backward": window["bwd"]}
    out = []
    for phase, n in n_phase.items():
        if n == 0 or (mode == "eval" and phase != "forward"):
            continue
        for mesh in ("dense", "expert"):
            gs = [(g, n * gathers(g)) for g in groups if g["mesh"] == mesh and g["shards"] > 1]
            if not gs:
                continue
            suffix = "" if mesh == "dense" else "_experts"
            out.append(_entry(f"fsdp_all_gather_{phase}{suffix}", "all_gather", dense_dims if mesh == "dense"
                              else exp_dims, gs[0][0]["shards"], phase, sum(c for _, c in gs),
                              sum(c * g["gather_bytes"] for g, c in gs),
                              ranks=folded if mesh == "expert" else None))  # fmt: skip
    bwd = window["bwd"] * calls  # backwards of the step: every group reduce-scatters once in each
    if mode == "eval" or bwd == 0:
        return out
    for mesh in ("dense", "expert"):
        gs = [g for g in groups if g["mesh"] == mesh and (entries is None or g["grad_shard_bytes"])]  # frozen: none
        suffix = "" if mesh == "dense" else "_experts"
        sharded = [g for g in gs if g["shards"] > 1]
        if sharded:
            sh = sharded[0]["shards"]
            out.append(_entry(f"fsdp_reduce_scatter{suffix}", "reduce_scatter", dense_dims if mesh == "dense"
                              else exp_dims, sh, "backward", bwd * len(sharded),
                              bwd * sum(sh * g["grad_shard_bytes"] for g in sharded),
                              ranks=folded if mesh == "expert" else None))  # fmt: skip
        if gs:  # FSDP2 on a 2-D mesh (dp_replicate, shard) all-reduces over dp_replicate, a group of 1 included
            out.append(_entry(f"dp_all_reduce{suffix}", "all_reduce", ("dp_replicate",), layout.dp_replicate,
                              "backward", bwd * len(gs), bwd * sum(g["grad_shard_bytes"] for g in gs)))  # fmt: skip
    return out


def _replicated_grads(cfg: ModelConfig, layout: Layout, entries: tuple | list | None = None) -> list[dict]:
    """Without FSDP: ``reduce_gradients``' all-reduces of the fp32 gradients (dense over the mesh, routed experts'
    block over the ranks holding it); with ``entries`` (``trainable.param_entries``) the trainable tensors' only."""
    if layout.fsdp or layout.world == 1:
        return []
    shapes = _param_shapes(json.dumps(cfg.to_dict(), sort_keys=True))
    if entries is not None:
        shapes = tuple((e["name"], *e["shape"][1:]) for e in entries if e["train"])
    ep = layout.ep > 1
    expert = sum(r * n for name, r, n, _ in shapes if ep and ".mlp.experts." in f".{name}") // layout.ep
    dense = sum(r * n for name, r, n, _ in shapes if not (ep and ".mlp.experts." in f".{name}"))
    out = [_entry("grad_all_reduce", "all_reduce", _dims(layout, DIMS), layout.world, "step", 1, F32 * dense)]
    replicas = layout.world // layout.ep
    if ep and replicas > 1:
        out.append(_entry("grad_all_reduce_experts", "all_reduce", _dims(layout, ("dp_replicate", "dp_shard", "cp")),
                          replicas, "step", 1, F32 * expert))  # fmt: skip
    return out


# ---------------------------------------------------------------- EP, CP, loss


def _ep_rounds(cfg: ModelConfig, rows: float, ep: int) -> int:
    """``genoctx.parallel.experts.n_rounds`` for a largest row/column sum of ``rows``."""
    cap = cfg.moe_chunk_tokens * cfg.num_experts_per_tok
    return max(1, math.ceil(rows / (cap - ep + 1))) if rows > 0 else 0


def _ep(cfg: ModelConfig, layout: Layout, N: int, a: int, skew: float, passes: dict, recompute: bool,
        mode: str, chunks: int) -> list[dict]:  # fmt: skip
    """Expert-parallel counts all-gathers and all-to-alls of the busiest rank (module docstring); ``N`` tokens per
    pass on the rank, in ``chunks`` calls of each MoE layer per pass."""
    P = layout.ep
    moe = sum(1 for t in cfg.mlp_layer_types if t == "sparse")
    if P == 1 or moe == 0:
        return []
    E, k, D = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size
    rows = N * k  # this rank's (token, slot) rows per pass
    R = chunks * _ep_rounds(cfg, rows / chunks * skew, P)  # rounds per MoE layer per pass
    if layout.ep_folded:
        dims = ("ep",)  # the folded EP group (genoctx.plan.time.group_ranks: consecutive ranks)
        ranks = "contiguous blocks of ep ranks inside dp_shard x cp (cp fastest)"
    else:
        dims, ranks = ("ep",), None
    kept_send, kept_ret = min(1.0, skew / P), 1.0 / P
    fwd = passes["fwd"] + passes["nograd"]
    plan = [("forward", fwd, 1)]
    if mode == "train":
        plan += [("recompute", passes["bwd"] if recompute else 0, 1), ("backward", passes["bwd"], 2)]
    out = []
    for phase, n, width in plan:
        if n == 0:
            continue
        if phase != "backward":  # the counts travel once per forward (the backward reuses the plan)
            out.append(_entry(f"ep_counts_{phase}", "all_gather", dims, P, phase, n * moe * chunks,
                              n * moe * chunks * I64 * E,
                              ranks=ranks))  # fmt: skip
        row = width * D * a
        sent, returned = n * moe * rows * row, n * moe * skew * rows * row
        out.append(_entry(f"ep_dispatch_{phase}", "all_to_all", dims, P, phase, n * moe * R, sent,
                          kept=kept_send, ranks=ranks))  # fmt: skip
        out[-1]["recv_wire_bytes"] = returned * (1 - kept_ret)  # the busiest rank receives skew x the mean
        out.append(_entry(f"ep_combine_{phase}", "all_to_all", dims, P, phase, n * moe * R, returned,
                          kept=kept_ret, ranks=ranks))  # fmt: skip
        out[-1]["recv_wire_bytes"] = sent * (1 - kept_send)  # its own rows' outputs, back from the other ranks
    return out


def _cp(cfg: ModelConfig, layout: Layout, B: int, T: int, a: int, passes: dict, recompute: bool,
        mode: str, cp_layout: str, chunks: int) -> list[dict]:  # fmt: skip
    """Context-parallel all-gathers (forward, recompute) and their backward all-to-alls, per rank (module
    docstring); ``T`` tokens per window on the rank, ``B`` windows, each mixing layer called ``chunks`` times per
    pass (the KDA tails and states travel once per call, the DSA latents once per token)."""
    P = layout.cp
    if P == 1:
        return []
    n_local = 2 if cp_layout == "zigzag" else 1
    H, K, w = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim - 1
    kda = sum(1 for t in cfg.layer_types if t != DSA)
    full = sum(1 for t, ix in zip(cfg.layer_types, cfg.indexer_types, strict=True) if t == DSA and ix == "full")
    shared = sum(1 for t in cfg.layer_types if t == DSA) - full
    R, dI = cfg.kv_lora_rank, cfg.index_head_dim
    parts = [  # name, layers, bytes per rank per layer per pass
        ("cp_kda_conv_tail", kda, chunks * n_local * B * w * 3 * H * K * a),
        ("cp_kda_state", kda, chunks * n_local * B * H * K * 2 * K * F32),
        ("cp_dsa_latents_and_keys", full, B * T * (R + 2 * dI) * a),
        ("cp_dsa_latents", shared, B * T * R * a),
    ]
    fwd = passes["fwd"] + passes["nograd"]
    plan = [("forward", fwd)] + ([("recompute", passes["bwd"] if recompute else 0)] if mode == "train" else [])
    out = []
    for name, layers, per in parts:
        if layers == 0:
            continue
        for phase, n in plan:
            if n:
                out.append(_entry(f"{name}_{phase}" if phase != "forward" else name, "all_gather", ("cp",), P, phase,
                                  n * layers * chunks, n * layers * per))  # fmt: skip
        if mode == "train" and passes["bwd"]:
            n = passes["bwd"]
            out.append(_entry(f"{name}_backward", "all_to_all", ("cp",), P, "backward", n * layers * chunks,
                              n * layers * P * per))  # fmt: skip
    return out


def _loss_and_stats(cfg: ModelConfig, layout: Layout, mode: str) -> list[dict]:
    """The step's small all-reduces over the whole mesh (``genoctx.train.loop``): scored count, loss and aux sums,
    MoE loads, gradient norm."""
    if mode != "train" or layout.world == 1:
        return []
    dims, g = _dims(layout, DIMS), layout.world
    moe = sum(1 for t in cfg.mlp_layer_types if t == "sparse")
    out = [_entry("loss_count", "all_reduce", dims, g, "forward", 1, I64),
           _entry("loss_sums", "all_reduce", dims, g, "step", 1, 2 * I64)]  # fmt: skip
    if moe:
        out.append(_entry("moe_loads", "all_reduce", dims, g, "step", moe, moe * I64 * cfg.n_routed_experts))
    out.append(_entry("grad_norm", "all_reduce", dims, g, "step", 1, I64))
    return out


def step_comms(cfg: ModelConfig, seq_len: int, layout: Layout, *, batch_size: int = 1, recompute: bool = True,
               dtype: str = "bf16", skew: float = 1.0, seq_chunk_tokens: int | None = None, mode: str = "train",
               cp_layout: str = "contiguous", trainable: Trainable | None = None) -> list[dict]:  # fmt: skip
    """Bytes that cross the network in one step on the busiest rank, by kind of collective call (module docstring).

    Args:
        cfg: the model.
        seq_len: tokens per window (``L``); a rank holds ``L / cp`` of each.
        layout: ``dp_replicate x ep x dp_shard x cp`` (``genoctx.parallel.layout.Layout``).
        batch_size: windows per data-parallel rank per step (eval: windows scored, one forward each).
        recompute: activation checkpointing of every decoder layer (``apply_ac``): the EP and CP exchanges run
            again in backward (FSDP's all-gathers do not).
        dtype: ``"bf16"`` (bf16 all-gathered parameters and activations, fp32 islands and gradient reduction) or
            ``"fp32"``.
        skew: rows the busiest EP rank's experts receive over the mean, ``>= 1``, taken as at most ``ep`` (a rank
            receives at most every row) (``genoctx.plan.flops.PUBLISHED_SKEW``: the busiest/mean expert load of the
            published run, an upper bound of the per-rank skew when a rank holds several experts).
        seq_chunk_tokens: ``train.seq_chunk_tokens`` (train only): windows trained in chunks (under CP, rounds of
            ``cp x`` this many tokens): every chunk runs a forward without graph, a forward with graph and a
            backward, each with its own FSDP all-gathers and reduce-scatters; EP and CP move the same bytes per
            token per pass. None, or not below ``L / cp``: one pass.
        mode: ``"train"`` (forward, backward, optimizer step) or ``"eval"`` (forward of ``batch_size`` windows
            under ``torch.no_grad``: no gradients, no loss reductions; ``genoctx.eval.distributed``).
        cp_layout: ``"contiguous"`` or ``"zigzag"`` (the KDA pieces per rank: 1 or 2).
        trainable: what trains (``genoctx.plan.trainable.Trainable``; None or its default: every parameter): frozen
            bf16 tensors are all-gathered at their dtype, frozen fp8 holders not at all (``fsdp_groups``), and neither
            is reduce-scattered nor all-reduced; LoRA adapters
            are gathered and reduced with their layer (``fsdp_groups``).

    Returns:
        ``[{"name", "collective", "dims", "group_size", "phase", "calls", "payload_bytes", "wire_bytes"}]`` (and
        ``"ranks"`` for groups drawn from inside a mesh dimension: folded EP), in step order within each part; no
        entry for a collective that the layout does not run.

    Raises:
        ValueError: an unknown ``dtype`` or ``mode``, ``seq_len`` not a multiple of ``cp``, ``skew < 1``,
            ``ep`` not dividing ``n_routed_experts``, ``batch_size < 1``, ``seq_chunk_tokens < 1``.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    if mode not in ("train", "eval"):
        raise ValueError(f"mode must be train or eval, got {mode!r}")
    if seq_len < 1 or seq_len % layout.cp:
        raise ValueError(f"seq_len {seq_len} must be a positive multiple of cp={layout.cp}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if layout.ep > 1 and cfg.n_routed_experts % layout.ep:
        raise ValueError(f"ep={layout.ep} must divide n_routed_experts={cfg.n_routed_experts}")
    if not skew >= 1.0:
        raise ValueError(f"skew must be >= 1 (busiest / mean expert rows), got {skew}")
    skew = min(float(skew), float(max(1, layout.ep)))  # a rank receives at most every row: ep x the mean
    if seq_chunk_tokens is not None and seq_chunk_tokens < 1:
        raise ValueError(f"seq_chunk_tokens must be >= 1, got {seq_chunk_tokens}")
    a = DTYPE_BYTES[dtype]
    T = seq_len // layout.cp
    chunks = 1
    if mode == "eval":  # batch_size windows, one forward each
        B, window = 1, {"fwd": 0, "nograd": batch_size, "bwd": 0}
    else:
        if seq_chunk_tokens is not None and seq_chunk_tokens < T:
            chunks = -(-seq_len // (seq_chunk_tokens * layout.cp))
        B, window = batch_size, {"fwd": 1, "nograd": 1 if chunks > 1 else 0, "bwd": 1}  # forward sweep: no graph
    step = seq_len if chunks == 1 else seq_chunk_tokens * layout.cp  # a model call's tokens: window or round
    call_tokens = [B * (min(step, seq_len - s) // layout.cp) for s in range(0, seq_len, step)]  # the rank's
    entries = None if trainable is None or trainable.default else param_entries(cfg, trainable)
    out = _fsdp(cfg, layout, dtype, mode, window, call_tokens, entries)
    out += _replicated_grads(cfg, layout, entries) if mode == "train" else []
    out += _ep(cfg, layout, B * T, a, skew, window, recompute, mode, chunks)
    out += _cp(cfg, layout, B, T, a, window, recompute, mode, cp_layout, chunks)
    out += _loss_and_stats(cfg, layout, mode)
    return out


def total_bytes(comms: list[dict], key: str = "wire_bytes") -> float:
    """The sum of ``key`` (``"wire_bytes"`` or ``"payload_bytes"``) over ``step_comms``'s entries."""
    return float(sum(c[key] for c in comms))
