"""Where training's per-step metrics go: ``RUN/metrics.jsonl``, and the same rows to TensorBoard, MLflow or W&B.

``train.loggers`` (``genoctx train --logger tensorboard|mlflow|wandb``, repeatable or a comma list; none by default)
adds, next to metrics.jsonl and from the same rows (TensorBoard and MLflow: local files only, no server is contacted):

- ``tensorboard``: event files under ``RUN/tensorboard`` (tensorboardX's ``SummaryWriter``: ``tensorboard --logdir
  RUN/tensorboard``). A resumed attempt writes a purge marker at its first step, so TensorBoard drops the points an
  earlier attempt wrote past the checkpoint it resumed from (as metrics.jsonl is cut back). Scalars are float32
  (the event format's ``simple_value``).
- ``mlflow``: one MLflow run per run directory in the SQLite store ``RUN/mlruns/mlflow.db`` (``mlflow ui
  --backend-store-uri sqlite:///RUN/mlruns/mlflow.db``), experiment ``genoctx``, the recipe's ``train``, ``loss`` and
  ``data`` keys and ``model.preset``/``model.init`` as parameters; a resumed attempt continues the same MLflow run,
  and steps it redoes are logged again (``attempt`` says which attempt computed a point). MLflow's telemetry is
  turned off (``MLFLOW_DISABLE_TELEMETRY``, unless set).
- ``wandb``: one W&B run per run directory, its files under ``RUN/wandb``; online or offline as W&B's own settings
  say (``WANDB_MODE=offline``: nothing is sent, ``wandb sync RUN/wandb/offline-run-*`` later; online needs ``wandb
  login`` or ``WANDB_API_KEY``), project ``$WANDB_PROJECT`` or ``genoctx``, run name the run folder's, the recipe's
  keys as config (as MLflow's parameters). The run id is kept in ``RUN/wandb/genoctx.json`` with the last step sent:
  a resumed attempt continues the same W&B run (``resume="allow"``) and sends only the steps after it, because a
  W&B run's steps only increase: a step that a resumed attempt redoes keeps the first attempt's point in W&B
  (metrics.jsonl and TensorBoard hold the redone one, MLflow both). W&B's console capture is off and it prints
  nothing (``silent``): stdout stays genoctx's JSON.

Every numeric top-level field of a metrics row but ``step`` (loss, aux_loss, grad_norm, lr, tokens_per_s,
peak_memory_bytes, ...) is one scalar at that step; lists (``layers``, ``ranks``) and null values are not logged.
The packages are the ``genoctx[loggers]`` extra (tensorboardX; mlflow-skinny with SQLAlchemy and Alembic; wandb),
imported only when asked for.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
import uuid
import warnings
from pathlib import Path

from ..errors import GenoctxError
from ..recipes import LOGGERS

log = logging.getLogger("genoctx.train")

# logger (genoctx.recipes.LOGGERS) -> the modules it imports, each from the genoctx[loggers] extra
MODULES = {"tensorboard": ("tensorboardX",), "mlflow": ("mlflow", "sqlalchemy", "alembic"), "wandb": ("wandb",)}
EXTRA = "pip install 'genoctx[loggers]'"
MLFLOW_EXPERIMENT = "genoctx"
WANDB_PROJECT = "genoctx"  # unless $WANDB_PROJECT names one
WANDB_OFFLINE = "or WANDB_MODE=offline to keep the run's W&B files under RUN/wandb (wandb sync later)"


def check_loggers(names: list[str]) -> None:
    """Check that every logger in ``names`` is known and its packages are installed (no import, nothing written;
    but ``wandb`` is imported to ask W&B's settings whether it runs online and, if so, has an API key: no network).

    Raises:
        GenoctxError: an unknown name, or a missing package (one line naming the logger, the package and the
            ``genoctx[loggers]`` extra to install), or W&B online without credentials or with bad settings.
    """
    for name in names:
        if name not in LOGGERS:
            raise GenoctxError(f"--logger {name!r}: expected {' or '.join(LOGGERS)} (train.loggers)")
        missing = [m for m in MODULES[name] if importlib.util.find_spec(m) is None]
        if missing:
            raise GenoctxError(
                f"--logger {name} (train.loggers) needs the {', '.join(missing)} package"
                f"{'s' if len(missing) > 1 else ''}, not installed here: {EXTRA}"
            )
        if name == "wandb":
            _check_wandb()


def _check_wandb() -> None:
    """W&B's mode (``WANDB_MODE``, ``wandb offline``) and, online, its credentials, asked without network or prompt.

    Raises:
        GenoctxError: online with no API key (``wandb login``, ``WANDB_API_KEY``), or a bad W&B setting.
    """
    import wandb

    try:
        mode = wandb.setup(wandb.Settings(silent=True)).settings.mode
        if mode in ("offline", "dryrun", "disabled") or wandb.login(verify=False, prompt=False):
            return
    except (wandb.errors.Error, ValueError) as e:  # ValueError: pydantic's, of a bad WANDB_* value
        errors = e.errors() if callable(getattr(e, "errors", None)) else []
        msg = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in errors) or str(e).strip()
        raise GenoctxError(
            f"--logger wandb (train.loggers): W&B's settings: {msg.splitlines()[0]}; {WANDB_OFFLINE}"
        ) from None
    raise GenoctxError(f"--logger wandb (train.loggers): W&B is online and has no API key here: run wandb login or "
                       f"set WANDB_API_KEY, {WANDB_OFFLINE}")  # fmt: skip


def scalars(row: dict) -> dict[str, float]:
    """The numeric top-level fields of a metrics row but ``step`` (bools, None, lists and dicts left out)."""
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)}


class MetricsLog:
    """A training process's metrics sink: one JSON line per step in ``RUN/metrics.jsonl`` (appended; the caller
    has cut it back to ``start``) and the same row to each logger of ``loggers``.

    Use as a context manager (``with MetricsLog(out, ...) as metrics: metrics.write(row)``); the loggers are opened
    on entry and closed on exit (an MLflow run is marked FINISHED, KILLED on Ctrl-C or FAILED; a W&B run finishes
    with exit code 0, 130 or 1).

    Args:
        out: the run directory.
        loggers: names from ``genoctx.recipes.LOGGERS`` (``recipe.train.loggers``), checked by :func:`check_loggers`.
        start: the step this attempt starts from (the rows it writes are steps ``start + 1, ...``).
        recipe: the run's ``genoctx.recipes.Recipe`` (MLflow's parameters, W&B's config), or None.
        attempt: the attempt's number (``genoctx.train.loop.begin_attempt``): TensorBoard's file name ends with it,
            so an attempt's file sorts after its predecessors' (TensorBoard reads them in name order).
    """

    def __init__(self, out: str | Path, loggers: list[str] = (), start: int = 0, recipe=None, attempt: int = 1):
        self.out, self.names, self.start, self.recipe = Path(out), list(loggers), int(start), recipe
        self.attempt = int(attempt)
        self._file = None
        self._sinks: list = []

    def __enter__(self) -> MetricsLog:
        check_loggers(self.names)
        self._file = open(self.out / "metrics.jsonl", "a")  # noqa: SIM115 - closed in __exit__
        try:
            for name in self.names:
                if name == "tensorboard":
                    self._sinks.append(_TensorBoard(self.out, self.start, self.attempt))
                elif name == "mlflow":
                    self._sinks.append(_MLflow(self.out, self.recipe))
                else:
                    self._sinks.append(_WandB(self.out, self.recipe))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def write(self, row: dict) -> None:
        """Append ``row`` (one step: ``step`` and its metrics) to metrics.jsonl, flushed, and log its scalars."""
        self._file.write(json.dumps(row, default=str) + "\n")
        self._file.flush()
        values = scalars(row)
        for sink in self._sinks:
            sink.log(int(row["step"]), values)

    def __exit__(self, exc_type, exc, tb) -> None:
        status = "FINISHED" if exc_type is None else "KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED"
        for sink in self._sinks:
            try:
                sink.close(status)
            except Exception as e:  # noqa: BLE001 - a logger failing to close must not hide the run's own error
                log.warning("closing the %s logger: %s", type(sink).__name__.strip("_").lower(), e)
        self._sinks = []
        if self._file is not None:
            self._file.close()
            self._file = None


class _TensorBoard:
    """Scalars to event files under ``RUN/tensorboard`` (tensorboardX)."""

    def __init__(self, out: Path, start: int, attempt: int):
        from tensorboardX import SummaryWriter

        # purge_step: TensorBoard drops an earlier attempt's points at steps >= start + 1 (redone by this attempt).
        # File names are events.out.tfevents.SECONDS.HOST + suffix: the attempt's number orders (and keeps apart)
        # two attempts that start within one second
        self.writer = SummaryWriter(logdir=str(out / "tensorboard"), purge_step=start + 1,
                                    filename_suffix=f".attempt{attempt:04d}")  # fmt: skip

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()


class _MLflow:
    """Metrics to the run directory's own MLflow store, ``RUN/mlruns/mlflow.db`` (SQLite; mlflow-skinny)."""

    def __init__(self, out: Path, recipe):
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # local files only: no usage reports either
        root = out.resolve() / "mlruns"
        root.mkdir(parents=True, exist_ok=True)
        for name in ("mlflow.store.db.utils", "alembic"):  # "creating initial MLflow database tables ..."
            logging.getLogger(name).setLevel(logging.WARNING)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # SQLAlchemy's about MLflow's mappers
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
            exp = self.client.get_experiment_by_name(MLFLOW_EXPERIMENT)
        self._metric = Metric
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
            MLFLOW_EXPERIMENT, artifact_location=(root / "artifacts").as_uri())  # fmt: skip
        runs = self.client.search_runs([exp_id], max_results=1, order_by=["attributes.start_time ASC"])
        if runs:  # a resumed attempt: the same MLflow run
            self.run_id = runs[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(exp_id, run_name=out.name, tags={"genoctx.run": str(out.resolve())}
                                                 ).info.run_id  # fmt: skip
            params = [Param(k, v) for k, v in _params(recipe).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
                self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, step: int, values: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(k, float(v), now, step) for k, v in values.items()]  # (NaN kept: MLflow's is_nan)
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)


class _WandB:
    """Metrics to one W&B run per run directory (files under ``RUN/wandb``; its id in ``RUN/wandb/genoctx.json``)."""

    STATUS_EXIT = {"FINISHED": 0, "KILLED": 130, "FAILED": 1}  # MetricsLog's status -> the W&B run's exit code

    def __init__(self, out: Path, recipe):
        import wandb

        root = out.resolve() / "wandb"
        root.mkdir(parents=True, exist_ok=True)
        self.state = root / "genoctx.json"
        saved = json.loads(self.state.read_text()) if self.state.exists() else {}
        self.id, self.step = saved.get("id") or uuid.uuid4().hex[:12], int(saved.get("step", 0))
        try:
            self.run = wandb.init(
                dir=str(out.resolve()), id=self.id, resume="allow", name=out.name, job_type="train",
                project=None if os.environ.get("WANDB_PROJECT") else WANDB_PROJECT,
                config=_config(recipe), settings=wandb.Settings(console="off", silent=True),
            )  # fmt: skip
        except wandb.errors.Error as e:  # credentials refused, ... (check_loggers found none missing): W&B's line
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GenoctxError(f"--logger wandb (train.loggers): {msg}; {WANDB_OFFLINE}") from None
        self._save()

    def _save(self) -> None:
        tmp = self.state.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"id": self.id, "step": self.step}) + "\n")
        os.replace(tmp, self.state)

    def log(self, step: int, values: dict[str, float]) -> None:
        if step <= self.step:  # redone after a resume: W&B holds this step already (its steps only increase)
            return
        self.run.log(values, step=step)
        self.step = step
        self._save()

    def close(self, status: str) -> None:
        self.run.finish(exit_code=self.STATUS_EXIT[status])


def _config(recipe) -> dict:
    """The recipe's ``train``, ``loss`` and ``data`` keys and ``model.preset``/``model.init``, flat (``train.lr``)."""
    if recipe is None:
        return {}
    d = recipe.to_dict()
    flat = {f"model.{k}": d["model"].get(k) for k in ("preset", "init")}
    for section in ("train", "loss", "data"):
        flat.update({f"{section}.{k}": v for k, v in d[section].items()})
    return flat


def _params(recipe) -> dict[str, str]:
    """:func:`_config` as MLflow parameters (strings of at most 500 characters)."""
    return {k: str(v)[:500] for k, v in _config(recipe).items()}
