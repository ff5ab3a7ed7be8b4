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
