"""Run by tests/plan/test_ops.py: two gloo ranks train one step of a preset (``name``) on FSDP2 (``dp_shard=2``),
each counting its aten ops per component and pass with ``genoctx.model.opcount.OpCounter`` (after a warm-up step:
FSDP's lazy init and AdamW's state); each rank writes ``OUT/{name}-rank{r}.pt``: ``{"counts", "total"}``."""

import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from genoctx.parallel.mesh import leaving_mesh

L = 512


def run(rank: int, world: int, init_file: str, out_dir: str, name: str = "tiny") -> None:
    from genoctx.model.config import preset
    from genoctx.model.model import HybridLM
    from genoctx.model.opcount import count_train_step
    from genoctx.parallel.fsdp import apply_parallel
    from genoctx.parallel.mesh import init_parallel
    from genoctx.recipes import TrainConfig
    from genoctx.train.loop import build_optimizer, train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with leaving_mesh():
        dims = init_parallel(dp_shard=world)
        torch.manual_seed(0)
        model = HybridLM(preset(name), seed=0)
        apply_parallel(model, dims)
        cfg = TrainConfig(steps=3, lr=1e-3, warmup_steps=1, dtype="fp32")
        opt, sched = build_optimizer(model, cfg, cfg.steps)
        x = torch.randint(3, 7, (world, L), generator=torch.Generator().manual_seed(1))[dims.dp_rank][None]
        train_step(model, opt, sched, x[:, :64], cfg, nullcontext(), dims)
        c = count_train_step(model, opt, lambda: train_step(model, opt, sched, x, cfg, nullcontext(), dims))
    torch.save({"counts": c.counts, "total": c.total}, Path(out_dir) / f"{name}-rank{rank}.pt")


if __name__ == "__main__":  # pragma: no cover - run by the test
    sys.exit("run by tests/plan/test_ops.py")
