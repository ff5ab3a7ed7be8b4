"""A resumed multi-rank run is the uninterrupted run: every step's learning rate and loss, and the final weights.

``genoctx.train.distributed.train_distributed`` runs unchanged; its workers are spawned gloo processes
(``mesh_runner.spawn_workers``, no Ray: Ray's own restore is covered in ``test_distributed.py``). Each layout trains
4 steps uninterrupted with a checkpoint after every step; a copy of that run with its checkpoints 3 and 4 removed
is resumed from checkpoint 2 (as ``--stop-after 2`` leaves it). The schedule decays from step 2 on, so the
learning rate differs at steps 2, 3 and 4: a resume that restored the schedule's counter but not the optimizer's
current rate (DCP checkpoints hold only tensors) trains step 3 at the wrong rate and fails here.

Also: a resume that changes the data-parallel size (the global batch) is refused unless ``allow_batch_change``
(then recorded in state.json and events.jsonl), and ``--resume`` of a folder that holds no run is refused.

Resumed == uninterrupted is asserted to a tolerance (``_same_run``: rel 1e-6). On GPUs (NCCL) the same layout holds
bit for bit only with ``train.deterministic: true`` (and a fixed NCCL algorithm per collective, as one job's
runs have); to a tolerance otherwise (float atomics in the MoE combine and the sparse MLA backward).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from genoctx.errors import GenoctxError
from genoctx.recipes import load_recipe
from genoctx.train.checkpoint import (
    list_checkpoints,
    load_model,
    load_training_state,
    read_full_tensors,
    read_state,
    read_tensors,
)
from genoctx.train.distributed import train_distributed
from genoctx.train.loop import build_optimizer, read_events, train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
from mesh_runner import spawn_workers  # noqa: E402  (kept on sys.path: the spawned ranks import it too)

STEPS = 4
SETS = ["train.seq_len=256", "train.checkpoint_every=1", "train.keep_checkpoints=0", "train.warmup_steps=1",
        f"train.steps={STEPS}"]  # fmt: skip


def _recipe(*extra):
    return load_recipe("recipes/tiny.yaml", [*SETS, *extra])


def _rows(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    ck = list_checkpoints(run)[-1]
    return read_full_tensors(ck) if (ck / "dcp").is_dir() else read_tensors(ck / "model.safetensors")


def _cut_back(run: Path, to: Path, step: int) -> Path:
    """A copy of ``run`` as ``--stop-after step`` leaves it: the checkpoints after ``step`` removed."""
    shutil.copytree(run, to)
    for ck in list_checkpoints(to):
        if int(ck.name.split("_")[1]) > step:
            shutil.rmtree(ck)
    return to


def _mesh(prepared, recipe, out, workers=2, **kw):
    return train_distributed(prepared, recipe, out, run_workers=spawn_workers, num_workers=workers, **kw)


def _same_run(resumed: Path, full: Path, rel: float = 1e-6, atol: float = 1e-7) -> None:
    a, b = _rows(resumed), _rows(full)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    lrs = [r["lr"] for r in b]
    assert len(set(lrs[1:])) == 3  # the rate changes at every step from the stop on: a wrong one cannot hide
    assert [r["lr"] for r in a] == pytest.approx(lrs, rel=1e-9)
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=rel)
    wa, wb = _weights(resumed), _weights(full)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=rel, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


LAYOUTS = {
    "fsdp2": dict(fsdp=2),
    "ep2_folded": dict(fsdp=2, ep=2, ep_folded=True),
    "cp2": dict(cp=2),
    "fsdp2_bf16_moments": dict(fsdp=2),  # train.optimizer_state_dtype=bf16 (RECIPE_SETS)
    "cp2_fep2_knobs": dict(cp=2, ep=2, ep_folded=True),  # both memory knobs, chunked, under CP x folded EP (FSDP)
    "hsdp2x2_knobs": dict(fsdp=2, workers=4),  # both memory knobs under HSDP (2 replicas x FSDP 2)
    "fep2_lora": dict(fsdp=2, ep=2, ep_folded=True),  # train.trainable: lora (the experts' adapters under EP)
}
RECIPE_SETS = {
    "fsdp2_bf16_moments": ["train.optimizer_state_dtype=bf16"],
    "cp2_fep2_knobs": ["train.optimizer_state_dtype=bf16", "train.activation_checkpointing=true",
                       "train.offload_activations=true", "train.seq_chunk_tokens=64"],
    "hsdp2x2_knobs": ["train.optimizer_state_dtype=bf16", "train.activation_checkpointing=true",
                      "train.offload_activations=true"],
    "fep2_lora": ["train.trainable=lora", "train.lora_rank=4"],
}  # fmt: skip


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_resumed_mesh_run_is_the_uninterrupted_run(prepared, tmp_path, name):
    full = tmp_path / "full"
    recipe = _recipe(*RECIPE_SETS.get(name, []))
    _mesh(prepared, recipe, full, **LAYOUTS[name])
    assert read_state(list_checkpoints(full)[-1])["format"] == "dcp"
    part = _cut_back(full, tmp_path / "part", 2)
    summary = _mesh(prepared, recipe, part, resume=True, **LAYOUTS[name])
    assert summary["resumed_from"] == 2 and summary["step"] == STEPS
    assert [(a["resumed_from"], a["steps_run"]) for a in summary["attempts"]] == [(2, 2)]  # steps 3, 4 only
    _same_run(part, full)
    if name == "cp2_fep2_knobs":  # the chunked backward ran: rounds of cp x 64 tokens over the 256-token crops
        assert {r["seq_chunks"] for r in _rows(full)} == {2}
        # the knobs' checkpoint resumed without them: fp32 moments (cast up), no offload, one pass
        plain = _cut_back(full, tmp_path / "plain", 2)
        done = _mesh(prepared, _recipe(), plain, resume=True, **LAYOUTS[name])
        assert done["resumed_from"] == 2 and done["step"] == STEPS
        moments = read_full_tensors(list_checkpoints(plain)[-1], prefix="optim.")
        assert all(v.dtype == torch.float32 for k, v in moments.items() if k.endswith(("exp_avg", "exp_avg_sq")))
        assert [r["seq_chunks"] for r in _rows(plain)][-2:] == [1, 1]
    if name == "fep2_lora":  # the adapters trained, were saved and resumed (checked above); only they have moments
        from genoctx.model.lora import is_lora_name

        weights = _weights(full)
        moments = read_full_tensors(list_checkpoints(full)[-1], prefix="optim.")
        assert any(k.endswith("experts.gate_up_proj_lora_A") for k in weights)
        assert {k.rsplit(".", 1)[0] for k in moments} == {k for k in weights if is_lora_name(k)}
    if "train.optimizer_state_dtype=bf16" in RECIPE_SETS.get(name, []):  # the moments: saved in bf16, and the
        # resumed run's equal the uninterrupted run's
        ma, mb = (read_full_tensors(list_checkpoints(r)[-1], prefix="optim.") for r in (part, full))
        moments = [k for k in mb if k.endswith(("exp_avg", "exp_avg_sq"))]
        assert moments and ma.keys() == mb.keys()
        assert all(mb[k].dtype == torch.bfloat16 and torch.equal(ma[k], mb[k]) for k in moments)
        # the DCP checkpoint read in one process by an fp32 AdamW: its moments cast up, exactly
        model = load_model(list_checkpoints(full)[-1])[0]
        opt, sched = build_optimizer(model, _recipe().train, STEPS)
        load_training_state(list_checkpoints(full)[-1], model, opt, sched)
        names = {id(p): n for n, p in model.named_parameters()}
        assert len(opt.state) == len(names)
        for p, st in opt.state.items():
            for k in ("exp_avg", "exp_avg_sq"):
                assert st[k].dtype == torch.float32 and torch.equal(st[k], mb[f"{names[id(p)]}.{k}"].float())


def test_a_one_process_checkpoint_resumes_on_the_mesh_at_the_runs_rate(prepared, tmp_path):
    """One process -> CP=2 (the same data-parallel size): the mesh reads the safetensors checkpoint's slices and
    the schedule; CP=2 equals CP=1 to fp32 tolerance."""
    full = tmp_path / "full"
    train(prepared, _recipe(), full)
    part = _cut_back(full, tmp_path / "part", 2)
    assert _mesh(prepared, _recipe(), part, cp=2, resume=True)["resumed_from"] == 2
    # weights: CP=2's fp32 sums differ in the last bits and AdamW's normalised steps carry that to ~4e-6; a step
    # at a wrong rate (0.003 for 0.0023) moves them ~7e-4
    _same_run(part, full, rel=1e-5, atol=1e-4)


def test_a_one_process_lora_checkpoint_resumes_on_the_mesh(prepared, tmp_path):
    """A one-process LoRA run (safetensors) resumed on CP=2 x folded EP=2 (one data-parallel rank, as one process):
    every rank reads its slices of the adapters and their moments (not drawn again; the experts' adapters split with
    their experts), so steps 3 and 4 and the final weights are the uninterrupted run's."""
    recipe = _recipe("train.trainable=lora", "train.lora_rank=4")
    full = tmp_path / "full"
    train(prepared, recipe, full)
    part = _cut_back(full, tmp_path / "part", 2)
    assert _mesh(prepared, recipe, part, cp=2, ep=2, ep_folded=True, resume=True)["resumed_from"] == 2
    _same_run(part, full, rel=1e-5, atol=1e-4)  # tolerances of the CP=2 resume above


@pytest.fixture(scope="module")
def fsdp2_run(prepared, tmp_path_factory) -> Path:
    """2 steps of an FSDP=2 run (2 data-parallel ranks: 512 tokens per step)."""
    run = tmp_path_factory.mktemp("fsdp2") / "run"
    _mesh(prepared, _recipe(), run, fsdp=2, stop_after=2)
    return run


def test_a_resume_that_changes_the_global_batch_is_refused(prepared, fsdp2_run, tmp_path):
    run = shutil.copytree(fsdp2_run, tmp_path / "run")
    before = sorted(p.name for p in run.rglob("*"))
    with pytest.raises(GenoctxError) as e:
        train(prepared, _recipe(), run, resume=True)  # one process: 1 data-parallel rank, 256 tokens per step
    msg = str(e.value)
    assert msg.startswith("--resume: the run trained 512 tokens per step (2 data-parallel rank(s), ")
    assert "this invocation would train 256 (1)" in msg and "--num-workers / --cp = 2" in msg
    assert "--allow-batch-change" in msg and "\n" not in msg
    assert sorted(p.name for p in run.rglob("*")) == before  # nothing written


def test_allow_batch_change_resumes_and_records_it(prepared, fsdp2_run, tmp_path):
    run = shutil.copytree(fsdp2_run, tmp_path / "run")
    summary = train(prepared, _recipe("train.steps=3"), run, resume=True, allow_batch_change=True)
    assert summary["resumed_from"] == 2
    want = {"step": 2, "from_tokens": 512, "to_tokens": 256, "from_dp": 2, "to_dp": 1}
    assert read_state(list_checkpoints(run)[-1])["batch_changes"] == [want]
    assert [{k: e[k] for k in want} for e in read_events(run) if e["event"] == "batch_change"] == [want]
    # the schedule went on at the run's step, on the resumed recipe's schedule (fsdp2_run ran 2 of 4; resumed with 3
    # steps): step 3's rate is an uninterrupted 3-step run's (genoctx.train.checkpoint.restore_schedule)
    full = tmp_path / "full"
    train(prepared, _recipe("train.steps=3"), full)
    assert _rows(run)[2]["lr"] == pytest.approx(_rows(full)[2]["lr"], rel=1e-9)


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_resume_of_a_folder_without_a_run_is_refused(prepared, tmp_path, make):
    out = tmp_path / "typo"
    if make == "empty":
        out.mkdir()
    for call in (lambda: train(prepared, _recipe(), out, resume=True),
                 lambda: _mesh(prepared, _recipe(), out, fsdp=2, resume=True)):  # fmt: skip
        with pytest.raises(GenoctxError, match=r"^--resume: --out .*typo (does not exist|holds no run)"):
            call()
    assert sorted(tmp_path.iterdir()) == ([out] if make == "empty" else [])
    assert make == "missing" or list(out.iterdir()) == []


def test_resume_warns_of_a_newer_incomplete_checkpoint_and_loads_the_newest_complete(prepared, tmp_path, caplog):
    run = tmp_path / "run"
    train(prepared, _recipe(), run, stop_after=2)
    torn = run / "checkpoints" / "step_000003"
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"half a copy")  # no state.json: an interrupted copy
    with caplog.at_level("WARNING", logger="genoctx"):
        summary = train(prepared, _recipe(), run, resume=True)
    assert summary["resumed_from"] == 2
    lines = [r.getMessage() for r in caplog.records if "incomplete" in r.getMessage()]
    assert lines == [f"{torn} is incomplete (no state.json, which a save writes last: an interrupted copy?); "
                     f"--resume loads {run / 'checkpoints' / 'step_000002'}"]  # fmt: skip


def test_resume_with_only_an_incomplete_checkpoint_warns_and_starts_at_step_0(prepared, tmp_path, caplog):
    """One process, as the distributed driver: a run whose only checkpoint is torn says so before step 0."""
    run = tmp_path / "run"
    torn = run / "checkpoints" / "step_000001"
    torn.mkdir(parents=True)
    (torn / "model.safetensors").write_bytes(b"half a copy")
    with caplog.at_level("WARNING", logger="genoctx"):
        summary = train(prepared, _recipe(), run, resume=True, stop_after=1)
    assert summary["resumed_from"] is None and summary["steps_run"] == 1
    lines = [r.getMessage() for r in caplog.records if "incomplete" in r.getMessage()]
    assert lines == [f"{torn} is incomplete (no state.json, which a save writes last: an interrupted copy?); "
                     "--resume loads nothing (step 0)"]  # fmt: skip
