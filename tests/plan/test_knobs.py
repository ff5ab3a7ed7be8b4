"""The planner's memory knobs (issue 36): AdamW moments in bf16, the checkpointed layers' inputs offloaded to host,
the optimizer offloaded; host memory and host-device traffic in the plan; their step-time cost; the knob search."""

from __future__ import annotations

import json

import pytest

from genoctx.model.config import preset
from genoctx.parallel.layout import Layout
from genoctx.plan import plan_memory
from genoctx.plan.hardware import HOST_KEYS, PROFILES, hardware_from_dict, load_hardware
from genoctx.plan.search import KNOB_COMBOS, plan_with_knobs, search_layouts
from genoctx.plan.time import add_time, host_seconds

GLM = preset("glm-5.3-flash")
L1M = 1 << 20
LAY32 = Layout(dp_replicate=1, ep=32, dp_shard=1, cp=32, ep_folded=True)
GIB = 2**30


def test_bf16_moments_halve_the_optimizer_state_and_nothing_else():
    base = plan_memory(GLM, L1M, LAY32, gpu_memory_gib=178)
    half = plan_memory(GLM, L1M, LAY32, gpu_memory_gib=178, optimizer_state_dtype="bf16")
    P = sum(base["params_per_rank"].values())
    assert base["persistent_gib"]["optimizer_state"] == pytest.approx(8 * P / GIB, abs=1e-5)
    assert half["persistent_gib"]["optimizer_state"] == pytest.approx(4 * P / GIB, abs=1e-5)
    assert half["components_gib"]["optimizer_state"] == pytest.approx(base["components_gib"]["optimizer_state"] / 2,
                                                                      abs=1e-5)  # fmt: skip
    for k in ("weights", "layer_inputs", "activations_kda", "kda_core_recompute"):
        assert half["components_gib"][k] == base["components_gib"][k], k
    assert half["knobs"] == ["optimizer_state_dtype=bf16"] and base["knobs"] == []
    assert half["optimizer_state_dtype"] == "bf16" and half["host_gib"] == 0.0


def test_offloaded_layer_inputs_move_to_the_host_and_one_stays_in_flight():
    base = plan_memory(GLM, L1M, LAY32, gpu_memory_gib=178)
    off = plan_memory(GLM, L1M, LAY32, gpu_memory_gib=178, offload_activations=True, host_memory_gib=238)
    n_layers = GLM.num_hidden_layers
    per_layer = base["components_gib"]["layer_inputs"] / 44  # at layer 44's backward: layers 0..43 kept (fp32)
    assert base["peak_phase"].startswith("backward layer 44")
    assert off["components_gib"]["layer_inputs"] == pytest.approx(per_layer, rel=1e-4)  # the copy in flight
    assert off["host_gib"] == pytest.approx(n_layers * per_layer, rel=1e-4)  # every layer's input, on the host
    moved = off["host_device_bytes"]
    assert moved["to_host"] == moved["to_device"] == pytest.approx(off["host_gib"] * GIB, rel=1e-6)
    assert off["host_fits"] is True and off["fits"] is False  # 220.8 GiB: the gradients peak in early layers now
    assert off["total_gib"] < base["total_gib"]
    with pytest.raises(ValueError, match="offload_activations needs recompute"):
        plan_memory(GLM, L1M, LAY32, gpu_memory_gib=178, offload_activations=True, recompute=False)
    with pytest.raises(ValueError, match="optimizer_state_dtype"):
        plan_memory(GLM, L1M, LAY32, gpu_memory_gib=178, optimizer_state_dtype="fp8")


def test_a_host_that_cannot_hold_the_offloaded_state_does_not_fit():
    kw = dict(gpu_memory_gib=178, optimizer_offload=True, offload_activations=True)
    p = plan_memory(GLM, L1M, LAY32, host_memory_gib=300, **kw)
    P = sum(p["params_per_rank"].values())
    # on a CPU nothing is pinned: masters + gradients (fp32) + both moments (fp32) + the layer inputs, exactly
    cpu = plan_memory(GLM, L1M, LAY32, host_memory_gib=300, device="cpu", **kw)
    assert cpu["host_gib"] * GIB == pytest.approx(16 * P + p["host_device_bytes"]["to_host"] - 4 * P, rel=1e-6)
    # on CUDA the pinned masters and gradients count at their power-of-two blocks (tests/plan/test_pinned.py):
    # 291.3 GiB (the fp32 layer inputs 90 GiB of it), more than a B200 node's 238 GiB per GPU
    assert p["host_gib"] > 238 > cpu["host_gib"]
    assert p["fits"] and p["host_fits"]
    assert plan_memory(GLM, L1M, LAY32, host_memory_gib=238, **kw)["host_fits"] is False
    small = plan_memory(GLM, L1M, LAY32, host_memory_gib=100, **kw)
    assert small["host_fits"] is False and small["fits"] is False and small["total_gib"] == p["total_gib"]
    assert plan_memory(GLM, L1M, LAY32, **kw)["host_fits"] is None  # not checked


def test_the_knob_search_fits_32_b200_and_64_h200():
    plans = search_layouts(GLM, L1M, 32, 178, knobs="auto", host_memory_gib=238)
    assert not any(p["fits"] and not p["knobs"] for p in plans)  # without a knob nothing fits 32 B200
    fitting = [p for p in plans if p["fits"]]
    assert fitting, "no layout of 32 B200 fits with the knobs"
    combos = [sorted(k for k, v in c.items()) for c in KNOB_COMBOS]
    for p in fitting:
        assert p["total_gib"] <= 178 and p["host_gib"] <= 238
        on = sorted({"offload_activations": "offload_activations", "optimizer_state_dtype=bf16":
                     "optimizer_state_dtype", "optimizer_offload": "optimizer_offload"}[k] for k in p["knobs"])
        assert on in combos and on  # none fits without a knob
    # 64 x H200 (139 GiB usable): the 64-GPU layout fits with the layer inputs offloaded (144.3 GiB without a knob:
    # the fp32 residual streams) and room to spare
    h200 = plan_with_knobs(GLM, L1M, Layout(dp_replicate=1, ep=32, dp_shard=1, cp=64, ep_folded=True),
                           gpu_memory_gib=139, host_memory_gib=238)  # fmt: skip
    assert h200["fits"] and h200["knobs"] == ["offload_activations"] and h200["total_gib"] < 139 - 15
    with pytest.raises(ValueError, match="knobs"):
        search_layouts(GLM, L1M, 32, 178, knobs="all")


def test_knob_time_copies_hide_behind_compute_and_the_cpu_optimizer_does_not():
    b200 = load_hardware("b200")
    p = plan_memory(GLM, L1M, LAY32, gpu_memory_gib=178, optimizer_offload=True, offload_activations=True)
    add_time([p], GLM, b200)
    t = p["time"]
    acts = p["host_device_bytes"]["activations"]  # the layer inputs' copies back are not prefetched: exposed
    assert acts == 90 * GIB and t["host_s"]["copies"] == pytest.approx(acts / (6.4e10 * 0.8), rel=1e-9)
    P = sum(p["params_per_rank"].values())
    assert t["host_s"]["cpu_optimizer"] == pytest.approx(28 * P / (9e10 * 0.7), rel=1e-9)
    slow = hardware_from_dict({**b200.to_dict(), "host_device_bytes_per_s": 1e8, "sources": {}})
    q = plan_memory(GLM, L1M, LAY32, gpu_memory_gib=178, offload_activations=True)
    base = plan_time_of(q, b200)
    add_time([q], GLM, slow)
    busy = base["compute_s"] + base["memory_bound_s"]
    fwd = busy * base["forward_share"]
    bw = 1e8 * 0.8
    moved = q["host_device_bytes"]
    want = max(0, moved["to_host"] / bw - fwd) + moved["to_device"] / bw  # (all the copies back are layer inputs)
    assert q["time"]["host_s"]["copies"] == pytest.approx(want, rel=1e-9)
    assert q["time"]["step_s"] == pytest.approx(base["step_s"] + want, rel=1e-9) and q["time"]["bound"] == "host"
    none = plan_memory(GLM, L1M, LAY32, gpu_memory_gib=178)
    add_time([none], GLM, b200)
    assert none["time"]["host_s"] == {"copies": 0.0, "cpu_optimizer": 0.0, "link_needed": 0.0}
    assert q["time"]["host_s"]["link_needed"] == pytest.approx(moved["to_host"] / fwd, rel=1e-9)
    assert host_seconds(q, base, slow)["copies"] == pytest.approx(want, rel=1e-9)


def plan_time_of(p: dict, hw) -> dict:
    from genoctx.plan.time import plan_time

    lay = Layout(**{k: v for k, v in p["layout"].items() if k != "world"})
    return plan_time(GLM, p["seq_len"], lay, hw, dtype=p["dtype"], recompute=p["recompute"])


def test_host_rates_are_optional_in_a_profile_and_cited_in_the_shipped_ones():
    for name in PROFILES:
        hw = load_hardware(name)
        assert all(getattr(hw, k) > 0 for k in HOST_KEYS) and len(hw.sources["host"]) > 40
    mine = hardware_from_dict(dict(name="t", dtype_flops={"bf16": 1e15, "fp32": 1e14}, hbm_bytes_per_s=1e12,
                                   memory_gib=80.0, gpus_per_node=4, intra_node_bytes_per_s=1e11,
                                   inter_node_bytes_per_s=1e10))  # fmt: skip
    assert all(getattr(mine, k) is None for k in HOST_KEYS)
    p = plan_memory(GLM, L1M, LAY32, gpu_memory_gib=178, optimizer_offload=True)
    add_time([p], GLM, mine)
    assert {k: v for k, v in p["time"]["host_s"].items() if k != "link_needed"} == {"copies": None,
                                                                                    "cpu_optimizer": None}


def run_cli(args):
    from typer.testing import CliRunner

    from genoctx.cli import app

    return CliRunner().invoke(app, list(map(str, args)))


def test_cli_knobs_auto_and_bad_knob_flags():
    args = ["plan", "--preset", "glm-5.3-flash", "--seq-len", "1M", "--gpus", "32", "--gpu-memory-gib", "178"]
    lay = ["--ep", "32", "--ep-folded", "--cp", "32"]
    r = run_cli([*args, *lay, "--knobs", "auto", "--format", "json"])
    assert r.exit_code == 0, r.output
    (p,) = json.loads(r.stdout)["layouts"]
    assert p["fits"] and p["knobs"] == ["optimizer_offload"] and p["time"]["host_s"]["cpu_optimizer"] > 0
    table = run_cli([*args, *lay, "--knobs", "auto"])
    assert table.exit_code == 0 and "offload-opt" in table.stdout and "host of #1: 201.3 GiB" in table.stdout
    for extra, needle in ((["--knobs", "all"], "--knobs"), (["--optimizer-state-dtype", "fp8"], "--optimizer-state"),
                          (["--offload-activations", "--no-recompute"], "--offload-activations"),
                          (["--knobs", "auto", "--seq-chunk", "64k"], "--knobs auto"),
                          (["--eval", "--knobs", "auto"], "--eval"), (["--host-memory-gib", "0"], "--host-memory")):
        r = run_cli([*args, *extra])
        assert r.exit_code == 2 and r.stdout == "" and needle in r.stderr, (extra, r.output)
        assert len(r.stderr.strip().splitlines()) == 1
