"""Frozen weights kept in block-scaled fp8 and dequantized per use, inside the layer that uses them (issue 44).

The published GLM-5.3-Flash checkpoint stores its projection weights as ``float8_e4m3fn`` with
``<name>_scale_inv`` ``[ceil(out / b0), ceil(in / b1)]`` fp32 (``weight_block_size`` ``[128, 128]``), and
``w[r, c] = fp8[r, c] * scale_inv[r // b0, c // b1]`` (DeepSeek-V3's ``weight_dequant``: ``dequant_fp8``, which
``genoctx.model.hf`` uses to dequantize on load). A frozen base need not be dequantized at all until a layer runs:

- ``FP8Weight``: a small module holding one weight as loaded, buffers ``weight`` ``[*lead, out, in]``
  float8_e4m3fn and ``scale_inv`` ``[*lead, ceil(out / b0), ceil(in / b1)]`` fp32 (blocks over the last two dims;
  ``lead`` = ``[E]`` for the grouped routed experts' ``gate_up_proj`` [E, 2I, D] / ``down_proj`` [E, D, I], one
  grid of blocks per expert). ``dequantize()`` is ``dequant_fp8(...)`` cast to the dtype the weight computes in.
  Buffers, not parameters: no gradient, no optimizer state, no fp32 master. Module casts (``.to(bf16)``,
  ``.float()``) move them between devices but never change their dtype (they change the compute dtype instead).
- ``freeze_to_fp8(model, which, block)``: replaces the chosen parameters by ``FP8Weight`` holders (quantizing
  them block-wise, ``scale = amax / 448`` per block: ``quantize_fp8``). The holder of ``<owner>.<name>`` is the
  submodule ``<owner>.<name>_fp8``; ``<owner>.<name>`` stays readable as a property that dequantizes, so a layer's
  own code (``F.linear(x, self.weight)``, ``self.gate_up_proj[e]``) runs unchanged. The owner's class is replaced
  by a subclass made for it (as ``torch.nn.utils.parametrize`` does), whose ``forward`` dequantizes each held
  weight it reads at most once per call and drops it on return: only the layer that runs has a dequantized weight,
  and under activation checkpointing the recompute dequantizes again. ``nn.Linear`` owners (``LoRALinear`` too)
  compute through ``fp8_linear``, an autograd function that saves the fp8 tensor and its scale (not the dequantized
  weight) and dequantizes again in backward, so that even without checkpointing no dequantized weight waits for the
  backward. The routed experts read one expert at a time (``Experts.expert_weight``: ``holder[e]``, an
  ``FP8View`` of that expert's bytes and scale blocks) through ``fp8_linear`` too: never the ``[E, ...]`` stack.
  ``unfreeze_fp8`` turns holders back into plain (dequantized) parameters, for an export.
- ``genoctx.model.hf.load_hf(..., keep_fp8=True)`` fills holders straight from a checkpoint's fp8 tensors and
  scales (``fp8_targets``), never dequantizing the whole model.
- ``hold_on_host(model, device)``: every holder's bytes and scales move to host memory (pinned where CUDA is), and
  each use copies the fp8 tensor it reads to the compute ``device`` (``fetch``: one linear's weight, one routed
  expert's slice) right before dequantizing it, in forward, in the recompute and again in backward; nothing of it
  stays on the device. ``train.offload_optimizer`` holds frozen fp8 weights so (``genoctx.parallel.build``), as
  FSDP2's ``CPUOffloadPolicy`` holds the parameters: what keeps a 313B base off 8 H100s' memory.

Exactness: the forward equals the forward with ``dequantize()``'s weights bit for bit (the same values feed the
same ops), and so do the input gradients (``fp8_linear``'s backward is ``grad @ W``, as autograd's for
``F.linear``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
SUFFIX = "_fp8"  # the holder of <owner>.<name> is <owner>.<name>_fp8


def fetch(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """``t`` on the compute ``device``: itself when it is there (or ``device`` is None), else a copy made now
    (``non_blocking`` from pinned host memory: ordered before the kernels that read it on the current stream). The
    one place a host-held fp8 tensor (``hold_on_host``) reaches the device; the copy lives as long as its use."""
    if device is None or t.device == device:
        return t
    return t.to(device, non_blocking=t.is_pinned())


def dequant_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], origin=(0, 0)) -> torch.Tensor:
    """Block-wise fp8 -> fp32 (DeepSeek-V3's ``weight_dequant``): ``w[r, c] * scale_inv[r // b0, c // b1]`` over the
    last two dims, for ``w`` the box of a weight starting at row, column ``origin`` and ``scale_inv`` the scale
    blocks that cover it (the whole scale for a whole weight). Leading dims (experts) are matched one to one.

    Args:
        w: ``[*lead, rows, cols]`` float8 (or any float) tensor.
        scale_inv: ``[*lead, ceil((r + rows) / b0), ceil((c + cols) / b1)]`` with ``r, c = origin mod block``.
        block: ``(b0, b1)`` rows, columns per scale block.
        origin: the box's first row and column in the whole weight.

    Returns:
        ``[*lead, rows, cols]`` fp32.
    """
    b0, b1 = block
    rows, cols = w.shape[-2:]
    r, c = origin[0] % b0, origin[1] % b1
    s = scale_inv.float().repeat_interleave(b0, -2)[..., r : r + rows, :]
    return w.float() * s.repeat_interleave(b1, -1)[..., c : c + cols]


def scale_shape(shape: tuple, block: tuple[int, int]) -> tuple:
    """``[*lead, ceil(rows / b0), ceil(cols / b1)]``: the ``scale_inv`` shape of a weight of ``shape``."""
    return (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise fp32/bf16 -> fp8 as DeepSeek-V3 quantizes: per ``b0 x b1`` block of the last two dims,
    ``scale = amax / 448`` (amax floored at 1e-12, so an all-zero block has a finite scale) and
    ``q = e4m3(w / scale)`` (clamped to +-448). Blocks at the edge of a shape that ``block`` does not divide
    are partial (``ceil``).

    Args:
        w: ``[*lead, rows, cols]`` floating tensor, ``rows, cols >= 1``.
        block: ``(b0, b1)``.

    Returns:
        ``(q [*lead, rows, cols] float8_e4m3fn, scale_inv [*lead, ceil(rows / b0), ceil(cols / b1)] fp32)``, with
        ``dequant_fp8(q, scale_inv, block) ~ w`` (e4m3's 3 mantissa bits: relative error <= 2^-4 per element of
        the block's amax order).

    Raises:
        ValueError: ``w`` has fewer than 2 dims or is not floating point, or ``block`` is not two positive ints.
    """
    if w.dim() < 2 or not w.is_floating_point():
        raise ValueError(f"quantize_fp8: needs a floating tensor of >= 2 dims, got {w.dtype} {tuple(w.shape)}")
    b0, b1 = block
    if b0 < 1 or b1 < 1:
        raise ValueError(f"quantize_fp8: block must be positive, got {block}")
    *lead, rows, cols = w.shape
    R, C = -(-rows // b0), -(-cols // b1)
    x = F.pad(w.detach().float(), (0, C * b1 - cols, 0, R * b0 - rows))  # zeros change no block's amax
    blocks = x.reshape(*lead, R, b0, C, b1)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp_min(1e-12) / E4M3_MAX  # [*lead, R, C]
    q = (blocks / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.reshape(*lead, R * b0, C * b1)[..., :rows, :cols].contiguous(), scale


class FP8Weight(nn.Module):
    """One frozen weight as block-scaled fp8 (module docstring).

    Args:
        weight: ``[*lead, out, in]`` float8_e4m3fn (or e5m2).
        scale_inv: ``[*lead, ceil(out / b0), ceil(in / b1)]`` (stored fp32).
        block: ``(b0, b1)``.
        dtype: the dtype ``dequantize()`` returns (the dtype the weight computed in before: bf16, fp32, ...).

    Raises:
        ValueError: ``weight`` is not float8, or ``scale_inv`` has the wrong shape.
    """

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype):
        super().__init__()
        if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"FP8Weight: weight must be float8, got {weight.dtype}")
        if tuple(scale_inv.shape) != scale_shape(tuple(weight.shape), block):
            raise ValueError(f"FP8Weight: scale_inv {tuple(scale_inv.shape)} does not fit weight "
                             f"{tuple(weight.shape)} in {tuple(block)} blocks")  # fmt: skip
        self.register_buffer("weight", weight)
        self.register_buffer("scale_inv", scale_inv.float())
        self.block = (int(block[0]), int(block[1]))
        self.dtype = dtype
        self.ep_block: tuple[int, int] | None = None  # (first expert, all experts) once EP sliced it (experts)
        self.compute_device: torch.device | None = None  # set by hold_on_host: the buffers stay in host memory

    @classmethod
    def quantize(cls, w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> FP8Weight:
        """The holder of ``w`` quantized by ``quantize_fp8`` (dequantizes to ``w``'s dtype)."""
        return cls(*quantize_fp8(w, block), block, w.dtype)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dequantize(self) -> torch.Tensor:
        """``dequant_fp8(weight, scale_inv, block)`` in ``dtype``: ``[*lead, out, in]``, no grad; on the compute
        device (``hold_on_host``: the fp8 bytes copied there first)."""
        w, s = fetch(self.weight, self.compute_device), fetch(self.scale_inv, self.compute_device)
        return dequant_fp8(w, s, self.block).to(self.dtype)

    def __getitem__(self, e: int) -> FP8View:
        """Expert ``e`` of a stacked ``[E, out, in]`` holder: views of its fp8 rows and its scale blocks (no copy,
        nothing dequantized), for ``fp8_linear`` or ``FP8View.dequantize``."""
        return FP8View(self.weight[e], self.scale_inv[e], self.block, self.dtype)

    def experts(self, first: int, n: int) -> FP8Weight:
        """A new holder of experts ``[first, first + n)`` of a stacked ``[E, out, in]`` holder (copies of their fp8
        rows and scale blocks; blocks never span experts, so the slice is block-safe), ``ep_block`` = ``(first, E)``
        (``genoctx.parallel.experts.apply_ep``; any device, meta included)."""
        out = FP8Weight(self.weight[first : first + n].clone(), self.scale_inv[first : first + n].clone(), self.block,
                        self.dtype)  # fmt: skip
        out.ep_block = (first, self.weight.shape[0])
        return out

    def nbytes(self) -> int:
        """Bytes held: 1 per fp8 element + 4 per scale block."""
        return self.weight.numel() * self.weight.element_size() + self.scale_inv.numel() * 4

    def _apply(self, fn, recurse=True):
        # Module casts move the buffers but keep them fp8 / fp32: a float cast changes only the compute dtype. A
        # host-held holder (hold_on_host) stays in host memory: a move changes only its compute device.
        if self.compute_device is not None:
            t = self._buffers["weight"]
            probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))  # where and in what a move would put it
            self.compute_device = probe.device
            if probe.dtype != t.dtype:
                self.dtype = probe.dtype
            return self
        for name in ("weight", "scale_inv"):
            t = self._buffers[name]
            moved = fn(t)
            if moved.dtype != t.dtype:
                if name == "weight":
                    self.dtype = moved.dtype
                moved = t.to(moved.device)
            self._buffers[name] = moved
        return self

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, {self.weight.dtype}, block={self.block}, dtype={self.dtype}"


class FP8View(NamedTuple):
    """One weight's fp8 values and scale blocks as views into a holder (``FP8Weight[e]``: one routed expert):
    ``weight`` ``[out, in]`` float8, ``scale_inv`` ``[ceil(out / b0), ceil(in / b1)]`` fp32, ``block``, ``dtype``
    (the compute dtype ``dequantize`` returns)."""

    weight: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dequantize(self) -> torch.Tensor:
        """``dequant_fp8(weight, scale_inv, block)`` in ``dtype`` (equal bit for bit to the same rows of the whole
        holder's ``dequantize()``: the same element-wise products)."""
        return dequant_fp8(self.weight, self.scale_inv, self.block).to(self.dtype)


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """``F.linear(x, w)`` for ``w`` a weight tensor ``[out, in]``, or ``fp8_linear`` for an fp8 one (``FP8View`` /
    ``FP8Weight``): x ``[..., in]`` -> ``[..., out]``."""
    return fp8_linear(x, w) if isinstance(w, (FP8View, FP8Weight)) else F.linear(x, w)


class _FP8Linear(torch.autograd.Function):
    """``F.linear(x, dequantize(), bias)`` that saves the fp8 tensor and its scale, not the dequantized weight."""

    @staticmethod
    def forward(ctx, x, holder_weight, scale_inv, block, dtype, bias):
        # a host-held holder (hold_on_host): its bytes copied to x's device for this use; the host tensors are saved
        w = dequant_fp8(fetch(holder_weight, x.device), fetch(scale_inv, x.device), block).to(dtype)
        ctx.save_for_backward(holder_weight, scale_inv)
        ctx.block, ctx.dtype, ctx.x_dtype, ctx.has_bias = block, dtype, x.dtype, bias is not None
        return F.linear(x, w, bias)

    @staticmethod
    def backward(ctx, g):
        w8, s = ctx.saved_tensors
        gx = gb = None
        if ctx.needs_input_grad[0]:
            w = dequant_fp8(fetch(w8, g.device), fetch(s, g.device), ctx.block).to(ctx.dtype)
            gx = g.matmul(w.to(g.dtype)).to(ctx.x_dtype)
        if ctx.has_bias and ctx.needs_input_grad[5]:
            gb = g.reshape(-1, g.shape[-1]).sum(0)
        return gx, None, None, None, None, gb


def fp8_linear(x: torch.Tensor, holder: FP8Weight | FP8View, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, holder.dequantize(), bias)``: x ``[..., in]`` -> ``[..., out]``; the weight is dequantized in
    forward and again in backward (``grad_x = grad @ W``), never kept; no gradient for the weight. ``holder`` is
    a 2-D ``FP8Weight`` or one expert's ``FP8View``."""
    return _FP8Linear.apply(x, holder.weight, holder.scale_inv, holder.block, holder.dtype, bias)


def _held(module: nn.Module, name: str) -> torch.Tensor:
    """``module.<name>``: the dequantized weight, once per forward call of ``module`` (its cache), else fresh."""
    scope = module.__dict__.get("_fp8_scope")
    if scope is None:
        return module._modules[name + SUFFIX].dequantize()
    if name not in scope:
        scope[name] = module._modules[name + SUFFIX].dequantize()
    return scope[name]


def _scoped_forward(module: nn.Module, *args, **kwargs):
    """The owner's own forward, with each held weight dequantized at most once for this call and dropped after."""
    base = module._fp8_base.forward
    if base is nn.Linear.forward:  # (a subclass with its own forward, LoRA's, calls fp8_linear itself)
        return fp8_linear(args[0], module._modules["weight" + SUFFIX], module.bias)
    if "_fp8_scope" in module.__dict__:  # re-entered (a nested call): share the outer call's weights
        return base(module, *args, **kwargs)
    module.__dict__["_fp8_scope"] = {}
    try:
        return base(module, *args, **kwargs)
    finally:
        del module.__dict__["_fp8_scope"]


def _inject(module: nn.Module, name: str) -> None:
    """Give ``module`` a class of its own (once) whose ``forward`` is ``_scoped_forward`` and add property ``name``."""
    cls = module.__class__
    if "_fp8_base" not in cls.__dict__:
        cls = type(f"FP8{cls.__name__}", (cls,), {"_fp8_base": cls, "forward": _scoped_forward})
        module.__class__ = cls
    setattr(cls, name, property(lambda self, n=name: _held(self, n)))


def attach_fp8(module: nn.Module, name: str, holder: FP8Weight) -> None:
    """Replace parameter ``module.<name>`` by ``holder`` (submodule ``<name>_fp8``); ``module.<name>`` then reads
    ``holder.dequantize()`` (cached per forward call).

    Raises:
        ValueError: ``module`` has no parameter ``name``, or ``holder``'s shape differs from it (nn.Linear: only
            ``weight``).
    """
    p = module._parameters.get(name)
    if p is None:
        raise ValueError(f"attach_fp8: {type(module).__name__} has no parameter {name!r}")
    if tuple(p.shape) != tuple(holder.shape):
        raise ValueError(f"attach_fp8: {name} is {tuple(p.shape)}, the fp8 holder {tuple(holder.shape)}")
    if isinstance(module, nn.Linear) and name != "weight":
        raise ValueError(f"attach_fp8: an nn.Linear holds only its weight in fp8, not {name!r}")
    del module._parameters[name]
    module.add_module(name + SUFFIX, holder)
    _inject(module, name)


def freeze_to_fp8(
    model: nn.Module,
    which: Iterable[str] | Callable[[str, torch.Tensor], bool],
    block: tuple[int, int] = (128, 128),
) -> dict[str, FP8Weight]:
    """Replace the chosen frozen weights of ``model`` by block-scaled fp8 holders (module docstring).

    Args:
        model: any module; parameters are chosen by their ``named_parameters`` names.
        which: names (``"layers.1.mlp.experts.gate_up_proj"``, ``"layers.0.self_attn.q_proj.weight"``) or a
            predicate ``(name, parameter) -> bool``. Each must be a parameter of >= 2 dims (blocks over the last
            two), of an ``nn.Linear`` (its weight) or of a module that reads it as ``self.<name>`` (the experts).
        block: ``(b0, b1)`` scale blocks (the published checkpoint's ``weight_block_size`` is ``[128, 128]``).

    Returns:
        ``{name: holder}`` of the weights replaced (each holder dequantizes to the parameter's former dtype).

    Raises:
        ValueError: a named parameter that does not exist, has fewer than 2 dims, or is shared (tied) with another
            name.
    """
    every = dict(model.named_parameters(remove_duplicate=False))
    if callable(which):
        chosen = [n for n, p in every.items() if which(n, p)]
    else:
        chosen = list(which)
        missing = [n for n in chosen if n not in every]
        if missing:
            raise ValueError(f"freeze_to_fp8: no parameter {missing[0]!r} in {type(model).__name__}")
    out = {}
    for name in chosen:
        p = every[name]
        if p.dim() < 2:
            raise ValueError(f"freeze_to_fp8: {name} has {p.dim()} dims; fp8 blocks need >= 2")
        tied = [n for n, q in every.items() if q is p and n != name]
        if tied:
            raise ValueError(f"freeze_to_fp8: {name} is shared with {tied[0]} (tied weights stay as they are)")
        owner_name, _, attr = name.rpartition(".")
        holder = FP8Weight.quantize(p.detach(), block) if p.device.type != "meta" else empty_holder(p, block)
        attach_fp8(model.get_submodule(owner_name), attr, holder)
        out[name] = holder
    return out


def empty_holder(p: torch.Tensor, block: tuple[int, int]) -> FP8Weight:
    """A holder shaped for ``p`` on ``p``'s device, values undefined (to fill from a checkpoint)."""
    w = torch.empty(p.shape, dtype=E4M3, device=p.device)
    return FP8Weight(w, torch.empty(scale_shape(tuple(p.shape), block), device=p.device), block, p.dtype)


def fp8_bytes(model: nn.Module) -> int:
    """Bytes of every ``FP8Weight`` of ``model``: 1 per fp8 element + 4 per scale block."""
    return sum(m.nbytes() for m in model.modules() if isinstance(m, FP8Weight))


def holders(model: nn.Module) -> dict[str, FP8Weight]:
    """``{name of the weight it replaced: holder}`` for every ``FP8Weight`` of ``model``."""
    return {n[: -len(SUFFIX)]: m for n, m in model.named_modules() if isinstance(m, FP8Weight)}


def held(module: nn.Module, name: str) -> FP8Weight | None:
    """The holder of ``module.<name>`` (``<name>_fp8``), or None where that weight is a plain parameter."""
    h = module._modules.get(name + SUFFIX)
    return h if isinstance(h, FP8Weight) else None


def is_matmul_weight(name: str, module: nn.Module) -> bool:
    """Whether parameter ``name`` (``HybridLM.named_parameters()`` form) of ``module`` (its owner) is a matmul weight
    that ``train.frozen_dtype: fp8`` keeps in fp8 when frozen: an ``nn.Linear`` weight inside a decoder layer's
    mixer (``self_attn``, its indexer too) or feed-forward (``mlp``: dense MLP, shared experts), not the router
    (``mlp.gate``), or a routed expert's ``gate_up_proj`` / ``down_proj``. The same tensors
    ``genoctx.plan.trainable`` counts as fp8; the router, norms, mHC, convolutions, the embedding and ``lm_head``
    stay in the compute dtype."""
    parts = name.split(".")
    if len(parts) < 4 or parts[0] != "layers" or parts[2] not in ("self_attn", "mlp"):
        return False
    if isinstance(module, nn.Linear):
        return parts[-1] == "weight" and not name.endswith("mlp.gate.weight")
    return ".mlp.experts." in name and parts[-1] in ("gate_up_proj", "down_proj")


def matmul_weights(model: nn.Module) -> list[str]:
    """The parameters of ``model`` that ``is_matmul_weight`` names, in ``named_parameters`` order (any device)."""
    mods = dict(model.named_modules())
    return [n for n, _ in model.named_parameters() if is_matmul_weight(n, mods[n.rpartition(".")[0]])]


@torch.no_grad()
def unfreeze_fp8(model: nn.Module) -> int:
    """The inverse of ``freeze_to_fp8``, in place: every holder of ``model`` becomes again a parameter
    ``<owner>.<name>`` holding its ``dequantize()`` values (the compute dtype; ``requires_grad`` False) and each
    owner gets its own class back. For what needs plain weights (an HF export, ``genoctx.model.lora.merge_lora``);
    it holds the dequantized model whole. Returns the number of weights converted."""
    n = 0
    for owner in list(model.modules()):
        names = [k[: -len(SUFFIX)] for k, m in owner._modules.items() if isinstance(m, FP8Weight)]
        if not names:
            continue
        owner.__dict__.pop("_fp8_scope", None)
        if "_fp8_base" in type(owner).__dict__:  # its own class back first: the properties would shadow the parameters
            owner.__class__ = type(owner)._fp8_base
        for name in names:
            h = owner._modules.pop(name + SUFFIX)
            owner.register_parameter(name, nn.Parameter(h.dequantize(), requires_grad=False))
            n += 1
    return n


def hold_on_host(model: nn.Module, device: torch.device | str) -> int:
    """Move every ``FP8Weight`` of ``model`` to host memory (pinned when CUDA is available, for asynchronous copies)
    and make ``device`` its compute device: each use then copies the fp8 tensor it reads to ``device`` first
    (``fetch``), and module moves leave it on the host. On a CPU ``device`` nothing moves. Returns the host bytes
    held (``FP8Weight.nbytes``). Used by ``genoctx.parallel.build`` for ``train.offload_optimizer`` with
    ``train.frozen_dtype: fp8``."""
    device = torch.device(device)
    pin = torch.cuda.is_available() and device.type == "cuda"
    total = 0
    for h in holders(model).values():
        for name in ("weight", "scale_inv"):
            t = h._buffers[name].to("cpu")
            h._buffers[name] = t.pin_memory() if pin else t
        h.compute_device = device
        total += h.nbytes()
    return total
