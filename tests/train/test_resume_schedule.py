"""``--resume`` with another step budget or rate continues on one stated schedule: the resumed steps follow the
schedule of an uninterrupted run of the new recipe (``restore_schedule`` keeps this invocation's ``base_lrs`` and
``lr_lambdas``, only the step comes from the checkpoint). Issue 45: a 4-step run resumed with ``--steps 6`` trained
step 5 at the old schedule's floor (3.0e-4) and step 6 at the new one's 5.58e-4."""

import json
import logging

import pytest
import torch

from genoctx.recipes import load_recipe
from genoctx.train.checkpoint import restore_schedule
from genoctx.train.loop import lr_lambda, train


def _recipe(steps, *extra):
    over = [f"train.steps={steps}", "train.seq_len=256", "train.checkpoint_every=2", "train.warmup_steps=1",
            "train.keep_checkpoints=0", *extra]  # fmt: skip
    return load_recipe("recipes/tiny.yaml", over)


def _schedule(cfg, steps):
    """The rates of steps 1..steps of an uninterrupted run of ``cfg`` (LambdaLR sets lambda(k) before step k+1)."""
    return [cfg.lr * lr_lambda(cfg, cfg.steps)(k) for k in range(steps)]


def _lrs_after_restore(saved_cfg, new_cfg, done):
    """The rates a LambdaLR over one parameter gives steps done+1..new_cfg.steps after ``done`` steps of ``saved_cfg``'s
    schedule were saved and restored into ``new_cfg``'s."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=saved_cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(saved_cfg, saved_cfg.steps))
    for _ in range(done):
        opt.step()
        sched.step()
    state, opt_state = sched.state_dict(), opt.state_dict()
    opt2 = torch.optim.AdamW([p], lr=new_cfg.lr)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lr_lambda(new_cfg, new_cfg.steps))
    opt2.load_state_dict(opt_state)
    restore_schedule(sched2, state)
    out = []
    for _ in range(done, new_cfg.steps):
        out.append(opt2.param_groups[0]["lr"])
        opt2.step()
        sched2.step()
    return out


def test_restored_schedule_is_the_new_recipes_at_every_step():
    four, six = _recipe(4).train, _recipe(6).train
    assert _lrs_after_restore(four, six, 4) == pytest.approx(_schedule(six, 6)[4:], rel=1e-12)
    assert _lrs_after_restore(four, six, 4) == pytest.approx([1.233e-3, 5.58e-4], rel=1e-3)  # the numbers
    # an unchanged recipe resumes on its own schedule (stop-after / kill), a new lr scales the new schedule
    assert _lrs_after_restore(six, six, 2) == pytest.approx(_schedule(six, 6)[2:], rel=1e-12)
    low = _recipe(6, "train.lr=1e-3").train
    assert _lrs_after_restore(four, low, 4) == pytest.approx(_schedule(low, 6)[4:], rel=1e-12)
    assert _lrs_after_restore(four, low, 4)[0] == pytest.approx(1e-3 * 0.4109, rel=1e-3)


def test_resume_with_more_steps_trains_every_step_on_the_stated_schedule(prepared, tmp_path, caplog):
    run = tmp_path / "run"
    train(prepared, _recipe(4), run)
    with caplog.at_level(logging.WARNING, logger="genoctx.train"):
        summary = train(prepared, _recipe(6), run, resume=True)
    assert summary["resumed_from"] == 4 and summary["steps_run"] == 2
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    four, six = _recipe(4).train, _recipe(6).train
    expected = _schedule(four, 4) + _schedule(six, 6)[4:]  # steps 5 and 6 lie on the 6-step schedule
    assert [r["lr"] for r in rows] == pytest.approx(expected, rel=1e-9)
    assert rows[4]["lr"] == pytest.approx(1.233e-3, rel=1e-3) and rows[5]["lr"] == pytest.approx(5.58e-4, rel=1e-3)
    said = [r.getMessage() for r in caplog.records if "--resume: train.steps 4 -> 6" in r.getMessage()]
    assert len(said) == 1
    assert "steps 5..6 follow the schedule of an uninterrupted 6-step run" in said[0]
    assert "step 5 trains at lr 1.233e-03" in said[0]
