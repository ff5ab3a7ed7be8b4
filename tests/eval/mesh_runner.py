"""A stand-in for ``genoctx.cluster.run_workers`` without Ray: spawned gloo processes run the worker function.

``spawn_workers`` has ``run_workers``' signature and result (``WorkerRun``: seconds, rank 0's return value), so the
driver code under test (``genoctx.eval.distributed.score_on_mesh``) runs unchanged; only Ray's start-up (~30 s per
run on this machine) is left out. A ``GenoctxError`` raised on the workers is raised again here with the first
failing rank's message, as ``run_workers`` does. ``fork_ranks`` runs the rank function of a worker script
(``tests/parallel/*_worker.py``, ``tests/train/verify_worker.py``) on ranks forked from the same server.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path

import torch


class LocalSession:
    """``genoctx.cluster.WorkerSession`` without Ray: the CPU device; no Ray checkpoint to restore and nothing
    reported (a training run then resumes from its own ``RUN/checkpoints``)."""

    gpus_per_worker = 0

    def device(self):
        return torch.device("cpu")

    def local_world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size()  # every rank on this machine

    def report(self, metrics: dict, checkpoint_dir=None) -> None:
        pass

    @contextlib.contextmanager
    def checkpoint_dir(self):
        yield None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, worker_fn, config: dict, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from genoctx.errors import GenoctxError
    from genoctx.parallel.mesh import leaving_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with leaving_mesh():  # as genoctx.cluster._run_on_worker: every group freed before the process exits
            value = worker_fn(config, LocalSession())
        if rank == 0:
            torch.save({"value": value}, Path(out) / "value.pt")
    except GenoctxError as e:
        (Path(out) / f"error{rank}.txt").write_text(str(e))


PRELOAD = ["torch", "torch._dynamo", "torch.distributed.checkpoint", "genoctx.parallel.build",
           "genoctx.train.distributed", "genoctx.eval.distributed", "mesh_runner"]  # fmt: skip
# torch._dynamo: torch imports it when a rank first builds a model (nn.init), ~1.2 s of every rank otherwise


def _forkserver() -> str:
    """``"forkserver"`` with ``PRELOAD`` imported once by the server: every rank of every ``spawn_workers`` call is a
    fork of it (no torch import per rank, ~2-3 s each before; a fresh process all the same). The server keeps the
    environment and working directory of its start: the workers get absolute paths and no environment of a test."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call); later ones keep it
    return "forkserver"


def fork_ranks(fn, args: tuple, nprocs: int, timeout: float = 600) -> None:
    """``fn(rank, *args)`` for rank 0..nprocs-1, each in a fresh process forked from the preloaded server
    (``_forkserver``): what a worker script's ``mp.start_processes(fn, args, nprocs, start_method="fork")`` runs
    after importing torch and genoctx itself, without that interpreter's start and imports (~3 s on a small CPU) and
    a ``torch._dynamo`` import in every rank. ``fn`` is pickled by name: its module must be importable from
    ``sys.path`` as it is now (each rank gets this process's ``sys.path``); the ranks get the environment and working
    directory of the server's start (pass absolute paths).

    Raises:
        torch.multiprocessing.ProcessRaisedException / ProcessExitedException: a rank failed (its traceback).
        TimeoutError: not done within ``timeout`` seconds (every rank is killed first).
    """
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method=_forkserver())
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.0, min(5.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            for proc in ctx.processes:
                proc.kill()
            for proc in ctx.processes:
                proc.join()
            raise TimeoutError(f"{fn.__module__}.{fn.__name__} on {nprocs} ranks: not done within {timeout} s")


def spawn_workers(worker_fn, config: dict, *, num_workers: int, storage_path, run_name: str = "run",
                  gpus_per_worker: float = 0, address=None, max_failures: int = 0, keep_checkpoints: int = 0,
                  what: str = "distributed run", placement_timeout=None, log_file=None):  # fmt: skip
    """``run_workers`` on ``num_workers`` gloo processes forked from a preloaded server (``_forkserver``; CPU only;
    the Ray-only arguments are ignored)."""
    import torch.multiprocessing as mp

    from genoctx.cluster import WorkerRun
    from genoctx.errors import GenoctxError

    out = Path(storage_path) / run_name
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    args = (worker_fn, config, num_workers, _free_port(), str(out))
    mp.start_processes(_entry, args=args, nprocs=num_workers, join=True, start_method=_forkserver())
    seconds = time.perf_counter() - t0
    errors = sorted(out.glob("error*.txt"))
    if errors:
        raise GenoctxError(errors[0].read_text())
    return WorkerRun(seconds, torch.load(out / "value.pt", weights_only=False)["value"])
