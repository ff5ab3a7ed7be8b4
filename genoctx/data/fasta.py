"""Reading FASTA (plain, gzip, bgzip) with Biopython, with one-line errors that name the file and record.

Design choices:
- Parsing is Biopython's ``SimpleFastaParser`` (the parser behind ``Bio.SeqIO.parse(handle, "fasta")``,
  without building ``Seq`` objects); the record name is the first word of the header, as ``record.id``.
- Compression is detected from the magic bytes, not the suffix. bgzip (BGZF) is a series of gzip members,
  so ``gzip.open`` streams it like plain gzip (UCSC's ``hg38.fa.gz`` is plain gzip).
- Text is decoded as latin-1 (one byte = one character) so that a stray non-ASCII byte reaches the
  tokenizer, which reports its offset, instead of failing as a Unicode error with no position.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import zlib
from collections.abc import Iterator
from pathlib import Path

from Bio.SeqIO.FastaIO import SimpleFastaParser

from genoctx.errors import GenoctxError

log = logging.getLogger(__name__)

_GZIP_MAGIC = b"\x1f\x8b"


class FastaError(GenoctxError):
    """A FASTA file cannot be read: missing, corrupt or truncated gzip, duplicate or empty records."""


def is_gzip(path: Path) -> bool:
    """True if ``path`` starts with the gzip magic bytes (plain gzip or bgzip)."""
    try:
        with open(path, "rb") as f:
            return f.read(2) == _GZIP_MAGIC
    except OSError as e:
        raise FastaError(f"{path}: cannot open FASTA: {e.strerror or e}") from None


def iter_records(path: str | Path) -> Iterator[tuple[str, bytes]]:
    """Stream the records of a FASTA file (plain, gzip or bgzip), one at a time.

    Args:
        path: the FASTA file.

    Yields:
        ``(name, sequence)``: ``name`` is the first word of the header line, ``sequence`` the record's
        bases as ASCII bytes (line breaks removed, case kept).

    Raises:
        FastaError: the file is missing or unreadable; the gzip stream is truncated or corrupt (the
            message names the last record read); a header has no name; two records share a name;
            the file holds no record. Empty records are skipped with a warning.
    """
    path = Path(path)
    gz = is_gzip(path)
    seen: set[str] = set()
    last = "<before the first record>"
    try:
        opener = gzip.open if gz else open
        with opener(path, "rt", encoding="latin-1") as handle:
            for title, seq in SimpleFastaParser(handle):
                words = title.split(None, 1)
                if not words:
                    raise FastaError(f"{path}: a header line after record {last!r} has no name")
                name = words[0]
                if name in seen:
                    raise FastaError(f"{path}: duplicate record name {name!r}")
                seen.add(name)
                last = name
                if not seq:
                    log.warning("%s: record %r is empty; skipped", path, name)
                    continue
                yield name, seq.encode("latin-1")
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise FastaError(f"{path}: truncated or corrupt gzip after record {last!r}: {e}") from None
    except OSError as e:
        raise FastaError(f"{path}: cannot read FASTA: {e.strerror or e}") from None
    if not seen:
        raise FastaError(f"{path}: no FASTA records found (no line starts with '>')")


def locate_line(path: str | Path, record: str, offset: int) -> int | None:
    """1-based line number in ``path`` of base ``offset`` (0-based) of ``record``; None if not found.

    For error messages only: it re-reads the file from the start (line lengths may vary).
    """
    opener = gzip.open if is_gzip(Path(path)) else open
    try:
        with opener(path, "rt", encoding="latin-1") as handle:
            inside, seen = False, 0
            for number, line in enumerate(handle, start=1):
                if line.startswith(">"):
                    words = line[1:].split(None, 1)
                    inside = bool(words) and words[0] == record
                    continue
                if inside:
                    seen += len(line.rstrip().replace(" ", "").replace("\r", ""))
                    if offset < seen:
                        return number
    except (OSError, EOFError, zlib.error):
        return None
    return None


def record_names(path: str | Path) -> list[str]:
    """Names of the non-empty records of ``path`` in file order (reads the whole file; same errors)."""
    return [name for name, _ in iter_records(path)]


def fasta_md5(path: str | Path, chunk_bytes: int = 1 << 22) -> str:
    """Hex md5 of the file's bytes (compressed bytes for a .gz), read in chunks of ``chunk_bytes``.

    Raises:
        FastaError: the file is missing or unreadable.
    """
    h = hashlib.md5()
    try:
        with open(path, "rb") as f:
            while block := f.read(chunk_bytes):
                h.update(block)
    except OSError as e:
        raise FastaError(f"{path}: cannot read FASTA: {e.strerror or e}") from None
    return h.hexdigest()
