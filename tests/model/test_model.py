"""HybridLM: the chunk contract and the bookkeeping the trainer relies on."""

import torch

from genoctx.data.tokenizer import BOS, encode
from genoctx.model.config import preset
from genoctx.model.model import HybridLM, shift_inputs, token_losses


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
    for k in (2, 3):
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
    assert stats[1]["path"] == "sparse"


def test_parameter_counts_active_below_total():
    counts = HybridLM(preset("tiny")).num_parameters()
    assert 0 < counts["active"] < counts["total"]


def test_parameter_counts_equal_hand_computation_for_tiny():
    """tiny: d=32, layers K D, KDA 2 heads of 8, DSA 2 heads of 8 (1 kv), indexer 2 x 8, 4 experts of 16 (top-2,
    1 shared), n = 2 streams, vocab 8. Every weight counted by hand."""
    d, hk = 32, 16
    kda = 3 * d * hk + 3 * hk * 4 + (d * 8 + 8 * hk) + 2 + hk + d * 2 + (d * 8 + 8 * hk + hk) + 8 + hk * d
    dsa = d * 16 + 2 * d * 8 + 16 * d + d * 16 + d * 8 + d * 2
    moe = 4 * d + 3 * 4 * d * 16 + 3 * d * 16
    hc = 8 * 64 + 3 + 2 + 2 + 4  # phi [n(n+2), n d], alpha x3, b_pre, b_post, b_res
    block = moe + 2 * hc + 2 * d  # + two RMSNorm weights
    total = 8 * d + 8 * d + d + (kda + block) + (dsa + block)  # embed, head, final norm, blocks
    assert (kda, dsa, moe, hc, total) == (3114, 2368, 7808, 523, 23862)
    active = total - 2 * (4 - 2) * 3 * d * 16  # two unused experts per token in each of the 2 layers
    assert HybridLM(preset("tiny")).num_parameters() == {"total": total, "active": active}
    with torch.device("meta"):
        assert HybridLM(preset("tiny")).num_parameters() == {"total": total, "active": active}


def test_flops_per_token_equal_hand_computation_for_tiny():
    """FLOPs formula of flops_per_token, written out for tiny at L = 40 (top-16, chunk 16, head dim 8)."""
    from genoctx.model.model import flops_per_token

    cfg = preset("tiny")
    active = HybridLM(cfg).num_parameters()["active"]
    L = 40
    k_eff = (sum(range(1, 17)) + (L - 16) * 16) / L  # mean of min(16, t), t = 1..40
    mean_vis = (L + 1) / 2
    kda = 2 * (4 * 16 * 8 + 3 * 8 * 8)  # 1 KDA layer, 2 heads
    attn = 2 * 2 * 8 * k_eff  # 1 DSA layer, 2 heads of 8
    indexer = 2 * 8 * mean_vis + (3 * 2 * 8 + 2 * 8) * k_eff
    f = flops_per_token(cfg, L, active)
    want = {"dense": 6 * (active - 8 * 32), "kda": 6 * kda, "dsa_attention": 6 * attn, "dsa_indexer": 2 * indexer}
    for key, val in want.items():
        assert abs(f["train"][key] - val) < 1e-6, key
    assert abs(f["train"]["total"] - sum(want.values())) < 1e-6
    assert abs(f["forward"]["dsa_indexer"] - 2 * 2 * 8 * mean_vis) < 1e-6


def test_layer_stats_report_tokens_per_expert(realdna):
    model = HybridLM(preset("tiny"))
    model(shift_inputs(_real_tokens(realdna, 64), BOS))
    for s in model.layer_stats():
        tpe = s["moe_tokens_per_expert"]
        assert len(tpe) == 4 and sum(tpe) == 64 * 2  # every token routed to top-2 experts
        assert abs(s["moe_load_max_over_mean"] - max(tpe) / (sum(tpe) / 4)) < 1e-9


def test_bf16_autocast_forward_backward_close_to_fp32(realdna):
    """Under CPU bf16 autocast the loss and gradients are finite and close to fp32 (bf16 has ~3 significant
    digits); the KDA state stays fp32 and the decay g is computed in fp32."""
    model = HybridLM(preset("tiny"))
    tokens = _real_tokens(realdna, 96)
    ref, _ = _loss(model, tokens, 1)
    g_ref = torch.autograd.grad(ref, list(model.parameters()), allow_unused=True)
    seen = {}
    kda = model.blocks[0].mixer
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
