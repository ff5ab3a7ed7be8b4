"""Host syncs of a training step, counted on CPU (``genoctx.model.host``): the counter sees every kind of device ->
host read; the step path has no raw read outside the one door; a step reads once (its metrics) plus what the expert
dispatch needs (split sizes: one read per MoE token chunk, or under expert parallelism one per MoE forward), however
many layers or chunks it has; and the statistics read at the end of the step are the values read one by one."""

from __future__ import annotations

import ast
import contextlib
import copy
from pathlib import Path

import pytest
import torch

from genoctx.model.config import preset
from genoctx.model.head import head_token_losses
from genoctx.model.host import SyncCounter, cpu_values, optimizer_steps, read, reads_free
from genoctx.model.model import HybridLM
from genoctx.model.moe import Experts, MoE
from genoctx.model.stats import as_number
from genoctx.recipes import TrainConfig
from genoctx.train.loop import build_optimizer, forward_backward, train_step

ROOT = Path(__file__).resolve().parents[2]
# the modules a training step runs through (the model, its kernels' wrappers, CP and EP, the loop)
STEP_PATH = [
    *(f"genoctx/model/{m}.py" for m in ("moe", "dsa", "head", "vocab", "kda", "hyper", "model", "stats", "norms")),
    "kernels/indexer_topk.py", "kernels/sparse_mla.py", "genoctx/parallel/context.py", "genoctx/parallel/experts.py",
    "genoctx/train/chunked.py", "genoctx/train/loop.py",
]  # fmt: skip


def test_counter_sees_each_kind_of_host_read():
    t, m = torch.arange(6), torch.arange(6) > 2
    cases = {
        "item": lambda: (int(t[0]), float(t.float().mean()), bool(m.any()), t[1].item()),
        "mask_index": lambda: t[m],
        "nonzero": lambda: torch.where(m),
        "unique": lambda: torch.unique(t),
        "bincount": lambda: torch.bincount(t, minlength=8),
        "repeat_interleave": lambda: t[:3].repeat_interleave(torch.tensor([1, 2, 3])),
    }
    for kind, fn in cases.items():
        with SyncCounter() as c:
            fn()
        assert set(c.ops) == {kind} and not c.reads, kind
    with SyncCounter() as c:  # no read: output sizes known on the host, reads of host-resident values, no tensor
        t[:3].repeat_interleave(torch.tensor([1, 2, 3]), output_size=6)
        t.masked_fill(m, 0).sum()
        cpu_values(t)
        read(None, 3, label="none")
        assert not reads_free("cpu")  # inside the counter genoctx takes its accelerator paths
    assert c.total == 0 and reads_free("cpu")
    with SyncCounter() as c:  # the door: one read per call, whatever it reads, named by its label
        read(t, m, t.sum(), label="a")
        read(t.float().mean(), label="b")
        torch.Tensor.tolist(t)  # on CPU a raw .tolist() dispatches nothing: hence the door (and the AST check)
    assert c.reads == {"a": 1, "b": 1} and not c.ops
    step = torch.tensor(3.0)
    with SyncCounter(host_resident=[step]) as c:
        float(step)
    assert c.total == 0
    with pytest.raises(ValueError, match="device read"):
        cpu_values(torch.empty(2, device="meta"))


def test_read_is_one_copy_of_exact_values():
    big = torch.tensor([2**40 + 1, -3])
    x = torch.tensor(0.1, dtype=torch.float32)
    got = read(big, x, torch.tensor([True, False]), None, torch.zeros(0), label="mixed")
    assert got == [[2**40 + 1, -3], float(x), [True, False], None, []]
    assert isinstance(got[1], float) and read(torch.tensor(7), label="one") == 7


def test_step_path_has_no_raw_host_read():
    """No ``.item()``, ``.tolist()`` or ``torch.tensor(..., device=...)`` (a blocking host -> device copy) on the step
    path: deliberate reads go through ``genoctx.model.host.read`` (which the counter sees; a CPU ``.tolist()`` is
    invisible to it)."""
    bad = []
    for rel in STEP_PATH:
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            if node.func.attr in ("item", "tolist") and not node.args:
                bad.append(f"{rel}:{node.lineno} .{node.func.attr}()")
            if node.func.attr == "tensor" and any(k.arg == "device" for k in node.keywords):
                bad.append(f"{rel}:{node.lineno} torch.tensor(..., device=...)")
    assert not bad, bad


def _cfg(layers: int, moe: bool, **kw):
    mlp = ["sparse" if moe and i % 2 else "dense" for i in range(layers)]
    return preset("tiny", num_hidden_layers=layers, layer_types="KD" * (layers // 2), mlp_layer_types=mlp,
                  indexer_types=["full"] * layers, moe_chunk_tokens=32, **kw)  # fmt: skip


def _counted_step(cfg, chunk, tokens, ep=False):
    """One training step after a first one (the optimizer's state exists), counted. Returns (counter, metrics)."""
    torch.manual_seed(0)
    model = HybridLM(cfg).train()
    if ep:
        from genoctx.parallel.experts import apply_ep

        apply_ep(model, None, 1, 0)
    tc = TrainConfig(lr=1e-2, warmup_steps=1, seq_chunk_tokens=chunk)
    opt, sched = build_optimizer(model, tc, 10)
    train_step(model, opt, sched, tokens, tc, contextlib.nullcontext())
    with SyncCounter(host_resident=optimizer_steps(opt)) as c:  # AdamW's step counters live on the host
        metrics = train_step(model, opt, sched, tokens, tc, contextlib.nullcontext())
    return c, metrics


# (layers, MoE layers, seq_chunk_tokens, split reads per MoE layer) of a 64-token window, moe_chunk_tokens = 32
STEP_CASES = {"dense2": (2, False, None, 0), "dense4-4chunks": (4, False, 16, 0), "moe2-2chunks": (2, True, 32, 3 * 2),
              "moe4": (4, True, None, 2 * 2)}  # fmt: skip


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("case", list(STEP_CASES))
def test_step_syncs_do_not_grow_with_layers_or_chunks(case, grouped, monkeypatch):
    """A step reads its metrics once, with 2 layers or 4, in one pass or in chunks. Beyond that only the expert
    dispatch's loop (``Experts.forward_loop``; the grouped path keeps its offsets on the device and reads nothing)
    reads: one read of the split sizes per MoE token chunk and pass -- one pass: forward + its checkpoint's
    recomputation (2 per token chunk); chunked (``seq_chunk_tokens``): the no-grad forward sweep + the backward
    sweep's forward and recomputation (3 per chunk). Before the cut, with dense MLPs, a 2-layer step read 8 times,
    4 layers in 4 chunks 45 times."""
    monkeypatch.setattr(Experts, "grouped", grouped)
    layers, moe, chunk, per_moe = STEP_CASES[case]
    tokens = torch.randint(0, 4, (1, 64), generator=torch.Generator().manual_seed(1))
    c, _ = _counted_step(_cfg(layers, moe), chunk, tokens)
    assert not c.ops, c.ops  # nothing read around the door
    split = {"moe.split": layers // 2 * per_moe} if moe and not grouped else {}
    assert dict(c.reads) == {"step.metrics": 1, **split}


def test_step_syncs_under_expert_parallelism():
    """Under EP the dispatch reads the all-gathered counts once per MoE forward (every ``all_to_all`` round's split
    sizes, forward and backward, follow from them on the host): one read per MoE layer, none per round or chunk."""
    tokens = torch.randint(0, 4, (1, 64), generator=torch.Generator().manual_seed(1))
    c, _ = _counted_step(_cfg(4, True), None, tokens, ep=True)
    assert not c.ops and dict(c.reads) == {"step.metrics": 1, "ep.counts": 2}


@pytest.mark.parametrize("chunk", [None, 32])
def test_deferred_statistics_equal_the_values_read_one_by_one(chunk):
    """The step's metrics (one combined read) and ``layer_stats`` (one read of every layer's device tensors) equal
    what reading each value at once gives -- the code before the syncs were cut: ``float(loss_sum / max(int(count),
    1))``, ``float(aux)``, ``float(grad_norm)``, each MoE layer's ``update_bias()`` read on its own, each stat read
    with ``as_number``."""
    cfg = _cfg(2, True, moe_aux_loss_coef=0.01)
    tokens = torch.randint(0, 4, (1, 64), generator=torch.Generator().manual_seed(2))
    tc = TrainConfig(lr=1e-2, warmup_steps=1, seq_chunk_tokens=chunk)
    torch.manual_seed(0)
    a = HybridLM(cfg).train()
    b = copy.deepcopy(a)
    opt_a, sched_a = build_optimizer(a, tc, 10)
    opt_b, sched_b = build_optimizer(b, tc, 10)
    got = train_step(a, opt_a, sched_a, tokens, tc, contextlib.nullcontext())
    stats_a = a.layer_stats()

    opt_b.zero_grad(set_to_none=True)
    loss_sum, count, aux = forward_backward(b, tokens, contextlib.nullcontext(), None, None, chunk)
    stats_b = [{k: as_number(v) for k, v in (layer.self_attn.stats or {}).items()} for layer in b.layers]
    moes = [layer.mlp for layer in b.layers if isinstance(layer.mlp, MoE)]
    moe_stats = [{k: as_number(v) for k, v in m.stats.items()} for m in moes]
    grad_norm = torch.nn.utils.clip_grad_norm_(b.parameters(), tc.grad_clip)
    opt_b.step()
    sched_b.step()
    loads = [m.load_counts.clone() for m in moes]
    moe = [m.update_bias() for m in moes]
    assert got["loss"] == float(loss_sum / max(int(count), 1)) and got["scored_tokens"] == int(count)
    assert got["aux_loss"] == aux != 0.0 and got["grad_norm"] == float(grad_norm)
    assert got["moe_load_max_over_mean"] == max(m["load_max_over_mean"] for m in moe)
    for m, load in zip(moe, loads, strict=True):  # the loads, exact, and their ratio as fp32 computes it
        assert m["tokens_per_expert"] == cpu_values(load)
        assert sum(m["tokens_per_expert"]) == 64 * cfg.num_experts_per_tok
        assert m["load_max_over_mean"] == float(load.float().max() / load.float().mean())
    for s_a, s_b in zip(stats_a, stats_b, strict=True):
        assert {k: s_a[k] for k in s_b} == s_b
    moe_layer = next(s for s in stats_a if "moe_tokens_per_expert" in s)
    assert moe_layer["moe_tokens_per_expert"] == cpu_values(moe_stats[0]["tokens_per_expert"])
    assert moe_layer["moe_load_max_over_mean"] == moe_stats[0]["load_max_over_mean"]
    for p_a, p_b in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p_a, p_b)  # the same step


def test_head_reads_once_per_call_and_never_through_the_vocab_head():
    """``head_token_losses`` checks the ranges of rows and scored targets in one read (was up to 7, a boolean-mask
    index among them); ``VocabHead`` ids are in range by construction: no read, and its id map is copied to the device
    once."""
    from genoctx.model.vocab import TokenMap, VocabHead

    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(10, 8, generator=g), torch.randn(12, 8, generator=g)
    tgt, scored = torch.randint(0, 5, (10,), generator=g), torch.rand(10, generator=g) > 0.3
    rows = torch.tensor([3, 1, 4, 0, 9])
    with SyncCounter() as c:
        ref = head_token_losses(h, w, tgt, scored, 4, rows=rows)
    assert dict(c.reads) == {"head.check": 1} and not c.ops
    with pytest.raises(ValueError, match="out of range"):
        head_token_losses(h, w, torch.where(scored, 5, tgt), scored, 4, rows=rows)
    with pytest.raises(ValueError, match="rows must lie"):
        head_token_losses(h, w, tgt, scored, 4, rows=torch.tensor([0, 12]))
    head_token_losses(h, w, torch.where(scored, tgt, 99), scored, 4, rows=rows)  # unscored targets are never read
    with SyncCounter() as c:
        same = head_token_losses(h, w, tgt, scored, 4, rows=rows, check_values=False)
    assert c.total == 0 and torch.equal(same, ref)

    torch.manual_seed(0)
    model = HybridLM(preset("tiny", vocab_size=12)).train()
    head = VocabHead(TokenMap((3, 1, 4, 0, 9, 11, 11, 11)), "nucleotide", chunk_tokens=16)
    tokens = torch.randint(0, 4, (1, 32), generator=g)
    with SyncCounter() as c:
        head.token_losses(model, tokens, tokens, tokens < 4).sum().backward()
    assert not c.reads and not c.ops  # the MoE layer's grouped dispatch keeps its offsets on the device
    assert head._ids_at(tokens.device) is head._ids_at(tokens.device)


def test_indexer_topk_reads_nothing_when_the_caller_knows_visible():
    """The DSA layer hands the top-k its visible counts as a host list (from the positions): no read; without it the
    PyTorch top-k reads ``visible`` once; pruning reads per block and runs only where reads are free (a CPU outside
    the counter), with the same selection."""
    from genoctx.model.dsa import indexer_topk

    g = torch.Generator().manual_seed(0)
    T, N = 96, 40
    q, w, k = torch.randn(1, T, 2, 8, generator=g), torch.rand(1, T, 2, generator=g), torch.randn(1, N, 8, generator=g)
    vis = [min(N, (p + 1) // 2) for p in range(T)]
    visible = torch.tensor(vis)
    ref = indexer_topk(q, w, k, visible, 8, 64, prune=False)
    with SyncCounter() as c:
        out = indexer_topk(q, w, k, visible, 8, 64, prune=False, visible_host=vis)
    assert c.total == 0 and torch.equal(out, ref)
    with SyncCounter() as c:
        indexer_topk(q, w, k, visible, 8, 64, prune=False)
    assert dict(c.reads) == {"indexer_topk.visible": 1} and not c.ops
    with SyncCounter() as c:
        pruned = indexer_topk(q, w, k, visible, 8, 32, prune=True, visible_host=vis)
    assert c.ops and torch.equal(pruned, ref)  # per-block reads: why the layer prunes only where they are free
    with pytest.raises(ValueError, match="non-decreasing"):
        indexer_topk(q, w, k, visible, 8, 64, visible_host=vis[::-1])


def test_triton_indexer_topk_checks_visible_on_the_host():
    """The Triton top-k (under the interpreter here) checks a host ``visible_host`` instead of reading ``visible``
    back from the device: no read; without it, its device check is one read (``item``). Counted on the launcher: the
    body of a ``torch.library`` op runs below the dispatch mode, where the counter does not see it."""
    from kernels.indexer_topk import indexer_topk, indexer_topk_launch

    g = torch.Generator().manual_seed(0)
    T, N = 8, 6
    q, w, k = (
        torch.randn(1, T, 1, 16, generator=g),
        torch.rand(1, T, 1, generator=g),
        torch.randn(1, N, 16, generator=g),
    )
    vis = [(p + 1) * N // T for p in range(T)]
    visible = torch.tensor(vis)
    with SyncCounter() as c:
        out = indexer_topk_launch(q, w, k, visible, 4, visible_host=vis)
    assert c.total == 0
    with SyncCounter() as c:
        ref = indexer_topk_launch(q, w, k, visible, 4)
    assert dict(c.ops) == {"item": 1} and torch.equal(out, ref)
    assert torch.equal(indexer_topk(q, w, k, visible, 4, visible_host=vis), ref)  # the op, its device check skipped
    with pytest.raises(ValueError, match="non-decreasing"):
        indexer_topk(q, w, k, visible, 4, visible_host=vis[::-1])
