"""The planner counts the mHC residual streams at the dtype they have: fp32 in every layout (one process: fp32
parameters under bf16 autocast; FSDP2: no forward-input casts, the embedding's output upcast), and with them each
sub-layer's input ``h`` and its normalised copy, whose matmuls each save their own bf16 copy under autocast
(``genoctx.plan.sizes._Sizes.r``, ``_norm_in``, ``INPUT_CASTS``).

The measured checks run decoder layers of ``tiny`` under CPU bf16 autocast with FSDP-like parameters (bf16, the
islands fp32: ``genoctx.parallel.fsdp._islands``) on fp32 streams, as a bf16 FSDP2 rank runs them, and count what
the forward leaves alive (allocator events, as ``tests/test_plan.py``). Fast: T = 2048 tokens of a 32-wide model."""

import pytest
import torch

from genoctx.model.config import preset
from genoctx.model.hyper import HyperConnection
from genoctx.model.kda import KimiDeltaAttention
from genoctx.model.model import DecoderLayer
from genoctx.model.moe import MoE
from genoctx.parallel.layout import Layout
from genoctx.plan import eval_memory as PE
from genoctx.plan import memory as PM
from genoctx.plan import sizes as PS

TINY = preset("tiny")
GLM = preset("glm-5.3-flash")
T = 2048
BF16, FP32 = PS._Sizes(a=2), PS._Sizes(a=4)


def _alive(fn) -> tuple[int, object]:
    """Bytes ``fn()``'s allocations leave alive (allocated minus freed, its output included) and its output."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # earlier tests' cyclic garbage is not freed inside the measurement (it would count as negative)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    return sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), out


def _storage_bytes(*outs) -> int:
    """Bytes of the distinct storages of the tensors in ``outs`` (tensors, tuples, caches with tensor fields)."""
    seen = {}
    for o in outs:
        ts = [o] if isinstance(o, torch.Tensor) else list(o) if isinstance(o, tuple) else list(vars(o).values())
        for t in ts:
            if isinstance(t, torch.Tensor):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _fsdp_like(i: int) -> DecoderLayer:
    """Decoder layer ``i`` of tiny with a bf16 FSDP2 rank's parameter dtypes: bf16, the islands fp32."""
    torch.manual_seed(0)
    layer = DecoderLayer(TINY, i)
    for p in layer.parameters():
        p.data = p.data.to(torch.bfloat16)
    islands = [layer.attn_hc, layer.ffn_hc, layer.self_attn if isinstance(layer.self_attn, KimiDeltaAttention)
               else None, layer.mlp.gate if isinstance(layer.mlp, MoE) else None]  # fmt: skip
    for m in filter(None, islands):
        for p in m.parameters():
            p.data = p.data.float()
    return layer


def _autocast(fn):
    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn()

    return run


def test_bf16_plans_count_the_streams_in_fp32():
    """Per token of a bf16 plan of GLM-5.3-Flash: a layer input (what recomputation keeps, what activation offload
    copies) and each stream ``n D 4`` bytes, the mHC terms those of an fp32 plan, the eval streams fp32."""
    n, D = GLM.hc_mult, GLM.hidden_size
    st = PM._step(GLM, 4096, Layout(), True, False, 1, "bf16", "cuda", None)
    x = PM._layer(st, 0, GLM.layer_types[0], GLM.mlp_layer_types[0], GLM.indexer_types[0])
    assert x["input"] == st.N * n * D * 4
    assert PS._hc(GLM, BF16) == PS._hc(GLM, FP32) and PS._hc_bwd(GLM, BF16) == PS._hc_bwd(GLM, FP32)
    assert x["saved"]["mhc"] == st.N * 2 * (n * D * 4 + PS._hc(GLM, FP32))
    assert x["w_bwd_mix"]["stream_gradients"] == st.N * (n * D * 4 + D * 2)  # the streams' and the mixer output's
    params = {"weights": 0.0, "root": 0.0, "blocks": [0.0] * GLM.num_hidden_layers}
    ev = PE._EvalRun(cfg=GLM, s=BF16, layout=Layout(), L=4096, chunk=None, rows=None, head_chunk=2048,
                     cp_layout="", params=params)  # fmt: skip
    phases = dict(PE._eval_layer(ev, 0, 4096, {}, [("mixer", {})]))
    assert phases["forward layer 0 (kda+mlp): mHC"]["mhc"] == 3 * 4096 * n * D * 4


def test_mhc_saved_bytes_under_bf16_autocast():
    """``pre`` and ``post`` of one mHC on fp32 streams around a bf16 sub-layer output keep ``_hc`` bytes per token
    (the streams themselves and the returned tensors aside)."""
    cfg = TINY
    torch.manual_seed(0)
    hc = HyperConnection(cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    x = torch.randn(1, T, cfg.hc_mult, cfg.hidden_size, requires_grad=True)
    y = torch.randn(1, T, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)

    def both():
        h, coeffs = hc.pre(x)
        return h, hc.post(x, y, coeffs)

    got, (h, out) = _alive(_autocast(both))
    assert h.dtype == out.dtype == torch.float32
    assert (got - _storage_bytes(h, out)) / T == pytest.approx(PS._hc(cfg, BF16), rel=0.02)


def test_layer_saved_bytes_under_bf16_autocast_with_fp32_streams():
    """A KDA + dense-MLP decoder layer as a bf16 FSDP2 rank runs it keeps what the plan's ``_layer`` saves (its two
    streams, two mHC calls, the mixer and MLP with their fp32 inputs' norms), less the input stream allocated
    before."""
    n, D = TINY.hc_mult, TINY.hidden_size
    layer = _fsdp_like(0)
    x = torch.randn(1, T, n, D, requires_grad=True)
    got, (out, cache, _) = _alive(_autocast(lambda: layer(x)))
    st = PM._step(TINY, T, Layout(), False, False, 1, "bf16", "cuda", None)
    planned = sum(PM._layer(st, 0, TINY.layer_types[0], TINY.mlp_layer_types[0], "full")["saved"].values())
    assert out.dtype == torch.float32
    assert got - _storage_bytes(out, cache) == pytest.approx(planned - T * n * D * 4, rel=0.01)


@pytest.mark.parametrize("i, part", [(0, "mixer"), (0, "ffn"), (1, "mixer"), (1, "ffn")])
def test_fp32_sublayer_input_costs_its_norm_and_casts(i, part):
    """Each sub-layer (KDA, full DSA, dense MLP, MoE) on an fp32 input (its normalised mHC collapse) against a bf16
    one: the difference is ``_norm_in``'s against ``_norm``'s (the normalised copy in fp32; a bf16 copy per
    consuming matmul, ``INPUT_CASTS``; the MoE's checkpoint keeping the fp32 output), less the fp32 input itself
    (allocated before)."""
    D = TINY.hidden_size
    kind = {(0, "mixer"): "kda", (1, "mixer"): "dsa_full", (0, "ffn"): "mlp", (1, "ffn"): "moe"}[(i, part)]
    alive = {}
    for dtype in (torch.bfloat16, torch.float32):
        layer = _fsdp_like(i)
        norm, sub = (layer.input_layernorm, layer.self_attn) if part == "mixer" else \
            (layer.post_attention_layernorm, layer.mlp)  # fmt: skip
        h = torch.randn(1, T, D, dtype=dtype, requires_grad=True)
        got, out = _alive(_autocast(lambda sub=sub, norm=norm, h=h: sub(norm(h))))
        outs = out[:2] if isinstance(out, tuple) else (out,)
        alive[dtype] = got - _storage_bytes(*[o for o in outs if o is not None])
    want = PS._norm_in(BF16, D, PS.INPUT_CASTS[kind]) - PS._norm(BF16, D) - 4 * D
    assert (alive[torch.float32] - alive[torch.bfloat16]) / T == pytest.approx(want, abs=1.0)
