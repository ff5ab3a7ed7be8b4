"""A repeat-aware reference model for ``eval --by-position``: how much far context can give on this DNA.

(Interface stub: the scoring kernel lands in the next commit; until then ``token_losses`` is the static chain's.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import GenoctxError
from .markov import MAX_ORDER, MarkovModel, fit_markov

ORDER = 12  # static context order (fitted on the training split)
KMER = 12  # seed length of repeat experts, bases
EXPERTS = 16  # most repeat experts alive at once


@dataclass
class RepeatModel:
    """A mixture of order-k context models and repeat experts (forward and reverse-complement copies).

    Attributes:
        static: the order-``order`` chain fitted on the training split (``markov.MarkovModel``).
        kmer: seed length of repeat experts (bases).
        max_experts: most repeat experts alive at once.
    """

    static: MarkovModel
    kmer: int = KMER
    max_experts: int = EXPERTS

    @property
    def name(self) -> str:
        return "repeat"

    def describe(self) -> dict:
        """The model's fields in the eval document's ``models`` entry (beside ``name``, ``kind``, ``path``)."""
        return {"order": self.static.order, "kmer": self.kmer, "experts": self.max_experts,
                "train_tokens": self.static.tokens_seen}  # fmt: skip

    def token_losses(self, tokens: np.ndarray) -> np.ndarray:
        """Next-base loss of every position of one window, in nats (float64 [W]); 0 where not scored."""
        return self.static.token_losses(tokens)


def check_repeat_args(order: int, kmer: int, max_experts: int) -> None:
    """One-line errors for bad flags (before anything is fitted or scored).

    Raises:
        GenoctxError: ``--repeat-order`` outside 0..MAX_ORDER, ``--repeat-kmer`` outside 4..16, ``--repeat-experts``
            outside 1..256.
    """
    if not 0 <= order <= MAX_ORDER:
        raise GenoctxError(f"--repeat-order {order}: the order must be between 0 and {MAX_ORDER}")
    if not 4 <= kmer <= 16:
        raise GenoctxError(f"--repeat-kmer {kmer}: the seed length must be between 4 and 16 bases")
    if not 1 <= max_experts <= 256:
        raise GenoctxError(f"--repeat-experts {max_experts}: must be between 1 and 256")


def fit_repeat(data_dir: str | Path, order: int = ORDER, kmer: int = KMER, max_experts: int = EXPERTS,
               split: str = "train") -> RepeatModel:  # fmt: skip
    """The repeat reference with its static chain fitted on ``split`` (default: train) of a prepared directory.

    Raises:
        GenoctxError: bad parameters (:func:`check_repeat_args`), an empty split, a split without A/C/G/T.
    """
    check_repeat_args(order, kmer, max_experts)
    return RepeatModel(fit_markov(data_dir, order, 1.0, split), kmer, max_experts)
