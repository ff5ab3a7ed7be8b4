"""The memory planner against measured peaks: one JSON line per (preset, length, layout).

    .venv/bin/python bench/plan_vs_measured.py [--presets tiny cpu-small] [--lengths 1k 4k] [--threads 2]
        [--layouts single single-ac fsdp2-cp2 single-eval single-eval-chunk fsdp2-cp2-eval fsdp2-cp2-eval-chunk]

Default lengths (``DEFAULT_LENGTHS``): one process 1k/2k/4k (tiny) and 1k/4k/16k (cpu-small); the other training
layouts 4k; the evaluation layouts 4k (tiny) and 16k (cpu-small).

Prints, per preset, length and layout::

    {"bench": "plan_vs_measured", "preset": "cpu-small", "seq_len": 4096, "layout": "single",
     "mesh": {"dp_replicate": 1, "ep": 1, "dp_shard": 1, "cp": 1}, "recompute": false, "dtype": "fp32",
     "predicted_mib": ..., "measured_mib": ..., "rel_error": ..., "within_15pct": true, "peak_phase": ..., ...}

``rel_error`` = (predicted - measured) / measured. The issue asks for |rel_error| <= 0.15 everywhere. ``seconds`` is
the measured step (profiled), ``wall_s`` the whole line (model, warm-up step, measurement, plan).

Method:

- Model ``HybridLM(preset)`` in fp32 on the CPU, AdamW from ``genoctx.train.loop.build_optimizer``, one step
  with ``genoctx.train.loop.train_step`` (forward, backward, gradient clipping, AdamW step, router-bias update)
  on ``<bos>`` + real DNA (the embedded hg38 chr22 piece, repeated to the length), batch 1.
- A first step at 256 tokens creates AdamW's state (a step in the middle of a run has it); gradients are then
  set to None (``train_step`` does so first anyway), and the measured step runs at the length asked for.
- Measured peak = the bytes of every live tensor storage before the step (``gc`` walk, plus the parameters and
  optimizer state) + the largest running sum of the allocator's allocation and free events during the step
  (``torch.profiler`` with ``profile_memory=True``: the CPU allocator's own byte counts, in-op temporaries
  included; not the process RSS, which holds the Python runtime, libraries and freed-but-cached pages).
- Predicted = ``genoctx.plan.plan_memory(cfg, L, layout, dtype="fp32", device="cpu", recompute=...)``
  (``total_gib``: no allocator slack on the CPU, no bf16 copies).
- Layouts (each one a function ``measure_<name>``; add one by writing another):
  ``single``: one process, no layer recomputation (what ``genoctx train`` runs on one device);
  ``single-ac``: one process with every decoder layer checkpointed (``genoctx.parallel.fsdp.apply_ac``);
  ``fsdp2-cp2``: 4 gloo processes, FSDP over 2 x CP 2 with layer recomputation (``genoctx.parallel.fsdp``), the
  busiest rank's peak; ``fsdp2-cp2-fep2``: the same with folded EP 2 (``Layout.ep_folded``: the EP groups drawn
  from the four ranks), ``-forced`` with every token routed to the first k experts (all on EP rank 0: the receive
  bound of the dispatch rounds); ``cp4-fep4``: CP 4 with folded EP 4 (one expert block per rank). A layout whose
  code is not there yet prints a line with ``"skipped"`` and the reason.
- Evaluation layouts (``"mode": "eval"``, predicted by ``genoctx.plan.plan_eval``, forward only under
  ``torch.no_grad``, the model in eval mode, a first window of 256 tokens before the measured one):
  ``single-eval``: one process, ``genoctx.eval.scoring.position_losses(model, tokens)`` on the whole window;
  ``single-eval-chunk``: the same fed in chunks of ``L / 4`` tokens with the carried cache (``chunk_tokens``);
  ``fsdp2-cp2-eval``: 4 gloo processes, FSDP 2 x CP 2 (contiguous) built with ``genoctx.parallel.build.build_model``
  and scored with ``genoctx.eval.distributed.mesh_scorer`` (what ``genoctx eval --num-workers`` runs), the busiest
  rank's peak; ``fsdp2-cp2-eval-chunk``: each CP piece streamed in chunks of ``L / 8`` (``cp_chunk_tokens``).
  The CP rows depend on thread timing: gloo's worker thread may drop its references to an all-gather's buffers after
  the main thread has moved on, so on a busy machine a rank can read up to one gathered DSA window (``L (R + 2 dI)``
  fp32) higher (cpu-small 16k chunked: 101.9 MiB idle, 107.8-109.9 MiB with the load average at 6 on 2 cores).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WARMUP_TOKENS = 256
# lengths per layout and preset (tiny's 64-token MoE chunks and 16-token KDA chunks make long profiles slow)
DEFAULT_LENGTHS = {
    "single": {"tiny": ["1k", "2k", "4k"], "cpu-small": ["1k", "4k", "16k"]},
    "single-ac": {"tiny": ["4k"], "cpu-small": ["4k"]},
    "fsdp2-cp2": {"tiny": ["4k"], "cpu-small": ["4k"]},
    "fsdp2-cp2-fep2": {"tiny": ["4k"], "cpu-small": ["4k"]},
    "fsdp2-cp2-fep2-forced": {"tiny": ["4k"], "cpu-small": ["4k"]},
    "cp4-fep4": {"tiny": ["4k"], "cpu-small": ["4k"]},
    "single-eval": {"tiny": ["4k"], "cpu-small": ["16k"]},
    "single-eval-chunk": {"tiny": ["4k"], "cpu-small": ["16k"]},
    "fsdp2-cp2-eval": {"tiny": ["4k"], "cpu-small": ["16k"]},
    "fsdp2-cp2-eval-chunk": {"tiny": ["4k"], "cpu-small": ["16k"]},
}


def _tokens(L: int):
    """``[1, L]`` int64 genoctx ids of real DNA (hg38 chr22:32,000,001-32,300,000, repeated to ``L``)."""
    import torch

    from genoctx.data.tokenizer import encode

    text = (REPO / "data" / "hg38" / "hg38_chr22_32000001-32300000.fa").read_text().split("\n", 1)[1]
    seq = text.replace("\n", "")
    seq = (seq * (L // len(seq) + 1))[:L]
    return torch.from_numpy(encode(seq)[0].astype("int64"))[None]


def _live_storage_bytes(*tensors) -> int:
    """Bytes of the distinct storages of every tensor the garbage collector sees, plus ``tensors``."""
    import torch

    seen: dict[int, int] = {}

    def add(t) -> None:
        if hasattr(t, "to_local"):  # a DTensor: its local shard
            t = t.to_local()
        if not torch.is_tensor(t) or t.device.type != "cpu":
            return
        try:
            st = t.untyped_storage()
            if st.nbytes():
                seen[st.data_ptr()] = st.nbytes()
        except (RuntimeError, NotImplementedError):  # a wrapper subclass or a freed (resized to 0) FSDP buffer
            pass

    gc.collect()
    for o in gc.get_objects():
        try:
            if torch.is_tensor(o):
                add(o)
        except ReferenceError:  # a dead weak proxy
            pass
    for t in tensors:
        add(t)
    return sum(seen.values())


def _profiled_peak(fn) -> tuple[int, float]:
    """``(largest running sum of the allocator's byte events, seconds)`` while ``fn()`` runs."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    seconds = time.perf_counter() - t0
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU
    )
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    return peak, seconds


def _step_peak(model, optimizer, scheduler, tokens, tc, dims=None) -> tuple[int, float]:
    """Warm-up step (AdamW state), then the measured ``train_step`` on ``tokens``: ``(peak bytes, seconds)``."""
    from genoctx.train.loop import train_step

    train_step(model, optimizer, scheduler, tokens[:, :WARMUP_TOKENS], tc, nullcontext(), dims)
    optimizer.zero_grad(set_to_none=True)
    state = [v for st in optimizer.state.values() for v in st.values()]
    base = _live_storage_bytes(tokens, *model.parameters(), *model.buffers(), *state)
    delta, seconds = _profiled_peak(lambda: train_step(model, optimizer, scheduler, tokens, tc, nullcontext(), dims))
    return base + delta, seconds


def _predict(cfg, L: int, layout, recompute: bool) -> dict:
    from genoctx.plan import plan_memory

    return plan_memory(cfg, L, layout, gpu_memory_gib=1024.0, recompute=recompute, dtype="fp32", device="cpu")


def measure_single(preset_name: str, L: int, threads: int, recompute: bool = False) -> dict:
    """One process, fp32, batch 1; ``recompute``: every decoder layer checkpointed (``apply_ac``)."""
    import torch

    from genoctx.model.config import preset
    from genoctx.model.model import HybridLM
    from genoctx.parallel.layout import Layout
    from genoctx.recipes import TrainConfig
    from genoctx.train.loop import build_optimizer

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = preset(preset_name)
    model = HybridLM(cfg)
    if recompute:
        from genoctx.parallel.fsdp import apply_ac

        apply_ac(model)
    tc = TrainConfig(steps=10, lr=1e-3, warmup_steps=0)
    optimizer, scheduler = build_optimizer(model, tc, tc.steps)
    measured, seconds = _step_peak(model, optimizer, scheduler, _tokens(L), tc)
    plan = _predict(cfg, L, Layout(), recompute)
    return {"measured": measured, "seconds": seconds, "plan": plan, "layout": Layout()}


def measure_single_ac(preset_name: str, L: int, threads: int) -> dict:
    """``measure_single`` with every decoder layer recomputed in backward."""
    return measure_single(preset_name, L, threads, recompute=True)


def _fsdp_worker(rank: int, world: int, port: int, preset_name: str, L: int, out: str, mesh: dict) -> None:
    import torch
    import torch.distributed as dist

    from genoctx.model.config import preset
    from genoctx.model.model import HybridLM
    from genoctx.model.moe import MoE
    from genoctx.parallel.fsdp import apply_parallel
    from genoctx.parallel.mesh import init_parallel
    from genoctx.recipes import TrainConfig
    from genoctx.train.loop import build_optimizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        dims = init_parallel(cp=mesh["cp"], dp_shard=mesh["dp_shard"], ep=mesh["ep"], ep_folded=mesh["ep_folded"])
        model = HybridLM(preset(preset_name))
        if mesh["forced"]:  # every token's top-k experts are the first k: all on EP rank 0
            for m in model.modules():
                if isinstance(m, MoE):
                    m.gate.e_score_correction_bias.data[: m.top_k] += 100.0
        apply_parallel(model, dims, activation_checkpointing=True)
        tc = TrainConfig(steps=10, lr=1e-3, warmup_steps=0)
        optimizer, scheduler = build_optimizer(model, tc, tc.steps)
        peak, seconds = _step_peak(model, optimizer, scheduler, _tokens(L), tc, dims)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"peak": peak, "seconds": seconds}))
    finally:
        dist.destroy_process_group()


def _measure_mesh(preset_name: str, L: int, layout, forced: bool = False) -> dict:
    """``layout.world`` gloo processes training one step with layers recomputed; the busiest rank's peak."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    from genoctx.model.config import preset

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mesh = {"cp": layout.cp, "dp_shard": layout.dp_shard, "ep": layout.ep, "ep_folded": layout.ep_folded,
            "forced": forced}  # fmt: skip
    world = layout.world
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_fsdp_worker, args=(world, port, preset_name, L, tmp, mesh), nprocs=world, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    plan = _predict(preset(preset_name), L, layout, True)
    busiest = max(ranks, key=lambda r: r["peak"])
    return {"measured": busiest["peak"], "seconds": max(r["seconds"] for r in ranks), "plan": plan,
            "layout": layout, "per_rank_mib": [round(r["peak"] / 2**20, 2) for r in ranks]}  # fmt: skip


def measure_fsdp2_cp2(preset_name: str, L: int, threads: int) -> dict:
    """4 gloo processes: FSDP (dp_shard 2) x CP 2, layers recomputed; the busiest rank's peak."""
    from genoctx.parallel.layout import Layout

    return _measure_mesh(preset_name, L, Layout(dp_shard=2, cp=2))


def measure_fsdp2_cp2_fep2(preset_name: str, L: int, threads: int) -> dict:
    """4 gloo processes: FSDP 2 x CP 2 with folded EP 2 (the EP group drawn from the four ranks), recomputed."""
    from genoctx.parallel.layout import Layout

    return _measure_mesh(preset_name, L, Layout(dp_shard=2, cp=2, ep=2, ep_folded=True))


def measure_fsdp2_cp2_fep2_forced(preset_name: str, L: int, threads: int) -> dict:
    """``measure_fsdp2_cp2_fep2`` with every token routed to the first k experts (all on EP rank 0)."""
    from genoctx.parallel.layout import Layout

    return _measure_mesh(preset_name, L, Layout(dp_shard=2, cp=2, ep=2, ep_folded=True), forced=True)


def measure_cp4_fep4(preset_name: str, L: int, threads: int) -> dict:
    """4 gloo processes: CP 4 with folded EP 4 (one expert block per rank, no expert sharding), recomputed."""
    from genoctx.parallel.layout import Layout

    return _measure_mesh(preset_name, L, Layout(cp=4, ep=4, ep_folded=True))


def _predict_eval(cfg, L: int, layout, chunk: int | None) -> dict:
    from genoctx.plan import plan_eval

    return plan_eval(cfg, L, layout, gpu_memory_gib=1024.0, chunk_tokens=chunk, dtype="fp32", device="cpu")


def measure_single_eval(preset_name: str, L: int, threads: int, chunk: int | None = None) -> dict:
    """One process, fp32: ``position_losses(model, tokens, chunk)`` on one window (eval mode, ``torch.no_grad``)."""
    import torch

    from genoctx.eval.scoring import position_losses
    from genoctx.model.config import preset
    from genoctx.model.model import HybridLM
    from genoctx.parallel.layout import Layout

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = preset(preset_name)
    model = HybridLM(cfg).eval()
    tokens = _tokens(L)
    position_losses(model, tokens[:, :WARMUP_TOKENS], chunk)
    base = _live_storage_bytes(tokens, *model.parameters(), *model.buffers())
    delta, seconds = _profiled_peak(lambda: position_losses(model, tokens, chunk))
    return {"measured": base + delta, "seconds": seconds, "plan": _predict_eval(cfg, L, Layout(), chunk),
            "layout": Layout()}  # fmt: skip


def measure_single_eval_chunk(preset_name: str, L: int, threads: int) -> dict:
    """``measure_single_eval`` with the window fed in 4 chunks (``chunk_tokens = L / 4``) with the carried cache."""
    return measure_single_eval(preset_name, L, threads, chunk=L // 4)


def _eval_mesh_worker(rank: int, world: int, port: int, preset_name: str, L: int, chunk, out: str) -> None:
    import torch
    import torch.distributed as dist

    from genoctx.eval.distributed import mesh_scorer
    from genoctx.model.config import preset
    from genoctx.parallel.build import build_model
    from genoctx.parallel.mesh import init_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        dims = init_parallel(cp=2, dp_shard=2)
        model = build_model(preset(preset_name), dims, cp_chunk_tokens=chunk).eval()
        score = mesh_scorer(model, dims, chunk, torch.device("cpu"))
        tokens = _tokens(L)[0].numpy()
        score(tokens[:WARMUP_TOKENS])  # FSDP2's lazy initialisation; the root's parameters stay all-gathered
        base = _live_storage_bytes(*model.parameters(), *model.buffers())
        delta, seconds = _profiled_peak(lambda: score(tokens))
        Path(out, f"rank{rank}.json").write_text(json.dumps({"peak": base + delta, "seconds": seconds}))
    finally:
        dist.destroy_process_group()


def measure_fsdp2_cp2_eval(preset_name: str, L: int, threads: int, chunk: int | None = None) -> dict:
    """4 gloo processes, FSDP (dp_shard 2) x CP 2 (contiguous), built with ``genoctx.parallel.build.build_model`` and
    scored with ``genoctx.eval.distributed.mesh_scorer`` (forward only); the busiest rank's peak."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    from genoctx.model.config import preset
    from genoctx.parallel.layout import Layout

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_eval_mesh_worker, args=(4, port, preset_name, L, chunk, tmp), nprocs=4, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(4)]
    layout = Layout(dp_shard=2, cp=2)
    busiest = max(ranks, key=lambda r: r["peak"])
    return {"measured": busiest["peak"], "seconds": max(r["seconds"] for r in ranks),
            "plan": _predict_eval(preset(preset_name), L, layout, chunk), "layout": layout,
            "per_rank_mib": [round(r["peak"] / 2**20, 2) for r in ranks]}  # fmt: skip


def measure_fsdp2_cp2_eval_chunk(preset_name: str, L: int, threads: int) -> dict:
    """``measure_fsdp2_cp2_eval`` with each CP piece (``L / 2`` tokens) streamed in 4 chunks of ``L / 8``."""
    return measure_fsdp2_cp2_eval(preset_name, L, threads, chunk=L // 8)


LAYOUTS = {
    "single": (measure_single, None),
    "single-ac": (measure_single_ac, "genoctx.parallel.fsdp"),
    "fsdp2-cp2": (measure_fsdp2_cp2, "genoctx.parallel.fsdp"),
    "fsdp2-cp2-fep2": (measure_fsdp2_cp2_fep2, "genoctx.parallel.fsdp"),
    "fsdp2-cp2-fep2-forced": (measure_fsdp2_cp2_fep2_forced, "genoctx.parallel.fsdp"),
    "cp4-fep4": (measure_cp4_fep4, "genoctx.parallel.fsdp"),
    "single-eval": (measure_single_eval, None),
    "single-eval-chunk": (measure_single_eval_chunk, None),
    "fsdp2-cp2-eval": (measure_fsdp2_cp2_eval, "genoctx.eval.distributed"),
    "fsdp2-cp2-eval-chunk": (measure_fsdp2_cp2_eval_chunk, "genoctx.eval.distributed"),
}
EVAL_LAYOUTS = ("single-eval", "single-eval-chunk", "fsdp2-cp2-eval", "fsdp2-cp2-eval-chunk")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "cpu-small"])
    ap.add_argument("--lengths", nargs="+", help="tokens (k/M suffixes); default: DEFAULT_LENGTHS")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from genoctx.data.windows import parse_size

    for name in a.layouts:
        fn, needs = LAYOUTS[name]
        if needs is not None and importlib.util.find_spec(needs) is None:
            print(json.dumps({"bench": "plan_vs_measured", "layout": name, "skipped": f"{needs} does not exist yet"}),
                  flush=True)  # fmt: skip
            continue
        for preset_name in a.presets:
            for size in a.lengths or DEFAULT_LENGTHS[name].get(preset_name, ["1k", "4k"]):
                L = parse_size(size)
                line = {"bench": "plan_vs_measured", "preset": preset_name, "seq_len": L, "layout": name}
                t0 = time.perf_counter()
                try:
                    r = fn(preset_name, L, a.threads)
                except Exception as e:  # noqa: BLE001 -- a layout whose code is unfinished is reported, not fatal
                    last = [x for x in str(e).splitlines() if x.strip()]  # a worker's traceback: its last line
                    line["skipped"] = f"{type(e).__name__}: {last[-1].strip() if last else ''}"[:300]
                    print(json.dumps(line), flush=True)
                    continue
                plan = r["plan"]
                pred, meas = plan["total_gib"] * 2**30, r["measured"]
                err = (pred - meas) / meas
                if plan.get("mode") == "eval":
                    line.update(mode="eval", chunk_tokens=plan["chunk_tokens"])
                line.update(
                    mesh=r["layout"].to_dict(), recompute=plan.get("recompute"), dtype="fp32", threads=a.threads,
                    predicted_mib=round(pred / 2**20, 2), measured_mib=round(meas / 2**20, 2),
                    rel_error=round(err, 4), within_15pct=abs(err) <= 0.15, peak_phase=plan["peak_phase"],
                    seconds=round(r["seconds"], 1), wall_s=round(time.perf_counter() - t0, 1),
                )  # fmt: skip
                if "per_rank_mib" in r:
                    line["per_rank_mib"] = r["per_rank_mib"]
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
