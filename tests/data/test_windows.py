"""Windowing and `prepare`: coordinates, N policy, resumable atomic shards, manifest, clean errors."""

import gzip
import hashlib
import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import pyfaidx
import pytest

from genoctx.data.fasta import FastaError
from genoctx.data.tokenizer import VOCAB, encode
from genoctx.data.windows import parse_size, plan_windows, prepare, read_manifest, verify
from genoctx.errors import GenoctxError

CHR1 = "hg38_chr1_1-1000000.fa.gz"
CHR2 = "hg38_chr2_1-2333275.fa.gz"
CHR22 = "hg38_chr22_32000001-32300000.fa"
CHRM = "hg38_chrM.fa"
# hg38 chr1 gaps in the piece, 1-based inclusive (data/hg38/SOURCES.md)
CHR1_GAPS = [(1, 10_000), (207_667, 257_666), (297_969, 347_968), (535_989, 585_988)]


@pytest.fixture
def dna(realdna, tmp_path) -> Path:
    """A private copy of the real pieces (pyfaidx may write indexes next to them)."""
    folder = tmp_path / "dna"
    folder.mkdir()
    for f in realdna.glob("hg38_*"):
        shutil.copy2(f, folder / f.name)
    return folder


def _files(out: Path) -> list[Path]:
    return sorted(p for p in out.rglob("*") if p.is_file()) if out.exists() else []


# ----------------------------------------------------------------------------------------- parse_size


@pytest.mark.parametrize(
    ("value", "size"),
    [(4096, 4096), ("4096", 4096), ("16k", 16384), ("32K", 32768), ("512k", 524288), ("1M", 1048576),
     ("1m", 1048576), (" 2M ", 2097152), ("1G", 1024**3), (np.int64(7), 7)],
)  # fmt: skip
def test_parse_size(value, size):
    assert parse_size(value) == size


@pytest.mark.parametrize("value", ["1.5M", "16kb", "", "k", "-1", "0", 0, -5, True, None, 1.0, "1 M b"])
def test_parse_size_rejects(value):
    with pytest.raises(GenoctxError):
        parse_size(value)


# --------------------------------------------------------------------------------------- plan_windows


def _plan_reference(length, window, stride, drop_last):
    out, s = [], 0
    while s + window <= length:
        out.append((s, s + window))
        s += stride
    if not drop_last and s < length:
        out.append((s, length))
    return out


def test_plan_windows_examples():
    assert plan_windows(10, 4) == [(0, 4), (4, 8)]
    assert plan_windows(10, 4, drop_last=False) == [(0, 4), (4, 8), (8, 10)]
    assert plan_windows(10, 4, 2) == [(0, 4), (2, 6), (4, 8), (6, 10)]
    assert plan_windows(11, 4, 2, drop_last=False) == [(0, 4), (2, 6), (4, 8), (6, 10), (8, 11)]
    assert plan_windows(3, 4) == [] and plan_windows(3, 4, drop_last=False) == [(0, 3)]
    assert plan_windows(8, 4, drop_last=False) == [(0, 4), (4, 8)]
    assert plan_windows(10, 2, 5) == [(0, 2), (5, 7)]
    assert plan_windows(0, 4, drop_last=False) == []


def test_plan_windows_against_loop():
    rng = np.random.default_rng(0)
    for _ in range(300):
        length, window, stride = (int(x) for x in rng.integers(1, 60, size=3))
        for drop_last in (True, False):
            assert plan_windows(length, window, stride, drop_last) == _plan_reference(length, window, stride, drop_last)
    with pytest.raises(GenoctxError):
        plan_windows(10, 0)
    with pytest.raises(GenoctxError):
        plan_windows(10, 4, 0)


# ------------------------------------------------------------------------------------------- prepare


def test_prepare_default_split_and_shards(dna, tmp_path):
    out = tmp_path / "out"
    m = prepare([dna / CHR2, dna / CHR22], out, 16384, stride=12000, progress=False)
    assert m["format"] == "genoctx-windows" and m["format_version"] == 1
    assert m["vocabulary"] == list(VOCAB) and m["window"] == 16384 and m["stride"] == 12000
    assert m["policies"] == {"case": "softmask-channel", "n": "never-scored", "max_n_fraction": 0.5,
                             "iupac": "as-N", "drop_last": True}  # fmt: skip
    assert m["splits"] == {"train": ["chr2"], "eval": ["chr22"]}
    assert [s["md5"] for s in m["sources"]] == [hashlib.md5((dna / f).read_bytes()).hexdigest() for f in (CHR2, CHR22)]
    assert [s["records"] for s in m["sources"]] == [["chr2"], ["chr22"]]
    assert json.loads((out / "manifest.json").read_text()) == m

    for shard, fname in zip(m["shards"], (CHR2, CHR22), strict=True):
        seq = str(pyfaidx.Fasta(str(dna / fname), sequence_always_upper=False)[shard["chrom"]][:])
        tokens = np.fromfile(out / shard["tokens"], dtype=np.uint8)
        softmask = np.fromfile(out / shard["softmask"], dtype=np.uint8)
        ref_tokens, ref_softmask = encode(seq)
        assert np.array_equal(tokens, ref_tokens) and np.array_equal(softmask, ref_softmask)
        assert shard["length"] == len(seq)
        assert shard["n_count"] == seq.upper().count("N")
        assert shard["softmask_count"] == sum(c.islower() for c in seq)
        assert shard["iupac_count"] == 0
        assert shard["crc32"] == f"{zlib.crc32(tokens.tobytes()):08x}"
        assert shard["softmask_crc32"] == f"{zlib.crc32(softmask.tobytes()):08x}"
        # windows: stride 12000, full windows only, each with counts from the source slice
        ws = [w for w in m["windows"] if w["chrom"] == shard["chrom"]]
        spans = [(w["start"], w["end"]) for w in ws]
        expected = [(s, e) for s, e in plan_windows(len(seq), 16384, 12000)
                    if seq[s:e].upper().count("N") <= 0.5 * 16384]  # fmt: skip
        assert spans == expected
        for w in ws[::7]:
            piece = seq[w["start"] : w["end"]]
            assert w["n_count"] == piece.upper().count("N")
            assert w["softmask_count"] == sum(c.islower() for c in piece)
            assert w["offset"] == w["start"] and m["shards"][w["shard"]] is shard
            assert w["crc32"] == f"{zlib.crc32(tokens[w['start'] : w['end']].tobytes()):08x}"
    chr2 = m["shards"][0]
    assert chr2["n_count"] == 10_000 and chr2["softmask_count"] > 0  # chr2 starts with 10,000 N, soft-masked
    for split in ("train", "eval"):
        ws = [w for w in m["windows"] if w["split"] == split]
        assert m["counts"][split] == {"windows": len(ws), "tokens": 16384 * len(ws)}
    assert m["skipped"]["partial"] == 2
    assert verify(out) == []


def test_n_policy_chr1_gaps(dna, tmp_path):
    m = prepare([dna / CHR1], tmp_path / "out", "16k", progress=False)
    seq = str(pyfaidx.Fasta(str(dna / CHR1))["chr1"][:])
    gaps0 = [(a - 1, b) for a, b in CHR1_GAPS]  # 0-based half-open
    assert all(set(seq[a:b]) == {"N"} for a, b in gaps0) and seq.count("N") == 160_000
    kept = {(w["start"], w["end"]) for w in m["windows"]}
    planned = plan_windows(1_000_000, 16384, 16384)
    inside = [(s, e) for s, e in planned if any(a <= s and e <= b for a, b in gaps0)]
    assert len(inside) == 2 + 2 + 2  # the three 50 kb gaps each hold two whole 16k windows
    assert not kept & set(inside)
    too_many = [(s, e) for s, e in planned if seq[s:e].count("N") > 0.5 * 16384]
    assert set(inside) < set(too_many)
    assert m["skipped"] == {"too_many_n": len(too_many), "partial": 1}  # 1,000,000 is not a multiple of 16k
    assert kept == set(planned) - set(too_many)
    assert m["splits"] == {"train": ["chr1"], "eval": []}
    # a stricter policy drops every window touching a gap
    strict = prepare([dna / CHR1], tmp_path / "strict", "16k", max_n_fraction=0.0, progress=False)
    assert all(w["n_count"] == 0 for w in strict["windows"])
    assert strict["skipped"]["too_many_n"] == sum(1 for s, e in planned if "N" in seq[s:e])


def test_plain_gzip_input(dna, tmp_path):
    gz = tmp_path / "chr22.fa.gz"
    gz.write_bytes(gzip.compress((dna / CHR22).read_bytes()))
    a = prepare([gz], tmp_path / "a", 4096, progress=False)
    b = prepare([dna / CHR22], tmp_path / "b", 4096, progress=False)
    assert a["shards"][0]["crc32"] == b["shards"][0]["crc32"]
    assert a["windows"] == b["windows"] and len(a["windows"]) == 300_000 // 4096


def test_explicit_splits_uppercase_and_drop_last(dna, tmp_path):
    out = tmp_path / "out"
    m = prepare(
        [dna / CHR2, dna / CHRM, dna / CHR22], out, 4096, train_chroms=["chrM"], eval_chroms=["chr22"],
        uppercase_only=True, drop_last=False, progress=False,
    )  # fmt: skip
    assert m["splits"] == {"train": ["chrM"], "eval": ["chr22"]}  # chr2 not requested: not tokenised
    assert [s["records"] for s in m["sources"]] == [["chr2"], ["chrM"], ["chr22"]]
    assert not (out / "shards" / "chr2.tokens.u8").exists()
    assert m["policies"]["case"] == "uppercase"
    assert m["policies"]["drop_last"] is False
    chrm = m["shards"][0]
    assert chrm["softmask_count"] == 0 and not np.fromfile(out / chrm["softmask"], dtype=np.uint8).any()
    last = [w for w in m["windows"] if w["chrom"] == "chrM"][-1]
    assert (last["start"], last["end"]) == (16384, 16569) and m["skipped"]["partial"] == 0


def test_rerun_skips_and_resumes(dna, tmp_path):
    out = tmp_path / "out"
    args = dict(fastas=[dna / CHR2, dna / CHR22], out=out, window="8k", stride="4k", progress=False)
    first = prepare(**args)
    manifest_bytes = (out / "manifest.json").read_bytes()
    mtimes = {p: p.stat().st_mtime_ns for p in _files(out)}
    assert prepare(**args) == first  # nothing to do
    assert {p: p.stat().st_mtime_ns for p in _files(out)} == mtimes

    (out / "manifest.json").unlink()  # an interrupted run: shards done, no manifest
    assert prepare(**args) == first
    assert (out / "manifest.json").read_bytes() == manifest_bytes
    shard_files = [p for p in mtimes if p.parent.name == "shards"]
    assert all(p.stat().st_mtime_ns == mtimes[p] for p in shard_files)

    damaged = out / first["shards"][1]["tokens"]  # a damaged shard is found and rewritten
    data = bytearray(damaged.read_bytes())
    data[100] = (data[100] + 1) % 4
    damaged.write_bytes(bytes(data))
    assert len(verify(out)) == 1 and str(damaged) in verify(out)[0]
    assert prepare(**args) == first
    assert verify(out) == [] and (out / "manifest.json").read_bytes() == manifest_bytes
    assert (out / first["shards"][0]["tokens"]).stat().st_mtime_ns == mtimes[out / first["shards"][0]["tokens"]]


def test_rerun_with_other_arguments_refused(dna, tmp_path):
    out = tmp_path / "out"
    prepare([dna / CHR22], out, 4096, progress=False)
    before = {p: p.read_bytes() for p in _files(out)}
    for kwargs in (
        {"window": 8192},
        {"window": 4096, "stride": 2048},
        {"window": 4096, "uppercase_only": True},
    ):
        with pytest.raises(GenoctxError, match="new --out"):
            prepare([dna / CHR22], out, progress=False, **kwargs)
    assert {p: p.read_bytes() for p in _files(out)} == before
    (out / "manifest.json").unlink()  # shards of another case policy are refused too
    with pytest.raises(GenoctxError, match="new --out"):
        prepare([dna / CHR22], out, 4096, uppercase_only=True, progress=False)


def _assert_clean(out: Path):
    assert not (out / "manifest.json").exists()
    assert not [p for p in _files(out) if p.parent.name == "shards"]


def _bad_record_file(dna: Path, tmp_path: Path) -> Path:
    path = tmp_path / "bad.fa"
    path.write_bytes((dna / CHR22).read_bytes() + b">chrBad\nACGTACGT\nACG*T\n")
    return path


@pytest.mark.parametrize("case", ["missing", "duplicate", "duplicate-across", "truncated", "bad-byte", "absent"])
def test_errors_leave_nothing(dna, tmp_path, case):
    out = tmp_path / "out"
    kwargs = {}
    if case == "missing":
        fastas, words = [dna / CHR22, tmp_path / "nope.fa"], ["nope.fa"]
    elif case == "duplicate":
        path = tmp_path / "dup.fa"
        path.write_bytes((dna / CHR22).read_bytes() + (dna / CHRM).read_bytes() + (dna / CHR22).read_bytes())
        fastas, words = [path], ["dup.fa", "duplicate", "chr22"]
    elif case == "duplicate-across":
        fastas, words = [dna / CHR22, dna / CHRM, dna / CHR22], ["chr22", "also appears"]
    elif case == "truncated":
        data = (dna / CHR2).read_bytes()
        path = tmp_path / "cut.fa.gz"
        path.write_bytes(data[: len(data) * 3 // 4])
        fastas, words = [dna / CHR22, path], ["cut.fa.gz", "truncated"]
    elif case == "bad-byte":
        fastas, words = (
            [_bad_record_file(dna, tmp_path)],
            ["bad.fa", "chrBad", "'*'", "offset 11", "position 12", "line 5"],
        )
    else:
        fastas, words = [dna / CHR22, dna / CHRM], ["chrX", "present: chr22, chrM"]
        kwargs = {"train_chroms": ["chr22"], "eval_chroms": ["chrX"]}
    with pytest.raises(GenoctxError) as info:
        prepare(fastas, out, 4096, progress=False, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message
    if case != "absent":
        assert isinstance(info.value, FastaError)
    _assert_clean(out)
    assert not out.exists()  # the run created it, and removed it


def test_error_keeps_an_existing_folder(dna, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(GenoctxError):
        prepare([_bad_record_file(dna, tmp_path)], out, 4096, progress=False)
    assert _files(out) == [out / "notes.txt"]


def test_argument_errors(dna, tmp_path):
    for kwargs in (
        {"window": "1.5M"},
        {"window": 4096, "max_n_fraction": 1.5},
        {"window": 4096, "train_chroms": ["chr22"], "eval_chroms": ["chr22"]},
        {"window": 4096, "train_chroms": [], "eval_chroms": []},
    ):
        with pytest.raises(GenoctxError):
            prepare([dna / CHR22], tmp_path / "out", progress=False, **kwargs)
    assert not (tmp_path / "out").exists()


def test_read_manifest_and_verify_errors(dna, tmp_path):
    with pytest.raises(GenoctxError, match="no manifest"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(GenoctxError, match="manifest.json"):
        verify(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "genoctx-windows", "format_version": 99}))
    with pytest.raises(GenoctxError, match="format_version"):
        read_manifest(tmp_path)
    out = tmp_path / "out"
    m = prepare([dna / CHRM], out, 4096, progress=False)
    (out / m["shards"][0]["softmask"]).unlink()
    problems = verify(out)
    assert len(problems) == 1 and "missing" in problems[0]
