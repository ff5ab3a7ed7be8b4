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

from genoctx.cluster import _workers_per_node, check_gpus_per_worker, check_local, worker_env
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


@pytest.mark.parametrize("value", [0.5, 0.25, 1.5, 2, 8, -1])
def test_gpus_per_worker_other_than_0_or_1_is_refused(value):
    """A fraction puts two NCCL ranks on one GPU ("Duplicate GPU detected"), more than 1 leaves GPUs idle."""
    with pytest.raises(GenoctxError) as e:
        check_gpus_per_worker(value)
    assert str(e.value).startswith(f"--gpus-per-worker {value:g}: must be 1 (one GPU per worker")
    check_gpus_per_worker(0)
    check_gpus_per_worker(1)


def test_workers_per_node_counts_the_scarcest_resource():
    node = {"CPU": 8.0, "GPU": 2.0, "memory": 1e9}
    assert _workers_per_node(node, {"CPU": 1}) == 8
    assert _workers_per_node(node, {"CPU": 1, "GPU": 1}) == 2
    assert _workers_per_node({"CPU": 2.0}, {"CPU": 1, "GPU": 1}) == 0


def test_check_local_counts_torch_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_local(2, 1) == 2
    assert check_local(64, 0) == 2  # CPU workers: the local Ray gets enough CPUs
    with pytest.raises(GenoctxError) as e:
        check_local(3, 1)
    assert str(e.value) == (
        "--num-workers 3 x --gpus-per-worker 1 = 3 GPUs asked; this machine has 2 (torch.cuda.device_count()); pass "
        "--address for a Ray cluster"
    )
    with pytest.raises(GenoctxError, match=r"--gpus-per-worker 0.5: must be 1"):
        check_local(2, 0.5)


def test_workers_get_expandable_segments_and_a_user_value_is_kept():
    """The allocator setting the planner assumes reaches every worker through Ray's runtime environment (item 9)."""
    assert worker_env({}) == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    got = worker_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"})  # the older name, merged into the new
    assert got == {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:True"}
    kept = {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}
    assert worker_env(kept) == kept


def test_the_address_path_hands_the_workers_env_to_ray_train(monkeypatch, tmp_path):
    """``run_workers(address=...)`` (attached to a cluster: the driver's os.environ never reaches its workers) gives
    Ray Train a ``RunConfig`` whose ``worker_runtime_env`` sets ``PYTORCH_ALLOC_CONF``; Ray itself is faked: no
    connection is made and no worker starts."""
    import ray.train.torch

    import genoctx.cluster as cluster

    seen = {}

    class FakeTrainer:
        def __init__(self, loop, *, train_loop_config, scaling_config, run_config):
            seen.update(scaling=scaling_config, run=run_config)

        def fit(self):
            return type("Result", (), {"return_value": 7})()

    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(cluster, "_connect", lambda address, *a: seen.setdefault("address", address) and None)
    monkeypatch.setattr(ray.train.torch, "TorchTrainer", FakeTrainer)
    run = cluster.run_workers(print, {}, num_workers=4, storage_path=tmp_path, run_name="r", gpus_per_worker=1,
                              address="10.0.0.1:6379", placement_timeout=0)  # fmt: skip
    assert run.value == 7 and seen["address"] == "10.0.0.1:6379"
    assert seen["run"].worker_runtime_env["env_vars"]["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    assert seen["scaling"].resources_per_worker == {"CPU": 1, "GPU": 1}


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
                 "--num-workers", "4", "--gpus-per-worker", "1")  # fmt: skip
    assert _one_error_line(r).endswith("= 4 GPUs asked; this machine has 0 (torch.cuda.device_count()); "
                                       "--gpus-per-worker 0 runs on the CPU")  # fmt: skip
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("verb, value", [("train", "0.5"), ("eval", "2")])
def test_gpus_per_worker_other_than_1_is_one_line_on_any_ray(prepared, tmp_path, verb, value):
    """A fraction or more than one GPU per worker, with --address too (no local check there): one line, exit 2,
    before anything starts or is written (item 3)."""
    ray_args = ["--num-workers", "2", "--gpus-per-worker", value, "--address", "127.0.0.1:1"]
    if verb == "train":
        r = _train(prepared, tmp_path / "run", *ray_args)
    else:
        r = _genoctx("eval", "--by-position", "--data", str(prepared), "--checkpoint", str(tmp_path / "none"),
                     *ray_args)  # fmt: skip
    assert _one_error_line(r).startswith(f"genoctx: error: --gpus-per-worker {value}: must be 1 (one GPU per worker")
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


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
