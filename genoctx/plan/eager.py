"""Bytes the eager ops of a step move, per component, pass and kind: the memory-bound term of the PyTorch path.

Why: genoctx's PyTorch path (``kda_kernel: torch``, ``kernels: torch``, and the mHC, norm and MoE code on every
device) runs each elementwise op, reduction, copy and gather as its own kernel, which reads its inputs from memory
and writes its output back. A fused kernel would move a layer's activations once (``genoctx.plan.time``'s
``activations`` memory model); the eager chain moves them once per op: ``cpu-small`` at 2k tokens moves 5.8 GB
elementwise, 0.5 GB of gathers and 2.5 GB of products' operands where the activation model counts 1.4 GB
(``docs/plan.md``, "Checked on this machine"). ``genoctx.plan.time`` uses these bytes under ``memory_model: eager``
(a CPU profile).

What is counted: what ``genoctx.model.opcount.OpCounter`` counts in ``bytes[component][pass][kind]``
(``genoctx.model.opcount.op_bytes``: the bytes of every tensor an op takes and returns, views and allocations
excluded), the optimizer pass and FSDP's and CP's collectives aside; kinds ``elementwise`` (pointwise ops,
reductions, copies, concatenations), ``gather`` (row gathers and scatters) and ``matmul`` (the products' operands
and outputs, whose FLOPs ``genoctx.plan.flops`` counts).

Method: a linear model. Each component's bytes per token are a sum of features, each a count of elements per
token that the code's tensors hold (``features``: products of the component's dims, e.g. ``n D`` for the mHC
streams, ``H C`` for a KDA chunk's score rows, ``H W`` for a DSA query's scores over its ``W`` slots, ``H_I P`` for
the indexer's scores over the pools each query sees, ``1 / c`` for the MoE's dispatch chunks of ``c`` tokens),
times a coefficient in bytes per element (``COEFS[component][pass][kind]``). The coefficients are fitted by least
squares to OpCounter's bytes of real steps of 30 random small configs (``bench/op_count.py --fit-bytes``, which
prints the tables below); ``tests/plan/test_ops.py`` holds the model to the bytes counted on configs it was not
fitted on (tiny and cpu-small at three lengths each, a chunked step, no-grad forwards): each kind within 8%, each
component within 25%. It is a fit over dims, not a count op by op: a config whose dims lie far outside the fitted
ranges (``bench/op_count.py``'s ``FIT_DIMS``) may be off by more, and a fitted total below zero counts as zero.

Units: bytes (floats). ``T``: tokens of the forward call on the rank, ``S``: positions before them (cache or
earlier CP pieces).
"""

from __future__ import annotations

from ..model.config import DSA, KDA, ModelConfig
from ..parallel.layout import Layout

PASSES = ("forward", "recompute", "backward")
KINDS = ("elementwise", "gather", "matmul")
COMPONENTS = ("kda", "dsa_attention", "dsa_indexer", "moe", "dense_mlp", "mhc", "norms", "other")


def _dsa_shape(cfg: ModelConfig, T: int, S: int) -> dict:
    """The sparse attention's and the indexer's sizes for ``T`` queries after ``S`` positions: ``W`` slots per query,
    ``split`` queries attended densely (``genoctx.model.dsa._dense_split``), ``dense`` (query, key) pairs of those,
    ``K`` pools selected."""
    from ..model.dsa import DENSE_RATIO, _dense_split, attn_tile_tokens

    kp = cfg.index_kpool
    K = min(cfg.index_topk // kp, (S + T) // kp)
    W = K * kp + (kp - 1 if cfg.index_kpool_always_select_tail else 0)
    H, R = cfg.num_attention_heads, cfg.kv_lora_rank
    split, _ = _dense_split(W, S + T, T, H, R, attn_tile_tokens(R, H), DENSE_RATIO)
    return {"W": W, "split": split, "dense": split * (S + split), "K": K}


def _topk_tiles(cfg: ModelConfig, T: int, S: int) -> dict:
    """The indexer top-k's score elements (``scored``: each row's visible pools) and merged candidates (``merged``: a
    tile's rows x (K + block columns) per block) over ``T`` queries after ``S`` positions, from
    ``genoctx.plan.ops.topk_row_tiles``."""
    from .ops import _cdiv, topk_row_tiles

    C, K, tiles = topk_row_tiles(cfg, T, S)
    scored = sum((r1 - r0) * n_vis for r0, r1, n_vis, _ in tiles)
    merged = sum((r1 - r0) * _cdiv(n_vis, C) * (K + C) for r0, r1, n_vis, _ in tiles)
    return {"scored": scored, "merged": merged}


def features(cfg: ModelConfig, comp: str, T: int, S: int = 0, selected: bool = False) -> dict:
    """Elements per token of ``comp``'s tensors, one instance (a KDA or DSA layer, an MoE or dense MLP, one mHC call,
    one norm, the model's ``other``), over ``T`` tokens after ``S``: ``{feature: elements}`` (``COEFS``' order).
    ``selected``: the DSA top-k selections are given (the chunked backward's grad pass reuses its sweep's,
    ``genoctx.train.chunked``): no top-k scoring in the indexer's features.

    Raises:
        ValueError: an unknown component.
    """
    D, n = cfg.hidden_size, cfg.hc_mult
    if comp == "kda":
        H, K, C = cfg.linear_num_heads, cfg.linear_head_dim, cfg.kda_chunk_size
        return {"1": 1, "D": D, "HK": H * K, "HC": H * C, "HKK/C": H * K * K / C}
    if comp == "mhc":
        return {"1": 1, "nD": n * D, "D": D, "n2i": n * n * cfg.hc_sinkhorn_iters}
    if comp == "norms":
        return {"1": 1, "D": D}
    if comp == "dense_mlp":
        return {"1": 1, "D": D, "I": cfg.intermediate_size}
    if comp == "moe":
        k, Im = cfg.num_experts_per_tok, cfg.moe_intermediate_size
        c = min(cfg.moe_chunk_tokens, T) if T else 1  # tokens per dispatch chunk: each chunk's [E] and [c, E] tensors
        E = cfg.n_routed_experts
        return {"1": 1, "D": D, "kI": k * Im, "sI": cfg.n_shared_experts * Im, "E": E, "kD": k * D, "1/c": 1 / c,
                "E/c": E / c}  # fmt: skip
    if comp in ("dsa_attention", "dsa_indexer"):
        H, R, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        s = _dsa_shape(cfg, T, S)
        sparse = (T - s["split"]) / T if T else 0.0
        dense = s["dense"] / T if T else 0.0
        common = {"1": 1, "D": D, "HW": H * s["W"] * sparse, "Hdense": H * dense, "dense": dense,
                  "WR": s["W"] * (R + dr) * sparse, "W": s["W"] * sparse}  # fmt: skip
        if comp == "dsa_attention":
            hd = cfg.qk_nope_head_dim + dr
            return {**common, "Hhd": H * (hd + cfg.v_head_dim + R), "q": cfg.q_lora_rank}
        iH = cfg.index_n_heads
        blk = {"scored": 0, "merged": 0} if selected else _topk_tiles(cfg, T, S)
        scored = blk["scored"] / T if T else 0.0
        return {**common, "iHd": iH * cfg.index_head_dim, "iHP": iH * scored, "P": scored,
                "merge": blk["merged"] / T if T else 0.0, "K": s["K"], "Kd": s["K"] * cfg.index_head_dim * sparse,
                "iHK": iH * s["K"] * sparse, "iHdense": iH * dense}  # fmt: skip
    if comp == "other":
        return {"1": 1, "D": D, "nD": n * D, "V": cfg.vocab_size}
    raise ValueError(f"unknown component {comp!r}")


# bytes per element of each feature, per component, pass and kind: fitted by ``bench/op_count.py --fit-bytes``
# (module docstring); ``EVAL_COEFS``: the no-grad forward of scoring. Missing entries are 0.
COEFS: dict = {
    "kda": {
        "forward": {
            "elementwise": {"1": -1028.0, "D": -10.1, "HK": 876.9, "HC": 31.79, "HKK/C": -47.91},
            "matmul": {"1": 37.01, "D": 27.86, "HK": 189.4, "HC": 17.92, "HKK/C": 7.052},
        },
        "backward": {
            "elementwise": {"1": -2022.0, "D": 44.04, "HK": 1819.0, "HC": 103.3, "HKK/C": -51.14},
            "matmul": {"1": -12.52, "D": 54.97, "HK": 486.7, "HC": 54.8, "HKK/C": 17.96},
        },
    },
    "dsa_attention": {
        "forward": {
            "elementwise": {
                "1": 1274.0,
                "D": -8.642,
                "HW": 13.7,
                "Hdense": 40.23,
                "dense": 56.24,
                "WR": 0.5295,
                "W": 68.16,
                "Hhd": 8.101,
                "q": 27.35,
            },
            "gather": {
                "1": 62.76,
                "D": -0.15,
                "HW": -0.3222,
                "Hdense": -0.08058,
                "dense": 11.92,
                "WR": 4.105,
                "W": 6.526,
                "Hhd": 0.2057,
                "q": 0.6633,
            },
            "matmul": {
                "1": -76.78,
                "D": 11.72,
                "HW": 5.895,
                "Hdense": 7.704,
                "dense": 0.6265,
                "WR": 8.324,
                "W": 0.525,
                "Hhd": 16.13,
                "q": 10.01,
            },
        },
        "backward": {
            "elementwise": {
                "1": 2094.0,
                "D": 3.114,
                "HW": 37.58,
                "Hdense": 82.58,
                "dense": 56.54,
                "WR": 2.002,
                "W": 50.93,
                "Hhd": 20.33,
                "q": 106.3,
            },
            "gather": {
                "1": 182.5,
                "D": -0.1535,
                "HW": -0.7823,
                "Hdense": -0.1702,
                "dense": 11.37,
                "WR": 8.328,
                "W": 11.07,
                "Hhd": 0.3751,
                "q": 2.109,
            },
            "matmul": {
                "1": -310.7,
                "D": 23.92,
                "HW": 13.17,
                "Hdense": 19.77,
                "dense": 2.084,
                "WR": 28.66,
                "W": 1.495,
                "Hhd": 35.06,
                "q": 17.92,
            },
        },
    },
    "dsa_indexer": {
        "forward": {
            "elementwise": {
                "1": 1147.0,
                "D": 1.373,
                "HW": 20.7,
                "Hdense": 38.72,
                "dense": 46.25,
                "WR": 0.07657,
                "W": 35.04,
                "iHd": 4.84,
                "iHP": 8.842,
                "P": 30.17,
                "merge": 6.845,
                "K": 445.2,
                "Kd": 1.009,
                "iHK": 4.801,
                "iHdense": 2.692,
            },
            "gather": {
                "1": 356.2,
                "D": -0.4806,
                "HW": -0.4162,
                "Hdense": 2.433,
                "dense": 15.24,
                "WR": 4.098,
                "W": -5.798,
                "iHd": 5.68,
                "iHP": 0.3805,
                "P": 2.155,
                "merge": 2.315,
                "K": 151.5,
                "Kd": 8.137,
                "iHK": -13.82,
                "iHdense": -3.346,
            },
            "matmul": {
                "1": 1042.0,
                "D": 10.7,
                "HW": 5.809,
                "Hdense": 10.91,
                "dense": -6.932,
                "WR": 4.21,
                "W": -28.83,
                "iHd": 37.71,
                "iHP": 12.94,
                "P": -12.29,
                "merge": 9.087,
                "K": 154.7,
                "Kd": 11.12,
                "iHK": -8.506,
                "iHdense": -4.098,
            },
        },
        "backward": {
            "elementwise": {
                "1": 487.3,
                "D": 1.217,
                "HW": 0.5209,
                "Hdense": 1.024,
                "dense": -0.4288,
                "WR": -0.006319,
                "W": -4.663,
                "iHd": 17.69,
                "iHP": 0.05294,
                "P": -3.195,
                "merge": 1.513,
                "K": 0.967,
                "Kd": 2.001,
                "iHK": -3.825,
                "iHdense": -1.211,
            },
            "matmul": {
                "1": 177.8,
                "D": 12.03,
                "HW": 0.2844,
                "Hdense": 0.4143,
                "dense": -0.007459,
                "WR": -0.01467,
                "W": 0.08871,
                "iHd": 6.19,
                "iHP": 0.01421,
                "P": 0.4912,
                "merge": -0.2763,
                "K": -0.2312,
                "Kd": -0.01556,
                "iHK": -0.1586,
                "iHdense": -0.3623,
            },
        },
    },
    "moe": {
        "forward": {
            "elementwise": {
                "1": 164.2,
                "D": 21.76,
                "kI": 36.7,
                "sI": 35.61,
                "E": 22.02,
                "kD": 13.81,
                "1/c": 1276.0,
                "E/c": -132.1,
            },
            "gather": {
                "1": 65.79,
                "D": 10.81,
                "kI": 0.3062,
                "sI": -0.1625,
                "E": 4.992,
                "kD": 8.933,
                "1/c": 501.6,
                "E/c": -64.8,
            },
            "matmul": {
                "1": -803.5,
                "D": 28.42,
                "kI": 22.53,
                "sI": 17.82,
                "E": 8.318,
                "kD": 3.361,
                "1/c": 11960.0,
                "E/c": 15300.0,
            },
        },
        "recompute": {
            "elementwise": {
                "1": 135.1,
                "D": 1.915,
                "kI": 0.5522,
                "sI": -0.2797,
                "E": 9.428,
                "kD": 13.72,
                "1/c": 790.3,
                "E/c": -96.16,
            },
            "gather": {
                "1": 56.16,
                "D": 3.006,
                "kI": 0.2667,
                "sI": -0.1378,
                "E": 4.764,
                "kD": 4.796,
                "1/c": 408.3,
                "E/c": -48.82,
            },
            "matmul": {
                "1": -803.5,
                "D": 28.42,
                "kI": 22.53,
                "sI": 17.82,
                "E": 8.318,
                "kD": 3.361,
                "1/c": 11960.0,
                "E/c": 15300.0,
            },
        },
        "backward": {
            "elementwise": {
                "1": -2491.0,
                "D": 83.08,
                "kI": 176.8,
                "sI": 155.8,
                "E": -10.32,
                "kD": 15.06,
                "1/c": 17070.0,
                "E/c": 48220.0,
            },
            "gather": {
                "1": 52.6,
                "D": 11.05,
                "kI": 0.2452,
                "sI": -0.1298,
                "E": 8.81,
                "kD": 8.745,
                "1/c": 405.5,
                "E/c": -65.51,
            },
            "matmul": {
                "1": -1607.0,
                "D": 56.84,
                "kI": 45.05,
                "sI": 35.65,
                "E": 16.64,
                "kD": 6.721,
                "1/c": 23920.0,
                "E/c": 30600.0,
            },
        },
    },
    "dense_mlp": {
        "forward": {"elementwise": {"I": 36.0}, "matmul": {"1": -52.41, "D": 13.06, "I": 13.0}},
        "backward": {"elementwise": {"D": 12.0, "I": 96.0}, "matmul": {"1": -104.8, "D": 26.11, "I": 26.0}},
    },
    "mhc": {
        "forward": {
            "elementwise": {"1": 342.3, "nD": 49.48, "D": 5.327, "n2i": 32.66},
            "matmul": {"1": 21.09, "nD": 12.68, "D": -0.8139, "n2i": 0.2315},
        },
        "backward": {
            "elementwise": {"1": 545.7, "nD": 154.1, "D": -12.58, "n2i": 56.66},
            "matmul": {"1": 42.17, "nD": 25.35, "D": -1.628, "n2i": 0.4629},
        },
    },
    "norms": {
        "forward": {"elementwise": {"1": 24.0, "D": 28.01}},
        "backward": {"elementwise": {"1": 36.0, "D": 96.01}},
    },
    "other": {
        "forward": {
            "elementwise": {"1": 3.752, "D": 20.11, "nD": 15.78, "V": 30.01},
            "gather": {"1": 0.1231, "D": 4.056, "nD": 3.964e-09, "V": 0.9849},
            "matmul": {"1": 0.4924, "D": 4.056, "nD": 5.086e-08, "V": 3.939},
        },
        "backward": {
            "elementwise": {"1": 4.191, "D": 89.1, "nD": 15.32, "V": 33.53},
            "gather": {"1": 0.1231, "D": 4.056, "nD": 3.964e-09, "V": 0.9849},
            "matmul": {"1": 0.9848, "D": 8.112, "nD": 1.017e-07, "V": 7.879},
        },
    },
}
EVAL_COEFS: dict = {
    "kda": {
        "forward": {
            "elementwise": {"1": -1028.0, "D": -10.1, "HK": 876.9, "HC": 31.79, "HKK/C": -47.91},
            "matmul": {"1": 37.01, "D": 27.86, "HK": 189.4, "HC": 17.92, "HKK/C": 7.052},
        }
    },
    "dsa_attention": {
        "forward": {
            "elementwise": {
                "1": 1274.0,
                "D": -8.642,
                "HW": 13.7,
                "Hdense": 40.23,
                "dense": 56.24,
                "WR": 0.5295,
                "W": 68.16,
                "Hhd": 8.101,
                "q": 27.35,
            },
            "gather": {
                "1": 62.76,
                "D": -0.15,
                "HW": -0.3222,
                "Hdense": -0.08058,
                "dense": 11.92,
                "WR": 4.105,
                "W": 6.526,
                "Hhd": 0.2057,
                "q": 0.6633,
            },
            "matmul": {
                "1": -76.78,
                "D": 11.72,
                "HW": 5.895,
                "Hdense": 7.704,
                "dense": 0.6265,
                "WR": 8.324,
                "W": 0.525,
                "Hhd": 16.13,
                "q": 10.01,
            },
        }
    },
    "dsa_indexer": {
        "forward": {
            "elementwise": {
                "1": 555.1,
                "D": 1.308,
                "HW": 0.1305,
                "Hdense": 0.7604,
                "dense": -0.08612,
                "WR": 0.03574,
                "W": -5.965,
                "iHd": 3.847,
                "iHP": 8.092,
                "P": 41.9,
                "merge": 1.891,
                "K": 139.8,
                "Kd": 2.65,
                "iHK": -3.696,
                "iHdense": -0.9969,
            },
            "gather": {"P": 8.0, "K": 64.0},
            "matmul": {
                "1": 214.3,
                "D": 12.9,
                "HW": -0.06163,
                "Hdense": 0.511,
                "dense": -0.2083,
                "WR": 0.02521,
                "W": -1.542,
                "iHd": 10.33,
                "iHP": 12.06,
                "P": 6.74,
                "merge": 0.6315,
                "K": -0.7596,
                "Kd": 0.5475,
                "iHK": -1.547,
                "iHdense": -0.4529,
            },
        }
    },
    "moe": {
        "forward": {
            "elementwise": {
                "1": 164.2,
                "D": 21.76,
                "kI": 36.7,
                "sI": 35.61,
                "E": 21.98,
                "kD": 13.81,
                "1/c": 1277.0,
                "E/c": -132.6,
            },
            "gather": {
                "1": 65.79,
                "D": 10.81,
                "kI": 0.3062,
                "sI": -0.1625,
                "E": 4.992,
                "kD": 8.933,
                "1/c": 501.6,
                "E/c": -64.8,
            },
            "matmul": {
                "1": -803.5,
                "D": 28.42,
                "kI": 22.53,
                "sI": 17.82,
                "E": 8.318,
                "kD": 3.361,
                "1/c": 11960.0,
                "E/c": 15300.0,
            },
        }
    },
    "dense_mlp": {"forward": {"elementwise": {"I": 36.0}, "matmul": {"1": -52.41, "D": 13.06, "I": 13.0}}},
    "mhc": {
        "forward": {
            "elementwise": {"1": 342.3, "nD": 49.48, "D": 5.327, "n2i": 32.66},
            "matmul": {"1": 21.09, "nD": 12.68, "D": -0.8139, "n2i": 0.2315},
        }
    },
    "norms": {"forward": {"elementwise": {"1": 24.0, "D": 28.01}}},
    "other": {
        "forward": {
            "elementwise": {"1": 1.141, "D": 20.06, "nD": 15.82, "V": 9.125},
            "gather": {"1": 0.1231, "D": 4.056, "nD": 3.964e-09, "V": 0.9849},
            "matmul": {"1": 0.4924, "D": 4.056, "nD": 5.086e-08, "V": 3.939},
        }
    },
}


# the bytes of a KDA layer's CP state pass (``genoctx.parallel.context.kda_cp_cache``) per token of the rank's piece,
# beyond its one-process call: fitted by ``bench/op_count.py --fit-cp-bytes`` to cp = 2 ranks' counts of 10 random
# configs (each pass and kind within 14%, most within 5%; its gathers, a few bytes per token, left out). The fit
# covers head dims 8-32 and K / C <= 2: far outside (K / C > 8) its negative terms clamp the forward bytes to 0
CP_COEFS: dict = {
    "kda": {
        "forward": {
            "elementwise": {"1": -617.6, "D": -11.5, "HK": 1012.0, "HC": 7.7, "HKK/C": -128.6},
            "matmul": {"1": -24.09, "D": 14.25, "HK": 261.5, "HC": 13.6, "HKK/C": -16.04},
        },
        "recompute": {
            "elementwise": {"1": 16.54, "D": 0.9102, "HK": 175.9, "HC": 0.6089, "HKK/C": 0.9392},
            "matmul": {"1": 23.22, "D": 20.23, "HK": 49.69, "HC": -0.5982, "HKK/C": -3.189},
        },
        "backward": {
            "elementwise": {"1": -2142.0, "D": 33.28, "HK": 2838.0, "HC": 77.85, "HKK/C": -296.4},
            "matmul": {"1": -56.55, "D": 23.3, "HK": 854.7, "HC": 58.93, "HKK/C": -30.76},
        },
    },
}


def _instances(cfg: ModelConfig) -> list[tuple[str, int]]:
    """``(component, instances)`` of one forward of every layer."""
    full = sum(1 for i, k in enumerate(cfg.layer_types) if k == DSA and cfg.indexer_types[i] == "full")
    sparse = sum(1 for t in cfg.mlp_layer_types if t == "sparse")
    L = cfg.num_hidden_layers
    return [("kda", cfg.layer_types.count(KDA)), ("dsa_attention", cfg.layer_types.count(DSA)),
            ("dsa_indexer", full), ("moe", sparse), ("dense_mlp", L - sparse), ("mhc", 2 * L), ("norms", 2 * L),
            ("other", 1)]  # fmt: skip


def _empty() -> dict:
    return {c: {p: dict.fromkeys(KINDS, 0.0) for p in PASSES} for c in COMPONENTS}


def _call(cfg: ModelConfig, out: dict, table: dict, T: int, S: int, B: int, passes=PASSES,
          selected: bool = False, into: str | None = None) -> None:  # fmt: skip
    """Every component's bytes over ``B x T`` tokens after ``S`` into ``out`` (``selected``: as ``features``), each of
    ``passes`` of ``table`` added to the same pass of ``out`` or, given ``into``, to that one."""
    for comp, n in _instances(cfg):
        if not n or not T:
            continue
        f = features(cfg, comp, T, S, selected)
        for p in passes:
            for kind in KINDS:
                coef = table.get(comp, {}).get(p, {}).get(kind)
                if coef:  # a fit may go below 0 far outside its ranges: never fewer than no bytes
                    per_token = sum(coef.get(name, 0.0) * v for name, v in f.items())
                    out[comp][into or p][kind] += n * B * T * max(0.0, per_token)


def _cp_state(cfg: ModelConfig, out: dict, T: int, B: int, passes=PASSES, into: str | None = None) -> None:
    """Under CP, every KDA layer's ``[L | M]`` state pass over the rank's ``B x T`` tokens (``CP_COEFS``) into
    ``out``: each of ``passes`` into the same pass or, given ``into``, into that one (a no-grad forward, the sweep
    or scoring, and a layer's rerun under activation checkpointing move the pass's forward bytes)."""
    n = cfg.layer_types.count(KDA)
    f = features(cfg, "kda", T)
    for p in passes:
        for kind, coef in CP_COEFS["kda"].get(p, {}).items():
            out["kda"][into or p][kind] += n * B * T * max(0.0, sum(coef.get(k, 0.0) * v for k, v in f.items()))


def _totals(out: dict) -> dict:
    by_kind = {k: sum(out[c][p][k] for c in COMPONENTS for p in PASSES) for k in KINDS}
    return {"components": out, "by_kind": by_kind, "total": sum(by_kind.values())}


def step_bytes(cfg: ModelConfig, seq_len: int, layout: Layout | None = None, *, batch_size: int = 1,
               recompute: bool = False, seq_chunk_tokens: int | None = None,
               cp_state: bool = True) -> dict:  # fmt: skip
    """Bytes the eager elementwise and gather ops of one training step move on a rank (the busiest: under CP the one
    holding the window's last piece), per component, pass and kind.

    Args:
        cfg: the architecture; seq_len: tokens per window; batch_size: windows per rank.
        layout: the parallel layout (``cp`` splits the window; each KDA layer then runs its ``[L | M]`` state pass
            over the rank's piece too, ``CP_COEFS``; the contiguous layout).
        recompute: activation checkpointing: each layer's forward bytes once more in ``recompute``.
        seq_chunk_tokens: the chunked backward's chunk (its no-grad sweep adds each chunk's scoring forward).
        cp_state: count the CP state pass (False: the one-process bytes of the rank's piece, as
            ``bench/op_count.py --fit-cp-bytes`` fits the difference).

    Returns:
        ``{"components": {component: {pass: {kind: bytes}}}, "by_kind": {kind: bytes}, "total": bytes}``.
    """
    layout = layout or Layout()
    out = _empty()
    from .ops import rank_rounds

    rounds = rank_rounds(seq_len, layout.cp, seq_chunk_tokens)
    sel = len(rounds) > 1
    cp = layout.cp > 1 and cp_state
    for S, t in rounds:
        _call(cfg, out, COEFS, t, S, batch_size, PASSES, sel)
        if cp:
            _cp_state(cfg, out, t, batch_size)
        if recompute:  # each layer's forward once more in backward
            _call(cfg, out, COEFS, t, S, batch_size, ("forward",), sel, into="recompute")
            if cp:
                _cp_state(cfg, out, t, batch_size, ("forward",), into="recompute")
        if sel:  # the no-grad sweep scores every chunk first
            _call(cfg, out, EVAL_COEFS, t, S, batch_size, ("forward",))
            if cp:
                _cp_state(cfg, out, t, batch_size, ("forward",))
    return _totals(out)


def eval_bytes(cfg: ModelConfig, seq_len: int, layout: Layout | None = None, chunk_tokens: int | None = None) -> dict:
    """Bytes the eager ops of scoring one window (no gradient) move on a rank, in chunks of ``chunk_tokens``: the
    same dict as ``step_bytes``, every byte in ``forward`` (under CP the last piece's, its KDA layers' state pass
    at ``CP_COEFS``' forward bytes)."""
    layout = layout or Layout()
    out = _empty()
    tokens = seq_len // layout.cp
    chunk = chunk_tokens or tokens
    for t0 in range(0, tokens, chunk):
        _call(cfg, out, EVAL_COEFS, min(chunk, tokens - t0), seq_len - tokens + t0, 1, ("forward",))
        if layout.cp > 1:  # each KDA layer's state pass, no grad
            _cp_state(cfg, out, min(chunk, tokens - t0), 1, ("forward",))
    return _totals(out)
