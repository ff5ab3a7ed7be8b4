"""Bytes that cross the network in one step, by collective."""

from __future__ import annotations

from ..model.config import ModelConfig
from ..parallel.layout import Layout


def all_to_all_bytes(cfg: ModelConfig, tokens: int, layout: Layout, a: int, passes: int) -> float:
    """Bytes one rank sends by expert-parallel all-to-all in a step over ``tokens`` tokens, with balanced routing:
    per MoE layer, ``tokens x k`` rows of which ``(ep - 1) / ep`` belong to another rank's experts, ``D`` values of
    ``a`` bytes each per exchange, ``passes`` exchanges (``genoctx.parallel.experts``: a forward dispatches the hidden
    states and combines the outputs, 2; its backward sends hidden states and output gradients and returns input
    gradients and outputs, 4; a forward recomputed under activation checkpointing, 2 more; balanced, a rank sends
    as many rows as it receives). 0 without EP. Forced-imbalanced routing moves up to ``ep`` times more through the
    busiest rank (in more rounds of the same bounded size)."""
    if layout.ep == 1:
        return 0.0
    moe = sum(1 for t in cfg.mlp_layer_types if t == "sparse")
    rows = tokens * cfg.num_experts_per_tok * (layout.ep - 1) / layout.ep
    return moe * rows * cfg.hidden_size * a * passes
