"""``genoctx train``: post-train a model (one process or Ray workers), or ``--dry-run``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from ..errors import GenoctxError
from .common import (
    _absolute_paths,
    _at_least,
    _Command,
    _data_dir,
    _device,
    _emit_json,
    _gpus_per_worker,
    _out_dir,
    _setup_logging,
    _size,
    _user_errors,
    app,
)
from .options import Device, GpusPerWorker, NumWorkers, PlacementTimeout, RayAddress, Verbose, Wait


@app.command(cls=_Command)
@_user_errors
@_absolute_paths
def train(
    data: Annotated[Path, typer.Option(help="Prepared data directory (genoctx prepare --out).")],
    out: Annotated[Path, typer.Option(help="Run directory: checkpoints/ and metrics.jsonl.")],
    recipe: Annotated[Path | None, typer.Option(help="YAML recipe (recipes/*.yaml).")] = None,
    steps: Annotated[int | None, typer.Option(help="Optimizer steps (overrides train.steps; 0 = save init).")] = None,
    resume: Annotated[
        bool,
        typer.Option(
            help="Continue the run in --out from its latest checkpoint (exactly: weights, AdamW, schedule); "
            "--out must hold a run."
        ),  # fmt: skip
    ] = False,
    allow_batch_change: Annotated[
        bool,
        typer.Option(
            "--allow-batch-change",
            help="Let --resume change the data-parallel size (--num-workers / --cp) and so the tokens per step "
            "(refused otherwise); recorded in state.json's batch_changes.",
        ),
    ] = False,
    stop_after: Annotated[
        int | None,
        typer.Option(help="End this invocation after step N >= 1 (checkpointed); --resume continues."),
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", metavar="KEY=VALUE", help="Override a recipe key: train.lr=1e-3.")
    ] = None,
    init: Annotated[
        str | None,
        typer.Option(
            "--init",
            help="Start from a pretrained base: an HF model directory or a Hub repo id (org/name[@revision]) "
            "fetched by huggingface_hub into its cache (HF_HUB_OFFLINE, HF_ENDPOINT respected); = model.init.",
        ),
    ] = None,
    device: Device = "cpu",
    num_workers: NumWorkers = None,
    cp: Annotated[
        int | None,
        typer.Option(help="Context-parallel size: workers sharing one window (pieces: --cp-layout); = train.cp."),
    ] = None,
    cp_layout: Annotated[
        str | None,
        typer.Option(
            "--cp-layout",
            metavar="LAYOUT",
            help="CP pieces: contiguous or zigzag, as eval's and plan's; = train.cp_layout.",
        ),
    ] = None,
    ep: Annotated[
        int | None, typer.Option(help="Expert-parallel size: workers splitting the routed experts; = train.ep.")
    ] = None,
    fsdp: Annotated[
        int | None,
        typer.Option(help="FSDP2 size: workers sharding parameters and optimizer state; = train.fsdp."),
    ] = None,
    ep_folded: Annotated[
        bool | None,
        typer.Option(
            "--ep-folded/--no-ep-folded",
            help="Draw the --ep group from the --fsdp x --cp workers (MoE parallel folding) instead of an axis of "
            "its own; = train.ep_folded.",
        ),
    ] = None,
    fsdp_one: Annotated[
        bool | None,
        typer.Option(
            "--fsdp-one/--no-fsdp-one",
            help="FSDP2 on one worker (--num-workers 1): bf16 mixed precision and offload_optimizer as a sharded "
            "layout runs them, on one GPU; = train.fsdp_one.",
        ),
    ] = None,
    seq_chunk: Annotated[
        str | None,
        typer.Option(
            "--seq-chunk",
            metavar="SIZE",
            help="Train each window as consecutive chunks of this many tokens (k/M suffixes), exactly (the chunked "
            "backward: memory bounded by the chunk plus the state crossing chunk boundaries); with --cp C each "
            "worker chunks its piece (rounds of C chunks); = train.seq_chunk_tokens.",
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Train even when the memory planner predicts the layout does not fit.")
    ] = False,
    gpu_memory_gib: Annotated[
        float | None,
        typer.Option(
            "--gpu-memory-gib",
            help="With --gpus-per-worker 1: memory of one worker's GPU in GiB for the memory plan before launch "
            "(default: this machine's GPU; a driver without one leaves the plan to each worker's GPU).",
        ),
    ] = None,
    address: RayAddress = None,
    gpus_per_worker: GpusPerWorker = 0,
    placement_timeout: PlacementTimeout = None,
    wait: Wait = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Build the recipe's model on the layout (fake process group, meta device) and print each simulated "
            "rank's bytes as JSON, with the planner's step time and GPU-hours for the run's steps on --hardware; no "
            "Ray, no training, --out untouched.",
        ),
    ] = False,
    hardware: Annotated[
        str | None,
        typer.Option(
            "--hardware",
            metavar="NAME|FILE",
            help="With --dry-run: the GPU profile of the predicted step time (h100, h200, b200 or a YAML file; "
            "default b200).",
        ),
    ] = None,
    logger: Annotated[
        list[str] | None,
        typer.Option(
            "--logger",
            metavar="NAME",
            help="Also send metrics.jsonl's rows to tensorboard (RUN/tensorboard), mlflow (RUN/mlruns/mlflow.db) or "
            "wandb (W&B; WANDB_MODE=offline keeps it to RUN/wandb); repeatable or a comma list; = train.loggers. "
            "Needs pip install 'genoctx[loggers]'.",
        ),
    ] = None,
    no_verify: Annotated[
        bool,
        typer.Option(
            "--no-verify",
            help="Load the --resume checkpoint or the --init genoctx checkpoint without checking its files against "
            "the sizes and digests recorded when it was written; = train.verify_checkpoints=false.",
        ),
    ] = False,
    verbose: Verbose = False,
) -> None:
    """Post-train the hybrid model on the train split; prints a JSON run summary.

    --resume continues from the newest checkpoint whose files verify (sizes and xxh3_64 digests recorded in its
    state.json); each newer damaged one is skipped with a warning and set aside as step_N.broken. --init RUN
    (a genoctx run or checkpoint) is refused when its checkpoint does not verify. --no-verify skips the checks.

    Example: genoctx train --data prepared --recipe recipes/cpu-small.yaml --out runs/demo --steps 200

    Example (metrics to TensorBoard too): genoctx train ... --logger tensorboard; tensorboard --logdir runs/demo

    Example (Ray, 2 workers sharing each window): genoctx train --data prepared --recipe recipes/tiny.yaml
    --out runs/cp2 --num-workers 2 --cp 2 [--set train.cp_layout=zigzag]
    """
    _setup_logging(verbose)
    from ..recipes import load_recipe
    from ..train.frozen import check_frozen_dtype
    from ..train.loop import check_trainable

    _at_least("--steps", steps, 0)
    _at_least("--stop-after", stop_after, 1)
    _at_least("--num-workers", num_workers, 1)
    _at_least("--cp", cp, 1)
    _at_least("--ep", ep, 1)
    _at_least("--fsdp", fsdp, 1)
    _gpus_per_worker(gpus_per_worker)
    _at_least("--placement-timeout", placement_timeout, 0)
    if gpu_memory_gib is not None and not 0 < gpu_memory_gib < float("inf"):
        raise GenoctxError(f"--gpu-memory-gib: must be a positive number of GiB, got {gpu_memory_gib}")
    data = _data_dir(data)
    _out_dir(out)  # creates nothing
    overrides = _train_overrides(set_, steps=steps, init=init, cp=cp, ep=ep, fsdp=fsdp, ep_folded=ep_folded,
                                 fsdp_one=fsdp_one, cp_layout=cp_layout, seq_chunk=seq_chunk, logger=logger,
                                 no_verify=no_verify)  # fmt: skip
    rec = load_recipe(recipe, overrides)
    # lora: one line before anything is built (not compiled yet; every mesh layout runs it)
    check_trainable(rec.train.trainable, mesh=num_workers is not None or rec.train.ep > 1, compile=rec.train.compile)
    check_frozen_dtype(rec.train, mesh=num_workers is not None or rec.train.ep > 1)  # fp8: not with compile
    _train_flags_without_effect(data, rec, seq_chunk=seq_chunk is not None, hardware=hardware, dry_run=dry_run,
                                num_workers=num_workers, gpus_per_worker=gpus_per_worker, device=device,
                                gpu_memory_gib=gpu_memory_gib, force=force, cp_layout=cp_layout,
                                allow_batch_change=allow_batch_change, resume=resume,
                                stop_after=stop_after)  # fmt: skip
    if dry_run:
        if resume or stop_after is not None or address is not None:
            raise GenoctxError("--dry-run builds the model only: --resume, --stop-after and --address do not apply")
        _emit_json({"dry_run": _train_dry_run(data, rec, num_workers, hardware or "b200")})
        return
    _train_launch(data, rec, out, device=device, num_workers=num_workers, cp=cp, ep=ep, fsdp=fsdp,
                  ep_folded=ep_folded, force=force, address=address, gpus_per_worker=gpus_per_worker,
                  placement_timeout=placement_timeout, resume=resume, stop_after=stop_after, wait=wait,
                  allow_batch_change=allow_batch_change, gpu_memory_gib=gpu_memory_gib)  # fmt: skip

def _train_overrides(set_, *, steps, init, cp, ep, fsdp, ep_folded, fsdp_one, cp_layout, seq_chunk, logger,
                     no_verify) -> list[str]:
    """The recipe overrides of ``train``'s flags: ``--set KEY=VALUE`` items then one per flag given.

    Returns the list of ``KEY=VALUE`` strings (the flags win over the recipe and ``--set``). Raises GenoctxError
    for a bad ``--cp-layout``, ``--seq-chunk`` or ``--logger``.
    """
    overrides = list(set_ or [])
    if steps is not None:  # the flag wins over the recipe and --set (and is checked above)
        overrides.append(f"train.steps={steps}")
    if init is not None:
        overrides.append(f"model.init={init}")
    for key, value in (("cp", cp), ("ep", ep), ("fsdp", fsdp)):
        if value is not None:
            overrides.append(f"train.{key}={value}")
    if ep_folded is not None:
        overrides.append(f"train.ep_folded={str(ep_folded).lower()}")
    if fsdp_one is not None:
        overrides.append(f"train.fsdp_one={str(fsdp_one).lower()}")
    if cp_layout is not None:
        if cp_layout not in ("contiguous", "zigzag"):
            raise GenoctxError(f"--cp-layout must be contiguous or zigzag, got {cp_layout!r}")
        overrides.append(f"train.cp_layout={cp_layout}")
    if seq_chunk is not None:
        overrides.append(f"train.seq_chunk_tokens={_size('--seq-chunk', seq_chunk)}")
    if logger is not None:
        overrides.append(f"train.loggers=[{','.join(_loggers(logger))}]")
    if no_verify:
        overrides.append("train.verify_checkpoints=false")
    return overrides


def _train_launch(data: Path, rec, out: Path, *, device, num_workers, cp, ep, fsdp, ep_folded, force, address,
                  gpus_per_worker, placement_timeout, resume, stop_after, wait, allow_batch_change,
                  gpu_memory_gib) -> None:
    """Train in this process (no ``--num-workers``) or on Ray workers and print the run's JSON summary.

    Raises GenoctxError when a mesh or Ray flag is given without ``--num-workers``, or the local machine lacks
    the GPUs asked for.
    """
    from ..train.loop import train as run_train

    dev = _device(device)
    if num_workers is None:
        ray_flags = (address, placement_timeout, gpu_memory_gib)
        if any(v not in (None, 1) for v in (cp, ep, fsdp)) or any(v is not None for v in ray_flags) or gpus_per_worker \
                or ep_folded or rec.train.fsdp_one:  # fmt: skip
            raise GenoctxError("--cp, --ep, --fsdp, --ep-folded, --fsdp-one, --address, --gpus-per-worker, "
                               "--gpu-memory-gib and --placement-timeout need --num-workers")  # fmt: skip
        _emit_json(run_train(data, rec, out, resume=resume, device=dev, stop_after=stop_after, wait=wait,
                             allow_batch_change=allow_batch_change))  # fmt: skip
        return
    from ..cluster import check_local, run_workers
    from ..train.distributed import train_distributed

    if address is None:
        check_local(num_workers, gpus_per_worker)  # GPUs this machine lacks: refused before --out is touched

    _emit_json(
        train_distributed(
            data,
            rec,
            out,
            run_workers=run_workers,
            num_workers=num_workers,
            cp=rec.train.cp,
            ep=rec.train.ep,
            fsdp=rec.train.fsdp,
            ep_folded=rec.train.ep_folded,
            force=force,
            address=address,
            gpus_per_worker=gpus_per_worker,
            placement_timeout=placement_timeout,
            resume=resume,
            stop_after=stop_after,
            wait=wait,
            allow_batch_change=allow_batch_change,
            gpu_memory_gib=gpu_memory_gib,
        )
    )



def _train_flags_without_effect(data: Path, rec, *, seq_chunk: bool, hardware: str | None, dry_run: bool,
                                num_workers: int | None, gpus_per_worker: float, device: str,
                                gpu_memory_gib: float | None, force: bool, cp_layout: str | None,
                                allow_batch_change: bool, resume: bool, stop_after: int | None) -> None:  # fmt: skip
    """``genoctx train``'s flags that another setting makes inert: one warning line each on stderr, or a
    ``GenoctxError`` (exit 2) where the run would not be what was asked:

    - ``--seq-chunk`` with a crop (``train.seq_len``, e.g. a recipe's) at or below the chunk while the whole windows
      are longer: the step would train one short crop in one pass, not the windows in chunks (refused; naming
      ``--set train.seq_len=null``). A chunk at or above the whole window (a one-pass run) warns, in the loop.
    - ``--device cuda`` with ``--num-workers`` and ``--gpus-per-worker 0``: the workers would train on CPUs
      (refused).
    - warnings: ``--hardware`` without ``--dry-run``; ``--gpu-memory-gib`` / ``--force`` where nothing is planned
      (one process, CPU workers); ``--cp-layout`` with ``--cp 1``; ``--allow-batch-change`` without ``--resume``;
      ``--stop-after`` at or past ``train.steps``.

    Raises:
        GenoctxError: the two refusals above, one line naming the flags and what to pass.
    """
    from ..data.dataset import WindowDataset
    from ..train.loop import unused_seq_chunk

    warn = logging.getLogger("genoctx.train").warning
    if seq_chunk:
        unused = unused_seq_chunk(rec.train, WindowDataset(data, "train").window)
        if unused is not None and unused[1]:
            raise GenoctxError(f"--seq-chunk: {unused[0]}; or drop --seq-chunk")
    if num_workers is not None and not gpus_per_worker and device not in ("cpu", "auto") and not dry_run:
        raise GenoctxError(f"--device {device} with --num-workers: the Ray workers' device is set by "
                           "--gpus-per-worker (0: CPUs); pass --gpus-per-worker 1 to train on GPUs")  # fmt: skip
    if hardware is not None and not dry_run:
        warn("--hardware %s has no effect without --dry-run (the predicted step time)", hardware)
    planned = num_workers is not None and gpus_per_worker > 0 and not dry_run  # genoctx.train.distributed
    if not planned and (force or (gpu_memory_gib is not None and num_workers is not None)):
        flags = " and ".join(f for f, on in (("--force", force), ("--gpu-memory-gib", gpu_memory_gib is not None))
                             if on)  # fmt: skip
        warn("%s: no effect: the memory plan before launch runs for GPU workers only (--num-workers with "
             "--gpus-per-worker 1)", flags)  # fmt: skip
    if cp_layout is not None and rec.train.cp == 1:
        warn("--cp-layout %s has no effect with --cp 1 (one worker per window: nothing is cut)", cp_layout)
    if allow_batch_change and not resume:
        warn("--allow-batch-change has no effect without --resume")
    if stop_after is not None and stop_after >= rec.train.steps and not dry_run:
        warn("--stop-after %d has no effect: the run ends at train.steps %d", stop_after, rec.train.steps)


def _loggers(values: list[str]) -> list[str]:
    """``--logger`` values (repeated, or comma lists) as a list of names from ``genoctx.recipes.LOGGERS``.

    Raises:
        GenoctxError: an unknown or empty name (one line naming --logger).
    """
    from ..recipes import LOGGERS

    names = [name.strip() for value in values for name in value.split(",")]
    for name in names:
        if name not in LOGGERS:
            raise GenoctxError(f"--logger {name!r}: expected {' or '.join(LOGGERS)} (repeatable, or a comma list)")
    return names


def _train_dry_run(data: Path, rec, num_workers: int | None, hardware: str = "b200") -> dict:
    """``genoctx train --dry-run``: ``genoctx.train.dryrun.dry_run`` of the recipe's model (``_recipe_model``: a
    preset, or ``model.init``'s config with the recipe's compute knobs) on ``num_workers`` ranks (1 when None) with
    ``train.ep``/``train.fsdp``/``train.cp``, the recipe's dtype, activation checkpointing, optimizer offload and
    AdamW moment dtype (``train.optimizer_state_dtype``);
    with ``"time"``: the planner's step time on ``hardware`` (``genoctx.plan.time.plan_time``) and the GPU-hours
    of the recipe's ``train.steps`` (logged on stderr too).

    Raises:
        GenoctxError: ``model.init``'s config not readable without a download, a layout that does not make
            ``num_workers`` ranks or that this model or window cannot run (one line naming the flag).
    """
    from ..data.dataset import WindowDataset
    from ..parallel.layout import Layout
    from ..train.dryrun import dry_run
    from .plan import _hardware_and_skew, _recipe_model

    cfg = _recipe_model(rec, "--dry-run")
    t = rec.train
    try:
        layout = Layout.for_world(num_workers or 1, ep=t.ep, dp_shard=t.fsdp, cp=t.cp, ep_folded=t.ep_folded,
                                  fsdp_one=t.fsdp_one)  # fmt: skip
    except ValueError as e:
        raise GenoctxError(str(e)) from None
    L = t.seq_len or WindowDataset(data, "train").window
    if L % t.cp or L // t.cp < cfg.kda_chunk_size:
        raise GenoctxError(f"--cp {t.cp}: the {L}-token window does not split into {t.cp} pieces of at least "
                           f"{cfg.kda_chunk_size} tokens")  # fmt: skip
    hw, _ = _hardware_and_skew(hardware, "1")
    out = dry_run(cfg, layout, activation_checkpointing=t.activation_checkpointing, dtype=t.dtype,
                  optimizer_offload=t.offload_optimizer, optimizer_state_dtype=t.optimizer_state_dtype)  # fmt: skip
    out["time"] = _predicted_time(cfg, L, layout, hw, t)
    out["trainable"] = _trainable_meta(cfg, t.trainable)
    return out


def _trainable_meta(cfg, spec: str) -> dict:
    """What ``train.trainable`` trains of ``cfg`` (``genoctx.train.loop.trainable_counts`` on the meta device), logged
    on stderr as ``trainable: kda,dsa (12.3M of 313.3B parameters)``."""
    import torch

    from ..model.model import HybridLM
    from ..train.loop import describe_trainable, trainable_counts

    with torch.device("meta"):
        counts = trainable_counts(HybridLM(cfg), spec)
    logging.getLogger("genoctx.train").info(describe_trainable(counts))
    return counts


def _predicted_time(cfg, seq_len: int, layout, hw, t) -> dict:
    """``plan_time``'s step of the recipe's training (``t``: ``TrainConfig``) on ``hw``, the GPU-hours of its
    ``t.steps`` steps, logged on stderr."""
    from ..plan import plan_memory
    from ..plan.time import TIME_KEYS, gpu_hours, plan_time, with_host_time

    try:
        p = plan_time(cfg, seq_len, layout, hw, batch_size=t.batch_size, recompute=t.activation_checkpointing,
                      dtype=t.dtype, seq_chunk_tokens=t.seq_chunk_tokens)  # fmt: skip
    except ValueError as e:
        raise GenoctxError(f"--dry-run: {e}") from None
    try:  # the memory knobs' host time needs the step's plan (none for what plan_memory does not model)
        plan = plan_memory(cfg, seq_len, layout, gpu_memory_gib=hw.memory_gib, recompute=t.activation_checkpointing,
                           optimizer_offload=t.offload_optimizer, batch_size=t.batch_size, dtype=t.dtype,
                           seq_chunk_tokens=t.seq_chunk_tokens,
                           optimizer_state_dtype=t.optimizer_state_dtype,
                           offload_activations=t.offload_activations)  # fmt: skip
    except ValueError:
        plan = None
    with_host_time(p, plan, hw)
    out = {k: p[k] for k in TIME_KEYS}
    out.update(steps=t.steps, gpu_hours=gpu_hours(p["step_s"], t.steps, layout.world))
    logging.getLogger("genoctx.plan").info(
        "predicted on %s: %.2f s per step (%.0f tokens/s, MFU %.1f%%, bound: %s); %d steps = %.1f GPU-hours on %d "
        "GPUs", hw.name, p["step_s"], p["tokens_per_s"], 100 * p["mfu"], p["bound"], t.steps, out["gpu_hours"],
        layout.world,
    )  # fmt: skip
    return out
