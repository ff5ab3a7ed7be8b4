"""Exact chunked backward (``genoctx.train.chunked``): one window trained as chunks, each recomputed in reverse with the
gradient later chunks sent into its outgoing cache, equals one pass over the whole window: loss, auxiliary losses,
every parameter's gradient, the router loads and the layers' stats."""

import copy

import pytest
import torch

from genoctx.data.tokenizer import BOS
from genoctx.model.config import preset
from genoctx.model.model import HybridLM, token_losses
from genoctx.train.chunked import chunk_bounds, chunked_forward_backward
from genoctx.train.loop import scored_mask, shift_inputs


def _one_pass(model, tokens):
    inputs, scored = shift_inputs(tokens, BOS), scored_mask(tokens)
    logits, _ = model(inputs)
    losses = token_losses(logits, tokens, scored)
    count = scored.sum()
    aux = model.aux_loss()
    (losses.sum() / count.clamp(min=1) + (aux if aux is not None else 0)).backward()
    return losses.sum().detach(), (aux.detach() if aux is not None else None)


def _chunked(model, tokens, chunk):
    inputs, scored = shift_inputs(tokens, BOS), scored_mask(tokens)
    return chunked_forward_backward(model, inputs, tokens, scored, chunk, scored.sum())


def _cfg(**kw):
    base = dict(num_hidden_layers=4, layer_types="KDDK", indexer_types=["full", "full", "shared", "full"],
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"], index_topk=8, index_kpool=4)  # fmt: skip
    base.update(kw)
    return preset("tiny", **base)


def _compare(cfg, tokens, chunk, atol=1e-10):
    torch.manual_seed(0)
    plain = HybridLM(cfg).double().train()
    chunked = copy.deepcopy(plain)
    loss0, aux0 = _one_pass(plain, tokens)
    loss1, aux1 = _chunked(chunked, tokens, chunk)
    torch.testing.assert_close(loss1.double(), loss0.double(), rtol=0, atol=1e-9)
    if aux0 is None:
        assert aux1 is None
    else:
        torch.testing.assert_close(aux1, aux0, rtol=0, atol=1e-12)
    n = 0
    for (name, p0), p1 in zip(plain.named_parameters(), chunked.parameters(), strict=True):
        if p0.grad is None:
            assert p1.grad is None, name
            continue
        torch.testing.assert_close(p1.grad, p0.grad, rtol=0, atol=atol, msg=name)
        n += 1
    assert n > 20
    for m0, m1 in zip(plain.modules(), chunked.modules(), strict=True):
        if hasattr(m0, "load_counts"):
            assert torch.equal(m1.load_counts, m0.load_counts)  # each token's routing counted once
    return plain, chunked


def test_chunk_bounds_cover_the_window_and_the_last_chunk_is_short():
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(8, 16) == [(0, 8)]
    with pytest.raises(ValueError):
        chunk_bounds(8, 0)


@pytest.mark.parametrize("stage", ["sparse", "warmup", "off"])
def test_chunked_backward_equals_one_pass_fp64(stage):
    # 70 tokens in chunks of 16: 5 chunks, the last 6 long; pools of 4 cut by chunk ends (16 and 70 not multiples
    # of the pool at 70); a shared DSA layer; MoE with the sequence-wise balance loss; two sequences
    cfg = _cfg(indexer_stage=stage, moe_aux_loss_coef=0.1)
    tokens = torch.randint(0, 4, (2, 70))
    tokens[1, 20:40] = 4  # an N run: unscored positions inside and across a chunk boundary
    plain, chunked = _compare(cfg, tokens, 16)
    stats0, stats1 = plain.layer_stats(), chunked.layer_stats()
    for s0, s1 in zip(stats0, stats1, strict=True):
        if "moe_tokens_per_expert" in s0:
            assert s1["moe_tokens_per_expert"] == s0["moe_tokens_per_expert"]  # the window's loads, not a chunk's
        if s0["mixer"] == "dsa":
            assert s1["path"] == s0["path"] == "sparse"
            if s0.get("indexer_loss") is not None:
                assert s1["indexer_loss"] == pytest.approx(s0["indexer_loss"], rel=1e-9)


def test_chunked_backward_with_a_chunk_shorter_than_a_pool_and_an_all_n_chunk():
    cfg = _cfg(moe_aux_loss_coef=0.0)
    tokens = torch.randint(0, 4, (1, 37))
    tokens[0, 12:24] = 4  # chunk [12, 24) scores nothing
    _compare(cfg, tokens, 3)  # 13 chunks of 3 tokens (< kpool), the last one 1 token


def test_one_chunk_is_one_pass():
    cfg = _cfg()
    tokens = torch.randint(0, 4, (1, 40))
    _compare(cfg, tokens, 64, atol=1e-12)


def test_chunked_backward_under_activation_checkpointing():
    from genoctx.parallel.fsdp import apply_ac

    cfg = _cfg(moe_aux_loss_coef=0.1)
    tokens = torch.randint(0, 4, (1, 50))
    torch.manual_seed(0)
    plain = HybridLM(cfg).double().train()
    ac = copy.deepcopy(plain)
    apply_ac(ac)
    loss0, _ = _one_pass(plain, tokens)
    loss1, _ = _chunked(ac, tokens, 16)
    torch.testing.assert_close(loss1.double(), loss0.double(), rtol=0, atol=1e-9)
    for (name, p0), p1 in zip(plain.named_parameters(), ac.parameters(), strict=True):
        if p0.grad is not None:
            torch.testing.assert_close(p1.grad, p0.grad, rtol=0, atol=1e-10, msg=name)
    for m0, m1 in zip(plain.modules(), ac.modules(), strict=True):
        if hasattr(m0, "load_counts"):
            assert torch.equal(m1.load_counts, m0.load_counts)
