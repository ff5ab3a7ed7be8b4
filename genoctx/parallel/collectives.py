"""The one layer every ``torch.distributed`` collective of genoctx goes through: NCCL's rules checked on any backend.

gloo accepts what NCCL refuses: a CPU tensor all-reduced on a NCCL group fails on the first GPU run (the eval's
``reduce_sums`` of numpy sums, the gradient norm of CPU-offloaded gradients), while every CPU test passes. So each
collective genoctx calls is a thin wrapper here, with ``torch.distributed``'s signature, that checks its arguments
against NCCL's rules before handing them on unchanged:

- every tensor is on the group's device, the one a collective of that group moves data on: the ``device_type`` of
  ``mesh`` when one is given (a ``DeviceMesh``, or any description with a ``device_type``: ``"cuda"`` for a NCCL
  mesh), else the group's backend's (``nccl``: ``cuda``, ``gloo``: ``cpu``; ``fake``, ``mpi`` and mixed backends:
  any device). All tensors of one call share one device (a ``cuda:0`` input with a ``cuda:1`` output is refused);
- split sizes (``all_to_all_single``) are host ints: a list of Python (or numpy) ints, one per rank of the group,
  summing to the tensor's rows; never a tensor, whose values would be read back by a device-to-host sync;
- the object collectives get a list of the group's size (``all_gather_object``) and a host-int ``src``.

A violation raises ``CollectiveError`` naming the call site (the caller's ``file:line in function``, and its caller)
and the argument at fault. The check reads only metadata (``tensor.device``, list lengths, ``dist.get_backend``):
no sync, no copy; the call site is looked up only when there is an error. Under torch's ``fake`` backend (the dry
run, ``genoctx.train.dryrun``) meta tensors are accepted on any mesh: they carry no data.

Wrapped (the collectives genoctx uses): ``all_reduce``, ``all_gather_into_tensor``, ``all_gather`` (list form),
``all_to_all_single`` (with split sizes), ``broadcast_object_list``, ``all_gather_object``, ``barrier``. Under NCCL
``barrier`` names the current CUDA device (``device_ids``) instead of letting NCCL guess one from the rank.
``device_of`` / ``to_device_of`` say where a collective of a group wants its tensors, for callers whose data starts
elsewhere (host sums, CPU-offloaded gradients). ``tests/parallel/test_collectives.py`` reads every module of
``genoctx/`` and ``kernels/`` and fails if one other than this calls a ``torch.distributed`` collective itself
(FSDP2's and DTensor's own collectives, inside torch, are exempt); process-group creation and teardown
(``init_process_group``, ``new_group``, ``destroy_process_group``, ``DeviceMesh``) are not collectives.
"""

from __future__ import annotations

import numbers
import os
import sys

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "CollectiveError",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast_object_list",
    "device_of",
    "to_device_of",
]

# the device type a backend moves tensors on; a backend not here (fake, mpi, ucc, undefined) accepts any device
BACKEND_DEVICE = {"nccl": "cuda", "gloo": "cpu", "xccl": "xpu", "hccl": "hpu"}
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
_HERE = os.path.abspath(__file__)


class CollectiveError(ValueError):
    """A collective called against NCCL's rules (a tensor off the group's device, split sizes that are not host ints,
    a wrongly sized object list). A bug in the caller, not bad user input: the message names the call site."""


def device_of(group=None, mesh=None) -> torch.device | None:
    """The device a collective on ``group`` (or ``mesh``) moves tensors on, or None where any device goes.

    Args:
        group: a process group (None: the default group). Its backend decides: ``nccl`` -> ``cuda``, ``gloo`` ->
            ``cpu`` (``BACKEND_DEVICE``); ``fake``, ``mpi`` and mixed (``"cpu:gloo,cuda:nccl"``) -> None.
        mesh: a mesh description with a ``device_type`` (a ``DeviceMesh``; ``ParallelDims.mesh``), or an object
            holding one as ``.mesh`` (``ParallelDims``); it decides over the group's backend when given.

    Returns:
        ``torch.device(type)`` without an index (the current device of that type), or None.
    """
    kind = _mesh_kind(mesh) or BACKEND_DEVICE.get(_backend(group))
    return torch.device(kind) if kind is not None else None


def to_device_of(t: Tensor, group=None, mesh=None) -> Tensor:
    """``t`` on the device a collective on ``group`` / ``mesh`` wants (``device_of``): ``t`` itself when it is there
    already or any device goes, else a copy there (for host data: one host-to-device copy; bring a result back with
    ``.cpu()``)."""
    want = device_of(group, mesh)
    if want is None or t.device.type == want.type:
        return t
    return t.to(want)


def all_reduce(tensor: Tensor, op=dist.ReduceOp.SUM, group=None, *, mesh=None) -> None:
    """``dist.all_reduce(tensor, op, group)`` in place, after the device check (module docstring).

    Args:
        tensor: any shape and dtype NCCL reduces, on the group's device.
        op: a ``dist.ReduceOp`` (SUM by default; gloo has no PREMUL_SUM or AVG).
        group: the process group (None: the default group).
        mesh: the mesh description whose ``device_type`` the tensor must be on (``device_of``).

    Raises:
        CollectiveError: ``tensor`` is not a tensor or not on the group's device.
    """
    _check_tensors("all_reduce", group, mesh, tensor=tensor)
    dist.all_reduce(tensor, op=op, group=group)


def all_gather_into_tensor(output: Tensor, input: Tensor, group=None, *, mesh=None) -> None:
    """``dist.all_gather_into_tensor(output, input, group)``: ``input`` [n, ...] of every rank into ``output``
    [P n, ...] (rank-major), after the device check; both on the group's device.

    Raises:
        CollectiveError: either is not a tensor, they are on different devices or not on the group's.
    """
    _check_tensors("all_gather_into_tensor", group, mesh, output=output, input=input)
    dist.all_gather_into_tensor(output, input, group=group)


def all_gather(tensor_list: list[Tensor], tensor: Tensor, group=None, *, mesh=None) -> None:
    """``dist.all_gather(tensor_list, tensor, group)``: rank q's ``tensor`` into ``tensor_list[q]`` (one per rank of
    the group, each of ``tensor``'s shape and dtype), after the device check.

    Raises:
        CollectiveError: ``tensor_list`` is not a list of the group's size, or a tensor is off the group's device.
    """
    _check_list_size("all_gather", "tensor_list", tensor_list, group)
    _check_tensors("all_gather", group, mesh, tensor_list=tensor_list, tensor=tensor)
    dist.all_gather(tensor_list, tensor, group=group)


def all_to_all_single(output: Tensor, input: Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group=None, *, mesh=None) -> None:  # fmt: skip
    """``dist.all_to_all_single``: ``input``'s rows ``input_split_sizes[d]`` to rank ``d`` in order, ``output``'s
    rows ``output_split_sizes[s]`` from rank ``s`` (None: equal parts of dim 0), after the checks.

    Args:
        output, input: tensors [rows, ...] on the group's device (one device for both).
        output_split_sizes, input_split_sizes: None, or host ints (Python or numpy), one per rank of the group,
            each >= 0, summing to ``output.shape[0]`` / ``input.shape[0]``.

    Raises:
        CollectiveError: a tensor off the group's device, or split sizes that are a tensor, hold a tensor or a
            non-int, a negative size, have the wrong length or the wrong sum.
    """
    _check_tensors("all_to_all_single", group, mesh, output=output, input=input)
    _check_splits("output_split_sizes", output_split_sizes, output, group)
    _check_splits("input_split_sizes", input_split_sizes, input, group)
    dist.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                           input_split_sizes=input_split_sizes, group=group)  # fmt: skip


def broadcast_object_list(object_list: list, src: int = 0, group=None) -> None:
    """``dist.broadcast_object_list(object_list, src, group)``: rank ``src``'s picklable objects into every rank's
    list, in place (NCCL: through the current CUDA device, which must be this rank's).

    Raises:
        CollectiveError: ``object_list`` is not a list or ``src`` not a host int.
    """
    if not isinstance(object_list, list):
        _fail("broadcast_object_list", f"object_list is a {type(object_list).__name__}, not a list")
    if isinstance(src, bool) or not isinstance(src, numbers.Integral):
        _fail("broadcast_object_list", f"src is a {type(src).__name__}, not a host int (the global rank)")
    dist.broadcast_object_list(object_list, src=int(src), group=group)


def all_gather_object(object_list: list, obj, group=None) -> None:
    """``dist.all_gather_object(object_list, obj, group)``: every rank's picklable ``obj`` into ``object_list`` (one
    entry per rank of the group, in rank order), in place.

    Raises:
        CollectiveError: ``object_list`` is not a list of the group's size (torch would leave extra entries
            untouched, or fail half-way with an IndexError).
    """
    _check_list_size("all_gather_object", "object_list", object_list, group)
    dist.all_gather_object(object_list, obj, group=group)


def barrier(group=None) -> None:
    """``dist.barrier(group)``; under NCCL on this rank's current CUDA device (``device_ids``), so that NCCL does not
    guess the device from the rank (a wrong guess hangs or makes a second communicator)."""
    if _backend(group) == "nccl" and torch.cuda.is_available():
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


def _backend(group) -> str:
    return str(dist.get_backend(group))


def _mesh_kind(mesh) -> str | None:
    """The ``device_type`` of a mesh description (or of its ``.mesh``: ``ParallelDims``); None without one."""
    if mesh is None:
        return None
    kind = getattr(mesh, "device_type", None)
    if kind is None and getattr(mesh, "mesh", None) is not None:
        kind = getattr(mesh.mesh, "device_type", None)
    return kind


def _check_tensors(call: str, group, mesh, **tensors) -> None:
    """Every tensor of ``tensors`` (a tensor, or a list of them) on ``device_of(group, mesh)``, all on one device."""
    want = device_of(group, mesh)
    first = None  # (label, device) of the first tensor
    for name, value in tensors.items():
        many = isinstance(value, (list, tuple))
        for i, t in enumerate(value if many else (value,)):
            label = f"{name}[{i}]" if many else name
            if not isinstance(t, Tensor):
                _fail(call, f"{label} is a {type(t).__name__}, not a tensor")
            dev = t.device
            if want is not None and dev.type != want.type and not (dev.type == "meta" and _backend(group) == "fake"):
                source = (f"the mesh's device_type is {want.type!r}" if _mesh_kind(mesh) is not None
                          else f"the group's backend is {_backend(group)}")  # fmt: skip
                _fail(
                    call,
                    f"{label} ({_describe(t)}) is on {dev}, but {source}: the collective needs its tensors "
                    f"on {want.type} (move them there first: collectives.to_device_of)",
                )
            if first is None:
                first = (label, dev)
            elif dev != first[1]:
                _fail(call, f"{label} ({_describe(t)}) is on {dev} but {first[0]} is on {first[1]}: the tensors of "
                            f"one collective must share one device")  # fmt: skip


def _check_splits(name: str, sizes, t: Tensor, group) -> None:
    """``sizes`` None, or host ints (one per rank, >= 0) summing to ``t.shape[0]``."""
    call = "all_to_all_single"
    if sizes is None:
        return
    if isinstance(sizes, Tensor):
        _fail(
            call,
            f"{name} is a tensor ({_describe(sizes)} on {sizes.device}), not a list of host ints: its "
            f"values would be read back by a device-to-host sync (use .tolist() once, where it is made)",
        )
    if not isinstance(sizes, (list, tuple)):
        _fail(call, f"{name} is a {type(sizes).__name__}, not a list of host ints")
    for i, s in enumerate(sizes):
        if isinstance(s, Tensor):
            _fail(call, f"{name}[{i}] is a tensor ({_describe(s)} on {s.device}), not a host int: reading it is a "
                        f"device-to-host sync")  # fmt: skip
        if isinstance(s, bool) or not isinstance(s, numbers.Integral):
            _fail(call, f"{name}[{i}] is a {type(s).__name__} ({s!r}), not a host int")
        if s < 0:
            _fail(call, f"{name}[{i}] is {s}, a negative size")
    world = dist.get_world_size(group)
    if len(sizes) != world:
        _fail(call, f"{name} has {len(sizes)} sizes for a group of {world} ranks")
    rows = t.shape[0] if t.dim() else 1
    if sum(int(s) for s in sizes) != rows:
        _fail(call, f"{name} sums to {sum(int(s) for s in sizes)}, but the tensor has {rows} rows (dim 0)")


def _check_list_size(call: str, name: str, value, group) -> None:
    if not isinstance(value, list):
        _fail(call, f"{name} is a {type(value).__name__}, not a list")
    world = dist.get_world_size(group)
    if len(value) != world:
        _fail(call, f"{name} has {len(value)} entries for a group of {world} ranks")


def _describe(t: Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


def _fail(call: str, what: str):
    raise CollectiveError(f"{_call_site()}: {call}: {what}")


def _call_site() -> str:
    """``"path:line in function (called from path:line in function)"``: the first two frames outside this module."""
    f = sys._getframe(1)
    while f is not None and os.path.abspath(f.f_code.co_filename) == _HERE:
        f = f.f_back
    if f is None:  # pragma: no cover - called from this module only
        return "<unknown call site>"
    site = _frame(f)
    return f"{site} (called from {_frame(f.f_back)})" if f.f_back is not None else site


def _frame(f) -> str:
    path = os.path.abspath(f.f_code.co_filename)
    if path.startswith(_ROOT + os.sep):
        path = os.path.relpath(path, _ROOT)
    return f"{path}:{f.f_lineno} in {f.f_code.co_name}"
