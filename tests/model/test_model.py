"""HybridLM: the chunk contract on real DNA, and the bookkeeping the trainer relies on (stats, counts, FLOPs, casts,
auxiliary losses, router balancing)."""

import torch

from genoctx.data.tokenizer import BOS, encode
from genoctx.model.config import preset
from genoctx.model.model import FP32_PARAMETERS, HybridLM, cast_model, shift_inputs, token_losses


def _real_tokens(realdna, n: int, offset: int = 1000) -> torch.Tensor:
    seq = (realdna / "hg38_chr22_32000001-32300000.fa").read_text().split("\n", 1)[1].replace("\n", "")
    tokens, _ = encode(seq[offset : offset + n])
    return torch.from_numpy(tokens.astype("int64"))[None]


def _loss(model, tokens, chunks):
    inputs = shift_inputs(tokens, BOS)
    scored = torch.ones_like(tokens, dtype=torch.bool)
    cache = None
    total = 0.0
    for part_in, part_t, part_s in zip(
        inputs.tensor_split(chunks, 1),
        tokens.tensor_split(chunks, 1),
        scored.tensor_split(chunks, 1),
        strict=True,
    ):
        logits, cache = model(part_in, cache)
        total = total + token_losses(logits, part_t, part_s).sum()
    return total / tokens.numel(), cache


def test_chunks_with_carried_cache_equal_one_pass(realdna):
    """One pass over L tokens == k passes over L/k with the carried cache: loss and every gradient (fp64)."""
    cfg = preset("tiny")
    model = HybridLM(cfg).double()
    tokens = _real_tokens(realdna, 150)
    ref, cache1 = _loss(model, tokens, 1)
    g_ref = torch.autograd.grad(ref, [p for p in model.parameters()], allow_unused=True)
    for k in (2, 3, 7):
        got, cache_k = _loss(model, tokens, k)
        assert cache_k.position == cache1.position == 150
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
        g = torch.autograd.grad(got, [p for p in model.parameters()], allow_unused=True)
        for (name, _), a, b in zip(model.named_parameters(), g, g_ref, strict=True):
            if b is None:
                assert a is None, name
                continue
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=name)


def test_layer_stats_record_the_sparse_path(realdna):
    model = HybridLM(preset("tiny"))
    model(shift_inputs(_real_tokens(realdna, 64), BOS))
    stats = model.layer_stats()
    assert [s["mixer"] for s in stats] == ["kda", "dsa"]
    assert stats[0]["path"] == "chunk"
    assert stats[1]["path"] == "sparse" and stats[1]["indexer"] == "full"
    assert 0 < stats[1]["keys_attended"] < 64 * 65 // 2


def test_parameter_counts_equal_hand_computation_for_tiny():
    """tiny: hidden 32, vocab 8, layers K (dense MLP 48) and D (MoE: 4 experts of 16, top-2, 1 shared); KDA 2 heads of
    8, conv 4; MLA 2 heads, q-LoRA 24, kv-LoRA 16, qk 8, v 8; indexer 2 x 8, pools of 4; mHC 2 streams. Every weight
    counted by hand."""
    d, hk = 32, 16
    kda = 3 * d * hk + 3 * hk * 4 + (d * 8 + 8 * hk + hk + 2) + d * 2 + (d * 8 + 8 * hk) + 8 + hk * d
    indexer = 24 * 16 + d * 8 + 2 * 8 + d * 2 + 4 * 8 + 8 * d  # wq_b, wk, k_norm (w, b), weights_proj, ape, gate
    dsa = d * 24 + 24 + 24 * 2 * 8 + d * 16 + 16 + 16 * 2 * (8 + 8) + 2 * 8 * d + indexer
    mlp = 3 * d * 48
    moe = 4 * d + 4 * (2 * 16 * d + d * 16) + 3 * d * 16  # router, experts (gate_up, down), shared expert
    hc = (2 + 2) * 2 * (2 * d) + (2 + 2) * 2 + 3  # fn, base, scale
    norms = 2 * d
    total = 8 * d + 8 * d + d + (kda + mlp + 2 * hc + norms) + (dsa + moe + 2 * hc + norms)
    assert (kda, dsa, moe, hc, total) == (3098, 3736, 7808, 523, 22014)
    active = total - (4 - 2) * 3 * d * 16  # two unused experts per token in the one MoE layer
    assert HybridLM(preset("tiny")).num_parameters() == {"total": total, "active": active}
    with torch.device("meta"):
        assert HybridLM(preset("tiny")).num_parameters() == {"total": total, "active": active}


def test_parameter_counts_of_the_published_model():
    """GLM-5.3-Flash's text model (no vision tower, no MTP layer), counted on the meta device: 313.3B / 17.4B."""
    with torch.device("meta"):
        counts = HybridLM(preset("glm-5.3-flash")).num_parameters()
    assert round(counts["total"] / 1e9, 1) == 313.3 and round(counts["active"] / 1e9, 1) == 17.4


def test_layer_stats_report_tokens_per_expert(realdna):
    model = HybridLM(preset("tiny"))
    model(shift_inputs(_real_tokens(realdna, 64), BOS))
    stats = model.layer_stats()
    assert "moe_tokens_per_expert" not in stats[0]  # dense MLP
    tpe = stats[1]["moe_tokens_per_expert"]
    assert len(tpe) == 4 and sum(tpe) == 64 * 2  # every token routed to top-2 experts
    assert abs(stats[1]["moe_load_max_over_mean"] - max(tpe) / (sum(tpe) / 4)) < 1e-9


def test_aux_loss_and_router_balancing(realdna):
    """``aux_loss()`` sums what the layers produced (indexer KL; MoE balance loss when its coefficient is set);
    ``update_router_biases()`` runs the balancing step of every MoE layer."""
    model = HybridLM(preset("tiny", moe_aux_loss_coef=0.1))
    x = shift_inputs(_real_tokens(realdna, 64), BOS)
    model(x)
    dsa, moe = model.layers[1].self_attn, model.layers[1].mlp
    torch.testing.assert_close(model.aux_loss(), dsa.aux_loss + moe.aux_loss)
    bias = moe.gate.e_score_correction_bias.clone()
    out = model.update_router_biases()
    assert len(out) == 1 and sum(out[0]["tokens_per_expert"]) == 64 * 2
    assert not torch.equal(bias, moe.gate.e_score_correction_bias)
    with torch.no_grad():
        model(x)
    assert model.layers[1].self_attn.aux_loss is None  # the indexer KL only with grad


def test_cache_detach_keeps_values_cuts_graph(realdna):
    model = HybridLM(preset("tiny"))
    _, cache = model(shift_inputs(_real_tokens(realdna, 30), BOS))
    assert cache.layers[1].latent.requires_grad
    cut = cache.detach()
    assert cut.position == cache.position == 30
    for a, b in zip(cache.layers, cut.layers, strict=True):
        for k, v in vars(a).items():
            if torch.is_tensor(v):
                w = getattr(b, k)
                assert torch.equal(v, w) and not w.requires_grad, k


def test_cast_model_keeps_fp32_islands():
    model = cast_model(HybridLM(preset("tiny")), torch.bfloat16)
    islands = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point():
            want = torch.float32 if name.endswith(FP32_PARAMETERS) else torch.bfloat16
            assert t.dtype == want, name
            islands += name.endswith(FP32_PARAMETERS)
    assert islands == 3 + 1 + 2 * 4  # conv1d, dt_bias, A_log; a router bias; mHC base/scale of 2 layers x 2
    cast_model(model, torch.float64)
    assert all(t.dtype == torch.float64 for t in model.state_dict().values() if t.is_floating_point())


def test_bf16_autocast_forward_backward_close_to_fp32(realdna):
    """Under CPU bf16 autocast the loss and gradients are finite and close to fp32 (bf16 has ~3 significant
    digits); the KDA state stays fp32 and the decay g is computed in fp32."""
    model = HybridLM(preset("tiny"))
    tokens = _real_tokens(realdna, 96)
    ref, _ = _loss(model, tokens, 1)
    g_ref = torch.autograd.grad(ref, list(model.parameters()), allow_unused=True)
    seen = {}
    kda = model.layers[0].self_attn
    orig = kda.project

    def spy(x, conv_state=None):
        out = orig(x, conv_state)
        seen["g"], seen["beta"] = out[3].dtype, out[4].dtype
        return out

    kda.project = spy
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, cache = _loss(model, tokens, 1)
    g = torch.autograd.grad(got, list(model.parameters()), allow_unused=True)
    assert seen == {"g": torch.float32, "beta": torch.float32}
    assert cache.layers[0].state.dtype == torch.float32
    assert torch.isfinite(got) and abs(float(got.detach()) - float(ref.detach())) < 0.05 * float(ref.detach())
    num = den = 0.0
    for a, b in zip(g, g_ref, strict=True):
        if b is None:
            continue
        assert torch.isfinite(a).all()
        num += float((a.float() - b).pow(2).sum())
        den += float(b.pow(2).sum())
    assert (num / den) ** 0.5 < 0.1  # relative gradient error over all parameters
