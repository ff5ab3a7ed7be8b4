"""Expert parallelism: the round schedule, EP=1 in one process == MoE, and EP=2 on gloo == one process.

The round schedule and the per-expert split of a round are pure functions, tested on random count matrices. One
process runs ``apply_ep`` with a single rank (the rounds and the autograd Function without communication) against
the class ``MoE`` in fp64. One run of ``ep_worker.py``'s ranks (two gloo processes, ``mesh_runner.fork_ranks``)
computes every EP=2 case: random routing with unequal token counts, every row forced onto rank 0's experts in many
rounds, a rank with no token, and the peak memory of one forward + backward with balanced and forced routing, with
and without rounds.
"""

import copy
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from genoctx.model.moe import MoE
from genoctx.parallel.experts import (
    apply_ep,
    expert_parameters,
    n_rounds,
    round_bounds,
    round_schedule,
    rows_per_expert,
)

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import ep_worker  # noqa: E402
from ep_worker import CASES, EP, MEM_TOKENS, MEMORY_CASES, ep_moe, ep_tokens  # noqa: E402
from mesh_runner import fork_ranks  # noqa: E402

EXPERT_PARAMS = ("experts.gate_up_proj", "experts.down_proj")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops, as in the workers: one thread, no spinning against the other processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _random_pairs(gen: torch.Generator):
    """(pair [P, P] int64, cap) count matrices: uniform, skewed onto one destination, a permutation, zeros."""
    for P in (1, 2, 3, 4, 8):
        for cap in (P, P + 1, 7 * P, 64):
            yield torch.randint(0, 50, (P, P), generator=gen), cap
            skew = torch.zeros(P, P, dtype=torch.long)
            skew[:, 0] = torch.randint(0, 200, (P,), generator=gen)  # every source to destination 0
            yield skew, cap
            yield torch.eye(P, dtype=torch.long)[torch.randperm(P, generator=gen)] * 97, cap
            yield torch.zeros(P, P, dtype=torch.long), cap


def test_round_schedule_delivers_every_row_once_within_the_bound():
    gen = torch.Generator().manual_seed(0)
    for pair, cap in _random_pairs(gen):
        P = pair.shape[0]
        sched = round_schedule(pair, cap)  # [R, P, P]
        R = sched.shape[0]
        assert R == n_rounds(pair, cap)
        assert torch.equal(sched, round_schedule(pair.clone(), cap))  # deterministic: a function of the counts
        assert torch.equal(sched.sum(0), pair) and bool((sched >= 0).all())  # every row exactly once
        if R:
            assert int(sched.sum(1).max()) <= cap  # rows a destination receives in one round
            assert int(sched.sum(2).max()) <= cap  # rows a source sends in one round
        M = int(max(pair.sum(0).max(), pair.sum(1).max()))
        assert R == -(-M // (cap - P + 1)) and R >= -(-M // cap)  # rounds: at least the receive-bound optimum
        # the rounds cut each pair's block into consecutive slices [lo, hi) that cover it once, in order
        prev = torch.zeros_like(pair)
        for r in range(R):
            lo, hi = round_bounds(pair, R, r)
            assert torch.equal(lo, prev) and bool((hi >= lo).all())
            prev = hi
        assert torch.equal(prev, pair)


def test_round_schedule_of_forced_routing_keeps_the_bound():
    """Both ranks send all their rows to rank 0 (the worker's forced case): twice the rounds, none over cap."""
    pair = torch.tensor([[4096, 0], [4096, 0]])
    sched = round_schedule(pair, 256)
    assert sched.shape[0] == -(-8192 // 255) == 33
    assert int(sched[:, :, 0].sum(1).max()) <= 256 and int(sched[:, :, 1].sum()) == 0


def test_n_rounds_rejects_bad_input():
    with pytest.raises(ValueError, match="less than ep=4"):
        n_rounds(torch.ones(4, 4, dtype=torch.long), 3)
    with pytest.raises(ValueError, match=r"\[ep, ep\]"):
        n_rounds(torch.ones(2, 3, dtype=torch.long), 8)
    with pytest.raises(ValueError, match="negative"):
        n_rounds(-torch.ones(2, 2, dtype=torch.long), 8)


def test_rows_per_expert_splits_each_round_by_expert():
    """The receiver's per-(source, expert) counts of a round equal those of the explicit expert-sorted rows."""
    gen = torch.Generator().manual_seed(1)
    for P, El, cap in ((2, 4, 6), (3, 2, 5), (4, 3, 40)):
        counts = torch.randint(0, 9, (P, P * El), generator=gen)
        counts[0, :El] += 30  # a skewed destination
        pair = counts.view(P, P, El).sum(-1)
        R = n_rounds(pair, cap)
        for me in range(P):
            block = counts[:, me * El : (me + 1) * El]
            # source s's rows for `me`, sorted by local expert: expert ids repeated by their counts
            rows = [torch.arange(El).repeat_interleave(block[s]) for s in range(P)]
            total = torch.zeros_like(block)
            for r in range(R):
                lo, hi = round_bounds(pair, R, r)
                got = rows_per_expert(block, lo[:, me], hi[:, me])
                want = torch.stack([torch.bincount(rows[s][lo[s, me] : hi[s, me]], minlength=El) for s in range(P)])
                assert torch.equal(got, want)
                total += got
            assert torch.equal(total, block)


def _fwd_bwd(moe: MoE, x: torch.Tensor, g: torch.Tensor, autocast: bool = False) -> list[torch.Tensor]:
    xi = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = moe(xi)
    loss = (y.to(g.dtype) * g).sum() + (moe.aux_loss if moe.aux_loss is not None else 0)
    return [y, *torch.autograd.grad(loss, [xi, *moe.parameters()])]


@pytest.mark.parametrize("kw", [dict(), dict(moe_aux_loss_coef=0.1, n_group=2, topk_group=1, num_experts_per_tok=2)])
def test_one_rank_ep_equals_moe_fp64(kw):
    """ep=1 (no group): the rounds, the regrouping by expert and the autograd Function alone, against the class
    forward in fp64: the output and the gradients of x and every parameter to 1e-12, in several rounds."""
    overrides = dict(moe_chunk_tokens=5, **kw)
    ref = ep_moe(overrides, "random").double()
    ep = copy.deepcopy(ref)
    handles = apply_ep(ep, None, 1, 0)
    x, g = (t.double() for t in ep_tokens("one", 0, (2, 23), 32))
    want, got = _fwd_bwd(ref, x, g), _fwd_bwd(ep, x, g)
    names = ["y", "x"] + [n for n, _ in ep.named_parameters()]
    for name, a, b in zip(names, got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=name)
    k = ref.top_k
    s = ep.stats
    assert torch.equal(s["tokens_per_expert"], ref.stats["tokens_per_expert"])
    assert s["ep_received_rows"] == 46 * k and s["ep_rounds"] == -(-46 * k // (5 * k)) > 1
    assert s["ep_max_round_rows"] <= 5 * k
    ex = ep.experts
    assert (ex.ep_size, ex.ep_rank, ex.expert_offset, ex.n_local_experts) == (1, 0, 0, 8)
    assert expert_parameters(ep) == [ex.gate_up_proj, ex.down_proj]
    assert all(p._genoctx_expert for p in expert_parameters(ep)) and not expert_parameters(ref)
    with torch.no_grad():  # evaluation: no graph, same values
        torch.testing.assert_close(ep(x), ref(x), atol=1e-12, rtol=1e-12)
    for h in handles:
        h.remove()
    assert "forward" not in vars(ep) and "forward" not in vars(ex)  # the class forwards are back


def test_one_rank_ep_under_bf16_autocast_recomputes_in_bf16(monkeypatch):
    """The expert recomputation in backward runs under the forward's autocast (bf16, as the forward ran; the caller's
    backward runs outside autocast): every expert call returns bf16, and the output and gradients are within bf16
    rounding (2e-2 of the largest value; 0.3% measured) of the class forward's."""
    import genoctx.parallel.experts as ep_mod

    calls, original = [], ep_mod.expert_mlp

    def recording_mlp(*args):
        out = original(*args)
        calls.append((torch.is_grad_enabled(), out.dtype))
        return out

    monkeypatch.setattr(ep_mod, "expert_mlp", recording_mlp)
    ref = ep_moe(dict(moe_chunk_tokens=5), "random")
    ep = copy.deepcopy(ref)
    apply_ep(ep, None, 1, 0)
    x, g = ep_tokens("bf16", 0, (2, 23), 32)
    want, got = _fwd_bwd(ref, x, g, autocast=True), _fwd_bwd(ep, x, g, autocast=True)
    assert got[0].dtype == torch.bfloat16
    assert {c[0] for c in calls} == {False, True}  # forward (no grad) and backward recomputation (grad) calls
    assert {c[1] for c in calls} == {torch.bfloat16}
    for a, b in zip(got, want, strict=True):
        assert _rel(a.detach().float(), b.detach().float()) <= 2e-2


def test_apply_ep_rejects_bad_layouts():
    moe = ep_moe(dict(), "zero")
    with pytest.raises(ValueError, match="n_routed_experts=8 is not divisible by ep=3"):
        apply_ep(moe, None, 3, 0)
    with pytest.raises(ValueError, match="ep_rank 2 is not in"):
        apply_ep(moe, None, 2, 2)
    with pytest.raises(ValueError, match="less than ep=4"):
        apply_ep(ep_moe(dict(moe_chunk_tokens=1, num_experts_per_tok=2), "zero"), None, 4, 0)
    with pytest.raises(ValueError, match="needs a process group"):
        apply_ep(moe, None, 2, 0)
    assert moe.experts.gate_up_proj.shape[0] == 8 and not expert_parameters(moe)  # nothing changed
    apply_ep(moe, None, 1, 0)
    with pytest.raises(ValueError, match="already has expert parallelism"):
        apply_ep(moe, None, 1, 0)


@pytest.fixture(scope="module")
def distributed(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ep")
    # ep_worker.py's ranks, forked from the preloaded server (as ``python ep_worker.py OUT``)
    fork_ranks(ep_worker.run, (tempfile.mktemp(prefix="genoctx-gloo-"), str(out)), EP, timeout=300)
    return [torch.load(out / f"rank{r}.pt") for r in range(EP)]


def _reference(case: str) -> dict:
    """One process, all 8 experts: each rank's tokens through the MoE separately (outputs, input gradients, loads,
    aux losses per rank); the parameter gradients of the sum of both ranks' losses."""
    overrides, bias, shapes = CASES[case]
    moe = ep_moe(overrides, bias)
    ranks = []
    for r, shape in enumerate(shapes):
        x, g = ep_tokens(case, r, shape, moe.experts.hidden_size)
        if x.numel() == 0:  # no token: nothing to compare but shapes, no gradient to add
            ranks.append({"y": torch.zeros_like(x), "x_grad": torch.zeros_like(x), "aux": None})
            continue
        x.requires_grad_(True)
        y = moe(x)
        loss = (y * g).sum() + (moe.aux_loss if moe.aux_loss is not None else 0)
        loss.backward()
        aux = None if moe.aux_loss is None else float(moe.aux_loss.detach())
        tpe = moe.stats["tokens_per_expert"]
        ranks.append({"y": y.detach(), "x_grad": x.grad, "aux": aux, "tokens_per_expert": tpe})
    return {"ranks": ranks, "grads": {n: p.grad for n, p in moe.named_parameters()}, "top_k": moe.top_k}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 for empty tensors)."""
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("case", list(CASES))
def test_ep2_equals_one_process_forward_and_every_gradient(distributed, case):
    """Outputs (1e-6) and input gradients (1e-5) per rank equal one process on that rank's tokens; each rank's
    expert gradients equal its rows of the one-process gradient over both ranks' tokens (the owner already holds
    every rank's contribution); router and shared-expert gradients summed over the ranks equal one process's."""
    ref = _reference(case)
    El = 8 // EP
    for r in range(EP):
        got, want = distributed[r][case], ref["ranks"][r]
        assert got["y"].shape == want["y"].shape
        assert _rel(got["y"], want["y"]) <= 1e-6
        assert _rel(got["x_grad"], want["x_grad"]) <= 1e-5
        assert got["offset"] == r * El
        if want["aux"] is not None:
            assert got["aux"] == pytest.approx(want["aux"], rel=1e-6)
            assert torch.equal(got["stats"]["tokens_per_expert"], want["tokens_per_expert"])  # global ids, [8]
            assert torch.equal(got["load_counts"], want["tokens_per_expert"])
        for name in EXPERT_PARAMS:
            g_ref = ref["grads"][name]
            assert got["grads"][name].shape[0] == El
            assert _rel(got["grads"][name], g_ref[r * El : (r + 1) * El]) <= 1e-5, name
    for name, g_ref in ref["grads"].items():
        if name not in EXPERT_PARAMS:
            assert _rel(sum(distributed[r][case]["grads"][name] for r in range(EP)), g_ref) <= 1e-5, name
    slots = sum(int(distributed[r][case]["stats"]["tokens_per_expert"].sum()) for r in range(EP))
    assert sum(distributed[r][case]["stats"]["ep_received_rows"] for r in range(EP)) == slots  # none dropped
    assert distributed[0][case]["stats"]["ep_rounds"] == distributed[1][case]["stats"]["ep_rounds"] > 1


def test_ep2_forced_routing_runs_in_rounds_of_bounded_size(distributed):
    """Every (token, slot) of both ranks goes to experts 0-2 (rank 0): rank 0 receives all 168 rows in
    ceil(168 / (12 - 1)) = 16 rounds of at most moe_chunk_tokens x top-k = 12 rows; rank 1 receives none and
    still runs every round (its results equal one process above)."""
    overrides, _, shapes = CASES["forced"]
    cap = overrides["moe_chunk_tokens"] * 3
    total = sum(b * t for b, t in shapes) * 3
    s0, s1 = (distributed[r]["forced"]["stats"] for r in range(EP))
    assert bool((s0["tokens_per_expert"][3:] == 0).all()) and bool((s1["tokens_per_expert"][3:] == 0).all())
    assert (s0["ep_received_rows"], s1["ep_received_rows"], s1["ep_max_round_rows"]) == (total, 0, 0)
    assert s0["ep_max_round_rows"] <= cap
    assert s0["ep_rounds"] == s1["ep_rounds"] == -(-total // (cap - EP + 1)) == 16
    for r in range(EP):  # one host read (the gathered counts) for the 16 rounds, forward and backward: none per round
        assert distributed[r]["forced"]["syncs"] == ({"ep.counts": 1}, {})


def test_ep2_rank_without_tokens_receives_and_takes_part(distributed):
    s0, s1 = (distributed[r]["empty"]["stats"] for r in range(EP))
    assert int(s1["tokens_per_expert"].sum()) == 0 and s1["ep_received_rows"] > 0
    assert s0["ep_rounds"] == s1["ep_rounds"]


def test_ep_peak_memory_does_not_depend_on_routing(distributed):
    """Peak live tensor bytes (torch's MemTracker) of one forward + backward on the busiest rank: with every row of
    both ranks forced onto rank 0's experts (twice the rows, in twice the rounds) within 15% of balanced routing;
    in a single round (moe_chunk_tokens beyond the tokens: no bound) the forced rank would need far more."""
    mem = {name: [distributed[r]["memory"][name] for r in range(EP)] for name in MEMORY_CASES}
    busiest = {name: max(m["peak_bytes"] for m in mem[name]) for name in MEMORY_CASES}
    cap = MEMORY_CASES["forced"][0]["moe_chunk_tokens"] * 2
    forced0 = mem["forced"][0]["stats"]
    assert forced0["ep_received_rows"] == EP * MEM_TOKENS * 2 and mem["forced"][1]["stats"]["ep_received_rows"] == 0
    for name in ("balanced", "forced"):
        assert all(m["stats"]["ep_max_round_rows"] <= cap for m in mem[name])
    balanced_rows = [m["stats"]["ep_received_rows"] for m in mem["balanced"]]
    assert max(balanced_rows) < 1.2 * MEM_TOKENS * 2  # balanced: each rank receives about its own share
    assert busiest["forced"] <= 1.15 * busiest["balanced"]
    # without rounds the forced rank receives all 8192 rows at once: the bound is what keeps the peak flat
    assert mem["forced_one_round"][0]["stats"]["ep_max_round_rows"] == EP * MEM_TOKENS * 2
    assert busiest["forced_one_round"] > 1.15 * busiest["balanced_one_round"]
    assert busiest["forced_one_round"] > 1.15 * busiest["balanced"]


def _lora_moe(frozen: bool = True) -> MoE:
    """``ep_moe`` in fp64 (moe_intermediate_size 24: the experts' weight shapes [48, 32] / [32, 24] differ from
    every other matmul's output here) with rank-2 LoRA adapters on both expert projections, B drawn non-zero (a
    fresh B is zero: its A would get no gradient), the base expert weights frozen unless ``frozen`` is False."""
    from genoctx.model.lora import EXPERT_TARGETS, apply_lora

    moe = ep_moe(dict(moe_chunk_tokens=5, moe_intermediate_size=24), "random").double()
    apply_lora(moe, 2, 6.0, EXPERT_TARGETS, seed=3)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name in ("gate_up_proj_lora_B", "down_proj_lora_B"):
            b = getattr(moe.experts, name)
            b.copy_(torch.randn(b.shape, generator=gen, dtype=b.dtype) * 0.3)
    for name in EXPERT_PARAMS:
        moe.get_parameter(name).requires_grad_(not frozen)
    return moe


class _MatmulShapes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the output shape of every matmul (mm, addmm, bmm) run while active."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.shapes.append(tuple(out.shape))
        return out


def _weight_grad_matmuls(moe: MoE, x: torch.Tensor, g: torch.Tensor) -> int:
    """Matmuls of ``moe``'s backward whose output has an expert weight's shape (one expert's ``gate_up`` [2I, D] or
    ``down`` [D, I]): its weight-gradient products (each round gives an expert at most moe_chunk_tokens x top-k =
    15 rows, so no activation has these shapes)."""
    ex = moe.experts
    weights = {tuple(ex.gate_up_proj.shape[1:]), tuple(ex.down_proj.shape[1:])}
    xi = x.clone().requires_grad_(True)
    loss = (moe(xi) * g).sum()
    with _MatmulShapes() as mode:
        loss.backward()
    return sum(s in weights for s in mode.shapes)


def test_ep_lora_gradients_equal_the_merged_weights():
    """LoRA on the routed experts under EP (ep=1: the rounds and the autograd Function without communication), fp64,
    base expert weights frozen: the output and the gradients of x, of the four expert adapters and of the router and
    shared expert equal autograd through the merged formulation (the slow reference: a merged copy run with
    ``W + s B_e A_e`` built from the adapters by ``merged_parameters``) to 1e-12, in several rounds; the frozen
    weights get no gradient."""
    from torch.func import functional_call

    from genoctx.model.lora import merge_lora, merged_parameters

    ref = _lora_moe()
    ep = copy.deepcopy(ref)
    apply_ep(ep, None, 1, 0)
    assert len(expert_parameters(ep)) == 6  # the two base weights and the four adapters, split with them
    merged = merge_lora(copy.deepcopy(ref))
    merged.recompute = False  # a checkpoint's recomputation would run outside functional_call, on the copy's W
    x, g = (t.double() for t in ep_tokens("lora", 0, (2, 23), 32))
    adapters = {n: p for n, p in ref.named_parameters() if "lora" in n}
    trained = {n: p for n, p in merged.named_parameters() if p.requires_grad}  # router, shared expert

    xi = x.clone().requires_grad_(True)
    y_ref = functional_call(merged, {**merged_parameters(ref), **trained}, (xi,))
    want = torch.autograd.grad((y_ref * g).sum(), [xi, *adapters.values(), *trained.values()])
    xe = x.clone().requires_grad_(True)
    y = ep(xe)
    (y * g).sum().backward()
    got = [xe.grad] + [ep.get_parameter(n).grad for n in [*adapters, *trained]]
    assert ep.stats["ep_rounds"] > 1
    torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=1e-12)
    for name, a, b in zip(["x", *adapters, *trained], got, want, strict=True):
        assert b.abs().max() > 0, name  # every adapter carries signal (B non-zero)
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=name)
    assert ep.experts.gate_up_proj.grad is None and ep.experts.down_proj.grad is None


@pytest.mark.parametrize("ep", [True, False], ids=["ep_function", "one_process_grouped"])
def test_frozen_expert_weights_get_no_gradient_matmul(ep):
    """With the base expert weights frozen (``train.trainable`` without ``experts``; LoRA on them or not) neither the
    EP backward nor the one-process grouped dispatch computes their weight gradients: no matmul of the backward has
    a weight's shape. The same model with the weights trainable runs two per expert and round (the count is not
    vacuous), and the adapters' gradients are the same either way."""
    x, g = (t.double() for t in ep_tokens("frozen", 0, (2, 23), 32))
    counts, grads = {}, {}
    for frozen in (True, False):
        moe = _lora_moe(frozen)
        moe.shared_experts.requires_grad_(False)  # its down_proj [32, 24] has a routed expert's shape
        if ep:
            apply_ep(moe, None, 1, 0)
        counts[frozen] = _weight_grad_matmuls(moe, x, g)
        grads[frozen] = {n: p.grad for n, p in moe.named_parameters() if "lora" in n}
    assert counts[True] == 0
    assert counts[False] >= 2 * 8 and counts[False] % 2 == 0
    for name, gr in grads[True].items():
        torch.testing.assert_close(gr, grads[False][name], atol=1e-12, rtol=1e-12, msg=name)


class _Shapes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the shape and dtype of every tensor an op returns while active."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.seen.append((tuple(t.shape), t.dtype))
        return out


def test_ep_over_fp8_holders_equals_ep_over_the_dequantized_weights():
    """``train.frozen_dtype: fp8`` under EP (ep=1: the rounds and the autograd Function without communication): the
    routed experts' ``gate_up_proj`` / ``down_proj`` held as block-scaled e4m3 (8 x 8 blocks, several per expert),
    with LoRA on both. Output and the gradients of x, the four expert adapters, the router and the shared expert equal
    those of the same EP Function over plain fp64 weights holding the dequantized values (``unfreeze_fp8``) to
    1e-12, in several rounds; the holders get no gradient and stay bit-identical; no op ever returns a dequantized
    [E, ...] stack (the stacks are dequantized one expert per use), which the property read does (not vacuous)."""
    from genoctx.model.fp8 import FP8Weight, freeze_to_fp8, held, unfreeze_fp8

    base = _lora_moe()
    names = ["experts.gate_up_proj", "experts.down_proj"]
    freeze_to_fp8(base, names, (8, 8))
    ref = copy.deepcopy(base)
    assert unfreeze_fp8(ref) == 2  # the slow reference: plain weights equal to the holders' dequantized values
    fp8 = copy.deepcopy(base)
    apply_ep(ref, None, 1, 0)
    apply_ep(fp8, None, 1, 0)
    ex = fp8.experts
    hs = [held(ex, n) for n in ("gate_up_proj", "down_proj")]
    assert all(isinstance(h, FP8Weight) and h.ep_block == (0, 8) for h in hs)
    assert len(expert_parameters(fp8)) == 4  # the adapters; the holders are buffers (no gradient, no optimizer)
    before = [(h.weight.clone(), h.scale_inv.clone()) for h in hs]
    x, g = (t.double() for t in ep_tokens("fp8", 0, (2, 23), 32))
    trained = [n for n, p in ref.named_parameters() if p.requires_grad]
    assert sum("lora" in n for n in trained) == 4 and not any(
        n.endswith(("gate_up_proj", "down_proj")) for n in trained
    )
    want = _fwd_bwd_named(ref, x, g, trained)
    stacks = {(8, 48, 32), (8, 32, 24)}
    with _Shapes() as mode:
        got = _fwd_bwd_named(fp8, x, g, trained)
    assert fp8.stats["ep_rounds"] > 1
    assert not [s for s, dt in mode.seen if s in stacks and dt == torch.float64]
    with _Shapes() as mode:
        _ = ex.gate_up_proj  # the whole-stack read EP avoids
    assert ((8, 48, 32), torch.float64) in mode.seen
    for name in ["y", "x", *trained]:
        assert want[name].abs().max() > 0, name
        torch.testing.assert_close(got[name], want[name], atol=1e-12, rtol=1e-12, msg=name)
    for h, (w, s) in zip(hs, before, strict=True):
        assert torch.equal(h.weight.view(torch.uint8), w.view(torch.uint8)) and torch.equal(h.scale_inv, s)
    # slicing on E is block-safe: experts [4, 8) of a holder equal rows [4, 8) of the whole holder, dequantized too
    part = held(base.experts, "gate_up_proj").experts(4, 4)
    whole = held(base.experts, "gate_up_proj")
    assert part.ep_block == (4, 8) and part.nbytes() * 2 == whole.nbytes()
    torch.testing.assert_close(part.dequantize(), whole.dequantize()[4:], atol=0, rtol=0)


def _fwd_bwd_named(moe: MoE, x: torch.Tensor, g: torch.Tensor, names: list[str]) -> dict:
    """``moe(x)`` and the gradients of ``sum(y g)`` w.r.t. x and the parameters ``names``: ``{"y", "x", *names}``."""
    xi = x.clone().requires_grad_(True)
    y = moe(xi)
    grads = torch.autograd.grad((y * g).sum(), [xi, *(moe.get_parameter(n) for n in names)])
    return {"y": y.detach(), "x": grads[0], **dict(zip(names, grads[1:], strict=True))}
