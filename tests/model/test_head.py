"""Chunked fused LM head + cross-entropy (genoctx/model/head.py) vs the full-logits reference, forward and
backward, and proofs that no [N, V] tensor is ever created or saved."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from genoctx.model.head import head_token_losses, head_token_losses_reference

CHR22 = "hg38_chr22_32000001-32300000.fa"
ROWS = [17, 3, 40, 8, 29]  # a "nucleotide" vocabulary inside a text vocabulary: unsorted, not contiguous


def _inputs(N, V, D, dtype=torch.float64, p_scored=0.7, classes=None):
    """hidden [N, D], weight [V, D] (leaves, requires_grad), targets [N] in [0, classes) with -100 where
    unscored, scored [N] bool with at least one True and one False, grad_out [N] non-uniform (signed)."""
    hidden = (torch.randn(N, D, dtype=torch.float64) * 0.7).to(dtype).requires_grad_(True)
    weight = (torch.randn(V, D, dtype=torch.float64) * 0.7).to(dtype).requires_grad_(True)
    scored = torch.rand(N) < p_scored
    if N > 1:
        scored[0], scored[-1] = True, False
    else:
        scored[0] = True
    targets = torch.randint(0, classes or V, (N,))
    targets[~scored] = -100  # unscored targets are never read, even out of range
    grad_out = torch.randn(N, dtype=torch.float64) * 3.0
    return hidden, weight, targets, scored, grad_out


def _run(fn, hidden, weight, grad_out, *args, **kw):
    """Loss, grad wrt hidden and weight of ``(fn(...) * grad_out).sum()``."""
    hidden.grad = weight.grad = None
    loss = fn(hidden, weight, *args, **kw)
    (loss * grad_out.to(loss.dtype)).sum().backward()
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


# --- equality to the reference (fp64) -------------------------------------------------------------------------


@pytest.mark.parametrize("restricted", [False, True], ids=["full", "rows"])
@pytest.mark.parametrize(
    "N,chunk",
    [(37, 8), (37, 1), (37, 37), (37, 100), (64, 16), (1, 4)],
    ids=["N%chunk!=0", "chunk1", "chunk=N", "chunk>N", "exact", "N1"],
)
def test_chunked_equals_reference_fp64(N, chunk, restricted):
    V, D = 45, 6
    rows = torch.tensor(ROWS) if restricted else None
    hidden, weight, targets, scored, grad_out = _inputs(N, V, D, classes=len(ROWS) if restricted else V)
    loss, gh, gw = _run(head_token_losses, hidden, weight, grad_out, targets, scored, chunk, rows=rows)
    loss_r, gh_r, gw_r = _run(head_token_losses_reference, hidden, weight, grad_out, targets, scored, rows=rows)
    assert loss.dtype == torch.float64 and loss.shape == (N,)
    torch.testing.assert_close(loss, loss_r, rtol=0, atol=1e-12)
    torch.testing.assert_close(gh, gh_r, rtol=0, atol=1e-12)
    torch.testing.assert_close(gw, gw_r, rtol=0, atol=1e-12)
    assert torch.all(loss[~scored] == 0) and torch.all(loss[scored] > 0)
    assert torch.all(gh[~scored] == 0)  # unscored tokens get no gradient
    if restricted:
        others = torch.ones(V, dtype=torch.bool)
        others[ROWS] = False
        assert torch.all(gw[others] == 0)  # only the selected rows are trained
        assert torch.all(gw[ROWS].abs().sum(dim=1) > 0)


def test_rows_listed_twice_get_both_gradients():
    """A row listed twice in ``rows`` is two classes with equal logits; its gradient is the sum of both
    (index_add, as autograd of ``weight[rows]`` gives), and the loss matches the reference."""
    rows = torch.tensor([3, 5, 3])
    hidden, weight, targets, scored, grad_out = _inputs(25, 8, 4, classes=3)
    got = _run(head_token_losses, hidden, weight, grad_out, targets, scored, 6, rows=rows)
    ref = _run(head_token_losses_reference, hidden, weight, grad_out, targets, scored, rows=rows)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    assert torch.all(got[2][[0, 1, 2, 4, 6, 7]] == 0) and torch.all(got[2][[3, 5]].abs().sum(dim=1) > 0)


def test_sum_of_losses_backward_matches_reference():
    """grad_out from ``.sum()`` is an expanded (stride-0) tensor: the common training call."""
    hidden, weight, targets, scored, _ = _inputs(50, 30, 4)
    out = []
    for fn, kw in ((head_token_losses, {"chunk_tokens": 7}), (head_token_losses_reference, {})):
        hidden.grad = weight.grad = None
        fn(hidden, weight, targets, scored, **kw).sum().backward()
        out.append((hidden.grad.clone(), weight.grad.clone()))
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("frozen", ["hidden", "weight"])
def test_one_input_frozen(frozen):
    """Only the inputs that require grad get one (a frozen head, or hidden states from a detached trunk)."""
    hidden, weight, targets, scored, grad_out = _inputs(30, 12, 4)
    ref = _run(head_token_losses_reference, hidden, weight, grad_out, targets, scored)
    (hidden if frozen == "hidden" else weight).requires_grad_(False)
    hidden.grad = weight.grad = None
    (head_token_losses(hidden, weight, targets, scored, chunk_tokens=7) * grad_out).sum().backward()
    if frozen == "hidden":
        assert hidden.grad is None
        torch.testing.assert_close(weight.grad, ref[2], rtol=0, atol=1e-12)
    else:
        assert weight.grad is None
        torch.testing.assert_close(hidden.grad, ref[1], rtol=0, atol=1e-12)


def test_autocast_does_not_change_the_precision_policy():
    """Under CPU autocast to bf16, an fp32 head still computes in fp32 (same values, bit for bit)."""
    hidden, weight, targets, scored, grad_out = _inputs(40, 16, 8, dtype=torch.float32)
    plain = _run(head_token_losses, hidden, weight, grad_out, targets, scored, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = _run(head_token_losses, hidden, weight, grad_out, targets, scored, 16)
    torch.testing.assert_close(auto, plain, rtol=0, atol=0)


@pytest.mark.parametrize("restricted", [False, True], ids=["full", "rows"])
def test_gradcheck_fp64(restricted):
    """Backward against finite differences of the forward: independent of the reference."""
    rows = torch.tensor([4, 0, 2]) if restricted else None
    hidden, weight, targets, scored, _ = _inputs(9, 6, 3, classes=3 if restricted else 6)
    assert torch.autograd.gradcheck(
        lambda h, w: head_token_losses(h, w, targets, scored, chunk_tokens=4, rows=rows), (hidden, weight)
    )


def test_known_values():
    """Zero weight: uniform softmax, loss = ln V (ln R restricted) on scored tokens, 0 elsewhere; one-hot
    logits: loss = log(V - 1 + e^a) - a."""
    N, V, D = 6, 11, 4
    hidden = torch.randn(N, D, dtype=torch.float64)
    scored = torch.tensor([True, False, True, True, False, True])
    targets = torch.tensor([0, 99, 10, 5, -1, 3])
    loss = head_token_losses(hidden, torch.zeros(V, D, dtype=torch.float64), targets, scored, chunk_tokens=4)
    expect = scored.double() * math.log(V)
    torch.testing.assert_close(loss, expect, rtol=0, atol=1e-14)
    rows = torch.tensor([1, 2, 3])
    loss = head_token_losses(
        hidden, torch.zeros(V, D, dtype=torch.float64), targets.clamp(0, 2), scored, chunk_tokens=4, rows=rows
    )
    torch.testing.assert_close(loss, scored.double() * math.log(3), rtol=0, atol=1e-14)
    a = 2.5  # h = e_0, W = a * e_0 on row 7: logit a on row 7, 0 elsewhere
    hidden = torch.zeros(1, D, dtype=torch.float64)
    hidden[0, 0] = 1.0
    weight = torch.zeros(V, D, dtype=torch.float64)
    weight[7, 0] = a
    loss = head_token_losses(hidden, weight, torch.tensor([7]), torch.tensor([True]), chunk_tokens=1)
    assert loss.item() == pytest.approx(math.log(V - 1 + math.exp(a)) - a, abs=1e-14)


def test_nothing_scored_gives_zeros_not_nan():
    hidden, weight, targets, _, grad_out = _inputs(20, 9, 3)
    scored = torch.zeros(20, dtype=torch.bool)
    targets[:] = 12345  # out of range but unscored: allowed
    loss, gh, gw = _run(head_token_losses, hidden, weight, grad_out, targets, scored, 6)
    assert torch.all(loss == 0) and torch.all(gh == 0) and torch.all(gw == 0)


def test_real_dna_restricted_and_full(realdna):
    """Targets are real chr22 bases (A C G T N ids 0..4, N unscored) inside a 300-token 'text vocabulary'."""
    from genoctx.data.tokenizer import SCORED_IDS, encode

    seq = (realdna / CHR22).read_text().split("\n", 1)[1].replace("\n", "")[:700]
    tokens = torch.from_numpy(encode(seq)[0].astype("int64"))
    N = tokens.numel()
    scored = torch.isin(tokens, torch.tensor(SCORED_IDS))
    rows = torch.tensor([65, 67, 71, 84, 78])  # 'A' 'C' 'G' 'T' 'N' as byte ids of a text vocabulary
    hidden, weight, _, _, grad_out = _inputs(N, 300, 8)
    for r, targets in ((rows, tokens), (None, rows[tokens])):  # restricted: ids 0..4; full: the text ids
        loss, gh, gw = _run(head_token_losses, hidden, weight, grad_out, targets, scored, 64, rows=r)
        ref = _run(head_token_losses_reference, hidden, weight, grad_out, targets, scored, rows=r)
        torch.testing.assert_close((loss, gh, gw), ref, rtol=0, atol=1e-12)
    # the two objectives differ: the restricted softmax has 5 classes, the full one 300
    restricted = head_token_losses(hidden, weight, tokens, scored, 64, rows=rows)
    full = head_token_losses(hidden, weight, rows[tokens], scored, 64)
    assert torch.all(restricted[scored] < full[scored])


# --- low precision vs the fp64 reference ----------------------------------------------------------------------

# (hidden dtype, weight dtype, loss atol, relative error of grad hidden, of grad weight). The loss error of a bf16
# weight is at most two roundings of half a bf16 ulp of |logit| < 16 (2 * 2^-5 = 0.0625; asserted below); a bf16
# gradient is rounded to 8 bits (2^-9 relative) on output, and the bf16 backward matmuls add ~2^-8 more.
PRECISIONS = [
    (torch.float32, torch.float32, 1e-5, 1e-5, 1e-5),
    (torch.bfloat16, torch.float32, 1e-5, 4e-3, 1e-5),  # bf16 activations, fp32 head: the matmul runs in fp32
    (torch.bfloat16, torch.bfloat16, 0.0625, 2e-2, 2e-2),
]


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("restricted", [False, True], ids=["full", "rows"])
@pytest.mark.parametrize("h_dtype,w_dtype,loss_atol,gh_rel,gw_rel", PRECISIONS, ids=["fp32", "bf16-h", "bf16"])
def test_low_precision_close_to_fp64_reference(h_dtype, w_dtype, loss_atol, gh_rel, gw_rel, restricted):
    N, V, D = 300, 200, 32
    rows = torch.tensor(ROWS) if restricted else None
    hidden, weight, targets, scored, grad_out = _inputs(N, V, D, classes=len(ROWS) if restricted else V)
    h = hidden.detach().to(h_dtype).requires_grad_(True)
    w = weight.detach().to(w_dtype).requires_grad_(True)
    h64 = h.detach().double().requires_grad_(True)  # the same (rounded) values in fp64
    w64 = w.detach().double().requires_grad_(True)
    loss, gh, gw = _run(head_token_losses, h, w, grad_out, targets, scored, 64, rows=rows)
    loss_r, gh_r, gw_r = _run(head_token_losses_reference, h64, w64, grad_out, targets, scored, rows=rows)
    assert (h64 @ w64.T).abs().max().item() < 16  # the range the bf16 loss tolerance is derived for
    assert loss.dtype == torch.float32 and gh.dtype == h_dtype and gw.dtype == w_dtype
    torch.testing.assert_close(loss.double(), loss_r, rtol=0, atol=loss_atol)
    assert _rel(gh, gh_r) < gh_rel
    assert _rel(gw, gw_r) < gw_rel
    if restricted:
        others = torch.ones(V, dtype=torch.bool)
        others[ROWS] = False
        assert torch.all(gw[others] == 0)


# --- memory: chunking bounds every tensor, in forward and backward --------------------------------------------


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any aten op returns (views included) while active.
    It sees the ops of the autograd engine's backward too (CPU backward runs on the calling thread)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _largest_in_forward_and_backward(fn, *args, **kw):
    hidden, weight = args[0], args[1]
    hidden.grad = weight.grad = None
    with _LargestTensor() as fwd:
        loss = fn(*args, **kw)
    grad_out = torch.randn(loss.shape, dtype=loss.dtype)
    with _LargestTensor() as bwd:
        loss.backward(grad_out)
    return fwd.largest, bwd.largest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_op_creates_a_tensor_larger_than_one_chunk_of_logits(dtype):
    N, V, D, chunk = 96, 64, 8, 8  # N·V = 6144 >> bound = max(chunk·V, N·D, V·D) = 768
    hidden, weight, targets, scored, _ = _inputs(N, V, D, dtype=dtype)
    bound = max(chunk * V, N * D, V * D)
    fwd, bwd = _largest_in_forward_and_backward(head_token_losses, hidden, weight, targets, scored, chunk)
    assert fwd <= bound and bwd <= bound, (fwd, bwd, bound)
    # the probe is not blind: without chunking (one chunk of N, or the reference) it sees [N, V], both ways
    fwd, bwd = _largest_in_forward_and_backward(head_token_losses, hidden, weight, targets, scored, N)
    assert fwd >= N * V and bwd >= N * V
    fwd, bwd = _largest_in_forward_and_backward(head_token_losses_reference, hidden, weight, targets, scored)
    assert fwd >= N * V and bwd >= N * V


@pytest.mark.parametrize("restricted", [False, True], ids=["full", "rows"])
def test_saved_for_backward_is_inputs_and_one_float_per_token(restricted):
    """What autograd keeps between forward and backward: hidden and weight (the caller's tensors, not copies),
    targets, the mask, rows and the log-sum-exp [N]; never logits."""
    N, V, D = 96, 64, 8
    rows = torch.tensor(ROWS) if restricted else None
    hidden, weight, targets, scored, _ = _inputs(N, V, D, classes=len(ROWS) if restricted else V)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        head_token_losses(hidden, weight, targets, scored, chunk_tokens=8, rows=rows)
    shapes = sorted(tuple(t.shape) for t in saved)
    expect = [(N,), (N,), (N,), (N, D), (V, D)] + ([(len(ROWS),)] if restricted else [])
    assert shapes == sorted(expect)
    assert any(t.data_ptr() == hidden.data_ptr() for t in saved)
    assert any(t.data_ptr() == weight.data_ptr() for t in saved)
    floats = [t for t in saved if t.shape == (N,) and t.is_floating_point()]
    assert len(floats) == 1 and floats[0].dtype == torch.float64  # the log-sum-exp
    # the reference, for contrast, saves full [N, V] logits (or their softmax)
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        head_token_losses_reference(hidden, weight, targets, scored, rows=rows)
    assert max(t.numel() for t in saved) >= N * (len(ROWS) if restricted else V)


# --- errors ---------------------------------------------------------------------------------------------------


def _bad(**change):
    N, V, D = 5, 7, 3
    kw = dict(
        hidden=torch.randn(N, D),
        weight=torch.randn(V, D),
        targets=torch.randint(0, V, (N,)),
        scored=torch.ones(N, dtype=torch.bool),
        chunk_tokens=2,
        rows=None,
    )
    kw.update(change)
    return kw


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(chunk_tokens=0), "chunk_tokens"),
        (dict(chunk_tokens=2.5), "chunk_tokens"),
        (dict(hidden=torch.randn(1, 5, 3)), "hidden"),
        (dict(hidden=torch.ones(5, 3, dtype=torch.int64)), "hidden"),
        (dict(weight=torch.randn(7, 4)), "D differs"),
        (dict(weight=torch.randn(0, 3)), "no rows"),
        (dict(targets=torch.zeros(4, dtype=torch.int64)), "targets"),
        (dict(targets=torch.zeros(5, dtype=torch.int32)), "targets"),
        (dict(scored=torch.ones(5)), "scored"),
        (dict(scored=torch.ones(6, dtype=torch.bool)), "scored"),
        (dict(targets=torch.tensor([0, 1, 7, 2, 3])), r"out of range.*V = 7.*max 7"),
        (dict(targets=torch.tensor([0, -1, 2, 2, 3])), r"out of range.*min -1"),
        (dict(rows=torch.tensor([1, 2])), r"out of range.*R = 2"),
        (dict(rows=torch.tensor([1, 7])), "rows must lie"),
        (dict(rows=torch.tensor([], dtype=torch.int64)), "rows"),
        (dict(rows=torch.tensor([[1, 2]])), "rows"),
    ],
)
def test_errors(change, match):
    kw = _bad(**change)
    with pytest.raises(ValueError, match=match):
        head_token_losses(**kw)
    kw.pop("chunk_tokens")
    if "chunk_tokens" not in change:  # the reference validates the same way
        with pytest.raises(ValueError, match=match):
            head_token_losses_reference(**kw)


def test_out_of_range_target_allowed_where_unscored():
    kw = _bad(targets=torch.tensor([0, 1, 7, 2, -100]), scored=torch.tensor([True, True, False, True, False]))
    loss = head_token_losses(**kw)
    assert torch.all(loss[[2, 4]] == 0) and torch.all(loss[[0, 1, 3]] > 0)
