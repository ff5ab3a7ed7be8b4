"""Training metrics to TensorBoard and MLflow (``--logger``, ``train.loggers``): local files holding the numbers of
metrics.jsonl, one point per step; a missing package or an unknown logger is one line, exit 2. (The CLI run here also
checks train's stderr in a pipe: no progress bar.)"""

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from genoctx.cli import app
from genoctx.errors import GenoctxError
from genoctx.recipes import load_recipe
from genoctx.train.loop import train
from genoctx.train.metrics import scalars

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny.yaml"
KEYS = {"attempt", "loss", "aux_loss", "scored_tokens", "grad_norm", "lr", "moe_load_max_over_mean", "tokens",
        "tokens_per_s", "peak_memory_bytes", "seq_chunks"}  # fmt: skip (seq_chunk_tokens is null: one pass)


def _rows(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def _tensorboard(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series as TensorBoard reads it (its EventAccumulator: purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_cli_logger_tensorboard_holds_the_metrics_jsonl_numbers(prepared, tmp_path):
    run = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "genoctx", "train", "--data", str(prepared), "--recipe", str(TINY), "--out", str(run),
         "--steps", "2", "--logger", "tensorboard"],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    # in a pipe: no progress bar, no escape code, the plain log lines as before (tests/test_progress.py: a terminal)
    assert "\x1b[" not in r.stderr and not re.search("[\u2500-\u259f]", r.stderr), r.stderr
    lines = r.stderr.splitlines()
    assert all(re.match(r"\d\d:\d\d:\d\d (INFO|WARNING) genoctx[.\w]*: ", ln) for ln in lines), r.stderr
    assert [ln.split(": ", 1)[1].split("  ")[0] for ln in lines if " step " in ln] == ["step 1/2", "step 2/2"]
    rows = _rows(run)
    assert [row["step"] for row in rows] == [1, 2]
    series = _tensorboard(run / "tensorboard")
    assert set(series) == KEYS == set(scalars(rows[0]))
    for key, points in series.items():  # float32: the event format's simple_value
        assert points == [(row["step"], float(np.float32(row[key]))) for row in rows], key
    assert series["loss"][0][1] == pytest.approx(rows[0]["loss"], rel=1e-7) and 0.5 < series["loss"][0][1] < 3
    assert not (run / "mlruns").exists()  # only what was asked for


def test_mlflow_run_resumes_and_tensorboard_drops_redone_steps(prepared, tmp_path):
    """One MLflow run per run directory, continued by --resume; the numbers are metrics.jsonl's exactly. A resumed
    attempt's TensorBoard purge marker hides what a killed attempt wrote past the checkpoint it resumed from."""
    from mlflow.tracking import MlflowClient
    from tensorboardX import SummaryWriter

    run = tmp_path / "run"
    over = ["train.steps=3", "train.checkpoint_every=1", "train.loggers=tensorboard,mlflow"]
    recipe = load_recipe(TINY, over)
    assert recipe.train.loggers == ["tensorboard", "mlflow"]
    train(prepared, recipe, run, stop_after=1)
    (first,) = (run / "tensorboard").iterdir()
    assert first.name.endswith(".attempt0001")
    with SummaryWriter(str(tmp_path / "killed")) as w:  # what a killed attempt 1 wrote after its checkpoint
        for step in (2, 3):
            w.add_scalar("loss", 99.0, global_step=step)
    (killed,) = (tmp_path / "killed").iterdir()
    killed.rename(run / "tensorboard" / f"{first.name}.killed")  # read after attempt 1's file, before attempt 2's
    train(prepared, recipe, run, resume=True)
    rows = _rows(run)
    assert [(row["step"], row["attempt"]) for row in rows] == [(1, 1), (2, 2), (3, 2)]
    assert _tensorboard(run / "tensorboard")["loss"] == [(row["step"], float(np.float32(row["loss"]))) for row in rows]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlruns' / 'mlflow.db'}")
        (only,) = client.search_runs([client.get_experiment_by_name("genoctx").experiment_id])
    assert only.info.status == "FINISHED" and only.info.run_name == "run"
    assert only.data.params["train.steps"] == "3" and only.data.params["model.preset"] == "tiny"
    assert set(only.data.metrics) == KEYS
    for key in KEYS:
        history = sorted((m.step, m.value) for m in client.get_metric_history(only.info.run_id, key))
        assert history == [(row["step"], float(row[key])) for row in rows], key  # exact: doubles
    assert not list(Path.cwd().glob("mlruns"))  # nothing outside the run directory


def test_unknown_logger_and_missing_package_are_one_line_exit_2(prepared, tmp_path, monkeypatch):
    def error_line(*args):
        res = CliRunner().invoke(app, ["train", "--data", str(prepared), "--recipe", str(TINY), "--out",
                                       str(tmp_path / "run"), "--steps", "1", *args])  # fmt: skip
        assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("genoctx: error: "), res.stderr
        return lines[0]

    assert "--logger 'neptune'" in error_line("--logger", "tensorboard,neptune")
    assert "train.loggers must list some of 'tensorboard', 'mlflow', 'wandb', got 'foo'" in error_line(
        "--set", "train.loggers=foo"
    )
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if mlflow-skinny were not installed
    line = error_line("--logger", "tensorboard", "--logger", "mlflow")
    assert "--logger mlflow (train.loggers) needs the mlflow package" in line
    assert line.endswith("not installed here: pip install 'genoctx[loggers]'"), line
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert "--logger wandb (train.loggers) needs the wandb package" in error_line("--logger", "wandb")
    assert not (tmp_path / "run").exists()  # refused before the run folder is touched
    with pytest.raises(GenoctxError, match=r"genoctx\[loggers\]"):
        train(prepared, load_recipe(TINY, ["train.loggers=[mlflow]"]), tmp_path / "lib")
