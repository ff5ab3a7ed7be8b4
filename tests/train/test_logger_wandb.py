"""Training metrics to W&B (``--logger wandb``) in offline mode: the run's files under RUN/wandb, read back from W&B's
transaction log (``run-ID.wandb``: LevelDB-style log records, each a ``wandb_internal_pb2.Record``). Every history
point is metrics.jsonl's number (doubles, exact), every step once, across a resume that continues the same run id.
No network: WANDB_MODE=offline, and W&B's singleton is torn down around each test so that it reads the env again."""

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from genoctx.cli import app
from genoctx.recipes import load_recipe
from genoctx.train.loop import train
from genoctx.train.metrics import scalars

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny.yaml"
KEYS = {
    "attempt",
    "loss",
    "aux_loss",
    "scored_tokens",
    "grad_norm",
    "lr",
    "moe_load_max_over_mean",
    "tokens",
    "tokens_per_s",
    "peak_memory_bytes",
    "seq_chunks",
}  # as tests/train/test_loggers.py
BLOCK = 32768  # the log's block size; the file opens with a 7-byte header (":W&B", magic 0xBEE1, version 0)


def _records(path: Path):
    """The ``Record`` messages of one ``.wandb`` transaction log, in order (FULL, or FIRST..MIDDLE..LAST pieces)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B" and data[4:7] == b"\xe1\xbe\x00", data[:7]
    pos, piece = 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        piece += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(piece)
            piece = b""
            yield record


def _offline_runs(run: Path) -> list[dict]:
    """Each offline W&B run folder under RUN/wandb (oldest first): its run record's id/project/name/config, its
    history points {step: {key: value}} without W&B's own ``_`` keys, and its exit code."""
    found = []
    for folder in sorted((run / "wandb").glob("offline-run-*")):
        (log,) = folder.glob("run-*.wandb")
        info = {"history": {}, "exit_code": None}
        for r in _records(log):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                info.update(id=r.run.run_id, project=r.run.project, name=r.run.display_name,
                            config={u.key: json.loads(u.value_json) for u in r.run.config.update})  # fmt: skip
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                assert r.history.step.num == items["_step"] and r.history.step.num not in info["history"]
                info["history"][r.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
            elif kind == "exit":
                info["exit_code"] = r.exit.exit_code
        found.append(info)
    return found


@pytest.fixture
def offline(monkeypatch):
    """W&B offline, its env read afresh (the singleton keeps the env it saw first)."""
    for name in ("WANDB_PROJECT", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb.teardown()
    yield
    wandb.teardown()


def test_wandb_offline_run_holds_metrics_jsonl_and_resume_continues_it_once(prepared, tmp_path, offline):
    """Attempt 1 logs steps 1, 2 and is 'killed' after checkpoint 1 (checkpoint 2 removed); the resumed attempt
    redoes step 2 and runs 3, in the same W&B run id, sending only step 3: W&B keeps attempt 1's point of step 2."""
    run = tmp_path / "run"
    recipe = load_recipe(TINY, ["train.steps=3", "train.checkpoint_every=1", "train.loggers=wandb"])
    train(prepared, recipe, run, stop_after=2)
    first = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in first] == [1, 2]
    state = json.loads((run / "wandb" / "genoctx.json").read_text())
    assert state["step"] == 2 and len(state["id"]) == 12
    shutil.rmtree(run / "checkpoints" / "step_000002")  # the kill came before checkpoint 2 was written
    train(prepared, recipe, run, resume=True)
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row["attempt"]) for row in rows] == [(1, 1), (2, 2), (3, 2)]

    a1, a2 = _offline_runs(run)
    assert a1["id"] == a2["id"] == state["id"] == json.loads((run / "wandb" / "genoctx.json").read_text())["id"]
    assert (a1["project"], a1["name"], a1["exit_code"], a2["exit_code"]) == ("genoctx", "run", 0, 0)
    assert a1["config"]["train.steps"] == 3 and a1["config"]["model.preset"] == "tiny"
    assert sorted(a1["history"]) == [1, 2] and sorted(a2["history"]) == [3]  # each step once in the W&B run
    sent = {**a1["history"], **a2["history"]}
    for step, row in ((1, first[0]), (2, first[1]), (3, rows[2])):  # the point W&B holds: its attempt's row, exact
        assert sent[step] == scalars(row) and set(sent[step]) == KEYS, step
    for step in (1, 2, 3):  # the resumed run redid step 2 exactly: every step's loss is metrics.jsonl's
        assert sent[step]["loss"] == rows[step - 1]["loss"] and 0.5 < sent[step]["loss"] < 3
    assert sent[2]["attempt"] == 1 != rows[1]["attempt"]  # (the redone point itself is not sent)
    assert json.loads((run / "wandb" / "genoctx.json").read_text())["step"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # nothing outside the run folder


def test_cli_logger_wandb_keeps_stdout_json_and_stderr_genoctx_lines(prepared, tmp_path):
    """In a fresh process (as a user runs it), W&B prints nothing: stdout is the JSON summary, stderr genoctx's."""
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")} | {"WANDB_MODE": "offline"}
    r = subprocess.run(
        [sys.executable, "-m", "genoctx", "train", "--data", str(prepared), "--recipe", str(TINY), "--out", str(run),
         "--steps", "1", "--logger", "wandb"],
        capture_output=True, text=True, cwd=tmp_path, env=env | {"PYTHONPATH": str(REPO)}, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads(r.stdout)  # the whole of stdout: one JSON document
    assert summary["steps_run"] == 1 and summary["final_loss"] == rows[0]["loss"]
    lines = r.stderr.splitlines()
    assert all(re.match(r"\d\d:\d\d:\d\d (INFO|WARNING) genoctx[.\w]*: ", ln) for ln in lines), r.stderr
    assert len(lines) == 2 and "wandb" not in r.stderr.lower(), r.stderr  # the model line, step 1/1
    (only,) = _offline_runs(run)
    assert only["history"] == {row["step"]: scalars(row) for row in rows} and set(only["history"][1]) == KEYS
    assert not (tmp_path / "wandb").exists()  # nothing outside the run folder


def test_wandb_init_error_is_one_line_exit_2(prepared, tmp_path, offline, monkeypatch):
    """W&B refusing to start (online without an API key, say) is one line naming --logger wandb and the way out."""

    def refuse(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.\nmore detail")

    monkeypatch.setattr(wandb, "init", refuse)
    res = CliRunner().invoke(app, ["train", "--data", str(prepared), "--recipe", str(TINY), "--out",
                                   str(tmp_path / "run"), "--steps", "1", "--logger", "wandb"])  # fmt: skip
    assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and "genoctx: error: " in ln]
    assert len(lines) == 1, res.stderr
    assert lines[0].endswith(
        "--logger wandb (train.loggers): No API key configured. Use `wandb login` to log in.; "
        "or WANDB_MODE=offline to keep the run's W&B files under RUN/wandb (wandb sync later)"
    )
    assert "more detail" not in res.stderr


def test_wandb_online_without_api_key_or_bad_mode_is_refused_before_the_run_folder(prepared, tmp_path, monkeypatch):
    """Online with no credentials (wandb.login finds none: faked, so no key on this machine can reach a server) or a
    bad WANDB_MODE: one line, exit 2, before the run folder is touched and before wandb.init."""

    def error_line(mode):
        monkeypatch.setenv("WANDB_MODE", mode)
        wandb.teardown()
        res = CliRunner().invoke(app, ["train", "--data", str(prepared), "--recipe", str(TINY), "--out",
                                       str(tmp_path / "run"), "--steps", "1", "--logger", "wandb"])  # fmt: skip
        wandb.teardown()
        assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("genoctx: error: --logger wandb (train.loggers): "), lines
        assert not (tmp_path / "run").exists()
        return lines[0]

    asked = []
    monkeypatch.setattr(wandb, "login", lambda **kw: asked.append(kw) or False)
    monkeypatch.setattr(wandb, "init", lambda **kw: pytest.fail("wandb.init reached"))
    assert error_line("online").endswith(
        "W&B is online and has no API key here: run wandb login or set WANDB_API_KEY, or WANDB_MODE=offline to keep "
        "the run's W&B files under RUN/wandb (wandb sync later)"
    )
    assert asked == [{"verify": False, "prompt": False}]  # no network, no prompt
    line = error_line("bogus")
    assert "W&B's settings: mode: Input should be 'online', 'offline'" in line and "WANDB_MODE=offline" in line
    assert len(asked) == 1  # the settings failed first
