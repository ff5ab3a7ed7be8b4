"""Fresh initialisation that does not depend on the parallel layout: any rank can draw any slice of any tensor.

A model built on the meta device and sharded (FSDP2, expert parallel) must start from the same weights as the
same model built whole in one process, or the layout tests could not start every layout from one model, and a
run's result would depend on its GPU count. torch's generators draw a tensor as one stream, so a rank cannot draw
its own rows of a tensor without drawing all of them. Here every tensor is drawn in **row blocks** of its first
dimension, each block from its own generator seeded by ``(seed, tensor name, block index)``:

- block ``j`` of a tensor of global shape ``[n0, *rest]`` is rows ``[j B, (j + 1) B)`` with
  ``B = max(1, BLOCK_ELEMENTS // prod(rest))`` (a function of the shape alone: about 16 MiB of fp32 per block);
- a rank holding rows ``[lo, hi)`` (FSDP2 ``Shard(0)``, an expert-parallel block of experts, or both) draws only
  the blocks that overlap them and keeps its rows, then the columns its placements give it (``Shard(1)``): at most
  one block more than its own slice is ever allocated, whatever the tensor's size;
- the tensor name is the one-device state-dict name (``layers.3.mlp.experts.gate_up_proj``), so the global tensor
  is the same under every layout.

The distributions are the ones the modules draw when built on their own (``init_spec``): linear and embedding
weights N(0, initializer_range) (a unit-scale untied embedding), norms 1, biases 0, KDA's short convolution
U(+-1/sqrt(kernel)), ``A_log`` 0 with the safe gate (else log U(1, 16)), ``dt_bias = softplus^-1(dt)`` with
``dt`` log-uniform in [1e-3, 0.1] (clamped at 1e-4), mHC ``fn`` N(0, initializer_range), ``base`` 0, ``scale`` 1,
the indexer's ``index_kpool_compress_ape`` 0 and ``index_kpool_compress_gate`` N(0, initializer_range), router
weights N(0, initializer_range) and its correction bias 0. Only the draws differ from the modules' own (one
stream per block instead of one per process), not the distributions.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn

BLOCK_ELEMENTS = 1 << 22  # elements per row block (16 MiB of fp32): a function of the shape, never of the layout


@dataclass(frozen=True)
class Init:
    """How one tensor is drawn: ``kind`` in ``normal`` (``std`` = a), ``uniform`` (in [a, b)), ``zeros``, ``ones``,
    ``a_log`` (log U(1, 16)), ``dt_bias`` (softplus^-1 of a log-uniform dt in [1e-3, 0.1], clamped at 1e-4)."""

    kind: str
    a: float = 0.0
    b: float = 0.0


def init_spec(model: nn.Module) -> dict[str, Init]:
    """How every parameter and buffer of a ``HybridLM`` is initialised, by its one-device state-dict name
    (non-persistent buffers included; a tied ``lm_head.weight`` is the embedding's entry).

    Raises:
        ValueError: a parameter of a module this table does not know (a new layer must say how it starts).
    """
    from .dsa import Indexer
    from .hyper import HyperConnection
    from .kda import ForgetGate, GatedRMSNorm
    from .moe import Experts, MoE, TopkRouter
    from .norms import RMSNorm

    cfg = model.cfg
    std = cfg.initializer_range
    spec: dict[str, Init] = {}
    for mod_name, mod in model.named_modules():
        pre = f"{mod_name}." if mod_name else ""
        own = {n: t for n, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False))}
        for n in own:
            name = pre + n
            if isinstance(mod, nn.Embedding):
                s = Init("normal", std if cfg.tie_word_embeddings else 1.0)
            elif isinstance(mod, nn.Linear):
                s = Init("normal", std) if n == "weight" else Init("zeros")
            elif isinstance(mod, nn.Conv1d):
                bound = 1.0 / math.sqrt(mod.kernel_size[0])
                s = Init("uniform", -bound, bound)
            elif isinstance(mod, (RMSNorm, GatedRMSNorm, nn.LayerNorm)):
                s = Init("ones") if n == "weight" else Init("zeros")
            elif isinstance(mod, ForgetGate):
                s = Init("dt_bias") if n == "dt_bias" else Init("zeros" if mod.lower_bound is not None else "a_log")
            elif isinstance(mod, HyperConnection):
                s = {"fn": Init("normal", std), "base": Init("zeros"), "scale": Init("ones")}[n]
            elif isinstance(mod, Indexer):
                s = Init("normal", std) if n == "index_kpool_compress_gate" else Init("zeros")
            elif isinstance(mod, TopkRouter):
                s = Init("normal", std) if n == "weight" else Init("zeros")
            elif isinstance(mod, Experts):
                s = Init("normal", std)
            elif isinstance(mod, MoE):  # load_counts
                s = Init("zeros")
            else:
                raise ValueError(f"init_spec: no initialisation known for {name} ({type(mod).__name__})")
            spec[name] = s
    if cfg.tie_word_embeddings:
        spec["lm_head.weight"] = spec["embed_tokens.weight"]
    return spec


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}:{name}:{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _draw(spec: Init, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """One block, fp64 on the CPU (fp64 so that an fp64 model's draws are fp64; cast by the caller)."""
    t = torch.empty(shape, dtype=torch.float64)
    if spec.kind == "normal":
        return t.normal_(0.0, spec.a, generator=gen)
    if spec.kind == "uniform":
        return t.uniform_(spec.a, spec.b, generator=gen)
    if spec.kind == "a_log":
        return t.uniform_(1.0, 16.0, generator=gen).log_()
    if spec.kind == "dt_bias":
        dt = t.uniform_(math.log(1e-3), math.log(0.1), generator=gen).exp_().clamp_min_(1e-4)
        return dt + torch.log(-torch.expm1(-dt))
    raise ValueError(f"unknown init kind {spec.kind!r}")


def draw_slice(spec: Init, shape: tuple[int, ...], seed: int, name: str, box: tuple[slice, ...]) -> torch.Tensor:
    """The part ``box`` (one ``slice`` per dim, steps of 1) of the tensor ``name`` of global ``shape``, as drawn
    under ``seed`` (module docstring): fp64 on the CPU, shape of the box. Allocates at most the overlapping row
    blocks (each at most ``BLOCK_ELEMENTS`` elements or one row) plus the result.

    Raises:
        ValueError: an unknown ``spec.kind``.
    """
    out_shape = tuple(len(range(*s.indices(n))) for s, n in zip(box, shape, strict=True))
    if spec.kind in ("zeros", "ones"):
        return (torch.zeros if spec.kind == "zeros" else torch.ones)(out_shape, dtype=torch.float64)
    if not shape:  # a scalar: one block of one element
        return _draw(spec, (), torch.Generator().manual_seed(_block_seed(seed, name, 0)))
    n0, rest = shape[0], tuple(shape[1:])
    rows = max(1, BLOCK_ELEMENTS // max(1, math.prod(rest)))
    lo, hi, _ = box[0].indices(n0)
    parts = []
    for j in range(lo // rows, -(-hi // rows) if hi > lo else lo // rows):
        start, stop = j * rows, min(n0, (j + 1) * rows)
        block = _draw(spec, (stop - start, *rest), torch.Generator().manual_seed(_block_seed(seed, name, j)))
        parts.append(block[max(lo, start) - start : min(hi, stop) - start][(slice(None), *box[1:])])
    if not parts:
        return torch.empty(out_shape, dtype=torch.float64)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


@torch.no_grad()
def fill_fresh(targets: dict, spec: dict[str, Init], seed: int) -> None:
    """Initialise every target in place: ``targets`` maps a one-device name to ``(local tensor, global shape,
    box)`` (the box: this rank's slice of the global tensor, one ``slice`` per dim). Each rank draws only its
    box (``draw_slice``); the values are the same under every layout."""
    for name, (local, shape, box) in targets.items():
        if local.numel() == 0:
            continue
        local.copy_(draw_slice(spec[name], tuple(shape), seed, name, box).to(local.dtype))


def whole(model: nn.Module) -> dict:
    """The targets of a one-device model for ``fill_fresh``: every tensor whole (box = all of it)."""
    out = {}
    for name, t in list(model.named_parameters(remove_duplicate=True)) + list(model.named_buffers()):
        out[name] = (t.data, tuple(t.shape), tuple(slice(0, n) for n in t.shape))
    return out


def init_weights(model: nn.Module, seed: int) -> None:
    """Fresh weights for a one-device ``HybridLM`` (the same values any layout gets for ``seed``; tied weights are
    drawn once, as the embedding)."""
    fill_fresh(whole(model), init_spec(model), seed)


def seed_from_generator() -> int:
    """A model seed drawn from torch's global CPU generator: ``torch.manual_seed(s)`` then ``HybridLM(cfg)`` (which
    draws it first) gives the same model as ``torch.manual_seed(s)`` then ``genoctx.parallel.build.build_model`` on
    any mesh."""
    return int(torch.randint(0, 2**62, (), device="cpu"))
