"""HybridLM equals the oracle: transformers 5.23.0 ``glm5_next`` on tiny random checkpoints loaded with ``load_hf``.

Each case builds a random ``Glm5NextForConditionalGeneration`` with transformers (``glm5_reference.build``: the
parameters the reference initialises to constants, such as ``index_kpool_compress_ape``, the mHC ``base`` and the
router's ``e_score_correction_bias``, are re-drawn at random so every path matters), saves it with
``save_pretrained``, loads it with ``genoctx.model.load_hf`` and compares logits on sequences much longer than
``index_topk + index_kpool`` in fp32.

Relative error, everywhere in this file: ``max |ours - ref| / max |ref|`` over all the compared values (every
logit of every position and batch row; for gradients, every entry of a parameter's gradient).

Besides the logits, every case checks that sparse selection really ran and was the reference's: each DSA layer's
selected token set equals the reference indexer's ``topk_indices`` for every query, the recorded path is "sparse"
and the attended (query, key) pairs are well below the dense count. Negative controls (a tail rule flipped, a
re-drawn parameter zeroed, groups ignored) move the logits far beyond the tolerance, so the comparison can fail.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from glm5_reference import build, save, text_config

import genoctx.model.dsa as dsa
from genoctx.model import HybridLM, load_hf
from genoctx.model.config import DSA
from genoctx.model.dsa import DSASelection
from genoctx.model.reference import masked_mla_attention

TOL = 1e-5  # fp32 relative error of the logits
CONTROL = 1e-4  # a wrong feature must move the logits by more than this (10x TOL; measured 1e-3 .. 2e-2)
T, B = 150, 2  # T >> index_topk + index_kpool (16 + 4 .. 32 + 16): most queries attend a fraction of their keys
V = 16  # vocab_size of glm5_reference.text_config

K_D_D_D_SHARED = dict(
    layer_types=["linear_attention"] + ["indexed_attention"] * 3,
    indexer_types=["full", "full", "shared", "full"],
)
CASES = {
    # (a) K K K D, dense first layer then MoE (glm5_reference.text_config)
    "kkkd": {},
    # (b) pools of 1, 4, 16 tokens, tail on and off (pools of 1 have no tail: both must equal the reference)
    **{
        f"kpool{kp}-tail-{'on' if tail else 'off'}": dict(
            index_kpool=kp, index_topk=16 if kp < 16 else 32, index_kpool_always_select_tail=tail
        )
        for kp in (1, 4, 16)
        for tail in (True, False)
    },
    # (c) adjacent DSA layers: full, shared (reuses the selection of the layer before), full again
    "shared": K_D_D_D_SHARED,
    # (d) group-limited routing: 4 groups of 2 experts, top-2 groups
    "n_group": dict(n_group=4, topk_group=2),
    # other switches of the published config
    "attention_bias": dict(attention_bias=True),
    "no_topk_norm-2_shared": dict(norm_topk_prob=False, n_shared_experts=2),
    "no_gate_bound": dict(linear_lower_bound=None),
    "one_stream": dict(hc_mult=1),
    "dsa_first": dict(
        num_hidden_layers=5,
        layer_types=["indexed_attention"] * 2 + ["linear_attention"] * 3,
        indexer_types=["full", "shared", "full", "full", "full"],
        mlp_layer_types=["sparse"] * 5,
    ),
}


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |a - ref| / max |ref|`` (the relative error of this file)."""
    return float((a.double() - ref.double()).abs().max() / ref.double().abs().max())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(case) -> (reference model, its save_pretrained directory)``, built once per module."""
    built = {}

    def get(case: str):
        if case not in built:
            ref = build(text_config(**CASES[case]), seed=0)
            path = tmp_path_factory.mktemp(case)
            save(ref, path)
            built[case] = (ref, path)
        return built[case]

    return get


def _tokens(b: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def _reference_run(ref, ids):
    """Reference logits [B, T, V] fp32 and each indexer's ``topk_indices`` [B, T, width] (token ids, -1 = empty), by
    layer index."""
    import transformers.models.glm5_next.modeling_glm5_next as M

    picked = {}
    hooks = [
        m.register_forward_hook(lambda mod, args, out, i=int(name.split(".")[-3]): picked.__setitem__(i, out))
        for name, m in ref.named_modules()
        if isinstance(m, M.Glm5NextTextIndexer)
    ]
    try:
        with torch.no_grad():
            logits = ref(input_ids=ids).logits.float()
    finally:
        for h in hooks:
            h.remove()
    return logits, picked


def _our_run(model: HybridLM, ids):
    """Our logits and each DSA layer's selection (``DSASelection``), by layer index."""
    sels = {}
    hooks = [
        layer.self_attn.register_forward_hook(lambda mod, args, out, i=i: sels.__setitem__(i, out[2]))
        for i, layer in enumerate(model.layers)
        if layer.layer_type == DSA
    ]
    try:
        with torch.no_grad():
            logits, _ = model(ids)
    finally:
        for h in hooks:
            h.remove()
    return logits, sels


def _mask(tok: torch.Tensor, n: int) -> torch.Tensor:
    """Token indices [B, T, W] (-1 = empty) -> [B, T, n] bool mask of the selected keys."""
    m = torch.zeros(*tok.shape[:2], n + 1, dtype=torch.bool)
    m.scatter_(-1, torch.where(tok < 0, n, tok.long()), True)
    return m[..., :n]


def _check_selection(model: HybridLM, ref_idx: dict, sels: dict, b: int, t: int) -> None:
    """Every DSA layer ran sparse, attended far fewer keys than dense, and selected exactly the reference's tokens
    (for shared layers: the selection of the full layer before them, as the reference's ``prev_topk_indices``)."""
    dense = b * t * (t + 1) // 2
    stats = model.layer_stats()
    last_full = None
    for i, layer in enumerate(model.layers):
        if layer.layer_type != DSA:
            continue
        s = stats[i]
        assert s["path"] == "sparse", (i, s)
        assert 0 < s["keys_attended"] < 0.7 * dense, (i, s["keys_attended"], dense)
        ours = _mask(sels[i].tokens(), t)
        assert int(ours.sum()) == s["keys_attended"]
        if layer.self_attn.indexer is not None:
            last_full = i
            theirs = _mask(ref_idx[i], t)
        else:
            assert s["indexer"] == "shared" and sels[i] is sels[last_full]
            theirs = _mask(ref_idx[last_full], t)
        assert torch.equal(ours, theirs), f"layer {i}: selection differs at {int((ours != theirs).sum())} entries"


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_reference(checkpoint, case):
    """(a) K K K D with a dense first layer, (b) index_kpool 1/4/16 with the tail on/off, (c) full/shared indexers
    on adjacent DSA layers, (d) n_group > 1; (f) all on batch 2. fp32, relative error <= 1e-5 on every logit, and
    the same selected tokens as the reference for every query of every DSA layer."""
    ref, path = checkpoint(case)
    ours = load_hf(path).eval()
    assert ours.cfg.layer_types == ref.config.text_config.layer_types
    assert next(ours.parameters()).dtype == torch.float32
    ids = _tokens(B, T)
    want, ref_idx = _reference_run(ref, ids)
    got, sels = _our_run(ours, ids)
    assert got.shape == want.shape == (B, T, V)
    assert rel(got, want) <= TOL
    _check_selection(ours, ref_idx, sels, B, T)

    # negative controls: the feature under test matters at this tolerance
    if ours.cfg.index_kpool > 1:  # the tail rule flipped
        wrong = load_hf(path).eval()
        for layer in wrong.layers:
            if layer.layer_type == DSA:
                layer.self_attn.tail = not layer.self_attn.tail
        assert rel(_our_run(wrong, ids)[0], want) > CONTROL
    if ours.cfg.n_group > 1:  # groups ignored
        wrong = load_hf(path).eval()
        for layer in wrong.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.n_group = 1
        assert rel(_our_run(wrong, ids)[0], want) > CONTROL


@pytest.mark.parametrize(
    "suffix", ["index_kpool_compress_ape", "index_kpool_compress_gate", "hc.base", "e_score_correction_bias"]
)
def test_redrawn_parameters_matter(checkpoint, suffix):
    """The parameters the reference initialises to constants were re-drawn; zeroing them in our copy moves the logits
    far beyond the tolerance, so the equality above covers their paths."""
    ref, path = checkpoint("kkkd")
    ours = load_hf(path).eval()
    ids = _tokens(B, T)
    want, _ = _reference_run(ref, ids)
    hit = 0
    with torch.no_grad():
        for name, t in list(ours.named_parameters()) + list(ours.named_buffers()):
            if name.endswith(suffix):
                assert float(t.abs().max()) > 0
                t.zero_()
                hit += 1
    assert hit > 0
    assert rel(_our_run(ours, ids)[0], want) > CONTROL


@pytest.mark.parametrize("t", [157, 7, 1])
def test_lengths_and_tiles_not_multiples(checkpoint, monkeypatch, t):
    """(e) Lengths that are not multiples of the pool (4), the KDA chunk (16), the MoE chunk (37 tokens), the
    indexer tiles (5 query rows x 32 pool columns, pruned in groups of 8: the 39 pools of 157 tokens make one full
    and one partial column block) or the attention tile (150 slots: 7 query rows of 19 selected tokens); and
    lengths below ``index_topk`` (7) and of one token, on batch 2."""
    monkeypatch.setattr(dsa, "INDEX_COL_BLOCK", 32)
    monkeypatch.setattr(dsa, "INDEX_GROUP", 8)
    monkeypatch.setattr(dsa, "INDEX_ROW_TILE", 5)
    ref, path = checkpoint("kkkd")
    loaded = load_hf(path)
    cfg = dataclasses.replace(loaded.cfg, kda_chunk_size=16, indexer_tile_tokens=160, moe_chunk_tokens=37)
    ours = HybridLM(cfg).eval()
    ours.load_state_dict(loaded.state_dict())
    for layer in ours.layers:
        if layer.layer_type == DSA:
            layer.self_attn.attn_tile_tokens = 150
    ids = _tokens(B, t, seed=2)
    want, ref_idx = _reference_run(ref, ids)
    got, sels = _our_run(ours, ids)
    assert rel(got, want) <= TOL
    if t > 100:
        _check_selection(ours, ref_idx, sels, B, t)
    else:  # too short for a sparse selection to skip much: still the reference's tokens
        for i, sel in sels.items():
            assert torch.equal(_mask(sel.tokens(), t), _mask(ref_idx[i], t))


def test_gradients_equal_reference_fp32(checkpoint):
    """LM-loss gradients of every parameter equal the reference's autograd gradients (fp32): relative error of all
    gradients together <= 1e-5, of each parameter <= 1e-3 (the mHC gradients are ~1e-6 and sums of cancelling
    terms). The indexers get no LM gradient in either (their inputs are detached / the reference's is no_grad)."""
    ref, path = checkpoint("shared")
    ref = copy.deepcopy(ref).train()
    ours = load_hf(path).train()
    ids = _tokens(B, T + 1, seed=3)
    x, y = ids[:, :-1], ids[:, 1:]
    F.cross_entropy(ref(input_ids=x).logits.float().reshape(-1, V), y.reshape(-1)).backward()
    loss = F.cross_entropy(ours(x)[0].reshape(-1, V), y.reshape(-1))
    loss.backward()
    theirs = dict(ref.named_parameters())
    num = den = 0.0
    compared = 0
    for name, p in ours.named_parameters():
        gr = theirs[name if name.startswith("lm_head") else "model.language_model." + name].grad
        if ".indexer." in name:
            assert p.grad is None and gr is None, name
            continue
        assert p.grad is not None and gr is not None, name
        assert rel(p.grad, gr) <= 1e-3, (name, rel(p.grad, gr))
        num = max(num, float((p.grad - gr).abs().max()))
        den = max(den, float(gr.abs().max()))
        compared += 1
    assert compared > 50 and num / den <= TOL


def _masked_dense_mla(calls):
    """A stand-in for ``dsa.sparse_mla``: the same math as a dense softmax over all keys with the selection as a mask
    (``reference.masked_mla_attention``, builds [B, H, T, N])."""

    def f(q, kv, sel: DSASelection, scale, tile_tokens=None):
        calls.append(q.shape[1])
        return masked_mla_attention(q, kv, _mask(sel.tokens(), kv.shape[1]), scale)

    return f


def _loss_and_grads(model: HybridLM, ids: torch.Tensor, splits: tuple[int, ...]):
    """Mean next-token loss plus the indexer KL (each chunk's mean weighted by its share of the tokens), over
    consecutive chunks with the carried cache; returns (loss, {name: grad}, final cache)."""
    x, y = ids[:, :-1], ids[:, 1:]
    n = x.shape[1]
    assert sum(splits) == n
    total, cache, s = 0.0, None, 0
    for c in splits:
        logits, cache = model(x[:, s : s + c], cache)
        ce = F.cross_entropy(logits.reshape(-1, V), y[:, s : s + c].reshape(-1), reduction="sum") / y.numel()
        total = total + ce + model.aux_loss() * (c / n)
        s += c
    params = [p for _, p in model.named_parameters()]
    grads = torch.autograd.grad(total, params, allow_unused=True)
    return total.detach(), dict(zip([k for k, _ in model.named_parameters()], grads, strict=True)), cache


def test_sparse_gradients_equal_dense_masked_fp64(checkpoint, monkeypatch):
    """fp64: loss and the gradient of every parameter through our sparse attention (``sparse_mla``: gathered tiles,
    hand-written backward) equal those of the same math as a dense masked softmax, on the model with full and
    shared DSA layers (the indexer KL, whose gradient is hand-written too, is in the loss)."""
    _, path = checkpoint("shared")
    model = load_hf(path, dtype=torch.float64).train()
    assert next(model.parameters()).dtype == torch.float64
    ids = _tokens(B, T + 1, seed=4)
    loss, grads, _ = _loss_and_grads(model, ids, (T,))
    calls = []
    monkeypatch.setattr(dsa, "sparse_mla", _masked_dense_mla(calls))
    loss_ref, grads_ref, _ = _loss_and_grads(model, ids, (T,))
    assert calls == [T, T, T]  # every DSA layer took the dense masked path
    torch.testing.assert_close(loss, loss_ref, rtol=1e-12, atol=0)
    for name, g in grads.items():
        if grads_ref[name] is None:
            assert g is None, name
            continue
        assert rel(g, grads_ref[name]) <= 1e-10, (name, rel(g, grads_ref[name]))


@pytest.mark.parametrize("splits", [(1, 2, 70, 77), (37, 37, 37, 39), (3, 147)])
def test_chunked_passes_equal_one_pass_fp64(checkpoint, splits):
    """One pass over 150 tokens equals consecutive chunks carrying the cache (MLA latents, pooled indexer keys and the
    incomplete pool's keys and gates, the shared selection, KDA state and conv tail): loss (next-token loss plus
    indexer KL) and every gradient, fp64. Chunks of 1 and 2 tokens are shorter than a pool and than the conv tail;
    37-token chunks end mid-pool."""
    _, path = checkpoint("shared")
    model = load_hf(path, dtype=torch.float64).train()
    ids = _tokens(B, T + 1, seed=5)
    loss, grads, cache = _loss_and_grads(model, ids, (T,))
    loss_k, grads_k, cache_k = _loss_and_grads(model, ids, splits)
    assert cache.position == cache_k.position == T
    torch.testing.assert_close(loss_k, loss, rtol=1e-12, atol=0)
    for name, g in grads.items():
        if g is None:
            assert grads_k[name] is None, name
            continue
        assert rel(grads_k[name], g) <= 1e-10, (name, rel(grads_k[name], g))
    assert any(".indexer." in n and g is not None for n, g in grads.items())  # the indexer KL is in the loss
    for i, (a, b) in enumerate(zip(cache.layers, cache_k.layers, strict=True)):
        for field in vars(a):
            u, v = getattr(a, field), getattr(b, field)
            if u is None:
                assert v is None, (i, field)
                continue
            assert u.shape == v.shape, (i, field)
            torch.testing.assert_close(v, u, rtol=1e-10, atol=1e-12, msg=f"layer {i} cache {field}")
    assert cache.layers[1].tail_k.shape[1] == T % 4  # the incomplete pool travels
