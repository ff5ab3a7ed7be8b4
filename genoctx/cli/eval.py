"""``genoctx eval``: per-position loss of checkpoints, baselines and references."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from ..errors import GenoctxError
from .common import (
    _absolute_paths,
    _alias,
    _at_least,
    _Command,
    _data_dir,
    _device,
    _emit_json,
    _gpus_per_worker,
    _setup_logging,
    _size,
    _user_errors,
    app,
)
from .options import (
    ChunkTokens,
    Cp,
    Device,
    Ep,
    EpFolded,
    Fsdp,
    GpusPerWorker,
    NumWorkers,
    PlacementTimeout,
    RayAddress,
    Verbose,
)


@app.command("eval", cls=_Command)
@_user_errors
@_absolute_paths
def eval_(
    data: Annotated[Path, typer.Option(help="Prepared data directory.")],
    checkpoint: Annotated[
        list[Path] | None,
        typer.Option(
            metavar="PATH",
            help="Checkpoint, run directory (its latest) or HF model directory (config.json + safetensors); "
            "repeatable, the first is the baseline.",
        ),
    ] = None,
    by_position: Annotated[
        bool,
        typer.Option(
            "--by-position",
            show_default=False,
            help="The loss binned by how many tokens of context each token had: what eval does (the default and, so "
            "far, only mode; --copy-probe adds to it), so the flag may be left out.",
        ),
    ] = True,
    baseline: Annotated[
        Path | None, typer.Option(help="Checkpoint to compare against (same as giving it as the first --checkpoint).")
    ] = None,
    split: Annotated[str, typer.Option(help="Split of the prepared data to score.")] = "eval",
    bins: Annotated[str, typer.Option(help="log2, linear:N, or comma-separated edges in tokens.")] = "log2",
    markov: Annotated[
        int | None, typer.Option(help="Also score an order-K Markov chain fitted on the train split.")
    ] = None,
    markov_alpha: Annotated[float, typer.Option(help="Add-alpha pseudo-count of the Markov chain.")] = 1.0,
    reference: Annotated[
        str | None,
        typer.Option(
            metavar="NAME",
            help="Also score a reference that uses far context without a network: repeat (context models fitted "
            "on the train split, mixed with experts copying earlier forward and reverse-complement repeats in the "
            "window); every other model's rows get their change vs it.",
        ),
    ] = None,
    # defaults: genoctx.eval.repeat's ORDER, KMER, EXPERTS (literals here so that --help imports no numpy or torch;
    # a test holds them equal)
    repeat_order: Annotated[
        int, typer.Option(help="Order of the repeat reference's static context model (fitted on the train split).")
    ] = 10,
    repeat_kmer: Annotated[int, typer.Option(help="Seed length of the repeat reference's experts (bases).")] = 12,
    repeat_experts: Annotated[int, typer.Option(help="Most repeat experts alive at once.")] = 16,
    reverse_complement: Annotated[
        bool, typer.Option("--reverse-complement", help="Also score the reverse-complement strand.")
    ] = False,
    split_by: Annotated[
        str | None, typer.Option(help="softmask: report soft-masked and unmasked bases separately too.")
    ] = None,
    resamples: Annotated[int, typer.Option(help="Bootstrap resamples over windows (0 = no intervals).")] = 1000,
    seed: Annotated[int, typer.Option(help="Seed of the bootstrap.")] = 0,
    format_: Annotated[str, typer.Option("--format", help="table, json or csv (on stdout).")] = "table",
    plot: Annotated[
        Path | None,
        typer.Option(
            help="Write a plot of loss against position (PNG; .pdf/.svg by suffix); its folder is created. "
            "Checked before scoring; written after the result is on stdout."
        ),
    ] = None,
    plot_metric: Annotated[
        str, typer.Option(help="What --plot draws: loss or relative_change (vs the baseline).")
    ] = "loss",
    seq_chunk: Annotated[
        str | None,
        typer.Option(
            "--seq-chunk",
            metavar="SIZE",
            help="Score each window (under --cp each CP piece) as consecutive chunks of this many tokens (k/M "
            "suffixes) with the carried cache, as train's --seq-chunk; default whole windows. Old name: "
            "--chunk-tokens.",
        ),
    ] = None,
    chunk_tokens: ChunkTokens = None,
    loss_vocab: Annotated[
        str | None,
        typer.Option(
            help="For a text-vocabulary model: softmax over the full vocabulary or the nucleotide rows "
            "(default: the run's loss.vocab; full for an HF base)."
        ),
    ] = None,
    max_windows: Annotated[int | None, typer.Option(help="Score only the first N windows.")] = None,
    copy_probe: Annotated[
        bool,
        typer.Option(
            "--copy-probe",
            help="Also copy a segment to each window's end from log-spaced distances and report the loss on the "
            "copy vs in place (the model's reach).",
        ),
    ] = False,
    copy_segment: Annotated[int, typer.Option(help="Bases copied by --copy-probe.")] = 200,
    copy_distances: Annotated[int, typer.Option(help="Log-spaced distances of --copy-probe (64 to W - segment).")] = 8,
    device: Device = "cpu",
    num_workers: NumWorkers = None,
    fsdp: Fsdp = None,
    ep: Ep = None,
    ep_folded: EpFolded = False,
    cp: Cp = None,
    cp_layout: Annotated[
        str, typer.Option(help="CP pieces: contiguous or zigzag (as train.cp_layout).")
    ] = "contiguous",
    address: RayAddress = None,
    gpus_per_worker: GpusPerWorker = 0,
    placement_timeout: PlacementTimeout = None,
    gpu_memory_gib: Annotated[
        float | None,
        typer.Option(
            "--gpu-memory-gib",
            help="Memory of one worker's device in GiB for the memory plan, as genoctx plan's (default: the GPU's; "
            "on the CPU with a local Ray, host memory / workers). Old name: --memory-gib.",
        ),
    ] = None,
    memory_gib: Annotated[float | None, typer.Option("--memory-gib", hidden=True)] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Score even when the memory planner predicts a rank does not fit.")
    ] = False,
    no_verify: Annotated[
        bool,
        typer.Option(
            "--no-verify",
            help="Read genoctx checkpoints without checking their files against the sizes and digests recorded when "
            "they were written.",
        ),
    ] = False,
    verbose: Verbose = False,
) -> None:
    """Held-out next-token loss, binned by how many tokens of context each token had, with 95% bootstrap
    intervals over windows (--by-position: the default mode, the flag may be left out; --copy-probe adds a
    copy probe to it). Several --checkpoint: the first is the baseline (paired intervals of the change).
    With --num-workers the checkpoints are scored on Ray workers on the training mesh (no rank holds a model;
    forward only; the statistics are then computed here exactly as for one process).

    Every genoctx checkpoint's weight files are checked against the sizes and xxh3_64 digests recorded when it was
    written before anything is scored (--no-verify skips it); a damaged file is one line naming it (exit 2). A run
    directory whose newest checkpoint does not verify is refused, naming the newest one that does (pass that one
    explicitly): an eval measures one specific model, so an older one is never evaluated silently.

    Examples:
      genoctx eval --by-position --checkpoint runs/init --checkpoint runs/demo --data prepared --markov 8
      genoctx eval --by-position --checkpoint runs/demo --baseline runs/init --data prepared --format json
      genoctx eval --by-position --markov 12 --data prepared --reverse-complement --split-by softmask
      genoctx eval --by-position --checkpoint runs/demo --data prepared --markov 8 --reference repeat
      genoctx eval --by-position --checkpoint runs/demo --data prepared --markov 8 --copy-probe
      genoctx eval --checkpoint runs/base --checkpoint runs/post --data prepared --num-workers 4 --fsdp 2 --cp 2
    """
    _setup_logging(verbose)
    chunk, gpu_memory_gib, memory_flag = _eval_checks(
        format_, plot, plot_metric, checkpoint, baseline, seq_chunk, chunk_tokens, gpu_memory_gib, memory_gib,
        copy_segment, copy_distances, loss_vocab)  # fmt: skip
    data = _data_dir(data)
    mesh = _eval_mesh(num_workers, fsdp, ep, cp, cp_layout, address, gpus_per_worker, gpu_memory_gib, force,
                      ep_folded, placement_timeout, memory_flag)  # fmt: skip
    from ..eval.plot import prepare_plot_path, remove_folders
    from ..eval.position import evaluate

    created = prepare_plot_path(plot) if plot is not None else []  # before scoring: a bad path costs no run
    try:
        doc = evaluate(
            list(checkpoint or []),
            data,
            split=split,
            bins=bins,
            baseline=baseline,
            chunk_tokens=chunk,
            max_windows=max_windows,
            device=_device(device),
            markov=markov,
            markov_alpha=markov_alpha,
            reference=reference,
            repeat_order=repeat_order,
            repeat_kmer=repeat_kmer,
            repeat_experts=repeat_experts,
            reverse_complement=reverse_complement,
            split_by=split_by,
            resamples=resamples,
            seed=seed,
            loss_vocab=loss_vocab,
            copy_probe=copy_probe,
            copy_segment=copy_segment,
            copy_distances_n=copy_distances,
            mesh=mesh,
            verify=not no_verify,
        )
    except BaseException:
        remove_folders(created)  # no output of a failed run, not even --plot's empty folder
        raise
    _eval_output(doc, format_, plot, plot_metric)

def _eval_checks(format_, plot, plot_metric, checkpoint, baseline, seq_chunk, chunk_tokens, gpu_memory_gib,
                 memory_gib, copy_segment, copy_distances, loss_vocab):  # fmt: skip
    """Check ``eval``'s flags before any work; resolve the hidden old names of ``--seq-chunk``/``--gpu-memory-gib``.

    Returns ``(chunk, gpu_memory_gib, memory_flag)``: the chunk in tokens (None: unchunked), the GPU memory in GiB
    (None: not given) and the flag name the user typed for it. Raises GenoctxError naming the first bad flag.
    """
    if format_ not in ("table", "json", "csv"):
        raise GenoctxError(f"--format must be table, json or csv, got {format_!r}")
    if plot_metric not in ("loss", "relative_change"):
        raise GenoctxError(f"--plot-metric must be loss or relative_change, got {plot_metric!r}")
    if plot is not None and plot_metric == "relative_change" and len(checkpoint or []) + bool(baseline) < 2:
        raise GenoctxError("--plot-metric relative_change needs a baseline (two or more checkpoints)")
    seq_chunk, chunk_flag = _alias("--seq-chunk", seq_chunk, "--chunk-tokens", chunk_tokens)
    gpu_memory_gib, memory_flag = _alias("--gpu-memory-gib", gpu_memory_gib, "--memory-gib", memory_gib)
    chunk = _size(chunk_flag, seq_chunk) if seq_chunk is not None else None
    _at_least("--copy-segment", copy_segment, 1)
    _at_least("--copy-distances", copy_distances, 1)
    if loss_vocab not in (None, "full", "nucleotide"):
        raise GenoctxError(f"--loss-vocab must be full or nucleotide, got {loss_vocab!r}")
    return chunk, gpu_memory_gib, memory_flag


def _eval_output(doc: dict, format_: str, plot, plot_metric: str) -> None:
    """Write ``eval``'s result to stdout as ``format_`` (table, json, csv), then the ``--plot`` file if asked."""
    from ..eval.position import plot as write_plot
    from ..eval.position import to_csv, to_table

    # the result first: if the plot fails after all, what was computed is already out
    if format_ == "json":
        _emit_json(doc)
    elif format_ == "csv":
        sys.stdout.write(to_csv(doc))
    else:
        sys.stdout.write(to_table(doc) + "\n")
    sys.stdout.flush()
    if plot is not None:
        write_plot(doc, plot, metric=plot_metric)
        logging.getLogger("genoctx.eval").info("wrote %s", plot)



def _eval_mesh(num_workers, fsdp, ep, cp, cp_layout, address, gpus_per_worker, memory_gib, force, ep_folded=False,
               placement_timeout=None, memory_flag="--gpu-memory-gib"):  # fmt: skip
    """``genoctx.eval.distributed.MeshEval`` of eval's --num-workers flags, or None for one process. ``memory_flag``:
    the name the memory was given by (--gpu-memory-gib, or its old name --memory-gib), for messages.

    Raises:
        GenoctxError: a size below 1, a mesh flag without --num-workers, or (local Ray) more GPUs asked than this
            machine has (``genoctx.cluster.check_local``); one line naming the flag.
    """
    for flag, value in (("--num-workers", num_workers), ("--fsdp", fsdp), ("--ep", ep), ("--cp", cp)):
        _at_least(flag, value, 1)
    _gpus_per_worker(gpus_per_worker)
    _at_least("--placement-timeout", placement_timeout, 0)
    if memory_gib is not None and not 0 < memory_gib < float("inf"):
        raise GenoctxError(f"{memory_flag}: must be a positive number of GiB, got {memory_gib}")
    if num_workers is None:
        given = [f for f, v in (("--fsdp", fsdp), ("--ep", ep), ("--cp", cp), ("--address", address),
                                ("--gpus-per-worker", gpus_per_worker or None), (memory_flag, memory_gib),
                                ("--force", force or None), ("--ep-folded", ep_folded or None),
                                ("--placement-timeout", placement_timeout))
                 if v is not None]  # fmt: skip
        if given or cp_layout != "contiguous":
            raise GenoctxError(f"{(given or ['--cp-layout'])[0]} needs --num-workers (evaluation on a mesh)")
        return None
    from ..cluster import check_local, run_workers
    from ..eval.distributed import MeshEval

    if address is None:
        check_local(num_workers, gpus_per_worker)  # GPUs this machine lacks: refused before any checkpoint is read
    return MeshEval(run_workers, num_workers, fsdp=fsdp or 1, ep=ep or 1, cp=cp or 1, cp_layout=cp_layout,
                    address=address, gpus_per_worker=gpus_per_worker, memory_gib=memory_gib, force=force,
                    ep_folded=ep_folded, placement_timeout=placement_timeout)  # fmt: skip
