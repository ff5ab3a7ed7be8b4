"""Hardware as data: what one GPU (and its node) can do, each number with its public source, and the efficiencies
the time model (``genoctx.plan.time``) applies to each class of work.

A profile is a YAML file: the shipped ones are ``genoctx/plan/hardware/{h100,h200,b200}.yaml`` (``--hardware
b200``); a user's own is any path (``--hardware my-gpu.yaml``) with the same keys:

    name: B200
    dtype_flops: {bf16: 2.25e15, fp32: 8.0e13, tf32: 1.1e15}  # dense FLOP/s per GPU (2 FLOPs per multiply-add)
    hbm_bytes_per_s: 8.0e12                       # device memory bandwidth, bytes/s
    memory_gib: 178.0                             # usable device memory, GiB
    gpus_per_node: 8
    intra_node_bytes_per_s: 9.0e11                # per GPU, each way (NVLink)
    inter_node_bytes_per_s: 5.0e10                # per GPU, each way (the node's NICs / GPUs)
    sources: {dtype_flops: "...", ...}            # where each number comes from (shipped profiles: required)
    efficiency: {matmul: 0.6}                     # optional: overrides of EFFICIENCY (a measured profile)
    op_host_s: 1.0e-5                             # optional: host seconds per eager aten op (OP_HOST_S)
    host_overlaps_device: true                    # optional: the host queues ops while the device runs them (a GPU);
                                                  # false: each op's host time adds to the step (a CPU)
    memory_model: activations                     # optional: what the memory-bound term counts (MEMORY_MODELS)

``dtype_flops``: ``bf16`` (tensor cores), ``fp32`` (CUDA-core FMA: fp32 GEMMs with TF32 off, as genoctx runs them) and,
optional in a user's profile, ``tf32`` (tensor cores on fp32 operands; what fla-core's fp32 dots run at). Which
peak each component of a step runs at: ``genoctx.plan.flops`` (its table) and ``genoctx.plan.time.unit_dtype``.

Efficiencies are named defaults with their reasons (``EFFICIENCY``, ``EFFICIENCY_REASONS``), taken from public
kernel and library measurements, never fitted to the published run the planner is checked against.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import yaml

from ..errors import GenoctxError

PROFILES_DIR = Path(__file__).parent / "hardware"
PROFILES = ("h100", "h200", "b200")

EFFICIENCY = {
    "matmul": 0.6,
    "attention": 0.15,
    "memory": 0.7,
    "collective": 0.7,
    "host_copy": 0.8,
    "gather": 0.7,
}
EFFICIENCY_REASONS = {
    "matmul": "large bf16 GEMMs reach 60-75% of the datasheet dense peak in cuBLAS; 0.6 for the smaller, uneven "
    "expert GEMMs (Megatron-Core DeepSeek-V3 on GB300: 1,233 TFLOPS/GPU of ~2,500, arXiv 2603.07685)",
    "attention": "sparse MLA and chunked linear attention: FlashMLA sparse forward ~640 TFLOPS on H800 (~0.65 of "
    "peak) but the sparse backward 100-115 TFLOPS on H800/H200 (~0.11, TileLang deepseek_v32); a backward of twice "
    "the forward's FLOPs gives 3 / (1/0.65 + 2/0.11) = 0.15 over a step",
    "memory": "elementwise and reduction kernels (norms, gates, mHC mixing, Sinkhorn, softmax) stream device memory "
    "at 70-90% of its peak; 0.7 for unfused PyTorch ops",
    "host_copy": "pinned cudaMemcpyAsync over PCIe Gen5 x16 reaches ~50-55 of its 64 GB/s each way (nvbandwidth "
    "host_to_device_memcpy_ce on H100/B200 nodes); 0.8",
    "gather": "row gathers and scatters (index_select, index_add_) of the eager memory model only (memory_model: "
    "eager, a CPU profile measures its own); on a GPU, without a measurement yet, the memory efficiency",
    "collective": "NCCL's bus bandwidth for messages of tens to hundreds of MB: ~80% of NVLink (nccl-tests "
    "all_reduce ~360 of 450 GB/s on H100) and ~90% of InfiniBand line rate; 0.7 for per-layer FSDP buckets and "
    "chunked all-to-alls",
}
COLLECTIVE_LATENCY_S = 3.0e-5  # seconds per collective call (NCCL launch + sync, tens of microseconds)
# host seconds per eager aten op on a GPU node (Python, autograd, dispatcher, cudaLaunchKernel): ~5-25 us per op
# ("From PyTorch op to kernel launch", jiahuanglin.xyz GPU-kernel lesson 18: Python ~1, pybind ~1, autograd 1-3,
# dispatcher 1-2, backend 1-5, cudaLaunchKernel 1-3 us); 1e-5 s, the middle of that range
OP_HOST_S = 1.0e-5
# what the memory-bound term of ``genoctx.plan.time`` counts: ``activations``, the activation bytes each layer writes
# moved a fixed number of times per pass (a fused kernel's traffic; the GPU profiles, not yet checked on a GPU), or
# ``eager``, the bytes each eager op of genoctx's PyTorch path reads and writes (``genoctx.plan.eager``; a CPU, where
# every op runs eagerly: the Triton and fla kernels need CUDA)
MEMORY_MODELS = ("activations", "eager")
HOST_KEYS = ("host_memory_gib", "host_device_bytes_per_s", "host_memory_bytes_per_s")  # optional
DTYPES = ("bf16", "fp32", "tf32")  # the peaks a profile may give (bf16 and fp32 required)
_KEYS = ("name", "dtype_flops", "hbm_bytes_per_s", "memory_gib", "gpus_per_node", "intra_node_bytes_per_s",
         "inter_node_bytes_per_s")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One GPU and its node. Rates are per GPU: FLOP/s by dtype (dense), bytes/s of device memory, bytes/s each way
    to a GPU of the same node and to one of another node; ``efficiency`` by work class (``EFFICIENCY`` keys). The
    host (optional keys; None: not checked or timed): ``host_memory_gib`` the node's memory per GPU,
    ``host_device_bytes_per_s`` each way between a GPU and host memory (its PCIe link), ``host_memory_bytes_per_s``
    the node's DRAM bandwidth per GPU (what a CPU optimizer step streams at). ``op_host_s``: host seconds per eager
    aten op (``genoctx.plan.ops`` counts them; ``genoctx.plan.time``'s ``launch`` term); ``host_overlaps_device``:
    whether that host time runs beside the device's work (a GPU: the step takes the longer of the two) or adds to
    it (a CPU, where the host is the device). ``memory_model``: what the memory-bound term counts
    (``MEMORY_MODELS``)."""

    name: str
    dtype_flops: dict
    hbm_bytes_per_s: float
    memory_gib: float
    gpus_per_node: int
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    host_memory_gib: float | None = None
    host_device_bytes_per_s: float | None = None
    host_memory_bytes_per_s: float | None = None
    sources: dict = dataclasses.field(default_factory=dict)
    efficiency: dict = dataclasses.field(default_factory=lambda: dict(EFFICIENCY))
    collective_latency_s: float = COLLECTIVE_LATENCY_S
    op_host_s: float = OP_HOST_S
    host_overlaps_device: bool = True
    memory_model: str = "activations"

    def flops(self, dtype: str) -> float:
        """Dense FLOP/s of ``dtype`` (a key of ``DTYPES``).

        Raises:
            GenoctxError: one line, a peak the profile does not give (``tf32`` is optional in a user's profile).
        """
        if dtype not in self.dtype_flops:
            raise GenoctxError(f"hardware {self.name}: dtype_flops has no {dtype}, which this plan runs at (add "
                               f"dtype_flops.{dtype} to the profile)")  # fmt: skip
        return float(self.dtype_flops[dtype])

    def to_dict(self) -> dict:
        """The profile as plain data (what ``genoctx plan --format json`` prints under ``hardware``)."""
        return dataclasses.asdict(self)


def _positive(where: str, key: str, v) -> float:
    if isinstance(v, str):  # (YAML 1.1 reads 2.25e15, without a dot and sign, as a string)
        try:
            v = float(v)
        except ValueError:
            pass
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        raise GenoctxError(f"{where}: {key} must be a positive number, got {v!r}")
    return float(v)


def hardware_from_dict(doc: dict, where: str = "hardware") -> Hardware:
    """A ``Hardware`` from a profile's mapping (the YAML's keys, module docstring).

    Raises:
        GenoctxError: one line naming ``where`` and the key: a missing or unknown key, a value that is not a
            positive number, an efficiency outside (0, 1] or of an unknown class, an unknown ``memory_model``.
    """
    if not isinstance(doc, dict):
        raise GenoctxError(f"{where}: a hardware profile is a mapping of {', '.join(_KEYS)}")
    known = set(_KEYS) | set(HOST_KEYS) | {"sources", "efficiency", "collective_latency_s", "op_host_s",
                                           "host_overlaps_device", "memory_model"}  # fmt: skip
    for key in doc:
        if key not in known:
            raise GenoctxError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")
    for key in _KEYS:
        if key not in doc:
            raise GenoctxError(f"{where}: missing key {key!r}")
    flops = doc["dtype_flops"]
    if not isinstance(flops, dict) or "bf16" not in flops or "fp32" not in flops:
        raise GenoctxError(f"{where}: dtype_flops must map bf16 and fp32 to FLOP/s, got {flops!r}")
    for k in flops:
        if k not in DTYPES:
            raise GenoctxError(f"{where}: dtype_flops.{k}: unknown dtype (known: {', '.join(DTYPES)})")
    flops = {k: _positive(where, f"dtype_flops.{k}", v) for k, v in flops.items()}
    eff = dict(EFFICIENCY)
    for k, v in (doc.get("efficiency") or {}).items():
        if k not in EFFICIENCY:
            raise GenoctxError(f"{where}: efficiency.{k}: unknown class (known: {', '.join(EFFICIENCY)})")
        if _positive(where, f"efficiency.{k}", v) > 1:
            raise GenoctxError(f"{where}: efficiency.{k} must be in (0, 1], got {v!r}")
        eff[k] = float(v)
    overlaps = doc.get("host_overlaps_device", True)
    if not isinstance(overlaps, bool):
        raise GenoctxError(f"{where}: host_overlaps_device must be true or false, got {overlaps!r}")
    memory_model = doc.get("memory_model", "activations")
    if memory_model not in MEMORY_MODELS:
        raise GenoctxError(f"{where}: memory_model must be one of {', '.join(MEMORY_MODELS)}, got {memory_model!r}")
    gpn = doc["gpus_per_node"]
    if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1:
        raise GenoctxError(f"{where}: gpus_per_node must be an integer >= 1, got {gpn!r}")
    return Hardware(
        name=str(doc["name"]),
        dtype_flops=flops,
        hbm_bytes_per_s=_positive(where, "hbm_bytes_per_s", doc["hbm_bytes_per_s"]),
        memory_gib=_positive(where, "memory_gib", doc["memory_gib"]),
        gpus_per_node=gpn,
        intra_node_bytes_per_s=_positive(where, "intra_node_bytes_per_s", doc["intra_node_bytes_per_s"]),
        inter_node_bytes_per_s=_positive(where, "inter_node_bytes_per_s", doc["inter_node_bytes_per_s"]),
        **{k: (_positive(where, k, doc[k]) if doc.get(k) is not None else None) for k in HOST_KEYS},
        sources=dict(doc.get("sources") or {}),
        efficiency=eff,
        collective_latency_s=_positive(
            where, "collective_latency_s", doc.get("collective_latency_s", COLLECTIVE_LATENCY_S)
        ),  # fmt: skip
        op_host_s=_positive(where, "op_host_s", doc.get("op_host_s", OP_HOST_S)),
        host_overlaps_device=overlaps,
        memory_model=memory_model,
    )


def load_hardware(name_or_path: str | Path) -> Hardware:
    """A shipped profile by name (``h100``, ``h200``, ``b200``; any case) or a user's YAML file by path.

    Raises:
        GenoctxError: an unknown name that is not a file, an unreadable file or bad YAML (naming the file), or a
            bad profile (``hardware_from_dict``).
    """
    key = str(name_or_path).lower()
    path = PROFILES_DIR / f"{key}.yaml" if key in PROFILES else Path(name_or_path)
    if not path.is_file():
        raise GenoctxError(f"--hardware {name_or_path}: neither a profile ({', '.join(PROFILES)}) nor a YAML file")
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise GenoctxError(f"{path}: not a readable YAML hardware profile ({type(e).__name__})") from None
    return hardware_from_dict(doc, where=str(path))
