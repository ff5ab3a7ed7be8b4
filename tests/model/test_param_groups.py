"""``train.trainable``'s groups (genoctx.model.groups): every parameter in exactly one, by name and layer kind."""

import pytest

from genoctx.model.config import preset
from genoctx.model.groups import GROUPS, group_of, parse_trainable
from genoctx.model.model import HybridLM


@pytest.mark.parametrize("name", ["tiny", "cpu-small"])
def test_every_parameter_is_in_one_group_and_every_group_is_used(name):
    cfg = preset(name)
    model = HybridLM(cfg, seed=0)
    counts = {}
    for n, p in model.named_parameters():
        g = group_of(n, cfg.layer_types)
        counts[g] = counts.get(g, 0) + p.numel()
    assert set(counts) == set(GROUPS)
    assert sum(counts.values()) == sum(p.numel() for p in model.parameters())


def test_names_map_as_documented():
    kinds = ["linear_attention", "indexed_attention"]
    assert group_of("layers.0.self_attn.q_proj.weight", kinds) == "kda"
    assert group_of("layers.1.self_attn.q_a_proj.weight", kinds) == "dsa"
    assert group_of("layers.1.self_attn.indexer.wk.weight", kinds) == "indexer"
    assert group_of("layers.1.self_attn.indexer.k_norm.bias", kinds) == "norms"
    assert group_of("layers.0.self_attn.o_norm.weight", kinds) == "norms"
    assert group_of("layers.1.mlp.gate.weight", kinds) == "router"
    assert group_of("layers.0.mlp.gate_proj.weight", kinds) == "dense_mlp"
    assert group_of("layers.1.mlp.experts.gate_up_proj", kinds) == "experts"
    assert group_of("layers.1.mlp.shared_experts.up_proj.weight", kinds) == "shared_experts"
    assert group_of("layers.1._checkpoint_wrapped_module.ffn_hc.fn", kinds) == "mhc"
    assert group_of("norm.weight", kinds) == "norms"
    assert (group_of("embed_tokens.weight", kinds), group_of("lm_head.weight", kinds)) == ("embed", "head")
    with pytest.raises(ValueError, match="no trainable group"):
        group_of("layers.0.adapter.weight", kinds)


def test_parse_trainable():
    assert parse_trainable("all") == GROUPS
    assert parse_trainable(" lora , embed,norms") == ("norms", "embed", "lora")
    assert parse_trainable("lora") == ("lora",)
    for bad, msg in (("", "empty"), ("kda,attention", "'attention' is not a group"), ("kda,kda", "twice")):
        with pytest.raises(ValueError, match=msg):
            parse_trainable(bad)
