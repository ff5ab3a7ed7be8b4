"""The command line as a user (or a shell pipeline) sees it: JSON on stdout, logs on stderr, exit codes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REALDNA = REPO / "data" / "hg38"


def genoctx(*args, check=True):
    r = subprocess.run(
        [sys.executable, "-m", "genoctx", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    if check and r.returncode != 0:
        raise AssertionError(f"genoctx {args} exited {r.returncode}: {r.stderr[-2000:]}")
    return r


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    data = root / "data"
    r = genoctx(
        "prepare",
        "--fasta",
        REALDNA / "hg38_chrM.fa",
        "--fasta",
        REALDNA / "hg38_chr22_32000001-32300000.fa",
        "--chroms",
        "chrM",
        "--eval-chroms",
        "chr22",
        "--window",
        "2k",
        "--out",
        data,
    )
    summary = json.loads(r.stdout)
    assert summary["window"] == 2048
    for name, steps in (("init", 0), ("run", 2)):
        r = genoctx(
            "train",
            "--data",
            data,
            "--recipe",
            "recipes/tiny.yaml",
            "--out",
            root / name,
            "--steps",
            steps,
            "--set",
            "train.seq_len=256",
        )
        assert json.loads(r.stdout)["steps"] == steps
    return root


def test_eval_json_has_one_object_per_bin(pipeline):
    r = genoctx(
        "eval",
        "--by-position",
        "--checkpoint",
        pipeline / "run",
        "--baseline",
        pipeline / "init",
        "--data",
        pipeline / "data",
        "--format",
        "json",
        "--max-windows",
        "2",
        "--bins",
        "linear:4",
        "--plot",
        pipeline / "p.png",
    )
    doc = json.loads(r.stdout)
    assert len(doc["bins"]) == 4
    assert doc["overall"]["tokens"] == sum(b["tokens"] for b in doc["bins"])
    assert (pipeline / "p.png").stat().st_size > 1000


def test_table_and_csv_go_to_stdout(pipeline):
    r = genoctx(
        "eval",
        "--by-position",
        "--checkpoint",
        pipeline / "run",
        "--data",
        pipeline / "data",
        "--max-windows",
        "1",
        "--format",
        "csv",
    )
    assert r.stdout.splitlines()[0].startswith("start,end,tokens")
    r = genoctx(
        "eval",
        "--by-position",
        "--checkpoint",
        pipeline / "run",
        "--data",
        pipeline / "data",
        "--max-windows",
        "1",
    )
    assert "overall" in r.stdout and "bits/base" in r.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["eval", "--by-position", "--checkpoint", "NOPE", "--data", "DATA"], "NOPE"),
        (["eval", "--by-position", "--checkpoint", "RUN", "--data", "DATA", "--bins", "0,99999"], "99999"),
        (["eval", "--by-position", "--checkpoint", "RUN", "--data", "DATA", "--split", "nosuch"], "nosuch"),
        (["train", "--data", "DATA", "--out", "NEW", "--recipe", "NOPE.yaml"], "NOPE.yaml"),
        (["train", "--data", "DATA", "--out", "NEW", "--set", "train.bogus=1"], "bogus"),
        (["prepare", "--fasta", "NOPE.fa", "--out", "NEW", "--window", "1k"], "NOPE.fa"),
        (["prepare", "--fasta", "CHRM", "--out", "NEW", "--window", "12q"], "12q"),
    ],
)
def test_user_errors_are_one_line_with_exit_2(pipeline, tmp_path, args, needle):
    subst = {
        "DATA": pipeline / "data",
        "RUN": pipeline / "run",
        "NEW": tmp_path / "new",
        "NOPE": tmp_path / "NOPE",
        "NOPE.yaml": tmp_path / "NOPE.yaml",
        "NOPE.fa": tmp_path / "NOPE.fa",
        "CHRM": REALDNA / "hg38_chrM.fa",
    }
    r = genoctx(*[subst.get(a, a) for a in args], check=False)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert needle in lines[0]
    assert r.stdout == ""
    assert not (tmp_path / "new").exists() or not any((tmp_path / "new").iterdir())


def test_help_lists_the_verbs():
    r = genoctx("--help")
    for verb in ("prepare", "train", "eval"):
        assert verb in r.stdout
