"""Count the aten ops a step dispatches, per model component and pass: what ``genoctx.plan.ops`` plans.

Every eager aten op (views included: each is a dispatcher call, Python and C++ host time, and on a GPU most of them
a kernel launch) is one count. ``OpCounter`` is a ``TorchDispatchMode`` that sorts each op into

- a **component** (``OP_COMPONENTS``): the model module it runs in. Forward ops take the innermost component module
  on the module stack (forward pre/post hooks of ``KimiDeltaAttention`` -> ``kda``, ``Indexer`` -> ``dsa_indexer``,
  the rest of ``DeepSeekSparseAttention`` -> ``dsa_attention``, ``MoE`` -> ``moe``, a decoder layer's dense ``MLP``
  -> ``dense_mlp``, ``HyperConnection`` -> ``mhc``, the decoder layers' ``RMSNorm``s -> ``norms``); ops outside them
  (embedding, stream expansion and collapse, the final norm, the head and the loss, the step's glue and the parallel
  runtime: FSDP2's gathers, copies and reduce-scatters, CP's and EP's exchanges) are ``other``. Components
  that run as methods rather than ``forward`` are entered around those methods while counting
  (``HyperConnection.pre``/``post``; ``Indexer.keys``/``queries``/``extend``, the DSA layer's ``_indexer_loss`` and
  the indexer top-k, ``genoctx.model.dsa.indexer_topk``). Backward ops
  take the component of the autograd node that runs them (``torch._C._current_autograd_node``): each node is
  labelled when the module that created it returns (its post hook walks the new part of the graph; its pre hook
  first gives what reaches it from outside to the enclosing component), so a node's backward is charged to the
  module whose forward made it.
- a **pass** (``OP_PASSES``): ``forward`` (no autograd node running), ``recompute`` (inside backward with grad
  enabled: a checkpoint's rerun, charged to the node whose saved tensor triggered it), ``backward`` (inside backward,
  grad off), and ``optimizer`` (the gradient clip and ``optimizer.step``, marked by ``phase("optimizer")``).

Counted as ``TorchDispatchMode`` sees them: the body of a ``torch.library`` custom op (a Triton kernel's launcher) is
one op; ops inside ``torch.compile``'d regions are not seen individually. Inside an ``OpCounter`` genoctx takes the
paths it takes on an accelerator (``genoctx.model.host.reads_free`` is False, as inside a ``SyncCounter``): the PyTorch
indexer top-k does not prune key blocks by host reads, so the count does not depend on the data.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .host import _counters

OP_COMPONENTS = ("kda", "dsa_attention", "dsa_indexer", "moe", "dense_mlp", "mhc", "norms", "other")
OP_PASSES = ("forward", "recompute", "backward", "optimizer")
BYTE_KINDS = ("elementwise", "gather", "matmul")
# ops whose time is their FLOPs (``genoctx.plan.flops`` counts them): products, the triangular solve, convolutions
MATMUL_OPS = frozenset({"mm", "bmm", "baddbmm", "addmm", "addbmm", "_grouped_mm", "linalg_solve_triangular",
                        "convolution", "convolution_backward", "_convolution"})  # fmt: skip
# ops that read or write rows at indices (a gather's reads and a scatter's writes are not streamed)
GATHER_OPS = frozenset({"index_select", "index_add", "index_add_", "gather", "scatter", "scatter_", "scatter_add",
                        "scatter_add_", "index", "index_put", "index_put_", "_index_put_impl_", "embedding",
                        "embedding_dense_backward", "take_along_dim", "index_copy", "index_copy_",
                        "index_fill", "index_fill_", "masked_scatter", "masked_select"})  # fmt: skip
# ops that move no bytes: views (``OpOverload.is_view``) and these (allocation, shape-only)
NO_BYTES_OPS = frozenset({"_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                          "lift_fresh", "_local_scalar_dense", "_to_copy_meta"})  # fmt: skip


def op_bytes(func, args, kwargs, out) -> tuple[str, int]:
    """``(kind, bytes)`` one aten op moves: the bytes of every tensor it takes and returns (``numel x element size``;
    an in-place op's tensor counts as read and written), 0 for views and allocations (``NO_BYTES_OPS``); ``kind``
    one of ``BYTE_KINDS`` (``MATMUL_OPS``, ``GATHER_OPS``, else elementwise: pointwise, reductions, copies,
    concatenations). An expanded (stride 0) operand counts at its expanded size, as the op's loop reads it."""
    name = func.__name__.split(".")[0]
    kind = "matmul" if name in MATMUL_OPS else "gather" if name in GATHER_OPS else "elementwise"
    if getattr(func, "is_view", False) or name in NO_BYTES_OPS:
        return kind, 0
    total = 0
    for t in tree_flatten((args, kwargs, out))[0]:
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return kind, total


def component_methods(model: nn.Module) -> list[tuple[object, str, str]]:
    """``(object, method name, component)`` of the component code that runs outside a module's ``forward``."""
    from . import dsa
    from .dsa import DeepSeekSparseAttention, Indexer
    from .hyper import HyperConnection

    out: list = [(dsa, "indexer_topk", "dsa_indexer")]
    for m in model.modules():
        if isinstance(m, HyperConnection):
            out += [(m, "pre", "mhc"), (m, "post", "mhc")]
        elif isinstance(m, Indexer):
            out += [(m, name, "dsa_indexer") for name in ("keys", "queries", "extend")]
        elif isinstance(m, DeepSeekSparseAttention):
            out.append((m, "_indexer_loss", "dsa_indexer"))
    return out


def component_modules(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """``(module, component)`` of every component module of a ``HybridLM`` (``OP_COMPONENTS``), outer first."""
    from .dsa import DeepSeekSparseAttention, Indexer
    from .hyper import HyperConnection
    from .kda import KimiDeltaAttention
    from .moe import MLP, MoE
    from .norms import RMSNorm

    out = []
    for layer in getattr(model, "layers", []):
        for m in layer.modules():
            if isinstance(m, KimiDeltaAttention):
                out.append((m, "kda"))
            elif isinstance(m, DeepSeekSparseAttention):
                out.append((m, "dsa_attention"))
            elif isinstance(m, Indexer):
                out.append((m, "dsa_indexer"))
            elif isinstance(m, MoE):
                out.append((m, "moe"))
            elif isinstance(m, MLP) and m is getattr(layer, "mlp", None):
                out.append((m, "dense_mlp"))
            elif isinstance(m, HyperConnection):
                out.append((m, "mhc"))
            elif isinstance(m, RMSNorm) and m in (getattr(layer, "input_layernorm", None),
                                                  getattr(layer, "post_attention_layernorm", None)):  # fmt: skip
                out.append((m, "norms"))
    return out


def _grad_fns(obj, out: list) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.grad_fn is not None:
            out.append(obj.grad_fn)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _grad_fns(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _grad_fns(o, out)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            _grad_fns(getattr(obj, name), out)


class _Restore:
    """Undo of ``OpCounter._wrap``: put the original attribute back (or drop the instance's wrapper)."""

    def __init__(self, obj, name: str, original) -> None:
        self.obj, self.name, self.original = obj, name, original

    def remove(self) -> None:
        if self.original is None:
            delattr(self.obj, self.name)
        else:
            setattr(self.obj, self.name, self.original)


class OpCounter(TorchDispatchMode):
    """Counts of the aten ops dispatched inside it: ``counts[component][pass]`` (``OP_COMPONENTS`` x ``OP_PASSES``;
    every component and pass present, zeros included) and ``total``; the bytes they move,
    ``bytes[component][pass][kind]`` (``op_bytes``, ``BYTE_KINDS``). ``model``: the ``HybridLM`` whose modules name
    the components (hooks are added on entry and removed on exit). Use ``with counter.phase("optimizer"):`` around
    the clip and the optimizer step."""

    def __init__(self, model: nn.Module | None = None):
        from collections import Counter

        super().__init__()
        self.reads: Counter = Counter()  # ``genoctx.model.host.read`` calls by label (as a ``SyncCounter``'s)
        self.counts = {c: dict.fromkeys(OP_PASSES, 0) for c in OP_COMPONENTS}
        self.bytes = {c: {p: dict.fromkeys(BYTE_KINDS, 0) for p in OP_PASSES} for c in OP_COMPONENTS}
        self._stack: list[str] = []
        self._labels: dict = {}  # autograd node -> component (the nodes are kept alive by the dict)
        self._phase: str | None = None
        self._model = model
        self._hooks: list = []

    @property
    def total(self) -> int:
        """All ops counted."""
        return sum(sum(p.values()) for p in self.counts.values())

    def by_pass(self) -> dict:
        """``{pass: ops}`` over all components."""
        return {p: sum(self.counts[c][p] for c in OP_COMPONENTS) for p in OP_PASSES}

    def bytes_by_kind(self, passes=OP_PASSES) -> dict:
        """``{kind: bytes}`` moved over all components in ``passes`` (``BYTE_KINDS``)."""
        return {k: sum(self.bytes[c][p][k] for c in OP_COMPONENTS for p in passes) for k in BYTE_KINDS}

    @contextlib.contextmanager
    def phase(self, name: str):
        """Charge every op inside to pass ``name`` (``"optimizer"``), each to the component it would get."""
        old, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = old

    def _label(self, roots: list, comp: str) -> None:
        todo = [r for r in roots if r not in self._labels]
        while todo:
            node = todo.pop()
            if node in self._labels:
                continue
            self._labels[node] = comp
            for nxt, _ in node.next_functions:
                if nxt is not None and nxt not in self._labels:
                    todo.append(nxt)

    def _pre(self, comp: str):
        def hook(module, args, kwargs):
            roots: list = []
            _grad_fns((args, kwargs), roots)
            self._label(roots, self._stack[-1] if self._stack else "other")
            self._stack.append(comp)

        return hook

    def _post(self, comp: str):
        def hook(module, args, kwargs, output):
            roots: list = []
            _grad_fns(output, roots)
            self._label(roots, comp)
            self._stack.pop()

        return hook

    def _wrap(self, obj, name: str, comp: str) -> None:
        fn = getattr(obj, name)
        pre, post = self._pre(comp), self._post(comp)

        def entered(*args, **kwargs):
            pre(None, args, kwargs)
            out = None
            try:
                out = fn(*args, **kwargs)
                return out
            finally:
                post(None, args, kwargs, out)

        own = name in vars(obj)
        setattr(obj, name, entered)
        self._hooks.append(_Restore(obj, name, fn if own else None))

    def __enter__(self):
        if self._model is not None:
            for m, comp in component_modules(self._model):
                self._hooks.append(m.register_forward_pre_hook(self._pre(comp), with_kwargs=True))
                self._hooks.append(m.register_forward_hook(self._post(comp), with_kwargs=True, always_call=True))
            for obj, name, comp in component_methods(self._model):
                self._wrap(obj, name, comp)
        _counters().append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _counters().remove(self)
        for h in reversed(self._hooks):
            h.remove()
        self._hooks.clear()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        node = torch._C._current_autograd_node()
        if node is None:
            comp = self._stack[-1] if self._stack else "other"
            ps = self._phase or "forward"
        else:
            comp = self._labels.get(node, self._stack[-1] if self._stack else "other")
            ps = self._phase or ("recompute" if torch.is_grad_enabled() else "backward")
        self.counts[comp][ps] += 1
        out = func(*args, **(kwargs or {}))
        kind, moved = op_bytes(func, args, kwargs, out)
        self.bytes[comp][ps][kind] += moved
        return out


def count_train_step(model, optimizer, step) -> OpCounter:
    """Run ``step()`` (one ``genoctx.train.loop.train_step`` of ``model`` and ``optimizer``) under an ``OpCounter``:
    everything from the gradient clip on (``torch.nn.utils.clip_grad_norm_``, ``optimizer.step``, the router-bias
    update, the metric read) in pass ``optimizer``. Returns the counter."""
    counter = OpCounter(model)
    clip = torch.nn.utils.clip_grad_norm_

    def clip_in_optimizer_pass(*args, **kwargs):
        counter._phase = "optimizer"
        return clip(*args, **kwargs)

    hook = optimizer.register_step_pre_hook(lambda *a: setattr(counter, "_phase", "optimizer"))
    torch.nn.utils.clip_grad_norm_ = clip_in_optimizer_pass
    try:
        with counter:
            step()
    finally:
        torch.nn.utils.clip_grad_norm_ = clip
        hook.remove()
        counter._phase = None
    return counter
