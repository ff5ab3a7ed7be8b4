"""``genoctx.model.hf.save_hf`` and ``genoctx export``: a model goes back out as an HF directory that transformers
5.23.0 (``Glm5NextForConditionalGeneration.from_pretrained``) loads to the same logits.

The oracle is transformers itself: a tiny random reference model (``glm5_reference``) is saved, read with
``load_hf``, changed by two optimizer steps (so an export that wrote the original weights back would fail), exported
and loaded again by transformers. Logits are compared in fp32 (``atol 1e-5``); tensors read back with ``load_hf``
must be identical.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from glm5_reference import build, genoctx_log, reference_modules, save, text_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import genoctx.model.hf as hf
from genoctx.cli import app
from genoctx.errors import GenoctxError
from genoctx.lock import LOCK_NAME, output_lock
from genoctx.model import HybridLM, load_hf
from genoctx.model.hf import PLACEHOLDER_VISION, _exchange, checkpoint_layout, parse_bytes, save_hf

PRE = "model.language_model."
ATOL = 1e-5


def _ours(model: HybridLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids)[0].float()


def _theirs(path: Path, ids: torch.Tensor, **kw):
    """(transformers model loaded from ``path``, its fp32 logits for ``ids``)."""
    _, Model = reference_modules()
    ref = Model.from_pretrained(str(path), **kw).eval()
    with torch.no_grad():
        return ref, ref(input_ids=ids).logits.float()


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory's safetensors files (one or many)."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _same_model(a: HybridLM, b: HybridLM) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


class Source:
    """A transformers-saved tiny VL checkpoint, read with load_hf and trained for two AdamW steps."""

    def __init__(self, root: Path):
        self.ref = build(text_config(), seed=0)
        self.path = root / "vl"
        save(self.ref, self.path)
        self.ids = torch.randint(0, 16, (2, 48), generator=torch.Generator().manual_seed(0))
        model = load_hf(self.path).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            tokens = torch.randint(0, 16, (2, 33), generator=g)
            logits = model(tokens[:, :-1])[0]
            F.cross_entropy(logits.reshape(-1, 16).float(), tokens[:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():  # router biases are buffers (moved by the balancing rule, not the optimizer)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.add_(torch.randn(b.shape, generator=g) * 0.01)
        self.model = model.eval()
        self.want = _ours(model, self.ids)
        with torch.no_grad():
            before = self.ref(input_ids=self.ids).logits
        assert (self.want - before).abs().max() > 1e-2  # the training changed the function


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Source:
    return Source(tmp_path_factory.mktemp("export"))


def test_roundtrip_without_base(src, tmp_path):
    """Published names under the VL prefix, the model's own VL config with the placeholder vision tower (no vision
    weights), transformers' logits equal ours, load_hf reads back identical tensors."""
    out = tmp_path / "out"
    summary = save_hf(src.model, out)
    layout = checkpoint_layout(src.model.cfg)
    assert summary["files"] == ["config.json", "model.safetensors"] == sorted(p.name for p in out.iterdir())
    assert summary["tensors"] == len(layout) and summary["shards"] == 1 and summary["config"] == "model"
    tensors = load_file(out / "model.safetensors")
    assert set(tensors) == {k if k == "lm_head.weight" else PRE + k for k in layout}
    assert f"{PRE}layers.1.mlp.experts.7.up_proj.weight" in tensors and f"{PRE}layers.0.hc_attn_fn" in tensors
    assert summary["bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "glm5_next" and config["architectures"] == ["Glm5NextForConditionalGeneration"]
    assert config["vision_config"] == {**PLACEHOLDER_VISION, "out_hidden_size": 32}
    assert {k: v for k, v in config["text_config"].items() if k != "dtype"} == src.model.cfg.to_hf_dict()
    ref, got = _theirs(out, src.ids)
    assert torch.allclose(got, src.want, atol=ATOL, rtol=0)
    assert ref.lm_head.weight is not ref.model.language_model.embed_tokens.weight
    _same_model(load_hf(out), src.model)


def test_shards_and_index(src, tmp_path):
    """A small limit: several shards named like transformers', an index with the right total_size and weight map,
    each shard within the limit except a tensor larger than it (alone in its shard); transformers loads them."""
    limit = 5000  # bytes; e.g. the mHC fn matrices [15, 96] fp32 (5760 bytes) are larger
    out = tmp_path / "sharded"
    summary = save_hf(src.model, out, max_shard_bytes=limit)
    n = summary["shards"]
    names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert n > 10 and sorted(summary["files"]) == sorted(["config.json", "model.safetensors.index.json", *names])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    sizes, alone, keys = {}, 0, {}
    for name in names:
        with safe_open(str(out / name), framework="pt") as f:
            shard = {k: f.get_tensor(k) for k in f.keys()}
        sizes[name] = sum(t.numel() * t.element_size() for t in shard.values())
        if sizes[name] > limit:
            assert len(shard) == 1, name
            alone += 1
        keys.update(dict.fromkeys(shard, name))
    big = [k for k, t in _tensors(out).items() if t.numel() * t.element_size() > limit]
    assert alone == len(big) and f"{PRE}layers.0.hc_attn_fn" in big  # each larger tensor has a shard of its own
    assert index["weight_map"] == keys and len(keys) == summary["tensors"]
    assert index["metadata"]["total_size"] == sum(sizes.values()) == summary["bytes"]
    _, got = _theirs(out, src.ids)
    assert torch.allclose(got, src.want, atol=ATOL, rtol=0)
    _same_model(load_hf(out), src.model)


def test_bf16_stored_as_save_pretrained_stores_it(src, tmp_path):
    """``dtype=bf16``: the same tensors, dtypes (fp32 islands kept fp32) and bytes as transformers' own
    ``save_pretrained`` of the model loaded in bf16; config dtype bfloat16."""
    fp32 = tmp_path / "fp32"
    save_hf(src.model, fp32)
    ours = tmp_path / "bf16"
    assert save_hf(src.model, ours, dtype=torch.bfloat16)["dtype"] == "bfloat16"
    ref, _ = _theirs(fp32, src.ids[:, :8], dtype=torch.bfloat16)
    ref.save_pretrained(str(tmp_path / "theirs"))
    theirs = {k: v for k, v in _tensors(tmp_path / "theirs").items() if not k.startswith("model.visual.")}
    got = _tensors(ours)
    assert got.keys() == theirs.keys()
    islands = 0
    for k, t in got.items():
        assert t.dtype == theirs[k].dtype and _bits(t) == _bits(theirs[k]), k
        islands += t.dtype == torch.float32
    assert islands == 3 * 5 + 3 + 4 * 4  # KDA q/k/v conv, dt_bias, A_log; router biases; mHC base/scale
    config = json.loads((ours / "config.json").read_text())
    assert config["dtype"] == config["text_config"]["dtype"] == "bfloat16"


def _vl_base(src: Source, root: Path) -> tuple[Path, dict]:
    """The source checkpoint plus an MTP layer (``layers.4.*``, ``eh_proj``, ``shared_head``) in a second shard and
    tokenizer files. Returns (directory, the MTP tensors)."""
    base = root / "base"
    shutil.copytree(src.path, base)
    tensors = load_file(base / "model.safetensors")
    mtp = {k.replace("layers.3.", "layers.4."): t.clone() for k, t in tensors.items() if ".layers.3." in k}
    mtp[f"{PRE}layers.4.eh_proj.weight"] = torch.randn(32, 64)
    mtp[f"{PRE}layers.4.shared_head.head.weight"] = torch.randn(16, 32).to(torch.bfloat16)
    (base / "model.safetensors").unlink()
    shards = {"model-00001-of-00002.safetensors": tensors, "model-00002-of-00002.safetensors": mtp}
    weight_map = {}
    for name, part in shards.items():
        save_file(part, str(base / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (base / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (base / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    (base / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    (base / "special_tokens_map.json").write_text('{"eos_token": "<eos>"}')
    (base / "chat_template.jinja").write_text("{{ messages }}")
    (base / "tokenizer.model").write_bytes(bytes(range(256)))
    return base, mtp


def test_base_carries_vision_mtp_and_tokenizer(src, tmp_path):
    """With a VL base: its vision tower and MTP layer are carried byte for byte (in their own dtypes), its
    tokenizer and generation files copied, its config kept but for dtype; transformers loads the result."""
    base, mtp = _vl_base(src, tmp_path)
    vision = {k: t for k, t in _tensors(base).items() if k.startswith("model.visual.")}
    out = tmp_path / "out"
    with genoctx_log() as records:
        summary = save_hf(src.model, out, base_dir=base, dtype=torch.bfloat16)
    assert summary["carried"] == {"vision": len(vision), "mtp": len(mtp), "dequantized": 0} and len(vision) > 10
    assert f"carried over {len(mtp)} MTP tensors" in " ".join(r.getMessage() for r in records)
    copied = ["chat_template.jinja", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
              "tokenizer.model", "tokenizer_config.json"]  # fmt: skip
    assert summary["copied"] == copied
    for name in copied:
        assert (out / name).read_bytes() == (base / name).read_bytes(), name
    got = _tensors(out)
    for k, t in {**vision, **mtp}.items():
        assert got[k].dtype == t.dtype and _bits(got[k]) == _bits(t), k
    assert got[f"{PRE}layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    want_cfg = json.loads((base / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and want_cfg["dtype"] == "float32"
    assert config["text_config"].get("dtype") == ("bfloat16" if "dtype" in want_cfg["text_config"] else None)
    assert config["vision_config"] == want_cfg["vision_config"]
    for c in (config, want_cfg):
        c.pop("dtype")
        c["text_config"].pop("dtype", None)
    assert config == want_cfg  # the VL wrapper unchanged
    back = load_hf(out)
    assert back.hf_source["skipped"] == {"vision": len(vision), "mtp": len(mtp)}
    ref, got_logits = _theirs(out, src.ids)
    assert ref.model.visual.blocks[0].attn.qkv.weight.dtype == torch.bfloat16
    qkv = vision["model.visual.blocks.0.attn.qkv.weight"]
    assert torch.equal(ref.model.visual.blocks[0].attn.qkv.weight, qkv.to(torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = _ours(back, src.ids)
    assert (got_logits - src.want).abs().max() / src.want.abs().max() < 0.05
    assert (ours - src.want).abs().max() / src.want.abs().max() < 0.05


def test_base_of_another_architecture_refused(src, tmp_path):
    base = tmp_path / "other"
    shutil.copytree(src.path, base)
    config = json.loads((base / "config.json").read_text())
    config["text_config"]["num_experts_per_tok"] = 3
    (base / "config.json").write_text(json.dumps(config))
    with pytest.raises(GenoctxError) as e:
        save_hf(src.model, tmp_path / "out", base_dir=base)
    msg = str(e.value)
    assert "\n" not in msg and "num_experts_per_tok is 3 there and 2 in the model" in msg and str(base) in msg
    assert not (tmp_path / "out").exists()


def test_fp8_base_mtp_dequantized(src, tmp_path):
    """A block-fp8 base: its fp8 MTP weight is written dequantized (``fp8 * scale_inv`` per 5 x 7 block) in the
    export dtype, without ``_scale_inv`` and without ``quantization_config``."""
    base = tmp_path / "fp8"
    shutil.copytree(src.path, base)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [5, 7]}
    (base / "config.json").write_text(json.dumps(config))
    tensors = load_file(base / "model.safetensors")
    w = torch.randn(32, 64).to(torch.float8_e4m3fn)
    scale = torch.rand(7, 10) + 0.5
    tensors[f"{PRE}layers.4.eh_proj.weight"] = w
    tensors[f"{PRE}layers.4.eh_proj.weight_scale_inv"] = scale
    save_file(tensors, str(base / "model.safetensors"))
    summary = save_hf(src.model, tmp_path / "out", base_dir=base)
    assert summary["carried"]["mtp"] == 1 and summary["carried"]["dequantized"] == 1
    got = _tensors(tmp_path / "out")
    want = w.float() * scale.repeat_interleave(5, 0)[:32].repeat_interleave(7, 1)[:, :64]
    assert torch.equal(got[f"{PRE}layers.4.eh_proj.weight"], want)
    assert not any(k.endswith("_scale_inv") for k in got)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and "quantization_config" not in config["text_config"]


def test_tied_embeddings(tmp_path):
    """Tied (the VL config's flag): no lm_head.weight written; still tied after from_pretrained; same logits."""
    ref = build(text_config(), seed=1, tie_word_embeddings=True)
    save(ref, tmp_path / "src")
    model = load_hf(tmp_path / "src")
    assert model.lm_head.weight is model.embed_tokens.weight
    with torch.no_grad():
        model.embed_tokens.weight.mul_(1.5)
    out = tmp_path / "out"
    save_hf(model, out)
    assert "lm_head.weight" not in load_file(out / "model.safetensors")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    ids = torch.randint(0, 16, (1, 40), generator=torch.Generator().manual_seed(2))
    theirs, got = _theirs(out, ids)
    assert theirs.lm_head.weight is theirs.model.language_model.embed_tokens.weight
    assert torch.allclose(got, _ours(model, ids), atol=ATOL, rtol=0)
    back = load_hf(out)
    assert back.lm_head.weight is back.embed_tokens.weight
    _same_model(back, model)


def _cli(*args):
    return CliRunner().invoke(app, ["export", *map(str, args)])


def _one_error_line(res) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("genoctx: error: "), res.stderr
    return lines[0]


def _listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_cli_non_empty_out_refused_then_forced(src, tmp_path):
    """A non-empty --out: exit 2 with one line naming it and --force, nothing written; with --force it is
    replaced (old files gone, no lock file left)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = _listing(tmp_path)
    line = _one_error_line(_cli(src.path, "--out", out))
    assert str(out) in line and "--force" in line and "not empty" in line
    assert _listing(tmp_path) == before
    res = _cli(src.path, "--out", out, "--force", "--max-shard-size", "20KB")
    assert res.exit_code == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["checkpoint"] == str(src.path) and summary["base"] == str(src.path)  # an HF dir: a re-export
    assert summary["carried"]["vision"] > 10 and summary["copied"] == ["generation_config.json"]
    assert summary["shards"] > 1 and not (out / "notes.txt").exists() and not (out / LOCK_NAME).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporaries left
    _same_model(load_hf(out), load_hf(src.path))
    vision = {k: t for k, t in _tensors(out).items() if k.startswith("model.visual.")}
    res = _cli(out, "--out", out, "--force")  # in place (reshard into one file): read first, then swapped
    assert res.exit_code == 0, res.stderr
    assert sorted(json.loads(res.stdout)["files"]) == ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert all(torch.equal(t, vision[k]) for k, t in _tensors(out).items() if k.startswith("model.visual."))
    _same_model(load_hf(out), load_hf(src.path))


def test_cli_flag_errors(src, tmp_path):
    for args, needle in (
        (["--dtype", "fp8"], "--dtype must be keep, bf16 or fp32"),
        (["--max-shard-size", "5XB"], "--max-shard-size: '5XB' is not a size"),
        (["--base", tmp_path, "--no-base"], "not both"),
        (["--base", tmp_path], f"base {tmp_path}: not an HF model directory"),
    ):
        assert needle in _one_error_line(_cli(src.path, "--out", tmp_path / "out", *args))
    assert not (tmp_path / "out").exists()
    assert parse_bytes("5GB") == 5 * 10**9 and parse_bytes("2GiB") == 2 * 2**30 and parse_bytes("1.5kb") == 1500


@pytest.mark.parametrize("exists", [False, True])
def test_failing_export_leaves_no_partial_output(src, tmp_path, monkeypatch, exists):
    """A failure after the first shard: a new --out is not created; an existing one (replaced with force) is left
    exactly as it was; no temporary folder or lock file remains."""
    out = tmp_path / "out"
    if exists:
        save_hf(src.model, out, max_shard_bytes=20_000)
    before = _listing(tmp_path)
    real, calls = hf._write_shard, []

    def failing(path, tensors):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(path, tensors)

    monkeypatch.setattr(hf, "_write_shard", failing)
    with pytest.raises(OSError, match="No space left"):
        save_hf(src.model, out, max_shard_bytes=20_000, force=True)
    assert len(calls) == 2 and calls[0].parent.name.startswith(".out.export-")
    assert _listing(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == (["out"] if exists else [])


def test_locked_out_and_stale_temporaries(src, tmp_path):
    """Another writer holds --out: refused naming it. A temporary left by a killed export is removed."""
    out = tmp_path / "out"
    with output_lock(out, what="train"), pytest.raises(GenoctxError, match=r"is being written by PID \d+"):
        save_hf(src.model, out)
    stale = tmp_path / ".out.export-dead"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    save_hf(src.model, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_cli_exports_a_run_and_its_init_base(prepared, tmp_path):
    """``genoctx export RUN``: the latest checkpoint of a tiny nucleotide run, read back identical and loaded by
    transformers to the same logits. A run whose state.json records ``init.path`` takes that directory as its base
    (tokenizer copied).

    The logits are compared over 16 tokens (index_topk, so every key is selected): beyond that the DSA layer keeps 4
    of its key pools, and in this barely trained model many pool scores are exactly 0 (the indexer's ReLU), so which
    of the tied pools ``topk`` keeps is up to each implementation (transformers and genoctx break such ties
    differently: not a property of the weights). The sparse path on untied scores is compared in the tests above."""
    from genoctx.recipes import load_recipe
    from genoctx.train.checkpoint import latest_checkpoint, load_model
    from genoctx.train.loop import train

    run = tmp_path / "run"
    sets = ["train.steps=2", "train.seq_len=256", "train.checkpoint_every=2", "train.warmup_steps=1"]
    train(prepared, load_recipe("recipes/tiny.yaml", sets), run)
    model, _, _ = load_model(run)
    ids = torch.randint(0, 8, (2, 16), generator=torch.Generator().manual_seed(3))
    out = tmp_path / "hf"
    res = _cli(run, "--out", out)
    assert res.exit_code == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["checkpoint"] == str(latest_checkpoint(run)) and summary["base"] is None
    _same_model(load_hf(out), model)
    _, got = _theirs(out, ids)
    assert torch.allclose(got, _ours(model, ids), atol=ATOL, rtol=0)
    # the run "started from" that directory: its config and tokenizer files are kept
    (out / "tokenizer.json").write_text('{"dna": true}')
    ckpt = latest_checkpoint(run)
    state = json.loads((ckpt / "state.json").read_text())
    (ckpt / "state.json").write_text(json.dumps({**state, "init": {"source": "x", "path": str(out), "revision": None}}))
    res = _cli(run, "--out", tmp_path / "again", "--dtype", "bf16")
    assert res.exit_code == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["base"] == str(out) and summary["copied"] == ["tokenizer.json"] and summary["dtype"] == "bfloat16"
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["vision_config"] == json.loads((out / "config.json").read_text())["vision_config"]
    assert _cli(run, "--out", run, "--force").exit_code == 2  # would delete the checkpoint
    assert latest_checkpoint(run) == ckpt


@pytest.mark.parametrize("atomic", [True, False])
def test_exchange_swaps_folders(tmp_path, atomic):
    """The final swap: renameat2(RENAME_EXCHANGE), or the three-rename fallback; both leave each folder's content
    under the other's name and nothing else."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "new").write_text("export")
    (b / "old").write_text("previous")
    _exchange(a, b, atomic=atomic)
    assert _listing(tmp_path) == {"a/old": b"previous", "b/new": b"export"}
