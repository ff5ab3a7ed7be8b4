"""AdamW whose moments are stored in a narrower dtype than the parameters (``train.optimizer_state_dtype=bf16``).

DeepSeek-V3 technical report (arXiv 2412.19437), section 3.3 "Low-Precision Storage": "we adopt the BF16 data format
instead of FP32 to track the first and second moments in the AdamW optimizer, without incurring observable
performance degradation"; the master weights and gradients stay fp32.

``AdamW(params, ..., state_dtype=torch.bfloat16)`` holds, per parameter of N local elements (an FSDP2 parameter: its
DTensor shard's local elements):

- ``step``: a float32 scalar tensor (as ``torch.optim.AdamW``);
- ``exp_avg``, ``exp_avg_sq``: tensors of the parameter's shape (a DTensor with its placements for a DTensor
  parameter) in ``state_dtype``: 2 x 2 bytes x N with bf16, against 2 x 4 bytes x N for fp32 moments.

One step, for one parameter at a time (its local tensors when it is a DTensor: the gradient must have the same
placements, as FSDP2's reduce-scattered gradients have): the moments are copied up to fp32, updated with the fp32
gradient exactly as ``torch.optim.AdamW``'s single-tensor path does (decoupled weight decay ``p *= 1 - lr wd``,
``m = lerp(m, g, 1 - beta1)``, ``v = beta2 v + (1 - beta2) g^2``, ``p -= lr / (1 - beta1^t) * m / (sqrt(v) /
sqrt(1 - beta2^t) + eps)``), the fp32 parameter is updated in place, and the moments are stored back rounded to
nearest (``Tensor.copy_``) in ``state_dtype``. The step's temporaries are those of one parameter: fp32 copies of its
two moments and the denominator (divided in place), 3 x 4 bytes x N_max where N_max is the largest local parameter's
element count (1 x 4 N_max with fp32 moments, updated in place). For comparison ``torch.optim.AdamW``'s
single-tensor path (the CPU default) allocates 2 x 4 N_max (the square root, then the division), its foreach path
(the CUDA default) 4 bytes per element of all parameters of a device and dtype at once. Measured on the CPU
(``bench/optim_state.py``: peak resident memory of a step above the memory before it): 3.0, 1.0 and 2.0 x 4 N_max.
Never are all moments upcast at once: that would allocate the 8 bytes per parameter this class exists to save.

With ``state_dtype`` float32 the arithmetic is torch's single-tensor AdamW's, operation for operation (equal to it
bit for bit on the CPU; ``genoctx.train.loop.build_optimizer`` uses ``torch.optim.AdamW`` itself for fp32).

Checkpoints: ``state_dict()`` holds the moments in ``state_dtype``; ``load_state_dict`` accepts moments of any
floating dtype (``torch.optim.AdamW``'s fp32 ones included) and stores them in ``state_dtype``; a
``torch.optim.AdamW`` loading this class's ``state_dict`` casts them up to the parameters' dtype itself.
"""

from __future__ import annotations

import torch

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # train.optimizer_state_dtype -> torch dtype
MOMENTS = ("exp_avg", "exp_avg_sq")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (shares its memory), ``t`` itself otherwise."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW``) with ``exp_avg``/``exp_avg_sq`` in ``state_dtype``
    (module docstring: dtypes, bytes, the step's temporaries, checkpoints).

    Args:
        params: parameters or param groups (fp32 masters: plain tensors or FSDP2 DTensors).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (a float ``lr``: ``LambdaLR`` sets it per group).
        state_dtype: the moments' dtype (``torch.bfloat16`` or ``torch.float32``).

    Raises:
        ValueError: a negative ``lr``/``eps``/``weight_decay``, betas outside [0, 1), a ``state_dtype`` that is not a
            floating dtype; at ``step``: a sparse gradient, or a DTensor gradient whose placements differ from its
            parameter's.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, state_dtype: torch.dtype = torch.bfloat16) -> None:  # fmt: skip
        if not 0.0 <= lr or not 0.0 <= eps or not 0.0 <= weight_decay:
            raise ValueError(f"AdamW: lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"AdamW: betas must be in [0, 1), got {betas}")
        if not state_dtype.is_floating_point:
            raise ValueError(f"AdamW: state_dtype must be a floating dtype, got {state_dtype}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.state_dtype = state_dtype  # read by genoctx.parallel.state.canonical_state for a fresh state

    def _init_state(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        st["step"] = torch.zeros((), dtype=torch.float32)
        for k in MOMENTS:
            st[k] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
        return st

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW update of every parameter with a gradient, one parameter at a time; returns ``closure()``'s
        loss (or None)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("AdamW: sparse gradients are not supported")
                st = self.state[p] if self.state[p] else self._init_state(p)
                if hasattr(p, "placements") and tuple(p.grad.placements) != tuple(p.placements):
                    raise ValueError(f"AdamW: gradient placements {p.grad.placements} differ from the "
                                     f"parameter's {p.placements}")  # fmt: skip
                param, grad = _local(p), _local(p.grad)
                m_store, v_store = _local(st["exp_avg"]), _local(st["exp_avg_sq"])
                st["step"] += 1
                step = st["step"].item()
                # fp32 working copies (the stored tensors themselves when they already are the param's dtype)
                m = m_store if m_store.dtype == param.dtype else m_store.to(param.dtype)
                v = v_store if v_store.dtype == param.dtype else v_store.to(param.dtype)
                if wd != 0:
                    param.mul_(1 - lr * wd)
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = lr / (1 - beta1**step)
                denom = v.sqrt().div_((1 - beta2**step) ** 0.5).add_(eps)  # in place: one temporary
                param.addcdiv_(m, denom, value=-step_size)
                del denom
                if m is not m_store:
                    m_store.copy_(m)  # round to nearest into state_dtype
                    v_store.copy_(v)
                del m, v
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim.Optimizer.load_state_dict`` (which casts the moments to the parameters' dtype), then the
        moments stored in ``state_dtype``: a checkpoint with fp32 moments (``torch.optim.AdamW``'s) resumes here
        rounded to bf16, one with bf16 moments exactly. Transiently holds one parameter-dtype copy of the loaded
        moments (the base class's cast)."""
        super().load_state_dict(state_dict)
        for st in self.state.values():
            for k in MOMENTS:
                if k in st and st[k].dtype != self.state_dtype:
                    st[k] = st[k].to(self.state_dtype)


__all__ = ["AdamW", "STATE_DTYPES"]
