"""Worker of tests/parallel/test_build.py: spawned gloo ranks build models with genoctx.parallel.build and report.

``python build_worker.py OUT_DIR ARGS.pt WORLD CASE`` runs CASE on WORLD ranks; each rank writes ``rankR.pt``.

Cases:
- ``memory``: for layouts FSDP=4 and FSDP=2 x EP=2, the peak growth of resident private memory while
  ``build_model`` reads the rank's slices of an HF checkpoint (``peak_bytes``), the rank's share (its local
  pieces) and the largest decoder layer; then the peak of the old path (``load_hf`` of the whole model, then
  ``apply_parallel``) for the same layout.
- ``fresh``: ``build_model(Fresh())`` after ``torch.manual_seed(0)`` in several layouts; every tensor gathered whole.
- ``uneven``: a model whose ``A_log`` (2 heads) and mHC ``scale`` (3) have fewer rows than 4 ranks and whose 6
  routed experts do not split evenly: built from an HF export in one layout, saved (DCP), loaded in others.
- ``bad``: a checkpoint with one misshapen tensor: the message every rank raised.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from genoctx.errors import GenoctxError
from genoctx.model.model import HybridLM
from genoctx.parallel.build import Fresh, FromCheckpoint, FromHF, Zeros, build_model
from genoctx.parallel.mesh import init_parallel, leaving_mesh
from genoctx.parallel.state import local_targets

# (ep, dp_shard, cp[, ep_folded]); the rest of 4 ranks is dp_replicate. "fsdp4_fep2": EP 2 folded into FSDP 4, each
# expert block FSDP-sharded over efsdp = 2 ranks (Shard(1) where the block's experts do not split evenly)
LAYOUTS = {"fsdp4": (1, 4, 1), "fsdp2_ep2": (2, 2, 1), "ep2_dp2": (2, 1, 1), "fsdp2_cp2": (1, 2, 2),
           "hsdp2_2": (1, 2, 1), "fsdp4_fep2": (2, 4, 1, True)}  # fmt: skip


def _dims(name: str):
    ep, dp_shard, cp, *folded = LAYOUTS[name]
    return init_parallel(cp=cp, ep=ep, dp_shard=dp_shard, ep_folded=bool(folded))


def _anon_bytes() -> int:
    """Resident private memory of this process (resident minus file-backed pages of /proc/self/statm), bytes."""
    _, resident, shared, *_ = (int(x) for x in Path("/proc/self/statm").read_text().split())
    return (resident - shared) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes(fn) -> tuple[int, object]:
    """``(peak growth of resident private memory while fn() runs, fn's result)``, sampled every 0.2 ms by a thread
    after ``malloc_trim`` returned freed memory to the system. The CPU allocator's profiler events cannot measure
    this: a safetensors read keeps its buffer alive for as long as torch's profiler runs."""
    import ctypes
    import gc
    import threading

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = _anon_bytes()
    peak, done = [base], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _anon_bytes())
            time.sleep(0.0002)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        out = fn()
    finally:
        done.set()
        th.join()
    return max(peak[0], _anon_bytes()) - base, out


def full_state(model, dims) -> dict:
    """Every stored tensor of the model whole (a collective): each rank's pieces (``local_targets``: local tensor
    and its box in the one-device tensor) gathered and placed by their boxes. (DTensor's ``full_tensor`` is not
    used: it mis-assembles an uneven ``[Shard(0), Shard(0)]`` expert block.)"""
    keep = set(model.state_dict().keys())
    if model.lm_head.weight is model.embed_tokens.weight:
        keep.discard("lm_head.weight")
    mine = {n: (shape, box, t.detach().cpu().clone()) for n, (t, shape, box) in local_targets(model, dims).items()
            if n in keep}  # fmt: skip
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    out = {}
    for name, (shape, _, t) in mine.items():
        full = torch.empty(shape, dtype=t.dtype)
        for p in parts:
            _, box, piece = p[name]
            full[box] = piece
        out[name] = full
    return out


def run_memory(args: dict) -> dict:
    from genoctx.model.hf import load_hf
    from genoctx.parallel.fsdp import apply_parallel

    res = {}
    with torch.device("meta"):  # warm-up: the first model built in a process imports and initialises ~80 MB of
        HybridLM(args["cfg"])  # code and caches once (kernels, autograd, ...), whatever the model's size
    for name in ("fsdp4", "fsdp2_ep2"):
        dims = _dims(name)
        dist.barrier()
        peak, model = peak_bytes(lambda d=dims: build_model(args["cfg"], d, source=FromHF(Path(args["hf"]))))
        share = sum(t.numel() * t.element_size() for t, _, _ in local_targets(model, dims).values())
        layer = max(sum(p.numel() * p.element_size() for p in lay.parameters()) for lay in model.layers)
        state = full_state(model, dims)
        del model
        dist.barrier()

        def old(d=dims):  # the code before genoctx.parallel.build: the whole model on every rank, then sharded
            m = load_hf(args["hf"], dtype=torch.float32)
            apply_parallel(m, d)
            return m

        old_peak, m = peak_bytes(old)
        del m
        res[name] = {"peak": peak, "share": share, "layer": layer, "old_peak": old_peak, "state": state}
    return res


def run_fresh(args: dict) -> dict:
    res = {}
    for name in ("fsdp4", "fsdp2_ep2", "ep2_dp2", "fsdp2_cp2", "hsdp2_2", "fsdp4_fep2"):
        dims = _dims(name)
        torch.manual_seed(0)
        model = build_model(args["cfg"], dims, source=Fresh())
        res[name] = full_state(model, dims)
    return res


def run_uneven(args: dict, out: Path) -> dict:
    from genoctx.recipes import Recipe, TrainConfig
    from genoctx.train.loop import build_optimizer
    from genoctx.train.sharded import load_any, save_sharded

    cfg, res = args["cfg"], {}
    src = _dims("fsdp2_ep2")
    model = build_model(cfg, src, source=FromHF(Path(args["hf"])))
    res["loaded"] = full_state(model, src)
    res["local_rows"] = {n: int(t.shape[0]) if t.dim() else 1 for n, (t, _, _) in local_targets(model, src).items()}
    tc = TrainConfig(steps=1)
    opt, sched = build_optimizer(model, tc, 1)
    save_sharded(out / "run", 1, model, opt, sched, Recipe(model=cfg, train=tc), {}, src)
    ckpt = out / "run" / "checkpoints" / "step_000001"
    res["placements"] = {}
    for name in ("fsdp4", "ep2_dp2", "hsdp2_2", "fsdp4_fep2"):
        dims = _dims(name)
        m = build_model(cfg, dims, source=FromCheckpoint(ckpt))  # weights only (--init RUN)
        res[f"init->{name}"] = full_state(m, dims)
        m2 = build_model(cfg, dims, source=Zeros())  # resume: model and optimizer together
        o2, s2 = build_optimizer(m2, tc, 1)
        load_any(ckpt, m2, o2, s2, dims)
        res[f"resume->{name}"] = full_state(m2, dims)
        p = m2.layers[1].mlp.experts.gate_up_proj
        res["placements"][name] = [str(pl) for pl in getattr(p, "placements", ())]
    one = args.get("one_ckpt")
    if one:  # a one-process safetensors checkpoint, each rank reading its slices
        dims = _dims("fsdp4")
        res["one->fsdp4"] = full_state(build_model(cfg, dims, source=FromCheckpoint(Path(one))), dims)
    return res


def run_bad(args: dict) -> dict:
    dims = _dims("fsdp2_ep2")
    try:
        build_model(args["cfg"], dims, source=FromHF(Path(args["hf"])))
    except GenoctxError as e:
        return {"error": str(e)}
    return {"error": None}


def run(rank: int, world: int, init_file: str, out_dir: str, args_path: str, case: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with leaving_mesh():
        args = torch.load(args_path, weights_only=False)
        out = Path(out_dir)
        if case == "memory":
            res = run_memory(args)
        elif case == "fresh":
            res = run_fresh(args)
        elif case == "uneven":
            res = run_uneven(args, out)
        else:
            res = run_bad(args)
        dist.barrier()
    torch.save(res, out / f"rank{rank}.pt")


if __name__ == "__main__":
    init = tempfile.mktemp(prefix="genoctx-gloo-")
    # fork, not spawn: the ranks do not import torch and genoctx again
    args = (int(sys.argv[3]), init, sys.argv[1], sys.argv[2], sys.argv[4])
    mp.start_processes(run, args=args, nprocs=int(sys.argv[3]), start_method="fork")
