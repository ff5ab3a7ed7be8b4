"""Context and data parallelism on gloo with 2 processes equal one process (DESIGN.md correctness rules).

One subprocess run (two spawned gloo ranks) computes every distributed case; the tests compare them with
the single-process loop (``forward_backward`` with no parallel dims), forward and backward.
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
from genoctx.train.loop import forward_backward

L = 320  # window tokens: 160 per CP rank = 10 KDA chunks of 16; top-16 sparse attention over up to 320 keys


def _tiny() -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(preset("tiny"))


def _reference(tokens: torch.Tensor) -> dict:
    model = _tiny()
    loss_sum, count, aux = forward_backward(model, tokens, nullcontext())
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
    }


@pytest.fixture(scope="module")
def distributed(windows, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("cp")
    torch.save(windows, out / "windows.pt")
    worker = Path(__file__).with_name("cp_worker.py")
    subprocess.run([sys.executable, str(worker), str(out), str(out / "windows.pt")], check=True, timeout=300)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _assert_same(dist_case: dict, ref: dict) -> None:
    assert dist_case["count"] == ref["count"]
    loss, loss_ref = dist_case["loss_sum"] / ref["count"], ref["loss_sum"] / ref["count"]
    assert loss == pytest.approx(loss_ref, rel=1e-5)
    assert dist_case["aux"] == pytest.approx(ref["aux"], rel=1e-5, abs=1e-7)
    for name, g_ref in ref["grads"].items():
        g = dist_case["grads"][name]
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-4 * float(g_ref.abs().max()) + 1e-9, msg=name)


def test_cp2_equals_cp1_loss_and_every_gradient(distributed, windows):
    ref = _reference(windows["dna"][None])
    assert ref["count"] == L and any(g.abs().max() > 0 for g in ref["grads"].values())
    for rank in range(2):  # gradients are all-reduced: both ranks must hold the one-process gradient
        _assert_same(distributed[rank]["cp2"], ref)


def test_cp_splits_dsa_keys_scored_unevenly(distributed):
    """Causal imbalance: rank 1's queries see rank 0's keys too, so it scores (3x here) more keys."""
    T = L // 2
    k0 = distributed[0]["cp2"]["keys_scored"][1]
    k1 = distributed[1]["cp2"]["keys_scored"][1]
    assert k0 == T * (T + 1) // 2 and k1 == T * T + T * (T + 1) // 2
    assert k0 + k1 == L * (L + 1) // 2  # together exactly the one-process causal pairs


def test_all_n_slice_on_one_rank_gives_the_cp1_loss(distributed, windows):
    ref = _reference(windows["n_start"][None])
    assert ref["count"] == L // 2
    for rank in range(2):
        case = distributed[rank]["cp2_n"]
        assert all(torch.isfinite(g).all() for g in case["grads"].values())
        _assert_same(case, ref)


def test_dp2_equals_one_process_with_both_windows_batched(distributed, windows):
    ref = _reference(windows["pair"])
    for rank in range(2):
        _assert_same(distributed[rank]["dp2"], ref)
