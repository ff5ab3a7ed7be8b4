"""Worker of tests/train/test_verify.py: 2 spawned gloo ranks (FSDP=2) save and check sharded (DCP) checkpoints.

``python verify_worker.py OUT_DIR CASE`` runs CASE on 2 ranks; each rank writes ``rankR.pt``.

Cases:
- ``save``: the tiny model on FSDP=2 with its AdamW state saved as ``RUN/checkpoints/step_000001`` and
  ``step_000002`` (``save_sharded``: each rank hashes its own shard files, rank 0 records them); returns which files
  each rank hashed while saving.
- ``resume`` (after the test damaged step 2's ``dcp/__1_0.distcp``): ``refuse_unverified`` of the run (its newest
  checkpoint) on both ranks, the files each rank hashed (spread: recorded file ``i`` on rank ``i % 2``), then
  ``_choose_checkpoint`` (the distributed ``--resume``'s choice, with a session that has no Ray checkpoint).
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class NoRaySession:
    """The part of ``genoctx.cluster.WorkerSession`` ``_choose_checkpoint`` uses: no checkpoint registered with Ray."""

    @contextlib.contextmanager
    def checkpoint_dir(self):
        yield None


def _hashed_names(into: list[str]) -> None:
    """Record the names ``genoctx.train.integrity._check_file`` / ``checkpoint.digest_files`` hash on this rank."""
    import genoctx.train.checkpoint as checkpoint
    import genoctx.train.integrity as integrity
    import genoctx.train.sharded as sharded

    real_check, real_digest = integrity._check_file, checkpoint.digest_files

    def check(root, name, rec):
        into.append(name)
        return real_check(root, name, rec)

    def digest(root, names):
        names = list(names)
        into.extend(names)
        return real_digest(root, names)

    integrity._check_file = check
    sharded.digest_files = digest


def run_save(out: Path, dims) -> dict:
    from genoctx.model.config import preset
    from genoctx.parallel.build import Fresh, build_model
    from genoctx.recipes import Recipe, TrainConfig
    from genoctx.train.loop import build_optimizer
    from genoctx.train.sharded import save_sharded

    cfg = preset("tiny")
    tc = TrainConfig(steps=2, keep_checkpoints=0)
    torch.manual_seed(0)
    model = build_model(cfg, dims, source=Fresh())
    opt, sched = build_optimizer(model, tc, 2)
    hashed: list[str] = []
    _hashed_names(hashed)
    for step in (1, 2):
        for p in model.parameters():  # a step of gradients: AdamW's state exists and the weights change
            p.grad = torch.ones_like(p)
        opt.step()
        save_sharded(out / "run", step, model, opt, sched, Recipe(model=cfg, train=tc), {}, dims)
    return {"hashed_at_save": hashed}


def run_resume(out: Path, dims) -> dict:
    from genoctx.errors import AgreedError
    from genoctx.train.distributed import _choose_checkpoint
    from genoctx.train.integrity import refuse_unverified

    run = out / "run"
    hashed: list[str] = []
    _hashed_names(hashed)
    res: dict = {}
    try:
        refuse_unverified(run / "checkpoints" / "step_000002", run, run, "--checkpoint", "evaluate it", dims=dims)
        res["refused"] = None
    except AgreedError as e:
        res["refused"] = str(e)
    res["hashed_by_refuse"] = list(hashed)
    res["choice"] = _choose_checkpoint(run, dist.get_rank(), NoRaySession(), dims, verify=True)
    return res


def run(rank: int, world: int, init_file: str, out_dir: str, case: str) -> None:
    from genoctx.parallel.mesh import init_parallel, leaving_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with leaving_mesh():
        dims = init_parallel(dp_shard=world)
        out = Path(out_dir)
        res = run_save(out, dims) if case == "save" else run_resume(out, dims)
        dist.barrier()
        del dims
    torch.save(res, out / f"rank{rank}.pt")


if __name__ == "__main__":
    init = tempfile.mktemp(prefix="genoctx-gloo-")
    # fork, not spawn: the ranks do not import torch and genoctx again
    mp.start_processes(run, args=(2, init, sys.argv[1], sys.argv[2]), nprocs=2, start_method="fork")
