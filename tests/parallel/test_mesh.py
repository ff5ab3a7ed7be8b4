"""The 4-D mesh (dp_replicate x ep x dp_shard x cp) trains exactly as one process (issue 13).

Two subprocess runs (two and four spawned gloo ranks) train two AdamW steps in each layout: FSDP=2, EP=2 and DP=2
on two ranks; EP=2 x CP=2, FSDP=2 x CP=2, DP=2 x EP=2, FSDP=2 x EP=2 and HSDP (2 replicas x FSDP=2) on four. One
process trains the same model on all the data ranks' windows batched. Every layout must give its loss (1e-5
relative) and every gradient (1e-4) at both steps, so the first optimizer step (sharded AdamW state, the global
gradient norm used for clipping, the router-bias update from all-reduced loads) is checked by the second step.

The model (``mesh_worker.mesh_config``): KDA, a full DSA layer and a shared one, a dense MLP and two MoE layers of 8
routed experts (top-2) with re-drawn router biases and mHC bases; the windows are real hg38 (chrM).
"""

import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from genoctx.data.fasta import iter_records
from genoctx.data.tokenizer import encode
from genoctx.train.loop import build_optimizer, train_step

sys.path.insert(0, str(Path(__file__).parent))
from mesh_worker import CASES, STEPS, mesh_model, train_config  # noqa: E402

L = 160  # window tokens: CP=2 pieces of 80
TWO = ["fsdp2", "dp2"]
FOUR = ["fsdp2_cp2", "hsdp2_2"]


@pytest.fixture(scope="module")
def windows() -> torch.Tensor:
    realdna = Path(__file__).resolve().parents[2] / "data" / "hg38"
    ((_, chrm),) = iter_records(realdna / "hg38_chrM.fa")
    m = torch.from_numpy(encode(chrm)[0].astype("int64"))
    return torch.stack([m[2000 + 3000 * i : 2000 + 3000 * i + L] for i in range(4)])


def _reference(batch: torch.Tensor) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = mesh_model()
        cfg = train_config()
        opt, sched = build_optimizer(model, cfg, cfg.steps)
        steps = []
        for _ in range(STEPS):
            m = train_step(model, opt, sched, batch, cfg, nullcontext())
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
            steps.append({"metrics": m, "grads": grads, "biases": biases})
    finally:
        torch.set_num_threads(threads)
    return steps


@pytest.fixture(scope="module")
def reference(windows):
    cache = {}

    def get(dp: int) -> list[dict]:
        if dp not in cache:
            cache[dp] = _reference(windows[:dp])
        return cache[dp]

    return get


def _spawn(windows, out: Path, world: int, cases: list[str]) -> list[dict]:
    torch.save({"windows": windows}, out / "windows.pt")
    worker = Path(__file__).with_name("mesh_worker.py")
    subprocess.run([sys.executable, str(worker), str(out), str(out / "windows.pt"), str(world), ",".join(cases)],
                   check=True, timeout=600)  # fmt: skip
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def two(windows, tmp_path_factory):
    return _spawn(windows, tmp_path_factory.mktemp("mesh2"), 2, TWO)


@pytest.fixture(scope="module")
def four(windows, tmp_path_factory):
    return _spawn(windows, tmp_path_factory.mktemp("mesh4"), 4, FOUR)


def _expert_rows(name: str, grad: torch.Tensor, offsets: dict, ref: torch.Tensor) -> torch.Tensor:
    """The rows of the one-process gradient that a rank's expert block holds (its full gradient otherwise)."""
    module = name.rsplit(".", 1)[0]
    if module in offsets and grad.shape != ref.shape:
        return ref[offsets[module] : offsets[module] + grad.shape[0]]
    return ref


def _assert_layout_equals_one_process(ranks: list[dict], case: str, ref: list[dict]) -> None:
    full = sum(g.numel() for g in ref[0]["grads"].values())
    for r, res in enumerate(ranks):
        got = res[case]
        lay = got["layout"]
        experts = sum(g.numel() for n, g in ref[0]["grads"].items() if ".mlp.experts." in n)
        # what this rank holds: dense parameters / dense_shard, routed experts / (ep x expert_shard) (FSDP pads
        # uneven shards by < 1 row per parameter); AdamW keeps two moments of the same shape
        fsdp = lay["dp_shard"] > 1
        dense_shard = lay["ep"] * lay["dp_shard"] * lay["cp"] if fsdp else 1
        expert_shard = lay["ep"] * (lay["dp_shard"] * lay["cp"] if fsdp else 1)
        want = (full - experts) / dense_shard + experts / expert_shard
        assert want * 0.9 <= got["local_numel"] <= want * 1.1, (case, got["local_numel"], want, full)
        assert got["optimizer_numel"] == 2 * got["local_numel"]
        for step in range(STEPS):
            g_step, r_step = got["steps"][step], ref[step]
            assert g_step["metrics"]["scored_tokens"] == r_step["metrics"]["scored_tokens"]
            assert g_step["metrics"]["loss"] == pytest.approx(r_step["metrics"]["loss"], rel=1e-5), (case, r, step)
            assert g_step["metrics"]["grad_norm"] == pytest.approx(r_step["metrics"]["grad_norm"], rel=1e-4)
            assert set(g_step["grads"]) == set(r_step["grads"]), case
            for name, g in g_step["grads"].items():
                want = _expert_rows(name, g, got["offsets"], r_step["grads"][name])
                tol = 1e-4 * float(want.abs().max()) + 1e-9
                torch.testing.assert_close(g, want, rtol=1e-4, atol=tol, msg=f"{case} rank {r} step {step} {name}")
            for name, b in g_step["biases"].items():
                torch.testing.assert_close(b, r_step["biases"][name], rtol=0, atol=1e-7)


@pytest.mark.parametrize("case", TWO)
def test_two_rank_layouts_equal_one_process(two, reference, case):
    ep, dp_shard, cp = CASES[case]
    layout = two[0][case]["layout"]
    assert (layout["ep"], layout["dp_shard"], layout["cp"]) == (ep, dp_shard, cp)
    dp = layout["dp_replicate"] * ep * dp_shard
    _assert_layout_equals_one_process(two, case, reference(dp))


@pytest.mark.parametrize("case", FOUR)
def test_four_rank_layouts_equal_one_process(four, reference, case):
    ep, dp_shard, cp = CASES[case]
    layout = four[0][case]["layout"]
    assert (layout["ep"], layout["dp_shard"], layout["cp"]) == (ep, dp_shard, cp)
    dp = layout["dp_replicate"] * ep * dp_shard
    _assert_layout_equals_one_process(four, case, reference(dp))
