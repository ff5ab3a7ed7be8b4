"""Layer statistics kept on the device until the step is over.

A layer records what it ran in ``stats`` (``DeepSeekSparseAttention``: keys attended, the indexer loss; ``MoE``:
the load ratio). Reading a number off a tensor (``int(t)``, ``float(t)``) waits for the device (a host sync per
layer and chunk, ``genoctx.model.host``) and, inside a compiled decoder layer (``train.compile``,
``genoctx.parallel.compile``), breaks the graph. ``host_number`` therefore keeps the 0-dim tensor (detached), eager
or compiled, and ``HybridLM.layer_stats`` reads every recorded tensor of every layer after the step in one copy
(``read_numbers``); ``as_number`` converts one value where a single read is wanted.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .host import read


def host_number(t: Tensor, kind: type[int] | type[float]) -> Tensor:
    """The 0-dim tensor ``t``, detached: a statistic read later as ``kind`` (``as_number``, ``read_numbers``), never
    now (no host sync)."""
    del kind  # the dtype says it: integer tensors read as int, floating ones as float
    return t.detach()


def as_number(v):
    """A value of a layer's ``stats``: a 0-dim tensor as a Python int (integer dtypes) or float (one host read);
    anything else (a number, a string, None, a tensor of several values) as it is."""
    if torch.is_tensor(v) and v.dim() == 0:
        x = read(v, label="stats")
        return float(x) if v.is_floating_point() or v.is_complex() else int(x)
    return v


def read_numbers(dicts: list[dict], label: str = "stats") -> list[dict]:
    """Copies of ``dicts`` whose tensor values are read in one host copy: 0-dim tensors as Python int/float (by
    dtype), others as nested lists; non-tensor values as they are."""
    keys = [(i, k) for i, d in enumerate(dicts) for k, v in d.items() if torch.is_tensor(v)]
    vals = read(*(dicts[i][k] for i, k in keys), label=label) if keys else []
    if len(keys) == 1:
        vals = [vals]
    out = [dict(d) for d in dicts]
    for (i, k), v in zip(keys, vals, strict=True):
        t = dicts[i][k]
        out[i][k] = float(v) if t.dim() == 0 and t.is_floating_point() else v
    return out
