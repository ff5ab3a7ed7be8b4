"""Resumable, verified HTTP downloads (stdlib ``urllib``) and fetching an assembly's files into a cache.

Design choices:
- A file is downloaded to ``NAME.part`` beside its destination; after an interruption the next attempt
  asks for the rest with ``Range: bytes=N-``. The answer is checked before a byte is appended: a 206 must
  carry ``Content-Range: bytes N-END/TOTAL`` starting at N, ending at TOTAL - 1, with a Content-Length of
  END - N + 1 and (when an earlier answer told it) the same TOTAL; a 416 must say the file is N bytes.
  Otherwise, and when the server ignores the range (200), the partial file is dropped and the file starts
  again from byte 0 at once, with one warning. Connection errors, timeouts and 5xx answers are retried with
  exponential backoff
  (``backoff * 2**attempt`` seconds); 4xx answers (404) fail at once with the URL in the message.
- The finished ``.part`` is checked against the md5 from the server's ``md5sum.txt`` and only then renamed
  into place (``os.replace``), so a file in the cache is always a verified one. A checksum mismatch
  deletes the file and downloads it once more from scratch; a second mismatch is an error that names the
  file, both checksums and the URL.
- Progress is a rich bar on stderr (bytes, rate, ETA) when stderr is a terminal; a callback
  ``on_progress(done_bytes, total_bytes)`` serves tests and other front ends. Reads block on the socket
  (with a timeout), never poll.

Reference: RFC 9110 section 14 (range requests); UCSC ``md5sum.txt`` beside each download folder.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from genoctx.data.assemblies import Assembly, parse_chrom_sizes, parse_md5sum, resolve_base_url
from genoctx.errors import GenoctxError

log = logging.getLogger(__name__)

_CHUNK = 1 << 20
ProgressFn = Callable[[int, int | None], None]


class DownloadError(GenoctxError):
    """A download failed for good: HTTP error, retries exhausted, or a checksum mismatch."""


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/genoctx`` (default ``~/.cache/genoctx``)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "genoctx"


def _md5_file(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _fetch_once(url: str, part: Path, timeout: float, on_progress: ProgressFn | None, sizes: dict[str, int]) -> None:
    """One attempt: continue ``part`` from its current size, or start it again from byte 0 when the server's
    answer to the range request does not fit (see the module docstring). ``sizes["total"]`` remembers the file
    size an earlier answer gave. Raises urllib/http/OSError on failure."""
    have = part.stat().st_size if part.exists() else 0
    while True:
        request = urllib.request.Request(url, headers={"User-Agent": "genoctx", "Accept-Encoding": "identity"})
        if have:
            request.add_header("Range", f"bytes={have}-")
        try:
            response = urllib.request.urlopen(request, timeout=timeout)
        except urllib.error.HTTPError as e:
            if e.code == 416 and have:  # the range starts at or past the end: the part is complete, or too long
                total = _range_total(e.headers.get("Content-Range"))
                e.close()
                if total is None or total == have:
                    return
                log.warning("%s: asked for bytes from %d, the server says the file is %d bytes; starting the file "
                            "again from byte 0", url, have, total)  # fmt: skip
                part.unlink(missing_ok=True)
                have = 0
                continue
            raise
        with response:
            status = response.status
            length = response.headers.get("Content-Length")
            expected = int(length) if length is not None and length.strip().isdigit() else None
            if have and status == 206:
                content_range = response.headers.get("Content-Range")
                problem = _range_problem(content_range, have, expected, sizes.get("total"))
                if problem is not None:
                    log.warning("%s: asked for bytes from %d, %s; starting the file again from byte 0",
                                url, have, problem)  # fmt: skip
                    part.unlink(missing_ok=True)  # the answer is dropped unread with the connection
                    have = 0
                    continue
                mode, done = "ab", have
                total = _range_total(content_range)
            elif status == 206:
                raise http.client.HTTPException(f"206 partial answer to a request without Range ({url})")
            else:  # 200: the whole file, from byte 0
                if have:
                    log.warning("%s: the server ignored Range (asked for bytes from %d, answered %d with the whole "
                                "file); starting the file again from byte 0", url, have, status)  # fmt: skip
                mode, done = "wb", 0
                total = expected
            if total is not None:
                sizes["total"] = total
            got = 0
            with open(part, mode) as f:
                while block := response.read1(_CHUNK):  # what has arrived, up to 1 MiB: progress on slow links
                    f.write(block)
                    got += len(block)
                    done += len(block)
                    if on_progress is not None:
                        on_progress(done, total)
            if expected is not None and got != expected:
                raise http.client.IncompleteRead(b"", expected - got)
            return


_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$")


def _range_problem(content_range: str | None, have: int, length: int | None, known_total: int | None) -> str | None:
    """Why a 206 answer to ``Range: bytes={have}-`` cannot be appended to ``have`` bytes, or None if it can."""
    m = _CONTENT_RANGE.match(content_range or "")
    if m is None:
        return f"the server's 206 answer has no usable Content-Range ({content_range!r})"
    start, end, total = int(m.group(1)), int(m.group(2)), None if m.group(3) == "*" else int(m.group(3))
    if start != have or end < start:
        return f"the server's Content-Range is {content_range.strip()!r}"
    if total is not None and end != total - 1:
        return f"the server's Content-Range {content_range.strip()!r} does not run to the end of the file"
    if length is not None and length != end - start + 1:
        return f"the server's Content-Range {content_range.strip()!r} disagrees with its Content-Length {length}"
    if total is not None and known_total is not None and total != known_total:
        return (
            f"the server's Content-Range {content_range.strip()!r} gives another file size than before ({known_total})"
        )
    return None


def _range_total(content_range: str | None) -> int | None:
    if content_range and "/" in content_range:
        tail = content_range.rsplit("/", 1)[1].strip()
        return int(tail) if tail.isdigit() else None
    return None


def download(
    url: str,
    dest: str | Path,
    md5: str | None = None,
    retries: int = 5,
    backoff: float = 1.0,
    timeout: float = 60.0,
    on_progress: ProgressFn | None = None,
    progress: bool | None = None,
) -> Path:
    """Download ``url`` to ``dest``, resuming and retrying, verified by ``md5`` before it is renamed in place.

    Args:
        url: http(s) URL.
        dest: final path; ``dest.part`` holds the bytes until they are verified.
        md5: expected hex md5 of the whole file; None skips the check (used for ``md5sum.txt`` itself).
        retries: attempts after the first for connection errors, timeouts, truncated bodies and 5xx.
        backoff: seconds before the first retry; doubled for each further one.
        timeout: socket timeout in seconds for connecting and for each read.
        on_progress: called as ``on_progress(done_bytes, total_bytes or None)`` after every block.
        progress: show a rich progress bar on stderr; default: when stderr is a terminal.

    Returns:
        ``dest`` (a verified file).

    Raises:
        DownloadError: 4xx answer (the URL and status are named), retries exhausted, or the md5 differs
            twice (the file, both checksums and the URL are named). No ``.part`` or ``dest`` is left by a
            checksum failure; a ``.part`` from a connection failure is kept for the next resume.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    show = sys.stderr.isatty() if progress is None else progress
    for verify_attempt in range(2):
        _fetch_with_retries(url, part, retries, backoff, timeout, on_progress, show)
        if md5 is None:
            break
        actual = _md5_file(part)
        if actual == md5.lower():
            break
        part.unlink(missing_ok=True)
        if verify_attempt == 0:
            log.warning("%s: md5 %s != expected %s (from %s); downloading again", dest.name, actual, md5, url)
            continue
        raise DownloadError(f"{dest.name}: md5 {actual} != expected {md5} after two downloads from {url}")
    os.replace(part, dest)
    return dest


def progress_bar():
    """A transient rich download bar on stderr: the task's description (a file name), bar, bytes, rate, ETA. The
    description is printed as text, never read as rich markup (a name holding ``[bold]`` prints as written)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    return Progress(
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )


def _fetch_with_retries(
    url: str,
    part: Path,
    retries: int,
    backoff: float,
    timeout: float,
    on_progress: ProgressFn | None,
    show: bool,
) -> None:
    bar = None
    callback = on_progress
    sizes: dict[str, int] = {}  # the file size the server gave, checked against later answers
    if show:
        bar = progress_bar()
        task = bar.add_task(part.name.removesuffix(".part"), total=None)

        def callback(done: int, total: int | None) -> None:
            bar.update(task, completed=done, total=total)
            if on_progress is not None:
                on_progress(done, total)

        bar.start()
    try:
        for attempt in range(retries + 1):
            try:
                _fetch_once(url, part, timeout, callback, sizes)
                return
            except urllib.error.HTTPError as e:
                if e.code < 500:
                    raise DownloadError(f"{url}: HTTP {e.code} {e.reason}") from None
                error: Exception = e
            except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
                error = e
            if attempt == retries:
                raise DownloadError(f"{url}: download failed after {retries + 1} attempts: {error}") from None
            delay = backoff * 2**attempt
            have = part.stat().st_size if part.exists() else 0
            log.warning("%s: %s; retrying in %.1f s from byte %d", url, error, delay, have)
            time.sleep(delay)
    finally:
        if bar is not None:
            bar.stop()


def fetch_text(url: str, retries: int = 3, backoff: float = 1.0, timeout: float = 60.0) -> str:
    """GET a small text file (``md5sum.txt``, ``chrom.sizes``) with the same retries; raises DownloadError."""
    last: Exception | None = None
    for attempt in range(retries + 1):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "genoctx"}),
                                        timeout=timeout) as r:  # fmt: skip
                return r.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as e:
            if e.code < 500:
                raise DownloadError(f"{url}: HTTP {e.code} {e.reason}") from None
            last = e
        except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
            last = e
        if attempt < retries:
            time.sleep(backoff * 2**attempt)
    raise DownloadError(f"{url}: download failed after {retries + 1} attempts: {last}")


def fetch_assembly(
    assembly: Assembly,
    chroms: list[str] | None,
    cache_dir: str | Path | None = None,
    base_url: str | None = None,
    retries: int = 5,
    backoff: float = 1.0,
    timeout: float = 60.0,
    on_progress: ProgressFn | None = None,
    progress: bool | None = None,
) -> tuple[list[Path], dict[str, int]]:
    """Fetch the FASTA files of ``chroms`` (or the whole genome) into the cache, verified by md5.

    Args:
        assembly: e.g. :data:`genoctx.data.assemblies.HG38`.
        chroms: chromosome names (one ``chromosomes/{chrom}.fa.gz`` each); None = ``bigZips/{name}.fa.gz``.
        cache_dir: default :func:`default_cache_dir`; files go to ``{cache_dir}/{assembly.name}/{path}``.
        base_url: a mirror; default ``$GENOCTX_BASE_URL`` or UCSC.
        retries, backoff, timeout, on_progress, progress: as in :func:`download`.

    Returns:
        ``(paths, sizes)``: the verified local ``.fa.gz`` files in the order asked, and ``{chrom: length}``
        from the server's ``chrom.sizes`` (to check lengths after decompression).

    Raises:
        DownloadError: as in :func:`download`; a file absent from the server's ``md5sum.txt``; a requested
            chromosome absent from ``chrom.sizes``.
    """
    base = resolve_base_url(assembly, base_url)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root = cache / assembly.name
    sizes_url = f"{base}/{assembly.sizes_path}"
    sizes = parse_chrom_sizes(fetch_text(sizes_url, retries, backoff, timeout), sizes_url)
    if chroms is not None:
        unknown = [c for c in chroms if c not in sizes]
        if unknown:
            raise DownloadError(
                f"{sizes_url}: no chromosome {', '.join(unknown)}; known: {', '.join(list(sizes)[:30])}"
            )
    wanted = [assembly.chromosome_path(c) for c in chroms] if chroms is not None else [assembly.genome_path]
    md5_tables: dict[str, dict[str, str]] = {}
    paths = []
    for rel in wanted:
        md5_rel = assembly.md5_path(rel)
        if md5_rel not in md5_tables:
            md5_url = f"{base}/{md5_rel}"
            md5_tables[md5_rel] = parse_md5sum(fetch_text(md5_url, retries, backoff, timeout), md5_url)
        name = rel.rsplit("/", 1)[-1]
        md5 = md5_tables[md5_rel].get(name)
        if md5 is None:
            raise DownloadError(f"{base}/{md5_rel}: no md5 listed for {name}")
        dest = root / rel
        if dest.is_file() and _md5_file(dest) == md5:
            log.info("%s: in the cache and verified (md5 %s)", dest, md5)
        else:
            log.info("downloading %s/%s -> %s", base, rel, dest)
            download(f"{base}/{rel}", dest, md5, retries, backoff, timeout, on_progress, progress)
        paths.append(dest)
    return paths, sizes
