"""Step time, tokens/s, MFU and what bounds a layout: FLOPs (``genoctx.plan.flops``) and bytes
(``genoctx.plan.comms``) of one step on the busiest rank, turned into seconds on a ``Hardware`` profile.

The model (every term is a place where a measurement can disagree):

- **Compute.** Each FLOPs component runs at ``peak(unit) x efficiency[class]``: ``matmul`` (dense and expert
  GEMMs, attention projections, LM head), ``attention`` (KDA core, DSA indexer, sparse MLA), ``memory`` (mHC).
  The rate is the one of what runs: ``step_flops`` gives each component's FLOPs by unit (``genoctx.plan.flops``,
  its docstring's table: component -> unit -> why, with the code), and ``unit_dtype`` maps a unit to a peak of
  the profile: the run's dtype (``bf16`` tensor cores), ``fp32`` (CUDA-core FMA: the fp32 islands, the DSA
  indexer's fp32 top-k dots and KL, the MoE router, the mHC mixings, the PyTorch KDA core, the KDA short
  convolution, the chunked head's fp32 master without FSDP; genoctx never enables TF32), ``tf32`` (fla-core's
  fp32 decay-score dots). A component's seconds are the sum over its units of ``FLOPs / (peak(unit) x
  efficiency[class])``.
- **Memory-bound kernels.** Norms, gates, activations, softmax statistics, mHC stream mixing and Sinkhorn move
  bytes, not FLOPs: the activation bytes per token each layer writes (the planner's per-token sizes,
  ``genoctx.plan.sizes``, as kept without recompute) are written and read once in each forward (2x), read, and
  their gradients written and read in backward (4x), at ``hbm_bytes_per_s x efficiency["memory"]``.
  That is the ``activations`` memory model (a fused kernel's traffic; the GPU profiles). Under ``memory_model:
  eager`` (a CPU profile: every op of genoctx runs eagerly there) the term is instead the bytes each eager op reads
  and writes (``genoctx.plan.eager``): elementwise ops and the products' operands at ``hbm_bytes_per_s x
  efficiency["memory"]``, row gathers and scatters at ``x efficiency["gather"]``. A product then takes its FLOPs'
  time plus its operands' (the two do not overlap in a small product on a CPU core).
- **Communication.** Each collective of ``step_comms`` takes ``wire_bytes / (bandwidth x efficiency["collective"]) +
  calls x latency`` (an all-to-all: the larger of what the rank sends and receives, ``recv_wire_bytes``; the busiest
  expert rank receives ``skew`` x the mean); the bandwidth is NVLink's when every rank of its group is in one node
  (mesh rank order ``dp_replicate x ep x dp_shard x cp``, cp fastest, ``gpus_per_node`` consecutive ranks a node),
  else the NIC's; an all-to-all over nodes sends its in-node share over NVLink and the rest over the NIC, at the
  same time.
- **Overlap.** FSDP2's all-gathers and reduce-scatters and HSDP's gradient all-reduce (names ``fsdp_*``,
  ``dp_*``) run on their own streams beside compute (prefetch one layer ahead): only what exceeds the step's
  compute is exposed, plus one unit's gather and one reduce-scatter at the ends of the step that nothing hides.
  Expert-parallel all-to-all, context-parallel exchanges and the loss/statistics reductions sit between the
  computations that need them (genoctx issues them synchronously): all exposed.
- **Launch.** Every eager aten op costs the host ``op_host_s`` (Python, autograd, the dispatcher, a kernel launch):
  ``launch_s = ops x op_host_s`` with ``ops`` the step's aten ops on the rank (``genoctx.plan.ops``). On a GPU
  (``host_overlaps_device``) the host queues ops while the device runs earlier ones: the step takes the longer of
  the device's time and the host's. On a CPU the host is the device: the two add.
- **Step.** ``step_s = compute + memory-bound + exposed communication`` (the device's time, ``device_s``), then the
  launch term as above; what bounds the layout is the largest of compute, memory-bound kernels, intra-node and
  inter-node exposed communication and ``launch``. ``tokens_per_s`` counts the
  step's tokens over all data-parallel ranks; ``mfu`` is the model FLOPs of those tokens (``flops_per_token``'s
  training total, no recompute) over ``world x peak(bf16) x step_s``.

Not modelled: host overheads beyond the per-op cost, the optimizer step's memory passes over the shard,
contention between NCCL and compute kernels for SMs and memory bandwidth, stragglers beyond the routing skew.
"""

from __future__ import annotations

from ..model.config import DSA, KDA, ModelConfig
from ..parallel.layout import Layout
from .hardware import Hardware
from .sizes import DTYPE_BYTES, _dsa, _hc, _kda, _mlp, _moe, _Sizes

BOUNDS = ("compute", "memory-bound kernels", "intra-node", "inter-node", "host", "launch")
OVERLAPPED_PREFIXES = ("fsdp_", "dp_")  # collectives FSDP2 / HSDP run beside compute (module docstring)


def _dim_strides(layout: Layout) -> dict:
    """Rank stride of each mesh dimension (``dp_replicate x ep x dp_shard x cp``, cp fastest)."""
    cp, ds, ep = layout.cp, layout.dp_shard, layout.ep_axis
    return {"cp": 1, "dp_shard": cp, "ep": cp * ds, "dp_replicate": cp * ds * ep}


def group_ranks(dims, layout: Layout, size: int | None = None) -> list[int]:
    """Ranks of rank 0's group over mesh dimensions ``dims`` (names of ``genoctx.parallel.layout.DIMS``; the mesh's
    ``ep`` axis has size 1 when EP is folded). Under ``Layout.ep_folded``, ``("ep",)`` is the folded EP group
    (``ep`` consecutive ranks: the fastest index of ``dp_shard x cp``) and ``"efsdp"`` the ranks sharding one
    block of experts (every ``ep``-th rank of ``dp_shard x cp``), as ``genoctx.parallel.mesh`` builds them.
    ``size``: the group's size when known; a group whose dims do not give it is taken as consecutive ranks."""
    dims = tuple(dims)
    stride = _dim_strides(layout)
    if layout.ep_folded and dims == ("ep",):
        ranks = list(range(layout.ep))
    else:
        ranks = [0]
        for d in dims:
            if d == "efsdp":
                ranks = [r + i * layout.ep for r in ranks for i in range(layout.dp_shard * layout.cp // layout.ep)]
                continue
            n = layout.ep_axis if d == "ep" else getattr(layout, d)
            ranks = [r + i * stride[d] for r in ranks for i in range(n)]
    if size is not None and size > 1 and len(set(ranks)) != size:
        ranks = list(range(size))
    return sorted(set(ranks))


def collective_seconds(entry: dict, layout: Layout, hw: Hardware) -> tuple[float, str]:
    """``(seconds, "intra-node" | "inter-node")`` of one ``step_comms`` entry on ``hw`` (module docstring)."""
    g = int(entry.get("group_size", 1))
    wire = max(float(entry.get("wire_bytes", 0.0)), float(entry.get("recv_wire_bytes", 0.0)))  # (sends and receives)
    if g <= 1 or wire <= 0:
        return 0.0, "intra-node"
    ranks = group_ranks(entry.get("dims", ()), layout, g)
    gpn = hw.gpus_per_node
    eff = hw.efficiency["collective"]
    lat = hw.collective_latency_s * float(entry.get("calls", 1))
    nodes = {r // gpn for r in ranks}
    if len(nodes) == 1:
        return wire / (hw.intra_node_bytes_per_s * eff) + lat, "intra-node"
    if entry.get("collective") == "all_to_all":
        same = sum(1 for r in ranks if r // gpn == ranks[0] // gpn) - 1
        out = (len(ranks) - 1 - same) / max(1, len(ranks) - 1)
        t = max(wire * (1 - out) / hw.intra_node_bytes_per_s, wire * out / hw.inter_node_bytes_per_s) / eff
        return t + lat, "inter-node"
    return wire / (hw.inter_node_bytes_per_s * eff) + lat, "inter-node"


def activation_bytes_per_token(cfg: ModelConfig, dtype: str) -> float:
    """Bytes each token's activations take in one forward of all decoder layers (kept as without recompute): per
    layer its mixer (``_kda`` / ``_dsa``), its feed-forward (dense ``_mlp``; MoE: ``_moe``'s norm, ``k`` routed rows of
    ``6 I a`` and the shared expert's ``6 Is a``), two mHC calls (``_hc``) and its ``n`` fp32 input streams."""
    s = _Sizes(a=DTYPE_BYTES[dtype])
    n, D = cfg.hc_mult, cfg.hidden_size
    total = 0.0
    for i, kind in enumerate(cfg.layer_types):
        if kind == KDA:
            mixer = _kda(cfg, s)
        elif kind == DSA:
            mixer = _dsa(cfg, s, cfg.indexer_types[i] == "full")
        else:  # pragma: no cover - layer kinds are KDA or DSA
            mixer = 0.0
        if cfg.mlp_layer_types[i] == "sparse":
            shared = cfg.moe_intermediate_size * cfg.n_shared_experts
            ffn = _moe(cfg, s) - 8 + 6 * s.a * (cfg.num_experts_per_tok * cfg.moe_intermediate_size + shared)
        else:
            ffn = _mlp(cfg, s)
        total += mixer + ffn + 2 * _hc(cfg, s) + n * D * s.f
    return total


def unit_dtype(unit: str, dtype: str) -> str:
    """The peak (a ``Hardware.dtype_flops`` key) that FLOPs of ``unit`` (``genoctx.plan.flops.UNITS``) run at in a
    run of compute dtype ``dtype`` ("bf16" or "fp32"): ``run`` -> ``dtype``; ``run_tf32`` -> ``dtype``, ``tf32`` in
    an fp32 run; ``fp32`` and ``tf32`` -> themselves.

    Raises:
        ValueError: an unknown unit.
    """
    if unit == "run":
        return dtype
    if unit == "run_tf32":
        return "tf32" if dtype == "fp32" else dtype
    if unit in ("fp32", "tf32"):
        return unit
    raise ValueError(f"unknown compute unit {unit!r}")


def compute_seconds(flops: dict, cfg: ModelConfig, hw: Hardware, dtype: str) -> dict:
    """Seconds of each FLOPs component of ``flops`` (``step_flops``'s dict) at its class's efficiency, each of its
    units (``units``; a component without them runs wholly in the run's ``dtype``) at the peak ``unit_dtype``
    gives: ``{name: seconds}`` plus ``by_class`` (``{"matmul": s, "attention": s, "memory": s}``) and ``by_dtype``
    (``{peak: s}``: the seconds spent at each peak of ``hw``). ``cfg``: unused (kept for callers).

    Raises:
        GenoctxError: ``hw`` has no peak for a unit that runs (``Hardware.flops``).
    """
    out, by_class, by_dtype = {}, {"matmul": 0.0, "attention": 0.0, "memory": 0.0}, {}
    for name, c in flops["components"].items():
        cls = c["class"]
        eff = hw.efficiency["matmul" if cls == "matmul" else "attention" if cls == "attention" else "memory"]
        units = c.get("units") or {"run": c["forward"] + c["recompute"] + c["backward"]}
        t = 0.0
        for unit, f in units.items():
            if not f:
                continue
            dt = unit_dtype(unit, dtype)
            s = f / (hw.flops(dt) * eff)
            by_dtype[dt] = by_dtype.get(dt, 0.0) + s
            t += s
        out[name] = t
        by_class[cls] = by_class.get(cls, 0.0) + t
    out["by_class"] = by_class
    out["by_dtype"] = by_dtype
    return out


def step_time(flops: dict, comms: list[dict], cfg: ModelConfig, layout: Layout, hw: Hardware, *, dtype: str,
              seq_len: int, batch_size: int, model_flops_per_token: float, ops: float = 0.0,
              eager_bytes: dict | None = None) -> dict:  # fmt: skip
    """Seconds of one step on the busiest rank from its FLOPs, collectives and aten ops (module docstring: the model).

    Args:
        flops: ``genoctx.plan.flops.step_flops`` (or ``eval_flops``) of the layout.
        comms: ``genoctx.plan.comms.step_comms`` of the layout.
        cfg, layout, hw: the model, the layout, the hardware profile.
        dtype: the run's compute dtype ("bf16" or "fp32").
        seq_len, batch_size: tokens per window and windows per data-parallel rank.
        model_flops_per_token: training (or forward) FLOPs per token without recompute, for MFU.
        ops: aten ops of the step on the rank (``genoctx.plan.ops``; 0: no launch term).
        eager_bytes: ``{kind: bytes}`` the step's eager ops move (``genoctx.plan.eager``'s ``by_kind``): the
            memory-bound term under ``hw.memory_model == "eager"`` (required there).

    Returns:
        ``{"step_s", "tokens_per_s", "mfu", "bound", "compute_s", "memory_bound_s", "comm_s": {"intra-node",
        "inter-node"} (all communication), "exposed_comm_s": {...}, "compute_by_component_s": {...},
        "compute_by_dtype_s": {peak: s} (compute seconds at each peak of ``hw``), "comm_by_collective_s": {name: s},
        "hbm_bytes", "ops", "launch_s", "device_s"}``; seconds, tokens/s, MFU a fraction. ``device_s``: the step
        without the launch term.
    """
    comp = compute_seconds(flops, cfg, hw, dtype)
    comp_by = {k: v for k, v in comp.items() if k not in ("by_class", "by_dtype")}
    compute_s = sum(comp_by.values())
    passes = 2 * (1 + flops["recompute"] / flops["forward"] if flops["forward"] else 1) + (
        4 if flops["backward"] else 0)  # fmt: skip
    if hw.memory_model == "eager":
        if eager_bytes is None:
            raise ValueError("step_time: a profile with memory_model eager needs eager_bytes")
        streamed = eager_bytes.get("elementwise", 0.0) + eager_bytes.get("matmul", 0.0)
        gathered = eager_bytes.get("gather", 0.0)
        hbm = streamed + gathered
        memory_s = streamed / (hw.hbm_bytes_per_s * hw.efficiency["memory"]) + gathered / (
            hw.hbm_bytes_per_s * hw.efficiency["gather"])  # fmt: skip
    else:
        hbm = activation_bytes_per_token(cfg, dtype) * flops["tokens"] * passes
        memory_s = hbm / (hw.hbm_bytes_per_s * hw.efficiency["memory"])
    busy = compute_s + memory_s
    hidden = {"intra-node": 0.0, "inter-node": 0.0}
    exposed = {"intra-node": 0.0, "inter-node": 0.0}
    by_name, first = {}, {"intra-node": 0.0, "inter-node": 0.0}
    units = cfg.num_hidden_layers + 1
    for e in comms:
        t, link = collective_seconds(e, layout, hw)
        by_name[e["name"]] = by_name.get(e["name"], 0.0) + t
        if e["name"].startswith(OVERLAPPED_PREFIXES):
            hidden[link] += t
            if e["name"].startswith("fsdp_all_gather_forward") or e["name"].startswith("fsdp_reduce_scatter"):
                first[link] += t / units  # the step's first gather and last reduce-scatter: nothing to hide behind
        else:
            exposed[link] += t
    overlapped = sum(hidden.values())
    spill = max(0.0, overlapped - busy)
    for link in exposed:
        share = hidden[link] / overlapped if overlapped else 0.0
        exposed[link] += spill * share + first[link]
    device_s = busy + sum(exposed.values())
    launch_s = ops * hw.op_host_s
    step_s = max(device_s, launch_s) if hw.host_overlaps_device else device_s + launch_s
    tokens = batch_size * seq_len * layout.dp
    parts = {"compute": compute_s, "memory-bound kernels": memory_s, **exposed, "launch": launch_s}
    return {
        "step_s": step_s,
        "tokens_per_s": tokens / step_s if step_s else float("inf"),
        "mfu": model_flops_per_token * tokens / (layout.world * hw.flops("bf16") * step_s) if step_s else 0.0,
        "bound": max(parts, key=parts.get),
        "compute_s": compute_s,
        "memory_bound_s": memory_s,
        "comm_s": _link_totals(comms, layout, hw),
        "exposed_comm_s": exposed,
        "compute_by_component_s": comp_by,
        "compute_by_dtype_s": comp["by_dtype"],
        "comm_by_collective_s": by_name,
        "hbm_bytes": hbm,
        "ops": ops,
        "launch_s": launch_s,
        "device_s": device_s,
    }


def _link_totals(comms: list[dict], layout: Layout, hw: Hardware) -> dict:
    out = {"intra-node": 0.0, "inter-node": 0.0}
    for e in comms:
        t, link = collective_seconds(e, layout, hw)
        out[link] += t
    return out


def plan_time(cfg: ModelConfig, seq_len: int, layout: Layout, hw: Hardware, *, batch_size: int = 1,
              recompute: bool = True, dtype: str = "bf16", skew: float = 1.0, seq_chunk_tokens: int | None = None,
              mode: str = "train", trainable=None) -> dict:  # fmt: skip
    """Predicted seconds of one training step (``mode="eval"``: of scoring one window) of ``cfg`` on ``layout`` and
    ``hw``: ``step_time`` of ``step_flops`` / ``eval_flops`` and ``step_comms``, with the inputs recorded.

    Args:
        cfg: the architecture (its compute knobs: ``kda_kernel`` and ``kernels`` pick the KDA core's and the sparse
            attention's units, ``genoctx.plan.flops``).
        seq_len: tokens per window; batch_size: windows per data-parallel rank.
        layout: the parallel layout; hw: the hardware profile (``load_hardware``).
        recompute: activation checkpointing of the decoder layers; dtype: "bf16" or "fp32".
        skew: busiest / mean expert rows of a rank (1 balanced; ``genoctx.plan.flops.PUBLISHED_SKEW`` ~4 on real DNA).
        seq_chunk_tokens: the chunked backward's chunk (``train.seq_chunk_tokens``), or None for one pass.
        mode: "train" or "eval".
        trainable: what trains (``genoctx.plan.trainable.Trainable``, train only): LoRA's FLOPs, the frozen tensors'
            all-gathers at their dtype and no reduce-scatter for them. None: full training.

    Returns:
        ``step_time``'s dict plus ``"hardware"`` (its name), ``"skew"``, ``"flops"`` (this rank's step total) and
        ``"comm_bytes"`` (this rank's wire bytes).

    Raises:
        ValueError: as ``step_flops`` and ``step_comms``; an unknown ``mode``.
    """
    from .comms import step_comms
    from .eager import eval_bytes, step_bytes
    from .flops import eval_flops, flops_per_token, step_flops
    from .ops import eval_ops, step_ops

    if mode not in ("train", "eval"):
        raise ValueError(f"mode must be train or eval, got {mode!r}")
    if mode == "train":
        fl = step_flops(cfg, seq_len, layout, batch_size=batch_size, recompute=recompute,
                        seq_chunk_tokens=seq_chunk_tokens, skew=skew, trainable=trainable)  # fmt: skip
        ops = step_ops(cfg, seq_len, layout, batch_size=batch_size, recompute=recompute,
                       seq_chunk_tokens=seq_chunk_tokens, trainable=trainable)["total"]  # fmt: skip
        eager = step_bytes(cfg, seq_len, layout, batch_size=batch_size, recompute=recompute,
                           seq_chunk_tokens=seq_chunk_tokens) if hw.memory_model == "eager" else None  # fmt: skip
    else:
        fl = eval_flops(cfg, seq_len, layout)
        ops = eval_ops(cfg, seq_len, layout)["total"]
        eager = eval_bytes(cfg, seq_len, layout) if hw.memory_model == "eager" else None
    comms = step_comms(cfg, seq_len, layout, batch_size=batch_size, recompute=recompute, dtype=dtype, skew=skew,
                       seq_chunk_tokens=seq_chunk_tokens, mode=mode,
                       trainable=trainable if mode == "train" else None)  # fmt: skip
    per_token = flops_per_token(cfg, seq_len)["train" if mode == "train" else "forward"]["total"]
    out = step_time(fl, comms, cfg, layout, hw, dtype=dtype, seq_len=seq_len,
                    batch_size=batch_size if mode == "train" else 1, model_flops_per_token=per_token,
                    ops=ops, eager_bytes=eager["by_kind"] if eager else None)  # fmt: skip
    out.update(hardware=hw.name, skew=skew, flops=fl["total"], comm_bytes=sum(e["wire_bytes"] for e in comms),
               forward_share=fl["forward"] / fl["total"] if fl["total"] else 1.0)  # fmt: skip
    return out


def host_seconds(plan: dict, t: dict, hw: Hardware) -> dict:
    """Seconds the memory knobs add to a training step (``plan_memory``'s ``plan`` with ``plan_time``'s ``t``).

    - Copies between host and device (``plan["host_device_bytes"]``: the offloaded layer inputs, and under
      ``optimizer_offload`` the fp32 shards each all-gather reads and the gradients written back) at
      ``host_device_bytes_per_s x efficiency["host_copy"]``. The copies to host run on a side stream beside the
      forward (its share of the busy time, by FLOPs) and the optimizer offload's copies to the device on FSDP2's
      all-gather path beside the recompute and backward: only what exceeds that compute is exposed. A layer input's
      copy back runs on the compute stream right before its recompute (``genoctx.parallel.offload``: not
      prefetched): all exposed. So is a host-held fp8 holder's copy (``frozen_dtype="fp8"`` under ``optimizer_offload``,
      ``host_device_bytes["frozen_fp8"]``: ``genoctx.model.fp8.fetch`` copies each use's bytes on the compute stream
      right before the matmul that reads them).
    - ``optimizer_offload``: AdamW runs on the host over the rank's shard, streaming the fp32 master and gradient and
      both moments in and the master and moments out (``12 + 4 m`` bytes per local parameter, ``m`` a moment's
      element size) at ``host_memory_bytes_per_s x efficiency["memory"]``, after the backward: all exposed.
    - AdamW moments in bf16 on the device: no cost here (the optimizer step is not modelled, ``step_time``).

    Returns:
        ``{"copies": s, "cpu_optimizer": s, "link_needed": bytes/s}`` (0 without the knobs; None where the profile
        has no host rates); ``link_needed`` is the host-device bandwidth, each way, at which the copies would hide
        behind the compute they overlap (the copies back of layer inputs and the fp8 fetches, which overlap nothing,
        left out).
    """
    moved = plan.get("host_device_bytes") or {"to_host": 0.0, "to_device": 0.0}
    out = {"copies": 0.0, "cpu_optimizer": 0.0, "link_needed": 0.0}
    if moved["to_host"] or moved["to_device"]:
        busy = t["compute_s"] + t["memory_bound_s"]
        fwd = busy * t.get("forward_share", 1.0)
        exposed = moved.get("activations", 0.0) + moved.get("frozen_fp8", 0.0)  # on the compute stream
        hid = [(moved["to_host"], fwd), (moved["to_device"] - exposed, busy - fwd)]
        out["link_needed"] = max((b / s if s > 0 else float("inf")) if b else 0.0 for b, s in hid)
        if hw.host_device_bytes_per_s is None:
            out["copies"] = None
        else:
            bw = hw.host_device_bytes_per_s * hw.efficiency["host_copy"]
            busy = t["compute_s"] + t["memory_bound_s"]
            fwd = busy * t.get("forward_share", 1.0)
            back = max(0.0, (moved["to_device"] - exposed) / bw - (busy - fwd)) + exposed / bw
            out["copies"] = max(0.0, moved["to_host"] / bw - fwd) + back
    if plan.get("optimizer_offload"):
        if hw.host_memory_bytes_per_s is None:
            out["cpu_optimizer"] = None
        else:
            m = 2 if plan.get("optimizer_state_dtype") == "bf16" else 4
            params = plan.get("trainable_params_per_rank", sum(plan["params_per_rank"].values()))
            out["cpu_optimizer"] = (12 + 4 * m) * params / (hw.host_memory_bytes_per_s * hw.efficiency["memory"])
    return out


def gpu_hours(step_s: float, steps: int, world: int) -> float:
    """GPU-hours of ``steps`` steps of ``step_s`` seconds on ``world`` GPUs."""
    return step_s * steps * world / 3600.0


TIME_KEYS = ("step_s", "tokens_per_s", "mfu", "bound", "compute_s", "compute_by_dtype_s", "memory_bound_s",
             "exposed_comm_s", "comm_s", "hardware", "skew", "host_s", "ops", "launch_s", "device_s")  # fmt: skip


def add_time(plans: list[dict], cfg: ModelConfig, hw: Hardware, *, skew: float = 1.0) -> list[dict]:
    """Put ``"time"`` (``plan_time``'s ``TIME_KEYS``) into each plan of ``plan_memory`` / ``plan_eval`` /
    ``search_layouts``, for the plan's own layout, window, batch, dtype, recompute and chunk. Returns ``plans``.

    Raises:
        ValueError: as ``plan_time``.
    """
    from .trainable import check_trainable

    for p in plans:
        lay = Layout(**{k: v for k, v in p["layout"].items() if k != "world"})
        mode = p.get("mode", "train")
        tr = p.get("trainable")
        tr = (
            None
            if tr is None
            else check_trainable(
                tr["trainable"],
                tr["lora_rank"],
                tr["frozen_dtype"],
                tuple(tr["lora_targets"]) if tr["lora_targets"] else None,
            )
        )
        t = plan_time(cfg, p["seq_len"], lay, hw, batch_size=p.get("batch_size", 1), dtype=p["dtype"], skew=skew,
                      recompute=p.get("recompute", False), seq_chunk_tokens=p.get("seq_chunk_tokens"),
                      mode=mode, trainable=tr)  # fmt: skip
        with_host_time(t, p if mode == "train" else None, hw)
        p["time"] = {k: t[k] for k in TIME_KEYS}
    return plans


def with_host_time(t: dict, plan: dict | None, hw: Hardware) -> dict:
    """``plan_time``'s ``t`` with ``"host_s"`` (``host_seconds`` of the training ``plan``; zeros for None) added to
    its step: ``step_s``, ``tokens_per_s`` and ``mfu`` rescaled, ``bound`` "host" when that is the largest part.
    Returns ``t``."""
    t["host_s"] = host_seconds(plan, t, hw) if plan is not None else {"copies": 0.0, "cpu_optimizer": 0.0,
                                                                       "link_needed": 0.0}  # fmt: skip
    extra = sum(v for k, v in t["host_s"].items() if v and k != "link_needed")
    if extra:
        scale = t["step_s"] / (t["step_s"] + extra)
        t["step_s"] += extra
        t["tokens_per_s"] *= scale
        t["mfu"] *= scale
        if extra > max(t["compute_s"], t["memory_bound_s"], *t["exposed_comm_s"].values(), t.get("launch_s", 0.0)):
            t["bound"] = "host"
    return t


def rank_by_throughput(plans: list[dict]) -> list[dict]:
    """``plans`` (each with ``"time"``: ``add_time``) ordered as ``genoctx plan --rank-by throughput`` lists them:
    those that fit first, the most tokens/s first, ties by less memory; then those that do not fit, nearest to fitting
    first (``genoctx.plan.search.closeness``, as ``--rank-by memory``: the closest is the same whatever the order)."""
    from .search import closeness

    fitting = sorted((p for p in plans if p["fits"]), key=lambda p: (-p["time"]["tokens_per_s"], p["total_gib"]))
    return fitting + sorted((p for p in plans if not p["fits"]), key=closeness)
