"""FASTA reading: real hg38 pieces (bgzip, plain, plain gzip) against pyfaidx, and one-line errors."""

import gzip
import hashlib
import logging
import shutil

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
