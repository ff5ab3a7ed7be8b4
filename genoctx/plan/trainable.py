"""What trains, for the planner (issue 44): ``train.trainable``'s groups, LoRA adapters and the frozen dtype, counted
parameter by parameter from the model's shapes (``HybridLM(cfg)`` on the meta device) and ``genoctx.model.groups``.

A parameter of a group ``train.trainable`` names trains as today: an fp32 master, an fp32 gradient, AdamW state,
reduce-scattered in fp32. Every other parameter is frozen: only its weight is held, in ``frozen_dtype``; no
gradient, no optimizer state, no master, no reduce-scatter. A frozen bf16 weight is still an FSDP2 parameter:
sharded as the trainable ones (dim 0), all-gathered at bf16, offloaded to the host by ``CPUOffloadPolicy`` under
``optimizer_offload``. A frozen parameter of an fp32 island module (``sizes._is_island``) is gathered at its frozen
dtype too (no fp32 master to gather).

``frozen_dtype``:

- ``"bf16"``: 2 bytes per element.
- ``"fp8"``: the published checkpoint's block-scaled e4m3 matmul weights as loaded: 1 byte per element plus one fp32
  ``scale_inv`` (4 bytes) per ``FP8_BLOCK x FP8_BLOCK`` block of each ``[out, in]`` matrix (per expert for the routed
  experts). These are ``genoctx.model.fp8.FP8Weight`` buffers, not parameters, so FSDP2 neither shards nor
  all-gathers them (``genoctx.parallel.build._hold_fp8``): a dense matrix is held whole on every rank, the routed
  experts' ``[E, out, in]`` holders sliced by EP on dim 0 only (``E / ep`` experts per rank, never cut further by the
  expert shard; ``genoctx.parallel.experts.apply_ep``). Each use dequantizes one matrix (a linear's weight, one
  expert's ``[out, in]``) to bf16 and drops it: that is the working set (``memory._split``'s ``fp8_use``). Under
  ``optimizer_offload`` the holders live in pinned host memory and each use copies its fp8 bytes and scales to the
  device first (``genoctx.model.fp8.hold_on_host`` / ``fetch``): in forward, in the recompute and in backward,
  never kept (``memory.fp8_fetches``); without it they are resident on the device. The fp8 tensors (``fp8``): every
  ``nn.Linear`` weight of a decoder
  layer's mixer (``self_attn``, its indexer too) and feed-forward (``mlp``: dense MLP, shared experts), and the routed
  experts' ``gate_up_proj`` / ``down_proj``; the router, norms, mHC, convolutions, gates' vectors, the embedding
  and ``lm_head`` stay bf16 (2 bytes) when frozen.

LoRA (``lora_rank`` r > 0, ``lora`` in ``trainable``): one adapter per target (``lora_targets``, default: the targets
training adapts, ``genoctx.model.lora.DEFAULT_TARGETS``; the routed experts one adapter per expert), ``A [r, in]`` and
``B [out, r]``, ``r (in + out)`` trainable parameters per target (per expert for experts), held in the target's layer
(sharded with it: dense dim 0 over ``dp_shard``, experts over EP and the expert shard). Its FLOPs: ``2 r (in + out)``
per token per target forward, up to twice that backward (``genoctx.plan.flops``); its activations: ``x A^T``, ``r``
values per token per target (per routed row for experts), in the activation dtype.

FLOPs (``genoctx.plan.flops._flow``): what autograd runs. A frozen weight's product computes only its input's
gradient, none before the first tensor that needs a gradient (with ``embed`` frozen, the first layers up to the first
trainable tensor: no backward and no recompute); ``kv_b_proj``'s adapter is merged per call (``W + s B A``).
``tests/plan/test_flops.py`` holds it equal to FlopCounterMode on frozen-subset and LoRA steps.

Not counted: the smaller activations autograd may keep for a frozen matmul (an upper bound); ``kv_b_proj``'s adapter
counts ``r`` activations per token as the others do (it keeps none: an upper bound).
"""

from __future__ import annotations

import dataclasses
import functools
import json

from ..model.config import ModelConfig
from ..model.groups import GROUPS, LORA, group_of, parse_trainable

FROZEN_DTYPES = ("bf16", "fp8")
FP8_BLOCK = 128  # block of the published checkpoint's scale_inv (DeepSeek-V3 / GLM-5 FP8: 128 x 128)
SCALE_BYTES = 4  # fp32 scale_inv element
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class Trainable:
    """``train.trainable``, ``train.lora_rank``, ``train.frozen_dtype`` and ``train.lora_targets`` as the planner takes
    them. ``lora_targets``: None for the default targets (module docstring), or a tuple of name suffixes of target
    modules / expert parameters (``q_proj``, ``o_proj``, ``gate_up_proj``, ...)."""

    spec: str = "all"
    lora_rank: int = 0
    frozen_dtype: str = "bf16"
    lora_targets: tuple[str, ...] | None = None

    @property
    def groups(self) -> tuple[str, ...]:
        return parse_trainable(self.spec)

    @property
    def default(self) -> bool:
        """Full training (``all``, no adapters): the planner's numbers as before issue 44."""
        return self.groups == GROUPS and self.lora_rank == 0

    def to_dict(self) -> dict:
        return {"trainable": ",".join(self.groups) if self.groups != GROUPS else "all", "lora_rank": self.lora_rank,
                "frozen_dtype": self.frozen_dtype,
                "lora_targets": list(self.lora_targets) if self.lora_targets else None}  # fmt: skip


def check_trainable(trainable: str, lora_rank: int, frozen_dtype: str,
                    lora_targets: tuple[str, ...] | None = None) -> Trainable:  # fmt: skip
    """A checked ``Trainable``.

    Raises:
        ValueError: a bad group list (``parse_trainable``), ``lora_rank`` not an integer >= 0, ``lora`` without a
            rank or a rank without ``lora``, an unknown ``frozen_dtype``, an empty ``lora_targets``.
    """
    groups = parse_trainable(trainable)
    if not isinstance(lora_rank, int) or isinstance(lora_rank, bool) or lora_rank < 0:
        raise ValueError(f"lora_rank must be an integer >= 0, got {lora_rank!r}")
    if (LORA in groups) != (lora_rank > 0):
        raise ValueError(f"trainable {trainable!r} with lora_rank {lora_rank}: 'lora' needs lora_rank > 0 and "
                         "lora_rank > 0 needs 'lora' in trainable")  # fmt: skip
    if frozen_dtype not in FROZEN_DTYPES:
        raise ValueError(f"frozen_dtype must be one of {', '.join(FROZEN_DTYPES)}, got {frozen_dtype!r}")
    if lora_targets is not None and not lora_targets:
        raise ValueError("lora_targets: an empty list (None for the default targets)")
    return Trainable(trainable, lora_rank, frozen_dtype, tuple(lora_targets) if lora_targets else None)


@functools.lru_cache(maxsize=8)
def _table(key: str) -> tuple:
    """``(name, shape, matmul)`` of every parameter of ``HybridLM(cfg)`` (meta device); ``matmul``: an ``nn.Linear``
    weight of a layer's ``self_attn`` or ``mlp`` (not the router) or a routed expert's ``gate_up_proj`` /
    ``down_proj``."""
    import torch
    from torch import nn

    from ..model.model import HybridLM

    cfg = ModelConfig.from_dict(json.loads(key))
    with torch.device("meta"):
        model = HybridLM(cfg)
    mods = dict(model.named_modules())
    out = []
    for name, p in model.named_parameters():
        mod, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        parts = name.split(".")
        in_block = len(parts) > 3 and parts[0] == "layers" and parts[2] in ("self_attn", "mlp")
        linear = isinstance(mods.get(mod), nn.Linear) and leaf == "weight" and not mod.endswith("mlp.gate")
        expert = ".mlp.experts." in f".{name}" and leaf in EXPERT_PARAMS
        out.append((name, tuple(p.shape), bool(in_block and (linear or expert))))
    return tuple(out)


def _shape(name: str, shape: tuple, ep_kind: bool) -> tuple:
    """``sizes.shard_numel``'s ``(kind, rows, numel per row, size of dim 1)`` of a tensor."""
    rows = shape[0] if shape else 1
    n = 1
    for s in shape:
        n *= s
    return ("expert" if ep_kind else "dense", rows, n // max(1, rows), shape[1] if len(shape) > 1 else 1)


def _target(name: str, targets: tuple[str, ...] | None) -> bool:
    """Whether matmul weight ``name`` gets an adapter: its module's (or expert parameter's) name ends in one of
    ``targets``, by default ``genoctx.model.lora.DEFAULT_TARGETS`` (what ``apply_lora`` adapts in training)."""
    if targets is None:
        from ..model.lora import DEFAULT_TARGETS

        targets = DEFAULT_TARGETS
    mod = name[: -len(".weight")] if name.endswith(".weight") else name
    return any(mod == t or mod.endswith("." + t) for t in targets)


def param_entries(cfg: ModelConfig, tr: Trainable) -> list[dict]:
    """Every tensor the run holds, the base's and the adapters', as the planner counts it.

    Raises:
        ValueError: ``lora_targets`` that name no target.

    Returns:
        ``[{"name", "layer" (decoder layer index, None for the root), "shape" (``shard_numel``'s tuple),
        "train" (bool: fp32 master, gradient, AdamW state), "store" ([(shape tuple, bytes per element)]: the frozen
        weight and, fp8, its scales; empty when trained), "fp8" (a frozen fp8 matmul weight: an ``FP8Weight`` holder,
        whole or EP-sliced, dequantized per use),
        "lora" (``"mixer"``, ``"mlp"``, ``"experts"`` for an adapter, else None), "in", "out" (an adapter's target
        widths; per expert for experts)}]``, in ``named_parameters`` order with each layer's adapters after its
        parameters.
    """
    groups = set(tr.groups)
    r = tr.lora_rank
    out: list[dict] = []
    for name, shape, matmul in _table(json.dumps(cfg.to_dict(), sort_keys=True)):
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        expert = ".mlp.experts." in f".{name}"
        sh = _shape(name, shape, expert)
        train = group_of(name, cfg.layer_types) in groups
        store: list = []
        fp8 = not train and matmul and tr.frozen_dtype == "fp8"
        if not train:
            store.append((sh, 1 if fp8 else 2))
            if fp8:
                o, i = shape[-2], shape[-1]
                blocks = -(-o // FP8_BLOCK), -(-i // FP8_BLOCK)
                lead = shape[0] if len(shape) == 3 else 1
                scale = (("expert", lead, blocks[0] * blocks[1], blocks[0]) if len(shape) == 3
                         else ("dense", blocks[0], blocks[1], blocks[1]))  # fmt: skip
                store.append((scale, SCALE_BYTES))
        out.append({"name": name, "layer": layer, "shape": sh, "train": train, "store": store, "fp8": fp8,
                    "lora": None, "in": 0, "out": 0})  # fmt: skip
        if r and matmul and _target(name, tr.lora_targets):
            o, i = shape[-2], shape[-1]
            part = "experts" if expert else ("mixer" if name.split(".")[2] == "self_attn" else "mlp")
            base = name[: -len(".weight")] if name.endswith(".weight") else name
            if expert:  # one adapter per expert: A [E, r, in], B [E, out, r]
                a_sh, b_sh = ("expert", shape[0], r * i, r), ("expert", shape[0], o * r, o)
            else:
                a_sh, b_sh = ("dense", r, i, i), ("dense", o, r, r)
            for suffix, s in (("lora_A", a_sh), ("lora_B", b_sh)):
                out.append({"name": f"{base}.{suffix}", "layer": layer, "shape": s, "train": True, "store": [],
                            "fp8": False, "lora": part, "in": i, "out": o})  # fmt: skip
    if r and tr.lora_targets and not any(e["lora"] for e in out):
        raise ValueError(f"lora_targets {','.join(tr.lora_targets)}: no matmul of the mixers, MLPs or experts matches")
    return out


def lora_widths(cfg: ModelConfig, tr: Trainable) -> list[dict]:
    """Per decoder layer, the sum of ``in + out`` over its LoRA targets: ``{"mixer", "mlp", "experts"}`` (experts: of
    one expert's targets, per routed row). All 0 without LoRA."""
    out = [{"mixer": 0, "mlp": 0, "experts": 0} for _ in range(cfg.num_hidden_layers)]
    for e in param_entries(cfg, tr):
        if e["lora"] and e["name"].endswith("lora_A"):
            out[e["layer"]][e["lora"]] += e["in"] + e["out"]
    return out


def counts(cfg: ModelConfig, tr: Trainable) -> dict:
    """Parameters of the run: ``{"params_trainable", "params_frozen", "params_lora", "frozen_bytes"}`` (whole model,
    unsharded; ``params_lora``: the adapters' share of ``params_trainable``; ``frozen_bytes``: the frozen weights and
    scales)."""
    t = f = lo = fb = 0
    for e in param_entries(cfg, tr):
        n = e["shape"][1] * e["shape"][2]
        if e["train"]:
            t += n
            lo += n if e["lora"] else 0
        else:
            f += n
            fb += sum(s[1] * s[2] * b for s, b in e["store"])
    return {"params_trainable": t, "params_frozen": f, "params_lora": lo, "frozen_bytes": fb}
