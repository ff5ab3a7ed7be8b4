"""``genoctx train --num-workers N``: the distributed driver on CPU (gloo): resume, worker-failure restart, a killed
driver, the zigzag CP layout and EP -> FSDP resharding on resume.

The layouts' own checks (CP zigzag, EP then FSDP resharding) run on gloo processes without Ray
(``mesh_runner.spawn_workers``); what only Ray does (restarting the group after a worker died, its copy of the
checkpoints, a killed driver) runs through the CLI on Ray. The Ray tests share one local Ray per module
(``ray_address``: started in this process, each ``genoctx train`` attaches with ``--address``; a Ray of its own
costs every run ~20 s to start and stop on a small CPU); they are marked ``slow`` (deselect with
``-m "not slow"``). ``tests/test_cluster.py`` covers the Ray genoctx starts itself.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from cli_runner import run_genoctx  # tests/cli_runner.py: tests/ is on sys.path (its conftest.py)

from genoctx.recipes import load_recipe
from genoctx.train.checkpoint import read_full_tensors
from genoctx.train.distributed import train_distributed
from genoctx.train.loop import train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
from mesh_runner import spawn_workers  # noqa: E402  (kept on sys.path: the forked ranks import it too)

SETS = ["train.seq_len=256", "train.checkpoint_every=1", "train.keep_checkpoints=0", "train.warmup_steps=1"]


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory):
    """The GCS address of a local Ray started here for this module's Ray tests (4 CPUs, no dashboard)."""
    import tempfile

    import ray

    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    ctx = ray.init(num_cpus=4, include_dashboard=False, _temp_dir=temp, object_store_memory=256 << 20,
                   configure_logging=False, logging_config=ray.LoggingConfig(log_level="ERROR"))  # fmt: skip
    try:
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()
        import shutil

        shutil.rmtree(temp, ignore_errors=True)


def _cli(*args, env=None):
    sets = [x for s in SETS for x in ("--set", s)]  # later --set overrides win
    return run_genoctx("train", "--recipe", "recipes/tiny.yaml", *sets, *args, env={**os.environ, **(env or {})},
                       timeout=400)  # fmt: skip


def _pools_scored(a: int, b: int) -> int:
    """(query, pool) pairs the tiny preset's indexer (pools of 4 tokens) scores for the queries at positions a..b-1:
    each scores the (t + 1) // 4 complete pools it sees."""
    return sum((t + 1) // 4 for t in range(a, b))


def _losses(run):
    return [(m["step"], m["loss"]) for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--cp", "2"], "need --num-workers"),
        (["--num-workers", "3", "--cp", "2"], "divide --num-workers 3"),
        (["--ep", "2"], "need --num-workers"),
        (["--fsdp-one"], "need --num-workers"),  # FSDP2 on one rank: the mesh's path, through Ray
        (["--num-workers", "2", "--fsdp-one"], "--fsdp-one is FSDP2 on one rank: --num-workers 2 shards with --fsdp"),
        (["--num-workers", "4", "--ep", "2", "--fsdp", "2", "--cp", "2"], "--ep 2 x --fsdp 2 x --cp 2 = 8 must divide"),
        (["--num-workers", "3", "--ep", "3"], "--ep 3 must divide model.n_routed_experts (4)"),
        (["--num-workers", "2", "--fsdp", "0"], "--fsdp"),
        (["--num-workers", "2", "--cp", "2", "--set", "train.seq_len=255"], "does not split into 2"),
        (
            ["--num-workers", "2", "--cp", "2", "--set", "train.cp_layout=diagonal"],
            "train.cp_layout must be 'contiguous' or 'zigzag', got 'diagonal'",
        ),
        (
            ["--num-workers", "2", "--cp", "2", "--set", "train.cp_layout=zigzag", "--set", "train.seq_len=254"],
            "--cp 2 with train.cp_layout=zigzag: the 254-token training window does not split into 4 equal slices",
        ),
        # each CP rank chunks its piece: every round of cp x chunk tokens must split into the layout's pieces
        (
            ["--num-workers", "2", "--cp", "2", "--set", "train.cp_layout=zigzag", "--seq-chunk", "51"],
            "--seq-chunk 51 with --cp 2: rounds of 102 tokens (the last one 52) of the 256-token window do not split "
            "into 4 equal pieces of at least 3 tokens (zigzag layout)",
        ),
        (["--num-workers", "2", "--cp", "2", "--seq-chunk", "127"], "rounds of 254 tokens (the last one 2)"),
    ],
)
def test_bad_parallel_flags_are_one_line_errors(prepared, tmp_path, args, msg):
    r = _cli("--data", str(prepared), "--out", str(tmp_path / "r"), *args)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


@pytest.fixture(scope="module")
def one_process_run(prepared, tmp_path_factory):
    """An uninterrupted 3-step one-process run of the same recipe (the reference of the Ray runs)."""
    ref = tmp_path_factory.mktemp("ref") / "run"
    train(prepared, load_recipe("recipes/tiny.yaml", ["train.steps=3", *SETS]), ref)
    return ref


@pytest.mark.slow
def test_ray_cp2_resume_and_killed_worker_restart_match_one_process(prepared, one_process_run, tmp_path, ray_address):
    """CP=2 on 2 Ray workers: stop after step 1, resume; during the resumed run worker 1 is killed before
    step 3, Ray restarts the group from checkpoint 2. Every step's loss equals an uninterrupted one-process
    run (CP=2 == CP=1, fp32)."""
    ref = one_process_run
    run = tmp_path / "run"
    common = ["--data", str(prepared), "--out", str(run), "--num-workers", "2", "--cp", "2", "--steps", "3",
              "--address", ray_address]  # fmt: skip
    first = _cli(*common, "--stop-after", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads(first.stdout)["step"] == 1 and [s for s, _ in _losses(run)] == [1]
    second = _cli(*common, "--resume", env={"GENOCTX_FAULT_KILL": "1:2"})
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads(second.stdout)
    assert (run / ".fault_done").exists()  # the worker was killed once and the group restarted
    assert summary["step"] == 3 and summary["resumed_from"] == 1 and summary["workers"] == 2
    # the restarted group loaded checkpoint 2 (written just before the kill, before Ray had registered it) and ran
    # only step 3: attempt 2 ran step 2, attempt 3 step 3, and the metrics rows say which attempt computed them
    attempts = [(a["attempt"], a["resumed_from"], a["steps_run"], a["status"]) for a in summary["attempts"]]
    assert attempts == [(2, 1, 1, "failed"), (3, 2, 1, "completed")]
    assert [(m["step"], m["attempt"]) for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())] == [
        (1, 1),
        (2, 2),
        (3, 3),
    ]
    got, want = _losses(run), _losses(ref)
    assert [s for s, _ in got] == [1, 2, 3]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002", "step_000003"]
    # per-rank metrics: rank 1 scores ~3x rank 0's indexer pools (128-token slices of a 256-token crop)
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    k0, k1 = (r["dsa_keys_scored"] for r in last["ranks"])
    assert (k0, k1) == (_pools_scored(0, 128), _pools_scored(128, 256)) == (2016, 6112)
    assert summary["rank_imbalance"]["dsa_keys_scored_max_over_mean"] == pytest.approx(2 * k1 / (k0 + k1))


def test_cp2_zigzag_matches_one_process_and_balances_dsa_keys(prepared, one_process_run, tmp_path):
    """``train.cp_layout=zigzag`` on 2 ranks (gloo processes, ``mesh_runner.spawn_workers``: the driver
    ``train_distributed`` unchanged, no Ray): rank 0 holds pieces 0 and 3 of the 256-token crop, rank 1 pieces 1
    and 2 (64 tokens each, a multiple of the pool size 4). Losses equal the one-process run; both ranks score the
    same indexer pools."""
    run = tmp_path / "zigzag"
    recipe = load_recipe("recipes/tiny.yaml", [*SETS, "train.steps=3", "train.cp=2", "train.cp_layout=zigzag"])
    summary = train_distributed(prepared, recipe, run, run_workers=spawn_workers, num_workers=2, cp=2, stop_after=2)
    assert summary["step"] == 2 and summary["workers"] == 2
    got, want = _losses(run), _losses(one_process_run)[:2]
    assert [s for s, _ in got] == [1, 2]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    c = 256 // 4
    want = _pools_scored(0, c) + _pools_scored(3 * c, 4 * c)
    assert want == _pools_scored(c, 3 * c) == c * (2 * 2 * c + 2 - 4) // 4 == 4064  # c (2 P c + 2 - kpool) / kpool
    for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()):
        assert [r["dsa_keys_scored"] for r in row["ranks"]] == [want] * 2
    assert summary["rank_imbalance"]["dsa_keys_scored_max_over_mean"] == 1.0


@pytest.mark.slow
def test_ray_driver_and_rank0_killed_during_a_save_then_resume(prepared, tmp_path, ray_address):
    """``save+driver:4``: rank 0 kills the driver, then itself, while checkpoint 4 is half written (Ray has not
    registered checkpoint 2 either, or has). ``--resume`` loads step 2, the newest complete checkpoint, removes the
    temporary of step 4, runs steps 3..6 only and says ``resumed_from: 2`` truthfully. Every step's learning rate
    (the schedule decays through steps 3..6) and loss, and the final weights, are those of the same run uninterrupted
    (2 gloo ranks without Ray, ``spawn_workers``): the DCP checkpoint restored the optimizer's current rate."""
    run = tmp_path / "run"
    common = ["--data", str(prepared), "--out", str(run), "--num-workers", "2", "--steps", "6",
              "--set", "train.checkpoint_every=2", "--address", ray_address]  # fmt: skip
    first = _cli(*common, env={"GENOCTX_FAULT_KILL": "save+driver:4"})
    assert first.returncode == -9, first.stderr[-3000:]
    partial = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".step_000004.")]
    assert len(partial) == 1 and (run / "checkpoints" / "step_000002").is_dir()
    second = _cli(*common, "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads(second.stdout)
    assert summary["resumed_from"] == 2 and summary["removed_partial_checkpoints"] == partial
    assert [(a["resumed_from"], a["steps_run"], a["status"]) for a in summary["attempts"]] == [(2, 4, "completed")]
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["attempt"]) for m in rows] == [(1, 1), (2, 1), (3, 2), (4, 2), (5, 2), (6, 2)]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000004", "step_000006"]
    full = tmp_path / "full"
    recipe = load_recipe("recipes/tiny.yaml", [*SETS, "train.steps=6", "train.checkpoint_every=2"])
    train_distributed(prepared, recipe, full, run_workers=spawn_workers, num_workers=2)
    want = [json.loads(ln) for ln in (full / "metrics.jsonl").read_text().splitlines()]
    assert len({m["lr"] for m in want[2:]}) == 4  # a wrong rate at any resumed step shows
    assert [m["lr"] for m in rows] == pytest.approx([m["lr"] for m in want], rel=1e-9)
    assert [m["loss"] for m in rows] == pytest.approx([m["loss"] for m in want], rel=1e-6)
    got, ref = (read_full_tensors(r / "checkpoints" / "step_000006") for r in (run, full))
    assert got.keys() == ref.keys()
    for k in got:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")


def test_ep2_then_resume_at_fsdp2_matches_one_process(prepared, tmp_path):
    """EP=2 on 2 ranks (gloo processes, ``mesh_runner.spawn_workers``, no Ray) for 2 steps (a sharded checkpoint:
    each rank its block of experts), then a resume at FSDP=2: the checkpoint is resharded (experts and AdamW moments
    now FSDP shards) and step 3 runs. Two data ranks see what one process with batch 2 sees: every loss equals that
    run's; the per-rank metrics carry the EP received rows."""
    ref = tmp_path / "ref"
    train(prepared, load_recipe("recipes/tiny.yaml", ["train.steps=3", "train.batch_size=2", *SETS]), ref)
    run = tmp_path / "run"

    def mesh(**kw):
        recipe = load_recipe("recipes/tiny.yaml", [*SETS, "train.steps=3", *(f"train.{k}={v}" for k, v in kw.items()
                                                                               if k in ("ep", "fsdp"))])  # fmt: skip
        return train_distributed(prepared, recipe, run, run_workers=spawn_workers, num_workers=2, **kw)

    mesh(ep=2, stop_after=2)
    ckpt = run / "checkpoints" / "step_000002"
    state = json.loads((ckpt / "state.json").read_text())
    assert state["format"] == "dcp"
    assert state["layout"] == {"dp_replicate": 1, "ep": 2, "dp_shard": 1, "cp": 1, "ep_folded": False}
    assert not (ckpt / "model.safetensors").exists() and (ckpt / "dcp" / ".metadata").is_file()
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["ep_rank"] for r in rows[0]["ranks"]] == [0, 1]
    assert all(r["ep_received_rows"] > 0 for row in rows for r in row["ranks"])
    summary = mesh(fsdp=2, resume=True)
    assert summary["resumed_from"] == 2 and summary["step"] == 3
    got, want = _losses(run), _losses(ref)
    assert [s for s, _ in got] == [1, 2, 3]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert a == pytest.approx(b, rel=1e-5)
