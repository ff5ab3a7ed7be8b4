"""What a training worker takes from its own node rather than from the driver, and the memory plan of a driver
without a GPU (issue 43 items 8 and 16; item 9's allocator setting: ``tests/test_cluster.py``).

- Threads: a worker's torch CPU threads are its node's cores over the run's workers on that node (Ray's local world
  size), not the driver's cores over the global world size (on a 64-GPU cluster that gave the CPU AdamW of optimizer
  offload a fraction of a core).
- Memory plan: a driver with no GPU (a CPU head node) used to skip the plan silently; now it plans against
  ``--gpu-memory-gib`` when given, else says so and leaves the check to every worker's GPU (one verdict, all ranks).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from cli_runner import run_genoctx  # tests/cli_runner.py: tests/ is on sys.path (its conftest.py)

from genoctx.errors import GenoctxError
from genoctx.parallel.layout import Layout
from genoctx.recipes import load_recipe
from genoctx.train import distributed

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="the driver without a GPU is this machine")
SETS = ["train.seq_len=256", "train.warmup_steps=1"]


class _Node:
    """A worker session on a node where ``local`` of the run's workers run."""

    def __init__(self, local: int):
        self.local = local

    def local_world_size(self) -> int:
        return self.local


def test_worker_threads_are_the_nodes_cores_over_the_workers_on_that_node(monkeypatch):
    monkeypatch.setattr(distributed, "node_cores", lambda: 32)
    assert distributed.worker_threads(_Node(4)) == 8  # 32 cores, 4 workers on this node: whatever the world size
    assert distributed.worker_threads(_Node(8)) == 4
    assert distributed.worker_threads(_Node(64)) == 1  # never 0
    assert distributed.worker_threads(_Node(4), configured=3) == 3  # train.num_threads wins


@NO_GPU
def test_a_driver_without_a_gpu_says_it_leaves_the_plan_to_the_workers(caplog):
    recipe = load_recipe("recipes/tiny.yaml", SETS)
    layout = Layout.for_world(2)
    with caplog.at_level(logging.INFO, logger="genoctx.train"):
        assert distributed._check_memory(recipe, 256, layout, 1, force=False) is False
    assert "memory plan: this driver has no GPU and no --gpu-memory-gib was given; each worker checks it" in caplog.text
    assert distributed._check_memory(recipe, 256, layout, 0, force=False) is True  # CPU workers: nothing to plan


def test_the_plan_needs_no_local_gpu_with_gpu_memory_gib():
    recipe = load_recipe("recipes/tiny.yaml", SETS)
    layout = Layout.for_world(2)
    assert distributed._check_memory(recipe, 256, layout, 1, force=False, gpu_memory_gib=80.0) is True
    with pytest.raises(GenoctxError, match=r"^memory plan: .* GiB per GPU, more than 1e-05 GiB"):
        distributed._check_memory(recipe, 256, layout, 1, force=False, gpu_memory_gib=1e-5)
    assert distributed._check_memory(recipe, 256, layout, 1, force=True, gpu_memory_gib=1e-5) is True  # --force


@NO_GPU
def test_the_workers_are_told_to_plan_when_the_driver_could_not(prepared, tmp_path):
    """The config every worker gets says whether to plan on its GPU, with the tokens per window it plans for."""
    from genoctx.cluster import WorkerRun

    seen = {}

    def run_workers(fn, config, **kw):
        seen.update(config)
        return WorkerRun(0.0)

    recipe = load_recipe("recipes/tiny.yaml", SETS)
    distributed.train_distributed(prepared, recipe, tmp_path / "a", run_workers=run_workers, num_workers=2,
                                  gpus_per_worker=1)  # fmt: skip
    assert (seen["plan_on_workers"], seen["seq_len"], seen["force"]) == (True, 256, False)
    assert "threads" not in seen  # the worker's own node decides (worker_threads)
    distributed.train_distributed(prepared, recipe, tmp_path / "b", run_workers=run_workers, num_workers=2,
                                  gpus_per_worker=1, gpu_memory_gib=80.0)  # fmt: skip
    assert seen["plan_on_workers"] is False  # planned here


def test_gpu_memory_gib_plans_before_anything_starts(prepared, tmp_path):
    sets = [x for s in SETS for x in ("--set", s)]
    r = run_genoctx("train", "--recipe", "recipes/tiny.yaml", *sets, "--data", str(prepared), "--out",
                    str(tmp_path / "run"), "--num-workers", "2", "--gpus-per-worker", "1", "--address",
                    "127.0.0.1:1", "--gpu-memory-gib", "0.00001", env=dict(os.environ), timeout=300)  # fmt: skip
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("genoctx: error: memory plan: "), r.stderr
    assert not (tmp_path / "run").exists()


def test_a_gpu_worker_plans_against_its_own_gpu(monkeypatch):
    """What a worker runs when the driver could not plan (``plan_on_workers``), here as one rank of two (no
    collective: ``is_distributed`` False): its GPU's memory (``device_memory_gib``, replaced here: no GPU) against
    the same plan; a CPU worker plans nothing."""
    from types import SimpleNamespace

    recipe = load_recipe("recipes/tiny.yaml", SETS)
    config = {"seq_len": 256, "force": False}
    dims = SimpleNamespace(layout=Layout.for_world(2), is_distributed=False)
    monkeypatch.setattr(distributed, "device_memory_gib", lambda dev: 1e-5)
    with pytest.raises(GenoctxError, match=r"^memory plan: .* GiB per GPU, more than 1e-05 GiB"):
        distributed._plan_on_worker(recipe, config, dims, torch.device("cuda", 1), 0)
    distributed._plan_on_worker(recipe, config, dims, torch.device("cpu"), 0)  # CPU: not planned
    distributed._plan_on_worker(recipe, {**config, "force": True}, dims, torch.device("cuda", 1), 0)
    monkeypatch.setattr(distributed, "device_memory_gib", lambda dev: 80.0)
    distributed._plan_on_worker(recipe, config, dims, torch.device("cuda", 1), 0)
