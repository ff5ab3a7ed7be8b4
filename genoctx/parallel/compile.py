"""``torch.compile`` per decoder layer (``train.compile``), applied from outside the model as torchtitan's
``apply_compile`` does.

``apply_compile(model)`` compiles each decoder layer's ``forward`` (TorchDynamo + Inductor by default) in place:
``layer.forward = torch.compile(layer.forward)`` on the instance, so parameter names, ``state_dict`` and module
hooks are unchanged (FSDP2's unshard/reshard hooks stay eager around the compiled forward). Order in
``genoctx.parallel.fsdp.apply_parallel``: expert and context parallelism, compile, activation checkpointing,
FSDP2 (torchtitan compiles before FSDP). Activation checkpointing wraps the compiled forward: the checkpoint runs
eagerly and its recomputation calls the compiled forward again (a checkpoint inside a compiled region must be
one graph without breaks, which a MoE layer is not).

What stays eager, and why (``GRAPH_BREAKS``, one break each):

- a MoE (``MoE.forward``) as a whole, marked ``torch.compiler.disable`` on the instance: with grad on it
  checkpoints each token chunk, and the chunk's expert dispatch has data-dependent per-expert row counts (a host
  list for ``torch.split``); a checkpoint inside a compiled region cannot hold that break, so dynamo would trace the
  chunk, fail, and run it eagerly anyway. The dense MLP is compiled.

What was a break and is not any more (the model's math unchanged):

- the DSA indexer's PyTorch top-k steers its tiles from the host (``visible.tolist()``, per-tile pruning
  thresholds, ragged candidates): while compiling it is called as one opaque op
  (``genoctx.model.dsa.indexer_topk_op``, a ``torch.library`` custom op with a shape-only fake);
- the layers' statistics (DSA keys attended and indexer loss, the MoE load ratio) were Python numbers read off
  tensors (``int(t)``, ``float(t)``, ``if mean > 0``): they stay 0-dim tensors while compiling and
  ``HybridLM.layer_stats`` reads them after the step (``genoctx.model.stats``); the keys a DSA layer scores
  are a closed form of its positions (no tensor at all);
- KDA passed one tensor to two inputs of an autograd Function (``_CausalDecayScores``: keys as rows and as
  columns), which dynamo cannot trace: the rows get a view of it.

Layers of one structure share their compiled graphs (parameters are graph inputs); a new sequence length
recompiles once, then shapes are dynamic. Compile time grows with the window: dynamo unrolls Python loops, so each
KDA block (``kda_block_tokens``, a checkpoint of its own) becomes its own subgraph with its chunks unrolled, and
Inductor compiles each. Measured on this 2-core CPU (``bench/compile_speed.py``, Inductor, warm cache): tiny at
256 tokens ~1 min, cpu-small at 4096 tokens (4 blocks per KDA layer) ~8 min; a 512k window (512 blocks) is out of
reach until one block's graph is compiled once and reused. Training steps then run at 0.46-0.79 (tiny) and 0.65
(cpu-small) of eager's time. ``BreakLog`` records the breaks per layer kind (``layer_kind``) during
a compiled model's first forward; ``tests/parallel/test_compile.py`` holds them equal to ``GRAPH_BREAKS``.
"""

from __future__ import annotations

import logging
import re
import time

import torch
import torch.distributed as dist
from torch import nn

from ..model.moe import MoE

_MOE_EAGER = ("MoE: its checkpointed token chunks hold the expert dispatch, whose per-expert row counts are data "
              "(a host list for torch.split); a checkpoint in a compiled region cannot hold a graph break")  # fmt: skip
_MOE_SITE = "model.py forward -> MoE.forward (compiler-disabled)"

log = logging.getLogger("genoctx.parallel")

# The graph breaks of one decoder layer compiled by ``apply_compile``, by ``layer_kind``: {site: why it stays}.
# Measured on CPU, fp32, training forward (grad on), the PyTorch DSA path (``BreakLog``; the test holds them).
# The kinds of the presets and of GLM-5.3-Flash (a dense MLP only in its first KDA layers).
GRAPH_BREAKS: dict[str, dict[str, str]] = {
    "kda+mlp": {},
    "kda+moe": {_MOE_SITE: _MOE_EAGER},
    "dsa-full+moe": {_MOE_SITE: _MOE_EAGER},
    "dsa-shared+moe": {_MOE_SITE: _MOE_EAGER},
}


def layer_kind(layer: nn.Module) -> str:
    """A decoder layer's mixer and feed-forward, the keys of ``GRAPH_BREAKS``: ``"kda+mlp"``, ``"kda+moe"``,
    ``"dsa-full+moe"`` (a DSA layer with its own indexer), ``"dsa-shared+moe"`` (one reusing the previous
    layer's selection), ..."""
    if layer.layer_type == "linear_attention":
        mixer = "kda"
    else:
        mixer = "dsa-shared" if layer.self_attn.indexer is None else "dsa-full"
    return f"{mixer}+{'moe' if isinstance(layer.mlp, MoE) else 'mlp'}"


def prepare_layer(layer: nn.Module) -> None:
    """Mark the eager parts of one decoder layer (module docstring): a MoE's ``forward`` (whatever it is now:
    ``MoE.forward`` or expert parallelism's override) becomes its ``torch.compiler.disable`` on the instance.
    Idempotent."""
    if isinstance(layer.mlp, MoE):
        fn = layer.mlp.forward
        if not getattr(fn, "_genoctx_eager", False):
            eager = torch.compiler.disable(fn, reason=_MOE_EAGER)
            eager._genoctx_eager = True
            layer.mlp.forward = eager


def apply_compile(model: nn.Module, backend="inductor") -> int:
    """``torch.compile`` each decoder layer's ``forward`` of ``model`` (a ``HybridLM``) in place, after
    ``prepare_layer``. Call after expert and context parallelism, before activation checkpointing and FSDP2
    (``apply_parallel`` does). Each layer compiles at its first call (seconds to minutes on a CPU: the first step).

    Args:
        model: the model; its ``layers`` change in place (names, parameters and ``state_dict`` do not).
        backend: ``torch.compile``'s backend: ``"inductor"`` (the default: C++/OpenMP on CPU, Triton on CUDA),
            ``"aot_eager"`` (the same forward and backward graphs run by eager kernels: no code generation),
            ``"eager"`` (graph capture only) or a backend callable (``BreakLog.backend``).

    Returns:
        The number of layers compiled.
    """
    kinds: set[str] = set()
    for i, layer in enumerate(model.layers):
        prepare_layer(layer)
        layer.forward = torch.compile(layer.forward, backend=backend)
        announce_first_call(layer, i, backend, kinds)
    return len(model.layers)


def announce_first_call(layer: nn.Module, index: int, backend, kinds: set[str]) -> list:
    """One-shot hooks on a compiled decoder layer that say when it compiles (compilation is lazy: at its first call):
    a log line before its first forward and one with the seconds it took after, then the hooks remove themselves.
    The first layer of each kind (``layer_kind``, recorded in ``kinds``) logs at INFO on rank 0 (the others reuse
    its graphs, and other ranks compile the same); the rest at DEBUG. Its backward compiles in the first backward,
    inside the first step's time. Returns the hook handles."""
    kind, t0, level, handles = layer_kind(layer), [0.0], [logging.DEBUG], []
    name = backend if isinstance(backend, str) else type(backend).__name__

    def before(_m, _args):
        rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        level[0] = logging.INFO if rank0 and kind not in kinds else logging.DEBUG
        kinds.add(kind)
        log.log(level[0], "compiling decoder layer %d (%s; torch.compile, %s) at its first call ...", index, kind, name)
        t0[0] = time.perf_counter()

    def after(_m, _args, _out):
        log.log(level[0], "decoder layer %d (%s) compiled and ran its first forward in %.1f s", index, kind,
                time.perf_counter() - t0[0])  # fmt: skip
        for h in handles:
            h.remove()

    handles += [layer.register_forward_pre_hook(before), layer.register_forward_hook(after)]
    return handles


def break_site(reason) -> str:
    """One graph break (a dynamo ``GraphCompileReason``) as ``"<file> <function>: <reason>"``, named by the innermost
    frame of genoctx's code (a break inside torch, such as calling a disabled module ``forward``, by our call site;
    dynamo's resume functions by the function they resume), or, for a call to a compiler-disabled function,
    ``"<file> <function> -> <callee> (compiler-disabled)"``."""
    frames = [f for f in reason.user_stack if "genoctx" in f.filename] or list(reason.user_stack)
    where = "?"
    if frames:
        f = frames[-1]
        where = f"{f.filename.replace(chr(92), '/').rsplit('/', 1)[-1]} "
        where += re.sub(r"^torch_dynamo_resume_in_(.*)_at_\d+$", r"\1", f.name)
    callee = re.search(r"Skip calling function `<function ([\w.<>]+) at", reason.reason)
    if callee:
        return f"{where} -> {callee.group(1)} (compiler-disabled)"
    return f"{where}: {reason.reason.strip().splitlines()[0]}"


class BreakLog:
    """Graph breaks per decoder layer kind (``layer_kind``), recorded while a model compiled by ``apply_compile``
    with ``backend=log.backend`` runs its first forward: compilation is lazy, so each layer's graphs and breaks
    appear during its first call (a later layer of the same structure reuses them and adds none).

    ``log = BreakLog("aot_eager"); apply_compile(model, backend=log.backend); log.attach(model); model(tokens)``,
    then ``log.sites == {kind: {break_site, ...}}`` for every kind in the model (an empty set: no break), and
    ``log.backend.graphs`` holds the captured graphs.

    Args:
        backend: the backend that compiles the graphs (``apply_compile``'s ``backend``).
    """

    def __init__(self, backend="inductor"):
        from torch._dynamo.backends.debugging import ExplainWithBackend

        self.backend = ExplainWithBackend(backend)
        self.sites: dict[str, set[str]] = {}

    def attach(self, model: nn.Module) -> list:
        """Forward hooks on each decoder layer (module hooks run outside the compiled forward) that file the breaks
        its call added under its kind. Returns the hook handles (``.remove()`` them when done)."""
        handles = []
        for layer in model.layers:
            kind, start = layer_kind(layer), [0]
            self.sites.setdefault(kind, set())

            def before(_m, _args, _start=start):
                _start[0] = len(self.backend.break_reasons)

            def after(_m, _args, _out, _kind=kind, _start=start):
                self.sites[_kind] |= {break_site(r) for r in self.backend.break_reasons[_start[0] :]}

            handles += [layer.register_forward_pre_hook(before), layer.register_forward_hook(after)]
        return handles
