"""The Triton KPool indexer top-k (``kernels.indexer_topk``) against the PyTorch path
``genoctx.model.dsa.indexer_topk``: the same indices in the same order, at awkward sizes, in fp32 and fp16, with ties,
through both merge strategies and with offsets past 2^31 elements. Without CUDA the kernel runs under
TRITON_INTERPRET=1 (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

import kernels.indexer_topk as kit
from genoctx.model import dsa

SENTINEL = dsa.SENTINEL


def _dyadic(*shape, num: int, den: int) -> torch.Tensor:
    """Values ``k / den`` with ``|k| <= num``: every product and sum the indexer forms is exact in fp32 (and the
    inputs in fp16), so scores do not depend on the order of the sums and the selection must be bitwise equal."""
    return torch.randint(-num, num + 1, shape).float() / den


def _inputs(B, T, N, H, D, dtype, device, exact=True):
    if exact:  # |q.k| <= D, |score| <= H D: below 2^24 ulps of 2^-16
        q, w, k = (
            _dyadic(B, T, H, D, num=64, den=64),
            _dyadic(B, T, H, num=16, den=16),
            _dyadic(B, N, D, num=64, den=64),
        )
    else:
        q, w, k = torch.randn(B, T, H, D), torch.randn(B, T, H), torch.randn(B, N, D)
    return q.to(device, dtype), w.to(device, dtype), k.to(device, dtype)


CASES = {  # B, S (cached positions), T (queries), kpool, topk (pools), H_I, d_I
    "pools-K5": (2, 0, 27, 4, 5, 3, 5),  # K not a power of two; early rows see fewer pools than K
    "tokens-cache": (2, 11, 19, 1, 9, 2, 8),  # pools of one token, queries after a cache
    "many-blocks": (1, 70, 13, 1, 40, 4, 16),  # several key blocks merged into a running top-64
    "few-pools": (2, 3, 20, 4, 16, 2, 16),  # every query sees fewer pools than top-k
    "channel-chunks": (1, 6, 14, 2, 5, 2, 40),  # fp32: d_I in 3 chunks of 16 (the last one masked)
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_selection_equals_torch_path(case, dtype, device):
    """Exact scores: the kernel returns the PyTorch path's indices, order and sentinels, bit for bit (int64 and
    int32); the PyTorch path runs with small tiles so that its own pruning and block merges are exercised."""
    B, S, T, kpool, topk, H, D = CASES[case]
    P = (S + T) // kpool
    q, w, k = _inputs(B, T, P, H, D, dtype, device)
    vis = ((torch.arange(S, S + T) + 1) // kpool).to(device)
    want = dsa.indexer_topk(q, w, k, vis, topk, 64)
    got = kit.indexer_topk(q, w, k, vis, topk)
    assert got.shape == want.shape == (B, T, min(topk, P)) and got.dtype == torch.long
    assert torch.equal(got, want)
    assert torch.equal(kit.indexer_topk(q, w, k, vis, topk, index_dtype=torch.int32), want.int())
    assert bool((got == SENTINEL).any()) == (int(vis[0]) < got.shape[-1])


def test_random_inputs_equal_torch_path(device):
    """Continuous random fp32 inputs (scores rounded, summed in another order than torch's): still the same
    selection at this seed; a difference could only come from two scores within fp32 rounding of each other."""
    B, S, T, kpool, topk, H, D = 2, 8, 40, 2, 6, 4, 16
    q, w, k = _inputs(B, T, (S + T) // kpool, H, D, torch.float32, device, exact=False)
    vis = ((torch.arange(S, S + T) + 1) // kpool).to(device)
    assert torch.equal(kit.indexer_topk(q, w, k, vis, topk), dsa.indexer_topk(q, w, k, vis, topk, 1 << 12))


def test_ties_go_to_the_most_recent_pools(device):
    """Zero head weights (every score 0) keep the newest visible pools, newest first; duplicated keys (equal
    non-zero scores, which the 2^-40 tie-break cannot split at this magnitude) come out highest index first, as in
    the PyTorch path's final sort."""
    B, T, N, H, D = 1, 9, 40, 2, 8
    q, w, k = _inputs(B, T, N, H, D, torch.float32, device)
    vis = torch.arange(N - T + 1, N + 1, device=device)
    got = kit.indexer_topk(q, w * 0, k, vis, 5)
    assert torch.equal(got[0], vis[:, None] - 1 - torch.arange(5, device=device))
    q, w = q.abs(), w.abs() + 1  # non-negative queries and weights
    k[:, [3, 17, 30]] = 1.0  # three equal keys, the largest possible scores: the top of every row that sees them
    want = dsa.indexer_topk(q, w, k, vis, 5, 64)
    got = kit.indexer_topk(q, w, k, vis, 5)
    assert torch.equal(got, want)
    assert got[0, -1, :3].tolist() == [30, 17, 3]


def test_bitonic_merge_path(monkeypatch, device):
    """The GPU's merge (bitonic ``tl.topk``), run here under the interpreter at a tiny size, equals the PyTorch
    path too (the other tests use the interpreter's rank merge)."""
    monkeypatch.setattr(kit, "MERGE_SORT", True)
    B, S, T, topk, H, D = 1, 17, 6, 5, 4, 8
    q, w, k = _inputs(B, T, S + T, H, D, torch.float32, device)
    vis = torch.arange(S + 1, S + T + 1, device=device)
    assert torch.equal(kit.indexer_topk(q, w, k, vis, topk), dsa.indexer_topk(q, w, k, vis, topk, 64))


def test_offsets_past_2_31_elements(huge, device):
    """Queries and keys whose element offsets pass 2^31 (query stride 2^29 + 3 elements over 6 queries, key stride
    2^28 + 5 over 11 keys; sparse memory-mapped files): the same selection as compact copies."""
    if device != "cpu":
        pytest.skip("the sparse-file views are CPU memory")
    B, T, N, H, D = 1, 6, 11, 2, 16
    q, w, k = _inputs(B, T, N, H, D, torch.float16, device)
    st = 2**29 + 3
    qh = huge(q, (T * st, st, D, 1))
    kh = huge(k, (N * (2**28 + 5), 2**28 + 5, 1))
    assert (T - 1) * qh.stride(1) > 2**31 and (N - 1) * kh.stride(1) > 2**31
    vis = torch.tensor([3, 5, 5, 8, 10, 11])
    want = dsa.indexer_topk(q, w, k, vis, 4, 64)
    assert torch.equal(kit.indexer_topk(qh, w, kh, vis, 4), want)


def test_raises_and_shares_the_tie_break():
    assert kit.TIE_BREAK == dsa.TIE_BREAK and kit.SENTINEL == dsa.SENTINEL
    q, w, k = _inputs(1, 4, 4, 2, 8, torch.float32, "cpu")
    vis = torch.arange(1, 5)
    with pytest.raises(ValueError, match="topk >= 1"):
        kit.indexer_topk(q, w, k, vis, 0)
    for bad in (torch.arange(1, 4), torch.tensor([1, 3, 2, 4]), torch.arange(2, 6)):
        with pytest.raises(ValueError, match="visible"):
            kit.indexer_topk(q, w, k, bad, 2)
    with pytest.raises(ValueError, match="index_dtype"):
        kit.indexer_topk(q, w, k, vis, 2, index_dtype=torch.float32)
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        kit.indexer_topk(q.double(), w.double(), k.double(), vis, 2)
    assert kit.indexer_topk(q, w, k[:, :0], torch.zeros(4, dtype=torch.long), 3).shape == (1, 4, 0)
