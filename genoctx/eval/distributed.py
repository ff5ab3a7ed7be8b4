"""Evaluation on the training mesh: ``genoctx eval --by-position --num-workers N [--fsdp F] [--ep E] [--cp C]``.

The 313B model fits on no single device, so its held-out loss is measured as it was trained (torchtitan's
``validate.py``, NeMo Automodel's ``_run_validation_epoch``): on the same mesh ``dp_replicate x ep x dp_shard x cp``,
forward only.

- The driver (``score_on_mesh``) checks the layout, each checkpoint's small files (recipe/state or config/tokenizer;
  an HF directory's tensor shapes from its headers) and the memory plan (``genoctx.plan.plan_eval``) before any
  worker starts, then hands ``_eval_worker`` to the worker runner it is given (``genoctx.cluster.run_workers``, passed
  in by the CLI: this module imports neither Ray nor the cluster layer above it).
- Every worker builds each checkpoint's model with ``genoctx.parallel.build.build_model`` (meta device, EP, CP,
  FSDP2, then only this rank's shards filled from the checkpoint: no rank holds the model), in eval mode under
  ``torch.no_grad`` (no gradient, no optimizer), in the precision one process uses on the same device
  (``genoctx.eval.scoring.eval_precision``: on GPU fp32 masters all-gathered as bf16 under bf16 autocast, as in
  training; fp32 on the CPU).
- Windows: data rank ``d`` (over ``dp_replicate x ep x dp_shard``) scores windows ``d, d + dp, d + 2 dp, ...``. Every
  rank runs the same number of forwards (a rank without a window in the last round scores a window of ``<pad>``,
  which has no scored token), so the collectives of FSDP, EP and CP stay in step.
- A window is split over the CP ranks of its data rank as in training (``contiguous`` or ``zigzag``:
  ``genoctx.parallel.context.shard_sequence``), and each CP piece is streamed through every mixing layer in
  ``chunk_tokens`` chunks with the carried cache (``apply_cp(..., chunk_tokens)``). Without CP the window is fed in
  ``chunk_tokens`` chunks with the model's carried cache, as one process does.
- Reduced: per window, bin, strand and soft-mask view, the sum of token losses (nats, float64) and the count of
  scored tokens (int64): each rank adds what its positions contribute, one all-reduce (sum) over the mesh totals
  them, and rank 0 returns them (``WorkerRun.value``). The driver then computes everything else exactly as for one
  process (``genoctx.eval.position.evaluate``: bootstrap intervals, paired changes, ``last_vs_first_bin``, Markov
  reference, table, JSON, plot), so a layout changes nothing but float rounding of the sums.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import GenoctxError
from ..heap import keep_freed_memory
from ..train.integrity import refuse_unverified, run_of
from .scoring import (
    BinnedLoss,
    EvalCheckpoint,
    eval_checkpoint,
    eval_precision,
    view_parts,
    views_of,
    window_strands,
    window_sums,
)

log = logging.getLogger("genoctx.eval")

RUN_NAME = "eval"  # Ray Train's run directory under the driver's temporary storage


@dataclass(frozen=True)
class MeshEval:
    """How ``genoctx eval`` runs on a mesh (the flags of ``--num-workers``).

    Attributes:
        run_workers: ``genoctx.cluster.run_workers`` (handed in by the CLI).
        num_workers: Ray workers, one rank each; ``ep x fsdp x cp`` must divide it (the rest is ``dp_replicate``).
        fsdp, ep, cp: FSDP2 shard size (``dp_shard``), expert-parallel and context-parallel sizes.
        ep_folded: the EP groups drawn from the ``fsdp x cp`` ranks (``genoctx.parallel.layout.Layout.ep_folded``).
        cp_layout: ``contiguous`` or ``zigzag`` (``genoctx.parallel.layout.cp_pieces``).
        address: Ray cluster address (``auto``, ``ray://HOST:PORT``); None starts a local Ray.
        gpus_per_worker: GPUs per worker; 0 = CPU and gloo.
        memory_gib: the memory of one rank's device checked against the plan; None = the local GPU's (GPU
            workers; no check when the driver has none) or, on the CPU with a local Ray, host memory / workers.
        force: start even when the planner predicts that the evaluation does not fit.
        placement_timeout: seconds the workers may wait for their resources (``run_workers``'s; None = its default,
            0 = forever).
    """

    run_workers: Callable
    num_workers: int
    fsdp: int = 1
    ep: int = 1
    cp: int = 1
    cp_layout: str = "contiguous"
    address: str | None = None
    gpus_per_worker: float = 0
    memory_gib: float | None = None
    force: bool = False
    ep_folded: bool = False
    placement_timeout: float | None = None


def round_robin(n: int, dp: int, dp_rank: int) -> list[int | None]:
    """The windows data rank ``dp_rank`` of ``dp`` scores, one per round: ``dp_rank + r dp`` for rounds
    ``r < ceil(n / dp)``, None where that is past the last window (a rank then scores a ``<pad>`` window so that
    every rank runs the same forwards)."""
    rounds = -(-n // dp)
    return [i if (i := dp_rank + r * dp) < n else None for r in range(rounds)]


def mesh_scorer(model, dims, chunk_tokens: int | None, device, autocast=None):
    """A window scorer for one rank of the mesh: ``score(tokens int64 [W]) -> (losses float64 [W] nats, mine bool
    [W] or None)``, ``mine`` the positions this rank scored (its CP pieces; None without CP: all of them).

    Without CP the window runs as ``position_losses`` runs it (chunks of ``chunk_tokens`` with the carried cache).
    Under CP (``dims.cp > 1``) this rank runs its pieces (``shard_sequence`` in ``dims.cp_layout``) in one model call
    whose mixing layers stream each piece in ``chunk_tokens`` chunks (built with ``cp_chunk_tokens``); a collective
    over the CP group, called by every CP rank with the same window.
    """
    from ..data.dataset import scored_mask
    from ..data.tokenizer import BOS
    from ..model.model import shift_inputs, token_losses
    from ..parallel.context import shard_sequence
    from .scoring import _chunk_losses

    autocast = autocast or nullcontext()
    forward = model if callable(model) else model.forward

    @torch.no_grad()
    def score(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        t = torch.as_tensor(tokens, dtype=torch.long)[None].to(device)
        W = t.shape[1]
        if dims is None or dims.cp == 1:
            with autocast:
                losses = _chunk_losses(forward, t, 0, W, chunk_tokens, None)[0]
            return losses[0].cpu().numpy(), None
        pos = torch.arange(W, device=t.device)[None]
        parts = (shift_inputs(t, BOS), t, scored_mask(t), pos)
        inputs, targets, scored, pos = (shard_sequence(x, dims.cp, dims.cp_rank, dims.cp_layout) for x in parts)
        with autocast:
            logits, _ = forward(inputs, None)
        local = token_losses(logits.float(), targets, scored).double()[0].cpu().numpy()
        idx = pos[0].cpu().numpy()
        losses, mine = np.zeros(W), np.zeros(W, dtype=bool)
        losses[idx], mine[idx] = local, True
        return losses, mine

    return score


def score_rank(score, ds, n: int, edges: list[int], views: list[str], dims, progress: bool = False) -> dict:
    """This rank's part of the sums of ``n`` windows of ``ds``: ``{(strand, mask): (loss sum float64 [n, bins],
    count int64 [n, bins])}`` over the windows of its data rank (``round_robin``) and its positions, zero elsewhere.
    A collective when the mesh has more than one rank (each round's forwards). ``progress``: an INFO line per round
    (windows done over the whole mesh, tokens/s; rank 0 says it for all)."""
    nb = len(edges) - 1
    strands, masks = view_parts(views)
    sums = {(s, m): np.zeros((n, nb)) for s in strands for m in masks}
    cnts = {(s, m): np.zeros((n, nb), dtype=np.int64) for s in strands for m in masks}
    bin_of = np.searchsorted(np.asarray(edges[1:-1]), np.arange(ds.window), side="right")
    dp, dp_rank = (dims.dp, dims.dp_rank) if dims is not None else (1, 0)
    schedule = round_robin(n, dp, dp_rank)
    pad = _pad_item(ds.window)
    t0 = time.perf_counter()
    for r, i in enumerate(schedule):
        for strand, tokens, soft in window_strands(ds[i] if i is not None else pad, strands):
            losses, mine = score(tokens)
            if i is None:
                continue
            for mask, (s_, c_) in window_sums(losses, tokens, soft, bin_of, nb, masks, mine).items():
                sums[strand, mask][i] += s_
                cnts[strand, mask][i] += c_
        if progress:
            done, dt = min(n, (r + 1) * dp), time.perf_counter() - t0
            log.info("round %d/%d: %d/%d windows scored, %.0f tokens/s", r + 1, len(schedule), done, n,
                     done * len(strands) * ds.window / max(dt, 1e-9))  # fmt: skip
    return {k: (sums[k], cnts[k]) for k in sums}


def _pad_item(window: int) -> dict:
    from ..data.tokenizer import PAD

    return {"tokens": torch.full((window,), PAD, dtype=torch.long), "softmask": torch.zeros(window, dtype=torch.bool),
            "start": 0, "end": 0}  # fmt: skip


def reduce_sums(parts: dict, dims) -> dict:
    """Sum every rank's ``score_rank`` arrays over the whole mesh (one all-reduce of the losses in float64 and one
    of the counts in int64); the same dict with the totals, on every rank. The host arrays travel on the mesh's
    device (NCCL reduces CUDA tensors only: ``genoctx.parallel.collectives.to_device_of``) and come back as numpy."""
    from ..parallel import collectives as coll

    if dims is None or not dims.is_distributed:
        return parts
    keys = sorted(parts)
    group, mesh = dims.dp_cp_group, dims.mesh
    flat_s = coll.to_device_of(torch.from_numpy(np.stack([parts[k][0] for k in keys]).copy()), group, mesh)
    flat_c = coll.to_device_of(torch.from_numpy(np.stack([parts[k][1] for k in keys]).copy()), group, mesh)
    coll.all_reduce(flat_s, group=group, mesh=mesh)
    coll.all_reduce(flat_c, group=group, mesh=mesh)
    flat_s, flat_c = flat_s.cpu(), flat_c.cpu()
    return {k: (flat_s[j].numpy(), flat_c[j].numpy()) for j, k in enumerate(keys)}


def build_eval_model(spec: EvalCheckpoint, dims, device, chunk_tokens: int | None):
    """``spec``'s model on the mesh of ``dims`` (``build_model`` from the checkpoint: this rank's shards only), in
    eval mode with its head (``with_head``). On CUDA the fp32 masters are all-gathered as bf16 (FSDP2
    ``MixedPrecisionPolicy``, as in training); under CP each piece is streamed in ``chunk_tokens`` chunks.

    Raises:
        GenoctxError: the checkpoint does not fit the model or is unreadable on some rank (the same line on every
            rank: ``genoctx.parallel.build.agree``).
    """
    from ..parallel.build import FromCheckpoint, FromHF, build_model
    from .scoring import with_head

    # a LoRA run's checkpoint: its adapters built with the model (spec.lora) and read with the base
    source = FromCheckpoint(spec.path, adapters=True) if spec.kind == "genoctx" else FromHF(spec.path)
    param_dtype = eval_precision(device).param_dtype  # bf16 on CUDA, as one process's autocast (scoring)
    model = build_model(spec.cfg, dims, source=source, device=device, param_dtype=param_dtype,
                        cp_chunk_tokens=chunk_tokens if dims is not None and dims.cp > 1 else None,
                        lora=spec.lora)  # fmt: skip
    return with_head(model, spec)


def _eval_worker(config: dict, session) -> dict | None:
    """One rank of the mesh: every checkpoint of ``config`` built on the mesh and its windows scored; returns (rank
    0) ``{"models": [{"loss_vocab", "sums": {"strand/mask": [loss sums, counts]}}], "ranks": [...]}``."""
    import torch.distributed as dist

    from ..data.dataset import WindowDataset
    from ..parallel import collectives as coll
    from ..parallel.build import agree
    from ..parallel.mesh import init_parallel
    from ..train.distributed import worker_logging, worker_threads

    worker_logging()
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
    torch.set_num_threads(worker_threads(session))  # this node's cores over the run's workers on it
    dims = init_parallel(config["cp"], layout=config["cp_layout"], ep=config["ep"], dp_shard=config["dp_shard"],
                         ep_folded=config.get("ep_folded", False))  # fmt: skip
    rank = dist.get_rank()
    device = session.device()
    if torch.device(device).type == "cpu":  # activations in this process's heap: keep it (genoctx.heap)
        keep_freed_memory()
    precision = eval_precision(device)  # the one decision, as one process's (genoctx.eval.scoring)
    ds = agree(dims, lambda: WindowDataset(config["data"], config["split"]))
    models, peaks = [], []
    given = config.get("given") or config["checkpoints"]
    runs = config.get("runs") or [None] * len(config["checkpoints"])
    for path, named, run in zip(config["checkpoints"], given, runs, strict=True):
        spec = agree(dims, lambda p=path: eval_checkpoint(p, config["loss_vocab"]))
        if config.get("verify", True) and spec.kind == "genoctx":  # every rank hashes its share; one verdict
            refuse_unverified(spec.path, named, Path(run) if run else None, "--checkpoint", "evaluate it",
                              dims=dims)  # fmt: skip
        model = build_eval_model(spec, dims, device, config["chunk_tokens"])
        if rank == 0:
            log.info("scoring %d %s windows with %s on %s (%s)", config["windows"], config["split"], spec.path,
                     dims.layout.describe(), precision.describe())  # fmt: skip
        score = mesh_scorer(model, dims, config["chunk_tokens"], device, precision.autocast())
        parts = score_rank(score, ds, config["windows"], config["edges"], config["views"], dims, progress=rank == 0)
        totals = reduce_sums(parts, dims)
        models.append({"loss_vocab": spec.loss_vocab,
                       "sums": {f"{s}/{m}": [v[0], v[1]] for (s, m), v in totals.items()}})  # fmt: skip
        peaks.append(_peak_bytes(device))
        del model, score
        gc.collect()
    ranks = [None] * dims.world
    coll.all_gather_object(ranks, {"rank": rank, **dims.coordinates(), "peak_memory_bytes": max(peaks, default=0)})
    return {"models": models, "ranks": ranks} if rank == 0 else None


def _peak_bytes(device) -> int:
    from ..train.loop import peak_memory_bytes

    return peak_memory_bytes(torch.device(device))


def _check_layout(mesh: MeshEval, specs: list[EvalCheckpoint], window: int):
    """The ``Layout`` of ``mesh``; every checkpoint's model must run on it and the window split into its CP pieces.

    Raises:
        GenoctxError: sizes that do not divide ``--num-workers``, ``--ep`` not dividing a model's routed experts,
            a window that does not split into the CP pieces, an unknown ``--cp-layout`` (one line, naming the flag).
    """
    from ..parallel.layout import LAYOUTS, Layout, cp_pieces

    try:
        layout = Layout.for_world(mesh.num_workers, ep=mesh.ep, dp_shard=mesh.fsdp, cp=mesh.cp,
                                  ep_folded=mesh.ep_folded)  # fmt: skip
    except ValueError as e:
        raise GenoctxError(str(e)) from None
    if mesh.cp_layout not in LAYOUTS:
        raise GenoctxError(f"--cp-layout must be one of {', '.join(LAYOUTS)}, got {mesh.cp_layout!r}")
    pieces = sum(len(p) for p in cp_pieces(mesh.cp, mesh.cp_layout if mesh.cp > 1 else "contiguous"))
    for spec in specs:
        cfg = spec.cfg
        moe = "sparse" in cfg.mlp_layer_types
        if mesh.ep > 1 and (not moe or cfg.n_routed_experts % mesh.ep):
            raise GenoctxError(f"--ep {mesh.ep} must divide the routed experts of {spec.path} "
                               f"({cfg.n_routed_experts if moe else 0})")  # fmt: skip
        tail = cfg.linear_conv_kernel_dim - 1
        if mesh.cp > 1 and (window % pieces or window // pieces < tail):
            how = f" with --cp-layout {mesh.cp_layout}" if mesh.cp_layout != "contiguous" else ""
            raise GenoctxError(f"--cp {mesh.cp}{how}: the {window}-token window does not split into {pieces} equal "
                               f"pieces of at least {tail} tokens")  # fmt: skip
    return layout


def _memory_budget(mesh: MeshEval) -> tuple[float | None, str]:
    """``(GiB of one rank's device, device kind for the planner)``: ``mesh.memory_gib``, else the local GPU's (GPU
    workers), else host memory over the workers (CPU, local Ray); None when it cannot be known here."""
    device = "cuda" if mesh.gpus_per_worker > 0 else "cpu"
    if mesh.memory_gib is not None:
        return mesh.memory_gib, device
    if device == "cuda":
        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / 2**30, device
        return None, device
    if mesh.address is None:
        try:
            host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        except (ValueError, OSError, AttributeError):
            return None, device
        return host / mesh.num_workers, device
    return None, device


def _check_memory(mesh: MeshEval, layout, specs: list[EvalCheckpoint], window: int, chunk_tokens: int | None) -> None:
    """The planner's per-rank peak of evaluating one window (``genoctx.plan.plan_eval``) of each model against the
    device's memory; a plan that does not fit is a one-line ``GenoctxError`` unless ``mesh.force``."""
    from ..plan import check_fits, plan_eval

    budget, device = _memory_budget(mesh)
    if budget is None:
        log.info("memory plan: no device memory known on the driver (--memory-gib); not checked")
        return
    for spec in specs:
        try:
            plan = plan_eval(spec.cfg, window, layout, gpu_memory_gib=budget, chunk_tokens=chunk_tokens,
                             dtype="bf16" if device == "cuda" else "fp32", device=device,
                             loss_vocab_rows=_loss_rows(spec), loss_chunk_tokens=spec.head_chunk_tokens,
                             cp_layout=mesh.cp_layout)  # fmt: skip
        except ValueError as e:  # a layout or option the planner cannot take
            raise GenoctxError(f"memory plan: {e}") from None
        if not mesh.force:
            check_fits(plan)
        log.info("memory plan (%s, %s): %s of %s per rank", layout.describe(), spec.path, _size(plan["total_gib"]),
                 _size(budget))  # fmt: skip


def _size(gib: float) -> str:
    return f"{gib:.1f} GiB" if gib >= 1 else f"{gib * 1024:.2f} MiB"


def _loss_rows(spec: EvalCheckpoint) -> int | None:
    return 5 if spec.loss_vocab == "nucleotide" else None


def score_on_mesh(
    paths: list[Path],
    data_dir: Path,
    split: str,
    edges: list[int],
    views: list[str],
    n: int,
    window: int,
    chunk_tokens: int | None,
    loss_vocab: str | None,
    mesh: MeshEval,
    verify: bool = True,
    given: list | None = None,
) -> list[tuple[EvalCheckpoint, dict[str, BinnedLoss]]]:
    """Score ``n`` windows of ``split`` with every checkpoint on the mesh of ``mesh`` (module docstring).

    Args:
        paths: resolved checkpoints (genoctx checkpoints, DCP or one-process, or HF model directories).
        data_dir, split: the prepared windows (visible to every worker: a shared filesystem on a cluster).
        edges, views: bins and views (``genoctx.eval.position``).
        n: windows scored (the first ``n`` of the split); window: their length in tokens.
        chunk_tokens: tokens per chunk (CP: per chunk of a piece); None = whole windows (pieces).
        loss_vocab: as ``evaluate``'s.
        mesh: the layout and where to run it.
        verify: the workers check every genoctx checkpoint's weight files against their recorded sizes and digests
            before building it (``genoctx.train.integrity.refuse_unverified``: recorded file ``i`` hashed by rank
            ``i % world``, the verdict agreed by every rank).
        given: the checkpoints as the user named them (a run directory: its newest checkpoint, refused naming the
            newest one that verifies when it does not); default ``paths``.

    Returns:
        Per checkpoint, in order: its ``EvalCheckpoint`` and ``{view: BinnedLoss}`` (arrays [n, bins]), equal to
        one process's ``score_windows`` up to float rounding.

    Raises:
        GenoctxError: a bad layout (``_check_layout``), an unreadable checkpoint (before any worker starts when
            the driver can tell; else the line every rank agreed on), a plan that does not fit (unless
            ``mesh.force``), or a failed worker group.
    """
    from ..model.hf import check_hf
    from ..train.checkpoint import validate_checkpoint

    specs = [eval_checkpoint(p, loss_vocab) for p in paths]
    for spec in specs:  # what the ranks would each find wrong, found once before any of them starts
        if spec.kind == "hf":
            check_hf(spec.path, spec.cfg)
        else:
            validate_checkpoint(spec.path)
    layout = _check_layout(mesh, specs, window)
    _check_memory(mesh, layout, specs, window, chunk_tokens)
    given = list(given) if given is not None else list(paths)
    config = {
        "checkpoints": [str(s.path) for s in specs],
        "verify": verify,
        "given": [str(g) for g in given],  # as named, for the messages
        "runs": [str(r.resolve()) if (r := run_of(g)) is not None else None for g in given],
        "data": str(Path(data_dir).resolve()),
        "split": split,
        "edges": list(edges),
        "views": list(views),
        "windows": n,
        "chunk_tokens": chunk_tokens,
        "loss_vocab": loss_vocab,
        "cp": layout.cp,
        "ep": layout.ep,
        "dp_shard": layout.dp_shard,
        "ep_folded": layout.ep_folded,
        "cp_layout": mesh.cp_layout if layout.cp > 1 else "contiguous",
    }
    storage = Path(tempfile.mkdtemp(prefix="genoctx-eval-"))
    ray_log = storage.with_name(storage.name + ".log")  # Ray's own lines: kept only when a failure names it
    try:
        run = mesh.run_workers(_eval_worker, config, num_workers=layout.world, storage_path=storage,
                               run_name=RUN_NAME, gpus_per_worker=mesh.gpus_per_worker, address=mesh.address,
                               max_failures=0, keep_checkpoints=0, what="distributed eval",
                               placement_timeout=mesh.placement_timeout, log_file=ray_log)  # fmt: skip
    except GenoctxError as e:
        if str(ray_log) not in str(e):
            ray_log.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    ray_log.unlink(missing_ok=True)
    got = run.value
    if not got or len(got.get("models", [])) != len(specs):
        raise GenoctxError("distributed eval failed: rank 0 returned no result")
    busiest = max((r["peak_memory_bytes"] for r in got["ranks"]), default=0)
    log.info("distributed eval on %s: %.1f s, busiest rank's peak memory %.1f MiB", layout.describe(), run.seconds,
             busiest / 2**20)  # fmt: skip
    out = []
    for spec, m in zip(specs, got["models"], strict=True):
        sums, cnts = {}, {}
        for key, (s_, c_) in m["sums"].items():
            strand, mask = key.split("/")
            sums[strand, mask], cnts[strand, mask] = np.asarray(s_, dtype=np.float64), np.asarray(c_, dtype=np.int64)
        out.append((spec, views_of(sums, cnts, views, edges)))
    return out
