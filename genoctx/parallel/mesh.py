"""One device mesh for every parallel dimension: ``dp_replicate x ep x dp_shard x cp`` (``genoctx.parallel.layout``).

Every process group genoctx uses comes from this mesh (``torch.distributed.device_mesh.init_device_mesh``, gloo on
CPU, NCCL on CUDA), so no dimension has two owners:

    dims            mesh dimension(s)                      used for
    cp_group        cp                                     KDA state fold, DSA key all-gathers (apply_cp)
    ep_group        ep                                     token dispatch to experts (apply_ep)
    dp (data rank)  dp_replicate x ep x dp_shard           which windows a rank reads (sample_batch)
    world_group     all four                               loss count, MoE loads, gradient norm, dense grads
    expert_group    dp_replicate x dp_shard x cp           expert grads without FSDP (ranks holding one block)
    dense_mesh      (dp_replicate, ep x dp_shard x cp)     FSDP2 mesh of dense parameters (HSDP when replicated)
    expert_mesh     (dp_replicate, dp_shard x cp)          FSDP2 mesh of each rank's block of routed experts
    expert_dtensor  (ep, dp_shard x cp) or (ep,)           a routed expert's DTensor view (``parallel.state``)

Folded EP (``Layout.ep_folded``): the mesh's ``ep`` dimension has size 1 and a second mesh over the same ranks,
``(dp_replicate, ep, efsdp)`` with ``ep`` the fastest-varying rank index (contiguous EP groups, as Megatron-Core's
expert rank order ``tp-ep-dp-pp``), gives ``ep_group`` (its ``ep``), ``expert_mesh`` (``(dp_replicate, efsdp)``)
and ``expert_dtensor`` (``(ep, efsdp)``); every other group is the table's.

``fsdp_one`` (``Layout.fsdp_one``): one rank with FSDP2: ``dense_mesh`` and ``expert_mesh`` are 1-rank meshes, and
the dims count as distributed (``is_distributed``): the parameters are DTensors, so the step, the gradient norm and the
checkpoints take the mesh's path (collectives over one rank, DCP checkpoints), not the one-process one.

The model is written for one device; parallelism is applied from outside in this order (``apply_parallel``):
expert parallel (``apply_ep``: keep this rank's experts), context parallel (``apply_cp``: mixing layers see their
pieces' caches), activation checkpointing (``apply_ac``), FSDP2 (``apply_fsdp``), then the optimizer is built on the
sharded parameters.
"""

from __future__ import annotations

import gc
import traceback
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

from .layout import DIMS, Layout, cp_pieces


@dataclass
class ParallelDims:
    """Which parallel dims are on, this rank's coordinates and the groups that serve them (see the module table).

    Attributes:
        layout: the sizes (``Layout``); ``cp``, ``dp``, ``ep``, ``world``, ``fsdp`` are read from it.
        cp_rank, dp_rank, ep_rank: this rank's index in its CP group, among the data-parallel ranks, in its EP group.
        cp_group, ep_group: None when that size is 1.
        dp_cp_group: the whole mesh (loss count, MoE loads, dense gradients without FSDP).
        expert_group: ranks holding the same block of experts (expert gradients without FSDP); None when 1 rank.
        dense_mesh, expert_mesh: the FSDP2 meshes (None without FSDP).
        expert_dtensor_mesh: the mesh a routed expert's tensor is a DTensor of: ``(ep, expert shard)`` under FSDP,
            ``(ep,)`` without (None without EP).
        cp_layout: ``"contiguous"`` or ``"zigzag"`` (``genoctx.parallel.layout.cp_pieces``).
    """

    layout: Layout = field(default_factory=Layout)
    cp_rank: int = 0
    dp_rank: int = 0
    ep_rank: int = 0
    cp_group: object | None = None
    ep_group: object | None = None
    dp_cp_group: object | None = None
    expert_group: object | None = None
    dense_mesh: object | None = None
    expert_mesh: object | None = None
    cp_layout: str = "contiguous"
    mesh: object | None = None
    expert_dtensor_mesh: object | None = None

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def fsdp(self) -> bool:
        return self.layout.fsdp

    @property
    def is_distributed(self) -> bool:
        """The mesh's code path (collectives, DTensor parameters, DCP checkpoints): several ranks, or FSDP2 on one
        (``Layout.fsdp_one``)."""
        return self.world > 1 or self.fsdp

    def coordinates(self) -> dict:
        """This rank's place in the mesh, for metrics: ``{"cp_rank", "dp_rank", "ep_rank"}``."""
        return {"cp_rank": self.cp_rank, "dp_rank": self.dp_rank, "ep_rank": self.ep_rank}

    def drop_groups(self) -> None:
        """Forget every process group and mesh these dims hold (they become None); sizes and ranks are kept.

        A group held here (or by a mesh) stays alive as long as these dims do; ``destroy_parallel`` calls this so
        that the groups can be freed, and their gloo threads joined, before the interpreter exits.
        """
        for name in _GROUP_FIELDS:
            setattr(self, name, None)


_GROUP_FIELDS = ("cp_group", "ep_group", "dp_cp_group", "expert_group", "dense_mesh", "expert_mesh", "mesh",
                 "expert_dtensor_mesh")  # fmt: skip
# every ParallelDims init_parallel made in this process, until destroy_parallel: weak, so that tracking them never
# keeps a group alive longer than its users do
_LIVE: list[weakref.ref[ParallelDims]] = []


def init_parallel(
    cp: int = 1,
    layout: str = "contiguous",
    *,
    ep: int = 1,
    dp_shard: int = 1,
    ep_folded: bool = False,
    device_type: str | None = None,
    fsdp_one: bool = False,
) -> ParallelDims:
    """Build the mesh ``dp_replicate x ep x dp_shard x cp`` over the initialised default process group.

    Args:
        cp, ep, dp_shard: sizes; ``dp_replicate`` is the rest of the world size.
        layout: the CP layout recorded in the returned dims (``cp_pieces``; ignored when ``cp == 1``).
        ep_folded: draw the EP groups from the ``dp_shard x cp`` ranks (module docstring) instead of an axis.
        fsdp_one: FSDP2 on a world of one rank (``Layout.fsdp_one``; dropped where ``dp_shard x cp > 1``).
        device_type: ``"cpu"`` or ``"cuda"``; default from the backend (NCCL: cuda, else cpu).

    Returns:
        ``ParallelDims`` with its groups and meshes.

    Raises:
        ValueError: torch.distributed is not initialised, ``ep x dp_shard x cp`` (folded: ``dp_shard x cp``) does
            not divide the world size, a folded ``ep`` does not divide ``dp_shard x cp``, an unknown CP layout, or
            ``fsdp_one`` on several ranks that ``dp_shard``/``cp`` do not shard over.
    """
    import torch
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    cp_pieces(max(cp, 1), layout)  # validates the layout
    if not dist.is_initialized():
        raise ValueError("init_parallel needs torch.distributed initialised (gloo on CPU, nccl on CUDA)")
    lay = Layout.for_world(dist.get_world_size(), ep=ep, dp_shard=dp_shard, cp=cp, ep_folded=ep_folded,
                           fsdp_one=fsdp_one)  # fmt: skip
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    sizes = {d: getattr(lay, d) for d in DIMS} | {"ep": lay.ep_axis}
    mesh = init_device_mesh(device_type, tuple(sizes[d] for d in DIMS), mesh_dim_names=DIMS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "slicing a flattened dim from root mesh will be deprecated"
        dp_mesh = mesh["dp_replicate", "ep", "dp_shard"]._flatten("dp")
        world_mesh = mesh[DIMS]._flatten("world")
        folded = ep_folded and ep > 1
        # ranks holding the same expert block (expert gradients without FSDP); folded EP is always sharded
        expert_rep = None if folded else mesh["dp_replicate", "dp_shard", "cp"]._flatten("expert_replicas")
        dense_mesh = expert_mesh = None
        if lay.fsdp:
            mesh["ep", "dp_shard", "cp"]._flatten("dense_shard")
            dense_mesh = mesh["dp_replicate", "dense_shard"]
            if not folded:
                mesh["dp_shard", "cp"]._flatten("expert_shard")
                expert_mesh = mesh["dp_replicate", "expert_shard"]
    ep_group, ep_rank, dtensor_mesh = None, 0, None
    if folded:
        efsdp = lay.expert_shard
        ranks = torch.arange(lay.world).reshape(lay.dp_replicate, efsdp, ep).transpose(1, 2)  # ep fastest
        emesh = DeviceMesh(device_type, ranks, mesh_dim_names=("dp_replicate", "ep", "efsdp"))
        ep_group, ep_rank = emesh["ep"].get_group(), emesh["ep"].get_local_rank()
        expert_mesh, dtensor_mesh = emesh["dp_replicate", "efsdp"], emesh["ep", "efsdp"]
    elif ep > 1:
        ep_group, ep_rank = mesh["ep"].get_group(), mesh["ep"].get_local_rank()
        dtensor_mesh = mesh["ep", "expert_shard"] if lay.fsdp else mesh["ep"]
    dims = ParallelDims(
        layout=lay,
        cp_rank=mesh["cp"].get_local_rank(),
        dp_rank=dp_mesh.get_local_rank(),
        ep_rank=ep_rank,
        cp_group=mesh["cp"].get_group() if cp > 1 else None,
        ep_group=ep_group,
        dp_cp_group=world_mesh.get_group(),
        expert_group=expert_rep.get_group() if expert_rep is not None and expert_rep.size() > 1 else None,
        dense_mesh=dense_mesh,
        expert_mesh=expert_mesh,
        cp_layout=layout if cp > 1 else "contiguous",
        mesh=mesh,
        expert_dtensor_mesh=dtensor_mesh,
    )
    _LIVE.append(weakref.ref(dims))
    return dims


def _clear_frames(error: BaseException | None) -> None:
    """Clear the locals of the finished frames in ``error``'s traceback and in those of its causes and contexts
    (``traceback.clear_frames``): a frame that failed holds the model, its meshes and so their process groups."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if error.__traceback__ is not None:
            traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def destroy_parallel(error: BaseException | None = None) -> None:
    """Leave the mesh: free every process group this process made, so that none outlives the interpreter.

    Drops the groups of every ``ParallelDims`` ``init_parallel`` returned (``ParallelDims.drop_groups``), clears the
    finished frames of ``error`` (and of its causes) when one is given, destroys the default process group with every
    group made from it (``torch.distributed.destroy_process_group``) and runs ``gc.collect()``. Without this, a group
    held by a reference cycle or a traceback is freed only at interpreter exit, where gloo's threads, stopped in a
    destructor that may not throw, can end the rank with SIGABRT ("terminate called without an active exception").

    Args:
        error: the exception the worker is leaving with, if any (it is re-raised by the caller, not here).

    Never raises: a teardown error is turned into a warning, so that it cannot hide ``error``.
    """
    for ref in _LIVE:
        if (dims := ref()) is not None:
            dims.drop_groups()
    _LIVE.clear()
    _clear_frames(error)
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:  # pragma: no cover - teardown after a failed collective
        warnings.warn(f"destroy_process_group failed while leaving the mesh: {e}", stacklevel=2)
    gc.collect()


@contextmanager
def leaving_mesh():
    """Run a worker's body and leave the mesh after it, on success or error (``destroy_parallel``).

    Every process that joins a gloo/NCCL mesh (``cluster._run_on_worker``, the test workers) runs inside this, so
    that every group's threads are joined before the process exits. An exception is re-raised unchanged.
    """
    try:
        yield
    except BaseException as e:
        destroy_parallel(e)
        raise
    destroy_parallel()
