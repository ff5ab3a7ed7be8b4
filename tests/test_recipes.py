from pathlib import Path

import pytest

from genoctx.errors import GenoctxError
from genoctx.model.config import PRESETS
from genoctx.recipes import load_recipe

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads(path):
    r = load_recipe(path)
    assert r.preset in PRESETS
    assert r.train.steps >= 0
    # the resolved recipe round-trips through its dict form
    from genoctx.recipes import recipe_from_dict

    assert recipe_from_dict(r.to_dict()) == r


def test_set_overrides_typed_values():
    r = load_recipe(RECIPES[0], ["train.lr=1e-4", "model.index_topk=64", "train.seq_len=null"])
    assert r.train.lr == pytest.approx(1e-4)
    assert r.model.index_topk == 64
    assert r.train.seq_len is None


@pytest.mark.parametrize("bad", ["train.nope=1", "lr=1", "optim.lr=1", "model.layer_pattern=KXD"])
def test_bad_overrides_are_user_errors(bad):
    with pytest.raises(GenoctxError):
        load_recipe(RECIPES[0], [bad])


def test_missing_recipe_names_the_file(tmp_path):
    with pytest.raises(GenoctxError, match="nope.yaml"):
        load_recipe(tmp_path / "nope.yaml")
