"""The speed planner checked on this machine: predicted vs measured train-step seconds of ``cpu-small`` on the CPU.

    .venv/bin/python bench/step_time_cpu.py [--lengths 2k 4k 8k] [--steps 5] [--layouts single fsdp2-cp2]
        [--recipe recipes/cpu-small.yaml] [--work DIR] [--seconds 0.5] [--save-profiles DIR] [--predict-only]

Prints one JSON line per hardware profile (``"kind": "profile"``), one per measured case::

    {"bench": "step_time_cpu", "kind": "case", "layout": "fsdp2-cp2", "seq_len": 4096, "ranks": 4,
     "predicted_s": ..., "predicted_no_launch_s": ..., "launch_s": ..., "planned_ops": ..., "aten_ops": ...,
     "measured_s": ..., "ratio": ..., "ratio_no_launch": ..., "bound": "compute", "predicted_tokens_per_s": ...,
     "measured_tokens_per_s": ..., "compute_s": ..., "memory_bound_s": ..., "exposed_comm_s": ...,
     "comm_s": ..., "predicted_no_overlap_s": ..., "steps_s": [...], ...}

and a final ``"kind": "summary"`` line: the error band (min / max ``ratio`` = predicted / measured, and of
``ratio_no_launch``: the prediction without the launch term), whether the cases
ranked by step seconds agree between prediction and measurement, and whether the one-process vs FSDP x CP choice at
each length (by tokens/s) agrees. Progress and the runs' logs go to stderr. The default run (3 lengths x 2 layouts,
5 steps each) is the one the README's table comes from: about 5 minutes on the 2-core dev machine at a load average
of 2, 8 minutes at 4-6 (other jobs). Every rate and step is wall-clock: run it on an idle machine (a load average
above the cores is warned about on stderr and recorded in every line as ``loadavg_1m``).

Method:

1. **Hardware, measured here** (``measure_profile``; one ``genoctx.plan.hardware.Hardware`` per layout's rank count
   R, through ``hardware_from_dict``, written with ``--save-profiles`` for ``genoctx plan --hardware FILE``). What
   ONE rank gets when R ranks share this machine: R concurrent processes, each with torch threads
   ``max(1, cores // R)`` as ``genoctx train`` (one process: torch's default, the cores) and its distributed driver
   (``cores // world``) give them, every section time-boxed (``--seconds``) so that the ranks overlap throughout:
   - ``dtype_flops.fp32``: ``torch.mm`` FLOP/s over the model's GEMM shapes (``gemm_shapes``: dense MLP, KDA
     projections, routed experts at ``--gemm-rows`` tokens), total FLOPs over total seconds; ``bf16`` = the same
     (the runs are fp32; the CPU has no faster bf16 path that genoctx uses).
   - ``hbm_bytes_per_s``: ``torch.add(a, b, out=c)`` of three ``--mem-mib`` fp32 tensors (larger than the caches):
     3 x the tensor bytes per call.
   - ``op_host_s``: seconds per aten op of a 64-op autograd chain on 16 values (forward, backward, an update: the
     host's cost of an op with no work), ``host_overlaps_device`` false (the host is the device): the launch term of
     ``genoctx.plan.time`` adds ``planned_ops x op_host_s`` to the step (``genoctx.plan.ops`` counts the ops).
   - ``intra_node_bytes_per_s`` (and ``inter_node``, unused: ``gpus_per_node`` = R, one machine): a gloo
     ``all_gather`` of ``--comm-mib`` per rank in pairs of processes (every pair at once, max(2, R) processes):
     wire bytes (``genoctx.plan.comms``' convention: ``(g - 1)`` x the input) over seconds; the all_reduce's rate
     (``2 (g - 1) / g`` x the buffer) is recorded beside it. ``collective_latency_s``: a 4-byte all_reduce's seconds.
   - ``memory_model: eager``: on a CPU every op of genoctx runs eagerly, so the memory-bound term is the bytes those
     ops move (``genoctx.plan.eager``), not the activation bytes a fused kernel would.
   - Efficiencies: ``matmul`` 1.0 (the microbenchmark IS the achieved rate at the model's shapes); ``memory``: the
     eager basket's rate over the add's (``eager_basket``: seven kinds of eager op at the model's activation shapes,
     inputs rotated through 256 MiB so that they come from memory), capped at 1; ``gather``: ``index_select`` of
     latent rows and ``index_add_`` back at sparse attention's shapes, over the add's rate; ``collective`` 1.0 (the
     rate is gloo's own on this machine; small messages pay the measured latency);
     ``attention`` = ``torch.bmm`` FLOP/s over the attention class's product shapes (``bmm_shapes``: a KDA chunk's
     scores, a sparse-attention tile's scores and output, an indexer tile's scores; total FLOPs over total seconds)
     over the GEMM rate, capped at 1 (the KDA core, the indexer and sparse MLA run as small batched products on
     the CPU). None is fitted to a step time; the profile is measured before any training step runs. Every rank
     runs with ``genoctx.heap.keep_freed_memory`` as genoctx's CPU runs do.
2. **Predicted**: ``genoctx.plan.time.plan_time(cfg, L, layout, hw, batch_size, recompute, dtype, seq_chunk_tokens)``
   with the recipe's model and train knobs (``cpu-small``: fp32, batch 1, no activation checkpointing).
   ``predicted_no_overlap_s`` = compute + memory-bound + ALL communication (no FSDP overlap): the alternative a CPU
   with gloo may follow (gloo's collectives run on the cores the ranks compute on).
3. **Measured**: real train steps on the shipped hg38 pieces (``genoctx prepare --window max(lengths)`` once under
   ``--work``), random ``L``-token crops (``train.seq_len=L``): ``single`` = ``genoctx train --recipe RECIPE --set
   train.seq_len=L --steps N`` (a subprocess, the CLI itself); ``fsdp2-cp2`` = ``genoctx.train.distributed.
   train_distributed`` with ``num_workers=4, fsdp=2, cp=2`` (``genoctx train --num-workers 4 --fsdp 2 --cp 2``'s
   driver and worker loop, the same gloo ranks and threads) on ranks forked here instead of Ray's workers (Ray's
   start-up and its daemons would only add noise to a 2-core machine; tests/eval/mesh_runner.py does the same).
   Per step: the loop's own timer (``RUN/metrics.jsonl``: ``tokens / tokens_per_s``; under the mesh the slowest
   rank's, from ``ranks``); the first step is dropped (warm-up), ``measured_s`` is the median of the rest.
   ``aten_ops``: the step's ops as ``genoctx.model.opcount`` counts them (one process: on real DNA, untimed; a mesh:
   its busiest rank, the window's last CP piece, on random tokens, ``bench/op_count.py``'s ``count_mesh``), beside
   the ``planned_ops`` that the launch term uses.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

HG38 = REPO / "data" / "hg38"
FASTAS = ("hg38_chr1_1-1000000.fa.gz", "hg38_chr2_1-2333275.fa.gz", "hg38_chr22_32000001-32300000.fa")
LAYOUT_ARGS = {"single": {}, "fsdp2-cp2": {"dp_shard": 2, "cp": 2}}  # Layout(**...) of each --layouts name


def log(msg: str) -> None:
    print(f"step_time_cpu: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ 1. the hardware profile, measured


def gemm_shapes(cfg, rows: int) -> list[tuple[int, int, int]]:
    """``(m, k, n)`` of the model's main GEMMs at ``rows`` tokens: dense MLP (gate+up, down), KDA projections (in,
    out), a routed expert at its balanced share of the rows (``rows x top-k / E``; gate+up, down)."""
    D, hk = cfg.hidden_size, cfg.linear_num_heads * cfg.linear_head_dim
    er = max(1, rows * cfg.num_experts_per_tok // cfg.n_routed_experts)
    return [(rows, D, 2 * cfg.intermediate_size), (rows, cfg.intermediate_size, D), (rows, D, hk), (rows, hk, D),
            (er, D, 2 * cfg.moe_intermediate_size), (er, cfg.moe_intermediate_size, D)]  # fmt: skip


def bmm_shapes(cfg, rows: int) -> list[tuple[int, int, int, int]]:
    """``(batch, m, k, n)`` of the attention class's batched products at ``rows`` tokens (what the CPU runs for
    ``genoctx.plan.flops``' ``kda_core``, ``dsa_attention`` and ``dsa_indexer``): a KDA chunk's scores
    (``[H rows / C, C, d_k] x [.., d_k, C]``), a sparse-attention tile's scores and output over its ``W`` slots
    per query (``[rows, H, R] x [rows, R, W]``, ``[rows, H, W] x [rows, W, R]``), an indexer tile's scores
    (``[1, min(rows, 256) H_I, d_I] x [1, d_I, rows / kpool]``)."""
    C, dk, H = cfg.kda_chunk_size, cfg.linear_head_dim, cfg.linear_num_heads
    kp = cfg.index_kpool
    W = min(cfg.index_topk, rows) + (kp - 1 if cfg.index_kpool_always_select_tail else 0)
    Ha, R = cfg.num_attention_heads, cfg.kv_lora_rank
    iH, iD = cfg.index_n_heads, cfg.index_head_dim
    return [(H * max(1, rows // C), C, dk, C), (rows, Ha, R, W), (rows, Ha, W, R),
            (1, min(rows, 256) * iH, iD, max(1, rows // kp))]  # fmt: skip


def _timed(fn, seconds: float) -> float:
    """Seconds per call of ``fn`` run for about ``seconds`` (after two warm-up calls)."""
    fn()
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return dt / n


def _counted(fn):
    """The ``genoctx.model.opcount.OpCounter`` of one untimed ``fn()``: its aten ops and the bytes they move."""
    from genoctx.model.opcount import OpCounter

    with OpCounter() as counter:
        fn()
    return counter


def count_aten_ops(fn) -> int:
    """Aten ops ``fn()`` dispatches (counted once, untimed)."""
    return _counted(fn).total


def _tiny_chain(n: int = 64):
    """A function running ``n`` autograd-recorded elementwise ops on 16 values, their backward and a parameter update:
    the per-op host cost (Python, dispatcher, autograd graph) with no work to speak of."""
    import torch

    w = torch.ones(16, requires_grad=True)

    def run():
        y = w
        for _ in range(n):
            y = y * 1.0001
        y.sum().backward()
        with torch.no_grad():
            w.sub_(w.grad, alpha=1e-6)
        w.grad = None

    return run


def eager_basket(spec: dict):
    """``[(name, fn)]``: the kinds of eager op the PyTorch path is made of, at the model's activation shapes
    (``spec["act"]``: rows, mHC streams ``n``, width ``D``, KDA heads ``H`` x ``K``, chunk ``C``): a contiguous
    add, a broadcast multiply (streams x per-stream coefficient), an exponential, a sum over the streams, a
    concatenation, a masked fill of chunk score blocks, a transposed copy. Each call takes the next of enough copies
    of its inputs (256 MiB in all, more than the caches) that its inputs come from memory, as in a step whose
    working set is many times the caches. Each moves the bytes ``genoctx.model.opcount.op_bytes`` counts for it;
    the basket's bytes over its seconds is the eager rate."""
    import torch

    rows, n, D, H, K, C = spec["act"]
    mask = torch.ones(C, C, dtype=torch.bool).triu_(1)

    def inputs():
        return {"x": torch.rand(rows, n, D), "y": torch.rand(rows, n, D), "c": torch.rand(rows, n, 1),
                "e": torch.rand(rows, H * K), "a": torch.rand(rows, D), "b": torch.rand(rows, D),
                "sc": torch.rand(max(1, rows // C), H, C, C), "t": torch.rand(rows, H, K)}  # fmt: skip

    first = inputs()
    one = sum(t.numel() * t.element_size() for t in first.values())
    sets = [first] + [inputs() for _ in range(max(1, (256 << 20) // one) - 1)]
    turn = [0]

    def rotating(f):
        def call():
            turn[0] += 1
            return f(sets[turn[0] % len(sets)])

        return call

    ops = [("add", lambda s: torch.add(s["x"], s["y"])), ("mul_broadcast", lambda s: s["x"] * s["c"]),
           ("exp", lambda s: torch.exp(s["e"])), ("sum", lambda s: s["x"].sum(1)),
           ("cat", lambda s: torch.cat([s["a"], s["b"]], -1)),
           ("masked_fill", lambda s: s["sc"].masked_fill(mask, 0.0)),
           ("transpose_copy", lambda s: s["t"].transpose(0, 1).contiguous())]  # fmt: skip
    return [(name, rotating(f)) for name, f in ops]


def _moved(fn) -> int:
    """Bytes ``fn()``'s ops move (``genoctx.model.opcount``'s rule), counted once."""
    return sum(_counted(fn).bytes_by_kind().values())


def _compute_rank(rank: int, world: int, port: int, spec: dict, out: str) -> None:
    """One of ``world`` concurrent ranks: GEMM, batched-product and memory rates with ``spec["threads"]`` threads."""
    import torch
    import torch.distributed as dist

    from genoctx.heap import keep_freed_memory

    keep_freed_memory()  # as the measured steps' ranks (genoctx.heap)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(spec["threads"])
        torch.manual_seed(rank)
        T = spec["seconds"]
        res = {"gemm": []}
        for m, k, n in spec["gemm"]:
            a, b, c = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)
            dist.barrier()
            s = _timed(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), T)
            res["gemm"].append({"shape": [m, k, n], "flops": 2.0 * m * k * n, "seconds": s})
        res["bmm"] = []
        for nb, m, k, n in spec["bmm"]:
            a, b, c = torch.randn(nb, m, k), torch.randn(nb, k, n), torch.empty(nb, m, n)
            dist.barrier()
            s = _timed(lambda a=a, b=b, c=c: torch.bmm(a, b, out=c), T)
            res["bmm"].append({"shape": [nb, m, k, n], "flops": 2.0 * nb * m * k * n, "seconds": s})
        numel = spec["mem_bytes"] // 4
        x, y, z = torch.rand(numel), torch.rand(numel), torch.empty(numel)
        dist.barrier()
        s = _timed(lambda: torch.add(x, y, out=z), T)
        res["memory"] = {"bytes": 3.0 * numel * 4, "seconds": s}
        res["eager"] = []
        for name, fn in eager_basket(spec):
            dist.barrier()
            res["eager"].append({"op": name, "bytes": _moved(fn), "seconds": _timed(fn, T / 4)})
        rows, R, W = spec["gather"]
        src, idx = torch.randn(rows, R), torch.randint(0, rows, (rows * W,))
        g = torch.empty(rows * W, R)
        dist.barrier()
        s = _timed(lambda: torch.index_select(src, 0, idx, out=g), T / 2)
        dist.barrier()
        s_add = _timed(lambda: src.index_add_(0, idx, g), T / 2)
        moved = _moved(lambda: torch.index_select(src, 0, idx)) + _moved(lambda: src.index_add_(0, idx, g))
        res["gather"] = {"bytes": moved, "seconds": s + s_add, "shape": [rows, R, W]}
        chain = _tiny_chain()
        dist.barrier()
        res["op"] = {"ops": count_aten_ops(chain), "seconds": _timed(chain, T)}
        dist.barrier()
        Path(out, f"compute{rank}.json").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def _comm_rank(rank: int, world: int, port: int, spec: dict, out: str) -> None:
    """One of ``world`` ranks in pairs ``(2i, 2i + 1)``: gloo all_gather / all_reduce of ``spec["bytes"]`` per rank,
    every pair at once, and a 4-byte all_reduce's latency."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(spec["threads"])
        groups = [dist.new_group([i, i + 1]) for i in range(0, world - 1, 2)]
        g = groups[rank // 2] if rank // 2 < len(groups) else None
        numel = spec["bytes"] // 4
        t = torch.rand(numel)
        outs = [torch.empty(numel) for _ in range(2)]
        res = {}
        if g is not None:
            for name, fn, wire in (("all_gather", lambda: dist.all_gather(outs, t, group=g), numel * 4.0),
                                   ("all_reduce", lambda: dist.all_reduce(t, group=g), numel * 4.0)):  # fmt: skip
                fn()
                dist.barrier()
                times = []
                for _ in range(spec["reps"]):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                res[name] = {"wire_bytes": wire, "seconds": statistics.median(times)}
            tiny = torch.zeros(1)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(spec["latency_calls"]):  # a count, not a time box: both ranks of a pair make every call
                dist.all_reduce(tiny, group=g)
            res["latency_s"] = (time.perf_counter() - t0) / spec["latency_calls"]
        dist.barrier()
        Path(out, f"comm{rank}.json").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(fn, args: tuple, world: int, timeout: float, what: str) -> None:
    """``fn(rank, *args)`` on ``world`` spawned processes; every one killed if not done within ``timeout`` seconds."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.0, min(5.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            for proc in ctx.processes:
                proc.kill()
            raise TimeoutError(f"{what} on {world} ranks: not done within {timeout:.0f} s")


def _run_ranks(fn, world: int, spec: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        _start(fn, (world, _free_port(), spec, tmp), world, 300, fn.__name__)
        return [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("*.json"))]


def measure_profile(cfg, ranks: int, *, seconds: float, gemm_rows: int, mem_mib: int, comm_mib: int,
                    cores: int) -> dict:  # fmt: skip
    """Raw per-rank measurements on this machine with ``ranks`` concurrent ranks (module docstring, step 1):
    ``{"ranks", "threads", "compute": [per rank], "comm": [per rank of the pairs]}``."""
    threads = max(1, cores // ranks)
    C, dk, H = cfg.kda_chunk_size, cfg.linear_head_dim, cfg.linear_num_heads
    spec = {"threads": threads, "seconds": seconds, "gemm": gemm_shapes(cfg, gemm_rows),
            "bmm": bmm_shapes(cfg, gemm_rows), "mem_bytes": mem_mib << 20,
            "act": [gemm_rows, cfg.hc_mult, cfg.hidden_size, H, dk, C],
            "gather": [gemm_rows, cfg.kv_lora_rank, min(64, cfg.index_topk)]}  # fmt: skip
    compute = _run_ranks(_compute_rank, ranks, spec)
    cworld = max(2, ranks)
    cspec = {"threads": max(1, cores // cworld), "seconds": seconds, "bytes": comm_mib << 20, "reps": 5,
             "latency_calls": 200}  # fmt: skip
    comm = [r for r in _run_ranks(_comm_rank, cworld, cspec) if r]
    return {"ranks": ranks, "threads": threads, "comm_threads": cspec["threads"], "compute": compute, "comm": comm,
            "act": spec["act"]}  # fmt: skip


def profile_dict(meas: dict, memory_gib: float, cores: int) -> tuple[float, dict]:
    """``(seconds per aten op, a hardware_from_dict mapping)`` from ``measure_profile``'s measurements: every rate the
    mean over ranks.

    Args:
        meas: ``{"ranks": R, "threads": t, "compute": [{"gemm": [{"flops", "seconds"}], "bmm": [{"flops", "seconds"}],
            "memory": {"bytes", "seconds"}, "op": {"ops", "seconds"}}] per rank, "comm": [{"all_gather":
            {"wire_bytes", "seconds"}, "all_reduce": {...}, "latency_s": s}] per rank}``.
        memory_gib: this machine's memory (GiB); each rank is given ``memory_gib / R``.
        cores: CPU cores (recorded in the name and sources).

    Returns:
        Seconds per aten op of a tiny autograd chain (host cost, not a ``Hardware`` key) and the profile's keys
        (``genoctx.plan.hardware`` docstring): FLOP/s, bytes/s, GiB, seconds.
    """
    R, comp = meas["ranks"], meas["compute"]

    def mean(xs):
        return sum(xs) / len(xs)

    mm = mean([sum(g["flops"] for g in r["gemm"]) / sum(g["seconds"] for g in r["gemm"]) for r in comp])
    bmm = mean([sum(b["flops"] for b in r["bmm"]) / sum(b["seconds"] for b in r["bmm"]) for r in comp])
    mem = mean([r["memory"]["bytes"] / r["memory"]["seconds"] for r in comp])
    eager = mean([sum(e["bytes"] for e in r["eager"]) / sum(e["seconds"] for e in r["eager"]) for r in comp])
    gather = mean([r["gather"]["bytes"] / r["gather"]["seconds"] for r in comp])
    op_s = mean([r["op"]["seconds"] / r["op"]["ops"] for r in comp])
    ag = mean([r["all_gather"]["wire_bytes"] / r["all_gather"]["seconds"] for r in meas["comm"]])
    ar = mean([r["all_reduce"]["wire_bytes"] / r["all_reduce"]["seconds"] for r in meas["comm"]])
    lat = mean([r["latency_s"] for r in meas["comm"]])
    t = meas["threads"]
    where = f"bench/step_time_cpu.py on this machine ({cores} cores), {R} concurrent rank(s) x {t} torch thread(s)"
    return op_s, {
        "name": f"cpu-{cores}core-{R}rank",
        "dtype_flops": {"fp32": mm, "bf16": mm},
        "hbm_bytes_per_s": mem,
        "memory_gib": memory_gib / R,
        "gpus_per_node": R,
        "intra_node_bytes_per_s": ag,
        "inter_node_bytes_per_s": ag,
        "collective_latency_s": lat,
        "op_host_s": op_s,
        "host_overlaps_device": False,
        "memory_model": "eager",
        "efficiency": {
            "matmul": 1.0,
            "memory": min(1.0, eager / mem),
            "gather": min(1.0, gather / mem),
            "collective": 1.0,
            "attention": min(1.0, bmm / mm),
        },  # fmt: skip
        "sources": {
            "dtype_flops": f"torch.mm over the model's GEMM shapes, total FLOPs / total seconds; {where}; bf16 = fp32",
            "hbm_bytes_per_s": f"torch.add(a, b, out=c), 3 x tensor bytes per call; {where}",
            "intra_node_bytes_per_s": f"gloo all_gather in pairs ({meas['comm_threads']} thread(s) each), wire bytes "
            f"(g - 1) x input / s; all_reduce 2 (g - 1) / g x buffer / s = {ar:.3e}",
            "collective_latency_s": "gloo all_reduce of 4 bytes in pairs, seconds per call",
            "op_host_s": f"seconds per aten op of a 64-op autograd chain on 16 values, its backward and an update; "
            f"{where}",
            "host_overlaps_device": "false: on a CPU the host is the device, each op's host time adds to the step",
            "efficiency.attention": f"torch.bmm at the attention class's shapes (bmm_shapes: batch, m, k, n "
            f"{[b['shape'] for b in comp[0]['bmm']]}), total FLOPs / total seconds, over the GEMM rate "
            f"({bmm:.3e} / {mm:.3e} FLOP/s)",
            "memory_model": "eager: on a CPU every op of genoctx runs eagerly (genoctx.plan.eager counts their bytes)",
            "efficiency.memory": f"the eager basket (bench/step_time_cpu.py eager_basket: "
            f"{', '.join(e['op'] for e in comp[0]['eager'])} at [{', '.join(map(str, meas['act']))}] = rows, n, D, H, "
            f"K, C), its bytes / its seconds over the add's ({eager:.3e} / {mem:.3e} B/s)",
            "efficiency.gather": f"index_select of rows and index_add_ back, [rows, R, slots] = "
            f"{comp[0]['gather']['shape']}, over the add's rate ({gather:.3e} / {mem:.3e} B/s)",
            "efficiency.matmul/collective": "1.0: the microbenchmarks are the achieved rates",
            "memory_gib": "this machine's memory / ranks",
        },
    }


def _memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


# ------------------------------------------------------------------ 2. predicted


def predict(recipe, L: int, layout, hw) -> dict:
    """``plan_time`` of the recipe's model and train knobs at ``L`` tokens on ``layout`` and ``hw``, plus
    ``no_overlap_s`` (compute + memory-bound + all communication)."""
    from genoctx.plan.time import plan_time

    t = recipe.train
    p = plan_time(recipe.model, L, layout, hw, batch_size=t.batch_size, recompute=t.activation_checkpointing,
                  dtype=t.dtype, seq_chunk_tokens=t.seq_chunk_tokens)  # fmt: skip
    p["no_overlap_s"] = p["compute_s"] + p["memory_bound_s"] + sum(p["comm_s"].values())
    return p


def step_aten_ops(recipe, tokens: int) -> int:
    """Aten ops of one one-process train step of the recipe's model on ``tokens`` tokens of real DNA (after a warm-up
    step that creates AdamW's state); counted, not timed (``count_aten_ops``)."""
    from contextlib import nullcontext

    import torch

    from genoctx.data.tokenizer import encode
    from genoctx.parallel.build import build_model
    from genoctx.train.loop import build_optimizer, train_step

    torch.manual_seed(0)
    seq = (HG38 / FASTAS[2]).read_text().split("\n", 1)[1].replace("\n", "")[:tokens]
    x = torch.from_numpy(encode(seq)[0].astype("int64"))[None]
    model = build_model(recipe.model, None)
    opt, sched = build_optimizer(model, recipe.train, recipe.train.steps)
    train_step(model, opt, sched, x[:, :256], recipe.train, nullcontext())
    return count_aten_ops(lambda: train_step(model, opt, sched, x, recipe.train, nullcontext()))


def mesh_aten_ops(recipe, L: int, layout) -> int | None:
    """Aten ops of the busiest rank (the window's last CP piece) of a ``layout`` train step of the recipe's model
    (a preset, else None) on random tokens (``bench/op_count.py``'s ``count_mesh``: gloo ranks spawned here, FSDP2
    over ``dp_shard x cp``)."""
    from op_count import count_mesh

    from genoctx.model.config import PRESETS

    name = next((n for n, c in PRESETS.items() if c == recipe.model), None)
    return None if name is None else count_mesh(name, L, layout.cp, layout.dp_shard)["total"]


# ------------------------------------------------------------------ 3. measured


def prepare(work: Path, window: int) -> Path:
    """``genoctx prepare`` of the shipped hg38 pieces into ``work/data-W`` (once): train chr1 + chr2, hold out chr22."""
    data = work / f"data-{window}"
    if not (data / "manifest.json").is_file():
        cmd = [sys.executable, "-m", "genoctx.cli", "prepare", "--out", str(data), "--window", str(window),
               "--chroms", "chr1,chr2", "--eval-chroms", "chr22"]  # fmt: skip
        for f in FASTAS:
            cmd += ["--fasta", str(HG38 / f)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=REPO)
    return data


def step_seconds(metrics: Path) -> list[float]:
    """Seconds of each step in ``metrics.jsonl``: ``tokens / tokens_per_s`` (one process), or the slowest rank's
    under a mesh (its ``ranks`` rows)."""
    out = []
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        ranks = row.get("ranks")
        if ranks:
            out.append(max(r["tokens"] / r["tokens_per_s"] for r in ranks))
        else:
            out.append(row["tokens"] / row["tokens_per_s"])
    return out


def _overrides(L: int, steps: int) -> list[str]:
    # one checkpoint, after the last timed step; a log line every step
    return [f"train.seq_len={L}", f"train.steps={steps}", f"train.checkpoint_every={steps}", "train.log_every=1",
            "train.keep_checkpoints=1"]  # fmt: skip


def train_single(recipe_path: Path, data: Path, out: Path, L: int, steps: int) -> Path:
    """``genoctx train`` (one process) in a subprocess; its ``metrics.jsonl``."""
    cmd = [sys.executable, "-m", "genoctx.cli", "train", "--data", str(data), "--recipe", str(recipe_path),
           "--out", str(out)]  # fmt: skip
    for s in _overrides(L, steps):
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=REPO)
    return out / "metrics.jsonl"


class _Session:
    """``genoctx.cluster.WorkerSession`` without Ray (the CPU; nothing to restore or report)."""

    gpus_per_worker = 0

    def device(self):
        import torch

        return torch.device("cpu")

    def report(self, metrics: dict, checkpoint_dir=None) -> None:
        pass

    def checkpoint_dir(self):
        import contextlib

        return contextlib.nullcontext(None)


def _rank_entry(rank: int, worker_fn, config: dict, world: int, port: int) -> None:
    import torch.distributed as dist

    from genoctx.parallel.mesh import leaving_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    with leaving_mesh():  # as genoctx.cluster's workers: every group freed before the process exits
        worker_fn(config, _Session())


def _local_workers(worker_fn, config: dict, *, num_workers: int, **_ray_only):
    """``genoctx.cluster.run_workers`` on ``num_workers`` spawned gloo processes (the Ray-only arguments ignored)."""
    from genoctx.cluster import WorkerRun

    t0 = time.perf_counter()
    _start(_rank_entry, (worker_fn, config, num_workers, _free_port()), num_workers, 1800, "training")
    return WorkerRun(time.perf_counter() - t0, None)


def train_mesh(recipe_path: Path, data: Path, out: Path, L: int, steps: int, layout) -> Path:
    """``genoctx train --num-workers W --fsdp S --cp C``'s driver (``train_distributed``) on local gloo ranks."""
    from genoctx.recipes import load_recipe
    from genoctx.train.distributed import train_distributed

    sets = _overrides(L, steps) + [f"train.cp={layout.cp}", f"train.fsdp={layout.dp_shard}"]
    rec = load_recipe(recipe_path, sets)
    train_distributed(data, rec, out, run_workers=_local_workers, num_workers=layout.world, cp=layout.cp,
                      fsdp=layout.dp_shard)  # fmt: skip
    return out / "metrics.jsonl"


# ------------------------------------------------------------------ 4. compared


def summary(cases: list[dict]) -> dict:
    """The error band and whether the rankings agree (module docstring). ``cases``: the case lines."""
    done = [c for c in cases if c.get("measured_s")]
    ratios = [c["ratio"] for c in done]
    name = [f"{c['layout']}@{c['seq_len']}" for c in done]
    by_pred = [name[i] for i in sorted(range(len(done)), key=lambda i: done[i]["predicted_s"])]
    by_meas = [name[i] for i in sorted(range(len(done)), key=lambda i: done[i]["measured_s"])]
    choice = {}
    for L in sorted({c["seq_len"] for c in done}):
        at = [c for c in done if c["seq_len"] == L]
        if len(at) > 1:
            p = max(at, key=lambda c: c["predicted_tokens_per_s"])["layout"]
            m = max(at, key=lambda c: c["measured_tokens_per_s"])["layout"]
            choice[str(L)] = {"predicted": p, "measured": m, "agree": p == m}
    return {
        "bench": "step_time_cpu",
        "kind": "summary",
        "cases": len(done),
        "ratio_min": min(ratios) if ratios else None,
        "ratio_max": max(ratios) if ratios else None,
        "ratio_no_launch_min": min((c["ratio_no_launch"] for c in done if c.get("ratio_no_launch")), default=None),
        "ratio_no_launch_max": max((c["ratio_no_launch"] for c in done if c.get("ratio_no_launch")), default=None),
        "rank_by_predicted_s": by_pred,
        "rank_by_measured_s": by_meas,
        "ranking_agrees": by_pred == by_meas,
        "layout_choice": choice,
        "layout_choice_agrees": all(v["agree"] for v in choice.values()) if choice else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", nargs="+", default=["2k", "4k", "8k"], help="tokens per window (k/M suffixes)")
    ap.add_argument("--steps", type=int, default=5, help="train steps per case (the first is dropped as warm-up)")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUT_ARGS), choices=list(LAYOUT_ARGS))
    ap.add_argument("--recipe", type=Path, default=REPO / "recipes" / "cpu-small.yaml")
    ap.add_argument("--work", type=Path, help="prepared data and runs (default: a temporary directory, removed)")
    ap.add_argument("--seconds", type=float, default=0.5, help="time box of each microbenchmark section")
    ap.add_argument("--gemm-rows", type=int, default=2048, help="tokens (rows) of the microbenchmark's GEMMs")
    ap.add_argument("--mem-mib", type=int, default=64, help="MiB of each tensor of the bandwidth microbenchmark")
    ap.add_argument("--comm-mib", type=int, default=32, help="MiB per rank of the gloo bandwidth microbenchmark")
    ap.add_argument("--save-profiles", type=Path, help="write each measured profile here as cpu-R.yaml")
    ap.add_argument("--predict-only", action="store_true", help="measure the profiles and predict; no training")
    a = ap.parse_args()

    from genoctx.data.windows import parse_size
    from genoctx.errors import GenoctxError
    from genoctx.parallel.layout import Layout
    from genoctx.plan.hardware import hardware_from_dict
    from genoctx.recipes import load_recipe

    def bad(msg: str):
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)

    try:
        lengths = [parse_size(x) for x in a.lengths]
        recipe = load_recipe(a.recipe)
    except (ValueError, GenoctxError) as e:
        bad(f"--lengths/--recipe: {e}")
    if a.steps < 2:
        bad(f"--steps must be >= 2 (the first step is dropped), got {a.steps}")
    if any(L < 64 or L % 4 for L in lengths):
        bad(f"--lengths must be multiples of 4 (CP and FSDP split them) of at least 64, got {a.lengths}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    t_start = time.perf_counter()
    if os.getloadavg()[0] > cores:
        log(f"load average {os.getloadavg()[0]:.1f} > {cores} cores: other processes share the CPU, timings are noisy")

    hws, op_s = {}, {}
    for R in sorted({Layout(**LAYOUT_ARGS[n]).world for n in a.layouts}):
        log(f"profile: {R} rank(s) x {max(1, cores // R)} thread(s)")
        meas = measure_profile(recipe.model, R, seconds=a.seconds, gemm_rows=a.gemm_rows, mem_mib=a.mem_mib,
                               comm_mib=a.comm_mib, cores=cores)  # fmt: skip
        op_s[R], doc = profile_dict(meas, _memory_gib(), cores)
        hws[R] = hardware_from_dict(doc, where=f"measured profile ({R} ranks)")
        if a.save_profiles:
            import yaml

            a.save_profiles.mkdir(parents=True, exist_ok=True)
            (a.save_profiles / f"cpu-{R}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        print(json.dumps({"bench": "step_time_cpu", "kind": "profile", **doc, "seconds_per_aten_op": op_s[R],
                          "measured": meas, "loadavg_1m": os.getloadavg()[0]}), flush=True)  # fmt: skip

    work = a.work or Path(tempfile.mkdtemp(prefix="step_time_cpu"))
    cases, ops = [], {}
    try:
        data = None if a.predict_only else prepare(work, max(lengths))
        for L in lengths:
            for name in a.layouts:
                layout = Layout(**LAYOUT_ARGS[name])
                p = predict(recipe, L, layout, hws[layout.world])
                n = (name, L)
                if n not in ops:
                    log(f"counting the aten ops of a step: {name}, {L} tokens")
                    ops[n] = step_aten_ops(recipe, L) if layout.world == 1 else mesh_aten_ops(recipe, L, layout)
                host = None if ops[n] is None else ops[n] * op_s[layout.world]
                line = {"bench": "step_time_cpu", "kind": "case", "layout": name, "seq_len": L,
                        "ranks": layout.world, "dtype": recipe.train.dtype, "predicted_s": p["step_s"],
                        "predicted_no_launch_s": p["device_s"], "launch_s": p["launch_s"], "planned_ops": p["ops"],
                        "measured_s": None, "ratio": None, "ratio_no_launch": None, "bound": p["bound"],
                        "predicted_tokens_per_s": p["tokens_per_s"], "measured_tokens_per_s": None,
                        "compute_s": p["compute_s"], "memory_bound_s": p["memory_bound_s"],
                        "exposed_comm_s": sum(p["exposed_comm_s"].values()), "comm_s": sum(p["comm_s"].values()),
                        "predicted_no_overlap_s": p["no_overlap_s"],
                        "compute_by_component_s": p["compute_by_component_s"], "flops": p["flops"],
                        "comm_bytes": p["comm_bytes"], "aten_ops": ops[n], "host_s": host}  # fmt: skip
                if not a.predict_only:
                    out = work / "runs" / f"{name}-{L}"
                    shutil.rmtree(out, ignore_errors=True)
                    log(f"{name} at {L} tokens: {a.steps} steps")
                    t0 = time.perf_counter()
                    if layout.world == 1:
                        metrics = train_single(a.recipe, data, out, L, a.steps)
                    else:
                        metrics = train_mesh(a.recipe, data, out, L, a.steps, layout)
                    steps = step_seconds(metrics)
                    measured = statistics.median(steps[1:])
                    tokens = recipe.train.batch_size * L * layout.dp
                    line.update(measured_s=measured, ratio=p["step_s"] / measured,
                                ratio_no_launch=p["device_s"] / measured,
                                measured_tokens_per_s=tokens / measured, steps_s=steps,
                                wall_s=time.perf_counter() - t0, loadavg_1m=os.getloadavg()[0])  # fmt: skip
                cases.append(line)
                print(json.dumps(line), flush=True)
    finally:
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({**summary(cases), "wall_s": time.perf_counter() - t_start, "loadavg_1m": os.getloadavg()[0]}),
          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
