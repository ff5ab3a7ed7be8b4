"""``genoctx.parallel.collectives``: NCCL's device rules checked on CPU, and every collective of genoctx through it.

- The layer, from a mesh description whose device is CUDA (``SimpleNamespace(device_type="cuda")``) on a 1-rank
  gloo group in this process (no GPU): a CPU tensor is refused naming the call site (this file's line and function)
  and the argument; split sizes that are tensors (or wrong) are refused; good input passes through with its values.
- Items 1 and 2 of issue 43: ``eval.distributed.reduce_sums`` (numpy sums) and ``parallel.fsdp.grad_norm`` (CPU
  gradients, as under optimizer offload) hand the layer tensors on the mesh's device. The stand-in for a device
  other than the CPU is ``meta`` (a CPU build has no CUDA tensor): the all-reduce is replaced by a recorder, and the
  old code's CPU tensors are refused by the layer on that mesh.
- An AST read of every module under ``genoctx/`` and ``kernels/``: none but the layer calls a ``torch.distributed``
  collective (FSDP2's and DTensor's own, inside torch, are exempt; group creation is not a collective).
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from genoctx.parallel import collectives as coll
from genoctx.parallel.collectives import CollectiveError

ROOT = Path(__file__).resolve().parents[2]
CUDA = SimpleNamespace(device_type="cuda")  # a mesh description whose device is CUDA (a NCCL mesh)
CPU = SimpleNamespace(device_type="cpu")
META = SimpleNamespace(device_type="meta")  # stands for "not the CPU" where a tensor must exist there


@pytest.fixture(scope="module", autouse=True)
def _one_rank():
    """A 1-rank gloo default group in this process (no threads of other ranks, ~2 ms), destroyed after."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _refused(call, *match: str) -> str:
    """``call()`` raises ``CollectiveError`` naming the line of ``call``'s body in this file and every ``match``."""
    with pytest.raises(CollectiveError) as e:
        call()
    msg = str(e.value)
    tb = e.value.__traceback__.tb_next  # the lambda's frame: the call site the layer must name
    assert msg.startswith(f"tests/parallel/test_collectives.py:{tb.tb_lineno} in <lambda> (called from "), msg
    for m in match:
        assert m in msg, (m, msg)
    return msg


def test_a_cpu_tensor_on_a_cuda_mesh_is_refused_naming_the_call_site_and_argument():
    x = torch.arange(4.0)
    _refused(lambda: coll.all_reduce(x, mesh=CUDA), "all_reduce: tensor (float32 [4]) is on cpu",
             "the mesh's device_type is 'cuda'")  # fmt: skip
    _refused(lambda: coll.all_gather_into_tensor(torch.empty(4), x, mesh=CUDA),
             "all_gather_into_tensor: output (float32 [4]) is on cpu")  # fmt: skip
    _refused(lambda: coll.all_gather([torch.empty(4)], x, mesh=CUDA), "all_gather: tensor_list[0]")
    _refused(lambda: coll.all_to_all_single(torch.empty(4), x, [4], [4], mesh=CUDA), "all_to_all_single: output")
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]  # refused before anything ran
    assert coll.device_of(mesh=CUDA) == torch.device("cuda") and coll.device_of() == torch.device("cpu")


def test_the_device_comes_from_the_groups_backend_without_a_mesh(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert coll.device_of() == torch.device("cuda")
    _refused(lambda: coll.all_reduce(torch.ones(2)), "tensor (float32 [2]) is on cpu, but the group's backend is nccl")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "fake")  # the dry run: meta tensors on a cpu mesh
    assert coll.device_of() is None
    coll._check_tensors("all_reduce", None, CPU, tensor=torch.empty(2, device="meta"))
    with pytest.raises(CollectiveError, match=r"input \(float32 \[2\]\) is on meta but output is on cpu"):
        coll._check_tensors(
            "all_gather_into_tensor", None, None, output=torch.empty(2), input=torch.empty(2, device="meta")
        )
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    with pytest.raises(CollectiveError, match="tensor .* is on meta"):
        coll._check_tensors("all_reduce", None, CPU, tensor=torch.empty(2, device="meta"))


def test_split_sizes_must_be_host_ints():
    out, inp = torch.empty(4), torch.arange(4.0)
    _refused(lambda: coll.all_to_all_single(out, inp, torch.tensor([4]), [4]),
             "output_split_sizes is a tensor (int64 [1] on cpu), not a list of host ints")  # fmt: skip
    _refused(lambda: coll.all_to_all_single(out, inp, [4], [torch.tensor(4)]), "input_split_sizes[0] is a tensor")
    _refused(lambda: coll.all_to_all_single(out, inp, [4], [4.0]), "input_split_sizes[0] is a float")
    _refused(lambda: coll.all_to_all_single(out, inp, [3], [4]), "output_split_sizes sums to 3, but the tensor has 4")
    _refused(lambda: coll.all_to_all_single(out, inp, [2, 2], [4]), "output_split_sizes has 2 sizes for a group of 1")
    _refused(lambda: coll.broadcast_object_list([1], src=torch.tensor(0)), "src is a Tensor, not a host int")
    _refused(lambda: coll.all_gather_object([None, None], 1), "object_list has 2 entries for a group of 1 ranks")


@pytest.mark.filterwarnings("ignore:.*all_gather_into_tensor.*:FutureWarning")  # torch 2.13 deprecates it
def test_good_input_passes_through():
    x = torch.arange(4.0)
    coll.all_reduce(x, mesh=CPU)
    coll.all_reduce(x, op=dist.ReduceOp.MAX)
    out = torch.empty(4)
    coll.all_gather_into_tensor(out, x)
    parts = [torch.empty(4)]
    coll.all_gather(parts, x, mesh=CPU)
    a2a = torch.empty(4)
    coll.all_to_all_single(a2a, x, [4], [np.int64(4)], mesh=CPU)
    objs, got = [{"a": 1}], [None]
    coll.broadcast_object_list(objs, src=0)
    coll.all_gather_object(got, "mine")
    coll.barrier()
    for t in (x, out, parts[0], a2a):
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert objs == [{"a": 1}] and got == ["mine"]
    assert coll.to_device_of(x, mesh=CPU) is x


class _Stop(Exception):
    pass


def _recording(monkeypatch) -> list[torch.device]:
    """Replace torch's all-reduce (what the layer calls once its checks pass) by a recorder of the devices."""
    seen = []

    def fake(tensor, op=None, group=None, async_op=False):
        seen.append(tensor.device)
        raise _Stop

    monkeypatch.setattr(dist, "all_reduce", fake)
    return seen


def _sums() -> dict:
    return {("+", "all"): (np.array([[1.5, 2.0]]), np.array([[3, 4]], dtype=np.int64))}


def test_item1_reduce_sums_all_reduces_on_the_mesh_device(monkeypatch):
    from genoctx.eval.distributed import reduce_sums

    dims = SimpleNamespace(is_distributed=True, dp_cp_group=None, mesh=CPU)
    out = reduce_sums(_sums(), dims)  # the real 1-rank reduction: the same numbers, numpy arrays again
    assert out[("+", "all")][0].tolist() == [[1.5, 2.0]] and out[("+", "all")][1].tolist() == [[3, 4]]
    # the old code's tensors (from numpy, on the CPU) on a mesh off the CPU: refused by the layer
    old = torch.from_numpy(np.stack([_sums()[("+", "all")][0]]).copy())
    _refused(lambda: coll.all_reduce(old, group=None, mesh=CUDA), "tensor (float64 [1, 1, 2]) is on cpu")
    seen = _recording(monkeypatch)
    with pytest.raises(_Stop):
        reduce_sums(_sums(), SimpleNamespace(is_distributed=True, dp_cp_group=None, mesh=META))
    assert seen == [torch.device("meta")]


def test_item2_grad_norm_of_cpu_gradients_all_reduces_on_the_mesh_device(monkeypatch):
    from genoctx.parallel.fsdp import clip_grad_norm, grad_norm

    model = torch.nn.Linear(3, 2)
    for p in model.parameters():
        p.grad = torch.full_like(p, 2.0)  # host gradients: optimizer offload's
    dims = SimpleNamespace(is_distributed=True, world=1, ep=1, dp_cp_group=None, mesh=CPU)
    assert grad_norm(model, dims).item() == pytest.approx(2.0 * 8**0.5)
    assert clip_grad_norm(model, 1.0, dims) == pytest.approx(2.0 * 8**0.5)
    seen = _recording(monkeypatch)
    with pytest.raises(_Stop):
        grad_norm(model, SimpleNamespace(is_distributed=True, world=1, ep=1, dp_cp_group=None, mesh=META))
    assert seen == [torch.device("meta")]


# ---------------------------------------------------------------------------------------------------------------
# No collective outside the layer

LAYER = "genoctx/parallel/collectives.py"
COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
    "all_gather_object", "_all_gather_base", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "scatter", "scatter_object_list",
    "gather", "gather_object", "send", "recv", "isend", "irecv", "send_object_list", "recv_object_list",
    "batch_isend_irecv", "P2POp", "barrier", "monitored_barrier",
})  # fmt: skip
# ProcessGroup's own methods (no other class has these names)
PG_METHODS = frozenset({"allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "_allgather_base",
                        "allgather_into_tensor_coalesced", "alltoall", "alltoall_base", "_reduce_scatter_base",
                        "reduce_scatter_tensor_coalesced"})  # fmt: skip
DIST_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d")
# modules that are nothing but collectives: importing one is calling them
COLLECTIVE_MODULES = ("torch.distributed._functional_collectives", "torch.distributed.nn.functional",
                      "torch.distributed.nn", "torch.ops.c10d", "torch.ops._c10d_functional")  # fmt: skip


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def collective_calls(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for every use of a ``torch.distributed`` collective in ``source`` (any import spelling)."""
    tree = ast.parse(source)
    alias: dict[str, str] = {}  # local name -> the module it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if node.module in DIST_MODULES and a.name in COLLECTIVES:
                    found.append((node.lineno, f"from {node.module} import {a.name}"))
                alias[a.asname or a.name] = full
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                name = (f"{node.module}." if isinstance(node, ast.ImportFrom) and node.module else "") + a.name
                if any(name == m or name.startswith(m + ".") for m in COLLECTIVE_MODULES):
                    found.append((node.lineno, f"import {name}"))
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted is None:
                if node.attr in PG_METHODS:
                    found.append((node.lineno, f".{node.attr}"))
                continue
            head, _, rest = dotted.partition(".")
            full = f"{alias.get(head, head)}.{rest}" if rest else alias.get(head, head)
            module, _, attr = full.rpartition(".")
            if (
                (module in DIST_MODULES and attr in COLLECTIVES)
                or attr in PG_METHODS
                or any(full.startswith(m + ".") for m in COLLECTIVE_MODULES)
            ):
                found.append((node.lineno, full))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            args = node.args
            if len(args) >= 2 and isinstance(args[1], ast.Constant) and args[1].value in COLLECTIVES:
                target = _dotted(args[0])
                if target is not None and alias.get(target.split(".")[0], target) in DIST_MODULES:
                    found.append((node.lineno, f"getattr(..., {args[1].value!r})"))
    return sorted(set(found))


@pytest.mark.parametrize("source,hits", [
    ("import torch.distributed as dist\ndist.all_reduce(x)\ndist.get_rank()\ndist.new_group([0])", 1),
    ("import torch\ntorch.distributed.barrier()\ntorch.distributed.init_process_group('gloo')", 1),
    ("from torch import distributed as d\nd.all_gather_object(a, b)\nd.destroy_process_group()", 1),
    ("from torch.distributed import all_to_all_single, get_rank\nall_to_all_single(o, i)", 1),
    ("import torch.distributed._functional_collectives as funcol\nfuncol.all_reduce(x, 'sum', g)", 2),
    ("import torch\ntorch.ops._c10d_functional.all_reduce(x, 'sum', '0')", 1),
    ("pg = dist.distributed_c10d._get_default_group()\npg.allreduce([x])", 1),
    ("import torch.distributed as dist\nf = getattr(dist, 'broadcast')", 1),
    ("from genoctx.parallel import collectives as coll\ncoll.all_reduce(x, group=g)\nnp.broadcast_to(a, s)", 0),
])  # fmt: skip
def test_the_scanner_finds_every_spelling(source, hits):
    assert len(collective_calls(source)) == hits, collective_calls(source)


def test_no_module_but_the_layer_calls_a_collective():
    found = []
    for pkg in ("genoctx", "kernels"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel != LAYER:
                found += [f"{rel}:{line}: {what}" for line, what in collective_calls(path.read_text())]
    assert not found, "collectives outside genoctx/parallel/collectives.py:\n" + "\n".join(found)


def test_the_layer_wraps_every_collective_genoctx_used():
    names = {"all_reduce", "all_gather_into_tensor", "all_gather", "all_to_all_single", "broadcast_object_list",
             "all_gather_object", "barrier"}  # fmt: skip
    assert names <= set(coll.__all__) and all(callable(getattr(coll, n)) for n in names)
    assert collective_calls((ROOT / LAYER).read_text())  # the scanner sees the layer's own calls
