"""Recipes: YAML files that mirror typed dataclasses, with ``--set a.b=c`` overrides from the command line.

A recipe has two sections::

    model:            # a ModelConfig: `preset` plus any ModelConfig field to override
      preset: cpu-small
    train:            # a TrainConfig
      steps: 300
      lr: 2.0e-3

The resolved recipe (preset expanded, overrides applied) is saved beside every checkpoint, so a checkpoint
alone says what produced it.

``model.init`` (a pretrained base) given on the command line (``--init``, ``--set model.init``) over a recipe file that
names a preset: the base's config.json fixes the architecture, so the file's preset and architecture keys are ignored
(one log line) and its compute knobs kept; a preset or architecture key given with ``--set`` besides is refused.

Every error names where the bad key or value came from: the recipe file, or the ``--set key=value`` that gave it
(with the closest real key when a key is unknown), and the offending value.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .data.tokenizer import VOCAB
from .errors import GenoctxError
from .model.config import PRESETS, ModelConfig, preset
from .model.groups import parse_trainable
from .model.lora import DEFAULT_TARGETS

log = logging.getLogger("genoctx.recipes")

SECTIONS = ("model", "train", "data", "loss")
LOGGERS = ("tensorboard", "mlflow", "wandb")  # train.loggers: where metrics go besides RUN/metrics.jsonl


class RecipeValueError(GenoctxError):
    """A bad value of one recipe key; ``key`` is its dotted name (``train.steps``), so the caller can say
    whether it came from the recipe file or from ``--set``."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


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
    # check a checkpoint's recorded file sizes and xxh3_64 digests before --resume or --init reads it
    # (genoctx.train.integrity); false (--no-verify) loads it unchecked
    verify_checkpoints: bool = True
    log_every: int = 10
    dtype: str = "fp32"  # "fp32" or "bf16" (autocast; states and KDA decay stay fp32)
    num_threads: int | None = None  # torch CPU threads; None = torch's default
    # how --cp splits a window over ranks: "contiguous" (slice r on rank r) or "zigzag" (2 x cp pieces, rank r
    # holds pieces r and 2 cp - 1 - r: equal DSA work per rank); ignored by one-process training
    cp_layout: str = "contiguous"
    # the parallel layout of a Ray run (genoctx.parallel.layout; --cp/--ep/--fsdp override): context-parallel,
    # expert-parallel and FSDP2 sizes; the rest of --num-workers is dp_replicate (replicas)
    cp: int = 1
    ep: int = 1
    fsdp: int = 1
    # folded expert parallelism: the EP group drawn from the fsdp x cp ranks (MoE parallel folding; ep must divide
    # fsdp x cp) instead of a mesh axis of its own that multiplies the data ranks (genoctx.parallel.layout)
    ep_folded: bool = False
    # FSDP2 on one worker (--num-workers 1): fully_shard over a 1-rank mesh, so that one GPU runs FSDP2's bf16 mixed
    # precision and offload_optimizer as a sharded layout does (genoctx.parallel.layout.Layout.fsdp_one; --fsdp-one)
    fsdp_one: bool = False
    activation_checkpointing: bool = False  # recompute each decoder layer in backward (genoctx.parallel.fsdp.apply_ac)
    # keep the input each checkpointed decoder layer holds for its recompute ([B, T, hc_mult, D] residual streams) in
    # host memory: copied to host after the layer's forward, back before its recompute (genoctx.parallel.offload;
    # Megatron-Core / torchtitan activation offloading); exact; needs activation_checkpointing
    offload_activations: bool = False
    # train each window as consecutive chunks of this many tokens with the exact chunked backward
    # (genoctx.train.chunked): memory bounded by the chunk plus the boundary state; null = one pass
    seq_chunk_tokens: int | None = None
    offload_optimizer: bool = False  # FSDP2 CPUOffloadPolicy: sharded params, grads and AdamW state in CPU memory
    # dtype of AdamW's exp_avg and exp_avg_sq: "fp32" (torch.optim.AdamW, 8 bytes per parameter) or "bf16"
    # (genoctx.train.optim.AdamW: 4 bytes per parameter, updated in fp32, stored rounded; fp32 masters and
    # gradients either way, DeepSeek-V3 section 3.3); changes the numbers, so off by default
    optimizer_state_dtype: str = "fp32"
    # what trains (issue 44; genoctx.model.groups): "all", or a comma list of the named groups (kda, dsa, indexer,
    # router, experts, shared_experts, dense_mlp, mhc, norms, embed, head) and lora; every other parameter is frozen
    # (requires_grad false: no gradient, no optimizer state) and, with router frozen, so are the MoE routing biases.
    # lora adds the adapters (genoctx.model.lora, train.lora_*) and trains them, in one process and on every mesh
    trainable: str = "all"
    # LoRA (read when train.trainable names lora): the rank r, alpha (scaling alpha / r, PEFT's) and the adapted
    # projections, a comma list of nn.Linear leaf names and experts.gate_up_proj / experts.down_proj
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_targets: str = ",".join(DEFAULT_TARGETS)
    # the dtype of the frozen matmul weights (every nn.Linear weight of a layer's mixer and MLP, the routed experts)
    # when train.trainable freezes them: "bf16" (the compute dtype, as today) or "fp8" (block-scaled e4m3 with fp32
    # scales, genoctx.model.fp8: an fp8 base's blocks kept as loaded, any other quantized at load; dequantized per
    # use inside the layer); one process only for now (issue 44; docs/train.md)
    frozen_dtype: str = "bf16"
    # torch.compile each decoder layer (genoctx.parallel.compile; Inductor): the first step compiles (minutes on a
    # CPU, growing with the window); off by default until measured on a GPU (bench/compile_speed.py); not with
    # cp > 1, ep > 1 or seq_chunk_tokens (the chunked backward) yet
    compile: bool = False
    # deterministic kernels (genoctx.train.loop.deterministic_mode): torch.use_deterministic_algorithms, the sparse MLA
    # backward without atomics (dQ, then dKV by an inverse index), the MoE combine as a fixed-order sum over slots;
    # the same run then gives the same bits on a GPU (slower; off by default)
    deterministic: bool = False
    # metrics.jsonl's rows also to these (LOGGERS; --logger): RUN/tensorboard, RUN/mlruns, W&B (genoctx.train.metrics)
    loggers: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Check types and ranges; the first bad field raises :class:`RecipeValueError` naming ``train.<field>``."""
        if isinstance(self.loggers, str):  # a comma list: --set train.loggers=tensorboard,mlflow
            self.loggers = [name.strip() for name in self.loggers.split(",") if name.strip()]
        for f in dataclasses.fields(self):
            setattr(self, f.name, _check_value(f"train.{f.name}", getattr(self, f.name), _HINTS[TrainConfig][f.name]))
        bad = [name for name in self.loggers if name not in LOGGERS]
        if bad:
            _bad("train.loggers", f"must list some of {', '.join(map(repr, LOGGERS))}", bad[0])
        self.loggers = list(dict.fromkeys(self.loggers))  # each once, in order
        choices = {"dtype": ("fp32", "bf16"), "cp_layout": ("contiguous", "zigzag"),
                   "optimizer_state_dtype": ("fp32", "bf16"), "frozen_dtype": ("bf16", "fp8")}  # fmt: skip
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                _bad(f"train.{name}", f"must be {' or '.join(map(repr, allowed))}", getattr(self, name))
        try:  # one canonical spelling ("all" stays "all"), so that a resume compares like with like
            groups = parse_trainable(self.trainable)
            self.trainable = "all" if self.trainable.strip() == "all" else ",".join(groups)
        except ValueError as e:
            raise RecipeValueError("train.trainable", str(e)) from None
        if self.frozen_dtype == "fp8" and self.trainable == "all":  # nothing frozen: nothing to hold in fp8
            why = "train.trainable is all (nothing is frozen): name what trains, or use bf16"
            raise RecipeValueError("train.frozen_dtype", f"train.frozen_dtype: fp8 holds frozen weights, but {why}")
        names = [t.strip() for t in self.lora_targets.split(",")]
        bad = [t for t in names if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)?", t)]
        if bad or len(set(names)) != len(names):
            _bad("train.lora_targets", "must be a comma list of distinct module names (q_proj, experts.down_proj, "
                 "...), each once", self.lora_targets)  # fmt: skip
        self.lora_targets = ",".join(names)
        for name, lo, hi, what in _TRAIN_RANGES:
            v = getattr(self, name)
            if v is not None and not ((lo is None or v >= lo) and (hi is None or v < hi)):
                _bad(f"train.{name}", f"must be {what}", v)
        if self.offload_activations and not self.activation_checkpointing:  # it offloads what recompute keeps
            raise RecipeValueError("train.offload_activations", "train.offload_activations offloads the checkpointed "
                                   "layers' inputs: it needs train.activation_checkpointing: true")  # fmt: skip
        if self.compile and (self.cp > 1 or self.ep > 1):  # their mixers' / MoEs' forwards are replaced: untested
            raise RecipeValueError("train.compile", f"train.compile is not supported with train.cp={self.cp}, "
                                   f"train.ep={self.ep} yet: set train.compile=false or use cp = ep = 1")  # fmt: skip
        if self.compile and self.seq_chunk_tokens is not None:  # caches per chunk: a recompile per offset, breaks
            raise RecipeValueError("train.compile", "train.compile is not supported with train.seq_chunk_tokens "
                                   f"({self.seq_chunk_tokens}) yet: set one of them to false / null")  # fmt: skip


# (field, lowest allowed, first value not allowed, in words); None = unbounded
_TRAIN_RANGES = (
    ("steps", 0, None, ">= 0"),
    ("batch_size", 1, None, ">= 1"),
    ("seq_len", 1, None, ">= 1 (or null: the whole window)"),
    ("lr", 0.0, None, ">= 0"),
    ("min_lr_ratio", 0.0, 1.0 + 1e-12, "between 0 and 1"),
    ("warmup_steps", 0, None, ">= 0"),
    ("weight_decay", 0.0, None, ">= 0"),
    ("beta1", 0.0, 1.0, "in [0, 1)"),
    ("beta2", 0.0, 1.0, "in [0, 1)"),
    ("grad_clip", 1e-300, None, "> 0"),
    ("seed", 0, 2**63, "in [0, 2**63)"),
    ("checkpoint_every", 1, None, ">= 1"),
    ("keep_checkpoints", 0, None, ">= 0 (0 = keep all)"),
    ("log_every", 1, None, ">= 1"),
    ("num_threads", 1, None, ">= 1 (or null: torch's default)"),
    ("seq_chunk_tokens", 1, None, ">= 1 (or null: one pass over the window)"),
    ("cp", 1, None, ">= 1"),
    ("ep", 1, None, ">= 1"),
    ("fsdp", 1, None, ">= 1"),
    ("lora_rank", 1, None, ">= 1"),
    ("lora_alpha", 1e-300, None, "> 0"),
)

# ModelConfig integer fields that may be 0 (every other integer field must be >= 1); ModelConfig checks the rest
_MODEL_MAY_BE_ZERO = {"n_shared_experts", "qk_rope_head_dim", "pad_token_id", "bos_token_id", "eos_token_id",
                      "hc_sinkhorn_iters"}  # fmt: skip
# ModelConfig float fields that may be negative (every other one must be >= 0: scales, epsilons, rates)
_MODEL_MAY_BE_NEGATIVE = {"linear_lower_bound"}
# model fields that also take a string of letters (``--set model.layer_types=KKKD``)
_LETTER_FIELDS = {"layer_types", "mlp_layer_types", "indexer_types"}


@dataclass
class DataConfig:
    """How windows are fed to a base with a text vocabulary (``genoctx.model.vocab``)."""

    # the base token that starts each window (<bos>); None = tokenizer_config.json's bos_token, else its eos_token
    window_start_token: str | None = None

    def __post_init__(self) -> None:
        if self.window_start_token is not None and not (
            isinstance(self.window_start_token, str) and self.window_start_token
        ):
            _bad("data.window_start_token", "must be a token of the base's tokenizer", self.window_start_token)


@dataclass
class LossConfig:
    """The next-token loss (``genoctx.model.vocab``): over the base's ``full`` vocabulary (default) or the
    ``nucleotide`` rows only (a different objective), with the head computed ``chunk_tokens`` tokens at a time."""

    vocab: str = "full"
    chunk_tokens: int = 2048  # 2048 x 154,880 fp32 logits = 1.18 GiB: bench/lm_head.py

    def __post_init__(self) -> None:
        self.vocab = _check_value("loss.vocab", self.vocab, str)
        self.chunk_tokens = _check_value("loss.chunk_tokens", self.chunk_tokens, int)
        if self.vocab not in ("full", "nucleotide"):
            _bad("loss.vocab", "must be 'full' or 'nucleotide'", self.vocab)
        if self.chunk_tokens < 1:
            _bad("loss.chunk_tokens", "must be >= 1", self.chunk_tokens)


@dataclass
class Recipe:
    """A resolved recipe: the model architecture, the training settings and the preset it started from.

    ``init`` (recipe key ``model.init``, CLI ``--init``): a pretrained base (an HF model directory or a Hub repo
    id) to start from; its config.json then fixes the architecture and ``model`` may set compute knobs only
    (``genoctx.train.init.resolve_init`` fills ``model`` in).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    preset: str | None = None
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    init: str | None = None
    model_knobs: dict = field(default_factory=dict)  # the compute knobs the recipe set (with init)

    def to_dict(self) -> dict:
        """The recipe as YAML would hold it; an unresolved ``init`` recipe holds the base and its knobs only."""
        model = {"init": self.init, **self.model_knobs} if self.init is not None else {
            "preset": self.preset, "init": None, **dataclasses.asdict(self.model)}  # fmt: skip
        return {
            "model": model,
            "train": dataclasses.asdict(self.train),
            "data": dataclasses.asdict(self.data),
            "loss": dataclasses.asdict(self.loss),
        }


_HINTS = {cls: typing.get_type_hints(cls) for cls in (TrainConfig, ModelConfig)}


def _short(value, limit: int = 60) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _bad(key: str, what: str, value) -> typing.NoReturn:
    raise RecipeValueError(key, f"{key} {what}, got {_short(value)}")


def _describe(key: str, hint) -> str:
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    parts = [words.get(a, "a list of strings") for a in args if a is not type(None)]
    if key.split(".", 1)[1] in _LETTER_FIELDS:
        parts.append("a string of letters")
    return " or ".join(parts) + (" or null" if type(None) in args else "")


def _check_value(key: str, value, hint):
    """``value`` converted to the field's type (ints to floats, YAML 1.1's ``'1e-4'`` strings to floats), or a
    :class:`RecipeValueError` naming ``key`` and the value."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    name = key.split(".", 1)[1]
    if value is None and type(None) in args:
        return None
    for t in args:
        if t is bool and isinstance(value, bool):
            return value
        if isinstance(value, bool):
            continue
        if t is int and isinstance(value, int):
            return value
        if t is float and isinstance(value, int | float | str):
            try:
                x = float(value)
            except (ValueError, OverflowError):
                continue
            if not math.isfinite(x):
                _bad(key, "must be a finite number", value)
            return x
        if t is str and isinstance(value, str):
            return value
        if typing.get_origin(t) is list and isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        if typing.get_origin(t) is list and isinstance(value, str) and name in _LETTER_FIELDS:
            return value
    _bad(key, f"must be {_describe(key, hint)}", value)


def _coerce(value: str):
    """Parse a ``--set`` value: integers and floats (``1e-4`` included), else YAML rules (bool, null, lists)."""
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value  # not YAML: the plain string (the field's type check names it)


def _suggest(key: str, known: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _known_keys(section: str) -> set[str]:
    cls = {"model": ModelConfig, "train": TrainConfig, "data": DataConfig, "loss": LossConfig}[section]
    names = {f.name for f in dataclasses.fields(cls)}
    return names | {"preset", "init"} if section == "model" else names


def _apply(raw: dict, overrides: list[str], source: str) -> tuple[dict, dict[str, str]]:
    """``raw`` with the overrides applied, and where each overridden key came from (``{"train.lr": "--set
    train.lr=1e-3"}``; a later ``--set`` of the same key wins)."""
    out: dict = {}
    for k, v in raw.items():
        if k in SECTIONS and v is not None and not isinstance(v, dict):
            raise GenoctxError(f"{source}: section {k!r} must be a mapping of keys, got {_short(v)}")
        out[k] = dict(v or {}) if k in SECTIONS else v
    origins: dict[str, str] = {}
    for item in overrides:
        where = f"--set {item}"
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise GenoctxError(f"{where}: expected section.key=value (e.g. train.steps=10)")
        key, value = item.split("=", 1)
        key = key.strip()
        section, name = key.split(".", 1)
        if section not in SECTIONS:
            raise GenoctxError(f"{where}: unknown section {section!r} (use {', '.join(s + '.*' for s in SECTIONS)})")
        if name not in _known_keys(section):
            raise GenoctxError(f"{where}: unknown key {key}{_suggest(key, _dotted(section))}")
        out.setdefault(section, {})[name] = _coerce(value)
        origins[key] = where
    return out, origins


def _dotted(section: str) -> list[str]:
    return [f"{section}.{k}" for k in _known_keys(section)]


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``section.key=value`` overrides to a raw recipe dict (a copy is returned).

    Raises:
        GenoctxError: an override that is not ``a.b=c``, or names an unknown section or key (the message
            quotes the ``--set`` and suggests the closest key).
    """
    return _apply(raw, overrides, "<recipe>")[0]


def recipe_from_dict(raw: dict, source: str = "<recipe>", origins: dict[str, str] | None = None) -> Recipe:
    """Build a ``Recipe`` from a raw dict (as loaded from YAML).

    Args:
        raw: ``{"model": {...}, "train": {...}}``.
        source: where ``raw`` came from (the recipe file), named in errors.
        origins: dotted keys that came from elsewhere (``{"train.lr": "--set train.lr=abc"}``): errors about
            those keys name that instead of ``source``.

    Raises:
        GenoctxError: unknown sections or keys, unknown preset, invalid values; one line naming the file (or
            the ``--set``), the key and the value.
    """
    return _build(raw, source, origins or {}, None)


def _build(raw: dict, source: str, origins: dict[str, str], file_raw: dict | None) -> Recipe:
    def where(key: str) -> str:
        return origins.get(key, source)

    if not isinstance(raw, dict):
        raise GenoctxError(f"{source}: a recipe must be a mapping with 'model' and 'train' sections")
    unknown = sorted(map(str, set(raw) - set(SECTIONS)))
    if unknown:
        raise GenoctxError(f"{source}: unknown recipe section {unknown[0]!r} (expected {', '.join(SECTIONS)})")
    sections = {}
    for s in SECTIONS:
        v = raw.get(s)
        if v is not None and not isinstance(v, dict):
            raise GenoctxError(f"{source}: section {s!r} must be a mapping of keys, got {_short(v)}")
        sections[s] = dict(v or {})
        bad = sorted(map(str, set(sections[s]) - _known_keys(s)))
        if bad:
            key = f"{s}.{bad[0]}"
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise GenoctxError(f"{where(key)}: unknown key {key}{_suggest(key, _dotted(s))}{more}")

    # model: types and ranges key by key, then ModelConfig's own (cross-field) checks
    model_raw = sections["model"]
    preset_name = model_raw.pop("preset", None)
    if preset_name is not None and (not isinstance(preset_name, str) or preset_name not in PRESETS):
        raise GenoctxError(
            f"{where('model.preset')}: model.preset {_short(preset_name)} is not a preset; "
            f"known: {', '.join(sorted(PRESETS))}"
        )
    init = model_raw.pop("init", None)
    if init is not None and (not isinstance(init, str) or not init.strip()):
        raise GenoctxError(f"{where('model.init')}: model.init must be an HF model directory or Hub repo id, got "
                           f"{_short(init)}")  # fmt: skip
    knobs: dict = {}
    if init is not None:
        ignored = None
        if "model.init" in origins:  # --init (or --set model.init) over a file's architecture: the base's wins
            preset_name, ignored = _ignore_file_architecture(preset_name, model_raw, origins)
        if preset_name is not None:
            raise GenoctxError(
                f"{where('model.preset')}: model.preset {preset_name!r} with model.init {init!r}: the base's "
                "config.json fixes the architecture; drop model.preset (--set model.preset=null)"
            )
        arch = sorted(k for k in model_raw if k not in ModelConfig._runtime)
        if arch:
            key = f"model.{arch[0]}"
            raise GenoctxError(
                f"{where(key)}: {key} cannot change the architecture of the initialised model (model.init {init!r});"
                f" only compute knobs may be set: {', '.join(ModelConfig._runtime)}"
            )
        if ignored:
            log.info("model.init %s: its config.json fixes the architecture; %s's %s ignored", init, source, ignored)
    try:
        _check_model_values(model_raw)
    except RecipeValueError as e:
        raise GenoctxError(f"{where(e.key)}: {e}") from None
    if init is not None:
        knobs = dict(model_raw)
        model_raw = {}
    try:
        model = _build_model(preset_name, model_raw)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise GenoctxError(f"{_blame_model(e, origins, source, file_raw)}: model: {_msg(e)}") from None

    built = {}
    for name, cls in (("train", TrainConfig), ("data", DataConfig), ("loss", LossConfig)):
        try:
            built[name] = cls(**sections[name])
        except RecipeValueError as e:
            raise GenoctxError(f"{where(e.key)}: {e}") from None
    return Recipe(model=model, preset=preset_name, init=init, model_knobs=knobs, **built)


def _ignore_file_architecture(preset_name: str | None, model_raw: dict,
                              origins: dict[str, str]) -> tuple[str | None, str | None]:  # fmt: skip
    """``--init`` given on the command line over a recipe file that names a preset (and perhaps architecture keys):
    the user means the base (its config.json fixes the architecture), so the file's ``model.preset`` and its
    architecture keys are dropped from ``model_raw`` (in place); its compute knobs stay. A preset or an architecture
    key given by ``--set`` is the user's own clash and is left for the caller to refuse.

    Returns:
        the preset still to check (None, or the one a ``--set model.preset`` gave) and what was dropped, for the
        caller's one log line (``"model.preset tiny"``, ``"model.preset X and 13 architecture keys (a, b, c, ...)"``),
        or None.
    """
    if "model.preset" in origins:
        return preset_name, None
    arch = sorted(k for k in model_raw if k not in ModelConfig._runtime and f"model.{k}" not in origins)
    for k in arch:
        del model_raw[k]
    what = [f"model.preset {preset_name}"] if preset_name is not None else []
    if arch:
        names = ", ".join(arch[:3]) + (", ..." if len(arch) > 3 else "")
        what.append(f"{len(arch)} architecture key{'s' * (len(arch) > 1)} ({names})")
    return None, " and ".join(what) or None


def _check_model_values(model_raw: dict) -> None:
    """Convert and check each model value in place: its type, integers in 1..2**31 - 1 (from 0 for a few;
    ``vocab_size`` from the 8 nucleotide tokens) and numbers >= 0 (but ``linear_lower_bound``)."""
    for name, value in list(model_raw.items()):
        key = f"model.{name}"
        value = model_raw[name] = _check_value(key, value, _HINTS[ModelConfig][name])
        if isinstance(value, int) and not isinstance(value, bool):
            lo = 0 if name in _MODEL_MAY_BE_ZERO else 1
            if not lo <= value < 2**31:
                _bad(key, f"must be in {lo}..2**31 - 1", value)
            if name == "vocab_size" and value < len(VOCAB):
                _bad(key, f"must be >= {len(VOCAB)} (the nucleotide tokens {', '.join(VOCAB)})", value)
        elif isinstance(value, float) and name not in _MODEL_MAY_BE_NEGATIVE and value < 0:
            _bad(key, "must be >= 0", value)


def _msg(e: Exception) -> str:
    return " ".join(str(e.args[0] if e.args else e).split())


def _build_model(preset_name: str | None, model_raw: dict) -> ModelConfig:
    if preset_name is not None:
        return preset(preset_name, **model_raw)
    return ModelConfig.from_dict(model_raw)


def _blame_model(err: Exception, origins: dict[str, str], source: str, file_raw: dict | None) -> str:
    """Who gave an inconsistent model: the file when no ``--set`` touched the model or the file alone fails too;
    else the model ``--set`` items whose key the message names (all of them when it names none)."""
    sets = {k: v for k, v in origins.items() if k.startswith("model.")}
    if not sets:
        return source
    if file_raw is not None:
        try:
            file_model = dict(file_raw.get("model") or {})
            name = file_model.pop("preset", None)
            _check_model_values(file_model)
            _build_model(name, file_model)
        except Exception:  # noqa: BLE001 - the file alone is inconsistent too: the file is to blame
            return source
    msg = _msg(err)
    named = [v for k, v in sets.items() if k.split(".", 1)[1] in msg]
    return " ".join(named or sets.values())


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> Recipe:
    """Load a YAML recipe (or the defaults when ``path`` is None) and apply ``--set`` overrides.

    Raises:
        GenoctxError: missing file, invalid YAML, unknown keys, bad values; the message names the recipe file
            or the ``--set`` item that gave the culprit.
    """
    raw: dict = {}
    source = "<defaults>"
    if path is not None:
        p = Path(path)
        source = str(p)
        if p.is_dir():
            raise GenoctxError(f"recipe {p} is a directory; give a YAML file such as recipes/tiny.yaml")
        if not p.is_file():
            raise GenoctxError(f"recipe not found: {p}")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            line = getattr(getattr(e, "problem_mark", None), "line", None)
            where = f" line {line + 1}" if line is not None else ""
            raise GenoctxError(f"{p}:{where} invalid YAML") from None
        except (OSError, UnicodeDecodeError) as e:
            raise GenoctxError(f"{p}: unreadable recipe: {e}") from None
        if not isinstance(raw, dict):
            raise GenoctxError(f"{p}: a recipe must be a mapping with 'model' and 'train' sections")
    merged, origins = _apply(raw, overrides or [], source)
    return _build(merged, source, origins, raw)
