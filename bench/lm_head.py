"""Peak memory and time of LM head + cross-entropy (forward + backward): chunked vs full logits; one JSON line.

    .venv/bin/python bench/lm_head.py [--tokens 65536] [--hidden 4096] [--vocab 154880] [--chunk-tokens 2048]
                                      [--dtype fp32|bf16] [--device cpu|cuda] [--threads 2] [--quick]

Prints::

    {"bench": "lm_head", "tokens": N, "hidden": D, "vocab": V, "chunk_tokens": C, "dtype": ..., "device": ...,
     "chunked": {"working_mib": ..., "seconds": ..., ...}, "unchunked": {"working_mib": ..., "computed": true},
     "target_working_gib": 1.5, "chunked_meets_target": ..., "counted": "..."}

Cases:
- ``chunked``: ``genoctx.model.head.head_token_losses(hidden, weight, targets, scored, chunk_tokens=C)``.
- ``unchunked``: ``head_token_losses_reference`` (the [N, V] logits in one matmul, ``F.cross_entropy``), i.e.
  what ``lm_head`` + ``token_losses`` do today.
Both run ``losses.sum().backward()`` with ``hidden`` [N, D] and ``weight`` [V, D] (``--dtype``) requiring grad,
targets uniform over V, 95% of tokens scored.

What is counted (``working_mib``): the step's peak memory minus the memory before the step (hidden, weight,
targets and mask allocated, kernels warmed up on a tiny problem), minus the two gradients the step must produce
(``hidden.grad`` N·D and ``weight.grad`` V·D in their dtypes, computed from the shapes, reported as
``grads_mib``). So it is the memory the head + loss needs beyond its inputs and one gradient buffer per
input in the input's dtype: chunk logits, and for a bf16 weight the extra half of the fp32 buffer the
weight's gradient is accumulated in. ``peak_above_inputs_mib`` is the raw
difference. The target (issue 12, item 3) is ``working_mib`` <= 1.5 GiB at the full configuration.

Method: each measured case runs in a fresh subprocess. On CPU, peak = ``ru_maxrss`` (the process's peak
resident set) after the step, memory before = the resident set just before it (``bench/_memory.py``); inputs
are generated in place so that no transient larger than the step's precedes it (``rss_peak_before_step_mib``
is reported to show it). On CUDA: ``torch.cuda.max_memory_allocated()`` minus the allocation before the step.
The unchunked case is measured only when its formula (below) needs less than a quarter of the memory
available; otherwise it is reported from the formula with ``"computed": true`` and no time.

Formulas (``formula_mib``): unchunked = 3 x [N, V] fp32 (the log-softmax saved for backward, the gradient
arriving at it and the gradient it returns; a bf16 weight's bf16 [N, V] logits are freed before); chunked = one
[C, V] fp32 chunk of logits (x1.5 for a bf16 weight, whose bf16 matmul output coexists with its fp32 copy)
+ for a bf16 weight 2 bytes x V·D: the fp32 [V, D] accumulation buffer of the weight's gradient is alive during
the whole backward, the bf16 ``weight.grad`` counted in ``grads_mib`` only at its end, so the buffer costs
V·D·4 - V·D·2 beyond what is subtracted. The quick configuration measures both cases to check the formulas.

``--quick``: N 4096, D 256, V 16384, C 512 (seconds). The full configuration at fp32 is ~3.3e14 flop
(forward, recomputation and two backward matmuls): about half an hour on 2 CPU cores; memory above the
inputs does not depend on N (only the gradients do), so ``--tokens 8192`` at the full D, V, C gives the same
working memory in a quarter of that.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _mib(n_bytes: float) -> float:
    return round(n_bytes / 2**20, 1)


def formulas(N: int, D: int, V: int, C: int, dtype: str) -> dict:
    """Working memory (bytes) each case needs by the shape arithmetic in the module docstring."""
    low = dtype != "fp32"
    unchunked = 3 * N * V * 4
    c = min(C, N)
    chunked = c * V * (6 if low else 4) + (V * D * 2 if low else 0)  # fp32 buffer beyond the bf16 weight.grad
    return {"unchunked": unchunked, "chunked": chunked}


def worker(case: str, N: int, D: int, V: int, C: int, dtype: str, device: str) -> dict:
    """One forward + backward of ``case`` in this process; returns its times and memory (MiB)."""
    import torch
    from _memory import peak_rss_mib, rss_now_mib  # bench/_memory.py, beside this script

    from genoctx.model.head import head_token_losses, head_token_losses_reference

    dt = getattr(torch, DTYPES[dtype])

    def fn(h, w, t, s):
        if case == "chunked":
            return head_token_losses(h, w, t, s, chunk_tokens=C)
        return head_token_losses_reference(h, w, t, s)

    def inputs(n, v):
        g = torch.Generator(device=device).manual_seed(0)
        hidden = torch.randn(n, D, dtype=dt, device=device, generator=g).requires_grad_(True)  # ~ RMS-normed
        weight = torch.randn(v, D, dtype=dt, device=device, generator=g).mul_(0.02).requires_grad_(True)
        targets = torch.randint(0, v, (n,), device=device, generator=g)
        scored = torch.rand(n, device=device, generator=g) < 0.95
        return hidden, weight, targets, scored

    fn(*inputs(64, 128)).sum().backward()  # warm-up: loads kernels
    hidden, weight, targets, scored = inputs(N, V)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
        before = torch.cuda.max_memory_allocated() / 2**20
    else:
        base = rss_now_mib()
        before = peak_rss_mib()
    t0 = time.perf_counter()
    losses = fn(hidden, weight, targets, scored)
    if device == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    losses.sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else peak_rss_mib()
    grads = hidden.grad.numel() * hidden.grad.element_size() + weight.grad.numel() * weight.grad.element_size()
    above = peak - base
    return {
        "working_mib": round(above - grads / 2**20, 1),
        "peak_above_inputs_mib": round(above, 1),
        "grads_mib": _mib(grads),
        "inputs_mib": _mib(sum(x.numel() * x.element_size() for x in (hidden, weight, targets, scored))),
        "rss_peak_before_step_mib": round(before - base, 1),
        "forward_s": round(t1 - t0, 2),
        "seconds": round(t2 - t0, 2),
        "mean_loss": round(float(losses.sum() / scored.sum()), 4),
    }


def _available_bytes(device: str) -> int:
    if device == "cuda":
        import torch

        return torch.cuda.mem_get_info()[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=154880)
    ap.add_argument("--chunk-tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="N 4096, D 256, V 16384, C 512: a smoke run")
    ap.add_argument("--worker", choices=["chunked", "unchunked"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick:
        a.tokens, a.hidden, a.vocab, a.chunk_tokens = 4096, 256, 16384, 512
    N, D, V, C = a.tokens, a.hidden, a.vocab, a.chunk_tokens
    if a.worker:
        import torch

        torch.set_num_threads(a.threads)
        print(json.dumps(worker(a.worker, N, D, V, C, a.dtype, a.device)))
        return
    expect = formulas(N, D, V, C, a.dtype)
    line = {
        "bench": "lm_head",
        "tokens": N,
        "hidden": D,
        "vocab": V,
        "chunk_tokens": C,
        "dtype": a.dtype,
        "device": a.device,
        "threads": a.threads,
        "quick": a.quick,
    }
    available = _available_bytes(a.device)
    for case in ("chunked", "unchunked"):
        res: dict = {"formula_mib": _mib(expect[case])}
        if case == "unchunked" and expect[case] > available / 4:
            res.update({"working_mib": _mib(expect[case]), "computed": True})
        else:
            cmd = [sys.executable, __file__, "--worker", case, "--tokens", str(N), "--hidden", str(D)]
            cmd += ["--vocab", str(V), "--chunk-tokens", str(C), "--dtype", a.dtype, "--device", a.device]
            cmd += ["--threads", str(a.threads)]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode:
                err = p.stderr.strip().splitlines()
                res["error"] = err[-1] if err else p.returncode
            else:
                res.update(json.loads(p.stdout.strip().splitlines()[-1]), computed=False)
        line[case] = res
    line["target_working_gib"] = 1.5
    if "working_mib" in line["chunked"]:
        line["chunked_meets_target"] = line["chunked"]["working_mib"] <= 1.5 * 1024
    if "working_mib" in line["unchunked"] and line["chunked"].get("working_mib"):
        line["unchunked_over_chunked"] = round(line["unchunked"]["working_mib"] / line["chunked"]["working_mib"], 1)
    line["counted"] = (
        "working_mib = peak during forward+backward - memory before it (hidden, weight, targets, mask) "
        "- hidden.grad - weight.grad; CPU: ru_maxrss in a fresh subprocess; CUDA: max_memory_allocated"
    )
    print(json.dumps(line))


if __name__ == "__main__":
    main()
