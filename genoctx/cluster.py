"""Ray plumbing: run a group of worker processes with Ray Train (V2 ``TorchTrainer``), locally or on a cluster.

This module knows nothing of training or evaluation. ``run_workers(worker_fn, config, ...)`` is handed the function
every worker runs; the caller (``genoctx train --num-workers N`` through ``genoctx.train.distributed``, later
``genoctx eval --num-workers N`` through ``genoctx.eval.distributed``) prepares the worker's ``config`` and reads what
rank 0's worker function returned (``WorkerRun.value``) or what the workers wrote once they are done:

- Ray: an existing cluster (``address="auto"`` or ``"ray://HOST:PORT"``) or a local one started with no dashboard
  and a short temporary directory (``_ray_temp_dir``: unix socket paths are limited to ~107 characters), stopped
  again at the end. Ray prints worker and raylet lines to stdout; stdout is for the caller's JSON summary only, so
  they go to stderr.
- Workers: ``num_workers`` processes, ``gpus_per_worker`` GPUs each (0: CPU). Ray Train creates the default process
  group (gloo on CPU, NCCL on CUDA) before ``worker_fn(config, session)`` is called on every worker.
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
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import AgreedError, GenoctxError

_SOCKET_BUDGET = 40  # characters of the Ray temp dir that keep its socket paths under the unix limit


def _ray_temp_dir(out: Path) -> str:
    """``RUN/.ray`` when short enough for Ray's unix sockets, else a short directory under /tmp."""
    p = out / ".ray"
    if len(str(p)) <= _SOCKET_BUDGET:
        p.mkdir(parents=True, exist_ok=True)
        return str(p)
    return tempfile.mkdtemp(prefix="gx-ray-", dir="/tmp")


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


_AGREED = "genoctx_agreed_error"  # the key of a worker's return value that carries an error every rank raised


def _run_on_worker(worker_fn: Callable[[dict, WorkerSession], Any], config: dict, gpus_per_worker: float) -> Any:
    """``worker_fn(config, session)``; an ``AgreedError`` (a user error raised on every rank at once, so none waits in
    a collective) ends the worker quietly with ``{_AGREED: message}`` instead of a traceback Ray would print."""
    try:
        return worker_fn(config, WorkerSession(gpus_per_worker))
    except AgreedError as e:
        return {_AGREED: str(e)}


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
        gpus_per_worker: GPUs per worker; > 0 runs on CUDA with NCCL, 0 on CPU with gloo.
        address: Ray cluster address (``"auto"``, ``"ray://HOST:PORT"``); None starts a local Ray.
        max_failures: restarts of the whole group before giving up (``FailureConfig``).
        keep_checkpoints: reported checkpoints Ray keeps (``CheckpointConfig.num_to_keep``); 0 keeps all.
        what: the failure message's subject (``"distributed training"``).

    Returns:
        ``WorkerRun``: the seconds the worker group ran and what rank 0's ``worker_fn`` returned.

    Raises:
        GenoctxError: a user error every rank agreed on (``AgreedError``: its message, and no restart), or the group
            still failed after ``max_failures`` restarts: one line, a worker's own ``GenoctxError`` message when one
            raised it, else the first line of Ray's error.
    """
    with contextlib.redirect_stdout(sys.stderr):  # Ray's worker and raylet lines: stdout is the caller's
        return _fit(worker_fn, config, Path(storage_path), run_name, num_workers, gpus_per_worker, address,
                    max_failures, keep_checkpoints, what)  # fmt: skip


def _fit(worker_fn, config, storage, run_name, num_workers, gpus_per_worker, address, max_failures, keep, what):
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    started, temp_dir = False, None
    root = logging.getLogger()  # Ray's LoggingConfig sets the root logger's level and handlers: ours come back after
    saved = (root.level, list(root.handlers))
    if not ray.is_initialized():
        if address:
            ray.init(address=address, log_to_driver=True)
        else:
            temp_dir = _ray_temp_dir(storage)
            ray.init(
                include_dashboard=False,
                _temp_dir=temp_dir,
                num_cpus=max(num_workers + 1, os.cpu_count() or 1),
                num_gpus=int(math.ceil(gpus_per_worker * num_workers)) or None,
                object_store_memory=256 << 20,  # checkpoints travel as files, not through the object store
                configure_logging=False,
                # warnings only at ERROR: with no dashboard, Ray Train's placement-group cleaner cannot reach the
                # state API and would warn once a second for the whole run
                logging_config=ray.LoggingConfig(log_level="ERROR"),
            )
        started = True
    resources = {"CPU": 1}
    if gpus_per_worker > 0:
        resources["GPU"] = gpus_per_worker

    def loop(cfg: dict):  # runs on every worker (cloudpickled: worker_fn travels by reference)
        return _run_on_worker(worker_fn, cfg, gpus_per_worker)

    trainer = TorchTrainer(
        loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(
            num_workers=num_workers, use_gpu=gpus_per_worker > 0, resources_per_worker=resources
        ),
        run_config=RunConfig(
            name=run_name,
            storage_path=str(storage),
            failure_config=FailureConfig(max_failures=max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=keep or None),
        ),
    )
    t0 = time.perf_counter()
    try:
        result = trainer.fit()
    except Exception as e:  # ray.train.TrainingFailedError and friends: one line for the user
        mine = _worker_error(e)
        if mine is not None:
            raise GenoctxError(mine) from e
        raise GenoctxError(f"{what} failed: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    finally:
        if started:
            ray.shutdown()
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
    value = getattr(result, "return_value", None)
    if isinstance(value, dict) and _AGREED in value:
        raise GenoctxError(value[_AGREED])
    return WorkerRun(time.perf_counter() - t0, value)
