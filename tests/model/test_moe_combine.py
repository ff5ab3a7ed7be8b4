"""The deterministic MoE combine (issue 43 item 14): ``combine_slots``' fixed-order slot sum equals the ``index_add_``
combine to fp32 rounding, forward and backward, in ``Experts`` and under expert parallelism (one rank, its rounds),
and the combine that ran is recorded in ``MoE.stats["combine"]``."""

import copy

import pytest
import torch

from genoctx.model.config import ModelConfig
from genoctx.model.moe import MoE, combine_slots
from genoctx.parallel.experts import apply_ep
from genoctx.train.loop import deterministic_mode


def _moe() -> MoE:
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=12, n_routed_experts=6, num_experts_per_tok=3, moe_intermediate_size=8,
                      n_shared_experts=1, moe_chunk_tokens=7, initializer_range=0.3)  # fmt: skip
    return MoE(cfg)


def test_slot_sum_equals_index_add_forward_and_backward():
    """Rows in a shuffled order, each slot once, some tokens with fewer than k rows (as one EP round): both paths
    give the same [N, D] sums and the same row gradients to fp32 rounding; the slot sum's are the same bits twice."""
    torch.manual_seed(1)
    N, k, D = 37, 3, 16
    slots = torch.randperm(N * k)[: N * k - 5]
    rows = torch.randn(slots.numel(), D, dtype=torch.float32, requires_grad=True)
    g = torch.randn(N, D)
    got = {}
    for path in ("index_add", "slot_sum", "slot_sum"):
        out = combine_slots(rows, slots, N, k, path)
        (grad,) = torch.autograd.grad((out * g).sum(), rows)
        if path in got:
            assert torch.equal(out, got[path][0]) and torch.equal(grad, got[path][1])
        got[path] = (out, grad)
    torch.testing.assert_close(got["slot_sum"][0], got["index_add"][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got["slot_sum"][1], got["index_add"][1], rtol=0, atol=0)  # a gather either way
    with pytest.raises(ValueError, match="slot_sum"):
        combine_slots(rows, slots, N, k, "atomic")


@pytest.mark.parametrize("ep", [False, True])
def test_deterministic_mode_selects_slot_sum_equal_to_index_add(ep):
    """``deterministic_mode(True)`` runs the slot sum (recorded in ``stats["combine"]``), ``False`` the index_add;
    the MoE output and every gradient agree to fp32 rounding; with ``ep`` through ``apply_ep``'s rounds (one rank:
    moe_chunk_tokens 7 of 46 tokens, several rounds)."""
    base = _moe()
    x = torch.randn(2, 23, 12)
    g = torch.randn(2, 23, 12)
    res = {}
    for on in (False, True):
        moe = copy.deepcopy(base)
        if ep:
            apply_ep(moe, None, 1, 0)
        xi = x.clone().requires_grad_(True)
        with deterministic_mode(on):
            y = moe(xi)
            grads = torch.autograd.grad((y * g).sum(), [xi, *moe.parameters()])
        assert moe.stats["combine"] == ("slot_sum" if on else "index_add")
        if ep:
            assert moe.stats["ep_rounds"] > 1
        res[on] = [y, *grads]
    assert not torch.are_deterministic_algorithms_enabled()  # restored
    for a, b in zip(res[True], res[False], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
