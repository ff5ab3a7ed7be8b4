"""Single-nucleotide vocabulary with a soft-mask channel, vectorised with 256-entry lookup tables.

Design choices:
- One token per base. ``A C G T`` are ids 0..3 so that the complement of a base is ``3 - id``; ``N`` is 4;
  three specials follow (``<pad>``, ``<bos>``, ``<eos>``), 8 ids in all. This is the character-level
  vocabulary of HyenaDNA (Nguyen et al., 2023) trimmed to what genoctx uses.
- Case is not part of the token: UCSC soft-masks repeats (RepeatMasker + TRF) in lower case; ``encode``
  returns the case as a separate boolean channel (``softmask``), so the loss may weight repeats (Evo 2
  weights them 0.1) without doubling the vocabulary.
- IUPAC ambiguity codes (R Y K M S W B D H V) become ``N``: they are never scored, like ``N``.
- Any other byte is an error (:class:`InvalidBaseError`), never silently mapped.

No torch here: this module is numpy only (``genoctx/data`` imports torch in ``dataset.py`` only).
"""

from __future__ import annotations

import numpy as np

from genoctx.errors import GenoctxError

VOCAB: tuple[str, ...] = ("A", "C", "G", "T", "N", "<pad>", "<bos>", "<eos>")
A, C, G, T, N, PAD, BOS, EOS = range(8)
VOCAB_SIZE = len(VOCAB)
SCORED_IDS: tuple[int, ...] = (A, C, G, T)
IUPAC_CODES = "RYKMSWBDHV"

_INVALID = 255  # marker in the lookup table for a byte that is not a base


class InvalidBaseError(GenoctxError):
    """A byte in a sequence is not a nucleotide (ACGTN, either case) nor an IUPAC ambiguity code.

    Attributes ``offset`` (0-based position in the sequence) and ``byte`` (int) let callers add the file,
    record and line to the message.
    """

    def __init__(self, offset: int, byte: int):
        self.offset = offset
        self.byte = byte
        super().__init__(f"invalid base {chr(byte)!r} (byte 0x{byte:02x}) at offset {offset} (0-based)")


def _build_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    token = np.full(256, _INVALID, dtype=np.uint8)
    lower = np.zeros(256, dtype=bool)
    iupac = np.zeros(256, dtype=bool)
    for i, base in enumerate("ACGTN"):
        token[ord(base)] = i
        token[ord(base.lower())] = i
        lower[ord(base.lower())] = True
    for code in IUPAC_CODES:
        token[ord(code)] = N
        token[ord(code.lower())] = N
        lower[ord(code.lower())] = True
        iupac[ord(code)] = True
        iupac[ord(code.lower())] = True
    return token, lower, iupac


_TOKEN_LUT, _LOWER_LUT, _IUPAC_LUT = _build_tables()
_UPPER_CHARS = np.frombuffer(b"ACGTN", dtype=np.uint8)
_LOWER_CHARS = np.frombuffer(b"acgtn", dtype=np.uint8)
_COMPLEMENT_LUT = np.array([T, G, C, A, N, PAD, BOS, EOS], dtype=np.uint8)


def _as_bytes_array(seq: bytes | bytearray | memoryview | str | np.ndarray) -> np.ndarray:
    if isinstance(seq, str):
        try:
            seq = seq.encode("ascii")
        except UnicodeEncodeError as e:
            raise InvalidBaseError(e.start, ord(seq[e.start]) & 0xFF) from None
    if isinstance(seq, np.ndarray):
        if seq.dtype != np.uint8 or seq.ndim != 1:
            raise TypeError(f"encode expects a 1-D uint8 array of ASCII bytes, got {seq.dtype} {seq.shape}")
        return seq
    return np.frombuffer(seq, dtype=np.uint8)


def encode(seq: bytes | str | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Map a nucleotide sequence to token ids and a soft-mask channel (vectorised table lookup).

    Args:
        seq: ASCII bases as ``bytes``/``str`` or a 1-D ``uint8`` array of length L.

    Returns:
        ``(tokens, softmask)``: ``tokens`` uint8 [L] with ids A=0 C=1 G=2 T=3 N=4 (IUPAC codes → N);
        ``softmask`` bool [L], True where the input base was lower case.

    Raises:
        InvalidBaseError: on the first byte that is not ACGTN or an IUPAC code (either case); it names
            the 0-based offset and the byte.
    """
    raw = _as_bytes_array(seq)
    tokens = _TOKEN_LUT[raw]
    if tokens.size and tokens.max() == _INVALID:
        offset = int(np.flatnonzero(tokens == _INVALID)[0])
        raise InvalidBaseError(offset, int(raw[offset]))
    return tokens, _LOWER_LUT[raw]


_STRIP = b" \t\r\n\v\f"  # deleted by encode_chunk (line breaks, blank lines, stray spaces)
_TOKEN_TABLE = _TOKEN_LUT.tobytes()
_LOWER_TABLE = _LOWER_LUT.astype(np.uint8).tobytes()
_INVALID_BYTE = bytes([_INVALID])


def encode_chunk(raw: bytes, softmask: bool = True) -> tuple[bytes, bytes | None]:
    """Tokenise a raw piece of FASTA sequence text in one pass: whitespace removed, bases mapped.

    The fast path of ``genoctx prepare``: ``bytes.translate`` with a 256-entry table and a delete set,
    equal to :func:`encode` on the text with line breaks removed (tested on the real hg38 pieces).

    Args:
        raw: sequence text as in the file, line breaks (``\\n``, ``\\r\\n``), blank lines, spaces and tabs
            allowed (they are removed); no header lines.
        softmask: also return the soft-mask channel.

    Returns:
        ``(tokens, mask)``: ``tokens`` bytes [L] of ids A=0 C=1 G=2 T=3 N=4 (IUPAC codes → N), ``mask``
        bytes [L] of 0/1 (1 = lower case) or None when ``softmask`` is False. L = non-whitespace bytes.

    Raises:
        InvalidBaseError: the first byte that is neither a base, an IUPAC code nor whitespace; its
            ``offset`` is the 0-based position in ``raw`` (not in the stripped sequence).
    """
    tokens = raw.translate(_TOKEN_TABLE, _STRIP)
    if _INVALID_BYTE in tokens:
        arr = np.frombuffer(raw, dtype=np.uint8)
        bad = (_TOKEN_LUT[arr] == _INVALID) & ~np.isin(arr, np.frombuffer(_STRIP, dtype=np.uint8))
        offset = int(np.flatnonzero(bad)[0])
        raise InvalidBaseError(offset, int(arr[offset]))
    return tokens, (raw.translate(_LOWER_TABLE, _STRIP) if softmask else None)


def count_iupac(seq: bytes | str | np.ndarray) -> int:
    """Number of IUPAC ambiguity codes (R Y K M S W B D H V, either case) in ``seq``."""
    return int(np.count_nonzero(_IUPAC_LUT[_as_bytes_array(seq)]))


def decode(tokens: np.ndarray, softmask: np.ndarray | None = None) -> str:
    """Inverse of :func:`encode` (IUPAC codes come back as N).

    Args:
        tokens: integer array [L] of ids in 0..4 (A C G T N). Accepts numpy arrays, lists or CPU tensors.
        softmask: optional bool array [L]; True positions are written in lower case.

    Raises:
        ValueError: a token is a special (``<pad>``, ``<bos>``, ``<eos>``) or out of range, or the
            soft-mask length differs.
    """
    ids = np.asarray(tokens).astype(np.int64, copy=False).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() > N):
        bad = int(np.flatnonzero((ids < 0) | (ids > N))[0])
        name = VOCAB[ids[bad]] if 0 <= ids[bad] < VOCAB_SIZE else str(int(ids[bad]))
        raise ValueError(f"cannot decode token {name} at offset {bad}: only A C G T N are bases")
    chars = _UPPER_CHARS[ids]
    if softmask is not None:
        mask = np.asarray(softmask).astype(bool, copy=False).reshape(-1)
        if mask.shape != ids.shape:
            raise ValueError(f"softmask length {mask.size} != tokens length {ids.size}")
        chars = np.where(mask, _LOWER_CHARS[ids], chars)
    return chars.tobytes().decode("ascii")


def reverse_complement(tokens: np.ndarray) -> np.ndarray:
    """Reverse complement of token ids [L] (uint8 in and out): A<->T, C<->G (``3 - id``); N, specials kept.

    The soft-mask channel, if any, is simply reversed by the caller (``softmask[::-1]``).
    """
    ids = np.asarray(tokens)
    if ids.size and (ids.min() < 0 or ids.max() >= VOCAB_SIZE):
        raise ValueError(f"token ids must be in 0..{VOCAB_SIZE - 1}")
    return _COMPLEMENT_LUT[ids[::-1].astype(np.int64, copy=False)]
