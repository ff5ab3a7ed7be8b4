"""The dry run (genoctx.train.dryrun): the real construction and parallelism code on torch's fake process group,
meta device. Its counts are the ground truth the planner's static terms (genoctx.plan) must equal; the CLI's
`plan --dry-run` and `train --dry-run`. Each simulated rank is a fresh process (seconds each)."""

import json
import math
from pathlib import Path

import pytest
import torch
from cli_runner import run_genoctx  # tests/cli_runner.py: tests/ is on sys.path (its conftest.py)

from genoctx import plan as P
from genoctx.model.config import preset
from genoctx.model.model import HybridLM
from genoctx.parallel.layout import Layout
from genoctx.recipes import load_recipe
from genoctx.train.dryrun import dry_run, name_class, reuse_server

REPO = Path(__file__).resolve().parents[1]
SMALL = preset("cpu-small")  # KDA, DSA, dense MLP and MoE layers; 1.2M parameters
GIB = 2**30


@pytest.fixture(scope="module", autouse=True)
def _one_rank_server():
    """The module's ``dry_run`` calls ask one rank server (``reuse_server``): its imports paid once, each rank still a
    fresh fork of it."""
    with reuse_server():
        yield


def genoctx(*args):
    return run_genoctx(*args, cwd=REPO, timeout=600)


def _shapes(cfg):
    with torch.device("meta"):
        model = HybridLM(cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _one_row_per_parameter(cfg, layout) -> float:
    """The most a rank's local parameters can differ from the mean ``P / shards``: FSDP2 shards dim 0 with
    ``torch.chunk`` sizes, so a rank holds at most one row more (or, at the end, fewer) of each parameter."""
    if not layout.fsdp:
        return 0.0
    return float(sum(math.prod(s[1:]) for s in _shapes(cfg).values() if s))


SMALL6 = preset("cpu-small", n_routed_experts=6, n_group=1, topk_group=1)  # folded EP 2 over 4: 3 experts on 2


@pytest.mark.parametrize(
    "cfg,layout",
    [(SMALL, Layout(dp_shard=4)), (SMALL, Layout(ep=2, dp_shard=2)), (SMALL, Layout(dp_replicate=2, cp=2)),
     (SMALL, Layout(dp_replicate=2, dp_shard=2)), (SMALL, Layout(ep=2, dp_shard=2, cp=2, ep_folded=True)),
     (SMALL6, Layout(ep=2, dp_shard=4, ep_folded=True))],
    ids=["fsdp4", "ep2-fsdp2", "hsdp-cp2", "hsdp-fsdp2", "fep2-fsdp2-cp2", "fep2-fsdp4-shard1"],
)  # fmt: skip
def test_planner_static_terms_equal_the_built_model(cfg, layout):
    d = dry_run(cfg, layout, ranks="all")
    plan = P.plan_memory(cfg, 1 << 14, layout, gpu_memory_gib=80.0)
    allocated = plan["params_per_rank"]["dense"] + plan["params_per_rank"]["expert"]  # padded shards, exact
    ranks = d["ranks"]
    assert [r["rank"] for r in ranks] == list(range(layout.world))
    # the unpadded shards partition the model
    counts = P.param_counts(cfg)
    replicas = layout.world // layout.dense_shard
    experts = counts["expert"] * (layout.world // (layout.ep * layout.expert_shard))
    assert sum(r["params_local"] for r in ranks) == replicas * counts["dense"] + experts
    pad = _one_row_per_parameter(cfg, layout)
    for r in ranks:
        # what the planner counts is what FSDP2 allocates on every rank (every shard padded to rank 0's size)
        assert r["weights"] == 4 * allocated and r["gradients"] == r["weights"]
        assert allocated - pad <= r["params_local"] <= allocated
        assert r["optimizer_state"] == 8 * r["params_local"]  # exp_avg + exp_avg_sq of the unpadded piece
        assert r["weights"] / GIB == pytest.approx(plan["persistent_gib"]["weights"], abs=1e-6)
    r0 = ranks[0]  # rank 0 holds the first, largest torch.chunk piece of every parameter: the planner's rank
    assert r0["params_local"] == allocated and r0["optimizer_state"] / GIB == pytest.approx(
        plan["persistent_gib"]["optimizer_state"], abs=1e-6)  # fmt: skip
    for r in ranks:
        assert sum(r["by_class"]["weights"].values()) == r["weights"]
        assert r["by_class"]["weights"]["moe_experts"] > 0 and r["by_class"]["weights"]["kda"] > 0
        # the planner's unsharded term of the largest layer (bf16, fp32 islands): what FSDP2 all-gathers
        assert plan["largest_layer_unsharded_gib"] == pytest.approx(r["largest_unsharded_layer"]["bytes"] / GIB,
                                                                    abs=1e-6)  # fmt: skip
        assert 0 < r["largest_unsharded_group"]["bytes"] <= r["largest_unsharded_layer"]["bytes"]
    # every rank of a layout has the same groups: the largest all-gather is the same everywhere
    assert len({r["largest_unsharded_group"]["bytes"] for r in ranks}) == 1


def test_bf16_moments_count_two_bytes_each():
    """``optimizer_state_dtype="bf16"`` (``train.optimizer_state_dtype``): the built optimizer's zero moments are bf16,
    2 x 2 bytes per local parameter (fp32: 2 x 4), the rest unchanged; rank 0 equals the planner's term."""
    layout = Layout(dp_shard=2)
    r32, r16 = (dry_run(SMALL, layout, ranks=[0], optimizer_state_dtype=s) for s in ("fp32", "bf16"))
    assert (r32["optimizer_state_dtype"], r16["optimizer_state_dtype"]) == ("fp32", "bf16")
    r32, r16 = r32["ranks"][0], r16["ranks"][0]
    assert r32["optimizer_state"] == 8 * r32["params_local"] and r16["optimizer_state"] == 4 * r16["params_local"]
    assert all(r16[k] == r32[k] for k in ("weights", "gradients", "buffers", "params_local"))
    plan = P.plan_memory(SMALL, 1 << 14, layout, gpu_memory_gib=80.0, optimizer_state_dtype="bf16")
    assert r16["optimizer_state"] / GIB == pytest.approx(plan["persistent_gib"]["optimizer_state"], abs=1e-6)


def test_replicated_layout_holds_everything_but_the_other_experts():
    d = dry_run(SMALL, Layout(dp_replicate=2, ep=2), ranks=[0])
    pc = P.param_counts(SMALL)
    r = d["ranks"][0]
    assert r["params_local"] == pc["dense"] + pc["expert"] // 2
    assert r["largest_unsharded_group"]["bytes"] == 0 and r["fsdp_groups"] == 0


def test_name_classes():
    classes = {n: name_class(n, SMALL) for n in _shapes(SMALL)}
    assert classes["embed_tokens.weight"] == "embedding/head" and classes["norm.weight"] == "norms"
    assert classes["layers.0.self_attn.q_proj.weight"] == "kda"
    assert classes["layers.3.self_attn.kv_b_proj.weight"] == "dsa"
    assert classes["layers.0.mlp.up_proj.weight"] == "dense_mlp"
    assert classes["layers.1.mlp.experts.down_proj"] == "moe_experts"
    assert classes["layers.1.mlp.gate.weight"] == "moe_other"
    assert classes["layers.1.attn_hc.fn"] == "mhc"
    assert "other" not in classes.values()


def _rank_rows(d0: int, shards: int, rank: int) -> int:
    chunk = -(-d0 // shards)  # torch.chunk
    return max(0, min(chunk, d0 - rank * chunk))


def test_cli_plan_dry_run_at_the_real_size():
    glm = preset("glm-5.3-flash")
    r = genoctx("plan", "--dry-run", "--preset", "glm-5.3-flash", "--seq-len", "1M", "--gpus", 64, "--cp", 64,
                "--format", "json")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["layouts"][0]["layout"]["cp"] == 64 and doc["dry_run"]["layout"]["cp"] == 64
    r0, last = doc["dry_run"]["ranks"]
    assert (r0["rank"], last["rank"]) == (0, 63)
    mean = 4 * P.param_counts(glm)["total"] / 64
    pad = 4 * _one_row_per_parameter(glm, Layout(cp=64))
    assert mean <= r0["weights"] <= mean + pad  # ~20 GiB: one parameter in 64, padded to rank 0's chunks
    assert last["weights"] == r0["weights"]  # FSDP2 allocates the padded size on every rank
    assert r0["weights"] / GIB == pytest.approx(doc["layouts"][0]["persistent_gib"]["weights"], abs=1e-6)
    shapes = _shapes(glm).values()
    for rank, got in ((0, r0), (63, last)):  # exactly torch.chunk's rows of every parameter
        assert got["params_local"] == sum(_rank_rows(s[0], 64, rank) * math.prod(s[1:]) for s in shapes)
    assert doc["layouts"][0]["largest_layer_unsharded_gib"] == pytest.approx(
        r0["largest_unsharded_layer"]["bytes"] / GIB, abs=1e-6)  # fmt: skip


def test_cli_plan_dry_run_bad_layout_is_one_line():
    r = genoctx("plan", "--dry-run", "--preset", "tiny", "--seq-len", "4k", "--gpus", 4, "--ep", 3)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "--ep 3" in r.stderr


def test_cli_train_dry_run(prepared, tmp_path):
    out = tmp_path / "run"
    args = ("train", "--dry-run", "--data", prepared, "--recipe", "recipes/tiny.yaml", "--out", out)
    r = genoctx(*args, "--num-workers", 4, "--fsdp", 2, "--ep", 2)
    assert r.returncode == 0, r.stderr[-2000:]
    dr = json.loads(r.stdout)["dry_run"]
    assert dr["layout"] == {"dp_replicate": 1, "ep": 2, "dp_shard": 2, "cp": 1, "ep_folded": False, "world": 4}
    assert [x["rank"] for x in dr["ranks"]] == [0, 3] and all(x["weights"] > 0 for x in dr["ranks"])
    assert not out.exists()
    # the planner's step time on the --hardware profile (default B200) and the GPU-hours of the recipe's steps
    t, steps = dr["time"], load_recipe("recipes/tiny.yaml").train.steps
    assert t["hardware"] == "B200" and t["steps"] == steps and t["step_s"] > 0
    assert t["gpu_hours"] == pytest.approx(t["step_s"] * steps * 4 / 3600)
    assert f"{steps} steps = " in r.stderr and "GPU-hours on 4 GPUs" in r.stderr
    # bf16 moments (no cost the time model sees) on an H100: the same layout's step, on a slower GPU
    bf16 = genoctx(*args, "--num-workers", 4, "--fsdp", 2, "--ep", 2, "--hardware", "h100",
                   "--set", "train.optimizer_state_dtype=bf16", "--set", "train.trainable=kda,dsa")  # fmt: skip
    assert bf16.returncode == 0, bf16.stderr[-2000:]
    dr16 = json.loads(bf16.stdout)["dry_run"]
    # (tiny's step is launch-bound on both GPUs: the device's part tells the slower GPU)
    assert dr16["time"]["hardware"] == "H100" and dr16["time"]["device_s"] > t["device_s"]
    assert dr16["optimizer_state_dtype"] == "bf16"
    got = dr16["trainable"]  # what train.trainable trains (issue 44), said on stderr too
    assert got["trainable_parameters"] == got["groups"]["kda"] + got["groups"]["dsa"] < got["parameters"]
    assert f"trainable: kda,dsa ({got['trainable_parameters'] / 1e3:.1f}K of " in bf16.stderr
    assert json.loads(r.stdout)["dry_run"]["trainable"]["trainable"] == "all"
    assert all(x["optimizer_state"] == 4 * x["params_local"] > 0 for x in dr16["ranks"])
    bad = genoctx(*args, "--num-workers", 4, "--fsdp", 3)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--fsdp 3" in bad.stderr
    assert not out.exists()


TRAINABLE_CASES = [
    ("lora", 4, "fp8", Layout(ep=2, dp_shard=2)),
    ("kda,dsa,indexer,router,mhc,norms", 0, "fp8", Layout(dp_shard=4)),
    ("lora,embed,norms", 4, "bf16", Layout(ep=2, dp_shard=2, cp=2, ep_folded=True)),
    ("lora", 16, "fp8", Layout(dp_replicate=2, ep=2)),
]


@pytest.mark.parametrize("spec,r,frozen,layout", TRAINABLE_CASES, ids=["lora-ep2", "groups-fsdp4", "longlora-fep2",
                                                                        "lora16-hsdp"])  # fmt: skip
def test_trainable_dry_run_equals_the_plan(spec, r, frozen, layout):
    """``train.trainable`` (issue 44): the dry run's frozen bytes (fp8 weights + fp32 scale blocks, or bf16), the
    trainable masters (LoRA adapters placed as their targets: experts' over EP, dense ones FSDP dim 0), gradients and
    AdamW moments per rank equal the plan's, every rank; rank 0's trainable elements exactly."""
    d = dry_run(SMALL, layout, ranks="all", trainable=spec, lora_rank=r, frozen_dtype=frozen)
    plan = P.plan_memory(SMALL, 1 << 14, layout, gpu_memory_gib=80.0, trainable=spec, lora_rank=r,
                         frozen_dtype=frozen)  # fmt: skip
    per = plan["persistent_gib"]
    assert d["trainable"]["trainable"] == spec and d["trainable"]["frozen_dtype"] == frozen
    for x in d["ranks"]:
        for key in ("frozen", "weights", "gradients", "optimizer_state"):
            assert x[key] / GIB == pytest.approx(per[key], abs=1e-6), (x["rank"], key)
        assert x["weights"] == x["frozen"] + x["gradients"]  # fp32 masters and gradients of what trains only
        assert 0 < x["frozen"] and 0 < x["gradients"] < x["weights"]
    r0 = d["ranks"][0]
    assert r0["trainable_params_local"] == plan["trainable_params_per_rank"]
    if r:  # the adapters alone (LoRA) or beside groups: their share counted apart
        assert r0["adapters"]["adapter_params_local"] > 0
    full = dry_run(SMALL, layout, ranks=[0])["ranks"][0]  # everything trains: more of everything but frozen
    assert r0["gradients"] < full["gradients"] and r0["optimizer_state"] < full["optimizer_state"]
    assert r0["params_local"] >= full["params_local"]  # the frozen base is all still held (plus the adapters)


def test_dry_run_holds_fp8_frozen_whole_per_rank_under_fsdp_and_cp():
    """``train.frozen_dtype: fp8`` on a mesh with ``dp_shard`` and ``cp`` > 1 and folded EP (issue 44): the dry run
    builds the ``FP8Weight`` holders as training does, and every rank holds each dense matmul weight whole and its
    ``E / ep`` experts (never cut by FSDP2 or the expert shard) in fp8 plus 128 x 128 fp32 scale blocks, beside
    the bf16 frozen rest at FSDP2's padded shard; none of it is in an FSDP group (nothing all-gathered), and it all
    equals the plan's. Counted here from the one-device model's shapes."""
    from genoctx.model.fp8 import is_matmul_weight

    layout = Layout(ep=2, dp_shard=2, cp=2, ep_folded=True)  # 4 ranks: EP 2 folded in dp_shard x cp
    d = dry_run(SMALL, layout, ranks=[0, 3], trainable="lora", lora_rank=4, frozen_dtype="fp8")
    plan = P.plan_memory(SMALL, 1 << 14, layout, gpu_memory_gib=80.0, trainable="lora", lora_rank=4,
                         frozen_dtype="fp8")  # fmt: skip
    with torch.device("meta"):
        model = HybridLM(SMALL)
    mods = dict(model.named_modules())
    fp8 = bf16 = dense = 0
    for name, p in model.named_parameters():
        if is_matmul_weight(name, mods[name.rpartition(".")[0]]):
            lead = p.shape[0] // layout.ep if p.dim() == 3 else 1
            fp8 += lead * (p.shape[-2] * p.shape[-1] + 4 * math.ceil(p.shape[-2] / 128) * math.ceil(p.shape[-1] / 128))
            dense += p.numel() if p.dim() == 2 else 0
        else:  # frozen bf16, FSDP2's padded dim-0 shard over dp_shard x cp (4); experts' over the expert shard (2)
            shards = 2 if ".mlp.experts." in name else 4
            rows = p.shape[0] if p.dim() else 1
            per = p.shape[0] // layout.ep if ".mlp.experts." in name else rows
            bf16 += 2 * -(-per // shards) * (p.numel() // max(1, rows))
    assert fp8 > dense > 0
    for x in d["ranks"]:
        assert x["frozen"] == fp8 + bf16, x["rank"]
        assert x["frozen"] / GIB == pytest.approx(plan["persistent_gib"]["frozen"], abs=1e-6)
        assert x["largest_unsharded_layer"]["bytes"] < dense  # an FSDP group holds no fp8 matmul weight


def test_cli_plan_dry_run_one_node_lora_fp8_at_the_real_size():
    """The published run on one node (issue 44): GLM-5.3-Flash, 512k tokens on 8 H100s, LoRA on a frozen fp8 base,
    the plan's fitting layout (folded EP 8 over CP 8, optimizer offload) dry-run at 8 ranks: each static term of rank 0
    and rank 7 equals the plan's (~42.8 GiB of frozen fp8 weights and scales: every dense matrix whole, 36 of the 288
    experts per layer; ~1.3 GiB of adapter masters)."""
    r = genoctx("plan", "--dry-run", "--preset", "glm-5.3-flash", "--seq-len", "512k", "--gpus", 8, "--hardware",
                "h100", "--trainable", "lora", "--frozen-dtype", "fp8", "--ep", 8, "--ep-folded", "--cp", 8,
                "--offload-optimizer", "--offload-activations", "--seq-chunk", "16k", "--format", "json")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    per, dr = doc["layouts"][0]["persistent_gib"], doc["dry_run"]
    assert doc["layouts"][0]["fits"] and [x["rank"] for x in dr["ranks"]] == [0, 7]
    for x in dr["ranks"]:
        for key in ("frozen", "weights", "gradients", "optimizer_state"):
            assert x[key] / GIB == pytest.approx(per[key], abs=1e-6), (x["rank"], key)
    assert 40 < per["frozen"] < 45 and per["gradients"] < 2
