"""Activation offloading: each checkpointed decoder layer's input kept in host memory between its forward and its
recompute (``train.offload_activations``; Megatron-Core's ``--cpu-offloading`` of activations and torchtitan's
activation offloading do the same for the tensors a layer keeps).

With activation checkpointing (``genoctx.parallel.fsdp.apply_ac``, non-reentrant ``torch.utils.checkpoint``) all
a decoder layer keeps on the device from its forward to its backward is its input, the ``[B, T, n, D]`` residual
streams (``n = hc_mult``): ``B x T_local x n x D x element size`` bytes per layer, ``T_local`` the tokens the rank
holds in that pass (its CP piece; a chunk of ``seq_chunk_tokens`` under the chunked backward), summed over the
layers (GLM-5.3-Flash at 1M tokens on 32 GPUs: ~42 GiB per GPU). With offloading:

- **forward**: the layer runs on the device input as without offloading (no extra copy on its path); a copy of the
  input goes to host memory (CUDA: pinned memory, ``non_blocking`` on a side stream that waits for the compute
  stream, with an event; CPU: a real ``clone``, so that the copy exists and is counted) and the checkpoint keeps
  only that copy. Nothing keeps the device input once the next layer has consumed it, so it is freed.
- **backward**: the layer's recompute copies the host tensor back to the device (on the compute stream, after the
  side stream's event) and runs on it.

The numbers are exactly those of checkpointing without offloading (the same values in the same order: a copy
changes no bit). Time: one device-to-host copy per layer in forward (overlapped with the next layers' compute on
CUDA) and one host-to-device copy per layer in backward (on the compute stream, before the recompute: not
prefetched yet). ``OffloadStats`` counts both, in copies and bytes.

Host memory: each copy is one pinned tensor from PyTorch's CUDA caching host allocator, which takes the next power
of two of its size (``at::CachingHostAllocator``; up to 2x) and keeps freed blocks for reuse. The planner counts
that (``genoctx.plan.memory.pinned_block_bytes``), as it counts FSDP2's pinned masters and gradients under
``CPUOffloadPolicy(pin_memory=True)``. Not carved from one pool: a copy lives from its layer's forward to its
recompute, and a pool would need those lifetimes; the planner's count is exact for the allocator as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _Stats:
    """Copies made by activation offloading since the last ``reset()`` (all of this process's models)."""

    to_host: int = 0  # copies of a layer input to host memory (one per checkpointed layer call with grad)
    to_host_bytes: int = 0  # bytes of those copies (numel x element size)
    to_device: int = 0  # copies back to the device (one per recompute)
    to_device_bytes: int = 0

    def reset(self) -> None:
        self.to_host = self.to_host_bytes = self.to_device = self.to_device_bytes = 0


OffloadStats = _Stats()  # module-level counters: tests and benches read them (genoctx.parallel.offload.OffloadStats)

_SIDE_STREAMS: dict = {}  # CUDA device -> the stream the device-to-host copies run on
_ANCHORS: dict = {}  # device -> an empty tensor on it (tells checkpoint which device's RNG and autocast to keep)


def _side_stream(device: torch.device):
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def device_anchor(device: torch.device) -> torch.Tensor:
    """An empty tensor on ``device``, passed to ``checkpoint`` beside the host copy: ``checkpoint`` infers from its
    tensor arguments which device's RNG state and autocast state to restore for the recompute, and the host copy
    alone would say "cpu"."""
    if device not in _ANCHORS:
        _ANCHORS[device] = torch.empty(0, device=device)
    return _ANCHORS[device]


class HostCopy:
    """A layer input's copy in host memory: ``tensor`` (``[B, T, n, D]`` on the CPU, pinned on CUDA, detached, with
    the input's ``requires_grad`` so the recompute saves what the forward saved), the ``device`` it came from and,
    on CUDA, the ``event`` after which the copy is complete."""

    def __init__(self, tensor: torch.Tensor, device: torch.device, event=None):
        self.tensor, self.device, self.event = tensor, device, event


def to_host(x: torch.Tensor) -> HostCopy:
    """Copy ``x`` (a layer input, any shape and dtype) to host memory; counted in ``OffloadStats``.

    On CUDA the copy runs ``non_blocking`` into pinned memory on a side stream that first waits for the compute
    stream; ``x.record_stream`` keeps the caching allocator from reusing ``x``'s memory before the copy has read it.
    On the CPU it is a ``clone`` (the memory does not move, but the mechanics and counts are those of a GPU run).
    """
    device = x.device
    src = x.detach()
    event = None
    if device.type == "cuda":
        stream = _side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            host = torch.empty(src.shape, dtype=src.dtype, layout=src.layout, pin_memory=True)
            host.copy_(src, non_blocking=True)
            event = stream.record_event()
        src.record_stream(stream)
    else:
        host = src.clone()
    host.requires_grad_(x.requires_grad)
    OffloadStats.to_host += 1
    OffloadStats.to_host_bytes += host.numel() * host.element_size()
    return HostCopy(host, device, event)


def to_device(copy: HostCopy, host: torch.Tensor | None = None) -> torch.Tensor:
    """The layer input back on its device from ``copy`` (``host``: the checkpoint's saved form of ``copy.tensor``,
    the same values); counted in ``OffloadStats``. On CUDA the compute stream first waits for the device-to-host
    copy's event, then copies ``non_blocking`` from the pinned buffer. Keeps ``requires_grad`` (a differentiable
    copy), so the recompute records the same saved tensors as the forward did."""
    host = copy.tensor if host is None else host
    if copy.event is not None:
        torch.cuda.current_stream(copy.device).wait_event(copy.event)
    out = host.to(copy.device, non_blocking=True) if copy.device.type == "cuda" else host.clone()
    OffloadStats.to_device += 1
    OffloadStats.to_device_bytes += out.numel() * out.element_size()
    return out
