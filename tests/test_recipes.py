from pathlib import Path

import pytest

from genoctx.errors import GenoctxError
from genoctx.model.config import PRESETS
from genoctx.recipes import load_recipe, recipe_from_dict

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads(path):
    r = load_recipe(path)
    assert r.preset in PRESETS or r.init is not None  # a preset, or a pretrained base (model.init)
    assert r.train.steps >= 0
    # the resolved recipe round-trips through its dict form
    from genoctx.recipes import recipe_from_dict

    assert recipe_from_dict(r.to_dict()) == r


def test_set_overrides_typed_values():
    r = load_recipe(RECIPES[0], ["train.lr=1e-4", "model.index_topk=64", "train.seq_len=null"])
    assert r.train.lr == pytest.approx(1e-4)
    assert r.model.index_topk == 64
    assert r.train.seq_len is None


def test_layer_types_as_letters():
    """``--set model.layer_types=KDKD`` (K = KDA, D = DSA) gives the glm5_next list; it round-trips."""
    from genoctx.model.config import DSA, KDA
    from genoctx.recipes import recipe_from_dict

    r = load_recipe(RECIPES[0], ["model.layer_types=KDKD", "model.mlp_layer_types=DSSS"])
    assert r.preset == "cpu-small"
    assert r.model.layer_types == [KDA, DSA, KDA, DSA]
    assert r.model.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    assert recipe_from_dict(r.to_dict()) == r


def test_big_recipes_post_train_glm_5_3_flash():
    """The published experiment: from zai-org/GLM-5.3-Flash (its config.json fixes the architecture: the
    glm-5.3-flash preset is that architecture), 80 steps, full-vocabulary loss in chunks."""
    assert PRESETS["glm-5.3-flash"].num_hidden_layers == 45 and PRESETS["glm-5.3-flash"].n_routed_experts == 288
    for name in ("hg38-512k.yaml", "hg38-1m.yaml"):
        r = load_recipe(RECIPES[0].parent / name)
        assert r.init == "zai-org/GLM-5.3-Flash" and r.preset is None and r.model_knobs == {}
        assert (r.train.steps, r.loss.vocab, r.loss.chunk_tokens, r.train.dtype) == (80, "full", 2048, "bf16")
        assert recipe_from_dict(r.to_dict()) == r


@pytest.mark.parametrize(
    "bad", ["train.nope=1", "lr=1", "optim.lr=1", "model.layer_types=KXD", "model.layer_types=KKD", "model.d_model=64"]
)
def test_bad_overrides_are_user_errors(bad):
    with pytest.raises(GenoctxError):
        load_recipe(RECIPES[0], [bad])


def test_missing_recipe_names_the_file(tmp_path):
    with pytest.raises(GenoctxError, match="nope.yaml"):
        load_recipe(tmp_path / "nope.yaml")
