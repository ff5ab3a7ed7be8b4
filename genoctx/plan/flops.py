"""FLOPs of a training step and of scoring a window, by formula, per component (DESIGN.md: speed planned like memory).

What is counted: matrix products, 2 FLOPs per multiply-add, exactly the ops ``torch.utils.flop_counter.FlopCounterMode``
counts (``mm``, ``addmm``, ``bmm``, ``baddbmm``, einsums that lower to them, convolutions, SDPA), as genoctx's
PyTorch path runs them (the CPU path; the Triton kernels of ``kernels/`` compute the same products and are tested equal
to it). Not counted, as FlopCounterMode does not count them: elementwise work (norms, gates, activations, softmax,
Sinkhorn, the mHC ``pre`` weighted sum, indexer pooling, the MoE combine), gathers and scatters, ``torch.topk``, the
KDA core's triangular solve (``C (K + V) / 2`` multiply-adds per token and head) and the diagonal sub-chunk blocks of
its decay scores (elementwise, ``2 sub K`` multiply-adds per token and head). ``tests/plan/test_flops.py`` holds the
totals equal to FlopCounterMode on real train steps of ``tiny`` and ``cpu-small``.

Method. Every product of the code is a term here, with the number of times it runs in a step:

- forward: the one forward of the step (for the chunked backward, ``genoctx.train.chunked``, the reverse sweep's
  forward with grad). The indexer KL of the sparse stage computes its gradients inside the forward
  (``_IndexerKLSparse``): they are counted there, as they run.
- recompute: every further forward. genoctx always recomputes the KDA core block by block
  (``chunk_kda(recompute=True)``) and each MoE token chunk (router, shared and routed experts; the Sinkhorn
  map is not); under CP also the KDA ``[L | M]`` state pass (its projections and core; the core inside it twice,
  nested checkpoints). With ``recompute=True`` (``apply_ac``) every decoder layer runs its forward once more (a
  region inside ``k`` nested checkpoints runs ``k + 1`` times, ``k + 2`` with AC). With ``seq_chunk_tokens`` the
  no-grad forward sweep runs every chunk once more (no indexer KL there, no checkpoints); the indexer top-k runs
  there only (the grad pass and its recompute reuse the sweep's selections, ``genoctx.train.chunked``).
- backward: ``2x`` a product's forward (input and weight gradients), ``1x`` where only one side needs a gradient: the
  indexer's projections (input detached: weight gradient only), a frozen weight (``train.trainable``: input gradient
  only; ``0x`` where the input needs none either, ``_flow``), the KDA core's first product with a zero initial
  state; none for what gets no gradient (the indexer top-k, run without grad; the last state update of a KDA core
  whose final state is not used). The sparse MLA backward is ``2.5x`` its forward (it recomputes the scores: five
  products to the forward's two); the KDA core adds the triangular solve's ``G_A = -G_B X^T`` product.

The busiest rank: under context parallelism the rank holding the window's last piece (rank ``cp - 1``, or rank 0 of
the zigzag layout): its DSA queries see the whole window before them (indexer scoring, the widest selections). Under
expert parallelism each rank runs the routed experts of the tokens routed to its block: balanced, the rank's own
``N x top-k`` token-slots; ``skew`` (busiest / mean expert load) scales them (the published run saw about
``PUBLISHED_SKEW``).

Units (what each product runs on, so that ``genoctx.plan.time`` times it at the rate of what runs). Every term is
tagged where it is counted: ``run``, the run's compute dtype (bf16 tensor cores under ``train.dtype: bf16``, where
autocast lowers ``nn.Linear``/``einsum``/SDPA and FSDP2 gathers bf16 parameters; fp32 in an fp32 run); ``fp32``,
fp32 whatever the run's dtype (an fp32 island with autocast off, or fp32 operands: CUDA-core FMA, since genoctx
never enables TF32: no ``allow_tf32``, no ``set_float32_matmul_precision``, and its Triton kernels pass
``input_precision="ieee"`` for fp32); ``tf32``, fp32 operands on TF32 tensor cores (Triton's default precision,
in fla-core); ``run_tf32``, the run's dtype, or TF32 in an fp32 run (fla-core's other dots). Per component:

==========================  =====================  =================================================================
component / product         unit                   why (the code)
==========================  =====================  =================================================================
dense_mlp, experts (GEMMs)  run                    ``nn.Linear`` / ``F.linear`` under autocast (model/moe.py
                                                   ``expert_ffn``, the shared expert, dense MLP)
experts: router             fp32                   ``TopkRouter``: ``F.linear`` in fp32, autocast off (model/moe.py)
attention_projections       run                    KDA q/k/v, gates, ``o_proj``; MLA projections and absorbed
                                                   ``einsum`` products; the indexer's ``wq_b``, ``wk``, gate, weights
attention_projections:      fp32                   ``KimiDeltaAttention.project``: the depthwise ``conv1d`` is an
  KDA short convolution                            fp32 island (autocast off; no GEMM form: CUDA cores)
kda_core, ``torch``         fp32                   ``chunk_kda``: autocast off, fp32 (model/kda.py)
kda_core, ``fla``           tf32 (decay scores),   fla's off-diagonal sub-chunk scores load q, k, g as fp32 and
                            run_tf32 (the rest)    ``tl.dot`` at Triton's default (tf32); the rest on q, k, v in the
                                                   compute dtype (model/kda.py ``fla_core_inputs``)
kda_core: CP state pass     fp32                   ``kda_cp_cache`` runs genoctx's ``chunk_kda`` and the fold with
  and fold                                         autocast off whatever ``kda_kernel`` is (parallel/context.py)
dsa_indexer: top-k scores   fp32                   the pooled keys are fp32 (``Indexer.pool``): the PyTorch top-k
                                                   promotes, the Triton one dots in fp32 ``ieee`` (FMA; kernels/
                                                   indexer_topk.py); ``dot_dtype`` is never set by genoctx
dsa_indexer: the KL         fp32                   ``_IndexerKLSparse`` / ``_kl_warmup_tile``: autocast off, target
                                                   scores and pool scores in fp32 (model/dsa.py)
dsa_attention, sparse       run (``triton``),      kernels/sparse_mla.py dots q and latents in q's dtype; the
                            fp32 (``torch``)       PyTorch ``_SparseMLA`` runs in fp32, autocast off
dsa_attention, dense        run                    SDPA under autocast (``DeepSeekSparseAttention._dense``)
lm_head_loss, own logits    run                    ``lm_head`` is an ``nn.Linear`` under autocast
lm_head_loss, chunked head  run under FSDP,        ``_ChunkedHeadLoss``: autocast off, the weight's dtype (bf16
  (training)                else fp32              parameters only where FSDP2 gathers them; model/head.py)
lm_head_loss, scoring       run (full vocab),      ``VocabHead.log_probs``: the full vocabulary's product under
                            fp32 (nucleotide rows) autocast, the nucleotide rows' ``.float()`` (model/vocab.py)
mhc                         fp32                   ``HyperConnection``: coefficients and ``comb^T x`` with autocast
                                                   off on the fp32 streams (model/hyper.py)
==========================  =====================  =================================================================

Each component's ``units`` (``step_flops``) gives its FLOPs (all phases) by unit; ``tests/plan/test_flops.py`` holds
them equal to the FLOPs FlopCounterMode counts by operand dtype on a real bf16-autocast train step.

Units: FLOPs (floats). ``tokens``: tokens the rank processes per step (``batch_size x seq_len / cp``).
"""

from __future__ import annotations

from ..model.config import DSA, ModelConfig
from ..parallel.layout import Layout, cp_pieces
from .trainable import Trainable, param_entries

PUBLISHED_SKEW = 4.0  # busiest / mean routed-expert load per rank seen in the published GLM-5.3-Flash run
NUCLEOTIDE_VOCAB = 8  # a model with this vocabulary trains on its own logits (``genoctx.plan.sizes``)
COMPONENTS = ("dense_mlp", "experts", "attention_projections", "kda_core", "dsa_indexer", "dsa_attention",
              "lm_head_loss", "mhc")  # fmt: skip
CLASSES = {
    "dense_mlp": "matmul", "experts": "matmul", "attention_projections": "matmul", "lm_head_loss": "matmul",
    "kda_core": "attention", "dsa_indexer": "attention", "dsa_attention": "attention", "mhc": "memory",
}  # fmt: skip
PHASES = ("forward", "recompute", "backward")
# What each product runs on (module docstring, "Units"); ``genoctx.plan.time.unit_dtype`` maps them to a rate.
UNITS = ("run", "fp32", "tf32", "run_tf32")

# Copied from the code they describe (tests/plan/test_flops.py checks that they still match):
SUB_CHUNK = 8  # genoctx.model.kda._SUB_CHUNK
INDEX_ROW_TILE = 256  # genoctx.model.dsa.INDEX_ROW_TILE
INDEX_COL_BLOCK = 4096  # genoctx.model.dsa.INDEX_COL_BLOCK
INDEX_GROUP = 32  # genoctx.model.dsa.INDEX_GROUP


class _Tally:
    """FLOPs per component and phase, and per unit (``UNITS``). ``add(comp, fwd, bwd, depth, unit=...)``: a product
    of ``fwd`` FLOPs forward and ``bwd`` backward, inside ``depth`` nested checkpoints of the layer (each reruns it
    once in backward), run on ``unit``."""

    def __init__(self, dead: bool = True) -> None:
        self.f = {c: dict.fromkeys(PHASES, 0.0) for c in COMPONENTS}
        self.u = {c: {p: {} for p in PHASES} for c in COMPONENTS}  # component -> phase -> unit -> FLOPs
        # the forward of layers no gradient reaches (``_flow``): apply_ac does not rerun them
        self.dead = _Tally(dead=False) if dead else None

    def merge(self, other: _Tally) -> None:
        """Add ``other``'s FLOPs (every phase and unit)."""
        for c in COMPONENTS:
            for p in PHASES:
                self.f[c][p] += other.f[c][p]
                for u, v in other.u[c][p].items():
                    self.u[c][p][u] = self.u[c][p].get(u, 0.0) + v

    def add(self, comp: str, fwd: float, bwd: float = 0.0, depth: int = 0, rerun: float | None = None,
            unit: str = "run") -> None:  # fmt: skip
        """``rerun``: FLOPs of one recomputation when it is less than ``fwd`` (default ``fwd``)."""
        assert unit in UNITS, unit
        parts = {"forward": fwd, "recompute": (fwd if rerun is None else rerun) * depth, "backward": bwd}
        for phase, v in parts.items():
            self.f[comp][phase] += v
            if v:
                self.u[comp][phase][unit] = self.u[comp][phase].get(unit, 0.0) + v


def _mm(t: _Tally, comp: str, n: float, d_in: int, d_out: int, grad: bool, sides: int = 2, depth: int = 0,
        unit: str = "run") -> None:  # fmt: skip
    """A linear map of ``n`` rows ``d_in -> d_out``: ``2 n d_in d_out`` forward, ``sides`` times that backward."""
    f = 2.0 * n * d_in * d_out
    t.add(comp, f, f * sides if grad else 0.0, depth if grad else 0, unit=unit)


# ------------------------------------------------------------------ layers, one call each


def _sides(g: dict | None, key: str) -> int:
    """Backward products of a product ``key`` of the layer: one per operand that needs a gradient (``_flow``: the
    input, the weight); 2 in full training (``g`` None)."""
    if g is None:
        return 2
    x_live, w_train = g[key][:2]
    return int(x_live) + int(w_train)


class _LayerFlow:
    """``_flow``'s bookkeeping of one decoder layer (its names start with ``pre``): ``d`` is the layer's entry."""

    def __init__(self, pre: str, train: dict, adapters: dict) -> None:
        self.pre, self.train, self.adapters = pre, train, adapters
        self.d: dict = {"adapters": []}

    def tw(self, rel: str) -> bool:
        """Whether the layer's parameter ``rel`` trains."""
        return self.train[self.pre + rel]

    def lin(self, key: str, x_live: bool, mod: str, weight: str = ".weight") -> bool:
        """A weight product ``key`` of module ``mod`` on an input that needs a gradient (``x_live``) or not; returns
        whether its output needs one."""
        w, ad = self.tw(mod + weight), self.pre + mod in self.adapters
        self.d[key] = (x_live, w, ad)
        if ad and not mod.endswith("kv_b_proj"):
            part, d_in, d_out = self.adapters[self.pre + mod]
            self.d["adapters"].append((part, d_in, d_out, x_live))
        return x_live or w or ad

    def hc(self, name: str, x_live: bool) -> bool:
        """An mHC (``attn_hc``/``ffn_hc``) on streams ``x_live``: its ``fn`` product and ``comb^T x`` (two
        activations); returns whether its coefficients need a gradient."""
        m = self.tw(f"{name}.fn")
        self.d[f"{name}_fn"] = (x_live, m, False)
        coeff = x_live or m or self.tw(f"{name}.base") or self.tw(f"{name}.scale")
        self.d[f"{name}_comb"] = (coeff, x_live, False)
        return coeff


def _flow(cfg: ModelConfig, tr: Trainable) -> tuple[list[dict], tuple]:
    """Which operands of each product need a gradient when not everything trains (``train.trainable``), as autograd
    decides it: a tensor needs one when a trainable parameter is upstream of it. Per decoder layer ``{key: (input
    needs a gradient, weight trains, has a LoRA adapter)}`` for its weight products (and ``(a, b, False)`` for the
    mHC ``comb^T x`` of two activations), ``"core"`` / ``"attn"`` (the KDA core's or the sparse attention's backward
    runs: one of their inputs needs a gradient), ``"indexer"`` (the indexer trains: its weight gradients from the KL),
    ``"adapters"`` (``[(component, in, out, input needs a gradient)]`` of its per-token adapters) and ``"kv_b_merge"``
    (``kv_b_proj`` carries an adapter: ``W + s B A`` is formed once per call, ``genoctx.model.dsa``); and the LM
    head's ``(input needs a gradient, weight trains, False)``.

    So a frozen weight's product computes ``dX`` only (one backward product, not two) where its input needs a
    gradient, and nothing where it does not (the first layers before anything trains: with ``embed`` frozen the
    residual streams need no gradient until the first trainable tensor). The indexer's inputs are detached."""
    ents = param_entries(cfg, tr)
    train = {e["name"]: e["train"] for e in ents if not e["lora"]}
    adapters: dict[str, tuple] = {}
    for e in ents:
        if e["lora"] and e["name"].endswith("lora_A"):
            adapters[e["name"][: -len(".lora_A")]] = (e["lora"], e["in"], e["out"])
    layers = []
    live = train["embed_tokens.weight"]
    for i, kind in enumerate(cfg.layer_types):
        lay = _LayerFlow(f"layers.{i}.", train, adapters)
        d, tw, lin, hc = lay.d, lay.tw, lay.lin, lay.hc
        pre = lay.pre
        coeff = hc("attn_hc", live)
        h = coeff or tw("input_layernorm.weight")
        a = "self_attn."
        if kind == DSA:
            qa = lin("q_a_proj", h, a + "q_a_proj") or tw(a + "q_a_layernorm.weight")
            q = lin("q_b_proj", qa, a + "q_b_proj")
            lat = lin("kv_a_proj_with_mqa", h, a + "kv_a_proj_with_mqa") or tw(a + "kv_a_layernorm.weight")
            kvb = tw(a + "kv_b_proj.weight") or pre + a + "kv_b_proj" in adapters  # the (merged) weight
            d["kv_b_merge"] = pre + a + "kv_b_proj" in adapters
            d["uk"] = (q, kvb, False)
            d["attn"] = q or kvb or lat
            d["uv"] = (d["attn"], kvb, False)
            y = lin("o_proj", d["attn"] or kvb, a + "o_proj")
            # the indexer's projections (group ``indexer``; its k_norm is ``norms``: no weight gradient from it)
            d["indexer"] = train.get(pre + a + "indexer.wk.weight", False)
        else:
            qkv = any([lin(k, h, a + k) for k in ("q_proj", "k_proj", "v_proj")])
            conv = lin("conv1d", qkv, a + "conv1d")
            fg = a + "forget_gate."
            g_ = lin("f_b_proj", lin("f_a_proj", h, fg + "f_a_proj"), fg + "f_b_proj")
            g_ = g_ or tw(fg + "dt_bias") or tw(fg + "A_log")
            beta = lin("b_proj", h, a + "b_proj")
            d["core"] = conv or g_ or beta
            gate = lin("g_b_proj", lin("g_a_proj", h, a + "g_a_proj"), a + "g_b_proj")
            y = lin("o_proj", d["core"] or gate or tw(a + "o_norm.weight"), a + "o_proj")
        live = y or coeff
        coeff = hc("ffn_hc", live)
        h = coeff or tw("post_attention_layernorm.weight")
        if cfg.mlp_layer_types[i] == "dense":
            act = lin("gate_proj", h, "mlp.gate_proj") | lin("up_proj", h, "mlp.up_proj")
            y = lin("down_proj", act, "mlp.down_proj")
        else:
            y = lin("router", h, "mlp.gate")
            if cfg.n_shared_experts:
                se = "mlp.shared_experts."
                act = lin("gate_proj", h, se + "gate_proj") | lin("up_proj", h, se + "up_proj")
                y = lin("down_proj", act, se + "down_proj") or y
            act = lin("experts_gu", h, "mlp.experts.gate_up_proj", "")
            y = lin("experts_down", act, "mlp.experts.down_proj", "") or y
        d["moe"] = y  # the MoE's checkpointed token chunks are recomputed only when their backward runs
        live = y or coeff
        d["layer"] = live  # the decoder layer's output needs a gradient: apply_ac's recompute runs
        layers.append(d)
    head = live or train["norm.weight"]
    return layers, (head, train.get("lm_head.weight", train["embed_tokens.weight"]), False)


def _floor_sum(n: int, m: int, a: int, b: int) -> int:
    """``sum_{i=0}^{n-1} floor((a i + b) / m)`` for ``n, a, b >= 0``, ``m >= 1``, in O(log) steps (the Euclid-like
    reduction): the tile sums below stay exact and fast at any length."""
    total = 0
    while n > 0:
        if a >= m:
            total += n * (n - 1) // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        y = a * n + b
        if y < m:
            break
        n, b, m, a = y // m, y % m, a, m
    return total


def _tiles(T: int, rows: int, S: int, kp: int) -> tuple[int, int]:
    """Query tiles of ``rows`` rows over positions ``S .. S + T - 1``, each seeing up to its last row ``r1``:
    ``(sum rows x (S + r1), sum rows x ((S + r1) // kp))``."""
    full, rest = divmod(T, rows)
    keys = rows * (full * S + rows * full * (full + 1) // 2) + rest * (S + T)
    pools = rows * _floor_sum(full, kp, rows, S + rows) + rest * ((S + T) // kp)
    return keys, pools


def _kda_core(cfg: ModelConfig, rows: int, T: int, V: int, grad: bool, *, state_in_grad: bool,
              state_out_used: bool) -> tuple[float, float, float]:  # fmt: skip
    """``chunk_kda`` over ``rows`` sequences of ``T`` tokens, values ``V`` wide (``[v | 0]``: ``V + K`` in the CP
    state pass): (forward, backward, one recomputation) FLOPs.

    Per head and chunk of ``C`` (``n = C / sub`` sub-chunks): the decay scores of two rows (``A_kk``, ``A_qk``,
    ``genoctx.model.kda._fused_scores``) inside sub-chunks ``2 x 2 C sub K`` and, with ``n > 1``, between sub-chunks
    ``2 x 2 C C K`` (sub-chunk 0's row block, all zero, included); ``[W; Q] S`` ``2 (2C) K V``; ``A_qk V'``
    ``2 C^2 V``; ``K^T V'`` ``2 K C V``. Backward: each twice, plus the solve's ``-G_B X^T`` ``2 C^2 (K + V)``; the
    first chunk's ``S`` product once when the initial state needs no gradient, the last chunk's state update not at
    all when the final state is not used (``genoctx.model.kda._scan_backward`` skips them). A block's recomputation
    reruns the whole block (``_KDABlock``, its last state update ``K^T V'`` included)."""
    C, K, H = cfg.kda_chunk_size, cfg.linear_head_dim, cfg.linear_num_heads
    sub = SUB_CHUNK if C % SUB_CHUNK == 0 else C
    block = max(C, cfg.kda_block_tokens // C * C)
    chunks = T // block * (block // C) + -(-(T % block) // C)
    scores = 4.0 * C * K * (sub + (C if C > sub else 0))
    ws, av, kv = 4.0 * C * K * V, 2.0 * C * C * V, 2.0 * K * C * V
    fwd = chunks * (scores + ws + av + kv)
    bwd = 0.0
    if grad and chunks:
        bwd = chunks * (2 * (scores + ws + av + kv) + 2.0 * C * C * (K + V))
        bwd -= 0.0 if state_in_grad else ws  # the first chunk: no gradient for a zero initial state
        bwd -= 0.0 if state_out_used else 2 * kv  # the last chunk's state update feeds nothing
    return rows * H * fwd, rows * H * bwd, rows * H * fwd


def _add_kda_core(t: _Tally, cfg: ModelConfig, parts: tuple[float, float, float], rows: int, T: int, depth: int,
                  fla: bool) -> None:  # fmt: skip
    """Tally ``_kda_core``'s ``(forward, backward, rerun)`` of ``rows`` sequences of ``T`` tokens. genoctx's core
    (``chunk_kda``): fp32 with autocast off. fla-core's: the off-diagonal sub-chunk decay scores in ``tf32`` (fla's
    ``chunk_kda_fwd_kernel_inter_solve_fused`` loads q, k and g as fp32 and ``tl.dot``s them at Triton's default
    precision), the rest on q, k, v in the compute dtype (``run_tf32``, ``genoctx.model.kda.fla_core_inputs``)."""
    f, b, r = parts
    if not fla:
        t.add("kda_core", f, b, depth, r, unit="fp32")
        return
    C, K, H = cfg.kda_chunk_size, cfg.linear_head_dim, cfg.linear_num_heads
    sub = SUB_CHUNK if C % SUB_CHUNK == 0 else C
    block = max(C, cfg.kda_block_tokens // C * C)
    chunks = T // block * (block // C) + -(-(T % block) // C)
    s = rows * H * chunks * 4.0 * (C - sub) * C * K  # forward of the scores (rerun whole; backward twice)
    s_bwd = 2 * s if b else 0.0
    t.add("kda_core", s, s_bwd, depth, s, unit="tf32")
    t.add("kda_core", f - s, b - s_bwd, depth, r - s, unit="run_tf32")


def _kda_projections(t: _Tally, cfg: ModelConfig, n: float, grad: bool, *, output: bool = True, depth: int = 0,
                     g: dict | None = None) -> None:  # fmt: skip
    """``KimiDeltaAttention.project`` (q, k, v, the depthwise conv, the forget gate, beta) and, with ``output``, the
    output gate and ``o_proj`` of ``n`` tokens; ``g``: the layer's backward sides (``_flow``; None: 2 each)."""
    D, H, Dh = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim
    hk = H * Dh
    c = "attention_projections"
    for key in ("q_proj", "k_proj", "v_proj"):
        _mm(t, c, n, D, hk, grad, _sides(g, key), depth=depth)
    # depthwise conv: 2 n 3hk w
    _mm(t, c, n, cfg.linear_conv_kernel_dim, 3 * hk, grad, _sides(g, "conv1d"), depth=depth, unit="fp32")
    _mm(t, c, n, D, Dh, grad, _sides(g, "f_a_proj"), depth=depth)  # forget gate f_a
    _mm(t, c, n, Dh, hk, grad, _sides(g, "f_b_proj"), depth=depth)  # forget gate f_b
    _mm(t, c, n, D, H, grad, _sides(g, "b_proj"), depth=depth)  # b_proj (beta)
    if output:
        _mm(t, c, n, D, Dh, grad, _sides(g, "g_a_proj"))  # g_a
        _mm(t, c, n, Dh, hk, grad, _sides(g, "g_b_proj"))  # g_b
        _mm(t, c, n, hk, D, grad, _sides(g, "o_proj"))  # o_proj


def _kda_layer(t: _Tally, cfg: ModelConfig, B: int, pieces: list[tuple[int, int]], grad: bool, ctx: dict) -> None:
    """One KDA layer over this rank's ``pieces`` (``(start, length)``, batched as rows); under CP (``ctx["cp"]``) the
    ``[L | M]`` state pass (``genoctx.parallel.context.kda_cp_cache``) first."""
    c = pieces[0][1]
    rows = B * len(pieces)
    n = rows * c
    K = V = cfg.linear_head_dim
    H = cfg.linear_num_heads
    g = ctx.get("g")
    core = g is None or g["core"]  # any input of the core needs a gradient: its backward runs whole
    if ctx["cp"]:
        w = cfg.linear_conv_kernel_dim - 1
        for key in ("q_proj", "k_proj", "v_proj"):  # the pieces' conv tails
            _mm(t, "attention_projections", rows * w, cfg.hidden_size, H * K, grad, _sides(g, key))
        depth = 1 if grad and core else 0  # the state pass is one checkpoint; its core's blocks a second one in it
        _kda_projections(t, cfg, n, grad, output=False, depth=depth, g=g)
        # the state pass runs genoctx's chunk_kda (fp32) whatever kda_kernel is (genoctx.parallel.context.kda_cp_cache)
        parts = _kda_core(cfg, rows, c, V + K, grad and core, state_in_grad=False, state_out_used=True)  # [0 | I]
        _add_kda_core(t, cfg, parts, rows, c, depth + 1 if grad and core else 0, fla=False)
        P = ctx["n_pieces"]  # the fold S_{p+1} = M_p S_p + L_p over every natural piece, on every rank
        fold = 2.0 * B * H * K * K * V
        # backward: dM and dS (only dM for a zero S_0); the last product's state is used only when carried on
        back = sum(fold * (2 if p or ctx["carry_in"] else 1) for p in range(P) if p < P - 1 or ctx["carry_out"])
        t.add("kda_core", P * fold, back if grad and core else 0.0, unit="fp32")  # autocast off, fp32 states
    _kda_projections(t, cfg, n, grad, g=g)
    parts = _kda_core(cfg, rows, c, V, grad and core, state_in_grad=ctx["cp"] or ctx["carry_in"],
                      state_out_used=ctx["carry_out"] and not ctx["cp"])  # fmt: skip
    _add_kda_core(t, cfg, parts, rows, c, 1 if grad and core else 0, fla=cfg.kda_kernel == "fla")


def _topk_scoring(cfg: ModelConfig, S: int, T: int) -> float:
    """``indexer_topk`` for queries at positions ``S .. S + T - 1`` (one batch row; no grad): per row tile of ``R``
    rows the ``(S + r1) // kpool`` pools the tile's last row sees, ``2 R H_I (d_I + 1)`` per pool (the ReLU scores'
    product and the head-weighted sum), tiles as the code cuts them."""
    kp, HI, dI = cfg.index_kpool, cfg.index_n_heads, cfg.index_head_dim
    n_keys = (S + T) // kp
    if T == 0 or n_keys == 0:
        return 0.0
    g = INDEX_GROUP
    tile = cfg.indexer_tile_tokens
    cols = max(g, min(INDEX_COL_BLOCK, tile) // g * g)
    cols = max(g, min(cols, -(-n_keys // g) * g))
    R = max(1, min(INDEX_ROW_TILE, T, tile // cols))
    return 2.0 * HI * (dI + 1) * _tiles(T, R, S, kp)[1]


def _dsa_layer(t: _Tally, cfg: ModelConfig, i: int, B: int, pieces: list[tuple[int, int]], grad: bool,
               ctx: dict) -> None:  # fmt: skip
    """One DSA layer over this rank's ``pieces``, one call each (``DeepSeekSparseAttention.forward``); under CP the
    latents and indexer keys projected once more for the gather (``dsa_cp_cache``)."""
    D, H, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    dqk, dv, qr = cfg.qk_head_dim, cfg.v_head_dim, cfg.q_lora_rank
    HI, dI, kp = cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
    full = cfg.indexer_types[i] == "full"
    sparse = cfg.dsa_mode == "sparse"
    kl_fwd = full and grad and cfg.indexer_stage != "off"  # the indexer KL, its gradients inside the forward
    n = B * sum(T for _, T in pieces)
    p = "attention_projections"
    g = ctx.get("g")
    kl_w = kl_fwd and (g is None or g["indexer"])
    attn = g is None or g["attn"]  # the indexer's weight gradients: only when it trains
    if ctx["cp"]:
        _mm(t, p, n, D, R, grad, _sides(g, "kv_a_proj_with_mqa"))  # latents for the gather
        if full:
            _mm(t, p, n, D, 2 * dI, grad and kl_w, sides=1)  # indexer keys and compress gates (input detached)
    _mm(t, p, n, D, qr, grad, _sides(g, "q_a_proj"))  # q_a_proj
    _mm(t, p, n, qr, H * dqk, grad, _sides(g, "q_b_proj"))  # q_b_proj
    _mm(t, p, n, D, R, grad, _sides(g, "kv_a_proj_with_mqa"))  # kv_a_proj_with_mqa
    _mm(t, p, n, H * dqk, R, grad, _sides(g, "uk"))  # q W_UK (absorbed; per head dqk -> R)
    _mm(t, p, n, H * R, dv, grad, _sides(g, "uv"))  # o_lat W_UV (per head R -> dv)
    _mm(t, p, n, H * dv, D, grad, _sides(g, "o_proj"))  # o_proj
    if g is not None and g["kv_b_merge"]:  # W + s B A of kv_b_proj, once per call; gradients to A and B
        _mm(t, p, len(pieces) * H * (dqk + dv), ctx["lora_r"], R, grad)
    kl = kl_w
    if full:  # inputs detached: weight gradients only, and only from the KL
        _mm(t, p, n, qr, HI * dI, grad and kl, sides=1)  # wq_b
        _mm(t, p, n, D, dI, grad and kl, sides=1)  # wk
        _mm(t, p, n, D, dI, grad and kl, sides=1)  # compress gate
        _mm(t, p, n, D, HI, grad and kl, sides=1)  # weights_proj
    tail = kp - 1 if cfg.index_kpool_always_select_tail else 0
    widths = {S: min(cfg.index_topk // kp, (S + T) // kp) for S, T in pieces}  # selected pools per call
    shared_k = max(widths.values())  # a shared layer under CP: the full layer's selections padded to the widest
    # sparse MLA: the Triton kernel dots q and the latents in their compute dtype; the PyTorch path in fp32
    attn_unit = "run" if cfg.kernels == "triton" else "fp32"
    for S, T in pieces:
        if not sparse:  # SDPA under autocast: the compute dtype
            keys = _dense_keys(cfg, S, T)
            t.add("dsa_attention", 4.0 * B * H * R * keys, 10.0 * B * H * R * keys if grad and attn else 0.0)
            if kl_fwd and cfg.indexer_stage == "warmup":
                _warmup_kl(t, cfg, B, S, T, kl_w)
            continue
        Kp = widths[S] if full else shared_k
        W = Kp * kp + tail
        nq = B * T
        keys = _sparse_keys(cfg, S, T, W) if cfg.kernels != "triton" else T * W  # (query, key) pairs per window
        Wk = keys / T  # keys per query: W, fewer or more where short-window tiles attend densely
        t.add("dsa_attention", 4.0 * nq * H * R * Wk, 10.0 * nq * H * R * Wk if grad and attn else 0.0, unit=attn_unit)
        if full:  # the pooled keys are fp32: the top-k's dots run in fp32 (FMA), the KL with autocast off
            if not ctx["selected"]:  # the chunked step's grad pass takes its sweep's selection
                t.add("dsa_indexer", B * _topk_scoring(cfg, S, T), unit="fp32")
            if kl_fwd and cfg.indexer_stage == "sparse":  # target, pool scores, head sum (bmm), gradients: in forward
                t.add("dsa_indexer", 2.0 * nq * (H * R * Wk + 3 * HI * dI * Kp + 2 * HI * Kp), unit="fp32")
            elif kl_fwd:
                _warmup_kl(t, cfg, B, S, T, kl_w)


def _sparse_keys(cfg: ModelConfig, S: int, T: int, W: int) -> int:
    """(query, key) pairs the PyTorch sparse attention computes for ``T`` queries after ``S`` cached positions,
    ``W`` slots each: ``W`` per query in gathering tiles, every key up to the tile's last row in the dense tiles of a
    short window (``genoctx.model.dsa._dense_split``)."""
    from ..model.dsa import DENSE_RATIO, _dense_split, _dense_tiles, attn_tile_tokens

    H, R = cfg.num_attention_heads, cfg.kv_lora_rank
    split, rows = _dense_split(W, S + T, T, H, R, attn_tile_tokens(R, H), DENSE_RATIO)
    return (T - split) * W + sum((t1 - t0) * (S + t1) for t0, t1 in _dense_tiles(T, split, rows))


def _dense_keys(cfg: ModelConfig, S: int, T: int) -> float:
    """(query, key) pairs dense attention's SDPA tiles compute (``DeepSeekSparseAttention._dense``): per tile of
    ``rows = indexer_tile_tokens // (S + T)`` queries, every key up to the tile's last row."""
    N = S + T
    rows = max(1, cfg.indexer_tile_tokens // N)
    if S == 0 and rows >= T:
        return float(T * T)
    return float(_tiles(T, rows, S, 1)[0])


def _warmup_kl(t: _Tally, cfg: ModelConfig, B: int, S: int, T: int, train: bool = True) -> None:
    """The warm-up stage's KL tiles (``_kl_warmup_tile``, checkpointed): dense target scores (no grad) and indexer
    scores of every visible complete pool (with grad when the indexer trains: ``train``), tiles of
    ``indexer_tile_tokens // (N H)`` rows."""
    H, R, HI, dI, kp = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
    N = S + T
    rows = max(1, cfg.indexer_tile_tokens // (N * H))
    keys, pools = _tiles(T, rows, S, kp)
    scores = 2.0 * B * HI * dI * pools
    back = 2 * scores if train else 0.0
    t.add("dsa_indexer", 2.0 * B * H * R * keys + scores, back, 1, unit="fp32")  # autocast off, fp32


def _swiglu(t: _Tally, comp: str, n: float, D: int, inter: int, grad: bool, g: dict | None, depth: int = 0,
            keys: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")) -> None:  # fmt: skip
    """A SwiGLU over ``n`` rows: gate and up ``D -> inter`` each (or, two ``keys``, one ``gate_up`` product ``D -> 2
    inter``), down ``inter -> D`` (backward sides from ``g``)."""
    width = inter * (2 if len(keys) == 2 else 1)
    for key in keys[:-1]:
        _mm(t, comp, n, D, width, grad, _sides(g, key), depth=depth)
    _mm(t, comp, n, inter, D, grad, _sides(g, keys[-1]), depth=depth)


def _ffn_layer(t: _Tally, cfg: ModelConfig, i: int, n: float, grad: bool, ep_factor: float,
               g: dict | None = None) -> None:  # fmt: skip
    """The feed-forward of layer ``i`` over ``n`` tokens: a dense SwiGLU MLP, or the MoE (router, shared expert,
    routed experts; each token chunk a checkpoint); ``g``: the layer's backward sides (``_flow``)."""
    D = cfg.hidden_size
    if cfg.mlp_layer_types[i] == "dense":
        _swiglu(t, "dense_mlp", n, D, cfg.intermediate_size, grad, g)
        return
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts
    depth = 1 if g is None or g["moe"] else 0  # a chunk's checkpoint reruns only when its backward runs
    # router: fp32, autocast off
    _mm(t, "experts", n, D, cfg.n_routed_experts, grad, _sides(g, "router"), depth=depth, unit="fp32")
    if shared:
        _swiglu(t, "dense_mlp", n, D, shared, grad, g, depth=depth)
    slots = n * cfg.num_experts_per_tok * ep_factor  # gate_up_proj [E, 2I, D] is one product
    _swiglu(t, "experts", slots, D, cfg.moe_intermediate_size, grad, g, depth, ("experts_gu", "experts_down"))


def _mhc(t: _Tally, cfg: ModelConfig, n: float, grad: bool, g: dict | None = None) -> None:
    """Two hyper-connections of a layer: ``x~ fn^T`` ``[nD] -> [(2 + n) n]`` and ``comb^T x`` (``n^2 D``) per token."""
    m, D = cfg.hc_mult, cfg.hidden_size
    for hc in ("attn_hc", "ffn_hc"):  # autocast off, fp32 coefficients and streams
        _mm(t, "mhc", n, m * D, (2 + m) * m, grad, _sides(g, f"{hc}_fn"), unit="fp32")
        _mm(t, "mhc", n, m * m, D, grad, _sides(g, f"{hc}_comb"), unit="fp32")


def _head(t: _Tally, cfg: ModelConfig, n: float, grad: bool, rows: int | None, ctx: dict,
          sides: int = 2) -> None:  # fmt: skip
    """The LM head and loss: the model's own ``lm_head`` (an 8-token vocabulary) or the chunked head of a text base
    (``genoctx.model.head``: logits recomputed in backward) over ``rows`` softmax rows (default ``vocab_size``).

    Units: ``lm_head`` is an ``nn.Linear`` under autocast (``run``). The chunked training head turns autocast off
    and multiplies in the weight's dtype: bf16 where FSDP2 all-gathers bf16 parameters (``ctx["fsdp"]``), else the
    fp32 master (``fp32``). Scoring (``ctx["eval"]``, ``VocabHead.log_probs``): the full vocabulary's product under
    autocast (``run``), the nucleotide rows' in fp32 (``.float()``; issue 43 item 13 keeps autocast off it)."""
    D = cfg.hidden_size
    if cfg.vocab_size == NUCLEOTIDE_VOCAB:
        _mm(t, "lm_head_loss", n, D, cfg.vocab_size, grad, sides)
        return
    V = rows or cfg.vocab_size
    if ctx["eval"]:
        unit = "run" if rows is None else "fp32"
    else:
        unit = "run" if ctx["fsdp"] else "fp32"
    _mm(t, "lm_head_loss", n, D, V, grad, sides, depth=1, unit=unit)


# ------------------------------------------------------------------ the rank's calls


def _rank_rounds(L: int, cp: int, cp_layout: str, seq_chunk_tokens: int | None) -> list[list[tuple[int, int]]]:
    """The busiest rank's pieces ``(start, length)`` per round: one round (the whole window, or under CP its pieces)
    or, with ``seq_chunk_tokens`` below the rank's share, rounds of ``cp x seq_chunk_tokens`` tokens."""
    chunked = seq_chunk_tokens is not None and seq_chunk_tokens * cp < L
    size = seq_chunk_tokens * cp if chunked else L
    mine = cp_pieces(cp, cp_layout)[0 if cp_layout == "zigzag" else cp - 1] if cp > 1 else [0]
    n_pieces = 2 * cp if cp > 1 and cp_layout == "zigzag" else cp
    rounds = []
    for s in range(0, L, size):
        r = min(L, s + size) - s
        c = r // n_pieces
        rounds.append([(s + p * c, c) for p in mine])
    return rounds


def _lora(t: _Tally, cfg: ModelConfig, i: int, n: float, grad: bool, ep_factor: float, r: int,
          adapters: list) -> None:  # fmt: skip
    """LoRA adapters of layer ``i`` (``genoctx.plan.trainable``), ``adapters`` from ``_flow``: ``2 r (in + out)`` per
    token per target forward (``x A^T``, then ``B``); backward ``dA``, ``dB`` and the input's gradient of ``B``'s
    product, and ``x``'s of ``A``'s where ``x`` needs one (``3`` or ``4 r (in + out)``). The mixer's in
    ``attention_projections``, the MLP's (shared experts inside the MoE's checkpointed chunks) in ``dense_mlp``, the
    experts' per routed row in ``experts``. (``kv_b_proj``'s adapter is merged per call: ``_dsa_layer``.)"""
    moe = cfg.mlp_layer_types[i] != "dense"  # (an adapter's layer always needs its backward: no dead checkpoint)
    for part, d_in, d_out, x_live in adapters:
        comp, rows, depth = {"mixer": ("attention_projections", n, 0), "mlp": ("dense_mlp", n, 1 if moe else 0),
                             "experts": ("experts", n * cfg.num_experts_per_tok * ep_factor, 1)}[part]  # fmt: skip
        _mm(t, comp, rows, d_in, r, grad, 1 + int(x_live), depth=depth)  # x A^T
        _mm(t, comp, rows, r, d_out, grad, 2, depth=depth)  # (x A^T) B^T


def _pass(cfg: ModelConfig, B: int, rounds, grad: bool, cp: int, n_pieces: int, ep_factor: float,
          loss_vocab_rows: int | None, *, fsdp: bool, eval_mode: bool = False,
          flow: tuple | None = None, lora_r: int = 0, selected: bool = False) -> _Tally:  # fmt: skip
    """One forward (with or without grad) over every round of the rank, and what its backward would cost
    (``flow``: ``_flow`` when not everything trains, or None; ``lora_r``: the adapters' rank; ``selected``: the DSA
    top-k selections are given (the chunked step's grad pass reuses its sweep's), no indexer scoring)."""
    t = _Tally()
    for k, pieces in enumerate(rounds):
        n = B * sum(T for _, T in pieces)
        ctx = {"cp": cp > 1, "n_pieces": n_pieces, "carry_in": k > 0, "carry_out": k < len(rounds) - 1,
               "fsdp": fsdp, "eval": eval_mode, "lora_r": lora_r, "selected": selected}  # fmt: skip
        for i, kind in enumerate(cfg.layer_types):
            g = ctx["g"] = flow[0][i] if flow is not None else None
            lt = t if g is None or g["layer"] else _Tally(dead=False)  # a layer before anything needs a gradient: apart
            if kind == DSA:
                _dsa_layer(lt, cfg, i, B, pieces, grad, ctx)
            else:
                _kda_layer(lt, cfg, B, pieces, grad, ctx)
            _ffn_layer(lt, cfg, i, n, grad, ep_factor, g)
            if g is not None and g["adapters"]:
                _lora(lt, cfg, i, n, grad, ep_factor, lora_r, g["adapters"])
            _mhc(lt, cfg, n, grad, g)
            if lt is not t:
                t.merge(lt)
                t.dead.merge(lt)
        _head(t, cfg, n, grad, loss_vocab_rows, ctx, 2 if flow is None else int(flow[1][0]) + int(flow[1][1]))
    return t


def _result(components: dict, units: dict, tokens: int) -> dict:
    out = {"components": {}}
    for c in COMPONENTS:
        by_unit: dict = {}
        for p in PHASES:
            for u, v in units[c][p].items():
                by_unit[u] = by_unit.get(u, 0.0) + v
        out["components"][c] = {**{p: components[c][p] for p in PHASES}, "class": CLASSES[c], "units": by_unit}
    for p in PHASES:
        out[p] = sum(components[c][p] for c in COMPONENTS)
    out["total"] = out["forward"] + out["recompute"] + out["backward"]
    out["tokens"] = tokens
    return out


def _check(cfg: ModelConfig, seq_len: int, layout: Layout, batch_size: int, cp_layout: str) -> int:
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    cp = layout.cp
    pieces = 2 * cp if cp > 1 and cp_layout == "zigzag" else cp
    if seq_len % pieces:
        raise ValueError(f"seq_len {seq_len} does not split into the {pieces} pieces of cp={cp} ({cp_layout})")
    return pieces


def step_flops(cfg: ModelConfig, seq_len: int, layout: Layout = Layout(), *, batch_size: int = 1,
               recompute: bool = True, seq_chunk_tokens: int | None = None, skew: float = 1.0,
               cp_layout: str = "contiguous", loss_vocab_rows: int | None = None,
               trainable: Trainable | None = None) -> dict:  # fmt: skip
    """FLOPs of one training step on the busiest rank (forward, recompute, backward), by component (module docstring).

    Args:
        cfg: the model with its compute knobs (``kda_chunk_size``, ``kda_block_tokens``, ``indexer_tile_tokens``,
            ``dsa_mode``, ``indexer_stage`` count).
        seq_len: tokens per window ``L``.
        layout: the parallel layout; ``cp`` splits each window (the busiest rank holds the last piece), ``ep`` places
            the routed experts (balanced: a rank runs its own tokens' ``top-k`` slots).
        batch_size: windows per data-parallel rank per step.
        recompute: activation checkpointing of every decoder layer (``apply_ac``): one more forward of each layer.
        seq_chunk_tokens: ``train.seq_chunk_tokens`` (the chunked backward: a no-grad forward sweep first); None,
            or not below ``L / cp``: one pass.
        skew: busiest / mean routed-expert load (1 = balanced; ``PUBLISHED_SKEW`` as seen in the published run).
        cp_layout: ``"contiguous"`` or ``"zigzag"`` (``genoctx.parallel.layout.cp_pieces``).
        loss_vocab_rows: softmax rows of the chunked head of a text base (5 for ``loss.vocab: nucleotide``); None =
            ``vocab_size``. An 8-token model trains on its own logits.
        trainable: what trains (``genoctx.plan.trainable.Trainable``): frozen weights' products compute only their
            input's gradient, and nothing before the first tensor that needs one (``_flow``); LoRA adds its
            adapters' products (``_lora``). None: full training.

    Returns:
        ``{"components": {name: {"forward", "recompute", "backward": FLOPs, "class": "matmul" | "attention" |
        "memory", "units": {unit: FLOPs}}}, "forward", "recompute", "backward", "total": FLOPs, "tokens": N}`` for
        the names of ``COMPONENTS`` (``units``: the component's FLOPs of all phases by ``UNITS``, module
        docstring); ``N = batch_size x seq_len / cp``.

    Raises:
        ValueError: ``seq_len`` or ``batch_size`` below 1, ``skew`` below 0, or a window that does not split into the
            CP layout's pieces.
    """
    n_pieces = _check(cfg, seq_len, layout, batch_size, cp_layout)
    if skew < 0:
        raise ValueError(f"skew must be >= 0, got {skew}")
    # a rank without EP runs its own rows; with EP at most every row of its group (ep x the mean), as comms takes it
    skew = min(skew, float(layout.ep)) if layout.ep > 1 else 1.0
    rounds = _rank_rounds(seq_len, layout.cp, cp_layout, seq_chunk_tokens)
    B = batch_size
    flow = _flow(cfg, trainable) if trainable is not None and not trainable.default else None
    lora = dict(flow=flow, lora_r=trainable.lora_rank if trainable is not None else 0)
    chunked = len(rounds) > 1 or (seq_chunk_tokens is not None and seq_chunk_tokens * layout.cp < seq_len)
    # chunked: the grad pass (and its AC recompute) takes the top-k selections of the sweep (no indexer scoring)
    grad = _pass(cfg, B, rounds, True, layout.cp, n_pieces, skew, loss_vocab_rows, fsdp=layout.fsdp, selected=chunked,
                 **lora)  # fmt: skip
    comps = {c: dict(grad.f[c]) for c in COMPONENTS}
    units = {c: {p: dict(grad.u[c][p]) for p in PHASES} for c in COMPONENTS}

    def rerun(c: str, tally: _Tally, sign: float = 1.0) -> None:  # tally's forward of c once more, as recompute
        comps[c]["recompute"] += sign * tally.f[c]["forward"]
        for u, v in tally.u[c]["forward"].items():
            units[c]["recompute"][u] = units[c]["recompute"].get(u, 0.0) + sign * v

    for c in COMPONENTS:
        if recompute and c != "lm_head_loss":  # apply_ac: every decoder layer's forward once more (not the head)
            rerun(c, grad)
            rerun(c, grad.dead, -1.0)  # but not the layers no gradient reaches
    if chunked:
        sweep = _pass(cfg, B, rounds, False, layout.cp, n_pieces, skew, loss_vocab_rows, fsdp=layout.fsdp, **lora)
        for c in COMPONENTS:
            rerun(c, sweep)
    return _result(comps, units, B * seq_len // layout.cp)


def eval_flops(cfg: ModelConfig, seq_len: int, layout: Layout = Layout(), *, cp_layout: str = "contiguous",
               loss_vocab_rows: int | None = None) -> dict:  # fmt: skip
    """FLOPs of scoring one window (forward only, no grad) on the busiest rank, in ``step_flops``' shape (recompute
    and backward 0). Args and errors as ``step_flops`` (one window)."""
    n_pieces = _check(cfg, seq_len, layout, 1, cp_layout)
    rounds = _rank_rounds(seq_len, layout.cp, cp_layout, None)
    t = _pass(cfg, 1, rounds, False, layout.cp, n_pieces, 1.0, loss_vocab_rows, fsdp=layout.fsdp, eval_mode=True)
    return _result(t.f, t.u, seq_len // layout.cp)


def flops_per_token(cfg: ModelConfig, seq_len: int, active_params: int | None = None) -> dict:
    """FLOPs per token of one window of ``seq_len`` tokens on one device (what ``genoctx model info`` prints).

    ``train``: forward + backward (model FLOPs, no recomputation); ``train_with_recompute``: what the device runs with
    activation checkpointing (forward + every recompute + backward); ``forward``: scoring (no grad). Each a dict of
    ``COMPONENTS`` plus ``total``, FLOPs per token (``step_flops`` / ``eval_flops`` divided by ``seq_len``). With
    ``active_params``, also ``six_n_active`` = ``6 x active_params`` (the usual estimate, for comparison).

    Raises:
        ValueError: ``seq_len < 1``.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    step = step_flops(cfg, seq_len, recompute=True)
    ev = eval_flops(cfg, seq_len)
    L = float(seq_len)
    train = {c: (v["forward"] + v["backward"]) / L for c, v in step["components"].items()}
    train["total"] = (step["forward"] + step["backward"]) / L
    rec = {c: (v["forward"] + v["recompute"] + v["backward"]) / L for c, v in step["components"].items()}
    rec["total"] = step["total"] / L
    fwd = {c: v["forward"] / L for c, v in ev["components"].items()}
    fwd["total"] = ev["forward"] / L
    out = {"train": train, "train_with_recompute": rec, "forward": fwd}
    if active_params is not None:
        out["six_n_active"] = 6.0 * active_params
    return out


__all__ = ["CLASSES", "COMPONENTS", "PUBLISHED_SKEW", "UNITS", "eval_flops", "flops_per_token", "step_flops"]
