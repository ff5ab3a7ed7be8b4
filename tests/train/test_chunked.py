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


def test_the_planner_counts_the_boundary_state_the_chunked_step_keeps():
    """``genoctx.plan.seq_chunk_boundary_bytes``: per token, the DSA latents and pooled keys of every token (times the
    planner's copies at the peak), a KDA state and conv tail per chunk boundary, and each full DSA layer's top-k pools
    of every token (``selection_memo``, int32), as the forward sweep keeps them."""
    from genoctx.plan.sizes import _LATENT_COPIES, _POOL_COPIES, seq_chunk_boundary_bytes
    from genoctx.train.chunked import _Boundaries

    cfg = _cfg(kv_lora_rank=24, index_head_dim=16)
    model = HybridLM(cfg).train()
    L, T = 256, 64
    tokens = torch.randint(0, 4, (1, L))
    kept = _Boundaries()
    cache = None
    full = [m for m in model.modules() if getattr(m, "indexer", 0) is not None and hasattr(m, "selection_memo")]
    for m in full:
        m.selection_memo = {}
    with torch.no_grad():
        for s in range(0, L, T):
            kept.add(cache)
            _, cache = model(shift_inputs(tokens, BOS)[:, s : s + T], cache)
    kept.final = cache
    latents = sum(c.latent.numel() * 4 for c in cache.layers if hasattr(c, "latent"))
    pools = sum(c.pool_k.numel() * 4 for c in cache.layers if getattr(c, "pool_k", None) is not None)
    assert latents > 0 and pools > 0
    kda = sum(t.numel() * 4 for row, _ in kept.small[1:] for c in row if hasattr(c, "state")
              for t in (c.state, c.conv_state))  # fmt: skip
    # the last boundary's KDA state is the final cache's (not stored per chunk): L / T boundaries in the formula
    kda_per_boundary = kda / (L // T - 1)
    memo = sum(p.numel() * p.element_size() for m in full for p in m.selection_memo.values())
    assert memo == len(full) * L * (cfg.index_topk // cfg.index_kpool) * 4 > 0  # B L K 4 per full layer
    want = (_LATENT_COPIES * latents + _POOL_COPIES * pools + memo) / L + kda_per_boundary / T
    assert seq_chunk_boundary_bytes(cfg, T, rows=1, a=4) == pytest.approx(want, rel=1e-9)


def test_plan_chunked_training_is_bounded_by_the_chunk_plus_the_boundary():
    from genoctx.parallel.layout import Layout
    from genoctx.plan import best_seq_chunk, plan_memory, seq_chunk_boundary_bytes

    cfg = preset("cpu-small")
    kw = dict(gpu_memory_gib=4, device="cpu", dtype="fp32", recompute=False)
    whole = plan_memory(cfg, 1 << 20, Layout(), **kw)
    p = plan_memory(cfg, 1 << 20, Layout(), seq_chunk_tokens=16384, **kw)
    q = plan_memory(cfg, 1 << 18, Layout(), seq_chunk_tokens=16384, **kw)
    assert p["seq_chunk_tokens"] == 16384 and p["tokens_per_rank"] == 16384 and whole["seq_chunk_tokens"] is None
    assert whole["total_gib"] > 50 and p["total_gib"] < 4  # 1M tokens of cpu-small: ~100 GiB whole, ~3 chunked
    boundary = seq_chunk_boundary_bytes(cfg, 16384, 1, 4) / 2**30
    assert p["components_gib"]["seq_chunk_boundary"] == pytest.approx(boundary * (1 << 20), abs=1e-5)
    # what grows with L is the boundary state (and the indexer tiles' and latent gradients' context)
    assert p["total_gib"] - q["total_gib"] >= boundary * ((1 << 20) - (1 << 18)) * 0.99
    assert best_seq_chunk(cfg, 1 << 20, Layout(), **kw)["seq_chunk_tokens"] >= 16384  # the largest chunk that fits
    assert best_seq_chunk(cfg, 1 << 14, Layout(), **kw)["seq_chunk_tokens"] is None  # one pass fits
    # under CP each rank chunks its piece: one chunk's working set, the same boundary state (every rank holds it)
    cp2 = plan_memory(cfg, 1 << 20, Layout(cp=2, dp_shard=1), **kw)
    c = plan_memory(cfg, 1 << 20, Layout(cp=2, dp_shard=1), seq_chunk_tokens=16384, **kw)
    assert c["tokens_per_rank"] == 16384 and c["seq_chunk_tokens"] == 16384 and cp2["seq_chunk_tokens"] is None
    assert c["total_gib"] < 4 < cp2["total_gib"]
    assert c["components_gib"]["seq_chunk_boundary"] == pytest.approx(
        seq_chunk_boundary_bytes(cfg, 2 * 16384, 1, 4) / 2**30 * (1 << 20), abs=1e-5
    )


@pytest.mark.parametrize("vocab", ["full", "nucleotide"])
def test_chunked_backward_through_a_text_vocabulary_head(vocab):
    """A base with a text vocabulary (``VocabHead``: inputs mapped to its ids, the chunked head's loss over the full
    vocabulary or the nucleotide rows) trains in chunks as in one pass."""
    from genoctx.model.vocab import TokenMap, VocabHead

    cfg = _cfg(vocab_size=40, moe_aux_loss_coef=0.1)
    head = VocabHead(TokenMap((11, 23, 5, 31, 17, 2, 3, 4)), vocab, chunk_tokens=16)
    tokens = torch.randint(0, 4, (1, 45))
    inputs, scored = shift_inputs(tokens, BOS), scored_mask(tokens)
    torch.manual_seed(0)
    plain = HybridLM(cfg).double().train()
    chunked = copy.deepcopy(plain)
    losses = head.token_losses(plain, inputs, tokens, scored)
    (losses.sum() / scored.sum() + plain.aux_loss()).backward()
    loss1, _ = chunked_forward_backward(chunked, inputs, tokens, scored, 20, scored.sum(), head=head)
    torch.testing.assert_close(loss1, losses.sum().detach(), rtol=0, atol=1e-9)
    for (name, p0), p1 in zip(plain.named_parameters(), chunked.parameters(), strict=True):
        if p0.grad is not None:
            torch.testing.assert_close(p1.grad, p0.grad, rtol=0, atol=1e-10, msg=name)


def test_the_recompute_takes_each_dsa_layers_latents_as_a_view_of_the_kept_ones(monkeypatch):
    """The reverse pass does not copy the latents of earlier tokens (``DSACache.window``, ``_Splice``): every DSA
    layer of every chunk after the first reads them from the forward sweep's whole-window latents, and the gradients
    still equal one pass (``cat``'s gradient split into the incoming cache's and the chunk's own)."""
    from genoctx.model import dsa

    spliced = []
    orig = dsa._Splice.apply

    def spy(past, own, window):
        out = orig(past, own, window)
        spliced.append((out.untyped_storage().data_ptr() == window.untyped_storage().data_ptr(), out.shape[1]))
        return out

    monkeypatch.setattr(dsa._Splice, "apply", spy)
    cfg = _cfg(moe_aux_loss_coef=0.0)
    tokens = torch.randint(0, 4, (1, 50))
    _compare(cfg, tokens, 16)  # chunks [0,16) [16,32) [32,48) [48,50); DSA layers 1 and 2
    assert sorted(spliced) == sorted([(True, n) for n in (32, 48, 50) for _ in range(2)])
