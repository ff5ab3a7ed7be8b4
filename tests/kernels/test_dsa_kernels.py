"""The DSA layer's use of the Triton kernels: the ``model.kernels`` knob, the path recorded per layer, and a layer run
through the kernels (here under the Triton interpreter, on CPU) equal to the same layer on the PyTorch path."""

from __future__ import annotations

import pytest
import torch

from genoctx.model import dsa
from genoctx.model.config import ModelConfig, preset
from genoctx.model.model import HybridLM
from genoctx.recipes import load_recipe


def _layer(**kw) -> dsa.DeepSeekSparseAttention:
    cfg = preset("tiny", hidden_size=24, num_attention_heads=3, kv_lora_rank=12, q_lora_rank=16, qk_nope_head_dim=8,
                 v_head_dim=6, index_n_heads=2, index_head_dim=8, index_topk=12, index_kpool=4, **kw)  # fmt: skip
    layer = dsa.DeepSeekSparseAttention(cfg, 1)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    return layer


def test_kernels_knob_is_a_validated_runtime_knob():
    """``kernels`` defaults to "triton", accepts "torch", rejects anything else by name, is a compute knob (not in
    config.json, ignored by architecture comparisons) and is set from the command line with --set."""
    assert ModelConfig().kernels == "triton" and "kernels" in ModelConfig._runtime
    with pytest.raises(ValueError, match="kernels"):
        ModelConfig(kernels="cuda")
    cfg = preset("tiny", kernels="torch")
    assert "kernels" not in cfg.to_hf_dict()
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict(), **{k: getattr(cfg, k) for k in ModelConfig._runtime}) == cfg
    assert load_recipe(None, ["model.preset=tiny", "model.kernels=torch"]).model.kernels == "torch"


def test_cpu_runs_the_torch_path_and_says_so():
    """On CPU nothing changes: the default ("triton") gives the same bits as "torch", and every DSA layer records
    ``kernel: torch`` next to its ``path``."""
    model = HybridLM(preset("tiny"))
    tokens = torch.randint(0, 8, (2, 40))
    with torch.no_grad():
        y = model(tokens)[0]
        dsa_stats = [s for s in model.layer_stats() if s["mixer"] == "dsa"]
        for layer in model.layers:
            if isinstance(layer.self_attn, dsa.DeepSeekSparseAttention):
                assert layer.self_attn.kernels == "triton"
                layer.self_attn.kernels = "torch"
        assert torch.equal(model(tokens)[0], y)
    assert dsa_stats and all(s["kernel"] == "torch" and s["path"] == "sparse" for s in dsa_stats)
    assert list(dsa_stats[0])[1:4] == ["mixer", "path", "kernel"]


def test_layer_through_kernels_equals_torch_path(monkeypatch, device):
    """A DSA layer whose indexer top-k and sparse attention run the Triton kernels (on CPU the device check is
    replaced so that they run under the interpreter) gives the PyTorch path's selection, output, indexer loss and
    parameter gradients; its stats say ``kernel: triton``, and ``torch`` with the knob set to "torch". Queries after
    a cache of 6 positions, batch 2."""
    layer = _layer().to(device)
    B, S, T = 2, 6, 15
    x0, x = torch.randn(B, S, 24, device=device), torch.randn(B, T, 24, device=device)
    params = [p for p in layer.parameters() if p.requires_grad]

    def run():
        with torch.no_grad():
            _, cache, _ = layer(x0)
        y, _, sel = layer(x, cache)
        loss = (y * torch.linspace(-1, 1, y.numel(), device=device).view_as(y)).sum() + layer.aux_loss
        return y, sel, layer.stats, torch.autograd.grad(loss, params, allow_unused=True)

    if device == "cpu":
        monkeypatch.setattr(dsa, "_kernel_device", lambda t: True)
    layer.kernels = "torch"
    y_ref, sel_ref, stats_ref, g_ref = run()
    layer.kernels = "triton"
    y, sel, stats, g = run()
    assert stats_ref["kernel"] == "torch" and stats["kernel"] == "triton" and stats["path"] == "sparse"
    assert torch.equal(sel.pools, sel_ref.pools)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert float(stats["indexer_loss"]) == pytest.approx(float(stats_ref["indexer_loss"]), rel=1e-5)  # device 0-dim
    for a, b in zip(g, g_ref, strict=True):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_fp64_stays_on_the_torch_path(monkeypatch):
    """The kernels take fp32/fp16/bf16; an fp64 layer runs (and records) the PyTorch path."""
    monkeypatch.setattr(dsa, "_kernel_device", lambda t: True)
    layer = _layer().double()
    layer(torch.randn(1, 9, 24, dtype=torch.float64))
    assert layer.stats["kernel"] == "torch"


def test_model_imports_no_kernels_at_module_level():
    """genoctx/model imports ``kernels`` (hence Triton) only inside the function that runs them on CUDA: a CPU
    install without a working Triton imports the model. Checked on the source: no module-level import of either."""
    import ast
    from pathlib import Path

    import genoctx.model

    for path in Path(genoctx.model.__file__).parent.glob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module-level statements only
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            assert not any(n.split(".")[0] in ("kernels", "triton") for n in names), (path.name, names)
