"""Gloo ranks that leave the mesh in three ways; each rank writes its native thread counts to ``rank{r}.json``.

Usage: ``python teardown_worker.py OUT_DIR MODE`` with MODE ``ok`` (the body returns inside ``leaving_mesh``),
``error`` (it raises, with the mesh held by a reference cycle and by the failing frame) or ``bare`` (no
``leaving_mesh``: the groups are still alive when the rank is done, what the test shows would happen without it).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from genoctx.parallel.mesh import init_parallel, leaving_mesh


def native_threads() -> int:
    """Threads of this process as the kernel counts them (gloo's are native threads Python does not list)."""
    return len(os.listdir("/proc/self/task"))


def _hold_and_use(dims, fail: bool) -> None:
    cycle = {"dims": dims}
    cycle["self"] = cycle  # freed only by the garbage collector
    t = torch.ones(4)
    dist.all_reduce(t, group=dims.cp_group)
    dist.all_reduce(t, group=dims.dp_cp_group)
    if fail:
        raise RuntimeError("a failure on the mesh")


def run(rank: int, world: int, init_file: str, out_dir: str, mode: str) -> None:
    torch.set_num_threads(1)
    before = native_threads()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    dims = init_parallel(cp=2)
    during = native_threads()
    raised = None
    if mode == "bare":
        _hold_and_use(dims, False)
    else:
        try:
            with leaving_mesh():
                _hold_and_use(dims, mode == "error")
        except RuntimeError as e:
            raised = str(e)
    del dims
    res = {"before": before, "during": during, "after": native_threads(), "raised": raised,
           "initialized": dist.is_initialized()}  # fmt: skip
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    if mode == "bare":
        dist.destroy_process_group()  # the test's own cleanup, after the count


if __name__ == "__main__":
    init = tempfile.mktemp(prefix="genoctx-gloo-")
    mp.start_processes(run, args=(2, init, sys.argv[1], sys.argv[2]), nprocs=2, start_method="fork")
