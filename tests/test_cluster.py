"""``genoctx.cluster``: a worker group that can never be placed, or is not placed in time, is one line and exit 2.

The local case needs no Ray: more GPUs asked than ``torch.cuda.device_count()`` is refused before Ray starts. The
cluster case (``--address``) runs against a small Ray head started here (2 CPUs, one of them held by a placement group
``blocker`` of its own, as another job would hold it): 3 workers can never fit (refused at once), 2 fit the cluster
but not its free CPU (refused after ``--placement-timeout``); afterwards only ``blocker`` is left on the cluster.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest
import torch
from cli_runner import run_genoctx  # tests/cli_runner.py: tests/ is on sys.path (its conftest.py)

from genoctx.cluster import _workers_per_node, check_local, gpus_needed
from genoctx.errors import GenoctxError

SETS = ["train.seq_len=256", "train.warmup_steps=1"]
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="the local case is this GPU-less machine's")


def _genoctx(*args, env=None):
    return run_genoctx(*args, env={**os.environ, **(env or {})}, timeout=300)


def _train(prepared, out, *args, env=None):
    sets = [x for s in SETS for x in ("--set", s)]
    return _genoctx("train", "--recipe", "recipes/tiny.yaml", *sets, "--data", str(prepared), "--out", str(out),
                    *args, env=env)  # fmt: skip


def _one_error_line(r) -> str:
    """The run's one error line, checked: exit 2, no traceback, nothing after it, and no other genoctx error."""
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("genoctx: error: "), r.stderr
    assert sum(line.startswith("genoctx: error") for line in lines) == 1, r.stderr
    return lines[-1]


@pytest.mark.parametrize(
    "workers, gpus, need",
    [(1, 0, 0), (2, 1, 2), (2, 2, 4), (3, 0.5, 2), (4, 0.25, 1), (5, 0.25, 2), (3, 0.6, 3), (10, 0.1, 1)],
)
def test_gpus_needed_packs_fractions_without_splitting_a_worker_over_two_gpus(workers, gpus, need):
    assert gpus_needed(workers, gpus) == need


def test_workers_per_node_counts_the_scarcest_resource():
    node = {"CPU": 8.0, "GPU": 2.0, "memory": 1e9}
    assert _workers_per_node(node, {"CPU": 1}) == 8
    assert _workers_per_node(node, {"CPU": 1, "GPU": 1}) == 2
    assert _workers_per_node(node, {"CPU": 1, "GPU": 0.5}) == 4
    assert _workers_per_node(node, {"CPU": 1, "GPU": 0.6}) == 2  # 0.6 + 0.6 do not share one GPU
    assert _workers_per_node(node, {"CPU": 1, "GPU": 4}) == 0  # 4 GPUs on one node: never on this one
    assert _workers_per_node({"CPU": 2.0}, {"CPU": 1, "GPU": 1}) == 0


def test_check_local_counts_torch_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_local(4, 0.5) == 2
    assert check_local(2, 1) == 2
    assert check_local(64, 0) == 2  # CPU workers: the local Ray gets enough CPUs
    with pytest.raises(GenoctxError) as e:
        check_local(3, 0.6)
    assert str(e.value) == (
        "--num-workers 3 x --gpus-per-worker 0.6 = 3 GPUs asked (a GPU holds 1 worker of 0.6); this machine has 2 "
        "(torch.cuda.device_count()); pass --address for a Ray cluster"
    )
    with pytest.raises(GenoctxError, match=r"--gpus-per-worker 1.5: above 1 it must be a whole number"):
        check_local(1, 1.5)


@NO_GPU
def test_train_asking_gpus_on_a_machine_without_any_is_one_line_before_ray(prepared, tmp_path):
    r = _train(prepared, tmp_path / "run", "--num-workers", "2", "--gpus-per-worker", "1")
    line = _one_error_line(r)
    assert line == (
        "genoctx: error: --num-workers 2 x --gpus-per-worker 1 = 2 GPUs asked; this machine has 0 "
        "(torch.cuda.device_count()); --gpus-per-worker 0 runs on the CPU"
    )
    assert len(r.stderr.strip().splitlines()) == 1  # no Ray line: Ray never started
    assert not (tmp_path / "run").exists()


@NO_GPU
def test_eval_asking_gpus_on_a_machine_without_any_is_one_line_before_ray(prepared, tmp_path):
    r = _genoctx("eval", "--by-position", "--data", str(prepared), "--checkpoint", str(tmp_path / "none"),
                 "--num-workers", "4", "--gpus-per-worker", "0.5")  # fmt: skip
    assert _one_error_line(r).endswith("= 2 GPUs asked (a GPU holds 2 workers of 0.5); this machine has 0 "
                                       "(torch.cuda.device_count()); --gpus-per-worker 0 runs on the CPU")  # fmt: skip
    assert len(r.stderr.strip().splitlines()) == 1


def test_placement_timeout_needs_num_workers_and_is_not_negative(prepared, tmp_path):
    r = _train(prepared, tmp_path / "run", "--placement-timeout", "5")
    assert "--placement-timeout need --num-workers" in _one_error_line(r)
    r = _train(prepared, tmp_path / "run", "--num-workers", "2", "--placement-timeout", "-1")
    assert "--placement-timeout: must be >= 0" in _one_error_line(r)
    r = _genoctx("eval", "--by-position", "--data", str(prepared), "--placement-timeout", "5")
    assert "--placement-timeout needs --num-workers" in _one_error_line(r)
    assert not (tmp_path / "run").exists()


def test_an_address_where_nothing_listens_is_one_line_at_once(prepared, tmp_path):
    with socket.socket() as s:  # a port nothing listens on once it is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _train(prepared, tmp_path / "run", "--num-workers", "2", "--address", f"127.0.0.1:{port}")
    assert _one_error_line(r) == (
        f"genoctx: error: --address 127.0.0.1:{port}: no Ray cluster answers there (Connection refused)"
    )


HEAD = """
import signal, sys, time, ray
from ray.util.placement_group import placement_group
ray.init(num_cpus=2, include_dashboard=False, _temp_dir=sys.argv[1], object_store_memory=128 << 20,
         logging_config=ray.LoggingConfig(log_level="ERROR"))
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))  # exit runs ray.shutdown: the head's processes end with it
pg = placement_group([{"CPU": 1}], name="blocker")
assert pg.wait(120)
print(ray.get_runtime_context().gcs_address, flush=True)
while True:
    time.sleep(1)
"""

STATE = """
import json, sys, ray
from ray._private.state import actors
ray.init(address=sys.argv[1], logging_config=ray.LoggingConfig(log_level="ERROR"))
pgs = [(p["name"], p["state"]) for p in ray.util.placement_group_table().values()]
alive = [a for a in actors().values() if a["State"] == "ALIVE"]
print(json.dumps({"pgs": pgs, "actors": len(alive), "free_cpu": ray.available_resources().get("CPU", 0)}))
"""

# a local head started by ray.init uses token authentication (~/.ray/auth_token); a driver given its address
# explicitly uses it only when told to
AUTH = {"RAY_AUTH_MODE": "token"}


@pytest.fixture(scope="module")
def head():
    """The address of a Ray head with 2 CPUs, one held by the placement group ``blocker``; stopped afterwards."""
    temp = tempfile.mkdtemp(prefix="gx-t-", dir="/tmp")  # short: Ray's unix socket paths
    proc = subprocess.Popen([sys.executable, "-c", HEAD, temp], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        address = proc.stdout.readline().strip()
        if not address:
            proc.kill()
            pytest.fail(f"the Ray head did not start: {proc.stderr.read()[-2000:]}")
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(temp, ignore_errors=True)


def _cluster_state(address: str) -> dict:
    r = subprocess.run([sys.executable, "-c", STATE, address], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **AUTH})  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _assert_only_the_blocker_is_left(address: str) -> None:
    state = _cluster_state(address)
    live = [name for name, s in state["pgs"] if s != "REMOVED"]
    assert live == ["blocker"], state
    assert len(state["pgs"]) >= 2, state  # the run did reserve one, and removed it
    assert state["actors"] == 0 and state["free_cpu"] == 1.0, state


def test_a_group_the_cluster_can_never_hold_is_refused_at_once(head, prepared, tmp_path):
    r = _train(prepared, tmp_path / "run", "--num-workers", "3", "--address", head, "--placement-timeout", "600",
               env=AUTH)  # fmt: skip
    assert _one_error_line(r) == (
        "genoctx: error: distributed training: --num-workers 3 x {CPU 1} can never be placed: the cluster's 1 "
        "node(s) hold at most 2 such workers (free: CPU 1 of 2; a cluster that autoscales may grow: "
        "--placement-timeout 0 waits for it)"
    )
    state = _cluster_state(head)
    assert [name for name, s in state["pgs"] if s != "REMOVED"] == ["blocker"], state
    assert state["actors"] == 0 and state["free_cpu"] == 1.0, state


def test_a_group_not_placed_in_time_is_refused_and_nothing_is_left(head, prepared, tmp_path):
    r = _train(prepared, tmp_path / "run", "--num-workers", "2", "--address", head, "--placement-timeout", "3",
               env=AUTH)  # fmt: skip
    assert _one_error_line(r) == (
        "genoctx: error: distributed training: --num-workers 2 x {CPU 1} not placed within --placement-timeout 3 s "
        "(free: CPU 1 of 2; raise --placement-timeout to wait longer, 0 waits forever)"
    )
    _assert_only_the_blocker_is_left(head)


def test_eval_on_the_cluster_takes_the_placement_timeout(head, prepared, tmp_path):
    from genoctx.recipes import load_recipe
    from genoctx.train.loop import train

    train(prepared, load_recipe("recipes/tiny.yaml", ["train.steps=0", *SETS]), tmp_path / "init")
    r = _genoctx("eval", "--by-position", "--data", str(prepared), "--checkpoint", str(tmp_path / "init"),
                 "--max-windows", "2", "--num-workers", "2", "--address", head, "--placement-timeout", "2",
                 env=AUTH)  # fmt: skip
    assert _one_error_line(r) == (
        "genoctx: error: distributed eval: --num-workers 2 x {CPU 1} not placed within --placement-timeout 2 s "
        "(free: CPU 1 of 2; raise --placement-timeout to wait longer, 0 waits forever)"
    )
    _assert_only_the_blocker_is_left(head)
