"""GLM-5.3-Flash checkpoints in the Hugging Face format: names, shards, the VL layout, fp8 blocks; loading.

A glm5_next checkpoint directory holds ``config.json`` (a ``glm5_next`` VL config with ``text_config``, or a flat
``glm5_next_text`` config) and one or many safetensors files (``model.safetensors``, or shards listed by
``model.safetensors.index.json``). Its tensor names are the published ones (what ``save_pretrained`` of
transformers 5.23.0 writes), which transformers converts on load (``conversion_mapping.py``, "glm5_next"). The
same conversions, as one table (``checkpoint_layout``; docs/checkpoints.md prints it), map each checkpoint
tensor to a genoctx parameter or a slice of one:

==========================================================  ==============================================
checkpoint (after ``model.language_model.`` / ``model.``)    genoctx ``HybridLM``
==========================================================  ==============================================
``layers.{i}.hc_attn_{fn,base,scale}``                       ``layers.{i}.attn_hc.{fn,base,scale}``
``layers.{i}.hc_ffn_{fn,base,scale}``                        ``layers.{i}.ffn_hc.{fn,base,scale}``
``layers.{i}.self_attn.{f_a_proj,f_b_proj}.weight``          ``layers.{i}.self_attn.forget_gate.*.weight``
``layers.{i}.self_attn.{dt_bias,A_log}``                     ``layers.{i}.self_attn.forget_gate.*``
``layers.{i}.self_attn.{q,k,v}_conv1d.weight`` [HK, 1, k]    rows 0:HK, HK:2HK, 2HK:3HK of ``self_attn.conv1d.weight``
``layers.{i}.mlp.experts.{e}.gate_proj.weight`` [I, D]       ``layers.{i}.mlp.experts.gate_up_proj[e, :I]``
``layers.{i}.mlp.experts.{e}.up_proj.weight`` [I, D]         ``layers.{i}.mlp.experts.gate_up_proj[e, I:]``
``layers.{i}.mlp.experts.{e}.down_proj.weight`` [D, I]       ``layers.{i}.mlp.experts.down_proj[e]``
every other tensor (``embed_tokens``, ``norm``, norms,       the same name
projections, router, indexer, shared experts), ``lm_head``
==========================================================  ==============================================

transformers' own in-memory names (``attn_hc.fn``, ``forget_gate.*``, ``conv1d.weight``, stacked
``experts.gate_up_proj`` / ``down_proj``) are accepted too. Skipped, and reported on the log: the vision tower
(``model.visual.*``) and the multi-token-prediction layer (``layers.{num_hidden_layers}.*`` and any
``shared_head``), as transformers skips them. Any other tensor is an error, as is a missing or misshapen one.

Block-wise fp8 (``quantization_config.weight_block_size`` ``[b0, b1]`` in ``config.json``): a weight stored as
float8 comes with ``<name>_scale_inv`` ``[ceil(out / b0), ceil(in / b1)]`` and is dequantized on load,
``w[r, c] = fp8[r, c] * scale_inv[r // b0, c // b1]`` (DeepSeek-V3's ``weight_dequant``).

Loading reads one tensor at a time into a model whose parameters were allocated once (on the meta device, then
``to_empty``): peak memory is the model plus one tensor, never two copies of the model.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import GenoctxError
from .config import DSA, ModelConfig
from .model import HybridLM, cast_model

log = logging.getLogger("genoctx")

PREFIXES = ("model.language_model.", "model.")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_STORED = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor goes: genoctx parameter ``name`` (state-dict name), at ``index`` (None = the
    whole tensor; else an index tuple into it)."""

    name: str
    index: tuple | None = None


def checkpoint_layout(cfg: ModelConfig) -> dict[str, Slot]:
    """The published checkpoint name (without the ``model.language_model.`` prefix; ``lm_head.weight`` as is) of
    every tensor of ``HybridLM(cfg)``, with where it goes (``Slot``). One entry per checkpoint tensor; together
    they cover every persistent parameter and buffer exactly once (tested)."""
    out: dict[str, Slot] = {"embed_tokens.weight": Slot("embed_tokens.weight"), "norm.weight": Slot("norm.weight")}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = Slot("lm_head.weight")
    HK = cfg.linear_num_heads * cfg.linear_head_dim
    I = cfg.moe_intermediate_size
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        for part in ("fn", "base", "scale"):
            out[f"{p}hc_attn_{part}"] = Slot(f"{p}attn_hc.{part}")
            out[f"{p}hc_ffn_{part}"] = Slot(f"{p}ffn_hc.{part}")
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + n] = Slot(p + n)
        a = p + "self_attn."
        if cfg.layer_types[i] == DSA:
            names = ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
                     "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"]  # fmt: skip
            if cfg.attention_bias:
                names += ["q_a_proj.bias", "kv_a_proj_with_mqa.bias", "o_proj.bias"]
            if cfg.indexer_types[i] == "full":
                names += [f"indexer.{n}" for n in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias",
                          "weights_proj.weight", "index_kpool_compress_ape", "index_kpool_compress_gate")]  # fmt: skip
            out.update({a + n: Slot(a + n) for n in names})
        else:
            for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "b_proj.weight", "g_a_proj.weight",
                      "g_b_proj.weight", "o_norm.weight", "o_proj.weight"):  # fmt: skip
                out[a + n] = Slot(a + n)
            for n in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
                out[a + n] = Slot(a + "forget_gate." + n)
            for j, c in enumerate("qkv"):
                out[f"{a}{c}_conv1d.weight"] = Slot(a + "conv1d.weight", (slice(j * HK, (j + 1) * HK),))
        m = p + "mlp."
        if cfg.mlp_layer_types[i] == "sparse":
            out[m + "gate.weight"] = Slot(m + "gate.weight")
            out[m + "gate.e_score_correction_bias"] = Slot(m + "gate.e_score_correction_bias")
            for e in range(cfg.n_routed_experts):
                x = f"{m}experts.{e}."
                out[x + "gate_proj.weight"] = Slot(m + "experts.gate_up_proj", (e, slice(0, I)))
                out[x + "up_proj.weight"] = Slot(m + "experts.gate_up_proj", (e, slice(I, 2 * I)))
                out[x + "down_proj.weight"] = Slot(m + "experts.down_proj", (e,))
            if cfg.n_shared_experts > 0:
                for n in ("gate_proj", "up_proj", "down_proj"):
                    out[f"{m}shared_experts.{n}.weight"] = Slot(f"{m}shared_experts.{n}.weight")
        else:
            for n in ("gate_proj", "up_proj", "down_proj"):
                out[f"{m}{n}.weight"] = Slot(f"{m}{n}.weight")
    return out


def read_config(path: str | Path) -> tuple[ModelConfig, dict]:
    """``(ModelConfig, the raw config.json dict)`` of an HF model directory.

    Raises:
        GenoctxError: no or unreadable ``config.json``, or a config that is not glm5_next (the key is named).
    """
    p = Path(path) / "config.json"
    if not p.is_file():
        raise GenoctxError(f"{path}: not an HF model directory (no config.json)")
    try:
        raw = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise GenoctxError(f"{p}: cannot read JSON: {e}") from None
    try:
        return ModelConfig.from_hf_dict(raw), raw
    except (TypeError, ValueError) as e:
        raise GenoctxError(f"{p}: {e.args[0] if e.args else e}") from None


def is_hf_dir(path: str | Path) -> bool:
    """True when ``path`` is a directory with a ``config.json`` and safetensors weights."""
    p = Path(path)
    return (p / "config.json").is_file() and (
        (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file()
    )


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of an HF model directory, in index order.

    Raises:
        GenoctxError: no weights, an unreadable index, or a shard the index names that is absent.
    """
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise GenoctxError(f"{index}: not a safetensors index ({e})") from None
        files = list(dict.fromkeys(weight_map.values()))
        missing = [f for f in files if not (p / f).is_file()]
        if missing:
            raise GenoctxError(f"{index}: shard {missing[0]} is missing from {p}")
        return [p / f for f in files]
    if (p / "model.safetensors").is_file():
        return [p / "model.safetensors"]
    raise GenoctxError(f"{p}: no model.safetensors or model.safetensors.index.json")


def _dequant_fp8(
    w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str, file: Path
) -> torch.Tensor:
    """Block-wise fp8 -> fp32: ``w[r, c] * scale_inv[r // b0, c // b1]`` (2-D weights)."""
    b0, b1 = block
    rows, cols = w.shape[-2:]
    want = (math.ceil(rows / b0), math.ceil(cols / b1))
    if tuple(scale_inv.shape[-2:]) != want:
        raise GenoctxError(
            f"{file}: {name}_scale_inv has shape {tuple(scale_inv.shape)}, expected {want} for {block} blocks"
        )
    s = scale_inv.float().repeat_interleave(b0, -2)[..., :rows, :].repeat_interleave(b1, -1)[..., :cols]
    return w.float() * s


def load_hf(path: str | Path, dtype: torch.dtype | None = None) -> HybridLM:
    """Load a glm5_next HF model directory into a ``HybridLM`` (module docstring: names, skips, fp8).

    Args:
        path: a directory with ``config.json`` and safetensors weights (one file or an index of shards).
        dtype: parameter dtype; None = the checkpoint's (``dtype``/``torch_dtype`` of config.json, else the stored
            dtype; bf16 for fp8 checkpoints). The fp32 islands (``FP32_PARAMETERS``) stay fp32 (fp64 when
            ``dtype`` is fp64).

    Returns:
        ``HybridLM`` on the CPU, in training mode; ``forward`` returns logits over the whole vocabulary. Its
        ``hf_source`` attribute records the directory and what was skipped.

    Raises:
        GenoctxError: a missing, misshapen or unknown tensor (named with its file), an fp8 weight without its
            scale, or a bad config (the message names the file and key).
    """
    root = Path(path)
    cfg, raw = read_config(root)
    files = weight_files(root)
    qc = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config") or {}
    block = tuple(qc["weight_block_size"]) if qc.get("weight_block_size") else None
    if dtype is None:
        name = raw.get("dtype") or raw.get("torch_dtype") or (raw.get("text_config") or {}).get("dtype")
        dtype = torch.bfloat16 if block else _DTYPES.get(str(name), None)
    layout = checkpoint_layout(cfg)
    with torch.device("meta"):
        model = HybridLM(cfg)
    from safetensors import safe_open

    handles = {}
    try:
        for f in files:
            handles[f] = safe_open(str(f), framework="pt")
        if dtype is None:  # the config does not say: the first stored float tensor's dtype
            stored = (_STORED.get(h.get_slice(k).get_dtype()) for h in handles.values() for k in h.keys())
            dtype = next((d for d in stored if d is not None), torch.float32)
        cast_model(model, dtype)
        model.to_empty(device="cpu")
        params = dict(model.named_parameters())
        params.update(dict(model.named_buffers()))
        # transformers' in-memory names (attn_hc.fn, forget_gate.*, conv1d.weight, stacked experts) are genoctx's
        persistent = set(model.state_dict().keys())
        for name, b in model.named_buffers():
            if name not in persistent:
                b.zero_()
        where = {}  # scale_inv lookups may cross shards
        for f, h in handles.items():
            for k in h.keys():
                where[k] = f
        filled: set[tuple[str, str]] = set()  # (parameter, repr(index)); index None: loaded whole
        skipped = {"vision": 0, "mtp": 0}
        mtp = re.compile(r"^layers\.(\d+)\.|\.shared_head\.")
        for key, f in where.items():
            if key.endswith("_scale_inv"):
                if block is None:
                    raise GenoctxError(f"{f}: {key} but config.json declares no quantization_config.weight_block_size")
                continue
            if key.startswith("model.visual.") or key.startswith("visual."):
                skipped["vision"] += 1
                continue
            short = key
            for pre in PREFIXES:
                if key.startswith(pre):
                    short = key[len(pre) :]
                    break
            m = mtp.search(short)
            if m and (m.group(1) is None or int(m.group(1)) >= cfg.num_hidden_layers):
                skipped["mtp"] += 1
                continue
            if short == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            slot = layout.get(short)
            if slot is None and short in persistent:
                slot = Slot(short)
            if slot is None:
                raise GenoctxError(f"{f.name}: unknown tensor {key} (not a glm5_next text-model tensor)")
            t = handles[f].get_tensor(key)
            if block is not None and t.dtype in _FP8:
                sk = key + "_scale_inv"
                if sk not in where:
                    raise GenoctxError(f"{f.name}: fp8 tensor {key} has no {sk}")
                t = _dequant_fp8(t, handles[where[sk]].get_tensor(sk), block, key, where[sk])
            dest = params[slot.name]
            view = dest if slot.index is None else dest[slot.index]
            if tuple(t.shape) != tuple(view.shape):
                raise GenoctxError(
                    f"{f.name}: tensor {key} has shape {tuple(t.shape)}, expected {tuple(view.shape)} "
                    f"for {root}/config.json"
                )
            with torch.no_grad():
                view.copy_(t)
            filled.add((slot.name, repr(slot.index)))
            del t
    finally:
        handles.clear()
    for ck, slot in layout.items():
        if (slot.name, "None") not in filled and (slot.name, repr(slot.index)) not in filled:
            raise GenoctxError(f"{root}: tensor {ck} is missing (searched {', '.join(f.name for f in files)})")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if skipped["vision"] or skipped["mtp"]:
        log.info(
            "%s: skipped %d vision-tower tensors (model.visual.*) and %d multi-token-prediction tensors "
            "(layers.%d.*), as transformers does", root, skipped["vision"], skipped["mtp"], cfg.num_hidden_layers,
        )  # fmt: skip
    model.hf_source = {"path": str(root), "files": [f.name for f in files], "skipped": skipped, "dtype": str(dtype)}
    return model
