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
from genoctx.plan import eval_memory as PE
from genoctx.plan import sizes as PS

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
    assert (PS.ATTN_TILE_TOKENS, PS.ATTN_TILE_BYTES) == (dsa.ATTN_TILE_TOKENS, dsa.ATTN_TILE_BYTES)
    assert (PS.INDEX_ROW_TILE, PS.INDEX_COL_BLOCK, PS.INDEX_GROUP) == (
        dsa.INDEX_ROW_TILE, dsa.INDEX_COL_BLOCK, dsa.INDEX_GROUP)  # fmt: skip
    assert PS.SUB_CHUNK == kda._SUB_CHUNK
    from genoctx.data.tokenizer import VOCAB

    assert PS.NUCLEOTIDE_VOCAB == len(VOCAB)


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
    assert counts["total"] == 313_326_816_766  # `genoctx model info` counts the same (docs/model.md)
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
    one_block = dataclasses.replace(SMALL, kda_block_tokens=1 << 30)  # the KDA core's working set grows with T too
    for layout in (Layout(), Layout(dp_shard=2, cp=2)):
        p1, p2 = _plan(one_block, 1 << 16, layout, **kw), _plan(one_block, 1 << 17, layout, **kw)
        assert p1["peak_phase"] == p2["peak_phase"]  # the same moment of the step: the same tensors
        assert p2["tokens_per_rank"] == 2 * p1["tokens_per_rank"] == (1 << 17) // layout.cp
        assert _activations(p2) == pytest.approx(2 * _activations(p1), rel=1e-4)
    # more CP ranks: fewer tokens per rank, less activation memory
    two, four = _plan(SMALL, 1 << 16, Layout(cp=2), **kw), _plan(SMALL, 1 << 16, Layout(cp=4), **kw)
    assert four["tokens_per_rank"] * 2 == two["tokens_per_rank"]
    assert _activations(four) < _activations(two)


def test_kda_core_working_set_is_one_block():
    """With the core in blocks (``kda_block_tokens``) its recomputed working set grows only by what crosses blocks
    (states, the finished blocks' input gradients): far less than linearly, and less than one block spanning T."""
    def core(cfg, L):
        return P.plan_memory(cfg, L, Layout(), gpu_memory_gib=1.0, dtype="fp32", device="cpu")["working_sets_gib"][
            "kda_core_recompute"]  # fmt: skip

    one_block = dataclasses.replace(SMALL, kda_block_tokens=1 << 30)
    assert core(one_block, 1 << 17) == pytest.approx(2 * core(one_block, 1 << 16), rel=1e-3)
    assert core(SMALL, 1 << 17) < 0.25 * core(one_block, 1 << 17)
    assert core(SMALL, 1 << 17) < 2 * core(SMALL, 1 << 16)


def test_recompute_lowers_activations():
    for cfg, L, layout, kw in ((SMALL, 1 << 15, Layout(), dict(dtype="fp32", device="cpu")),
                               (GLM, 1 << 17, Layout(ep=2, dp_shard=2, cp=16), {})):  # fmt: skip
        with_ac, without = _plan(cfg, L, layout, recompute=True, **kw), _plan(cfg, L, layout, recompute=False, **kw)
        assert _activations(with_ac) < _activations(without)
        assert with_ac["total_gib"] < without["total_gib"]
        assert without["components_gib"]["layer_inputs"] == 0
        if not with_ac["peak_phase"].startswith("backward layer 0 "):  # the other layers' inputs are still kept
            assert with_ac["components_gib"]["layer_inputs"] > 0


def test_search_lists_only_valid_layouts_of_the_world_best_first():
    plans = P.search_layouts(SMALL, 1 << 14, 8, 0.5, dtype="fp32", device="cpu")
    assert plans
    seen = set()
    for p in plans:
        lay = p["layout"]
        ep_axis = 1 if lay["ep_folded"] else lay["ep"]  # folded: the EP group drawn from dp_shard x cp
        assert lay["dp_replicate"] * ep_axis * lay["dp_shard"] * lay["cp"] == lay["world"] == 8
        assert SMALL.n_routed_experts % lay["ep"] == 0 and (1 << 14) // lay["cp"] >= SMALL.kda_chunk_size
        assert not lay["ep_folded"] or (lay["ep"] > 1 and (lay["dp_shard"] * lay["cp"]) % lay["ep"] == 0)
        assert p["fits"] == (p["total_gib"] <= 0.5)
        seen.add((*(lay[d] for d in DIMS), lay["ep_folded"]))
    assert len(seen) == len(plans) == len(P.valid_layouts(SMALL, 1 << 14, 8))
    keys = [(not p["fits"], p["total_gib"]) for p in plans]
    assert keys == sorted(keys)
    assert any(p["fits"] for p in plans) and not all(p["fits"] for p in plans)
    # cp leaves pieces of at least one KDA chunk; ep divides the experts
    assert all(lay.cp <= 2 for lay in P.valid_layouts(TINY, 32, 4))  # kda_chunk_size 16
    assert {lay.ep for lay in P.valid_layouts(SMALL, 1 << 14, 16)} == {1, 2, 4, 8}


def test_reference_run_plan_schema():
    """`genoctx plan --preset glm-5.3-flash --seq-len 1M --gpus 64 --gpu-memory-gib 178`: every 64-rank layout, each
    with the documented keys (the numbers docs/plan.md quotes come from this command)."""
    plans = P.search_layouts(GLM, 1 << 20, 64, 178.0)
    assert len(plans) == len(P.valid_layouts(GLM, 1 << 20, 64)) > 50
    for p in plans:
        assert {"layout", "fits", "total_gib", "components_gib"} <= set(p)
        assert set(p["layout"]) == {*DIMS, "ep_folded", "world"} and p["layout"]["world"] == 64
        assert isinstance(p["fits"], bool) and isinstance(p["total_gib"], float)
        assert p["recompute"] and p["dtype"] == "bf16" and not p["optimizer_offload"]
    json.dumps(plans)  # plain JSON
    best = plans[0]
    assert best["components_gib"]["optimizer_state"] > 0 and best["components_gib"]["allocator_slack"] > 0


def test_reference_run_fits_with_folded_experts_without_offload():
    """The reference run (GLM-5.3-Flash, 1M tokens, 64 GPUs of 178 GiB, AdamW): the best layout is CP=64 with EP=32
    folded into the same ranks, at or below the published 144.5 GiB without any offload; without folding no layout
    fits unless the optimizer state goes to host memory (docs/plan.md)."""
    plans = P.search_layouts(GLM, 1 << 20, 64, 178.0)
    best = plans[0]
    assert best["fits"] and best["total_gib"] <= 144.5
    assert best["layout"] == {"dp_replicate": 1, "ep": 32, "dp_shard": 1, "cp": 64, "ep_folded": True, "world": 64}
    assert best["tokens_per_rank"] == 16384 and best["all_to_all_gib"] > 0
    unfolded = [p for p in plans if not p["layout"]["ep_folded"]]
    assert unfolded and not any(p["fits"] for p in unfolded)
    off = [p for p in P.search_layouts(GLM, 1 << 20, 64, 178.0, optimizer_offload=True) if not p["layout"]["ep_folded"]]
    assert off[0]["fits"] and off[0]["layout"]["cp"] == 64 and 100 < off[0]["total_gib"] < 178
    for L in (1 << 19, 1 << 18):  # 512k and 256k fit too, below the 1M plan
        assert P.search_layouts(GLM, L, 64, 178.0)[0]["total_gib"] < best["total_gib"]


def test_folding_shards_the_experts_over_the_cp_ranks():
    """Folded EP=32 over CP=64: 9 experts per rank, split (dim 1) over the 2 ranks holding them, instead of all 288
    all-gathered per layer; the tokens per rank are CP's, and the expert all-to-all volume grows with EP."""
    folded = _plan(GLM, 1 << 20, Layout(ep=32, cp=64, ep_folded=True))
    plain = _plan(GLM, 1 << 20, Layout(cp=64))
    assert folded["tokens_per_rank"] == plain["tokens_per_rank"] == 16384
    c0, c1 = plain["components_gib"], folded["components_gib"]
    assert c1["unsharded_params"] < c0["unsharded_params"] / 5
    assert c1["fsdp_reduce_scatter"] < c0["fsdp_reduce_scatter"] / 10
    assert plain["all_to_all_gib"] == 0
    assert 0 < _plan(GLM, 1 << 20, Layout(ep=2, cp=64, ep_folded=True))["all_to_all_gib"] < folded["all_to_all_gib"]
    # 288 / 32 = 9 experts over efsdp = 2 ranks: Shard(1), no padded expert (Shard(0) would allocate 5 of 9)
    shapes = P.param_counts(GLM)["shapes"]
    lay = Layout(ep=32, cp=64, ep_folded=True)
    assert lay.expert_shard == 2
    experts = sum(rows * rest for kind, rows, rest, _ in shapes if kind == "expert")
    assert P.shard_numel(shapes, lay)["expert"] == experts // 64


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
        s = PS._Sizes(a=a)
        x = torch.randn(1, T, cfg.hidden_size).to(dtype).requires_grad_(True)
        norm = {k: PS._norm_in(s, cfg.hidden_size, casts) for k, casts in PS.INPUT_CASTS.items()}  # sizes._norm_in
        cases = [
            (KimiDeltaAttention(cfg), PS._kda(cfg, s) - norm["kda"]),
            (DeepSeekSparseAttention(cfg, 1), PS._dsa(cfg, s, True) - norm["dsa_full"]),
            (MLP(cfg.hidden_size, cfg.intermediate_size), PS._mlp(cfg, s) - norm["mlp"]),
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
    assert [p["layout"] for p in one["layouts"]] == [
        {"dp_replicate": 1, "ep": 1, "dp_shard": 2, "cp": 2, "ep_folded": False, "world": 4}]  # fmt: skip


def test_cli_table_and_nothing_fitting():
    r = _cli("--preset", "cpu-small", "--seq-len", "16k", "--gpus", "4", "--gpu-memory-gib", "8")
    assert r.exit_code == 0 and "components of #1" in r.stdout and "MiB/GPU" in r.stdout
    r = _cli("--preset", "cpu-small", "--seq-len", "16k", "--gpus", "2", "--gpu-memory-gib", "0.01", "--format", "json")
    assert r.exit_code == 0
    doc = json.loads(r.stdout)
    assert doc["layouts"] == [] and doc["closest"] and not any(p["fits"] for p in doc["closest"])


def test_cli_seq_chunk_auto_plans_chunked_training_beside_cp():
    """--seq-chunk auto: a layout that does not fit in one pass is planned with the largest chunk that fits (under CP
    each rank chunking its piece); the table says which chunk each row trains with. 1M in one pass needs 18 GiB per
    GPU with CP=2 (bf16), more without CP: nothing fits 12 GiB without chunks."""
    args = ["--preset", "cpu-small", "--seq-len", "1M", "--gpus", "2", "--gpu-memory-gib", "12"]
    doc = json.loads(_cli(*args, "--seq-chunk", "auto", "--format", "json").stdout)
    chunked = [p for p in doc["layouts"] if p["seq_chunk_tokens"]]
    assert {p["layout"]["cp"] for p in chunked} == {1, 2}  # chunking without CP and with it
    assert all(p["tokens_per_rank"] == p["seq_chunk_tokens"] for p in chunked)
    plain = json.loads(_cli(*args, "--format", "json").stdout)
    assert plain["layouts"] == [] and all(p["fits"] for p in chunked)
    for p in chunked:  # chunking needs less than the same layout in one pass
        same = [q for q in plain["layouts"] + plain.get("closest", []) if q["layout"] == p["layout"]]
        assert all(q["total_gib"] > p["total_gib"] for q in same)
    for extra in (["--fsdp", "2"], ["--cp", "2"]):
        r = _cli(*args, *extra, "--seq-chunk", "16k")
        assert r.exit_code == 0 and "chunk" in r.stdout and "seq_chunk_boundary" in r.stdout, r.output


def test_seq_chunk_hint_is_the_planners_auto_pick():
    """When no layout trains a 1M window in one pass in 12 GiB (cpu-small, 2 GPUs; the test above), the hint is the
    first fitting plan of the --seq-chunk auto search: a chunk that fits where the same layout in one pass does not.
    With one layout given: that layout's best_seq_chunk. None when one pass fits, or when no chunk fits either."""
    kw = dict(gpu_memory_gib=12.0, dtype="bf16")
    hint = P.seq_chunk_hint(SMALL, M, 2, **kw)
    auto = P.search_layouts(SMALL, M, 2, seq_chunk_tokens="auto", **kw)
    assert not any(p["fits"] for p in P.search_layouts(SMALL, M, 2, **kw))  # one pass fits nowhere
    assert auto[0]["fits"] and auto[0]["seq_chunk_tokens"] == hint["seq_chunk_tokens"] == 256 * 1024
    assert hint["layout"] == auto[0]["layout"] and hint["total_gib"] == auto[0]["total_gib"] < 12.0
    assert hint["flag"] == "--seq-chunk 256k"
    lay = Layout(**{k: v for k, v in hint["layout"].items() if k != "world"})
    assert not _plan(SMALL, M, lay, **kw)["fits"]
    assert _plan(SMALL, M, lay, seq_chunk_tokens=hint["seq_chunk_tokens"], **kw)["total_gib"] == hint["total_gib"]
    fsdp = P.seq_chunk_hint(SMALL, M, 2, layout=Layout(dp_shard=2), **kw)
    assert fsdp["seq_chunk_tokens"] == P.best_seq_chunk(SMALL, M, Layout(dp_shard=2), **kw)["seq_chunk_tokens"]
    assert fsdp["layout"]["dp_shard"] == 2 and fsdp["total_gib"] < 12.0
    assert P.seq_chunk_hint(SMALL, M, 2, gpu_memory_gib=40.0, dtype="bf16") is None  # one pass fits (18 GiB, CP=2)
    assert P.seq_chunk_hint(SMALL, M, 2, gpu_memory_gib=0.01, dtype="bf16") is None  # nothing fits


def test_cli_plan_names_the_seq_chunk_that_fits():
    """`genoctx plan` with nothing fitting in one pass: the JSON's `hint` and the table's last line name the
    --seq-chunk the planner picks (with the layout's flags); none with --seq-chunk auto, or when a layout fits."""
    args = ["--preset", "cpu-small", "--seq-len", "1M", "--gpus", "2", "--gpu-memory-gib", "12"]
    want = P.seq_chunk_hint(SMALL, M, 2, gpu_memory_gib=12.0, dtype="bf16")
    doc = json.loads(_cli(*args, "--format", "json").stdout)
    assert doc["layouts"] == [] and {k: doc["hint"][k] for k in want} == want
    assert doc["hint"]["message"].startswith("no training step fits in 12 GiB as planned, but one in chunks does: "
                                             "--seq-chunk 256k --ep 2 --fsdp 2 --ep-folded (")  # fmt: skip
    table = _cli(*args).stdout
    assert table.splitlines()[-1] == "hint: " + doc["hint"]["message"]
    one = json.loads(_cli(*args, "--fsdp", "2", "--format", "json").stdout)  # one layout given: that layout chunked
    assert not one["layouts"][0]["fits"] and one["hint"]["flag"] == "--seq-chunk 256k"
    assert one["hint"]["layout"] == one["layouts"][0]["layout"] and "--fsdp" not in one["hint"]["message"]
    assert "hint" not in json.loads(_cli(*args, "--seq-chunk", "auto", "--format", "json").stdout)
    assert "hint" not in json.loads(_cli(*args[:-1], "40", "--format", "json").stdout)
    assert "hint:" not in _cli(*args[:-1], "0.01").stdout


def test_cli_plan_old_and_new_flag_names_agree():
    """One name per idea: --num-workers is --gpus; with --eval, --seq-chunk is eval's chunk and --chunk-tokens its
    old name (still accepted; without --eval still refused, as before); --no-ep-folded is the default."""
    base = ["--preset", "cpu-small", "--seq-len", "16k", "--format", "json"]
    gpus = json.loads(_cli(*base, "--gpus", "4").stdout)
    assert json.loads(_cli(*base, "--num-workers", "4").stdout) == gpus and gpus["gpus"] == 4
    new = json.loads(_cli(*base, "--eval", "--gpus", "2", "--seq-chunk", "4k").stdout)
    old = json.loads(_cli(*base, "--eval", "--gpus", "2", "--chunk-tokens", "4k").stdout)
    assert new == old and {p["chunk_tokens"] for p in new["layouts"]} == {4096}
    lay = ["--gpus", "2", "--ep", "2", "--cp", "2"]
    assert json.loads(_cli(*base, *lay, "--ep-folded").stdout)["layouts"][0]["layout"]["ep_folded"] is True
    r = _cli(*base, *lay, "--no-ep-folded")
    assert r.exit_code == 2 and "(or add --ep-folded" in r.stderr  # an axis of its own: 2 x 2 ranks are not 2
    r = _cli(*base, "--eval", "--seq-chunk", "0")
    assert r.exit_code == 2 and r.stderr.startswith("genoctx: error: --seq-chunk"), r.stderr


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
        (["--preset", "tiny", "--gpus", "2", "--dp-replicate", "2", "--offload-optimizer"], "--offload-optimizer"),
        (["--preset", "tiny", "--gpu-memory-gib", "-1"], "--gpu-memory-gib"),
        (["--preset", "tiny", "--format", "xml"], "--format"),
        (["--preset", "tiny", "--dtype", "fp16"], "--dtype"),
        (["--preset", "tiny", "--gpus", "x"], "--gpus"),
        (["--preset", "tiny", "--hf", "somewhere"], "--preset"),
        (["--hf", "/nonexistent/dir"], "--hf"),
        (["--preset", "tiny", "--seq-len", "8"], "--seq-len"),
        (["--preset", "tiny", "--ep-folded"], "--ep-folded needs --ep"),
        (["--preset", "tiny", "--gpus", "2", "--ep", "2", "--cp", "2"], "(or add --ep-folded"),
        (["--preset", "tiny", "--gpus", "2", "--ep", "4", "--cp", "2", "--ep-folded"], "--ep 4 (folded) must divide"),
        (["--preset", "tiny", "--eval", "--seq-chunk", "auto"], "--seq-chunk auto chooses a training chunk"),
        (["--preset", "tiny", "--eval", "--seq-chunk", "1k", "--chunk-tokens", "1k"], "old name of --seq-chunk"),
        (["--preset", "tiny", "--seq-chunk", "0"], "--seq-chunk"),
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


# ---------------------------------------------------------------- evaluation (plan_eval)


def _eval(cfg, L, layout=Layout(), **kw):
    kw.setdefault("gpu_memory_gib", 178.0)
    return P.plan_eval(cfg, L, layout, **kw)


CPU = dict(dtype="fp32", device="cpu")


@pytest.mark.parametrize(
    "cfg,L,layout,kw",
    [
        (TINY, 4096, Layout(), dict(CPU)),
        (SMALL, 1 << 14, Layout(), dict(CPU, chunk_tokens=4096)),
        (SMALL, 1 << 14, Layout(dp_shard=2, cp=2), dict(CPU, chunk_tokens=2048)),
        (SMALL, 1 << 14, Layout(ep=2, cp=4), dict(CPU, cp_layout="zigzag")),
        (GLM, 1 << 19, Layout(ep=2, cp=32), {}),
        (GLM, 1 << 19, Layout(ep=32, dp_shard=2), dict(chunk_tokens=4096, loss_vocab_rows=5)),
        (GLM, 1 << 17, Layout(dp_replicate=8, ep=8), dict(chunk_tokens=8192)),  # no FSDP: every weight replicated
    ],
)
def test_eval_components_add_up_and_hold_no_training_state(cfg, L, layout, kw):
    p = _eval(cfg, L, layout, **kw)
    assert p["mode"] == "eval" and p["batch_size"] == 1 and p["chunk_tokens"] == kw.get("chunk_tokens")
    assert set(p["components_gib"]) == set(P.EVAL_COMPONENTS)
    assert not {"gradients", "optimizer_state", "optimizer_step", "fsdp_reduce_scatter"} & set(p["components_gib"])
    assert sum(p["components_gib"].values()) == pytest.approx(p["total_gib"], abs=1e-5)
    assert all(v >= 0 for v in p["components_gib"].values()) and p["fits"] == (p["total_gib"] <= 178.0)
    assert p["persistent_gib"]["gradients"] == p["persistent_gib"]["optimizer_state"] == 0
    assert p["tokens_per_rank"] == L // layout.cp
    # the weights are what a training step's plan holds for the same layout: the local fp32 parameters
    train = _plan(cfg, L, layout, **{k: v for k, v in kw.items() if k in ("dtype", "device")})
    assert p["components_gib"]["weights"] == train["components_gib"]["weights"] == p["persistent_gib"]["weights"]
    assert p["params_per_rank"] == train["params_per_rank"]
    assert (p["components_gib"]["unsharded_params"] > 0) == layout.fsdp
    assert p["total_gib"] < train["total_gib"]  # no gradients, no optimizer state, nothing saved for backward


def test_eval_smaller_chunks_lower_the_peak_until_the_caches_dominate():
    """Without CP a chunk's working set shrinks with the chunk; the window's DSA caches (held twice in the last chunk)
    do not, and become the largest term. (The sparse attention's tile, sized in bytes, holds up to 2048 of
    cpu-small's query rows: it shrinks with the chunk down to 256 tokens, below the indexer's fixed tiles after.)"""
    totals, caches, kda = [], [], []
    for chunk in (None, 1 << 16, 1 << 14, 1 << 12, 1 << 10, 1 << 8, 1 << 6):
        p = _eval(SMALL, 1 << 18, chunk_tokens=chunk, **CPU)
        totals.append(p["total_gib"])
        caches.append(p["components_gib"]["carried_caches"])
        kda.append(p["working_sets_gib"]["kda_forward"])
    assert totals == sorted(totals, reverse=True) and totals[0] > 15 * totals[-1]
    assert kda[1] == pytest.approx(4 * kda[2], rel=1e-3)  # a KDA layer's working set: linear in the chunk
    assert caches[-1] == pytest.approx(caches[-2], rel=0.02)  # the caches: the window's, whatever the chunk
    last = _eval(SMALL, 1 << 18, chunk_tokens=1 << 6, **CPU)["components_gib"]
    assert last["carried_caches"] == max(last.values())
    assert last["carried_caches"] > 0.8 * totals[-1]  # the window's caches: nearly all that is left


def test_eval_carried_dsa_latents_grow_linearly_with_the_window():
    """At a fixed chunk the last chunk holds the window's latents (the cache handed in and the one built): every
    doubling of L adds the same bytes per added token (R a, twice, per DSA layer)."""
    R, kp, dI = SMALL.kv_lora_rank, SMALL.index_kpool, SMALL.index_head_dim
    n_dsa = SMALL.layer_types.count("indexed_attention")
    got = [_eval(SMALL, L, chunk_tokens=1024, **CPU)["components_gib"]["carried_caches"] * 2**30
           for L in (1 << 16, 1 << 17, 1 << 18)]  # fmt: skip
    per_token = 2 * n_dsa * 4 * (R + dI / kp)  # fp32 latents and pooled keys, old and new cache
    assert got[1] - got[0] == pytest.approx(per_token * (1 << 16), rel=1e-3)
    assert got[2] - got[1] == pytest.approx(per_token * (1 << 17), rel=1e-3)


def test_eval_cp_divides_the_residual_streams_and_the_busiest_rank_holds_the_window():
    kw = dict(CPU, chunk_tokens=512)  # (at 1024 the sparse attention's byte-sized tile moves cp=4's peak elsewhere)
    two, four = _eval(SMALL, 1 << 16, Layout(cp=2), **kw), _eval(SMALL, 1 << 16, Layout(cp=4), **kw)
    assert two["peak_phase"].split(":")[1] == four["peak_phase"].split(":")[1]  # the same moment of a layer
    assert two["tokens_per_rank"] == 2 * four["tokens_per_rank"] == 1 << 15
    assert two["components_gib"]["residual_streams"] == pytest.approx(2 * four["components_gib"]["residual_streams"],
                                                                      rel=1e-4)  # fmt: skip
    assert four["working_sets_gib"]["cp_gather"] > 0 and two["working_sets_gib"]["cp_gather"] > 0
    # zigzag: every rank holds a late piece; its rank has as many tokens as contiguous's
    zz = _eval(SMALL, 1 << 16, Layout(cp=4), cp_layout="zigzag", **kw)
    assert zz["cp_layout"] == "zigzag" and zz["tokens_per_rank"] == four["tokens_per_rank"]


def test_eval_search_glm_512k_on_64_gpus():
    """`genoctx plan --eval --preset glm-5.3-flash --seq-len 512k --gpus 64 --gpu-memory-gib 178`: layouts that fit,
    best first; whole windows need CP (each rank's KDA layers run their piece in one call), chunks let CP=1 fit."""
    plans = P.search_layouts(GLM, 1 << 19, 64, 178.0, mode="eval")
    assert len(plans) == len(P.valid_layouts(GLM, 1 << 19, 64, mode="eval")) > 50
    fitting = [p for p in plans if p["fits"]]
    assert len(fitting) >= 5 and all(p["total_gib"] <= 178 for p in fitting)
    best = fitting[0]
    assert best["layout"] == {"dp_replicate": 1, "ep": 32, "dp_shard": 1, "cp": 64, "ep_folded": True, "world": 64}
    assert 20 < best["total_gib"] < 40 and "autocast_cache" not in best["components_gib"]
    assert best["components_gib"]["moe_dispatch"] > 0 and best["all_to_all_gib"] > 0
    assert not any(p["fits"] for p in plans if p["layout"]["cp"] == 1)  # a whole 512k window per rank: too large
    chunked = P.search_layouts(GLM, 1 << 19, 64, 178.0, mode="eval", chunk_tokens=4096)
    assert any(p["fits"] and p["layout"]["cp"] == 1 for p in chunked)
    assert chunked[0]["total_gib"] <= best["total_gib"]
    one_m = [p for p in P.search_layouts(GLM, 1 << 20, 64, 178.0, mode="eval") if p["fits"]]
    assert one_m and one_m[0]["layout"]["cp"] >= 32 and one_m[0]["total_gib"] > best["total_gib"]
    json.dumps(plans)


def test_eval_table_and_check_fits_say_eval():
    p = _eval(SMALL, 1 << 14, Layout(dp_shard=2), chunk_tokens=2048, **CPU)
    table = P.format_table([p])
    assert "mode eval, chunk 2048" in table and "recompute" not in table and "carried_caches" in table
    tight = _eval(GLM, 1 << 19, Layout(dp_replicate=2, ep=32), gpu_memory_gib=80.0)
    with pytest.raises(GenoctxError) as e:
        P.check_fits(tight)
    msg = str(e.value)
    assert "\n" not in msg and "genoctx plan --eval --gpus N" in msg and "--chunk-tokens" in msg and "--force" in msg


@pytest.mark.parametrize(
    "args,match",
    [
        (dict(chunk_tokens=0), "chunk_tokens"),
        (dict(cp_layout="diagonal"), "cp_layout"),
        (dict(layout=Layout(cp=3)), "does not split into 3"),
        (dict(layout=Layout(cp=2), cp_layout="zigzag", L=6), "does not split into 4 equal pieces of at least 3"),
        (dict(layout=Layout(ep=3)), "ep=3 does not divide"),
        (dict(dtype="fp16"), "dtype must be"),
    ],
)
def test_plan_eval_rejects_bad_arguments(args, match):
    layout = args.pop("layout", Layout())
    with pytest.raises(ValueError, match=match):
        _eval(TINY, args.pop("L", 4096), layout, **args)


def test_eval_pieces_may_be_shorter_than_a_kda_chunk():
    """genoctx eval splits a window into CP pieces of at least the conv tail (3 tokens), not a KDA chunk (16)."""
    assert _eval(TINY, 64, Layout(cp=8), **CPU)["tokens_per_rank"] == 8
    assert Layout(cp=8) in P.valid_layouts(TINY, 64, 8, mode="eval")
    assert Layout(cp=8) not in P.valid_layouts(TINY, 64, 8)


def _no_grad_peak(module, *args) -> int:
    """The largest running sum of the CPU allocator's events while ``module(*args)`` runs under ``torch.no_grad``
    (after a first call: the kernels' lazy allocations)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        module(*args)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            module(*args)
    cur = peak = 0
    for e in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
        if e.name() == "[memory]":
            cur += e.nbytes()
            peak = max(peak, cur)
    return peak


def test_eval_working_sets_match_the_allocator():
    """The per-layer no-grad working sets plan_eval adds up are what the layers allocate (tiny and cpu-small, fp32,
    2048 tokens): a KDA layer, a DSA layer without and with a cache (its returned cache included), an MoE and a
    dense MLP."""
    from genoctx.model.dsa import DeepSeekSparseAttention
    from genoctx.model.kda import KimiDeltaAttention
    from genoctx.model.moe import MLP, MoE

    T, s = 2048, PS._Sizes(a=4)
    torch.manual_seed(0)
    # tiny with a small top-k tile, so that its DSA layer peaks in the attention phase the cases below compare
    for cfg in (dataclasses.replace(TINY, indexer_tile_tokens=4096), SMALL):
        x = torch.randn(1, T, cfg.hidden_size)
        dsa, i = DeepSeekSparseAttention(cfg, 0).eval(), cfg.layer_types.index("indexed_attention")
        with torch.no_grad():
            cache = dsa(torch.randn(1, 1024, cfg.hidden_size))[1]
        dsa_want = [PE._dsa_eval(cfg, s, True, T, S)["attention"]["dsa_attention"] + PE._eval_cache(cfg, s, i, S + T, T)
                    for S in (0, 1024)]  # fmt: skip
        cases = [
            (KimiDeltaAttention(cfg).eval(), (x,), PE._kda_eval(cfg, s, 1, T), 0.02),
            (dsa, (x,), dsa_want[0], 0.12),
            (dsa, (x, cache), dsa_want[1], 0.12),
            (MoE(cfg).eval(), (x,), PE._ffn_eval(cfg, s, 1, T, 1)["moe_dispatch"], 0.03),
            (MLP(cfg.hidden_size, cfg.intermediate_size), (x,), PE._ffn_eval(cfg, s, 0, T, 1)["dense_mlp"], 0.02),
        ]
        for j, (module, args, want, rel) in enumerate(cases):
            assert _no_grad_peak(module, *args) == pytest.approx(want, rel=rel), (cfg.hidden_size, j)


def test_cli_eval_json():
    r = _cli("--eval", "--preset", "cpu-small", "--seq-len", "16k", "--gpus", "4", "--chunk-tokens", "4k",
             "--dtype", "fp32", "--format", "json")  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["mode"] == "eval" and doc["seq_len"] == 16384 and doc["layouts"]
    for p in doc["layouts"]:
        assert p["mode"] == "eval" and p["chunk_tokens"] == 4096 and p["fits"] and p["layout"]["world"] == 4
        assert set(p["components_gib"]) == set(P.EVAL_COMPONENTS)
    assert [p["total_gib"] for p in doc["layouts"]] == sorted(p["total_gib"] for p in doc["layouts"])
    want = P.plan_eval(SMALL, 16384, Layout(dp_shard=2, cp=2), gpu_memory_gib=178.0, chunk_tokens=4096, dtype="fp32")
    one = _cli("--eval", "--preset", "cpu-small", "--seq-len", "16k", "--gpus", "4", "--fsdp", "2", "--cp", "2",
               "--chunk-tokens", "4k", "--dtype", "fp32", "--format", "json")  # fmt: skip
    got = json.loads(one.stdout)["layouts"]
    assert [{k: v for k, v in p.items() if k != "time"} for p in got] == [want]  # (plus the time model's "time")
    bounds = ("compute", "memory-bound kernels", "intra-node", "inter-node", "launch")
    assert got[0]["time"]["step_s"] > 0 and got[0]["time"]["bound"] in bounds
    table = _cli("--eval", "--preset", "glm-5.3-flash", "--seq-len", "512k", "--gpus", "64")
    assert table.exit_code == 0 and "mode eval, chunk whole" in table.stdout and "components of #1" in table.stdout


@pytest.mark.parametrize(
    "args,flag",
    [
        (["--eval", "--no-recompute"], "--no-recompute"),
        (["--eval", "--offload-optimizer", "--fsdp", "2", "--gpus", "2"], "--offload-optimizer"),
        (["--eval", "--batch-size", "2"], "--batch-size"),
        (["--chunk-tokens", "1k"], "--chunk-tokens"),
        (["--eval", "--chunk-tokens", "0"], "--chunk-tokens"),
        (["--eval", "--cp-layout", "diagonal"], "--cp-layout"),
        (["--eval", "--gpus", "2", "--cp", "2", "--cp-layout", "zigzag", "--seq-len", "18"], "--ep/--fsdp/--cp"),
    ],
)
def test_cli_eval_bad_flags_exit_2_with_one_line(args, flag):
    r = _cli("--preset", "tiny", *args)
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert err.startswith("genoctx: error:") and "\n" not in err and flag in err, err


def test_fla_kda_kernel_is_planned_with_its_own_terms_on_cuda():
    """``kda_kernel="fla"`` (fla-core's Triton chunk_kda, CUDA only): the plan counts fla's saved tensors and working
    sets (counted from fla-core, unmeasured) instead of the PyTorch core's blocks; on the CPU the PyTorch core runs,
    so the plan does not change."""
    fla = dataclasses.replace(SMALL, kda_kernel="fla")
    lay = Layout()
    torch_cuda = P.plan_memory(SMALL, 1 << 16, lay, gpu_memory_gib=80.0, recompute=False)
    fla_cuda = P.plan_memory(fla, 1 << 16, lay, gpu_memory_gib=80.0, recompute=False)
    N, H, K, C = 1 << 16, SMALL.linear_num_heads, SMALL.linear_head_dim, SMALL.kda_chunk_size
    kda_layers = SMALL.layer_types.count("linear_attention")
    extra = fla_cuda["components_gib"]["activations_kda"] - torch_cuda["components_gib"]["activations_kda"]
    assert extra * P.GIB == pytest.approx(kda_layers * N * 4 * H * (K + 2 * C), rel=1e-4)  # g_cumsum, Aqk, Akk
    assert fla_cuda["working_sets_gib"]["kda_core_recompute"] != torch_cuda["working_sets_gib"]["kda_core_recompute"]
    cpu = dict(dtype="fp32", device="cpu", gpu_memory_gib=80.0)
    on_cpu = [P.plan_memory(c, 1 << 16, lay, **cpu) for c in (fla, SMALL)]
    assert on_cpu[0]["components_gib"] == on_cpu[1]["components_gib"] and on_cpu[0]["total_gib"] > 0
    with pytest.raises(ValueError, match="kda_kernel"):
        dataclasses.replace(SMALL, kda_kernel="cuda")
