"""Checkpoints carry their own integrity (``genoctx.train.integrity``): every file's size and xxh3_64 digest in
state.json, checked by every reader before it loads anything.

The damage is the issue's: 64 bytes zeroed in the middle of a file, the size unchanged, which safetensors and
``torch.load`` read silently (they check headers, not tensor bytes). The CLI runs in-process (typer's CliRunner):
exit codes and the one stderr line are what a user sees. The multi-rank case (2 gloo ranks, FSDP=2, DCP) runs
``verify_worker.py``.
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file
from typer.testing import CliRunner

from genoctx.cli import app
from genoctx.recipes import load_recipe
from genoctx.train.checkpoint import list_checkpoints, prune_checkpoints
from genoctx.train.loop import read_events, train

SETS = ["train.seq_len=256", "train.checkpoint_every=2", "train.warmup_steps=1", "train.keep_checkpoints=0"]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import verify_worker  # noqa: E402
from mesh_runner import fork_ranks  # noqa: E402


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def damage(path: Path) -> None:
    """Zero 64 bytes in the middle of ``path`` (its size stays)."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    assert any(data[mid : mid + 64]), "nothing to damage there"
    data[mid : mid + 64] = bytes(64)
    path.write_bytes(bytes(data))


def _error_line(res) -> str:
    """The one ``genoctx: error:`` line, last on stderr, with no traceback."""
    lines = res.stderr.strip().splitlines()
    assert [ln for ln in lines if ln.startswith("genoctx: error:")] == lines[-1:], res.stderr[-3000:]
    assert "Traceback" not in res.stderr and (res.exception is None or isinstance(res.exception, SystemExit))
    return lines[-1]


def _eval(prepared, ckpt, *extra):
    return _cli("eval", "--by-position", "--data", prepared, "--checkpoint", ckpt, "--max-windows", 1, "--resamples", 0,
                "--format", "json", *extra)  # fmt: skip


def _init(prepared, base, out, *extra):
    return _cli("train", "--data", prepared, "--recipe", "recipes/tiny.yaml", "--set", "model.preset=null", "--out",
                out, "--init", base, "--steps", 0, *extra)  # fmt: skip


def _resume(prepared, run, *extra):
    sets = [x for s in SETS for x in ("--set", s)]
    return _cli("train", "--data", prepared, "--recipe", "recipes/tiny.yaml", "--out", run, "--steps", 6, "--resume",
                *sets, *extra)  # fmt: skip


@pytest.fixture(scope="module")
def run4(prepared, tmp_path_factory):
    """A tiny run with checkpoints 2 and 4."""
    run = tmp_path_factory.mktemp("verify") / "run"
    train(prepared, load_recipe("recipes/tiny.yaml", ["train.steps=4", *SETS]), run)
    return run


def _copy(run4, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(run4, run)
    return run


def test_each_checkpoint_records_the_size_and_xxh3_64_of_every_file_it_wrote(run4):
    ckpts = list_checkpoints(run4)
    assert [c.name for c in ckpts] == ["step_000002", "step_000004"]
    for ck in ckpts:
        files = json.loads((ck / "state.json").read_text())["files"]
        assert sorted(files) == ["model.safetensors", "optimizer.pt", "recipe.yaml"]
        for name, rec in files.items():
            data = (ck / name).read_bytes()
            assert rec == {"bytes": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}
    res = _cli("verify", run4)  # a clean run: exit 0, every file ok
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] and [c["step"] for c in doc["checkpoints"]] == [2, 4]
    assert {f["status"] for c in doc["checkpoints"] for f in c["files"].values()} == {"ok"}
    disk = sum((c / n).stat().st_size for c in ckpts for n in ("model.safetensors", "optimizer.pt", "recipe.yaml"))
    assert doc["gb_hashed"] == round(disk / 1e9, 6) and doc["seconds"] >= 0
    for bad, why in ((run4 / "nope", "no such run or"), (run4 / "checkpoints", "not a checkpoint")):
        res = _cli("verify", bad)
        assert res.exit_code == 2 and why in _error_line(res) and res.stdout == ""


def test_damaged_weights_are_refused_by_eval_export_and_init_unless_no_verify(prepared, run4, tmp_path):
    run = _copy(run4, tmp_path)
    ck, older = run / "checkpoints" / "step_000004", run / "checkpoints" / "step_000002"
    bad = ck / "model.safetensors"
    damage(bad)
    # the run directory: refused, naming the damaged file and the newest checkpoint that verifies (never read instead)
    res = _eval(prepared, run)
    assert res.exit_code == 2 and res.stdout == ""
    line = _error_line(res)
    assert f"its newest checkpoint step_000004 does not verify ({bad}: xxh3_64 digest " in line
    assert f"the newest checkpoint that verifies is {older}: pass it explicitly to evaluate it" in line
    for res in (_eval(prepared, ck), _cli("export", ck, "--out", tmp_path / "hf"), _cli("export", run, "--out",
                tmp_path / "hf"), _init(prepared, ck, tmp_path / "init")):  # fmt: skip
        assert res.exit_code == 2, res.stderr[-3000:]
        line = _error_line(res)
        assert str(bad) in line and "recorded in state.json (damaged after it was written)" in line
    assert not (tmp_path / "hf").exists() and list_checkpoints(tmp_path / "init") == []
    res = _cli("verify", run)
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    assert not doc["ok"] and [c["ok"] for c in doc["checkpoints"]] == [True, False]
    f = doc["checkpoints"][1]["files"]["model.safetensors"]
    assert f["status"] == "mismatch" and f["expected"] != f["actual"] and f["bytes"] == bad.stat().st_size
    assert f["actual"] == xxhash.xxh3_64(bad.read_bytes()).hexdigest()
    assert doc["checkpoints"][1]["files"]["optimizer.pt"]["status"] == "ok"
    # the older checkpoint, given explicitly, is evaluated
    assert _eval(prepared, older).exit_code == 0
    # --no-verify: read as it is
    res = _eval(prepared, ck, "--no-verify")
    assert res.exit_code == 0 and json.loads(res.stdout)["checkpoint"] == str(ck)
    assert _cli("export", ck, "--out", tmp_path / "hf", "--no-verify").exit_code == 0
    res = _init(prepared, ck, tmp_path / "init", "--no-verify")
    assert res.exit_code == 0, res.stderr[-3000:]
    started = load_file(str(list_checkpoints(tmp_path / "init")[0] / "model.safetensors"))
    damaged = load_file(str(bad))
    assert started.keys() == damaged.keys() and all(torch.equal(started[k], damaged[k]) for k in damaged)


def test_a_damaged_optimizer_state_stops_only_a_resume(prepared, run4, tmp_path):
    """Eval and export read the weights, not optimizer.pt: they go on. A resume with nothing older to fall back to
    is refused naming the file, and nothing is set aside."""
    run = _copy(run4, tmp_path)
    shutil.rmtree(run / "checkpoints" / "step_000002")
    ck = run / "checkpoints" / "step_000004"
    bad = ck / "optimizer.pt"
    damage(bad)
    res = _resume(prepared, run)
    assert res.exit_code == 2
    line = _error_line(res)
    assert f"--resume: no checkpoint of {run} verifies; the newest: {bad}: xxh3_64 digest" in line
    assert [c.name for c in list_checkpoints(run)] == ["step_000004"]
    assert [e["attempt"] for e in read_events(run) if e["event"] == "start"] == [1]  # no attempt started
    assert _eval(prepared, run).exit_code == 0
    res = _cli("verify", ck)
    assert res.exit_code == 1
    files = json.loads(res.stdout)["checkpoints"][0]["files"]
    assert {n: f["status"] for n, f in files.items()} == {"model.safetensors": "ok", "optimizer.pt": "mismatch",
                                                          "recipe.yaml": "ok"}  # fmt: skip


def test_a_truncated_file_is_a_size_mismatch(prepared, run4, tmp_path):
    run = _copy(run4, tmp_path)
    ck = run / "checkpoints" / "step_000004"
    path = ck / "model.safetensors"
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size // 2])
    res = _eval(prepared, ck)
    assert res.exit_code == 2
    assert f"{path}: {size // 2} bytes on disk, {size} recorded in state.json (truncated" in _error_line(res)
    res = _cli("verify", ck)
    f = json.loads(res.stdout)["checkpoints"][0]["files"]["model.safetensors"]
    assert res.exit_code == 1 and f["status"] == "size" and f["actual_bytes"] == size // 2 and f["actual"] is None


def test_a_checkpoint_without_digests_loads_with_one_warning(prepared, run4, tmp_path):
    """Checkpoints written before digests were recorded: read, with one warning line; ``genoctx verify`` says
    ``unrecorded`` and exits 0."""
    run = _copy(run4, tmp_path)
    ck = run / "checkpoints" / "step_000004"
    state = json.loads((ck / "state.json").read_text())
    del state["files"]
    (ck / "state.json").write_text(json.dumps(state))
    res = _eval(prepared, run)
    assert res.exit_code == 0, res.stderr[-3000:]
    assert [ln for ln in res.stderr.splitlines() if "digests" in ln][0].endswith(
        f"{ck}: no digests recorded; not verified"
    )
    assert len([ln for ln in res.stderr.splitlines() if "digests" in ln]) == 1
    res = _cli("verify", run)
    assert res.exit_code == 0
    doc = json.loads(res.stdout)
    assert doc["ok"] and not doc["checkpoints"][1]["recorded"]
    assert {n: f["status"] for n, f in doc["checkpoints"][1]["files"].items()} == dict.fromkeys(
        ("model.safetensors", "optimizer.pt", "recipe.yaml"), "unrecorded"
    )


def test_a_checkpoint_folder_without_state_json_is_named(prepared, run4, tmp_path, monkeypatch):
    """``checkpoints/step_N`` without state.json (an interrupted copy): ``verify`` reports it (status incomplete,
    exit 1); eval, export and ``--init`` of the run refuse it when it is the newest, naming the newest complete
    one; eval and export name an older one in a warning; never read. Paths are given relative to the working
    directory (the CLI makes them absolute first: the messages name absolute paths)."""
    run = _copy(run4, tmp_path)
    ck4 = run / "checkpoints" / "step_000004"
    for step in (1, 6):  # copies cut short before their state.json
        part = run / "checkpoints" / f"step_00000{step}"
        part.mkdir()
        shutil.copy(ck4 / "recipe.yaml", part / "recipe.yaml")
    older, newer = run / "checkpoints" / "step_000001", run / "checkpoints" / "step_000006"
    monkeypatch.chdir(tmp_path)
    res = _cli("verify", "run")
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    assert doc["path"] == str(run) and not doc["ok"]
    entries = [(c["step"], c["status"], c["ok"]) for c in doc["checkpoints"]]
    assert entries == [(1, "incomplete", False), (2, "ok", True), (4, "ok", True), (6, "incomplete", False)]
    assert doc["checkpoints"][3]["path"] == str(newer)
    assert doc["checkpoints"][3]["files"]["recipe.yaml"]["status"] == "unrecorded"
    line = f"{newer} is incomplete (no state.json, which a save writes last: an interrupted copy?)"
    assert f"genoctx: incomplete: {line}" in res.stderr.splitlines()
    res = _cli("verify", Path("run") / "checkpoints" / "step_000006")
    assert res.exit_code == 1 and [c["status"] for c in json.loads(res.stdout)["checkpoints"]] == ["incomplete"]
    tiny = Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml"
    init = _cli("train", "--data", prepared, "--recipe", tiny, "--set", "model.preset=null", "--out", "init", "--init",
                "run", "--steps", 0)  # fmt: skip
    for res in (_eval(prepared, "run"), _cli("export", "run", "--out", "hf"), init):
        assert res.exit_code == 2 and res.stdout == ""
        assert _error_line(res) == (f"genoctx: error: {run}: its newest checkpoint {line}; the newest complete "
                                    f"checkpoint is {ck4}: pass it explicitly to read it")  # fmt: skip
    assert not (tmp_path / "hf").exists() and not (tmp_path / "init").exists()
    shutil.rmtree(newer)
    for res in (_eval(prepared, "run"), _cli("export", "run", "--out", "hf")):
        assert res.exit_code == 0, res.stderr[-3000:]
        assert json.loads(res.stdout)["checkpoint"] == str(ck4)
        warned = [ln for ln in res.stderr.splitlines() if "incomplete" in ln]
        assert len(warned) == 1 and warned[0].endswith(f"{run}: reading step_000004; not read: {older} is "
                                                       "incomplete (no state.json, which a save writes last: an "
                                                       "interrupted copy?)"), warned  # fmt: skip


def test_a_checkpoint_folder_passed_without_its_state_json_is_named_by_every_reader(prepared, run4, tmp_path):
    """A checkpoint folder given directly whose state.json is gone (an incomplete save): eval, export and ``--init``
    each say so in one line naming the folder and state.json (not "no checkpoint"), exit 2, nothing written; a folder
    with state.json but no weights is named as such."""
    run = _copy(run4, tmp_path)
    ck = run / "checkpoints" / "step_000004"
    (ck / "state.json").unlink()
    tiny = Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml"
    init = ("train", "--data", prepared, "--recipe", tiny, "--set", "model.preset=null", "--out", tmp_path / "init",
            "--steps", 0, "--init")  # fmt: skip
    want = f"{ck} has no state.json: not a genoctx checkpoint (an incomplete save?)"
    for res, head in ((_eval(prepared, ck), ""), (_cli("export", ck, "--out", tmp_path / "hf"), ""),
                      (_cli(*init, ck), f"--init {ck}: ")):  # fmt: skip
        assert res.exit_code == 2 and res.stdout == ""
        assert _error_line(res) == f"genoctx: error: {head}{want}"
    shutil.copy(run4 / "checkpoints" / "step_000004" / "state.json", ck / "state.json")
    (ck / "model.safetensors").unlink()
    for res in (_eval(prepared, ck), _cli("export", ck, "--out", tmp_path / "hf")):
        assert res.exit_code == 2 and res.stdout == ""
        assert _error_line(res) == (f"genoctx: error: {ck} has state.json but no model.safetensors or dcp/.metadata: "
                                    "an incomplete checkpoint")  # fmt: skip
    assert not (tmp_path / "hf").exists() and not (tmp_path / "init").exists()


def test_pruning_counts_only_the_checkpoints_up_to_the_one_written(tmp_path):
    """A newer checkpoint left by an earlier attempt (a resume fell back past it) is never one of the kept N, and
    a checkpoint set aside as broken is no checkpoint at all."""
    for name in ("step_000002", "step_000003", "step_000004", "step_000004.broken"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
        (tmp_path / "checkpoints" / name / "state.json").write_text('{"step": 0}')
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step_000002", "step_000003", "step_000004"]
    assert [p.name for p in prune_checkpoints(tmp_path, 3, keep=1)] == ["step_000002"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_000003", "step_000004", "step_000004.broken"]  # fmt: skip


def _spawn(tmp: Path, case: str) -> list[dict]:
    # verify_worker.py's ranks, forked from the preloaded server (as ``python verify_worker.py TMP CASE``)
    fork_ranks(verify_worker.run, (2, tempfile.mktemp(prefix="genoctx-gloo-"), str(tmp), case), 2)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_sharded_checkpoints_are_hashed_per_rank_and_verified_on_the_mesh(prepared, tmp_path):
    """FSDP=2 on 2 gloo ranks: each rank hashes its own DCP shard while saving; a damaged shard is refused by the
    one-process readers and by the mesh (each rank hashing every other recorded file, one verdict), and the
    distributed resume's choice falls back to the checkpoint before it."""
    ranks = _spawn(tmp_path, "save")
    run = tmp_path / "run"
    ck1, ck2 = (run / "checkpoints" / f"step_00000{s}" for s in (1, 2))
    files = json.loads((ck2 / "state.json").read_text())["files"]
    names = ["dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "recipe.yaml", "scheduler.json"]
    assert sorted(files) == names
    for name, rec in files.items():
        data = (ck2 / name).read_bytes()
        assert rec == {"bytes": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}
    assert ranks[1]["hashed_at_save"] == ["dcp/__1_0.distcp"] * 2  # its own shard, at each of the two saves
    assert ranks[0]["hashed_at_save"] == [
        "dcp/__0_0.distcp", "dcp/.metadata", "scheduler.json", "recipe.yaml"] * 2  # fmt: skip
    bad = ck2 / "dcp" / "__1_0.distcp"
    damage(bad)
    for res in (_eval(prepared, ck2), _cli("export", ck2, "--out", tmp_path / "hf"), _init(prepared, ck2,
                tmp_path / "init")):  # fmt: skip
        assert res.exit_code == 2, res.stderr[-3000:]
        assert f"{bad}: xxh3_64 digest" in _error_line(res)
    assert _eval(prepared, ck2, "--no-verify").exit_code == 0  # DCP does not notice
    res = _cli("verify", run)
    assert res.exit_code == 1
    statuses = {n: f["status"] for n, f in json.loads(res.stdout)["checkpoints"][1]["files"].items()}
    assert statuses == {**dict.fromkeys(names, "ok"), "dcp/__1_0.distcp": "mismatch"}

    ranks = _spawn(tmp_path, "resume")
    msg = ranks[0]["refused"]
    assert msg == ranks[1]["refused"] and f"its newest checkpoint step_000002 does not verify ({bad}: xxh3_64" in msg
    assert f"the newest checkpoint that verifies is {ck1}: pass it explicitly" in msg
    weights = [n for n in names if n != "scheduler.json"]  # what a reader of the model reads
    for r in (0, 1):  # recorded file i on rank i % 2: step 2's, then step 1's (the newest that verifies)
        assert ranks[r]["hashed_by_refuse"] == weights[r::2] * 2
        assert ranks[r]["choice"] == (1, "run", str(ck1))
    assert [c.name for c in list_checkpoints(run)] == ["step_000001"]
    assert (run / "checkpoints" / "step_000002.broken" / "dcp" / "__1_0.distcp").is_file()  # set aside
