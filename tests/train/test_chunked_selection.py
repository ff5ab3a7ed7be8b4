"""The chunked step's grad pass reuses the DSA top-k selections of its no-grad sweep (``genoctx.train.chunked``,
``DeepSeekSparseAttention.selection_memo``): the indexer top-k runs once per chunk per full DSA layer (in the sweep),
never in the grad pass, and the loss and every gradient are bit-identical to scoring again."""

import copy

import pytest
import torch

from genoctx.data.tokenizer import BOS
from genoctx.model import dsa
from genoctx.model.config import preset
from genoctx.model.model import HybridLM
from genoctx.train import chunked
from genoctx.train.chunked import chunk_bounds, chunked_forward_backward
from genoctx.train.loop import scored_mask, shift_inputs


def _cfg(**kw):
    # layers K D D K: two DSA layers, the first "full" (own indexer), the second "shared" (takes its selection)
    base = dict(num_hidden_layers=4, layer_types="KDDK", indexer_types=["full", "full", "shared", "full"],
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"], index_topk=8, index_kpool=4,
                indexer_stage="sparse", moe_aux_loss_coef=0.1)  # fmt: skip
    base.update(kw)
    return preset("tiny", **base)


def _step(model, tokens, chunk):
    inputs, scored = shift_inputs(tokens, BOS), scored_mask(tokens)
    return chunked_forward_backward(model, inputs, tokens, scored, chunk, scored.sum())


def _count_topk(monkeypatch):
    """Patch ``dsa.indexer_topk`` to record ``(grad enabled, the chunk's query count T)`` per call."""
    calls = []
    orig = dsa.indexer_topk

    def spy(iq, *a, **kw):
        calls.append((torch.is_grad_enabled(), iq.shape[1]))
        return orig(iq, *a, **kw)

    monkeypatch.setattr(dsa, "indexer_topk", spy)
    return calls


@pytest.mark.parametrize("ac", [False, True])
def test_the_grad_pass_reuses_the_sweeps_topk_and_changes_no_bit(monkeypatch, ac):
    # 50 tokens in chunks of 16: 4 chunks (the last 2 long), pools of 4 cut by the chunk ends; one full DSA layer
    cfg = _cfg()
    tokens = torch.randint(0, 4, (2, 50), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    reuse = HybridLM(cfg).double().train()
    again = copy.deepcopy(reuse)
    if ac:  # activation checkpointing recomputes each layer in backward: it reuses the selection too
        from genoctx.parallel.fsdp import apply_ac

        apply_ac(reuse)
        apply_ac(again)
    full = [m for m in reuse.modules() if isinstance(m, dsa.DeepSeekSparseAttention) and m.indexer is not None]
    assert len(full) == 1

    calls = _count_topk(monkeypatch)
    loss1, aux1 = _step(reuse, tokens, 16)
    lengths = [e - s for s, e in chunk_bounds(50, 16)]
    assert calls == [(False, t) for t in lengths]  # the sweep: once per chunk per full layer; the grad pass: never
    assert all(m.selection_memo is None for m in full)  # dropped after the step

    calls.clear()
    monkeypatch.setattr(chunked, "_full_dsa", lambda model: [])  # no memo: the grad pass scores again (as before)
    loss0, aux0 = _step(again, tokens, 16)
    passes = 3 if ac else 2  # the sweep, the grad pass (and the checkpoint's recompute)
    assert calls[: len(lengths)] == [(False, t) for t in lengths] and len(calls) == passes * len(lengths)

    assert torch.equal(loss1, loss0)
    assert (aux1 is None) == (aux0 is None) and (aux1 is None or torch.equal(aux1, aux0))
    n = 0
    for (name, p1), p0 in zip(reuse.named_parameters(), again.parameters(), strict=True):
        assert (p1.grad is None) == (p0.grad is None), name
        if p1.grad is not None:
            assert torch.equal(p1.grad, p0.grad), name
            n += 1
    assert n > 20


def test_the_memo_is_dropped_when_the_sweep_raises(monkeypatch):
    cfg = _cfg()
    model = HybridLM(cfg).double().train()
    full = [m for m in model.modules() if isinstance(m, dsa.DeepSeekSparseAttention) and m.indexer is not None]

    def boom(*a, **kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(dsa, "indexer_topk", boom)
    with pytest.raises(RuntimeError, match="boom"):
        _step(model, torch.randint(0, 4, (1, 20)), 8)
    assert all(m.selection_memo is None for m in full)
