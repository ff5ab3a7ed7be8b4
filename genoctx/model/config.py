"""Architecture of GLM-5.3-Flash (transformers ``glm5_next``), in the reference's own field names.

``ModelConfig`` has two parts:

- the fields of transformers 5.23.0 ``Glm5NextTextConfig`` (same names, same meaning, same derived
  defaults: ``layer_types``, ``mlp_layer_types`` and ``indexer_types`` are filled as the reference's
  ``__post_init__`` fills them). These, and only these, are written to ``config.json``
  (``to_hf_dict``) and read from one (``from_hf_dict``: the flat text config or the ``text_config`` of the VL
  config);
- genoctx's compute knobs (``kda_chunk_size``, tile budgets, ``dsa_mode``, the indexer training stage, the
  MoE balancing rate, ``kernels``): how to compute the same function, never what function. They stay in genoctx
  recipes.

The model (``layer_types``): ``"linear_attention"`` = Kimi Delta Attention (KDA), ``"indexed_attention"`` =
NoPE MLA with DeepSeek Sparse Attention (DSA) and a KPool lightning indexer. ``mlp_layer_types``:
``"dense"`` = SwiGLU MLP of ``intermediate_size``, ``"sparse"`` = MoE. ``indexer_types``: ``"full"`` runs the
indexer, ``"shared"`` reuses the selection of the full DSA layer right before it. In recipes and ``--set``
the three lists may be given as strings of letters, one per layer: ``K``/``D`` (KDA / DSA), ``D``/``S``
(dense / sparse MLP), ``F``/``S`` (full / shared indexer), e.g. ``--set model.layer_types=KKKD``.

Presets (``PRESETS``), all the same architecture:

- ``glm-5.3-flash``: the published model (``zai-org/GLM-5.3-Flash``). Every value is the default of
  transformers 5.23.0 ``Glm5NextTextConfig`` (whose docstring names that checkpoint), which matches the
  published shape summarised in REFERENCES.md: 45 layers, KDA at ``i % 4 != 3`` (34) and DSA at
  3, 7, ..., 43 (11); hidden 4096; KDA 64 heads x 128, conv 4, gate lower bound -5; MLA 64 heads,
  q-LoRA 1536, kv-LoRA 512, qk_nope 256, v 256, no RoPE; indexer 32 heads x 128, top-2048 tokens as pools
  of 16 plus the tail; first 3 layers dense (12288), then 288 experts of 2048, top-8, 1 shared, routed
  scaling 2.5, SwiGLU limit 10; mHC 4 streams, Sinkhorn 20; vocabulary 154,880; context 1,048,576.
  ``genoctx model info --preset glm-5.3-flash`` counts 313.3B total / 17.4B active parameters for the text
  model (the model card's 320B / 18B also counts the vision tower and the MTP layer, which genoctx skips).
- ``tiny``: unit tests (seconds on a CPU).
- ``cpu-small``: the README demo on a laptop CPU (prepare -> train -> eval in minutes); nucleotide
  vocabulary of 8 tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

KDA = "linear_attention"
DSA = "indexed_attention"
LAYER_TYPES = (KDA, DSA)
MLP_TYPES = ("dense", "sparse")
INDEXER_TYPES = ("full", "shared")
_LETTERS = {
    "layer_types": {"K": KDA, "D": DSA},
    "mlp_layer_types": {"D": "dense", "S": "sparse"},
    "indexer_types": {"F": "full", "S": "shared"},
}

# config.json keys that describe the checkpoint or the runtime, not the architecture: read and ignored.
_HF_IGNORED = {
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "output_router_logits", "keys_to_ignore_at_inference", "_name_or_path", "auto_map", "attention_dropout",
    "initializer_range", "router_aux_loss_coef", "head_dim", "qk_head_dim", "base_config_key",
    "tie_word_embeddings", "pad_token_id", "bos_token_id", "eos_token_id", "max_position_embeddings",
    "num_local_experts", "quantization_config", "rope_scaling", "rope_theta", "rope_parameters",
    "return_dict", "output_hidden_states", "output_attentions", "chunk_size_feed_forward", "id2label",
    "label2id", "problem_type", "tokenizer_class", "is_encoder_decoder", "_attn_implementation",
    "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset", "linear_attn_config",
}


@dataclass
class ModelConfig:
    """GLM-5.3-Flash architecture (``Glm5NextTextConfig`` fields) plus genoctx compute knobs.

    Widths are in channels; ``index_topk``, ``index_kpool``, ``indexer_tile_tokens``, ``moe_chunk_tokens`` and
    ``kda_chunk_size`` are in tokens. Defaults of the architecture fields are those of the reference except
    where a small model is the better default (widths, layer count, vocabulary = the 8 nucleotide tokens).

    Raises (from ``__post_init__``):
        ValueError: an unknown layer/MLP/indexer type, lists of the wrong length, a "shared" indexer layer that
            does not directly follow a "full" DSA layer, RoPE (``qk_rope_head_dim > 0``), ``index_topk`` not a
            multiple of ``index_kpool``, or another inconsistent value (the message names the field).
    """

    # ---- glm5_next text config (transformers 5.23.0 Glm5NextTextConfig) ----
    vocab_size: int = 8
    hidden_size: int = 128
    intermediate_size: int = 256  # dense MLP layers
    moe_intermediate_size: int = 64  # one routed expert (and the shared expert, times n_shared_experts)
    num_hidden_layers: int = 4
    num_attention_heads: int = 4  # MLA heads
    num_key_value_heads: int | None = None  # must equal num_attention_heads (reference check)
    n_shared_experts: int = 1
    n_routed_experts: int = 8
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 32
    q_lora_rank: int = 48
    qk_rope_head_dim: int = 0  # NoPE: must be 0
    v_head_dim: int = 32
    qk_nope_head_dim: int = 32
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 1048576
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    tie_word_embeddings: bool = False
    mlp_layer_types: list[str] | None = None
    attention_bias: bool = False
    index_topk: int = 2048
    index_head_dim: int = 32
    index_n_heads: int = 4
    layer_types: list[str] | None = None
    indexer_types: list[str] | None = None
    swiglu_limit: float = 10.0
    linear_head_dim: int = 32
    linear_num_heads: int = 4
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True

    # ---- genoctx compute knobs (not part of config.json) ----
    kda_chunk_size: int = 64  # tokens per chunk of the chunked WY form
    # tokens per block of the PyTorch KDA core (whole chunks): its working set, forward and recomputed backward,
    # is one block's (``chunk_kda(block_tokens=)``)
    kda_block_tokens: int = 1024
    indexer_tile_tokens: int = 1 << 22  # query rows x pool columns of indexer scores held at once
    moe_chunk_tokens: int = 4096  # tokens per MoE dispatch chunk
    # "sparse": attention over the indexer's selection (default). "dense": full causal attention, only when
    # asked for explicitly (indexer warm-up, comparisons).
    dsa_mode: str = "sparse"
    # Indexer training stage (DeepSeek-V3.2, carried over to pools): "sparse" = KL(p || softmax(I)) over the
    # selected pools, p = the main attention's mass summed over each pool's tokens (detached), indexer input
    # detached; "warmup" = the same over every visible complete pool against dense attention (with
    # model.dsa_mode=dense and every non-indexer parameter frozen: the trainer's job); "off" = no indexer loss.
    indexer_stage: str = "sparse"
    indexer_loss_coef: float = 1.0
    router_bias_rate: float = 1e-3  # aux-loss-free balancing step u (DeepSeek-V3) on e_score_correction_bias
    moe_aux_loss_coef: float = 0.0  # optional sequence-wise balance loss (DeepSeek-V3 eq. 17-20)
    # DSA on CUDA: "triton" = the kernels of ``kernels/`` (indexer top-k, sparse MLA forward/backward), "torch" = the
    # PyTorch path. On CPU the PyTorch path always runs. The path that ran is in the layer's stats["kernel"].
    kernels: str = "triton"
    # KDA's core on CUDA: "torch" = genoctx's chunk_kda in blocks (the default, also the only one on CPU), "fla" =
    # fla-core's Triton chunk_kda (``pip install 'genoctx[gpu]'``). The core that ran is in the layer's stats["path"].
    kda_kernel: str = "torch"

    _runtime = (
        "kda_chunk_size", "kda_block_tokens", "indexer_tile_tokens", "moe_chunk_tokens", "dsa_mode",
        "indexer_stage", "indexer_loss_coef", "router_bias_rate", "moe_aux_loss_coef", "kernels", "kda_kernel",
    )  # fmt: skip

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if n < 1:
            raise ValueError(f"num_hidden_layers must be >= 1, got {n}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        # the reference's derived defaults (Glm5NextTextConfig.__post_init__)
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense"] * min(3, n) + ["sparse"] * (n - 3)
        if self.layer_types is None:
            self.layer_types = [KDA if i % 4 != 3 else DSA for i in range(n)]
        if self.indexer_types is None:
            self.indexer_types = ["full"] * n
        for name, allowed in (("layer_types", LAYER_TYPES), ("mlp_layer_types", MLP_TYPES),
                              ("indexer_types", INDEXER_TYPES)):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, str):
                letters = _LETTERS[name]
                bad = sorted(set(value) - set(letters))
                if bad:
                    raise ValueError(f"{name}: letters must be {'/'.join(letters)}, got {value!r}")
                value = [letters[c] for c in value]
            value = ["indexed_attention" if v == "full_attention" else v for v in value]
            if len(value) != n or any(v not in allowed for v in value):
                raise ValueError(f"{name} must list {n} entries from {allowed}, got {value!r}")
            setattr(self, name, list(value))
        for i, t in enumerate(self.indexer_types):
            if t == "shared" and self.layer_types[i] == DSA:
                if i == 0 or self.layer_types[i - 1] != DSA or self.indexer_types[i - 1] != "full":
                    raise ValueError(
                        f"indexer_types[{i}] is 'shared' but layer {i - 1} is not a DSA layer with a 'full' "
                        "indexer (a shared layer reuses the selection of the full DSA layer right before it)"
                    )
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError("num_key_value_heads must equal num_attention_heads (glm5_next MLA)")
        if self.qk_rope_head_dim:
            raise ValueError(f"qk_rope_head_dim must be 0 (the DSA layers are NoPE), got {self.qk_rope_head_dim}")
        if self.index_kpool < 1 or self.index_topk < 1 or self.index_topk % self.index_kpool:
            raise ValueError(
                f"index_topk ({self.index_topk}) must be a positive multiple of index_kpool ({self.index_kpool})"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {self.hidden_act!r}")
        if "sparse" in self.mlp_layer_types:
            E, k, g = self.n_routed_experts, self.num_experts_per_tok, self.n_group
            if E < 1 or not 1 <= k <= E:
                raise ValueError(f"num_experts_per_tok must be in [1, n_routed_experts={E}], got {k}")
            if g < 1 or E % g or not 1 <= self.topk_group <= g:
                raise ValueError(f"n_group ({g}) must divide n_routed_experts ({E}) and topk_group be in [1, {g}]")
            if g > 1 and E // g < 2:
                raise ValueError("n_group > 1 needs at least 2 experts per group (groups are scored by their top 2)")
            if k > self.topk_group * (E // g):
                raise ValueError(f"num_experts_per_tok ({k}) exceeds the experts of topk_group groups")
        if self.hc_mult < 1:
            raise ValueError(f"hc_mult must be >= 1, got {self.hc_mult}")
        if self.dsa_mode not in ("sparse", "dense"):
            raise ValueError(f"dsa_mode must be 'sparse' or 'dense', got {self.dsa_mode!r}")
        if self.indexer_stage not in ("sparse", "warmup", "off"):
            raise ValueError(f"indexer_stage must be 'sparse', 'warmup' or 'off', got {self.indexer_stage!r}")
        if self.kernels not in ("triton", "torch"):
            raise ValueError(f"kernels must be 'triton' or 'torch', got {self.kernels!r}")
        if self.kda_kernel not in ("torch", "fla"):
            raise ValueError(f"kda_kernel must be 'torch' or 'fla', got {self.kda_kernel!r}")
        for name in ("kda_chunk_size", "kda_block_tokens", "indexer_tile_tokens", "moe_chunk_tokens",
                     "linear_conv_kernel_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per MLA head (``qk_nope_head_dim + qk_rope_head_dim``; no RoPE here)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def to_dict(self) -> dict:
        """All fields (architecture and compute knobs), as in recipes."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """From a recipe's ``model`` section (all fields allowed).

        Raises:
            ValueError: unknown keys (listed) or invalid values.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**d)

    def to_hf_dict(self) -> dict:
        """The flat ``glm5_next_text`` config.json (architecture fields only; reads back with ``from_hf_dict``
        and with transformers' ``Glm5NextTextConfig``)."""
        d = {k: v for k, v in dataclasses.asdict(self).items() if k not in self._runtime}
        d["head_dim"] = self.qk_rope_head_dim
        return {"model_type": "glm5_next_text", **d}

    @classmethod
    def from_hf_dict(cls, d: dict, **runtime) -> ModelConfig:
        """From an HF ``config.json`` dict: a flat ``glm5_next_text`` config or a ``glm5_next`` VL config (its
        ``text_config``). Handles the reference's aliases (``linear_attn_config``, ``index_topk_pattern``,
        ``index_topk_freq``/``index_skip_topk_offset``, ``num_local_experts``); ``runtime`` sets compute knobs.
        ``tie_word_embeddings`` of a VL config is its top-level flag (default False), the one transformers'
        ``Glm5NextForConditionalGeneration`` ties ``lm_head`` by; the ``text_config``'s own flag is not used.

        Raises:
            ValueError: a ``model_type`` other than glm5_next(_text), an unknown key (named), or an invalid value.
        """
        mt = d.get("model_type")
        if mt not in (None, "glm5_next_text", "glm5_next"):
            raise ValueError(f"model_type {mt!r} is not glm5_next / glm5_next_text")
        if mt == "glm5_next" or "text_config" in d:
            text = dict(d.get("text_config") or {})
            if text:  # transformers ties lm_head by the VL config's own flag (Glm5NextConfig default False)
                text["tie_word_embeddings"] = d.get("tie_word_embeddings", False)
            else:  # flat VL config: the text fields sit at the top level
                text = {k: v for k, v in d.items() if k not in ("vision_config", "model_type")}
            d = text
            mt = d.get("model_type", "glm5_next_text")
        if mt not in (None, "glm5_next_text", "glm5_next"):
            raise ValueError(f"model_type {mt!r} is not glm5_next / glm5_next_text")
        names = {f.name for f in dataclasses.fields(cls)} - set(cls._runtime)
        vision_keys = {"vision_config", "image_token_id", "video_token_id", "image_start_token_id",
                       "image_end_token_id", "video_start_token_id", "video_end_token_id"}  # fmt: skip
        unknown = sorted(set(d) - names - _HF_IGNORED - vision_keys)
        if unknown:
            raise ValueError(f"unknown glm5_next keys {unknown}")
        kw = {k: v for k, v in d.items() if k in names}
        if "num_local_experts" in d and "n_routed_experts" not in kw:
            kw["n_routed_experts"] = d["num_local_experts"]
        for k in ("tie_word_embeddings", "pad_token_id", "bos_token_id", "eos_token_id", "max_position_embeddings",
                  "initializer_range"):  # fmt: skip
            if k in d:
                kw[k] = d[k]
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0] if kw["eos_token_id"] else None
        la = d.get("linear_attn_config")
        if la is not None:
            kw.setdefault("linear_head_dim", la.get("head_dim", 128))
            kw.setdefault("linear_num_heads", la.get("num_heads", 64))
            kw.setdefault("linear_conv_kernel_dim", la.get("short_conv_kernel_size", 4))
            lb = la.get("gate_lower_bound", -5.0)
            if la.get("safe_gate", True) and lb is None:
                lb = -5.0
            kw.setdefault("linear_lower_bound", lb)
        if kw.get("indexer_types") is None:
            n = kw.get("num_hidden_layers", 45)
            pattern = d.get("index_topk_pattern")
            if pattern is not None:
                kw["indexer_types"] = (
                    [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
                )
            else:
                freq = max(d.get("index_topk_freq", 1), 1)
                offset = d.get("index_skip_topk_offset", 2)
                kw["indexer_types"] = ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n)]
        # reference defaults for fields a checkpoint's config.json may omit
        ref = reference_defaults()
        for k, v in ref.items():
            kw.setdefault(k, v)
        return cls(**kw, **runtime)


def reference_defaults() -> dict:
    """The defaults of transformers 5.23.0 ``Glm5NextTextConfig`` for every architecture field (the published
    GLM-5.3-Flash; derived lists left None)."""
    return dict(
        vocab_size=154880, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=2048,
        num_hidden_layers=45, num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1,
        n_routed_experts=288, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=0,
        v_head_dim=256, qk_nope_head_dim=256, n_group=1, topk_group=1, num_experts_per_tok=8, norm_topk_prob=True,
        hidden_act="silu", max_position_embeddings=1048576, initializer_range=0.02, rms_norm_eps=1e-5,
        pad_token_id=154820, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False, attention_bias=False,
        index_topk=2048, index_head_dim=128, index_n_heads=32, swiglu_limit=10.0, linear_head_dim=128,
        linear_num_heads=64, linear_conv_kernel_dim=4, linear_lower_bound=-5.0, hc_mult=4, hc_eps=1e-6,
        hc_sinkhorn_iters=20, index_kpool=16, index_kpool_always_select_tail=True,
    )  # fmt: skip


def _presets() -> dict[str, ModelConfig]:
    return {
        # The published model: every field is the transformers 5.23.0 Glm5NextTextConfig default (module docstring).
        "glm-5.3-flash": ModelConfig(**reference_defaults(), moe_chunk_tokens=16384),
        "tiny": ModelConfig(
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            layer_types=[KDA, DSA],
            mlp_layer_types=["dense", "sparse"],
            num_attention_heads=2,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_nope_head_dim=8,
            v_head_dim=8,
            index_n_heads=2,
            index_head_dim=8,
            index_topk=16,
            index_kpool=4,
            linear_num_heads=2,
            linear_head_dim=8,
            kda_chunk_size=16,
            # 256 query rows x 4096 pool columns per top-k tile (8 MiB at this width): 4096 starved the tile to one
            # row once a window has 4096 pools (16k tokens), millions of tiny ops at 64k
            indexer_tile_tokens=1 << 20,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_chunk_tokens=64,
            hc_mult=2,
            hc_sinkhorn_iters=10,
        ),
        "cpu-small": ModelConfig(
            hidden_size=128,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_hidden_layers=4,
            layer_types=[KDA, KDA, KDA, DSA],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            linear_num_heads=4,
            linear_head_dim=32,
            num_attention_heads=4,
            q_lora_rank=64,
            kv_lora_rank=64,
            qk_nope_head_dim=32,
            v_head_dim=32,
            index_n_heads=4,
            index_head_dim=32,
            index_topk=256,
            index_kpool=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_chunk_tokens=8192,
            # KDA blocks of 4096 tokens (a block's backward working set, ~20 MiB at this width): each block is a fixed
            # ~300 aten ops, so 1024-token blocks made a CPU step at 8k tokens issue ~5k more ops for nothing
            kda_block_tokens=4096,
            hc_mult=4,
        ),
    }


PRESETS: dict[str, ModelConfig] = _presets()


def preset(name: str, **overrides) -> ModelConfig:
    """Return a copy of the named preset with ``overrides`` applied (derived fields re-derived, all re-checked).

    Raises:
        KeyError: unknown preset name (the message lists the known ones).
        ValueError: an invalid override.
    """
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    base = PRESETS[name]
    if "num_hidden_layers" in overrides:  # derived lists follow a new layer count unless given
        for k in ("layer_types", "mlp_layer_types", "indexer_types"):
            overrides.setdefault(k, None)
    if "num_attention_heads" in overrides:  # and the key/value heads follow the heads
        overrides.setdefault("num_key_value_heads", None)
    return dataclasses.replace(base, **overrides)


__all__ = ["DSA", "KDA", "ModelConfig", "PRESETS", "preset", "reference_defaults"]
