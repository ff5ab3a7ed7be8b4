"""The planner: a config x sequence length x parallel layout (x hardware) -> bytes per GPU by component and phase.

Modules, in reading order:

- ``sizes``: units, parameter counts and shard sizes, per-token activation sizes of each layer kind;
- ``memory``: ``plan_memory``, the peak of one training step on the busiest rank (its docstring: the method and
  the assumptions);
- ``eval_memory``: ``plan_eval``, the peak of scoring one window (forward only);
- ``comms``: bytes sent per step by collective;
- ``search``: every layout of a number of GPUs, planned and sorted; the sequence chunk that makes a plan fit;
- ``report``: a plan in words, the one-line error of a plan that does not fit, the table.

This module re-exports the public names, so ``from genoctx.plan import plan_memory`` reads as before.
"""

from __future__ import annotations

from .comms import all_to_all_bytes
from .eval_memory import EVAL_COMPONENTS, EVAL_WORKING_SETS, plan_eval
from .memory import plan_memory
from .report import check_fits, describe_layout, format_table
from .search import SEQ_CHUNK_CANDIDATES, best_seq_chunk, search_layouts, seq_chunk_hint, valid_layouts
from .sizes import (
    ALLOCATOR_SLACK,
    COMPONENTS,
    DTYPE_BYTES,
    GIB,
    WORKING_SETS,
    param_counts,
    seq_chunk_boundary_bytes,
    shard_numel,
)  # fmt: skip

__all__ = [
    "ALLOCATOR_SLACK", "COMPONENTS", "DTYPE_BYTES", "EVAL_COMPONENTS", "EVAL_WORKING_SETS", "GIB",
    "SEQ_CHUNK_CANDIDATES", "WORKING_SETS", "all_to_all_bytes", "best_seq_chunk", "check_fits", "describe_layout",
    "format_table", "param_counts", "plan_eval", "plan_memory", "search_layouts", "seq_chunk_boundary_bytes",
    "seq_chunk_hint", "shard_numel", "valid_layouts",
]  # fmt: skip
