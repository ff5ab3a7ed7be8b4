"""Downloads from a local UCSC-shaped mirror (real hg38 pieces): resume, md5 failure, 404, slow server, CLI."""

from __future__ import annotations

import hashlib
import json

import pytest
from mirror_server import build_mirror_files, serve
from typer.testing import CliRunner

from genoctx.cli import app
from genoctx.data.assemblies import HG38, get_assembly, parse_chrom_sizes, parse_md5sum, resolve_base_url
from genoctx.data.download import DownloadError, download, fetch_assembly
from genoctx.data.fasta import iter_records
from genoctx.errors import GenoctxError

CHR2 = "/goldenPath/hg38/chromosomes/chr2.fa.gz"


@pytest.fixture(scope="module")
def mirror_files():
    from pathlib import Path

    return build_mirror_files(Path(__file__).resolve().parents[2] / "data" / "hg38")


@pytest.fixture
def mirror(mirror_files):
    """A running UCSC-shaped mirror of the real pieces with fault modes (see mirror_server.py)."""
    with serve(mirror_files) as m:
        yield m


def test_registry_and_parsers(monkeypatch):
    assert get_assembly("hg38") is HG38
    assert HG38.chromosome_path("chr22") == "chromosomes/chr22.fa.gz"
    assert HG38.genome_path == "bigZips/hg38.fa.gz" and HG38.sizes_path == "bigZips/hg38.chrom.sizes"
    assert HG38.md5_path("bigZips/hg38.fa.gz") == "bigZips/md5sum.txt"
    assert HG38.ucsc_sizes["chr1"] == 248_956_422 and HG38.ucsc_sizes["chr2"] == 242_193_529
    with pytest.raises(GenoctxError, match="known: hg38"):
        get_assembly("hg99")
    monkeypatch.setenv("GENOCTX_BASE_URL", "http://mirror/x/")
    assert resolve_base_url(HG38) == "http://mirror/x" and resolve_base_url(HG38, "http://a/") == "http://a"
    monkeypatch.delenv("GENOCTX_BASE_URL")
    assert resolve_base_url(HG38) == "https://hgdownload.soe.ucsc.edu/goldenPath/hg38"
    md5 = "0" * 31 + "1"
    assert parse_md5sum(f"{md5}  chr1.fa.gz\n\n{md5} *chr2.fa.gz\n") == {"chr1.fa.gz": md5, "chr2.fa.gz": md5}
    with pytest.raises(GenoctxError, match="line 1"):
        parse_md5sum("nothex  chr1.fa.gz\n")
    assert parse_chrom_sizes("chr1\t248956422\nchr22\t50818468\n") == {"chr1": 248956422, "chr22": 50818468}


def test_resume_after_drop_is_byte_identical(mirror, tmp_path):
    data = mirror.files[CHR2]
    mirror.drop[CHR2] = 300_000  # first GET: 300 kB, then the connection closes
    dest = download(mirror.url + "/chromosomes/chr2.fa.gz", tmp_path / "chr2.fa.gz",
                    md5=hashlib.md5(data).hexdigest(), backoff=0.01, progress=False)  # fmt: skip
    assert dest.read_bytes() == data
    gets = [(rng, status) for path, rng, status in mirror.log if path == CHR2]
    assert gets == [(None, 200), ("bytes=300000-", 206)]
    assert not (tmp_path / "chr2.fa.gz.part").exists()


def test_corrupt_byte_retries_once_then_fails(mirror, tmp_path, caplog):
    data = mirror.files[CHR2]
    md5 = hashlib.md5(data).hexdigest()
    mirror.corrupt[CHR2] = 1  # one bad copy, then good: succeeds on the second download
    dest = download(mirror.url + "/chromosomes/chr2.fa.gz", tmp_path / "a.fa.gz", md5=md5, progress=False)
    assert dest.read_bytes() == data and "downloading again" in caplog.text
    mirror.corrupt[CHR2] = 2  # two bad copies: error naming file, both checksums and the URL
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 1
    with pytest.raises(DownloadError) as info:
        download(mirror.url + "/chromosomes/chr2.fa.gz", tmp_path / "b.fa.gz", md5=md5, progress=False)
    message = str(info.value)
    for word in ("b.fa.gz", md5, hashlib.md5(bytes(bad)).hexdigest(), mirror.url + "/chromosomes/chr2.fa.gz"):
        assert word in message
    assert not (tmp_path / "b.fa.gz").exists() and not (tmp_path / "b.fa.gz.part").exists()


def test_404_names_the_url(mirror, tmp_path):
    url = mirror.url + "/chromosomes/chrNope.fa.gz"
    with pytest.raises(DownloadError, match="404") as info:
        download(url, tmp_path / "x.fa.gz", progress=False)
    assert url in str(info.value)
    assert [s for p, _, s in mirror.log] == [404]  # no retry on a 4xx


def test_slow_server_reports_progress(mirror, tmp_path):
    mirror.delay = 0.002  # per 16 KiB: chr1 (259 kB) takes ~35 ms
    seen = []
    path = "/goldenPath/hg38/chromosomes/chr1.fa.gz"
    download(mirror.url + "/chromosomes/chr1.fa.gz", tmp_path / "c.fa.gz", on_progress=lambda d, t: seen.append((d, t)),
             progress=False)  # fmt: skip
    total = len(mirror.files[path])
    assert len(seen) >= 2 and seen[-1] == (total, total)
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:], strict=False))


def test_fetch_assembly_chromosomes_and_cache(mirror, tmp_path):
    paths, sizes = fetch_assembly(HG38, ["chr22", "chrM"], cache_dir=tmp_path, base_url=mirror.url, progress=False)
    assert paths == [tmp_path / "hg38/chromosomes/chr22.fa.gz", tmp_path / "hg38/chromosomes/chrM.fa.gz"]
    assert sizes == {"chr1": 1_000_000, "chr2": 2_333_275, "chr22": 300_000, "chrM": 16_569}
    assert [n for n, _ in iter_records(paths[0])] == ["chr22"]
    n_get = len(mirror.log)
    fetch_assembly(HG38, ["chr22"], cache_dir=tmp_path, base_url=mirror.url, progress=False)
    assert [p for p, _, _ in mirror.log[n_get:]] == [  # cached and verified: only the small text files
        "/goldenPath/hg38/bigZips/hg38.chrom.sizes", "/goldenPath/hg38/chromosomes/md5sum.txt"]  # fmt: skip
    with pytest.raises(DownloadError, match="chrZ"):
        fetch_assembly(HG38, ["chrZ"], cache_dir=tmp_path, base_url=mirror.url, progress=False)
    genome, _ = fetch_assembly(HG38, None, cache_dir=tmp_path, base_url=mirror.url, progress=False)
    assert [n for n, _ in iter_records(genome[0])] == ["chr1", "chr2", "chr22", "chrM"]


def test_cli_prepare_assembly_from_mirror(mirror, tmp_path, monkeypatch):
    monkeypatch.setenv("GENOCTX_BASE_URL", mirror.url)
    out = tmp_path / "out"
    args = ["prepare", "--assembly", "hg38", "--chroms", "chrM", "--eval-chroms", "chr22", "--window", "4k",
            "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["splits"] == {"train": ["chrM"], "eval": ["chr22"]}
    assert summary["counts"]["eval"]["windows"] == 300_000 // 4096
    ok = CliRunner().invoke(app, ["prepare", "--verify", str(out)])
    assert ok.exit_code == 0 and json.loads(ok.stdout)["ok"] is True
    # a length that disagrees with chrom.sizes after decompression: error, nothing left behind
    mirror.files["/goldenPath/hg38/bigZips/hg38.chrom.sizes"] = b"chrM\t16570\nchr22\t300000\n"
    bad = CliRunner().invoke(app, [*args[:-1], str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "16570" in bad.output and "chrM" in bad.output
    assert not (tmp_path / "bad" / "manifest.json").exists()
    assert not list((tmp_path / "bad").rglob("*.u8"))


# --------------------------------------------------------------- answers to a Range request (issue 11.7)


def _bytes_read(seen: list[tuple[int, int | None]], have: int) -> int:
    """Body bytes the client read, from its progress calls (``done`` falls back when a file starts over)."""
    total, prev = 0, have
    for done, _ in seen:
        total += done - prev if done >= prev else done
        prev = done
    return total


@pytest.mark.parametrize("md5", [True, False])
def test_206_from_another_offset_restarts_from_zero(mirror, tmp_path, caplog, md5):
    data = mirror.files[CHR2]
    dest = tmp_path / "chr2.fa.gz"
    (tmp_path / "chr2.fa.gz.part").write_bytes(data[:300_000])  # an earlier, interrupted download
    mirror.bad_range[CHR2] = 37_856  # the server answers from byte 262144 (and says so in Content-Range)
    seen = []
    download(mirror.url + "/chromosomes/chr2.fa.gz", dest, md5=hashlib.md5(data).hexdigest() if md5 else None,
             on_progress=lambda d, t: seen.append((d, t)), progress=False)  # fmt: skip
    assert dest.read_bytes() == data
    gets = [(rng, status) for path, rng, status in mirror.log if path == CHR2]
    assert gets == [("bytes=300000-", 206), (None, 200)]  # the next request starts at 0, no md5 round
    assert _bytes_read(seen, 300_000) == len(data)  # the bad 206 body was not read, the file was read once
    assert all(done <= len(data) for done, _ in seen)
    lines = [r.getMessage() for r in caplog.records if "Content-Range" in r.getMessage()]
    assert lines == [f"{mirror.url}/chromosomes/chr2.fa.gz: asked for bytes from 300000, the server's Content-Range "
                     f"is 'bytes 262144-{len(data) - 1}/{len(data)}'; starting the file again from byte 0"]  # fmt: skip
    assert "downloading again" not in caplog.text


def test_200_to_a_range_request_restarts_from_zero(mirror, tmp_path, caplog):
    data = mirror.files[CHR2]
    dest = tmp_path / "chr2.fa.gz"
    (tmp_path / "chr2.fa.gz.part").write_bytes(b"\0" * 300_000)  # would be kept by an append
    mirror.ignore_range.add(CHR2)
    seen = []
    download(mirror.url + "/chromosomes/chr2.fa.gz", dest, md5=hashlib.md5(data).hexdigest(),
             on_progress=lambda d, t: seen.append((d, t)), progress=False)  # fmt: skip
    assert dest.read_bytes() == data
    assert [(rng, s) for p, rng, s in mirror.log if p == CHR2] == [("bytes=300000-", 200)]
    assert _bytes_read(seen, 300_000) == len(data) and seen[-1] == (len(data), len(data))
    lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert lines == [f"{mirror.url}/chromosomes/chr2.fa.gz: the server ignored Range (asked for bytes from 300000, "
                     "answered 200 with the whole file); starting the file again from byte 0"]  # fmt: skip
    assert "downloading again" not in caplog.text


def test_416_for_a_part_longer_than_the_file_restarts_from_zero(mirror, tmp_path, caplog):
    data = mirror.files[CHR2]
    dest = tmp_path / "chr2.fa.gz"
    (tmp_path / "chr2.fa.gz.part").write_bytes(data + b"junk")
    download(mirror.url + "/chromosomes/chr2.fa.gz", dest, md5=hashlib.md5(data).hexdigest(), progress=False)
    assert dest.read_bytes() == data
    assert [(rng, s) for p, rng, s in mirror.log if p == CHR2] == [(f"bytes={len(data) + 4}-", 416), (None, 200)]
    assert f"the file is {len(data)} bytes" in caplog.text and "downloading again" not in caplog.text
