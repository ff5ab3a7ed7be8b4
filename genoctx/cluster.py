"""Ray plumbing: run a group of worker processes with Ray Train (V2 ``TorchTrainer``), locally or on a cluster.

This module knows nothing of training or evaluation. ``run_workers(worker_fn, config, ...)`` is handed the function
every worker runs; the caller (``genoctx train --num-workers N`` through ``genoctx.train.distributed``, later
``genoctx eval --num-workers N`` through ``genoctx.eval.distributed``) prepares the worker's ``config`` and reads what
rank 0's worker function returned (``WorkerRun.value``) or what the workers wrote once they are done:

- Ray: an existing cluster (``address="auto"`` or ``"ray://HOST:PORT"``) or a local one started with no dashboard
  and a short temporary directory (``_ray_temp_dir``: unix socket paths are limited to ~107 characters), stopped
  again at the end. Ray prints worker and raylet lines to stdout; stdout is for the caller's JSON summary only, so
  they go to stderr.
- Resources: a local Ray gets the GPUs torch sees (``torch.cuda.device_count()``) and ``max(num_workers + 1,
  cpu_count)`` CPUs (CPU workers may oversubscribe a laptop); a request for more GPUs than that is refused before
  Ray starts (``check_local``). On any Ray the group's placement group (``{"CPU": 1, "GPU": 1}`` per GPU worker, PACK,
  as Ray Train asks for it) is reserved before the trainer starts: a group the cluster's nodes cannot hold at their
  present size is refused at once, one that does not get its resources within ``placement_timeout`` seconds
  (``--placement-timeout``, default ``PLACEMENT_TIMEOUT_S``; 0 waits forever, as Ray Train does) is refused then;
  either is one line naming the request and the cluster's free and total resources, the reservation removed and
  the driver disconnected. Ray Train itself would retry an unplaceable group forever (ray-project/ray#27287); its
  own bound (``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`` with ``FailureConfig.controller_failure_limit=0``) ends the
  same way but prints the controller's tracebacks through the driver. Resources another job takes between the
  check and Ray Train's own reservation make Ray Train wait for them as before. A ``HOST:PORT`` address where
  nothing listens is refused at once (``_reachable``; Ray retries it for ~20 minutes).
- Workers: ``num_workers`` processes, ``gpus_per_worker`` GPUs each: 1 (one GPU per rank; Ray Train sets it as the
  worker's current CUDA device) or 0 (CPU); anything else is refused (``check_gpus_per_worker``: a fraction puts two
  NCCL ranks on one GPU, more than one leaves GPUs idle). Ray Train creates the default process group (gloo on CPU,
  NCCL on CUDA) before ``worker_fn(config, session)`` is called on every worker. Every worker gets
  ``PYTORCH_ALLOC_CONF`` with ``expandable_segments:True`` (what the memory planner assumes) through its Ray
  runtime environment (``worker_env``), on a local Ray and on a cluster alike.
- Failures: Ray restarts the whole group up to ``max_failures`` times (``FailureConfig``); Ray keeps the
  ``keep_checkpoints`` newest reported checkpoints (0: all) under ``storage_path/run_name``. A group that still fails
  is a one-line ``GenoctxError``.

The worker never imports Ray: what it needs of Ray Train's per-worker API comes in the ``WorkerSession`` it is
handed (report a step and its checkpoint, the checkpoint Ray restores after a restart or on ``--resume``, the
worker's device).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import AgreedError, GenoctxError

_SOCKET_BUDGET = 40  # characters of the Ray temp dir that keep its socket paths under the unix limit
# seconds a worker group may wait for its resources on a cluster whose nodes can hold it: longer than an autoscaler
# takes to add a GPU node (boot plus a CUDA image pull, minutes), short enough that a busy cluster says so in minutes
PLACEMENT_TIMEOUT_S = 600.0
_STRATEGY = "PACK"  # Ray Train's default placement strategy (ScalingConfig.placement_strategy), given to both


_TEMP_NOTE = ".ray-temp"  # RUN/.ray-temp: the /tmp directory of the run's local Ray when RUN/.ray is too long
log = logging.getLogger("genoctx.cluster")


def _ray_temp_dir(out: Path) -> str:
    """``RUN/.ray`` when short enough for Ray's unix sockets, else a short directory under /tmp, named in
    ``RUN/.ray-temp`` until the run ends (``stop_stale_ray`` finds it there after a killed driver)."""
    p = out / ".ray"
    if len(str(p)) <= _SOCKET_BUDGET:
        p.mkdir(parents=True, exist_ok=True)
        return str(p)
    d = tempfile.mkdtemp(prefix="gx-ray-", dir="/tmp")
    out.mkdir(parents=True, exist_ok=True)
    (out / _TEMP_NOTE).write_text(d + "\n")
    return d


def _under(path: str, dirs: list[str]) -> bool:
    return any(path == d or path.startswith(d + os.sep) for d in dirs)


def stop_stale_ray(out: str | Path, grace: float = 5.0) -> list[int]:
    """Stop what the local Ray of an earlier driver of this run folder left running, and remove its temp directory.

    A driver killed with SIGKILL never runs ``ray.shutdown``: its Ray's ``ray::DashboardAgent`` and
    ``ray::RuntimeEnvAgent`` (and, on a busy machine, the raylet or GCS) outlive it by a minute or more. They are
    found by the run's Ray temp directory (``RUN/.ray``, or the one ``RUN/.ray-temp`` names): a process of this user
    whose command line names a path under it, or that holds a file open under it (the agents' logs). Each gets
    SIGTERM, then SIGKILL after ``grace`` seconds. Only a driver that holds the run folder's lock calls this (no
    live run uses that directory); ``run_workers`` does before it starts a local Ray. By hand (docs/cluster.md):
    ``python -c "from genoctx.cluster import stop_stale_ray; stop_stale_ray('RUN')"``.

    Args:
        out: the run folder (``storage_path`` of ``run_workers``).
        grace: seconds between SIGTERM and SIGKILL.

    Returns:
        The PIDs stopped (empty when nothing was left).
    """
    import ray  # noqa: F401, I001  (puts the psutil Ray bundles on sys.path: it comes before psutil)
    import psutil

    out = Path(out)
    note = out / _TEMP_NOTE
    found = [out / ".ray"] + ([Path(note.read_text().strip())] if note.is_file() else [])
    found = [d for d in found if d.is_dir()]
    dirs = sorted({str(d) for d in found} | {os.path.realpath(d) for d in found})
    stale = []
    if dirs:
        for p in psutil.process_iter(["pid", "uids", "cmdline", "status"]):
            try:
                if p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
                    continue
                if p.info["uids"] is None or p.info["uids"].real != os.getuid():
                    continue
                words = [w.split("=", 1)[-1] for w in p.info["cmdline"] or []]
                if any(_under(w, dirs) for w in words) or any(_under(f.path, dirs) for f in p.open_files()):
                    stale.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
    for p in stale:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(stale, timeout=grace)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=grace)
    if stale:
        log.warning("stopped %d Ray process%s an earlier driver of %s left running (pids %s)", len(stale),
                    "es" * (len(stale) != 1), out, ", ".join(str(p.pid) for p in stale))  # fmt: skip
    for d in found:
        shutil.rmtree(d, ignore_errors=True)
    note.unlink(missing_ok=True)
    return [p.pid for p in stale]


def _workers_per_node(node: dict[str, float], bundle: dict[str, float]) -> int:
    """How many workers asking ``bundle`` (``{"CPU": 1}`` or ``{"CPU": 1, "GPU": 1}``) one node of ``node`` total
    resources holds: the scarcest resource decides."""
    return min((int(node.get(key, 0.0) / need + 1e-9) for key, need in bundle.items()), default=0)


def gpus_needed(num_workers: int, gpus_per_worker: float) -> int:
    """GPUs that ``num_workers`` workers need on one machine: one each for GPU workers (``gpus_per_worker`` 1), 0 for
    CPU workers (``gpus_per_worker`` 0; ``check_gpus_per_worker`` refuses anything else)."""
    return num_workers if gpus_per_worker > 0 else 0


def check_gpus_per_worker(gpus_per_worker: float) -> None:
    """Refuse a ``--gpus-per-worker`` other than 0 (CPU workers, gloo) or 1 (one GPU per worker, NCCL).

    A fraction would let Ray put two workers on one GPU, and NCCL refuses two ranks on one device ("Duplicate GPU
    detected"); above 1 a worker would hold GPUs it never uses (each rank runs on one device: ``WorkerSession.device``).

    Raises:
        GenoctxError: one line naming the flag and the value.
    """
    if gpus_per_worker not in (0, 1):
        raise GenoctxError(
            f"--gpus-per-worker {gpus_per_worker:g}: must be 1 (one GPU per worker: NCCL refuses two ranks on one GPU "
            "and a rank uses only one) or 0 (CPU workers); for more GPUs raise --num-workers"
        )


def check_local(num_workers: int, gpus_per_worker: float) -> int:
    """Refuse a worker group this machine's local Ray could never start, before anything starts (no Ray, no worker).

    Args:
        num_workers: worker processes asked for (``--num-workers``).
        gpus_per_worker: GPUs per worker (``--gpus-per-worker``: 1, or 0 = CPU workers, always accepted: a local Ray
            gets at least ``num_workers + 1`` CPUs).

    Returns:
        The GPUs this machine has (``torch.cuda.device_count()``: what the local Ray is told it has).

    Raises:
        GenoctxError: a ``gpus_per_worker`` other than 0 or 1 (``check_gpus_per_worker``), or more GPUs asked than
            the machine has (one line naming the request, the GPUs it needs and the GPUs here).
    """
    import torch

    check_gpus_per_worker(gpus_per_worker)
    have = torch.cuda.device_count()
    need = gpus_needed(num_workers, gpus_per_worker)
    if need > have:
        hint = "; --gpus-per-worker 0 runs on the CPU" if have == 0 else "; pass --address for a Ray cluster"
        raise GenoctxError(
            f"--num-workers {num_workers} x --gpus-per-worker {gpus_per_worker:g} = {need} GPU{'s' * (need != 1)} "
            f"asked; this machine has {have} (torch.cuda.device_count()){hint}"
        )
    return have


# what genoctx.plan.memory assumes of every GPU process: the caching allocator grows and shrinks its segments in
# place instead of keeping freed blocks in fixed ones (no fragmentation term in the plan). Read once, when the
# process starts: a worker gets it from its Ray runtime environment, never from the driver's os.environ.
ALLOC_CONF = "expandable_segments:True"
ALLOC_ENV = "PYTORCH_ALLOC_CONF"  # torch's name since 2.9; PYTORCH_CUDA_ALLOC_CONF is its deprecated alias
_ALLOC_ENV_OLD = "PYTORCH_CUDA_ALLOC_CONF"


def cuda_alloc_conf(current: str | None) -> str:
    """The allocator configuration of a GPU process: ``current`` (``key:value`` pairs joined by commas) with
    ``expandable_segments:True`` added when it names no ``expandable_segments`` (a value given is kept: the user's
    choice)."""
    if not current or not current.strip():
        return ALLOC_CONF
    keys = {pair.split(":", 1)[0].strip() for pair in current.split(",")}
    return current if "expandable_segments" in keys else f"{current},{ALLOC_CONF}"


def worker_env(driver_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables every worker gets through its Ray runtime environment (``RunConfig``'s
    ``worker_runtime_env``), on a local Ray and on a cluster at ``--address`` alike (whose workers never see the
    driver's environment): ``PYTORCH_ALLOC_CONF`` = ``cuda_alloc_conf`` of the driver's (``driver_env``, default
    ``os.environ``: ``PYTORCH_ALLOC_CONF``, else the older ``PYTORCH_CUDA_ALLOC_CONF``), set before the worker
    process starts and so before torch reads it. (Torch's CPU threads are set on the worker, from its own node:
    ``genoctx.train.distributed.worker_threads``.)"""
    env = os.environ if driver_env is None else driver_env
    return {ALLOC_ENV: cuda_alloc_conf(env.get(ALLOC_ENV) or env.get(_ALLOC_ENV_OLD))}


def _run_config(storage: Path, run_name: str, max_failures: int, keep: int):
    """Ray Train's ``RunConfig`` of a worker group, the same for a local Ray and ``--address``: its storage, restarts,
    checkpoints kept and the workers' environment (``worker_env`` of the driver's)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig

    return RunConfig(
        name=run_name,
        storage_path=str(storage),
        failure_config=FailureConfig(max_failures=max_failures),
        checkpoint_config=CheckpointConfig(num_to_keep=keep or None),
        worker_runtime_env={"env_vars": worker_env()},
    )


def _bundle(gpus_per_worker: float) -> dict[str, float]:
    """One worker's resources, as Ray Train's ``ScalingConfig.resources_per_worker`` and the placement group's."""
    return {"CPU": 1, "GPU": gpus_per_worker} if gpus_per_worker > 0 else {"CPU": 1}


def _request(num_workers: int, bundle: dict[str, float]) -> str:
    inner = ", ".join(f"{k} {v:g}" for k, v in bundle.items())
    return f"--num-workers {num_workers} x {{{inner}}}"


def _resources(bundle: dict[str, float], free: dict[str, float], total: dict[str, float]) -> str:
    return ", ".join(f"{k} {free.get(k, 0):g} of {total.get(k, 0):g}" for k in bundle)


def _max_from_autoscaler() -> dict[str, float] | None:
    """The most of each resource an autoscaling cluster may grow to, as Ray Train's own check reads it (the
    autoscaler's cluster config in the GCS); None when Ray reports none (a fixed cluster, or an autoscaler that does
    not publish its config)."""
    try:
        from ray._private.state import state

        return state.get_max_resources_from_cluster_config() or None
    except Exception:  # a private API: without it the present nodes decide
        return None


def _place(num_workers: int, bundle: dict[str, float], timeout: float, what: str) -> None:
    """Reserve the worker group's placement group on the connected Ray and remove it again, or refuse the group.

    Refused at once when the nodes cannot hold ``num_workers`` workers of ``bundle`` at their present size (or, on
    an autoscaling cluster that publishes its config, above the most it may grow to); else refused when the group is
    not placed within ``timeout`` seconds (> 0). Nothing is left reserved either way.

    Raises:
        GenoctxError: one line naming the request (``--num-workers N x {CPU 1, GPU 1}``) and the cluster's free and
            total resources.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    request = _request(num_workers, bundle)
    grow = _max_from_autoscaler()
    if grow is not None:
        short = [k for k, v in bundle.items() if num_workers * v > grow.get(k, 0)]
        if short:
            free = _resources(bundle, ray.available_resources(), ray.cluster_resources())
            most = ", ".join(f"{k} {grow.get(k, 0):g}" for k in short)
            raise GenoctxError(
                f"{what}: {request} can never be placed: this autoscaling cluster grows to at most {most} (free: "
                f"{free})"
            )
    else:
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        room = sum(_workers_per_node(n, bundle) for n in nodes)
        if room < num_workers:
            free = _resources(bundle, ray.available_resources(), ray.cluster_resources())
            raise GenoctxError(
                f"{what}: {request} can never be placed: the cluster's {len(nodes)} node(s) hold at most {room} such "
                f"worker{'s' * (room != 1)} (free: {free}; a cluster that autoscales may grow: --placement-timeout 0 "
                "waits for it)"
            )
    pg = placement_group([dict(bundle) for _ in range(num_workers)], strategy=_STRATEGY)
    try:
        if not pg.wait(timeout):
            free = _resources(bundle, ray.available_resources(), ray.cluster_resources())
            raise GenoctxError(
                f"{what}: {request} not placed within --placement-timeout {timeout:g} s (free: {free}; raise "
                "--placement-timeout to wait longer, 0 waits forever)"
            )
    finally:
        remove_placement_group(pg)


class WorkerSession:
    """What a worker function gets of Ray Train's per-worker API (``ray.train``), so that it need not import Ray.

    Args:
        gpus_per_worker: as given to ``run_workers``; 0 means the worker runs on the CPU.
    """

    def __init__(self, gpus_per_worker: float = 0) -> None:
        self.gpus_per_worker = gpus_per_worker

    def device(self):
        """This worker's ``torch.device``: its GPU (``ray.train.torch.get_device``) or the CPU."""
        import torch

        if self.gpus_per_worker > 0:
            import ray.train.torch

            return ray.train.torch.get_device()
        return torch.device("cpu")

    def local_world_size(self) -> int:
        """The workers of this run on this worker's node (``ray.train.get_context().get_local_world_size()``): they
        share its CPU cores."""
        import ray.train

        return ray.train.get_context().get_local_world_size()

    def report(self, metrics: dict, checkpoint_dir: str | Path | None = None) -> None:
        """``ray.train.report``: every worker reports each step it reports; at most one of them hands the directory
        of the checkpoint it wrote (Ray copies it under ``storage_path/run_name``)."""
        import ray.train

        ckpt = ray.train.Checkpoint.from_directory(str(checkpoint_dir)) if checkpoint_dir is not None else None
        ray.train.report(metrics, checkpoint=ckpt)

    @contextlib.contextmanager
    def checkpoint_dir(self) -> Iterator[Path | None]:
        """The directory of the newest checkpoint Ray registered for this run (after a restart of the group or a
        rerun of the same ``run_name``), or None when there is none; valid inside the ``with`` block."""
        import ray.train

        ckpt = ray.train.get_checkpoint()
        if ckpt is None:
            yield None
            return
        with ckpt.as_directory() as d:
            yield Path(d)


# the token that marks a worker's line as genoctx's own on its way to the driver (``_RayLog`` sends those to the
# user's stderr, everything else of Ray's to the run's log file): Ray's own "info message" token, which Ray's printer
# strips, so a marked line reads the same where no ``_RayLog`` routes it
_MARK = ":info_message:"


class _Marked(logging.Formatter):
    """``%(message)s`` with every line (a traceback's too) behind ``_MARK``: Ray forwards a worker's stderr line by
    line."""

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(_MARK + line for line in (super().format(record).splitlines() or [""]))


def _mark_worker_logs() -> None:
    """In a Ray worker: the ``genoctx`` logger's lines go to stderr marked (``_MARK``), at INFO, not to the root
    logger (where Ray Train's handlers are). ``genoctx.train.distributed.worker_logging`` finds the handler there and
    adds none of its own."""
    glog = logging.getLogger("genoctx")
    if not any(isinstance(h.formatter, _Marked) for h in glog.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Marked("%(message)s"))
        glog.addHandler(handler)
    glog.setLevel(logging.INFO)
    glog.propagate = False


_AGREED = "genoctx_agreed_error"  # the key of a worker's return value that carries an error every rank raised


def _run_on_worker(worker_fn: Callable[[dict, WorkerSession], Any], config: dict, gpus_per_worker: float,
                   end: str | None = None) -> Any:  # fmt: skip
    """``worker_fn(config, session)``; an ``AgreedError`` (a user error raised on every rank at once, so none waits in
    a collective) ends the worker quietly with ``{_AGREED: message}`` instead of a traceback Ray would print. Its
    ``genoctx`` log lines are marked (``_mark_worker_logs``); the last line it writes is the marked ``end`` (when
    given), which tells the driver's ``_RayLog.drain`` that all its lines have arrived.

    The body runs inside ``parallel.mesh.leaving_mesh``: on success or error every process group is destroyed and
    freed before the worker returns, so no gloo thread outlives the interpreter (SIGABRT at exit otherwise)."""
    from .parallel.mesh import leaving_mesh

    _mark_worker_logs()
    try:
        with leaving_mesh():
            return worker_fn(config, WorkerSession(gpus_per_worker))
    except AgreedError as e:
        return {_AGREED: str(e)}
    finally:
        if end is not None:
            print(_MARK + end, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class WorkerRun:
    """What ``run_workers`` hands back: the seconds the worker group ran (``TorchTrainer.fit``, Ray's start and
    shutdown excluded) and the value the rank-0 worker function returned (``Result.return_value``; plain data)."""

    seconds: float
    value: Any = None


def _worker_error(e: BaseException) -> str | None:
    """The message of a ``GenoctxError`` a worker raised (a user error every rank agreed on, e.g. an unreadable
    checkpoint), found in Ray Train's ``WorkerGroupError.worker_failures``; None when there is none."""
    failures = getattr(e, "worker_failures", None) or {}
    for rank in sorted(failures):
        err = failures[rank]
        while err is not None:
            if isinstance(err, GenoctxError) or type(err).__name__ == "GenoctxError":
                return str(err).strip().splitlines()[0] if str(err).strip() else None
            err = getattr(err, "cause", None) or err.__cause__
    return None


def _failure(e: BaseException) -> str:
    """The error that ended a worker group, in one line: the first failed rank's exception (``rank 1: RuntimeError:
    boom``, found in Ray Train's ``WorkerGroupError.worker_failures``), else Ray's own error's first line."""
    failures = getattr(e, "worker_failures", None) or {}
    for rank in sorted(failures):
        err = failures[rank]
        while getattr(err, "cause", None) is not None or err.__cause__ is not None:  # Ray wraps the worker's error
            err = getattr(err, "cause", None) or err.__cause__
        text = str(err).strip().splitlines()
        return f"rank {rank}: {type(err).__name__}: {text[0] if text else ''}".rstrip(": ")
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def run_workers(
    worker_fn: Callable[[dict, WorkerSession], Any],
    config: dict,
    *,
    num_workers: int,
    storage_path: str | Path,
    run_name: str,
    gpus_per_worker: float = 0,
    address: str | None = None,
    max_failures: int = 0,
    keep_checkpoints: int = 0,
    what: str = "distributed run",
    placement_timeout: float | None = None,
    log_file: str | Path | None = None,
) -> WorkerRun:
    """Run ``worker_fn(config, session)`` on ``num_workers`` Ray Train workers and wait for them.

    Args:
        worker_fn: the function every worker runs (a module-level function: Ray pickles it by reference);
            ``session`` is a ``WorkerSession``.
        config: the workers' argument (Ray's ``train_loop_config``; plain data).
        num_workers: worker processes, one rank each.
        storage_path: where Ray keeps the run (``storage_path/run_name``); a local Ray's temporary directory goes
            under it when short enough (``_ray_temp_dir``).
        run_name: Ray Train's run name: rerunning the same name in the same ``storage_path`` restores its newest
            checkpoint (``WorkerSession.checkpoint_dir``).
        gpus_per_worker: GPUs per worker: 1 runs on CUDA with NCCL, 0 on CPU with gloo (``check_gpus_per_worker``).
        address: Ray cluster address (``"auto"``, ``"ray://HOST:PORT"``); None starts a local Ray.
        max_failures: restarts of the whole group before giving up (``FailureConfig``).
        keep_checkpoints: reported checkpoints Ray keeps (``CheckpointConfig.num_to_keep``); 0 keeps all.
        what: the failure message's subject (``"distributed training"``).
        placement_timeout: seconds the group may wait for its resources (``_place``); None = ``PLACEMENT_TIMEOUT_S``,
            0 = no check and no bound (Ray Train waits, and retries, forever).
        log_file: the file Ray's own lines of the run are appended to (``_RayLog``: Ray Train's reports, its
            tracebacks, the raylet's messages); None = ``storage_path/ray.log``. The workers' ``genoctx`` log lines
            go to stderr (and the file).

    Returns:
        ``WorkerRun``: the seconds the worker group ran and what rank 0's ``worker_fn`` returned.

    Raises:
        GenoctxError: a user error every rank agreed on (``AgreedError``: its message, and no restart), or the group
            still failed after ``max_failures`` restarts: one line, a worker's own ``GenoctxError`` message when one
            raised it, else the rank and the first line of the error that ended it, and the log file. Before any
            worker starts: a local Ray without the GPUs asked (``check_local``), an ``address`` Ray cannot connect
            to, or a group the cluster cannot hold or does not place within ``placement_timeout`` (``_place``), each
            one line.
    """
    timeout = PLACEMENT_TIMEOUT_S if placement_timeout is None else placement_timeout
    if not 0 <= timeout < float("inf"):
        raise GenoctxError(f"--placement-timeout: must be a number of seconds >= 0 (0 waits forever), got {timeout:g}")
    check_gpus_per_worker(gpus_per_worker)
    log = Path(log_file) if log_file is not None else Path(storage_path) / "ray.log"
    with contextlib.redirect_stdout(sys.stderr):  # Ray's worker and raylet lines: stdout is the caller's
        return _fit(worker_fn, config, Path(storage_path), run_name, num_workers, gpus_per_worker, address,
                    max_failures, keep_checkpoints, what, timeout, log)  # fmt: skip


class _RayLog:
    """While a worker group runs: Ray's own lines go to the run's log file, genoctx's to the user's stderr.

    What reaches the driver: the workers' and Ray Train controller's stdout/stderr lines (Ray's ``log_to_driver``:
    Ray Train's ``TrainingReport(...)`` lines, its tracebacks, genoctx's worker log lines), the GCS's error messages
    (a worker that died, with Ray's traceback) and the driver's own ``ray`` loggers. Inside the block the lines a
    worker's ``genoctx`` logger wrote (marked: ``_mark_worker_logs``) are printed on stderr as Ray printed them
    (deduplicated across workers, without Ray's ``(pid=...)`` prefix); every line, genoctx's too, is appended to
    ``path`` behind its source (``[RayTrainWorker pid=123]``). The root logger gets back the handlers and level it had
    before ``ray.init`` (``root``: Ray's ``LoggingConfig`` replaces them).

    The hooks are Ray's private ones (``ray._private.worker.print_to_stdstream`` and the driver's stream dispatcher,
    Ray 2.60); on a Ray without them Ray prints as before (a marked line then reads as plain text: ``_MARK`` is
    Ray's own token, which its printer strips).

    Args:
        path: the log file (appended to; its folder is made).
        root: the root logger's ``(level, handlers)`` to put back.
    """

    def __init__(self, path: Path, root: tuple[int, list[logging.Handler]]) -> None:
        import threading
        import uuid

        self.path, self.root = path, root
        self.end = f"genoctx-end {uuid.uuid4().hex}"  # each worker's last line (``_run_on_worker``): not shown
        self._ended = threading.Condition()
        self._ends = 0
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> _RayLog:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = logging.FileHandler(self.path, encoding="utf-8")
        self.file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self._write([f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} genoctx: Ray's log of this run (pid {os.getpid()})"])
        root = logging.getLogger()
        root.setLevel(self.root[0])
        root.handlers[:] = self.root[1]
        ray_logger = logging.getLogger("ray")
        saved = list(ray_logger.handlers)
        ray_logger.handlers[:] = [self.file]
        self._undo.append(lambda: ray_logger.handlers.__setitem__(slice(None), saved))
        try:
            import ray._private.worker as rw
            from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
        except ImportError:  # another Ray: it prints as it does
            return self
        printer = _LateLines.unwrap(rw.print_to_stdstream)
        rw.print_to_stdstream = self.route  # the GCS error listener looks it up at each message

        def give_back_gcs() -> None:  # an attached Ray lives on: late lines of this run still go to its file
            rw.print_to_stdstream = _LateLines(printer, self.path) if rw.global_worker.connected else printer

        self._undo.append(give_back_gcs)
        before = [(name, _LateLines.unwrap(fn)) for name, fn in dispatcher.handlers]
        dispatcher.remove_handler("ray_print_logs")
        if len(dispatcher.handlers) < len(before):  # log_to_driver: our printer in place of Ray's
            dispatcher.add_handler("ray_print_logs", lambda data: self.route(data, ignore_prefix=True))

            def give_back() -> None:
                dispatcher.remove_handler("ray_print_logs")
                if rw.global_worker.connected:  # an attached Ray lives on: its printer again (shutdown removes it)
                    for name, fn in before:
                        if name == "ray_print_logs":
                            dispatcher.add_handler(name, _LateLines(fn, self.path))

            self._undo.append(give_back)
        self._printer, self._autoscaler_events = printer, rw.filter_autoscaler_events
        return self

    def __exit__(self, *exc) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self.file.close()

    def route(self, data: dict, ignore_prefix: bool = False) -> None:
        """One batch of lines from Ray (``data["lines"]``, from ``data["pid"]``, ``data["actor_name"]``, ...): all to
        the file; the marked ones (``_MARK``) to stderr through Ray's printer."""
        lines = [str(line) for line in data.get("lines") or []]
        ends = sum(line == _MARK + self.end for line in lines)
        if ends:
            lines = [line for line in lines if line != _MARK + self.end]
            with self._ended:
                self._ends += ends
                self._ended.notify_all()
        if data.get("pid") == "autoscaler":  # its status table every 5 s: only its events, as Ray prints them
            lines = list(self._autoscaler_events(lines))
        self._write(_behind_source(data, lines))
        mine = [line for line in lines if line.startswith(_MARK)]
        if mine:
            self._printer({**data, "lines": mine}, ignore_prefix=True)

    def drain(self, workers: int, timeout: float = 5.0) -> None:
        """Wait until the last line of each of ``workers`` workers has reached the driver (Ray forwards them a
        moment after they are written; lines still on their way when Ray shuts down are lost), at most ``timeout``
        seconds (a worker killed before its last line)."""
        with self._ended:
            self._ended.wait_for(lambda: self._ends >= workers, timeout=timeout)

    def _write(self, lines: list[str]) -> None:
        self.file.acquire()
        try:
            if self.file.stream is not None:  # None once closed: a batch still on its way after the run is dropped
                self.file.stream.write("".join(line + "\n" for line in lines))
                self.file.stream.flush()
        finally:
            self.file.release()


def _behind_source(data: dict, lines: list[str]) -> list[str]:
    """A Ray log batch's lines as its log file holds them: behind their source (``[RayTrainWorker pid=123] ...``),
    genoctx's mark (``_MARK``) dropped."""
    who = data.get("actor_name") or data.get("task_name") or ""
    source = f"[{who + ' ' if who else ''}pid={data.get('pid')}]"
    return [f"{source} {line.replace(_MARK, '', 1)}" for line in lines]


_TRAIN_ACTORS = ("RayTrainWorker", "TrainController")  # Ray Train V2's actors (their log batches' ``actor_name``)


class _LateLines:
    """Ray's printer after a run on a Ray that lives on (attached with ``--address``, or started by the caller):
    the batches of Ray Train's actors (``_TRAIN_ACTORS``) that reach the driver after the run returned (the
    controller's failure report and its traceback arrive a moment after ``fit`` raised, on a loaded machine after the
    run's error line) are appended to the run's log file behind their source, their marked lines (``_MARK``) still
    printed; every other batch goes to Ray's printer as before. The next run's ``_RayLog`` takes Ray's printer back
    out (``unwrap``); ``ray.shutdown`` removes it.

    Args:
        printer: Ray's printer (``print_to_stdstream`` or the dispatcher's ``partial`` of it).
        path: the run's log file (appended to, a batch at a time).
    """

    def __init__(self, printer: Callable, path: Path) -> None:
        self.printer, self.path = printer, path

    @staticmethod
    def unwrap(printer: Callable) -> Callable:
        """Ray's own printer under any ``_LateLines``."""
        while isinstance(printer, _LateLines):
            printer = printer.printer
        return printer

    def __call__(self, data: dict, *args, **kwargs) -> None:
        if data.get("actor_name") not in _TRAIN_ACTORS:
            return self.printer(data, *args, **kwargs)
        lines = [str(line) for line in data.get("lines") or []]
        with contextlib.suppress(OSError), self.path.open("a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in _behind_source(data, lines)))
        mine = [line for line in lines if line.startswith(_MARK)]
        if mine:
            self.printer({**data, "lines": mine}, *args, **kwargs)


def _reachable(address: str, timeout: float = 10.0) -> None:
    """Refuse a ``HOST:PORT`` address where nothing listens (Ray itself retries a dead GCS address for ~20 minutes);
    ``auto`` and ``ray://`` addresses are left to Ray."""
    host, _, port = address.rpartition(":")
    if address == "auto" or "://" in address or not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise GenoctxError(f"--address {address}: no Ray cluster answers there ({e.strerror or e})") from None


def _resource_view(resources: dict[str, float]) -> dict[str, float]:
    """Ray's resources without its per-node markers (``node:IP``), memory in GiB (``memory_gib``,
    ``object_store_memory_gib``), counts rounded to 0.1."""
    out = {}
    for key, value in sorted(resources.items()):
        if key.startswith("node:"):
            continue
        if key in ("memory", "object_store_memory"):
            key, value = f"{key}_gib", value / 2**30
        out[key] = round(float(value), 1)
    return out


def cluster_resources(address: str) -> dict:
    """Attach to the Ray cluster at ``address`` (``auto``, ``HOST:PORT`` or ``ray://HOST:PORT``), read what it has
    and disconnect: ``{"address", "nodes" (live), "total", "free"}``, resources as in ``_resource_view`` (``GPU``,
    ``CPU``, ``memory_gib``, accelerator types, ...). For ``genoctx doctor --address``; Ray's own lines go to stderr.

    Raises:
        GenoctxError: nothing answers at ``address``, or Ray cannot connect (one line naming --address).
    """
    import ray

    _reachable(address)
    with contextlib.redirect_stdout(sys.stderr):
        try:
            ray.init(address=address, log_to_driver=False, logging_config=ray.LoggingConfig(log_level="ERROR"))
        except Exception as e:  # as _connect: one line
            why = "; ".join(str(x).strip().splitlines()[0] for x in (e, e.__cause__) if x and str(x).strip())
            raise GenoctxError(f"--address {address}: cannot connect to Ray: {why or type(e).__name__}") from None
        try:
            return {
                "address": address,
                "nodes": sum(1 for n in ray.nodes() if n.get("Alive")),
                "total": _resource_view(ray.cluster_resources()),
                "free": _resource_view(ray.available_resources()),
            }
        finally:
            ray.shutdown()


def _connect(address: str | None, storage: Path, num_workers: int, gpus_per_worker: float) -> str | None:
    """``ray.init``: attach to ``address``, or start a local Ray with the CPUs asked (at least) and the GPUs torch
    sees, after ``check_local``. Returns the local Ray's temporary directory (None when attached)."""
    import ray

    if address:
        _reachable(address)
        try:
            ray.init(address=address, log_to_driver=True)
        except Exception as e:  # ConnectionError (and its cause: no cluster, a wrong token, ...): one line
            why = "; ".join(str(x).strip().splitlines()[0] for x in (e, e.__cause__) if x and str(x).strip())
            raise GenoctxError(f"--address {address}: cannot connect to Ray: {why or type(e).__name__}") from None
        return None
    gpus = check_local(num_workers, gpus_per_worker)
    stop_stale_ray(storage)  # what a killed driver of this run left
    temp_dir = _ray_temp_dir(storage)
    ray.init(
        include_dashboard=False,
        _temp_dir=temp_dir,
        num_cpus=max(num_workers + 1, os.cpu_count() or 1),  # CPU workers may oversubscribe a laptop
        num_gpus=gpus,  # what torch sees: never GPUs the machine does not have
        object_store_memory=256 << 20,  # checkpoints travel as files, not through the object store
        configure_logging=False,
        # warnings only at ERROR: with no dashboard, Ray Train's placement-group cleaner cannot reach the
        # state API and would warn once a second for the whole run
        logging_config=ray.LoggingConfig(log_level="ERROR"),
    )
    return temp_dir


def _fit(worker_fn, config, storage, run_name, num_workers, gpus_per_worker, address, max_failures, keep, what,
         placement_timeout, log_file):  # fmt: skip
    import ray
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    started, temp_dir = False, None
    root = logging.getLogger()  # Ray's LoggingConfig sets the root logger's level and handlers: ours come back after
    saved = (root.level, list(root.handlers))
    routed = contextlib.ExitStack()
    try:
        if not ray.is_initialized():
            temp_dir = _connect(address, storage, num_workers, gpus_per_worker)
            started = True
        router = routed.enter_context(_RayLog(log_file, saved))
        resources = _bundle(gpus_per_worker)
        if placement_timeout > 0:
            _place(num_workers, resources, placement_timeout, what)

        end = router.end  # a string: the closure travels to the workers

        def loop(cfg: dict):  # runs on every worker (cloudpickled: worker_fn travels by reference)
            return _run_on_worker(worker_fn, cfg, gpus_per_worker, end)

        trainer = TorchTrainer(
            loop,
            train_loop_config=config,
            scaling_config=ScalingConfig(
                num_workers=num_workers,
                use_gpu=gpus_per_worker > 0,
                resources_per_worker=resources,
                placement_strategy=_STRATEGY,
            ),
            run_config=_run_config(storage, run_name, max_failures, keep),
        )
        t0 = time.perf_counter()
        try:
            result = trainer.fit()
            router.drain(num_workers)
        except Exception as e:  # ray.train.TrainingFailedError and friends: one line for the user
            router.drain(num_workers)
            mine = _worker_error(e)
            if mine is not None:
                raise GenoctxError(mine) from e
            raise GenoctxError(f"{what} failed: {_failure(e)} (Ray's log: {log_file})") from e
    finally:
        if started:
            ray.shutdown()
        routed.close()
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
            (storage / _TEMP_NOTE).unlink(missing_ok=True)
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
    value = getattr(result, "return_value", None)
    if isinstance(value, dict) and _AGREED in value:
        raise GenoctxError(value[_AGREED])
    return WorkerRun(time.perf_counter() - t0, value)
