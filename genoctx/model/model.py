"""HybridLM: GLM-5.3-Flash's text model (transformers ``glm5_next``), fast and memory-bounded.

Design choices (read top to bottom, nanoGPT style):

- The function is the reference's (``Glm5NextTextModel`` + ``lm_head``): embedding copied into ``hc_mult``
  residual streams; per layer a mixer (Kimi Delta Attention for ``"linear_attention"``, NoPE MLA with
  DeepSeek Sparse Attention for ``"indexed_attention"``) and a feed-forward (dense SwiGLU MLP or MoE), each
  pre-norm (``input_layernorm`` / ``post_attention_layernorm``) and wrapped by an mHC hyper-connection
  (``attn_hc`` / ``ffn_hc``); then the mean over streams, the final RMSNorm and ``lm_head``. No positional
  encoding anywhere (KDA layers carry order; the DSA layers are NoPE).
- Module and parameter names are the reference's with the ``model.language_model.`` prefix removed, so an HF
  checkpoint maps one to one (``genoctx.model.hf``).
- The chunk contract (DESIGN.md): ``forward(tokens, cache) -> (logits, cache)``. A long sequence may be fed
  as consecutive chunks, each taking the cache the previous one returned; the result equals one pass.
  This one mechanism serves streaming evaluation, context parallelism and the equivalence tests.
- A "full" DSA layer hands its selection to the next layer; a "shared" DSA layer uses it (``indexer_types``).
- Auxiliary losses (indexer KL, optional MoE balance loss) are collected from the layers after each
  forward (``aux_loss()``); what each layer ran (KDA core, DSA path) is recorded in ``layer_stats()``.
- fp32 islands (the reference's ``_keep_in_fp32_modules_strict``): ``FP32_PARAMETERS`` stay fp32 when the
  model is cast to a half type (``cast_model``; fp64 for an fp64 model); their computations run in fp32 under bf16
  autocast. ``genoctx.model.precision.ISLANDS`` names every fp32 computation (these and the norms, router, softmax
  statistics, indexer scores, loss) and can record the dtype each one ran in during a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .config import DSA, ModelConfig
from .dsa import DeepSeekSparseAttention
from .fp8 import FP8Weight
from .hyper import HyperConnection, expand_streams, reduce_streams
from .init import init_weights, seed_from_generator
from .kda import KimiDeltaAttention
from .moe import MLP, MoE
from .norms import RMSNorm
from .precision import island
from .stats import read_numbers

# Parameter/buffer name suffixes kept in fp32 whatever the model dtype (transformers glm5_next
# ``_keep_in_fp32_modules_strict``).
FP32_PARAMETERS = (
    "e_score_correction_bias",
    "conv1d.weight",
    "dt_bias",
    "A_log",
    "attn_hc.base",
    "attn_hc.scale",
    "ffn_hc.base",
    "ffn_hc.scale",
)


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast floating parameters and buffers to ``dtype`` in place, except ``FP32_PARAMETERS``, which are never
    below fp32 (fp32 for bf16/fp16/fp32, fp64 for an fp64 model, so that fp64 checks are fp64 throughout), and the
    fp8 frozen weights' holders (``genoctx.model.fp8.FP8Weight``: their e4m3 bytes and fp32 scales stay as loaded).
    Returns ``model``."""
    island = torch.promote_types(dtype, torch.float32)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.is_floating_point() or any(part.endswith("_fp8") for part in name.split(".")[:-1]):
            continue
        want = island if name.endswith(FP32_PARAMETERS) else dtype
        if t.dtype != want:
            t.data = t.data.to(want)
    return model


@dataclass
class ModelCache:
    """What one chunk leaves for the next: one entry per layer (``KDACache`` / ``DSACache``) and the number of
    tokens already processed (``position``, tokens)."""

    layers: list = field(default_factory=list)
    position: int = 0

    def map_tensors(self, fn) -> ModelCache:
        """A copy with ``fn`` applied to every floating tensor of every layer's cache (each layer's fields in their
        declaration order, the order of ``tensors``); other fields as they are, and so are the fields a cache type
        names in its ``views`` (views of state held elsewhere, such as ``DSACache.window``: not state of their own)."""

        def _m(c):
            if c is None:
                return None
            skip = getattr(c, "views", ())
            return type(c)(**{k: (fn(v) if torch.is_tensor(v) and v.is_floating_point() and k not in skip else v)
                              for k, v in vars(c).items()})  # fmt: skip

        return ModelCache([_m(c) for c in self.layers], self.position)

    def tensors(self) -> list[torch.Tensor]:
        """Every floating tensor of the layers' caches, in ``map_tensors``' order."""
        return [v for c in self.layers if c is not None for k, v in vars(c).items()
                if torch.is_tensor(v) and v.is_floating_point() and k not in getattr(c, "views", ())]  # fmt: skip

    def detach(self) -> ModelCache:
        """A copy whose tensors are cut from the autograd graph (truncated backprop across chunks)."""
        return self.map_tensors(torch.Tensor.detach)


class DecoderLayer(nn.Module):
    """One mixer and one feed-forward, each pre-norm and wrapped by mHC (``Glm5NextTextDecoderLayer``)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_type = cfg.layer_types[layer_idx]
        D = cfg.hidden_size
        self.self_attn = DeepSeekSparseAttention(cfg, layer_idx) if self.layer_type == DSA else KimiDeltaAttention(cfg)
        if cfg.mlp_layer_types[layer_idx] == "sparse":
            self.mlp = MoE(cfg)
        else:
            self.mlp = MLP(D, cfg.intermediate_size, cfg.swiglu_limit, cfg.initializer_range)
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        hc = dict(sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps,
                  init_std=cfg.initializer_range)  # fmt: skip
        self.attn_hc = HyperConnection(D, cfg.hc_mult, **hc)
        self.ffn_hc = HyperConnection(D, cfg.hc_mult, **hc)

    def forward(self, x: torch.Tensor, cache=None, selection=None):
        """x: [B, T, n, D] residual streams -> ([B, T, n, D], this layer's new cache, the selection for the next
        layer (a DSA layer's own; a KDA layer passes None, as the reference's ``prev_topk_indices``))."""
        h, coeffs = self.attn_hc.pre(x)
        h = self.input_layernorm(h)
        if self.layer_type == DSA:
            y, cache, selection = self.self_attn(h, cache, selection)
        else:
            y, cache = self.self_attn(h, cache)
            selection = None
        x = self.attn_hc.post(x, y, coeffs)
        h, coeffs = self.ffn_hc.pre(x)
        x = self.ffn_hc.post(x, self.mlp(self.post_attention_layernorm(h)), coeffs)
        return x, cache, selection


class HybridLM(nn.Module):
    """GLM-5.3-Flash text model with its language-model head.

    Parameters: ``embed_tokens``, ``layers.{i}.*``, ``norm``, ``lm_head`` (reference names without the
    ``model.language_model.`` prefix).

    Args:
        cfg: the architecture (``ModelConfig``).
    """

    def __init__(self, cfg: ModelConfig, seed: int | None = None):
        super().__init__()
        self.cfg = cfg
        # The model's init seed: given, or the first draw of torch's global generator, so that torch.manual_seed(s)
        # then HybridLM(cfg) equals genoctx.parallel.build.build_model after torch.manual_seed(s), on any mesh.
        self.init_seed = seed_from_generator() if seed is None else int(seed)
        device = torch.empty(0).device  # the ambient device (``with torch.device("meta"):`` builds without memory)
        with torch.device("meta"):  # built without memory, then allocated once and drawn layout-free
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        if device.type != "meta":
            self.materialize(device)
            # From scratch (genoctx.model.init): a unit-scale embedding (every layer input is RMS-normalised) and a
            # small head, so the first logits are near 0 and the first loss near ln(vocab). Tied (one matrix for
            # both), it takes the head's scale, the reference's initializer_range.
            init_weights(self, self.init_seed)

    def materialize(self, device: str | torch.device) -> None:
        """``to_empty(device)`` (values undefined: fill them next) that keeps what parallelism and the optimizer
        read from parameters: their Python attributes (``_genoctx_expert``, ``_no_weight_decay``; ``to_empty`` from
        the meta device makes new parameters) and the tied head."""
        marks = {n: dict(vars(p)) for n, p in self.named_parameters() if vars(p)}
        self.to_empty(device=device)
        for n, p in self.named_parameters():
            for k, v in marks.get(n, {}).items():
                setattr(p, k, v)
        self.tie_weights()

    def tie_weights(self) -> None:
        """``lm_head.weight`` is ``embed_tokens.weight`` when ``tie_word_embeddings`` (again after ``to_empty``,
        which may replace parameters)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, tokens: torch.Tensor, cache: ModelCache | None = None) -> tuple[torch.Tensor, ModelCache]:
        """Run one chunk.

        Args:
            tokens: [B, T] int64 token ids (inputs; for a window, ``<bos>`` followed by its first W-1 bases).
            cache: what the previous chunk returned, or None at the start of a sequence.

        Returns:
            (logits [B, T, vocab_size] fp32 (fp64 for an fp64 model), the cache for the next chunk).
        """
        h, cache = self.hidden(tokens, cache)
        logits = self.lm_head(h)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return logits, cache

    def hidden(self, tokens: torch.Tensor, cache: ModelCache | None = None) -> tuple[torch.Tensor, ModelCache]:
        """``forward`` without the head: the final hidden states (after the stream collapse and the final RMSNorm),
        for a head applied in chunks over a large vocabulary (``genoctx.model.head.head_token_losses``).

        Args:
            tokens: [B, T] int64 token ids; cache: as for ``forward``.

        Returns:
            (hidden [B, T, hidden_size] in the model's dtype, the cache for the next chunk).
        """
        layer_caches = cache.layers if cache is not None else [None] * len(self.layers)
        position = cache.position if cache is not None else 0
        x = expand_streams(self.embed_tokens(tokens), self.cfg.hc_mult)
        new_caches, selection = [], None
        for layer, c in zip(self.layers, layer_caches, strict=True):
            x, c, selection = layer(x, c, selection)
            new_caches.append(c)
        return self.norm(reduce_streams(x)), ModelCache(new_caches, position + tokens.shape[1])

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
        (KDA ``path``; DSA ``path``, ``indexer``, ``keys_scored``, ``keys_attended``, ``indexer_loss``) and, for
        MoE layers, ``moe_tokens_per_expert`` (list of E ints: token-slots routed to each expert in that forward)
        and ``moe_load_max_over_mean`` (max / mean of that list; 1.0 = perfectly balanced); under expert parallelism
        also the dispatch's ``ep_received_rows``, ``ep_max_round_rows`` and ``ep_rounds`` (genoctx.parallel.experts)."""
        out = []
        for i, layer in enumerate(self.layers):
            s = {"layer": i, "mixer": "dsa" if layer.layer_type == DSA else "kda"}
            s.update(getattr(layer.self_attn, "stats", None) or {})  # device tensors until read below
            fs = getattr(layer.mlp, "stats", None)
            if fs:
                s["moe_load_max_over_mean"] = fs.get("load_max_over_mean")
                s["moe_tokens_per_expert"] = fs.get("tokens_per_expert")
                s.update({k: v for k, v in fs.items() if k.startswith("ep_")})  # expert-parallel dispatch, if any
            out.append(s)
        return read_numbers(out, label="layer_stats")  # every layer's tensors in one host copy (genoctx.model.host)

    @torch.no_grad()
    def update_router_biases(self, read_now: bool = True, update: bool = True) -> list[dict]:
        """Aux-loss-free MoE balancing step (DeepSeek-V3), called after each optimizer step: ``MoE.update_bias`` of
        every MoE layer, its statistics read in one host copy (``read_now``; else left as device tensors for the
        caller's own combined read, ``genoctx.model.stats.read_numbers``). ``update=False``: the biases are left as
        they are (a frozen router), the statistics read and the load counts reset as in a balancing step."""
        out = [layer.mlp.update_bias(read_now=False, update=update) for layer in self.layers
               if isinstance(layer.mlp, MoE)]  # fmt: skip
        return read_numbers(out, label="moe_bias") if read_now else out

    def num_parameters(self) -> dict:
        """Parameter counts: ``total`` and ``active`` per token (total minus, in every MoE layer, the
        ``n_routed_experts - num_experts_per_tok`` routed experts a token does not use). Works on the meta
        device (no memory) for large presets."""
        total = sum(p.numel() for p in self.parameters())
        total += sum(m.weight.numel() for m in self.modules() if isinstance(m, FP8Weight))  # frozen fp8 weights
        cfg = self.cfg
        per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        n_moe = sum(isinstance(layer.mlp, MoE) for layer in self.layers)
        active = total - n_moe * (cfg.n_routed_experts - cfg.num_experts_per_tok) * per_expert
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
    island("loss.logits", logits)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return island("loss.tokens", ce.view_as(targets) * scored.to(ce.dtype))
