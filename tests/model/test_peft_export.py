"""``genoctx export`` of a LoRA run as a PEFT adapter (``genoctx.model.peft_export``), and ``--merge`` (issue 44).

The oracles are peft 0.21.2 and transformers 5.23.0 themselves: the keys, shapes and config genoctx writes are the
ones ``get_peft_model(...).save_pretrained`` writes for glm5_next, and ``PeftModel.from_pretrained`` of the folder on
transformers' model of the frozen base gives genoctx's logits (fp32, ``atol 1e-5``, as tests/model/test_export.py),
with the routed experts' adapters (``target_parameters``) and groups trained whole (``modules_to_save``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from cli_runner import run_genoctx  # tests/cli_runner.py: tests/ is on sys.path (its conftest.py)
from glm5_reference import build, logits, reference_modules, text_config
from safetensors.torch import load_file

from genoctx.errors import GenoctxError
from genoctx.model.config import preset
from genoctx.model.groups import group_of
from genoctx.model.hf import load_hf
from genoctx.model.lora import DEFAULT_TARGETS, EXPERT_TARGETS, LoRALinear, apply_lora, is_lora_name
from genoctx.model.model import HybridLM
from genoctx.model.peft_export import adapter_config, base_of_run, peft_adapter, save_peft
from genoctx.recipes import load_recipe
from genoctx.train.checkpoint import load_model
from genoctx.train.loop import train

ATOL = 1e-5
RANK, ALPHA = 2, 6.0
LINEAR = [t for t in DEFAULT_TARGETS if t not in EXPERT_TARGETS]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny transformers glm5_next (4 layers K K K D, 8 experts) saved as the frozen base."""
    path = tmp_path_factory.mktemp("peft") / "base"
    build(text_config(), seed=0).save_pretrained(str(path))
    return path


def _trained(base: Path, trainable: tuple[str, ...], targets=DEFAULT_TARGETS):
    """genoctx's model of ``base`` with adapters (B drawn nonzero, as after training) and the groups of
    ``trainable`` moved (the router's bias too when the router trains)."""
    model = load_hf(base)
    apply_lora(model, RANK, ALPHA, targets, seed=0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif not is_lora_name(n) and group_of(n, model.cfg.layer_types) in trainable:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias") and "router" in trainable:
                b.add_(torch.randn(b.shape, generator=g) * 0.05)
    return model.eval()


def _peft_logits(base: Path, adapter: Path, ids: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel

    _, Model = reference_modules()
    return logits(PeftModel.from_pretrained(Model.from_pretrained(str(base)), str(adapter)).eval(), ids)


def _shapes(path: Path) -> dict[str, tuple]:
    return {k: tuple(t.shape) for k, t in load_file(path / "adapter_model.safetensors").items()}


@pytest.mark.parametrize("targets", [DEFAULT_TARGETS, ("q_proj", "experts.down_proj")])
def test_keys_shapes_and_config_are_what_peft_writes(base, tmp_path, targets):
    """peft's own ``save_pretrained`` of transformers' model wrapped with the config genoctx writes has the same keys,
    shapes and config; and the linear adapters are exactly those that peft's leaf-name ``target_modules`` put on the
    text model (the regex keeps only the vision tower out)."""
    from peft import LoraConfig, get_peft_model

    model = _trained(base, ("norms", "lora"), targets)
    fields, tensors, info = peft_adapter(model, ("norms", "lora"), rank=RANK, alpha=ALPHA)
    _, Model = reference_modules()
    ref = Model.from_pretrained(str(base))
    theirs = get_peft_model(copy.deepcopy(ref), LoraConfig(r=RANK, lora_alpha=ALPHA, **fields))
    theirs.save_pretrained(str(tmp_path / "theirs"))
    assert {k: tuple(t.shape) for k, t in tensors.items()} == _shapes(tmp_path / "theirs")
    ours = adapter_config(rank=RANK, alpha=ALPHA, base=str(base), revision=None, **fields)
    assert ours == json.loads((tmp_path / "theirs" / "adapter_config.json").read_text())
    experts = [t for t in targets if t in EXPERT_TARGETS]
    assert fields["target_parameters"] == sorted(experts) and len(info["experts"]) == 3  # layers 1-3 are MoE
    nested = [k for k in tensors if ".experts.base_layer." in k]  # peft nests a second target parameter's wrapper
    assert len(nested) == (6 if len(experts) == 2 else 0)
    assert len(info["modules_to_save"]) == 15 and fields["modules_to_save"][-1] == "model.language_model.norm"
    leaf = [t for t in targets if t in LINEAR]
    by_leaf = get_peft_model(copy.deepcopy(ref), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=leaf))
    want = {n for n, _ in by_leaf.named_parameters() if "lora_" in n and ".visual." not in n}
    got = {n for n, _ in theirs.named_parameters() if "lora_" in n and ".experts." not in n}
    assert got == want and len(got) == 2 * len(info["adapters"]) > 0


@pytest.mark.parametrize(
    "trainable",
    [("norms", "lora"), ("kda", "indexer", "router", "mhc", "embed", "head", "lora"),
     ("dsa", "experts", "shared_experts", "dense_mlp", "norms", "lora")],
)  # fmt: skip
def test_peft_model_logits_equal_genoctx(base, tmp_path, trainable):
    """Every group, saved whole (``modules_to_save``), and the adapters, with those inside a group trained whole
    folded into its saved weights: PeftModel's logits equal genoctx's; the base alone's do not."""
    model = _trained(base, trainable)
    summary = save_peft(model, tmp_path / "adapter", trainable, rank=RANK, alpha=ALPHA)
    assert summary["files"] == ["adapter_config.json", "adapter_model.safetensors"]
    assert summary["modules_to_save"] > 0 and summary["adapters"] > 0
    assert (summary["folded"] > 0) == (trainable != ("norms", "lora"))  # adapters inside groups trained whole
    ids = torch.randint(0, 16, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids)[0].float()
    got = _peft_logits(base, tmp_path / "adapter", ids)
    assert torch.allclose(got, want, atol=ATOL, rtol=0), (got - want).abs().max()
    _, Model = reference_modules()
    assert (logits(Model.from_pretrained(str(base)).eval(), ids) - want).abs().max() > 1e-2


def test_refusals_are_one_line(base, tmp_path):
    model = _trained(base, ("lora",), ("q_proj",))
    with pytest.raises(GenoctxError, match="every adapter lies in a group trained whole"):
        peft_adapter(model, ("kda", "lora"), rank=RANK, alpha=ALPHA)  # q_proj is KDA's only: all folded
    with pytest.raises(GenoctxError, match=r"train.lora_rank/lora_alpha say 4/6.0"):
        peft_adapter(model, ("lora",), rank=4, alpha=ALPHA)
    model.extra = LoRALinear.from_linear(torch.nn.Linear(4, 4), RANK, ALPHA)  # a module transformers lacks
    with pytest.raises(GenoctxError, match="^extra: an adapted module transformers' glm5_next does not have"):
        peft_adapter(model, ("lora",), rank=RANK, alpha=ALPHA)
    tied = HybridLM(preset("tiny", tie_word_embeddings=True), seed=0)
    apply_lora(tied, RANK, ALPHA, seed=0)
    with pytest.raises(GenoctxError, match="train.trainable embed with tied embeddings"):
        peft_adapter(tied, ("embed", "lora"), rank=RANK, alpha=ALPHA)


def test_atomic_and_not_empty(base, tmp_path, monkeypatch):
    """A failed write leaves no folder and no temporary; a non-empty --out is refused unless --force."""
    import genoctx.model.peft_export as pe

    model = _trained(base, ("lora",))
    out = tmp_path / "adapter"

    def boom(**kw):
        raise RuntimeError("disk full")

    monkeypatch.setattr(pe, "adapter_config", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        save_peft(model, out, ("lora",), rank=RANK, alpha=ALPHA)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(GenoctxError, match="is not empty .*pass --force"):
        save_peft(model, out, ("lora",), rank=RANK, alpha=ALPHA)
    assert save_peft(model, out, ("lora",), rank=RANK, alpha=ALPHA, force=True)["files"] == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]


def test_bf16_keeps_the_fp32_islands(base, tmp_path):
    """``dtype=bf16``: adapters and saved modules in bf16, the fp32 islands (KDA conv, dt_bias, A_log) in fp32."""
    model = _trained(base, ("kda", "lora"))
    assert save_peft(model, tmp_path / "a", ("kda", "lora"), rank=RANK, alpha=ALPHA, dtype=torch.bfloat16)["dtype"] == (
        "bfloat16"
    )
    tensors = load_file(tmp_path / "a" / "adapter_model.safetensors")
    islands = {k for k in tensors if k.endswith(("conv1d.weight", "dt_bias", "A_log"))}
    assert len(islands) == 3 * 3  # three KDA layers
    assert all((t.dtype == torch.float32) == (k in islands) for k, t in tensors.items())


def test_base_of_run():
    hub = {"kind": "hf", "source": "zai-org/GLM-5.3-Flash", "revision": "abc", "path": "/c/snap", "hf_base": "/c/snap"}
    assert base_of_run(hub) == ("zai-org/GLM-5.3-Flash", "abc", None)
    name, rev, note = base_of_run({"kind": "genoctx", "source": "runs/a", "path": "runs/a/ck", "hf_base": "/b"})
    assert (name, rev) == (None, None) and "genoctx run runs/a" in note
    assert base_of_run(None)[0] is None and "no HF base" in base_of_run(None)[2]


def test_cli_export_of_a_lora_run(prepared, tmp_path):
    """A tiny LoRA run (lora,norms, two steps): ``genoctx export`` writes the adapter, PeftModel on transformers'
    model of the run's step-0 weights (their own --merge export) equals genoctx's logits; ``--merge`` writes the
    merged model, which transformers loads to the same logits; a non-empty --out is one line, exit 2 (a sharded
    LoRA checkpoint: tests/train/test_sharded_lora.py)."""
    over = ["train.seq_len=64", "train.steps=2", "train.warmup_steps=0", "train.lr=1e-2", "train.checkpoint_every=2",
            "train.trainable=lora,norms", "train.lora_rank=4", "train.lora_alpha=8"]  # fmt: skip
    rec = load_recipe("recipes/tiny.yaml", over)
    train(prepared, rec, tmp_path / "run")
    train(prepared, load_recipe("recipes/tiny.yaml", [*over, "train.steps=0"]), tmp_path / "init")
    r = run_genoctx("export", str(tmp_path / "init"), "--out", str(tmp_path / "base"), "--merge")  # B = 0: the base
    assert r.returncode == 0, r.stderr
    r = run_genoctx("export", str(tmp_path / "run"), "--out", str(tmp_path / "adapter"))
    assert r.returncode == 0 and "base_model_name_or_path is null" in r.stderr, r.stderr
    assert json.loads(r.stdout)["format"] == "peft"
    r = run_genoctx("export", str(tmp_path / "run"), "--out", str(tmp_path / "merged"), "--merge")
    assert r.returncode == 0 and "--merge: writing the merged model" in r.stderr, r.stderr
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8, None)
    assert config["modules_to_save"] and config["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    model = load_model(tmp_path / "run")[0].eval()
    # 16 tokens = index_topk: beyond it, a fresh tiny init's DSA selection differs from transformers' (logits 1e-4
    # apart before any adapter; equal with index_topk 64), which is not the export's; the sparse path is compared
    # above, on the reference-drawn base
    ids = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.index_topk), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids)[0].float()
    got = _peft_logits(tmp_path / "base", tmp_path / "adapter", ids)
    assert torch.allclose(got, want, atol=ATOL, rtol=0), (got - want).abs().max()
    _, Model = reference_modules()
    assert torch.allclose(logits(Model.from_pretrained(str(tmp_path / "merged")).eval(), ids), want, atol=ATOL, rtol=0)
    assert (logits(Model.from_pretrained(str(tmp_path / "base")).eval(), ids) - want).abs().max() > 1e-3
    again = ["export", str(tmp_path / "run"), "--out", str(tmp_path / "adapter"), "--base", str(tmp_path / "base")]
    r = run_genoctx(*again)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "pass --force" in r.stderr, r.stderr
    r = run_genoctx(*again, "--force")
    assert r.returncode == 0, r.stderr
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "base")
