"""Layouts and search: every layout a number of GPUs can take, each planned and sorted; the sequence chunk that
makes a plan fit."""

from __future__ import annotations

from ..model.config import ModelConfig
from ..parallel.layout import LAYOUTS, Layout
from .eval_memory import plan_eval
from .memory import plan_memory


def _divisors(x: int) -> list[int]:
    return [d for d in range(1, x + 1) if x % d == 0]


def valid_layouts(cfg: ModelConfig, seq_len: int, gpus: int, *, optimizer_offload: bool = False, mode: str = "train",
                  cp_layout: str = "contiguous") -> list[Layout]:  # fmt: skip
    """Every layout of ``gpus`` ranks this model can run: ``dp_replicate x ep x dp_shard x cp == gpus``, ``ep``
    dividing ``n_routed_experts`` (1 without MoE layers), and the folded layouts (``Layout.ep_folded``:
    ``dp_replicate x dp_shard x cp == gpus``, ``ep > 1`` dividing both ``dp_shard x cp`` and the experts),
    ``cp`` dividing ``seq_len`` with pieces of at least one
    KDA chunk (``kda_chunk_size`` tokens), FSDP (``dp_shard > 1`` or ``cp > 1``; on one GPU ``fsdp_one``) when
    ``optimizer_offload``. With
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
                    if gpus > 1:
                        continue
                    lay = Layout(fsdp_one=True)  # FSDP2 on one rank (Layout.fsdp_one): what offload runs under
                out.append(lay)
        if not moe:
            continue
        for dp_shard in _divisors(gpus // cp):  # folded: the EP group drawn from dp_shard x cp (always FSDP)
            for ep in _divisors(dp_shard * cp):
                if ep > 1 and cfg.n_routed_experts % ep == 0:
                    out.append(Layout(dp_replicate=gpus // (cp * dp_shard), ep=ep, dp_shard=dp_shard, cp=cp,
                                      ep_folded=True))  # fmt: skip
    return out


# the memory knobs ``knobs="auto"`` tries on each layout, in this order (the first that fits is kept): the exact
# ones that cost little time first (activation offload: copies beside compute), then bf16 moments (changes numbers,
# costs nothing), then the optimizer on the host (exact, but AdamW on the CPU every step)
KNOB_COMBOS = (
    {},
    {"offload_activations": True},
    {"optimizer_state_dtype": "bf16"},
    {"optimizer_state_dtype": "bf16", "offload_activations": True},
    {"optimizer_offload": True},
    {"optimizer_offload": True, "offload_activations": True},
)


# the sequence chunks ``knobs="auto"`` tries when nothing fits in one pass (the chunked backward, ``--seq-chunk``),
# largest first (fewest chunks: the least boundary state and overhead)
AUTO_SEQ_CHUNKS = (1 << 16, 1 << 14)


def plan_with_knobs(cfg: ModelConfig, seq_len: int, layout: Layout, *, seq_chunks: tuple[int, ...] = (),
                    **kwargs) -> dict:  # fmt: skip
    """The plan of ``layout`` with the first of ``KNOB_COMBOS`` (on top of the knobs given in ``kwargs``) that fits;
    none fitting in one pass, the same with each of ``seq_chunks`` in turn (``seq_chunk_tokens``, those below the
    rank's ``L / cp`` tokens); none fitting at all, the one nearest to fitting (``closeness``: GPU and host
    memory). Combinations the layout cannot take (activation offload without ``recompute``, optimizer offload
    without FSDP) are skipped.

    Raises:
        ValueError: as ``plan_memory``.
    """
    best = None
    for chunk in (None, *(c for c in seq_chunks if c < seq_len // layout.cp)):
        for combo in KNOB_COMBOS:
            kw = {**kwargs, **combo, **({"seq_chunk_tokens": chunk} if chunk else {})}
            if (kw.get("offload_activations") and not kw.get("recompute", True)) or (
                    kw.get("optimizer_offload") and not layout.fsdp):  # fmt: skip
                continue
            p = plan_memory(cfg, seq_len, layout, **kw)
            if p["fits"]:
                return p
            best = p if best is None or closeness(p) < closeness(best) else best
    return best


def shortfall(plan: dict) -> float:
    """How far a plan is from fitting, as a fraction of what is available: the GPU's excess (``total_gib`` over
    ``gpu_memory_gib``, minus 1; 0 when it fits) plus the host's (``host_gib`` over ``host_memory_gib``, minus 1; 0
    when it fits or was not checked). 0.0 for a plan that fits both; a plan short by 10% of the GPU and 50% of the
    host is 0.6. Fractions, not GiB, so that a GPU of 80 GiB and a host of 238 GiB per GPU weigh alike."""
    gpu = max(0.0, plan["total_gib"] / plan["gpu_memory_gib"] - 1.0)
    host = plan.get("host_memory_gib")
    if plan.get("host_fits") is False and host:
        gpu += max(0.0, plan["host_gib"] / host - 1.0)
    return gpu


def closeness(plan: dict) -> tuple:
    """Sort key of the plans that do not fit, nearest to fitting first (the planner's "closest", whatever
    ``--rank-by``): ``shortfall``, then less GPU memory, then fewer CP and EP ranks, then more replicas."""
    lay = plan["layout"]
    return (shortfall(plan), plan["total_gib"], lay["cp"], lay["ep"], -lay["dp_replicate"])


def search_layouts(cfg: ModelConfig, seq_len: int, gpus: int, gpu_memory_gib: float, *, mode: str = "train",
                   knobs: str = "none", **kwargs) -> list[dict]:  # fmt: skip
    """``plan_memory`` (``mode="eval"``: ``plan_eval``) of every layout of ``valid_layouts``, best first.

    Order: layouts that fit first; with ``knobs="auto"`` then by ``knob_rank``; then ascending ``total_gib`` (the
    most headroom first); ties by fewer CP ranks, then fewer EP ranks, then more data-parallel replicas (less
    communication for the same memory). Then those that do not fit, nearest to fitting first (``closeness``: GPU
    and host memory; a layout that fits the GPU and not the host may come before one that is short of GPU memory).

    Args:
        cfg, seq_len, gpu_memory_gib: as ``plan_memory``.
        gpus: ranks (the layouts' world size).
        mode: ``"train"`` (one training step) or ``"eval"`` (scoring one window).
        **kwargs: the other keyword arguments of ``plan_memory`` (of ``plan_eval`` in eval). In train mode
            ``seq_chunk_tokens`` applies to every layout (under CP, to each rank's piece); ``"auto"`` plans each of
            them by ``best_seq_chunk`` (one pass when it fits), so the list says whether chunking a whole window per
            rank beats spreading it over CP ranks, or both together.
        knobs: ``"none"`` (the knobs in ``kwargs`` only) or ``"auto"`` (train, one pass: each layout with the first
            of ``KNOB_COMBOS`` that fits, ``plan_with_knobs``; its ``"knobs"`` lists them; the layouts that fit
            ordered by their knobs' place in ``KNOB_COMBOS`` first, then by memory). When no layout fits in one
            pass, each is planned again with the chunked backward (``AUTO_SEQ_CHUNKS``, ``plan_with_knobs``'s
            ``seq_chunks``), one pass ranked before 64k chunks before 16k.

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
        if knobs not in ("none", "auto"):
            raise ValueError(f"knobs must be none or auto, got {knobs!r}")
        if knobs == "auto" and chunk is not None:
            raise ValueError("knobs='auto' plans one pass: not with seq_chunk_tokens")
        lays = lays if knobs == "none" else valid_layouts(cfg, seq_len, gpus, mode=mode)
        for lay in lays:
            if knobs == "auto":
                plans.append(plan_with_knobs(cfg, seq_len, lay, gpu_memory_gib=gpu_memory_gib, **kwargs))
            elif chunk is None:
                plans.append(plan_memory(cfg, seq_len, lay, gpu_memory_gib=gpu_memory_gib, **kwargs))
            elif chunk == "auto":
                plans.append(best_seq_chunk(cfg, seq_len, lay, gpu_memory_gib=gpu_memory_gib, **kwargs))
            else:
                plans.append(plan_memory(cfg, seq_len, lay, gpu_memory_gib=gpu_memory_gib, seq_chunk_tokens=chunk,
                                         **kwargs))  # fmt: skip
        if knobs == "auto" and not any(p["fits"] for p in plans):  # nothing fits in one pass: the chunked backward
            plans = [plan_with_knobs(cfg, seq_len, lay, gpu_memory_gib=gpu_memory_gib, seq_chunks=AUTO_SEQ_CHUNKS,
                                     **kwargs) for lay in lays]  # fmt: skip
    cost = knob_rank if knobs == "auto" else (lambda p: 0)
    fitting = sorted((p for p in plans if p["fits"]), key=lambda p: (cost(p), p["total_gib"], p["layout"]["cp"],
                                                                     p["layout"]["ep"], -p["layout"]["dp_replicate"]))
    return fitting + sorted((p for p in plans if not p["fits"]), key=closeness)  # fmt: skip


def knob_rank(plan: dict) -> int:
    """The position in ``KNOB_COMBOS`` of a plan's knobs (``knobs="auto"`` lists the layouts that fit with the
    fewest, cheapest knobs first); a chunked plan after every one-pass plan, 64k chunks before 16k
    (``AUTO_SEQ_CHUNKS``)."""
    on = {k.split("=")[0] for k in plan.get("knobs") or []}
    chunk = plan.get("seq_chunk_tokens")
    n = len(KNOB_COMBOS) + 1
    extra = 0 if not chunk else n * (1 + (AUTO_SEQ_CHUNKS.index(chunk) if chunk in AUTO_SEQ_CHUNKS
                                          else len(AUTO_SEQ_CHUNKS)))  # fmt: skip
    for i, combo in enumerate(KNOB_COMBOS):
        if set(combo) == on:
            return i + extra
    return len(KNOB_COMBOS) + extra


SEQ_CHUNK_CANDIDATES = tuple(1 << k for k in range(12, 19))  # 4k .. 256k tokens


def best_seq_chunk(cfg: ModelConfig, seq_len: int, layout: Layout, **kwargs) -> dict:
    """``plan_memory`` of ``layout`` in one pass if it fits, else with the largest ``seq_chunk_tokens`` of
    ``SEQ_CHUNK_CANDIDATES`` (below the window's ``L / cp`` tokens per rank) that fits (fewest chunks: the least
    boundary state and overhead); when none fits, the candidate nearest to fitting (``closeness``).
    ``kwargs``: ``plan_memory``'s."""
    whole = plan_memory(cfg, seq_len, layout, **kwargs)
    if whole["fits"]:
        return whole
    tried = [plan_memory(cfg, seq_len, layout, seq_chunk_tokens=c, **kwargs)
             for c in SEQ_CHUNK_CANDIDATES if c < seq_len // layout.cp]  # fmt: skip
    fitting = [p for p in tried if p["fits"]]
    if fitting:
        return max(fitting, key=lambda p: p["seq_chunk_tokens"])
    return min(tried + [whole], key=closeness)


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


def knobs_hint(cfg: ModelConfig, seq_len: int, gpus: int, gpu_memory_gib: float, *, layout: Layout | None = None,
               **kwargs) -> dict | None:  # fmt: skip
    """What ``genoctx plan`` says when no training step fits with the knobs given: what ``--knobs auto`` would find.

    Args:
        cfg, seq_len, gpu_memory_gib: as ``plan_memory``.
        gpus: ranks searched when ``layout`` is None (the layouts' world size).
        layout: the one layout to plan with the knobs (``plan_with_knobs``, one pass then ``AUTO_SEQ_CHUNKS``), or
            None to search every layout of ``gpus`` ranks (``search_layouts(..., knobs="auto")``).
        **kwargs: ``plan_memory``'s other keyword arguments (``host_memory_gib`` among them: offloaded state must fit
            the host); not ``seq_chunk_tokens`` (``--knobs auto`` chooses the chunk).

    Returns:
        None when nothing fits with the knobs either, else ``{"fitting": how many layouts fit, "layout": the first's
        layout dict, "knobs": its knob list, "seq_chunk_tokens": its chunk or None, "total_gib": GiB per GPU,
        "host_gib": host GiB per GPU its offloaded state holds, "flag": "--knobs auto"}`` (the first: the order of
        ``search_layouts``' knob search, the fewest and cheapest knobs first).

    Raises:
        ValueError: as ``plan_memory`` and ``valid_layouts``; ``seq_chunk_tokens`` given.
    """
    if kwargs.get("seq_chunk_tokens") is not None:
        raise ValueError("knobs_hint chooses the chunk: not with seq_chunk_tokens")
    kwargs.pop("seq_chunk_tokens", None)
    if layout is not None:
        plans = [plan_with_knobs(cfg, seq_len, layout, gpu_memory_gib=gpu_memory_gib, seq_chunks=AUTO_SEQ_CHUNKS,
                                 **kwargs)]  # fmt: skip
    else:
        plans = search_layouts(cfg, seq_len, gpus, gpu_memory_gib, knobs="auto", **kwargs)
    fitting = [p for p in plans if p["fits"]]
    if not fitting:
        return None
    p = fitting[0]
    return {"fitting": len(fitting), "layout": p["layout"], "knobs": list(p.get("knobs") or []),
            "seq_chunk_tokens": p.get("seq_chunk_tokens"), "total_gib": p["total_gib"],
            "host_gib": p.get("host_gib", 0.0), "flag": "--knobs auto"}  # fmt: skip
