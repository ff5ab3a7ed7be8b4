"""Reading FASTA (plain, gzip, bgzip) with Biopython, with one-line errors that name the file and record.

Design choices:
- Parsing is Biopython's ``SimpleFastaParser`` (the parser behind ``Bio.SeqIO.parse(handle, "fasta")``,
  without building ``Seq`` objects); the record name is the first word of the header, as ``record.id``.
- Compression is detected from the magic bytes, not the suffix. bgzip (BGZF) is a series of gzip members,
  so ``gzip.open`` streams it like plain gzip (UCSC's ``hg38.fa.gz`` is plain gzip).
- Decompression is ISA-L's (python-isal: ``isal.isal_zlib``, ``isal.igzip``; the same API as ``zlib`` and
  ``gzip``, about 3x faster to inflate), and the standard library's ``zlib``/``gzip`` where isal is not installed
  (:data:`GZIP_BACKEND` says which). Both give the same bytes; random access (bgzip's ``.gzi``) stays pyfaidx's.
- Text is decoded as latin-1 (one byte = one character) so that a stray non-ASCII byte reaches the
  tokenizer, which reports its offset, instead of failing as a Unicode error with no position.
- ``genoctx prepare`` reads through the fast streaming path, :class:`FastaStream`: a reader thread
  decompresses in blocks with ``zlib`` (it releases the GIL, so decompression overlaps tokenising on a
  second core) and the parser hands out raw sequence segments, line breaks included, in blocks of
  ``block_bytes``; the consumer strips and tokenises them in one ``bytes.translate`` pass
  (:func:`genoctx.data.tokenizer.encode_chunk`). Memory is O(block), whatever the record length.
  Biopython (:func:`iter_records`) stays the reference: tests check that both give the same records.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import queue
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

from Bio.SeqIO.FastaIO import SimpleFastaParser

from genoctx.errors import GenoctxError

try:  # ISA-L's inflate where python-isal is installed (a dependency), else the standard library's
    from isal import igzip as _gzip
    from isal import isal_zlib as _zlib

    GZIP_BACKEND = "isal"
except ImportError:  # pragma: no cover - tested in a subprocess that hides isal
    _gzip, _zlib = gzip, zlib
    GZIP_BACKEND = "zlib"

log = logging.getLogger(__name__)

crc32 = _zlib.crc32  # CRC-32 of a bytes-like object (running value as 2nd argument); ISA-L's equals zlib's, faster

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
        opener = _gzip.open if gz else open
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
    except (EOFError, zlib.error, _zlib.error, gzip.BadGzipFile) as e:
        raise FastaError(f"{path}: truncated or corrupt gzip after record {last!r}: {e}") from None
    except OSError as e:
        raise FastaError(f"{path}: cannot read FASTA: {e.strerror or e}") from None
    if not seen:
        raise FastaError(f"{path}: no FASTA records found (no line starts with '>')")


def locate_line(path: str | Path, record: str, offset: int) -> int | None:
    """1-based line number in ``path`` of base ``offset`` (0-based) of ``record``; None if not found.

    For error messages only: it re-reads the file from the start (line lengths may vary).
    """
    opener = _gzip.open if is_gzip(Path(path)) else open
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
    except (OSError, EOFError, zlib.error, _zlib.error):
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


# --------------------------------------------------------------------------------- fast streaming path

_WHITESPACE = b" \t\r\n\v\f"
_END = object()


def _decompressed_blocks(path: Path, gz: bool, block_bytes: int, stop: threading.Event) -> Iterator[bytes]:
    """Decompressed (or plain) bytes of ``path`` in pieces of at most ``block_bytes``.

    gzip members follow one another (bgzip, ``cat a.gz b.gz``); zero padding after the last is ignored.
    Inflated by :data:`GZIP_BACKEND` (ISA-L, or zlib without python-isal).

    Raises:
        FastaError: truncated or corrupt gzip (``_GzipError``); OSError passes through.
    """
    read_bytes = 1 << 20
    with open(path, "rb") as f:
        if not gz:
            while not stop.is_set() and (block := f.read(block_bytes)):
                yield block
            return
        d = _zlib.decompressobj(31)
        pending = b""
        while not stop.is_set():
            if not pending:
                pending = f.read(read_bytes)
                if not pending:
                    break
            try:
                out = d.decompress(pending, block_bytes)
            except (zlib.error, _zlib.error) as e:
                raise _GzipError(f"corrupt gzip: {e}") from None
            pending = d.unconsumed_tail
            if out:
                yield out
            if d.eof:  # end of one gzip member: the next one starts in unused_data (bgzip, concatenation)
                rest = d.unused_data  # (unconsumed_tail repeats it at eof)
                if not rest:
                    rest = f.read(read_bytes)
                if not rest:
                    return
                if not rest.startswith(_GZIP_MAGIC):
                    if rest.strip(b"\0") or f.read(read_bytes).strip(b"\0"):
                        raise _GzipError("trailing garbage after the last gzip member")
                    return
                d = _zlib.decompressobj(31)
                pending = rest
        if not stop.is_set() and not d.eof:
            raise _GzipError("truncated gzip (the stream ends inside a member)")


class _GzipError(Exception):
    pass


def _reader_thread(path: Path, gz: bool, block_bytes: int, out: queue.Queue, stop: threading.Event) -> None:
    try:
        for block in _decompressed_blocks(path, gz, block_bytes, stop):
            while not stop.is_set():
                try:
                    out.put(block, timeout=0.1)
                    break
                except queue.Full:
                    continue
        item: object = _END
    except BaseException as e:  # handed to the consumer, which raises it with context
        item = e
    while not stop.is_set():
        try:
            out.put(item, timeout=0.1)
            return
        except queue.Full:
            continue


def line_at(path: str | Path, offset: int) -> int:
    """1-based line number of byte ``offset`` of the decompressed text of ``path`` (for error messages)."""
    path = Path(path)
    line, seen = 1, 0
    stop = threading.Event()
    for block in _decompressed_blocks(path, is_gzip(path), 1 << 22, stop):
        if seen + len(block) > offset:
            return line + block.count(b"\n", 0, offset - seen)
        line += block.count(b"\n")
        seen += len(block)
    return line


class FastaStream:
    """Stream a FASTA file (plain, gzip, bgzip) record by record in bounded memory.

    ``for name, segments in FastaStream(path): for raw, offset in segments: ...`` — ``raw`` is a piece of
    the record's sequence exactly as in the file (line breaks and blank lines included; strip them with
    :func:`genoctx.data.tokenizer.encode_chunk`), ``offset`` its byte offset in the decompressed text
    (for :func:`line_at`). Pieces are at most ``block_bytes`` long. A record's ``segments`` must be
    consumed before the next record is asked for (like ``itertools.groupby``); unconsumed ones are skipped.

    Rules (the same as :func:`iter_records`, Biopython): the name is the first word of the header;
    empty records are skipped with a warning; a header without a name, a duplicate name, non-blank text
    before the first header and a file with no record are errors. After iteration, :attr:`names` lists the
    non-empty records in file order.

    Raises:
        FastaError: as above, and a missing/unreadable file or a truncated/corrupt gzip stream (naming the
            last record read). Nothing is yielded after an error.
    """

    def __init__(self, path: str | Path, block_bytes: int = 1 << 23, threaded: bool = True):
        self.path = Path(path)
        self.block_bytes = int(block_bytes)
        self.threaded = threaded
        self.names: list[str] = []

    # -- blocks from the reader (thread or inline)
    def _blocks(self) -> Iterator[bytes]:
        gz = is_gzip(self.path)
        stop = threading.Event()
        if not self.threaded:
            yield from self._guard(_decompressed_blocks(self.path, gz, self.block_bytes, stop))
            return
        q: queue.Queue = queue.Queue(maxsize=3)
        thread = threading.Thread(target=_reader_thread, args=(self.path, gz, self.block_bytes, q, stop), daemon=True)
        thread.start()
        try:
            while True:
                item = q.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    yield from self._guard(_raise(item))
                yield item
        finally:
            stop.set()
            thread.join()

    def _guard(self, blocks: Iterator[bytes]) -> Iterator[bytes]:
        last = self.names[-1] if self.names else "<before the first record>"
        try:
            yield from blocks
        except _GzipError as e:
            last = self.names[-1] if self.names else last
            raise FastaError(f"{self.path}: truncated or corrupt gzip after record {last!r}: {e}") from None
        except OSError as e:
            raise FastaError(f"{self.path}: cannot read FASTA: {e.strerror or e}") from None

    # -- events: ("header", name, offset) and ("seq", raw, offset)
    def _events(self) -> Iterator[tuple[str, bytes | str, int]]:
        header: bytearray | None = None
        header_offset = 0
        at_line_start = True
        base = 0  # offset of the block's first byte in the decompressed text
        started = False
        seen: set[str] = set()
        for block in self._blocks():
            pos, n = 0, len(block)
            while pos < n:
                if header is not None:
                    nl = block.find(b"\n", pos)
                    if nl < 0:
                        header += block[pos:]
                        if len(header) > 1 << 20:
                            raise FastaError(f"{self.path}: header line at byte {header_offset} is over 1 MiB")
                        pos = n
                        break
                    header += block[pos:nl]
                    pos, at_line_start = nl + 1, True
                    name = self._header_name(bytes(header), header_offset, seen)
                    header = None
                    started = True
                    yield ("header", name, header_offset)
                    continue
                if at_line_start and block[pos] == 0x3E:  # ">"
                    header, header_offset = bytearray(), base + pos
                    pos += 1
                    continue
                h = block.find(b">", pos)  # one-byte search (memchr): far faster than b"\n>" in DNA text
                while h >= 0 and (h == pos or block[h - 1] != 0x0A):  # h == pos: mid-line, not a header
                    h = block.find(b">", h + 1)  # a '>' inside a line: left for the tokenizer to reject
                end = n if h < 0 else h
                raw = block[pos:end] if (pos or end != n) else block
                at_line_start = raw.endswith(b"\n")
                if not started:
                    if not raw.isspace():
                        where = line_at(self.path, base + pos + len(raw) - len(raw.lstrip()))
                        raise FastaError(f"{self.path}: line {where}: text before the first '>' header")
                else:
                    yield ("seq", raw, base + pos)
                pos = end
            base += n
        if header is not None:
            name = self._header_name(bytes(header), header_offset, seen)
            yield ("header", name, header_offset)
            started = True
        if not started:
            raise FastaError(f"{self.path}: no FASTA records found (no line starts with '>')")

    def _header_name(self, header: bytes, offset: int, seen: set[str]) -> str:
        words = header.decode("latin-1").split(None, 1)
        if not words:
            last = self.names[-1] if self.names else "<before the first record>"
            line = line_at(self.path, offset)
            raise FastaError(f"{self.path}: line {line}: a header line after record {last!r} has no name")
        name = words[0]
        if name in seen:
            raise FastaError(f"{self.path}: line {line_at(self.path, offset)}: duplicate record name {name!r}")
        seen.add(name)
        return name

    def __iter__(self) -> Iterator[tuple[str, Iterator[tuple[bytes, int]]]]:
        events = self._events()
        pending: tuple[str, bytes | str, int] | None = None

        def next_event():
            nonlocal pending
            if pending is not None:
                ev, pending = pending, None
                return ev
            return next(events, None)

        ev = next_event()
        while ev is not None:
            kind, name, _ = ev
            assert kind == "header"
            # skip blank segments; a record with no base is empty
            first = None
            while (ev := next_event()) is not None:
                if ev[0] != "seq":
                    pending = ev  # the next header: this record is empty
                    break
                if not ev[1].isspace():
                    first = ev
                    break
            if first is None:
                log.warning("%s: record %r is empty; skipped", self.path, name)
                ev = next_event()
                continue
            self.names.append(str(name))
            done = False

            def segments(first=first):
                nonlocal pending, done
                yield first[1], first[2]
                while (e := next_event()) is not None:
                    if e[0] != "seq":
                        pending = e
                        break
                    yield e[1], e[2]
                done = True

            seg_iter = segments()
            yield str(name), seg_iter
            if not done:  # the consumer stopped early: drain
                for _ in seg_iter:
                    pass
            ev = next_event()


def _raise(e: BaseException) -> Iterator[bytes]:
    raise e
    yield b""  # pragma: no cover
