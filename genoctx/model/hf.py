"""GLM-5.3-Flash checkpoints in the Hugging Face format: names, shards, the VL layout, fp8 blocks; load and export.

A glm5_next checkpoint directory holds ``config.json`` (a ``glm5_next`` VL config with ``text_config``, or a flat
``glm5_next_text`` config) and one or many safetensors files (``model.safetensors``, or shards listed by
``model.safetensors.index.json``: read through it, each tensor from the shard its ``weight_map`` names, anything
else ignored with a warning, a tensor missing from its shard or in two shards an error; ``tensor_files``). Its
tensor names are the published ones (what ``save_pretrained`` of transformers 5.23.0 writes), which transformers
converts on load (``conversion_mapping.py``, "glm5_next"). The same conversions, as one table
(``checkpoint_layout``; docs/checkpoints.md prints it), map each checkpoint tensor to a genoctx parameter or a
slice of one:

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
``w[r, c] = fp8[r, c] * scale_inv[r // b0, c // b1]`` (DeepSeek-V3's ``weight_dequant``: ``fp8.dequant_fp8``).
``load_hf(..., keep_fp8=True)`` instead keeps each weight the checkpoint stores in fp8 as stored, with its scale
blocks, in a ``genoctx.model.fp8.FP8Weight`` holder that the layer dequantizes per use (one device, for now; a
published expert's ``gate_proj`` / ``up_proj`` go into the stacked ``gate_up_proj`` holder, so ``b0`` must divide
``moe_intermediate_size``, as 128 divides 2048).

Loading reads one tensor at a time into a model whose parameters were allocated once (on the meta device, then
``to_empty``): peak memory is the model plus one tensor, never two copies of the model.

Export (``save_hf``) is the same table read backwards: every genoctx tensor goes out under its published name
(stacked experts split per expert, ``conv1d`` into ``q/k/v_conv1d``, ``attn_hc.*`` -> ``hc_attn_*``), under
``model.language_model.``, into shards of at most ``max_shard_bytes`` named as transformers names them. With a base
(the HF directory the model came from) its config, vision tower, MTP layer and tokenizer files are kept; without,
the config is the model's own with a placeholder vision tower (``export_config``). The folder is written under a
temporary sibling name and swapped into place (``_exchange``); peak memory is the model plus one shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import GenoctxError
from .config import DSA, ModelConfig
from .fp8 import SUFFIX, freeze_to_fp8, unfreeze_fp8
from .fp8 import dequant_fp8 as _dequant_fp8
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


_MTP = re.compile(r"^layers\.(\d+)\.|\.shared_head\.")


def _short_name(key: str) -> str:
    """A checkpoint key without its ``model.language_model.`` / ``model.`` prefix."""
    for pre in PREFIXES:
        if key.startswith(pre):
            return key[len(pre) :]
    return key


def not_text_model(key: str, num_hidden_layers: int) -> str | None:
    """``"vision"`` for a vision-tower tensor (``model.visual.*``), ``"mtp"`` for a multi-token-prediction tensor
    (``layers.{i}.*`` with ``i >= num_hidden_layers``, or any ``shared_head``), else None: what ``load_hf`` skips and
    ``save_hf`` carries over from a base, by one rule."""
    if key.startswith(("model.visual.", "visual.")):
        return "vision"
    m = _MTP.search(_short_name(key))
    if m and (m.group(1) is None or int(m.group(1)) >= num_hidden_layers):
        return "mtp"
    return None


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


class _DuplicateKey(ValueError):
    """A key written twice in one JSON object (``_unique_keys``)."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """``json.loads``' ``object_pairs_hook``: the object as a dict; raises ``_DuplicateKey(key)`` on a repeated key."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _index_map(p: Path) -> tuple[Path, dict[str, str]]:
    """``(index path, weight_map)`` of the ``model.safetensors.index.json`` of directory ``p``, checked to be a map of
    tensor names to file names.

    A key written twice in one JSON object (``json`` would keep the last silently: two shards claiming one tensor)
    is refused.

    Raises:
        GenoctxError: an unreadable index, a duplicate key (the index and the key named), or a ``weight_map`` that is
            not ``{name: file name}`` (the index named).
    """
    index = p / "model.safetensors.index.json"
    try:
        weight_map = json.loads(index.read_text(), object_pairs_hook=_unique_keys)["weight_map"]
    except _DuplicateKey as e:
        key = e.args[0]
        raise GenoctxError(f"{index}: key {key!r} appears twice (which one holds the tensor?); keep one") from None
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise GenoctxError(f"{index}: not a safetensors index ({e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise GenoctxError(f"{index}: not a safetensors index (weight_map is not a map of tensor names to files)")
    return index, weight_map


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of an HF model directory, in index order (the files its index lists; any other
    ``.safetensors`` file beside them is not one of them: ``tensor_files``).

    Raises:
        GenoctxError: no weights, an unreadable index, or a shard the index names that is absent.
    """
    p = Path(path)
    if (p / "model.safetensors.index.json").is_file():
        index, weight_map = _index_map(p)
        files = list(dict.fromkeys(weight_map.values()))
        missing = [f for f in files if not (p / f).is_file()]
        if missing:
            raise GenoctxError(f"{index}: shard {missing[0]} is missing from {p}")
        return [p / f for f in files]
    if (p / "model.safetensors").is_file():
        return [p / "model.safetensors"]
    raise GenoctxError(f"{p}: no model.safetensors or model.safetensors.index.json")


_WARNED: set[tuple[str, str]] = set()  # (directory, warning) already logged by this process


def tensor_files(path: str | Path, warn: bool = True) -> dict[str, Path]:
    """Where each tensor of an HF model directory is read from: ``{checkpoint key: file}``, read through the index.

    One ``model.safetensors`` (no index): every tensor of it. With ``model.safetensors.index.json``: each tensor of
    its ``weight_map`` from the shard it names, and nothing else. What the index does not place is ignored, with
    one warning (``warn``; once per directory and process) naming the files: a ``.safetensors`` file the index does
    not list (a stray copy, an old ``model.safetensors``), and a tensor of a listed shard that the ``weight_map``
    does not name. Only safetensors headers are read.

    Raises:
        GenoctxError: one line naming the tensor and the file(s): a tensor missing from the shard the index names
            for it, a tensor present in two shards the index lists; as ``weight_files`` (no weights, a bad index, a
            missing shard); an unreadable safetensors header.
    """
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    files = weight_files(p)

    def keys(f: Path) -> list[str]:
        try:
            with safe_open(str(f), framework="pt") as h:
                return list(h.keys())
        except (SafetensorError, OSError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise GenoctxError(f"{f}: not a readable safetensors file ({first})") from None

    if not (p / "model.safetensors.index.json").is_file():
        return dict.fromkeys(keys(files[0]), files[0])
    index, weight_map = _index_map(p)
    held: dict[str, list[str]] = {}  # tensor -> the listed shards holding it
    for f in files:
        for k in keys(f):
            held.setdefault(k, []).append(f.name)
    for key, names in held.items():
        if len(names) > 1:
            raise GenoctxError(f"{p}: tensor {key} is in two shards, {names[0]} and {names[1]} (the index names "
                               f"{weight_map.get(key, 'neither')}); remove one copy")  # fmt: skip
    for key, name in weight_map.items():
        if name not in held.get(key, ()):
            where = f" (it is in {held[key][0]})" if key in held else ""
            raise GenoctxError(f"{index}: tensor {key} is not in {name}, the shard the index names for it{where}")
    listed = {f.name for f in files}
    ignored = sorted(f.name for f in p.glob("*.safetensors") if f.name not in listed)
    unmapped: dict[str, int] = {}
    for key, names in held.items():
        if key not in weight_map:
            unmapped[names[0]] = unmapped.get(names[0], 0) + 1
    ignored += [f"{n} tensor{'s' * (n > 1)} of {name} (not in the weight_map)" for name, n in sorted(unmapped.items())]
    if ignored and warn:
        line = f"not read, as {index.name} does not place them: {'; '.join(ignored)}"
        if (str(p), line) not in _WARNED:
            _WARNED.add((str(p), line))
            log.warning("%s: %s", p, line)
    return {k: p / weight_map[k] for k in held if k in weight_map}  # file order


def _check_scale(shape: tuple, scale_shape: tuple, block: tuple[int, int], scale_key: str, file: Path) -> None:
    """A weight of ``shape`` needs ``scale_inv`` of ``[*lead, ceil(rows / b0), ceil(cols / b1)]``.

    Raises:
        GenoctxError: it has another shape (named with its file).
    """
    want = (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    if tuple(scale_shape) != want:
        raise GenoctxError(
            f"{file.name}: {scale_key} has shape {tuple(scale_shape)}, expected {want} for {block} blocks"
        )


def block_size(raw: dict) -> tuple[int, int] | None:
    """The fp8 ``weight_block_size`` ``(b0, b1)`` of a raw config.json (top level or ``text_config``), or None."""
    qc = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config") or {}
    return tuple(qc["weight_block_size"]) if qc.get("weight_block_size") else None


def _slot_region(index: tuple | None, shape: tuple) -> tuple[list[tuple[int, int]], list[int]]:
    """The region of a ``Slot`` in its parameter's global coordinates: ``[(start, stop)]`` per dim, and the dims
    that remain in the checkpoint tensor (an integer index drops its dim)."""
    index = index or ()
    region, kept = [], []
    for d, n in enumerate(shape):
        ix = index[d] if d < len(index) else slice(None)
        if isinstance(ix, int):
            region.append((ix, ix + 1))
        else:
            lo, hi, _ = ix.indices(n)
            region.append((lo, hi))
            kept.append(d)
    return region, kept


class SliceReader:
    """safetensors handles for reading boxes of tensors, one per file, that never hold more than ``budget`` bytes.

    A ``safe_open`` handle keeps the memory of every tensor read through it until it is closed (safetensors 0.8:
    200 reads of 4 MB grew the resident set by 800 MB). So a handle is reopened before a read that would take the
    bytes read through it past ``budget`` (``genoctx.parallel.build`` passes the largest checkpoint tensor): what a
    rank holds beyond its own shards stays within one tensor plus the one being read.
    """

    def __init__(self, budget: int):
        self.budget = max(1, int(budget))
        self._open: dict[Path, list] = {}  # file -> [handle, bytes read through it]

    def handle(self, f: Path):
        """The open handle of ``f`` (headers: keys, shapes, dtypes)."""
        from safetensors import safe_open

        if f not in self._open:
            self._open[f] = [safe_open(str(f), framework="pt"), 0]
        return self._open[f][0]

    def nbytes(self, f: Path, key: str, box: tuple[slice, ...] | None = None) -> int:
        """Bytes of ``box`` (None: all) of tensor ``key`` of file ``f``, from its header."""
        sl = self.handle(f).get_slice(key)
        shape = sl.get_shape()
        if box is None:
            n = math.prod(shape)
        else:
            n = math.prod(len(range(*b.indices(d))) for b, d in zip(box, shape, strict=True)) if shape else 1
        return n * _ITEM_BYTES.get(sl.get_dtype(), 8)

    def read(self, f: Path, key: str, box: tuple[slice, ...]) -> torch.Tensor:
        """``box`` (one ``slice`` per dim) of tensor ``key`` of file ``f``: only those bytes are read."""
        nbytes = self.nbytes(f, key, box)
        sl = self.handle(f).get_slice(key)
        if self._open[f][1] and self._open[f][1] + nbytes > self.budget:
            self.close(f)  # frees what earlier reads through it kept
            sl = self.handle(f).get_slice(key)
        self._open[f][1] += nbytes
        return sl[box] if box else sl[...]

    def close(self, f: Path | None = None) -> None:
        for k in [f] if f is not None else list(self._open):
            entry = self._open.pop(k, None)
            if entry is not None:
                entry[0].__exit__(None, None, None)


_ITEM_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
               "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1}  # fmt: skip


def _read_box(reader: SliceReader, f: Path, key: str, box: tuple[slice, ...], scale, block) -> torch.Tensor:
    """``box`` of checkpoint tensor ``key`` (safetensors ``get_slice``: only those bytes are read); an fp8 weight
    is dequantized with the scale blocks that cover the box (``w[r, c] * scale_inv[r // b0, c // b1]``)."""
    t = reader.read(f, key, box)
    if scale is None or t.dtype not in _FP8:
        return t
    b0, b1 = block
    (r0, r1), (c0, c1) = (box[-2].start, box[-2].stop), (box[-1].start, box[-1].stop)
    sbox = (*box[:-2], slice(r0 // b0, -(-r1 // b0)), slice(c0 // b1, -(-c1 // b1)))
    sf, sk = scale
    return _dequant_fp8(t, reader.read(sf, sk, sbox), block, origin=(r0, c0))


def _read_kept_fp8(
    reader: SliceReader, f: Path, key: str, scale, block, region: list, targets: dict, kept: str, dims: list
) -> int:
    """Copy checkpoint tensor ``key`` (fp8) and its scale blocks, as stored, into the holder ``kept``'s
    ``weight`` / ``scale_inv`` at ``region`` (``_slot_region``, ``dims`` the holder dims the checkpoint tensor
    keeps): no dequantization; only the part inside this rank's box (its experts under expert parallelism) is
    read. Returns the bytes read.

    Raises:
        GenoctxError: ``key`` is not stored as the holder's fp8 dtype, the rank's box of the holder is not whole on
            its last two dims (expert parallelism slices only the experts: a rank reads its experts' tensors
            alone, the others are skipped), or ``region`` cuts a scale block (a stacked expert half whose rows
            ``b0`` does not divide).
    """
    w, shape, box = targets[f"{kept}.weight"]
    s, sshape, _ = targets[f"{kept}.scale_inv"]
    stored = reader.handle(f).get_slice(key).get_dtype()
    if scale is None or w.dtype != {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}.get(stored):
        raise GenoctxError(f"{f.name}: {key} is {stored}, not an fp8 weight with a scale to keep as {w.dtype}")
    if [(b.start, b.stop) for b in box[-2:]] != [(0, n) for n in shape[-2:]]:
        raise GenoctxError(f"{f.name}: keeping {key} in fp8 needs whole rows and columns of {kept[: -len(SUFFIX)]} "
                           "on each rank (a holder is sliced only on its experts)")  # fmt: skip
    (b0, b1), (r0, r1), (c0, c1) = block, region[-2], region[-1]
    if r0 % b0 or c0 % b1 or (r1 % b0 and r1 != shape[-2]) or (c1 % b1 and c1 != shape[-1]):
        raise GenoctxError(f"{f.name}: {key} fills rows {r0}:{r1}, columns {c0}:{c1} of {kept[: -len(SUFFIX)]}, "
                           f"which cut its {tuple(block)} fp8 blocks: it cannot be kept in fp8")  # fmt: skip
    # the leading (expert) dims: the part of the region inside this rank's box (EP: its block of [E, ...])
    inter = [(max(lo, b.start), min(hi, b.stop)) for (lo, hi), b in zip(region[:-2], box[:-2], strict=True)]
    if any(hi <= lo for lo, hi in inter):
        return 0  # another rank's experts
    n = len(shape)  # the checkpoint tensor's leading dims are the holder's that the slot keeps (an int index drops)
    src = tuple(slice(inter[d][0] - region[d][0], inter[d][1] - region[d][0]) for d in dims if d < n - 2)
    region = [*((i0 - b.start, i1 - b.start) for (i0, i1), b in zip(inter, box[:-2], strict=True)), region[-2],
              region[-1]]  # fmt: skip
    sregion = [*region[:-2], (r0 // b0, -(-r1 // b0)), (c0 // b1, -(-c1 // b1))]
    t, st = (reader.read(sf, k, (*src, slice(None), slice(None))) for sf, k in ((f, key), scale))
    with torch.no_grad():
        dst = w[tuple(slice(lo, hi) for lo, hi in region)]
        dst.copy_(t.reshape(dst.shape))
        sdst = s[tuple(slice(lo, hi) for lo, hi in sregion)]
        sdst.copy_(st.reshape(sdst.shape))
    return t.numel() + st.numel() * st.element_size()


def read_hf_into(root: str | Path, cfg: ModelConfig, targets: dict, warn: bool = True) -> dict:
    """Fill this rank's pieces of a model from an HF glm5_next directory, reading only the bytes they need.

    Every checkpoint tensor is mapped by ``checkpoint_layout`` to a region of a genoctx tensor (a stacked expert's
    ``gate_up_proj[e, :I]``, rows of the fused ``conv1d``, or a whole tensor); the part of that region inside the
    rank's box is read with safetensors' ``get_slice`` (fp8 weights dequantized with only the scale blocks that
    cover it) and copied into the rank's local tensor. Why not torch's ``HuggingFaceStorageReader`` /
    ``QuantizedHuggingFaceStorageReader``: they load into a state dict keyed by the published names, each value a
    DTensor piece of that published tensor; a rank's piece of one published expert or ``q_conv1d`` tensor is the
    intersection of its FSDP/EP slice of genoctx's grouped ``[E, 2I, D]`` or fused ``[3HK, 1, k]`` tensor with
    that tensor's region, which no placement of the published tensor describes; and their dtype decoding lacks
    ``F8_E8M0`` scales, which safetensors 0.8 reads.

    Args:
        root: the directory (``config.json``, one ``model.safetensors`` or an index of shards).
        cfg: the architecture (the directory's, with any compute knobs).
        targets: ``name -> (local tensor, global shape, box)`` (``genoctx.parallel.state.local_targets``; one
            device: every tensor whole). Parameters and persistent buffers are filled; others are left as they are.
        warn: log what the index leaves out (``tensor_files``); the ranks of a mesh pass False (the driver's
            ``check_hf`` said it once).

    Returns:
        ``{"files": [names], "skipped": {"vision": n, "mtp": n}, "read_bytes": bytes of tensor data read}``.

    Raises:
        GenoctxError: a missing, misshapen or unknown tensor (named with its file), an fp8 weight without its scale
            or with a misshapen one, a ``_scale_inv`` without a quantization config; an index that names a shard
            without the tensor, or a tensor in two shards (``tensor_files``).
    """
    root = Path(root)
    _, raw = read_config(root)
    block = block_size(raw)
    where = tensor_files(root, warn)  # each tensor from the shard the index names (scale_inv may be in another)
    files = weight_files(root)
    layout = checkpoint_layout(cfg)
    reader = SliceReader(budget=1)
    try:
        reader.budget = max((reader.nbytes(f, k) for k, f in where.items()), default=1)  # the largest tensor
        filled: set[tuple[str, str]] = set()
        skipped = {"vision": 0, "mtp": 0}
        read = 0
        for key, f in where.items():
            if key.endswith("_scale_inv"):
                if block is None:
                    raise GenoctxError(f"{f}: {key} but config.json declares no quantization_config.weight_block_size")
                continue
            kind = not_text_model(key, cfg.num_hidden_layers)
            if kind is not None:
                skipped[kind] += 1
                continue
            short = _short_name(key)
            if short == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            slot = layout.get(short)
            if slot is None and short in targets:  # transformers' in-memory names (attn_hc.fn, stacked experts, ...)
                slot = Slot(short)
            holder = f"{slot.name}{SUFFIX}" if slot is not None else ""  # an fp8 holder (load_hf keep_fp8)
            if slot is None or (slot.name not in targets and f"{holder}.weight" not in targets):
                raise GenoctxError(f"{f.name}: unknown tensor {key} (not a glm5_next text-model tensor)")
            local, shape, box = targets[slot.name] if slot.name in targets else targets[f"{holder}.weight"]
            region, kept = _slot_region(slot.index, shape)
            want = tuple(region[d][1] - region[d][0] for d in kept)
            sl = reader.handle(f).get_slice(key)
            got = tuple(sl.get_shape())
            if got != want:
                raise GenoctxError(f"{f.name}: tensor {key} has shape {got}, expected {want} for {root}/config.json")
            scale = None
            if block is not None and sl.get_dtype() in ("F8_E4M3", "F8_E5M2"):
                sk = key + "_scale_inv"
                if sk not in where:
                    raise GenoctxError(f"{f.name}: fp8 tensor {key} has no {sk}")
                _check_scale(got, reader.handle(where[sk]).get_slice(sk).get_shape(), block, sk, where[sk])
                scale = (where[sk], sk)
            filled.add((slot.name, repr(slot.index)))
            if slot.name not in targets:
                read += _read_kept_fp8(reader, f, key, scale, block, region, targets, holder, kept)
                continue
            inter = [(max(r0, b.start), min(r1, b.stop)) for (r0, r1), b in zip(region, box, strict=True)]
            if any(hi <= lo for lo, hi in inter):
                continue  # nothing of this tensor is on this rank
            src = tuple(slice(inter[d][0] - region[d][0], inter[d][1] - region[d][0]) for d in kept)
            t = _read_box(reader, f, key, src, scale, block)
            dst = local[tuple(slice(lo - b.start, hi - b.start) for (lo, hi), b in zip(inter, box, strict=True))]
            with torch.no_grad():
                dst.copy_(t.reshape(dst.shape))
            read += t.numel() * t.element_size()
            del t
    finally:
        reader.close()
    for ck, slot in layout.items():
        if (slot.name, "None") not in filled and (slot.name, repr(slot.index)) not in filled:
            raise GenoctxError(f"{root}: tensor {ck} is missing (searched {', '.join(f.name for f in files)})")
    return {"files": [f.name for f in files], "skipped": skipped, "read_bytes": read}


def log_skipped(root: str | Path, skipped: dict, cfg: ModelConfig) -> None:
    """Say what ``read_hf_into`` skipped (``skipped``: its ``{"vision": n, "mtp": n}``), when anything was."""
    if skipped.get("vision") or skipped.get("mtp"):
        log.info("%s: skipped %d vision-tower tensors (model.visual.*) and %d multi-token-prediction tensors "
                 "(layers.%d.*), as transformers does", root, skipped["vision"], skipped["mtp"],
                 cfg.num_hidden_layers)  # fmt: skip


def check_hf(root: str | Path, cfg: ModelConfig) -> dict:
    """Check, from the safetensors headers alone (no tensor data read), that an HF directory holds every tensor of
    ``cfg`` with its shape (fp8 scales included): what ``read_hf_into`` would find wrong on some rank, found by the
    driver before any worker starts. Returns ``read_hf_into``'s dict (``read_bytes`` 0).

    Raises:
        GenoctxError: as ``read_hf_into`` (a missing, misshapen or unknown tensor, named with its file).
    """
    from .init import whole

    with torch.device("meta"):
        shell = HybridLM(cfg)
    empty = {n: (torch.empty(0), shape, tuple(slice(0, 0) for _ in shape)) for n, (_, shape, _) in whole(shell).items()}
    return read_hf_into(root, cfg, empty)


def hf_dtype(root: str | Path) -> torch.dtype:
    """The dtype an HF directory's weights are held in when none is asked for: ``dtype``/``torch_dtype`` of
    config.json, else bf16 for fp8 checkpoints, else the first stored float tensor's dtype (fp32 if none)."""
    from safetensors import safe_open

    _, raw = read_config(root)
    name = raw.get("dtype") or raw.get("torch_dtype") or (raw.get("text_config") or {}).get("dtype")
    if block_size(raw):
        return torch.bfloat16
    if str(name) in _DTYPES:
        return _DTYPES[str(name)]
    for f in weight_files(root):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                d = _STORED.get(h.get_slice(k).get_dtype())
                if d is not None:
                    return d
    return torch.float32


def fp8_weights(root: str | Path, cfg: ModelConfig) -> list[str]:
    """The genoctx parameters (``checkpoint_layout`` names) that an HF directory stores as block-wise fp8 (every
    checkpoint tensor that fills them is float8 with a ``_scale_inv``), from the safetensors headers alone."""
    from safetensors import safe_open

    layout, where = checkpoint_layout(cfg), tensor_files(root, warn=False)
    fp8, other = set(), set()
    for key, f in where.items():
        if key.endswith("_scale_inv") or not_text_model(key, cfg.num_hidden_layers) is not None:
            continue
        short = _short_name(key)
        name = (layout.get(short) or Slot(short)).name
        with safe_open(str(f), framework="pt") as h:
            is_fp8 = h.get_slice(key).get_dtype() in ("F8_E4M3", "F8_E5M2") and key + "_scale_inv" in where
        (fp8 if is_fp8 else other).add(name)
    return sorted(fp8 - other)


def load_hf(
    path: str | Path, dtype: torch.dtype | None = None, runtime: dict | None = None, keep_fp8: bool = False
) -> HybridLM:
    """Load a glm5_next HF model directory into a one-device ``HybridLM`` (module docstring: names, skips, fp8):
    built on the meta device, allocated once, every tensor read whole by ``read_hf_into`` (the reader every rank of
    a mesh uses for its own slices: ``genoctx.parallel.build``).

    Args:
        path: a directory with ``config.json`` and safetensors weights (one file or an index of shards).
        dtype: parameter dtype; None = the checkpoint's (``hf_dtype``). The fp32 islands (``FP32_PARAMETERS``) stay
            fp32 (fp64 when ``dtype`` is fp64).
        runtime: genoctx compute knobs (``ModelConfig._runtime`` fields: chunk sizes, ``dsa_mode``, ...) to set;
            config.json has none.
        keep_fp8: keep the weights the checkpoint stores as block-wise fp8 as they are, in
            ``genoctx.model.fp8.FP8Weight`` holders (fp8 bytes and fp32 scale blocks, dequantized per use to
            ``dtype``; ``fp8_weights`` names them); False (the default): dequantize them on load.

    Returns:
        ``HybridLM`` on the CPU, in training mode; ``forward`` returns logits over the whole vocabulary. Its
        ``hf_source`` attribute records the directory and what was skipped.

    Raises:
        GenoctxError: a missing, misshapen or unknown tensor (named with its file), an fp8 weight without its
            scale, or a bad config (the message names the file and key); ``keep_fp8`` for a checkpoint with no
            fp8 blocks, or whose fp8 pieces cut the blocks of the tensor they fill.
    """
    from .init import whole

    root = Path(path)
    cfg, raw = read_config(root)
    if runtime:  # genoctx compute knobs (ModelConfig._runtime): not in config.json
        cfg = dataclasses.replace(cfg, **runtime)
    weight_files(root)
    dtype = dtype or hf_dtype(root)
    with torch.device("meta"):
        model = HybridLM(cfg)
    cast_model(model, dtype)
    if keep_fp8:
        if block_size(raw) is None:
            raise GenoctxError(f"{root}/config.json declares no quantization_config.weight_block_size: no fp8 to keep")
        freeze_to_fp8(model, fp8_weights(root, cfg), block_size(raw))  # empty holders on the meta device
    model.materialize("cpu")
    for b in model.buffers():  # router biases are read; load counts start at 0
        b.zero_()
    info = read_hf_into(root, cfg, whole(model))
    log_skipped(root, info["skipped"], cfg)
    model.hf_source = {"path": str(root), "files": info["files"], "skipped": info["skipped"], "dtype": str(dtype)}
    return model


# ---------------------------------------------------------------------------------------------------------------
# Export: a HybridLM back into a directory that transformers' Glm5NextForConditionalGeneration loads
# ---------------------------------------------------------------------------------------------------------------

VL_PREFIX = "model.language_model."
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_DTYPE_NAMES = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
}
# Weight files of other formats, never copied from a base (its safetensors are read tensor by tensor instead).
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth", ".ckpt",
                    ".h5", ".msgpack", ".gguf")  # fmt: skip
# The vision tower of the config written without a base: Glm5NextForConditionalGeneration always builds one, so
# the config must describe one; this is the smallest that transformers builds and runs (one block of width 16).
PLACEHOLDER_VISION = dict(model_type="glm5_next_vision", depth=1, hidden_size=16, num_heads=2, intermediate_size=16,
                          projection_intermediate_size=16)  # fmt: skip
_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12,
          "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_bytes(value: str, flag: str = "--max-shard-size") -> int:
    """A byte count as transformers' ``max_shard_size`` spells it: ``5GB`` (10^9), ``500MB``, ``2GiB`` (2^30),
    ``1.5GB``, ``123`` (bytes).

    Raises:
        GenoctxError: not a size, or below 1 byte (the message names ``flag`` and the value).
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", str(value))
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS:
        raise GenoctxError(f"{flag}: {value!r} is not a size (e.g. 5GB, 500MB, 2GiB or a number of bytes)")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n < 1:
        raise GenoctxError(f"{flag}: {value!r} is less than one byte")
    return n


def _entries(path: Path) -> list[str]:
    """Names in folder ``path`` other than its lock file (empty when ``path`` does not exist)."""
    from ..lock import LOCK_NAME

    try:
        return sorted(p.name for p in path.iterdir() if p.name != LOCK_NAME)
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise GenoctxError(f"{path}: exists and is not a folder; give a folder for the export") from None


def check_export_dir(out: str | Path, force: bool) -> None:
    """Refuse an export into a folder that holds anything (a lock file aside) unless ``force``.

    Raises:
        GenoctxError: ``out`` is a file, or is not empty and ``force`` is False (naming it and ``--force``).
    """
    out = Path(out)
    names = _entries(out)
    if names and not force:
        raise GenoctxError(f"{out} is not empty (holds {names[0]}{' ...' if len(names) > 1 else ''}); pass --force to "
                           "replace it, or choose another --out")  # fmt: skip


def base_config(cfg: ModelConfig, base_dir: str | Path) -> dict:
    """The raw ``config.json`` of the base HF directory ``base_dir``, checked to describe the architecture ``cfg``
    (every field of ``ModelConfig.to_hf_dict``, ``tie_word_embeddings`` included).

    Raises:
        GenoctxError: ``base_dir`` is not an HF model directory, or its config differs (the first differing key is
            named with both values).
    """
    base = Path(base_dir)
    if not is_hf_dir(base):
        raise GenoctxError(f"base {base}: not an HF model directory (config.json and model.safetensors or an index)")
    base_cfg, raw = read_config(base)
    ours, theirs = cfg.to_hf_dict(), base_cfg.to_hf_dict()
    diff = [k for k in ours if theirs.get(k) != ours[k]]
    if diff:
        k = diff[0]
        raise GenoctxError(
            f"base {base}/config.json does not describe this model: {k} is {theirs.get(k)!r} there and {ours[k]!r} "
            f"in the model ({len(diff)} field(s) differ); export without a base (--no-base) or give the right --base"
        )
    return raw


def export_config(cfg: ModelConfig, dtype_name: str, base_raw: dict | None = None) -> dict:
    """The ``config.json`` of an export.

    With ``base_raw`` (a base's config, checked by ``base_config``): that config unchanged except what the new
    weights change: ``dtype`` (and ``torch_dtype`` where present) at the top level and in ``text_config``, and no
    ``quantization_config`` (the export is not fp8). Without: the ``glm5_next`` VL config transformers'
    ``Glm5NextForConditionalGeneration`` loads, ``text_config = cfg.to_hf_dict()`` and the
    ``PLACEHOLDER_VISION`` tower (no weights are written for it: transformers initialises it at random and lists
    its tensors as MISSING when loading; DNA input has no image tokens, so it is never run).
    """
    if base_raw is None:
        text = {**cfg.to_hf_dict(), "dtype": dtype_name}
        return {
            "architectures": ["Glm5NextForConditionalGeneration"],
            "model_type": "glm5_next",
            "dtype": dtype_name,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "text_config": text,
            "vision_config": {**PLACEHOLDER_VISION, "out_hidden_size": cfg.hidden_size},
        }
    raw = json.loads(json.dumps(base_raw))  # a deep copy
    for d in (raw, raw.get("text_config")):
        if not isinstance(d, dict):
            continue
        d.pop("quantization_config", None)
        if d is raw or "dtype" in d or "torch_dtype" in d:
            d["dtype"] = dtype_name
        if "torch_dtype" in d:
            d["torch_dtype"] = dtype_name
    return raw


@dataclass
class _Tensor:
    """One tensor of the export: its checkpoint ``key``, stored ``shape`` and ``dtype``, and ``get()`` that
    materialises it (a contiguous copy of its own)."""

    key: str
    shape: tuple
    dtype: torch.dtype
    get: object  # () -> torch.Tensor

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _model_tensors(model: HybridLM, dtype: torch.dtype | None) -> list[_Tensor]:
    """The text model's tensors under their published names (``checkpoint_layout`` inverted: stacked experts split
    per expert, ``conv1d`` into ``q/k/v_conv1d``, ``attn_hc.fn`` -> ``hc_attn_fn``, ...), VL prefix, in ``dtype``
    (None: as held), the fp32 islands (``FP32_PARAMETERS``) never below fp32, as transformers stores them."""
    from .model import FP32_PARAMETERS

    sd = model.state_dict()
    meta = getattr(sd, "meta", None)  # a lazy state (``LazyState``): shapes known, tensors read when written
    out = []
    for ck, slot in checkpoint_layout(model.cfg).items():
        if meta is None:
            t = sd[slot.name] if slot.index is None else sd[slot.name][slot.index]
            shape, held = tuple(t.shape), t.dtype
        else:
            t, (shape, held) = None, meta(slot.name)
            shape = tuple(shape[1:] if slot.index is not None else shape)

        def get(t=t, n=slot.name, i=slot.index):
            if t is not None:
                return t
            return sd[n] if i is None else sd[n][i]

        want = held
        if dtype is not None and held.is_floating_point:
            want = torch.promote_types(dtype, torch.float32) if slot.name.endswith(FP32_PARAMETERS) else dtype
        key = ck if ck == "lm_head.weight" else VL_PREFIX + ck
        out.append(_Tensor(key, shape, want, lambda g=get, w=want: g().detach().to("cpu", w, copy=True).contiguous()))
    return out


class LazyState:
    """A model known by its config and a state read one tensor at a time (what ``save_hf`` needs of a model): how
    ``genoctx export`` consolidates a sharded checkpoint without holding the whole model.

    Args:
        cfg: the architecture.
        read: ``name -> tensor`` (the one-device names of ``HybridLM.state_dict``), called when a tensor is written.
        meta: ``name -> (shape, dtype)`` of every tensor, known without reading it.
        dtype: the dtype the model is held in (the export's ``keep``).

    The last ``KEEP`` tensors read are kept: a layer's stacked expert tensors (``gate_up_proj``, ``down_proj``) serve
    its experts' published tensors, which alternate between the two.
    """

    KEEP = 2

    def __init__(self, cfg: ModelConfig, read, meta: dict, dtype: torch.dtype):
        self.cfg, self.dtype, self._read, self._meta = cfg, dtype, read, meta
        self._kept: dict[str, torch.Tensor] = {}
        if cfg.tie_word_embeddings and "lm_head.weight" not in meta:
            self._meta = {**meta, "lm_head.weight": meta["embed_tokens.weight"]}

    def state_dict(self):
        return self

    def meta(self, name: str) -> tuple[tuple, torch.dtype]:
        return self._meta[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            name = "embed_tokens.weight"
        if name not in self._kept:
            if len(self._kept) >= self.KEEP:
                self._kept.pop(next(iter(self._kept)))
            self._kept[name] = self._read(name)
        return self._kept[name]


def _carried_tensors(base: Path, cfg: ModelConfig, dtype: torch.dtype) -> tuple[list[_Tensor], dict]:
    """The base's vision-tower and multi-token-prediction tensors (``not_text_model``), stored unchanged; a
    block-fp8 one (base ``quantization_config.weight_block_size``) is dequantized to ``dtype`` (its
    ``_scale_inv`` dropped), as the export carries no quantization config. Returns (tensors, counts)."""
    from safetensors import safe_open

    block = block_size(json.loads((base / "config.json").read_text()))
    where = tensor_files(base)  # through the base's index, as load_hf reads it
    counts = {"vision": 0, "mtp": 0, "dequantized": 0}

    def read(key: str) -> torch.Tensor:
        with safe_open(str(where[key]), framework="pt") as h:
            return h.get_tensor(key)

    def dequantized(key: str) -> torch.Tensor:
        w, sk = read(key), key + "_scale_inv"
        scale = read(sk)
        _check_scale(tuple(w.shape), tuple(scale.shape), block, sk, where[sk])
        return _dequant_fp8(w, scale, block).to(dtype).contiguous()

    out = []
    for key, f in where.items():
        kind = not_text_model(key, cfg.num_hidden_layers)
        if kind is None or (block is not None and key.endswith("_scale_inv")):
            continue
        # a flat base's ``model.layers.N.*`` goes under the VL prefix, like the rest of the export
        name = (
            key if key.startswith((VL_PREFIX, "model.visual.")) or not key.startswith("model.") else VL_PREFIX + key[6:]
        )
        with safe_open(str(f), framework="pt") as h:
            sl = h.get_slice(key)
            shape, stored = tuple(sl.get_shape()), sl.get_dtype()
        if block is not None and stored in ("F8_E4M3", "F8_E5M2"):
            if key + "_scale_inv" not in where:
                raise GenoctxError(f"{f.name}: fp8 tensor {key} has no {key}_scale_inv")
            out.append(_Tensor(name, shape, dtype, lambda k=key: dequantized(k)))
            counts["dequantized"] += 1
        else:
            tdtype = _SAFETENSORS_DTYPES.get(stored)
            if tdtype is None:
                raise GenoctxError(f"{f.name}: tensor {key} has dtype {stored}, which the export cannot carry")
            out.append(_Tensor(name, shape, tdtype, lambda k=key: read(k)))
        counts[kind] += 1
    return out, counts


_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool, **{n: getattr(torch, a) for n, a in (("F8_E4M3", "float8_e4m3fn"),
                       ("F8_E5M2", "float8_e5m2")) if hasattr(torch, a)}}  # fmt: skip


def _plan_shards(tensors: list[_Tensor], max_shard_bytes: int) -> list[list[_Tensor]]:
    """Greedy, in order, as huggingface_hub's ``split_torch_state_dict_into_shards`` (what ``save_pretrained``
    uses): a shard holds at most ``max_shard_bytes`` of tensor data, except a tensor larger than that, which gets a
    shard of its own."""
    shards: list[list[_Tensor]] = []
    cur: list[_Tensor] = []
    size = 0
    for t in tensors:
        if t.nbytes > max_shard_bytes:
            shards.append([t])
            continue
        if cur and size + t.nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    if cur or not shards:
        shards.append(cur)
    return shards


def _write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """One safetensors file (metadata ``format: pt``, which transformers expects)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def _copy_files(base: Path, dst: Path) -> list[str]:
    """Copy the base's non-weight, non-config files (tokenizer, generation config, chat template, ...) into
    ``dst``: regular files at the top level, hidden ones (``.genoctx.lock``, ``.gitattributes``) aside. Returns
    their names; sub-folders are not copied (logged)."""
    import shutil

    copied, skipped_dirs = [], []
    for p in sorted(base.iterdir()):
        if p.name.startswith(".") or p.name == "config.json" or p.name.endswith(_WEIGHT_SUFFIXES):
            continue
        if p.is_dir():
            skipped_dirs.append(p.name)
        elif p.is_file():
            shutil.copy2(p, dst / p.name)
            copied.append(p.name)
    if skipped_dirs:
        log.info("%s: folders not copied: %s", base, ", ".join(skipped_dirs))
    return copied


def _exchange(a: Path, b: Path, atomic: bool = True) -> None:
    """Swap folders ``a`` and ``b`` (afterwards ``b`` holds what ``a`` held, and the reverse): one atomic
    ``renameat2(RENAME_EXCHANGE)`` on Linux, so ``b`` always exists; elsewhere, on a file system without it, or
    with ``atomic=False``, three renames, during which ``b`` is briefly absent."""
    import ctypes
    import errno
    import os

    f = None
    if atomic:
        try:
            f = ctypes.CDLL(None, use_errno=True).renameat2
        except (AttributeError, OSError):
            pass
    if f is not None:
        f.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        at_fdcwd, rename_exchange = -100, 2
        if f(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), str(b))
    side = a.with_name(a.name + ".old")
    os.rename(b, side)
    try:
        os.rename(a, b)
    except BaseException:
        os.rename(side, b)
        raise
    os.rename(side, a)


@contextlib.contextmanager
def export_folder(out: Path, *, force: bool = False, wait: bool = False):
    """Write an export folder atomically: yields an empty temporary sibling folder (``.NAME.export-XXXX``) to fill,
    then swaps it into place as ``out`` (``_exchange``) when the block ends without error. A failed or killed export
    leaves ``out`` as it was (a folder this call created is removed again); temporaries of killed exports are removed
    by the next export. One writer at a time (``genoctx.lock.output_lock``, ``what="export"``); the finished folder
    has no lock file. Used by ``save_hf`` and ``genoctx.model.peft_export.save_peft``.

    Raises:
        GenoctxError: ``out`` not empty without ``force`` (``check_export_dir``), a file, or locked by another writer
            (unless ``wait``).
    """
    import os
    import shutil
    import tempfile

    from ..lock import LOCK_NAME, output_lock, share_like_umask

    out = Path(os.path.abspath(out))
    if out.is_symlink():
        out = out.resolve()
    check_export_dir(out, force)
    existed = out.exists()
    with output_lock(out, wait=wait, what="export") as lock:
        tmp = None
        try:
            check_export_dir(out, force)  # again, now that no other writer can fill it
            for stale in out.parent.iterdir():  # temporaries of killed exports (no live writer: we hold the lock)
                if stale.name.startswith(f".{out.name}.export-") and stale.is_dir() and not stale.is_symlink():
                    shutil.rmtree(stale, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
            with output_lock(tmp, what="export"):  # its lock file becomes out's when the folders are swapped
                yield tmp
                share_like_umask(tmp)  # mkdtemp made it 0700: readable by collaborators, as a plain mkdir would be
                _exchange(tmp, out)  # out: the export (its lock file the one held here); tmp: what out held
                shutil.rmtree(tmp, ignore_errors=True)
                tmp = None
                (out / LOCK_NAME).unlink(missing_ok=True)  # still held until the block ends; waiters re-lock
        except BaseException:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            if lock.created:
                lock.discard()
                if not existed:
                    with contextlib.suppress(OSError):
                        out.rmdir()
            raise


def save_hf(
    model: HybridLM,
    out_dir: str | Path,
    *,
    base_dir: str | Path | None = None,
    max_shard_bytes: int = 5_000_000_000,
    force: bool = False,
    dtype: torch.dtype | None = None,
    wait: bool = False,
) -> dict:
    """Write ``model`` as an HF directory that transformers 5.23.0 ``Glm5NextForConditionalGeneration
    .from_pretrained`` loads (and ``load_hf`` reads back to identical tensors): the published tensor names of
    ``checkpoint_layout`` under ``model.language_model.`` (``lm_head.weight`` unprefixed, omitted when tied),
    ``config.json`` (``export_config``) and, with a base, the base's vision tower, MTP layer and tokenizer files.

    Args:
        model: the model to export (any device; tensors are copied to the CPU one shard at a time), or a
            ``LazyState`` (a sharded checkpoint read one tensor at a time).
        out_dir: the output folder. Written under a temporary sibling name (``.NAME.export-XXXX``) and swapped into
            place at the end (``_exchange``), so a failed or killed export leaves ``out_dir`` as it was (a folder this
            call created is removed again); temporaries of killed exports are removed by the next export. One
            writer at a time (``genoctx.lock.output_lock``, ``what="export"``); the finished folder has no lock file.
        base_dir: the HF directory the model came from. Its ``config.json`` must describe the same architecture
            (``base_config``) and is kept (``export_config``); its vision-tower (``model.visual.*``) and
            multi-token-prediction tensors (``layers.{num_hidden_layers}.*``, ``shared_head``: what ``load_hf``
            skips) are carried over unchanged (fp8 ones dequantized to ``dtype``); its other files (tokenizer,
            ``generation_config.json``, chat template, ...) are copied. None: the model's own config
            (``export_config``), nothing carried.
        max_shard_bytes: most bytes of tensor data per file (as transformers' ``max_shard_size``; a tensor larger
            than that gets a file of its own). One file ``model.safetensors`` when everything fits, else
            ``model-00001-of-0000N.safetensors`` ... and ``model.safetensors.index.json`` (``metadata.total_size``
            in bytes, ``weight_map``).
        force: replace a non-empty ``out_dir`` (default: refuse).
        dtype: stored dtype of the model's tensors (None: as held); the fp32 islands (``FP32_PARAMETERS``) are never
            below fp32, as ``save_pretrained`` stores them. Carried tensors keep theirs. Weights the model holds
            in fp8 (``train.frozen_dtype: fp8``) are dequantized first, in place (``fp8.unfreeze_fp8``).
        wait: if another genoctx process writes ``out_dir``, wait for it (default: raise).

    Returns:
        ``{"out", "files" (names written), "tensors", "bytes" (tensor data), "shards", "dtype", "base",
        "carried": {"vision", "mtp", "dequantized"}, "copied" (base files copied), "config" ("base" | "model")}``.

    Raises:
        GenoctxError: ``out_dir`` not empty without ``force``, a file, or locked by another writer; ``out_dir``
            holds ``base_dir``; a base that is not an HF directory or describes another architecture;
            ``max_shard_bytes`` < 1.
    """
    import os

    if max_shard_bytes < 1:
        raise GenoctxError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    out = Path(os.path.abspath(out_dir))
    if out.is_symlink():
        out = out.resolve()
    base = Path(os.path.abspath(base_dir)) if base_dir is not None else None
    if base is not None and base != out and base.resolve().is_relative_to(out.resolve()):
        raise GenoctxError(f"{out} holds the base {base}: replacing it would delete the base; choose another folder")
    raw = base_config(model.cfg, base) if base is not None else None
    if not isinstance(model, LazyState):
        unfreeze_fp8(model)  # weights held in fp8 (train.frozen_dtype) are written dequantized, as the rest
    held = model.dtype if isinstance(model, LazyState) else model.embed_tokens.weight.dtype
    name = _DTYPE_NAMES.get(dtype or held)
    if name is None:
        raise GenoctxError(f"cannot export dtype {dtype or held}; use bfloat16, float16 or float32")
    config = export_config(model.cfg, name, raw)
    with export_folder(out, force=force, wait=wait) as tmp:
        tensors = _model_tensors(model, dtype)
        counts = {"vision": 0, "mtp": 0, "dequantized": 0}
        copied: list[str] = []
        if base is not None:
            carried, counts = _carried_tensors(base, model.cfg, dtype or held)
            tensors += carried
        shards = _plan_shards(tensors, max_shard_bytes)
        n = len(shards)
        names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for fname, shard in zip(names, shards, strict=True):
            _write_shard(tmp / fname, {t.key: t.get() for t in shard})
        total = sum(t.nbytes for t in tensors)
        if n > 1:
            weight_map = {t.key: f for f, shard in zip(names, shards, strict=True) for t in shard}
            index = {
                "metadata": {"total_parameters": sum(math.prod(t.shape) for t in tensors), "total_size": total},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if base is not None:
            copied = _copy_files(base, tmp)
    if counts["vision"] or counts["mtp"]:
        log.info(
            "%s: carried over %d MTP tensors and %d vision-tower tensors unchanged from %s%s", out, counts["mtp"],
            counts["vision"], base, f" ({counts['dequantized']} fp8 ones dequantized)" if counts["dequantized"] else "",
        )  # fmt: skip
    if base is None:
        log.info("%s: no base: config.json is the model's own, with a placeholder vision tower without weights", out)
    return {
        "out": str(out),
        "files": _entries(out),
        "tensors": len(tensors),
        "bytes": total,
        "shards": n,
        "dtype": name,
        "base": str(base) if base is not None else None,
        "carried": counts,
        "copied": copied,
        "config": "base" if base is not None else "model",
    }
