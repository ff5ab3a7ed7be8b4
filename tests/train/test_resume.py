"""Restarts that truly resume (one process): each test counts the optimizer steps every attempt actually ran
(``train_step`` calls, and the ``attempt`` that wrote each metrics row), because the data order is deterministic
and a run that silently recomputed every step would give the same losses.

Resumed == uninterrupted is asserted to rel 1e-6. On a GPU it holds bit for bit only with ``train.deterministic: true``;
otherwise to a tolerance (float atomics in the MoE combine and the sparse MLA backward vary the last bits)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from cli_runner import run_genoctx  # tests/cli_runner.py: tests/ is on sys.path (its conftest.py)

import genoctx.train.loop as loop
from genoctx.errors import GenoctxError
from genoctx.recipes import load_recipe
from genoctx.train.checkpoint import list_checkpoints
from genoctx.train.loop import read_events, train


def _recipe(steps, *extra):
    over = [f"train.steps={steps}", "train.seq_len=256", "train.checkpoint_every=2", "train.warmup_steps=1",
            "train.keep_checkpoints=0", *extra]  # fmt: skip
    return load_recipe("recipes/tiny.yaml", over)


def _rows(run):
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def counted(monkeypatch):
    """Counts the optimizer steps (``train_step`` calls: one forward, backward and update each) run in-process."""
    calls = []
    real = loop.train_step

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(loop, "train_step", counting)
    return calls


def _cli(*args, env=None, **kw):
    cmd = [sys.executable, "-m", "genoctx", "train", "--recipe", "recipes/tiny.yaml", "--set", "train.seq_len=256",
           "--set", "train.warmup_steps=1", "--set", "train.keep_checkpoints=0", *args]  # fmt: skip
    if kw:  # a caller that needs a real subprocess (its own process group, a pipe it reads while running)
        return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300,
                              **kw)  # fmt: skip
    return run_genoctx(*cmd[3:], env={**os.environ, **(env or {})}, timeout=300)


@pytest.fixture(scope="module")
def uninterrupted(prepared, tmp_path_factory):
    run = tmp_path_factory.mktemp("full") / "run"
    train(prepared, _recipe(6), run)
    return [r["loss"] for r in _rows(run)]


def test_kill_during_a_save_then_resume_continues_from_the_last_complete_checkpoint(
    prepared, tmp_path, counted, uninterrupted
):
    run = tmp_path / "run"
    r = _cli("--data", str(prepared), "--out", str(run), "--steps", "6", env={"GENOCTX_FAULT_KILL": "save:4"})
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    partial = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".step_000004.")]
    assert len(partial) == 1 and [c.name for c in list_checkpoints(run)] == ["step_000002"]
    assert [row["step"] for row in _rows(run)] == [1, 2, 3, 4]  # written before the kill

    summary = train(prepared, _recipe(6), run, resume=True)
    assert len(counted) == 4  # steps 3..6 ran; steps 1 and 2 were not run again
    assert summary["resumed_from"] == 2 and summary["steps_run"] == 4
    assert summary["removed_partial_checkpoints"] == partial
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000004", "step_000006"]
    rows = _rows(run)
    assert [(row["step"], row["attempt"]) for row in rows] == [(1, 1), (2, 1), (3, 2), (4, 2), (5, 2), (6, 2)]
    assert [row["loss"] for row in rows] == pytest.approx(uninterrupted, rel=1e-6)
    starts = [e for e in read_events(run) if e["event"] == "start"]
    assert [(e["attempt"], e["step"], e["removed_partial"]) for e in starts] == [(1, 0, []), (2, 2, partial)]


def test_stop_after_then_resume_runs_each_step_once(prepared, tmp_path, counted, uninterrupted):
    run = tmp_path / "run"
    first = train(prepared, _recipe(6), run, stop_after=3)
    assert len(counted) == 3 and first["steps_run"] == 3 and first["resumed_from"] is None
    second = train(prepared, _recipe(6), run, resume=True)
    assert len(counted) == 6  # 3 + 3: the resumed run started after step 3
    assert second["resumed_from"] == 3 and second["steps_run"] == 3
    rows = _rows(run)
    assert [(row["step"], row["attempt"]) for row in rows] == [(1, 1), (2, 1), (3, 1), (4, 2), (5, 2), (6, 2)]
    assert [row["loss"] for row in rows] == pytest.approx(uninterrupted, rel=1e-6)
    ends = [e for e in read_events(run) if e["event"] == "end"]
    assert [(e["status"], e["step"], e["steps_run"]) for e in ends] == [("completed", 3, 3), ("completed", 6, 3)]


def _sigint_default() -> None:
    """In the child before exec: SIGINT unblocked and at its default, as in a shell. An ignored or blocked SIGINT is
    inherited through exec (a library earlier in the suite may leave the pytest process so), and the child would then
    never see the test's interrupt (seen twice in the full suite, never alone)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_interrupt_before_the_first_checkpoint_then_resume_logs_each_step_once(prepared, tmp_path, counted):
    """SIGINT before any checkpoint exists, then --resume: nothing to load, so training starts again at step 1
    and metrics.jsonl holds steps 1..N once (not 1, 1, 2, ...)."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "genoctx", "train", "--recipe", "recipes/tiny.yaml", "--data", str(prepared),
           "--out", str(run), "--steps", "100000", "--set", "train.seq_len=256",
           "--set", "train.checkpoint_every=100000"]  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_default)
    try:
        deadline = time.monotonic() + 120
        while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 2):
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.poll() is not None else ""
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=180)  # the step in flight finishes first: slow on a loaded machine
    finally:
        p.kill()
    assert p.returncode == 130 and "interrupted" in err and "Traceback" not in err
    assert list_checkpoints(run) == [] and len(_rows(run)) >= 2
    assert [e["status"] for e in read_events(run) if e["event"] == "end"] == ["interrupted"]

    summary = train(prepared, _recipe(4, "train.checkpoint_every=100000"), run, resume=True)
    assert summary["resumed_from"] is None and summary["steps_run"] == 4 and len(counted) == 4
    assert [(row["step"], row["attempt"]) for row in _rows(run)] == [(1, 2), (2, 2), (3, 2), (4, 2)]


def test_a_failed_save_then_resume_logs_each_step_once(prepared, tmp_path, monkeypatch):
    """A save that raises (disk full) ends the attempt after its metrics row; the rerun cuts that row."""
    run = tmp_path / "run"
    real = loop.save_run_checkpoint

    def failing(out, step, *a, **k):
        if step == 4:
            raise OSError(28, "No space left on device")
        return real(out, step, *a, **k)

    monkeypatch.setattr(loop, "save_run_checkpoint", failing)
    with pytest.raises(OSError):
        train(prepared, _recipe(6), run)
    monkeypatch.setattr(loop, "save_run_checkpoint", real)
    assert [row["step"] for row in _rows(run)] == [1, 2, 3, 4]
    train(prepared, _recipe(6), run, resume=True)
    assert [(row["step"], row["attempt"]) for row in _rows(run)] == [(1, 1), (2, 1), (3, 2), (4, 2), (5, 2), (6, 2)]
    assert [e["status"] for e in read_events(run) if e["event"] == "end"] == ["failed", "completed"]


def _holder(folder, what):
    """A process that holds ``output_lock(folder)`` (as ``genoctx WHAT``) until a line arrives on its stdin."""
    code = (
        "import sys; from genoctx.lock import output_lock\n"
        "with output_lock(sys.argv[1], what=sys.argv[2]):\n"
        "    print('locked', flush=True); sys.stdin.readline()\n"
    )
    return subprocess.Popen([sys.executable, "-c", code, str(folder), what], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip


def test_one_writer_per_run_folder(prepared, tmp_path, counted):
    """A run folder held by another genoctx process (here a helper holding ``output_lock``) is refused, one
    process or Ray, naming the holder's PID, before anything is written; it is free again once the holder ends."""
    from genoctx.cluster import run_workers
    from genoctx.train.distributed import train_distributed

    run = tmp_path / "run"
    holder = _holder(run, "train")
    try:
        assert holder.stdout.readline() == "locked\n"
        for attempt in (lambda: train(prepared, _recipe(2), run),
                        lambda: train_distributed(prepared, _recipe(2), run, run_workers=run_workers,
                                                  num_workers=2)):  # fmt: skip
            with pytest.raises(GenoctxError, match=f"is being written by PID {holder.pid} \\(genoctx train\\)"):
                attempt()
        assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists() and counted == []
    finally:
        holder.communicate("\n", timeout=30)
    assert train(prepared, _recipe(2), run)["steps_run"] == 2


def test_train_wait_flag_waits_for_the_holder(prepared, tmp_path):
    run = tmp_path / "run"
    holder = _holder(run, "prepare")
    assert holder.stdout.readline() == "locked\n"
    cmd = [sys.executable, "-m", "genoctx", "train", "--recipe", "recipes/tiny.yaml", "--data", str(prepared),
           "--out", str(run), "--steps", "1", "--set", "train.seq_len=256", "--wait"]  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = ""
    while "waiting for PID" not in line:  # it logs once, then blocks
        line = p.stderr.readline()
        assert line or p.poll() is None, "exited without waiting"
    assert p.poll() is None and not (run / "metrics.jsonl").exists()
    holder.communicate("\n", timeout=30)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0 and json.loads(out)["steps_run"] == 1


def test_resume_refuses_a_recipe_that_changes_the_run(prepared, tmp_path, counted):
    run = tmp_path / "run"
    train(prepared, _recipe(4), run, stop_after=2)
    for extra, message in [
        ("model.hidden_size=64", r"--resume: model.hidden_size is 64 but the run's is 32 \(.*000002/recipe.yaml\)"),
        ("model.tie_word_embeddings=true", "model.tie_word_embeddings is True but the run's is False"),
        ("train.seed=7", "train.seed is 7 but the run was trained with 0"),
        ("loss.vocab=nucleotide", "loss.vocab is 'nucleotide' but the run was trained with 'full'"),
    ]:
        with pytest.raises(GenoctxError, match=message):
            train(prepared, _recipe(4, extra), run, resume=True)
    assert len(counted) == 2
    # a longer budget is allowed (logged): the run goes on from step 2
    assert train(prepared, _recipe(5), run, resume=True)["resumed_from"] == 2 and len(counted) == 5


def test_a_crop_longer_than_the_windows_is_refused(prepared, tmp_path):
    with pytest.raises(GenoctxError, match="train.seq_len 100000 is longer than the 2048-token windows"):
        train(prepared, _recipe(1, "train.seq_len=100000"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_checkpoints_are_readable_by_collaborators(prepared, tmp_path):
    """mkdtemp makes 0700 folders; a finished checkpoint has the modes of the umask (022: 0755 and 0644)."""
    old = os.umask(0o022)
    try:
        train(prepared, _recipe(1), tmp_path / "run")
    finally:
        os.umask(old)
    ck = list_checkpoints(tmp_path / "run")[-1]
    assert ck.stat().st_mode & 0o777 == 0o755
    assert {p.stat().st_mode & 0o777 for p in ck.iterdir()} == {0o644}


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(prepared, tmp_path, monkeypatch, caplog):
    """Checkpoint 4's weights are damaged (64 bytes zeroed, the size unchanged): --resume loads checkpoint 2's
    weights (not just its step), warns naming 4, sets it aside, and keep-N pruning (keep 1) then keeps the newest
    checkpoint that verifies (3) instead of counting the broken 4 as the kept one and removing 2 and 3."""
    from safetensors.torch import load_file

    from genoctx.train.integrity import check_checkpoint

    run = tmp_path / "run"
    train(prepared, _recipe(4), run)
    ck2, ck4 = run / "checkpoints" / "step_000002", run / "checkpoints" / "step_000004"
    want, newer = load_file(str(ck2 / "model.safetensors")), load_file(str(ck4 / "model.safetensors"))
    assert any(not torch.equal(want[k], newer[k]) for k in want)  # the two checkpoints hold different weights
    data = bytearray((ck4 / "model.safetensors").read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(64)
    (ck4 / "model.safetensors").write_bytes(bytes(data))

    loaded = {}
    real = loop.load_training_state

    def snapshot(ckpt, model, optimizer, scheduler):
        state = real(ckpt, model, optimizer, scheduler)
        loaded.update(path=ckpt, tensors={k: v.detach().clone() for k, v in model.state_dict().items()})
        return state

    monkeypatch.setattr(loop, "load_training_state", snapshot)
    with caplog.at_level("WARNING", logger="genoctx.train"):
        summary = train(prepared, _recipe(6, "train.checkpoint_every=3", "train.keep_checkpoints=1"), run, resume=True,
                        stop_after=3)  # fmt: skip
    assert summary["resumed_from"] == 2 and summary["steps_run"] == 1 and loaded["path"] == ck2
    assert all(torch.equal(loaded["tensors"][k], want[k]) for k in want)
    skipped = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert len(skipped) == 1 and skipped[0].startswith(f"--resume: skipping checkpoint {ck4} ({ck4}/model.safetensors:")
    assert skipped[0].endswith("; set aside as step_000004.broken")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000003", "step_000004.broken"]
    assert check_checkpoint(run / "checkpoints" / "step_000003")["ok"]
    starts = [e for e in read_events(run) if e["event"] == "start"]
    assert starts[-1]["checkpoint"] == str(ck2) and starts[-1]["step"] == 2
