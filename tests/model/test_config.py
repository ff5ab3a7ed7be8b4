"""ModelConfig: the glm5_next field names, config.json in and out (against transformers' Glm5NextTextConfig), the
presets and the checks on bad values."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import Glm5NextConfig, Glm5NextTextConfig

from genoctx.model.config import DSA, KDA, PRESETS, ModelConfig, preset, reference_defaults

ARCH = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in ModelConfig._runtime]

TINY = dict(
    vocab_size=16, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=5,
    num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
    kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, v_head_dim=12, index_topk=32, index_head_dim=8,
    index_n_heads=4, linear_head_dim=8, linear_num_heads=2, hc_mult=3, index_kpool=8, n_group=4, topk_group=2,
    routed_scaling_factor=1.5, norm_topk_prob=False, swiglu_limit=7.0, linear_conv_kernel_dim=3,
    linear_lower_bound=None, hc_eps=1e-5, hc_sinkhorn_iters=7, index_kpool_always_select_tail=False,
    rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=None, attention_bias=True,
    layer_types=[KDA, DSA, DSA, KDA, DSA], indexer_types=["full", "full", "shared", "full", "full"],
    mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse"],
)  # fmt: skip


def _arch(cfg: ModelConfig) -> dict:
    return {k: getattr(cfg, k) for k in ARCH}


@pytest.mark.parametrize("kw", [{}, TINY], ids=["published", "tiny"])
def test_from_hf_dict_of_transformers_config(kw):
    """``ModelConfig.from_hf_dict(Glm5NextTextConfig(...).to_dict())`` has every architecture field of the
    transformers config (the published defaults, and a tiny config that changes every field)."""
    hf = Glm5NextTextConfig(**kw)
    cfg = ModelConfig.from_hf_dict(hf.to_dict())
    for name in ARCH:
        assert getattr(cfg, name) == getattr(hf, name), name
    # the VL form (text_config inside) reads the same text model
    vl = Glm5NextConfig(text_config=kw or None, tie_word_embeddings=cfg.tie_word_embeddings).to_dict()
    assert _arch(ModelConfig.from_hf_dict(vl)) == _arch(cfg)


@pytest.mark.parametrize("name", ["tiny", "cpu-small", "glm-5.3-flash"])
def test_to_hf_dict_reads_back_in_transformers_and_genoctx(name):
    """``to_hf_dict()`` is a config transformers' ``Glm5NextTextConfig(**d)`` accepts, with the same architecture,
    and ``from_hf_dict`` gives back the same config (compute knobs are not part of it)."""
    cfg = preset(name)
    d = cfg.to_hf_dict()
    assert d["model_type"] == "glm5_next_text" and not set(d) & set(ModelConfig._runtime)
    hf = Glm5NextTextConfig(**d)
    for k in ARCH:
        assert getattr(hf, k) == getattr(cfg, k), k
    back = ModelConfig.from_hf_dict(d, kda_chunk_size=cfg.kda_chunk_size, moe_chunk_tokens=cfg.moe_chunk_tokens,
                                    indexer_tile_tokens=cfg.indexer_tile_tokens,
                                    kda_block_tokens=cfg.kda_block_tokens)  # fmt: skip
    assert back == cfg


def test_published_preset_is_the_reference_default():
    hf = Glm5NextTextConfig()
    assert reference_defaults() == {k: getattr(hf, k) for k in reference_defaults()}
    assert _arch(PRESETS["glm-5.3-flash"]) == _arch(ModelConfig.from_hf_dict(hf.to_dict()))
    cfg = PRESETS["glm-5.3-flash"]
    assert cfg.layer_types.count(KDA) == 34 and [i for i, t in enumerate(cfg.layer_types) if t == DSA][:2] == [3, 7]
    assert cfg.mlp_layer_types[:4] == ["dense"] * 3 + ["sparse"]


def test_reference_aliases():
    """The aliases transformers' config accepts: ``linear_attn_config``, ``index_topk_pattern``, the
    ``index_topk_freq`` / ``index_skip_topk_offset`` schedule, ``num_local_experts``, ``full_attention``."""
    kinds = ["linear_attention", "full_attention", "full_attention", "linear_attention"]
    base = dict(num_hidden_layers=4, layer_types=kinds)
    la = {"head_dim": 16, "num_heads": 3, "short_conv_kernel_size": 2, "gate_lower_bound": None, "safe_gate": True}
    cfg = ModelConfig.from_hf_dict({**base, "linear_attn_config": la, "index_topk_pattern": "FFSF"})
    hf = Glm5NextTextConfig(**base, linear_attn_config=la, index_topk_pattern="FFSF")
    for k in ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "linear_lower_bound", "indexer_types",
              "layer_types"):  # fmt: skip
        assert getattr(cfg, k) == getattr(hf, k), k
    assert cfg.linear_lower_bound == -5.0 and cfg.layer_types == [KDA, DSA, DSA, KDA]
    assert cfg.indexer_types == ["full", "full", "shared", "full"]
    sched = dict(num_hidden_layers=6, index_topk_freq=2, index_skip_topk_offset=2)
    assert ModelConfig.from_hf_dict(sched).indexer_types == Glm5NextTextConfig(**sched).indexer_types
    assert ModelConfig.from_hf_dict({"num_local_experts": 16}).n_routed_experts == 16


def test_letter_strings():
    cfg = ModelConfig(num_hidden_layers=4, layer_types="KDDK", mlp_layer_types="DSSS", indexer_types="FFSF")
    assert cfg.layer_types == [KDA, DSA, DSA, KDA]
    assert cfg.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    assert cfg.indexer_types == ["full", "full", "shared", "full"]
    with pytest.raises(ValueError, match="layer_types: letters must be K/D"):
        ModelConfig(num_hidden_layers=4, layer_types="KKKX")


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(num_hidden_layers=4, layer_types="KDKD", indexer_types="FFFS"), "indexer_types"),  # after a KDA layer
        (dict(num_hidden_layers=4, layer_types="DDDK", indexer_types="SFFF"), "indexer_types"),  # first layer
        (dict(num_hidden_layers=4, layer_types="KDDD", indexer_types="FFSS"), "indexer_types"),  # after a shared one
        (dict(qk_rope_head_dim=64), "qk_rope_head_dim"),
        (dict(index_topk=20, index_kpool=16), "index_topk"),
        (dict(num_key_value_heads=1), "num_key_value_heads"),
        (dict(num_hidden_layers=4, layer_types="KKD"), "layer_types"),
        (dict(num_hidden_layers=4, mlp_layer_types=["dense", "moe", "dense", "dense"]), "mlp_layer_types"),
        (dict(num_experts_per_tok=9, n_routed_experts=8), "num_experts_per_tok"),
        (dict(n_group=3, n_routed_experts=8), "n_group"),
        (dict(kda_chunk_size=0), "kda_chunk_size"),
        (dict(dsa_mode="auto"), "dsa_mode"),
    ],
)
def test_bad_config_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**kw)


def test_hf_dict_errors():
    with pytest.raises(ValueError, match="model_type 'llama'"):
        ModelConfig.from_hf_dict({"model_type": "llama", "hidden_size": 32})
    with pytest.raises(ValueError, match="model_type 'llava'"):
        ModelConfig.from_hf_dict({"model_type": "llava", "text_config": {"hidden_size": 32}})
    with pytest.raises(ValueError, match="unknown glm5_next keys \\['sliding_window'\\]"):
        ModelConfig.from_hf_dict({"model_type": "glm5_next_text", "sliding_window": 128})
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        ModelConfig.from_hf_dict({"qk_rope_head_dim": 64})


def test_presets_and_recipe_dicts():
    cfg = preset("tiny", num_hidden_layers=6)
    assert len(cfg.layer_types) == len(cfg.mlp_layer_types) == len(cfg.indexer_types) == 6  # lists re-derived
    assert cfg.layer_types == Glm5NextTextConfig(num_hidden_layers=6).layer_types
    assert preset("tiny").num_hidden_layers == 2  # the preset itself is untouched
    with pytest.raises(KeyError, match="cpu-small"):
        preset("nope")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown model config keys: \\['d_model'\\]"):
        ModelConfig.from_dict({"d_model": 32})
    assert cfg.qk_head_dim == cfg.qk_nope_head_dim
