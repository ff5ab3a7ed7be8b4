"""Feed-forward layers of GLM-5.3-Flash: a dense SwiGLU MLP and the DeepSeek-V3 style mixture of experts.

As transformers ``glm5_next`` (``Glm5NextTextMLP``, ``Glm5NextTextTopkRouter``, ``Glm5NextTextExperts``,
``Glm5NextTextMoE``), with DeepSeek-V3's routing (arXiv:2412.19437, section 2.1.2):

    SwiGLU(x) = down(silu(min(gate x, limit)) * clamp(up x, -limit, limit))        limit = swiglu_limit
    s_{t,e}   = sigmoid(x_t · w_e)                                   router affinity, fp32
    c_{t,e}   = s_{t,e} + b_e                                        b = e_score_correction_bias (selection only)
    groups    = the topk_group of n_group groups with the largest sum of their top-2 c
    TopK_t    = top num_experts_per_tok of c over the experts of those groups
    g_{t,e}   = s_{t,e} / (Σ_{j ∈ TopK_t} s_{t,j} + 1e-20) · routed_scaling_factor   (without the division
                when norm_topk_prob is false)
    y_t       = Σ_{e ∈ TopK_t} g_{t,e} · Expert_e(x_t) + Shared(x_t)

Design choices:

- Weights as the reference stores them: ``experts.gate_up_proj`` [E, 2I, D] (gate rows first),
  ``experts.down_proj`` [E, D, I], router ``gate.weight`` [E, D] and buffer ``gate.e_score_correction_bias``
  [E] (fp32 island), ``shared_experts`` a SwiGLU MLP of width ``moe_intermediate_size * n_shared_experts``.
- Dispatch sorts the (token, slot) pairs by expert and runs the routed experts as two grouped matrix products
  over all experts (``torch._grouped_mm``: gate_up, one SwiGLU over every row, down; ``Experts.forward_grouped``),
  or, where those cannot run (fp64, LoRA, fp8 experts, ``torch.compile``, CUDA without the bf16 sm90 kernel;
  ``Experts.path``, recorded in ``stats["experts"]``), each expert once on its contiguous slice
  (``forward_loop``, the reference); then scatters back with ``index_add_`` (``train.deterministic``: a fixed-order
  sum over each token's slots, ``combine_slots``; recorded in ``stats["combine"]``). No python loop over tokens.
- SwiGLU as one autograd Function (``swiglu_fused`` / ``swiglu_packed``): saves its inputs, hand-written backward,
  the same bits as ``swiglu``.
- Sequence-chunked dispatch: the [B·T] tokens go through in chunks of ``moe_chunk_tokens``; with grad enabled
  and ``recompute=True`` each chunk is checkpointed, so only one chunk's expert activations are alive.
- Hooks for expert parallelism (``genoctx.parallel.experts``, applied from outside): ``MoE._local`` (router,
  shared expert and loads of a chunk), ``MoE._record`` (statistics) and ``expert_mlp`` (one expert's math).
- Auxiliary-loss-free balancing (DeepSeek-V3): loads are counted into ``load_counts`` in training mode;
  ``update_bias()`` (called after each optimizer step, after the loads are all-reduced across ranks) moves
  ``e_score_correction_bias`` by ``router_bias_rate · sign(mean − load_e)``.
- Optional sequence-wise balance loss (DeepSeek-V3 eq. 17-20) when ``moe_aux_loss_coef > 0``.
- Aten ops (cpu-small's shape: fp32, grad on, training mode) for ``n`` token chunks: grouped ``21 + 49 n`` forward,
  ``4 + 181 n`` backward (recompute included), ``20 + 49 n`` no-grad eval, whatever the experts; the loop adds
  ``10 A`` / ``50 A`` / ``10 A`` for ``A`` experts with rows summed over the chunks (``21 + 46 n + 10 A``,
  ``4 + 187 n + 50 A``, ``20 + 46 n + 10 A``; ``tests/model/test_moe.py::test_op_counts_per_chunk``).
- Host reads (``genoctx.model.host``): none on the grouped path (the groups' offsets stay on the device); the loop
  reads once per token chunk the experts' row counts that ``torch.split`` needs (in training twice: forward and the
  checkpoint's recomputation). Loads and the load ratio stay on the device until ``HybridLM.layer_stats`` /
  ``update_router_biases`` read every layer's in one copy.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import flop_counter
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig
from .fp8 import held, linear
from .host import read
from .precision import island
from .stats import host_number, read_numbers


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` (``Glm5NextTextExperts._apply_gate``); same dtype.
    Plain autograd: the reference of ``swiglu_fused`` / ``swiglu_packed``."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def _swiglu_grads(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, limit: float):
    """(dL/dgate, dL/dup) of ``swiglu`` for its output gradient ``dh``: the values autograd computes for it (clamp's
    gradient passes where the input is inside the limits, bounds included), in 10 aten ops."""
    gc, uc = gate.clamp(max=limit), up.clamp(-limit, limit)
    d_up = (dh * F.silu(gc)).masked_fill_(uc != up, 0)
    d_gate = torch.ops.aten.silu_backward(dh * uc, gc).masked_fill_(gc != gate, 0)
    return d_gate, d_up


class _SwiGLU(torch.autograd.Function):
    """``swiglu`` with a hand-written backward that saves only its inputs (2 tensors where autograd saves 5)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.limit = limit
        return swiglu(gate, up, limit)

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        gate, up = ctx.saved_tensors
        return *_swiglu_grads(dh, gate, up, ctx.limit), None


class _SwiGLUPacked(torch.autograd.Function):
    """``swiglu`` of the halves of one ``[..., 2I]`` tensor (gate first): saves that tensor, returns its gradient
    as one tensor (one ``cat``), with no slice gradients to add."""

    @staticmethod
    def forward(ctx, gu: torch.Tensor, limit: float) -> torch.Tensor:
        ctx.save_for_backward(gu)
        ctx.limit = limit
        gate, up = gu.chunk(2, dim=-1)
        h = F.silu(gate.clamp(max=limit), inplace=True)  # in place: 2 [..., I] temporaries besides gu, not 3
        return h.mul_(up.clamp(-limit, limit))

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        (gu,) = ctx.saved_tensors
        gate, up = gu.chunk(2, dim=-1)
        return torch.cat(_swiglu_grads(dh, gate, up, ctx.limit), dim=-1), None


def swiglu_fused(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``swiglu(gate, up, limit)`` (same values, bit for bit, forward and backward) as one autograd Function: 4 aten
    ops forward, 10 backward, 2 tensors saved (autograd's ``swiglu``: 11 backward, 5 saved; each saved tensor also
    costs a checkpoint's recomputation two ``detach``). gate, up: [..., I], same shape and dtype -> [..., I]."""
    return _SwiGLU.apply(gate, up, limit)


def swiglu_packed(gu: torch.Tensor, limit: float) -> torch.Tensor:
    """``swiglu(gu[..., :I], gu[..., I:], limit)`` for gu [..., 2I] (gate half first) -> [..., I], as one autograd
    Function saving only ``gu`` (the experts' ``gate_up_proj`` output): same values as the reference, bit for bit."""
    return _SwiGLUPacked.apply(gu, limit)


class MLP(nn.Module):
    """Clamped SwiGLU feed-forward (``Glm5NextTextMLP``): ``down_proj(swiglu(gate_proj x, up_proj x))``.

    Args:
        hidden_size: D, input and output channels.
        intermediate_size: I, hidden channels.
        swiglu_limit: clamp limit of the gate (above) and up (both sides) projections.
        init_std: std of the normal init of the three weights.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float = 10.0, init_std: float = 0.02):
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(lin.weight, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] -> [..., D] (same dtype, or autocast's)."""
        return self.down_proj(swiglu_fused(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))


class TopkRouter(nn.Module):
    """Sigmoid router with group-limited top-k and a selection-only bias (``Glm5NextTextTopkRouter``).

    Parameters: ``weight`` [E, D]; buffer ``e_score_correction_bias`` [E] fp32 (persistent).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, D = cfg.n_routed_experts, cfg.hidden_size
        self.n_experts, self.top_k = E, cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.randn(E, D) * cfg.initializer_range)
        self.register_buffer("e_score_correction_bias", torch.zeros(E), persistent=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route tokens.

        Args:
            x: [N, D] tokens.

        Returns:
            (experts [N, k] int64, weights [N, k] fp32 (fp64 for fp64 input) = normalised affinities times
            ``routed_scaling_factor``, scores [N, E] = sigmoid affinities). Gradients reach ``weight`` through
            ``weights`` and ``scores``, never the bias; selection runs without grad.
        """
        with torch.autocast(device_type=x.device.type, enabled=False):
            rdt = torch.float64 if x.dtype == torch.float64 else torch.float32  # promote_types: an aten op
            scores = island("moe.router.scores", torch.sigmoid(F.linear(x.to(rdt), self.weight.to(rdt))))  # [N, E]
            experts = self.select(scores)
            weights = scores.gather(-1, experts)
            if self.norm_topk_prob:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
            weights = island("moe.router.weights", weights * self.routed_scaling_factor)
        return experts, weights, scores

    @torch.no_grad()
    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """The experts of each token: scores [N, E] (fp32 affinities) -> [N, k] int64, the top ``k`` of
        ``scores + e_score_correction_bias`` among the experts of the ``topk_group`` best groups (no grad)."""
        choice = scores + self.e_score_correction_bias.to(scores.dtype)
        if self.n_group > 1:
            N, E, G = choice.shape[0], self.n_experts, self.n_group
            grouped = choice.view(N, G, E // G)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1, sorted=False).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(N, E)
        return island("moe.router.topk", choice).topk(self.top_k, dim=-1, sorted=False).indices


def expert_mlp(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float, lora: tuple | None = None
) -> torch.Tensor:
    """One routed expert: ``down · swiglu(gate x, up x)`` for x [n, D], ``gate_up`` [2I, D] (gate rows first),
    ``down`` [D, I] -> [n, D] in x's dtype (or autocast's). Also run by expert parallelism on received rows.

    ``lora`` (optional, ``genoctx.model.lora``): this expert's adapters ``(A_gu [r, D], B_gu [2I, r], A_dn [r, I],
    B_dn [D, r], scale)`` (a pair may be None: that projection has none); each adapted projection adds the low-rank
    term ``scale · (h A^T) B^T`` to ``h W^T``, i.e. it runs ``W + scale · B A`` without forming it.

    ``gate_up`` / ``down`` may be an fp8 expert (``genoctx.model.fp8.FP8View``, ``train.frozen_dtype: fp8``): then
    ``fp8_linear`` dequantizes this expert's weight in forward and again in backward, never keeping it.
    """
    I = down.shape[1]
    gu = linear(x, gate_up)
    if lora is not None and lora[0] is not None:
        gu = gu + lora[4] * F.linear(F.linear(x, lora[0]), lora[1])
    h = swiglu(gu[:, :I], gu[:, I:], limit)
    y = linear(h, down)
    if lora is not None and lora[2] is not None:
        y = y + lora[4] * F.linear(F.linear(h, lora[2]), lora[3])
    return y


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of ``torch._grouped_mm`` (``torch.utils.flop_counter`` has no formula for it): ``2 M K N`` summed over
    the groups, i.e. ``2 x (output elements) x K`` with K the contraction length, except for 2D x 2D (the weights'
    gradient, groups along K: ``2 M K_total N``). Rows past ``offs[-1]`` are counted (``Experts`` leaves none)."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    out = 1
    for d in out_shape:
        out *= d
    return 2 * out * a_shape[-1]


if torch.ops.aten._grouped_mm not in flop_counter.flop_registry:  # FlopCounterMode (the planner's FLOP tests)
    flop_counter.register_flop_formula(torch.ops.aten._grouped_mm)(_grouped_mm_flops)


EXPERT_PATHS = ("grouped_mm", "loop")  # Experts.path: one grouped product per projection / one product per expert
COMBINES = ("index_add", "slot_sum")  # the MoE combine: float atomics on CUDA / a fixed-order sum (deterministic)


def combine_path() -> str:
    """The combine ``Experts`` and expert parallelism run: ``"slot_sum"`` while
    ``torch.are_deterministic_algorithms_enabled()`` (``train.deterministic``), else ``"index_add"``."""
    return "slot_sum" if torch.are_deterministic_algorithms_enabled() else "index_add"


def combine_slots(weighted: torch.Tensor, slots: torch.Tensor, n_tokens: int, k: int, path: str) -> torch.Tensor:
    """Sum each token's ``k`` weighted expert outputs: rows ``weighted [n, D]`` of the flat slots ``slots [n]`` (slot
    ``j`` of token ``t`` is ``t k + j``; each slot at most once) -> ``[n_tokens, D]`` in weighted's dtype (a token
    with no row gets 0).

    ``path`` (``COMBINES``): ``"index_add"`` adds the rows into their tokens (``index_add_``: float atomics on CUDA,
    the order of the additions varies from run to run); ``"slot_sum"`` places them in a ``[n_tokens, k, D]`` buffer
    (``index_copy_``, each slot written once) and sums over the slots in slot order: the same bits every run, forward
    and backward (both gathers), for ``k`` times the buffer. Equal to fp32 rounding.
    """
    D = weighted.shape[-1]
    if path == "index_add":
        return weighted.new_zeros(n_tokens, D).index_add_(0, slots // k, weighted)
    if path != "slot_sum":
        raise ValueError(f"combine_slots: path must be one of {COMBINES}, got {path!r}")
    buf = weighted.new_zeros(n_tokens * k, D).index_copy(0, slots, weighted)
    return buf.view(n_tokens, k, D).sum(1)


class Experts(nn.Module):
    """Routed experts stored as ``gate_up_proj`` [E, 2I, D] and ``down_proj`` [E, D, I] (``Glm5NextTextExperts``).

    ``grouped`` (class attribute, True): take ``forward_grouped`` where ``path`` allows it; False runs the reference
    ``forward_loop`` everywhere (tests set it to compare the two and to count the loop's host reads).
    """

    grouped = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.n_experts, self.hidden_size, self.intermediate_size = E, D, I
        self.swiglu_limit = cfg.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, D) * cfg.initializer_range)
        self.down_proj = nn.Parameter(torch.randn(E, D, I) * cfg.initializer_range)
        self.combine = "index_add"  # the combine the last forward ran (combine_path)
        self.last_path = "grouped_mm"  # the dispatch the last forward ran (path)
        self.lora_scale: float | None = None  # alpha / rank once genoctx.model.lora.apply_lora adds adapters

    def adapter(self, e: int) -> tuple | None:
        """Expert ``e``'s LoRA adapters for ``expert_mlp`` (``(A_gu, B_gu, A_dn, B_dn, scale)``, views of
        ``{gate_up_proj,down_proj}_lora_{A,B}`` [E, ...]; a pair is None where that projection has none), or None
        without adapters."""
        if self.lora_scale is None:
            return None
        gu_a, gu_b = getattr(self, "gate_up_proj_lora_A", None), getattr(self, "gate_up_proj_lora_B", None)
        dn_a, dn_b = getattr(self, "down_proj_lora_A", None), getattr(self, "down_proj_lora_B", None)
        return (*(None if t is None else t[e] for t in (gu_a, gu_b, dn_a, dn_b)), self.lora_scale)

    def expert_weight(self, name: str, e: int):
        """Expert ``e``'s ``name`` (``gate_up_proj`` / ``down_proj``) for ``expert_mlp``: the parameter's row ``e``,
        or, for a weight kept in fp8 (``genoctx.model.fp8``), that expert's fp8 view: dequantized per expert, per
        use, by ``expert_mlp``, never the whole ``[E, ...]`` stack."""
        h = held(self, name)
        return h[e] if h is not None else getattr(self, name)[e]

    def expert_weights(self, name: str):
        """Every expert's ``name`` at once, indexable by expert (``expert_weight(name, e)`` for all ``e``): the fp8
        holder, or the parameter's ``unbind(0)``: one aten op forward and one ``stack`` backward per dispatch, where
        ``E`` selects cost ``E`` ops forward and, in backward, ``E`` full-size ``select_backward`` tensors and their
        ``E - 1`` additions (the same gradient: each expert's rows are written once)."""
        h = held(self, name)
        return h if h is not None else getattr(self, name).unbind(0)

    def path(self, x: torch.Tensor) -> str:
        """The dispatch ``forward`` runs for tokens ``x`` (``EXPERT_PATHS``; recorded in ``MoE.stats["experts"]``).

        ``"grouped_mm"`` (``forward_grouped``) where ``torch._grouped_mm`` takes the operands: compute dtype (x's, or
        autocast's) fp32, bf16 or fp16 (it refuses fp64), rows of ``D`` and ``I`` elements a multiple of 16 bytes, no
        LoRA adapter and no fp8 holder on the experts, not under ``torch.compile`` (its meta function admits bf16
        only), and on CUDA only bf16 on sm90+ (torch's fused kernel; its fallback for other dtypes and GPUs loops
        over the groups with the offsets copied to the host: a hidden sync, so the loop's labelled read is kept
        there). Otherwise ``"loop"`` (``forward_loop``, the reference)."""
        dev = x.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) and x.dtype != torch.float64 else x.dtype
        size = torch.empty((), dtype=dt).element_size() if dt.is_floating_point else 0
        ok = (
            dt in (torch.float32, torch.bfloat16, torch.float16)
            and (self.hidden_size * size) % 16 == 0
            and (self.intermediate_size * size) % 16 == 0
            and self.lora_scale is None
            and held(self, "gate_up_proj") is None
            and held(self, "down_proj") is None
            and not torch.compiler.is_compiling()
            and (
                dev == "cpu"
                or (dev == "cuda" and dt == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0))
            )
        )
        return "grouped_mm" if ok and self.grouped else "loop"

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``Σ_slots weight · Expert(x)`` for [N, D] tokens routed to ``experts`` [N, k] -> [N, D] in x's dtype
        (or autocast's); slots are combined in the weights' dtype (fp32). Runs ``forward_grouped`` or
        ``forward_loop`` (``path``; the one that ran is ``self.last_path``): equal to fp32 rounding."""
        self.last_path = self.path(x)
        fn = self.forward_grouped if self.last_path == "grouped_mm" else self.forward_loop
        return fn(x, experts, weights)

    def forward_grouped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``forward`` as two grouped matrix products over all experts (``torch._grouped_mm``): the (token, slot)
        rows sorted by expert, ``gate_up`` over every row in one product, one ``swiglu``, ``down`` in one product.
        The groups' ends ``offs`` [E] int32 (cumulative rows, by ``searchsorted`` on the sorted ids) stay on the
        device: no host read, and 5 + 2 ops for the dispatch whatever the number of experts. Inputs as ``forward``;
        requires ``path(x) == "grouped_mm"`` (``torch._grouped_mm`` raises RuntimeError on fp64 or misaligned rows).
        Reference: ``forward_loop`` (the same math, one ``expert_mlp`` per expert)."""
        N, k = experts.shape
        E = self.n_experts
        ids, order = experts.reshape(-1).sort(stable=True)  # [N*k]: slot j of token t is at t*k + j
        offs = torch.searchsorted(ids, torch.arange(E, device=ids.device), right=True, out_int32=True)
        xs = x[order // k]  # [N*k, D], grouped by expert
        gu_w, dn_w = self.gate_up_proj, self.down_proj
        dev = x.device.type
        if torch.is_autocast_enabled(dev):  # what F.linear would run under autocast (the loop's dtype)
            dt = torch.get_autocast_dtype(dev)
            xs, gu_w, dn_w = xs.to(dt), gu_w.to(dt), dn_w.to(dt)
        # without grad each [N*k, ...] temporary goes as soon as the next exists (plan.sizes._moe_fwd's working set)
        gu = torch._grouped_mm(xs, gu_w.transpose(-2, -1), offs=offs)  # [N*k, 2I]
        del xs
        h = swiglu_packed(gu, self.swiglu_limit)  # [N*k, I]
        del gu
        ys = torch._grouped_mm(h, dn_w.transpose(-2, -1), offs=offs)  # [N*k, D]
        del h
        weighted = island("moe.combine", ys * weights.reshape(-1)[order].unsqueeze(-1))
        self.combine = combine_path()
        return combine_slots(weighted, order, N, k, self.combine).to(ys.dtype)

    def forward_loop(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``forward`` by one ``expert_mlp`` per expert with rows (the reference of ``forward_grouped``; the path
        for fp64, LoRA adapters, fp8 experts, ``torch.compile`` and CUDA without the fused grouped kernel). One host
        read per call: the experts' row counts that ``torch.split`` needs (``genoctx.model.host``, "moe.split")."""
        N, k = experts.shape
        flat = experts.reshape(-1)  # [N*k]: slot j of token t is at t*k + j
        order = torch.argsort(flat, stable=True)
        # the split sizes on the host: the one read this dispatch needs (genoctx.model.host; index_add_, not bincount,
        # whose CUDA kernel reads the max first: a second sync)
        counts = read(flat.new_zeros(self.n_experts).index_add_(0, flat, torch.ones_like(flat)), label="moe.split")
        token_of = order // k
        xs = x[token_of]  # [N*k, D], grouped by expert
        gus, dns = self.expert_weights("gate_up_proj"), self.expert_weights("down_proj")
        outs = [
            expert_mlp(xe, gus[e], dns[e], self.swiglu_limit, self.adapter(e))
            for e, xe in enumerate(torch.split(xs, counts))
            if xe.shape[0]
        ]
        empty = xs.new_zeros(0, self.hidden_size) if not outs else None
        del xs  # without grad the rows go before the concatenation (the working set plan.sizes._moe_fwd counts)
        ys = torch.cat(outs) if outs else empty
        del outs
        weighted = island("moe.combine", ys * weights.reshape(-1)[order].unsqueeze(-1))
        self.combine = combine_path()
        return combine_slots(weighted, order, N, k, self.combine).to(ys.dtype)


class MoE(nn.Module):
    """Mixture of experts with a shared expert (``Glm5NextTextMoE``): ``gate``, ``experts``, ``shared_experts``.

    Args:
        cfg: uses ``hidden_size``, ``n_routed_experts`` (E), ``num_experts_per_tok`` (k),
            ``moe_intermediate_size``, ``n_shared_experts``, ``n_group``, ``topk_group``, ``norm_topk_prob``,
            ``routed_scaling_factor``, ``swiglu_limit``, ``moe_chunk_tokens``, ``router_bias_rate``,
            ``moe_aux_loss_coef``, ``initializer_range``.
        recompute: checkpoint each token chunk when grad is enabled (bounded activation memory).

    Attributes set by ``forward``:
        stats: {"tokens_per_expert": LongTensor [E] (this forward), "load_max_over_mean": 0-dim fp32 tensor} (device
            tensors: no host read per layer; ``HybridLM.layer_stats`` reads them).
        aux_loss: the sequence-wise balance loss x ``moe_aux_loss_coef`` (scalar fp32), or None.
        last_selection: with the balance loss on, each sequence's expert selection counts ``[B, E]`` of this
            forward (fp32), else None.

    Set from outside:
        window_selection: ``(selection counts [B, E], window tokens L)`` of the whole window, or None. When set, the
            balance loss takes its ``f`` from it instead of from this forward's tokens, so that over the chunks of a
            window (``genoctx.train.chunked``) ``aux_loss x T_c / L`` sums to the whole window's loss exactly.

    Buffers:
        load_counts: [E] int64, tokens routed to each expert since the last ``update_bias()`` (training mode
            only; not saved).
    """

    def __init__(self, cfg: ModelConfig, recompute: bool = True):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.chunk_tokens = cfg.moe_chunk_tokens
        self.bias_rate = cfg.router_bias_rate
        self.aux_coef = cfg.moe_aux_loss_coef
        self.recompute = recompute
        self.gate = TopkRouter(cfg)
        self.experts = Experts(cfg)
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = (
            MLP(cfg.hidden_size, shared, cfg.swiglu_limit, cfg.initializer_range) if shared > 0 else None
        )
        self.register_buffer("load_counts", torch.zeros(self.n_experts, dtype=torch.long), persistent=False)
        self.stats: dict = {}
        self.aux_loss: torch.Tensor | None = None
        self.last_selection: torch.Tensor | None = None
        self.window_selection: tuple[torch.Tensor, int] | None = None

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, top_k={self.top_k}, chunk_tokens={self.chunk_tokens}"

    def _local(self, x: torch.Tensor, seq: torch.Tensor, n_seq: int):
        """Everything of one chunk but the routed experts (the hook expert parallelism reuses): x [N, D], seq [N]
        sequence index of each token.

        Returns (experts [N, k] int64, weights [N, k] fp32 (``TopkRouter``), shared expert output [N, D] or None,
        counts [E] int64, per-sequence selection counts [n_seq, E] and normalised-affinity sums [n_seq, E] (the
        last two only when the aux loss is on, else None)).
        """
        experts, weights, scores = self.gate(x)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        flat = experts.reshape(-1)  # counted into [E] (bincount's length would depend on the data under compile)
        counts = flat.new_zeros(self.n_experts).index_add_(0, flat, torch.ones_like(flat))
        sel = psum = None
        if self.aux_coef > 0:
            picked = F.one_hot(experts.reshape(-1), self.n_experts).to(scores.dtype)  # [N*k, E]
            sel = picked.new_zeros(n_seq, self.n_experts).index_add_(0, seq.repeat_interleave(self.top_k), picked)
            p = scores / scores.sum(-1, keepdim=True)
            psum = p.new_zeros(n_seq, self.n_experts).index_add_(0, seq, p)
        return experts, weights, shared, counts, sel, psum

    def _chunk(self, x: torch.Tensor, seq: torch.Tensor, n_seq: int):
        """One chunk of tokens: x [N, D], seq [N] sequence index of each token.

        Returns (y [N, D], counts [E] int64, per-sequence selection counts [n_seq, E] and normalised-affinity
        sums [n_seq, E] (the last two only when the aux loss is on, else None)).
        """
        experts, weights, shared, counts, sel, psum = self._local(x, seq, n_seq)
        y = self.experts(x, experts, weights)
        if shared is not None:
            y = y + shared.to(y.dtype)
        return y, counts, sel, psum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route and run the experts: x [B, T, D] -> [B, T, D].

        Sets ``stats`` and ``aux_loss``; in training mode adds this forward's loads to ``load_counts``.
        """
        B, T, D = x.shape
        flat = x.reshape(B * T, D)
        seq = torch.arange(B, device=x.device).repeat_interleave(T)
        ys, sels, psums = [], [], []
        tokens_per_expert = torch.zeros(self.n_experts, dtype=torch.long, device=x.device)
        use_ckpt = self.recompute and torch.is_grad_enabled()
        # split, not slices: a slice's backward writes its gradient into a zero tensor of the whole input, so n chunks
        # cost n full-size zero fills and n - 1 full-size additions (O(T^2 / chunk) bytes); split's backward joins the
        # chunks' gradients once
        for xc, sc in zip(flat.split(self.chunk_tokens), seq.split(self.chunk_tokens), strict=True):
            out = checkpoint(self._chunk, xc, sc, B, use_reentrant=False) if use_ckpt else self._chunk(xc, sc, B)
            ys.append(out[0])
            tokens_per_expert += out[1]
            sels.append(out[2])
            psums.append(out[3])
        y = torch.cat(ys) if ys else flat.new_zeros(0, D)
        self._record(tokens_per_expert, sels, psums, T)
        return y.view(B, T, D)

    def _record(self, tokens_per_expert: torch.Tensor, sels: list, psums: list, T: int) -> None:
        """After a forward over B sequences of T tokens: add the loads [E] to ``load_counts`` (training mode), set
        ``stats`` and ``aux_loss`` from the chunks' per-sequence selection counts and affinity sums (``_local``)."""
        if self.training:
            self.load_counts += tokens_per_expert
        mean = tokens_per_expert.float().mean()
        ratio = torch.where(mean > 0, tokens_per_expert.max() / mean, 0.0)  # no branch on a tensor (compile)
        self.stats = {
            "tokens_per_expert": tokens_per_expert.detach(),
            "load_max_over_mean": host_number(ratio, float),
            "combine": getattr(self.experts, "combine", None),  # index_add / slot_sum (train.deterministic)
            "experts": getattr(self.experts, "last_path", None),  # grouped_mm / loop (Experts.path)
        }
        self.aux_loss = self.last_selection = None
        if self.aux_coef > 0 and sels:
            # DeepSeek-V3 eq. 17-20, per sequence b: f_e = E/(k T) Σ_t 1[e ∈ TopK_t], P_e = 1/T Σ_t s'_{t,e},
            # L = Σ_e f_e P_e, averaged over the B sequences of this forward.
            self.last_selection = torch.stack(sels).sum(0).detach()
            sel, n = (self.last_selection, T) if self.window_selection is None else self.window_selection
            f = sel * (self.n_experts / (self.top_k * n))
            p = torch.stack(psums).sum(0) / T
            self.aux_loss = self.aux_coef * (f * p).sum(-1).mean()

    @torch.no_grad()
    def update_bias(self, read_now: bool = True, update: bool = True) -> dict:
        """Auxiliary-loss-free balancing step (DeepSeek-V3) on ``gate.e_score_correction_bias``:
        b_e += u · sign(mean load − load_e), from ``load_counts`` (all-reduce it across ranks first), which is
        then reset. A step with no recorded tokens leaves the bias unchanged; so does ``update=False`` (a frozen
        router: the statistics and the reset only).

        Returns:
            {"load_max_over_mean": float (0.0 when no tokens), "tokens_per_expert": list[int]}: one host read. With
            ``read_now=False`` the same as device tensors (0-dim fp32, [E] int64) and no read
            (``HybridLM.update_router_biases`` reads every layer's in one copy).
        """
        load = self.load_counts.float()
        mean = load.mean()
        if update:
            bias = self.gate.e_score_correction_bias
            bias += (self.bias_rate * torch.sign(mean - load)).to(bias.dtype)
        out = {
            "load_max_over_mean": torch.where(mean > 0, load.max() / mean, 0.0),  # no branch on a device value
            "tokens_per_expert": self.load_counts.clone(),
        }
        self.load_counts.zero_()
        return read_numbers([out], label="moe.bias")[0] if read_now else out
