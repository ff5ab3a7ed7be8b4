"""Checkpoints: weights in safetensors, optimizer and data-order state beside them, written atomically.

Layout of a run directory::

    RUN/
      metrics.jsonl                 one JSON object per logged step
      checkpoints/
        step_000100/
          model.safetensors         weights and buffers (MoE router biases included)
          optimizer.pt              AdamW and LR-schedule state
          state.json                step, data-order state, tokens seen, genoctx version
          recipe.yaml               the resolved recipe that produced it

A checkpoint directory is first written under a temporary name and renamed into place when complete, so
a killed run never leaves a half-written checkpoint that ``latest_checkpoint`` would pick.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from .. import __version__
from ..errors import GenoctxError
from ..model.hf import is_hf_dir
from ..model.model import HybridLM
from ..recipes import Recipe, recipe_from_dict

CKPT_DIR = "checkpoints"


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: HybridLM,
    optimizer,
    scheduler,
    recipe: Recipe,
    state: dict,
    keep: int = 0,
) -> Path:
    """Write a checkpoint of ``step`` under ``run_dir/checkpoints`` atomically; returns its directory.

    ``keep`` > 0 removes all but the ``keep`` most recent complete checkpoints afterwards.
    """
    root = Path(run_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"genoctx_version": __version__})
        torch.save(
            {
                "optimizer": optimizer.state_dict() if optimizer is not None else None,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
            },
            tmp / "optimizer.pt",
        )
        (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
        (tmp / "state.json").write_text(
            json.dumps({"step": step, "genoctx_version": __version__, **state}, indent=1)
        )
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep > 0:
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith("step_") and (p / "state.json").is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The most recent complete checkpoint of a run, or None."""
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, a run directory meaning its latest checkpoint, or an HF model directory
    (``config.json`` + safetensors, ``genoctx.model.hf.is_hf_dir``), returned as is.

    Raises:
        GenoctxError: the path is none of these, or the run has no complete checkpoint.
    """
    p = Path(path)
    if (p / "state.json").is_file() and (p / "model.safetensors").is_file():
        return p
    if is_hf_dir(p):
        return p
    if p.is_dir():
        latest = latest_checkpoint(p)
        if latest is not None:
            return latest
        raise GenoctxError(
            f"no checkpoint in {p} (expected {p}/{CKPT_DIR}/step_*/, a checkpoint directory or an HF model "
            "directory with config.json and model.safetensors)"
        )
    raise GenoctxError(f"checkpoint not found: {p}")


def load_recipe_of(ckpt: Path) -> Recipe:
    """The resolved recipe saved beside a checkpoint."""
    raw = yaml.safe_load((Path(ckpt) / "recipe.yaml").read_text())
    return recipe_from_dict(raw, str(Path(ckpt) / "recipe.yaml"))


def load_model(ckpt: str | Path, device: str | torch.device = "cpu") -> tuple[HybridLM, Recipe, dict]:
    """Load (model, recipe, state) from a genoctx checkpoint or run directory (an HF model directory is read
    with ``genoctx.model.load_hf`` instead: it has no recipe or training state).

    Raises:
        GenoctxError: missing or unreadable checkpoint files, or an HF model directory.
    """
    ckpt = resolve_checkpoint(ckpt)
    if not (ckpt / "state.json").is_file():
        raise GenoctxError(f"{ckpt} is an HF model directory, not a genoctx checkpoint (use genoctx.model.load_hf)")
    try:
        recipe = load_recipe_of(ckpt)
        state = json.loads((ckpt / "state.json").read_text())
        model = HybridLM(recipe.model)
        tensors = load_file(str(ckpt / "model.safetensors"), device=str(device))
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise GenoctxError(f"cannot read checkpoint {ckpt}: {e}") from None
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise GenoctxError(
            f"checkpoint {ckpt} does not match its recipe: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    return model.to(device), recipe, state


def load_training_state(ckpt: Path, model: HybridLM, optimizer, scheduler) -> dict:
    """Restore model, optimizer and schedule in place from ``ckpt``; returns its state.json dict."""
    tensors = load_file(str(ckpt / "model.safetensors"))
    model.load_state_dict(tensors, strict=True)
    opt = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=False)
    if optimizer is not None and opt["optimizer"] is not None:
        optimizer.load_state_dict(opt["optimizer"])
    if scheduler is not None and opt["scheduler"] is not None:
        scheduler.load_state_dict(opt["scheduler"])
    return json.loads((ckpt / "state.json").read_text())
