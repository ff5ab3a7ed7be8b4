"""``train.compile`` (``genoctx.parallel.compile``): each decoder layer compiled equals eager, forward and backward,
and breaks its graph only where ``GRAPH_BREAKS`` says.

Tolerance (fp32): the loss within 1e-6 relative; every gradient within 1e-5 relative plus 1e-6 of the largest
gradient entry of the model; router loads equal; ``layer_stats`` equal (floats within 1e-4 relative).

Cases, both with the ``eager`` backend (dynamo's graphs, with the forward and backward it traces of the autograd
Functions and checkpoints, run by eager kernels): tiny with a third layer, a shared DSA layer (so that every layer
kind of the presets and GLM-5.3-Flash is compiled: KDA + MLP, KDA + MoE, full DSA + MoE, shared DSA + MoE), and
cpu-small. Cost on this CPU (CPU seconds): 5.7 and 7.0. ``aot_eager`` (AOT autograd's joint graphs too) costs
16 s for tiny and Inductor's code generation minutes (gcc; cold cache ~3 min for tiny): too slow for the suite.
``bench/compile_speed.py`` compiles both presets with Inductor and prints their differences from eager (same
tolerance) with the speed.
"""

import copy

import pytest
import torch
import torch._dynamo as dynamo

from genoctx.data.tokenizer import BOS
from genoctx.errors import GenoctxError
from genoctx.model.config import preset
from genoctx.model.model import HybridLM
from genoctx.parallel.build import build_model
from genoctx.parallel.compile import GRAPH_BREAKS, BreakLog, apply_compile, layer_kind
from genoctx.recipes import recipe_from_dict
from genoctx.train.loop import shift_inputs

# the kinds each case holds, so a case that lost a layer kind fails here rather than testing less
CASES = {
    "tiny": ("eager", dict(num_hidden_layers=3, layer_types="KDD", mlp_layer_types=["dense", "sparse", "sparse"],
                           indexer_types=["full", "full", "shared"]), 16,
             {"kda+mlp", "dsa-full+moe", "dsa-shared+moe"}),
    "cpu-small": ("eager", {}, 64, {"kda+mlp", "kda+moe", "dsa-full+moe"}),
}  # fmt: skip


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


def _step(model, tokens):
    logits, _ = model(shift_inputs(tokens, BOS))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()) + model.aux_loss()
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_step_equals_eager_and_breaks_only_where_documented(case):
    backend, overrides, T, kinds = CASES[case]
    torch.manual_seed(0)
    eager = HybridLM(preset(case, **overrides))
    compiled = copy.deepcopy(eager)
    log = BreakLog(backend)
    assert apply_compile(compiled, backend=log.backend) == len(compiled.layers)
    log.attach(compiled)
    tokens = torch.randint(0, 4, (2, T))
    loss0, loss1 = _step(eager, tokens), _step(compiled, tokens)

    assert len(log.backend.graphs) >= len(kinds)  # it compiled: dynamo captured graphs
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=0)
    gmax = max(p.grad.abs().max() for p in eager.parameters() if p.grad is not None)
    for (name, p0), p1 in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert (p0.grad is None) == (p1.grad is None), name
        if p0.grad is not None:
            torch.testing.assert_close(p1.grad, p0.grad, rtol=1e-5, atol=1e-6 * gmax, msg=name)
    for b0, b1 in zip(eager.buffers(), compiled.buffers(), strict=True):  # router loads counted once
        assert torch.equal(b1, b0)
    s0, s1 = eager.layer_stats(), compiled.layer_stats()  # read after the step: numbers, as eager records them
    assert [sorted(s) for s in s1] == [sorted(s) for s in s0]
    for r0, r1 in zip(s0, s1, strict=True):
        for key, v0 in r0.items():
            assert type(r1[key]) is type(v0), key
            assert r1[key] == (pytest.approx(v0, rel=1e-4) if isinstance(v0, float) else v0), key

    assert {layer_kind(layer) for layer in compiled.layers} == kinds == set(log.sites)
    for kind in kinds:
        assert log.sites[kind] == set(GRAPH_BREAKS[kind]), kind


def test_train_compile_is_a_validated_recipe_knob_that_build_model_applies():
    rec = recipe_from_dict({"model": {"preset": "tiny"}, "train": {"compile": True}})
    assert rec.train.compile is True and rec.to_dict()["train"]["compile"] is True
    assert recipe_from_dict({"model": {"preset": "tiny"}}).train.compile is False  # off by default
    with pytest.raises(GenoctxError, match="train.compile must be true or false"):
        recipe_from_dict({"model": {"preset": "tiny"}, "train": {"compile": "yes"}})
    with pytest.raises(GenoctxError, match="train.compile is not supported with train.cp=2"):
        recipe_from_dict({"model": {"preset": "tiny"}, "train": {"compile": True, "cp": 2}})
    with pytest.raises(GenoctxError, match="train.compile is not supported with train.seq_chunk_tokens"):
        recipe_from_dict({"model": {"preset": "tiny"}, "train": {"compile": True, "seq_chunk_tokens": 64}})
    model = build_model(preset("tiny"), compile=True, activation_checkpointing=True)
    for layer in model.layers:  # the checkpoint (eager) wraps the compiled forward; the MoE stays eager
        assert layer.forward.__name__ == "recomputed"
        assert getattr(layer.forward.__kwdefaults__["_fwd"], "_torchdynamo_orig_callable", None) is not None
    assert getattr(model.layers[1].mlp.forward, "_genoctx_eager", False)
    assert not hasattr(build_model(preset("tiny")).layers[0].forward, "_torchdynamo_orig_callable")
