"""``genoctx.model.hf``: loading glm5_next checkpoints in every layout they come in, and the errors.

The checkpoints are written by transformers (``save_pretrained`` of a tiny random ``glm5_reference`` model) or
rewritten from one by the tests (shards and an index, a flat text config, transformers' in-memory names, block-wise
fp8 quantized by hand). Relative error = ``max |ours - ref| / max |ref|`` over all logits.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from glm5_reference import build, genoctx_log, logits, save, text_config
from safetensors.torch import load_file, save_file

from genoctx.errors import GenoctxError
from genoctx.model import HybridLM, load_hf
from genoctx.model.config import ModelConfig
from genoctx.model.hf import checkpoint_layout, is_hf_dir, read_config, weight_files
from genoctx.model.model import FP32_PARAMETERS

PRE = "model.language_model."
FP8_BLOCK = (5, 7)  # divides none of the tiny shapes (16, 24, 32, 48, ...)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).abs().max() / ref.double().abs().max())


class Base:
    """One reference model, its save_pretrained directory and its tensors (read once per module)."""

    def __init__(self, root: Path):
        self.ref = build(text_config(), seed=0)
        self.path = root / "vl"
        save(self.ref, self.path)
        self.tensors = load_file(self.path / "model.safetensors")
        self.config = json.loads((self.path / "config.json").read_text())
        self.ids = torch.randint(0, 16, (2, 60), generator=torch.Generator().manual_seed(0))
        self.want = logits(self.ref, self.ids)
        self.ours = load_hf(self.path)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Base:
    return Base(tmp_path_factory.mktemp("hf"))


def _write(dst: Path, tensors: dict, config: dict, shards: list[list[str]] | None = None) -> Path:
    """A checkpoint directory: config.json and one model.safetensors, or the given shards plus an index."""
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(config))
    if shards is None:
        save_file(tensors, str(dst / "model.safetensors"))
        return dst
    weight_map = {}
    for i, names in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(dst / fn))
        weight_map.update(dict.fromkeys(names, fn))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}}
    (dst / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}))
    return dst


def _assert_same_model(a: HybridLM, b: HybridLM) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def _our_logits(model: HybridLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids)[0]


def test_save_pretrained_vl_checkpoint(base):
    """The transformers-saved VL checkpoint (``text_config`` + vision tower) loads to the reference's logits; the
    vision tensors are skipped and the skip is logged."""
    assert is_hf_dir(base.path) and weight_files(base.path) == [base.path / "model.safetensors"]
    assert base.config["model_type"] == "glm5_next" and "text_config" in base.config
    with genoctx_log() as records:
        model = load_hf(base.path)
    assert rel(_our_logits(model, base.ids), base.want) <= 1e-5
    n_vision = sum(k.startswith("model.visual.") for k in base.tensors)
    assert n_vision > 10
    assert model.hf_source["skipped"] == {"vision": n_vision, "mtp": 0}
    assert model.hf_source["files"] == ["model.safetensors"] and model.hf_source["dtype"] == "torch.float32"
    msg = " ".join(r.getMessage() for r in records)
    assert f"skipped {n_vision} vision-tower tensors" in msg


def test_sharded_copy_with_index(base, tmp_path):
    """Two shards listed by model.safetensors.index.json load to the same model as the single file."""
    names = sorted(base.tensors)
    path = _write(tmp_path / "sharded", base.tensors, base.config, [names[::2], names[1::2]])
    assert not (path / "model.safetensors").exists() and is_hf_dir(path)
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert [f.name for f in weight_files(path)] == shards
    model = load_hf(path)
    _assert_same_model(model, base.ours)
    assert model.hf_source["files"] == shards
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(GenoctxError, match="shard model-00002-of-00002.safetensors is missing"):
        load_hf(path)


SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
WK = f"{PRE}layers.3.self_attn.indexer.wk.weight"


def _two_shards(base, path: Path) -> Path:
    """``base``'s tensors in two shards with their index; ``WK`` in the second."""
    names = sorted(base.tensors)
    first = [n for n in names[::2] if n != WK]
    return _write(path, base.tensors, base.config, [first, [n for n in names if n not in first]])


def _index(path: Path) -> dict:
    return json.loads((path / "model.safetensors.index.json").read_text())


def test_the_index_says_where_each_tensor_is_read_from(base, tmp_path):
    """A stray ``.safetensors`` beside the shards, holding a tensor of the model with other values (the issue's
    "stray tensor silently wins"), and a tensor of a listed shard that the weight_map does not name: both ignored, the
    index's tensors read, one warning naming both files; the same through the per-rank reader (``build_model``),
    which does not warn again."""
    from genoctx.parallel.build import FromHF, build_model

    path = _two_shards(base, tmp_path / "stray")
    save_file({WK: torch.full_like(base.tensors[WK], 7.0)}, str(path / "extra.safetensors"))
    unmapped = f"{PRE}layers.0.self_attn.rotary_emb.inv_freq"  # read, it would be an unknown tensor
    save_file({**load_file(path / SHARDS[1]), unmapped: torch.zeros(4)}, str(path / SHARDS[1]))
    with genoctx_log() as records:
        model = load_hf(path)
    _assert_same_model(model, base.ours)
    assert model.hf_source["files"] == SHARDS
    warnings = [r.getMessage() for r in records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "extra.safetensors" in warnings[0], warnings
    assert f"1 tensor of {SHARDS[1]} (not in the weight_map)" in warnings[0]
    with genoctx_log() as records:
        built = build_model(model.cfg, None, source=FromHF(path))
    _assert_same_model(built, base.ours)
    assert [r for r in records if r.levelname == "WARNING"] == []


@pytest.mark.parametrize("case", ["wrong shard", "in two shards", "key twice"])
def test_an_index_that_misplaces_a_tensor_is_one_line(base, tmp_path, case):
    """The index names a shard that lacks the tensor (it is in the other one), two listed shards both hold it, or its
    weight_map names the tensor twice (``json`` alone keeps the last, here the right shard, silently): one line naming
    the tensor and the files, from ``load_hf`` and from ``genoctx export`` (exit 2), before any tensor data is read
    (``check_hf``, what the driver runs before workers start)."""
    from typer.testing import CliRunner

    from genoctx.cli import app
    from genoctx.model.hf import check_hf

    path = _two_shards(base, tmp_path / "bad")
    index = _index(path)
    if case == "wrong shard":
        index["weight_map"][WK] = SHARDS[0]
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
        want = f"tensor {WK} is not in {SHARDS[0]}, the shard the index names for it (it is in {SHARDS[1]})"
    elif case == "key twice":
        text = json.dumps(index)
        assert text.count('"weight_map": {') == 1 and index["weight_map"][WK] == SHARDS[1]
        text = text.replace('"weight_map": {', f'"weight_map": {{"{WK}": "{SHARDS[0]}", ')
        (path / "model.safetensors.index.json").write_text(text)
        want = (f"{path / 'model.safetensors.index.json'}: key '{WK}' appears twice (which one holds the tensor?); "
                "keep one")  # fmt: skip
    else:
        save_file({**load_file(path / SHARDS[0]), WK: torch.zeros_like(base.tensors[WK])}, str(path / SHARDS[0]))
        want = f"tensor {WK} is in two shards, {SHARDS[0]} and {SHARDS[1]} (the index names {SHARDS[1]})"
    for read in (load_hf, lambda p: check_hf(p, base.ours.cfg)):
        with pytest.raises(GenoctxError) as e:
            read(path)
        assert "\n" not in str(e.value) and want in str(e.value), str(e.value)
    res = CliRunner().invoke(app, ["export", str(path), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and want in res.stderr.strip().splitlines()[-1], res.stderr[-2000:]
    assert "Traceback" not in res.stderr and not (tmp_path / "out").exists()


def test_flat_text_config(base, tmp_path):
    """A text-only checkpoint: flat ``glm5_next_text`` config.json and ``model.*`` names, no vision tower."""
    flat = {**base.config["text_config"], "architectures": ["Glm5NextForCausalLM"], "dtype": "float32"}
    tensors = {
        ("model." + k[len(PRE) :] if k.startswith(PRE) else k): t
        for k, t in base.tensors.items()
        if not k.startswith("model.visual.")
    }
    model = load_hf(_write(tmp_path / "flat", tensors, flat))
    _assert_same_model(model, base.ours)
    assert model.hf_source["skipped"] == {"vision": 0, "mtp": 0}


def test_mtp_layer_and_vision_skipped_and_logged(base, tmp_path):
    """The multi-token-prediction layer (``layers.{num_hidden_layers}.*``, ``shared_head``) is skipped, as
    transformers skips it, and reported on the log with the vision tower."""
    n = base.ours.cfg.num_hidden_layers
    tensors = dict(base.tensors)
    last = f"layers.{n - 1}."
    mtp = {k.replace(last, f"layers.{n}."): t.clone() for k, t in base.tensors.items() if last in k}
    mtp[f"{PRE}layers.{n}.eh_proj.weight"] = torch.randn(32, 64)
    mtp[f"{PRE}layers.{n}.shared_head.head.weight"] = torch.randn(16, 32)
    tensors.update(mtp)
    with genoctx_log() as records:
        model = load_hf(_write(tmp_path / "mtp", tensors, base.config))
    _assert_same_model(model, base.ours)
    n_vision = sum(k.startswith("model.visual.") for k in base.tensors)
    assert model.hf_source["skipped"] == {"vision": n_vision, "mtp": len(mtp)}
    msg = " ".join(r.getMessage() for r in records)
    assert f"{len(mtp)} multi-token-prediction tensors (layers.{n}.*)" in msg


def test_transformers_in_memory_names(base, tmp_path):
    """A state dict as transformers holds it in memory (``attn_hc.fn``, ``forget_gate.*``, one ``conv1d.weight``,
    stacked ``experts.gate_up_proj`` / ``down_proj``) loads to the same model."""
    sd = {k: v.detach().contiguous().clone() for k, v in base.ref.state_dict().items()}
    assert f"{PRE}layers.1.attn_hc.fn" in sd and f"{PRE}layers.1.mlp.experts.gate_up_proj" in sd
    assert f"{PRE}layers.1.self_attn.conv1d.weight" in sd and f"{PRE}layers.1.hc_attn_fn" not in sd
    model = load_hf(_write(tmp_path / "memory", sd, base.config))
    _assert_same_model(model, base.ours)


def _quantize_fp8(tensors: dict) -> tuple[dict, dict]:
    """Block-wise fp8 (DeepSeek-V3 layout) by hand: every 2-D projection weight of the text model becomes
    float8_e4m3fn plus ``<name>_scale_inv`` [ceil(out / 5), ceil(in / 7)] with ``w ~ fp8 * scale_inv`` per block.
    Returns (checkpoint tensors, {name: dequantized fp32 weight})."""
    b0, b1 = FP8_BLOCK
    out, deq = {}, {}
    for name, w in tensors.items():
        skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "visual")
        if w.dim() != 2 or not name.endswith(".weight") or any(s in name for s in skip):
            out[name] = w
            continue
        rows, cols = w.shape
        q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
        scale = torch.empty(math.ceil(rows / b0), math.ceil(cols / b1))
        d = torch.empty(rows, cols)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                blk = (slice(i * b0, (i + 1) * b0), slice(j * b1, (j + 1) * b1))
                s = w[blk].abs().max().clamp_min(1e-12) / 448.0
                q[blk] = (w[blk] / s).to(torch.float8_e4m3fn)
                scale[i, j] = s
                d[blk] = q[blk].float() * s
        out[name], out[name + "_scale_inv"], deq[name] = q, scale, d
    return out, deq


def _fp8_config(config: dict) -> dict:
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK)}
    return {**config, "quantization_config": qc}


@pytest.fixture(scope="module")
def fp8(base, tmp_path_factory):
    """(directory, dequantized weights): the base checkpoint quantized to block-wise fp8, weights and their scales
    in different shards (a scale is looked up across shards)."""
    tensors, deq = _quantize_fp8(base.tensors)
    assert len(deq) > 100
    weights = [k for k in tensors if not k.endswith("_scale_inv")]
    scales = [k for k in tensors if k.endswith("_scale_inv")]
    path = _write(tmp_path_factory.mktemp("fp8") / "fp8", tensors, _fp8_config(base.config), [weights, scales])
    return path, tensors, deq


def test_fp8_blocks_dequantized_on_load(base, fp8):
    """Loaded weights equal ``fp8 * scale_inv`` per block exactly (blocks of 5 x 7 that divide no shape), and the
    logits equal the reference model built from the dequantized weights."""
    path, _, deq = fp8
    model = load_hf(path, dtype=torch.float32)
    layout = checkpoint_layout(model.cfg)
    state = model.state_dict()
    ref = copy.deepcopy(base.ref)
    ref_state = ref.state_dict()
    with torch.no_grad():
        for name, d in deq.items():
            slot = layout[name[len(PRE) :]]
            got = state[slot.name] if slot.index is None else state[slot.name][slot.index]
            assert torch.equal(got, d), name
            dest = ref_state[PRE + slot.name]
            (dest if slot.index is None else dest[slot.index]).copy_(d)
    assert rel(_our_logits(model, base.ids), logits(ref, base.ids)) <= 1e-5
    assert rel(_our_logits(model, base.ids), base.want) > 1e-4  # the quantization noise is real
    default = load_hf(path)  # fp8 checkpoints load as bf16 by default, fp32 islands kept
    assert default.embed_tokens.weight.dtype == torch.bfloat16
    assert default.layers[0].self_attn.conv1d.weight.dtype == torch.float32


def _without(tensors: dict, name: str) -> dict:
    assert name in tensors
    return {k: v for k, v in tensors.items() if k != name}


ERRORS = {
    # case: (edit of the tensors, text the one-line message must contain)
    "missing": (
        lambda t: _without(t, f"{PRE}layers.3.self_attn.indexer.wk.weight"),
        ["tensor layers.3.self_attn.indexer.wk.weight is missing", "model.safetensors"],
    ),
    "missing conv slice": (
        lambda t: _without(t, f"{PRE}layers.0.self_attn.k_conv1d.weight"),
        ["tensor layers.0.self_attn.k_conv1d.weight is missing", "model.safetensors"],
    ),
    "misshapen": (
        lambda t: {**t, f"{PRE}layers.3.self_attn.q_a_proj.weight": torch.zeros(25, 32)},
        ["model.safetensors", f"{PRE}layers.3.self_attn.q_a_proj.weight has shape (25, 32), expected (24, 32)"],
    ),
    "unknown": (
        lambda t: {**t, f"{PRE}layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4)},
        ["model.safetensors", f"unknown tensor {PRE}layers.0.self_attn.rotary_emb.inv_freq"],
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_tensors_raise_one_line(base, tmp_path, case):
    edit, needles = ERRORS[case]
    path = _write(tmp_path / "bad", edit(dict(base.tensors)), base.config)
    with pytest.raises(GenoctxError) as e:
        load_hf(path)
    msg = str(e.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg


def test_fp8_errors_raise_one_line(base, fp8, tmp_path):
    """An fp8 weight without its scale, and a scale in a checkpoint whose config declares no fp8 blocks."""
    _, tensors, _ = fp8
    name = f"{PRE}layers.3.self_attn.o_proj.weight"
    path = _write(tmp_path / "noscale", _without(tensors, name + "_scale_inv"), _fp8_config(base.config))
    with pytest.raises(GenoctxError) as e:
        load_hf(path)
    assert "\n" not in str(e.value) and f"model.safetensors: fp8 tensor {name} has no {name}_scale_inv" in str(e.value)
    path = _write(tmp_path / "noblock", tensors, base.config)
    with pytest.raises(GenoctxError, match="declares no quantization_config.weight_block_size") as e:
        load_hf(path)
    assert "\n" not in str(e.value)


def test_config_and_directory_errors(base, tmp_path):
    with pytest.raises(GenoctxError, match="no config.json"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(GenoctxError, match="cannot read JSON"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**base.config, "model_type": "llama"}))
    with pytest.raises(GenoctxError, match="model_type 'llama'"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(base.config))
    assert not is_hf_dir(tmp_path)
    with pytest.raises(GenoctxError, match="no model.safetensors"):
        load_hf(tmp_path)


@pytest.mark.parametrize("where", ["vl", "text"])
def test_tie_word_embeddings(tmp_path, where):
    """transformers' VL model ties ``lm_head`` by the VL config's own flag (the text_config's flag is ignored), and
    save_pretrained then omits ``lm_head.weight``; genoctx follows the same flag, so logits equal in both cases."""
    vl = {"tie_word_embeddings": True} if where == "vl" else {}
    ref = build(text_config(tie_word_embeddings=where == "text"), seed=1, **vl)
    tied = ref.lm_head.weight is ref.model.language_model.embed_tokens.weight
    assert tied == (where == "vl")
    save(ref, tmp_path)
    assert ("lm_head.weight" in load_file(tmp_path / "model.safetensors")) == (not tied)
    model = load_hf(tmp_path)
    assert model.cfg.tie_word_embeddings == tied
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    ids = torch.randint(0, 16, (1, 40), generator=torch.Generator().manual_seed(1))
    assert rel(_our_logits(model, ids), logits(ref, ids)) <= 1e-5


def test_bf16_keeps_fp32_parameters(base):
    """``dtype=torch.bfloat16``: every tensor bf16 except ``FP32_PARAMETERS`` (the reference's
    ``_keep_in_fp32_modules_strict``: conv1d, dt_bias, A_log, mHC base/scale, router bias), which stay fp32."""
    model = load_hf(base.path, dtype=torch.bfloat16)
    kept = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.is_floating_point():
            continue
        if name.endswith(FP32_PARAMETERS):
            assert t.dtype == torch.float32, name
            assert torch.equal(t, base.ours.state_dict()[name]), name  # loaded without rounding
            kept += 1
        else:
            assert t.dtype == torch.bfloat16, name
    assert kept == 3 * 3 + 3 * 1 + 4 * 4  # KDA: conv1d, dt_bias, A_log; router biases; mHC base/scale
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _our_logits(model, base.ids)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert rel(got, base.want) < 0.05


@pytest.mark.parametrize(
    "over",
    [
        {},
        dict(layer_types="KDDD", indexer_types="FFSF", mlp_layer_types="DSSD", tie_word_embeddings=True),
        dict(attention_bias=True, n_shared_experts=0, index_kpool=1, index_topk=8),
    ],
)
def test_checkpoint_layout_covers_every_tensor_once(over):
    """``checkpoint_layout`` maps checkpoint tensors onto every element of every persistent parameter and buffer
    exactly once (a tied lm_head is not in the checkpoint)."""
    cfg = ModelConfig(num_hidden_layers=4, hidden_size=32, n_routed_experts=4, **over)
    model = HybridLM(cfg)
    hits = {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        hits.pop("lm_head.weight")
    for slot in checkpoint_layout(cfg).values():
        h = hits[slot.name]
        (h if slot.index is None else h[slot.index]).add_(1)
    for k, h in hits.items():
        assert bool((h == 1).all()), k
