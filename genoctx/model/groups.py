"""The named parameter groups of ``train.trainable`` (issue 44): which tensors of GLM-5.3-Flash a group holds.

A group is a name a researcher picks to train (``train.trainable: kda,dsa,indexer,router,mhc,norms``); every
parameter of ``HybridLM`` belongs to exactly one group, decided from its name (``model.named_parameters()``, FSDP2
and DTensor keep the names) and the kind of its layer (``cfg.layer_types``: a ``self_attn`` of a KDA layer is
``kda``, of a DSA layer ``dsa``). The first rule that matches wins, in this order:

=================  ====================================================================================
group              parameters
=================  ====================================================================================
``norms``          every normalisation weight and bias: ``input_layernorm``, ``post_attention_layernorm``,
                   the final ``norm``, the mixers' ``q_a_layernorm``, ``kv_a_layernorm``, ``o_norm`` and the
                   indexer's ``k_norm`` (LongLoRA trains these with the embeddings for context extension)
``embed``          ``embed_tokens``
``head``           ``lm_head``
``mhc``            the residual-stream mixings ``attn_hc``, ``ffn_hc`` (``fn``, ``base``, ``scale``)
``indexer``        a DSA layer's lightning indexer (``self_attn.indexer``: ``wq_b``, ``wk``, ``weights_proj``, the
                   KPool compression), its ``k_norm`` excepted (``norms``)
``kda``            the rest of a KDA layer's ``self_attn`` (projections, short convolution, forget gate, gates)
``dsa``            the rest of a DSA layer's ``self_attn`` (the MLA projections)
``router``         an MoE layer's ``mlp.gate`` (its score-correction bias is a buffer, not trained by gradient)
``experts``        the routed experts ``mlp.experts`` (``gate_up_proj``, ``down_proj``: [E, ...] each)
``shared_experts`` ``mlp.shared_experts``
``dense_mlp``      a dense layer's ``mlp`` (``gate_proj``, ``up_proj``, ``down_proj``)
=================  ====================================================================================

``lora`` is not a group of the base's parameters: it names the adapters (``genoctx.model.lora``) and is accepted
by ``parse_trainable`` beside the groups.
"""

from __future__ import annotations

import re

GROUPS = ("kda", "dsa", "indexer", "router", "experts", "shared_experts", "dense_mlp", "mhc", "norms", "embed", "head")
LORA = "lora"

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.*)$")


def group_of(name: str, layer_types: list[str] | tuple[str, ...]) -> str:
    """The group of parameter ``name`` (as ``HybridLM.named_parameters()`` gives it; FSDP2/DTensor names are the
    same, a ``_checkpoint_wrapped_module.`` or ``_orig_mod.`` infix is ignored).

    Args:
        name: the parameter's dotted name, e.g. ``"layers.3.self_attn.indexer.wk.weight"``.
        layer_types: ``cfg.layer_types`` (``"linear_attention"`` for KDA, anything else a DSA layer), to tell a
            KDA mixer from a DSA one.

    Returns:
        One of ``GROUPS``.

    Raises:
        ValueError: a name no rule matches (a parameter this map does not know: the map must be extended).
    """
    name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
    if "norm." in name:  # every norm module's name ends in "norm" (input_layernorm, o_norm, k_norm, norm)
        return "norms"
    if name.startswith("embed_tokens."):
        return "embed"
    if name.startswith("lm_head."):
        return "head"
    m = _LAYER.search(name)
    if m is None:
        raise ValueError(f"parameter {name!r}: no trainable group holds it (genoctx.model.groups)")
    i, rest = int(m.group(1)), m.group(2)
    if rest.startswith(("attn_hc.", "ffn_hc.")):
        return "mhc"
    if rest.startswith("self_attn.indexer."):
        return "indexer"
    if rest.startswith("self_attn."):
        return "kda" if layer_types[i] == "linear_attention" else "dsa"
    if rest.startswith("mlp.gate.") and rest.count(".") == 2:
        return "router"
    if rest.startswith("mlp.experts."):
        return "experts"
    if rest.startswith("mlp.shared_experts."):
        return "shared_experts"
    if rest.startswith("mlp."):
        return "dense_mlp"
    raise ValueError(f"parameter {name!r}: no trainable group holds it (genoctx.model.groups)")


def parse_trainable(spec: str) -> tuple[str, ...]:
    """``train.trainable`` -> the groups it names, in ``GROUPS`` order with ``lora`` last.

    Args:
        spec: ``"all"``, or a comma list of ``GROUPS`` names and ``lora`` (``"lora,embed,norms"``: LongLoRA's
            choice). Spaces around names are ignored.

    Returns:
        ``GROUPS`` for ``"all"``; else the named ones (``"lora"`` alone: ``("lora",)``).

    Raises:
        ValueError: an empty list, an unknown name (the message lists the known ones) or a name given twice.
    """
    spec = spec.strip()
    if spec == "all":
        return GROUPS
    names = [s.strip() for s in spec.split(",")]
    known = (*GROUPS, LORA)
    bad = [n for n in names if n not in known]
    if not spec or bad:
        what = f"{', '.join(map(repr, bad))} is not a group" if spec else "empty"
        raise ValueError(f"train.trainable {spec!r}: {what}; 'all' or a comma list of {', '.join(known)}")
    if len(set(names)) != len(names):
        raise ValueError(f"train.trainable {spec!r}: a group is named twice")
    return tuple(n for n in known if n in names)
