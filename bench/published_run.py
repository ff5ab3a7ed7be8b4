"""The published run as a held-out check of the speed planner: predicted tokens/s of GLM-5.3-Flash on 64 B200
(8 per node) at 1M and 256k tokens, beside the published 13.7k and 24.9k tokens/s.

Nothing here is fitted to those two numbers: the hardware profile (``genoctx/plan/hardware/b200.yaml``) and the
efficiencies (``genoctx.plan.hardware.EFFICIENCY``) are the shipped defaults with their sources, the FLOPs and
bytes the formulas tested against FlopCounterMode and counted gloo collectives (``genoctx.plan.flops``,
``genoctx.plan.comms``).

For each length, two layouts:

- ``published-like``: 16k tokens per GPU and EP 32 folded into the CP x FSDP ranks, the README's 64-GPU command
  (``--cp 64 --ep 32 --ep-folded``) at 1M; at 256k the same 16k tokens per GPU (cp 16 x dp_shard 4: four windows
  per step). The report gives neither layout; this is the one genoctx's reproduction runs.
- ``best``: the planner's fastest layout that fits in 178 GiB (``genoctx plan --rank-by throughput``).

each at the published routing skew (``PUBLISHED_SKEW``: the busiest GPU got ~4x the mean expert tokens) and
balanced, with the KDA core as ``genoctx train`` runs it by default (``kda_kernel: torch``, an fp32 island) and
with fla-core's bf16 kernels (``kda_kernel: fla``, the ``[gpu]`` extra). Each component is timed at the peak of
what runs it (``genoctx.plan.flops``' units: the DSA indexer's fp32 top-k dots and KL at the fp32 CUDA-core peak;
``compute_by_dtype_s`` gives the compute seconds at each peak). One JSON line per case, then a summary line with
the ratios predicted / published and the 256k / 1M ratio (published: 24.9 / 13.7 = 1.82).

Run: ``python bench/published_run.py`` (about 20 s on a laptop CPU; no GPU, no download).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

PUBLISHED = {1 << 20: 13.7e3, 1 << 18: 24.9e3}  # tokens/s on 64 B200 (the report)
GPUS, MEMORY_GIB = 64, 178.0


def _layouts(L: int):
    from genoctx.parallel.layout import Layout

    cp = L // (16 << 10)
    return Layout(cp=cp, dp_shard=GPUS // cp, ep=32, ep_folded=True)


def _case(cfg, L, layout, hw, skew, name, kernel) -> dict:
    from genoctx.plan import plan_memory
    from genoctx.plan.time import plan_time

    mem = plan_memory(cfg, L, layout, gpu_memory_gib=MEMORY_GIB, recompute=True, dtype="bf16")
    t = plan_time(cfg, L, layout, hw, skew=skew, recompute=True, dtype="bf16")
    return {
        "seq_len": L, "layout_kind": name, "layout": layout.describe(), "kda_kernel": kernel, "skew": skew,
        "fits": mem["fits"], "gib": mem["total_gib"], "step_s": round(t["step_s"], 3),
        "tokens_per_s": round(t["tokens_per_s"]), "published_tokens_per_s": PUBLISHED[L],
        "ratio": round(t["tokens_per_s"] / PUBLISHED[L], 3), "mfu": round(t["mfu"], 4), "bound": t["bound"],
        "compute_s": round(t["compute_s"], 3),
        "compute_by_dtype_s": {k: round(v, 3) for k, v in t["compute_by_dtype_s"].items()},
        "memory_bound_s": round(t["memory_bound_s"], 3),
        "exposed_comm_s": {k: round(v, 3) for k, v in t["exposed_comm_s"].items()},
        "top_compute_s": dict(sorted(((k, round(v, 3)) for k, v in t["compute_by_component_s"].items()),
                                     key=lambda kv: -kv[1])[:3]),
        "top_comm_s": dict(sorted(((k, round(v, 3)) for k, v in t["comm_by_collective_s"].items()),
                                  key=lambda kv: -kv[1])[:3]),
    }  # fmt: skip


def _best(cfg, L, hw, skew):
    from genoctx.parallel.layout import Layout
    from genoctx.plan import search_layouts
    from genoctx.plan.time import add_time, rank_by_throughput

    plans = search_layouts(cfg, L, GPUS, MEMORY_GIB, recompute=True, dtype="bf16")
    top = rank_by_throughput(add_time([p for p in plans if p["fits"]], cfg, hw, skew=skew))[0]
    return Layout(**{k: v for k, v in top["layout"].items() if k != "world"})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", default="b200", help="profile name or YAML (default b200)")
    args = ap.parse_args(argv)

    from genoctx.model.config import preset
    from genoctx.plan.flops import PUBLISHED_SKEW
    from genoctx.plan.hardware import load_hardware

    hw = load_hardware(args.hardware)
    rows = []
    for kernel in ("torch", "fla"):
        cfg = dataclasses.replace(preset("glm-5.3-flash"), kda_kernel=kernel)
        for skew in (PUBLISHED_SKEW, 1.0):
            for L in (1 << 20, 1 << 18):
                for name, lay in (("published-like", _layouts(L)), ("best", _best(cfg, L, hw, skew))):
                    row = _case(cfg, L, lay, hw, skew, name, kernel)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    summary = {"summary": "published_run", "hardware": hw.name}
    for r in rows:
        if r["layout_kind"] == "published-like":
            key = f"{r['kda_kernel']}_skew{r['skew']:g}"
            summary.setdefault(key, {})[f"ratio_{r['seq_len'] >> 10}k"] = r["ratio"]
            summary[key][f"bound_{r['seq_len'] >> 10}k"] = r["bound"]
    for v in summary.values():
        if isinstance(v, dict):
            v["predicted_256k_over_1m"] = round(
                v["ratio_256k"] * PUBLISHED[1 << 18] / (v["ratio_1024k"] * PUBLISHED[1 << 20]), 3
            )
    summary["published_256k_over_1m"] = round(PUBLISHED[1 << 18] / PUBLISHED[1 << 20], 3)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
