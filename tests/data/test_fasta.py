"""FASTA reading: real hg38 pieces (bgzip, plain, plain gzip) against pyfaidx, and one-line errors; ISA-L's
inflate equals zlib's (its fallback)."""

import gzip
import hashlib
import logging
import shutil
import subprocess
import sys
import threading
import zlib

import pyfaidx
import pytest

from genoctx.data.fasta import FastaError, fasta_md5, iter_records, record_names
from genoctx.errors import GenoctxError

PIECES = {
    "hg38_chr1_1-1000000.fa.gz": ("chr1", 1_000_000, "e02ac8a004e5b5f422a5c6dcfb0df700"),
    "hg38_chr2_1-2333275.fa.gz": ("chr2", 2_333_275, "e4738789a1507c053f97f1caa2ebed76"),
    "hg38_chr22_32000001-32300000.fa": ("chr22", 300_000, "01320157a250a3d2eea63e89ecf79eba"),
    "hg38_chrM.fa": ("chrM", 16_569, "43c9abf04c4c0731c51c0e9e61bd883f"),
}


@pytest.mark.parametrize("name", sorted(PIECES))
def test_real_pieces_match_pyfaidx(realdna, tmp_path, name):
    chrom, length, md5 = PIECES[name]
    for f in realdna.glob(name + "*"):  # pyfaidx may write an index: work on a copy
        shutil.copy2(f, tmp_path / f.name)
    records = list(iter_records(tmp_path / name))
    assert [(n, len(s)) for n, s in records] == [(chrom, length)]
    expected = str(pyfaidx.Fasta(str(tmp_path / name), sequence_always_upper=False)[chrom][:])
    assert records[0][1] == expected.encode()
    assert fasta_md5(tmp_path / name) == md5  # md5 listed in data/hg38/SOURCES.md


def test_plain_gzip_equals_plain(realdna, tmp_path):
    plain = realdna / "hg38_chr22_32000001-32300000.fa"
    gz = tmp_path / "chr22.fa.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))  # one gzip member, not BGZF
    assert list(iter_records(gz)) == list(iter_records(plain))
    assert fasta_md5(gz) == hashlib.md5(gz.read_bytes()).hexdigest()


def test_multi_record_names_and_empty(tmp_path, caplog):
    path = tmp_path / "multi.fa"
    path.write_bytes(b">seqA some description\nACGT\nacgt\n>seqB\n>seqC\r\nNNAC\r\n")
    with caplog.at_level(logging.WARNING):
        records = list(iter_records(path))
    assert records == [("seqA", b"ACGTacgt"), ("seqC", b"NNAC")]
    assert "seqB" in caplog.text and "empty" in caplog.text
    assert record_names(path) == ["seqA", "seqC"]


def _raises(path, *words):
    with pytest.raises(FastaError) as info:
        list(iter_records(path))
    assert isinstance(info.value, GenoctxError)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    for word in words:
        assert word in message
    return message


def test_missing_file(tmp_path):
    _raises(tmp_path / "nope.fa", "cannot open")
    with pytest.raises(FastaError):
        fasta_md5(tmp_path / "nope.fa")


def test_duplicate_names(tmp_path):
    path = tmp_path / "dup.fa"
    path.write_bytes(b">chrA\nACGT\n>chrB x\nAC\n>chrA again\nGG\n")
    _raises(path, "duplicate", "chrA")


def test_truncated_bgzip(realdna, tmp_path):
    data = (realdna / "hg38_chr1_1-1000000.fa.gz").read_bytes()
    path = tmp_path / "cut.fa.gz"
    path.write_bytes(data[: len(data) // 2])
    _raises(path, "truncated or corrupt gzip")


def test_corrupt_gzip(realdna, tmp_path):
    data = bytearray((realdna / "hg38_chrM.fa").read_bytes())
    blob = bytearray(gzip.compress(bytes(data)))
    blob[len(blob) // 2 : len(blob) // 2 + 64] = bytes(64)  # zero a stretch of the deflate stream
    path = tmp_path / "bad.fa.gz"
    path.write_bytes(bytes(blob))
    _raises(path, "truncated or corrupt gzip")


def test_no_records(tmp_path):
    path = tmp_path / "empty.fa"
    path.write_bytes(b"just some text\nwithout a header\n")
    _raises(path, "no FASTA records")


def test_header_without_name(tmp_path):
    path = tmp_path / "noname.fa"
    path.write_bytes(b">chrA\nAC\n>\nGG\n")
    _raises(path, "no name", "chrA")


def _inflated(paths):
    """Each file's decompressed bytes three ways: the streaming reader (odd block size), Biopython's records and
    FastaStream's records."""
    from genoctx.data import fasta

    out = {}
    for p in paths:
        blocks = b"".join(fasta._decompressed_blocks(p, True, 65_521, threading.Event()))
        stream = [(name, b"".join(raw for raw, _ in segs)) for name, segs in fasta.FastaStream(p, block_bytes=65_521)]
        out[p.name] = (blocks, list(iter_records(p)), stream)
    return out


def test_isal_and_zlib_fallback_give_identical_bytes_on_bgzip(realdna, monkeypatch):
    from genoctx.data import fasta

    paths = sorted(realdna.glob("*.fa.gz"))
    assert len(paths) == 2 and all((p.parent / (p.name + ".gzi")).is_file() for p in paths)  # bgzip, many members
    assert fasta.GZIP_BACKEND == "isal" and fasta._zlib.__name__ == "isal.isal_zlib"
    with_isal = _inflated(paths)
    for p in paths:  # the standard library's reading of all members
        assert with_isal[p.name][0] == gzip.decompress(p.read_bytes())
        assert len(with_isal[p.name][0]) == {"chr1": 1_020_006, "chr2": 2_379_948}[p.name.split("_")[1]]
    monkeypatch.setattr(fasta, "_zlib", zlib)
    monkeypatch.setattr(fasta, "_gzip", gzip)
    assert _inflated(paths) == with_isal


def test_without_isal_the_import_falls_back_to_zlib(realdna):
    code = (
        "import sys, hashlib, threading; sys.modules['isal'] = None\n"  # as if python-isal were not installed
        "from genoctx.data import fasta\n"
        "p = sys.argv[1]\n"
        "data = b''.join(fasta._decompressed_blocks(fasta.Path(p), True, 1 << 20, threading.Event()))\n"
        "recs = list(fasta.iter_records(p))\n"
        "print(fasta.GZIP_BACKEND, fasta._zlib.__name__, fasta._gzip.__name__, hashlib.md5(data).hexdigest(),"
        " recs[0][0], len(recs[0][1]))\n"
    )
    path = realdna / "hg38_chr1_1-1000000.fa.gz"
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    expected = hashlib.md5(gzip.decompress(path.read_bytes())).hexdigest()
    assert r.stdout.split() == ["zlib", "zlib", "gzip", expected, "chr1", "1000000"]
