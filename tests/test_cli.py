"""The command line as a user (or a shell pipeline) sees it: JSON on stdout, logs on stderr, exit codes."""

import json
import sys
from pathlib import Path

import pytest
from cli_runner import run_genoctx  # tests/cli_runner.py: tests/ is on sys.path (its conftest.py)

REPO = Path(__file__).resolve().parents[1]
REALDNA = REPO / "data" / "hg38"


def genoctx(*args, check=True):
    r = run_genoctx(*args, cwd=REPO, timeout=600)
    if check and r.returncode != 0:
        raise AssertionError(f"genoctx {args} exited {r.returncode}: {r.stderr[-2000:]}")
    return r


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    data = root / "data"
    r = genoctx(
        "prepare",
        "--fasta",
        REALDNA / "hg38_chrM.fa",
        "--fasta",
        REALDNA / "hg38_chr22_32000001-32300000.fa",
        "--chroms",
        "chrM",
        "--eval-chroms",
        "chr22",
        "--window",
        "2k",
        "--out",
        data,
    )
    summary = json.loads(r.stdout)
    assert summary["window"] == 2048
    for name, steps in (("init", 0), ("run", 2)):
        r = genoctx(
            "train",
            "--data",
            data,
            "--recipe",
            "recipes/tiny.yaml",
            "--out",
            root / name,
            "--steps",
            steps,
            "--set",
            "train.seq_len=256",
        )
        assert json.loads(r.stdout)["steps"] == steps
    return root


def test_eval_json_has_one_object_per_bin(pipeline):
    r = genoctx(
        "eval",
        "--by-position",
        "--checkpoint",
        pipeline / "run",
        "--baseline",
        pipeline / "init",
        "--data",
        pipeline / "data",
        "--format",
        "json",
        "--max-windows",
        "2",
        "--bins",
        "linear:4",
        "--plot",
        pipeline / "p.png",
    )
    doc = json.loads(r.stdout)
    assert len(doc["bins"]) == 4
    assert doc["overall"]["tokens"] == sum(b["tokens"] for b in doc["bins"])
    assert (pipeline / "p.png").stat().st_size > 1000


def test_table_and_csv_go_to_stdout(pipeline):
    r = genoctx(
        "eval",
        "--by-position",
        "--checkpoint",
        pipeline / "run",
        "--data",
        pipeline / "data",
        "--max-windows",
        "1",
        "--format",
        "csv",
    )
    assert r.stdout.splitlines()[0].startswith("start,end,tokens")
    r = genoctx(
        "eval",
        "--by-position",
        "--checkpoint",
        pipeline / "run",
        "--data",
        pipeline / "data",
        "--max-windows",
        "1",
    )
    assert "overall" in r.stdout and "bits/base" in r.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["eval", "--by-position", "--checkpoint", "NOPE", "--data", "DATA"], "NOPE"),
        (["eval", "--by-position", "--checkpoint", "RUN", "--data", "DATA", "--bins", "0,99999"], "99999"),
        (["eval", "--by-position", "--checkpoint", "RUN", "--data", "DATA", "--split", "nosuch"], "nosuch"),
        (["train", "--data", "DATA", "--out", "NEW", "--recipe", "NOPE.yaml"], "NOPE.yaml"),
        (["train", "--data", "DATA", "--out", "NEW", "--set", "train.bogus=1"], "bogus"),
        (["prepare", "--fasta", "NOPE.fa", "--out", "NEW", "--window", "1k"], "NOPE.fa"),
        (["prepare", "--fasta", "CHRM", "--out", "NEW", "--window", "12q"], "12q"),
    ],
)
def test_user_errors_are_one_line_with_exit_2(pipeline, tmp_path, args, needle):
    subst = {
        "DATA": pipeline / "data",
        "RUN": pipeline / "run",
        "NEW": tmp_path / "new",
        "NOPE": tmp_path / "NOPE",
        "NOPE.yaml": tmp_path / "NOPE.yaml",
        "NOPE.fa": tmp_path / "NOPE.fa",
        "CHRM": REALDNA / "hg38_chrM.fa",
    }
    r = genoctx(*[subst.get(a, a) for a in args], check=False)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert needle in lines[0]
    assert r.stdout == ""
    assert not (tmp_path / "new").exists() or not any((tmp_path / "new").iterdir())


def _glm5_reference():
    """tests/model/glm5_reference.py: tiny random models built with transformers' own glm5_next."""
    sys.path.insert(0, str(REPO / "tests" / "model"))
    try:
        import glm5_reference
    finally:
        sys.path.pop(0)
    return glm5_reference


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """(an HF glm5_next model directory with the 8-token nucleotide vocabulary, the transformers model)."""
    ref = _glm5_reference()
    model = ref.build(ref.text_config(vocab_size=8))
    path = tmp_path_factory.mktemp("hf") / "glm5-tiny"
    ref.save(model, path)
    return path, model


def test_eval_reads_an_hf_model_directory(pipeline, hf_dir):
    """``eval --checkpoint DIR`` on an HF checkpoint scores what the transformers reference computes."""
    import torch

    from genoctx.data.dataset import WindowDataset, scored_mask
    from genoctx.data.tokenizer import BOS
    from genoctx.model.model import shift_inputs

    path, ref_model = hf_dir
    r = genoctx(
        "eval", "--by-position", "--checkpoint", path, "--data", pipeline / "data", "--max-windows", "1",
        "--bins", "linear:2", "--resamples", "0", "--format", "json",
    )  # fmt: skip
    doc = json.loads(r.stdout)
    assert doc["checkpoint"] == str(path) and doc["models"][0]["name"] == "glm5-tiny"
    # the same window through transformers' Glm5NextForConditionalGeneration
    tokens = WindowDataset(pipeline / "data", "eval")[0]["tokens"][None].long()
    scored = scored_mask(tokens)
    logits = _glm5_reference().logits(ref_model, shift_inputs(tokens, BOS))
    ce = torch.nn.functional.cross_entropy(logits[0], tokens[0], reduction="none")[scored[0]]
    assert doc["overall"]["tokens"] == int(scored.sum())
    assert doc["overall"]["loss"] == pytest.approx(float(ce.double().mean()), rel=1e-5)


def test_eval_refuses_a_text_vocabulary_without_a_tokenizer(pipeline, hf_dir, tmp_path):
    """A text vocabulary is read through the base's tokenizer.json (genoctx.model.vocab); without one: one line."""
    import shutil

    src, _ = hf_dir
    path = tmp_path / "text-vocab"
    shutil.copytree(src, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["vocab_size"] = 154880
    (path / "config.json").write_text(json.dumps(cfg))
    r = genoctx("eval", "--by-position", "--checkpoint", path, "--data", pipeline / "data", check=False)
    assert r.returncode == 2 and r.stdout == ""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"{path}/tokenizer.json: no tokenizer.json" in lines[0], r.stderr


def test_model_info_reads_an_hf_config(hf_dir, tmp_path):
    """``model info --hf DIR`` needs config.json only, and counts the parameters the checkpoint holds."""
    path, ref_model = hf_dir
    (tmp_path / "config.json").write_text((path / "config.json").read_text())  # no weights
    doc = json.loads(genoctx("model", "info", "--hf", tmp_path).stdout)
    assert doc["hf"] == str(tmp_path) and doc["preset"] is None
    assert doc["layers"] == "KKKD" and doc["kda_layers"] == 3 and doc["dsa_layers"] == 1
    assert doc["moe_layers"] == 3 and doc["dense_mlp_layers"] == 1
    assert doc["config"]["hidden_size"] == 32 and doc["config"]["vocab_size"] == 8
    text = sum(p.numel() for n, p in ref_model.named_parameters() if not n.startswith("model.visual."))
    assert doc["parameters"]["total"] == text
    per_expert = 3 * 32 * 16  # gate, up, down of one routed expert
    assert doc["parameters"]["active"] == text - 3 * (8 - 2) * per_expert  # 3 MoE layers, 6 of 8 experts unused


def test_model_info_glm_5_3_flash_counts():
    doc = json.loads(genoctx("model", "info", "--preset", "glm-5.3-flash").stdout)
    assert doc["preset"] == "glm-5.3-flash"
    assert doc["parameters"]["total_b"] == 313.3 and doc["parameters"]["active_b"] == 17.4
    assert round(doc["parameters"]["total"] / 1e9, 1) == 313.3 and round(doc["parameters"]["active"] / 1e9, 1) == 17.4
    assert doc["kda_layers"] == 34 and doc["dsa_layers"] == 11 and doc["moe_layers"] == 42
    assert doc["config"]["vocab_size"] == 154880 and doc["config"]["n_routed_experts"] == 288


@pytest.mark.parametrize(
    "args, needle",
    [
        (["model", "info", "--preset", "glm-flash-like"], "glm-flash-like"),
        (["model", "info", "--hf", "NOPE"], "NOPE"),
        (["model", "info", "--preset", "tiny", "--hf", "NOPE"], "--hf"),
    ],
)
def test_model_info_user_errors(tmp_path, args, needle):
    r = genoctx(*[str(tmp_path / a) if a == "NOPE" else a for a in args], check=False)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_help_lists_the_verbs():
    r = genoctx("--help")
    for verb in ("prepare", "train", "eval"):
        assert verb in r.stdout


@pytest.fixture
def fake_eval(monkeypatch, tmp_path):
    """``genoctx eval`` in-process with ``genoctx.eval.position.evaluate`` replaced by a recorder (no model, no
    scoring): returns ``run(*args) -> (result, keyword arguments evaluate got)``; --data is a folder with a
    manifest."""
    from typer.testing import CliRunner

    from genoctx.cli import app

    (tmp_path / "manifest.json").write_text("{}")
    calls = []
    monkeypatch.setattr("genoctx.eval.position.evaluate", lambda ckpts, data, **kw: calls.append(kw) or {"ok": 1})

    def run(*args):
        calls.clear()
        res = CliRunner().invoke(app, ["eval", "--data", str(tmp_path), "--markov", "2", "--format", "json", *args])
        return res, (calls[0] if calls else None)

    return run


def test_eval_without_a_mode_scores_by_position(fake_eval):
    """--by-position is eval's default mode: leaving it out scores the same way (it was required and selected
    nothing); the flag is still accepted."""
    res, kw = fake_eval()
    assert res.exit_code == 0 and json.loads(res.stdout) == {"ok": 1}, res.output
    res2, kw2 = fake_eval("--by-position")
    assert res2.exit_code == 0 and kw2 == kw and not kw["copy_probe"]


def test_eval_old_flag_names_are_aliases(fake_eval, monkeypatch):
    """One name per idea: --seq-chunk (as train's and plan's) with the old --chunk-tokens, --gpu-memory-gib (as
    plan's) with the old --memory-gib, and --ep-folded/--no-ep-folded (as train's): old and new give evaluate the
    same arguments; both names at once, or a bad value, is one line naming the flag typed."""
    monkeypatch.setattr("genoctx.cluster.check_local", lambda *a: 0)
    _, new = fake_eval("--seq-chunk", "4k")
    _, old = fake_eval("--chunk-tokens", "4k")
    assert new["chunk_tokens"] == old["chunk_tokens"] == 4096
    mesh = ["--num-workers", "4", "--ep", "2", "--cp", "2"]
    _, new = fake_eval(*mesh, "--gpu-memory-gib", "3.5", "--ep-folded")
    _, old = fake_eval(*mesh, "--memory-gib", "3.5", "--ep-folded")
    assert new["mesh"] == old["mesh"] and new["mesh"].memory_gib == 3.5 and new["mesh"].ep_folded
    _, off = fake_eval(*mesh, "--no-ep-folded")
    assert off["mesh"].ep_folded is False and off["mesh"].memory_gib is None
    bad = [(["--seq-chunk", "4k", "--chunk-tokens", "4k"], "--chunk-tokens is the old name of --seq-chunk"),
           (["--chunk-tokens", "0"], "--chunk-tokens:"), (["--seq-chunk", "0"], "--seq-chunk:"),
           (["--memory-gib", "2"], "--memory-gib needs --num-workers"),
           ([*mesh, "--gpu-memory-gib", "-1"], "--gpu-memory-gib: must be a positive number")]  # fmt: skip
    for args, needle in bad:
        res, kw = fake_eval(*args)
        assert res.exit_code == 2 and kw is None and res.stdout == "", res.output
        assert res.stderr.startswith(f"genoctx: error: {needle}"), res.stderr
        assert res.stderr.count("\n") == 1


def test_train_ep_folded_and_cp_layout_flags(monkeypatch, tmp_path):
    """train takes --cp-layout as eval and plan do (= train.cp_layout), and --no-ep-folded; both reach the recipe."""
    from typer.testing import CliRunner

    from genoctx.cli import app

    (tmp_path / "manifest.json").write_text("{}")
    got = []
    monkeypatch.setattr("genoctx.train.loop.train", lambda data, rec, out, **kw: got.append(rec) or {"steps": 0})
    args = ["train", "--data", str(tmp_path), "--out", str(tmp_path / "run"), "--recipe", "recipes/tiny.yaml"]
    res = CliRunner().invoke(app, [*args, "--cp-layout", "zigzag", "--no-ep-folded"])
    assert res.exit_code == 0, res.output
    assert got[0].train.cp_layout == "zigzag" and got[0].train.ep_folded is False
    res = CliRunner().invoke(app, [*args, "--cp-layout", "diagonal"])
    assert res.exit_code == 2 and "--cp-layout must be contiguous or zigzag" in res.stderr
