"""Activation offloading (``train.offload_activations``) against plain activation checkpointing: the bytes each
step moves (``OffloadStats`` against the formula), whether the steps are equal, the step seconds and, on CUDA, the
peak device memory. JSON lines, one per (length, setting), then one summary per length.

    .venv/bin/python bench/activation_offload.py [--preset cpu-small] [--lengths 2k 8k] [--steps 3] [--device cpu]

Each case builds ``--preset`` with activation checkpointing (one process, ``genoctx.parallel.build.build_model``, the
same seed), trains ``--steps`` AdamW steps on the same random window (``--batch`` windows of the length) and records:
the losses, the median step seconds after the first step, the copies and bytes each way in one step
(``OffloadStats``), the formula's bytes ``layers x B x T x hc_mult x D x element size`` and, on CUDA,
``torch.cuda.max_memory_allocated`` over the steps (bf16 autocast there; fp32 on the CPU, where the "host copy" is a
clone in the same memory: the CPU run checks bytes and equality, not memory). Step seconds are wall-clock: on a
shared machine (``loadavg_1m`` in every row above its cores) they say nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from genoctx.model.config import preset
from genoctx.parallel.build import build_model
from genoctx.parallel.offload import OffloadStats
from genoctx.recipes import TrainConfig
from genoctx.train.loop import build_optimizer, train_autocast, train_step


def _tokens(s: str) -> int:
    s = s.lower()
    return int(float(s[:-1]) * (1 << 10 if s[-1] == "k" else 1 << 20)) if s[-1] in "km" else int(s)


def case(name: str, length: int, batch: int, steps: int, device: torch.device, offload: bool) -> dict:
    torch.manual_seed(0)
    model = build_model(preset(name), device=device, activation_checkpointing=True, offload_activations=offload)
    cfg = TrainConfig(steps=steps, lr=1e-3, warmup_steps=0, min_lr_ratio=1.0)
    opt, sched = build_optimizer(model, cfg, cfg.steps)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 4, (batch, length), generator=gen).to(device)
    autocast = train_autocast("bf16" if device.type == "cuda" else "fp32", device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    losses, seconds, stats = [], [], None
    for _ in range(steps):
        OffloadStats.reset()
        t0 = time.perf_counter()
        losses.append(train_step(model, opt, sched, tokens, cfg, autocast)["loss"])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - t0)
        stats = dict(vars(OffloadStats))
    c = model.cfg
    elem = 4  # the residual streams stay fp32 under autocast (the model's dtype)
    return {
        "bench": "activation_offload", "preset": name, "device": str(device), "seq_len": length, "batch": batch,
        "offload": offload, "losses": losses, "step_s": statistics.median(seconds[1:] or seconds),
        "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "moved": stats, "loadavg_1m": os.getloadavg()[0],
        "formula_bytes": c.num_hidden_layers * batch * length * c.hc_mult * c.hidden_size * elem if offload else 0,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--lengths", nargs="+", default=["2k", "8k"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    for s in args.lengths:
        length = _tokens(s)
        rows = {on: case(args.preset, length, args.batch, args.steps, device, on) for on in (False, True)}
        for row in rows.values():
            print(json.dumps(row), flush=True)
        off, on = rows[False], rows[True]
        print(json.dumps({"bench": "activation_offload", "kind": "summary", "seq_len": length,
                          "losses_equal": on["losses"] == off["losses"],
                          "bytes_match_formula": on["moved"]["to_host_bytes"] == on["formula_bytes"]
                          == on["moved"]["to_device_bytes"],
                          "step_s_ratio": round(on["step_s"] / off["step_s"], 3),
                          "peak_saved_bytes": None if off["peak_device_bytes"] is None
                          else off["peak_device_bytes"] - on["peak_device_bytes"]}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
