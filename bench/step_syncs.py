"""Host syncs of one training step (``genoctx.model.host``); prints one JSON line per case.

    .venv/bin/python bench/step_syncs.py [--device cpu|cuda] [--preset tiny] [--seq-len 256] [--seq-chunk 64]

For each case (one pass; chunked by ``--seq-chunk``): a model of the preset, batch 1, random nucleotide tokens, fp32,
one warm-up ``train_step`` (AdamW's state then exists), then one step inside ``SyncCounter``. Reported:

- ``reads``: the deliberate host reads by label (``step.metrics``: one per step; ``moe.split``: the expert dispatch's
  split sizes, one per MoE token chunk and pass);
- ``around_the_door``: the other host reads the counter saw (``SYNC_OPS`` kinds): 0 is the rule;
- on CUDA, ``cuda_sync_warnings``: the warnings of ``torch.cuda.set_sync_debug_mode("warn")`` during the step, each a
  synchronising CUDA call outside ``read`` (the real check; a CPU cannot run it), with their first messages.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import warnings

import torch

from genoctx.model.config import preset
from genoctx.model.host import SyncCounter, optimizer_steps
from genoctx.model.model import HybridLM
from genoctx.recipes import TrainConfig
from genoctx.train.loop import build_optimizer, train_step


def measure(device: str, name: str, seq_len: int, chunk: int | None) -> dict:
    torch.manual_seed(0)
    model = HybridLM(preset(name)).to(device).train()
    cfg = TrainConfig(lr=1e-3, warmup_steps=1, seq_chunk_tokens=chunk)
    opt, sched = build_optimizer(model, cfg, 10)
    tokens = torch.randint(0, 4, (1, seq_len), device=device)
    train_step(model, opt, sched, tokens, cfg, contextlib.nullcontext())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with SyncCounter(cuda_debug="warn", host_resident=optimizer_steps(opt)) as c:
            train_step(model, opt, sched, tokens, cfg, contextlib.nullcontext())
    sync_warnings = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
    out = {"device": device, "preset": name, "seq_len": seq_len, "seq_chunk_tokens": chunk, "reads": dict(c.reads),
           "around_the_door": dict(c.ops)}  # fmt: skip
    if device.startswith("cuda"):
        out["cuda_sync_warnings"] = len(sync_warnings)
        out["first_warnings"] = sync_warnings[:5]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seq-chunk", type=int, default=64)
    a = ap.parse_args()
    for chunk in (None, a.seq_chunk):
        print(json.dumps(measure(a.device, a.preset, a.seq_len, chunk)), flush=True)


if __name__ == "__main__":
    main()
