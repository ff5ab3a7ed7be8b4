"""Bad input on the command line, anywhere: one line on stderr that names the flag (or the recipe key and where it
came from) and the value, exit code 2, no traceback, no partial output. In-process through typer's CliRunner."""

import json
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from genoctx.cli import app

REPO = Path(__file__).resolve().parents[1]
REALDNA = REPO / "data" / "hg38"
CHRM = REALDNA / "hg38_chrM.fa"
TINY = REPO / "recipes" / "tiny.yaml"
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING) ")  # genoctx's log lines in a pipe


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def error_line(res) -> str:
    """The one error line of a user error (exit 2, nothing on stdout, no traceback); returns it."""
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code == 2, (res.exit_code, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("genoctx: error: "), res.stderr
    assert res.stdout == "", res.stdout
    return lines[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """train = chrM (windows of 512), eval = the first 2 kb of the chr22 piece."""
    from genoctx.data.windows import prepare

    root = tmp_path_factory.mktemp("inputs")
    lines = (REALDNA / "hg38_chr22_32000001-32300000.fa").read_text().splitlines()
    fa = root / "chr22.fa"
    fa.write_text("\n".join([">chr22", "".join(lines[1:])[:2048]]) + "\n")
    out = root / "data"
    prepare([CHRM, fa], out, window=512, train_chroms=["chrM"], eval_chroms=["chr22"], progress=False)
    return out


def markov_eval(data, *more):
    return invoke("eval", "--by-position", "--markov", "2", "--data", data, "--resamples", "0", "--max-windows", "1",
                  *more)  # fmt: skip


# ---------------------------------------------------------------- 1, 4: --stop-after, --steps, train.steps


def test_stop_after_must_be_at_least_1(data, tmp_path):
    line = error_line(invoke("train", "--data", data, "--out", tmp_path / "run", "--recipe", TINY,
                             "--stop-after", "-1"))  # fmt: skip
    assert line == "genoctx: error: --stop-after: must be >= 1, got -1"
    assert not (tmp_path / "run").exists()


def test_steps_must_be_at_least_0(data, tmp_path):
    line = error_line(invoke("train", "--data", data, "--out", tmp_path / "run", "--recipe", TINY, "--steps", "-1"))
    assert line == "genoctx: error: --steps: must be >= 0, got -1"
    assert not (tmp_path / "run").exists()


def test_recipe_steps_names_the_key_and_the_file(data, tmp_path):
    recipe = tmp_path / "neg.yaml"
    recipe.write_text("model:\n  preset: tiny\ntrain:\n  steps: -1\n")
    line = error_line(invoke("train", "--data", data, "--out", tmp_path / "run", "--recipe", recipe))
    assert line == f"genoctx: error: {recipe}: train.steps must be >= 0, got -1"
    line = error_line(invoke("train", "--data", data, "--out", tmp_path / "run", "--recipe", TINY,
                             "--set", "train.steps=-1"))  # fmt: skip
    assert line == "genoctx: error: --set train.steps=-1: train.steps must be >= 0, got -1"


# ---------------------------------------------------------------- 2, 3: size flags, window and stride limits


@pytest.mark.parametrize(
    "args, flag",
    [
        (["prepare", "--fasta", CHRM, "--out", "NEW", "--window", "0"], "--window"),
        (["prepare", "--fasta", CHRM, "--out", "NEW", "--window", "1k", "--stride", "0"], "--stride"),
        (["eval", "--by-position", "--markov", "2", "--data", "DATA", "--chunk-tokens", "0"], "--chunk-tokens"),
        (["model", "info", "--preset", "tiny", "--seq-len", "0"], "--seq-len"),
    ],
)
def test_size_flags_name_the_flag(data, tmp_path, args, flag):
    subst = {"NEW": tmp_path / "new", "DATA": data}
    line = error_line(invoke(*[subst.get(a, a) for a in args]))
    assert line == f"genoctx: error: {flag}: invalid size '0': must be positive"
    assert not (tmp_path / "new").exists()


def test_window_is_at_least_64_bases(tmp_path):
    line = error_line(invoke("prepare", "--fasta", CHRM, "--out", tmp_path / "new", "--window", "3"))
    assert line.startswith("genoctx: error: --window: '3' is 3 bases, less than the minimum of 64")
    assert not (tmp_path / "new").exists()
    res = invoke("prepare", "--fasta", CHRM, "--out", tmp_path / "ok", "--window", "64", "--chroms", "chrM")
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["window"] == 64


def test_stride_is_at_most_the_window(tmp_path):
    line = error_line(invoke("prepare", "--fasta", CHRM, "--out", tmp_path / "new", "--window", "1k",
                             "--stride", "4k"))  # fmt: skip
    assert line.startswith("genoctx: error: --stride: '4k' is 4096 bases, more than the maximum of 1024")
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------- 5: --set blames --set, the file blames the file


def test_set_typo_names_set_and_suggests_the_key(data, tmp_path):
    line = error_line(invoke("train", "--data", data, "--out", tmp_path / "run", "--recipe", TINY,
                             "--set", "train.seq_lenn=5"))  # fmt: skip
    assert line == "genoctx: error: --set train.seq_lenn=5: unknown key train.seq_lenn (did you mean train.seq_len?)"


def test_set_bad_value_names_set(data, tmp_path):
    line = error_line(invoke("train", "--data", data, "--out", tmp_path / "run", "--recipe", TINY,
                             "--set", "train.lr=abc"))  # fmt: skip
    assert line == "genoctx: error: --set train.lr=abc: train.lr must be a number, got 'abc'"


def test_recipe_typo_names_the_file(data, tmp_path):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("model:\n  preset: tiny\ntrain:\n  seq_lenn: 5\n")
    line = error_line(invoke("train", "--data", data, "--out", tmp_path / "run", "--recipe", recipe,
                             "--set", "train.lr=1e-3"))  # fmt: skip
    assert line == f"genoctx: error: {recipe}: unknown key train.seq_lenn (did you mean train.seq_len?)"


# ---------------------------------------------------------------- 6: --data DIR/manifest.json, missing --data


def test_data_may_be_the_manifest_file(data):
    by_dir = markov_eval(data, "--format", "json")
    by_file = markov_eval(data / "manifest.json", "--format", "json")
    assert by_dir.exit_code == 0 and by_file.exit_code == 0, by_file.stderr
    assert json.loads(by_file.stdout)["overall"] == json.loads(by_dir.stdout)["overall"]


def test_train_data_may_be_the_manifest_file(data, tmp_path):
    res = invoke("train", "--data", data / "manifest.json", "--out", tmp_path / "run", "--recipe", TINY,
                 "--steps", "0")  # fmt: skip
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["steps"] == 0


@pytest.mark.parametrize("verb", ["eval", "train"])
def test_data_missing_or_without_manifest_names_data(tmp_path, verb):
    (tmp_path / "empty").mkdir()
    for path, why in ((tmp_path / "nope", "no such directory"), (tmp_path / "empty", "no manifest.json")):
        if verb == "eval":
            res = markov_eval(path)
        else:
            res = invoke("train", "--data", path, "--out", tmp_path / "run", "--recipe", TINY, "--steps", "0")
        assert error_line(res).startswith(f"genoctx: error: --data {path}: {why}")


# ---------------------------------------------------------------- 7: --plot checked before scoring, result first


def test_plot_under_a_file_fails_before_scoring(data, tmp_path):
    (tmp_path / "afile").write_text("x")
    line = error_line(markov_eval(data, "--plot", tmp_path / "afile" / "sub" / "o.png"))
    assert line.startswith(f"genoctx: error: --plot {tmp_path / 'afile' / 'sub' / 'o.png'}: ")
    assert "not a directory" in line


def test_plot_suffix_matplotlib_cannot_write(data, tmp_path):
    line = error_line(markov_eval(data, "--plot", tmp_path / "o.xyz"))
    assert line.startswith(f"genoctx: error: --plot {tmp_path / 'o.xyz'}: cannot write .xyz images")
    assert not (tmp_path / "o.xyz").exists()


def test_plot_folder_is_created(data, tmp_path):
    res = markov_eval(data, "--plot", tmp_path / "a" / "b" / "o.svg")
    assert res.exit_code == 0, res.stderr
    assert (tmp_path / "a" / "b" / "o.svg").read_text().lstrip().startswith("<?xml")


def test_failed_eval_leaves_no_plot_folder(data, tmp_path):
    error_line(markov_eval(data, "--split", "nosuch", "--plot", tmp_path / "a" / "b" / "o.png"))
    assert not (tmp_path / "a").exists()


def test_result_is_out_before_the_plot_fails(data, tmp_path, monkeypatch):
    import matplotlib.figure

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    res = markov_eval(data, "--format", "json", "--plot", tmp_path / "o.png")
    assert res.exit_code == 2 and "Traceback" not in res.stderr
    assert json.loads(res.stdout)["overall"]["tokens"] > 0  # the result is out
    errors = [ln for ln in res.stderr.splitlines() if ln.strip() and not LOG_LINE.match(ln)]
    assert errors == [f"genoctx: error: --plot {tmp_path / 'o.png'}: cannot write: No space left on device"]
    assert not list(tmp_path.iterdir())  # no partial image


def test_prepare_verify_takes_the_manifest_file(data):
    res = invoke("prepare", "--verify", data / "manifest.json")
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["ok"] is True


def test_damaged_manifest_entry_is_named(data, tmp_path):
    d = tmp_path / "d"
    shutil.copytree(data, d)
    m = json.loads((d / "manifest.json").read_text())
    m["windows"][0]["offset"] = "zero"
    (d / "manifest.json").write_text(json.dumps(m))
    for res in (markov_eval(d), invoke("prepare", "--verify", d)):
        line = error_line(res)
        assert line == f"genoctx: error: {d / 'manifest.json'}: windows[0].offset must be an integer >= 0, got 'zero'"


# ---------------------------------------------------------------- more flags: --out, click's own usage errors


@pytest.mark.parametrize("verb", ["prepare", "train"])
def test_out_that_is_a_file_names_out(data, tmp_path, verb):
    (tmp_path / "afile").write_text("x")
    if verb == "prepare":
        res = invoke("prepare", "--fasta", CHRM, "--out", tmp_path / "afile", "--window", "1k")
    else:
        res = invoke("train", "--data", data, "--out", tmp_path / "afile", "--recipe", TINY, "--steps", "0")
    assert error_line(res) == f"genoctx: error: --out {tmp_path / 'afile'}: is a file; give a directory"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["train", "--data", "DATA", "--out", "NEW", "--steps", "abc"], "'--steps'"),
        (["train", "--out", "NEW"], "'--data'"),
        (["trian"], "'trian'"),
        (["eval", "--by-position", "--data", "DATA", "--bogus"], "--bogus"),
    ],
)
def test_usage_errors_are_one_line(data, tmp_path, args, needle):
    res = invoke(*[{"DATA": data, "NEW": tmp_path / "new"}.get(a, a) for a in args])
    assert needle in error_line(res)


def test_control_characters_in_a_value_stay_on_one_line(data, tmp_path):
    line = error_line(invoke("train", "--data", data, "--out", tmp_path / "r", "--set", "train.lr=a\nb\x1dc\x85"))
    assert line == "genoctx: error: --set train.lr=a\\nb\\x1dc\\x85: train.lr must be a number, got 'a\\nb\\x1dc\\x85'"


@pytest.mark.parametrize(
    "item, message",
    [  # each one crashed inside torch (IndexError at the embedding, RuntimeError in normal_) before
        ("model.vocab_size=3", "model.vocab_size must be >= 8 (the nucleotide tokens A, C, G, T, N, <pad>, <bos>, "
         "<eos>), got 3"),
        ("model.initializer_range=-1", "model.initializer_range must be >= 0, got -1.0"),
    ],
)  # fmt: skip
def test_model_values_that_crash_torch_are_user_errors(data, tmp_path, item, message):
    res = invoke("train", "--data", data, "--out", tmp_path / "r", "--recipe", TINY, "--steps", "1", "--set", item)
    assert error_line(res) == f"genoctx: error: --set {item}: {message}"
