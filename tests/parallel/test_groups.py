"""Folded expert parallelism builds the process groups Megatron-Core builds for the same sizes (the oracle).

For each layout and every rank (the ``fake`` process-group backend, one rank at a time in this process), genoctx's
``init_parallel(..., ep_folded=True)`` and megatron-core's ``parallel_state.initialize_model_parallel(
context_parallel_size=cp, expert_model_parallel_size=ep)`` give the same ranks in the EP group, the expert
data-parallel group (genoctx: the FSDP mesh of a rank's expert block, replicas included), the CP group and the
data-parallel group. Megatron's data parallelism is genoctx's ``dp_replicate x dp_shard``.
"""

import warnings

import pytest
import torch.distributed as dist

ps = pytest.importorskip("megatron.core.parallel_state")


def _ranks(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


def _mesh_ranks(mesh) -> list[int]:
    return sorted(mesh.mesh.flatten().tolist())


# (world, dp_shard, cp, ep); dp_replicate is the rest of the world
LAYOUTS = [(8, 1, 8, 4), (8, 4, 2, 4), (8, 2, 4, 2), (8, 2, 2, 2), (16, 2, 4, 8), (16, 1, 4, 2), (64, 1, 64, 32)]


@pytest.mark.parametrize("world,dp_shard,cp,ep", LAYOUTS)
def test_folded_groups_are_megatron_cores(world, dp_shard, cp, ep):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from genoctx.parallel.mesh import init_parallel

    ranks = range(world) if world <= 16 else (0, 1, 31, 32, 63)
    for rank in ranks:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            dims = init_parallel(cp, ep=ep, dp_shard=dp_shard, ep_folded=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ps.initialize_model_parallel(context_parallel_size=cp, expert_model_parallel_size=ep,
                                             create_gloo_process_groups=False)  # fmt: skip
            assert dims.layout.world == world and dims.layout.expert_shard == dp_shard * cp // ep
            assert _ranks(dims.ep_group) == _ranks(ps.get_expert_model_parallel_group()), ("ep", rank)
            assert dims.ep_rank == ps.get_expert_model_parallel_rank()
            assert _mesh_ranks(dims.expert_mesh) == _ranks(ps.get_expert_data_parallel_group()), ("edp", rank)
            cp_want = _ranks(ps.get_context_parallel_group())
            assert (_ranks(dims.cp_group) if cp > 1 else [rank]) == cp_want, ("cp", rank)
            assert _mesh_ranks(dims.mesh["dp"]) == _ranks(ps.get_data_parallel_group()), ("dp", rank)
            assert dims.dp_rank == ps.get_data_parallel_rank()
        finally:
            ps.destroy_model_parallel()
            dist.destroy_process_group()
