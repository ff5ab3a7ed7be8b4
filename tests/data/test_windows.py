"""Windowing and `prepare`: coordinates, N policy, resumable atomic shards, manifest, clean errors."""

import gzip
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pyfaidx
import pytest

from genoctx.data.fasta import FastaError
from genoctx.data.tokenizer import VOCAB, encode
from genoctx.data.windows import parse_size, plan_windows, prepare, read_manifest, verify
from genoctx.errors import GenoctxError
from genoctx.lock import LOCK_NAME

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
    mtimes = {p: p.stat().st_mtime_ns for p in _files(out) if p.name != LOCK_NAME}  # the lock is rewritten
    assert prepare(**args) == first  # nothing to do
    assert {p: p.stat().st_mtime_ns for p in _files(out) if p.name != LOCK_NAME} == mtimes

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


# ------------------------------------------------------------------------ one writer per --out (issue 11.6)

_REPO = Path(__file__).resolve().parents[2]
# prepare in a child process that stops inside the output lock (before writing) until its stdin gets a line
_PAUSED = (
    "import sys; from genoctx.data import windows\n"
    "real = windows._prepare\n"
    "def paused(*args, **kwargs):\n"
    "    print('inside', flush=True)\n"
    "    sys.stdin.readline()\n"
    "    return real(*args, **kwargs)\n"
    "windows._prepare = paused\n"
    "windows.prepare([sys.argv[1]], sys.argv[2], window=sys.argv[3], progress=False)\n"
)
_HOLD = (
    "import sys; from pathlib import Path; from genoctx.lock import output_lock\n"
    "with output_lock(Path(sys.argv[1]), what='prepare'):\n"
    "    print('locked', flush=True)\n"
    "    sys.stdin.readline()\n"
)


def _child(script: str, *args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(_REPO)}
    proc = subprocess.Popen([sys.executable, "-c", script, *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    assert proc.stdout.readline() in ("inside\n", "locked\n")
    return proc


def _go(proc: subprocess.Popen, kill: bool = False) -> int:
    if kill:
        proc.kill()
    else:
        proc.stdin.write("\n")
    proc.stdin.close()
    rc = proc.wait(timeout=120)
    proc.stdout.close()
    return rc


def _tree(out: Path) -> dict[str, bytes]:
    """Every file's bytes except the lock file's."""
    return {str(p.relative_to(out)): p.read_bytes() for p in _files(out) if p.name != LOCK_NAME}


def test_second_prepare_into_a_busy_out_is_refused(dna, tmp_path):
    ref = tmp_path / "ref"
    prepare([dna / CHRM], ref, "4k", progress=False)
    out = tmp_path / "out"
    first = _child(_PAUSED, dna / CHRM, out, "4k")  # holds the lock of out, has written nothing yet
    try:
        with pytest.raises(GenoctxError) as info:
            prepare([dna / CHRM], out, "8k", progress=False)
        assert str(info.value) == (
            f"{out} is being written by PID {first.pid} (genoctx prepare); wait for it or pass --wait"
        )
    finally:
        assert _go(first) == 0
    assert read_manifest(out)["window"] == 4096
    assert _tree(out) == _tree(ref) and verify(out) == []


def test_two_cli_prepares_race_one_wins(dna, tmp_path):
    """The issue's scenario, unsynchronised: whichever order the two runs take, one exits 0, the other 2 with
    one line (the lock's PID message, or 'other arguments' if the first had already finished), and the folder
    holds the winner's data."""
    out = tmp_path / "out"
    runs = {}
    for w in ("4k", "8k"):
        args = ["prepare", "--fasta", dna / CHRM, "--chroms", "chrM", "--window", w, "--out", out]
        runs[w] = subprocess.Popen([sys.executable, "-m", "genoctx", *map(str, args)], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, cwd=_REPO)  # fmt: skip
    results = {w: (p.wait(timeout=120), *p.communicate()) for w, p in runs.items()}
    codes = sorted(rc for rc, _, _ in results.values())
    assert codes == [0, 2], results
    (winner,) = [w for w, r in results.items() if r[0] == 0]
    (loser,) = [w for w, r in results.items() if r[0] == 2]
    lines = [ln for ln in results[loser][2].splitlines() if ln.startswith("genoctx: error:")]
    assert len(lines) == 1 and str(out) in lines[0], results[loser][2]
    assert "is being written by PID" in lines[0] or "window differs" in lines[0]
    assert json.loads(results[winner][1])["window"] == read_manifest(out)["window"] == parse_size(winner)
    assert verify(out) == []


def test_concurrent_same_arguments_give_the_same_bytes(dna, tmp_path):
    ref = tmp_path / "ref"
    prepare([dna / CHRM, dna / CHR22], ref, "4k", progress=False)
    out = tmp_path / "out"
    errors = []

    def run():
        try:
            prepare([dna / CHRM, dna / CHR22], out, "4k", progress=False, wait=True)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert _tree(out) == _tree(ref) and verify(out) == []
    # and without --wait: a run that meets a busy folder fails and leaves the folder as the other wrote it
    out2 = tmp_path / "out2"
    first = _child(_PAUSED, dna / CHRM, out2, "4k")
    with pytest.raises(GenoctxError, match=f"PID {first.pid}"):
        prepare([dna / CHRM], out2, "4k", progress=False)
    assert _go(first) == 0
    ref2 = tmp_path / "ref2"
    prepare([dna / CHRM], ref2, "4k", progress=False)
    assert _tree(out2) == _tree(ref2)


def test_prepare_wait_blocks_then_succeeds(dna, tmp_path, caplog):
    out = tmp_path / "out"
    holder = _child(_HOLD, out)
    done = []
    caplog.set_level(logging.INFO)
    t = threading.Thread(target=lambda: done.append(prepare([dna / CHRM], out, "4k", progress=False, wait=True)))
    t.start()
    deadline = time.monotonic() + 30
    while "waiting for PID" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.01)
    assert f"waiting for PID {holder.pid}" in caplog.text
    assert not done and not (out / "manifest.json").exists()
    assert _go(holder) == 0
    t.join(120)
    assert done and done[0]["window"] == 4096 and verify(out) == []


def test_lock_of_a_killed_prepare_does_not_block(dna, tmp_path):
    out = tmp_path / "out"
    holder = _child(_PAUSED, dna / CHRM, out, "8k")
    _go(holder, kill=True)  # SIGKILL inside the lock
    assert (out / LOCK_NAME).read_text().startswith(f"{holder.pid} ")
    m = prepare([dna / CHRM], out, "4k", progress=False)
    assert m["window"] == 4096 and verify(out) == []
    assert (out / LOCK_NAME).read_bytes() == b""


def test_lock_file_is_invisible_to_rerun_and_verify(dna, tmp_path):
    out = tmp_path / "out"
    first = prepare([dna / CHRM], out, "4k", progress=False)
    assert (out / LOCK_NAME).is_file()
    assert verify(out) == [] and prepare([dna / CHRM], out, "4k", progress=False) == first
    with pytest.raises(GenoctxError, match="window differs"):
        prepare([dna / CHRM], out, "8k", progress=False)
    assert read_manifest(out) == first


# ---------------------------------------------------------------------------- clearer messages (issue 11.8)


def test_record_shorter_than_the_window_is_named(dna, tmp_path, caplog):
    out = tmp_path / "out"
    with pytest.raises(GenoctxError) as info:  # asked for by name: an error
        prepare([dna / CHR22, dna / CHRM], out, "32k", train_chroms=["chrM"], eval_chroms=["chr22"], progress=False)
    assert str(info.value) == (
        f"chrM (16569 bases, {dna / CHRM}) is shorter than the window (32768 bases): no windows; "
        "use a smaller --window or --keep-partial"
    )
    _assert_clean(out)
    assert not out.exists()
    with pytest.raises(GenoctxError, match=r"chrM \(16569 bases in chrom.sizes\) is shorter than the window"):
        prepare([dna / CHRM], out, "32k", train_chroms=["chrM"], expected_lengths={"chrM": 16569}, progress=False)
    # kept as one partial window when asked
    m = prepare([dna / CHRM], out, "32k", train_chroms=["chrM"], drop_last=False, progress=False)
    assert [(w["start"], w["end"]) for w in m["windows"]] == [(0, 16569)]
    # the default split (every record) skips it with a warning that says why
    caplog.set_level(logging.INFO)
    m = prepare([dna / CHR22, dna / CHRM], tmp_path / "all", "32k", progress=False)
    assert m["splits"] == {"train": ["chrM"], "eval": ["chr22"]} and m["counts"]["train"]["windows"] == 0
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "shorter" in r.getMessage()]
    assert warning == [
        f"1 record shorter than the window (32768 bases) gave no windows: chrM (16569 bases, {dna / CHRM}); "
        "use a smaller --window or --keep-partial"
    ]


def test_rerun_names_the_argument_that_differs(dna, tmp_path):
    out = tmp_path / "out"
    prepare([dna / CHRM], out, 4096, progress=False)
    head = f"{out} holds a prepare with other arguments: "
    tail = "; use a new --out or remove it"
    cases = [
        ([dna / CHR22], {"window": 4096}, f"sources differ (was {CHRM}, now {CHR22})"),
        ([dna / CHRM], {"window": 8192}, "window differs (was 4096, now 8192)"),
        ([dna / CHRM], {"window": 4096, "stride": 2048}, "stride differs (was 4096, now 2048)"),
        ([dna / CHRM], {"window": 4096, "uppercase_only": True}, "uppercase_only differs (was false, now true)"),
        ([dna / CHRM], {"window": 4096, "drop_last": False}, "drop_last differs (was true, now false)"),
        ([dna / CHRM], {"window": 4096, "max_n_fraction": 0.1}, "max_n_fraction differs (was 0.5, now 0.1)"),
        ([dna / CHRM], {"window": 4096, "train_chroms": ["chrM"]},
         "train_chroms differ (was default: every record but chr22, now chrM), "
         "eval_chroms differ (was default: chr22, now none)"),
        ([dna / CHR22], {"window": 8192},
         f"window differs (was 4096, now 8192), sources differ (was {CHRM}, now {CHR22})"),
    ]  # fmt: skip
    for fastas, kwargs, differs in cases:
        with pytest.raises(GenoctxError) as info:
            prepare(fastas, out, progress=False, **kwargs)
        assert str(info.value) == head + differs + tail
    edited = tmp_path / "x" / CHRM  # same name, other content
    edited.parent.mkdir()
    data = bytearray((dna / CHRM).read_bytes())
    data[-3] = ord("A") if data[-3] != ord("A") else ord("C")
    edited.write_bytes(bytes(data))
    old_md5, new_md5 = hashlib.md5((dna / CHRM).read_bytes()).hexdigest(), hashlib.md5(data).hexdigest()
    with pytest.raises(GenoctxError) as info:
        prepare([edited], out, 4096, progress=False)
    assert str(info.value) == head + f"sources differ ({CHRM}: md5 was {old_md5}, now {new_md5})" + tail
    (out / "manifest.json").unlink()  # shards without a manifest: the sidecar names what differs
    with pytest.raises(GenoctxError) as info:
        prepare([dna / CHRM], out, 4096, uppercase_only=True, progress=False)
    side = out / "shards" / "chrM.json"
    assert str(info.value) == (
        f"{side}: this shard was prepared with other arguments: case differs (was softmask-channel, now uppercase)"
        "; use a new --out or remove it"
    )
