"""``genoctx plan``: memory and time of a layout before any GPU is rented."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from ..errors import GenoctxError
from .common import _alias, _at_least, _Command, _emit_json, _setup_logging, _size, _user_errors, app
from .options import ChunkTokens, Cp, Ep, EpFolded, Fsdp


@app.command(cls=_Command)
@_user_errors
def plan(
    preset: Annotated[str | None, typer.Option(help="Preset name: tiny, cpu-small, glm-5.3-flash.")] = None,
    hf: Annotated[
        Path | None, typer.Option("--hf", help="The config.json of an HF glm5_next model directory (no weights).")
    ] = None,
    recipe: Annotated[
        Path | None,
        typer.Option(help="A recipe: its model (a preset, or model.init's config.json), batch, dtype and loss."),
    ] = None,
    seq_len: Annotated[
        str | None,
        typer.Option(
            "--seq-len", metavar="SIZE", help="Window length in tokens (k/M suffixes); default recipe's or 1M."
        ),
    ] = None,
    gpus: Annotated[
        int,
        typer.Option(
            "--gpus",
            "--num-workers",
            help="Number of GPUs (ranks): the layouts' world size; --num-workers as in train and eval.",
        ),
    ] = 1,
    gpu_memory_gib: Annotated[
        float | None, typer.Option(help="Memory of one GPU in GiB (default the --hardware profile's; B200: 178).")
    ] = None,
    hardware: Annotated[
        str,
        typer.Option(
            "--hardware",
            metavar="NAME|FILE",
            help="GPU profile for step time and tokens/s: h100, h200, b200, or a YAML file with the same keys "
            "(genoctx.plan.hardware).",
        ),
    ] = "b200",
    skew: Annotated[
        str,
        typer.Option(
            metavar="X|published",
            help="Expert routing skew, busiest / mean expert tokens of a rank (1 balanced; 'published' the ~4x the "
            "published run saw on real DNA).",
        ),
    ] = "1",
    rank_by: Annotated[
        str, typer.Option("--rank-by", help="Order of the layouts that fit: memory (most headroom) or throughput.")
    ] = "memory",
    dp_replicate: Annotated[int | None, typer.Option(help="Data-parallel replicas (default: the rest).")] = None,
    ep: Ep = None,
    ep_folded: EpFolded = False,
    fsdp: Fsdp = None,
    cp: Cp = None,
    no_recompute: Annotated[
        bool, typer.Option("--no-recompute", help="No activation checkpointing of the decoder layers.")
    ] = False,
    offload_optimizer: Annotated[
        bool, typer.Option("--offload-optimizer", help="Masters, gradients and AdamW state in host memory (FSDP2).")
    ] = False,
    optimizer_state_dtype: Annotated[
        str | None,
        typer.Option(help="AdamW moments in fp32 or bf16 (train.optimizer_state_dtype; default the recipe's or fp32)."),
    ] = None,
    offload_activations: Annotated[
        bool,
        typer.Option(
            "--offload-activations",
            help="The checkpointed layers' inputs in host memory (train.offload_activations; needs recompute).",
        ),  # fmt: skip
    ] = False,
    knobs: Annotated[
        str,
        typer.Option(
            help="none, or auto: each layout with the first memory knobs that make it fit (activation "
            "offload, bf16 AdamW moments, both, optimizer offload; genoctx.plan.search.KNOB_COMBOS)."
        ),
    ] = "none",  # fmt: skip
    host_memory_gib: Annotated[
        float | None,
        typer.Option(
            help="Host memory per GPU in GiB that offloaded state must fit in (default the --hardware "
            "profile's, e.g. 238 on a DGX B200)."
        ),  # fmt: skip
    ] = None,
    batch_size: Annotated[
        int | None, typer.Option(help="Windows per data-parallel rank per step (default the recipe's or 1).")
    ] = None,
    dtype: Annotated[str | None, typer.Option(help="bf16 or fp32 (default the recipe's train.dtype or bf16).")] = None,
    format_: Annotated[str, typer.Option("--format", help="table or json (on stdout).")] = "table",
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Also build the model on the layout (the given one, else the best the search picks) with a fake "
            "process group on the meta device and count rank 0's and the last rank's bytes (genoctx.train.dryrun).",
        ),
    ] = False,
    eval_: Annotated[
        bool,
        typer.Option(
            "--eval",
            help="Plan scoring one window (genoctx eval, one process or --num-workers): forward only, no gradients, "
            "no optimizer (genoctx.plan.plan_eval).",
        ),
    ] = False,
    chunk_tokens: ChunkTokens = None,
    cp_layout: Annotated[
        str, typer.Option("--cp-layout", help="With --eval: contiguous or zigzag CP pieces (genoctx eval's).")
    ] = "contiguous",
    seq_chunk: Annotated[
        str | None,
        typer.Option(
            "--seq-chunk",
            metavar="SIZE|auto",
            help="Each window as consecutive chunks of this many tokens (k/M suffixes; under CP each rank's chunk "
            "of its piece), as train's and eval's --seq-chunk. Training: train.seq_chunk_tokens; 'auto': per layout "
            "one pass if it fits, else the largest chunk that fits (default: the recipe's train.seq_chunk_tokens, "
            "else one pass). With --eval: eval's streaming chunk with the carried cache (default whole windows; "
            "old name --chunk-tokens).",
        ),
    ] = None,
    trainable: Annotated[
        str,
        typer.Option(
            help="What trains (train.trainable): all, or a comma list of lora and the groups kda, dsa, "
            "indexer, router, experts, shared_experts, dense_mlp, mhc, norms, embed, head; the rest is frozen "
            "(weights only, in --frozen-dtype)."
        ),  # fmt: skip
    ] = "all",
    lora_rank: Annotated[
        int | None,
        typer.Option(help="LoRA rank (train.lora_rank) when --trainable names lora (default 16 then, else 0)."),
    ] = None,
    frozen_dtype: Annotated[
        str, typer.Option(help="Frozen weights in bf16 or fp8 (block-scaled e4m3, fp32 scales; train.frozen_dtype).")
    ] = "bf16",
    lora_targets: Annotated[
        str | None,
        typer.Option(
            help="Comma list of LoRA target modules / expert parameters by name suffix (train.lora_targets; "
            "default what train adapts: the KDA and MLA projections, dense and shared MLPs, routed "
            "experts)."
        ),  # fmt: skip
    ] = None,
) -> None:
    """Predict GPU memory per rank of one training step, by component, and its step time, tokens/s, MFU and what
    bounds it, for a model x window x parallel layout x GPU (--hardware). With --eval: of scoring one window in
    evaluation instead (the peak of one forward, no gradients).

    With none of --dp-replicate/--ep/--fsdp/--cp every layout of --gpus ranks is planned and those that fit are
    listed, best first (the table shows the top 10; none fitting: those nearest to fitting on the GPU and the host,
    whatever --rank-by). When no training step fits in one pass but one in chunks would, the table and the JSON
    (`hint`) name the --seq-chunk that fits; when --knobs auto would find layouts, `knobs_hint` says so. See
    genoctx/plan/ (memory.py) for every formula and assumption, and `bench/plan_vs_measured.py` for measured errors.

    Examples:
      genoctx plan --preset glm-5.3-flash --seq-len 1M --gpus 64 --gpu-memory-gib 178
      genoctx plan --preset glm-5.3-flash --seq-len 128k --gpus 64 --ep 2 --fsdp 2 --cp 16 --format json
      genoctx plan --recipe recipes/cpu-small.yaml --seq-len 16k --gpus 4 --gpu-memory-gib 8
      genoctx plan --dry-run --preset glm-5.3-flash --seq-len 1M --gpus 64 --cp 64
      genoctx plan --eval --preset glm-5.3-flash --seq-len 512k --gpus 64 --gpu-memory-gib 178
      genoctx plan --eval --seq-chunk 4k --preset glm-5.3-flash --seq-len 1M --gpus 64 --format json
      genoctx plan --preset glm-5.3-flash --seq-len 1M --gpus 64 --seq-chunk auto
      genoctx plan --preset glm-5.3-flash --seq-len 256k --gpus 64 --rank-by throughput --skew published
      genoctx plan --preset glm-5.3-flash --seq-len 1M --gpus 64 --hardware h200 --gpu-memory-gib 139
      genoctx plan --preset glm-5.3-flash --seq-len 1M --gpus 32 --gpu-memory-gib 178 --knobs auto
      genoctx plan --preset glm-5.3-flash --seq-len 512k --gpus 8 --hardware h100 --trainable lora
        --frozen-dtype fp8 --knobs auto
    """
    _setup_logging(False)
    hw, skew_x, gpu_memory_gib = _plan_checks(format_, rank_by, hardware, skew, gpu_memory_gib, preset, recipe, hf,
                                              gpus, dp_replicate, ep, fsdp, cp, batch_size, dtype)  # fmt: skip
    cfg, rec = _plan_model(preset, hf, recipe)
    default_len = rec.train.seq_len if rec is not None and rec.train.seq_len else 1 << 20
    L = _size("--seq-len", seq_len) if seq_len is not None else default_len
    if L < cfg.kda_chunk_size:
        raise GenoctxError(f"--seq-len: {L} tokens is shorter than one KDA chunk ({cfg.kda_chunk_size} tokens)")
    chunk_flag = "--chunk-tokens"
    if eval_ and seq_chunk is not None:  # eval's chunk: --seq-chunk, or its old name --chunk-tokens
        if seq_chunk == "auto":
            raise GenoctxError("--seq-chunk auto chooses a training chunk; with --eval give a size (e.g. 16k)")
        (chunk_tokens, chunk_flag), seq_chunk = _alias("--seq-chunk", seq_chunk, "--chunk-tokens", chunk_tokens), None
    kwargs = _plan_kwargs(rec, eval_, gpu_memory_gib, no_recompute, offload_optimizer, batch_size, dtype, dry_run,
                          chunk_tokens, cp_layout, chunk_flag)  # fmt: skip
    if knobs not in ("none", "auto"):
        raise GenoctxError(f"--knobs must be none or auto, got {knobs!r}")
    kwargs.update(_knob_kwargs(rec, eval_, hw, optimizer_state_dtype, offload_activations, host_memory_gib, knobs,
                               no_recompute, seq_chunk))  # fmt: skip
    kwargs.update(_trainable_kwargs(eval_, dry_run, trainable, lora_rank, frozen_dtype, lora_targets))
    if not eval_:
        if seq_chunk is None:
            chunk = rec.train.seq_chunk_tokens if rec is not None else None
        else:
            chunk = "auto" if seq_chunk == "auto" else _size("--seq-chunk", seq_chunk)
        if chunk is not None:
            kwargs["seq_chunk_tokens"] = chunk
    doc: dict = {"seq_len": L, "gpus": gpus, "gpu_memory_gib": gpu_memory_gib, **({"mode": "eval"} if eval_ else {}),
                 "hardware": hw.name, "skew": skew_x, "rank_by": rank_by}  # fmt: skip
    if ep_folded and ep is None:
        raise GenoctxError("--ep-folded needs --ep (the expert-parallel size to fold into --fsdp x --cp)")
    auto, layout = kwargs.get("seq_chunk_tokens") == "auto", None
    if any(x is not None for x in (dp_replicate, ep, fsdp, cp)):
        layout, plans, shown = _plan_fixed(cfg, L, gpus, dp_replicate, ep, fsdp, cp, offload_optimizer, eval_,
                                           ep_folded, kwargs, auto, knobs, hw, skew_x, doc)  # fmt: skip
    else:
        plans, shown = _plan_search(cfg, L, gpus, eval_, knobs, kwargs, hw, skew_x, rank_by, gpu_memory_gib, doc)
    _plan_hints(doc, cfg, L, gpus, layout, kwargs, plans, shown, eval_, knobs, auto, skew_x, gpu_memory_gib)
    if dry_run:
        doc = _plan_dry_run(doc, cfg, shown, kwargs, no_recompute, eval_, offload_optimizer)
    _plan_output(doc, format_, shown, plans, gpus, gpu_memory_gib, kwargs, dry_run, eval_)


def _plan_checks(format_, rank_by, hardware, skew, gpu_memory_gib, preset, recipe, hf, gpus, dp_replicate, ep, fsdp,
                 cp, batch_size, dtype):  # fmt: skip
    """Check ``plan``'s flags before any work.

    Returns ``(hw, skew_x, gpu_memory_gib)``: the hardware profile, the skew factor and the GPU memory in GiB
    (default: the profile's). Raises GenoctxError naming the first bad flag.
    """
    if format_ not in ("table", "json"):
        raise GenoctxError(f"--format must be table or json, got {format_!r}")
    if rank_by not in ("memory", "throughput"):
        raise GenoctxError(f"--rank-by must be memory or throughput, got {rank_by!r}")
    hw, skew_x = _hardware_and_skew(hardware, skew)
    gpu_memory_gib = hw.memory_gib if gpu_memory_gib is None else gpu_memory_gib
    if sum(x is not None for x in (preset, recipe, hf)) != 1:
        raise GenoctxError("give one of --preset NAME, --hf DIR and --recipe FILE")
    for flag, value in (("--gpus", gpus), ("--dp-replicate", dp_replicate), ("--ep", ep), ("--fsdp", fsdp),
                        ("--cp", cp), ("--batch-size", batch_size)):  # fmt: skip
        _at_least(flag, value, 1)
    if not 0 < gpu_memory_gib < float("inf"):
        raise GenoctxError(f"--gpu-memory-gib: must be a positive number of GiB, got {gpu_memory_gib}")
    if dtype is not None and dtype not in ("bf16", "fp32"):
        raise GenoctxError(f"--dtype must be bf16 or fp32, got {dtype!r}")
    return hw, skew_x, gpu_memory_gib


def _plan_fixed(cfg, L, gpus, dp_replicate, ep, fsdp, cp, offload_optimizer, eval_, ep_folded, kwargs, auto, knobs,
                hw, skew_x, doc):  # fmt: skip
    """Plan the one layout given by --dp-replicate/--ep/--fsdp/--cp (sets ``doc["layouts"]``).

    Returns ``(layout, plans, shown)``. Raises GenoctxError when the layout does not suit the model or window.
    """
    from ..plan import best_seq_chunk, plan_eval, plan_memory
    from ..plan.search import AUTO_SEQ_CHUNKS, plan_with_knobs
    from ..plan.time import add_time

    layout = _plan_layout(cfg, L, gpus, dp_replicate, ep, fsdp, cp, offload_optimizer, eval_, ep_folded)
    try:
        if auto:
            kwargs.pop("seq_chunk_tokens")
            plans = [best_seq_chunk(cfg, L, layout, **kwargs)]
        elif knobs == "auto":
            plans = [plan_with_knobs(cfg, L, layout, seq_chunks=AUTO_SEQ_CHUNKS, **kwargs)]
        else:
            plans = [(plan_eval if eval_ else plan_memory)(cfg, L, layout, **kwargs)]
    except ValueError as e:
        raise GenoctxError(f"--ep/--fsdp/--cp: {e}") from None
    doc["layouts"] = add_time(plans, cfg, hw, skew=skew_x)
    shown = plans
    return layout, plans, shown


def _plan_search(cfg, L, gpus, eval_, knobs, kwargs, hw, skew_x, rank_by, gpu_memory_gib, doc):
    """Plan every layout of ``gpus`` ranks (sets ``doc``'s searched/layouts, and closest when none fits).

    Returns ``(plans, shown)``: every plan ranked, and those shown (the fitting ones, else all). Raises
    GenoctxError when no layout of the model can run the window on ``gpus`` ranks.
    """
    from ..plan import search_layouts
    from ..plan.report import short_of
    from ..plan.time import add_time, rank_by_throughput

    plans = search_layouts(cfg, L, gpus, mode="eval" if eval_ else "train",
                           **({"knobs": knobs} if not eval_ else {}), **kwargs)  # fmt: skip
    if not plans:
        piece = "CP pieces of >= linear_conv_kernel_dim - 1" if eval_ else f"pieces of >= {cfg.kda_chunk_size}"
        raise GenoctxError(
            f"--gpus {gpus}: no layout of this model can run a {L}-token window on {gpus} ranks (cp must divide "
            f"--seq-len and leave {piece} tokens, ep must divide {cfg.n_routed_experts} experts)"
        )
    add_time(plans, cfg, hw, skew=skew_x)
    if rank_by == "throughput":
        plans = rank_by_throughput(plans)
    fitting = [p for p in plans if p["fits"]]
    doc.update(searched=len(plans), layouts=fitting)
    if not fitting:  # plans: nearest to fitting first (GPU and host), whatever --rank-by
        doc["closest"] = plans[:10]
        logging.getLogger("genoctx.plan").warning(
            "%s; the closest, %s, is %s", _nothing_fits(gpus, gpu_memory_gib, kwargs, plans), _knobbed(plans[0]),
            short_of(plans[0]).removeprefix("#1 does not fit: ").replace("#1 ", ""))  # fmt: skip
    shown = fitting or plans
    return plans, shown


def _plan_hints(doc, cfg, L, gpus, layout, kwargs, plans, shown, eval_, knobs, auto, skew_x, gpu_memory_gib) -> None:
    """Add the skew note and, when nothing fits, the --knobs auto and --seq-chunk hints to ``doc`` (and log them).

    Raises GenoctxError when the chunked layouts do not suit the model or window.
    """
    from ..plan import describe_layout, seq_chunk_hint
    from ..plan.report import skew_note

    if (note := skew_note(skew_x, shown[:10])) is not None:
        doc["skew_note"] = note
        logging.getLogger("genoctx.plan").warning("%s", note)
    if not eval_ and knobs == "none" and "seq_chunk_tokens" not in kwargs and not any(p["fits"] for p in plans):
        if (khint := _knobs_hint(cfg, L, gpus, layout, kwargs)) is not None:  # would --knobs auto find layouts?
            doc["knobs_hint"] = khint
    if not eval_ and not auto and not any(p["fits"] for p in plans):  # does chunking fit? (--seq-chunk auto's pick)
        try:
            hint = seq_chunk_hint(cfg, L, gpus, layout=layout, **kwargs)
        except ValueError as e:
            raise GenoctxError(f"--ep/--fsdp/--cp: {e}") from None
        if hint is not None:
            lay = hint["layout"]
            sizes = (("--ep", "ep"), ("--fsdp", "dp_shard"), ("--cp", "cp"))
            flags = " ".join([hint["flag"], *(f"{f} {lay[d]}" for f, d in sizes if lay[d] > 1),
                              *(["--ep-folded"] if lay["ep_folded"] else [])])  # fmt: skip
            hint["message"] = (f"no training step fits in {gpu_memory_gib:g} GiB as planned, but one in chunks does: "
                               f"{flags if layout is None else hint['flag']} ({describe_layout(hint)}, "
                               f"{hint['total_gib']:.2f} GiB per GPU); --seq-chunk auto plans every layout "
                               "chunked")  # fmt: skip
            doc["hint"] = hint
            logging.getLogger("genoctx.plan").warning("%s", hint["message"])


def _plan_dry_run(doc, cfg, shown, kwargs, no_recompute, eval_, offload_optimizer) -> dict:
    """Build the first shown layout's model (fake process group, meta device).

    Returns ``doc`` with the simulated ranks' bytes as its first key, ``dry_run``.
    """
    from ..parallel.layout import Layout
    from ..train.dryrun import dry_run as run_dry

    lay = Layout(**{d: shown[0]["layout"][d] for d in ("dp_replicate", "ep", "dp_shard", "cp", "ep_folded")},
                 fsdp_one=shown[0]["layout"].get("fsdp_one", False))  # fmt: skip
    doc = {
        "dry_run": run_dry(
            cfg,
            lay,
            activation_checkpointing=not (no_recompute or eval_),
            dtype=kwargs["dtype"],
            optimizer_offload=shown[0].get("optimizer_offload", offload_optimizer),
            optimizer_state_dtype=shown[0].get("optimizer_state_dtype", "fp32"),
            **{k: kwargs[k] for k in ("trainable", "lora_rank", "frozen_dtype", "lora_targets") if k in kwargs},
        ),
        **doc,
    }  # fmt: skip (the plan's knobs: --knobs auto may have turned optimizer offload or bf16 moments on)
    return doc


def _plan_output(doc, format_, shown, plans, gpus, gpu_memory_gib, kwargs, dry_run, eval_) -> None:
    """Write ``plan``'s result to stdout: ``doc`` as JSON, or the table with its hints and dry run."""
    from ..plan import format_table

    if format_ == "json":
        _emit_json(doc)
        return
    if doc.get("layouts") == [] and "closest" in doc:
        sys.stdout.write(f"{_nothing_fits(gpus, gpu_memory_gib, kwargs, plans)}; nearest to fitting first:\n")
    sys.stdout.write(format_table(shown) + "\n")
    if "knobs_hint" in doc:
        sys.stdout.write("\nhint: " + doc["knobs_hint"]["message"] + "\n")
    if "hint" in doc:
        sys.stdout.write("\nhint: " + doc["hint"]["message"] + "\n")
    if dry_run:
        sys.stdout.write("\n" + _format_dry_run(doc["dry_run"], shown[0], eval_) + "\n")
    sys.stdout.flush()



def _knobs_hint(cfg, seq_len: int, gpus: int, layout, kwargs: dict) -> dict | None:
    """``genoctx.plan.search.knobs_hint`` with its ``"message"`` (logged as a warning), or None when ``--knobs auto``
    finds nothing that fits either.

    Raises:
        GenoctxError: the layout flags are refused (``--ep/--fsdp/--cp``).
    """
    from ..plan.search import knobs_hint

    try:
        hint = knobs_hint(cfg, seq_len, gpus, layout=layout, **kwargs)
    except ValueError as e:
        raise GenoctxError(f"--ep/--fsdp/--cp: {e}") from None
    if hint is None:
        return None
    k = hint["fitting"]
    found = f"finds {k} layout{'s' if k > 1 else ''} that fit{'s' if k == 1 else ''}; first" if layout is None else (
        "fits it:")  # fmt: skip
    hint["message"] = (f"nothing fits without more memory knobs, but --knobs auto {found} {_knobbed(hint)}, "
                       f"{hint['total_gib']:.2f} GiB per GPU (host {hint['host_gib']:.1f} GiB per GPU)")  # fmt: skip
    logging.getLogger("genoctx.plan").warning("%s", hint["message"])
    return hint


def _nothing_fits(gpus: int, gpu_memory_gib: float, kwargs: dict, plans: list[dict]) -> str:
    """``"no layout of 8 GPUs fits in 178 GiB (and 238 GiB of host per GPU)"``: what `genoctx plan` searched (the
    host when one of ``plans`` offloads state to it)."""
    host = kwargs.get("host_memory_gib") if any(p.get("host_gib") for p in plans) else None
    return f"no layout of {gpus} GPUs fits in {gpu_memory_gib:g} GiB" + (
        f" (and {host:g} GiB of host per GPU)" if host else "")  # fmt: skip


def _knobbed(p: dict) -> str:
    """A plan's (or hint's) layout in words, with its memory knobs and chunk when it has them."""
    from ..plan.report import KNOB_SHORT, describe_layout

    knobs = ",".join(KNOB_SHORT.get(k, k) for k in p.get("knobs") or [])
    chunk = p.get("seq_chunk_tokens")
    return describe_layout(p) + (f" with {knobs}" if knobs else "") + (
        f" in {chunk >> 10 if chunk % 1024 == 0 else chunk}{'k' if chunk % 1024 == 0 else ''}-token chunks"
        if chunk else "")  # fmt: skip


def _trainable_kwargs(eval_, dry_run, trainable, lora_rank, frozen_dtype, lora_targets) -> dict:
    """``plan_memory``'s ``trainable``, ``lora_rank``, ``frozen_dtype``, ``lora_targets`` from ``genoctx plan``'s flags
    (empty when every parameter trains: the plan as before).

    Raises:
        GenoctxError: the flags with --eval, a bad group list, rank or dtype
            (``genoctx.plan.trainable.check_trainable``).
    """
    from ..plan.trainable import check_trainable

    given = trainable != "all" or lora_rank or frozen_dtype != "bf16" or lora_targets is not None
    if not given:
        return {}
    if eval_:
        raise GenoctxError("--trainable, --lora-rank, --frozen-dtype and --lora-targets are about a training step; "
                           "--eval plans scoring one window")  # fmt: skip
    rank = lora_rank if lora_rank is not None else (16 if "lora" in trainable.replace(" ", "").split(",") else 0)
    targets = tuple(t.strip() for t in lora_targets.split(",") if t.strip()) if lora_targets is not None else None
    try:
        tr = check_trainable(trainable, rank, frozen_dtype, targets)
    except ValueError as e:
        raise GenoctxError(f"--trainable/--lora-rank/--frozen-dtype/--lora-targets: {e}") from None
    return dict(trainable=tr.spec, lora_rank=tr.lora_rank, frozen_dtype=tr.frozen_dtype, lora_targets=tr.lora_targets)


def _knob_kwargs(rec, eval_, hw, optimizer_state_dtype, offload_activations, host_memory_gib, knobs, no_recompute,
                 seq_chunk) -> dict:  # fmt: skip
    """``plan_memory``'s memory-knob arguments from ``genoctx plan``'s flags, the recipe and the hardware profile.

    Raises:
        GenoctxError: a knob flag with --eval, a bad --optimizer-state-dtype or --host-memory-gib, activation offload
            with --no-recompute, --knobs auto with --seq-chunk.
    """
    given = optimizer_state_dtype is not None or offload_activations or knobs != "none"
    if eval_:
        if given:
            raise GenoctxError("--optimizer-state-dtype, --offload-activations and --knobs are about a training step; "
                               "--eval plans scoring one window")  # fmt: skip
        return {}
    t = rec.train if rec is not None else None
    osd = optimizer_state_dtype or (t.optimizer_state_dtype if t is not None else "fp32")
    if osd not in ("fp32", "bf16"):
        raise GenoctxError(f"--optimizer-state-dtype must be fp32 or bf16, got {osd!r}")
    off = offload_activations or (t is not None and t.offload_activations)
    if off and no_recompute:
        raise GenoctxError("--offload-activations offloads the checkpointed layers' inputs: not with --no-recompute")
    if knobs == "auto" and seq_chunk is not None:
        raise GenoctxError("--knobs auto plans one pass per layout: not with --seq-chunk")
    host = hw.host_memory_gib if host_memory_gib is None else host_memory_gib
    if host is not None and not 0 < host < float("inf"):
        raise GenoctxError(f"--host-memory-gib: must be a positive number of GiB, got {host}")
    return dict(optimizer_state_dtype=osd, offload_activations=off, host_memory_gib=host)


def _hardware_and_skew(hardware: str, skew: str):
    """``genoctx plan``'s ``--hardware`` profile and ``--skew`` (a number >= 1, or ``published``).

    Raises:
        GenoctxError: an unknown profile or a bad file (``genoctx.plan.hardware.load_hardware``), a bad skew.
    """
    from ..plan.flops import PUBLISHED_SKEW
    from ..plan.hardware import load_hardware

    hw = load_hardware(hardware)
    if skew == "published":
        return hw, PUBLISHED_SKEW
    try:
        x = float(skew)
    except ValueError:
        x = float("nan")
    if not 1 <= x < float("inf"):
        raise GenoctxError(f"--skew: a number >= 1 (busiest / mean expert tokens) or 'published', got {skew!r}")
    return hw, x


def _plan_kwargs(rec, eval_, gpu_memory_gib, no_recompute, offload, batch_size, dtype, dry_run, chunk_tokens,
                 cp_layout, chunk_flag="--seq-chunk") -> dict:  # fmt: skip
    """The keyword arguments of ``plan_memory`` (``plan_eval`` with --eval) from ``genoctx plan``'s flags and recipe.
    ``chunk_tokens``: eval's chunk, given as ``chunk_flag`` (--seq-chunk with --eval, or the old --chunk-tokens).

    Raises:
        GenoctxError: a training flag with --eval, an eval flag without it, a bad --chunk-tokens or --cp-layout.
    """
    head = dict(loss_vocab_rows=5 if rec is not None and rec.loss.vocab == "nucleotide" else None,
                loss_chunk_tokens=rec.loss.chunk_tokens if rec is not None else 2048)  # fmt: skip
    if not eval_:
        if chunk_tokens is not None or cp_layout != "contiguous":
            raise GenoctxError(f"{'--chunk-tokens' if chunk_tokens is not None else '--cp-layout'} plans evaluation: "
                               "add --eval")  # fmt: skip
        return dict(gpu_memory_gib=gpu_memory_gib, recompute=not no_recompute, optimizer_offload=offload,
                    batch_size=batch_size or (rec.train.batch_size if rec is not None else 1),
                    dtype=dtype or (rec.train.dtype if rec is not None else "bf16"), **head)  # fmt: skip
    for flag, on in (("--no-recompute", no_recompute), ("--offload-optimizer", offload),
                     ("--batch-size", batch_size is not None)):  # fmt: skip
        if on:
            raise GenoctxError(f"{flag} is about a training step; --eval plans scoring one window (no gradients, no "
                               "optimizer)")  # fmt: skip
    if cp_layout not in ("contiguous", "zigzag"):
        raise GenoctxError(f"--cp-layout must be contiguous or zigzag, got {cp_layout!r}")
    chunk = _size(chunk_flag, chunk_tokens) if chunk_tokens is not None else None
    # eval runs bf16 under autocast on the GPU whatever the recipe trained in: --dtype only
    return dict(gpu_memory_gib=gpu_memory_gib, chunk_tokens=chunk, dtype=dtype or "bf16", cp_layout=cp_layout,
                **head)  # fmt: skip


def _format_dry_run(dr: dict, plan: dict, eval_: bool = False) -> str:
    """A few human lines of ``genoctx plan --dry-run``: per simulated rank its counted GiB next to the plan's (with
    --eval only what evaluation holds: the weights and the all-gathers; no gradients, no optimizer state)."""
    from ..parallel.layout import Layout

    gib = 2**30
    lay = Layout(**{k: v for k, v in dr["layout"].items() if k != "world"}).describe()
    lines = [f"dry run ({lay}, {dr['dtype']}, built on the meta device in {dr['seconds']:.1f} s), GiB per rank "
             "counted from the built model (plan in brackets):"]  # fmt: skip
    per = plan["persistent_gib"]
    for r in dr["ranks"]:
        g = r["largest_unsharded_group"]
        train = "" if eval_ else (f"gradients {r['gradients'] / gib:.3f} [{per['gradients']:.3f}]  optimizer "
                                  f"{r['optimizer_state'] / gib:.3f} [{per['optimizer_state']:.3f}]  ")  # fmt: skip
        if "frozen" in r:  # train.trainable: the frozen weights (in weights) and what trains, each
            train = (f"frozen {r['frozen'] / gib:.3f} [{per.get('frozen', 0.0):.3f}]  trainable params "
                     f"{r['trainable_params_local']:.4g}  " + train)  # fmt: skip
        lines.append(
            f"  rank {r['rank']:>3}: params {r['params_local']:.4g}  weights {r['weights'] / gib:.3f} "
            f"[{per['weights']:.3f}]  {train}buffers "
            f"{r['buffers'] / gib:.4f}  largest all-gather {g['bytes'] / gib:.3f} ({g['module']}; layer "
            f"{r['largest_unsharded_layer']['bytes'] / gib:.3f} [{plan['largest_layer_unsharded_gib']:.3f}])"
        )
    if plan.get("optimizer_offload") and not eval_:
        lines.append("  (weights, gradients and optimizer state above live in host memory: FSDP2's CPUOffloadPolicy)")
    return "\n".join(lines)


def _plan_model(preset, hf, recipe):
    """``(ModelConfig, Recipe or None)`` of ``genoctx plan``'s --preset / --hf / --recipe (one of them)."""
    from ..model.config import preset as get_preset

    if preset is not None:
        try:
            return get_preset(preset), None
        except KeyError as e:
            raise GenoctxError(f"--preset: {e.args[0]}") from None
    from ..model.hf import read_config

    if hf is not None:
        try:
            return read_config(hf)[0], None
        except GenoctxError as e:
            raise GenoctxError(f"--hf {e}") from None
    from ..recipes import load_recipe

    rec = load_recipe(recipe)
    return _recipe_model(rec, f"--recipe {recipe}"), rec


def _recipe_model(rec, where: str):
    """The ``ModelConfig`` a recipe trains, without loading weights: its model, or ``model.init``'s config (an HF
    directory, a genoctx run or checkpoint, or a Hub repo's config.json already in the local cache) with the
    recipe's compute knobs. ``where`` names the recipe in errors.

    Raises:
        GenoctxError: a Hub repo whose config.json is not cached (a branch, tag, full or short commit of the cache:
            ``genoctx.train.init.expand_revision``), an ambiguous short commit, or an unreadable config (named).
    """
    import dataclasses

    from ..model.hf import read_config

    if rec.init is None:
        return rec.model
    init = Path(rec.init).expanduser()
    if (init / "config.json").is_file():
        cfg = read_config(init)[0]
    elif init.is_dir():  # a genoctx run or checkpoint
        from ..train.checkpoint import load_recipe_of, resolve_checkpoint

        cfg = load_recipe_of(resolve_checkpoint(init)).model
    else:  # a Hub repo id: its config.json from the local cache only (nothing is downloaded)
        from ..train.init import expand_revision

        repo, _, revision = rec.init.partition("@")
        revision = expand_revision(repo, revision or None, f"{where}: model.init {rec.init!r}")  # a short commit
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(repo, "config.json", revision=revision)
        except Exception:  # noqa: BLE001 -- an invalid repo id or no huggingface_hub: not in the cache
            cached = None
        if not isinstance(cached, str):
            raise GenoctxError(
                f"{where}: model.init {rec.init!r} is a Hub repo whose config.json is not in the local "
                "cache; give --hf DIR (a directory with its config.json) or --preset glm-5.3-flash (the published one)"
            )
        cfg = read_config(Path(cached).parent)[0]
    return dataclasses.replace(cfg, **rec.model_knobs)


def _plan_layout(cfg, seq_len, gpus, dp_replicate, ep, fsdp, cp, offload, eval_=False, ep_folded=False):
    """The ``Layout`` of ``genoctx plan``'s layout flags (unset ones 1; --dp-replicate unset: the rest of --gpus).
    With ``eval_`` a CP piece may be shorter than a KDA chunk (``plan_eval`` checks the pieces of its CP layout).
    ``ep_folded``: the EP group drawn from ``fsdp x cp`` (``Layout.ep_folded``).

    Raises:
        GenoctxError: the sizes do not make --gpus ranks, or the model cannot run them (the flag is named).
    """
    from ..parallel.layout import Layout

    ep, fsdp, cp = ep or 1, fsdp or 1, cp or 1
    try:
        layout = Layout.for_world(gpus, ep=ep, dp_shard=fsdp, cp=cp, ep_folded=ep_folded, world_flag="--gpus")
    except ValueError as e:
        raise GenoctxError(str(e)) from None
    if dp_replicate is not None and dp_replicate != layout.dp_replicate:
        raise GenoctxError(
            f"--dp-replicate {dp_replicate} x --ep {layout.ep_axis} x --fsdp {fsdp} x --cp {cp} = "
            f"{dp_replicate * layout.world // layout.dp_replicate} ranks, not --gpus {gpus}"
        )
    moe = "sparse" in cfg.mlp_layer_types
    if (moe and cfg.n_routed_experts % ep) or (not moe and ep > 1):
        raise GenoctxError(f"--ep {ep}: must divide the {cfg.n_routed_experts if moe else 0} routed experts")
    if seq_len % cp:
        raise GenoctxError(f"--cp {cp}: must divide --seq-len {seq_len}")
    if seq_len // cp < cfg.kda_chunk_size and not eval_:
        raise GenoctxError(
            f"--cp {cp}: pieces of {seq_len // cp} tokens are shorter than one KDA chunk ({cfg.kda_chunk_size})"
        )
    if offload and not layout.fsdp:
        raise GenoctxError("--offload-optimizer needs FSDP, --fsdp > 1 or --cp > 1 (it is FSDP2's CPUOffloadPolicy)")
    return layout
