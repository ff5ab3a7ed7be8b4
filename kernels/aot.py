"""Compile Triton launches for GPU targets on a machine without a GPU: does a kernel compile and fit on an H100/H200
(sm_90) and a B200 (sm_100)?

Two steps, both with Triton's own machinery (``triton.compile`` with an explicit ``GPUTarget``, the ``ptxas`` the
wheel ships):

1. ``captured_launches()``: while active, every ``kernel[grid](...)`` launch (plain, ``triton.heuristics`` or
   ``triton.autotune``) is recorded as a ``Launch`` (kernel, arguments, autotune configurations) and not run. The
   caller runs genoctx's (or fla's) Python entry point as it is called in training, with tensors on the ``meta``
   device: shapes, strides and dtypes are real, no memory is held, nothing executes.
2. ``compile_launch(launch, target)``: for each configuration, binds the recorded arguments exactly as
   ``JITFunction.run`` would on that GPU (same specialization: ints equal to 1, 16-divisible values; a meta tensor's
   address 0 counts as 16-byte aligned, as every CUDA allocation is), compiles to a cubin, and reads what the
   compiler reports: shared memory, tensor memory (sm_100), registers, spill stores/loads (``ptxas -v``).

``fits`` is the launch-time check a GPU would make: shared memory <= 227 KiB per block and registers x threads <=
64 Ki per SM (CUDA C Programming Guide, "Technical Specifications per Compute Capability", 9.0 and 10.0), tensor
memory <= 512 columns (sm_100), and, genoctx's own rule, no spills.

``addptr_offset_types(ttir)``: the integer type of every pointer offset in a kernel's Triton IR (``tt.addptr``), for
the test that every offset which can pass 2^31 elements is int64.

Not a runtime path: nothing in training imports this module.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction, create_function_from_signature

TARGETS = {"sm_90": GPUTarget("cuda", 90, 32), "sm_100": GPUTarget("cuda", 100, 32)}
GPUS = {"sm_90": "H100/H200", "sm_100": "B200"}
SHARED_LIMIT = 227 * 1024  # bytes of shared memory one block may use (opt-in maximum), sm_90 and sm_100
REGS_PER_SM = 64 * 1024  # 32-bit registers per SM, sm_90 and sm_100
TMEM_COLUMNS = 512  # tensor-memory columns per SM (sm_100)


@dataclass
class Launch:
    """One recorded kernel launch: ``fn`` (a ``JITFunction`` or ``triton.heuristics`` wrapper), its arguments and
    keyword arguments as passed (grid excluded), and ``configs`` (the autotuner's ``triton.Config`` list, or
    ``None`` for a launch whose meta-parameters are all in ``kwargs``)."""

    fn: object
    args: tuple
    kwargs: dict
    configs: list | None = None
    name: str = field(init=False)

    def __post_init__(self) -> None:
        inner = self.fn
        while not isinstance(inner, JITFunction):
            inner = inner.fn
        self.name = inner.fn.__name__

    def config_kwargs(self) -> list[dict]:
        """One keyword dict per configuration (the autotuner's meta-parameters and launch options), ``[{}]`` for a
        plain launch."""
        return [{}] if self.configs is None else [c.all_kwargs() for c in self.configs]


_MODE: dict = {"record": None, "target": None}


def _run(self: JITFunction, *args, grid, warmup, **kwargs):
    """Replacement of ``JITFunction.run`` while capturing (record the launch) or compiling (for ``_MODE['target']``)."""
    if _MODE["target"] is None:
        _MODE["record"].append(Launch(self, args, kwargs))
        return None
    target = _MODE["target"]
    backend = triton.compiler.make_backend(target)
    binder = create_function_from_signature(self.signature, self.params, backend)
    kwargs = dict(kwargs, debug=False)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args, specialization, options)
    src = triton.compiler.ASTSource(self, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)


def _autotuner_run(self: Autotuner, *args, **kwargs):
    kwargs.pop("grid", None)
    kwargs.pop("warmup", None)
    _MODE["record"].append(Launch(self.fn, args, kwargs, list(self.configs)))
    return None


@contextlib.contextmanager
def _patched() -> Iterator[None]:
    saved = (JITFunction.run, Autotuner.run)
    JITFunction.run, Autotuner.run = _run, _autotuner_run
    try:
        yield
    finally:
        JITFunction.run, Autotuner.run = saved


@contextlib.contextmanager
def captured_launches() -> Iterator[list[Launch]]:
    """Record every Triton launch made inside the block instead of running it; yields the list of ``Launch``."""
    launches: list[Launch] = []
    _MODE.update(record=launches, target=None)
    try:
        with _patched():
            yield launches
    finally:
        _MODE.update(record=None, target=None)


def dsa_launches(
    tokens: int, *, heads: int, latent: int, index_heads: int, index_dim: int, kpool: int, topk_pools: int
) -> list[tuple[str, str, Launch]]:
    """``(op, dtypes, Launch)`` for every launch genoctx's DSA kernels make in one training step of one layer.

    Calls the launchers on ``meta`` tensors of batch 1 and ``tokens`` queries over ``tokens`` keys, in the dtypes of a
    bf16-autocast step: the indexer top-k (``index_heads x index_dim``, pools of ``kpool``, ``topk_pools`` kept;
    bf16 queries, fp32 weights and pooled keys) with its default fp32 dot and with ``dot_dtype=bf16``; sparse MLA
    (``heads``, ``latent`` channels; bf16) forward, backward with atomic dKV, and the deterministic backward (dQ,
    then dKV over an inverse index whose data-dependent size is taken as every (query, pool) pair plus the tails).
    The launchers, not the ops: through an op, meta tensors reach its fake kernel and launch nothing.
    """
    import torch

    import kernels.sparse_mla as sm
    from kernels.indexer_topk import indexer_topk_launch

    B, T, N, kp, Kp = 1, tokens, tokens, kpool, topk_pools
    meta = dict(device="meta")
    out = []
    iq = torch.empty(B, T, index_heads, index_dim, dtype=torch.bfloat16, **meta)
    iw = torch.empty(B, T, index_heads, dtype=torch.float32, **meta)
    ik = torch.empty(B, N // kp, index_dim, dtype=torch.float32, **meta)
    visible = (torch.arange(T) + 1) // kp  # real values (the launcher checks them), moved to meta inside
    for dot in (None, torch.bfloat16):
        with captured_launches() as got:
            indexer_topk_launch(iq, iw, ik, visible, Kp, index_dtype=torch.int32, dot_dtype=dot)
        label = "q bf16, w fp32, k fp32, dot=" + ("fp32" if dot is None else "bf16")
        out += [("indexer_topk", label, launch) for launch in got]
    q = torch.empty(B, T, heads, latent, dtype=torch.bfloat16, **meta)
    kv = torch.empty(B, N, latent, dtype=torch.bfloat16, **meta)
    pools = torch.empty(B, T, Kp, dtype=torch.int32, **meta)
    pos = torch.empty(T, dtype=torch.long, **meta)
    scale = latent**-0.5
    with captured_launches() as got:
        o, lse = sm.sparse_mla_fwd(q, kv, pools, pos, kp, True, scale)
        sm.sparse_mla_bwd(q, kv, pools, pos, kp, True, scale, o, lse, torch.empty_like(o), deterministic=False)
    out += [(f"sparse_mla {'fwd' if i == 0 else 'bwd (atomic dKV)'}", "bf16", launch) for i, launch in enumerate(got)]
    saved = sm._inverse_selection
    sm._inverse_selection = lambda *_a: (  # data-dependent on a GPU; only its shapes matter here
        torch.empty(B * (N // kp) + 1, dtype=torch.long, **meta), torch.empty(T * Kp + T, dtype=torch.int32, **meta),
        N // kp)  # fmt: skip
    try:
        with captured_launches() as got:
            sm.sparse_mla_bwd(q, kv, pools, pos, kp, True, scale, o, lse, torch.empty_like(o), deterministic=True)
    finally:
        sm._inverse_selection = saved
    out += [(f"sparse_mla bwd (deterministic, {'dQ' if i == 0 else 'dKV'})", "bf16", launch)
            for i, launch in enumerate(got)]  # fmt: skip
    return out


_PTXAS = re.compile(
    r"Used (\d+) registers|(\d+) bytes spill stores, (\d+) bytes spill loads|(\d+) bytes stack frame"
)


def _ptxas_numbers(log: str) -> dict:
    out = {"registers": None, "spill_stores": 0, "spill_loads": 0, "stack_bytes": 0}
    for m in _PTXAS.finditer(log):
        if m.group(1):
            out["registers"] = int(m.group(1))
        elif m.group(2):
            out["spill_stores"] += int(m.group(2))
            out["spill_loads"] += int(m.group(3))
        else:
            out["stack_bytes"] = max(out["stack_bytes"], int(m.group(4)))
    return out


def compile_one(launch: Launch, target: str, config: dict) -> tuple[dict, object | None]:
    """Compile ``launch`` with one configuration's keyword arguments for ``target`` ("sm_90" or "sm_100").

    Returns ``(row, kernel)``: ``row`` has ``compiled``, ``error`` (the compiler's first line, or None),
    ``shared_bytes``, ``tmem_columns``, ``registers``, ``spill_stores``/``spill_loads``/``stack_bytes`` (bytes),
    ``num_warps``, ``num_stages`` and ``fits`` (module docstring); ``kernel`` is Triton's ``CompiledKernel`` (its
    ``asm`` holds ttir/ttgir/llir/ptx/cubin) or None when compilation failed.
    """
    row = {"compiled": False, "error": None}
    kw = {**launch.kwargs, **config}
    log = io.StringIO()
    saved = (triton.knobs.nvidia.dump_ptxas_log, triton.knobs.compilation.always_compile)
    triton.knobs.nvidia.dump_ptxas_log = True
    triton.knobs.compilation.always_compile = True  # ptxas runs (and logs) even when the cache has the kernel
    _MODE["target"] = TARGETS[target]
    try:
        with _patched(), contextlib.redirect_stdout(log):
            kernel = launch.fn.run(*launch.args, grid=None, warmup=True, **kw)
    except Exception as e:  # the compiler's refusal is the result, reported in one line
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [""]
        msg = lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"  # Triton: "at L:C:", source, the reason
        row["error"] = f"{type(e).__name__}: {msg}"[:300]
        return row, None
    finally:
        _MODE["target"] = None
        triton.knobs.nvidia.dump_ptxas_log, triton.knobs.compilation.always_compile = saved
    md = kernel.metadata
    row.update(compiled=True, shared_bytes=md.shared, tmem_columns=getattr(md, "tmem_size", 0) or 0)
    row.update(_ptxas_numbers(log.getvalue()))
    row.update(num_warps=md.num_warps, num_stages=md.num_stages)
    threads = 32 * md.num_warps * md.num_ctas
    regs = row["registers"] or 0
    row["fits"] = (
        md.shared <= SHARED_LIMIT
        and regs * threads <= REGS_PER_SM
        and row["tmem_columns"] <= TMEM_COLUMNS
        and row["spill_stores"] == 0
        and row["spill_loads"] == 0
    )
    return row, kernel


_ADDPTR = re.compile(r"tt\.addptr .*?: (?:tensor<[^>]*?!tt\.ptr<[^>]*>>|!tt\.ptr<[^>]*>), (tensor<[\dx]*(i\d+)>|i\d+)")


def addptr_offset_types(ttir: str) -> list[str]:
    """The integer type ("i32", "i64") of the offset of every ``tt.addptr`` in a kernel's Triton IR, in order."""
    out = []
    for m in _ADDPTR.finditer(ttir):
        out.append(m.group(2) or m.group(1))
    return out


__all__ = ["GPUS", "Launch", "TARGETS", "addptr_offset_types", "captured_launches", "compile_one", "dsa_launches"]
