"""The DSA kernels as PyTorch ops (``genoctx::indexer_topk``, ``genoctx::sparse_mla_fwd``, ``genoctx::sparse_mla_bwd``):
torch's own op checks, fake kernels that give the real outputs' shapes and dtypes (fake and meta tensors), and
``torch.compile(fullgraph=True)`` through the indexer and the attention, forward and backward, equal to eager. Without
CUDA the kernels run under TRITON_INTERPRET=1 (tests/conftest.py); tiny shapes: the interpreter is slow."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses import FakeTensorMode

import kernels.indexer_topk as kit
import kernels.sparse_mla as ksm
from genoctx.model import dsa

B, T, H, R, HI, DI, KPOOL, K = 1, 8, 2, 16, 2, 16, 2, 3  # N = T latents, T // KPOOL pools, top-3 pools
SCALE = 0.25


def _inputs(device, q_dtype=torch.float32, kv_dtype=torch.float32) -> dict:
    """Indexer and attention inputs of one chunk with no cache: positions 0 .. T-1, complete pools visible."""
    pos = torch.arange(T, device=device)
    return dict(
        iq=torch.randn(B, T, HI, DI, device=device),
        iw=torch.randn(B, T, HI, device=device),
        pk=torch.randn(B, T // KPOOL, DI, device=device),
        vis=(pos + 1) // KPOOL,
        pos=pos,
        q=torch.randn(B, T, H, R, device=device).to(q_dtype),
        kv=torch.randn(B, T, R, device=device).to(kv_dtype),
    )


@pytest.fixture(scope="module")
def op_cases() -> dict:
    """Arguments of each op (real values: opcheck runs the kernels). The backward op in its deterministic mode: the
    atomic one runs inside ``sparse_mla_fwd``'s autograd check (deterministic algorithms off)."""
    x = _inputs("cuda" if torch.cuda.is_available() else "cpu")
    pools = kit.indexer_topk(x["iq"], x["iw"], x["pk"], x["vis"], K, index_dtype=torch.int32)
    q, kv = x["q"].requires_grad_(), x["kv"].requires_grad_()
    sel = (pools, x["pos"], KPOOL, True, SCALE)
    o, lse = ksm.sparse_mla_fwd(q.detach(), kv.detach(), *sel)
    bwd = (q.detach(), kv.detach(), *sel, o, lse, torch.randn_like(o))
    return {
        "indexer_topk": (torch.ops.genoctx.indexer_topk.default, (x["iq"], x["iw"], x["pk"], x["vis"], K,
                                                                  torch.int32, None)),
        "sparse_mla_fwd": (torch.ops.genoctx.sparse_mla_fwd.default, (q, kv, *sel)),
        "sparse_mla_bwd": (torch.ops.genoctx.sparse_mla_bwd.default, (*bwd, True)),
    }  # fmt: skip


@pytest.mark.parametrize("case", ["indexer_topk", "sparse_mla_fwd", "sparse_mla_bwd"])
def test_opcheck(case, op_cases):
    """``torch.library.opcheck`` with all its checks: the schema (no undeclared mutation or aliasing), the autograd
    registration (the forward's formula; the others have no float input needing one), the fake kernel against the
    real outputs, and AOTAutograd with dynamic shapes (forward and, for ``sparse_mla_fwd``, backward) against eager."""
    op, args = op_cases[case]
    torch.library.opcheck(op, args)


def _meta(t: torch.Tensor) -> tuple:
    return t.shape, t.dtype, t.stride()


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float16, torch.float32)],
                         ids=["fp32", "q-fp16-kv-fp32"])  # fmt: skip
def test_fake_kernels_give_the_real_shapes(dtypes, device):
    """On fake tensors (FakeTensorMode) and on the meta device, the public functions return, without running a
    kernel, the shapes, dtypes and strides the kernels return: pools ``[B, T, min(K, N)]`` int32, o like q, dq like
    q, dkv like kv (fp32 latents under fp16 queries, as under autocast)."""
    x = _inputs(device, *dtypes)

    def run(x):
        q, kv = x["q"].requires_grad_(), x["kv"].requires_grad_()
        pools = kit.indexer_topk(x["iq"], x["iw"], x["pk"], x["vis"], K, index_dtype=torch.int32)
        wide = kit.indexer_topk(x["iq"], x["iw"], x["pk"], x["vis"], 99)  # more than the N pools: N columns, int64
        o = ksm.sparse_mla(q, kv, dsa.DSASelection(pools, x["pos"], KPOOL, True), SCALE)
        dq, dkv = torch.autograd.grad(o, (q, kv), torch.ones_like(o))
        return [_meta(t) for t in (pools, wide, o, dq, dkv)]

    want = run(x)
    assert [w[:2] for w in want] == [
        ((B, T, K), torch.int32), ((B, T, T // KPOOL), torch.int64), ((B, T, H, R), dtypes[0]),
        ((B, T, H, R), dtypes[0]), ((B, T, R), dtypes[1]),
    ]  # fmt: skip
    fm = FakeTensorMode()
    fake = {k: fm.from_tensor(v.detach()) for k, v in x.items()}
    with fm:
        assert run(fake) == want
    assert run({k: v.detach().to("meta") for k, v in x.items()}) == want


def test_fake_kernels_check_shapes_and_dtypes():
    """The fake kernels raise the real kernels' errors where no data is needed (a meta-device run fails as a real
    one would)."""
    x = {k: v.to("meta") for k, v in _inputs("cpu").items()}
    with pytest.raises(ValueError, match="do not fit"):
        kit.indexer_topk(x["iq"], x["iw"], x["pk"][..., :3], x["vis"], K)
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        kit.indexer_topk(x["iq"].double(), x["iw"], x["pk"], x["vis"], K)
    pools = torch.zeros(B, T, K, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="bad shapes"):
        torch.ops.genoctx.sparse_mla_fwd(x["q"], x["kv"][..., :3], pools, x["pos"], KPOOL, True, SCALE)


def test_backward_is_deterministic_when_torch_says_so(monkeypatch, device):
    """The autograd formula reads ``torch.are_deterministic_algorithms_enabled()`` as the backward runs: the atomic
    backward by default, the atomic-free one under ``torch.use_deterministic_algorithms(True)``; same gradients to
    fp32 rounding."""
    x = _inputs(device)
    pools = torch.tensor([1, 0, -1], dtype=torch.int32, device=device).expand(B, T, 3)  # tokens 0..3 and the tail
    sel = dsa.DSASelection(pools, x["pos"], KPOOL, True)
    seen, real = [], ksm.sparse_mla_bwd
    monkeypatch.setattr(ksm, "sparse_mla_bwd", lambda *a: seen.append(a[-1]) or real(*a))
    grads = []
    for det in (False, True):
        q, kv = x["q"].clone().requires_grad_(), x["kv"].clone().requires_grad_()
        o = ksm.sparse_mla(q, kv, sel, SCALE)
        torch.use_deterministic_algorithms(det)
        try:
            grads.append(torch.autograd.grad(o.sum(), (q, kv)))
        finally:
            torch.use_deterministic_algorithms(False)
    assert seen == [False, True]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _step(q, kv, iq, iw, pk, vis, pos):
    """One DSA attention step as the layer makes it: the indexer's pools, then sparse MLA over pools + tail."""
    pools = kit.indexer_topk(iq, iw, pk, vis, K, index_dtype=torch.int32)
    return pools, ksm.sparse_mla(q, kv, dsa.DSASelection(pools, pos, KPOOL, True), SCALE)


def test_compile_fullgraph_through_the_kernels_equals_eager(device):
    """``torch.compile(fullgraph=True)`` (AOTAutograd, eager backend) of the indexer + sparse MLA traces one graph
    holding the ops (a Triton launch inside a plain ``autograd.Function`` would break it) and gives eager's pools,
    output and gradients of q and kv, bit for bit."""
    from torch._dynamo.testing import CompileCounterWithBackend

    x = _inputs(device)
    args = [x[k] for k in ("q", "kv", "iq", "iw", "pk", "vis", "pos")]
    w = torch.randn(B, T, H, R, device=device)
    results = []
    counter = CompileCounterWithBackend("aot_eager")
    for fn in (_step, torch.compile(_step, fullgraph=True, backend=counter)):
        q, kv = args[0].clone().requires_grad_(), args[1].clone().requires_grad_()
        pools, o = fn(q, kv, *args[2:])
        dq, dkv = torch.autograd.grad((o * w).sum(), (q, kv))
        results.append((pools, o, dq, dkv))
    assert counter.frame_count == 1 and counter.op_count >= 2
    graph = str(counter.graphs[0].graph)
    assert "genoctx.indexer_topk" in graph and "genoctx.sparse_mla_fwd" in graph
    (pools, o, dq, dkv), got = results
    assert bool((pools >= 0).any()) and float(dkv.abs().sum()) > 0
    for a, b, what in zip(got, results[0], ("pools", "o", "dq", "dkv"), strict=True):
        assert torch.equal(a, b), what
