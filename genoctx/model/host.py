"""Host reads of device values: the one door a training step reads through, and a counter of the reads.

A GPU runs ahead of the Python thread that queues its kernels. Reading a device value on the host -- ``int(t)``,
``float(t)``, ``bool(t)`` and ``if t``, ``t.item()``, ``t.tolist()``, a boolean-mask index ``x[mask]``,
``torch.nonzero`` / ``torch.where(cond)``, ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` without
``output_size``, a blocking copy between host and device (``t.cpu()``, ``torch.tensor(list, device=cuda)``) --
waits until every queued kernel has run: the GPU idles while Python catches up. One such read per layer, chunk or
piece serialises a step. The rules of genoctx's step path (``genoctx.model``, ``kernels``, ``genoctx.parallel``
context/experts, ``genoctx.train`` loop/chunked; ``tests/model/test_syncs.py`` holds them):

- A read the algorithm needs goes through ``read`` (it names itself by a label): the expert dispatch's split sizes
  (one read per MoE token chunk on the per-expert loop, ``Experts.forward_loop``: ``torch.split`` of the rows by
  expert needs host sizes; none on the grouped path, whose offsets stay on the device; under expert parallelism
  one read of the all-gathered counts per MoE forward, which sizes every ``all_to_all`` round), and the step's
  metrics, read once per step in one copy (loss sum, token count, auxiliary loss, gradient norm, every MoE layer's
  loads: ``genoctx.train.loop.train_step``; ``HybridLM.layer_stats`` reads every layer's statistics in one copy).
- Everything else stays on the device: statistics are 0-dim / small tensors until ``layer_stats`` (``stats`` values
  may be tensors: read them with ``genoctx.model.stats.as_number``), shapes and loop bounds are Python ints computed
  from the config and the positions (never read off a tensor), index tensors made from host lists are made once per
  device and kept.
- No raw ``.item()``, ``.tolist()`` or ``torch.tensor(..., device=...)`` on the step path outside this module.

On a CPU a host read is free (host memory is the device's), and some CPU fast paths read on purpose (the PyTorch
indexer top-k prunes key blocks by thresholds it reads per tile): ``reads_free(device)`` tells them when they may.

``SyncCounter`` counts the reads of whatever runs inside it, on any device: a ``TorchDispatchMode`` that sees the aten
ops forcing a device -> host read (``SYNC_OPS``: ``_local_scalar_dense`` behind ``int``/``float``/``bool``/``item``,
``nonzero``, ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``, indexing by
a boolean mask, copies between a CUDA tensor and the host), plus the labelled ``read`` calls (on CPU ``.tolist()``
dispatches no aten op at all, hence the one door). Inside it ``reads_free`` is False everywhere, so genoctx takes
the paths it takes on an accelerator and what is counted on a CPU is what a GPU would wait for. The body of a
``torch.library`` custom op (the Triton kernels' ops) runs below the mode, unseen: a read there is counted on its
launcher (``tests/train/test_syncs.py``).

Where CUDA exists the real check is torch's own: ``torch.cuda.set_sync_debug_mode("warn")`` (or ``"error"``) warns
on (raises at) every synchronising CUDA call. ``SyncCounter(cuda_debug="warn")`` turns it on for its duration, and
``read`` turns it off around its own deliberate copy, so a warning names a read that went around the door. (Not
run here: this machine has no GPU; ``bench/gpu_check.sh`` is where it runs.)
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
# aten ops that read device memory on the host before they return (their output size or value is data)
SYNC_OPS = {
    _aten._local_scalar_dense.default: "item",  # int(t), float(t), bool(t), if t, t.item()
    _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select",
    _aten._unique2.default: "unique",
    _aten.unique_dim.default: "unique",
    _aten.unique_consecutive.default: "unique",
    _aten.bincount.default: "bincount",  # CUDA reads the max to size its output
    _aten.histc.default: "histc",  # CUDA reads min/max when they are not given
    _aten.equal.default: "equal",
    _aten.is_nonzero.default: "item",
}


class _State:
    """Process-wide, not thread-local: autograd may run a backward on a device thread of its own."""

    counters: list = []
    quiet = 0


_state = _State()


def _counters() -> list:
    return _state.counters


def reads_free(device: torch.device | str) -> bool:
    """Whether reading a value of a tensor on ``device`` on the host costs nothing: a CPU, outside a ``SyncCounter``
    (inside it genoctx behaves as on an accelerator)."""
    return torch.device(device).type == "cpu" and not _counters()


@contextlib.contextmanager
def _quiet():
    """No counting (and no CUDA sync warning) inside: ``read``'s own copy is counted once, by its label."""
    _state.quiet += 1
    mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        _state.quiet -= 1
        if mode:
            torch.cuda.set_sync_debug_mode(mode)


def _host_values(t: Tensor):
    """A host tensor's values: a Python number for a 0-dim tensor, else nested lists."""
    return t.item() if t.dim() == 0 else t.tolist()


def read(*values, label: str):
    """The host values of ``values`` (tensors on any device; other values pass through as they are) in one copy.

    Args:
        values: tensors (a 0-dim tensor comes back as a Python int, float or bool by its dtype, others as nested
            lists) or anything else (returned unchanged: None, numbers, strings).
        label: why the step reads here (``SyncCounter.reads`` counts by it).

    Returns:
        The value of the only argument, or a list with one value per argument.

    Device tensors are flattened into one buffer (integers and bools through float64 when dtypes differ: exact up
    to 2^53) and copied to the host at once: one synchronisation however many tensors are read. An active
    ``SyncCounter`` counts it once under ``label`` when there is a tensor (on a CPU too: it is what a GPU waits for).
    """
    tensors = [v for v in values if torch.is_tensor(v)]
    for c in _counters():
        if tensors and not _state.quiet:
            c.reads[label] += 1
    with _quiet():
        got = _read(tensors)
    it = iter(got)
    out = [next(it) if torch.is_tensor(v) else v for v in values]
    return out[0] if len(values) == 1 else out


def _read(tensors: list[Tensor]) -> list:
    if not tensors:
        return []
    if len(tensors) == 1:
        t = tensors[0].detach()
        return [_host_values(t.cpu())]
    dtypes = {t.dtype for t in tensors}
    dt = dtypes.pop() if len(dtypes) == 1 else torch.float64
    dev = tensors[0].device
    flat = torch.cat([t.detach().reshape(-1).to(device=dev, dtype=dt) for t in tensors]).cpu()
    out, at = [], 0
    for t in tensors:
        n = t.numel()
        part = flat[at : at + n].view(t.shape).to(t.dtype)
        out.append(_host_values(part))
        at += n
    return out


def cpu_values(t: Tensor):
    """The values of a tensor that lives on the host (plans computed from counts already read): a Python number for a
    0-dim tensor, else nested lists. No device read, so not counted.

    Raises:
        ValueError: ``t`` is not on the CPU (read a device tensor with ``read``).
    """
    if t.device.type != "cpu":
        raise ValueError(f"cpu_values: a {t.device} tensor is a device read; use genoctx.model.host.read")
    with _quiet():
        return _host_values(t.detach())


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """A host tensor copied to ``device`` without a host sync: from pinned memory, non-blocking, on CUDA (PyTorch's
    pinned allocator keeps the staging buffer until the copy has run); ``t`` itself when ``device`` is the CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class SyncCounter(TorchDispatchMode):
    """Count the device -> host reads of what runs inside (module docstring).

    Args:
        cuda_debug: where CUDA is available, ``torch.cuda.set_sync_debug_mode`` for the duration (``"warn"``,
            ``"error"``; None leaves it alone).
        host_resident: tensors that live on the host on a GPU too, whose reads are free there and not counted (the
            ``step`` counters of ``torch.optim.AdamW``, kept on the CPU unless ``capturable``: ``optimizer_steps``).

    Attributes:
        reads: ``Counter`` of ``read`` calls by label (deliberate reads).
        ops: ``Counter`` of the other reads by kind (``SYNC_OPS`` values, ``"mask_index"`` for indexing by a boolean
            mask, ``"repeat_interleave"`` without ``output_size``, ``"copy_to_host"`` / ``"copy_to_device"`` for a
            copy between a CUDA tensor and the host): reads that went around the door.
        total: ``sum(reads) + sum(ops)``.
    """

    def __init__(self, cuda_debug: str | None = None, host_resident=()):
        super().__init__()
        self.reads: Counter = Counter()
        self.ops: Counter = Counter()
        self.cuda_debug = cuda_debug
        self._old_debug = None
        self._host = list(host_resident)  # held: their ids stay theirs while counting

    @property
    def total(self) -> int:
        return sum(self.reads.values()) + sum(self.ops.values())

    def __enter__(self):
        _counters().append(self)
        if self.cuda_debug is not None and torch.cuda.is_available():
            self._old_debug = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(self.cuda_debug)
        return super().__enter__()

    def __exit__(self, *exc):
        _counters().remove(self)
        if self._old_debug is not None:
            torch.cuda.set_sync_debug_mode(self._old_debug)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _state.quiet:
            kind = _sync_kind(func, args, kwargs)
            if kind is not None and not (args and any(args[0] is t for t in self._host)):
                self.ops[kind] += 1
        return func(*args, **kwargs)


def optimizer_steps(optimizer) -> list[Tensor]:
    """The per-parameter ``step`` tensors of a ``torch.optim`` optimizer's state (on the host unless the optimizer is
    ``capturable``): ``SyncCounter(host_resident=...)``. Empty before the first step."""
    return [s["step"] for s in optimizer.state.values() if torch.is_tensor(s.get("step"))]


def _sync_kind(func, args, kwargs) -> str | None:
    """The kind of host read ``func(*args, **kwargs)`` forces, or None."""
    kind = SYNC_OPS.get(func)
    if kind is not None:
        return kind
    if func is _aten.repeat_interleave.Tensor:
        return None if kwargs.get("output_size") is not None else "repeat_interleave"
    if func in (_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default):
        idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in idx):
            return "mask_index"
        return None
    if func in (_aten._to_copy.default, _aten.copy_.default):
        src = args[0] if func is _aten._to_copy.default else args[1]
        dst = kwargs.get("device") if func is _aten._to_copy.default else args[0].device
        if torch.is_tensor(src) and dst is not None:
            a, b = src.device.type, torch.device(dst).type
            if a == "cuda" and b == "cpu":
                return "copy_to_host"
            if a == "cpu" and b == "cuda" and not (func is _aten._to_copy.default and kwargs.get("non_blocking")):
                return "copy_to_device"
    return None


__all__ = ["SYNC_OPS", "SyncCounter", "cpu_values", "optimizer_steps", "read", "reads_free", "to_device"]
