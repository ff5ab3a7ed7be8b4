"""AdamW moments in bf16 (``train.optimizer_state_dtype``): state bytes, the step's temporaries and its CPU time;
prints one JSON line.

One largest parameter of ``--numel`` fp32 elements (N_max) and 8 of N_max / 8 (2 N_max in all), random gradients,
one warm-up step (the state exists), then one measured step, for each optimizer in its own fresh process:

- ``torch_single`` / ``torch_foreach``: ``torch.optim.AdamW`` (fp32 moments; ``foreach`` False / True);
- ``ours_fp32`` / ``ours_bf16``: ``genoctx.train.optim.AdamW`` with ``state_dtype`` float32 / bfloat16.

Per optimizer: ``state_bytes_per_param`` (exp_avg + exp_avg_sq), ``step_temp_over_4_nmax``: the step's peak
resident memory above the resident memory before it (Linux ``VmHWM`` after ``echo 5 > /proc/self/clear_refs``) in
units of ``4 N_max`` bytes (one fp32 copy of the largest parameter; the planner's ``optimizer_step`` counts
``3 x 4 N_max`` for bf16 moments), and ``step_s`` (median of ``--repeats`` steps, this CPU).

    .venv/bin/python bench/optim_state.py                # N_max = 2^24 (64 MiB fp32)
    .venv/bin/python bench/optim_state.py --numel 4194304
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

KINDS = ("torch_single", "torch_foreach", "ours_fp32", "ours_bf16")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _measure(kind: str, numel: int, repeats: int) -> dict:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from genoctx.train.optim import AdamW

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel))] + [torch.nn.Parameter(torch.randn(numel // 8)) for _ in range(8)]
    opt = {
        "torch_single": lambda: torch.optim.AdamW(params, foreach=False),
        "torch_foreach": lambda: torch.optim.AdamW(params, foreach=True),
        "ours_fp32": lambda: AdamW(params, state_dtype=torch.float32),
        "ours_bf16": lambda: AdamW(params, state_dtype=torch.bfloat16),
    }[kind]()
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # the state exists from here on
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    before = _status_bytes("VmRSS:")
    opt.step()
    temp = _status_bytes("VmHWM:") - before
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    n = sum(p.numel() for p in params)
    state = sum(v.nbytes for st in opt.state.values() for k, v in st.items() if k != "step")
    return {"state_bytes_per_param": state / n, "step_temp_over_4_nmax": round(temp / (4 * numel), 2),
            "step_s": round(statistics.median(times), 4)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 24, help="elements of the largest parameter (N_max)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kind", choices=KINDS, help=argparse.SUPPRESS)  # one measurement, in a child process
    a = ap.parse_args()
    if a.kind:
        print(json.dumps(_measure(a.kind, a.numel, a.repeats)))
        return
    out = {"numel_largest": a.numel, "numel_total": a.numel + 8 * (a.numel // 8), "units": "bytes, seconds"}
    for kind in KINDS:
        r = subprocess.run([sys.executable, __file__, "--kind", kind, "--numel", str(a.numel), "--repeats",
                            str(a.repeats)], capture_output=True, text=True, check=True)  # fmt: skip
        out[kind] = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
