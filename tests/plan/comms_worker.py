"""Run by tests/plan/test_comms.py: four gloo ranks run one real training step (or one evaluation forward) of a tiny
model in each layout of ``CASES``, counting every collective the step issues (``Collectives``, a
``TorchDispatchMode`` that sees the ``c10d::`` ops FSDP2, EP, CP and the loop call). Each rank writes
``OUT/rank{r}.pt``: per case, ``[(collective, group size, in backward, input bytes)]``, the EP rows it received and
the names of the model's FSDP groups (``genoctx.train.dryrun._fsdp_groups``).
"""

import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from genoctx.model.config import preset
from genoctx.model.model import HybridLM
from genoctx.parallel.mesh import leaving_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from cp_worker import THREE_LAYERS  # noqa: E402

L = 128  # window tokens (CP=2: pieces of 64)
CHUNK = 48  # seq_chunk_tokens of the chunked case: CP=2 rounds of 96 and 32 tokens (48 and 16 a rank: MoE chunks 2 + 1)
# name -> (init_parallel kwargs, bf16, activation checkpointing, mode, extra)
CASES = {
    "hsdp_bf16_ac": ({"dp_shard": 2}, True, True, "train", {}),  # dp_replicate 2 x dp_shard 2, island groups
    "hsdp_bf16": ({"dp_shard": 2}, True, False, "train", {}),
    "fsdp_cp_ac": ({"dp_shard": 2, "cp": 2}, False, True, "train", {}),
    "fsdp_fep_bf16_ac": ({"dp_shard": 4, "ep": 2, "ep_folded": True}, True, True, "train", {}),
    "ep_fsdp_skew": ({"dp_shard": 2, "ep": 2}, False, False, "train", {"skew_bias": 0.15}),
    "dp2_ep2": ({"ep": 2}, False, False, "train", {}),  # no FSDP: gradients all-reduced (replicas and EP only)
    "fsdp_cp_chunk_bf16": ({"dp_shard": 2, "cp": 2}, True, False, "train", {"seq_chunk_tokens": CHUNK}),
    "eval_fep_cp": ({"dp_shard": 2, "cp": 2, "ep": 2, "ep_folded": True}, False, False, "eval", {"chunk": 32}),
}
# c10d op -> (collective, index of the input argument): what a wrapper around the collective sees
OPS = {
    "_allgather_base_": ("all_gather", 1),
    "allgather_": ("all_gather", 1),
    "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
    "broadcast_": ("broadcast", 0),
    "send": ("send_recv", 0),
}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class Collectives(TorchDispatchMode):
    """Every ``c10d::`` collective while active: ``records`` of ``(collective, group size, in backward, input
    bytes)``; an op this table does not know is recorded as ``("unknown:<op>", ...)`` (the test fails on it)."""

    def __init__(self):
        super().__init__()
        self.records = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d."):
            op = name.split(".")[1]
            if op != "barrier":
                kind, i = OPS.get(op, (f"unknown:{op}", 0))
                groups = [a for a in args if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type())]
                size = dist.ProcessGroup.unbox(groups[0]).size() if groups else -1
                in_bwd = torch._C._current_graph_task_id() != -1
                self.records.append((kind, size, in_bwd, _nbytes(args[i])))
        return func(*args, **(kwargs or {}))


def config():
    """``cp_worker.THREE_LAYERS`` (KDA, full DSA, shared DSA; dense MLP, two MoE layers) with 8 routed experts
    (top-2) and moe_chunk_tokens 32 (several EP rounds)."""
    return preset("tiny", **THREE_LAYERS, n_routed_experts=8, moe_chunk_tokens=32)


def model_for(bias: float = 0.0) -> HybridLM:
    torch.manual_seed(0)
    model = HybridLM(config())
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("hc.base", "e_score_correction_bias")):
                t.copy_(torch.randn_like(t.float()).to(t.dtype) * 0.1)
            if bias and name.endswith("e_score_correction_bias"):
                t[: t.numel() // 2] += bias  # favour the first EP rank's experts: skewed routing
    return model


def run_case(name: str, windows: torch.Tensor) -> dict:
    from genoctx.parallel.fsdp import apply_parallel
    from genoctx.parallel.mesh import init_parallel
    from genoctx.recipes import TrainConfig
    from genoctx.train.dryrun import _fsdp_groups
    from genoctx.train.loop import build_optimizer, train_step

    kw, bf16, ac, mode, extra = CASES[name]
    dims = init_parallel(**kw)
    model = model_for(extra.get("skew_bias", 0.0))
    apply_parallel(model, dims, activation_checkpointing=ac, param_dtype=torch.bfloat16 if bf16 else None,
                   cp_chunk_tokens=extra.get("chunk"))  # fmt: skip
    autocast = torch.autocast(device_type="cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    tokens = windows[dims.dp_rank][None]
    count = Collectives()
    if mode == "eval":
        from genoctx.eval.distributed import mesh_scorer

        model.eval()
        score = mesh_scorer(model, dims, extra["chunk"], "cpu", autocast)
        score(tokens[0].numpy())  # the first window (FSDP's lazy init), then one counted
        with count:
            score(tokens[0].numpy())
    else:
        cfg = TrainConfig(steps=1, lr=1e-3, warmup_steps=0, seq_chunk_tokens=extra.get("seq_chunk_tokens"))
        opt, sched = build_optimizer(model, cfg, cfg.steps)
        model.train()
        with count:
            train_step(model, opt, sched, tokens, cfg, autocast, dims)
    received = [int((getattr(layer.mlp, "stats", None) or {}).get("ep_received_rows", 0)) for layer in model.layers]
    groups = [g["module"] for g in _fsdp_groups(model)] if dims.fsdp else []
    return {"records": count.records, "received": received, "layout": dims.layout.to_dict(), "groups": groups}


def run(rank: int, world: int, init_file: str, out_dir: str, cases: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with leaving_mesh():
        g = torch.Generator().manual_seed(0)
        windows = torch.randint(0, 4, (4, L), generator=g)  # A, C, G, T ids: every position scored
        res = {name: run_case(name, windows) for name in cases}
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
