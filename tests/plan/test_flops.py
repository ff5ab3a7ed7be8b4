"""The FLOPs formulas (``genoctx.plan.flops``) equal what ``torch.utils.flop_counter.FlopCounterMode`` counts on real
train steps of the PyTorch path (CPU, fp32), forward and forward + backward (recomputation included), per component
where the module breakdown separates them; and the CP / EP accounting of the busiest rank, by value."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from genoctx.data.tokenizer import BOS
from genoctx.model import dsa, kda
from genoctx.model.config import DSA, preset
from genoctx.model.lora import apply_lora
from genoctx.model.model import shift_inputs, token_losses
from genoctx.parallel.build import build_model
from genoctx.parallel.layout import Layout
from genoctx.plan import flops
from genoctx.plan.flops import PUBLISHED_SKEW, eval_flops, flops_per_token, step_flops
from genoctx.plan.trainable import Trainable
from genoctx.train.chunked import chunked_forward_backward
from genoctx.train.loop import freeze_untrained


def _conv_backward(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
                   _output_padding, _groups, output_mask, out_shape, **kwargs):  # fmt: skip
    """FlopCounterMode's ``convolution_backward`` counts a grouped (depthwise) convolution's weight gradient as a dense
    one (``groups`` ignored: ``3 H K`` times too many for KDA's short convolution). Each gradient costs what the
    forward does."""
    return conv_flop_count(x_shape, w_shape, grad_out_shape, transposed) * (bool(output_mask[0]) + bool(output_mask[1]))


def _sdpa_cpu(query_shape, key_shape, value_shape, *args, **kwargs):
    """FlopCounterMode has no formula for the CPU SDPA kernel (dense DSA attention): ``QK^T`` and ``PV``, every
    query against every key (masks not discounted, as for the CUDA kernels); key heads broadcast (GQA)."""
    B, H, Sq, Dq = query_shape
    return 2 * B * H * Sq * key_shape[-2] * (Dq + value_shape[-1])


def _sdpa_cpu_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, **kwargs):
    """Its backward: 2.5x the forward (scores recomputed, then dV, dP, dQ, dK), FlopCounterMode's rule for the CUDA
    kernels."""
    return _sdpa_cpu(query_shape, key_shape, value_shape) * 5 // 2


class _ByDtype(FlopCounterMode):
    """``_counter()``'s FlopCounterMode that also sums each op's FLOPs by the dtype of its first tensor operand
    (``by_dtype``): the unit a GEMM ran on."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.by_dtype: dict = {}

    def _count_flops(self, func_packet, out, args, kwargs):
        if func_packet in self.flop_registry:
            n = self.flop_registry[func_packet](*args, **kwargs, out_val=out)
            dt = next(a.dtype for a in args if isinstance(a, torch.Tensor))
            self.by_dtype[dt] = self.by_dtype.get(dt, 0) + n
        return super()._count_flops(func_packet, out, args, kwargs)


def _counter(by_dtype: bool = False) -> FlopCounterMode:
    aten = torch.ops.aten
    return (_ByDtype if by_dtype else FlopCounterMode)(display=False, custom_mapping={
        aten.convolution_backward: _conv_backward,
        aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward,
    })  # fmt: skip


def _count(name: str, L: int, ac: bool, chunk: int | None = None, bf16: bool = False, trainable: str = "all",
           lora_rank: int = 0, **overrides) -> tuple:  # fmt: skip
    """One train step of ``forward_backward``'s one-process objective, counted: (cfg, forward counter, backward
    counter); the chunked backward (``chunk``) counted whole in the second. ``bf16``: the forward under bf16
    autocast (``train.dtype: bf16``), the counters also by operand dtype. ``trainable``, ``lora_rank``: what the
    loop trains (``apply_lora`` with the default targets, then ``freeze_untrained``)."""
    torch.manual_seed(0)
    cfg = preset(name, kernels="torch", kda_kernel="torch", **overrides)
    model = build_model(cfg, activation_checkpointing=ac)
    if lora_rank:
        apply_lora(model, lora_rank, 2.0 * lora_rank)
    freeze_untrained(model, trainable)
    tokens = torch.randint(0, 4, (1, L))
    inputs, scored = shift_inputs(tokens, BOS), torch.ones(1, L, dtype=torch.bool)
    if chunk is not None:
        with _counter() as both:
            chunked_forward_backward(model, inputs, tokens, scored, chunk, scored.sum())
        return cfg, None, both
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    with _counter(bf16) as fwd, autocast:
        logits, _ = model(inputs)
        loss = token_losses(logits, tokens, scored).sum() / L
        aux = model.aux_loss()
        loss = loss if aux is None else loss + aux
    with _counter(bf16) as bwd:
        loss.backward()
    return cfg, fwd, bwd


def _module(counts: dict, name: str, ops: tuple[str, ...] | None = None) -> int:
    """FLOPs counted inside module ``name`` (under ``HybridLM``), of the ops named in ``ops`` (all when None)."""
    found = counts.get(f"HybridLM.{name}", {}).items()
    return sum(v for op, v in found if ops is None or str(op).split(".")[-1] in ops)


def _forward_by_component(cfg, counts: dict) -> dict:
    """The counted forward per component (module breakdown; the mHC products run in the layer itself)."""
    out = dict.fromkeys(("dense_mlp", "experts", "kda_core", "mhc", "mixers_rest", "lm_head_loss"), 0)
    out["lm_head_loss"] = _module(counts, "lm_head")
    for i, kind in enumerate(cfg.layer_types):
        lay = f"layers.{i}"
        mlp = _module(counts, f"{lay}.mlp")
        if cfg.mlp_layer_types[i] == "dense":
            out["dense_mlp"] += mlp
        else:
            out["dense_mlp"] += _module(counts, f"{lay}.mlp.shared_experts")
            out["experts"] += _module(counts, f"{lay}.mlp.gate") + _module(counts, f"{lay}.mlp.experts")
        attn = _module(counts, f"{lay}.self_attn")
        if kind == DSA:
            out["mixers_rest"] += attn
        else:
            out["kda_core"] += _module(counts, f"{lay}.self_attn", ("bmm", "baddbmm"))
            out["mixers_rest"] += _module(counts, f"{lay}.self_attn", ("mm", "convolution"))
        out["mhc"] += _module(counts, lay) - attn - mlp
    return out


CASES = [("tiny", L, ac) for L in (64, 128, 256) for ac in (False, True)]
CASES += [("cpu-small", L, ac) for L in (128, 256, 512) for ac in (False, True)]


@pytest.mark.parametrize("name,L,ac", CASES)
def test_step_flops_equal_flop_counter(name, L, ac):
    """tiny (top-16 tokens, KDA chunk 16) at 64/128/256 and cpu-small (top-256, chunk 64) at 128/256/512: the top-k
    active in the longer ones, KDA over 2 to 16 chunks. Forward per component and the whole step (forward, layer
    recompute with ``ac``, the always-on KDA/MoE recompute, backward) within 1 % (measured: equal)."""
    cfg, fwd, bwd = _count(name, L, ac)
    plan = step_flops(cfg, L, recompute=ac)
    c = plan["components"]
    f_total = fwd.get_total_flops()
    assert plan["forward"] == pytest.approx(f_total, rel=0.01)
    assert plan["total"] == pytest.approx(f_total + bwd.get_total_flops(), rel=0.01)
    counted = _forward_by_component(cfg, fwd.get_flop_counts())
    for key in ("dense_mlp", "experts", "kda_core", "mhc", "lm_head_loss"):
        assert c[key]["forward"] == pytest.approx(counted[key], rel=0.01), key
    rest = sum(c[k]["forward"] for k in ("attention_projections", "dsa_indexer", "dsa_attention"))
    assert rest == pytest.approx(counted["mixers_rest"], rel=0.01)
    # the DSA layer's own products beyond its projection modules, less the absorbed q / output maps and the indexer's
    # compress gate (F.linear in the layer): attention, indexer scoring and KL
    i = cfg.layer_types.index(DSA)
    own = _module(fwd.get_flop_counts(), f"layers.{i}.self_attn") - sum(
        _module(fwd.get_flop_counts(), f"layers.{i}.self_attn.{m}")
        for m in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "indexer.wq_b", "indexer.wk",
                  "indexer.weights_proj")
    )  # fmt: skip
    absorbed = 2 * L * cfg.num_attention_heads * cfg.kv_lora_rank * (cfg.qk_head_dim + cfg.v_head_dim)
    gate = 2 * L * cfg.hidden_size * cfg.index_head_dim
    attention, indexer = c["dsa_attention"]["forward"], c["dsa_indexer"]["forward"]
    assert attention + indexer == pytest.approx(own - absorbed - gate, rel=0.01)
    assert indexer > 0.05 * (attention + indexer) and attention > 0.05 * (attention + indexer)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(indexer_stage="warmup", dsa_mode="dense"),  # the indexer warm-up: dense attention, KL over every pool
        # a shared DSA layer, KDA blocks of 48 tokens, MoE chunks of 50, no indexer KL
        dict(
            num_hidden_layers=3,
            layer_types="KDD",
            mlp_layer_types="DSS",
            indexer_types="FFS",
            indexer_stage="off",
            kda_block_tokens=48,
            moe_chunk_tokens=50,
        ),
    ],
)
def test_step_flops_equal_flop_counter_variants(overrides):
    """tiny at 136 tokens (not a multiple of the KDA chunk), activation checkpointing on."""
    cfg, fwd, bwd = _count("tiny", 136, True, **overrides)
    plan = step_flops(cfg, 136, recompute=True)
    assert plan["forward"] == pytest.approx(fwd.get_total_flops(), rel=0.01)
    assert plan["total"] == pytest.approx(fwd.get_total_flops() + bwd.get_total_flops(), rel=0.01)


def test_units_are_the_dtypes_a_bf16_step_runs():
    """Each product's unit (``step_flops``' ``units``, the table in ``genoctx.plan.flops``) is the dtype it runs in:
    a bf16-autocast train step of tiny (recomputed, 128 tokens: top-k and indexer KL active; the PyTorch kernels)
    counted by operand dtype equals the plan's FLOPs per ``unit_dtype(unit, "bf16")``, bf16 and fp32 alike. The
    indexer's scoring and KL, the router, the mHC, the KDA core and conv and the PyTorch sparse attention are fp32."""
    from genoctx.plan.time import unit_dtype

    cfg, fwd, bwd = _count("tiny", 128, True, bf16=True)
    plan = step_flops(cfg, 128, recompute=True)
    want = {"bf16": 0.0, "fp32": 0.0}
    for c in plan["components"].values():
        assert sum(c["units"].values()) == pytest.approx(c["forward"] + c["recompute"] + c["backward"])
        for unit, f in c["units"].items():
            want[unit_dtype(unit, "bf16")] += f
    counted = {dt: fwd.by_dtype.get(dt, 0) + bwd.by_dtype.get(dt, 0) for dt in (torch.bfloat16, torch.float32)}
    assert set(fwd.by_dtype) | set(bwd.by_dtype) == {torch.bfloat16, torch.float32}
    assert counted[torch.float32] == pytest.approx(want["fp32"], rel=0.01)
    assert counted[torch.bfloat16] == pytest.approx(want["bf16"], rel=0.01)
    units = {k: set(c["units"]) for k, c in plan["components"].items()}
    assert units["dsa_indexer"] == units["kda_core"] == units["mhc"] == units["dsa_attention"] == {"fp32"}
    assert units["dense_mlp"] == units["lm_head_loss"] == {"run"} and units["experts"] == {"run", "fp32"}
    # on a GPU: the Triton sparse attention runs in the compute dtype, fla's core in bf16 and tf32; the CP state
    # pass stays genoctx's fp32 core; the chunked head of a text base in its weight's dtype (bf16 under FSDP)
    gpu = step_flops(preset("tiny", kda_kernel="fla"), 128, Layout(cp=2), recompute=True)["components"]
    assert set(gpu["dsa_attention"]["units"]) == {"run"}
    assert set(gpu["kda_core"]["units"]) == {"fp32", "tf32", "run_tf32"}
    base = preset("tiny", vocab_size=64)
    assert set(step_flops(base, 128)["components"]["lm_head_loss"]["units"]) == {"fp32"}
    assert set(step_flops(base, 128, Layout(dp_shard=2))["components"]["lm_head_loss"]["units"]) == {"run"}
    assert set(eval_flops(base, 128)["components"]["lm_head_loss"]["units"]) == {"run"}


SUBSETS = [("kda,dsa,indexer,router,mhc,norms", 0), ("lora", 4), ("lora,embed,norms", 4), ("head", 0),
           ("norms", 0), ("experts", 0)]  # fmt: skip


@pytest.mark.parametrize("name,L,ac", [("tiny", 128, False), ("cpu-small", 256, True)])
@pytest.mark.parametrize("spec,r", SUBSETS, ids=[s.replace(",", "+") for s, _ in SUBSETS])
def test_frozen_and_lora_steps_equal_flop_counter(spec, r, name, L, ac):
    """What trains changes what the backward runs, and the plan counts what runs (FlopCounterMode, equal to the
    FLOP): a frozen weight's product computes only its input's gradient (one product, not two), and nothing where
    the input needs none either (the layers before the first trainable tensor: no backward, and no recompute of
    their checkpoints); the indexer's weight gradients only when it trains (its k_norm is ``norms``); LoRA's
    ``x A^T`` two products backward where ``x`` needs a gradient, one where it does not; ``kv_b_proj``'s adapter
    merged once per call (``W + s B A``). Measured: a frozen-everything-but-``head`` step's backward is the head's
    weight gradient alone."""
    cfg, fwd, bwd = _count(name, L, ac, trainable=spec, lora_rank=r)
    plan = step_flops(cfg, L, recompute=ac, trainable=Trainable(spec, r))
    assert plan["forward"] == fwd.get_total_flops()
    assert plan["total"] == fwd.get_total_flops() + bwd.get_total_flops()
    full = step_flops(cfg, L, recompute=ac)
    assert plan["backward"] < full["backward"] or r  # frozen weights: fewer backward products (LoRA adds its own)
    if spec == "head":  # nothing before the head needs a gradient: dW of lm_head only, no recompute
        assert bwd.get_total_flops() == 2 * L * cfg.hidden_size * cfg.vocab_size and plan["recompute"] == 0


def test_frozen_chunked_step_equals_flop_counter():
    """The chunked backward of a LoRA run (no-grad sweep, then each chunk with grad and recompute)."""
    cfg, _, both = _count("tiny", 256, True, chunk=64, trainable="lora", lora_rank=4)
    plan = step_flops(cfg, 256, recompute=True, seq_chunk_tokens=64, trainable=Trainable("lora", 4))
    assert plan["total"] == both.get_total_flops()


def test_chunked_step_and_eval_equal_flop_counter():
    """The chunked backward (no-grad sweep, then each chunk again with grad and recompute) and scoring one window."""
    cfg, _, both = _count("tiny", 256, True, chunk=64)
    plan = step_flops(cfg, 256, recompute=True, seq_chunk_tokens=64)
    assert plan["total"] == pytest.approx(both.get_total_flops(), rel=0.01)
    assert plan["recompute"] > step_flops(cfg, 256, recompute=True)["recompute"]  # the sweep
    model = build_model(cfg)
    with torch.no_grad(), _counter() as ev:
        model(shift_inputs(torch.randint(0, 4, (1, 256)), BOS))
    assert eval_flops(cfg, 256)["forward"] == pytest.approx(ev.get_total_flops(), rel=0.01)


def test_context_and_expert_parallel_accounting():
    """The busiest rank under cp=2 (the window's last half) against one rank, by value (tiny, L = 256: top-16 tokens,
    every query of either half sees full selections)."""
    cfg = preset("tiny")
    L = 256
    one, two = step_flops(cfg, L, recompute=False), step_flops(cfg, L, Layout(cp=2), recompute=False)
    first_half = step_flops(cfg, L // 2, recompute=False)  # rank 0 of cp=2 runs the same calls as a window of L/2
    assert two["tokens"] == L // 2 and one["tokens"] == L
    for key in ("dense_mlp", "experts", "mhc", "lm_head_loss", "dsa_attention"):
        for phase in ("forward", "recompute", "backward"):
            assert two["components"][key][phase] == pytest.approx(one["components"][key][phase] / 2), (key, phase)
    # the indexer of the last half (positions 128..255, 64 pools of 4): top-k scoring in one row tile of 128 (the
    # code's tiles: 64 key columns, up to 256 rows) seeing 64 pools, 2 H_I (d_I + 1) per pair; the KL over 4 selected
    # pools,
    # 19 token slots (16 + 3 tail): target 2 H R W, pool scores and their gradients 3 x 2 H_I d_I Kp, the head sum and
    # its gradient 2 x 2 H_I Kp
    scoring = 2 * 2 * 9 * (128 * 64)
    kl = 2 * 128 * (2 * 16 * 19 + 3 * 2 * 8 * 4 + 2 * 2 * 4)
    idx = [x["components"]["dsa_indexer"]["forward"] for x in (one, two, first_half)]
    assert idx[1] == scoring + kl and idx[1] > idx[2] and idx[1] >= idx[0] / 2  # (one tile: exactly half)
    # KDA under CP: the layer's core over 128 tokens, the [L | M] state pass (values V + K wide), the fold of 2 pieces
    # C 16, sub 8, K = V = 8; the two rows' scores inside sub-chunks 4 C sub K, between them 4 C C K
    chunk = 4 * 16 * 8 * (8 + 16) + 4 * 16 * 8 * 8 + 2 * 16 * 16 * 8 + 2 * 8 * 16 * 8
    chunk_lm = 4 * 16 * 8 * (8 + 16) + 4 * 16 * 8 * 16 + 2 * 16 * 16 * 16 + 2 * 8 * 16 * 16  # V + K = 16
    fold = 2 * 2 * (2 * 8 * 8 * 8)  # 2 pieces x [K, K] @ [K, V] x 2 heads
    assert one["components"]["kda_core"]["forward"] == 16 * 2 * chunk
    assert two["components"]["kda_core"]["forward"] == 8 * 2 * chunk + 8 * 2 * chunk_lm + fold
    # zigzag: rank 0 holds pieces 0 and 3 of 4 and scores what the contiguous busiest rank scores, less
    zig = step_flops(cfg, L, Layout(cp=2), recompute=False, cp_layout="zigzag")
    assert zig["components"]["dsa_indexer"]["forward"] < idx[1]
    # EP: balanced routing keeps the rank's own token-slots; skew scales the routed experts only (not the router)
    router = 2 * L * cfg.hidden_size * cfg.n_routed_experts  # one MoE layer
    ep = step_flops(cfg, L, Layout(ep=8), recompute=False)
    skewed = step_flops(cfg, L, Layout(ep=8), recompute=False, skew=PUBLISHED_SKEW)
    capped = step_flops(cfg, L, Layout(ep=2), recompute=False, skew=PUBLISHED_SKEW)  # at most ep x the mean
    assert capped["total"] == step_flops(cfg, L, Layout(ep=2), recompute=False, skew=2.0)["total"] > ep["total"]
    assert step_flops(cfg, L, Layout(), recompute=False, skew=PUBLISHED_SKEW)["total"] == one["total"]  # no EP
    assert ep["total"] == one["total"] and PUBLISHED_SKEW == 4.0
    assert skewed["components"]["experts"]["forward"] - router == pytest.approx(
        4 * (ep["components"]["experts"]["forward"] - router)
    )
    assert skewed["components"]["attention_projections"] == ep["components"]["attention_projections"]


def test_flops_per_token_and_copied_constants():
    """``model info``'s numbers are step_flops / eval_flops per token; the tile constants match the code's."""
    cfg = preset("tiny")
    f = flops_per_token(cfg, 64, active_params=1000)
    s, e = step_flops(cfg, 64), eval_flops(cfg, 64)
    assert f["train"]["total"] == pytest.approx((s["forward"] + s["backward"]) / 64)
    assert f["train_with_recompute"]["total"] == pytest.approx(s["total"] / 64)
    assert f["forward"]["total"] == pytest.approx(e["forward"] / 64) and f["six_n_active"] == 6000
    assert f["train"]["lm_head_loss"] == 6 * cfg.hidden_size * cfg.vocab_size
    assert set(f["train"]) == set(flops.COMPONENTS) | {"total"}
    assert (flops.SUB_CHUNK, flops.INDEX_ROW_TILE, flops.INDEX_COL_BLOCK, flops.INDEX_GROUP) == (
        kda._SUB_CHUNK, dsa.INDEX_ROW_TILE, dsa.INDEX_COL_BLOCK, dsa.INDEX_GROUP,
    )  # fmt: skip
    for n, m, a, b in ((0, 3, 1, 1), (7, 4, 3, 5), (50, 16, 64, 129), (13, 1, 0, 2)):  # the tiles' closed forms
        assert flops._floor_sum(n, m, a, b) == sum((a * i + b) // m for i in range(n))
    T, rows, S, kp = 300, 64, 1000, 16
    tiles = [(min(T, r0 + rows) - r0, S + min(T, r0 + rows)) for r0 in range(0, T, rows)]
    assert flops._tiles(T, rows, S, kp) == (sum(r * n for r, n in tiles), sum(r * (n // kp) for r, n in tiles))
    with pytest.raises(ValueError, match="seq_len"):
        step_flops(cfg, 0)
    with pytest.raises(ValueError, match="pieces"):
        step_flops(cfg, 63, Layout(cp=2))
