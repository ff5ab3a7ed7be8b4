"""The planner counts what trains (issue 44): frozen groups hold only their weights in the frozen dtype (fp8 with
its block scales), trainable ones masters, gradients and AdamW state; LoRA adds r (in + out) per target, its FLOPs,
and the frozen tensors lose their gradient reduce-scatter. Counted independently here from the model's modules."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from genoctx.model.config import preset
from genoctx.model.groups import GROUPS, group_of
from genoctx.model.model import HybridLM
from genoctx.parallel.layout import Layout
from genoctx.plan import memory, plan_memory
from genoctx.plan.comms import step_comms
from genoctx.plan.flops import step_flops
from genoctx.plan.search import plan_with_knobs
from genoctx.plan.sizes import shard_numel
from genoctx.plan.trainable import Trainable, check_trainable, counts

TINY = preset("tiny")
L = 1024
ONE = Layout()
SHARD2 = Layout(dp_replicate=1, ep=1, dp_shard=2, cp=1)
with torch.device("meta"):
    _MODEL = HybridLM(TINY)
PARAMS = dict(_MODEL.named_parameters())
MODS = dict(_MODEL.named_modules())


def _matmul(name: str) -> bool:
    """An fp8 / LoRA target as the issue names them: a Linear of a mixer or MLP (not the router), a routed expert."""
    parts, mod = name.split("."), name.rsplit(".", 1)[0]
    if not (parts[0] == "layers" and parts[2] in ("self_attn", "mlp")):
        return False
    if ".mlp.experts." in name:
        return True
    return isinstance(MODS[mod], nn.Linear) and name.endswith(".weight") and not mod.endswith("mlp.gate")


def _local(p, lay: Layout) -> int:
    """Elements of one dense parameter on a rank of ``lay``: FSDP2's padded dim-0 shard."""
    rows = p.shape[0] if p.dim() else 1
    return sum(shard_numel([("dense", rows, p.numel() // max(1, rows), 1)], lay).values())


def _frozen_bytes(groups: set, dtype: str) -> int:
    out = 0
    for name, p in PARAMS.items():
        if group_of(name, TINY.layer_types) in groups:
            continue
        if dtype == "fp8" and _matmul(name):
            lead = p.shape[0] if p.dim() == 3 else 1
            out += p.numel() + 4 * lead * math.ceil(p.shape[-2] / 128) * math.ceil(p.shape[-1] / 128)
        else:
            out += 2 * p.numel()
    return out


def _held(tr: str, rank: int = 0, dtype: str = "bf16", layout: Layout = ONE):
    st = memory._step(TINY, L, layout, True, False, 1, "bf16", "cuda", None)
    t = check_trainable(tr, rank, dtype)
    if not t.default:
        from genoctx.plan.trainable import param_entries

        st = memory.dataclasses.replace(st, tr=t, entries=tuple(param_entries(TINY, t)))
    return memory._held(st)


def test_all_is_todays_plan_memory_comms_flops():
    base = plan_memory(TINY, L, SHARD2, gpu_memory_gib=80)
    assert plan_memory(TINY, L, SHARD2, gpu_memory_gib=80, trainable="all", frozen_dtype="fp8") == base
    assert "trainable" not in base
    assert step_comms(TINY, L, SHARD2, trainable=Trainable()) == step_comms(TINY, L, SHARD2)
    assert step_flops(TINY, L, SHARD2, trainable=Trainable()) == step_flops(TINY, L, SHARD2)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_frozen_groups_cost_their_weights_in_the_frozen_dtype_and_nothing_else(dtype):
    groups = {"kda", "mhc"}
    full, part = _held("all"), _held("kda,mhc", dtype=dtype)
    trained = sum(p.numel() for n, p in PARAMS.items() if group_of(n, TINY.layer_types) in groups)
    frozen = _frozen_bytes(groups, dtype)
    assert 0 < trained < full.P_local
    assert part.P_local == trained and part.frozen == frozen
    assert part.weights == 4 * trained + frozen  # masters of what trains, the frozen weights (and scales)
    assert part.optimizer_state == 8 * trained and part.grad_bytes == 4
    assert counts(TINY, check_trainable("kda,mhc", 0, dtype))["frozen_bytes"] == frozen
    if dtype == "fp8":  # 1 byte per matmul element plus a 4-byte scale per 128 x 128 block: below bf16
        assert frozen < _frozen_bytes(groups, "bf16")


def test_frozen_weights_shard_as_fsdp2_and_the_plan_reports_them():
    part = _held("kda", dtype="bf16", layout=SHARD2)
    want = sum(2 * _local(p, SHARD2) for n, p in PARAMS.items() if group_of(n, TINY.layer_types) != "kda")
    assert part.frozen == want
    p = plan_memory(TINY, L, SHARD2, gpu_memory_gib=80, trainable="kda")
    assert p["trainable"]["trainable"] == "kda" and p["trainable_params_per_rank"] == part.P_local
    assert p["persistent_gib"]["frozen"] == round(want / 2**30, 6)


def test_lora_adds_r_in_plus_out_per_target_one_adapter_per_expert():
    """The default targets are what training adapts: the adapters ``apply_lora`` builds on the same model, which hold
    r (in + out) per target, one adapter per expert."""
    from genoctx.model.lora import apply_lora, is_lora_name

    r = 4
    adapted = HybridLM(TINY, seed=0)
    targets = apply_lora(adapted, r, 8.0)
    want = sum(p.numel() for n, p in adapted.named_parameters() if is_lora_name(n))
    formula = 0
    for name in targets:
        p = PARAMS[name if ".mlp.experts." in name else f"{name}.weight"]
        formula += r * (p.shape[-1] + p.shape[-2]) * (p.shape[0] if ".mlp.experts." in name else 1)
    assert formula == want
    c = counts(TINY, check_trainable("lora", r, "fp8"))
    assert c["params_lora"] == c["params_trainable"] == want > 0
    assert c["params_frozen"] == sum(p.numel() for p in PARAMS.values())
    assert _held("lora", r, "fp8").P_local == want
    both = counts(TINY, check_trainable("lora,norms", r, "bf16"))
    norms = sum(p.numel() for n, p in PARAMS.items() if group_of(n, TINY.layer_types) == "norms")
    assert both["params_trainable"] == want + norms
    with pytest.raises(ValueError, match="lora"):
        check_trainable("lora", 0, "bf16")
    with pytest.raises(ValueError, match="frozen_dtype"):
        check_trainable("kda", 0, "fp4")


def test_lora_flops_are_2r_in_plus_out_per_token_per_target_forward_3x_with_backward():
    r, n = 8, L
    # every group trains too (so every input needs a gradient), and adapters on the KDA layers' q_proj only
    tr = check_trainable(",".join(GROUPS) + ",lora", r, "bf16", ("q_proj",))
    base = step_flops(TINY, L, ONE, recompute=False)
    lora = step_flops(TINY, L, ONE, recompute=False, trainable=tr)
    q = [p for name, p in PARAMS.items() if name.endswith("self_attn.q_proj.weight")]
    want = sum(3 * 2 * n * r * (p.shape[0] + p.shape[1]) for p in q)
    assert len(q) > 0 and lora["total"] - base["total"] == pytest.approx(want)
    comp = lora["components"]["attention_projections"]
    assert comp["forward"] - base["components"]["attention_projections"]["forward"] == pytest.approx(want / 3)


def test_comms_lose_the_reduce_scatter_of_frozen_tensors():
    def by_name(c):
        return {e["name"]: e for e in c}

    full = by_name(step_comms(TINY, L, SHARD2))
    kda = by_name(step_comms(TINY, L, SHARD2, trainable=check_trainable("kda", 0, "bf16")))
    kda_numel = sum(_local(p, SHARD2) for n, p in PARAMS.items() if group_of(n, TINY.layer_types) == "kda")
    rs = kda["fsdp_reduce_scatter"]
    assert rs["payload_bytes"] == 2 * 4 * kda_numel  # the reduce-scatter input: the kda tensors' gradients only
    assert rs["payload_bytes"] < full["fsdp_reduce_scatter"]["payload_bytes"]
    n_kda = TINY.layer_types.count("linear_attention")
    assert rs["calls"] == n_kda  # one group per KDA mixer (its fp32 island); no other group has a gradient
    assert kda["dp_all_reduce"]["calls"] == n_kda
    # nothing trains but the adapters: frozen fp8 weights gather less than bf16, bf16 no more than full training
    gathers = {}
    for dt in ("bf16", "fp8"):
        c = by_name(step_comms(TINY, L, SHARD2, trainable=check_trainable("lora", 4, dt)))
        gathers[dt] = c["fsdp_all_gather_forward"]["payload_bytes"]
    assert gathers["fp8"] < gathers["bf16"]


def test_knobs_auto_considers_the_chunked_backward_when_nothing_fits_in_one_pass():
    L2, lay = 1 << 17, ONE
    kw = dict(trainable="lora", lora_rank=4, frozen_dtype="fp8", device="cpu")
    one = min(
        plan_memory(TINY, L2, lay, gpu_memory_gib=1e3, offload_activations=o, **kw)["total_gib"] for o in (False, True)
    )
    chunked = plan_memory(TINY, L2, lay, gpu_memory_gib=1e3, seq_chunk_tokens=1 << 16, **kw)["total_gib"]
    assert chunked < one
    mem = (one + chunked) / 2
    assert not plan_with_knobs(TINY, L2, lay, gpu_memory_gib=mem, **kw)["fits"]
    p = plan_with_knobs(TINY, L2, lay, gpu_memory_gib=mem, seq_chunks=(1 << 16, 1 << 14), **kw)
    assert p["fits"] and p["seq_chunk_tokens"] == 1 << 16


def test_cli_plan_trainable_flags():
    from typer.testing import CliRunner

    from genoctx.cli import app

    args = ["plan", "--preset", "tiny", "--seq-len", "1k", "--gpus", "2", "--fsdp", "2", "--gpu-memory-gib", "8"]
    r = CliRunner().invoke(app, [*args, "--trainable", "lora,norms", "--lora-rank", "4", "--frozen-dtype", "fp8",
                                 "--format", "json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    p = json.loads(r.output)["layouts"][0]
    assert p["trainable"]["trainable"] == "norms,lora" and p["trainable"]["lora_rank"] == 4
    assert p["trainable"]["frozen_dtype"] == "fp8" and p["time"]["step_s"] > 0
    bad = CliRunner().invoke(app, [*args, "--trainable", "lora,bogus"])
    assert bad.exit_code != 0 and "bogus" in bad.output


@pytest.mark.parametrize(
    ("spec", "rank", "dtype"), [("lora", 4, "fp8"), ("kda,norms", 0, "bf16"), ("lora,mhc", 2, "bf16")]
)
def test_memory_and_comms_gather_the_same_frozen_and_trainable_bytes(spec, rank, dtype):
    """The all-gathered layer the memory plan holds equals what comms' FSDP groups gather (up to FSDP2's padding)."""
    from genoctx.plan.comms import fsdp_groups
    from genoctx.plan.trainable import param_entries

    tr = check_trainable(spec, rank, dtype)
    entries = tuple(param_entries(TINY, tr))
    st = memory._step(TINY, L, SHARD2, True, False, 1, "bf16", "cuda", None)
    layers = memory._layers(memory.dataclasses.replace(st, tr=tr, entries=entries))
    groups = fsdp_groups(TINY, SHARD2, "bf16", entries)
    for i, x in enumerate(layers):
        gathered = 2 * sum(g["gather_bytes"] for g in groups if g["layer"] == i)  # 2 shards, each a padded piece
        assert x["block_bytes"] == pytest.approx(gathered, rel=0.01)
    full = memory._layers(st)
    assert all(x["dequant"] == 0 for x in full) and (dtype != "fp8" or all(x["dequant"] > 0 for x in layers))


@pytest.mark.parametrize(
    "name,seq_len,hardware", [("hg38-512k-node", 1 << 19, "h100"), ("hg38-1m-node", 1 << 20, "b200")]
)
def test_one_node_recipes_fit_their_node(name, seq_len, hardware):
    """``recipes/hg38-{512k,1m}-node.yaml`` (issue 44) are the planner's fitting rows of the one-node commands: their
    layout (8 workers), knobs and what trains, planned for GLM-5.3-Flash (the base the recipes load) on their
    hardware profile, fit the GPU and the host memory."""
    from pathlib import Path

    from genoctx.plan.hardware import load_hardware
    from genoctx.recipes import load_recipe

    rec = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / f"{name}.yaml")
    t, hw = rec.train, load_hardware(hardware)
    assert rec.init == "zai-org/GLM-5.3-Flash" and (t.trainable, t.frozen_dtype) == ("lora", "fp8")
    layout = Layout(ep=t.ep, dp_shard=t.fsdp, cp=t.cp, ep_folded=t.ep_folded)
    assert layout.world == 8
    plan = plan_memory(preset("glm-5.3-flash"), seq_len, layout, gpu_memory_gib=hw.memory_gib,
                       host_memory_gib=hw.host_memory_gib, recompute=t.activation_checkpointing,
                       optimizer_offload=t.offload_optimizer, offload_activations=t.offload_activations,
                       optimizer_state_dtype=t.optimizer_state_dtype, seq_chunk_tokens=t.seq_chunk_tokens,
                       trainable=t.trainable, lora_rank=t.lora_rank, frozen_dtype=t.frozen_dtype,
                       loss_chunk_tokens=rec.loss.chunk_tokens)  # fmt: skip
    assert plan["fits"] and plan["host_fits"] is not False, (plan["total_gib"], plan["host_gib"])
    assert plan["total_gib"] <= hw.memory_gib and plan["trainable"]["params_lora"] > 0


def test_a_plan_that_does_not_fit_says_what_it_is_short_of():
    """The table's line under a row that does not fit names GPU memory or host memory with the numbers (issue 44: a
    frozen-groups run that fits the GPU but not the host must not read as a GPU that is too small)."""
    from genoctx.plan.report import format_table, short_of

    tr = dict(trainable="kda,dsa,indexer,router,mhc,norms", frozen_dtype="fp8")
    ok = plan_memory(TINY, L, SHARD2, gpu_memory_gib=80.0, **tr)
    gpu = plan_memory(TINY, L, SHARD2, gpu_memory_gib=ok["total_gib"] / 2, **tr)
    host = plan_memory(TINY, L, SHARD2, gpu_memory_gib=80.0, optimizer_offload=True, host_memory_gib=1e-9, **tr)
    assert ok["fits"] and not gpu["fits"] and gpu["host_fits"] is None
    assert not host["fits"] and host["host_fits"] is False and host["total_gib"] <= 80.0
    need, have = gpu["total_gib"], gpu["gpu_memory_gib"]
    assert short_of(gpu) == (f"#1 does not fit: short of GPU memory: needs {need:.1f} GiB per GPU, {have:g} GiB "
                             f"available ({need - have:.1f} short)")  # fmt: skip
    assert short_of(host).startswith("#1 does not fit: short of host memory: needs ") and "GPU memory" not in short_of(
        host
    )  # fmt: skip
    assert f"needs {host['host_gib']:.1f} GiB per GPU, 1e-09 GiB available" in short_of(host)
    assert f"({short_of(host)})" in format_table([host]) and "does not fit" not in format_table([ok])


FP8_LAYOUTS = [Layout(dp_shard=4), Layout(dp_shard=2, cp=2), Layout(ep=2, dp_shard=2, cp=2, ep_folded=True)]


@pytest.mark.parametrize("layout", FP8_LAYOUTS, ids=["fsdp4", "fsdp2-cp2", "fep2-cp2"])
def test_fp8_frozen_held_whole_per_rank_and_never_gathered(layout):
    """Frozen fp8 matmul weights are ``FP8Weight`` buffers (issue 44): with ``dp_shard``/``cp`` > 1 a dense one is held
    whole on every rank and the routed experts' stack by EP alone (``E / ep``, not cut by the expert shard), and
    FSDP2 all-gathers none of it: the layer's gathered block and comms' gather bytes lose exactly the bf16 bytes of
    the matmul weights, the dequantized working set is one matrix (one expert's), and the frozen bf16 rest stays
    FSDP-sharded. Counted here from the model's parameters, not from the planner's tables."""
    from genoctx.plan.comms import fsdp_groups
    from genoctx.plan.trainable import param_entries

    ep = layout.ep
    want_fp8 = want_bf16 = 0  # bytes per rank
    gathered_mm = {}  # layer -> bf16 elements of its matmul weights once all-gathered (experts: E / ep)
    largest = {}  # layer -> elements of the largest matrix one use dequantizes
    for name, p in PARAMS.items():
        if _matmul(name):
            expert = p.dim() == 3
            lead = p.shape[0] // ep if expert else 1
            blocks = math.ceil(p.shape[-2] / 128) * math.ceil(p.shape[-1] / 128)
            want_fp8 += lead * (p.shape[-2] * p.shape[-1] + 4 * blocks)
            i = int(name.split(".")[1])
            gathered_mm[i] = gathered_mm.get(i, 0) + p.numel() // (ep if expert else 1)
            largest[i] = max(largest.get(i, 0), p.shape[-2] * p.shape[-1])
        else:  # LoRA alone: every other tensor frozen in bf16, FSDP2's padded dim-0 shard
            rows = p.shape[0] if p.dim() else 1
            kind = "expert" if ".mlp.experts." in name else "dense"
            want_bf16 += 2 * sum(shard_numel([(kind, rows, p.numel() // max(1, rows), 1)], layout).values())
    held = _held("lora", 4, "fp8", layout)
    assert held.fp8_held == want_fp8 and held.frozen == want_fp8 + want_bf16
    whole_dense = sum(p.numel() for n, p in PARAMS.items() if _matmul(n) and p.dim() == 2)
    assert want_fp8 > whole_dense  # a dense matrix is whole on this rank: not 1 / dp_shard of it
    plan = plan_memory(TINY, L, layout, gpu_memory_gib=80, trainable="lora", lora_rank=4, frozen_dtype="fp8")
    assert plan["persistent_gib"]["frozen"] == round((want_fp8 + want_bf16) / 2**30, 6)

    st = memory._step(TINY, L, layout, True, False, 1, "bf16", "cuda", None)
    lay = {}
    for dtype in ("bf16", "fp8"):
        tr = check_trainable("lora", 4, dtype)
        entries = tuple(param_entries(TINY, tr))
        lay[dtype] = memory._layers(memory.dataclasses.replace(st, tr=tr, entries=entries))
        lay[dtype + "_groups"] = fsdp_groups(TINY, layout, "bf16", entries)
    shards = {g["name"]: g["shards"] for g in lay["bf16_groups"]}
    for i, (b, f) in enumerate(zip(lay["bf16"], lay["fp8"], strict=True)):
        assert b["block_bytes"] - f["block_bytes"] == pytest.approx(2 * gathered_mm[i], rel=0.01)  # bf16 padding
        assert f["dequant"] == 2 * largest[i] and b["dequant"] == 0  # one matrix (one expert's) in bf16
        gb = sum(g["gather_bytes"] * g["shards"] for g in lay["bf16_groups"] if g["layer"] == i)
        gf = sum(g["gather_bytes"] * shards[g["name"]] for g in lay["fp8_groups"] if g["layer"] == i)
        assert gb - gf == pytest.approx(2 * gathered_mm[i], rel=0.01)  # the gathers carry no fp8 byte


def test_fp8_offloaded_holders_pinned_on_host_and_fetched_per_use():
    """``optimizer_offload`` with fp8 frozen weights (issue 44): the holders live in pinned host memory (each weight
    and each scale one pinned block, rounded to a power of two as ``pinned_block_bytes`` does) instead of the GPU,
    and every use copies them to the device: once in forward, once in the recompute, once in backward per model call
    (chunked: each chunk's call, plus its forward without graph), the copies the time model exposes in full."""
    from genoctx.plan.hardware import load_hardware
    from genoctx.plan.time import host_seconds, plan_time

    lay = Layout(dp_shard=2, cp=2)
    kw = dict(gpu_memory_gib=80, trainable="lora", lora_rank=4, frozen_dtype="fp8")
    on, off = plan_memory(TINY, L, lay, optimizer_offload=True, **kw), plan_memory(TINY, L, lay, **kw)
    held = _held("lora", 4, "fp8", lay)
    gpu = {"on": on["components_gib"]["weights"], "off": off["components_gib"]["weights"]}  # GPU, at the peak
    assert gpu["off"] > held.fp8_held / 2**30 and gpu["on"] == 0.0  # resident on the GPU, or not at all
    assert on["host_gib"] > off["host_gib"] == 0.0
    pinned = 0.0
    for name, p in PARAMS.items():
        if _matmul(name):
            lead = p.shape[:1] if p.dim() == 3 else ()
            blocks = math.ceil(p.shape[-2] / 128) * math.ceil(p.shape[-1] / 128)
            pinned += memory.pinned_block_bytes(math.prod(p.shape))  # whole: ep = 1
            pinned += memory.pinned_block_bytes(4 * (lead[0] if lead else 1) * blocks)
    st = memory.dataclasses.replace(memory._step(TINY, L, lay, True, True, 1, "bf16", "cuda", None),
                                    tr=check_trainable("lora", 4, "fp8"))  # fmt: skip
    st = memory.dataclasses.replace(st, entries=tuple(memory.param_entries(TINY, st.tr)))
    fp8_pinned = memory._pinned_optimizer_offload(st) - memory._pinned_optimizer_offload(
        memory.dataclasses.replace(st, entries=tuple(e for e in st.entries if not e["fp8"])))  # fmt: skip
    assert fp8_pinned == pinned
    moved = on["host_device_bytes"]
    assert moved["frozen_fp8"] == 3 * held.fp8_held and off["host_device_bytes"]["frozen_fp8"] == 0.0
    chunked = plan_memory(TINY, L, lay, optimizer_offload=True, seq_chunk_tokens=128, **kw)  # 512 / 128: 4 calls
    assert chunked["host_device_bytes"]["frozen_fp8"] == 4 * 4 * held.fp8_held
    norec = plan_memory(TINY, L, lay, optimizer_offload=True, recompute=False, **kw)
    assert norec["host_device_bytes"]["frozen_fp8"] == 2 * held.fp8_held
    hw = load_hardware("h100")
    t = plan_time(TINY, L, lay, hw, recompute=True, trainable=check_trainable("lora", 4, "fp8"))
    bw = hw.host_device_bytes_per_s * hw.efficiency["host_copy"]
    without = {**on, "host_device_bytes": {**moved, "frozen_fp8": 0.0, "to_device": moved["to_device"]
                                           - moved["frozen_fp8"]}}  # fmt: skip
    extra = host_seconds(on, t, hw)["copies"] - host_seconds(without, t, hw)["copies"]
    assert extra == pytest.approx(moved["frozen_fp8"] / bw, rel=1e-9)
