"""Feed-forward layers: a dense SwiGLU MLP and a DeepSeek-V3 style mixture of experts (pure PyTorch).

MoE (DeepSeek-V3, arXiv:2412.19437, section 2.1.2):

    s_{t,e}  = sigmoid(x_t · w_e)                                  router affinity, fp32
    TopK_t   = top-k over e of (s_{t,e} + b_e)                     b = expert bias, used for selection only
    g_{t,e}  = s_{t,e} / Σ_{j ∈ TopK_t} s_{t,j}   for e ∈ TopK_t     gate values (no bias)
    y_t      = Σ_{e ∈ TopK_t} g_{t,e} · Expert_e(x_t) + Shared(x_t)

Design choices:

- Experts are stacked weights (``w1``, ``w3`` [E, D, H], ``w2`` [E, H, D]). Dispatch sorts the (token, slot)
  pairs by expert, runs each expert once on its contiguous slice and scatters back with ``index_add_``;
  the only python loop is over experts, never over tokens.
- ``shared_experts`` SwiGLU experts of width ``expert_hidden`` are one MLP of width
  ``shared_experts · expert_hidden`` (the sum of S SwiGLUs is a SwiGLU of the concatenated hidden).
- Sequence-chunked dispatch: the [B·T] tokens are processed in chunks of ``moe_chunk_tokens``; with grad
  enabled and ``recompute=True`` each chunk is checkpointed (non-reentrant), so only one chunk's expert
  activations are alive at a time. Chunked == unchunked to fp32 rounding.
- Auxiliary-loss-free balancing (DeepSeek-V3): expert loads are counted into ``load_counts`` in training
  mode; ``update_bias()`` (called by the trainer after each optimizer step, after it all-reduces
  ``load_counts`` across data/context-parallel ranks) moves b_e by ``router_bias_rate · sign(mean − load_e)``.
- Optional sequence-wise balance loss (DeepSeek-V3 eq. 17-20) when ``moe_aux_loss_coef > 0``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``w2(silu(w1 x) * w3 x)``.

    Args:
        d_model: D, input and output channels.
        hidden: H, hidden channels.
        init_std: std of the normal init of all three weights.
    """

    def __init__(self, d_model: int, hidden: int, init_std: float = 0.02):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)  # gate
        self.w3 = nn.Linear(d_model, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, d_model, bias=False)  # down
        for lin in (self.w1, self.w2, self.w3):
            nn.init.normal_(lin.weight, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] -> [..., D] (same dtype, or autocast's)."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Mixture of experts with a sigmoid router, top-k by biased score and shared expert(s) (DeepSeek-V3).

    Args:
        cfg: uses ``d_model``, ``n_experts`` (E), ``experts_per_token`` (k), ``expert_hidden`` (H),
            ``shared_experts``, ``moe_chunk_tokens``, ``router_bias_rate``, ``moe_aux_loss_coef``,
            ``init_std``.
        recompute: checkpoint each token chunk when grad is enabled (bounded activation memory).

    Attributes set by ``forward``:
        stats: {"tokens_per_expert": LongTensor [E] (this forward), "load_max_over_mean": float}.
        aux_loss: the sequence-wise balance loss × ``moe_aux_loss_coef`` (scalar fp32), or None when the
            coefficient is 0.

    Buffers:
        expert_bias: [E] fp32, selection-only bias (saved in checkpoints, not learnable).
        load_counts: [E] int64, tokens routed to each expert since the last ``update_bias()`` (training
            mode only; not saved).

    Raises:
        ValueError: ``n_experts < 1``, ``experts_per_token`` not in [1, n_experts], or
            ``moe_chunk_tokens < 1``.
    """

    def __init__(self, cfg: ModelConfig, recompute: bool = True):
        super().__init__()
        E, k, D, H = cfg.n_experts, cfg.experts_per_token, cfg.d_model, cfg.expert_hidden
        if E < 1:
            raise ValueError(f"MoE needs n_experts >= 1, got {E} (use MLP for a dense layer)")
        if not 1 <= k <= E:
            raise ValueError(f"experts_per_token must be in [1, n_experts={E}], got {k}")
        if cfg.moe_chunk_tokens < 1:
            raise ValueError(f"moe_chunk_tokens must be >= 1, got {cfg.moe_chunk_tokens}")
        self.n_experts, self.top_k, self.d_model, self.hidden = E, k, D, H
        self.chunk_tokens = cfg.moe_chunk_tokens
        self.bias_rate = cfg.router_bias_rate
        self.aux_coef = cfg.moe_aux_loss_coef
        self.recompute = recompute

        self.router = nn.Parameter(torch.randn(E, D) * cfg.init_std)  # w_e, one row per expert
        self.w1 = nn.Parameter(torch.randn(E, D, H) * cfg.init_std)  # gate
        self.w3 = nn.Parameter(torch.randn(E, D, H) * cfg.init_std)  # up
        self.w2 = nn.Parameter(torch.randn(E, H, D) * cfg.init_std)  # down
        self.shared = MLP(D, cfg.shared_experts * H, cfg.init_std) if cfg.shared_experts > 0 else None
        self.register_buffer("expert_bias", torch.zeros(E), persistent=True)
        self.register_buffer("load_counts", torch.zeros(E, dtype=torch.long), persistent=False)
        self.stats: dict = {}
        self.aux_loss: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return (
            f"n_experts={self.n_experts}, top_k={self.top_k}, d_model={self.d_model}, hidden={self.hidden}, "
            f"chunk_tokens={self.chunk_tokens}, recompute={self.recompute}"
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router of DeepSeek-V3: sigmoid affinities, top-k by (affinity + bias), gates normalised to 1.

        Args:
            x: [N, D] tokens.

        Returns:
            (experts [N, k] int64, gates [N, k] fp32 summing to 1 per token, scores [N, E] fp32 = s).
            Gradients reach the router weights through ``gates`` and ``scores``, never the bias.
        """
        with torch.autocast(device_type=x.device.type, enabled=False):
            rdt = torch.promote_types(x.dtype, torch.float32)
            scores = torch.sigmoid(x.to(rdt) @ self.router.to(rdt).t())  # [N, E]
            experts = torch.topk(scores.detach() + self.expert_bias, self.top_k, dim=-1).indices
            gates = scores.gather(-1, experts)
            gates = gates / gates.sum(-1, keepdim=True)
        return experts, gates, scores

    def _experts(self, x: torch.Tensor, experts: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """Σ_slots gate · Expert(x) for [N, D] tokens routed to ``experts`` [N, k] -> [N, D]."""
        N, k = experts.shape
        flat = experts.reshape(-1)  # [N*k]: slot j of token t is at t*k + j
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        token_of = order // k
        xs = x[token_of]  # [N*k, D], grouped by expert
        outs = []
        for e, xe in enumerate(torch.split(xs, counts)):
            if xe.shape[0] == 0:
                continue
            outs.append((F.silu(xe @ self.w1[e]) * (xe @ self.w3[e])) @ self.w2[e])
        ys = torch.cat(outs) if outs else xs.new_zeros(0, self.d_model)
        # Combine the k slots of each token in fp32 (gates are fp32), then return in the experts' dtype.
        weighted = ys * gates.reshape(-1)[order].unsqueeze(-1)
        out = weighted.new_zeros(N, self.d_model).index_add_(0, token_of, weighted)
        return out.to(ys.dtype)

    def _chunk(self, x: torch.Tensor, seq: torch.Tensor, n_seq: int):
        """One chunk of tokens: x [N, D], seq [N] sequence index of each token.

        Returns (y [N, D], counts [E] int64, per-sequence selection counts [n_seq, E] fp32 and
        normalised-affinity sums [n_seq, E] fp32 (the last two only when the aux loss is on, else None)).
        """
        experts, gates, scores = self.route(x)
        y = self._experts(x, experts, gates)
        if self.shared is not None:
            y = y + self.shared(x).to(y.dtype)
        counts = torch.bincount(experts.reshape(-1), minlength=self.n_experts)
        if self.aux_coef > 0:
            picked = F.one_hot(experts.reshape(-1), self.n_experts).float()  # [N*k, E]
            sel = picked.new_zeros(n_seq, self.n_experts).index_add_(0, seq.repeat_interleave(self.top_k), picked)
            p = scores / scores.sum(-1, keepdim=True)
            psum = p.new_zeros(n_seq, self.n_experts).index_add_(0, seq, p)
            return y, counts, sel, psum
        return y, counts, None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route and run the experts: x [B, T, D] -> [B, T, D].

        Sets ``stats`` and ``aux_loss``; in training mode adds this forward's loads to ``load_counts``.
        The output dtype follows the expert matmuls (x's dtype, or autocast's).
        """
        B, T, D = x.shape
        flat = x.reshape(B * T, D)
        seq = torch.arange(B, device=x.device).repeat_interleave(T)
        ys, sels, psums = [], [], []
        tokens_per_expert = torch.zeros(self.n_experts, dtype=torch.long, device=x.device)
        use_ckpt = self.recompute and torch.is_grad_enabled()
        for start in range(0, B * T, self.chunk_tokens):
            xc, sc = flat[start : start + self.chunk_tokens], seq[start : start + self.chunk_tokens]
            if use_ckpt:
                out = checkpoint(self._chunk, xc, sc, B, use_reentrant=False)
            else:
                out = self._chunk(xc, sc, B)
            ys.append(out[0])
            tokens_per_expert += out[1]
            sels.append(out[2])
            psums.append(out[3])
        y = torch.cat(ys) if ys else flat.new_zeros(0, D)
        if self.training:
            self.load_counts += tokens_per_expert
        mean = tokens_per_expert.float().mean()
        self.stats = {
            "tokens_per_expert": tokens_per_expert.detach(),
            "load_max_over_mean": float(tokens_per_expert.max() / mean) if mean > 0 else 0.0,
        }
        self.aux_loss = None
        if self.aux_coef > 0 and ys:
            # DeepSeek-V3 eq. 17-20, per sequence b: f_e = E/(k T) Σ_t 1[e ∈ TopK_t], P_e = 1/T Σ_t s'_{t,e},
            # L = Σ_e f_e P_e, averaged over the B sequences of this forward.
            f = torch.stack(sels).sum(0) * (self.n_experts / (self.top_k * T))
            p = torch.stack(psums).sum(0) / T
            self.aux_loss = self.aux_coef * (f * p).sum(-1).mean()
        return y.view(B, T, D)

    @torch.no_grad()
    def update_bias(self) -> dict:
        """Auxiliary-loss-free balancing step (DeepSeek-V3): b_e += u · sign(mean_e' load − load_e).

        Uses ``load_counts`` (all-reduce it across data/context-parallel ranks before calling), then
        resets it to zero. A step with no recorded tokens leaves the bias unchanged.

        Returns:
            {"load_max_over_mean": float (0.0 when no tokens), "tokens_per_expert": list[int]}.
        """
        load = self.load_counts.float()
        mean = load.mean()
        self.expert_bias += self.bias_rate * torch.sign(mean - load)
        out = {
            "load_max_over_mean": float(load.max() / mean) if mean > 0 else 0.0,
            "tokens_per_expert": self.load_counts.tolist(),
        }
        self.load_counts.zero_()
        return out
