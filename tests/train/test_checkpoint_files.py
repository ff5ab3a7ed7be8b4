"""Checkpoint files as data: tied embeddings saved once and tied again on load, corrupt or hostile files refused
with one line naming the file (exit 2), never a traceback and never pickle code run."""

import json
import os
import pickle
import random
import shutil

import pytest
import torch
from cli_runner import run_genoctx  # tests/cli_runner.py: tests/ is on sys.path (its conftest.py)
from safetensors.torch import load_file

from genoctx.errors import GenoctxError
from genoctx.recipes import load_recipe
from genoctx.train.checkpoint import latest_checkpoint, load_model, read_optimizer
from genoctx.train.loop import train

SETS = ["train.seq_len=256", "train.checkpoint_every=2", "train.warmup_steps=1", "train.keep_checkpoints=0"]


def _recipe(steps, *extra):
    return load_recipe("recipes/tiny.yaml", [f"train.steps={steps}", *SETS, *extra])


def _rows(run):
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def test_tied_embeddings_save_resume_and_stay_tied(prepared, tmp_path):
    tied = "model.tie_word_embeddings=true"
    full, part = tmp_path / "full", tmp_path / "part"
    train(prepared, _recipe(4, tied), full)
    train(prepared, _recipe(4, tied), part, stop_after=2)
    ck = latest_checkpoint(part)
    stored = load_file(str(ck / "model.safetensors"))
    assert "lm_head.weight" not in stored and "embed_tokens.weight" in stored  # stored once, as transformers does
    model, recipe, _ = load_model(ck)
    assert recipe.model.tie_word_embeddings and model.lm_head.weight is model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, stored["embed_tokens.weight"])
    train(prepared, _recipe(4, tied), part, resume=True)
    a, b = _rows(full), _rows(part)
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-6)
    # the tied head starts at the head's small init: the first loss is near ln 8 (8 tokens), not ~20 nats
    assert abs(a[0]["loss"] - torch.log(torch.tensor(8.0)).item()) < 0.3
    final, _, _ = load_model(full)
    assert final.lm_head.weight is final.embed_tokens.weight
    untied = tmp_path / "untied"
    train(prepared, _recipe(1), untied)
    assert abs(_rows(untied)[0]["loss"] - a[0]["loss"]) < 0.3


def _genoctx(*args):
    return run_genoctx(*args, timeout=300)


@pytest.fixture(scope="module")
def run2(prepared, tmp_path_factory):
    run = tmp_path_factory.mktemp("ck") / "run"
    train(prepared, _recipe(2), run)
    return run


def _corrupt(run2, tmp_path, name, how):
    run = tmp_path / "run"
    shutil.copytree(run2, run)
    path = run / "checkpoints" / "step_000002" / name
    if how.startswith("random"):  # random:SEED
        path.write_bytes(random.Random(how).randbytes(4096))
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        path.write_text(how)
    return run, path


@pytest.mark.parametrize(
    "name, how, verbs",
    [
        ("model.safetensors", "random:0", ("eval", "resume")),
        ("model.safetensors", "truncate", ("eval", "resume")),
        ("optimizer.pt", "truncate", ("resume",)),
        *[("optimizer.pt", f"random:{seed}", ("resume",)) for seed in range(3)],
        ("state.json", "{not json", ("eval", "resume")),
        ("state.json", '{"step": "two"}', ("eval", "resume")),
        ("recipe.yaml", "model: [", ("eval",)),  # resume takes the recipe given, not the stored one
    ],
)
def test_a_corrupt_checkpoint_file_is_one_line_naming_it(prepared, run2, tmp_path, name, how, verbs):
    """The readers' own checks (``--no-verify``: the recorded digests, which would catch these first, are
    tested in test_verify.py)."""
    run, path = _corrupt(run2, tmp_path, name, how)
    for verb in verbs:
        if verb == "eval":
            r = _genoctx("eval", "--by-position", "--data", prepared, "--checkpoint", run, "--max-windows", 1,
                         "--resamples", 0, "--no-verify")  # fmt: skip
        else:
            r = _genoctx("train", "--data", prepared, "--recipe", "recipes/tiny.yaml", "--out", run, "--steps", 4,
                         "--resume", "--no-verify", *(x for s in SETS for x in ("--set", s)))  # fmt: skip
        assert r.returncode == 2, (verb, r.stderr[-2000:])
        lines = r.stderr.strip().splitlines()
        assert "Traceback" not in r.stderr and lines[-1].startswith("genoctx: error:") and str(path) in lines[-1]
        assert [ln for ln in lines if ln.startswith("genoctx: error:")] == [lines[-1]]


def test_an_hf_config_of_another_model_type_is_one_line(prepared, tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))
    (hf / "model.safetensors").write_bytes(b"")
    r = _genoctx("eval", "--by-position", "--data", prepared, "--checkpoint", hf, "--max-windows", 1)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "config.json" in r.stderr and "llama" in r.stderr and len(r.stderr.strip().splitlines()) == 1


class _RunsCode:
    """Unpickling this calls ``os.system`` (what a hostile checkpoint would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_an_optimizer_state_that_would_run_code_is_refused_unrun(run2, tmp_path):
    marker = tmp_path / "pwned"
    run = tmp_path / "run"
    shutil.copytree(run2, run)
    opt = run / "checkpoints" / "step_000002" / "optimizer.pt"
    torch.save({"optimizer": _RunsCode(marker), "scheduler": None}, opt)
    with pytest.raises(GenoctxError, match="refused: loading it would execute pickled code"):
        read_optimizer(opt)
    assert not marker.exists()
    with open(opt, "wb") as f:  # a plain pickle, not torch's zip format
        pickle.dump({"optimizer": _RunsCode(marker), "scheduler": None}, f)
    with pytest.raises(GenoctxError, match=str(opt)):
        read_optimizer(opt)
    assert not marker.exists()
    # the real thing is data: it loads with weights_only=True
    assert set(read_optimizer(run2 / "checkpoints" / "step_000002" / "optimizer.pt")) == {"optimizer", "scheduler"}
