"""LoRA adapters for GLM-5.3-Flash (issue 44): exact low-rank updates of chosen projections and the routed experts.

For a weight ``W [out, in]`` an adapter adds ``ΔW = s · B A`` with ``A [r, in]``, ``B [out, r]`` and
``s = alpha / r`` (Hu et al. 2021; PEFT's default scaling, no rsLoRA, no dropout). The adapted projection runs

    y = x W^T + s · (x A^T) B^T                                  (never forming ΔW; equal to x (W + s B A)^T)

Design choices:

- Targets are named by module leaf names, as PEFT's ``target_modules``: every ``nn.Linear`` whose last name is in
  ``targets`` (``q_proj``, ``kv_b_proj``, ``down_proj``, ...) becomes a ``LoRALinear``, an ``nn.Linear`` that keeps
  the same ``weight``/``bias`` parameters (same names: checkpoints, groups and the HF map still see ``*.weight``)
  and adds ``lora_A`` [r, in] and ``lora_B`` [out, r]. The routed experts are named as PEFT's
  ``target_parameters``: ``experts.gate_up_proj`` and ``experts.down_proj``.
- Routed experts (``moe.Experts``, ``gate_up_proj`` [E, 2I, D], ``down_proj`` [E, D, I]): one adapter per expert,
  stored expert-first, ``gate_up_proj_lora_A`` [E, r, D], ``gate_up_proj_lora_B`` [E, 2I, r], ``down_proj_lora_A``
  [E, r, I], ``down_proj_lora_B`` [E, D, r], run inside the grouped dispatch (``Experts.adapter(e)`` hands expert
  e's slices to ``moe.expert_mlp``, which adds the low-rank term on that expert's rows). Expert-first so that
  expert parallelism and FSDP shard them on dim 0 like the base weights (``genoctx.parallel.experts.apply_ep`` splits
  them with the experts; its autograd Function runs them and returns their gradients).
- PEFT's layout of the same adapters (peft 0.21 ``ParamWrapper``, ``tuners/lora/layer.py``): for a 3-D parameter
  ``[E, s1, s2]`` on a module without ``is_transposed`` (transformers' ``Glm5NextTextExperts`` has none: its
  ``F.linear(x, gate_up_proj[e])`` reads ``[E, out, in]``) peft swaps in/out to ``in = s2``, ``out = s1`` and holds
  ``lora_A.weight = nn.Linear(in, r·E).weight`` [r·E, in] and ``lora_B.weight = nn.Linear(r·E, out).weight``
  [out, r·E], with ``ΔW = scaling · einsum("o r e, e r i -> e o i", B.reshape(out, r, E), A.reshape(E, r, in))``:
  A's rows are expert-major (row ``e·r + j``), B's columns expert-minor (column ``j·E + e``). ``to_peft_experts`` /
  ``from_peft_experts`` convert (a reshape and a permute; the test holds them to peft's einsum). Not stored in
  peft's layout because B's experts interleave along its columns: no contiguous per-expert slice, no dim-0 shard.
- Init as PEFT (``init_lora_weights=True``): A kaiming-uniform(a=√5) with fan-in ``in`` (bound ``1/√in``; for the
  experts drawn on the ``[E·r, in]`` view, as peft's ``nn.Linear(in, r·E)``), B zeros: a fresh model's output is
  unchanged (bit for bit up to the sign of a zero).
- ``kv_b_proj`` is read by DSA as a weight (the absorbed MLA ``W_UK``/``W_UV``), not called: ``LoRALinear``
  offers ``merged_weight()`` (``W + s B A`` with autograd to A, B and W) and ``DSA.absorbed`` uses it when present.
- The slow reference is the merged formulation itself: ``merged_parameters`` gives ``W + s B A`` for every adapted
  weight, differentiable, to run through ``functional_call`` on the merged model (tests/model/test_lora.py).
- ``merge_lora`` folds every adapter into its base weight (export, ``--merge``); ``lora_parameters`` lists the
  adapters by name (checkpoints); ``is_lora_name`` tells an adapter's parameter name (suffix ``lora_A``/``lora_B``).

Apply on a built model (real or meta device) before parallelism and before the optimizer is made. Meta-device
adapters are drawn by ``reset_lora(model, seed)`` after ``to_empty`` (``genoctx.parallel.build.build_model``'s
``lora``: applied on meta, each rank keeping its piece of the one-process draws, ``reset_lora(..., targets)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .fp8 import attach_fp8, fp8_linear, held, unfreeze_fp8
from .moe import Experts

# The projections adapted by default: every attention projection of KDA (q/k/v/o) and of DSA's MLA, the dense and
# shared-expert MLPs and the routed experts. Not the indexer (it learns from its own KL), the router, the KDA gates,
# the embeddings or the head (train those whole with ``train.trainable`` groups).
DEFAULT_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "experts.gate_up_proj",
    "experts.down_proj",
)
EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")
LORA_SUFFIXES = ("lora_A", "lora_B")


@dataclass(frozen=True)
class LoRASpec:
    """The adapters to build (``apply_lora``'s arguments): rank r >= 1, alpha (scaling ``alpha / r``), targets (leaf
    names, a comma string or a sequence) and the seed of A's draws (``train.seed``; None: torch's generator)."""

    rank: int
    alpha: float
    targets: str | tuple[str, ...] = DEFAULT_TARGETS
    seed: int | None = None


def is_lora_name(name: str) -> bool:
    """Whether parameter ``name`` (``named_parameters()`` form) is a LoRA adapter: its last part ends in
    ``lora_A`` or ``lora_B`` (``...q_proj.lora_A``, ``...experts.gate_up_proj_lora_B``)."""
    return name.rsplit(".", 1)[-1].endswith(LORA_SUFFIXES)


def _kaiming_(t: torch.Tensor, fan_in: int, generator: torch.Generator | None) -> None:
    """PEFT's A init in place: kaiming-uniform(a=√5) for fan-in ``fan_in`` (uniform in ±1/√fan_in), on the [-1, fan_in]
    view (an [E, r, in] stack draws as peft's [E·r, in] ``nn.Linear`` weight). Drawn on the CPU in ``t``'s dtype (the
    generator is a CPU one) and copied: the same values on every device."""
    if t.device.type == "meta":
        return
    if t.device.type == "cpu" and t.is_contiguous():
        nn.init.kaiming_uniform_(t.view(-1, fan_in), a=math.sqrt(5), generator=generator)
        return
    cpu = torch.empty(t.shape, dtype=t.dtype)
    nn.init.kaiming_uniform_(cpu.view(-1, fan_in), a=math.sqrt(5), generator=generator)
    t.copy_(cpu)


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a LoRA adapter: ``y = x W^T + b + scaling · (x A^T) B^T``.

    Parameters: ``weight`` [out, in] and ``bias`` (the base's own parameter objects), ``lora_A`` [r, in] and
    ``lora_B`` [out, r] (the base's dtype and device). ``scaling = alpha / rank``.
    """

    @classmethod
    def from_linear(cls, base: nn.Linear, rank: int, alpha: float, generator=None) -> LoRALinear:
        """Wrap ``base`` (sharing its parameters) with fresh adapters: A kaiming-uniform(a=√5), B zeros."""
        m = cls(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        h = held(base, "weight")
        if h is None:
            m.weight, m.bias = base.weight, base.bias
            w = base.weight
        else:  # a frozen fp8 weight: the same holder, read by fp8_linear / merged_weight (genoctx.model.fp8)
            m.bias = base.bias
            attach_fp8(m, "weight", h)
            w = h.weight.new_empty(0, dtype=h.dtype)  # (the adapters' dtype and device)
        m.rank, m.scaling = int(rank), float(alpha) / int(rank)
        m.lora_A = nn.Parameter(torch.zeros(rank, base.in_features, dtype=w.dtype, device=w.device))
        m.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=w.dtype, device=w.device))
        m.reset_lora(generator)
        return m

    def reset_lora(self, generator=None) -> None:
        """Draw A (kaiming-uniform, a=√5, fan-in ``in``) and zero B, as PEFT."""
        with torch.no_grad():
            _kaiming_(self.lora_A, self.in_features, generator)
            self.lora_B.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype (or autocast's). A base weight kept in fp8 (``genoctx.model.fp8``)
        runs through ``fp8_linear`` (dequantized per use, never kept)."""
        h = held(self, "weight")
        y = F.linear(x, self.weight, self.bias) if h is None else fp8_linear(x, h, self.bias)
        return y + self.scaling * F.linear(F.linear(x, self.lora_A), self.lora_B)

    def merged_weight(self) -> torch.Tensor:
        """``W + scaling · B A`` [out, in] in W's dtype, differentiable in W, A and B (for a caller that reads the
        weight instead of calling the layer, e.g. DSA's absorbed ``kv_b_proj``); an fp8 base weight is dequantized
        first (this call's copy only)."""
        w = self.weight
        return w + self.scaling * (self.lora_B @ self.lora_A).to(w.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling}"


def _add_expert_adapters(ex: Experts, which: list[str], rank: int, alpha: float, generator) -> None:
    """Register ``{name}_lora_A`` [E, r, in] and ``{name}_lora_B`` [E, out, r] for each ``name`` in ``which``
    (``gate_up_proj``, ``down_proj``) and set ``ex.lora_scale``."""
    for name in which:
        h = held(ex, name)  # an fp8 holder is not dequantized here
        w = getattr(ex, name) if h is None else h.weight  # [E, out, in]
        E, out, inp = w.shape
        dtype = w.dtype if h is None else h.dtype  # (the dtype the weight computes in)
        a = nn.Parameter(torch.zeros(E, rank, inp, dtype=dtype, device=w.device))
        b = nn.Parameter(torch.zeros(E, out, rank, dtype=dtype, device=w.device))
        with torch.no_grad():
            _kaiming_(a, inp, generator)
        setattr(ex, f"{name}_lora_A", a)
        setattr(ex, f"{name}_lora_B", b)
    ex.lora_scale = float(alpha) / int(rank)
    ex.lora_rank = int(rank)


def apply_lora(
    model: nn.Module, rank: int, alpha: float, targets=DEFAULT_TARGETS, seed: int | None = None
) -> list[str]:
    """Add LoRA adapters to ``model`` in place (module docstring).

    Args:
        model: a ``HybridLM`` (or any module holding its layers), without adapters yet.
        rank: r >= 1.
        alpha: the scaling numerator (``scaling = alpha / rank``).
        targets: leaf names of ``nn.Linear`` modules and/or ``EXPERT_TARGETS`` (a string is split at commas).
        seed: seeds the draws of A (a local generator); None draws from torch's global generator.

    Returns:
        The adapted names, in module order: module paths for linears, ``<experts path>.gate_up_proj`` /
        ``.down_proj`` for the experts.

    Raises:
        ValueError: rank < 1; a target that matches nothing in the model; a model that already has adapters; a
            target linear whose weight is shared with another module (a tied ``lm_head``).
    """
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    targets = list(dict.fromkeys(targets))
    if int(rank) != rank or rank < 1:
        raise ValueError(f"apply_lora: rank must be an integer >= 1, got {rank!r}")
    if any(is_lora_name(n) for n, _ in model.named_parameters()):
        raise ValueError("apply_lora: the model already has LoRA adapters")
    generator = torch.Generator().manual_seed(int(seed)) if seed is not None else None
    linear_t = {t for t in targets if t not in EXPERT_TARGETS}
    expert_t = [t.split(".", 1)[1] for t in EXPERT_TARGETS if t in targets]
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    found, adapted = set(), []
    for path, mod in list(model.named_modules()):
        leaf = path.rsplit(".", 1)[-1]
        if isinstance(mod, Experts) and expert_t:
            if hasattr(mod, "ep_size"):
                raise ValueError("apply_lora: apply adapters before expert parallelism")
            _add_expert_adapters(mod, expert_t, int(rank), alpha, generator)
            found.update(f"experts.{n}" for n in expert_t)
            adapted += [f"{path}.{n}" for n in expert_t]
        elif (type(mod) is nn.Linear or getattr(type(mod), "_fp8_base", None) is nn.Linear) and leaf in linear_t:
            if held(mod, "weight") is None and uses[id(mod.weight)] > 1:
                raise ValueError(f"apply_lora: {path}.weight is shared with another module (tied); not adapted")
            parent = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model
            setattr(parent, leaf, LoRALinear.from_linear(mod, int(rank), alpha, generator))
            found.add(leaf)
            adapted.append(path)
    missing = [t for t in targets if t not in found]
    if missing:
        raise ValueError(
            f"apply_lora: targets {missing} match no nn.Linear leaf name or experts parameter in the model"
        )
    return adapted


def adapter_draws(model: nn.Module) -> list[tuple[str, str, int]]:
    """Every adapter of ``model`` as ``(parameter name, "kaiming" | "zeros", fan-in)``, in the order ``apply_lora``
    draws them (module order; a linear's ``lora_A`` then ``lora_B``; an ``Experts``' ``gate_up_proj`` pair, then
    ``down_proj``'s). Names are ``named_parameters()`` names (the one-device names on a parallelized model too)."""
    out = []
    for path, mod in model.named_modules():
        pre = f"{path}." if path else ""
        if isinstance(mod, LoRALinear):
            out += [(pre + "lora_A", "kaiming", mod.in_features), (pre + "lora_B", "zeros", 0)]
        elif isinstance(mod, Experts) and mod.lora_scale is not None:
            for name in ("gate_up_proj", "down_proj"):
                a = getattr(mod, f"{name}_lora_A", None)
                if a is not None:
                    out += [(f"{pre}{name}_lora_A", "kaiming", a.shape[-1]), (f"{pre}{name}_lora_B", "zeros", 0)]
    return out


def reset_lora(model: nn.Module, seed: int | None = None, targets: dict | None = None) -> None:
    """Redraw every adapter of ``model`` as ``apply_lora`` does (A kaiming-uniform, B zeros), e.g. after
    ``to_empty`` of a meta-device model.

    Args:
        model: a model with adapters (plain, or parallelized: FSDP2 shards, an expert-parallel block of experts).
        seed: seeds the generator of the A draws, as ``apply_lora``'s ``seed`` (None: torch's global generator).
        targets: None redraws each adapter whole. On a mesh, ``genoctx.parallel.state.local_targets``'s map
            (one-device name -> (this rank's local tensor, global shape, box)): every rank draws each A whole, in
            ``apply_lora``'s order on the CPU, and keeps its box, so that the adapters equal one process's for the
            same seed under every layout (cost: each rank draws every A once, r x in values per linear and E x r x in
            per expert stack, one tensor at a time).

    Raises:
        KeyError: ``targets`` lacks an adapter of ``model``.
    """
    generator = torch.Generator().manual_seed(int(seed)) if seed is not None else None
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, kind, fan_in in adapter_draws(model):
            if targets is None:
                local, box = params[name].data, None
                shape = tuple(local.shape)
            else:
                local, shape, box = targets[name]
            if kind == "zeros":
                local.zero_()
                continue
            full = torch.empty(shape, dtype=local.dtype)
            _kaiming_(full, fan_in, generator)
            local.copy_(full if box is None else full[box])


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapters of ``model`` by ``named_parameters()`` name (``is_lora_name``), in module order (for
    checkpoints and the optimizer)."""
    return {n: p for n, p in model.named_parameters() if is_lora_name(n)}


def expert_delta(a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``scale · B_e A_e`` for every expert: a [E, r, in], b [E, out, r] -> [E, out, in] in ``dtype`` (computed in
    ``dtype`` promoted to at least fp32)."""
    ct = torch.promote_types(dtype, torch.float32)
    return (torch.bmm(b.to(ct), a.to(ct)) * scale).to(dtype)


def merge_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale · B A``, the one merge of an adapter into its weight (``merge_lora``, the PEFT export's folded
    modules, ``--init`` of a LoRA run box by box, ``export --merge`` of a sharded run): w ``[out, in]`` with a
    ``[r, in]``, b ``[out, r]``, or the experts' w ``[E, out, in]`` with a ``[E, r, in]``, b ``[E, out, r]`` (a box of
    them alike). The sum is taken in W's dtype promoted to at least fp32, on W's device, rounded once to W's dtype."""
    ct = torch.promote_types(w.dtype, torch.float32)
    return (w.to(ct) + scale * (b.to(w.device, ct) @ a.to(w.device, ct))).to(w.dtype)


def merged_parameters(model: nn.Module, params: dict | None = None) -> dict[str, torch.Tensor]:
    """The slow reference of the adapters: ``{base weight name: W + s B A}`` for every adapted weight (linears
    [out, in], experts [E, out, in] with ``B_e A_e`` per expert), built by autograd-tracked ops from ``params``
    (``named_parameters()`` name -> tensor; default the model's own), so that ``torch.func.functional_call`` of the
    merged model (``merge_lora`` of a copy) with these weights is the merged formulation, forward and backward."""
    params = dict(model.named_parameters()) if params is None else params
    out = {}
    for path, mod in model.named_modules():
        pre = f"{path}." if path else ""
        if isinstance(mod, LoRALinear):
            W, A, B = params[pre + "weight"], params[pre + "lora_A"], params[pre + "lora_B"]
            out[pre + "weight"] = W + mod.scaling * (B @ A)
        elif isinstance(mod, Experts) and mod.lora_scale is not None:
            for name in ("gate_up_proj", "down_proj"):
                if f"{pre}{name}_lora_A" in params:
                    A, B = params[f"{pre}{name}_lora_A"], params[f"{pre}{name}_lora_B"]
                    out[pre + name] = params[pre + name] + mod.lora_scale * torch.bmm(B, A)
    return out


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight, in place, and remove the adapters: each ``LoRALinear`` becomes an
    ``nn.Linear`` holding ``W + s B A`` (the same ``weight`` parameter object, its data replaced), each adapted
    ``Experts`` holds ``W_e + s B_e A_e``. The sum is taken in W's dtype promoted to fp32, then rounded once to W's
    dtype. Weights kept in fp8 (``genoctx.model.fp8``) are first dequantized into plain parameters
    (``unfreeze_fp8``). Returns ``model`` (deep-copy it first to keep the adapters)."""
    unfreeze_fp8(model)
    for path, mod in list(model.named_modules()):
        if isinstance(mod, LoRALinear):
            mod.weight.copy_(merge_weight(mod.weight, mod.lora_A, mod.lora_B, mod.scaling))
            lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
            lin.weight, lin.bias = mod.weight, mod.bias
            parent = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model
            setattr(parent, path.rsplit(".", 1)[-1], lin)
        elif isinstance(mod, Experts) and mod.lora_scale is not None:
            for name in ("gate_up_proj", "down_proj"):
                a = getattr(mod, f"{name}_lora_A", None)
                if a is None:
                    continue
                w = getattr(mod, name)
                w.copy_(merge_weight(w, a, getattr(mod, f"{name}_lora_B"), mod.lora_scale))
                delattr(mod, f"{name}_lora_A")
                delattr(mod, f"{name}_lora_B")
            mod.lora_scale = None
    return model


def to_peft_experts(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """genoctx's expert adapters -> peft 0.21 ``ParamWrapper``'s ``lora_A.weight`` / ``lora_B.weight`` (module
    docstring): a [E, r, in] -> [E·r, in] (row ``e·r + j``), b [E, out, r] -> [out, r·E] (column ``j·E + e``).
    Contiguous copies, same dtype."""
    E, r, inp = a.shape
    return a.reshape(E * r, inp).contiguous(), b.permute(1, 2, 0).reshape(b.shape[1], r * E).contiguous()


def from_peft_experts(a: torch.Tensor, b: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``to_peft_experts``: peft's a [E·r, in], b [out, r·E] -> genoctx's [E, r, in], [E, out, r].

    Raises:
        ValueError: shapes that do not split into ``n_experts`` experts of one rank.
    """
    if a.shape[0] % n_experts or b.shape[1] != a.shape[0]:
        raise ValueError(
            f"from_peft_experts: A {tuple(a.shape)} and B {tuple(b.shape)} do not hold {n_experts} experts"
        )
    r = a.shape[0] // n_experts
    a3 = a.reshape(n_experts, r, a.shape[1]).contiguous()
    return a3, b.reshape(b.shape[0], r, n_experts).permute(2, 0, 1).contiguous()
