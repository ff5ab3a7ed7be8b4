"""The time model (genoctx.plan.time) and hardware profiles (genoctx.plan.hardware): arithmetic on stated inputs,
group placement against the mesh genoctx builds, profiles as data with sources and one-line errors."""

import math

import pytest
import torch.distributed as dist

from genoctx.errors import GenoctxError
from genoctx.model.config import preset
from genoctx.parallel.layout import Layout
from genoctx.plan.hardware import EFFICIENCY, EFFICIENCY_REASONS, PROFILES, hardware_from_dict, load_hardware
from genoctx.plan.time import collective_seconds, group_ranks, step_time

NODE = dict(name="t", dtype_flops={"bf16": 1e15, "fp32": 1e14}, hbm_bytes_per_s=1e12, memory_gib=80.0,
            gpus_per_node=4, intra_node_bytes_per_s=1e11, inter_node_bytes_per_s=1e10)  # fmt: skip


def test_shipped_profiles_load_and_cite_every_number():
    for name in PROFILES:
        hw = load_hardware(name)
        assert hw.efficiency == EFFICIENCY
        for key in ("dtype_flops", "hbm_bytes_per_s", "memory_gib", "intra_node_bytes_per_s",
                    "inter_node_bytes_per_s"):  # fmt: skip
            assert len(hw.sources.get(key, "")) > 20, (name, key)
    b200, h100, h200 = load_hardware("B200"), load_hardware("h100"), load_hardware("h200")
    assert b200.flops("bf16") == 2.25e15 and h100.flops("bf16") == h200.flops("bf16") == 9.89e14
    assert h200.hbm_bytes_per_s > h100.hbm_bytes_per_s
    assert b200.intra_node_bytes_per_s == 2 * h100.intra_node_bytes_per_s
    assert set(EFFICIENCY_REASONS) == set(EFFICIENCY) and all(0 < v <= 1 for v in EFFICIENCY.values())


@pytest.mark.parametrize(
    "change,message",
    [
        ({"gpus_per_node": 0}, "gpus_per_node must be an integer >= 1"),
        ({"hbm_bytes_per_s": -1}, "hbm_bytes_per_s must be a positive number"),
        ({"dtype_flops": {"bf16": 1e15}}, "dtype_flops must map bf16 and fp32"),
        ({"efficiency": {"matmul": 1.5}}, "efficiency.matmul must be in (0, 1]"),
        ({"efficiency": {"tensor": 0.5}}, "efficiency.tensor: unknown class"),
        ({"nvlink": 1}, "unknown key 'nvlink'"),
    ],
)
def test_a_bad_profile_is_one_line_naming_the_key(change, message):
    with pytest.raises(GenoctxError, match=None) as e:
        hardware_from_dict({**NODE, **change}, where="my.yaml")
    assert str(e.value).startswith("my.yaml: ") and message in str(e.value) and "\n" not in str(e.value)


def test_a_users_yaml_profile_with_overrides(tmp_path):
    p = tmp_path / "cpu.yaml"
    p.write_text("name: cpu\ndtype_flops: {bf16: 1e11, fp32: 5.0e+10}\nhbm_bytes_per_s: 2.0e+10\nmemory_gib: 16\n"
                 "gpus_per_node: 4\nintra_node_bytes_per_s: 1.0e+9\ninter_node_bytes_per_s: 1.0e+8\n"
                 "efficiency: {matmul: 1.0}\n")  # fmt: skip
    hw = load_hardware(p)
    assert hw.flops("bf16") == 1e11 and hw.efficiency["matmul"] == 1.0 and hw.efficiency["memory"] == 0.7
    with pytest.raises(GenoctxError, match="--hardware nope: neither a profile"):
        load_hardware("nope")
    (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
    with pytest.raises(GenoctxError, match="bad.yaml: not a readable YAML hardware profile"):
        load_hardware(tmp_path / "bad.yaml")


@pytest.mark.parametrize("dp_shard,cp,ep,folded",
                         [(2, 4, 2, False), (2, 2, 2, False), (4, 4, 8, True), (1, 8, 4, True)])  # fmt: skip
def test_group_ranks_are_the_mesh_genoctx_builds(dp_shard, cp, ep, folded):
    """Rank 0's groups on the fake backend (genoctx.parallel.mesh.init_parallel) are the ranks the time model
    places on nodes: CP, EP (folded: consecutive ranks), the dense FSDP mesh, the data-parallel replicas."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from genoctx.parallel.mesh import init_parallel

    layout = Layout(dp_replicate=2, ep=ep, dp_shard=dp_shard, cp=cp, ep_folded=folded)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=layout.world)
    try:
        dims = init_parallel(cp, ep=ep, dp_shard=dp_shard, ep_folded=folded)  # (dp_replicate: the rest, 2)
        assert sorted(dist.get_process_group_ranks(dims.cp_group)) == group_ranks(("cp",), layout)
        assert sorted(dist.get_process_group_ranks(dims.ep_group)) == group_ranks(("ep",), layout)
        shard = dims.dense_mesh.mesh[0].flatten().tolist()  # (dp_replicate, ep x dp_shard x cp): rank 0's shard row
        assert sorted(shard) == group_ranks(("ep", "dp_shard", "cp"), layout)
        replicas = dims.dense_mesh.mesh[:, 0].flatten().tolist()
        assert sorted(replicas) == group_ranks(("dp_replicate",), layout)
        if folded:  # the ranks sharding rank 0's block of experts
            assert sorted(dims.expert_mesh.mesh[0].flatten().tolist()) == group_ranks(("efsdp",), layout)
    finally:
        dist.destroy_process_group()


def test_collective_seconds_uses_nvlink_inside_a_node_and_the_nic_across():
    hw = hardware_from_dict(NODE)
    lay = Layout(dp_shard=2, cp=4)  # 8 ranks, 4 per node
    eff, lat = hw.efficiency["collective"], hw.collective_latency_s
    inside = {"name": "cp_dsa_latents", "collective": "all_gather", "dims": ("cp",), "group_size": 4, "calls": 3,
              "wire_bytes": 6e9}  # fmt: skip
    t, link = collective_seconds(inside, lay, hw)
    assert link == "intra-node" and t == pytest.approx(6e9 / (1e11 * eff) + 3 * lat)
    across = {**inside, "dims": ("dp_shard", "cp"), "group_size": 8}
    t, link = collective_seconds(across, lay, hw)
    assert link == "inter-node" and t == pytest.approx(6e9 / (1e10 * eff) + 3 * lat)
    a2a = {**across, "collective": "all_to_all"}  # 3 of 7 peers in the node, 4 in the other
    t, _ = collective_seconds(a2a, lay, hw)
    assert t == pytest.approx(max(6e9 * 3 / 7 / 1e11, 6e9 * 4 / 7 / 1e10) / eff + 3 * lat)
    assert collective_seconds({**inside, "group_size": 1}, lay, hw) == (0.0, "intra-node")


def _flops(matmul: float, attention: float, tokens: int = 1000, recompute: float = 0.0) -> dict:
    comps = {"dense_mlp": {"forward": matmul / 3, "recompute": recompute, "backward": 2 * matmul / 3 - recompute,
                           "class": "matmul"},
             "dsa_attention": {"forward": attention / 3, "recompute": 0.0, "backward": 2 * attention / 3,
                               "class": "attention"}}  # fmt: skip
    fwd = sum(c["forward"] for c in comps.values())
    rec = sum(c["recompute"] for c in comps.values())
    return {"components": comps, "forward": fwd, "recompute": rec, "backward": matmul + attention - fwd - rec,
            "total": matmul + attention, "tokens": tokens}  # fmt: skip


def test_step_time_hides_fsdp_behind_compute_and_exposes_the_rest():
    cfg = preset("tiny")
    hw = hardware_from_dict({**NODE, "efficiency": {"matmul": 0.5, "attention": 0.25}})
    lay = Layout(dp_shard=4)
    fl = _flops(matmul=1e15, attention=1e14)
    compute = 1e15 / (1e15 * 0.5) + 1e14 / (1e15 * 0.25)  # 2.4 s
    gather = {"name": "fsdp_all_gather_forward", "collective": "all_gather", "dims": ("dp_shard",), "group_size": 4,
              "calls": 1, "wire_bytes": 7e9}  # 0.1 s on NVLink at 0.7: hidden, but for one unit's share  # fmt: skip
    a2a = {"name": "ep_dispatch_forward", "collective": "all_to_all", "dims": ("dp_shard",), "group_size": 4,
           "calls": 1, "wire_bytes": 7e10}  # 1 s, exposed  # fmt: skip
    kw = dict(dtype="bf16", seq_len=1000, batch_size=1, model_flops_per_token=1e9)
    out = step_time(fl, [gather, a2a], cfg, lay, hw, **kw)
    units = cfg.num_hidden_layers + 1
    assert out["compute_s"] == pytest.approx(compute)
    t_gather, t_a2a = 0.1 + hw.collective_latency_s, 1.0 + hw.collective_latency_s
    assert out["exposed_comm_s"]["intra-node"] == pytest.approx(t_a2a + t_gather / units)
    assert out["step_s"] == pytest.approx(compute + out["memory_bound_s"] + t_a2a + t_gather / units)
    assert out["bound"] == "compute"
    assert out["tokens_per_s"] == pytest.approx(1000 * 4 / out["step_s"])
    assert out["mfu"] == pytest.approx(1e9 * 4000 / (4 * 1e15 * out["step_s"]))
    # an FSDP gather longer than the whole step's compute: what it exceeds by is exposed too
    big = {**gather, "wire_bytes": 7e11}  # 10 s
    out = step_time(fl, [big], cfg, lay, hw, **kw)
    t_big = 10.0 + hw.collective_latency_s
    busy = compute + out["memory_bound_s"]
    assert out["exposed_comm_s"]["intra-node"] == pytest.approx(t_big - busy + t_big / units)
    assert out["bound"] == "intra-node" and out["step_s"] == pytest.approx(t_big + t_big / units)


def test_memory_bound_time_counts_each_pass():
    cfg = preset("tiny")
    hw = hardware_from_dict(NODE)
    kw = dict(dtype="bf16", seq_len=1000, batch_size=1, model_flops_per_token=1e9)
    plain = step_time(_flops(1e12, 0.0), [], cfg, Layout(), hw, **kw)
    recomputed = step_time(_flops(1e12, 0.0, recompute=1e12 / 3), [], cfg, Layout(), hw, **kw)  # every forward again
    assert recomputed["hbm_bytes"] / plain["hbm_bytes"] == pytest.approx(8 / 6)  # 2 fwd + 2 recompute + 4 bwd
    assert plain["memory_bound_s"] == pytest.approx(plain["hbm_bytes"] / (1e12 * 0.7))
    assert math.isfinite(plain["step_s"]) and plain["exposed_comm_s"] == {"intra-node": 0.0, "inter-node": 0.0}


def _plan(*args):
    from typer.testing import CliRunner

    from genoctx.cli import app

    base = ["plan", "--preset", "cpu-small", "--seq-len", "16k", "--gpus", "4"]
    return CliRunner().invoke(app, [*base, *map(str, args)])


def test_cli_plan_times_each_layout_and_ranks_by_throughput(tmp_path):
    import json

    mem = json.loads(_plan("--format", "json", "--gpu-memory-gib", "8").stdout)
    thr = json.loads(_plan("--format", "json", "--gpu-memory-gib", "8", "--rank-by", "throughput").stdout)
    assert mem["hardware"] == "B200" and mem["skew"] == 1.0 and thr["rank_by"] == "throughput"
    assert sorted(map(json.dumps, mem["layouts"])) == sorted(map(json.dumps, thr["layouts"]))  # the same plans
    speeds = [p["time"]["tokens_per_s"] for p in thr["layouts"]]
    assert speeds == sorted(speeds, reverse=True) and len(set(speeds)) > 1
    assert [p["total_gib"] for p in mem["layouts"]] == sorted(p["total_gib"] for p in mem["layouts"])
    skewed = json.loads(_plan("--format", "json", "--gpu-memory-gib", "8", "--skew", "published").stdout)
    assert skewed["skew"] == 4.0
    by = {json.dumps(p["layout"]): p["time"]["step_s"] for p in mem["layouts"]}
    for p in skewed["layouts"]:  # a skew slows a layout with EP (the busiest rank's experts), never speeds one up
        slower = p["time"]["step_s"] > by[json.dumps(p["layout"])]
        assert slower if p["layout"]["ep"] > 1 else p["time"]["step_s"] >= by[json.dumps(p["layout"])]
    table = _plan("--gpu-memory-gib", "8", "--hardware", "h100")
    assert table.exit_code == 0 and "tokens/s" in table.stdout and "time model on H100" in table.stdout
    # the profile's memory when --gpu-memory-gib is not given
    assert json.loads(_plan("--format", "json", "--hardware", "h200").stdout)["gpu_memory_gib"] == 139.0


@pytest.mark.parametrize(
    "args,message",
    [
        (["--hardware", "tpu"], "--hardware tpu: neither a profile"),
        (["--skew", "0.5"], "--skew: a number >= 1"),
        (["--skew", "lots"], "--skew: a number >= 1"),
        (["--rank-by", "speed"], "--rank-by must be memory or throughput"),
    ],
)
def test_cli_plan_bad_speed_flags_are_one_line_exit_2(args, message):
    r = _plan(*args)
    assert r.exit_code == 2 and r.stdout == "" and message in r.stderr and len(r.stderr.strip().splitlines()) == 1
