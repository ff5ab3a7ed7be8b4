"""Aten ops of a training step and of scoring a window, per component and pass: planned like FLOPs and bytes.

Why count them: every eager aten op costs the host a few microseconds (Python, autograd, the dispatcher and, on a
GPU, a kernel launch), whatever its size. A step whose op count grows with the tokens a rank holds becomes
launch-bound once those ops are small: ``genoctx.plan.time`` turns ``ops x op_host_s`` into the ``launch`` term.

What is counted: what ``genoctx.model.opcount.OpCounter`` counts (a ``TorchDispatchMode``: every aten op, views
included, in ``forward``, ``recompute``, ``backward`` and ``optimizer``; per component of
``genoctx.model.opcount.OP_COMPONENTS``), on genoctx's PyTorch path (``kda_kernel: torch``, ``kernels: torch``) with
the accelerator's choices (no host-read pruning in the indexer top-k). ``tests/plan/test_ops.py`` holds the counts
equal to OpCounter's on real steps.

Method. The code of each component is a few loops: per call (a layer's forward), per KDA block and chunk, per DSA
query tile and indexer tile, per MoE token chunk and routed expert, per parameter tensor of the optimizer. Every loop
body issues a fixed number of ops in each pass: ``OPS[component][unit] = (forward, recompute, backward)``, copied
from the code by counting one body (OpCounter's counts; ``bench/op_count.py`` prints counted against planned per
component and pass, and the test checks the table at other lengths and configs). ``units`` counts how many times
each body runs for a config, a length, a layout and a chunk: the formulas of the loops' bounds, written out below.

Units: ops (ints). ``tokens``: tokens the rank processes per forward call (``seq_len / cp`` or the chunk).
"""

from __future__ import annotations

from ..model.config import DSA, KDA, ModelConfig
from ..parallel.layout import Layout

PASSES = ("forward", "recompute", "backward", "optimizer")
COMPONENTS = ("kda", "dsa_attention", "dsa_indexer", "moe", "dense_mlp", "mhc", "norms", "other")

# (forward, recompute, backward) ops of one loop body (module docstring), fp32, one process; counted from the code by
# OpCounter at several lengths (tests/plan/test_ops.py holds them). A KDA block's recompute runs inside its backward
# (``_KDABlock``), a MoE chunk's under its checkpoint (``recompute``). ``topk_call``: one ``indexer_topk`` call's ops
# beside its tiles and blocks (8, counted on the call alone: the chunked grad pass runs a full layer without it).
OPS: dict = {
    "kda": {"call": (86, 0, 169), "block": (90, 0, 209), "chunk": (3, 0, 6)},
    "dsa_attention": {
        "call": (110, 0, 142),
        "attn_tile": (21, 0, 33),
        "dense_call": (23, 0, 22),
        "dense_tile": (28, 0, 44),
    },
    "dsa_indexer": {
        "call": (76, 0, 42),
        "kl_tile": (59, 0, 2),
        "kl_dense_call": (26, 0, 0),
        "kl_dense_tile": (71, 0, 0),
        "topk_call": (8, 0, 0),
        "topk_tile": (19, 0, 0),
        "topk_block": (19, 0, 0),
        "topk_masked": (5, 0, 0),
    },  # fmt: skip
    "moe": {"call": (21, 0, 3), "chunk": (49, 35, 146)},
    "dense_mlp": {"call": (16, 0, 38)},
    "mhc": {"call": (49, 0, 86), "sinkhorn_iter": (4, 0, 6)},
    "norms": {"call": (8, 0, 18)},
    "other": {"call": (43, 0, 43)},
}
# forward ops of one loop body under torch.no_grad (scoring): the top-k as in training, no indexer KL, no checkpoints
EVAL_OPS: dict = {
    "kda": {"call": (79,), "block": (91,), "chunk": (3,)},
    "dsa_attention": {"call": (103,), "attn_tile": (21,), "dense_call": (23,), "dense_tile": (28,)},
    "dsa_indexer": {"call": (32,), "topk_call": (8,), "topk_tile": (19,), "topk_block": (19,), "topk_masked": (5,)},
    "moe": {"call": (20,), "chunk": (49,)},
    "dense_mlp": {"call": (16,)},
    "mhc": {"call": (45,), "sinkhorn_iter": (4,)},
    "norms": {"call": (7,)},
    "other": {"call": (17,)},
}
# the chunked backward (genoctx.train.chunked): its loop per chunk, and a full DSA layer's cache joins per later chunk
CHUNKED_OPS: dict = {"other": {"chunk": (22, 0, 2)}, "dsa_indexer": {"cached": (0, 0, 14)}}
# FSDP2 (``fully_shard``: each group's parameters all-gathered into the unsharded tensors before its forward and
# again before its backward, gradients reduce-scattered after): its runtime's ops land in ``other``, per group and per
# parameter tensor (averaged over a group's tensors, hence not whole), forward and backward; the model's own code
# changes by a few ops under it (a KDA layer's and an mHC call's parameters arrive as plain unsharded tensors, the
# gradient accumulation of the mHC parameters goes through FSDP's hooks); the clip and AdamW step over DTensors
FSDP_OPS = {"group": (60, 0, 12), "tensor": (6.3, 0, 1.15), "kda_layer": (-3, 0, -4), "mhc_call": (0, 0, 19),
            "dsa_indexer_call": (2, 0, 0), "optimizer": -20, "eval_group": 43}  # fmt: skip
# the optimizer pass: gradient clip, foreach AdamW (two host reads of each tensor's step count), schedule, the router
# biases' update and the step's metric read: per step, per trained parameter tensor, per MoE layer
OPTIMIZER_OPS = {"step": 60, "tensor": 2, "moe_layer": 20}
# context parallelism (``genoctx.parallel.context``; the rank holding the window's last piece, contiguous layout),
# per layer call beside its one-process loop bodies (planned after the ``S`` positions of the earlier pieces):
# - a KDA layer runs the ``[L | M]`` state pass of ``kda_cp_cache`` first: its projections, the conv tails'
#   all-gather, ``chunk_kda`` over the piece with values ``[v | 0]`` and the fold of the gathered transfer maps
#   (``piece``: per CP rank); ``call`` here, plus the pass's own blocks and chunks (``OPS["kda"]``' forward ones in
#   forward; under its checkpoint again in backward, with their backward ones);
# - a DSA layer takes the window's latents and pooled keys all-gathered (autograd-aware: gradients sent back);
# - ``other``: the step's own (the window's pieces cut out).
# CP always runs under FSDP2 (it shards over ``dp_shard x cp``), whose ``kda_layer`` change a KDA layer under CP does
# not see: its ``call`` includes that. Counted by OpCounter on cp = 2 and 4 ranks (``bench/op_count.py --cp 2``).
CP_OPS = {"kda": {"call": (110, 57, 233), "piece": (9, 0, 14)}, "dsa_attention": {"call": (39, 0, 54)},
          "dsa_indexer": {"call": (27, 0, 36)}, "other": {"call": (5, 0, 3)}}  # fmt: skip
CP_EVAL_OPS = {"kda": {"call": (104,), "piece": (9,)}, "dsa_attention": {"call": (33,)}, "dsa_indexer": {"call": (29,)}}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rank_rounds(seq_len: int, cp: int = 1, seq_chunk_tokens: int | None = None) -> list[tuple[int, int]]:
    """The busiest rank's forward calls of a training step: ``(S, T)``, its ``T`` tokens after ``S`` earlier positions
    of the window, per round: one round (the whole window, or under CP the last piece), or, with ``seq_chunk_tokens``
    below the rank's share, rounds of ``cp x seq_chunk_tokens`` tokens whose last pieces it holds: the contiguous CP
    layout's pieces of ``genoctx.plan.flops._rank_rounds`` (one per round)."""
    from .flops import _rank_rounds

    return [pieces[0] for pieces in _rank_rounds(seq_len, cp, "contiguous", seq_chunk_tokens)]


def kda_units(cfg: ModelConfig, T: int) -> dict:
    """Loop bodies of one KDA layer's forward over ``T`` tokens: ``call``, ``block`` (``chunk_kda``'s blocks of
    ``kda_block_tokens`` rounded down to whole chunks) and ``chunk`` (chunks of ``kda_chunk_size``, each block padded
    to whole chunks)."""
    C = cfg.kda_chunk_size
    block = T if cfg.kda_block_tokens is None else max(C, cfg.kda_block_tokens // C * C)
    full, rest = divmod(T, block)
    return {"call": 1, "block": full + (1 if rest else 0), "chunk": full * _cdiv(block, C) + _cdiv(rest, C)}


def moe_units(cfg: ModelConfig, rows: int) -> dict:
    """Loop bodies of one MoE layer's forward over ``rows`` tokens (``B x T``): ``call`` and ``chunk`` (token chunks
    of ``moe_chunk_tokens``; the routed experts run as two grouped products per chunk, whatever their number)."""
    return {"call": 1, "chunk": _cdiv(rows, cfg.moe_chunk_tokens)}


def topk_row_tiles(cfg: ModelConfig, T: int, S: int = 0) -> tuple[int, int, list[tuple[int, int, int, int]]]:
    """``genoctx.model.dsa.indexer_topk``'s loop bounds (no pruning) over ``T`` queries after ``S`` positions:
    ``(C, K, tiles)`` with ``C`` key columns per block, ``K`` pools kept per query and one ``(r0, r1, n_vis, first)``
    per row tile (its rows, the pools its last row and its first row see); no tiles when nothing is selected.
    These are the eager tiles: a CPU call scoring ``dsa.INDEX_COMPILE_PAIRS`` pairs and more with a narrow indexer
    (tiny at 256k tokens and beyond) takes its long tiles from one compiled kernel per block and about fifteen ops
    per tile (``dsa._grouped_topk``), fewer ops and bytes than planned here."""
    from ..model.dsa import INDEX_COL_BLOCK, INDEX_GROUP, INDEX_ROW_TILE

    kp, g, tile = cfg.index_kpool, INDEX_GROUP, cfg.indexer_tile_tokens
    n_pools = (S + T) // kp
    K = min(cfg.index_topk // kp, n_pools)
    if K == 0 or T == 0:
        return g, K, []
    C = max(g, min(INDEX_COL_BLOCK, tile) // g * g)
    C = max(g, min(C, _cdiv(n_pools, g) * g))
    R = max(1, min(INDEX_ROW_TILE, T, tile // C))
    tiles = [(r0, min(T, r0 + R), (S + min(T, r0 + R)) // kp, (S + r0 + 1) // kp) for r0 in range(0, T, R)]
    return C, K, tiles


def dsa_units(cfg: ModelConfig, T: int, B: int = 1, S: int = 0) -> dict:
    """Loop bodies of one DSA layer's forward over ``T`` queries (a window's start; ``B`` windows): ``call``, the
    sparse attention's query tiles (``attn_tile``: ``_SparseMLA``'s, as many for the sparse-stage indexer KL,
    ``kl_tile``) and the indexer top-k's row tiles (``topk_tile``), key blocks (``topk_block``) and the blocks that
    cross the causal boundary (``topk_masked``): ``genoctx.model.dsa.indexer_topk``'s loop bounds (no pruning)."""
    from ..model.dsa import DENSE_RATIO, _dense_split, _dense_tiles, _sparse_tiles, attn_tile_tokens

    kp = cfg.index_kpool
    n_pools = T // kp
    K = min(cfg.index_topk // kp, n_pools)
    width = K * kp + (kp - 1 if cfg.index_kpool_always_select_tail else 0)
    H, R = cfg.num_attention_heads, cfg.kv_lora_rank
    tile_tokens = attn_tile_tokens(R, H)
    rows = B * max(1, tile_tokens // max(1, width))
    split, drows = _dense_split(width, S + T, T, H, R, tile_tokens, DENSE_RATIO)  # dense tiles, S cached
    tiles, dense = len(_sparse_tiles(B, T, split, rows)), len(_dense_tiles(T, split, drows))
    out = {"call": 1, "attn_tile": tiles, "kl_tile": tiles, "dense_call": int(dense > 0), "dense_tile": dense,
           "kl_dense_call": int(dense > 0), "kl_dense_tile": B * dense, "topk_call": 0, "topk_tile": 0,
           "topk_block": 0, "topk_masked": 0}  # fmt: skip
    C, _, tiles = topk_row_tiles(cfg, T)
    if not tiles:
        return out
    row_tiles = blocks = masked = 0
    for _, _, n_vis, first in tiles:
        row_tiles += 1
        nb = _cdiv(n_vis, C)
        blocks += nb
        # a block needs the causal mask when it ends past the first row's visible keys (min(n_vis, c0 + C) > first)
        masked += nb - first // C - (1 if n_vis == first and n_vis % C else 0)
    out.update(topk_call=1, topk_tile=B * row_tiles, topk_block=B * blocks, topk_masked=B * masked)
    return out


def _add(out: dict, comp: str, table: dict, units: dict, times: int = 1, passes=("forward", "recompute",
                                                                               "backward")) -> None:  # fmt: skip
    for unit, n in units.items():
        per = table.get(comp, {}).get(unit)
        if per is None or not n:
            continue
        for p, v in zip(passes, per, strict=False):
            out[comp][p] += v * n * times


def _empty() -> dict:
    return {c: dict.fromkeys(PASSES, 0) for c in COMPONENTS}


def _layers(cfg: ModelConfig, out: dict, table: dict, tokens: int, batch: int, passes, cached: int = 0,
            selected: bool = False) -> None:  # fmt: skip
    """Every layer's loop bodies over ``tokens`` after ``cached`` positions into ``out``; ``selected``: the DSA top-k
    selections are given (the chunked step's grad pass and its recompute reuse the sweep's,
    ``genoctx.train.chunked``): no ``topk_*`` units."""
    for i, kind in enumerate(cfg.layer_types):
        if kind == KDA:
            _add(out, "kda", table, kda_units(cfg, tokens), 1, passes)
        elif kind == DSA:
            u = dsa_units(cfg, tokens, batch, cached)
            att = ("attn_tile", "dense_call", "dense_tile")
            _add(out, "dsa_attention", table, {"call": 1, **{k: u[k] for k in att}}, 1, passes)
            if cfg.indexer_types[i] == "full":
                skip = att + (("topk_call", "topk_tile", "topk_block", "topk_masked") if selected else ())
                _add(out, "dsa_indexer", table, {k: v for k, v in u.items() if k not in skip}, 1, passes)
        if cfg.mlp_layer_types[i] == "sparse":
            _add(out, "moe", table, moe_units(cfg, batch * tokens), 1, passes)
        else:
            _add(out, "dense_mlp", table, {"call": 1}, 1, passes)
        _add(out, "mhc", table, {"call": 2, "sinkhorn_iter": 2 * cfg.hc_sinkhorn_iters}, 1, passes)
        _add(out, "norms", table, {"call": 2}, 1, passes)
    _add(out, "other", table, {"call": 1}, 1, passes)


def _cp(cfg: ModelConfig, out: dict, tokens: int, cp: int, mode: str) -> None:
    """Context parallelism's ops (``CP_OPS``, ``CP_EVAL_OPS``) of one forward call of every layer over the rank's
    ``tokens`` (of ``cp`` pieces) into ``out``; ``mode`` "train" (forward, recompute, backward) or "eval" (forward)."""
    table, body = (CP_OPS, OPS) if mode == "train" else (CP_EVAL_OPS, EVAL_OPS)  # body: the state pass's chunk_kda
    passes = ("forward", "recompute", "backward") if mode == "train" else ("forward",)
    u = kda_units(cfg, tokens)
    _add(out, "other", table, {"call": 1}, 1, passes)
    for i, kind in enumerate(cfg.layer_types):
        if kind == KDA:
            _add(out, "kda", table, {"call": 1, "piece": cp}, 1, passes)  # the fold: per gathered piece
            for unit in ("block", "chunk"):  # the state pass's chunk_kda
                f = body["kda"][unit][0] * u[unit]
                out["kda"]["forward"] += f
                if mode == "train":  # its checkpoint reruns the pass in backward, then its backward
                    out["kda"]["backward"] += f + body["kda"][unit][2] * u[unit]
        elif kind == DSA:
            _add(out, "dsa_attention", table, {"call": 1}, 1, passes)
            if cfg.indexer_types[i] == "full":
                _add(out, "dsa_indexer", table, {"call": 1}, 1, passes)


def _totals(out: dict) -> dict:
    by_pass = {p: sum(out[c][p] for c in COMPONENTS) for p in PASSES}
    return {"components": out, "by_pass": by_pass, "total": sum(by_pass.values())}


def step_ops(cfg: ModelConfig, seq_len: int, layout: Layout | None = None, *, batch_size: int = 1,
             recompute: bool = False, seq_chunk_tokens: int | None = None, trainable=None,
             trainable_tensors: int | None = None) -> dict:  # fmt: skip
    """Aten ops of one training step on a rank (``genoctx.train.loop.train_step``), per component and pass.

    Args:
        cfg: the architecture and its compute knobs; seq_len: tokens per window; batch_size: windows per rank.
        layout: the parallel layout: ``cp`` splits the window and adds its own ops (``CP_OPS``: the KDA state pass,
            the DSA layers' gathered keys; the contiguous layout); FSDP2's (``FSDP_OPS``) whenever it shards
            (``dp_shard x cp > 1`` or ``fsdp_one``: ``genoctx.parallel.mesh`` shards over ``dp_shard x cp``);
            other dimensions add no model ops here. The contiguous CP layout (zigzag's two pieces per rank are
            planned as one: about 6% under on tiny); the rank planned is the last piece's (rank 0 issues ~170 more
            ops: its first queries' dense tiles). CP or FSDP2 with ``seq_chunk_tokens``: the CP ops per round and
            FSDP2's once per step (each round gathers again: 5-9% under on tiny at cp = 2), not yet per round.
        recompute: activation checkpointing (``apply_ac``): every decoder layer's forward runs once more in
            backward, planned as the layers' forward ops again in ``recompute`` (not yet checked against a count).
        seq_chunk_tokens: the chunked backward's chunk, or None (one pass).
        trainable, trainable_tensors: the optimizer's parameter tensors (None: every parameter tensor of the model).

    Returns:
        ``{"components": {component: {pass: ops}}, "by_pass": {pass: ops}, "total": ops}`` (``COMPONENTS``,
        ``PASSES``).
    """
    layout = layout or Layout()
    out = _empty()
    rounds = rank_rounds(seq_len, layout.cp, seq_chunk_tokens)
    sel = len(rounds) > 1  # chunked: the top-k runs in the no-grad sweep only
    for i, (S, t) in enumerate(rounds):  # S: the piece's earlier positions (cached, or other ranks' pieces)
        _layers(cfg, out, OPS, t, batch_size, ("forward", "recompute", "backward"), S, sel)
        if layout.cp > 1:
            _cp(cfg, out, t, layout.cp, "train")
        if recompute:
            again = _empty()
            _layers(cfg, again, OPS, t, batch_size, ("forward",), S, sel)
            if layout.cp > 1:  # the layer's rerun runs its state pass's forward again
                _cp(cfg, again, t, layout.cp, "train")
            for c in COMPONENTS:
                out[c]["recompute"] += again[c]["forward"] if c != "other" else 0
        if sel:  # the chunked backward's no-grad sweep runs every chunk once more (genoctx.train.chunked)
            _layers(cfg, out, EVAL_OPS, t, batch_size, ("forward",), S)
            if layout.cp > 1:
                _cp(cfg, out, t, layout.cp, "eval")
            _add(out, "other", CHUNKED_OPS, {"chunk": 1}, 1, ("forward", "recompute", "backward"))
            if i:  # a chunk after the first joins the caches handed to it (the DSA layers' latents and pools)
                full = sum(1 for j, k in enumerate(cfg.layer_types) if k == DSA and cfg.indexer_types[j] == "full")
                _add(out, "dsa_indexer", CHUNKED_OPS, {"cached": full}, 1, ("forward", "recompute", "backward"))
    if layout.dp_shard * layout.cp > 1 or layout.fsdp_one:
        _fsdp(cfg, out, layout)
    if trainable_tensors is None:
        from .trainable import check_trainable, param_entries

        tr = trainable if trainable is not None else check_trainable("all", 0, "bf16", None)
        trainable_tensors = sum(1 for e in param_entries(cfg, tr) if e["train"])
    moe = sum(1 for t in cfg.mlp_layer_types if t == "sparse")
    out["other"]["optimizer"] += (OPTIMIZER_OPS["step"] + OPTIMIZER_OPS["tensor"] * trainable_tensors
                                  + OPTIMIZER_OPS["moe_layer"] * moe)  # fmt: skip
    return _totals(out)


def _fsdp(cfg: ModelConfig, out: dict, layout: Layout) -> None:
    """FSDP2's ops of a training step (``FSDP_OPS``) into ``out``, from its groups
    (``genoctx.plan.comms.fsdp_groups``)."""
    from .comms import fsdp_groups
    from .trainable import check_trainable, param_entries

    groups = len(fsdp_groups(cfg, layout, "fp32"))
    tensors = len(param_entries(cfg, check_trainable("all", 0, "bf16", None)))
    f = FSDP_OPS
    n_kda = cfg.layer_types.count(KDA)
    n_idx = sum(1 for i, k in enumerate(cfg.layer_types) if k == DSA and cfg.indexer_types[i] == "full")
    terms = [
        ("other", groups, f["group"]),
        ("other", tensors, f["tensor"]),
        ("kda", n_kda, f["kda_layer"]),
        ("mhc", 2 * cfg.num_hidden_layers, f["mhc_call"]),
        ("dsa_indexer", n_idx, f["dsa_indexer_call"]),
    ]
    for comp, n, per in terms:
        for p, v in zip(("forward", "recompute", "backward"), per, strict=True):
            out[comp][p] += round(v * n)
    out["other"]["optimizer"] += f["optimizer"]


def eval_ops(cfg: ModelConfig, seq_len: int, layout: Layout | None = None, chunk_tokens: int | None = None) -> dict:
    """Aten ops of scoring one window (no gradient) on a rank, in chunks of ``chunk_tokens`` (None: one pass); the
    same dict as ``step_ops`` with every op in ``forward``. Under CP the busiest rank's (the last piece: its layers'
    CP ops, ``CP_EVAL_OPS``, and the scorer's, ``genoctx.eval.distributed.mesh_scorer``), under FSDP2 its forward
    gathers (``FSDP_OPS["eval_group"]`` per group). (Under CP only the mixers stream in ``chunk_tokens``: planned
    per chunk, the count is over-planned there.)"""
    layout = layout or Layout()
    out = _empty()
    tokens = seq_len // layout.cp
    chunk = chunk_tokens or tokens
    for t0 in range(0, tokens, chunk):
        _layers(cfg, out, EVAL_OPS, min(chunk, tokens - t0), 1, ("forward",), seq_len - tokens + t0)
        if layout.cp > 1:
            _cp(cfg, out, min(chunk, tokens - t0), layout.cp, "eval")
    if layout.dp_shard * layout.cp > 1 or layout.fsdp_one:  # FSDP2's forward gathers, per group
        from .comms import fsdp_groups

        out["other"]["forward"] += FSDP_OPS["eval_group"] * len(fsdp_groups(cfg, layout, "fp32"))
    return _totals(out)
