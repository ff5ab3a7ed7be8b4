"""Where a Triton kernel is launched: the CUDA device of its tensors (``--device cuda:N``, issue 43 item 6)."""

import contextlib

import torch


def on_device(t):
    """The context a kernel is launched in: ``torch.cuda.device(t.device)`` for a CUDA tensor ``t`` (Triton launches
    on the current CUDA device and its stream, which need not be the tensors' own: ``--device cuda:1`` from a process
    whose current device is 0), a no-op for a CPU tensor (the interpreter)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()
