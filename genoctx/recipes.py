"""Recipes: YAML files that mirror typed dataclasses, with ``--set a.b=c`` overrides from the command line.

A recipe has two sections::

    model:            # a ModelConfig: `preset` plus any ModelConfig field to override
      preset: cpu-small
    train:            # a TrainConfig
      steps: 300
      lr: 2.0e-3

The resolved recipe (preset expanded, overrides applied) is saved beside every checkpoint, so a checkpoint
alone says what produced it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .errors import GenoctxError
from .model.config import ModelConfig, preset


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping of ``genoctx train``. Lengths in tokens, learning rates per step."""

    steps: int = 300
    batch_size: int = 1  # windows per optimizer step (per data-parallel rank)
    seq_len: int | None = None  # train on random crops of this many tokens; None = the whole window
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 100  # steps; a checkpoint is also written at the end
    keep_checkpoints: int = 2  # most recent checkpoints kept on disk (0 = keep all)
    log_every: int = 10
    dtype: str = "fp32"  # "fp32" or "bf16" (autocast; states and KDA decay stay fp32)
    num_threads: int | None = None  # torch CPU threads; None = torch's default
    # how --cp splits a window over ranks: "contiguous" (slice r on rank r) or "zigzag" (2 x cp pieces, rank r
    # holds pieces r and 2 cp - 1 - r: equal DSA work per rank); ignored by one-process training
    cp_layout: str = "contiguous"

    def __post_init__(self) -> None:
        if self.dtype not in ("fp32", "bf16"):
            raise GenoctxError(f"train.dtype must be 'fp32' or 'bf16', got {self.dtype!r}")
        if self.cp_layout not in ("contiguous", "zigzag"):
            raise GenoctxError(f"train.cp_layout must be 'contiguous' or 'zigzag', got {self.cp_layout!r}")
        if self.steps < 0 or self.batch_size < 1 or self.checkpoint_every < 1:
            raise GenoctxError("train.steps must be >= 0, train.batch_size and train.checkpoint_every >= 1")


@dataclass
class Recipe:
    """A resolved recipe: the model architecture, the training settings and the preset it started from."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    preset: str | None = None

    def to_dict(self) -> dict:
        return {
            "model": {"preset": self.preset, **dataclasses.asdict(self.model)},
            "train": dataclasses.asdict(self.train),
        }


def _coerce(value: str):
    """Parse a ``--set`` value: integers and floats (``1e-4`` included), else YAML rules (bool, null, lists)."""
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return yaml.safe_load(value)


def _check_types(obj, source: str) -> None:
    """Reject values whose type does not match the dataclass field's default (ints accepted for floats)."""
    for f in dataclasses.fields(obj):
        default = f.default
        value = getattr(obj, f.name)
        if default is None or default is dataclasses.MISSING or value is None:
            continue
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            setattr(obj, f.name, float(value))
        elif isinstance(default, float) and isinstance(value, str):
            try:
                setattr(obj, f.name, float(value))  # YAML 1.1 reads 1e-4 as a string
            except ValueError:
                raise GenoctxError(f"{source}: {f.name} must be a number, got {value!r}") from None
        elif type(value) is not type(default):
            raise GenoctxError(f"{source}: {f.name} must be {type(default).__name__}, got {value!r}")


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``section.key=value`` overrides to a raw recipe dict (a copy is returned).

    Raises:
        GenoctxError: an override that is not ``a.b=c`` or names an unknown section.
    """
    out = {k: dict(v or {}) for k, v in raw.items()}
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise GenoctxError(f"--set expects section.key=value (e.g. train.steps=10), got {item!r}")
        key, value = item.split("=", 1)
        section, name = key.split(".", 1)
        if section not in ("model", "train"):
            raise GenoctxError(f"--set {item!r}: unknown section {section!r} (use model.* or train.*)")
        out.setdefault(section, {})[name] = _coerce(value)
    return out


def recipe_from_dict(raw: dict, source: str = "<recipe>") -> Recipe:
    """Build a ``Recipe`` from a raw dict (as loaded from YAML).

    Raises:
        GenoctxError: unknown sections or keys, unknown preset, invalid values (the message names ``source``).
    """
    unknown = set(raw) - {"model", "train"}
    if unknown:
        raise GenoctxError(f"{source}: unknown recipe sections {sorted(unknown)} (expected model, train)")
    model_raw = dict(raw.get("model") or {})
    preset_name = model_raw.pop("preset", None)
    try:
        if preset_name is not None:
            model = preset(preset_name, **model_raw)
        else:
            model = ModelConfig.from_dict(model_raw)
    except (KeyError, TypeError, ValueError) as e:
        msg = e.args[0] if e.args else str(e)
        raise GenoctxError(f"{source}: model: {msg}") from None
    _check_types(model, f"{source}: model")
    train_raw = dict(raw.get("train") or {})
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    bad = set(train_raw) - names
    if bad:
        raise GenoctxError(f"{source}: unknown train keys {sorted(bad)}")
    try:
        train = TrainConfig(**train_raw)
    except TypeError as e:
        raise GenoctxError(f"{source}: train: {e}") from None
    _check_types(train, f"{source}: train")
    return Recipe(model=model, train=train, preset=preset_name)


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> Recipe:
    """Load a YAML recipe (or the defaults when ``path`` is None) and apply ``--set`` overrides.

    Raises:
        GenoctxError: missing file, invalid YAML, unknown keys.
    """
    raw: dict = {}
    source = "<defaults>"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise GenoctxError(f"recipe not found: {p}")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            line = getattr(getattr(e, "problem_mark", None), "line", None)
            where = f" line {line + 1}" if line is not None else ""
            raise GenoctxError(f"{p}:{where} invalid YAML") from None
        if not isinstance(raw, dict):
            raise GenoctxError(f"{p}: a recipe must be a mapping with 'model' and 'train' sections")
    return recipe_from_dict(apply_overrides(raw, overrides or []), source)
