"""Windowing, N-gap policy, shard writer and manifest: the ``genoctx prepare`` verb's engine.

Layout of a prepared directory ``OUT``::

    OUT/manifest.json                 written last; the only file readers need to start from
    OUT/.genoctx.lock                 the writers' lock (genoctx.lock); empty when no prepare is running
    OUT/shards/{chrom}.tokens.u8      the whole record as raw uint8 token ids (np.memmap-able)
    OUT/shards/{chrom}.softmask.u8    0/1 per base (1 = lower case in the FASTA); all 0 with uppercase_only
    OUT/shards/{chrom}.json           sidecar: md5s, counts and the arguments that produced the shard

Design choices:
- One shard per chromosome, holding the whole record. A window is ``(shard, offset, start, end)``; windows
  are never copied, so an overlapping stride costs nothing on disk. Windows never cross chromosomes.
- The N policy is "never scored": windows whose N fraction exceeds ``max_n_fraction`` are skipped and
  counted; the N inside kept windows stay as token N and are masked from the loss downstream.
- The split is by chromosome (default: chr22 held out for eval, every other record trains).
- One writer per ``OUT``: a run holds :func:`genoctx.lock.output_lock` from before it reads an existing
  manifest until its own manifest is written; a second run into the same folder is refused with the first
  one's PID (or, with ``wait=True``, waits for it and then finds the folder prepared).
- Every file is written atomically (temporary name in the same folder, fsync, ``os.replace``). A rerun with
  the same arguments reuses shards whose bytes still match the md5 in their sidecar; a rerun with other
  arguments into a directory prepared differently is refused, naming each argument that differs. On a user
  error nothing written by the run is left behind.
- A record shorter than the window gives no window unless partial windows are kept: an error for a record
  asked for by name, a warning naming each such record for the default split (every record of the FASTA).
- Counting N and soft-masked bases per window uses block prefix sums (4096-base blocks), so it costs
  O(length + windows x block) whatever the stride.

No torch here (``genoctx/data`` imports torch in ``dataset.py`` only).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version
from pathlib import Path
from typing import Any

import numpy as np

from genoctx.data.fasta import FastaError, FastaStream, crc32, fasta_md5, is_gzip, line_at
from genoctx.data.tokenizer import VOCAB, InvalidBaseError, N, encode_chunk
from genoctx.errors import GenoctxError
from genoctx.lock import OutputLock, output_lock

log = logging.getLogger(__name__)

FORMAT = "genoctx-windows"
FORMAT_VERSION = 1
DEFAULT_EVAL_CHROMS = ("chr22",)
_COUNT_BLOCK = 4096
_WS = b" \t\r\n\v\f"
_SIZE_RE = re.compile(r"^\s*([0-9]+)\s*([kKmMgG]?)\s*$")  # ASCII digits only (\d takes any script's)
_SIZE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
try:  # the distribution's version (works even where an old editable install sees genoctx as a namespace)
    GENOCTX_VERSION = _dist_version("genoctx")
except PackageNotFoundError:
    GENOCTX_VERSION = "unknown"


# ----------------------------------------------------------------------------------------------- sizes


def parse_size(value: int | str) -> int:
    """Parse a window or stride size: an int, or a string with a binary suffix.

    ``"4096" -> 4096``, ``"16k"``/``"16K" -> 16384``, ``"512k" -> 524288``, ``"1M"``/``"1m" -> 1048576``,
    ``"1G" -> 1073741824`` (k = 1024, M = 1024², G = 1024³; ``m`` means mega, never milli).

    Raises:
        GenoctxError: not a positive whole number of bases (e.g. ``"1.5M"``, ``"16kb"``, ``0``, ``-1``).
    """
    if isinstance(value, bool):
        raise GenoctxError(f"invalid size {value!r}: expected a number of bases such as 16k, 512k or 1M")
    if isinstance(value, int | np.integer):
        size = int(value)
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        size = int(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    elif isinstance(value, str) and re.match(r"^\s*-[0-9]+\s*[kKmMgG]?\s*$", value):
        size = -1
    else:
        raise GenoctxError(f"invalid size {value!r}: expected a number of bases such as 16k, 512k or 1M")
    if size <= 0:
        raise GenoctxError(f"invalid size {value!r}: must be positive")
    return size


# --------------------------------------------------------------------------------------------- windows


def plan_windows(length: int, window: int, stride: int | None = None, drop_last: bool = True) -> list[tuple[int, int]]:
    """Windows over a record of ``length`` bases: 0-based half-open ``(start, end)``, starts at 0, stride, ...

    Every full window ``[s, s + window)`` with ``s + window <= length`` is listed. The first start past the
    last full window that is still inside the record gives one partial window ``[s, length)``: it is
    dropped when ``drop_last`` (the default) and kept otherwise (padded with PAD to ``window`` at load
    time). Later starts would give partial windows contained in that one and are never listed.

    Raises:
        GenoctxError: ``window`` or ``stride`` not positive, or ``length`` negative.
    """
    full, partial = _plan(length, window, window if stride is None else stride)
    return full if drop_last or partial is None else [*full, partial]


def _plan(length: int, window: int, stride: int) -> tuple[list[tuple[int, int]], tuple[int, int] | None]:
    if window <= 0 or stride <= 0:
        raise GenoctxError(f"window ({window}) and stride ({stride}) must be positive")
    if length < 0:
        raise GenoctxError(f"record length must be non-negative, got {length}")
    n_full = 0 if length < window else (length - window) // stride + 1
    full = [(s, s + window) for s in range(0, n_full * stride, stride)]
    s = n_full * stride
    partial = (s, length) if s < length else None
    return full, partial


class _RangeCounter:
    """Count positions where ``pred(arr)`` holds inside any ``[s, e)`` via per-block prefix sums.

    ``block_counts`` (int64 [len(arr) // block]) may be given when they were counted while streaming.
    """

    def __init__(
        self,
        arr: np.ndarray,
        pred: Callable[[np.ndarray], np.ndarray],
        block: int = _COUNT_BLOCK,
        block_counts: np.ndarray | None = None,
    ):
        self.arr, self.pred, self.block = arr, pred, block
        nb = arr.shape[0] // block
        if block_counts is not None:
            counts = block_counts[:nb]
        else:
            counts = np.empty(nb, dtype=np.int64)
            step = max(1, (1 << 24) // block)  # bound the temporary bool array to 16M elements
            for i in range(0, nb, step):
                j = min(nb, i + step)
                counts[i:j] = pred(arr[i * block : j * block]).reshape(j - i, block).sum(axis=1)
        self.cum = np.zeros(nb + 1, dtype=np.int64)
        np.cumsum(counts, out=self.cum[1:])

    def _direct(self, s: int, e: int) -> int:
        return int(np.count_nonzero(self.pred(self.arr[s:e]))) if e > s else 0

    def count(self, s: int, e: int) -> int:
        b = self.block
        bs, be = -(-s // b), e // b
        if bs >= be:
            return self._direct(s, e)
        return int(self.cum[be] - self.cum[bs]) + self._direct(s, bs * b) + self._direct(be * b, e)


class _BlockCounter:
    """Streaming per-block counts of N tokens over consecutive chunks of one record (chunks without N
    cost nothing: their blocks are known to be 0)."""

    def __init__(self, block: int = _COUNT_BLOCK):
        self.block = block
        self.parts: list[np.ndarray | int] = []  # arrays of counts, or an int = that many zero blocks
        self.fill = 0  # bases in the current partial block
        self.cur = 0

    def add(self, tokens: bytes, n_total: int) -> None:
        """Add one chunk (``n_total`` = number of N in ``tokens``, already counted)."""
        b, size, pos = self.block, len(tokens), 0
        if self.fill:
            take = min(b - self.fill, size)
            self.cur += tokens.count(4, 0, take) if n_total else 0
            self.fill += take
            pos = take
            if self.fill == b:
                self.parts.append(np.array([self.cur], np.int64))
                self.fill = self.cur = 0
        k = (size - pos) // b
        if k:
            if n_total:
                a = np.frombuffer(tokens, np.uint8, count=k * b, offset=pos).reshape(k, b)
                self.parts.append(np.count_nonzero(a == 4, axis=1).astype(np.int64))
            else:
                self.parts.append(k)
            pos += k * b
        if pos < size:
            self.cur += tokens.count(4, pos) if n_total else 0
            self.fill += size - pos

    def counts(self) -> np.ndarray:
        """N count per full block, int64 [length // block]."""
        arrays = [np.zeros(p, np.int64) if isinstance(p, int) else p for p in self.parts]
        return np.concatenate(arrays) if arrays else np.zeros(0, np.int64)


# ------------------------------------------------------------------------------------------- file I/O


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes | np.ndarray) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder, fsync, then ``os.replace``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            if isinstance(data, np.ndarray):
                data.tofile(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1) + "\n").encode()


def _file_md5(path: Path, chunk_bytes: int = 1 << 22) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def _file_crc32(path: Path, chunk_bytes: int = 1 << 22) -> str:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            crc = crc32(block, crc)
    return f"{crc:08x}"


def _safe_name(chrom: str) -> str:
    """File-system-safe stem for a record name (``HLA-A*01:01`` -> ``HLA-A_01_01``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", chrom).lstrip(".") or "_"


def read_manifest(out: str | Path) -> dict:
    """Load and check ``OUT/manifest.json`` (``out`` may also be the manifest file itself).

    Raises:
        GenoctxError: missing, not JSON, not a genoctx-windows manifest, an unknown format version or
            missing keys; the message names the path.
    """
    out = Path(out)
    path = out if out.suffix == ".json" and not out.is_dir() else out / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise GenoctxError(f"{path}: no manifest; run `genoctx prepare --out {path.parent}` first") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GenoctxError(f"{path}: unreadable manifest: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise GenoctxError(f"{path}: not a {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise GenoctxError(
            f"{path}: manifest format_version {manifest.get('format_version')!r} is not supported "
            f"(this genoctx reads version {FORMAT_VERSION})"
        )
    missing = [k for k in ("vocabulary", "policies", "window", "shards", "windows", "splits") if k not in manifest]
    if missing:
        raise GenoctxError(f"{path}: manifest lacks {', '.join(missing)}")
    return manifest


def verify(out: str | Path) -> list[str]:
    """Re-check every shard of a prepared directory against the manifest's lengths and md5s.

    Returns:
        One line per problem (missing file, wrong size, md5 mismatch); empty when everything matches.

    Raises:
        GenoctxError: the manifest itself is missing or invalid.
    """
    out = Path(out)
    manifest = read_manifest(out)
    root = out.parent if out.suffix == ".json" and not out.is_dir() else out
    problems = []
    for shard in manifest["shards"]:
        for key in ("tokens", "softmask"):
            path = root / shard[key]
            if not path.is_file():
                problems.append(f"{path}: missing shard file")
                continue
            size = path.stat().st_size
            if size != shard["length"]:
                problems.append(f"{path}: {size} bytes, manifest says {shard['length']}")
                continue
            crc_key = "crc32" if key == "tokens" else "softmask_crc32"
            md5_key = "md5" if key == "tokens" else "softmask_md5"  # format_version 1 before genoctx 0.2
            if crc_key in shard and (crc := _file_crc32(path)) != shard[crc_key]:
                problems.append(f"{path}: crc32 {crc} != manifest {shard[crc_key]}")
            elif crc_key not in shard and md5_key in shard and (md5 := _file_md5(path)) != shard[md5_key]:
                problems.append(f"{path}: md5 {md5} != manifest {shard[md5_key]}")
    for i, w in enumerate(manifest["windows"]):
        if "crc32" not in w or problems:
            continue
        shard = manifest["shards"][w["shard"]]
        with open(root / shard["tokens"], "rb") as f:
            f.seek(w["offset"])
            crc = f"{crc32(f.read(w['end'] - w['start'])):08x}"
        if crc != w["crc32"]:
            problems.append(
                f"{root / shard['tokens']}: window {i} ({w['chrom']}:{w['start']}-{w['end']}) crc32 "
                f"{crc} != manifest {w['crc32']}"
            )
    return problems


# -------------------------------------------------------------------------------------------- prepare


def _split_of(chrom: str, train: list[str] | None, eval_: list[str] | None) -> str | None:
    if train is None and eval_ is None:
        return "eval" if chrom in DEFAULT_EVAL_CHROMS else "train"
    if chrom in (train or ()):
        return "train"
    if chrom in (eval_ or ()):
        return "eval"
    return None


class _Run:
    """Files and folders one prepare run created, so a failed run can remove exactly those."""

    def __init__(self) -> None:
        self.files: list[Path] = []
        self.dirs: list[Path] = []

    def mkdir(self, path: Path) -> None:
        missing = []
        p = path
        while not p.exists():
            missing.append(p)
            p = p.parent
        path.mkdir(parents=True, exist_ok=True)
        self.dirs.extend(reversed(missing))  # in the order they were made

    def rollback(self, lock: OutputLock | None = None) -> None:
        """Remove the run's files, then its lock file if the run created it, then the run's folders."""
        for f in self.files:
            f.unlink(missing_ok=True)
        if lock is not None and (lock.created or lock.folder in self.dirs):
            lock.discard()
        for d in reversed(self.dirs):  # deepest first
            try:
                d.rmdir()
            except OSError:
                pass


class _Md5:
    """The md5 of a source file, computed in a background thread (hashlib releases the GIL)."""

    def __init__(self, path: Path):
        self.path = path
        self._value: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = fasta_md5(self.path)
        except BaseException as e:  # re-raised by result()
            self._error = e

    def result(self) -> str:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value


def _shard_args(chrom: str, source_md5: str, case: str) -> dict:
    return {"format_version": FORMAT_VERSION, "chrom": chrom, "source_md5": source_md5, "case": case}


def _clean_stale_temporaries(folder: Path) -> None:
    """Remove ``.NAME.tmp-PID`` files left by a killed run (PID no longer alive)."""
    if not folder.is_dir():
        return
    for tmp in folder.glob(".*.tmp-*"):
        try:
            pid = int(tmp.name.rsplit("-", 1)[1])
        except ValueError:
            continue
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except PermissionError:
            pass


def _shard_is_current(side_path: Path, tok_path: Path, sm_path: Path, shard_args: dict) -> dict | None:
    """The sidecar if the shard was finished with these arguments and its bytes still match; else None.

    Raises:
        GenoctxError: the shard was prepared with other arguments.
    """
    if not side_path.is_file():
        return None
    try:
        side = json.loads(side_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if side.get("args") != shard_args:
        old = side.get("args") if isinstance(side.get("args"), dict) else {}
        keys = [k for k in ("format_version", "chrom", "source_md5", "case") if old.get(k) != shard_args[k]]
        differs = ", ".join(f"{k} differs (was {old.get(k)}, now {shard_args[k]})" for k in keys)
        raise GenoctxError(
            f"{side_path}: this shard was prepared with other arguments: {differs}; use a new --out or remove it"
        )
    if (
        "crc32" in side
        and tok_path.is_file()
        and sm_path.is_file()
        and tok_path.stat().st_size == side["length"] == sm_path.stat().st_size
        and _file_crc32(tok_path) == side["crc32"]
        and _file_crc32(sm_path) == side["softmask_crc32"]
    ):
        return side
    return None


def _stream_shard(
    run: _Run,
    tok_path: Path,
    sm_path: Path,
    chrom: str,
    segments: Any,
    source: Path,
    uppercase_only: bool,
) -> tuple[dict, _BlockCounter]:
    """Tokenise one record's raw segments into ``tok_path``/``sm_path`` (temporary names, then rename).

    Memory is O(one segment) whatever the record length. Returns the record's stats and block counts.
    """
    tmps = [p.with_name(f".{p.name}.tmp-{os.getpid()}") for p in (tok_path, sm_path)]
    counter = _BlockCounter()
    length = n_count = sm_count = iupac = 0
    tok_crc = sm_crc = 0
    try:
        with open(tmps[0], "wb") as ftok, open(tmps[1], "wb") as fsm:
            for raw, offset in segments:
                try:
                    tokens, softmask = encode_chunk(raw, softmask=not uppercase_only)
                except InvalidBaseError as e:
                    pos = length + len(raw[: e.offset].translate(None, _WS))
                    line = line_at(source, offset + e.offset)
                    raise FastaError(
                        f"{source}: record {chrom}: invalid base {chr(e.byte)!r} (byte 0x{e.byte:02x}) at offset "
                        f"{pos} (0-based; position {pos + 1} of the record), line {line}"
                    ) from None
                if softmask is None:
                    softmask = bytes(len(tokens))
                n = tokens.count(4) if 4 in tokens else 0  # `in`: one memchr, far faster than count on N-free text
                if n:
                    iupac += n - raw.count(b"N") - raw.count(b"n")
                counter.add(tokens, n)
                if not uppercase_only:
                    sm_count += int(np.count_nonzero(np.frombuffer(softmask, np.uint8)))
                ftok.write(tokens)
                fsm.write(softmask)
                tok_crc = crc32(tokens, tok_crc)
                sm_crc = crc32(softmask, sm_crc)
                length += len(tokens)
                n_count += n
            # no fsync here: a shard torn by a crash fails its crc32 on the next run and is rewritten
        for tmp, path in zip(tmps, (tok_path, sm_path), strict=True):
            run.files.append(path)
            os.replace(tmp, path)
    except BaseException:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)
        raise
    stats = {
        "length": length,
        "n_count": n_count,
        "softmask_count": sm_count,
        "iupac_count": iupac,
        "crc32": f"{tok_crc:08x}",
        "softmask_crc32": f"{sm_crc:08x}",
    }
    return stats, counter


def prepare(
    fastas: list[Path],
    out: Path,
    window: int | str,
    stride: int | str | None = None,
    train_chroms: list[str] | None = None,
    eval_chroms: list[str] | None = None,
    max_n_fraction: float = 0.5,
    uppercase_only: bool = False,
    drop_last: bool = True,
    progress: bool = True,
    expected_lengths: dict[str, int] | None = None,
    *,
    wait: bool = False,
) -> dict:
    """Tokenise FASTA records into per-chromosome shards and write the window manifest.

    Args:
        fastas: FASTA files (plain, gzip or bgzip); record names must be unique across all of them.
        out: output directory (created). ``OUT/manifest.json`` is written last.
        window: window length in bases (int or size string such as ``"512k"``, see :func:`parse_size`).
        stride: distance between window starts in bases; default ``window`` (no overlap).
        train_chroms, eval_chroms: the split by chromosome. Both None: ``chr22`` -> eval, every other
            record -> train. Otherwise only the listed records are used (a None list counts as empty).
        max_n_fraction: windows with ``n_count / (end - start)`` above this are skipped (counted in
            ``skipped.too_many_n``). N inside kept windows is never scored downstream.
        uppercase_only: ignore soft-masking (the softmask shard is all 0; policy ``"uppercase"``).
        drop_last: drop each record's final partial window (counted in ``skipped.partial``); if False it is
            kept and padded with PAD at load time.
        progress: log one INFO line per record to stderr (via ``logging``); DEBUG when False.
        expected_lengths: ``{chrom: bases}`` (e.g. UCSC ``hg38.chrom.sizes``); a tokenised record of another
            length is an error (checked after decompression, before its windows are listed).
        wait: if another run is writing ``out`` (it holds ``out/.genoctx.lock``), wait for it to finish
            instead of failing; the waiting run then finds the folder prepared (or prepared differently).

    Returns:
        The manifest dict (also in ``OUT/manifest.json``); see the module docstring for the layout and
        ``docs`` of keys: format, format_version, genoctx_version, vocabulary, policies, window, stride,
        arguments, sources, splits, shards, windows (``shard`` = index into ``shards``, ``offset`` = start
        in the shard file), skipped, counts.

    Raises:
        GenoctxError (FastaError for file problems): bad sizes or fraction; a FASTA missing, corrupt,
        truncated, with duplicate names, or with an invalid base (file, record and position named); a
        requested chromosome absent (the names present are listed) or, with ``drop_last``, shorter than the
        window (its name, length in bases, file and the window are named); a chromosome in both splits;
        ``out`` holds a manifest or shard prepared with other arguments (each differing argument is named
        with its old and new value); ``out`` is being written by another run and ``wait`` is False (its
        PID is named). Nothing written by the run is left.
    """
    say = log.info if progress else log.debug
    window = parse_size(window)
    stride = window if stride is None else parse_size(stride)
    if not 0.0 <= float(max_n_fraction) <= 1.0:
        raise GenoctxError(f"max_n_fraction must be in [0, 1], got {max_n_fraction}")
    if not fastas:
        raise GenoctxError("no FASTA file given")
    train = None if train_chroms is None and eval_chroms is None else list(train_chroms or [])
    eval_ = None if train is None else list(eval_chroms or [])
    if train is not None:
        both = sorted(set(train) & set(eval_))
        if both:
            raise GenoctxError(f"chromosomes in both train and eval: {', '.join(both)}")
        if not train and not eval_:
            raise GenoctxError("empty chromosome lists: give --train-chroms and/or --eval-chroms")

    if train is not None and drop_last:  # a record asked for by name that cannot give a window: say so now
        for chrom in train + eval_:
            if chrom in (expected_lengths or {}) and expected_lengths[chrom] < window:
                raise GenoctxError(
                    f"{chrom} ({expected_lengths[chrom]} bases in chrom.sizes) is shorter than the window "
                    f"({window} bases): no windows; use a smaller --window or --keep-partial"
                )

    sources = [Path(p).expanduser().resolve() for p in fastas]
    for p in sources:
        is_gzip(p)  # FastaError if missing or unreadable: before anything is written
    md5_jobs = [_Md5(p) for p in sources]  # hashed in background threads while the records stream
    case = "uppercase" if uppercase_only else "softmask-channel"
    arguments = {
        "window": window,
        "stride": stride,
        "train_chroms": train,
        "eval_chroms": eval_,
        "max_n_fraction": float(max_n_fraction),
        "uppercase_only": bool(uppercase_only),
        "drop_last": bool(drop_last),
        "source_md5s": None,  # filled in from md5_jobs when first needed
    }

    out = Path(out)
    run = _Run()
    try:
        run.mkdir(out)
    except OSError as e:
        raise GenoctxError(f"{out}: cannot create the output folder: {e.strerror or e}") from None
    locked = False
    try:
        with output_lock(out, wait=wait, what="prepare") as lock:  # one writer from the first read to the manifest
            locked = True
            try:
                if (out / "manifest.json").exists():
                    old = read_manifest(out)
                    arguments["source_md5s"] = [job.result() for job in md5_jobs]
                    if old.get("arguments") != arguments:
                        differs = ", ".join(_argument_differences(old, arguments, sources))
                        raise GenoctxError(
                            f"{out} holds a prepare with other arguments: {differs}; use a new --out or remove it"
                        )
                    if not verify(out):
                        say("%s: already prepared with these arguments and every shard checks; nothing to do", out)
                        return old
                    say("%s: some shards are missing or damaged; resuming", out)
                return _prepare(
                    run, sources, md5_jobs, out, window, stride, train, eval_, arguments, case, say,
                    expected_lengths or {},
                )  # fmt: skip
            except GenoctxError:
                run.rollback(lock)
                raise
    except GenoctxError:
        if not locked:  # the folder is another run's: remove only folders this run made and left empty
            run.rollback()
        raise


def _chroms_text(value: list[str] | None, key: str) -> str:
    if value is None:
        default = ", ".join(DEFAULT_EVAL_CHROMS)
        return f"default: {default}" if key == "eval_chroms" else f"default: every record but {default}"
    return ", ".join(value) or "none"


def _argument_differences(old: dict, arguments: dict, sources: list[Path]) -> list[str]:
    """``"KEY differs (was OLD, now NEW)"`` for each prepare argument in which manifest ``old`` and ``arguments``
    differ, in argument order; sources are named by file name (by md5 when the names are the same)."""
    was = old.get("arguments")
    if not isinstance(was, dict):
        return ["it records no arguments (written by an older genoctx)"]
    found = []
    for key, now in arguments.items():
        before = was.get(key)
        if before == now:
            continue
        if key == "stride" and before == was.get("window") and now == arguments["window"]:
            continue  # stride = window on both sides: the window's line says it
        if key in ("train_chroms", "eval_chroms"):
            found.append(f"{key} differ (was {_chroms_text(before, key)}, now {_chroms_text(now, key)})")
        elif key == "source_md5s":
            old_paths = [str(e.get("path", "?")) for e in old.get("sources", []) if isinstance(e, dict)]
            old_names, new_names = [Path(p).name for p in old_paths], [p.name for p in sources]
            if old_names != new_names or not isinstance(before, list) or len(before) != len(now):
                found.append(f"sources differ (was {' + '.join(old_names)}, now {' + '.join(new_names)})")
            else:
                changed = [
                    f"{n}: md5 was {a}, now {b}" for n, a, b in zip(new_names, before, now, strict=True) if a != b
                ]
                found.append(f"sources differ ({'; '.join(changed)})")
        else:
            found.append(f"{key} differs (was {json.dumps(before)}, now {json.dumps(now)})")
    for key in was.keys() - arguments.keys():
        found.append(f"{key} differs (was {json.dumps(was[key])}, now not set)")
    return found or ["arguments differ"]


def _prepare(
    run: _Run,
    sources: list[Path],
    md5_jobs: list[_Md5],
    out: Path,
    window: int,
    stride: int,
    train: list[str] | None,
    eval_: list[str] | None,
    arguments: dict,
    case: str,
    say: Callable[..., None],
    expected_lengths: dict[str, int],
) -> dict:
    shards_dir = out / "shards"
    run.mkdir(shards_dir)
    _clean_stale_temporaries(shards_dir)
    _clean_stale_temporaries(out)
    max_n_fraction, drop_last = arguments["max_n_fraction"], arguments["drop_last"]
    uppercase_only = case == "uppercase"
    owner: dict[str, Path] = {}
    stems: dict[str, str] = {}
    source_entries, shards, windows = [], [], []
    splits: dict[str, list[str]] = {"train": [], "eval": []}
    skipped = {"too_many_n": 0, "partial": 0}
    too_short: list[str] = []  # records of the default split that gave no window: "chrM (16569 bases, FILE)"
    for src_index, (source, md5_job) in enumerate(zip(sources, md5_jobs, strict=True)):
        stream = FastaStream(source)
        for chrom, segments in stream:
            if chrom in owner:
                raise FastaError(f"{source}: record {chrom!r} also appears in {owner[chrom]}")
            owner[chrom] = source
            split = _split_of(chrom, train, eval_)
            if split is None:
                continue
            stem = _safe_name(chrom)
            if stem in stems.values():
                raise GenoctxError(f"{source}: record names {chrom!r} and another map to the same file name")
            stems[chrom] = stem
            tok_path = shards_dir / f"{stem}.tokens.u8"
            sm_path = shards_dir / f"{stem}.softmask.u8"
            side_path = shards_dir / f"{stem}.json"
            side = None
            if side_path.is_file():  # a rerun: the source's md5 decides whether the shard is reusable
                shard_args = _shard_args(chrom, md5_job.result(), case)
                side = _shard_is_current(side_path, tok_path, sm_path, shard_args)
            if side is not None:
                log.info("%s: shard %s is up to date; skipped", chrom, tok_path)
                for _ in segments:  # move the stream past this record
                    pass
                stats = side["stats"]
                tokens = np.memmap(tok_path, dtype=np.uint8, mode="r") if stats["length"] else np.zeros(0, np.uint8)
                softmask = np.memmap(sm_path, dtype=np.uint8, mode="r") if stats["length"] else tokens
                n_counter = _RangeCounter(tokens, lambda a: a == N)
            else:
                stats, blocks = _stream_shard(run, tok_path, sm_path, chrom, segments, source, uppercase_only)
                sidecar = {
                    "chrom": chrom,
                    "source": str(source),
                    "args": _shard_args(chrom, md5_job.result(), case),
                    "length": stats["length"],
                    "crc32": stats["crc32"],
                    "softmask_crc32": stats["softmask_crc32"],
                    "stats": stats,
                }
                run.files.append(side_path)
                _atomic_write(side_path, _json_bytes(sidecar))
                n, sm = stats["n_count"], stats["softmask_count"]
                log.info("%s: wrote %s (%d bases, %d N, %d soft-masked)", chrom, tok_path, stats["length"], n, sm)
                tokens = np.memmap(tok_path, dtype=np.uint8, mode="r") if stats["length"] else np.zeros(0, np.uint8)
                softmask = np.memmap(sm_path, dtype=np.uint8, mode="r") if stats["length"] else tokens
                n_counter = _RangeCounter(tokens, lambda a: a == N, block_counts=blocks.counts())
            if chrom in expected_lengths and stats["length"] != expected_lengths[chrom]:
                raise FastaError(
                    f"{source}: record {chrom} has {stats['length']} bases after decompression; "
                    f"chrom.sizes says {expected_lengths[chrom]}"
                )
            shard_index = len(shards)
            shards.append(
                {
                    "chrom": chrom,
                    "split": split,
                    "tokens": f"shards/{stem}.tokens.u8",
                    "softmask": f"shards/{stem}.softmask.u8",
                    "source": src_index,
                    **stats,
                }
            )
            splits[split].append(chrom)
            full, partial = _plan(stats["length"], window, stride)
            if not full and drop_last:
                record = f"{chrom} ({stats['length']} bases, {source})"
                if train is not None:  # asked for by name
                    raise GenoctxError(
                        f"{record} is shorter than the window ({window} bases): no windows; "
                        "use a smaller --window or --keep-partial"
                    )
                too_short.append(record)
            spans = list(full)
            if partial is not None:
                if drop_last:
                    skipped["partial"] += 1
                else:
                    spans.append(partial)
            kept = 0
            for start, end in spans:
                n_count = n_counter.count(start, end)
                if n_count > max_n_fraction * (end - start):
                    skipped["too_many_n"] += 1
                    continue
                kept += 1
                windows.append(
                    {
                        "split": split,
                        "chrom": chrom,
                        "start": start,
                        "end": end,
                        "n_count": n_count,
                        "softmask_count": int(np.count_nonzero(softmask[start:end])),
                        "shard": shard_index,
                        "offset": start,
                        "crc32": f"{crc32(tokens[start:end]):08x}",
                    }
                )
            del tokens, softmask, n_counter
            if not full and drop_last:
                say("%s -> %s: %d bases, shorter than the window (%d bases): no windows", chrom, split,
                    stats["length"], window)  # fmt: skip
            else:
                say("%s -> %s: %d bases, %d of %d windows kept", chrom, split, stats["length"], kept, len(spans))
        source_entries.append({"path": str(source), "md5": md5_job.result(), "records": stream.names})
    arguments["source_md5s"] = [e["md5"] for e in source_entries]

    requested = (train or []) + (eval_ or [])
    absent = [c for c in requested if c not in owner]
    if absent:
        present = ", ".join(owner) or "none"
        raise GenoctxError(f"chromosome(s) {', '.join(absent)} not found in the FASTA; present: {present}")
    counts = {
        split: {
            "windows": sum(1 for w in windows if w["split"] == split),
            "tokens": sum(w["end"] - w["start"] for w in windows if w["split"] == split),
        }
        for split in splits
    }
    if too_short:
        named = ", ".join(too_short[:10]) + (f" and {len(too_short) - 10} more" if len(too_short) > 10 else "")
        log.warning(
            "%d record%s shorter than the window (%d bases) gave no windows: %s; use a smaller --window or "
            "--keep-partial", len(too_short), "s" if len(too_short) > 1 else "", window, named,
        )  # fmt: skip
    for split, c in counts.items():
        if c["windows"] == 0:
            log.warning("split %r has no windows (chromosomes: %s)", split, ", ".join(splits[split]) or "none")
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "genoctx_version": GENOCTX_VERSION,
        "vocabulary": list(VOCAB),
        "policies": {
            "case": case,
            "n": "never-scored",
            "max_n_fraction": max_n_fraction,
            "iupac": "as-N",
            "drop_last": drop_last,
        },
        "window": window,
        "stride": stride,
        "arguments": arguments,
        "sources": source_entries,
        "splits": splits,
        "shards": shards,
        "windows": windows,
        "skipped": skipped,
        "counts": counts,
    }
    manifest_path = out / "manifest.json"
    run.files.append(manifest_path)
    _atomic_write(manifest_path, _json_bytes(manifest))
    n_train, n_eval = counts["train"]["windows"], counts["eval"]["windows"]
    say("%s: %d train and %d eval windows of %d bases", manifest_path, n_train, n_eval, window)
    return manifest
