"""``genoctx.cluster``'s logs: Ray's own lines of a run go to its log file, genoctx's worker lines to stderr, and what
a killed driver's Ray left running is stopped by the next start in the same run folder.

The Ray test runs one script (``RUNS``) in a subprocess, so that its stderr is what a user sees: it starts a local
Ray as ``run_workers`` does (``_connect``) and runs two small worker groups on it (no model, no training): one that
succeeds while Ray Train prints its ``TrainingReport(...)`` lines and a ``ray.train`` logger prints a traceback (as
Ray's internals do on a loaded machine), one whose rank 1 raises. The other tests need no Ray.
"""

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from genoctx.cluster import _MARK, _Marked, _RayLog, stop_stale_ray

REPO = Path(__file__).resolve().parents[1]

RUNS = r"""
import json, logging, sys
from pathlib import Path
from genoctx.cluster import _connect, run_workers
from genoctx.errors import GenoctxError

def work(cfg, session):  # pickled by value (it lives in __main__): the workers need no test module
    import logging, ray.train
    from genoctx.train.distributed import worker_logging
    worker_logging()  # what genoctx's train and eval workers do first
    rank = ray.train.get_context().get_world_rank()
    if rank == 0:  # as genoctx's workers log (Ray would fold the same line of every rank into one)
        logging.getLogger("genoctx.train").info("genoctx line from rank 0 of %s", cfg["name"])
    for step in range(2):
        session.report({"step": step})
    try:
        raise ValueError("internal hiccup")
    except ValueError:  # what Ray prints of its own on a loaded machine: a traceback through its logger
        logging.getLogger("ray.train.fake").exception("Ray-internal traceback of a run that goes on")
    if cfg["fail"] and rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    return {"rank": rank}

storage = Path(sys.argv[1])
_connect(None, storage, 2, 0)  # a local Ray started as run_workers starts it; both runs attach to it
out = {}
for name, fail in [("ok", False), ("fail", True)]:
    print(f"=== {name}", file=sys.stderr, flush=True)
    try:
        run = run_workers(work, {"fail": fail, "name": name}, num_workers=2, storage_path=storage / name,
                          run_name="ray", placement_timeout=0)
        out[name] = run.value
    except GenoctxError as e:
        print(f"genoctx: error: {e}", file=sys.stderr, flush=True)
        out[name] = str(e)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """The two runs' ``(stdout JSON, stderr of the ok run, stderr of the failing run, run folder)``."""
    storage = tmp_path_factory.mktemp("logs")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", RUNS, str(storage)], capture_output=True, text=True, timeout=600,
                       env=env, cwd=REPO)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    _, after_ok = r.stderr.split("=== ok\n", 1)
    ok, failed = after_ok.split("=== fail\n", 1)
    return json.loads(r.stdout.strip().splitlines()[-1]), ok, failed, storage


@pytest.mark.slow
def test_a_successful_run_shows_genoctx_lines_and_logs_ray_lines(two_runs):
    out, ok, _, storage = two_runs
    assert out["ok"] == {"rank": 0}
    assert "genoctx line from rank 0 of ok\n" in ok, ok  # all of the run's lines arrive before it returns
    assert "TrainingReport(" not in ok and "Traceback" not in ok and "internal hiccup" not in ok, ok
    assert _MARK not in ok, ok
    log = (storage / "ok" / "ray.log").read_text()
    reports = [line for line in log.splitlines() if "TrainingReport(" in line]
    assert len(reports) == 4, log  # 2 steps x 2 ranks, each behind its source
    assert all(line.startswith("[RayTrainWorker pid=") for line in reports), reports
    assert "Traceback (most recent call last):" in log and "ValueError: internal hiccup" in log
    assert "genoctx line from rank 0 of ok" in log and _MARK not in log and "genoctx-end" not in log


@pytest.mark.slow
def test_a_failing_worker_is_one_line_naming_rank_error_and_log(two_runs):
    out, _, failed, storage = two_runs
    log_path = storage / "fail" / "ray.log"
    why = "rank 1: RuntimeError: rank 1 fails on purpose"
    assert out["fail"] == f"distributed run failed: {why} (Ray's log: {log_path})"
    # the error line, once, after the workers' lines (the Ray Train controller's report of the failure arrives after
    # it, on a loaded machine after the run returned: ``_LateLines`` sends it to the log file)
    lines = failed.strip().splitlines()
    assert lines.count(f"genoctx: error: {out['fail']}") == 1 and f"genoctx: error: {out['fail']}" in lines[-2:]
    assert "genoctx line from rank 0 of fail\n" in failed, failed
    assert "Traceback" not in failed and "TrainingReport(" not in failed, failed
    log = log_path.read_text()
    assert "RuntimeError: rank 1 fails on purpose" in log and "Traceback (most recent call last):" in log


def test_marked_lines_and_the_router(tmp_path, capsys):
    """Every line of a genoctx record is marked; the router writes every line to the file and sends only the marked
    ones to the user; Ray's driver-side logger and its GCS error printer write to the file while it is active and
    are given back after."""
    import ray._private.worker as rw

    record = logging.LogRecord("genoctx.train", logging.INFO, __file__, 1, "a\nb", None, None)
    assert _Marked("%(message)s").format(record) == f"{_MARK}a\n{_MARK}b"

    printed = []
    ray_logger = logging.getLogger("ray")
    handlers, printer = list(ray_logger.handlers), rw.print_to_stdstream
    path = tmp_path / "logs" / "ray.log"
    with _RayLog(path, (logging.INFO, logging.getLogger().handlers[:])) as routed:
        routed._printer = lambda data, ignore_prefix: printed.append((data["lines"], ignore_prefix))
        routed.route({"pid": 7, "actor_name": "RayTrainWorker", "lines": [f"{_MARK}step 3", "TrainingReport(x)"]})
        rw.print_to_stdstream({"pid": "raylet", "is_err": False, "lines": ["Traceback: a worker died"]}, False)
        ray_logger.error("driver-side Ray error")
    assert rw.print_to_stdstream is printer and ray_logger.handlers == handlers
    assert printed == [([f"{_MARK}step 3"], True)]  # Ray's printer strips the mark
    log = path.read_text().splitlines()
    assert log[1:3] == ["[RayTrainWorker pid=7] step 3", "[RayTrainWorker pid=7] TrainingReport(x)"]
    assert log[3] == "[pid=raylet] Traceback: a worker died"
    assert log[4].endswith("ERROR ray: driver-side Ray error")
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_late_lines_of_a_run_on_a_ray_that_lives_on_go_to_its_log(tmp_path, monkeypatch):
    """On a Ray that lives on after the run (attached), Ray Train's actors' batches that arrive after the run returned
    (the controller's failure report: CI once printed it after genoctx's error line) go to the run's log file, their
    marked lines still to the user; other actors' batches to Ray's printer; the next run unwraps Ray's printer."""
    import ray._private.worker as rw
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    printed = []

    def ray_printer(data, ignore_prefix=False):
        printed.append(data["lines"])

    monkeypatch.setattr(rw, "print_to_stdstream", ray_printer)
    monkeypatch.setattr(dispatcher, "handlers", [("ray_print_logs", ray_printer)])
    monkeypatch.setattr(rw.global_worker, "_is_connected", True)  # an attached Ray: it lives on after the run
    path = tmp_path / "run" / "ray.log"
    with _RayLog(path, (logging.INFO, logging.getLogger().handlers[:])):
        pass
    late = dict(dispatcher.handlers)["ray_print_logs"]
    assert late is not ray_printer and rw.print_to_stdstream is not ray_printer
    controller = {"pid": 9, "actor_name": "TrainController", "is_err": True,
                  "lines": ["Error: Training failed due to worker errors:", "Traceback (most recent call last):",
                            f"{_MARK}genoctx: a late marked line"]}  # fmt: skip
    late(controller)
    rw.print_to_stdstream({**controller, "lines": ["RuntimeError: rank 1 fails on purpose"]}, False)
    late({"pid": 5, "actor_name": "SomeoneElse", "is_err": True, "lines": ["another job's line"]})
    assert printed == [[f"{_MARK}genoctx: a late marked line"], ["another job's line"]]
    log = path.read_text().splitlines()
    assert log[1:] == ["[TrainController pid=9] Error: Training failed due to worker errors:",
                       "[TrainController pid=9] Traceback (most recent call last):",
                       "[TrainController pid=9] genoctx: a late marked line",
                       "[TrainController pid=9] RuntimeError: rank 1 fails on purpose"]  # fmt: skip
    with _RayLog(tmp_path / "next" / "ray.log", (logging.INFO, logging.getLogger().handlers[:])) as routed:
        assert routed._printer is ray_printer  # Ray's own printer under the last run's wrapper
    assert dict(dispatcher.handlers)["ray_print_logs"].printer is ray_printer  # one wrapper, not a chain
    assert rw.print_to_stdstream.printer is ray_printer


HOLD = textwrap.dedent("""
    import os, signal, sys, time
    if os.environ.get("IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    path = os.environ.get("HOLD_FILE")
    f = open(path, "a") if path else None  # held open, named nowhere in the command line (Ray's agents)
    print("up", flush=True)
    time.sleep(600)
""")


def _holder(*args: str, **env: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, *args], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, **env})  # fmt: skip
    assert p.stdout.readline().strip() == "up"
    return p


def test_the_next_start_stops_what_a_killed_driver_left(tmp_path):
    """Processes that hold a file open under RUN/.ray, or name it in their command line, or hold one in the /tmp
    directory that RUN/.ray-temp names, are stopped (SIGTERM, SIGKILL for one that ignores it) and the directories
    removed; a process of another run folder whose name starts the same is left alone."""
    run, other = tmp_path / "run", tmp_path / "run-2"
    logs = run / ".ray" / "session_1" / "logs"
    logs.mkdir(parents=True)
    (other / ".ray").mkdir(parents=True)
    tmp_ray = Path(__import__("tempfile").mkdtemp(prefix="gx-ray-", dir="/tmp"))
    (run / ".ray-temp").write_text(f"{tmp_ray}\n")
    agent = _holder(HOLD_FILE=str(logs / "agent.log"))
    raylet = _holder(f"--log_dir={logs}")
    stubborn = _holder(HOLD_FILE=str(tmp_ray / "x.log"), IGNORE_TERM="1")
    bystander = _holder(HOLD_FILE=str(other / ".ray" / "agent.log"))
    try:
        stopped = stop_stale_ray(run, grace=1.0)
        assert sorted(stopped) == sorted([agent.pid, raylet.pid, stubborn.pid])
        for p in (agent, raylet, stubborn):  # gone (and reaped by psutil): the stubborn one only by SIGKILL
            with pytest.raises(ProcessLookupError):
                os.kill(p.pid, 0)
        assert bystander.poll() is None
        assert not (run / ".ray").exists() and not tmp_ray.exists() and not (run / ".ray-temp").exists()
        assert (other / ".ray").is_dir()
        assert stop_stale_ray(run) == []  # nothing left: nothing to do
    finally:
        for p in (agent, raylet, stubborn, bystander):
            p.kill()
            p.wait()
