"""The chunk-parallel KDA block (``_kda_block``: intra-chunk terms batched over all chunks, the state recurrence in
``_ChunkStateScan`` with a hand-written backward) against its slow reference, the per-chunk loop differentiated by
autograd (``chunk_kda(reference_loop=True)``, today's ``_kda_block_reference``), and the aten ops it issues."""

import collections

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from genoctx.model.kda import chunk_kda


def _inputs(B, T, H, K, V, dtype, init):
    g = torch.Generator().manual_seed(T * 31 + K)
    q = torch.randn(B, T, H, K, dtype=dtype, generator=g)
    k = F.normalize(torch.randn(B, T, H, K, dtype=dtype, generator=g), dim=-1)
    v = torch.randn(B, T, H, V, dtype=dtype, generator=g)
    gate = -torch.rand(B, T, H, K, dtype=dtype, generator=g) * 2
    beta = torch.rand(B, T, H, dtype=dtype, generator=g)
    s0 = torch.randn(B, H, K, V, dtype=dtype, generator=g) if init else None
    xs = [x for x in (q, k, v, gate, beta, s0) if x is not None]
    for x in xs:
        x.requires_grad_(True)
    do = torch.randn(B, T, H, V, dtype=dtype, generator=g)
    dS = torch.randn(B, H, K, V, dtype=dtype, generator=g)
    return xs, do, dS


def _run(xs, do, dS, final, **kw):
    for x in xs:
        x.grad = None
    o, S = chunk_kda(*xs[:5], initial_state=xs[5] if len(xs) > 5 else None, **kw)
    loss = (o * do).sum() + ((S * dS).sum() if final else 0)
    loss.backward()
    return [o.detach(), S.detach()] + [x.grad.clone() for x in xs]


NAMES = ["o", "S", "dq", "dk", "dv", "dg", "dbeta", "dS0"]
CASES = [  # T, chunk, block_tokens, recompute, initial state, final state's gradient
    (130, 16, 48, False, True, True),  # padded tail, 3 blocks of 2 chunks
    (130, 16, 48, True, True, False),  # the same checkpointed, the final state unused
    (97, 8, None, False, False, True),  # one block of 13 chunks, a zero initial state (no gradient)
    (64, 16, 32, True, False, False),
    (45, 12, 1000, False, True, True),  # C = 12: one sub-chunk
    (16, 16, None, False, True, False),  # one chunk, nothing after it
]


@pytest.mark.parametrize("T,C,block,recompute,init,final", CASES)
def test_chunk_parallel_equals_the_reference_loop_fp64(T, C, block, recompute, init, final):
    """Output, final state and the gradient of every input (the initial state included) equal the per-chunk loop
    under autograd to 1e-10 in fp64."""
    xs, do, dS = _inputs(2, T, 2, 8, 6, torch.float64, init)
    kw = dict(chunk_size=C, block_tokens=block, recompute=recompute)
    new = _run(xs, do, dS, final, **kw)
    ref = _run(xs, do, dS, final, reference_loop=True, **kw)
    for name, a, b in zip(NAMES, new, ref, strict=False):
        assert b.abs().max() > 0, name  # the case exercises it
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0, msg=name)


@pytest.mark.parametrize("T,C,block,recompute,init,final", CASES[:3])
def test_chunk_parallel_equals_the_reference_loop_fp32(T, C, block, recompute, init, final):
    """In fp32, within today's fp32 tolerance of the chunked core (1e-5 absolute, as ``test_kda.py``'s fp32 test)."""
    xs, do, dS = _inputs(1, T, 2, 16, 16, torch.float32, init)
    kw = dict(chunk_size=C, block_tokens=block, recompute=recompute)
    new = _run(xs, do, dS, final, **kw)
    ref = _run(xs, do, dS, final, reference_loop=True, **kw)
    for name, a, b in zip(NAMES, new, ref, strict=False):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


# aten ops of one block of N whole chunks (fp32; grad enabled or not, the forward is the same): forward FWD + 3 N,
# backward BWD + 3 N with its forward rerun in it (recompute, as the model runs it: RERUN + 3 N more), a block of one
# chunk one op fewer per layout change back to tokens (its output, its rerun's output, its packed gradient: a view,
# not a copy); a padded block PAD more each way (2 PAD with recompute). Per call: the zero state without an initial
# state; with several blocks the 5 splits into blocks and a cat of the outputs, in backward the split of the output's
# gradient and the splits' 5 cats. The test's own backward adds LOSS (the loss below, the leaves' gradient
# accumulation: a detach each and a copy of each strided gradient), 2 fewer without an initial state (chunk 0's state
# products skipped).
FWD, BWD, RERUN, PAD, LOSS = 87, 147, 59, 2, 15


def _expected(T, C, block, recompute, init=True):
    sizes = [min(block, T - s) for s in range(0, T, block)]
    n = [-(-t // C) for t in sizes]
    pad = 1 if T % C else 0
    several = len(n) > 1
    per = [3 * x - (x == 1) for x in n]  # a block of one chunk: one op fewer per return to the token layout
    fwd = (0 if init else 1) + 6 * several + sum(FWD + p for p in per) + PAD * pad
    # several blocks: the gradient's split and the 5 cats, less the 5 copies LOSS counts of strided leaf gradients
    bwd = LOSS - (0 if init else 2) + (6 - 5) * several + sum(BWD + p for p in per) + PAD * pad
    if recompute:
        bwd += sum(RERUN + p for p in per) + PAD * pad
    return fwd, bwd


@pytest.mark.parametrize("T,block,recompute,init", [(32, None, False, True), (88, None, False, True),
                                                    (96, 32, False, True), (128, 64, True, True),
                                                    (120, 48, True, True), (80, 32, True, False),
                                                    (16, None, True, True), (40, None, True, False)])  # fmt: skip
def test_op_count_is_a_constant_plus_three_per_chunk(T, block, recompute, init):
    """The aten ops ``chunk_kda`` issues (a TorchDispatchMode) are ``_expected``'s formula exactly: a constant per
    block (one autograd node, ``_KDABlock``) and 3 per chunk in the forward, 3 per chunk in the backward (6 with the
    forward rerun). The same forward without gradients."""
    C = 16
    xs, do, dS = _inputs(1, T, 2, 8, 8, torch.float32, init)
    s0 = xs[5] if init else None
    with _Count() as fwd:
        o, S = chunk_kda(*xs[:5], initial_state=s0, chunk_size=C, block_tokens=block, recompute=recompute)
    loss = (o * do).sum() + (S * dS).sum()
    with _Count() as bwd:
        loss.backward()
    per_chunk = sum(-(-min(block or T, T - s) // C) for s in range(0, T, block or T))
    assert fwd.ops["aten.baddbmm"] == 2 * per_chunk + len(range(0, T, block or T))  # the loop and A_qk V'
    assert (sum(fwd.ops.values()), sum(bwd.ops.values())) == _expected(T, C, block or T, recompute, init)
    with torch.no_grad(), _Count() as eval_:
        chunk_kda(*xs[:5], initial_state=s0, chunk_size=C, block_tokens=block)
    assert sum(eval_.ops.values()) == sum(fwd.ops.values())
