"""genoctx against transformers' ``glm5_next`` on the same weights: forward + backward seconds on the CPU.

    .venv/bin/python bench/vs_transformers.py [--preset cpu-small] [--lengths 1024 4096] [--repeats 3] [--keep-heap]

Prints one JSON line per length::

    {"bench": "vs_transformers", "preset": "cpu-small", "seq_len": 1024, "genoctx_s": ..., "transformers_s": ...,
     "speedup": ..., "paired_speedup": ..., "genoctx_ops": ..., "max_abs_logit_diff": ..., "threads": 2,
     "heap": "glibc defaults", "loadavg_1m": ...}

Method: a random ``preset`` model (``HybridLM``, seed 0, fp32) is exported with ``genoctx.model.hf.save_hf`` and loaded
by transformers 5.23.0 (``Glm5NextForConditionalGeneration.from_pretrained``) with its own PyTorch KDA and convolution
paths (fla's Triton kernels, which transformers binds when fla is importable, unwrapped: they need CUDA). The same
random nucleotide tokens (ids 3-6) go through both; a step is the forward, the mean token loss (cross-entropy against
the next token) and its backward. After one warm-up step each, ``--repeats`` pairs of steps run, genoctx's then the
reference's, back to back: each side's time is its median step (``speedup`` = the ratio of the two medians) and
``paired_speedup`` the median of the pairs' own ratios (both steps of a pair see the same minute of a VM whose speed
drifts 10-25% between runs; the two medians of a run may come from different minutes).
``max_abs_logit_diff``: the two models' forward logits, to show they are the same model (genoctx computes
GLM-5.3-Flash exactly; the reference's DSA layers are dense attention masked to the same selection). ``genoctx_ops``:
aten ops of genoctx's forward + backward (``genoctx.model.opcount.OpCounter``).

``--keep-heap``: both run with ``genoctx.heap.keep_freed_memory`` (as genoctx's CLI runs on a CPU); without it both
run on glibc's defaults, under which freed buffers go back to the kernel and return as page faults, which cost the
reference, with its larger and more numerous buffers, more than genoctx (``"heap"`` in each line says which).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def reference_model_class():
    """transformers' ``Glm5NextForConditionalGeneration`` with its PyTorch fallbacks (fla's kernels unwrapped)."""
    import transformers.models.glm5_next.modeling_glm5_next as M
    from transformers import Glm5NextForConditionalGeneration

    for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
                 "causal_conv1d_update"):  # fmt: skip
        f = getattr(M, name)
        while hasattr(f, "__wrapped__"):
            f = f.__wrapped__
        setattr(M, name, f)
    return Glm5NextForConditionalGeneration


def _timed_pairs(ours, theirs, repeats: int) -> tuple[float, float, float]:
    """``(median ours s, median theirs s, median of theirs / ours per pair)``: one warm-up each, then ``repeats``
    pairs, the two steps back to back in each pair (so that both see the same minute of a machine whose speed
    drifts)."""
    ours(), theirs()
    g, t = [], []
    for _ in range(repeats):
        for fn, out in ((ours, g), (theirs, t)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(g), statistics.median(t), statistics.median(b / a for a, b in zip(g, t, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--keep-heap", action="store_true", help="both with genoctx.heap.keep_freed_memory")
    a = ap.parse_args()
    if a.keep_heap:
        from genoctx.heap import keep_freed_memory

        keep_freed_memory()

    import torch
    import torch.nn.functional as F

    from genoctx.model.config import preset
    from genoctx.model.hf import save_hf
    from genoctx.model.model import HybridLM
    from genoctx.model.opcount import OpCounter

    cfg = preset(a.preset)
    ours = HybridLM(cfg, seed=0)
    with tempfile.TemporaryDirectory() as d:
        save_hf(ours, Path(d) / "hf")
        theirs = reference_model_class().from_pretrained(str(Path(d) / "hf")).float()

    def ours_step(ids):
        logits, _ = ours(ids)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        ours.zero_grad(set_to_none=True)

    def theirs_step(ids):
        logits = theirs(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        theirs.zero_grad(set_to_none=True)

    for L in a.lengths:
        ids = torch.randint(3, 7, (1, L), generator=torch.Generator().manual_seed(L))
        with torch.no_grad():
            diff = (ours.eval()(ids)[0].float() - theirs.eval()(input_ids=ids).logits.float()).abs().max().item()
        ours.train(), theirs.train()
        counter = OpCounter(ours)
        with counter:
            ours_step(ids)
        g, t, paired = _timed_pairs(lambda ids=ids: ours_step(ids), lambda ids=ids: theirs_step(ids), a.repeats)
        print(json.dumps({"bench": "vs_transformers", "preset": a.preset, "seq_len": L, "genoctx_s": round(g, 4),
                          "transformers_s": round(t, 4), "speedup": round(t / g, 2), "paired_speedup": round(paired, 2),
                          "genoctx_ops": counter.total, "max_abs_logit_diff": diff, "threads": torch.get_num_threads(),
                          "heap": "kept" if a.keep_heap else "glibc defaults",
                          "loadavg_1m": os.getloadavg()[0]}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
