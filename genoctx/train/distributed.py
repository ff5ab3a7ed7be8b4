"""Distributed training: the 4-D mesh's workers (the training worker and its driver; Ray itself is elsewhere).

``train_distributed`` is what ``genoctx train --num-workers N [--cp C] [--ep E] [--fsdp F]`` runs. It checks the
flags, the data and the memory plan, takes the run folder's lock and hands ``_train_worker`` to the worker runner it
is given (``genoctx.cluster.run_workers``, passed in by the CLI: this module imports neither Ray nor the cluster
layer above it); the worker reaches Ray Train only through the session object that runner hands it
(``genoctx.cluster.WorkerSession``: report, the checkpoint Ray restores, the device):

- Ray: an existing cluster (``address="auto"`` or ``"ray://HOST:PORT"``) or a local one started with no
  dashboard and a short temporary directory (``genoctx.cluster``). Ray Train
  creates the default process group (gloo on CPU, NCCL on CUDA); each worker then builds the device mesh
  ``dp_replicate x ep x dp_shard x cp`` (``genoctx.parallel.mesh.init_parallel``) and its model with
  ``genoctx.parallel.build.build_model`` (meta device, expert parallel, context parallel, activation checkpointing
  and FSDP2 applied from outside, then only this rank's shards allocated and filled: fresh, from the base's slices,
  or zeros for the checkpoint ``_resume`` loads), then builds the optimizer on the sharded parameters. On GPUs the
  memory planner (``genoctx.plan``) runs first: on the driver against ``--gpu-memory-gib`` or its own GPU, else
  (a driver without one, e.g. a CPU head node) on every worker against its GPU before the model is built
  (``_check_memory``). Each worker sets torch's CPU threads from its own node: its cores over the run's workers on
  that node (``worker_threads``); the allocator setting the planner assumes reaches it through Ray
  (``genoctx.cluster.worker_env``).
- Data: data rank ``d`` (over ``dp_replicate x ep x dp_shard``) takes samples ``(step * dp + d) * batch_size + b``
  (``sample_batch``); the CP ranks of a data rank take the same windows and each runs its pieces of them in the
  layout ``train.cp_layout``: ``contiguous`` (slice ``r`` on CP rank ``r``) or ``zigzag`` (pieces ``r`` and
  ``2 cp - 1 - r`` of ``2 cp``: the same DSA work on every rank; ``genoctx.parallel.context``).
- Checkpoints: every rank writes its shards of ``RUN/checkpoints/step_N`` (``torch.distributed.checkpoint``,
  atomic, reshardable to any layout: ``genoctx.train.sharded``; one worker writes the one-process safetensors
  form); ``genoctx eval`` and ``export`` read either; rank 0 reports it (``session.report``); Ray keeps its
  copy under ``RUN/ray``. ``--resume`` reruns the same ``RunConfig(name="ray", storage_path=RUN)``. Every attempt
  (the first, ``--resume``, or Ray's restart of the group after a worker died: ``FailureConfig``) starts from the
  newest complete checkpoint that verifies (its files against their recorded digests, the hashing shared by the
  ranks: ``genoctx.train.integrity``), Ray's (``session.checkpoint_dir()``) or the run's own, whichever is later
  (``_choose_checkpoint``, ``_resume``): Ray registers a report only once every worker's report is collected, so a
  kill soon after a save would otherwise redo its steps. ``RUN/events.jsonl`` records each attempt (step loaded,
  partial saves removed, steps run); the summary's ``resumed_from`` is the step this invocation loaded and
  ``attempts`` lists its attempts.
- Metrics: ``RUN/metrics.jsonl`` (rank 0) holds, per step, the global loss and a ``ranks`` list with each rank's
  mesh coordinates, tokens, tokens/s, peak memory, MoE max/mean expert load, DSA indexer (query, pool) pairs scored
  (``dsa_keys_scored``) and, under EP, the (token, slot) rows its experts received (``ep_received_rows``,
  ``ep_max_round_rows``). The summary prints the busiest rank's load over the mean (``rank_imbalance``). Rank 0 also
  sends each row's scalars to ``train.loggers`` (TensorBoard, MLflow, W&B: ``genoctx.train.metrics``).
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

from ..errors import AgreedError, GenoctxError
from ..heap import keep_freed_memory
from ..recipes import Recipe

log = logging.getLogger("genoctx.train")

RAY_RUN_NAME = "ray"  # Ray Train's run directory under RUN (its checkpoint copies and state snapshot)


def _rank_stats(model, tokens: int, dt: float, device) -> dict:
    from .loop import peak_memory_bytes

    stats = model.layer_stats()
    moe = [s["moe_load_max_over_mean"] for s in stats if s.get("moe_load_max_over_mean") is not None]
    return {
        "tokens": tokens,
        "tokens_per_s": tokens / dt if dt > 0 else None,
        "peak_memory_bytes": peak_memory_bytes(device),
        "moe_load_max_over_mean": max(moe) if moe else None,
        "dsa_keys_scored": sum(int(s.get("keys_scored") or 0) for s in stats if s["mixer"] == "dsa"),
        # expert parallel: (token, slot) rows this rank's experts received over all MoE layers, and the largest
        # receive of one dispatch round (bounded by moe_chunk_tokens x top-k whatever the routing)
        "ep_received_rows": sum(int(s.get("ep_received_rows") or 0) for s in stats),
        "ep_max_round_rows": max((int(s.get("ep_max_round_rows") or 0) for s in stats), default=0),
    }


def _rank_line(dims, ranks: list[dict]) -> str:
    """The layout and, under expert parallelism, the busiest rank's received expert rows over the mean."""
    line = dims.layout.describe()
    rows = [r.get("ep_received_rows") or 0 for r in ranks]
    if dims.ep > 1 and sum(rows) > 0:
        line += f"  ep rows busiest/mean {max(rows) * len(rows) / sum(rows):.2f}"
    return line


def worker_logging() -> None:
    """In a Ray worker: genoctx's progress lines (INFO, plain) on stderr, whatever level Ray's own logging is at; Ray
    forwards them to the driver's stderr. ``genoctx.progress``'s plain lines on rank 0 only (it speaks for the
    group: its chunks, windows and compile lines); call after the process group exists (Ray Train's)."""
    import torch.distributed as dist

    from ..progress import plain_lines

    plain_lines(not dist.is_initialized() or dist.get_rank() == 0)
    glog = logging.getLogger("genoctx")
    if not glog.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        glog.addHandler(handler)
    glog.setLevel(logging.INFO)
    glog.propagate = False


def node_cores() -> int:
    """The CPU cores this process may run on (its CPU affinity; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - no affinity API (macOS)
        return os.cpu_count() or 1


def worker_threads(session, configured: int | None = None) -> int:
    """Torch CPU threads of one worker: ``configured`` (``train.num_threads``) when set, else the cores of the
    worker's own node (``node_cores``) over the run's workers on that node (``session.local_world_size()``: Ray's
    local world size; a session without it is a local stand-in whose ranks all share this machine: the world size).

    Workers on one node share its cores (the CPU AdamW of ``train.offload_optimizer`` runs on them); computed on the
    worker because the driver, on another machine with ``--address``, knows neither its cores nor its neighbours.
    """
    import torch.distributed as dist

    if configured:
        return configured
    local = session.local_world_size() if hasattr(session, "local_world_size") else dist.get_world_size()
    return max(1, node_cores() // max(1, local))


def _train_worker(config: dict, session) -> None:
    """The worker loop (one process per rank of the mesh). ``config``: recipe dict, paths, layout, fault;
    ``session``: the worker's view of Ray Train (``genoctx.cluster.WorkerSession``: ``report``, ``checkpoint_dir``,
    ``device``)."""
    import torch
    import torch.distributed as dist

    from ..data.dataset import WindowDataset
    from ..model.vocab import TokenMap, VocabHead
    from ..parallel import collectives as coll
    from ..parallel.build import Fresh, Zeros, build_model
    from ..parallel.mesh import init_parallel
    from ..recipes import recipe_from_dict
    from .checkpoint import is_partial, read_state
    from .faults import DRIVER_ENV, ENV, maybe_kill
    from .frozen import describe_fp8, frozen_fp8
    from .init import base_source
    from .loop import (
        build_optimizer,
        describe_trainable,
        end_attempt,
        log_step,
        lora_spec,
        sample_batch,
        save_run_checkpoint,
        train_autocast,
        train_step,
        trainable_counts,
    )
    from .metrics import MetricsLog
    from .sharded import save_sharded

    worker_logging()
    if config.get("fault"):  # fault injection of the restart tests (genoctx.train.faults)
        os.environ[ENV], os.environ[DRIVER_ENV] = config["fault"], str(config["driver_pid"])
    recipe = recipe_from_dict(config["recipe"], "<ray config>")
    cfg = recipe.train
    out, data_dir = Path(config["out"]), Path(config["data"])
    dims = init_parallel(config["cp"], layout=cfg.cp_layout, ep=config.get("ep", 1), dp_shard=config.get("dp_shard", 1),
                         ep_folded=config.get("ep_folded", False), fsdp_one=config.get("fsdp_one", False))  # fmt: skip
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(worker_threads(session, cfg.num_threads))
    dev = session.device()  # its GPU, or the CPU when gpus_per_worker is 0
    if dev.type == "cpu":  # activations in this process's heap: keep it (genoctx.heap)
        keep_freed_memory()
    if config.get("plan_on_workers"):  # the driver had no GPU memory to plan against
        _plan_on_worker(recipe, config, dims, dev, rank)
    torch.manual_seed(cfg.seed)
    picked = _choose_checkpoint(out, rank, session, dims, verify=cfg.verify_checkpoints)
    extra = config["extra"]  # the base, token map and loss vocabulary (genoctx.train.init.describe)
    base = extra.get("init")  # loaded only when no checkpoint is (a fresh run from a base)
    if picked is None and base is not None and base.get("kind") == "genoctx" and cfg.verify_checkpoints:
        from .integrity import refuse_unverified

        init_run = Path(config["init_run"]) if config.get("init_run") else None  # a run directory given
        refuse_unverified(Path(base["path"]), base["source"], init_run, "--init", "start from it", dims=dims)
    # a run from a base training a subset (the driver's partial_record): its checkpoints hold what trains, so a resume
    # builds from the base and loads them over it
    held = partial_held(recipe) if is_partial(extra) else None
    source = (base_source(base) if held is not None else Zeros()) if picked is not None else (
        base_source(base) if base is not None else Fresh())  # fmt: skip
    bf16_params = torch.bfloat16 if cfg.dtype == "bf16" and dev.type == "cuda" else None  # FSDP MixedPrecisionPolicy
    # train.frozen_dtype: fp8 (genoctx.train.frozen): holders made on meta, EP-sliced with the experts, filled per rank
    fp8 = frozen_fp8(cfg, recipe.model, base, read_state(picked[2]) if picked is not None else None)
    extra = {**extra, **describe_fp8(fp8)}
    # meta device -> EP, CP, AC, FSDP2 -> to_empty -> this rank's shards (genoctx.parallel.build)
    model = build_model(recipe.model, dims, source=source, device=dev, param_dtype=bf16_params,
                        activation_checkpointing=cfg.activation_checkpointing,
                        offload_activations=cfg.offload_activations,
                        offload_optimizer=cfg.offload_optimizer, compile=cfg.compile,
                        lora=lora_spec(recipe), frozen_fp8=fp8)  # fmt: skip
    optimizer, scheduler = build_optimizer(model, cfg, cfg.steps)  # on the sharded parameters
    if rank == 0 and cfg.trainable != "all":
        log.info(describe_trainable(trainable_counts(model, cfg.trainable)))
    head = None
    if extra.get("token_map"):
        head = VocabHead(TokenMap.from_dict(extra["token_map"]), extra["loss_vocab"], recipe.loss.chunk_tokens)
    start, loaded, attempt = _resume(out, picked, model, optimizer, scheduler, rank, world, config["invocation"], dims,
                                     session=session, held=held)  # fmt: skip
    ds = WindowDataset(data_dir, "train")
    autocast = train_autocast(cfg.dtype, dev)
    end = cfg.steps if config["stop_after"] is None else min(cfg.steps, config["stop_after"])
    steps_run, status = 0, "failed"
    try:
        with MetricsLog(out, cfg.loggers, start, recipe, attempt["attempt"]) if rank == 0 else nullcontext() as metrics:
            for step in range(start, end):
                maybe_kill("step", rank, step, out)
                t0 = time.perf_counter()
                tokens, data_state = sample_batch(ds, cfg, step, dims.dp, dims.dp_rank)
                model.train()
                m = train_step(model, optimizer, scheduler, tokens.to(dev), cfg, autocast, dims, head=head)
                steps_run += 1
                dt = time.perf_counter() - t0
                mine = {"rank": rank, **dims.coordinates()}
                mine.update(_rank_stats(model, tokens.numel() // dims.cp, dt, dev))
                ranks = [None] * world
                coll.all_gather_object(ranks, mine)
                row = {
                    "step": step + 1,
                    "attempt": attempt["attempt"],
                    **m,
                    "tokens": sum(r["tokens"] for r in ranks),
                    "tokens_per_s": sum(r["tokens"] for r in ranks) / max(dt, 1e-9),
                    "peak_memory_bytes": max(r["peak_memory_bytes"] for r in ranks),
                    "layers": model.layer_stats(),
                    "ranks": ranks,
                }
                if rank == 0:
                    metrics.write(row)
                    if (step + 1) % cfg.log_every == 0 or step + 1 == end:
                        log_step(step + 1, cfg.steps, m, row["tokens_per_s"], _rank_line(dims, ranks))
                if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == end:
                    report = {"step": step + 1, "loss": m["loss"]}
                    if dims.is_distributed:  # every rank writes its shards (genoctx.train.sharded; also fsdp_one)
                        state = {"data": data_state, "seed": cfg.seed, **extra, "cp": dims.cp, "dp": dims.dp}
                        path = save_sharded(out, step + 1, model, optimizer, scheduler, recipe, state, dims,
                                            keep=cfg.keep_checkpoints, held=held)  # fmt: skip
                    elif rank == 0:
                        path = save_run_checkpoint(out, step + 1, model, optimizer, scheduler, recipe, data_state, dims,
                                                   extra=extra)  # fmt: skip
                    session.report(report, checkpoint_dir=path if rank == 0 else None)
        status = "completed"
    finally:
        if rank == 0:
            end_attempt(out, attempt, status, steps_run)


def _choose_checkpoint(out: Path, rank: int, session, dims=None, verify: bool = True):
    """Where this attempt of the worker group starts: the newest complete checkpoint that verifies, Ray's
    (``session.checkpoint_dir()``, restored from ``RUN/ray`` on ``--resume``) or the run's own
    (``RUN/checkpoints``), the later step first (the run's own at the same step); None when there is none.

    Ray registers a reported checkpoint only once the controller has collected every worker's report; a worker
    killed soon after a save, or a driver killed during one, leaves newer complete checkpoints in
    ``RUN/checkpoints`` than Ray knows of. Rank 0 lists the candidates and broadcasts them; with ``verify`` every
    rank then checks them in turn, newest first (``genoctx.train.integrity.check_checkpoint``: the hashing spread
    over the ranks, the verdict the same on every rank) until one verifies; rank 0 warns about each one skipped and
    sets the run's own aside (``set_aside``). A collective.

    Returns:
        ``(step, "ray" | "run", path or None)`` or None.

    Raises:
        AgreedError: (every rank) there are checkpoints but none verifies, the newest one's problem named.
    """
    from ..parallel import collectives as coll
    from .checkpoint import list_checkpoints, step_of
    from .integrity import ALL, check_checkpoint, problem, set_aside, skip_line, warn_unrecorded

    cands = [None]
    if rank == 0:
        found = []
        with session.checkpoint_dir() as d:
            if d is not None:  # (an unreadable state.json: last, and found broken when checked)
                found.append((_step_or(d, -1), "ray", None))
        found += [(step_of(c), "run", str(c)) for c in list_checkpoints(out)]
        cands = [sorted(found, key=lambda c: (c[0], c[1] == "run"), reverse=True)]
    coll.broadcast_object_list(cands, src=0)
    cands = cands[0]
    if not verify or not cands:
        return cands[0] if cands else None
    skipped = []
    for cand in cands:
        step, source, path = cand
        if source == "ray":
            with session.checkpoint_dir() as d:  # every rank's view of Ray's copy
                report = check_checkpoint(d, ALL, dims, validate_unrecorded=True)
        else:
            report = check_checkpoint(Path(path), ALL, dims, validate_unrecorded=True)
        bad = problem(report)
        if bad is None:
            warn_unrecorded(report, dims)
            if rank == 0:
                for (s_, src, p), why in skipped:
                    aside = set_aside(Path(p)) if src == "run" and Path(p).is_dir() else None
                    log.warning(skip_line(p if src == "run" else f"step {s_} (Ray's copy)", why, aside))
            return cand
        skipped.append((cand, bad))
    raise AgreedError(f"--resume: no checkpoint of {out} verifies; the newest: {skipped[0][1]}; --no-verify loads it "
                      "anyway, or start a new --out")  # fmt: skip


def _step_or(ckpt: Path, default: int) -> int:
    """The step in ``ckpt/state.json``, or ``default`` when it cannot be read."""
    from .checkpoint import read_state

    try:
        return int(read_state(ckpt)["step"])
    except GenoctxError:
        return default


def partial_held(recipe: Recipe) -> set[str]:
    """The one-device names a partial checkpoint of ``recipe``'s model holds (``genoctx.train.checkpoint.held_names``
    of ``train.trainable``), from the model built on the meta device with its adapters (no memory)."""
    from ..parallel.build import build_model
    from .checkpoint import held_names
    from .loop import lora_spec

    return held_names(build_model(recipe.model, None, materialize=False, lora=lora_spec(recipe)),
                      recipe.train.trainable)  # fmt: skip


def _resume(
    out: Path, picked, model, optimizer, scheduler, rank: int, world: int, invocation: str, dims=None, *, session=None,
    held: set[str] | None = None,
) -> tuple[int, Path | None, dict]:  # fmt: skip
    """Load the checkpoint ``_choose_checkpoint`` picked on every rank (a ``RUN/checkpoints`` choice must be visible
    to every rank: RUN on a shared filesystem); rank 0 then records the attempt
    (``genoctx.train.loop.begin_attempt``: partial saves removed, metrics cut back, ``start`` event).

    Returns:
        (step loaded, 0 for none; the checkpoint loaded or None; the ``start`` event of the attempt).

    Raises:
        GenoctxError: the chosen checkpoint is unreadable, or not visible on this rank.
    """
    from ..parallel import collectives as coll
    from .checkpoint import load_training_state
    from .loop import begin_attempt
    from .sharded import load_any

    def load(path: Path) -> None:  # any layout into this one (a collective when distributed)
        if dims is not None and dims.is_distributed:
            load_any(path, model, optimizer, scheduler, dims, held=held)
        else:
            load_training_state(path, model, optimizer, scheduler)

    start, loaded = 0, None
    if picked is not None:
        step, source, path = picked
        if source == "ray":
            with session.checkpoint_dir() as d:  # the one _choose_checkpoint read on rank 0
                load(d)
                loaded = Path(d)  # Ray's copy (named in the log and the start event: what was read)
        else:
            if not Path(path).is_dir():
                raise GenoctxError(
                    f"rank {rank}: checkpoint {path} is not visible on this node; put --out on a shared filesystem"
                )
            load(Path(path))
            loaded = Path(path)
        start = step
    attempt = [0]
    if rank == 0:
        if loaded is not None:
            what = "Ray's copy of the checkpoint, " if picked[1] == "ray" else ""
            log.info("resuming from %s%s (step %d)", what, loaded, start)
        attempt = [begin_attempt(out, start, loaded, invocation, workers=world)]
    coll.broadcast_object_list(attempt, src=0)
    return start, loaded, attempt[0]


def _summary(out: Path, recipe: Recipe, invocation: str, elapsed: float) -> dict:
    from .checkpoint import latest_checkpoint
    from .loop import invocation_attempts

    attempts = invocation_attempts(out, invocation)
    start = attempts[0]["resumed_from"] if attempts else None

    path = out / "metrics.jsonl"
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []
    per_rank: dict[int, dict] = {}
    for row in rows:
        for r in row.get("ranks", []):
            acc = per_rank.setdefault(r["rank"], {"tokens": 0, "dsa_keys_scored": 0, "ep_received_rows": 0})
            for key in acc:
                acc[key] += r.get(key) or 0

    def busiest_over_mean(key: str) -> float | None:
        vals = [v[key] for v in per_rank.values()]
        mean = sum(vals) / len(vals) if vals else 0
        return max(vals) / mean if mean > 0 else None

    last = rows[-1] if rows else None
    ckpt = latest_checkpoint(out)
    return {
        "run": str(out),
        "checkpoint": str(ckpt) if ckpt else None,
        "steps": recipe.train.steps,
        "step": last["step"] if last else (start or 0),
        "resumed_from": start,
        "attempts": attempts,
        "removed_partial_checkpoints": [n for a in attempts for n in a["removed_partial"]],
        "final_loss": last["loss"] if last else None,
        "tokens_per_s": last["tokens_per_s"] if last else None,
        "peak_memory_bytes": last["peak_memory_bytes"] if last else None,
        "workers": len(per_rank),
        "rank_imbalance": {
            "dsa_keys_scored_max_over_mean": busiest_over_mean("dsa_keys_scored"),
            "tokens_max_over_mean": busiest_over_mean("tokens"),
            "ep_received_rows_max_over_mean": busiest_over_mean("ep_received_rows"),
            "moe_load_max_over_mean": max(
                (r["moe_load_max_over_mean"] or 0.0 for r in (last or {}).get("ranks", [])), default=None
            ),
        },
        "elapsed_s": elapsed,
    }


def train_distributed(
    data_dir: str | Path,
    recipe: Recipe,
    out: str | Path,
    *,
    run_workers: Callable,
    num_workers: int,
    cp: int = 1,
    ep: int = 1,
    fsdp: int = 1,
    ep_folded: bool = False,
    force: bool = False,
    address: str | None = None,
    gpus_per_worker: float = 0,
    placement_timeout: float | None = None,
    resume: bool = False,
    stop_after: int | None = None,
    max_failures: int = 2,
    wait: bool = False,
    allow_batch_change: bool = False,
    gpu_memory_gib: float | None = None,
) -> dict:
    """Train with ``num_workers`` Ray workers on the mesh ``dp_replicate x ep x dp_shard x cp``
    (``genoctx.parallel.layout``; ``dp_shard`` = ``fsdp``, ``dp_replicate`` = ``num_workers / (ep fsdp cp)``).

    Args:
        data_dir: prepared data directory (``genoctx prepare --out``).
        recipe: the resolved recipe; ``train.batch_size`` is per DP rank.
        out: run directory (``checkpoints/``, ``metrics.jsonl``, ``ray/``).
        run_workers: runs the worker function on the workers and returns the seconds they ran (``.seconds``):
            ``genoctx.cluster.run_workers`` (the CLI passes it in: this layer does not import the one above it).
        num_workers: Ray workers (processes), one rank each.
        cp: context-parallel size; the window (or ``train.seq_len``) in tokens must split into ``cp`` pieces
            (``2 cp`` with ``train.cp_layout: zigzag``) of at least ``linear_conv_kernel_dim - 1`` tokens.
        ep: expert-parallel size; divides ``n_routed_experts``.
        fsdp: FSDP2 shard size (``dp_shard``); ``ep x fsdp x cp`` must divide ``num_workers``.
        ep_folded: draw the EP groups from the ``fsdp x cp`` ranks (``Layout.ep_folded``): ``ep`` must divide
            ``fsdp x cp``, and ``fsdp x cp`` must divide ``num_workers``.
        force: launch even when the memory planner (``genoctx.plan``) predicts that the layout does not fit.
        address: Ray cluster address (``"auto"``, ``"ray://HOST:PORT"``); None starts a local Ray.
        gpus_per_worker: GPUs per worker: 1 trains on CUDA with NCCL, 0 on CPU with gloo.
        placement_timeout: seconds the workers may wait for their resources (``run_workers``'s; None = its default,
            0 = forever).
        resume: continue the run in ``out`` from its newest checkpoint that verifies (``train.verify_checkpoints``).
        stop_after: end this invocation after that step (checkpointed); ``resume`` continues.
        max_failures: worker-group restarts (from the last checkpoint) before giving up.
        wait: when another process writes ``out`` (``genoctx.lock.output_lock``), wait for it instead of failing.
        allow_batch_change: let a ``resume`` change the data-parallel size, and so the tokens per step
            (``genoctx.train.loop.check_global_batch``; recorded in state.json's ``batch_changes``).
        gpu_memory_gib: memory of one worker's GPU in GiB for the memory plan before launch; None = this machine's
            GPU, or (a driver without one) each worker plans against its own GPU before building the model
            (``_check_memory``).

    Returns:
        The run summary (as ``train``'s, plus ``workers`` and ``rank_imbalance``: the busiest rank's DSA pools
        scored and tokens over the mean, and the largest MoE max/mean expert load).

    Raises:
        GenoctxError: ``out`` held by another writer, bad worker counts, a window that does not split into the
            layout's pieces, existing checkpoints without ``resume``, or a training failure after ``max_failures``
            restarts.
    """
    from ..data.dataset import WindowDataset
    from ..lock import output_lock
    from ..parallel.layout import Layout, cp_pieces, uneven_seq_chunk_round
    from .init import resolve_init, vocab_head
    from .loop import _check_manifest, check_run_to_resume, check_seq_len, describe_window, unused_seq_chunk
    from .metrics import check_loggers

    check_loggers(recipe.train.loggers)  # a logger's missing package: before Ray starts (rank 0 imports it)
    try:
        mesh_layout = Layout.for_world(num_workers, ep=ep, dp_shard=fsdp, cp=cp, ep_folded=ep_folded,
                                       fsdp_one=recipe.train.fsdp_one)  # fmt: skip
    except ValueError as e:
        raise GenoctxError(str(e)) from None
    out, data_dir = Path(out).resolve(), Path(data_dir).resolve()
    _check_manifest(data_dir)
    if resume:
        check_run_to_resume(out)
    # resolved once here (a Hub download; a resume at the run's recorded commit); the workers read the local path
    recipe, base = resolve_init(recipe, out if resume else None)
    vocab_head(recipe, base)  # a bad tokenizer: an error before --out is touched
    if ep > 1 and recipe.model.n_routed_experts % ep:
        raise GenoctxError(
            f"--ep {ep} must divide model.n_routed_experts ({recipe.model.n_routed_experts}): each rank holds "
            "an equal block of experts"
        )
    window = WindowDataset(data_dir, "train").window
    check_seq_len(recipe.train, window, data_dir)
    L = recipe.train.seq_len or window
    layout = recipe.train.cp_layout if cp > 1 else "contiguous"  # one process never cuts the window
    pieces, tail = sum(len(p) for p in cp_pieces(cp, layout)), recipe.model.linear_conv_kernel_dim - 1
    if L % pieces or L // pieces < tail:
        how = f" with train.cp_layout={layout}" if layout != "contiguous" else ""
        raise GenoctxError(
            f"--cp {cp}{how}: the {L}-token training window does not split into {pieces} equal slices "
            f"of at least {tail} tokens"
        )
    chunk = recipe.train.seq_chunk_tokens
    if cp > 1 and chunk is not None and chunk * cp < L:  # each rank chunks its piece: rounds of cp x chunk tokens
        last = L % (chunk * cp) or chunk * cp
        if uneven_seq_chunk_round(L, chunk, cp, layout, max(tail, 1)) is not None:
            raise GenoctxError(
                f"--seq-chunk {chunk} with --cp {cp}: rounds of {chunk * cp} tokens (the last one {last}) of the "
                f"{L}-token window do not split into {pieces} equal pieces of at least {max(tail, 1)} tokens "
                f"({layout} layout)"
            )
    if (unused := unused_seq_chunk(recipe.train, window, cp)) is not None:
        log.warning(unused[0])
    log.info("train %s", describe_window(recipe.train, window, cp))
    planned = _check_memory(recipe, L, mesh_layout, gpus_per_worker, force, gpu_memory_gib)
    with output_lock(out, wait=wait, what="train"):  # the driver is the run folder's one writer (rank 0 writes for it)
        return _launch(run_workers, data_dir, recipe, base, out, mesh_layout, address, gpus_per_worker, resume,
                       stop_after, max_failures, placement_timeout, allow_batch_change, L,
                       {"plan_on_workers": not planned, "force": force})  # fmt: skip


def _launch(run_workers, data_dir, recipe, base, out, layout, address, gpus_per_worker, resume, stop_after,
            max_failures, placement_timeout, allow_batch_change, seq_len, plan=None):  # fmt: skip
    from .checkpoint import HOLDS, TRAINABLE, latest_checkpoint, partial_record, validate_checkpoint
    from .faults import ENV as FAULT_ENV
    from .faults import parse_fault
    from .init import describe, vocab_head
    from .loop import carry_batch_changes, check_global_batch, check_resume, record_event, warn_newer_incomplete

    latest = latest_checkpoint(out)
    if latest is not None and not resume:
        raise GenoctxError(
            f"{out} already holds checkpoints (latest {latest.name}); pass --resume to continue or choose a new --out"
        )
    state = change = None
    if resume and latest is not None:
        latest = _readable_checkpoint(out, recipe.train.verify_checkpoints)
        state = validate_checkpoint(latest)  # an unreadable checkpoint: a one-line error here, not a failed group
        check_resume(recipe, latest, state, base)
        per_rank = recipe.train.batch_size * seq_len  # tokens per data rank per step (seq_len: the crop or window)
        change = check_global_batch(latest, state, layout.dp, per_rank, allow_batch_change)
    if resume:
        warn_newer_incomplete(out, latest)
    # a run from a base training a subset: its checkpoints hold what trains and name the base (a resume checks it);
    # also checks an --init run's own base when that run is partial (the ranks read it)
    partial = partial_record(recipe.train.trainable, base, state, latest)
    extra = describe(base, vocab_head(recipe, base, state))
    if state is not None and state.get("init") and base is None:
        extra["init"] = state["init"]
    carry_batch_changes(extra, state, change)
    if partial is not None:
        extra.update({"init": partial, HOLDS: TRAINABLE})
    out.mkdir(parents=True, exist_ok=True)
    if change is not None:
        record_event(out, {"event": "batch_change", **change})
    fault = os.environ.get(FAULT_ENV)  # genoctx.train.faults: kill a worker (or a save) once, for restart tests
    parse_fault(fault)
    invocation = uuid.uuid4().hex[:12]
    config = {
        "recipe": recipe.to_dict(),
        "out": str(out),
        "data": str(data_dir),
        "cp": layout.cp,
        "ep": layout.ep,
        "dp_shard": layout.dp_shard,
        "ep_folded": layout.ep_folded,
        "fsdp_one": layout.fsdp_one,
        "stop_after": stop_after,
        "gpus_per_worker": gpus_per_worker,
        "seq_len": seq_len,
        **(plan or {"plan_on_workers": False, "force": False}),  # _check_memory's verdict: plan on the workers?
        "fault": fault or None,
        "driver_pid": os.getpid(),
        "invocation": invocation,
        "extra": extra,
        "init_run": str(init_run.resolve()) if (init_run := _init_run(base)) is not None else None,
    }
    run = run_workers(  # Ray's stdout lines go to stderr there: stdout is for the JSON summary only
        _train_worker,
        config,
        num_workers=layout.world,
        storage_path=out,
        run_name=RAY_RUN_NAME,
        gpus_per_worker=gpus_per_worker,
        address=address,
        max_failures=max_failures,
        keep_checkpoints=recipe.train.keep_checkpoints,
        what="distributed training",
        placement_timeout=placement_timeout,
    )
    return _summary(out, recipe, invocation, run.seconds)


def _readable_checkpoint(out: Path, verify: bool) -> Path:
    """The checkpoint the driver checks a ``--resume`` against (``check_resume``): the newest, or with ``verify`` the
    newest whose small files read (``validate_checkpoint``); the workers then choose the one they load by its
    digests (``_choose_checkpoint``). No readable one: the newest (its error is then the driver's one line)."""
    from .checkpoint import latest_checkpoint, list_checkpoints, validate_checkpoint

    if verify:
        for ck in reversed(list_checkpoints(out)):
            try:
                validate_checkpoint(ck)
                return ck
            except GenoctxError:
                continue
    return latest_checkpoint(out)


def _init_run(base: dict | None) -> Path | None:
    """The run directory ``--init`` named (a genoctx base given as a run, not one checkpoint), or None."""
    from .integrity import run_of

    return run_of(base["source"]) if base is not None and base.get("kind") == "genoctx" else None


def plan_check(recipe: Recipe, seq_len: int, layout, gib: float, force: bool) -> dict:
    """The memory planner's plan (``genoctx.plan.plan_memory``) of one training step of ``recipe`` at ``seq_len``
    tokens on ``layout`` against ``gib`` GiB per GPU, with the recipe's memory knobs as training runs them.

    Raises:
        GenoctxError: a layout or option the planner cannot take, or (unless ``force``) a plan that does not fit
            (``check_fits``: one line with the breakdown).
    """
    from ..plan import check_fits, plan_memory

    t = recipe.train
    try:
        plan = plan_memory(recipe.model, seq_len, layout, gpu_memory_gib=gib, batch_size=t.batch_size,
                           recompute=t.activation_checkpointing, dtype=t.dtype, optimizer_offload=t.offload_optimizer,
                           seq_chunk_tokens=t.seq_chunk_tokens, optimizer_state_dtype=t.optimizer_state_dtype,
                           offload_activations=t.offload_activations)  # fmt: skip
    except ValueError as e:  # a layout or option the planner (and the run) cannot take
        raise GenoctxError(f"memory plan: {e}") from None
    if not force:
        check_fits(plan)
    return plan


def _plan_on_worker(recipe: Recipe, config: dict, dims, dev, rank: int) -> None:
    """The memory plan (``plan_check``) on a GPU worker, against its own GPU's memory (``device_memory_gib``), before
    its model is built; one verdict on every rank (``agree``: a collective). Nothing on a CPU worker.

    Raises:
        AgreedError: the plan does not fit some rank's GPU (unless ``config["force"]``), its line on every rank.
    """
    from ..parallel.build import agree

    if dev.type != "cuda":
        return
    gib = device_memory_gib(dev)
    plan = agree(dims, lambda: plan_check(recipe, config["seq_len"], dims.layout, gib, config["force"]))
    if rank == 0:
        _log_plan(plan, dims.layout, gib, "this worker's GPU")


def device_memory_gib(dev) -> float:
    """The total memory of CUDA device ``dev`` in GiB (``torch.cuda.get_device_properties``)."""
    import torch

    return torch.cuda.get_device_properties(dev).total_memory / 2**30


def _log_plan(plan: dict, layout, gib: float, where: str) -> None:
    log.info("memory plan (%s, %s): %.1f GiB of %.1f per GPU", layout.describe(), where, plan["total_gib"], gib)


def _check_memory(recipe: Recipe, seq_len: int, layout, gpus_per_worker: float, force: bool,
                  gpu_memory_gib: float | None = None) -> bool:  # fmt: skip
    """Run the memory planner (``plan_check``) for this layout before anything is launched, on GPU workers, against
    ``gpu_memory_gib`` or else this machine's GPU. A layout predicted not to fit is refused (``GenoctxError`` with
    the breakdown) unless ``force``. CPU runs are not planned (host memory is shared by the workers and the
    planner's budget is per GPU).

    Returns:
        False when the plan is left to the workers: GPU workers, and the driver has no GPU and no
        ``gpu_memory_gib`` (a CPU-only head node of a cluster); the log says so, and each worker then checks it
        against its own GPU's memory before building the model (the same verdict on every rank). True otherwise.
    """
    if gpus_per_worker <= 0:
        return True
    gib = gpu_memory_gib
    where = "--gpu-memory-gib" if gib is not None else "this machine's GPU"
    if gib is None:
        import torch

        if not torch.cuda.is_available():
            log.info("memory plan: this driver has no GPU and no --gpu-memory-gib was given; each worker checks it "
                     "against its own GPU before building the model")  # fmt: skip
            return False
        gib = device_memory_gib(torch.device("cuda", 0))
    _log_plan(plan_check(recipe, seq_len, layout, gib, force), layout, gib, where)
    return True
