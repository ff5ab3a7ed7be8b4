"""FSDP2 on a mesh of one rank (``Layout.fsdp_one``, ``train.fsdp_one``, ``--fsdp-one``).

At world size 1 genoctx applies FSDP2 only when asked: then ``apply_parallel`` wraps with ``fully_shard`` over a
1-rank ``dp_shard`` mesh (with ``offload_optimizer``, ``CPUOffloadPolicy``), the step takes the mesh's path
(``ParallelDims.is_distributed``) and must equal one process without FSDP; the planner accepts the layout with its
sharded sizes equal to the full ones. The mesh is a 1-rank gloo group in this process (no fork).
"""

import copy
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from genoctx.model.config import preset
from genoctx.parallel.layout import Layout
from genoctx.plan import plan_memory
from genoctx.plan.search import valid_layouts

sys.path.insert(0, str(Path(__file__).parent))
from mesh_worker import CHUNK, mesh_model, train_config  # noqa: E402


@pytest.fixture()
def one_rank():
    """A 1-rank gloo default group in this process, left with ``destroy_parallel`` (groups freed, then gc)."""
    from genoctx.parallel.mesh import destroy_parallel

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    destroy_parallel()


def test_fsdp_one_layout_only_on_one_rank():
    lay = Layout.for_world(1, fsdp_one=True)
    assert lay.fsdp and lay.dense_shard == 1 and lay.expert_shard == 1 and lay.world == 1
    assert not Layout.for_world(1).fsdp  # not asked: one rank stays unsharded, as before
    assert "dp_shard=1 (fsdp)" in lay.describe()
    assert Layout.for_world(2, dp_shard=2, fsdp_one=True) == Layout(dp_shard=2)  # sharded anyway: the flag drops
    with pytest.raises(ValueError, match="--fsdp-one is FSDP2 on one rank"):
        Layout.for_world(2, fsdp_one=True)
    with pytest.raises(ValueError, match="fsdp_one is FSDP2 on one rank"):
        Layout(dp_replicate=2, fsdp_one=True)


def test_planner_accepts_offload_on_one_rank_with_full_sizes():
    cfg = preset("tiny")
    kw = dict(gpu_memory_gib=80.0, device="cuda", dtype="bf16")
    with pytest.raises(ValueError, match="optimizer_offload needs FSDP"):
        plan_memory(cfg, 1024, Layout(), optimizer_offload=True, **kw)
    one = plan_memory(cfg, 1024, Layout(fsdp_one=True), optimizer_offload=True, **kw)
    two = plan_memory(cfg, 1024, Layout(dp_shard=2), optimizer_offload=True, **kw)
    assert one["params_per_rank"] == plan_memory(cfg, 1024, Layout(), **kw)["params_per_rank"]  # full sizes
    assert two["params_per_rank"]["dense"] < one["params_per_rank"]["dense"] <= 2 * two["params_per_rank"]["dense"]
    assert one["host_gib"] > 0 and one["layout"]["fsdp_one"] and "fsdp_one" not in two["layout"]
    assert valid_layouts(cfg, 1024, 1, optimizer_offload=True) == [Layout(fsdp_one=True)]
    assert Layout() in valid_layouts(cfg, 1024, 1)


def _state(model) -> dict:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in
            model.named_parameters()}  # fmt: skip


def test_one_rank_fsdp2_with_offload_trains_as_one_process(one_rank):
    """FSDP2 (fully_shard on every decoder layer and the root) with CPUOffloadPolicy, activation checkpointing with
    offloaded layer inputs and a chunked window, on one rank: the step equals one process's without FSDP."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    from torch.distributed.tensor import DTensor

    from genoctx.parallel.fsdp import apply_parallel
    from genoctx.parallel.mesh import init_parallel
    from genoctx.train.loop import build_optimizer, train_step

    dims = init_parallel(fsdp_one=True)
    assert dims.fsdp and dims.is_distributed and dims.layout == Layout(fsdp_one=True)
    ref = mesh_model()
    model = copy.deepcopy(ref)
    apply_parallel(model, dims, activation_checkpointing=True, offload_optimizer=True, offload_activations=True)
    apply_parallel(ref, init_parallel(), activation_checkpointing=True, offload_activations=True)  # no FSDP
    assert isinstance(model, FSDPModule) and all(isinstance(layer, FSDPModule) for layer in model.layers)
    assert not isinstance(ref, FSDPModule)
    assert isinstance(model._get_fsdp_state()._fsdp_param_group.offload_policy, CPUOffloadPolicy)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    cfg = train_config()
    cfg.seq_chunk_tokens = CHUNK
    tokens = torch.randint(0, 4, (1, 160), generator=torch.Generator().manual_seed(3))
    before = _state(model)
    assert all(torch.equal(before[n], p) for n, p in ref.named_parameters())
    got = []
    for m, dm in ((model, dims), (ref, None)):
        opt, sched = build_optimizer(m, cfg, cfg.steps)
        got.append(train_step(m, opt, sched, tokens, cfg, nullcontext(), dm))
        if m is model:
            moments = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim()]
            assert moments and all(isinstance(t, DTensor) and t.to_local().device.type == "cpu" for t in moments)
    assert got[0]["loss"] == pytest.approx(got[1]["loss"], rel=1e-5)
    assert got[0]["grad_norm"] == pytest.approx(got[1]["grad_norm"], rel=1e-4)
    after = _state(model)
    moved = 0
    for name, p in ref.named_parameters():
        torch.testing.assert_close(after[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
        moved += not torch.equal(after[name], before[name])
    assert moved > len(after) // 2  # the step changed the parameters (lr 1e-2)
