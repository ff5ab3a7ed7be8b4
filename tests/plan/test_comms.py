"""``genoctx.plan.comms.step_comms`` against the bytes real gloo steps send (issue 34, "plan speed like memory").

One run of four gloo ranks (``comms_worker.py``, forked from the preloaded server) takes one real training step of a
tiny model (KDA, a full and a shared DSA layer; two MoE layers of 8 experts) in each layout of ``CASES``: HSDP with
bf16 parameters (each fp32 island module its own FSDP group) and activation checkpointing, FSDP x CP, FSDP with
folded EP (bf16), EP x FSDP with routing forced onto one EP rank's experts, FSDP x CP trained in chunks (bf16), and
one evaluation forward on FSDP x CP with folded EP. A ``TorchDispatchMode`` counts every ``c10d::`` collective
(input bytes, group size, inside backward or not). Per (collective, group size, backward or not): the formula's
payload bytes equal the counted ones within 5% and its calls equal theirs (all-to-all rounds within 25%: they follow
the routing), on the busiest EP rank with its measured skew; every formula entry matters (dropping any one fails the
comparison); the planner's FSDP groups are the built model's.
"""

import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from genoctx.parallel.layout import Layout
from genoctx.plan.comms import all_to_all_bytes, fsdp_groups, step_comms, total_bytes, wire_bytes
from genoctx.plan.flops import PUBLISHED_SKEW

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import comms_worker  # noqa: E402
from comms_worker import CASES, L, config  # noqa: E402
from mesh_runner import fork_ranks  # noqa: E402

WORLD = 4


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("comms")
    fork_ranks(comms_worker.run, (WORLD, tempfile.mktemp(prefix="genoctx-gloo-"), str(out), list(CASES)), WORLD)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    return {case: [r[case] for r in ranks] for case in CASES}


def _table(entries) -> dict:
    """(collective, group size, in backward) -> [calls, bytes]."""
    t = defaultdict(lambda: [0, 0.0])
    for kind, g, bwd, calls, nbytes in entries:
        t[kind, g, bwd][0] += calls
        t[kind, g, bwd][1] += nbytes
    return dict(t)


def _busiest(results: list[dict]) -> tuple[dict, float]:
    """The rank whose experts received the most rows and its skew (received / the mean, ``moe x N k``)."""
    res = max(results, key=lambda r: sum(r["received"]))
    cfg, lay = config(), Layout(**res["layout"])
    moe = sum(1 for t in cfg.mlp_layer_types if t == "sparse")
    rows = L // lay.cp * cfg.num_experts_per_tok
    return res, (sum(res["received"]) / (moe * rows) if lay.ep > 1 else 1.0)


def _formula(case: str, layout: Layout, skew: float) -> list[dict]:
    _, bf16, ac, mode, extra = CASES[case]
    return step_comms(config(), L, layout, recompute=ac, dtype="bf16" if bf16 else "fp32", skew=skew,
                      seq_chunk_tokens=extra.get("seq_chunk_tokens"), mode=mode)  # fmt: skip


def _mismatches(formula: list[dict], measured: dict, rounds_vary: bool) -> list[str]:
    """The (collective, group size, in backward) keys where the formula and the count disagree: bytes by more than
    5%, calls at all (all-to-all calls within 25% when ``rounds_vary``: EP rounds follow the routing)."""
    want = _table((e["collective"], e["group_size"], e["phase"] in ("backward", "recompute"), e["calls"],
                   e["payload_bytes"]) for e in formula)  # fmt: skip
    bad = []
    for key in sorted(set(want) | set(measured), key=str):
        (wc, wb), (mc, mb) = want.get(key, (0, 0.0)), measured.get(key, (0, 0.0))
        calls_ok = abs(wc - mc) <= 0.25 * mc if (rounds_vary and key[0] == "all_to_all") else wc == mc
        if not calls_ok or abs(wb - mb) > 0.05 * mb or (mb == 0) != (wb == 0):
            bad.append(f"{key}: formula {wc} calls {wb:.0f} B, counted {mc} calls {mb:.0f} B")
    return bad


@pytest.mark.parametrize("case", list(CASES))
def test_formula_equals_counted_bytes(counted, case):
    """Every collective kind of the step: the formula's bytes (5%) and calls equal what the busiest rank sent."""
    res, skew = _busiest(counted[case])
    assert not [r for r in res["records"] if r[0].startswith("unknown")], res["records"]
    measured = _table((kind, g, bwd, 1, b) for kind, g, bwd, b in res["records"])
    layout = Layout(**res["layout"])
    if case == "ep_fsdp_skew":
        assert skew > 1.1, skew  # the router bias made one EP rank the busiest
    assert _mismatches(_formula(case, layout, skew), measured, layout.ep > 1) == []


def test_fsdp_groups_are_the_built_ones(counted):
    """``fsdp_groups`` names the groups ``apply_fsdp`` made (under bf16 one per fp32 island module: the KDA mixer,
    router and mHC mixings of a layer, each gathered at its own calls only)."""
    for case in CASES:
        res = counted[case][0]
        _, bf16, _, _, _ = CASES[case]
        planned = [g["name"].replace(".experts", ".mlp.experts").replace("root", "<root>")
                   for g in fsdp_groups(config(), Layout(**res["layout"]), "bf16" if bf16 else "fp32")]  # fmt: skip
        assert sorted(planned) == sorted(res["groups"]), case
    islands = {g["name"]: g["island"] for g in fsdp_groups(config(), Layout(dp_shard=2, dp_replicate=2))}
    assert islands["layers.0.self_attn"] == "kda" and islands["layers.1.mlp.gate"] == "router"
    assert islands["layers.2.attn_hc"] == islands["layers.2.ffn_hc"] == "mhc" and islands["layers.1"] is None


def test_every_formula_entry_is_needed(counted):
    """Dropping any one entry of the formula makes the comparison fail: each is checked by the measurement."""
    for case in CASES:
        res, skew = _busiest(counted[case])
        measured = _table((kind, g, bwd, 1, b) for kind, g, bwd, b in res["records"])
        layout = Layout(**res["layout"])
        formula = _formula(case, layout, skew)
        for i, e in enumerate(formula):
            assert _mismatches(formula[:i] + formula[i + 1 :], measured, layout.ep > 1), (case, e["name"])


def test_wire_conventions():
    """Ring all-gather sends (g - 1) x its shard, reduce-scatter (g - 1) / g of its input, all-reduce 2 (g - 1) / g,
    all-to-all what it does not keep; skewed EP: the busiest rank returns ``skew`` times the rows it dispatches."""
    assert wire_bytes("all_gather", 4, 100) == 300
    assert wire_bytes("reduce_scatter", 4, 400) == 300
    assert wire_bytes("all_reduce", 4, 100) == 150
    assert wire_bytes("all_to_all", 4, 100) == 75
    assert wire_bytes("all_reduce", 1, 100) == 0
    lay = Layout(ep=4, dp_shard=2)
    bal = {e["name"]: e for e in step_comms(config(), L, lay, skew=1.0)}
    hot = {e["name"]: e for e in step_comms(config(), L, lay, skew=PUBLISHED_SKEW)}
    assert hot["ep_dispatch_forward"]["payload_bytes"] == bal["ep_dispatch_forward"]["payload_bytes"]
    assert hot["ep_combine_forward"]["payload_bytes"] == 4 * bal["ep_combine_forward"]["payload_bytes"]
    assert hot["ep_dispatch_forward"]["wire_bytes"] == 0  # skew = ep: every row it holds goes to its own experts
    assert total_bytes(list(hot.values())) > total_bytes(list(bal.values()))
    # the memory plan's all-to-all term (all_to_all_bytes) is the balanced step's EP wire bytes
    ep_wire = sum(e["wire_bytes"] for e in bal.values() if e["name"].startswith(("ep_dispatch", "ep_combine")))
    assert ep_wire == pytest.approx(all_to_all_bytes(config(), L, lay, 2, passes=8))
    capped = {e["name"]: e for e in step_comms(config(), L, Layout(ep=2, dp_shard=2), skew=PUBLISHED_SKEW)}
    assert capped["ep_combine_forward"]["payload_bytes"] == 2 * capped["ep_dispatch_forward"]["payload_bytes"]
    with pytest.raises(ValueError, match="skew"):
        step_comms(config(), L, lay, skew=0.5)
