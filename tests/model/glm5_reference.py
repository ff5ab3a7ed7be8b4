"""The oracle: tiny random GLM-5.3-Flash models built with transformers' own ``glm5_next`` implementation.

transformers 5.23.0 binds fla's Triton kernels into ``modeling_glm5_next`` when fla is importable (fla is a dev
dependency of genoctx); Triton has no CPU driver, so ``reference_modules()`` points the module back at its own
PyTorch fallbacks (``chunk_kimi_delta_attention`` & co.), the code the reference runs without fla.
"""

from __future__ import annotations

import contextlib
import logging

import torch

_PATCHED = False


def reference_modules():
    """``(Glm5NextConfig, Glm5NextForConditionalGeneration)`` with the reference's PyTorch KDA/conv paths."""
    global _PATCHED
    import transformers.models.glm5_next.modeling_glm5_next as M
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    if not _PATCHED:
        for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
                     "causal_conv1d_update"):  # fmt: skip
            f = getattr(M, name)
            while hasattr(f, "__wrapped__"):
                f = f.__wrapped__
            setattr(M, name, f)
        _PATCHED = True
    return Glm5NextConfig, Glm5NextForConditionalGeneration


def text_config(**overrides) -> dict:
    """A tiny glm5_next text config: 4 layers K K K D (dense first layer, then MoE), 8 experts."""
    cfg = dict(
        vocab_size=16, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, v_head_dim=12, index_topk=16, index_head_dim=8,
        index_n_heads=8, linear_head_dim=8, linear_num_heads=2, hc_mult=3, index_kpool=4, pad_token_id=None,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        layer_types=["linear_attention"] * 3 + ["indexed_attention"],
    )  # fmt: skip
    cfg.update(overrides)
    if "num_hidden_layers" in overrides:
        n = cfg["num_hidden_layers"]
        for k in ("mlp_layer_types", "layer_types", "indexer_types"):
            if k not in overrides and k in cfg:
                cfg[k] = cfg[k][:n] + cfg[k][-1:] * (n - len(cfg[k]))
    return cfg


VISION = dict(depth=1, hidden_size=16, num_heads=2, out_hidden_size=32, intermediate_size=16,
              projection_intermediate_size=16)  # fmt: skip


@torch.no_grad()
def build(text: dict, seed: int = 0, **vl):
    """A random ``Glm5NextForConditionalGeneration`` (fp32, eval) whose zero- or one-initialised parameters
    (indexer pooling ``ape``/gate, mHC ``base``/``scale``, router bias, A_log, norm weights and biases, attention
    biases) are
    re-drawn so that every path of the math matters. ``vl``: fields of the VL config (e.g. its own
    ``tie_word_embeddings``)."""
    Config, Model = reference_modules()
    torch.manual_seed(seed)
    model = Model(Config(text_config=text, vision_config=VISION, **vl)).eval()
    for name, p in model.named_parameters():
        if name.startswith("model.visual"):
            continue
        if name.endswith(("index_kpool_compress_ape", "index_kpool_compress_gate")):
            p.normal_(0, 0.5)
        elif name.endswith(("hc.base",)):
            p.normal_(0, 0.5)
        elif name.endswith("hc.scale"):
            p.uniform_(0.5, 1.5)
        elif name.endswith("A_log"):
            p.normal_(0, 0.5)
        elif name.endswith(("norm.weight", "layernorm.weight")):
            p.uniform_(0.5, 1.5)
        elif name.endswith(("norm.bias", "proj.bias", "proj_with_mqa.bias")):  # attention_bias=True
            p.normal_(0, 0.1)
        elif name.endswith("embed_tokens.weight"):
            p.normal_(0, 1.0)
        elif name.endswith(("fn",)):
            p.normal_(0, 0.1)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.normal_(0, 0.05)
    return model


def save(model, path) -> None:
    """``save_pretrained`` into ``path`` (the published tensor names: what genoctx must read)."""
    model.save_pretrained(str(path))


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Reference logits ``[B, T, V]`` fp32 for token ids ``[B, T]``."""
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@contextlib.contextmanager
def genoctx_log():
    """Records of the "genoctx" logger at INFO and above (whatever its propagation)."""
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("genoctx")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
