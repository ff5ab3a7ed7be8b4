"""A UCSC-shaped hg38 mirror built from the real pieces, served by http.server on 127.0.0.1 with fault modes.

A helper module, not a conftest: tests/ has several folders and the name ``conftest`` is already imported.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from genoctx.data.fasta import iter_records

PIECES = {
    "chr1": "hg38_chr1_1-1000000.fa.gz",  # bgzip, served as is
    "chr2": "hg38_chr2_1-2333275.fa.gz",
    "chr22": "hg38_chr22_32000001-32300000.fa",  # plain: gzip-compressed for the mirror (one member)
    "chrM": "hg38_chrM.fa",
}


class Mirror:
    """Files by URL path, plus faults: ``drop[path] = n`` (first GET sends n bytes then closes),
    ``corrupt[path] = k`` (the first k GETs flip one byte), ``delay`` seconds per 16 KiB block,
    ``bad_range[path] = k`` (the next Range GET is answered 206 from k bytes before the offset asked for, and its
    Content-Range says so), ``ignore_range`` (paths whose next Range GET is answered 200 with the whole file).
    A 416 answer carries ``Content-Range: bytes */SIZE``."""

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.drop: dict[str, int] = {}
        self.corrupt: dict[str, int] = {}
        self.bad_range: dict[str, int] = {}
        self.ignore_range: set[str] = set()
        self.delay = 0.0
        self.log: list[tuple[str, str | None, int]] = []  # (path, Range header, status)
        self.url = ""


def _handler(mirror: Mirror):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def do_GET(self):
            path = self.path
            data = mirror.files.get(path)
            rng = self.headers.get("Range")
            if data is None:
                mirror.log.append((path, rng, 404))
                self.send_error(404)
                return
            start = 0
            if rng and rng.startswith("bytes="):
                start = int(rng[6:].split("-")[0])
                if start >= len(data):
                    mirror.log.append((path, rng, 416))
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if path in mirror.ignore_range:
                    mirror.ignore_range.discard(path)
                    start = 0
                elif path in mirror.bad_range:
                    start = max(0, start - mirror.bad_range.pop(path))
            body = data[start:]
            if mirror.corrupt.get(path, 0) > 0:
                mirror.corrupt[path] -= 1
                body = bytearray(body)
                body[len(body) // 2] ^= 0x01
                body = bytes(body)
            status = 206 if rng and start else 200
            mirror.log.append((path, rng, status))
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Accept-Ranges", "bytes")
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if path in mirror.drop:
                self._send(path, body[: mirror.drop.pop(path)])
                self.wfile.flush()
                self.close_connection = True
                return
            for i in range(0, len(body), 1 << 14):
                if mirror.delay:
                    time.sleep(mirror.delay)
                if not self._send(path, body[i : i + (1 << 14)]):
                    return

        def _send(self, path: str, block: bytes) -> bool:
            """Write ``block``; False when the client has gone (it may drop an answer it does not want)."""
            try:
                self.wfile.write(block)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
                return False
            return True

    return Handler


def build_mirror_files(realdna: Path) -> dict[str, bytes]:
    """``/goldenPath/hg38/...`` -> bytes: per-chromosome .fa.gz, md5sum.txt, bigZips hg38.fa.gz and chrom.sizes."""
    files: dict[str, bytes] = {}
    sizes = {}
    for chrom, name in PIECES.items():
        raw = (realdna / name).read_bytes()
        data = raw if name.endswith(".gz") else gzip.compress(raw, mtime=0)
        files[f"/goldenPath/hg38/chromosomes/{chrom}.fa.gz"] = data
        sizes[chrom] = len(next(iter(iter_records(realdna / name)))[1])
    chrom_md5 = "".join(
        f"{hashlib.md5(v).hexdigest()}  {k.rsplit('/', 1)[1]}\n" for k, v in files.items() if "/chromosomes/" in k
    )
    files["/goldenPath/hg38/chromosomes/md5sum.txt"] = chrom_md5.encode()
    genome = b"".join(files[f"/goldenPath/hg38/chromosomes/{c}.fa.gz"] for c in PIECES)
    files["/goldenPath/hg38/bigZips/hg38.fa.gz"] = genome
    files["/goldenPath/hg38/bigZips/md5sum.txt"] = f"{hashlib.md5(genome).hexdigest()}  hg38.fa.gz\n".encode()
    files["/goldenPath/hg38/bigZips/hg38.chrom.sizes"] = "".join(f"{c}\t{n}\n" for c, n in sizes.items()).encode()
    return files


@contextlib.contextmanager
def serve(files: dict[str, bytes]):
    """Run a mirror of ``files`` on 127.0.0.1 (a free port) in a thread; yields the :class:`Mirror`, whose
    ``url`` is the hg38 base (``http://127.0.0.1:PORT/goldenPath/hg38``)."""
    m = Mirror(dict(files))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(m))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    m.url = f"http://127.0.0.1:{server.server_address[1]}/goldenPath/hg38"
    try:
        yield m
    finally:
        server.shutdown()
        server.server_close()
