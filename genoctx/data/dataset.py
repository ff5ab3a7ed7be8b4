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

MAX_WINDOW = 1 << 30  # tokens (1G): a sanity bound on a manifest's window (hg38's chr1: 248,956,422 bases)


def data_root(data_dir: str | Path) -> Path:
    """The prepared directory: ``data_dir`` itself, or the folder of the ``manifest.json`` given instead
    (the same rule as :func:`genoctx.data.windows.read_manifest`)."""
    p = Path(data_dir)
    return p.parent if p.suffix == ".json" and not p.is_dir() else p


def load_manifest(data_dir: str | Path) -> dict:
    """Load ``DATA_DIR/manifest.json`` (``data_dir`` may be the manifest file itself) and check its format,
    vocabulary and the types and ranges of every shard and window entry (:func:`check_manifest`).

    Raises:
        GenoctxError: missing or invalid manifest, or a vocabulary other than this genoctx's
            (the message names the path).
    """
    manifest = read_manifest(data_dir)
    path = data_root(data_dir) / "manifest.json"
    vocabulary = manifest["vocabulary"]
    if not isinstance(vocabulary, list) or tuple(vocabulary) != VOCAB:
        raise GenoctxError(f"{path}: vocabulary {_short(vocabulary)} differs from {list(VOCAB)}")
    check_manifest(manifest, path)
    return manifest


def _short(value, limit: int = 60) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_manifest(manifest: dict, path: str | Path = "manifest.json") -> None:
    """Check what readers of a prepared directory rely on: ``policies`` a mapping, ``window`` in
    1..MAX_WINDOW, each shard ``{tokens: str, softmask: str, length: int >= 0}``, each window
    ``{split: str, chrom: str, shard: index into shards, offset, start, end: int}`` with ``0 <= start < end``,
    ``end - start <= window`` and ``offset + end - start <= `` its shard's length.

    Raises:
        GenoctxError: the first entry that breaks a rule; the message names ``path``, the entry and its value.
    """

    def bad(what: str, value) -> None:
        raise GenoctxError(f"{path}: {what}, got {_short(value)}")

    if not isinstance(manifest.get("policies"), dict):
        bad("policies must be a mapping", manifest.get("policies"))
    window = manifest.get("window")
    if not _is_int(window) or not 1 <= window <= MAX_WINDOW:
        bad(f"window must be an integer in 1..{MAX_WINDOW}", window)
    shards, windows = manifest.get("shards"), manifest.get("windows")
    if not isinstance(shards, list):
        bad("shards must be a list", shards)
    if not isinstance(windows, list):
        bad("windows must be a list", windows)
    for i, shard in enumerate(shards):
        if not isinstance(shard, dict):
            bad(f"shards[{i}] must be a mapping", shard)
        for key in ("tokens", "softmask"):
            if not isinstance(shard.get(key), str) or not shard[key]:
                bad(f"shards[{i}].{key} must be a file name", shard.get(key))
        if not _is_int(shard.get("length")) or shard["length"] < 0:
            bad(f"shards[{i}].length must be an integer >= 0", shard.get("length"))
    for i, w in enumerate(windows):
        if not isinstance(w, dict):
            bad(f"windows[{i}] must be a mapping", w)
        for key in ("split", "chrom"):
            if not isinstance(w.get(key), str):
                bad(f"windows[{i}].{key} must be a string", w.get(key))
        for key in ("shard", "offset", "start", "end"):
            if not _is_int(w.get(key)) or w[key] < 0:
                bad(f"windows[{i}].{key} must be an integer >= 0", w.get(key))
        if w["shard"] >= len(shards):
            bad(f"windows[{i}].shard must index one of the {len(shards)} shards", w["shard"])
        n, length = w["end"] - w["start"], shards[w["shard"]]["length"]
        if not 0 < n <= window:
            raise GenoctxError(
                f"{path}: windows[{i}] must hold 1..{window} bases (the window), got start {w['start']} end {w['end']}"
            )
        if w["offset"] + n > length:
            raise GenoctxError(
                f"{path}: windows[{i}] ends beyond its shard's {length} bases, got offset {w['offset']} + {n} bases"
            )


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
        """``data_dir``: the prepared directory, or its ``manifest.json``."""
        self.data_dir = data_root(data_dir)
        self.manifest = load_manifest(data_dir)
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
