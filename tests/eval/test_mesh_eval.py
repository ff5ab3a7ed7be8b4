"""``genoctx eval --num-workers N [--fsdp F] [--ep E] [--cp C]``: evaluation on the training mesh equals one process.

The driver (``genoctx.eval.distributed.score_on_mesh`` through ``evaluate(..., mesh=...)``) runs unchanged; the
workers are spawned gloo processes (``mesh_runner.spawn_workers``) instead of Ray workers (Ray is covered once, through
the CLI, by ``test_cli_on_ray_equals_one_process``). Three checkpoints of every kind eval reads are scored
together (the first is the baseline: paired intervals): a genoctx run (one-process safetensors), a DCP checkpoint
written by an FSDP=2 run (read here in other layouts), and an HF directory of a model with a text vocabulary (read
through its token map). The windows are real DNA (chr22), one with a second half of N (one CP piece all N), and a
padded last window; there are 3 of them, so with two data ranks one rank scores a ``<pad>`` window in the last round.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from cli_runner import run_genoctx  # tests/cli_runner.py: tests/ is on sys.path (its conftest.py)

from genoctx.errors import GenoctxError
from genoctx.eval.distributed import MeshEval, round_robin
from genoctx.eval.position import evaluate

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "parallel"))
sys.path.insert(0, str(HERE.parent / "model"))
from mesh_runner import spawn_workers  # noqa: E402
from mesh_worker import mesh_config, mesh_model  # noqa: E402

REALDNA = HERE.parents[1] / "data" / "hg38"
WINDOW = 256
CHUNK = 48  # tokens per chunk: windows (CP=1) and CP pieces of 128 or 64 tokens stream in several chunks
ARGS = dict(bins="linear:4", resamples=200, seed=3, chunk_tokens=CHUNK, reverse_complement=True, split_by="softmask")


def _real(n: int, skip: int) -> str:
    seq = "".join(ln.strip() for ln in (REALDNA / "hg38_chr22_32000001-32300000.fa").read_text().splitlines()[1:])
    seq = seq[skip:].replace("N", "").replace("n", "")
    return seq[:n]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Eval windows of 256 bases: real (soft-masked kept), real then 128 N (CP=2: rank 1's piece all N), and a last
    partial window of 200 bases padded to 256; train: other real DNA."""
    from genoctx.data.windows import prepare

    root = tmp_path_factory.mktemp("meshdata")
    ev = _real(256, 10_000) + _real(128, 20_000) + "N" * 128 + _real(200, 40_000)
    (root / "d.fa").write_text(f">chrE\n{ev}\n>chrT\n{_real(4000, 60_000)}\n")
    out = root / "prepared"
    prepare([root / "d.fa"], out, window=WINDOW, train_chroms=["chrT"], eval_chroms=["chrE"], drop_last=False,
            progress=False)  # fmt: skip
    return out


def _save_dcp(config: dict, session) -> None:
    """Worker: build model B on FSDP=2 from its one-process checkpoint and save it as DCP shards (a collective)."""
    from genoctx.parallel.build import FromCheckpoint, build_model
    from genoctx.parallel.mesh import init_parallel
    from genoctx.recipes import Recipe, TrainConfig
    from genoctx.train.sharded import save_sharded

    dims = init_parallel(dp_shard=2)
    model = build_model(mesh_config(), dims, source=FromCheckpoint(Path(config["src"])))
    save_sharded(Path(config["out"]), 5, model, None, None, Recipe(model=mesh_config(), train=TrainConfig()), {}, dims)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[Path]:
    """[genoctx run (safetensors), DCP checkpoint saved by FSDP=2, HF directory with a 40-token text vocabulary]."""
    from genoctx.recipes import Recipe, TrainConfig
    from genoctx.train.checkpoint import save_checkpoint

    root = tmp_path_factory.mktemp("ckpts")
    recipe = Recipe(model=mesh_config(), train=TrainConfig())
    save_checkpoint(root / "run_a", 3, mesh_model(), None, None, recipe, {})
    torch.manual_seed(11)
    b = mesh_model()
    with torch.no_grad():  # a different model: perturb every weight
        for p in b.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    save_checkpoint(root / "one_b", 1, b, None, None, recipe, {})
    spawn_workers(_save_dcp, {"src": str(root / "one_b" / "checkpoints" / "step_000001"), "out": str(root / "run_b")},
                  num_workers=2, storage_path=root / "spawn")  # fmt: skip
    dcp = root / "run_b" / "checkpoints" / "step_000005"
    assert (dcp / "dcp" / ".metadata").is_file() and not (dcp / "model.safetensors").exists()
    from glm5_reference import build, save, text_config

    sys.path.insert(0, str(HERE.parent / "train"))
    from test_init import VOCAB, _write_tokenizer

    hf = root / "glm-text"
    save(build(text_config(vocab_size=VOCAB), seed=5), hf)
    _write_tokenizer(hf)
    return [root / "run_a", dcp, hf]


@pytest.fixture(scope="module")
def one_process(data, checkpoints) -> dict:
    return evaluate(checkpoints, data, **ARGS)


LAYOUTS = {  # name -> (workers, fsdp, ep, cp, cp_layout[, ep_folded])
    "fsdp2": (2, 2, 1, 1, "contiguous"),
    "ep2": (2, 1, 2, 1, "contiguous"),
    "cp2": (2, 1, 1, 2, "contiguous"),
    "fsdp2_cp2_zigzag": (4, 2, 1, 2, "zigzag"),
    "cp2_fep2": (2, 1, 2, 2, "contiguous", True),  # EP 2 folded into the CP ranks
}


def _mesh(workers, fsdp, ep, cp, cp_layout, ep_folded=False, **kw) -> MeshEval:
    return MeshEval(spawn_workers, workers, fsdp=fsdp, ep=ep, cp=cp, cp_layout=cp_layout, ep_folded=ep_folded, **kw)


def _assert_same(got, want, path="doc"):
    """Equal documents: numbers to 1e-6 relative (the sums are reduced in another order and the models run in other
    pieces: fp32 rounding, ~1e-9 of a loss), or 1e-7 absolute for the small numbers made of two losses (differences,
    relative changes and their intervals); everything else exactly."""
    if isinstance(want, dict):
        assert set(got) == set(want), path
        for k in want:
            _assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-7), path
    else:
        assert got == want, path


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mesh_eval_equals_one_process(data, checkpoints, one_process, name):
    """Every layout gives the one-process JSON: per bin, view (both strands, soft-masked or not) and model the
    losses, counts, bootstrap intervals of the seed, paired changes vs the baseline and last-vs-first bin."""
    doc = evaluate(checkpoints, data, mesh=_mesh(*LAYOUTS[name]), **ARGS)
    _assert_same(json.loads(json.dumps(doc)), json.loads(json.dumps(one_process)))
    base, dcp, text = doc["models"]
    assert base["baseline"] and not dcp["baseline"] and text["loss_vocab"] == "full"
    assert dcp["overall"]["relative_change_ci"] is not None and dcp["bins"][-1]["relative_change_ci"] is not None
    assert dcp["last_vs_first_bin"]["change_difference_ci"] is not None
    # 2 windows of 256 bases and one of 200, minus the 128 N: every scored base counted once, on both strands
    assert base["overall"]["tokens"] == 2 * 256 + 200 - 128
    assert doc["views"]["both/all"]["overall"]["tokens"] == 2 * base["overall"]["tokens"]


def test_round_robin_gives_every_window_once_and_pads_the_last_round():
    for n, dp in [(5, 2), (4, 2), (1, 4), (7, 3)]:
        rounds = [round_robin(n, dp, d) for d in range(dp)]
        assert {len(r) for r in rounds} == {-(-n // dp)}  # the same number of forwards on every data rank
        seen = sorted(i for r in rounds for i in r if i is not None)
        assert seen == list(range(n))


def test_bad_layouts_and_copy_probe_are_one_line_errors(data, checkpoints):
    run_a = checkpoints[:1]
    for mesh, msg in [
        (_mesh(3, 2, 1, 1, "contiguous"), "--ep 1 x --fsdp 2 x --cp 1 = 2 must divide --num-workers 3"),
        (_mesh(6, 1, 3, 1, "contiguous"), "--ep 3 must divide the routed experts"),
        (_mesh(2, 1, 4, 2, "contiguous", True), "--ep 4 (folded) must divide --fsdp 1 x --cp 2 = 2"),
        (_mesh(2, 1, 2, 2, "contiguous"), "= 4 must divide --num-workers 2 (or add --ep-folded: --ep 2 drawn from"),
        (_mesh(2, 1, 1, 2, "diagonal"), "--cp-layout must be one of contiguous, zigzag"),
        (_mesh(3, 1, 1, 3, "zigzag"), "--cp 3 with --cp-layout zigzag: the 256-token window does not split into 6"),
    ]:
        with pytest.raises(GenoctxError, match=re.escape(msg)):
            evaluate(run_a, data, mesh=mesh, chunk_tokens=CHUNK)
    with pytest.raises(GenoctxError, match="--copy-probe needs one process"):
        evaluate(run_a, data, mesh=_mesh(2, 2, 1, 1, "contiguous"), copy_probe=True)


def test_a_plan_that_does_not_fit_is_refused_unless_forced(data, checkpoints):
    """Refused before any worker starts; with ``force`` the workers are started (a stand-in runner records it)."""
    mesh = _mesh(2, 2, 1, 1, "contiguous", memory_gib=1e-4)
    with pytest.raises(GenoctxError, match=r"memory plan: dp_replicate=1 ep=1 dp_shard=2 cp=1 needs .* than 0.0001"):
        evaluate(checkpoints[:1], data, mesh=mesh, chunk_tokens=CHUNK)
    started = []

    def runner(worker_fn, config, **kw):
        started.append(kw["num_workers"])
        raise GenoctxError("stand-in runner: no workers")

    forced = MeshEval(runner, 2, fsdp=2, memory_gib=1e-4, force=True)
    with pytest.raises(GenoctxError, match="stand-in runner"):
        evaluate(checkpoints[:1], data, mesh=forced, chunk_tokens=CHUNK)
    assert started == [2]


def test_a_checkpoint_unreadable_on_one_rank_is_one_error_on_all(data, checkpoints, tmp_path):
    """FSDP=2 reads the DCP checkpoint saved by FSDP=2: each rank reads its own shard file. Rank 1's file is cut short
    (the driver, which reads only the metadata, cannot tell; the digests, which would, are not checked here:
    ``verify=False``): every rank fails with one line, no rank hangs."""
    import shutil

    ckpt = tmp_path / "step_000005"
    shutil.copytree(checkpoints[1], ckpt)
    shard = ckpt / "dcp" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(GenoctxError, match=r"dcp: cannot load it into this model \(rank \d: ") as e:
        evaluate([ckpt], data, mesh=_mesh(2, 2, 1, 1, "contiguous"), chunk_tokens=CHUNK, max_windows=2, verify=False)
    assert "\n" not in str(e.value) and str(ckpt) in str(e.value)


def test_a_run_whose_newest_checkpoint_does_not_verify_is_refused_on_the_mesh(data, tmp_path):
    """The workers check the digests (each rank hashing its share) before building the model: a run directory whose
    newest checkpoint has a damaged weight file is refused on every rank with one line naming the file and the newest
    checkpoint that verifies; given explicitly, that one is scored."""
    from genoctx.recipes import Recipe, TrainConfig
    from genoctx.train.checkpoint import save_checkpoint

    run = tmp_path / "run"
    recipe = Recipe(model=mesh_config(), train=TrainConfig())
    for step in (3, 5):
        save_checkpoint(run, step, mesh_model(), None, None, recipe, {})
    bad = run / "checkpoints" / "step_000005" / "model.safetensors"
    raw = bytearray(bad.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 64] = bytes(64)
    bad.write_bytes(bytes(raw))
    mesh = _mesh(2, 2, 1, 1, "contiguous")
    with pytest.raises(GenoctxError) as e:
        evaluate(run, data, mesh=mesh, chunk_tokens=CHUNK, max_windows=1, resamples=0)
    msg = str(e.value)
    assert msg.startswith(f"--checkpoint {run}: its newest checkpoint step_000005 does not verify ({bad}: xxh3_64")
    assert msg.endswith(f"the newest checkpoint that verifies is {run / 'checkpoints' / 'step_000003'}: pass it "
                        "explicitly to evaluate it")  # fmt: skip
    doc = evaluate(run / "checkpoints" / "step_000003", data, mesh=mesh, chunk_tokens=CHUNK, max_windows=1, resamples=0)
    assert doc["checkpoint"] == str(run / "checkpoints" / "step_000003")


def _cli(*args, cwd=None):
    return run_genoctx("eval", "--by-position", *args, cwd=cwd or HERE.parents[1], timeout=600)


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--cp", "2"], "--cp needs --num-workers"),
        (["--num-workers", "3", "--fsdp", "2", "--memory-gib", "0.0001"],
         "--ep 1 x --fsdp 2 x --cp 1 = 2 must divide --num-workers 3"),
        (["--num-workers", "2", "--fsdp", "2", "--memory-gib", "0.0001"], "more than 0.0001 GiB"),
    ],
)
def test_cli_refuses_a_bad_mesh_before_any_worker_starts(data, checkpoints, args, msg):
    """One line, exit 2, nothing on stdout, no Ray started (the other refusals: ``test_bad_layouts...``)."""
    r = _cli("--data", data, "--checkpoint", checkpoints[0], *args)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""


@pytest.mark.slow
def test_cli_on_ray_equals_one_process(data, checkpoints, one_process, monkeypatch):
    """``genoctx eval --num-workers 2 --cp 2 --cp-layout zigzag`` through Ray Train: the one-process JSON. Every path
    is given relative to the driver's working directory (the workers start in another: the CLI makes them absolute
    before they start)."""
    import os

    here = Path(os.path.commonpath([data, *checkpoints]))
    monkeypatch.chdir(here)
    rel = [os.path.relpath(p) for p in (data, *checkpoints)]
    assert not any(os.path.isabs(p) for p in rel)
    r = _cli("--data", rel[0], *[a for c in rel[1:] for a in ("--checkpoint", c)], "--bins", "linear:4",
             "--resamples", 200, "--seed", 3, "--chunk-tokens", CHUNK, "--reverse-complement", "--split-by",
             "softmask", "--format", "json", "--num-workers", 2, "--cp", 2, "--cp-layout", "zigzag",
             cwd=here)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_same(json.loads(r.stdout), json.loads(json.dumps(one_process)))
    assert "distributed eval on dp_replicate=1 ep=1 dp_shard=1 cp=2" in r.stderr
