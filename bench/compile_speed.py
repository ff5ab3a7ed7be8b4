"""Training step time with each decoder layer compiled (``train.compile``) over eager; prints one JSON line.

    .venv/bin/python bench/compile_speed.py [--presets tiny,cpu-small] [--backend inductor] [--steps 5]

For each preset: its recipe's crop (``recipes/<preset>.yaml`` ``train.seq_len``: tiny 256, cpu-small 4096 tokens),
batch 1, fp32, random nucleotide tokens, on this CPU (``--threads``, default 1). Two copies of one initialised model,
one compiled (``genoctx.parallel.compile.apply_compile``); each runs ``genoctx.train.loop.train_step`` (forward,
backward, clip, AdamW, router biases). Reported per preset:

- ``compile_s``: the compiled model's first forward + backward (compilation; Inductor's cache under
  ``TORCHINDUCTOR_CACHE_DIR`` or /tmp/torchinductor_$USER makes a second run of this bench faster);
- ``eager_step_s`` / ``compiled_step_s``: median of ``--steps`` steps after one warm-up step each (interleaved,
  so both see the same machine load); ``ratio`` = compiled / eager (< 1: compiled is faster);
- ``loss_rel_diff``, ``grad_max_diff_over_gmax``, ``grad_ok``: the first forward + backward of both copies compared
  (before any optimizer step): the loss's relative difference, the largest gradient difference over the largest
  gradient entry, and whether every gradient is within the tests' tolerance (``tests/parallel/test_compile.py``:
  1e-5 relative plus 1e-6 of the largest entry).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from genoctx.model.model import HybridLM
from genoctx.parallel.compile import apply_compile
from genoctx.recipes import load_recipe
from genoctx.train.loop import build_optimizer, forward_backward, train_step

REPO = Path(__file__).resolve().parents[1]


def _grads(model: HybridLM) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _one(preset_name: str, backend: str, steps: int, seq_len: int | None) -> dict:
    recipe = load_recipe(REPO / "recipes" / f"{preset_name}.yaml")
    cfg = recipe.train
    L = seq_len or cfg.seq_len
    torch.manual_seed(0)
    eager = HybridLM(recipe.model)
    compiled = copy.deepcopy(eager)
    apply_compile(compiled, backend=backend)
    tokens = torch.randint(0, 4, (1, L))
    ctx = nullcontext()

    loss0 = forward_backward(eager, tokens, ctx)[0] / L
    g0 = _grads(eager)
    t0 = time.perf_counter()
    loss1 = forward_backward(compiled, tokens, ctx)[0] / L
    compile_s = time.perf_counter() - t0
    g1 = _grads(compiled)
    gmax = max(float(g.abs().max()) for g in g0.values())
    diff = max(float((g1[k] - g0[k]).abs().max()) for k in g0)
    ok = set(g0) == set(g1) and all(bool(((g1[k] - g0[k]).abs() <= 1e-5 * g0[k].abs() + 1e-6 * gmax).all()) for k in g0)

    times = {"eager": [], "compiled": []}
    opts = {name: build_optimizer(m, cfg, steps + 1) for name, m in (("eager", eager), ("compiled", compiled))}
    for i in range(steps + 1):  # step 0: warm-up (optimizer state, the compiled model's last recompiles)
        for name, m in (("eager", eager), ("compiled", compiled)):
            m.train()
            t = time.perf_counter()
            train_step(m, *opts[name], tokens, cfg, ctx)
            if i:
                times[name].append(time.perf_counter() - t)
    eager_s, compiled_s = statistics.median(times["eager"]), statistics.median(times["compiled"])
    return {
        "seq_len": L,
        "compile_s": round(compile_s, 1),
        "eager_step_s": round(eager_s, 4),
        "compiled_step_s": round(compiled_s, 4),
        "ratio": round(compiled_s / eager_s, 3),
        "loss_rel_diff": float(abs(loss1 - loss0) / abs(loss0)),
        "grad_max_diff_over_gmax": diff / gmax,
        "grad_ok": ok,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,cpu-small", help="comma list of recipes/<name>.yaml")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager, eager)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each (median)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per window (default: the recipe's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared 2-core machine)")
    args = parser.parse_args()
    from genoctx.heap import keep_freed_memory

    keep_freed_memory()  # as genoctx's CLI on a CPU (genoctx.heap)
    torch.set_num_threads(args.threads)
    out = {
        "bench": "compile_speed",
        "backend": args.backend,
        "threads": args.threads,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    for name in args.presets.split(","):
        out[name] = _one(name, args.backend, args.steps, args.seq_len)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
