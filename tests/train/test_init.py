"""``genoctx train --init``: post-training a pretrained glm5_next with a text vocabulary (built here with transformers
and a small character-level tokenizer), read through its token map, scored over its full vocabulary or the
nucleotide rows; the Hub path through a pre-populated HF cache, offline."""

import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
from cli_runner import run_genoctx  # tests/cli_runner.py: tests/ is on sys.path (its conftest.py)

from genoctx.data.dataset import WindowDataset, scored_mask
from genoctx.data.tokenizer import BOS
from genoctx.errors import GenoctxError
from genoctx.model.model import shift_inputs
from genoctx.recipes import load_recipe
from genoctx.train.checkpoint import latest_checkpoint, load_model
from genoctx.train.loop import sample_batch, train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from glm5_reference import build, logits, reference_modules, save, text_config  # noqa: E402

sys.path.pop(0)

# a character-level tokenizer whose ids for A C G T N are scattered through a text vocabulary of 40 tokens
CHARS = list("xyzTqwGerNtuiopCasdfghjklA") + [f"tok{i}" for i in range(12)]
SPECIAL = ["<|endoftext|>", "<sop>"]
VOCAB = len(CHARS) + len(SPECIAL)


def _write_tokenizer(path: Path, chars=CHARS) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Split

    vocab = {t: i for i, t in enumerate(chars)}
    for t in SPECIAL:
        vocab[t] = len(vocab)
    tok = Tokenizer(WordLevel(vocab, unk_token="x"))
    tok.pre_tokenizer = Split("", "isolated")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny glm5_next base with a 40-token text vocabulary (A = 25, C = 15, G = 6, T = 3, N = 9,
    <|endoftext|> = 38), its tokenizer files, and the transformers model."""
    path = tmp_path_factory.mktemp("base") / "glm-tiny"
    ref = build(text_config(vocab_size=VOCAB), seed=3)
    save(ref, path)
    _write_tokenizer(path)
    return path, ref


IDS = {"A": 25, "C": 15, "G": 6, "T": 3, "N": 9}
START = len(CHARS)  # <|endoftext|>, tokenizer_config.json's eos_token


def _recipe(init, *extra):
    return load_recipe(None, [f"model.init={init}", "train.steps=2", "train.seq_len=128", "train.warmup_steps=1",
                              "train.checkpoint_every=1", "train.lr=1e-3", *extra])  # fmt: skip


def _reference_loss(ref, tokens, rows=None):
    """Mean next-base loss (nats) of the transformers base on genoctx tokens [B, L], mapped by hand."""
    table = torch.tensor([IDS["A"], IDS["C"], IDS["G"], IDS["T"], IDS["N"], START, START, START])
    lg = logits(ref, table[shift_inputs(tokens, BOS)]).double()
    scored = scored_mask(tokens)
    if rows is None:
        ce = torch.nn.functional.cross_entropy(lg[scored], table[tokens][scored], reduction="none")
    else:
        ce = torch.nn.functional.cross_entropy(lg[..., rows][scored], tokens[scored], reduction="none")
    return float(ce.mean())


@pytest.mark.parametrize("vocab", ["full", "nucleotide"])
def test_init_trains_the_base_through_its_token_map(prepared, base, tmp_path, vocab):
    path, ref = base
    run = tmp_path / "run"
    # 16-token crops: every pool is selected (index_topk 16), so the loss does not hinge on how top-k breaks the
    # ties that 5 distinct input tokens make in the indexer's scores (genoctx: the most recent pool; torch.topk:
    # unspecified)
    rec = _recipe(path, f"loss.vocab={vocab}", "loss.chunk_tokens=5", "train.seq_len=16")
    summary = train(prepared, rec, run)
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    # step 1's loss is the base's own loss on that batch: its weights, the map, the window start, the vocabulary
    tokens, _ = sample_batch(WindowDataset(prepared, "train"), rec.train, 0)
    rows_ids = None if vocab == "full" else [IDS[b] for b in "ACGTN"]
    assert rows[0]["loss"] == pytest.approx(_reference_loss(ref, tokens, rows_ids), rel=1e-5)
    assert rows[1]["loss"] < rows[0]["loss"] + 0.5 and summary["steps_run"] == 2
    state = json.loads((latest_checkpoint(run) / "state.json").read_text())
    assert state["token_map"]["ids"] == [25, 15, 6, 3, 9, 38, 38, 38]
    assert state["token_map"]["window_start_token"] == "<|endoftext|>" and state["loss_vocab"] == vocab
    init = state["init"]
    assert init["source"] == str(path) and init["revision"] is None
    assert set(init["files"]) >= {"config.json", "tokenizer.json", "model.safetensors:header"}
    model, recipe, _ = load_model(run)
    assert recipe.model.vocab_size == VOCAB == 40 and recipe.init is None  # the resolved architecture
    assert model.cfg.hidden_size == 32


def test_eval_scores_base_and_post_trained_alike(prepared, base, tmp_path):
    """The base (HF dir, full vocabulary) and its post-trained run (the run's loss.vocab) through the same token
    map; the base's eval loss equals transformers' own full-vocabulary loss on the same windows."""
    from genoctx.eval.position import evaluate

    path, ref = base
    run = tmp_path / "run"
    train(prepared, _recipe(path), run)
    doc = evaluate([path, run], prepared, max_windows=2, resamples=0, chunk_tokens=700, bins="16")
    base_entry, post = doc["models"]
    assert (base_entry["loss_vocab"], post["loss_vocab"]) == ("full", "full")
    ds = WindowDataset(prepared, "eval")
    tokens = torch.stack([ds[i]["tokens"][:16] for i in range(2)]).long()

    def first16(entry):  # bin [0, 16): positions where every pool is selected (no top-k ties)
        assert (entry["bins"][0]["start"], entry["bins"][0]["end"], entry["bins"][0]["tokens"]) == (0, 16, 32)
        return entry["bins"][0]["loss"]

    assert first16(base_entry) == pytest.approx(_reference_loss(ref, tokens), rel=1e-5)
    nuc = evaluate([path], prepared, max_windows=2, resamples=0, loss_vocab="nucleotide", bins="16")
    assert nuc["models"][0]["loss_vocab"] == "nucleotide"
    assert first16(nuc["models"][0]) == pytest.approx(_reference_loss(ref, tokens, [IDS[b] for b in "ACGTN"]), rel=1e-5)
    assert nuc["overall"]["loss"] < base_entry["overall"]["loss"]  # 5-way softmax: a different, easier objective


def test_init_refuses_architecture_keys_and_presets(base):
    path, _ = base
    with pytest.raises(GenoctxError, match=r"--set model.hidden_size=64: model.hidden_size cannot change the arch"):
        _recipe(path, "model.hidden_size=64")
    with pytest.raises(GenoctxError, match="drop model.preset"):
        _recipe(path, "model.preset=tiny")
    rec = _recipe(path, "model.kda_chunk_size=16")  # a compute knob is fine
    assert rec.model_knobs == {"kda_chunk_size": 16}


def _hub_cache(
    root: Path, repo: str, src: Path, commit: str = "0123456789abcdef0123456789abcdef01234567", refs=("main",)
) -> Path:
    """The layout huggingface_hub's cache uses: models--org--name/{refs/<branch or tag>, snapshots/<commit>/files};
    ``src`` copied as the snapshot of ``commit``, each of ``refs`` pointing at it (a repo may hold several)."""
    folder = root / ("models--" + repo.replace("/", "--"))
    snap = folder / "snapshots" / commit
    shutil.copytree(src, snap)
    for ref in refs:
        (folder / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return snap


def _cli(args, env):
    import os

    return run_genoctx(*args, env={**os.environ, **env}, timeout=300)


def test_init_from_a_hub_repo_id_offline(prepared, base, tmp_path):
    path, _ = base
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    _hub_cache(cache, "zai-org/GLM-tiny", path, commit)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    common = ["train", "--data", prepared, "--steps", "1", "--set", "train.seq_len=128"]
    r = _cli([*common, "--init", "zai-org/GLM-tiny", "--out", tmp_path / "run"], env)
    assert r.returncode == 0, r.stderr[-2000:]
    state = json.loads((latest_checkpoint(tmp_path / "run") / "state.json").read_text())
    assert state["init"]["source"] == "zai-org/GLM-tiny" and state["init"]["revision"] == commit
    assert state["init"]["path"] == str(cache / "models--zai-org--GLM-tiny" / "snapshots" / commit)
    # an offline cache miss: one line naming the id, nothing written
    r = _cli([*common, "--init", "zai-org/GLM-missing", "--out", tmp_path / "miss"], env)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()
    assert len(last) == 1 and "--init zai-org/GLM-missing: not in the Hugging Face cache" in last[0]
    assert not (tmp_path / "miss").exists()


def _broken(base_path: Path, tmp_path: Path, how: str) -> Path:
    p = tmp_path / how
    shutil.copytree(base_path, p)
    if how == "no-tokenizer":
        (p / "tokenizer.json").unlink()
    elif how == "no-base-tokens":
        _write_tokenizer(p, [c for c in CHARS if c != "G"] + ["g"])
    elif how == "llama":
        cfg = json.loads((p / "config.json").read_text())
        cfg["model_type"] = "llama"
        (p / "config.json").write_text(json.dumps(cfg))
    elif how == "missing-shard":
        (p / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})
        )
        (p / "model.safetensors").unlink()
    return p


@pytest.mark.parametrize(
    "how, message",
    [
        ("no-tokenizer", "tokenizer.json: no tokenizer.json"),
        ("no-base-tokens", "tokenizer.json: no single-character token for 'G'"),
        ("llama", "llama"),
        ("missing-shard", "model-00002-of-00002.safetensors is missing"),
    ],
)
def test_a_bad_base_is_one_line_and_writes_nothing(prepared, base, tmp_path, how, message):
    p = _broken(base[0], tmp_path, how)
    out = tmp_path / "out"
    r = _cli(["train", "--data", prepared, "--steps", "1", "--init", p, "--out", out], {})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr[-2000:]
    assert message in lines[0] and lines[0].startswith("genoctx: error:")
    assert not out.exists()


def test_export_then_init_equals_init_from_the_checkpoint(prepared, base, tmp_path):
    """Post-train from the base, export to HF (the base's tokenizer and config carried), reload the export in
    transformers (same logits), then one more step from the export (--init HF dir) equals one more step from the
    genoctx checkpoint itself (--init RUN): the same loss and the same weights after the step."""
    path, _ = base
    run = tmp_path / "run"
    train(prepared, _recipe(path, "train.seq_len=16"), run)
    hf = tmp_path / "hf"
    r = _cli(["export", run, "--out", hf], {})
    assert r.returncode == 0, r.stderr[-2000:]
    assert (
        json.loads(r.stdout)["base"] == str(path)
        and (hf / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()
    )
    model, _, _ = load_model(run)
    _, Model = reference_modules()
    ref = Model.from_pretrained(str(hf)).eval()
    ids = torch.tensor([[START, IDS["A"], IDS["C"], IDS["G"], IDS["T"], IDS["N"], IDS["A"], IDS["A"]] * 2])
    assert torch.allclose(logits(ref, ids), model(ids)[0].detach(), atol=1e-5)

    one = ["train.steps=1", "train.seq_len=16"]
    a = train(prepared, _recipe(hf, *one), tmp_path / "from-export")
    b = train(prepared, _recipe(run, *one), tmp_path / "from-run")
    assert a["final_loss"] == pytest.approx(b["final_loss"], rel=1e-6)
    sa, sb = (load_model(tmp_path / x)[0].state_dict() for x in ("from-export", "from-run"))
    assert set(sa) == set(sb) and all(torch.allclose(sa[k], sb[k], atol=1e-6) for k in sa)
    ia = json.loads((latest_checkpoint(tmp_path / "from-export") / "state.json").read_text())
    ib = json.loads((latest_checkpoint(tmp_path / "from-run") / "state.json").read_text())
    assert ia["token_map"]["ids"] == ib["token_map"]["ids"] == [25, 15, 6, 3, 9, 38, 38, 38]
    assert (ia["init"]["kind"], ib["init"]["kind"]) == ("hf", "genoctx")
    assert ib["init"]["hf_base"] == str(path)  # the lineage's HF root: what export takes the tokenizer from


def test_resume_of_an_init_run_without_init_names_it(prepared, base, tmp_path):
    path, _ = base
    run = tmp_path / "run"
    train(prepared, _recipe(path, "train.seq_len=16"), run, stop_after=1)
    plain = load_recipe("recipes/tiny.yaml", ["train.steps=2", "train.seq_len=16", "train.warmup_steps=1",
                                              "train.checkpoint_every=1", "train.lr=1e-3"])  # fmt: skip
    with pytest.raises(GenoctxError, match=f"the run started from --init {path}: pass it again"):
        train(prepared, plain, run, resume=True)
    with pytest.raises(GenoctxError, match="data.window_start_token is '<sop>' but the run was trained with None"):
        train(prepared, _recipe(path, "train.seq_len=16", "data.window_start_token=<sop>"), run, resume=True)
    assert train(prepared, _recipe(path, "train.seq_len=16"), run, resume=True)["resumed_from"] == 1


# ---------------------------------------------------------------- Hub revisions from the cache alone (issue 24, 6)

A = "a1b2c3d4e5f60718293a4b5c6d7e8f9012345678"  # refs/main at the start
B = "b7e1c0de00112233445566778899aabbccddeeff"  # refs/v1.0 (a tag); refs/main later
C1, C2 = "c0ffee" + "1" * 34, "c0ffee" + "2" * 34  # two commits sharing the prefix c0ffee


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """An empty HF cache folder, with huggingface_hub in offline mode (as HF_HUB_CACHE=... HF_HUB_OFFLINE=1 set
    before it is imported)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def _variant(base_path: Path, dest: Path, shift: float) -> Path:
    """A copy of the base whose weights differ (every float tensor + ``shift``) and whose safetensors header says so
    (metadata ``variant``): another commit of the same repo."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base_path, dest)
    tensors = {k: v + shift if v.is_floating_point() else v for k, v in load_file(dest / "model.safetensors").items()}
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt", "variant": str(shift)})
    return dest


@pytest.fixture
def two_commits(base, offline_hub, tmp_path):
    """zai-org/GLM-tiny cached at A (refs/main) and at B (refs/v1.0, other weights), plus C1 and C2 (refs none)."""
    path, _ = base
    repo = "zai-org/GLM-tiny"
    _hub_cache(offline_hub, repo, path, A, refs=("main",))
    _hub_cache(offline_hub, repo, _variant(path, tmp_path / "b", 0.01), B, refs=("v1.0",))
    for c in (C1, C2):
        _hub_cache(offline_hub, repo, path, c, refs=())
    return offline_hub / "models--zai-org--GLM-tiny"


@pytest.mark.parametrize(
    "rev, commit",
    [
        ("", A),
        ("@main", A),
        ("@v1.0", B),
        (f"@{B}", B),
        (f"@{B[:7]}", B),
        (f"@{B[:4]}", B),
        (f"@{A[:10].upper()}", A),
        (f"@{C1[:7]}", C1),
    ],  # fmt: skip
)
def test_hub_revisions_resolve_from_the_cache_offline(two_commits, rev, commit):
    """A branch, a tag, a full commit and a short one (4+ hex digits, unique among the cached snapshots): each the
    snapshot of its commit, recorded as the full commit."""
    from genoctx.train.init import resolve_base

    path, info = resolve_base(f"zai-org/GLM-tiny{rev}")
    assert path == two_commits / "snapshots" / commit
    assert info["revision"] == commit and info["path"] == str(path) and info["source"] == f"zai-org/GLM-tiny{rev}"


def test_an_ambiguous_short_commit_lists_the_candidates(two_commits):
    from genoctx.train.init import resolve_base

    with pytest.raises(GenoctxError) as e:
        resolve_base("zai-org/GLM-tiny@c0ffee")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--init zai-org/GLM-tiny@c0ffee: the short commit c0ffee is ambiguous")
    assert f"{C1}, {C2}" in msg and str(two_commits / "snapshots") in msg


@pytest.mark.parametrize("rev", ["v9", "deadbee", "f" * 40])
def test_a_revision_missing_from_the_cache_is_one_line_exit_2(prepared, two_commits, offline_hub, tmp_path, rev):
    """A tag, a short and a full commit the cache does not hold: one line naming the repo, the revision and the
    cache folder, exit 2, nothing written."""
    from typer.testing import CliRunner

    from genoctx.cli import app

    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["train", "--data", str(prepared), "--steps", "1", "--out", str(out),
                                   "--init", f"zai-org/GLM-tiny@{rev}"])  # fmt: skip
    assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    line = lines[0]
    assert line.startswith(f"genoctx: error: --init zai-org/GLM-tiny@{rev}: not in the Hugging Face cache: ")
    assert f"revision {rev} of zai-org/GLM-tiny is not in {offline_hub}" in line
    assert "cached refs: main, v1.0" in line and "HF_HUB_OFFLINE is set" in line
    assert line.endswith(f"hf download zai-org/GLM-tiny --revision {rev}")
    assert not out.exists()


def test_dry_run_reads_a_short_commits_config_from_the_cache(prepared, two_commits):
    """``train --dry-run`` (no download: ``try_to_load_from_cache``) takes the short commit too."""
    from typer.testing import CliRunner

    from genoctx.cli import app

    res = CliRunner().invoke(app, ["train", "--data", str(prepared), "--out", "unused", "--dry-run",
                                   "--init", f"zai-org/GLM-tiny@{B[:7]}"])  # fmt: skip
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["dry_run"]["ranks"][0]["params_local"] > 0
    res = CliRunner().invoke(app, ["train", "--data", str(prepared), "--out", "unused", "--dry-run",
                                   "--init", "zai-org/GLM-tiny@c0ffee"])  # fmt: skip
    assert res.exit_code == 2 and "the short commit c0ffee is ambiguous" in res.stderr


@pytest.mark.parametrize("given", ["zai-org/GLM-tiny", "zai-org/GLM-tiny@main"])
def test_resume_uses_the_commit_the_run_started_from(prepared, base, two_commits, tmp_path, given):
    """Start from the branch (refs/main -> A), move the branch to B (other weights), resume: the resumed run's
    checkpoints still record A (revision, path, fingerprint), and the base they point at holds A's weights."""
    from safetensors.torch import load_file

    from genoctx.train.init import fingerprint

    run = tmp_path / "run"
    train(prepared, _recipe(given, "train.seq_len=16"), run, stop_after=1)
    first = json.loads((latest_checkpoint(run) / "state.json").read_text())["init"]
    assert first["revision"] == A and first["source"] == given
    (two_commits / "refs" / "main").write_text(B)  # the branch moves on
    summary = train(prepared, _recipe(given, "train.seq_len=16"), run, resume=True)
    assert summary["resumed_from"] == 1 and summary["steps_run"] == 1
    last = latest_checkpoint(run)
    assert last.name.endswith("2")
    init = json.loads((last / "state.json").read_text())["init"]
    snap_a, snap_b = two_commits / "snapshots" / A, two_commits / "snapshots" / B
    assert init["revision"] == A and init["source"] == given and init["path"] == str(snap_a) == init["hf_base"]
    assert init["files"] == first["files"] == fingerprint(snap_a) != fingerprint(snap_b)
    recorded, wa, wb = (load_file(Path(d) / "model.safetensors") for d in (init["path"], snap_a, snap_b))
    assert all(torch.equal(recorded[k], wa[k]) for k in wa) and not all(torch.equal(wa[k], wb[k]) for k in wa)
    # a new run from the branch now starts from B
    fresh = train(prepared, _recipe(given, "train.seq_len=16", "train.steps=0"), tmp_path / "new")
    assert fresh["steps_run"] == 0
    assert json.loads((latest_checkpoint(tmp_path / "new") / "state.json").read_text())["init"]["revision"] == B


def test_resume_whose_recorded_commit_left_the_cache_names_it(prepared, base, two_commits, tmp_path):
    run = tmp_path / "run"
    train(prepared, _recipe("zai-org/GLM-tiny", "train.seq_len=16"), run, stop_after=1)
    (two_commits / "refs" / "main").write_text(B)
    shutil.rmtree(two_commits / "snapshots" / A)
    with pytest.raises(GenoctxError) as e:
        train(prepared, _recipe("zai-org/GLM-tiny", "train.seq_len=16"), run, resume=True)
    msg = str(e.value)
    assert msg.startswith(f"--resume: --init zai-org/GLM-tiny@{A}: not in the Hugging Face cache: revision {A}")
    assert msg.endswith("(the commit the run started from, in its state.json)") and "\n" not in msg


def test_init_takes_its_own_export_of_a_nucleotide_run(prepared, tmp_path):
    """``genoctx export`` of a run with the 8 nucleotide tokens (no base: no tokenizer.json) is a base for
    ``--init``, as eval reads it: one step from the export equals one step from the run itself (loss and weights),
    with no token map recorded."""
    from typer.testing import CliRunner

    from genoctx.cli import app

    sets = ["train.seq_len=16", "train.warmup_steps=1", "train.checkpoint_every=1"]
    run = tmp_path / "run"
    train(prepared, load_recipe("recipes/tiny.yaml", ["train.steps=1", *sets]), run)
    hf = tmp_path / "hf"
    res = CliRunner().invoke(app, ["export", str(run), "--out", str(hf)])
    assert res.exit_code == 0, res.stderr[-2000:]
    assert not (hf / "tokenizer.json").exists() and json.loads(res.stdout)["base"] is None

    def one_step(init, out, *knobs):
        rec = load_recipe("recipes/tiny.yaml", [f"model.init={init}", "model.preset=null", "train.steps=1", *sets,
                                                *knobs])  # fmt: skip
        return train(prepared, rec, out)

    # config.json has no compute knobs: the tiny preset's, given as the recipe's, so both runs compute alike
    knobs = ["model.kda_chunk_size=16", "model.indexer_tile_tokens=1048576", "model.moe_chunk_tokens=64"]
    a, b = one_step(hf, tmp_path / "from-export", *knobs), one_step(run, tmp_path / "from-run")
    assert a["final_loss"] == pytest.approx(b["final_loss"], rel=1e-6)
    sa, sb = (load_model(tmp_path / x)[0].state_dict() for x in ("from-export", "from-run"))
    assert set(sa) == set(sb) and all(torch.allclose(sa[k], sb[k], atol=1e-6) for k in sa)
    state = json.loads((latest_checkpoint(tmp_path / "from-export") / "state.json").read_text())
    assert state["init"]["kind"] == "hf" and state["init"]["path"] == str(hf.resolve())
    assert "token_map" not in state and "loss_vocab" not in state

    # --resume of the run started with --init RUN (a nucleotide genoctx checkpoint: no tokenizer.json) continues it
    rec = load_recipe("recipes/tiny.yaml", [f"model.init={run}", "model.preset=null", *sets, "train.steps=2"])
    c = train(prepared, rec, tmp_path / "from-run", resume=True)
    assert c["steps_run"] == 1 and latest_checkpoint(tmp_path / "from-run").name == "step_000002"
    state = json.loads((latest_checkpoint(tmp_path / "from-run") / "state.json").read_text())
    assert state["init"]["kind"] == "genoctx" and "token_map" not in state


def test_init_over_a_recipe_that_names_a_preset_starts_from_the_base(prepared, base, tmp_path):
    """Issue 45: ``--init`` with a shipped recipe (``model.preset: tiny``) was refused until ``--set
    model.preset=null``. The base's config.json fixes the architecture: the file's preset is ignored, in one line."""
    path, _ = base
    run = tmp_path / "run"
    r = run_genoctx("train", "--data", str(prepared), "--recipe", "recipes/tiny.yaml", "--init", str(path), "--out",
                    str(run), "--steps", "1", "--set", "train.seq_len=16", "--set", "loss.chunk_tokens=5")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    said = [ln for ln in r.stderr.splitlines() if "fixes the architecture" in ln]
    assert len(said) == 1 and f"model.init {path}: its config.json fixes the architecture; " in said[0]
    assert said[0].endswith("recipes/tiny.yaml's model.preset tiny ignored")
    _, recipe, _ = load_model(run)
    assert recipe.model.vocab_size == VOCAB == 40 and recipe.preset is None  # the base's model, not tiny's 8 tokens


def test_init_ignores_a_files_architecture_but_not_a_set_one(base, tmp_path, caplog):
    path, _ = base
    caplog.set_level(logging.INFO, logger="genoctx.recipes")
    rec = load_recipe("recipes/gpu-check.yaml", [f"model.init={path}", "model.kda_chunk_size=16"])
    assert rec.preset is None and rec.init == str(path) and rec.model_knobs == {"kda_chunk_size": 16}
    assert "model.preset glm-5.3-flash and 13 architecture keys (hidden_size, intermediate_size, layer_types, ...) " \
        "ignored" in caplog.text  # fmt: skip
    # the user's own clash (--set) and a file that names both are still refused, in one line
    with pytest.raises(GenoctxError, match=r"^--set model.preset=tiny: .*drop model.preset"):
        load_recipe("recipes/tiny.yaml", [f"model.init={path}", "model.preset=tiny"])
    with pytest.raises(GenoctxError, match=r"^--set model.num_hidden_layers=3: model.num_hidden_layers cannot"):
        load_recipe("recipes/tiny.yaml", [f"model.init={path}", "model.num_hidden_layers=3"])
    both = tmp_path / "both.yaml"
    both.write_text(f"model:\n  preset: tiny\n  init: {path}\n")
    with pytest.raises(GenoctxError, match=rf"^{both}: model.preset 'tiny' with model.init"):
        load_recipe(both)
