"""The planned aten ops (``genoctx.plan.ops``) equal what ``genoctx.model.opcount.OpCounter`` (a ``TorchDispatchMode``)
counts on real steps: tiny and cpu-small at three lengths each, a chunked step, a no-grad scoring forward; per
component and pass. The launch term of the time model (``genoctx.plan.time``): ``ops x op_host_s``, added on a CPU,
overlapped on a GPU, named as the bound where it dominates.

Tolerances: the total within 1%, each component's pass within 3% (or 12 ops): a few ops follow branches of the code
the loop-body table does not model (a pool's partial tail, a padded last chunk).

The same counted steps check the bytes their eager ops move (``OpCounter.bytes``) against ``genoctx.plan.eager``, a
linear model fitted to random configs that are neither tiny nor cpu-small (``bench/op_count.py --fit-bytes``): each
kind's total within 8%, each component within 25% (the MoE's routed rows depend on the data), and the memory model
``eager`` of the time model turns those bytes into seconds."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from genoctx.model.config import preset
from genoctx.parallel.layout import Layout
from genoctx.plan import eager as E
from genoctx.plan import ops as O
from genoctx.plan.hardware import load_hardware
from genoctx.plan.time import plan_time

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from op_count import count_eval, count_step  # noqa: E402


def _close(counted: dict, planned: dict, passes) -> None:
    for comp in O.COMPONENTS:
        for p in passes:
            c, q = counted[comp][p], planned[comp][p]
            assert abs(c - q) <= max(12, 0.03 * c), (comp, p, c, q)


def _close_bytes(counted: dict, planned: dict, passes) -> None:
    for kind in E.KINDS:
        c = sum(counted[x][p][kind] for x in E.COMPONENTS for p in passes)
        q = sum(planned[x][p][kind] for x in E.COMPONENTS for p in passes)
        assert q == pytest.approx(c, rel=0.08), (kind, c, q)
    for x in E.COMPONENTS:
        c = sum(counted[x][p][k] for p in passes for k in E.KINDS)
        q = sum(planned[x][p][k] for p in passes for k in E.KINDS)
        assert q == pytest.approx(c, rel=0.25, abs=1e5), (x, c, q)


@pytest.mark.parametrize(("name", "L"), [("tiny", 256), ("tiny", 700), ("tiny", 2000), ("cpu-small", 512),
                                         ("cpu-small", 2048), ("cpu-small", 3000)])  # fmt: skip
def test_step_ops_equal_the_counted(name, L):
    c = count_step(name, L)
    plan = O.step_ops(preset(name), L)
    assert plan["total"] == pytest.approx(c.total, rel=0.01)
    _close(c.counts, plan["components"], O.PASSES)
    assert plan["by_pass"]["optimizer"] == c.by_pass()["optimizer"]  # exact: one op per foreach term and tensor
    _close_bytes(c.bytes, E.step_bytes(preset(name), L)["components"], E.PASSES)


def test_chunked_step_ops_equal_the_counted():
    c = count_step("tiny", 1000, chunk=256)
    plan = O.step_ops(preset("tiny"), 1000, seq_chunk_tokens=256)
    assert plan["total"] == pytest.approx(c.total, rel=0.01)
    _close(c.counts, plan["components"], O.PASSES)
    assert plan["total"] > 1.5 * O.step_ops(preset("tiny"), 1000)["total"]  # 4 chunks, each its own calls
    chunked = E.step_bytes(preset("tiny"), 1000, seq_chunk_tokens=256)
    _close_bytes(c.bytes, chunked["components"], E.PASSES)
    assert chunked["total"] > 1.2 * E.step_bytes(preset("tiny"), 1000)["total"]  # the sweep scores every chunk again


@pytest.mark.parametrize(("name", "L"), [("tiny", 700), ("cpu-small", 2048)])
def test_eval_ops_equal_the_counted(name, L):
    c = count_eval(name, L)
    plan = O.eval_ops(preset(name), L)
    assert plan["total"] == pytest.approx(c.total, rel=0.01)
    _close(c.counts, plan["components"], ("forward",))
    _close_bytes(c.bytes, E.eval_bytes(preset(name), L)["components"], ("forward",))


def test_ops_grow_with_what_loops():
    """The loop bounds: KDA chunks and blocks, DSA tiles, MoE chunks; CP divides a rank's tokens and adds each KDA
    layer's state pass over them (its blocks and chunks, the fold per piece) and FSDP2's change to the layer."""
    cfg = preset("cpu-small")
    assert cfg.kda_block_tokens == 4096 and O.kda_units(cfg, 8192) == {"call": 1, "block": 2, "chunk": 128}
    assert O.kda_units(cfg, 1000)["chunk"] == 16 and O.kda_units(cfg, 4100) == {"call": 1, "block": 2, "chunk": 65}
    assert O.moe_units(cfg, 8192 * 2 + 5)["chunk"] == 3
    cp, one = O.step_ops(cfg, 1 << 15, Layout(cp=2))["components"]["kda"], O.step_ops(cfg, 1 << 14)["components"]["kda"]
    u, n = O.kda_units(cfg, 1 << 14), cfg.layer_types.count("linear_attention")
    body = O.OPS["kda"]["block"][0] * u["block"] + O.OPS["kda"]["chunk"][0] * u["chunk"]
    state = O.CP_OPS["kda"]["call"][0] + 2 * O.CP_OPS["kda"]["piece"][0] + body
    assert cp["forward"] == one["forward"] + n * (state + O.FSDP_OPS["kda_layer"][0])
    a, b = O.step_ops(cfg, 1 << 13)["total"], O.step_ops(cfg, 1 << 14)["total"]
    assert b > a


def test_launch_term_adds_on_a_cpu_and_overlaps_on_a_gpu():
    cfg = preset("cpu-small")
    gpu = load_hardware("h100")
    cpu = dataclasses.replace(gpu, host_overlaps_device=False, op_host_s=7e-6)
    t_gpu = plan_time(cfg, 2048, Layout(), gpu, dtype="fp32", recompute=False)
    t_cpu = plan_time(cfg, 2048, Layout(), cpu, dtype="fp32", recompute=False)
    ops = O.step_ops(cfg, 2048)["total"]
    assert t_gpu["ops"] == t_cpu["ops"] == ops
    assert t_gpu["launch_s"] == pytest.approx(ops * 1e-5) and t_cpu["launch_s"] == pytest.approx(ops * 7e-6)
    assert t_cpu["step_s"] == pytest.approx(t_cpu["device_s"] + t_cpu["launch_s"])
    assert t_gpu["step_s"] == pytest.approx(max(t_gpu["device_s"], t_gpu["launch_s"]))
    # a small model on an H100: its many small ops outlast the device's work
    assert t_gpu["launch_s"] > t_gpu["device_s"] and t_gpu["bound"] == "launch"
    big = plan_time(preset("glm-5.3-flash"), 1 << 17, Layout(dp_shard=8, cp=8), gpu)
    assert big["bound"] != "launch" and big["launch_s"] < big["device_s"]


def test_fsdp_step_ops_equal_the_counted(tmp_path):
    """FSDP2 over two gloo ranks (tiny and cpu-small): each rank's model ops as one process's, plus the FSDP runtime's
    (gathers, copies, reduce-scatters: ``other``) per group and parameter tensor."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
    import ops_worker
    import torch
    from mesh_runner import fork_ranks

    for name in ("tiny", "cpu-small"):
        fork_ranks(ops_worker.run, (2, tempfile.mktemp(prefix="genoctx-gloo-"), str(tmp_path), name), 2)
        plan = O.step_ops(preset(name), ops_worker.L, Layout(dp_shard=2))
        assert plan["total"] > O.step_ops(preset(name), ops_worker.L)["total"] + 500  # FSDP's own ops, planned
        for r in range(2):
            got = torch.load(tmp_path / f"{name}-rank{r}.pt")
            assert plan["total"] == pytest.approx(got["total"], rel=0.01)
            _close(got["counts"], plan["components"], O.PASSES)


@pytest.mark.parametrize(("name", "L", "cp", "dp_shard", "mode"), [
    ("tiny", 1024, 4, 1, "train"), ("tiny", 1024, 2, 1, "eval"), ("cpu-small", 2048, 2, 2, "train"),
])  # fmt: skip
def test_cp_ops_equal_the_counted(tmp_path, name, L, cp, dp_shard, mode):
    """Context parallelism on gloo ranks (FSDP2 over ``dp_shard x cp``), the busiest rank (the window's last piece):
    its layers' ops after the earlier pieces' positions, each KDA layer's ``[L | M]`` state pass (``CP_OPS``: its
    blocks and chunks, and the fold per piece: cp = 2 and 4), FSDP2's; a training step and a CP scoring forward. The
    bytes of the cpu-small step and of the scoring forward: the KDA layers' state pass (``eager.CP_COEFS``, fitted on
    other configs) included (the step's KDA bytes below half of the counted without it)."""
    import tempfile

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
    from mesh_runner import fork_ranks
    from op_count import mesh_rank

    world, out = cp * dp_shard, tmp_path / "counted.pt"
    fork_ranks(mesh_rank, (world, tempfile.mktemp(prefix="genoctx-gloo-"), str(out), name, L, cp, dp_shard, mode,
                           None), world)  # fmt: skip
    got = torch.load(out)
    cfg, lay = preset(name), Layout(cp=cp, dp_shard=dp_shard)
    plan = O.step_ops(cfg, L, lay) if mode == "train" else O.eval_ops(cfg, L, lay)
    counted = {c: {p: got["counts"].get(c, {}).get(p, 0) for p in O.PASSES} for c in O.COMPONENTS}
    assert plan["total"] == pytest.approx(got["total"], rel=0.01)
    _close(counted, plan["components"], O.PASSES)
    kda = sum(plan["components"]["kda"].values())
    assert kda > 1.5 * sum(O.step_ops(cfg, L // cp)["components"]["kda"].values()) or mode == "eval"  # the pass
    if name == "cpu-small" or mode == "eval":
        b = (E.step_bytes(cfg, L, lay) if mode == "train" else E.eval_bytes(cfg, L, lay))["components"]
        for kind in ("elementwise", "matmul"):  # (CP's and FSDP's gathers and copies, ``other``, are not modelled)
            c = sum(got["bytes"].get(x, {}).get(p, {}).get(kind, 0) for x in E.COMPONENTS for p in E.PASSES)
            assert sum(b[x][p][kind] for x in E.COMPONENTS for p in E.PASSES) == pytest.approx(c, rel=0.08)
        c = sum(sum(k.values()) for k in got["bytes"]["kda"].values())
        assert sum(sum(k.values()) for k in b["kda"].values()) == pytest.approx(c, rel=0.1)
        if mode == "train":
            alone = E.step_bytes(cfg, L, lay, cp_state=False)["components"]["kda"]
            assert sum(sum(k.values()) for k in alone.values()) < 0.5 * c  # the state pass: more than the layer's


def test_eager_memory_model_times_the_counted_bytes():
    """``memory_model: eager`` (a CPU profile): the memory-bound term is the eager bytes, elementwise and the products'
    operands at the memory rate, gathers at the gather rate; ``activations`` (the GPU profiles) is unchanged."""
    cfg = preset("cpu-small")
    gpu = load_hardware("h100")
    eager = dataclasses.replace(gpu, memory_model="eager", efficiency={**gpu.efficiency, "gather": 0.2})
    t = plan_time(cfg, 2048, Layout(), eager, dtype="fp32", recompute=False)
    b = E.step_bytes(cfg, 2048)["by_kind"]
    bw = gpu.hbm_bytes_per_s
    assert t["memory_bound_s"] == pytest.approx(
        (b["elementwise"] + b["matmul"]) / (0.7 * bw) + b["gather"] / (0.2 * bw)
    )
    assert t["hbm_bytes"] == pytest.approx(sum(b.values()))
    a = plan_time(cfg, 2048, Layout(), gpu, dtype="fp32", recompute=False)
    assert a["hbm_bytes"] < 0.5 * t["hbm_bytes"]  # the activation model: what a fused kernel would move
    assert a["compute_s"] == t["compute_s"]
    ev = plan_time(cfg, 2048, Layout(), eager, dtype="fp32", mode="eval")
    assert ev["hbm_bytes"] == pytest.approx(E.eval_bytes(cfg, 2048)["total"])
    # the bytes grow with what the code holds: tokens, and the indexer's scores with the window
    small, big = E.step_bytes(cfg, 4096), E.step_bytes(cfg, 8192)
    assert big["components"]["mhc"]["forward"]["elementwise"] == pytest.approx(
        2 * small["components"]["mhc"]["forward"]["elementwise"])  # fmt: skip
    idx = [x["components"]["dsa_indexer"]["forward"]["elementwise"] for x in (small, big)]
    assert idx[1] > 2.1 * idx[0]  # superlinear: each query scores every earlier pool


def test_memory_model_is_checked():
    from genoctx.errors import GenoctxError
    from genoctx.plan.hardware import hardware_from_dict

    doc = dict(name="x", dtype_flops={"bf16": 1e12, "fp32": 1e12}, hbm_bytes_per_s=1e10, memory_gib=8,
               gpus_per_node=1, intra_node_bytes_per_s=1e9, inter_node_bytes_per_s=1e9)  # fmt: skip
    assert hardware_from_dict(doc).memory_model == "activations"
    with pytest.raises(GenoctxError, match="memory_model must be one of activations, eager, got 'fused'"):
        hardware_from_dict({**doc, "memory_model": "fused"})
