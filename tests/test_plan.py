"""The memory planner (genoctx.plan) and `genoctx plan`: arithmetic properties, layout search, the reference run's
plan, the CLI's JSON and its one-line errors. Fast: no training, no processes (the published model is built on the
meta device once)."""

import dataclasses
import json
import math

import pytest
import torch
from typer.testing import CliRunner

from genoctx import plan as P
from genoctx.cli import app
from genoctx.errors import GenoctxError
from genoctx.model import dsa, kda
from genoctx.model.config import preset
from genoctx.parallel.layout import DIMS, Layout

GLM = preset("glm-5.3-flash")
TINY = preset("tiny")
SMALL = preset("cpu-small")
M = 2**20
ACT = ("activations_kda", "activations_dsa", "activations_moe", "activations_dense_mlp", "activations_mhc",
       "activations_head", "layer_inputs")  # fmt: skip


def _plan(cfg, L, layout=Layout(), **kw):
    kw.setdefault("gpu_memory_gib", 178.0)
    return P.plan_memory(cfg, L, layout, **kw)


def _activations(p):
    return sum(p["components_gib"][k] for k in ACT)


def test_constants_match_the_code():
    assert P.ATTN_TILE_TOKENS == dsa.ATTN_TILE_TOKENS
    assert (P.INDEX_ROW_TILE, P.INDEX_COL_BLOCK, P.INDEX_GROUP) == (
        dsa.INDEX_ROW_TILE, dsa.INDEX_COL_BLOCK, dsa.INDEX_GROUP)  # fmt: skip
    assert P.SUB_CHUNK == kda._SUB_CHUNK
    from genoctx.data.tokenizer import VOCAB

    assert P.NUCLEOTIDE_VOCAB == len(VOCAB)


@pytest.mark.parametrize(
    "cfg,L,layout,kw",
    [
        (TINY, 4096, Layout(), dict(dtype="fp32", device="cpu", recompute=False)),
        (SMALL, 16384, Layout(dp_shard=2, cp=2), dict(dtype="fp32", device="cpu")),
        (GLM, 1 << 20, Layout(dp_shard=2, cp=32), {}),
        (GLM, 1 << 17, Layout(ep=2, dp_shard=2, cp=16), dict(optimizer_offload=True)),
        (GLM, 1 << 16, Layout(dp_replicate=2, ep=4, dp_shard=8), dict(recompute=False, batch_size=2)),
    ],
)
def test_components_add_up_to_the_total(cfg, L, layout, kw):
    p = _plan(cfg, L, layout, **kw)
    assert set(p["components_gib"]) == set(P.COMPONENTS)
    assert sum(p["components_gib"].values()) == pytest.approx(p["total_gib"], abs=1e-5)
    assert all(v >= 0 for v in p["components_gib"].values())
    assert p["fits"] == (p["total_gib"] <= p["gpu_memory_gib"])
    assert p["tokens_per_rank"] == kw.get("batch_size", 1) * L // layout.cp


def _allocated(cfg, layout: Layout) -> dict:
    """What one rank allocates, counted here from the meta model: FSDP2 cuts dim 0 of every parameter in
    ``torch.chunk`` pieces padded to the first one's ``ceil(rows / shards)`` rows; a routed expert's rows are its
    ``E / ep`` block first."""
    import torch

    from genoctx.model.model import HybridLM

    with torch.device("meta"):
        model = HybridLM(cfg)
    out = {"dense": 0, "expert": 0}
    for name, p in model.named_parameters():
        rows, rest = p.shape[0], p.numel() // p.shape[0]
        if ".mlp.experts." in name:
            out["expert"] += math.ceil(rows // layout.ep / layout.expert_shard) * rest
        else:
            out["dense"] += math.ceil(rows / layout.dense_shard) * rest
    return out


def test_persistent_state_is_what_a_rank_allocates():
    counts = P.param_counts(GLM)
    assert counts["total"] == 313_326_816_766  # `genoctx model info` counts the same (README, The model)
    for layout in (Layout(dp_shard=2, cp=32), Layout(ep=8, dp_shard=8), Layout(dp_replicate=2, ep=4, dp_shard=4, cp=2),
                   Layout(ep=2, cp=4), Layout(cp=8), Layout(cp=64)):  # fmt: skip
        p = _plan(GLM, 1 << 20, layout)
        want = _allocated(GLM, layout)
        assert p["params_per_rank"] == want
        local = want["dense"] + want["expert"]
        mean = counts["dense"] / layout.dense_shard + counts["expert"] / (layout.ep * layout.expert_shard)
        assert mean <= local <= 1.15 * mean  # padding of uneven shards: 288 experts over 64 ranks, heads over 128
        for key, per_param in (("weights", 4), ("gradients", 4), ("optimizer_state", 8)):
            assert p["persistent_gib"][key] == pytest.approx(per_param * local / 2**30, abs=1e-6)
        assert p["components_gib"]["weights"] == p["persistent_gib"]["weights"]
        assert p["components_gib"]["optimizer_state"] == p["persistent_gib"]["optimizer_state"]
    # doubling dp_shard about halves every sharded byte; doubling ep halves the experts only without FSDP
    a, b = _plan(GLM, 1 << 20, Layout(dp_shard=2, cp=8)), _plan(GLM, 1 << 20, Layout(dp_shard=4, cp=8))
    assert b["params_per_rank"]["dense"] * 2 == pytest.approx(a["params_per_rank"]["dense"], rel=1e-3)
    assert b["params_per_rank"]["expert"] * 2 == pytest.approx(a["params_per_rank"]["expert"], rel=1e-3)
    a, b = _plan(GLM, 1 << 17, Layout(dp_replicate=8)), _plan(GLM, 1 << 17, Layout(dp_replicate=4, ep=2))
    assert b["params_per_rank"]["dense"] == a["params_per_rank"]["dense"] == counts["dense"]
    assert b["params_per_rank"]["expert"] * 2 == a["params_per_rank"]["expert"]
    # CP ranks shard like data ranks (torchtitan's dp_shard_cp): CP=8 alone shards every parameter 8 ways
    c = _plan(GLM, 1 << 20, Layout(cp=8))
    assert c["params_per_rank"]["dense"] == pytest.approx(counts["dense"] / 8, rel=1e-3)
    assert c["params_per_rank"]["expert"] == counts["expert"] / 8  # 288 experts split evenly over 8


def test_offload_moves_the_sharded_state_to_the_host():
    on, off = (_plan(GLM, 1 << 17, Layout(ep=2, dp_shard=2, cp=16), optimizer_offload=o) for o in (True, False))
    assert on["persistent_gib"]["on_host"] and not off["persistent_gib"]["on_host"]
    for key in ("weights", "gradients", "optimizer_state"):
        assert on["components_gib"][key] == 0
    assert on["total_gib"] < off["total_gib"]
    with pytest.raises(ValueError, match="optimizer_offload needs FSDP"):
        _plan(GLM, 1 << 17, Layout(dp_replicate=2, ep=8), optimizer_offload=True)


@pytest.mark.parametrize("recompute", [False, True])
def test_activations_scale_linearly_with_tokens_per_rank(recompute):
    kw = dict(dtype="fp32", device="cpu", recompute=recompute)
    for layout in (Layout(), Layout(dp_shard=2, cp=2)):
        p1, p2 = _plan(SMALL, 1 << 16, layout, **kw), _plan(SMALL, 1 << 17, layout, **kw)
        assert p1["peak_phase"] == p2["peak_phase"]  # the same moment of the step: the same tensors
        assert p2["tokens_per_rank"] == 2 * p1["tokens_per_rank"] == (1 << 17) // layout.cp
        assert _activations(p2) == pytest.approx(2 * _activations(p1), rel=1e-4)
    # more CP ranks: fewer tokens per rank, less activation memory
    two, four = _plan(SMALL, 1 << 16, Layout(cp=2), **kw), _plan(SMALL, 1 << 16, Layout(cp=4), **kw)
    assert four["tokens_per_rank"] * 2 == two["tokens_per_rank"]
    assert _activations(four) < _activations(two)


def test_recompute_lowers_activations():
    for cfg, L, layout, kw in ((SMALL, 1 << 15, Layout(), dict(dtype="fp32", device="cpu")),
                               (GLM, 1 << 17, Layout(ep=2, dp_shard=2, cp=16), {})):  # fmt: skip
        with_ac, without = _plan(cfg, L, layout, recompute=True, **kw), _plan(cfg, L, layout, recompute=False, **kw)
        assert _activations(with_ac) < _activations(without)
        assert with_ac["total_gib"] < without["total_gib"]
        assert with_ac["components_gib"]["layer_inputs"] > 0 == without["components_gib"]["layer_inputs"]


def test_search_lists_only_valid_layouts_of_the_world_best_first():
    plans = P.search_layouts(SMALL, 1 << 14, 8, 0.5, dtype="fp32", device="cpu")
    assert plans
    seen = set()
    for p in plans:
        lay = p["layout"]
        assert lay["dp_replicate"] * lay["ep"] * lay["dp_shard"] * lay["cp"] == lay["world"] == 8
        assert SMALL.n_routed_experts % lay["ep"] == 0 and (1 << 14) // lay["cp"] >= SMALL.kda_chunk_size
        assert p["fits"] == (p["total_gib"] <= 0.5)
        seen.add(tuple(lay[d] for d in DIMS))
    assert len(seen) == len(plans) == len(P.valid_layouts(SMALL, 1 << 14, 8))
    keys = [(not p["fits"], p["total_gib"]) for p in plans]
    assert keys == sorted(keys)
    assert any(p["fits"] for p in plans) and not all(p["fits"] for p in plans)
    # cp leaves pieces of at least one KDA chunk; ep divides the experts
    assert all(lay.cp <= 2 for lay in P.valid_layouts(TINY, 32, 4))  # kda_chunk_size 16
    assert {lay.ep for lay in P.valid_layouts(SMALL, 1 << 14, 16)} == {1, 2, 4, 8}


def test_reference_run_plan_schema():
    """`genoctx plan --preset glm-5.3-flash --seq-len 1M --gpus 64 --gpu-memory-gib 178`: every 64-rank layout, each
    with the documented keys (the numbers the README quotes come from this command)."""
    plans = P.search_layouts(GLM, 1 << 20, 64, 178.0)
    assert len(plans) == len(P.valid_layouts(GLM, 1 << 20, 64)) > 50
    for p in plans:
        assert {"layout", "fits", "total_gib", "components_gib"} <= set(p)
        assert set(p["layout"]) == {*DIMS, "world"} and p["layout"]["world"] == 64
        assert isinstance(p["fits"], bool) and isinstance(p["total_gib"], float)
        assert p["recompute"] and p["dtype"] == "bf16" and not p["optimizer_offload"]
    json.dumps(plans)  # plain JSON
    best = plans[0]
    assert best["components_gib"]["optimizer_state"] > 0 and best["components_gib"]["allocator_slack"] > 0


def test_reference_run_fits_with_the_optimizer_offloaded():
    """The reference run (GLM-5.3-Flash, 1M tokens, 64 GPUs of 178 GiB, AdamW): CP=64 (FSDP over the CP ranks) fits
    with the optimizer state in host memory; with it on the GPU no layout fits (README, Planning memory)."""
    best = P.search_layouts(GLM, 1 << 20, 64, 178.0, optimizer_offload=True)[0]
    assert best["fits"] and best["layout"]["cp"] == 64 and 150 < best["total_gib"] < 178
    assert not any(p["fits"] for p in P.search_layouts(GLM, 1 << 20, 64, 178.0))


def test_reference_model_fits_with_more_gpus_or_shorter_windows():
    """What does fit (the planner's answer today): 1M tokens on 256 GPUs, 128k tokens on 64."""
    assert _plan(GLM, 1 << 20, Layout(dp_shard=2, cp=128))["fits"]
    assert _plan(GLM, 1 << 17, Layout(ep=2, dp_shard=2, cp=16))["fits"]


def test_check_fits():
    p = _plan(GLM, 1 << 20, Layout(dp_shard=2, cp=32))
    assert not p["fits"]
    with pytest.raises(GenoctxError) as e:
        P.check_fits(p)
    msg = str(e.value)
    assert "\n" not in msg and "dp_shard=2 cp=32" in msg and "178 GiB" in msg and "--force" in msg
    P.check_fits(_plan(TINY, 1024))  # fits: nothing raised


@pytest.mark.parametrize(
    "args,match",
    [
        (dict(layout=Layout(ep=3)), "ep=3 does not divide"),
        (dict(layout=Layout(cp=3)), "not a multiple of cp=3"),
        (dict(layout=Layout(cp=512)), "less than one KDA chunk"),
        (dict(dtype="fp16"), "dtype must be"),
        (dict(gpu_memory_gib=0), "gpu_memory_gib"),
        (dict(batch_size=0), "batch_size"),
        (dict(cfg=dataclasses.replace(TINY, dsa_mode="dense")), "sparse DSA"),
    ],
)
def test_plan_rejects_bad_arguments(args, match):
    layout = args.pop("layout", Layout())
    cfg = args.pop("cfg", TINY)
    with pytest.raises(ValueError, match=match):
        _plan(cfg, 4096, layout, **args)


def _saved_bytes(module, x) -> int:
    """Bytes a module's forward leaves alive (saved for backward), its output excluded (allocator events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = module(x)
        out = out[0] if isinstance(out, tuple) else out
    events = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    return sum(events) - out.untyped_storage().nbytes()


def test_saved_activation_formulas_match_autograd():
    """The per-token sizes the planner adds up are what the model's forward keeps (tiny, fp32 and bf16)."""
    from genoctx.model.dsa import DeepSeekSparseAttention
    from genoctx.model.kda import KimiDeltaAttention
    from genoctx.model.model import cast_model
    from genoctx.model.moe import MLP

    T = 2048
    cfg = TINY
    torch.manual_seed(0)
    for dtype, a in ((torch.float32, 4), (torch.bfloat16, 2)):
        s = P._Sizes(a=a)
        x = torch.randn(1, T, cfg.hidden_size).to(dtype).requires_grad_(True)
        cases = [
            (KimiDeltaAttention(cfg), P._kda(cfg, s) - P._norm(s, cfg.hidden_size)),
            (DeepSeekSparseAttention(cfg, 1), P._dsa(cfg, s, True) - P._norm(s, cfg.hidden_size)),
            (MLP(cfg.hidden_size, cfg.intermediate_size), P._mlp(cfg, s) - P._norm(s, cfg.hidden_size)),
        ]
        for module, per_token in cases:
            cast_model(module, dtype)
            got = _saved_bytes(module, x)
            assert got == pytest.approx(per_token * T, rel=0.02), type(module).__name__


def _cli(*args):
    return CliRunner().invoke(app, ["plan", *map(str, args)])


def test_cli_json():
    r = _cli("--preset", "tiny", "--seq-len", "4k", "--gpus", "4", "--format", "json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["seq_len"] == 4096 and doc["gpus"] == 4 and doc["layouts"]
    for p in doc["layouts"]:
        assert {"layout", "fits", "total_gib", "components_gib"} <= set(p) and p["fits"]
        assert p["layout"]["world"] == 4
    totals = [p["total_gib"] for p in doc["layouts"]]
    assert totals == sorted(totals)
    one = json.loads(_cli("--preset", "tiny", "--seq-len", "4k", "--gpus", "4", "--fsdp", "2", "--cp", "2",
                          "--format", "json").stdout)  # fmt: skip
    assert [p["layout"] for p in one["layouts"]] == [{"dp_replicate": 1, "ep": 1, "dp_shard": 2, "cp": 2, "world": 4}]


def test_cli_table_and_nothing_fitting():
    r = _cli("--preset", "cpu-small", "--seq-len", "16k", "--gpus", "4", "--gpu-memory-gib", "8")
    assert r.exit_code == 0 and "components of #1" in r.stdout and "MiB/GPU" in r.stdout
    r = _cli("--preset", "cpu-small", "--seq-len", "16k", "--gpus", "2", "--gpu-memory-gib", "0.01", "--format", "json")
    assert r.exit_code == 0
    doc = json.loads(r.stdout)
    assert doc["layouts"] == [] and doc["closest"] and not any(p["fits"] for p in doc["closest"])


def test_cli_recipe():
    r = _cli("--recipe", "recipes/cpu-small.yaml", "--seq-len", "8k", "--gpus", "2", "--format", "json")
    assert r.exit_code == 0, r.output
    assert all(p["dtype"] == "fp32" for p in json.loads(r.stdout)["layouts"])  # the recipe's train.dtype


@pytest.mark.parametrize(
    "args,flag",
    [
        (["--preset", "tiny", "--seq-len", "abc"], "--seq-len"),
        (["--preset", "nope"], "--preset"),
        (["--preset", "tiny", "--gpus", "0"], "--gpus"),
        (["--preset", "tiny", "--gpus", "4", "--ep", "3"], "--ep"),
        (["--preset", "tiny", "--gpus", "3", "--ep", "3"], "--ep 3"),
        (["--preset", "tiny", "--gpus", "4", "--cp", "4", "--seq-len", "32"], "--cp 4"),
        (["--preset", "tiny", "--gpus", "4", "--cp", "4", "--dp-replicate", "2"], "--gpus 4"),
        (["--preset", "tiny", "--gpus", "4", "--cp", "4", "--offload-optimizer"], "--offload-optimizer"),
        (["--preset", "tiny", "--gpu-memory-gib", "-1"], "--gpu-memory-gib"),
        (["--preset", "tiny", "--format", "xml"], "--format"),
        (["--preset", "tiny", "--dtype", "fp16"], "--dtype"),
        (["--preset", "tiny", "--gpus", "x"], "--gpus"),
        (["--preset", "tiny", "--hf", "somewhere"], "--preset"),
        (["--hf", "/nonexistent/dir"], "--hf"),
        (["--preset", "tiny", "--seq-len", "8"], "--seq-len"),
    ],
)
def test_cli_bad_values_exit_2_with_one_line(args, flag):
    r = _cli(*args)
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert err.startswith("genoctx: error:") and "\n" not in err and flag in err, err
    assert r.stdout == ""


def test_plan_is_pure():
    cfg = dataclasses.replace(TINY)
    before = cfg.to_dict()
    _plan(cfg, 4096, Layout(cp=2))
    assert cfg.to_dict() == before
