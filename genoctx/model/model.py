"""HybridLM: the hybrid long-context language model genoctx post-trains.

Design choices (read top to bottom, nanoGPT style):

- Tokens are single nucleotides (vocabulary in ``genoctx.data.tokenizer``); every window starts with a
  ``<bos>`` token so that the base at window position p is predicted from exactly p bases of context.
- A block is one mixing layer (Kimi Delta Attention, linear attention with a recurrent state, or DeepSeek
  Sparse Attention, a lightning indexer plus top-k attention) followed by a feed-forward layer (MoE with a
  shared expert, or a dense SwiGLU MLP). The mixers alternate by ``ModelConfig.layer_pattern`` (3 KDA : 1 DSA).
- Every sub-layer is pre-norm (RMSNorm) and wrapped by a manifold-constrained hyper-connection (mHC) over
  ``hc_streams`` residual streams: the residual stream is ``hc_streams`` times wider than ``d_model``.
- No positional embedding: KDA layers carry order; DSA layers are NoPE (as Kimi Linear's global layers).
- The chunk contract (DESIGN.md): ``forward(tokens, cache) -> (logits, cache)``. A long sequence may be fed
  as consecutive chunks, each taking the cache the previous one returned; the result equals one pass.
  This one mechanism serves streaming evaluation, context parallelism and the equivalence tests.
- Auxiliary losses (indexer KL, optional MoE balance loss) are collected from the layers after each
  forward (``aux_loss()``); what each layer ran (KDA core, DSA path) is recorded in ``layer_stats()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .config import DSA, ModelConfig
from .dsa import DeepSeekSparseAttention
from .hyper import HyperConnection, expand_streams, reduce_streams
from .kda import KimiDeltaAttention
from .moe import MLP, MoE


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension (Zhang & Sennrich, 2019); computed in at least fp32, returned in input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(dt)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(dt)).to(x.dtype)


@dataclass
class ModelCache:
    """What one chunk leaves for the next: one entry per layer (``KDACache`` / ``DSACache``) and the number of
    tokens already processed (``position``, tokens)."""

    layers: list = field(default_factory=list)
    position: int = 0

    def detach(self) -> ModelCache:
        """A copy whose tensors are cut from the autograd graph (truncated backprop across chunks)."""

        def _d(c):
            if c is None:
                return None
            return type(c)(**{k: (v.detach() if torch.is_tensor(v) else v) for k, v in vars(c).items()})

        return ModelCache([_d(c) for c in self.layers], self.position)


class Block(nn.Module):
    """One mixing layer and one feed-forward layer, each pre-norm and wrapped by a hyper-connection."""

    def __init__(self, cfg: ModelConfig, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.mix_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = DeepSeekSparseAttention(cfg) if layer_type == DSA else KimiDeltaAttention(cfg)
        self.mix_hc = HyperConnection(cfg.d_model, cfg.hc_streams, cfg.hc_sinkhorn_iters, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = MoE(cfg) if cfg.n_experts > 0 else MLP(cfg.d_model, cfg.mlp_hidden, cfg.init_std)
        self.ffn_hc = HyperConnection(cfg.d_model, cfg.hc_streams, cfg.hc_sinkhorn_iters, cfg.norm_eps)

    def forward(self, x: torch.Tensor, cache=None):
        """x: [B, T, n, D] residual streams -> ([B, T, n, D], this layer's new cache)."""
        h, coeffs = self.mix_hc.pre(x)
        y, cache = self.mixer(self.mix_norm(h), cache)
        x = self.mix_hc.post(x, y, coeffs)
        h, coeffs = self.ffn_hc.pre(x)
        x = self.ffn_hc.post(x, self.ffn(self.ffn_norm(h)), coeffs)
        return x, cache


class HybridLM(nn.Module):
    """Hybrid KDA/DSA language model over nucleotide tokens.

    Args:
        cfg: the architecture (``ModelConfig``).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=1.0)
        nn.init.normal_(self.head.weight, std=cfg.init_std)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    def forward(
        self, tokens: torch.Tensor, cache: ModelCache | None = None
    ) -> tuple[torch.Tensor, ModelCache]:
        """Run one chunk.

        Args:
            tokens: [B, T] int64 token ids (inputs; for a window, ``<bos>`` followed by its first W-1 bases).
            cache: what the previous chunk returned, or None at the start of a sequence.

        Returns:
            (logits [B, T, vocab_size] fp32 (fp64 for an fp64 model), the cache for the next chunk).
        """
        layer_caches = cache.layers if cache is not None else [None] * len(self.blocks)
        position = cache.position if cache is not None else 0
        x = expand_streams(self.embed(tokens), self.cfg.hc_streams)
        new_caches = []
        for block, c in zip(self.blocks, layer_caches, strict=True):
            x, c = block(x, c)
            new_caches.append(c)
        logits = self.head(self.norm(reduce_streams(x)))
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return logits, ModelCache(new_caches, position + tokens.shape[1])

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the auxiliary losses the layers produced in the last forward (indexer KL, MoE balance), or None."""
        total = None
        for m in self.modules():
            a = getattr(m, "aux_loss", None)
            if torch.is_tensor(a):
                total = a if total is None else total + a
        return total

    def layer_stats(self) -> list[dict]:
        """Per layer, what ran in the last forward: mixer type and path, DSA keys scored, MoE load."""
        out = []
        for i, b in enumerate(self.blocks):
            s = {"layer": i, "mixer": "dsa" if b.layer_type == DSA else "kda"}
            for k, v in (getattr(b.mixer, "stats", None) or {}).items():
                s[k] = v
            fs = getattr(b.ffn, "stats", None)
            if fs:
                s["moe_load_max_over_mean"] = fs.get("load_max_over_mean")
            out.append(s)
        return out

    @torch.no_grad()
    def update_router_biases(self) -> list[dict]:
        """Aux-loss-free MoE balancing step (DeepSeek-V3), called after each optimizer step."""
        return [b.ffn.update_bias() for b in self.blocks if isinstance(b.ffn, MoE)]

    def num_parameters(self) -> dict:
        """Total and active (per token) parameter counts."""
        total = sum(p.numel() for p in self.parameters())
        active = total
        cfg = self.cfg
        if cfg.n_experts > 0:
            per_expert = 3 * cfg.d_model * cfg.expert_hidden
            active -= len(self.blocks) * (cfg.n_experts - cfg.experts_per_token) * per_expert
        return {"total": total, "active": active}


def shift_inputs(tokens: torch.Tensor, bos_id: int) -> torch.Tensor:
    """Model inputs for next-token prediction of a whole window: ``<bos>`` then the window minus its last token.

    tokens: [B, W] int64 -> [B, W] int64. The logit at position p then predicts ``tokens[:, p]`` from the
    p bases before it (p = 0 is predicted from ``<bos>`` alone).
    """
    bos = torch.full_like(tokens[:, :1], bos_id)
    return torch.cat([bos, tokens[:, :-1]], dim=1)


def token_losses(logits: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Per-token next-token cross-entropy in nats, zero where not scored.

    logits [B, T, V] fp32, targets [B, T] int64, scored [B, T] bool -> [B, T] fp32.
    """
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return ce.view_as(targets) * scored.to(ce.dtype)
