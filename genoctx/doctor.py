"""``genoctx doctor``: check a machine (and, with ``--address``, a Ray cluster) before a GPU job is queued.

One JSON document (``check``), at the CLI's level of the arrows (cli -> doctor -> cluster, kernels):

- ``versions``: genoctx, Python, torch, CUDA (the CUDA torch was built with, ``torch.version.cuda``; None for a CPU
  wheel), NCCL (``torch.cuda.nccl.version()``; None without it), Triton, fla-core and Ray (installed distributions,
  ``importlib.metadata``; None when absent).
- ``gpus``: every CUDA device torch sees: index, name, memory (GiB = 2^30 bytes), compute capability ("9.0") and
  the compile target ("sm_90").
- ``kernels``: genoctx's Triton kernels (indexer top-k with fp32 and bf16 dots, sparse MLA forward, backward with
  atomic dKV, deterministic backward) compiled ahead of time for each target by the path of
  ``bench/kernel_compile.py`` (``kernels.aot``: ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cap,
  32))``), on ``meta`` tensors at GLM-5.3-Flash's DSA shapes and ``KERNEL_TOKENS`` tokens, the first autotune
  configuration of each launch (as ``tests/kernels/test_compile_targets.py``): compiled, and fits (shared memory,
  registers, no spills). Targets are the GPUs' own (sm_90, sm_100; another capability is reported as not checked,
  since ``kernels.aot``'s limits are those of sm_90 and sm_100), or ``--targets``, which a CPU machine can use too.
  Each target compiles in a process of its own (``TRITON_INTERPRET=0``; about 25 CPU-seconds).
- ``ray`` (``--address`` only): the cluster's live nodes and its total and free resources
  (``genoctx.cluster.cluster_resources``).
- ``missing``: one short phrase per thing that GPU training needs and this machine lacks ("no CUDA GPU", a CPU
  build of torch, no NCCL, kernels that do not compile, a Ray cluster without GPUs); ``warnings``: what only some
  runs need (fla-core, for ``kda_kernel: fla``). ``ok`` is true when nothing is missing; with ``cpu_ok`` (``--cpu-ok``:
  CI, a laptop) the GPU's own absence (no GPU, a CPU torch, no NCCL) does not count.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version

from .errors import GenoctxError

CHECKED_TARGETS = ("sm_90", "sm_100")  # the targets kernels.aot knows the limits of (H100/H200, B200)
KERNEL_TOKENS = 4096  # tokens of the meta tensors the kernels are compiled for (shapes only, no memory)
COMPILE_TIMEOUT_S = 900  # seconds one target's compile may take (about 25 CPU-seconds; minutes on a loaded machine)
NO_GPU = "no CUDA GPU"
WORKER = [sys.executable, "-m", "genoctx.doctor"]  # + target: _compile_worker in a process of its own


def _dist_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def versions() -> dict:
    """Versions of what a GPU run uses: ``genoctx``, ``python``, ``torch`` (``torch.__version__``), ``cuda`` (the
    CUDA torch was built with, None for a CPU build), ``nccl`` ("2.27.3", None when torch has no NCCL), ``triton``,
    ``fla`` (fla-core), ``ray``: strings, None when absent."""
    import torch

    from . import __version__

    nccl = None
    if torch.version.cuda is not None and torch.distributed.is_available() and torch.distributed.is_nccl_available():
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except (AttributeError, RuntimeError):  # a build without NCCL's library
            nccl = None
    return {
        "genoctx": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "triton": _dist_version("triton"),
        "fla": _dist_version("fla-core"),
        "ray": _dist_version("ray"),
    }


def gpus() -> list[dict]:
    """The CUDA devices torch sees: ``[{"index", "name", "memory_gib" (total, 2^30 bytes, 0.1), "capability"
    ("9.0"), "target" ("sm_90")}]``; ``[]`` without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(
            {
                "index": i,
                "name": p.name,
                "memory_gib": round(p.total_memory / 2**30, 1),
                "capability": f"{p.major}.{p.minor}",
                "target": f"sm_{p.major}{p.minor}",
            }
        )
    return out


def _targets(spec: str | None, devices: list[dict]) -> list[str]:
    """The compile targets: ``spec`` ("sm_90,sm_100"; "none" for none) or, when None, the GPUs' own.

    Raises:
        GenoctxError: a target other than sm_90 and sm_100 named in ``spec`` (one line naming --targets).
    """
    if spec is None:
        return sorted({g["target"] for g in devices})
    names = [t.strip() for t in spec.split(",") if t.strip()]
    if names == ["none"]:
        return []
    bad = [t for t in names if t not in CHECKED_TARGETS]
    if bad or not names:
        raise GenoctxError(f"--targets {spec}: give sm_90 and/or sm_100 (comma-separated), or none")
    return list(dict.fromkeys(names))


def _summarize(target: str, rows: list[dict], seconds: float) -> dict:
    """One target's result from its worker's rows (``kernels.aot.compile_one`` rows with ``op`` and ``kernel``)."""
    failures = [
        f"{r['op']} ({r['kernel']}): {r['error'] or 'does not fit'}" for r in rows if not (r["compiled"] and r["fits"])
    ]
    return {
        "target": target,
        "checked": True,
        "launches": len(rows),
        "compiled": sum(bool(r["compiled"]) for r in rows),
        "fit": sum(bool(r["compiled"] and r["fits"]) for r in rows),
        "ok": bool(rows) and not failures,
        "failures": failures,
        "seconds": round(seconds, 1),
    }


def compile_kernels(targets: list[str], timeout: float = COMPILE_TIMEOUT_S) -> dict[str, dict]:
    """Compile genoctx's kernels for each target, each in a process of its own (all at once).

    Returns ``{target: {"checked", "launches", "compiled", "fit", "ok", "failures" (one line each), "seconds"}}``; a
    target outside ``CHECKED_TARGETS`` gets ``{"checked": False, "why": ...}``, a worker that fails or passes
    ``timeout`` seconds ``{"checked": True, "ok": False, "failures": [its last stderr line]}``.
    """
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default; set to silence its warning
    out: dict[str, dict] = {}
    procs = {}
    for t in targets:
        if t not in CHECKED_TARGETS:
            why = f"genoctx's kernels are checked for {' and '.join(CHECKED_TARGETS)} only (kernels/aot.py's limits)"
            out[t] = {"target": t, "checked": False, "why": why}
            continue
        cmd = [*WORKER, t]
        procs[t] = (time.monotonic(), subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                      text=True))  # fmt: skip
    for t, (t0, p) in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            out[t] = {"target": t, "checked": True, "ok": False, "failures": [f"compiling took over {timeout:.0f} s"]}
            continue
        if p.returncode != 0:
            last = ([ln for ln in stderr.splitlines() if ln.strip()] or [f"exit {p.returncode}"])[-1]
            out[t] = {"target": t, "checked": True, "ok": False, "failures": [last.strip()[:300]]}
            continue
        rows = [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]
        out[t] = _summarize(t, rows, time.monotonic() - t0)
    return {t: out[t] for t in targets}


def _compile_worker(target: str) -> None:
    """Print one JSON line per launch of one DSA layer's training step compiled for ``target`` (run with
    ``TRITON_INTERPRET=0``): op, kernel and ``kernels.aot.compile_one``'s row."""
    from kernels.aot import compile_one, dsa_launches

    from .model.config import PRESETS

    cfg = PRESETS["glm-5.3-flash"]
    launches = dsa_launches(
        KERNEL_TOKENS, heads=cfg.num_attention_heads, latent=cfg.kv_lora_rank, index_heads=cfg.index_n_heads,
        index_dim=cfg.index_head_dim, kpool=cfg.index_kpool, topk_pools=cfg.index_topk // cfg.index_kpool,
    )  # fmt: skip
    for op, _dtypes, launch in launches:
        row, _ = compile_one(launch, target, launch.config_kwargs()[0])
        print(json.dumps({"op": op, "kernel": launch.name, **row}), flush=True)


def _missing(v: dict, devices: list[dict], kernels: dict, ray: dict | None) -> tuple[list[str], list[str]]:
    """``(gpu, other)``: what GPU training needs and is absent, split into the GPU's own absence (what ``--cpu-ok``
    excuses) and the rest."""
    gpu, other = [], []
    if not devices:
        gpu.append(NO_GPU)
    if v["cuda"] is None:
        gpu.append(
            f"torch {v['torch']} is a CPU build (torch.version.cuda is None): install the CUDA wheel (docs/cluster.md)"
        )
    if v["nccl"] is None:
        gpu.append(f"no NCCL in torch {v['torch']}")
    if v["triton"] is None:
        other.append("no Triton")
    for t, k in kernels.items():
        if k.get("checked") and not k["ok"]:
            other.append(f"genoctx's kernels do not compile for {t}: {'; '.join(k['failures'])}")
    if ray is not None and not ray["total"].get("GPU"):
        other.append(f"the Ray cluster at {ray['address']} has no GPU")
    return gpu, other


def check(address: str | None = None, targets: str | None = None, cpu_ok: bool = False) -> dict:
    """The doctor's document (module docstring): ``versions``, ``gpus``, ``kernels`` ({target: result}; when none is
    compiled, ``{"skipped": why}``), ``ray`` (None without ``address``), ``missing``, ``warnings``, ``cpu_ok``,
    ``ok``.

    Raises:
        GenoctxError: a bad ``--targets``; an ``address`` where no Ray cluster answers (one line naming --address).
    """
    v = versions()
    devices = gpus()
    names = _targets(targets, devices)
    ray = None
    if address is not None:
        from .cluster import cluster_resources

        ray = cluster_resources(address)
    if names:
        kernels = compile_kernels(names)
    elif targets is not None:
        kernels = {"skipped": "--targets none"}
    else:
        kernels = {"skipped": f"{NO_GPU}: give --targets sm_90,sm_100 to compile for them without one"}
    gpu, other = _missing(v, devices, {t: k for t, k in kernels.items() if isinstance(k, dict)}, ray)
    warnings = [] if v["fla"] else ["no fla-core: kda_kernel: fla needs it (pip install -e '.[gpu]')"]
    return {
        "versions": v,
        "gpus": devices,
        "kernels": kernels,
        "ray": ray,
        "missing": gpu + other,
        "warnings": warnings,
        "cpu_ok": cpu_ok,
        "ok": not other and (cpu_ok or not gpu),
    }


if __name__ == "__main__":  # the compile worker of compile_kernels: python -m genoctx.doctor sm_90
    _compile_worker(sys.argv[1])
