"""What `genoctx plan` says when nothing fits (issue 45 item 3): the closest layout is the one nearest to fitting on the
GPU and the host, whatever --rank-by; a layout that fits the GPU but not the host says so with both numbers; a --skew
above a layout's EP size is stated; when only memory knobs would make a layout fit, the message says --knobs auto
finds it. Small presets (cpu-small, 16k tokens): each case plans in well under a second."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from genoctx.cli import app
from genoctx.model.config import preset
from genoctx.parallel.layout import Layout
from genoctx.plan import plan_memory
from genoctx.plan.report import format_table, short_of, skew_note
from genoctx.plan.search import knobs_hint, plan_with_knobs, search_layouts, shortfall

SMALL = preset("cpu-small")
L = 1 << 14
MIB = 1 / 1024
ONE = Layout()
BF16_ACT = dict(optimizer_state_dtype="bf16", offload_activations=True)


def _cli(*args):
    return CliRunner().invoke(app, ["plan", "--preset", "cpu-small", "--seq-len", "16k", *map(str, args)])


def _json(*args):
    r = _cli(*args, "--format", "json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def host_case():
    """One GPU, 16k tokens: every knob combination is planned; the GPU holds bf16 moments + offloaded activations
    (1% headroom), which need more host memory than there is (1% short); nothing fits without a knob."""
    p = plan_memory(SMALL, L, ONE, gpu_memory_gib=100, host_memory_gib=100, **BF16_ACT)
    return {"gpu": p["total_gib"] * 1.01, "host": p["host_gib"] * 0.99, "need": p["total_gib"], "held": p["host_gib"]}


def test_shortfall_adds_the_gpu_and_the_host_fractions():
    p = {"total_gib": 110.0, "gpu_memory_gib": 100.0, "host_fits": False, "host_gib": 300.0, "host_memory_gib": 200.0}
    assert shortfall(p) == pytest.approx(0.1 + 0.5)
    assert shortfall({**p, "total_gib": 90.0}) == pytest.approx(0.5)  # fits the GPU: the host's fraction alone
    assert shortfall({**p, "host_fits": None}) == pytest.approx(0.1)  # host not checked
    assert shortfall({**p, "total_gib": 90.0, "host_fits": True}) == 0.0


def test_the_closest_knobs_are_nearest_to_fitting_not_the_least_gpu_memory(host_case):
    """A layout with no knob combination that fits: with a host far too small for offloaded state, the plan kept is
    the one a little short of GPU memory, not the one with the least GPU memory that is hopelessly short of host
    memory (what the search kept before); with a host 1% short, the one that fits the GPU."""
    g, h = host_case["gpu"], host_case["host"]
    tiny_host = plan_with_knobs(SMALL, L, ONE, gpu_memory_gib=g, host_memory_gib=1e-6)
    least_gpu = min(
        (plan_memory(SMALL, L, ONE, gpu_memory_gib=g, host_memory_gib=1e-6, **kw)
         for kw in ({}, {"optimizer_state_dtype": "bf16"}, {"offload_activations": True}, BF16_ACT)),
        key=lambda p: p["total_gib"],
    )  # fmt: skip
    assert least_gpu["host_fits"] is False and least_gpu["total_gib"] <= g  # fits the GPU, not the host
    assert not tiny_host["fits"] and tiny_host["knobs"] == ["optimizer_state_dtype=bf16"]
    assert tiny_host["host_gib"] == 0.0 and 0 < shortfall(tiny_host) < 0.1 < shortfall(least_gpu)
    near = plan_with_knobs(SMALL, L, ONE, gpu_memory_gib=g, host_memory_gib=h)
    assert not near["fits"] and near["total_gib"] <= g and near["host_fits"] is False
    assert shortfall(near) == pytest.approx(1 / 0.99 - 1, rel=1e-6)


def test_a_layout_that_fits_the_gpu_and_not_the_host_says_so_with_both_numbers(host_case):
    g, h = host_case["gpu"], host_case["host"]
    args = ("--gpus", "1", "--knobs", "auto", "--gpu-memory-gib", g, "--host-memory-gib", h)
    doc = _json(*args)
    p = doc["closest"][0]
    assert doc["layouts"] == [] and p["total_gib"] <= g and p["host_fits"] is False
    need, held = p["total_gib"], p["host_gib"]
    line = (f"#1 does not fit: short of host memory: needs {held:.1f} GiB per GPU, {h:g} GiB available "
            f"({held - h:.1f} short); it fits the GPU: {need:.1f} GiB per GPU of {g:g}")  # fmt: skip
    assert short_of(p) == line
    table = format_table(doc["closest"])
    row = next(r for r in table.splitlines() if r.startswith("  1 "))
    assert " host MiB " in table and f"{held * 1024:.2f}  host" in row and f"{need * 1024:.2f}" in row
    assert "(fits host: the row fits the GPU but not the host's" in table and f"({line})" in table
    r = _cli(*args)
    nothing = f"no layout of 1 GPUs fits in {g:g} GiB (and {h:g} GiB of host per GPU)"
    assert r.exit_code == 0 and r.stdout.startswith(f"{nothing}; nearest to fitting first:\n")
    warned = (f"WARNING genoctx.plan: {nothing}; the closest, dp_replicate=1 ep=1 dp_shard=1 cp=1 with "
              f"offload-act,bf16-moments, is {line.removeprefix('#1 does not fit: ')}")  # fmt: skip
    assert r.stderr.splitlines()[0].split(" ", 1)[1] == warned, r.stderr  # (then the --seq-chunk hint: 8k fits)


def test_the_closest_is_the_same_whatever_rank_by():
    """Nothing fits 64 MiB: --rank-by throughput lists the same closest layout as --rank-by memory (the one with the
    least memory, here all short of the GPU alone), not the fastest of those that do not fit."""
    args = ("--gpus", "4", "--gpu-memory-gib", 64 * MIB)
    mem, thr = _json(*args), _json(*args, "--rank-by", "throughput")
    assert mem["layouts"] == thr["layouts"] == []
    assert [p["layout"] for p in thr["closest"]] == [p["layout"] for p in mem["closest"]]
    every = search_layouts(SMALL, L, 4, 64 * MIB)
    least = min(p["total_gib"] for p in every)
    assert mem["closest"][0]["total_gib"] == pytest.approx(least)
    fastest = max(mem["closest"], key=lambda p: p["time"]["tokens_per_s"])
    assert fastest["layout"] != mem["closest"][0]["layout"]  # the old throughput order would have named another


def test_a_skew_above_the_ep_size_is_stated_and_is_what_the_time_uses():
    lay = ("--gpus", "4", "--ep", "2", "--fsdp", "2", "--gpu-memory-gib", "8")
    huge, two = _json(*lay, "--skew", "1e9"), _json(*lay, "--skew", "2")
    assert huge["skew_note"] == ("--skew 1e+09 is more than this layout can show: the busiest of its 2 EP ranks "
                                 "receives at most every row (2 x the mean), so it is timed at skew 2")  # fmt: skip
    assert "skew_note" not in two and huge["layouts"][0]["layout"]["ep"] == 2
    assert huge["layouts"][0]["time"]["step_s"] == two["layouts"][0]["time"]["step_s"]  # capped, as the note says
    assert f"     ({huge['skew_note']})" in _cli(*lay, "--skew", "1e9").stdout.splitlines()
    assert skew_note(1.0, huge["layouts"]) is None and skew_note(2.0, huge["layouts"]) is None
    listed = _json("--gpus", "4", "--gpu-memory-gib", "8", "--skew", "3")  # every layout of 4 ranks: ep 1, 2 or 4
    capped = [p for p in listed["layouts"][:10] if p["layout"]["ep"] < 3]
    ep0 = listed["layouts"][0]["layout"]["ep"]
    assert 0 < len(capped) < min(10, len(listed["layouts"])) and listed["skew_note"] == (
        f"--skew 3 is more than {len(capped)} of the {min(10, len(listed['layouts']))} listed layouts can show: the "
        f"busiest EP rank receives at most every row, ep x the mean, so each is timed at min(skew, ep); #1 (ep {ep0}) "
        f"at {min(3, ep0)}")  # fmt: skip


def test_nothing_fitting_without_knobs_names_what_knobs_auto_finds(host_case):
    """Without --knobs, nothing fits a GPU that holds the plan with offloaded activations: the message names what
    --knobs auto finds (its count and first layout, as the knob search lists them); not when --knobs auto is given
    or when nothing fits with knobs either."""
    g = host_case["need"] * 1.005  # bf16 moments + offloaded activations fit (the default host holds them)
    doc = _json("--gpus", "1", "--gpu-memory-gib", g)
    auto = [p for p in search_layouts(SMALL, L, 1, g, knobs="auto", host_memory_gib=238.0) if p["fits"]]
    assert doc["layouts"] == [] and auto
    hint = doc["knobs_hint"]
    assert hint["fitting"] == len(auto) and hint["knobs"] == auto[0]["knobs"] and hint["layout"] == auto[0]["layout"]
    assert hint["total_gib"] == pytest.approx(auto[0]["total_gib"]) and hint["total_gib"] <= g
    assert hint["message"] == (
        "nothing fits without more memory knobs, but --knobs auto finds 1 layout that fits; first dp_replicate=1 "
        f"ep=1 dp_shard=1 cp=1 with {_short(auto[0]['knobs'])}, {hint['total_gib']:.2f} GiB per GPU (host "
        f"{hint['host_gib']:.1f} GiB per GPU)"
    )
    assert "hint: " + hint["message"] in _cli("--gpus", "1", "--gpu-memory-gib", g).stdout.splitlines()
    assert "knobs_hint" not in _json("--gpus", "1", "--gpu-memory-gib", g, "--knobs", "auto")
    assert "knobs_hint" not in _json("--gpus", "1", "--gpu-memory-gib", 1 * MIB)
    one = _json("--gpus", "2", "--fsdp", "2", "--gpu-memory-gib", 1 * MIB)
    assert "knobs_hint" not in one and knobs_hint(SMALL, L, 1, 1 * MIB) is None


def _short(knobs):
    from genoctx.plan.report import KNOB_SHORT

    return ",".join(KNOB_SHORT.get(k, k) for k in knobs)
