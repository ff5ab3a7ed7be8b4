"""A LoRA run as a PEFT adapter folder (issue 44): ``adapter_config.json`` + ``adapter_model.safetensors`` that
peft 0.21.2 ``PeftModel.from_pretrained(Glm5NextForConditionalGeneration.from_pretrained(BASE), DIR)`` loads onto
transformers 5.23.0's glm5_next, to the logits of the genoctx model.

The layout is what peft 0.21.2 itself writes for that model (read from ``get_peft_model(...).save_pretrained``;
tests/model/test_peft_export.py holds the two equal, key for key and shape for shape):

- Keys are ``base_model.model.`` + the transformers in-memory name: ``model.language_model.`` + the genoctx name
  (genoctx's module and parameter names are transformers' in-memory ones; ``lm_head`` has no ``model.`` prefix).
- A linear adapter (``LoRALinear`` at path P): ``P.lora_A.weight`` [r, in] and ``P.lora_B.weight`` [out, r].
- Routed-expert adapters (peft's ``target_parameters``, ``lora.ParamWrapper``): ``experts.lora_A.weight`` [E·r, in]
  and ``experts.lora_B.weight`` [out, r·E] in peft's layout (``genoctx.model.lora.to_peft_experts``). peft sorts
  the target parameter names and wraps each in the previous one's wrapper, so with both targets ``down_proj`` is
  the outer wrapper (``experts.lora_*``) and ``gate_up_proj`` the inner one (``experts.base_layer.lora_*``).
- Groups trained whole (``train.trainable`` names besides ``lora``) are peft's ``modules_to_save``: the smallest
  modules owning their parameters (a module whose ancestor is listed is covered by it), named by full path
  (peft matches ``modules_to_save`` entries by string suffix: a leaf name such as ``norm`` would also catch
  ``o_norm``), saved as ``<module>.<tensor>`` with their persistent buffers (the router's
  ``e_score_correction_bias``). An adapter inside a module saved whole is folded into that module's saved weights
  (``W + s B A``): peft never adapts a module it saves whole, and the folded weight is the same function.
- ``target_modules`` is a regular expression (peft full-matches a string) naming exactly the adapted linears of the
  text model (the vision tower is never adapted): per in-layer path, ``\\d+`` where every layer holding it is
  adapted, else the layer numbers.

Refused (``GenoctxError``, exit 2 from the CLI; ``genoctx export --merge`` writes the merged model instead): an
adapted or saved module whose tensors have no transformers counterpart (``genoctx.model.hf.checkpoint_layout``);
``embed`` trained with tied embeddings (peft's copy of the embedding would leave the tied head behind); a frozen
fp8 tensor inside a module saved whole; every adapter folded (nothing left for LoRA to hold).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from ..errors import GenoctxError
from .fp8 import SUFFIX
from .groups import LORA, group_of
from .hf import _DTYPE_NAMES, VL_PREFIX, checkpoint_layout, export_folder
from .lora import LoRALinear, merge_weight, to_peft_experts
from .model import FP32_PARAMETERS
from .moe import Experts

log = logging.getLogger("genoctx")

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_VERSION = "0.21.2"  # the peft whose format this writes (and that the tests load it with)
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def hf_path(name: str) -> str:
    """transformers' in-memory name (``Glm5NextForConditionalGeneration``) of genoctx module or tensor ``name``:
    ``lm_head...`` as is, anything else under ``model.language_model.``."""
    return name if name == "lm_head" or name.startswith("lm_head.") else VL_PREFIX + name


def _within(path: str, roots: list[str]) -> str | None:
    """The entry of ``roots`` that is ``path`` or an ancestor of it, else None."""
    return next((r for r in roots if path == r or path.startswith(r + ".")), None)


def whole_modules(model: torch.nn.Module, groups: set[str]) -> list[str]:
    """The smallest modules holding every parameter of the groups in ``groups`` (genoctx module paths, sorted):
    each such parameter's owner, less those with a listed ancestor. Adapters are not parameters of any group."""
    from .lora import is_lora_name

    owners = set()
    for name, _ in model.named_parameters() if groups else ():
        if not is_lora_name(name) and group_of(name, model.cfg.layer_types) in groups:
            owners.add(name.rsplit(".", 1)[0] if "." in name else "")
    if "" in owners:
        raise GenoctxError("a trained group owns a parameter of the model's root; it cannot be a peft modules_to_save")
    return sorted(o for o in owners if not any(o.startswith(a + ".") for a in owners))


def _merged_state(module: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """``module``'s state dict (persistent buffers included) with every adapter in it folded into its base weight
    (``W + s B A`` in W's dtype promoted to fp32, rounded once, as ``lora.merge_lora``) and the adapters left out."""
    from .lora import is_lora_name

    out = {}
    for k, t in module.state_dict().items():
        if is_lora_name(k):
            continue
        if any(part.endswith(SUFFIX) for part in k.split(".")[:-1]):
            raise GenoctxError(
                f"{prefix}{k}: a frozen fp8 weight inside a module the export saves whole (peft modules_to_save); "
                "export with --merge"
            )
        out[k] = t
    for path, mod in module.named_modules():
        pre = f"{path}." if path else ""
        if isinstance(mod, LoRALinear):
            out[pre + "weight"] = merge_weight(mod.weight, mod.lora_A, mod.lora_B, mod.scaling)
        elif isinstance(mod, Experts) and mod.lora_scale is not None:
            for name in ("gate_up_proj", "down_proj"):
                a = getattr(mod, f"{name}_lora_A", None)
                if a is not None:
                    b = getattr(mod, f"{name}_lora_B")
                    out[pre + name] = merge_weight(getattr(mod, name), a, b, mod.lora_scale)
    return out


def _target_regex(adapted: list[str], all_paths: set[str]) -> str | None:
    """A regular expression that full-matches exactly the transformers names of the genoctx linear paths
    ``adapted``: grouped by in-layer path, ``\\d+`` where every layer of ``all_paths`` (the model's module paths)
    holding that in-layer path is adapted, else the layer numbers. None when ``adapted`` is empty."""
    by_rest: dict[str, set[int]] = {}
    alts = []
    for p in adapted:
        m = _LAYER.match(p)
        if m is None:
            alts.append(re.escape(hf_path(p)))
        else:
            by_rest.setdefault(m.group(2), set()).add(int(m.group(1)))
    for rest, idx in sorted(by_rest.items()):
        every = {int(m.group(1)) for q in all_paths if (m := _LAYER.match(q)) and m.group(2) == rest}
        layers = r"\d+" if idx == every else "(?:" + "|".join(str(i) for i in sorted(idx)) + ")"
        alts.append(f"{re.escape(VL_PREFIX)}layers\\.{layers}\\.{re.escape(rest)}")
    return "|".join(alts) or None


def adapter_config(
    *, rank: int, alpha: float, target_modules: str | None, target_parameters: list[str], modules_to_save: list[str],
    base: str | None, revision: str | None,
) -> dict:  # fmt: skip
    """``adapter_config.json`` as peft 0.21.2's ``LoraConfig.save_pretrained`` writes it for glm5_next (every field,
    peft's defaults where genoctx has no choice: no dropout, no bias, no rsLoRA/DoRA, ``init_lora_weights`` True,
    ``inference_mode`` True, as saved). ``lora_alpha`` an int when whole, as peft writes a user's int."""
    return {
        "alora_invocation_tokens": None,
        "alpha_pattern": {},
        "arrow_config": None,
        "auto_mapping": {
            "base_model_class": "Glm5NextForConditionalGeneration",
            "parent_library": "transformers.models.glm5_next.modeling_glm5_next",
        },
        "base_model_name_or_path": base,
        "bias": "none",
        "corda_config": None,
        "ensure_weight_tying": False,
        "eva_config": None,
        "exclude_modules": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "kasa_config": None,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": int(alpha) if float(alpha).is_integer() else float(alpha),
        "lora_bias": False,
        "lora_dropout": 0.0,
        "lora_ga_config": None,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": modules_to_save or None,
        "monteclora_config": None,
        "peft_type": "LORA",
        "peft_version": PEFT_VERSION,
        "qalora_group_size": 16,
        "r": int(rank),
        "rank_pattern": {},
        "revision": revision,
        "target_modules": target_modules,
        "target_parameters": target_parameters or None,
        "task_type": None,
        "trainable_token_indices": None,
        "use_bdlora": None,
        "use_dora": False,
        "use_qalora": False,
        "use_rslora": False,
        "velora_config": None,
    }


def peft_adapter(
    model: torch.nn.Module, trainable: tuple[str, ...], *, rank: int, alpha: float, dtype: torch.dtype | None = None
) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """The PEFT form of a LoRA model (module docstring).

    Args:
        model: a ``HybridLM`` with adapters (``genoctx.model.lora.apply_lora``), e.g. from
            ``genoctx.train.checkpoint.load_model`` of a LoRA run.
        trainable: ``genoctx.model.groups.parse_trainable`` of the run's ``train.trainable`` (``lora`` among them).
        rank, alpha: ``train.lora_rank`` / ``train.lora_alpha``; must be the model's (``scaling = alpha / rank``).
        dtype: stored dtype of every tensor (None: as held); the fp32 islands (``FP32_PARAMETERS``) never below fp32.

    Returns:
        ``(config fields for adapter_config (without base/revision), {key: CPU tensor}, info)``; ``info`` holds
        ``adapters`` (linear paths), ``experts`` (expert module paths), ``modules_to_save``, ``folded`` (adapters
        inside modules saved whole).

    Raises:
        GenoctxError: the refusals of the module docstring; a rank/alpha that is not the model's.
    """
    cfg = model.cfg
    groups = {g for g in trainable if g != LORA}
    if cfg.tie_word_embeddings and "embed" in groups:
        raise GenoctxError(
            "train.trainable embed with tied embeddings: peft's modules_to_save would copy the embedding and leave the "
            "tied head behind; export with --merge"
        )
    known = {s.name for s in checkpoint_layout(cfg).values()}  # every genoctx tensor that transformers has
    whole = whole_modules(model, groups)
    all_paths = {p for p, _ in model.named_modules()}
    linears, experts, folded = [], [], []
    for path, mod in model.named_modules():
        if isinstance(mod, LoRALinear) or (isinstance(mod, Experts) and mod.lora_scale is not None):
            scale = mod.scaling if isinstance(mod, LoRALinear) else mod.lora_scale
            r = mod.rank if isinstance(mod, LoRALinear) else mod.lora_rank
            if r != rank or abs(scale - alpha / rank) > 1e-12 * max(1.0, abs(scale)):
                raise GenoctxError(
                    f"{path}: adapter of rank {r}, scaling {scale}, but train.lora_rank/lora_alpha say {rank}/{alpha}"
                )
            if _within(path, whole):
                folded.append(path)
            elif isinstance(mod, LoRALinear):
                if path + ".weight" not in known:
                    raise GenoctxError(f"{path}: an adapted module transformers' glm5_next does not have; use --merge")
                linears.append(path)
            else:
                experts.append(path)
    saved = {w: _merged_state(model.get_submodule(w), f"{w}.") for w in whole}
    for w in whole:
        missing = [k for k in saved[w] if f"{w}.{k}" not in known]
        if missing:
            raise GenoctxError(f"{w}.{missing[0]}: trained whole, but transformers' glm5_next has no such tensor; use "
                               "--merge")  # fmt: skip
    if not linears and not experts:
        raise GenoctxError(
            "every adapter lies in a group trained whole (train.trainable): none is left as LoRA; export with --merge"
        )

    def stored(key: str, t: torch.Tensor) -> torch.Tensor:
        want = t.dtype
        if dtype is not None and t.is_floating_point():
            want = torch.promote_types(dtype, torch.float32) if key.endswith(FP32_PARAMETERS) else dtype
        return t.detach().to("cpu", want, copy=True).contiguous()

    tensors: dict[str, torch.Tensor] = {}
    for path in linears:
        mod = model.get_submodule(path)
        tensors[f"{PEFT_PREFIX}{hf_path(path)}.lora_A.weight"] = stored("lora_A", mod.lora_A)
        tensors[f"{PEFT_PREFIX}{hf_path(path)}.lora_B.weight"] = stored("lora_B", mod.lora_B)
    names = sorted({n for p in experts for n in ("gate_up_proj", "down_proj")
                    if getattr(model.get_submodule(p), f"{n}_lora_A", None) is not None})  # fmt: skip
    for path in experts:
        mod = model.get_submodule(path)
        for depth, n in enumerate(names):  # peft: sorted names, each wrapping the previous wrapper's base_layer
            a, b = to_peft_experts(getattr(mod, f"{n}_lora_A"), getattr(mod, f"{n}_lora_B"))
            key = f"{PEFT_PREFIX}{hf_path(path)}." + "base_layer." * depth
            tensors[key + "lora_A.weight"] = stored("lora_A", a)
            tensors[key + "lora_B.weight"] = stored("lora_B", b)
    for w in whole:
        for k, t in saved[w].items():
            tensors[f"{PEFT_PREFIX}{hf_path(f'{w}.{k}')}"] = stored(f"{w}.{k}", t)
    fields = {
        "target_modules": _target_regex(linears, all_paths),
        "target_parameters": [f"experts.{n}" for n in names],
        "modules_to_save": [hf_path(w) for w in whole],
    }
    return fields, tensors, {"adapters": linears, "experts": experts, "modules_to_save": whole, "folded": folded}


def save_peft(
    model: torch.nn.Module,
    out_dir: str | Path,
    trainable: tuple[str, ...],
    *,
    rank: int,
    alpha: float,
    base: str | None = None,
    revision: str | None = None,
    dtype: torch.dtype | None = None,
    force: bool = False,
    wait: bool = False,
) -> dict:
    """Write ``model``'s adapters (and the groups trained whole) as a PEFT adapter folder: ``adapter_config.json``
    (``adapter_config``) and ``adapter_model.safetensors`` (``peft_adapter``), atomically (``hf.export_folder``).

    Args:
        model, trainable, rank, alpha, dtype: as ``peft_adapter``.
        out_dir: the output folder (refused when not empty, unless ``force``).
        base: ``base_model_name_or_path`` (the run's HF base: a hub id or a folder), or None.
        revision: the base's commit, when it came from the hub.
        force, wait: replace a non-empty ``out_dir``; wait for another writer of it.

    Returns:
        ``{"out", "files", "format": "peft", "tensors", "bytes", "dtype", "base", "adapters" (count of linear
        adapters), "expert_adapters" (count of adapted expert modules), "target_parameters", "modules_to_save"
        (count), "folded" (count)}``.

    Raises:
        GenoctxError: as ``peft_adapter`` and ``hf.export_folder``.
    """
    from safetensors.torch import save_file

    fields, tensors, info = peft_adapter(model, trainable, rank=rank, alpha=alpha, dtype=dtype)
    config = adapter_config(rank=rank, alpha=alpha, base=base, revision=revision, **fields)
    held = model.embed_tokens.weight.dtype
    name = _DTYPE_NAMES.get(dtype or held)
    if name is None:
        raise GenoctxError(f"cannot export dtype {dtype or held}; use bfloat16, float16 or float32")
    out = Path(out_dir).absolute()
    with export_folder(out, force=force, wait=wait) as tmp:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if info["folded"]:
        log.info("%d adapter(s) lie in modules trained whole (modules_to_save): folded into their saved weights "
                 "(W + alpha/r B A), e.g. %s", len(info["folded"]), info["folded"][0])  # fmt: skip
    return {
        "out": str(out),
        "files": sorted(p.name for p in out.iterdir() if not p.name.startswith(".")),
        "format": "peft",
        "tensors": len(tensors),
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "dtype": name,
        "base": base,
        "adapters": len(info["adapters"]),
        "expert_adapters": len(info["experts"]),
        "target_parameters": fields["target_parameters"],
        "modules_to_save": len(info["modules_to_save"]),
        "folded": len(info["folded"]),
    }


def base_of_run(init: dict | None) -> tuple[str | None, str | None, str | None]:
    """``(base_model_name_or_path, revision, note)`` of a run from its ``state.json`` ``init`` record
    (``genoctx.train.init``: ``{"source", "path", "revision", "kind", "hf_base"}``): an HF base (``kind`` ``hf``) is
    named as the run named it (a hub id with its commit, or a folder); a genoctx run as the base (``kind``
    ``genoctx``: its weights, not its HF root, are what the adapters were trained on) or no base (a fresh init)
    gives None and a note saying what to load the adapter onto."""
    if isinstance(init, dict) and init.get("kind") == "hf" and init.get("source"):
        return str(init["source"]), init.get("revision"), None
    if isinstance(init, dict) and init.get("kind") == "genoctx":
        return None, None, (f"the run's frozen base is the genoctx run {init.get('source')}: base_model_name_or_path "
                            "is null; export that run (genoctx export) and load the adapter onto it")  # fmt: skip
    return None, None, ("the run has no HF base (a fresh init): base_model_name_or_path is null; the adapter loads "
                        "onto an HF export of the run's step-0 weights (--base DIR names it)")  # fmt: skip
