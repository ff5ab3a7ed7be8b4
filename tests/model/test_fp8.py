"""``genoctx.model.fp8``: frozen weights kept in block-scaled fp8, dequantized per use, equal to the dequantized
weights bit for bit (forward and input gradients); fp8 + scales bytes; the keep-fp8 checkpoint path."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from glm5_reference import build, save, text_config
from safetensors.torch import load_file
from test_hf import _write
from torch import nn

from genoctx.errors import GenoctxError
from genoctx.model import load_hf
from genoctx.model.config import preset
from genoctx.model.fp8 import FP8Weight, dequant_fp8, fp8_bytes, freeze_to_fp8, holders, quantize_fp8
from genoctx.model.model import HybridLM, cast_model
from genoctx.model.moe import Experts


def test_quantize_blocks_of_a_shape_the_block_does_not_divide():
    """[2, 13, 20] in (8, 7) blocks: scale [2, 2, 3] = amax / 448 per (partial) block, w ~ q * scale per element,
    an all-zero block stays zero (finite scale)."""
    w = torch.randn(2, 13, 20)
    w[1, 8:, 14:] = 0
    q, s = quantize_fp8(w, (8, 7))
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and s.shape == (2, 2, 3) and s.dtype == torch.float32
    assert torch.equal(s[0, 1, 2], w[0, 8:, 14:].abs().max() / 448)
    d = dequant_fp8(q, s, (8, 7))
    for e in range(2):
        for i in range(2):
            for j in range(3):
                blk = (e, slice(8 * i, 8 * i + 8), slice(7 * j, 7 * j + 7))
                assert torch.equal(d[blk], q[blk].float() * s[e, i, j])
                assert (d[blk] - w[blk]).abs().max() <= w[blk].abs().max() / 16
    assert torch.equal(d[1, 8:, 14:], torch.zeros(5, 6))


def test_linear_forward_and_gradients_equal_the_dequantized_weight():
    """An fp8 nn.Linear (13 x 20, (8, 7) blocks: ragged) equals nn.Linear with ``dequantize()``'s weight bit for
    bit, forward and input/bias gradients; the weight gets no gradient; a module cast keeps the storage fp8."""
    lin = nn.Linear(20, 13)
    (holder,) = freeze_to_fp8(lin, ["weight"], (8, 7)).values()
    ref = nn.Linear(20, 13)
    with torch.no_grad():
        ref.weight.copy_(holder.dequantize())
        ref.bias.copy_(lin.bias)
    assert [n for n, _ in lin.named_parameters()] == ["bias"]
    assert {n: b.dtype for n, b in lin.named_buffers()} == {"weight_fp8.weight": torch.float8_e4m3fn,
                                                            "weight_fp8.scale_inv": torch.float32}  # fmt: skip
    assert torch.equal(lin.weight, ref.weight)
    x = torch.randn(3, 5, 20, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = lin(x)
    assert {t.dtype for t in saved} == {torch.float8_e4m3fn, torch.float32} and len(saved) == 2  # fp8 + scale
    yr = ref(xr)
    assert torch.equal(y, yr)
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g)
    assert torch.equal(x.grad, xr.grad) and torch.equal(lin.bias.grad, ref.bias.grad)
    assert all(b.grad is None and not b.requires_grad for b in lin.buffers())
    lin.to(torch.bfloat16)  # storage stays fp8 / fp32; the weight now computes in bf16
    assert lin.weight_fp8.weight.dtype == torch.float8_e4m3fn and lin.weight_fp8.scale_inv.dtype == torch.float32
    assert lin.weight.dtype == torch.bfloat16 and torch.equal(lin.weight, ref.weight.to(torch.bfloat16))


def _frozen(name: str, p: torch.Tensor) -> bool:
    """The routed experts and every projection of the blocks (not embeddings, head, router or norms)."""
    return name.startswith("layers.") and p.dim() >= 2 and (".experts." in name or "proj.weight" in name)


def test_model_forward_and_gradients_equal_the_dequantized_model(monkeypatch):
    """tiny preset with the experts and every block projection in fp8 ((8, 7) blocks): logits and the gradients of
    what still trains equal the model whose weights are the dequantized ones, bit for bit (MoE recomputes its
    chunks: the experts are dequantized again in backward); bytes of the frozen weights are 1 per element + 4 per
    block. Both run the per-expert loop (fp8 experts always do; the grouped products round differently)."""
    monkeypatch.setattr(Experts, "grouped", False)
    model = HybridLM(preset("tiny"), seed=0)
    ref = copy.deepcopy(model)
    held = freeze_to_fp8(model, _frozen, (8, 7))
    assert "layers.1.mlp.experts.gate_up_proj" in held and "layers.1.mlp.experts.down_proj" in held
    assert "layers.0.self_attn.q_proj.weight" in held and len(held) > 20
    with torch.no_grad():
        for n, h in held.items():
            ref.get_parameter(n).copy_(h.dequantize())
    assert not any(n in held for n, _ in model.named_parameters())
    E, D, I = model.cfg.n_routed_experts, model.cfg.hidden_size, model.cfg.moe_intermediate_size
    assert held["layers.1.mlp.experts.down_proj"].scale_inv.shape == (E, -(-D // 8), -(-I // 7))
    want = sum(p.numel() + 4 * (-(-p.shape[-2] // 8) * -(-p.shape[-1] // 7)) * p[..., 0, 0].numel()
               for n, p in ref.named_parameters() if n in held)  # fmt: skip
    assert fp8_bytes(model) == want == sum(h.weight.numel() + 4 * h.scale_inv.numel() for h in held.values())
    ids = torch.randint(0, model.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    out, out_ref = model(ids)[0], ref(ids)[0]
    assert torch.equal(out, out_ref)
    g = torch.randn_like(out)
    out.backward(g)
    out_ref.backward(g)
    trained = dict(model.named_parameters())
    for n, p in ref.named_parameters():
        if n in held:
            continue
        assert (trained[n].grad is None) == (p.grad is None), n
        assert p.grad is None or torch.equal(trained[n].grad, p.grad), n


def test_experts_dequantize_per_expert_per_use_and_keep_nothing(monkeypatch):
    """The experts' loop dequantizes one expert's weight at a time, per use: in forward once per projection of each
    routed expert (2-D ``[2I, D]`` / ``[D, I]``, never the ``[E, ...]`` stack: the holder's whole ``dequantize`` is
    never called), and again in backward; autograd keeps each expert's fp8 rows and scales (views), no dequantized
    weight; the outputs and input gradients equal the experts with the dequantized weights bit for bit (both on the
    per-expert loop, which fp8 experts always run)."""
    import genoctx.model.fp8 as fp8

    monkeypatch.setattr(Experts, "grouped", False)

    model = HybridLM(preset("tiny"), seed=0)
    experts = model.layers[1].mlp.experts
    ref = copy.deepcopy(experts)
    held = freeze_to_fp8(experts, ["gate_up_proj", "down_proj"], (8, 7))
    with torch.no_grad():
        for n, h in held.items():
            getattr(ref, n).copy_(h.dequantize())
    whole, shapes = [], []
    for h in held.values():
        h.dequantize = lambda h=h: whole.append(1) or FP8Weight.dequantize(h)
    real = fp8.dequant_fp8
    monkeypatch.setattr(fp8, "dequant_fp8", lambda *a, **k: shapes.append(tuple(a[0].shape)) or real(*a, **k))
    E, D, I = model.cfg.n_routed_experts, model.cfg.hidden_size, model.cfg.moe_intermediate_size
    N, k = 5, model.cfg.num_experts_per_tok  # 5 tokens x 2 slots over 4 experts: rows 3, 3, 2, 2 (none D or 2I)
    routed = torch.arange(N * k).reshape(N, k) % E
    x = torch.randn(N, D, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    w = torch.rand(N, k)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = experts(x, routed, w)
    assert whole == [] and "_fp8_scope" not in experts.__dict__
    assert sorted(shapes) == sorted([(2 * I, D), (D, I)] * E)  # one expert's projection per dequantization
    assert sum(t.dtype == torch.float8_e4m3fn for t in saved) == 2 * E
    assert not any(t.is_floating_point() and tuple(t.shape) in ((2 * I, D), (D, I)) and t.dtype != torch.float8_e4m3fn
                   for t in saved)  # fmt: skip
    yr = ref(xr, routed, w)
    assert torch.equal(y, yr)
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g)
    assert torch.equal(x.grad, xr.grad) and len(shapes) == 4 * E and whole == []


def test_bad_choices_raise():
    model = HybridLM(preset("tiny"), seed=0)
    with pytest.raises(ValueError, match="no parameter 'layers.0.nope'"):
        freeze_to_fp8(model, ["layers.0.nope"])
    with pytest.raises(ValueError, match="fp8 blocks need >= 2"):
        freeze_to_fp8(model, ["norm.weight"])
    with pytest.raises(ValueError, match="scale_inv"):
        FP8Weight(torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.ones(1, 2), (4, 4), torch.float32)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    """A tiny glm5_next checkpoint with every 2-D block projection in fp8 blocks of (8, 7) (8 divides the expert
    halves' rows, 7 divides few column counts), each weight and its scale as stored; and one in (5, 7) blocks."""
    root = tmp_path_factory.mktemp("fp8keep")
    save(build(text_config(), seed=0), root / "vl")
    tensors = load_file(root / "vl" / "model.safetensors")
    config = json.loads((root / "vl" / "config.json").read_text())
    dirs = {}
    for block in ((8, 7), (5, 7)):
        out = {}
        for name, w in tensors.items():
            skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "visual")
            if w.dim() != 2 or not name.endswith(".weight") or any(s in name for s in skip):
                out[name] = w
                continue
            out[name], out[name + "_scale_inv"] = quantize_fp8(w, block)
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
        dirs[block] = _write(root / f"fp8-{block[0]}", out, {**config, "quantization_config": qc})
    return dirs


@pytest.mark.parametrize("dtype", [torch.float32, None])
def test_keep_fp8_load_equals_the_dequantized_load(fp8_dir, dtype):
    """``load_hf(keep_fp8=True)``: holders (fp8 as stored, experts stacked per expert) whose ``dequantize()``
    equals today's dequantized load bit for bit (fp32, and the default bf16); every other tensor equal; logits
    equal."""
    today = load_hf(fp8_dir[(8, 7)], dtype=dtype)
    kept = load_hf(fp8_dir[(8, 7)], dtype=dtype, keep_fp8=True)
    held = holders(kept)
    assert "layers.1.mlp.experts.gate_up_proj" in held and "layers.0.self_attn.q_proj.weight" in held
    assert all(h.weight.dtype == torch.float8_e4m3fn for h in held.values())
    for n, h in held.items():
        assert torch.equal(h.dequantize(), today.get_parameter(n)), n
    rest = kept.state_dict()
    for n, t in today.state_dict().items():
        assert n in held or torch.equal(rest[n], t), n
    ids = torch.randint(0, 16, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(kept.eval()(ids)[0], today.eval()(ids)[0])


def test_keep_fp8_refuses_blocks_cut_by_stacking(fp8_dir):
    """(5, 7) blocks: a published expert's up_proj starts at row I = 16 of the stacked gate_up_proj, inside a block
    of 5 rows, so the stacked fp8 weight cannot hold it: one line, not a silent dequantization."""
    with pytest.raises(GenoctxError, match="cut its \\(5, 7\\) fp8 blocks") as e:
        load_hf(fp8_dir[(5, 7)], keep_fp8=True)
    assert "\n" not in str(e.value)


def test_cast_model_keeps_the_fp8_holders_as_they_are():
    """``cast_model`` (the model's compute dtype) casts the other weights and leaves each holder's e4m3 bytes and fp32
    scales alone: its check of floating tensors would otherwise turn the fp8 weights into bf16."""
    model = HybridLM(preset("tiny"), seed=0)
    freeze_to_fp8(model, lambda n, p: n.endswith(("experts.gate_up_proj", "q_proj.weight")), block=(8, 8))
    before = {n: t.clone() for n, t in model.named_buffers() if "_fp8." in n}
    cast_model(model, torch.bfloat16)
    after = dict(model.named_buffers())
    assert len(before) == 2 * len(holders(model)) > 0
    for n, t in before.items():
        assert after[n].dtype == t.dtype and torch.equal(after[n], t)
    assert model.embed_tokens.weight.dtype == torch.bfloat16


def test_host_held_holders_are_fetched_per_use_and_stay_on_the_host(monkeypatch):
    """``hold_on_host`` (``train.offload_optimizer`` with fp8 frozen weights): every use reads the fp8 bytes and
    scales through ``fetch`` to the compute device: a linear's weight in forward and again in backward, each routed
    expert's slice per use, a property read (``held`` weight) too; module moves change only the compute device (and
    dtype), never where the bytes are; outputs and input gradients equal the device-held model's bit for bit."""
    import genoctx.model.fp8 as fp8

    model = HybridLM(preset("tiny"), seed=0)
    freeze_to_fp8(model, _frozen, (8, 7))
    ref = copy.deepcopy(model)
    assert fp8.hold_on_host(model, "cpu") == fp8_bytes(model) > 0
    hs = holders(model)
    assert {str(h.compute_device) for h in hs.values()} == {"cpu"}
    assert all(h.compute_device is None for h in holders(ref).values())
    fetched = []
    real = fp8.fetch
    monkeypatch.setattr(fp8, "fetch", lambda t, d: fetched.append((tuple(t.shape), t.dtype, str(d))) or real(t, d))
    ids = torch.randint(0, model.cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    out = model(ids)[0]
    forward = list(fetched)
    E, D, I = model.cfg.n_routed_experts, model.cfg.hidden_size, model.cfg.moe_intermediate_size
    q = tuple(hs["layers.0.self_attn.q_proj.weight"].weight.shape)
    assert (q, torch.float8_e4m3fn, "cpu") in forward  # a linear's bytes fetched for its forward
    assert ((2 * I, D), torch.float8_e4m3fn, "cpu") in forward and ((D, I), torch.float8_e4m3fn, "cpu") in forward
    assert not any(s[0] == E for s, _, _ in forward if len(s) == 3)  # never an expert stack
    assert all(d == "cpu" for _, _, d in forward) and len(forward) % 2 == 0  # the bytes and their scales, in pairs
    monkeypatch.setattr(fp8, "fetch", real)
    out_ref = ref(ids)[0]
    assert torch.equal(out, out_ref)
    monkeypatch.setattr(fp8, "fetch", lambda t, d: fetched.append((tuple(t.shape), t.dtype, str(d))) or real(t, d))
    g = torch.randn_like(out)
    out.backward(g)
    assert (q, torch.float8_e4m3fn, "cpu") in fetched[len(forward) :]  # fetched again for grad_x = grad @ W
    monkeypatch.setattr(fp8, "fetch", real)
    out_ref.backward(g)
    got = dict(model.named_parameters())
    for n, p in ref.named_parameters():
        assert (p.grad is None) == (got[n].grad is None) and (p.grad is None or torch.equal(p.grad, got[n].grad)), n
    # a module move leaves the bytes where they are: only the compute device and dtype follow
    w = hs["layers.0.self_attn.q_proj.weight"]
    before = w.weight.data_ptr()
    w.to("meta")
    assert w.compute_device == torch.device("meta") and w.weight.device.type == "cpu" and w.weight.data_ptr() == before
    w.to("cpu").to(torch.bfloat16)
    assert w.weight.dtype == torch.float8_e4m3fn and w.dtype == torch.bfloat16 and w.compute_device.type == "cpu"
