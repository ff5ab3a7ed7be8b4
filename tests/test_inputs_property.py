"""Property-based: whatever a user feeds the verbs, the outcome is a result or a one-line user error.

Inputs: (a) FASTA bytes to ``prepare``, (b) edits of a prepared manifest.json before ``eval`` or
``prepare --verify``, (c) recipe keys and values through ``--set`` before ``train --steps 0``, (d) size strings for
``--window``, ``--stride``, ``--chunk-tokens`` and ``--seq-len``. Allowed: exit 0 with a correct result (JSON on
stdout for JSON verbs), or exit 2 with exactly one ``genoctx: error:`` line on stderr (besides log lines) and no
traceback. Seeded (``derandomize``) and bounded: tiny inputs, a few dozen examples per property.
"""

import dataclasses
import gzip
import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from genoctx.cli import app
from genoctx.model.config import ModelConfig
from genoctx.recipes import TrainConfig

REPO = Path(__file__).resolve().parents[1]
REALDNA = REPO / "data" / "hg38"
TINY = REPO / "recipes" / "tiny.yaml"
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING) ")

SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def check_outcome(res, json_verb: bool = True) -> dict | None:
    """Exit 0 (with the JSON document when ``json_verb``; returned) or exit 2 with one error line."""
    assert res.exception is None or isinstance(res.exception, SystemExit), f"{res.exception!r}\n{res.stderr}"
    assert "Traceback" not in res.stderr, res.stderr
    if res.exit_code == 0:
        return json.loads(res.stdout) if json_verb else None
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and not LOG_LINE.match(ln)]
    assert len(lines) == 1 and lines[0].startswith("genoctx: error: "), res.stderr
    assert lines[0][len("genoctx: error: ") :].strip(), res.stderr
    return None


def _bases(n: int, skip: int = 0) -> str:
    seq = "".join((REALDNA / "hg38_chr22_32000001-32300000.fa").read_text().splitlines()[1:])
    return seq[skip : skip + n]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """train = chrT (2 windows of 512), eval = chrE (2 windows of 512), real bases."""
    from genoctx.data.windows import prepare

    root = tmp_path_factory.mktemp("prop")
    fa = root / "two.fa"
    fa.write_text(f">chrT\n{_bases(1100, 50_000)}\n>chrE\n{_bases(1100, 90_000)}\n")
    out = root / "data"
    prepare([fa], out, window=512, train_chroms=["chrT"], eval_chroms=["chrE"], progress=False)
    return out


# ------------------------------------------------------------------------------------- (a) FASTA bytes


@st.composite
def fasta_bytes(draw) -> bytes:
    """Random bytes, or a plausible FASTA: headers (named, bare '>', repeated), IUPAC and lowercase bases, blank
    lines, CRLF, text before the first header; sometimes gzip-compressed (or a truncated gzip)."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.binary(max_size=200))
    eol = draw(st.sampled_from(["\n", "\r\n"]))
    parts = []
    if draw(st.integers(0, 4)) == 0:
        parts.append(draw(st.sampled_from(["", "ACGT", "junk before header", ";comment"])))
    names = [">chrA", ">chrB desc", ">chr22", ">chrM", ">chr1 x y", ">", "> ", ">\tx", ">chrA"]
    for name in draw(st.lists(st.sampled_from(names), max_size=3, unique=draw(st.integers(0, 3)) > 0)):
        parts.append(name)
        for _ in range(draw(st.integers(0, 4))):
            kind = draw(st.integers(0, 9))
            if kind == 0:
                line = ""
            elif kind == 1:
                line = draw(st.text(alphabet="ACGTN-*. 0>;", max_size=20))
            elif kind < 5:
                line = draw(st.sampled_from(["ACGT", "acgtN", "NNNN", "RYKMSWBDHV"])) * draw(st.integers(1, 40))
            else:
                line = draw(st.text(alphabet="ACGTNacgtnRYKMSWBDHVrykmswbdhv", max_size=90))
            parts.append(line)
    raw = eol.join(parts).encode() + (eol.encode() if draw(st.booleans()) else b"")
    how = draw(st.integers(0, 7))
    if how == 0:
        raw = gzip.compress(raw)
    elif how == 1:
        raw = gzip.compress(raw)[: draw(st.integers(0, 30))]
    return raw


@settings(max_examples=40, **SETTINGS)
@given(raw=fasta_bytes(), keep_partial=st.booleans())
def test_prepare_any_fasta_bytes(raw, keep_partial):
    with tempfile.TemporaryDirectory() as tmp:
        fa = Path(tmp) / "in.fa"
        fa.write_bytes(raw)
        out = Path(tmp) / "out"
        flags = ["--keep-partial"] if keep_partial else []
        res = invoke("prepare", "--fasta", fa, "--out", out, "--window", "64", *flags)
        doc = check_outcome(res)
        if doc is None:  # a user error leaves no partial output
            assert not out.exists() or not any(out.iterdir()), sorted(out.rglob("*"))
        else:
            assert doc["window"] == 64 and (out / "manifest.json").is_file()


# ------------------------------------------------------------------------------ (b) manifest.json edits

ODD_VALUES = [None, "x", "", 1.5, -1, 0, 10**15, 2**31, True, [], {}, [1], {"a": 1}]


@st.composite
def manifest_edit(draw):
    """(path into the manifest, operation, value): delete a key, set a value of another type, change a number."""
    where = draw(st.sampled_from(["top", "shard", "window"]))
    if where == "top":
        key = draw(st.sampled_from(["format", "format_version", "vocabulary", "policies", "window", "stride",
                                    "shards", "windows", "splits", "counts"]))  # fmt: skip
        path = [key]
    elif where == "shard":
        path = ["shards", 0, draw(st.sampled_from(["tokens", "softmask", "length", "crc32", "softmask_crc32"]))]
    else:
        i = draw(st.integers(0, 3))
        path = ["windows", i, draw(st.sampled_from(["split", "chrom", "shard", "offset", "start", "end", "crc32"]))]
    op = draw(st.sampled_from(["delete", "set", "number"]))
    value = draw(st.sampled_from(ODD_VALUES)) if op == "set" else draw(st.sampled_from(["+1", "-1", "*2", "neg"]))
    return path, op, value


def _apply_edit(m: dict, path: list, op: str, value) -> None:
    node = m
    for p in path[:-1]:
        node = node[p]
    last = path[-1]
    if op == "delete":
        node.pop(last, None)
    elif op == "set":
        node[last] = value
    elif isinstance(node.get(last), int) and not isinstance(node.get(last), bool):
        x = node[last]
        node[last] = {"+1": x + 1, "-1": x - 1, "*2": 2 * x, "neg": -x - 1}[value]


@settings(max_examples=40, **SETTINGS)
@given(edit=manifest_edit(), verb=st.sampled_from(["eval", "verify"]))
def test_eval_and_verify_any_manifest_edit(data, edit, verb):
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "data"
        shutil.copytree(data, d)
        m = json.loads((d / "manifest.json").read_text())
        _apply_edit(m, *edit)
        (d / "manifest.json").write_text(json.dumps(m))
        if verb == "eval":
            res = invoke("eval", "--by-position", "--markov", "2", "--data", d, "--resamples", "0", "--format", "json")
            doc = check_outcome(res)
            if doc is not None:
                assert doc["overall"]["tokens"] == sum(b["tokens"] for b in doc["bins"]) > 0
        else:
            res = invoke("prepare", "--verify", d)
            doc = check_outcome(res)
            if doc is not None:
                assert doc["ok"] is True and doc["problems"] == []


# ----------------------------------------------------------------------------------- (c) recipe --set

SCHEMA_KEYS = sorted(
    [f"train.{f.name}" for f in dataclasses.fields(TrainConfig)]
    + [f"model.{f.name}" for f in dataclasses.fields(ModelConfig)]
    + ["model.preset"]
)
JUNK_KEYS = ["train.seq_lenn", "model.hidden", "optim.lr", "lr", "train.", ".x", "model.preset.x", "", "a.b.c"]


YAMLISH = ["null", "true", "false", "[1, 2]", "[a, b]", "{a: 1}", "'quoted'", "[", "KD", "KKD", "DSSS", "fp32", "bf16",
           "zigzag", "tiny", "sparse", "dense", "1e-3"]  # fmt: skip


@st.composite
def set_value(draw) -> str:
    """A ``--set`` value of a random type: mostly small integers and numbers (valid for many keys), YAML-ish
    words, huge integers, any float (nan, inf) or any text."""
    kind = draw(st.integers(0, 9))
    if kind <= 2:
        return str(draw(st.integers(-3, 70)))
    if kind == 3:
        return repr(draw(st.floats(-2.0, 2.0)))
    if kind == 4:
        return repr(draw(st.floats(allow_nan=True, allow_infinity=True)))
    if kind <= 6:
        return draw(st.sampled_from(YAMLISH))
    if kind == 7:
        return str(draw(st.sampled_from([10**20, -(10**20), 2**63])))
    return draw(st.text(max_size=12))


@st.composite
def set_items(draw) -> list[str]:
    items = []
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(SCHEMA_KEYS)) if draw(st.integers(0, 4)) else draw(st.sampled_from(JUNK_KEYS))
        sep = "=" if draw(st.integers(0, 9)) else draw(st.sampled_from(["", ":", "=="]))
        items.append(f"{key}{sep}{draw(set_value())}")
    return items


@settings(max_examples=30, **SETTINGS)
@given(items=set_items())
def test_train_any_set_override(data, items):
    with tempfile.TemporaryDirectory() as tmp:
        args = [a for item in items for a in ("--set", item)]
        res = invoke("train", "--data", data, "--out", Path(tmp) / "run", "--recipe", TINY, "--steps", "0", *args)
        doc = check_outcome(res)
        if doc is not None:
            assert doc["steps"] == 0 and Path(doc["checkpoint"]).is_dir()
        else:
            assert not (Path(tmp) / "run").exists()


# ----------------------------------------------------------------------------------------- (d) sizes

SIZES = st.one_of(
    st.text(max_size=8),
    st.from_regex(r"\A\s?-?[0-9]{0,4}(\.[0-9])?[kKmMgGbB]{0,2}\s?\Z"),
    st.sampled_from(["64", "1k", "1M", "1G", "2G", "0", "-1", "99999999999999999999G", "1e3", "0x40", "٦٤"]),
)


@settings(max_examples=40, **SETTINGS)
@given(flag=st.sampled_from(["--window", "--stride", "--chunk-tokens", "--seq-len"]), value=SIZES)
def test_any_size_string(data, flag, value):
    with tempfile.TemporaryDirectory() as tmp:
        fa = Path(tmp) / "in.fa"
        fa.write_text(f">chrT\n{_bases(300)}\n")
        out = Path(tmp) / "out"
        if flag == "--window":
            res = invoke("prepare", "--fasta", fa, "--out", out, "--window", value, "--keep-partial")
        elif flag == "--stride":
            res = invoke("prepare", "--fasta", fa, "--out", out, "--window", "128", "--stride", value)
        elif flag == "--chunk-tokens":
            res = invoke("eval", "--by-position", "--markov", "1", "--data", data, "--resamples", "0",
                         "--max-windows", "1", "--format", "json", "--chunk-tokens", value)  # fmt: skip
        else:
            res = invoke("model", "info", "--preset", "tiny", "--seq-len", value)
        doc = check_outcome(res)
        if doc is not None and flag == "--seq-len":
            assert doc["seq_len"] >= 1
        if doc is None:  # the error is about the size: it names the flag; no partial output
            assert res.stderr.strip().splitlines()[-1].startswith(f"genoctx: error: {flag}: "), res.stderr
            assert not out.exists() or not any(out.iterdir())
