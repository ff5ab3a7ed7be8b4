"""Run by tests/parallel/test_context.py: two gloo processes check CP=2 and DP=2 against one process.

Usage: python tests/parallel/cp_worker.py OUT_DIR WINDOWS.pt
WINDOWS.pt holds {"dna": [L] int64, "n_start": [L] int64, "pair": [2, L] int64} real-DNA windows; each rank
writes OUT_DIR/rank{r}.pt with the loss sums, counts, aux losses, gradients and DSA/MoE stats of each case.
"""

import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from genoctx.model.config import preset
from genoctx.model.model import HybridLM
from genoctx.parallel.context import apply_cp, destroy_parallel, init_parallel
from genoctx.train.loop import forward_backward


def tiny_model() -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(preset("tiny"))


def _case(model, tokens, dims):
    model.zero_grad(set_to_none=True)
    loss_sum, count, aux = forward_backward(model, tokens, nullcontext(), dims)
    return {
        "loss_sum": float(loss_sum),
        "count": int(count),
        "aux": aux,
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
        "keys_scored": [s.get("keys_scored") for s in model.layer_stats()],
    }


def run(rank: int, world: int, init_file: str, out_dir: str, windows_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    w = torch.load(windows_path)
    res = {}
    dims = init_parallel(cp=2)
    assert (dims.cp, dims.dp) == (2, 1)
    model = tiny_model()
    handles = apply_cp(model, dims.cp_group)
    res["cp2"] = _case(model, w["dna"][None], dims)
    res["cp2_n"] = _case(model, w["n_start"][None], dims)
    for h in handles:
        h.remove()
    destroy_parallel()
    dims = init_parallel(cp=1)
    assert (dims.cp, dims.dp) == (1, 2)
    res["dp2"] = _case(tiny_model(), w["pair"][dims.dp_rank][None], dims)
    destroy_parallel()
    dist.destroy_process_group()
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


if __name__ == "__main__":
    init = tempfile.mktemp(prefix="genoctx-gloo-")
    mp.spawn(run, args=(2, init, sys.argv[1], sys.argv[2]), nprocs=2)
