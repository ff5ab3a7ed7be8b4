"""Context and data parallelism on gloo with 2 and 4 processes equal one process (DESIGN.md correctness rules).

Two subprocess runs (two and four spawned gloo ranks) compute every distributed case: CP=2 in the contiguous
and zigzag layouts, DP=2, and CP=4 in both layouts (the KDA fold over 4 and 8 pieces). The tests compare them
with the single-process loop (``forward_backward`` with no parallel dims), forward and backward.
"""

import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from genoctx.data.fasta import iter_records
from genoctx.data.tokenizer import N, encode
from genoctx.model.config import preset
from genoctx.model.model import HybridLM
from genoctx.parallel.context import cp_pieces, shard_sequence
from genoctx.train.loop import forward_backward

L = 320  # window tokens: 160 per CP rank = 10 KDA chunks of 16; top-16 sparse attention over up to 320 keys
L4 = 256  # CP=4 window: zigzag pieces of 32 tokens = 2 KDA chunks of the tiny preset


def _tiny() -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(preset("tiny"))


def _reference(tokens: torch.Tensor) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: tiny ops, and no spinning against other processes
    try:
        model = _tiny()
        loss_sum, count, aux = forward_backward(model, tokens, nullcontext())
    finally:
        torch.set_num_threads(threads)
    return {
        "loss_sum": float(loss_sum),
        "count": int(count),
        "aux": aux,
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
    }


@pytest.fixture(scope="module")
def windows() -> dict:
    """Real hg38 windows: chrM bases; chr1 around base 10,000 where the leading N run ends (first half N)."""
    realdna = Path(__file__).resolve().parents[2] / "data" / "hg38"  # the realdna fixture's folder (module scope)
    ((_, chrm),) = iter_records(realdna / "hg38_chrM.fa")
    ((_, chr1),) = iter_records(realdna / "hg38_chr1_1-1000000.fa.gz")
    m = torch.from_numpy(encode(chrm)[0].astype("int64"))
    c1 = torch.from_numpy(encode(chr1[:20_000])[0].astype("int64"))
    n_start = c1[10_000 - L // 2 : 10_000 + L // 2]
    assert bool((n_start[: L // 2] == N).all()) and not bool((n_start[L // 2 :] == N).any())
    return {
        "dna": m[1000 : 1000 + L],
        "n_start": n_start,
        "pair": torch.stack([m[5000 : 5000 + L], m[9000 : 9000 + L]]),
        "short": m[12000 : 12000 + L4],
    }


@pytest.fixture(scope="module")
def reference(windows):
    """One-process results per window name (computed once)."""
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            w = windows[name]
            cache[name] = _reference(w if w.dim() == 2 else w[None])
        return cache[name]

    return get


def _spawn(windows, out: Path, world: int) -> list[dict]:
    torch.save(windows, out / "windows.pt")
    worker = Path(__file__).with_name("cp_worker.py")
    cmd = [sys.executable, str(worker), str(out), str(out / "windows.pt"), str(world)]
    subprocess.run(cmd, check=True, timeout=300)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def distributed(windows, tmp_path_factory) -> list[dict]:
    return _spawn(windows, tmp_path_factory.mktemp("cp"), 2)


@pytest.fixture(scope="module")
def distributed4(windows, tmp_path_factory) -> list[dict]:
    return _spawn(windows, tmp_path_factory.mktemp("cp4"), 4)


def _assert_same(dist_case: dict, ref: dict) -> None:
    assert dist_case["count"] == ref["count"]
    loss, loss_ref = dist_case["loss_sum"] / ref["count"], ref["loss_sum"] / ref["count"]
    assert loss == pytest.approx(loss_ref, rel=1e-5)
    assert dist_case["aux"] == pytest.approx(ref["aux"], rel=1e-5, abs=1e-7)
    for name, g_ref in ref["grads"].items():
        g = dist_case["grads"][name]
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-4 * float(g_ref.abs().max()) + 1e-9, msg=name)


def _dsa_keys(case: dict) -> int:
    """DSA keys scored by one rank (the tiny preset's layer 1 is its DSA layer)."""
    return case["keys_scored"][1]


def test_cp_pieces_and_shard_sequence_layouts():
    assert cp_pieces(2) == [[0], [1]]
    assert cp_pieces(2, "zigzag") == [[0, 3], [1, 2]]
    assert cp_pieces(4, "zigzag") == [[0, 7], [1, 6], [2, 5], [3, 4]]
    x = torch.arange(16).view(1, 8, 2)
    assert shard_sequence(x, 2, 0, "zigzag")[0, :, 0].tolist() == [0, 2, 12, 14]
    assert shard_sequence(x, 2, 1, "zigzag")[0, :, 0].tolist() == [4, 6, 8, 10]
    assert shard_sequence(x, 2, 1)[0, :, 0].tolist() == [8, 10, 12, 14]
    for layout in ("contiguous", "zigzag"):  # the ranks' pieces together are the window, each token once
        for cp in (1, 2, 4):
            y = torch.arange(24).view(1, 24)
            got = torch.cat([shard_sequence(y, cp, r, layout) for r in range(cp)], dim=1)
            assert sorted(got[0].tolist()) == list(range(24))
    with pytest.raises(ValueError, match="sequence length 10 is not a multiple of 4 pieces"):
        shard_sequence(torch.zeros(1, 10), 2, 0, "zigzag")
    with pytest.raises(ValueError, match="cp_layout"):
        cp_pieces(2, "diagonal")


@pytest.mark.parametrize("case", ["cp2", "cp2z"])
def test_cp2_equals_cp1_loss_and_every_gradient(distributed, reference, case):
    ref = reference("dna")
    assert ref["count"] == L and any(g.abs().max() > 0 for g in ref["grads"].values())
    for rank in range(2):  # gradients are all-reduced: both ranks must hold the one-process gradient
        _assert_same(distributed[rank][case], ref)


def test_cp_splits_dsa_keys_scored_unevenly(distributed):
    """Causal imbalance: rank 1's queries see rank 0's keys too, so it scores (3x here) more keys."""
    T = L // 2
    k0, k1 = (_dsa_keys(distributed[r]["cp2"]) for r in range(2))
    assert k0 == T * (T + 1) // 2 and k1 == T * T + T * (T + 1) // 2
    assert k0 + k1 == L * (L + 1) // 2  # together exactly the one-process causal pairs


def test_zigzag_splits_dsa_keys_scored_evenly(distributed):
    """Zigzag: rank 0 holds pieces 0 and 3, rank 1 pieces 1 and 2 (of L/4): both score c^2 x 3 + c (c + 1)."""
    c = L // 4
    k0, k1 = (_dsa_keys(distributed[r]["cp2z"]) for r in range(2))
    assert k0 == k1 == 3 * c * c + c * (c + 1)
    assert k0 + k1 == L * (L + 1) // 2


@pytest.mark.parametrize("case", ["cp2_n", "cp2z_n"])
def test_all_n_slice_on_one_rank_gives_the_cp1_loss(distributed, reference, case):
    """The window's first half is N: contiguous, rank 0's whole slice; zigzag, pieces 0 and 1 (one per rank)."""
    ref = reference("n_start")
    assert ref["count"] == L // 2
    for rank in range(2):
        got = distributed[rank][case]
        assert all(torch.isfinite(g).all() for g in got["grads"].values())
        _assert_same(got, ref)


def test_dp2_equals_one_process_with_both_windows_batched(distributed, reference):
    ref = reference("pair")
    for rank in range(2):
        _assert_same(distributed[rank]["dp2"], ref)


@pytest.mark.parametrize("case", ["cp4", "cp4z"])
def test_cp4_equals_cp1_loss_and_every_gradient(distributed4, reference, case):
    """Four ranks: the KDA state is folded over 4 (contiguous) or 8 (zigzag) pieces in natural order."""
    ref = reference("short")
    assert ref["count"] == L4
    for rank in range(4):
        _assert_same(distributed4[rank][case], ref)


def test_cp4_dsa_keys_scored_per_rank(distributed4):
    T, c = L4 // 4, L4 // 8
    contiguous = [_dsa_keys(distributed4[r]["cp4"]) for r in range(4)]
    zigzag = [_dsa_keys(distributed4[r]["cp4z"]) for r in range(4)]
    assert contiguous == [T * T * r + T * (T + 1) // 2 for r in range(4)]
    assert zigzag == [7 * c * c + c * (c + 1)] * 4
    assert sum(contiguous) == sum(zigzag) == L4 * (L4 + 1) // 2
