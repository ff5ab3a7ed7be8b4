"""Architecture configuration of the hybrid model (architecture fields only).

``ModelConfig`` describes a stack of blocks. Each block is one *mixing* layer (Kimi Delta Attention, ``K``,
or DeepSeek Sparse Attention, ``D``) followed by a feed-forward layer (mixture of experts, or a dense MLP
when ``n_experts == 0``), each sub-layer wrapped by a manifold-constrained hyper-connection (mHC) over
``hc_streams`` residual streams.

Presets (``PRESETS``):

- ``tiny``: a few thousand parameters, for unit tests (seconds on a CPU).
- ``cpu-small``: trains on a laptop CPU on real DNA in minutes (the README demo).
- ``glm-flash-like``: the published scale the project targets, a "flash" (~30B total, ~3B active) model:
  45 mixing layers (34 KDA + 11 DSA, about 3:1), MoE, n = 4 hyper-connections. Mixer widths are the
  published ones: KDA 32 heads of 128 (Kimi-Linear-48B-A3B), the lightning indexer 64 heads of 128 with
  top-2048 (DeepSeek-V3.2), DSA in MQA form with 32 query heads of 128. The MoE takes the 30B-A3B class
  shape of GLM-4.7-Flash (hidden 2048, 64 routed experts of width 1536, top-4, one shared expert, sigmoid
  router with expert bias). Kimi Linear's own MoE (hidden 2304, 256 experts of 1024, top-8) over 45 layers
  would give 83.7B total / 4.7B active, a different class (Kimi Linear has 27 layers); this preset gives
  29.2B total / 3.7B active (``genoctx model info --preset glm-flash-like``; the vocabulary is 8
  nucleotide tokens, so there are no large embedding tables).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

KDA = "K"
DSA = "D"


@dataclass
class ModelConfig:
    """Architecture of ``HybridLM``.

    Widths are in channels; lengths (``index_topk``, ``indexer_tile_tokens``, ``moe_chunk_tokens``,
    ``kda_chunk_size``) are in tokens.
    """

    vocab_size: int = 8
    d_model: int = 128
    n_layers: int = 4
    # One character per mixing layer, repeated to ``n_layers``: "K" = KDA, "D" = DSA. "KKKD" is 3:1.
    layer_pattern: str = "KKKD"

    # Kimi Delta Attention (Kimi Linear, 2025)
    kda_heads: int = 4
    kda_head_dim: int = 32  # dk = dv
    kda_conv_size: int = 4
    kda_chunk_size: int = 64

    # DeepSeek Sparse Attention (DeepSeek-V3.2)
    dsa_heads: int = 4  # query heads
    dsa_kv_heads: int = 1  # 1 = MQA (one shared key/value head), the default
    dsa_head_dim: int = 32
    index_heads: int = 4  # H_I
    index_head_dim: int = 32  # d_I
    index_topk: int = 2048  # keys attended per query
    indexer_tile_tokens: int = 1 << 22  # budget: query-tile rows x key columns of indexer scores held at once
    # "sparse": top-k attention (default). "dense": full causal attention, only when asked for explicitly.
    dsa_mode: str = "sparse"
    # Indexer training stage (DeepSeek-V3.2), recipe key model.indexer_stage (CLI: --set model.indexer_stage=...):
    # "sparse" = KL(p || softmax(I)) on the selected top-k set, p = head-summed main attention there (detached),
    # indexer input detached: the indexer learns only from the KL, the model only from the LM loss;
    # "warmup" = KL against the dense attention distribution over all visible keys (DeepSeek's warm-up also
    # runs the main attention dense, model.dsa_mode=dense, and freezes every non-indexer parameter: the
    # trainer's job); "off" = no indexer loss. indexer_loss_coef scales the KL added to the LM loss.
    indexer_stage: str = "sparse"
    indexer_loss_coef: float = 1.0

    # Feed-forward: MoE when n_experts > 0, else a dense SwiGLU MLP of width mlp_hidden
    n_experts: int = 8
    experts_per_token: int = 2
    expert_hidden: int = 128
    shared_experts: int = 1
    mlp_hidden: int = 256
    moe_chunk_tokens: int = 4096
    router_bias_rate: float = 1e-3  # aux-loss-free balancing step u (DeepSeek-V3)
    moe_aux_loss_coef: float = 0.0  # optional sequence-wise auxiliary loss

    # Hyper-connections (mHC, DeepSeek 2025)
    hc_streams: int = 4
    hc_sinkhorn_iters: int = 20

    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if not self.layer_pattern or set(self.layer_pattern) - {KDA, DSA}:
            raise ValueError(f"layer_pattern must use only 'K' and 'D', got {self.layer_pattern!r}")
        if self.dsa_mode not in ("sparse", "dense"):
            raise ValueError(f"dsa_mode must be 'sparse' or 'dense', got {self.dsa_mode!r}")
        if self.indexer_stage not in ("sparse", "warmup", "off"):
            raise ValueError(f"indexer_stage must be 'sparse', 'warmup' or 'off', got {self.indexer_stage!r}")
        if self.dsa_heads % self.dsa_kv_heads:
            raise ValueError("dsa_heads must be a multiple of dsa_kv_heads")
        if self.n_experts and self.experts_per_token > self.n_experts:
            raise ValueError("experts_per_token must be <= n_experts")
        if self.hc_streams < 1:
            raise ValueError("hc_streams must be >= 1")

    @property
    def layer_types(self) -> list[str]:
        """The mixer of each layer, e.g. ``['K', 'K', 'K', 'D']``."""
        p = self.layer_pattern
        return [p[i % len(p)] for i in range(self.n_layers)]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**d)


def _presets() -> dict[str, ModelConfig]:
    return {
        "tiny": ModelConfig(
            d_model=32,
            n_layers=2,
            layer_pattern="KD",
            kda_heads=2,
            kda_head_dim=8,
            kda_chunk_size=16,
            dsa_heads=2,
            dsa_head_dim=8,
            index_heads=2,
            index_head_dim=8,
            index_topk=16,
            indexer_tile_tokens=4096,
            n_experts=4,
            experts_per_token=2,
            expert_hidden=16,
            mlp_hidden=32,
            moe_chunk_tokens=64,
            hc_streams=2,
            hc_sinkhorn_iters=10,
        ),
        "cpu-small": ModelConfig(
            d_model=128,
            n_layers=4,
            layer_pattern="KKKD",
            kda_heads=4,
            kda_head_dim=32,
            dsa_heads=4,
            dsa_head_dim=32,
            index_heads=2,
            index_head_dim=32,
            index_topk=256,
            indexer_tile_tokens=1 << 22,
            n_experts=8,
            experts_per_token=2,
            expert_hidden=128,
            moe_chunk_tokens=8192,
            hc_streams=4,
        ),
        # Published scale, GLM-4.7-Flash class (~30B total, ~3B active; see the module docstring):
        # KDA 32 heads of 128 (Kimi Linear), DSA 32 query heads of 128 over one shared key/value head (MQA)
        # with DeepSeek-V3.2's indexer (64 heads of 128, top-2048); 45 mixing layers, 34 KDA + 11 DSA.
        "glm-flash-like": ModelConfig(
            vocab_size=8,
            d_model=2048,
            n_layers=45,
            layer_pattern="KKKDKKKDKKKDKKKDKKKDKKKDKKKDKKKDKKKDKKKDKKKKD",
            kda_heads=32,
            kda_head_dim=128,
            dsa_heads=32,
            dsa_kv_heads=1,
            dsa_head_dim=128,
            index_heads=64,
            index_head_dim=128,
            index_topk=2048,
            n_experts=64,
            experts_per_token=4,
            expert_hidden=1536,
            shared_experts=1,
            moe_chunk_tokens=16384,
            hc_streams=4,
        ),
    }


PRESETS: dict[str, ModelConfig] = _presets()


def preset(name: str, **overrides) -> ModelConfig:
    """Return a copy of the named preset with ``overrides`` applied.

    Raises:
        KeyError: unknown preset name (the message lists the known ones).
    """
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return dataclasses.replace(PRESETS[name], **overrides)
