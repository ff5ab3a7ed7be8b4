"""``train.frozen_dtype`` (issue 44): which frozen weights a run holds in fp8, and in which scale blocks.

``bf16`` (the default) changes nothing: a frozen weight is a parameter in the compute dtype with
``requires_grad`` False. ``fp8`` holds every frozen matmul weight (``genoctx.model.fp8.is_matmul_weight``: the
``nn.Linear`` weights of the mixers and MLPs, the routed experts' ``gate_up_proj`` / ``down_proj``; those
``train.trainable`` does not train) as block-scaled e4m3 with fp32 ``scale_inv`` (``genoctx.model.fp8.FP8Weight``),
dequantized per use inside the layer (per expert for the routed experts), never the whole model:

- from an HF base that stores them in fp8 (the published GLM-5.3-Flash: ``weight_scale_inv``, ``weight_block_size``
  ``[128, 128]``): the blocks as loaded, bit for bit, in the base's blocks; the ones it stores in bf16 (and, from a
  base of another precision, all) are quantized once loaded (``quantize_fp8``, ``scale = amax / 448`` per block);
- from scratch (no ``--init``): the fresh init is quantized (``[128, 128]`` blocks), for tests and small runs;
- ``--resume`` and ``genoctx eval`` / ``export`` of the run: holders shaped as the run's (the block recorded in
  every checkpoint's state.json, ``frozen_fp8``), filled from its checkpoint, which stores the fp8 bytes and scales
  (never a dequantized copy of the base).

On a mesh (``genoctx.parallel.build``): the holders are made on meta before parallelism; expert parallelism slices
the routed experts' holders (fp8 ``[E, out, in]`` and ``scale_inv`` ``[E, out / b0, in / b1]``) on E with the
experts, and each rank reads only its experts' fp8 blocks from the base (or quantizes its slice of a bf16 one);
FSDP2 shards parameters, not buffers, so the dense holders (attention, MLP and shared-expert linears) stay whole on
every rank (``genoctx.plan`` counts them so). ``train.compile`` with fp8 is refused (``FP8_ONE_PROCESS``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import GenoctxError
from ..model.config import ModelConfig
from ..model.groups import group_of, parse_trainable
from ..parallel.build import FP8_ONE_PROCESS, FrozenFP8
from ..recipes import TrainConfig

DEFAULT_BLOCK = (128, 128)  # the published checkpoint's weight_block_size
STATE_KEY = "frozen_fp8"  # state.json: {"block": [b0, b1], "weights": n}


def check_frozen_dtype(cfg: TrainConfig, mesh: bool) -> None:
    """Refuse what ``train.frozen_dtype: fp8`` cannot run yet, before anything is built.

    Raises:
        GenoctxError: ``fp8`` with ``train.compile`` (on a mesh, ``mesh``: ``--num-workers`` or ``train.ep`` > 1,
            ``FP8_ONE_PROCESS``; in one process the same refusal in its own words).
    """
    if cfg.frozen_dtype != "fp8":
        return
    if mesh and cfg.compile:
        raise GenoctxError(FP8_ONE_PROCESS)
    if cfg.compile:
        raise GenoctxError("train.frozen_dtype: fp8 with train.compile is not supported yet (issue 44): set "
                           "train.compile=false")  # fmt: skip


def frozen_matmuls(model_cfg: ModelConfig, trainable: str) -> tuple[str, ...]:
    """The matmul weights of ``HybridLM(model_cfg)`` (``is_matmul_weight``) whose group ``trainable`` does not train
    (built on the meta device: no memory)."""
    from ..model.fp8 import matmul_weights
    from ..model.model import HybridLM

    groups = set(parse_trainable(trainable))
    with torch.device("meta"):
        model = HybridLM(model_cfg)
    return tuple(n for n in matmul_weights(model) if group_of(n, model_cfg.layer_types) not in groups)


def frozen_fp8(cfg: TrainConfig, model_cfg: ModelConfig, base: dict | None = None, state: dict | None = None):
    """The ``FrozenFP8`` of a run (``genoctx.parallel.build.build_model``'s ``frozen_fp8``), or None for ``bf16``.

    Args:
        cfg: ``recipe.train`` (``frozen_dtype``, ``trainable``).
        model_cfg: the architecture (the base's, resolved).
        base: the run's base record (``genoctx.train.init.resolve_init``): an HF base with a
            ``quantization_config.weight_block_size`` gives the blocks; else ``DEFAULT_BLOCK``.
        state: a checkpoint's state.json (resume, eval, export): its ``frozen_fp8`` block wins (the holders it
            stores are in those blocks). A genoctx base (``--init RUN``) is read as its own checkpoint: it must be
            an fp8 run too (a bf16 one lacks the holders: the build names the missing tensor).

    Raises:
        GenoctxError: ``fp8`` with a ``trainable`` that freezes no matmul weight (``all``: nothing to hold in fp8).
    """
    if cfg.frozen_dtype != "fp8":
        return None
    names = frozen_matmuls(model_cfg, cfg.trainable)
    if not names:
        raise GenoctxError(f"train.frozen_dtype: fp8, but train.trainable {cfg.trainable} freezes no matmul weight "
                           "(nothing to hold in fp8): freeze some groups, or set train.frozen_dtype=bf16")  # fmt: skip
    block = DEFAULT_BLOCK
    if state is None and base is not None and base.get("kind") == "genoctx":  # --init RUN: its holders' blocks
        state = _state_of(Path(base["path"]))
    recorded = (state or {}).get(STATE_KEY) or {}
    if recorded.get("block"):
        block = tuple(int(b) for b in recorded["block"])
    elif base is not None and base.get("kind") == "hf":
        from ..model.hf import block_size, read_config

        block = tuple(block_size(read_config(base["path"])[1]) or DEFAULT_BLOCK)
    return FrozenFP8(names, (int(block[0]), int(block[1])))


def describe_fp8(frozen: FrozenFP8 | None) -> dict:
    """What state.json records of ``frozen`` (``STATE_KEY``), or nothing for ``bf16``."""
    if frozen is None:
        return {}
    return {STATE_KEY: {"block": list(frozen.block), "weights": len(frozen.names)}}


def _state_of(ckpt: Path) -> dict:
    """A genoctx checkpoint's state.json (``genoctx.train.checkpoint.read_state``'s file, read here without importing
    it: checkpoint imports this module)."""
    try:
        return json.loads((ckpt / "state.json").read_text())
    except (OSError, ValueError) as e:
        raise GenoctxError(f"{ckpt / 'state.json'}: not readable ({type(e).__name__})") from None
