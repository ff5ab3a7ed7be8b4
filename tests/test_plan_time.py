"""The time model (genoctx.plan.time) and hardware profiles (genoctx.plan.hardware): arithmetic on stated inputs,
group placement against the mesh genoctx builds, profiles as data with sources and one-line errors."""

import math

import pytest
import torch.distributed as dist

from genoctx.errors import GenoctxError
from genoctx.model.config import preset
from genoctx.parallel.layout import Layout
from genoctx.plan.flops import step_flops
from genoctx.plan.hardware import EFFICIENCY, EFFICIENCY_REASONS, PROFILES, hardware_from_dict, load_hardware
from genoctx.plan.time import collective_seconds, compute_seconds, group_ranks, step_time, unit_dtype

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
    for hw in (b200, h100, h200):  # every peak a plan runs at, tensor cores above CUDA-core fp32, cited
        assert set(hw.dtype_flops) == {"bf16", "fp32", "tf32"} and "TF32" in hw.sources["dtype_flops"]
        assert hw.flops("fp32") < hw.flops("tf32") < hw.flops("bf16")
    assert (b200.flops("fp32"), b200.flops("tf32"), h200.flops("fp32"), h100.flops("tf32")) == (
        8.0e13, 1.1e15, 6.7e13, 4.945e14)  # fmt: skip
    assert h200.hbm_bytes_per_s > h100.hbm_bytes_per_s
    assert b200.intra_node_bytes_per_s == 2 * h100.intra_node_bytes_per_s
    assert set(EFFICIENCY_REASONS) == set(EFFICIENCY) and all(0 < v <= 1 for v in EFFICIENCY.values())


@pytest.mark.parametrize(
    "change,message",
    [
        ({"gpus_per_node": 0}, "gpus_per_node must be an integer >= 1"),
        ({"hbm_bytes_per_s": -1}, "hbm_bytes_per_s must be a positive number"),
        ({"dtype_flops": {"bf16": 1e15}}, "dtype_flops must map bf16 and fp32"),
        ({"dtype_flops": {"bf16": 1e15, "fp32": 1e14, "fp8": 2e15}}, "dtype_flops.fp8: unknown dtype"),
        ({"dtype_flops": {"bf16": 1e15, "fp32": 1e14, "tf32": 0}}, "dtype_flops.tf32 must be a positive number"),
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
        launch_bound = p["time"]["bound"] == "launch"  # (the host's op issue outlasts the device: skew hidden)
        assert (slower or launch_bound) if p["layout"]["ep"] > 1 else p["time"]["step_s"] >= by[json.dumps(p["layout"])]
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


def test_each_component_is_timed_at_the_rate_of_what_runs():
    """Component seconds = sum over its units of FLOPs / (peak(unit) x efficiency[class]), the peak being the one the
    code runs at (``genoctx.plan.flops``' table): the DSA indexer's fp32 top-k dots and KL at the fp32 peak, not
    bf16 (issue 43 item 10); the router's share of ``experts``, the mHC, the PyTorch KDA core and the CP state pass
    at fp32; GEMMs, the Triton sparse attention and fla's core at bf16, fla's decay scores at tf32. An fp32 run
    times ``run`` at fp32 and fla's dots at tf32 (Triton's default for fp32 operands)."""
    hw = hardware_from_dict({**NODE, "dtype_flops": {"bf16": 1e15, "fp32": 1e14, "tf32": 5e14},
                             "efficiency": {"matmul": 0.5, "attention": 0.25, "memory": 0.8}})  # fmt: skip
    eff = {"matmul": 0.5, "attention": 0.25, "memory": 0.8}
    peak = {"bf16": 1e15, "fp32": 1e14, "tf32": 5e14}
    for kernel, dtype in (("torch", "bf16"), ("fla", "bf16"), ("fla", "fp32")):
        cfg = preset("cpu-small", kda_kernel=kernel)
        fl = step_flops(cfg, 16384, Layout(cp=2))
        t = step_time(fl, [], cfg, Layout(cp=2), hw, dtype=dtype, seq_len=16384, batch_size=1,
                      model_flops_per_token=1.0)  # fmt: skip
        comps = fl["components"]
        for name, c in comps.items():
            want = sum(f / (peak[unit_dtype(u, dtype)] * eff[c["class"]]) for u, f in c["units"].items())
            assert t["compute_by_component_s"][name] == pytest.approx(want), (kernel, dtype, name)
        total = {k: c["forward"] + c["recompute"] + c["backward"] for k, c in comps.items()}
        fp32 = 1e14 * eff["attention"]
        assert t["compute_by_component_s"]["dsa_indexer"] == pytest.approx(total["dsa_indexer"] / fp32)
        assert t["compute_s"] == pytest.approx(sum(t["compute_by_dtype_s"].values()))
        if dtype == "bf16":
            assert t["compute_by_component_s"]["dense_mlp"] == pytest.approx(total["dense_mlp"] / (1e15 * 0.5))
            assert t["compute_by_component_s"]["dsa_attention"] == pytest.approx(total["dsa_attention"] / 2.5e14)
            router = comps["experts"]["units"]["fp32"]
            assert 0 < router < 0.05 * total["experts"] and t["compute_by_component_s"]["experts"] == pytest.approx(
                router / (1e14 * 0.5) + (total["experts"] - router) / (1e15 * 0.5))  # fmt: skip
        if kernel == "torch":
            assert t["compute_by_component_s"]["kda_core"] == pytest.approx(total["kda_core"] / fp32)
        else:  # the CP state pass in fp32, fla's decay scores in tf32, the rest in bf16 (tf32 in an fp32 run)
            u = comps["kda_core"]["units"]
            rest = 1e15 if dtype == "bf16" else 5e14
            assert t["compute_by_component_s"]["kda_core"] == pytest.approx(
                u["fp32"] / fp32 + u["tf32"] / (5e14 * 0.25) + u["run_tf32"] / (rest * 0.25))  # fmt: skip
            assert set(t["compute_by_dtype_s"]) == ({"bf16", "fp32", "tf32"} if dtype == "bf16" else {"fp32", "tf32"})
    # the published run's indexer on B200: the fp32 peak, 28x the seconds the bf16 rate gave
    b200 = load_hardware("b200")
    big = preset("glm-5.3-flash")
    idx = step_flops(big, 1 << 20, Layout(cp=64, ep=32, ep_folded=True))["components"]["dsa_indexer"]
    f = idx["forward"] + idx["recompute"] + idx["backward"]
    assert idx["units"] == {"fp32": pytest.approx(f)}
    secs = compute_seconds({"components": {"dsa_indexer": idx}}, big, b200, "bf16")["dsa_indexer"]
    assert secs == pytest.approx(f / (8.0e13 * 0.15)) and secs * 8.0e13 / 2.25e15 == pytest.approx(f / (2.25e15 * 0.15))


def test_a_profile_without_the_tf32_peak_is_one_line_when_a_plan_needs_it(tmp_path):
    """``tf32`` is optional in a user's profile: plans that run nothing at it work, one that does (fla's core) says
    which key is missing, in one line (exit 2 from the CLI)."""
    hw = hardware_from_dict(NODE, where="mine.yaml")
    tiny, fla = preset("tiny"), preset("tiny", kda_kernel="fla")
    assert compute_seconds(step_flops(tiny, 256), tiny, hw, "bf16")["kda_core"] > 0
    with pytest.raises(GenoctxError, match="dtype_flops has no tf32") as e:
        compute_seconds(step_flops(fla, 256), fla, hw, "bf16")
    assert "\n" not in str(e.value)
    p, recipe = tmp_path / "mine.yaml", tmp_path / "fla.yaml"
    p.write_text("name: mine\ndtype_flops: {bf16: 1.0e+15, fp32: 1.0e+14}\nhbm_bytes_per_s: 1.0e+12\nmemory_gib: 80\n"
                 "gpus_per_node: 4\nintra_node_bytes_per_s: 1.0e+11\ninter_node_bytes_per_s: 1.0e+10\n")  # fmt: skip
    recipe.write_text("model:\n  preset: tiny\n  kda_kernel: fla\n")
    from typer.testing import CliRunner

    from genoctx.cli import app

    r = CliRunner().invoke(app, ["plan", "--recipe", str(recipe), "--seq-len", "1k", "--gpus", "1",
                                 "--hardware", str(p)])  # fmt: skip
    assert r.exit_code == 2 and "dtype_flops has no tf32" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_genoctx_never_enables_tf32():
    """The planner times fp32 GEMMs at the CUDA-core fp32 peak because nothing in genoctx turns TF32 on (PyTorch's
    default for matmuls is off; genoctx's Triton kernels pass ``input_precision="ieee"`` for fp32 operands). A line
    that enables it must come with a change to ``genoctx.plan.flops``' units."""
    import pathlib

    import genoctx

    root = pathlib.Path(genoctx.__file__).parent.parent
    files = [*(root / "genoctx").rglob("*.py"), *(root / "kernels").rglob("*.py")]
    assert len(files) > 40
    for f in files:
        text = f.read_text()
        for needle in ("allow_tf32", "set_float32_matmul_precision", "fp32_precision", '"tf32"', "'tf32'"):
            if needle in text and f.parts[-3:-1] != ("genoctx", "plan") and f.name != "hardware.py":
                raise AssertionError(f"{f}: {needle}")
