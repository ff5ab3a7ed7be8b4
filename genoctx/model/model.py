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

    def forward(self, tokens: torch.Tensor, cache: ModelCache | None = None) -> tuple[torch.Tensor, ModelCache]:
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
        """Per layer, what ran in the last forward: ``layer``, ``mixer`` ("kda"/"dsa"), the mixer's ``stats``
        (KDA ``path``; DSA ``path``, ``keys_scored``, ``keys_attended``, ``indexer_loss``) and, for MoE layers,
        ``moe_tokens_per_expert`` (list of E ints: token-slots routed to each expert in that forward) and
        ``moe_load_max_over_mean`` (max / mean of that list; 1.0 = perfectly balanced)."""
        out = []
        for i, b in enumerate(self.blocks):
            s = {"layer": i, "mixer": "dsa" if b.layer_type == DSA else "kda"}
            for k, v in (getattr(b.mixer, "stats", None) or {}).items():
                s[k] = v
            fs = getattr(b.ffn, "stats", None)
            if fs:
                s["moe_load_max_over_mean"] = fs.get("load_max_over_mean")
                tpe = fs.get("tokens_per_expert")
                s["moe_tokens_per_expert"] = tpe.tolist() if torch.is_tensor(tpe) else tpe
            out.append(s)
        return out

    @torch.no_grad()
    def update_router_biases(self) -> list[dict]:
        """Aux-loss-free MoE balancing step (DeepSeek-V3), called after each optimizer step."""
        return [b.ffn.update_bias() for b in self.blocks if isinstance(b.ffn, MoE)]

    def num_parameters(self) -> dict:
        """Parameter counts: ``total`` and ``active`` per token (total minus the ``n_experts -
        experts_per_token`` routed experts a token does not use, in every MoE layer). Works on the meta
        device (no memory) for large presets."""
        total = sum(p.numel() for p in self.parameters())
        active = total
        cfg = self.cfg
        if cfg.n_experts > 0:
            per_expert = 3 * cfg.d_model * cfg.expert_hidden
            active -= len(self.blocks) * (cfg.n_experts - cfg.experts_per_token) * per_expert
        return {"total": total, "active": active}


def flops_per_token(cfg: ModelConfig, seq_len: int, active_params: int) -> dict:
    """Model FLOPs per token of one sequence of ``seq_len`` tokens, training (forward + backward) and forward.

    Counts matmul FLOPs (2 per multiply-add); elementwise work (norms, gates, softmax, Sinkhorn, mHC stream
    mixing of ``n^2 D`` per token) and recomputation are not counted. Backward = 2x forward for everything
    trained by gradient; the indexer's top-k scoring runs without gradient (forward only).

    - ``dense`` = 2 x (active parameters, minus the embedding table unless tied: a lookup) per token
      forward, i.e. the usual ``6 N_active`` for training. Includes the mHC projections and the router.
    - ``kda`` per KDA layer and head, chunk ``C``, head dim ``d`` (chunked WY form, independent of L):
      ``A_kk``, ``A_qk`` ``2 C d``, triangular solve for W and U ``C d``, ``A_qk V'`` ``C d``, ``W S``, ``Q S``
      and the state update ``3 d^2`` multiply-adds: ``4 C d + 3 d^2``.
    - ``dsa_attention`` per DSA layer: ``2 H Dh k_eff`` multiply-adds (QK and PV), ``k_eff`` = mean over the
      sequence of ``min(top-k, t)`` keys attended (mean visible keys ``(L + 1) / 2`` when dense).
    - ``dsa_indexer`` per DSA layer: ``H_I d_I (L + 1) / 2`` multiply-adds (every visible key scored, forward
      only; the L-dependent term) plus, for the indexer KL of the sparse stage, ``3 H_I d_I k_eff`` (scores
      forward and backward) and ``H Dh k_eff`` (the target attention); the warm-up KL uses all visible keys.

    Args:
        cfg: the architecture.
        seq_len: L, tokens in the sequence (>= 1).
        active_params: ``HybridLM.num_parameters()["active"]``.

    Returns:
        ``{"train": {...}, "forward": {...}}``, each with ``dense``, ``kda``, ``dsa_attention``,
        ``dsa_indexer`` and ``total`` (FLOPs per token, floats).

    Raises:
        ValueError: ``seq_len < 1``.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    L = seq_len
    types = cfg.layer_types
    n_kda, n_dsa = types.count("K"), types.count(DSA)
    matmul_params = active_params - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
    C, d = cfg.kda_chunk_size, cfg.kda_head_dim
    kda_macs = n_kda * cfg.kda_heads * (4 * C * d + 3 * d * d)
    kk = min(cfg.index_topk, L) if cfg.dsa_mode == "sparse" else L
    k_eff = (kk * (kk + 1) / 2 + (L - kk) * kk) / L  # mean of min(top-k, t) over t = 1..L
    mean_visible = (L + 1) / 2
    keys = mean_visible if cfg.dsa_mode == "dense" else k_eff
    HI, dI, H, Dh = cfg.index_heads, cfg.index_head_dim, cfg.dsa_heads, cfg.dsa_head_dim
    attn_macs = n_dsa * 2 * H * Dh * keys
    topk_macs = n_dsa * HI * dI * mean_visible if (cfg.dsa_mode == "sparse" or cfg.indexer_stage == "sparse") else 0
    kl_keys = {"sparse": k_eff, "warmup": mean_visible, "off": 0.0}[cfg.indexer_stage]
    kl_macs = n_dsa * (3 * HI * dI + H * Dh) * kl_keys
    train = {
        "dense": 6.0 * matmul_params,
        "kda": 6.0 * kda_macs,
        "dsa_attention": 6.0 * attn_macs,
        "dsa_indexer": 2.0 * (topk_macs + kl_macs),
    }
    fwd = {
        "dense": 2.0 * matmul_params,
        "kda": 2.0 * kda_macs,
        "dsa_attention": 2.0 * attn_macs,
        "dsa_indexer": 2.0 * topk_macs,
    }
    for x in (train, fwd):
        x["total"] = sum(x.values())
    return {"train": train, "forward": fwd}


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
