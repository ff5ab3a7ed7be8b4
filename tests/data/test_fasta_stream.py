"""The fast streaming FASTA path against Biopython on real pieces and edge cases; prepare edge cases; interrupts."""

from __future__ import annotations

import gzip
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from genoctx.data.fasta import FastaError, FastaStream, iter_records
from genoctx.data.tokenizer import encode, encode_chunk
from genoctx.data.windows import prepare, verify
from genoctx.errors import GenoctxError

REAL = ["hg38_chr1_1-1000000.fa.gz", "hg38_chr2_1-2333275.fa.gz", "hg38_chr22_32000001-32300000.fa", "hg38_chrM.fa"]


def _stream(path, block_bytes=1 << 23, threaded=True):
    out = []
    for name, segments in FastaStream(path, block_bytes=block_bytes, threaded=threaded):
        tokens = b"".join(encode_chunk(raw)[0] for raw, _ in segments)
        out.append((name, tokens))
    return out


def _reference(path):
    return [(name, encode(seq)[0].tobytes()) for name, seq in iter_records(path)]


@pytest.mark.parametrize("name", REAL)
def test_fast_path_equals_biopython_on_real_pieces(realdna, name):
    expected = _reference(realdna / name)
    assert _stream(realdna / name) == expected
    assert _stream(realdna / name, block_bytes=4093, threaded=False) == expected  # odd blocks, headers split
    # the soft-mask channel too (chr2 is soft-masked)
    seq = dict(iter_records(realdna / name))
    for rec, segments in FastaStream(realdna / name, block_bytes=65537):
        mask = b"".join(encode_chunk(raw)[1] for raw, _ in segments)
        assert mask == encode(seq[rec])[1].view(np.uint8).tobytes()


EDGE = {
    "blank-lines": b">chrA first\nACGT\n\nacgt\n\n>chrB\n\nNNAC\nGT\n",
    "crlf-spaces": b">chrA\r\nAC GT\r\nac\r\n>chrB x y\r\nRYKM\r\n",
    "no-final-newline": b">chrA\nACGT\n>chrB\nGGCC",
    "empty-records": b">e1\n>chrA\nAC\n>e2\n\n>chrB\nGG\n>e3",
}


@pytest.mark.parametrize("case", sorted(EDGE))
def test_fast_path_equals_biopython_on_edge_cases(tmp_path, case, caplog):
    path = tmp_path / f"{case}.fa"
    path.write_bytes(EDGE[case])
    gz = tmp_path / f"{case}.fa.gz"
    gz.write_bytes(gzip.compress(EDGE[case]))  # plain gzip, not BGZF
    with caplog.at_level(logging.WARNING):
        expected = _reference(path)
        for p in (path, gz):
            for block in (3, 7, 1 << 20):
                assert _stream(p, block_bytes=block) == expected
    if case == "empty-records":
        assert [n for n, _ in expected] == ["chrA", "chrB"] and "'e1' is empty" in caplog.text


def test_stream_errors_name_file_and_line(tmp_path, realdna):
    cases = {
        b">chrA\nAC\n>chrB\nGG\n>chrA again\nTT\n": ["duplicate", "'chrA'", "line 5"],
        b">chrA\nAC\n> \nGG\n": ["no name", "chrA", "line 3"],
        b"junk\n>chrA\nAC\n": ["line 1", "before the first"],
        b"\n\n": ["no FASTA records"],
        b">chrA\nACGT>chrB\nGG\n": ["'>'", "line 2"],  # a '>' inside a line is a bad base, not a header
    }
    for i, (data, words) in enumerate(cases.items()):
        path = tmp_path / f"e{i}.fa"
        path.write_bytes(data)
        with pytest.raises(GenoctxError) as info:
            if b"ACGT>" in data:
                prepare([path], tmp_path / f"o{i}", 4, progress=False)
            else:
                _stream(path)
        for word in [str(path), *words]:
            assert word in str(info.value)
    cut = tmp_path / "cut.fa.gz"  # truncated plain gzip
    cut.write_bytes(gzip.compress((realdna / "hg38_chr22_32000001-32300000.fa").read_bytes())[:50_000])
    with pytest.raises(FastaError, match="truncated"):
        _stream(cut)


def test_prepare_iupac_invalid_byte_and_single_line(tmp_path, realdna):
    chr22 = (realdna / "hg38_chr22_32000001-32300000.fa").read_bytes()  # one 300 kb line
    body = bytearray(chr22[chr22.index(b"\n") + 1 :])
    for i, code in enumerate(b"RYKMSWBDHVryk"):
        body[1000 + i * 7] = code
    path = tmp_path / "iupac.fa"
    path.write_bytes(b">chr22\n" + bytes(body))
    m = prepare([path], tmp_path / "out", 4096, progress=False)
    shard = m["shards"][0]
    assert shard["length"] == 300_000 and shard["iupac_count"] == 13
    assert shard["n_count"] == 13 and m["windows"][0]["n_count"] == 13
    tokens = np.fromfile(tmp_path / "out" / shard["tokens"], np.uint8)
    assert (tokens[1000 : 1000 + 13 * 7 : 7] == 4).all()
    body[250_001] = ord("!")
    bad = tmp_path / "bad.fa"
    bad.write_bytes(b">chr22\n" + bytes(body))
    with pytest.raises(GenoctxError) as info:
        prepare([bad], tmp_path / "bad", 4096, progress=False)
    for word in (str(bad), "chr22", "'!'", "position 250002", "line 2"):
        assert word in str(info.value)
    assert not (tmp_path / "bad").exists()


def test_absent_chromosome_lists_names(tmp_path, realdna):
    with pytest.raises(GenoctxError, match="present: chrM"):
        prepare([realdna / "hg38_chrM.fa"], tmp_path / "o", 4096, train_chroms=["chr9"], progress=False)


def _build_big(path: Path, realdna: Path, copies: int) -> None:
    with gzip.open(realdna / "hg38_chr2_1-2333275.fa.gz", "rb") as f:
        text = f.read()
    body = gzip.compress(text[text.index(b"\n") + 1 :], 1)
    with open(path, "wb") as f:
        for i in range(copies):
            f.write(gzip.compress(f">chr{i + 1}\n".encode()) + body)


_CHILD = (
    "import sys; from genoctx.data.windows import prepare; "
    "prepare([sys.argv[1]], sys.argv[2], window='64k', progress=False)"
)


def _tree(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_interrupted_prepare_resumes_to_identical_output(tmp_path, realdna, sig):
    big = tmp_path / "big.fa.gz"
    _build_big(big, realdna, 8)  # 8 records x 2.33 Mb
    ref = tmp_path / "ref"
    prepare([big], ref, "64k", progress=False)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(big), str(out)], env=env)
    shards = out / "shards"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and child.poll() is None:  # wait until a first shard is finished
        if shards.is_dir() and any(shards.glob("chr*.json")):
            break
        time.sleep(0.02)
    child.send_signal(sig)
    child.wait(timeout=60)
    assert not (out / "manifest.json").exists() or child.returncode == 0
    prepare([big], out, "64k", progress=False)
    assert _tree(out) == _tree(ref) and verify(out) == []
