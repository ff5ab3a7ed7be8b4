"""Fixtures shared by tests/train/ (the repository-wide ones are tests/conftest.py)."""

import pytest


@pytest.fixture(scope="module")
def hf_base(prepared, tmp_path_factory):
    """An HF base: tiny's initial model (a steps=0 run) exported by ``genoctx export`` (the base of the partial
    checkpoints' tests, one process and mesh)."""
    from typer.testing import CliRunner

    from genoctx.cli import app
    from genoctx.recipes import load_recipe
    from genoctx.train.loop import train

    tmp = tmp_path_factory.mktemp("hf-base")
    train(prepared, load_recipe("recipes/tiny.yaml", ["train.steps=0", "train.seq_len=256"]), tmp / "scratch")
    res = CliRunner().invoke(app, ["export", str(tmp / "scratch"), "--out", str(tmp / "hf")])
    assert res.exit_code == 0, res.stderr
    return tmp / "hf"
