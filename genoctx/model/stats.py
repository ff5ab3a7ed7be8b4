"""Layer statistics without a host sync inside ``torch.compile``.

A layer records what it ran in ``stats`` (``DeepSeekSparseAttention``: keys attended, the indexer loss; ``MoE``:
the load ratio) as Python numbers for the log. Reading a number off a tensor (``int(t)``, ``float(t)``) waits for
the device and, inside a compiled decoder layer (``train.compile``, ``genoctx.parallel.compile``), breaks the
graph. ``host_number`` therefore keeps the 0-dim tensor while ``torch.compile`` traces and converts it at once
otherwise (eager runs record exactly what they recorded before); ``HybridLM.layer_stats`` reads every recorded
value with ``as_number``, after the step, so both record the same numbers.
"""

from __future__ import annotations

import torch
from torch import Tensor


def host_number(t: Tensor, kind: type[int] | type[float]) -> Tensor | int | float:
    """``kind(t)`` of a 0-dim tensor, or ``t`` itself while ``torch.compile`` traces (read it with ``as_number``)."""
    return t if torch.compiler.is_compiling() else kind(t)


def as_number(v):
    """A value of a layer's ``stats``: a 0-dim tensor left by ``host_number`` as a Python int (integer dtypes) or
    float; anything else (a number, a string, None, a tensor of several values) as it is."""
    if torch.is_tensor(v) and v.dim() == 0:
        return int(v) if not (v.is_floating_point() or v.is_complex()) else float(v)
    return v
