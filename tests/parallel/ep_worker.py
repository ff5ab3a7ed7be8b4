"""Run by tests/parallel/test_experts.py: two gloo processes run MoE layers with expert parallelism (EP=2).

Usage: python tests/parallel/ep_worker.py OUT_DIR

Each rank writes OUT_DIR/rank{r}.pt: for every case of ``CASES`` (the tokens of that rank, ``ep_tokens``) the
output, the gradient of the input and of every local parameter, ``stats`` and ``load_counts``; and for every case of
``MEMORY_CASES`` the peak live bytes of one forward + backward (``peak_bytes``) and ``stats``. The model of a case
is ``ep_moe(case)`` on both ranks (same seed), with EP applied; the one-process reference (the test) builds the
same module.
"""

import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from genoctx.model.config import ModelConfig, preset
from genoctx.model.host import SyncCounter
from genoctx.model.moe import MoE
from genoctx.parallel.experts import apply_ep, expert_parameters
from genoctx.parallel.mesh import leaving_mesh

EP = 2
# name -> (config overrides, router bias, per-rank input shapes [B, T])
CASES = {
    # random routing (re-drawn router bias), 3 rounds or more, unequal token counts, the aux loss on
    "random": (dict(moe_chunk_tokens=8, moe_aux_loss_coef=0.1), "random", [(2, 21), (1, 30)]),
    # experts 0, 1, 2 (all on rank 0) take every (token, slot) of both ranks: rank 1 receives nothing
    "forced": (dict(moe_chunk_tokens=4), "forced", [(2, 16), (1, 24)]),
    # rank 1 has no token at all but still receives rows (and takes part in every exchange)
    "empty": (dict(moe_chunk_tokens=8), "random", [(2, 19), (1, 0)]),
}
# memory: D 64, I 128 and 2048 tokens per rank in chunks of 256 (512 rows a round), balanced or forced, with
# rounds or (moe_chunk_tokens beyond the tokens) one round
MEM_CFG = dict(hidden_size=64, moe_intermediate_size=128, num_experts_per_tok=2)
MEM_TOKENS = 2048
MEMORY_CASES = {
    "balanced": (dict(MEM_CFG, moe_chunk_tokens=256), "zero"),
    "forced": (dict(MEM_CFG, moe_chunk_tokens=256), "forced"),
    "balanced_one_round": (dict(MEM_CFG, moe_chunk_tokens=1 << 20), "zero"),
    "forced_one_round": (dict(MEM_CFG, moe_chunk_tokens=1 << 20), "forced"),
}


def ep_config(**overrides) -> ModelConfig:
    """The tiny preset with 8 routed experts (4 per EP rank), top-3, one shared expert."""
    kw = dict(n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1)
    kw.update(overrides)
    return preset("tiny", **kw)


def ep_moe(overrides: dict, bias: str) -> MoE:
    """A fp32 MoE (seed 0) in training mode. ``bias``: "zero" (router at init), "random" (bias ~ N(0, 0.3):
    uneven, non-trivial routing) or "forced" (random, plus 100 on the first k experts, all on EP rank 0)."""
    torch.manual_seed(0)
    moe = MoE(ep_config(**overrides)).train()
    with torch.no_grad():
        b = moe.gate.e_score_correction_bias
        if bias != "zero":
            b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
        if bias == "forced":
            b[: moe.top_k] += 100.0
    return moe


def ep_tokens(case: str, rank: int, shape: tuple[int, int], hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, g) [B, T, hidden] fp32: rank ``rank``'s input and the output weights of its loss ``sum(y g)``."""
    gen = torch.Generator().manual_seed(1000 * rank + sum(map(ord, case)))
    return torch.randn(*shape, hidden, generator=gen), torch.randn(*shape, hidden, generator=gen)


def _equality_case(name: str, rank: int, group) -> dict:
    overrides, bias, shapes = CASES[name]
    moe = ep_moe(overrides, bias)
    handles = apply_ep(moe, group, EP, rank)
    assert len(expert_parameters(moe)) == 2
    x, g = ep_tokens(name, rank, shapes[rank], moe.experts.hidden_size)
    x.requires_grad_(True)
    with SyncCounter() as syncs:  # host reads of the dispatch (genoctx.model.host), however many rounds
        y = moe(x)
        loss = (y * g).sum()
        if moe.aux_loss is not None:
            loss = loss + moe.aux_loss
        loss.backward()
    out = {
        "syncs": (dict(syncs.reads), dict(syncs.ops)),
        "y": y.detach(),
        "x_grad": x.grad,
        "grads": {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in moe.named_parameters()},
        "aux": None if moe.aux_loss is None else float(moe.aux_loss.detach()),
        "stats": dict(moe.stats),
        "load_counts": moe.load_counts.clone(),
        "offset": moe.experts.expert_offset,
    }
    for h in handles:
        h.remove()
    assert "forward" not in vars(moe) and "forward" not in vars(moe.experts)
    return out


def _memory_case(name: str, rank: int, group) -> dict:
    """Peak live tensor bytes over one forward + backward, measured by torch's ``MemTracker`` (a
    ``TorchDispatchMode`` that follows every tensor storage an op creates until it is freed; works on CPU)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    overrides, bias = MEMORY_CASES[name]
    moe = ep_moe(overrides, bias)
    apply_ep(moe, group, EP, rank)
    x, g = ep_tokens("memory", rank, (1, MEM_TOKENS), moe.experts.hidden_size)
    x.requires_grad_(True)
    dist.barrier(group)
    tracker = MemTracker()
    with tracker:
        (moe(x) * g).sum().backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return {"peak_bytes": int(peak), "stats": dict(moe.stats)}


def run(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=EP)
    with leaving_mesh():
        group = dist.new_group(list(range(EP)))
        res = {name: _equality_case(name, rank, group) for name in CASES}
        res["memory"] = {name: _memory_case(name, rank, group) for name in MEMORY_CASES}
        del group
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


if __name__ == "__main__":
    init = tempfile.mktemp(prefix="genoctx-gloo-")
    # fork, not spawn: the ranks do not import torch and genoctx again
    mp.start_processes(run, args=(init, sys.argv[1]), nprocs=EP, start_method="fork")
