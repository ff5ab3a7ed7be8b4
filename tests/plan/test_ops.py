"""The planned aten ops (``genoctx.plan.ops``) equal what ``genoctx.model.opcount.OpCounter`` (a ``TorchDispatchMode``)
counts on real steps: tiny and cpu-small at three lengths each, a chunked step, a no-grad scoring forward; per
component and pass. The launch term of the time model (``genoctx.plan.time``): ``ops x op_host_s``, added on a CPU,
overlapped on a GPU, named as the bound where it dominates.

Tolerances: the total within 1%, each component's pass within 3% (or 12 ops): a few ops follow branches of the code
the loop-body table does not model (a pool's partial tail, a padded last chunk)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from genoctx.model.config import preset
from genoctx.parallel.layout import Layout
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


@pytest.mark.parametrize(("name", "L"), [("tiny", 256), ("tiny", 700), ("tiny", 2000), ("cpu-small", 512),
                                         ("cpu-small", 2048), ("cpu-small", 3000)])  # fmt: skip
def test_step_ops_equal_the_counted(name, L):
    c = count_step(name, L)
    plan = O.step_ops(preset(name), L)
    assert plan["total"] == pytest.approx(c.total, rel=0.01)
    _close(c.counts, plan["components"], O.PASSES)
    assert plan["by_pass"]["optimizer"] == c.by_pass()["optimizer"]  # exact: one op per foreach term and tensor


def test_chunked_step_ops_equal_the_counted():
    c = count_step("tiny", 1000, chunk=256)
    plan = O.step_ops(preset("tiny"), 1000, seq_chunk_tokens=256)
    assert plan["total"] == pytest.approx(c.total, rel=0.01)
    _close(c.counts, plan["components"], O.PASSES)
    assert plan["total"] > 1.5 * O.step_ops(preset("tiny"), 1000)["total"]  # 4 chunks, each its own calls


@pytest.mark.parametrize(("name", "L"), [("tiny", 700), ("cpu-small", 2048)])
def test_eval_ops_equal_the_counted(name, L):
    c = count_eval(name, L)
    plan = O.eval_ops(preset(name), L)
    assert plan["total"] == pytest.approx(c.total, rel=0.01)
    _close(c.counts, plan["components"], ("forward",))


def test_ops_grow_with_what_loops():
    """The loop bounds: KDA chunks and blocks, DSA tiles, MoE chunks; CP divides a rank's tokens."""
    cfg = preset("cpu-small")
    assert cfg.kda_block_tokens == 4096 and O.kda_units(cfg, 8192) == {"call": 1, "block": 2, "chunk": 128}
    assert O.kda_units(cfg, 1000)["chunk"] == 16 and O.kda_units(cfg, 4100) == {"call": 1, "block": 2, "chunk": 65}
    assert O.moe_units(cfg, 8192 * 2 + 5)["chunk"] == 3
    assert O.step_ops(cfg, 1 << 15, Layout(cp=2))["components"]["kda"] == O.step_ops(cfg, 1 << 14)["components"]["kda"]
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
