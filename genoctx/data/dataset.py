"""Torch Dataset over prepared windows: shards are memory-mapped read-only, windows sliced by offset.

The only module of ``genoctx/data`` that imports torch. Reads what ``genoctx prepare``
(:func:`genoctx.data.windows.prepare`) wrote; see that module for the directory layout.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from genoctx.data.tokenizer import PAD, VOCAB, T
from genoctx.data.windows import read_manifest
from genoctx.errors import GenoctxError


def load_manifest(data_dir: str | Path) -> dict:
    """Load ``DATA_DIR/manifest.json`` and check its format and vocabulary.

    Raises:
        GenoctxError: missing or invalid manifest, or a vocabulary other than this genoctx's
            (the message names the path).
    """
    manifest = read_manifest(data_dir)
    if tuple(manifest["vocabulary"]) != VOCAB:
        raise GenoctxError(
            f"{Path(data_dir) / 'manifest.json'}: vocabulary {manifest['vocabulary']} differs from {list(VOCAB)}"
        )
    return manifest


def scored_mask(tokens: torch.Tensor) -> torch.Tensor:
    """Positions that count in the loss: True for A/C/G/T (ids 0..3), False for N and specials.

    Args:
        tokens: integer tensor of any shape, e.g. LongTensor [B, W].
    Returns:
        BoolTensor of the same shape.
    """
    return (tokens >= 0) & (tokens <= T)


class WindowDataset(Dataset):
    """The windows of one split of a prepared directory.

    ``ds[i]`` is a dict: ``tokens`` LongTensor [W] (token ids, PAD after the end of a partial window),
    ``softmask`` BoolTensor [W] (True = soft-masked repeat; False on padding), ``chrom`` str,
    ``start``/``end`` int (0-based half-open coordinates in the chromosome; ``end - start <= W``).
    ``W`` is :attr:`window`. Shards are opened lazily with ``np.memmap(mode="r")`` in each process, so the
    dataset can be handed to DataLoader workers.

    Raises (from ``__init__``):
        GenoctxError: invalid manifest; ``split`` has no windows (the available splits are named); a shard
            file missing or of the wrong size.
    """

    def __init__(self, data_dir: str | Path, split: str):
        self.data_dir = Path(data_dir)
        self.manifest = load_manifest(self.data_dir)
        self.split = split
        self.window = int(self.manifest["window"])
        self.policies = self.manifest["policies"]
        self.windows = [w for w in self.manifest["windows"] if w["split"] == split]
        if not self.windows:
            available = sorted({w["split"] for w in self.manifest["windows"]})
            raise GenoctxError(
                f"{self.data_dir}: split {split!r} has no windows; available: {', '.join(available) or 'none'}"
            )
        self.shards = self.manifest["shards"]
        for index in sorted({w["shard"] for w in self.windows}):
            shard = self.shards[index]
            for key in ("tokens", "softmask"):
                path = self.data_dir / shard[key]
                if not path.is_file() or path.stat().st_size != shard["length"]:
                    raise GenoctxError(
                        f"{path}: shard missing or not {shard['length']} bytes; run `genoctx prepare` again"
                    )
        self._maps: dict[int, tuple[np.memmap, np.memmap]] = {}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_maps"] = {}  # memmaps are reopened in each worker
        return state

    def _open(self, index: int) -> tuple[np.memmap, np.memmap]:
        if index not in self._maps:
            shard = self.shards[index]
            self._maps[index] = (
                np.memmap(self.data_dir / shard["tokens"], dtype=np.uint8, mode="r"),
                np.memmap(self.data_dir / shard["softmask"], dtype=np.uint8, mode="r"),
            )
        return self._maps[index]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict:
        w = self.windows[i]
        tok_map, sm_map = self._open(w["shard"])
        off, n = w["offset"], w["end"] - w["start"]
        tokens = np.full(self.window, PAD, dtype=np.int64)
        tokens[:n] = tok_map[off : off + n]
        softmask = np.zeros(self.window, dtype=bool)
        softmask[:n] = sm_map[off : off + n] != 0
        return {
            "tokens": torch.from_numpy(tokens),
            "softmask": torch.from_numpy(softmask),
            "chrom": w["chrom"],
            "start": w["start"],
            "end": w["end"],
        }
