"""Scoring windows: per-position losses of any chunk-contract model, summed per window, bin and view; and what a
checkpoint is (its architecture, token map and loss vocabulary) for building its model anywhere.

Shared by the one-process evaluation (``genoctx.eval.position``) and the evaluation on the training mesh
(``genoctx.eval.distributed``, where each rank sums only the positions it scored): the same per-window sums
(``window_sums``) and views (``views_of``) in both, so the statistics computed from them are the same code.

Any object with the chunk contract ``model(inputs [B, T], cache) -> (logits [B, T, V], cache)`` can be scored.
Views: ``"{strand}/{mask}"`` with strand in forward, reverse, both and mask in all, softmasked, unmasked;
``"forward/all"`` is the main result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..data.dataset import WindowDataset, scored_mask
from ..data.tokenizer import BOS, PAD, VOCAB, reverse_complement
from ..model.model import shift_inputs, token_losses
from ..progress import bar
from ..train.checkpoint import load_model, resolve_checkpoint
from .copyprobe import TailScoreFn
from .markov import MarkovModel

log = logging.getLogger("genoctx.eval")

STRANDS = ("forward", "reverse", "both")
MASKS = ("all", "softmasked", "unmasked")
MAIN_VIEW = "forward/all"
CHUNK_PROGRESS_TOKENS = 65536  # a window (or tail) longer than this reports its chunks' progress (genoctx.progress)


# The precision of evaluation on a device type: the autocast dtype of every forward (None: fp32, no autocast). On a
# mesh FSDP2 also all-gathers the (fp32 master) parameters in it; the fp32 islands stay fp32 either way. CUDA runs
# bf16, as training does and as the planner sizes it (genoctx.plan.plan_eval), in one process and on the mesh alike.
EVAL_DTYPES: dict[str, torch.dtype | None] = {"cuda": torch.bfloat16, "cpu": None}


@dataclass(frozen=True)
class EvalPrecision:
    """How a checkpoint's forwards run in evaluation (``eval_precision``), the same in one process
    (``model_scorer``) and on the mesh (``genoctx.eval.distributed``).

    Attributes:
        device_type: ``"cuda"`` or ``"cpu"``.
        dtype: the autocast dtype (``torch.bfloat16``) or None (fp32, no autocast); on a mesh also FSDP2's
            ``param_dtype`` (``param_dtype``).
    """

    device_type: str
    dtype: torch.dtype | None = None

    @property
    def param_dtype(self) -> torch.dtype | None:
        """FSDP2's ``MixedPrecisionPolicy.param_dtype`` on a mesh (None keeps fp32)."""
        return self.dtype

    def autocast(self):
        """A fresh context for one forward: ``torch.autocast`` in ``dtype`` without its weight-cast cache (nothing
        is reused by a backward, and the cache would keep a low-precision copy of every weight it casts), or a
        no-op for fp32."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype, cache_enabled=False)

    def describe(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} autocast" if self.dtype is not None else "fp32"


def eval_precision(device: str | torch.device) -> EvalPrecision:
    """The ``EvalPrecision`` of evaluating on ``device`` (``EVAL_DTYPES`` of its type): the one decision of eval's
    precision, called by one-process scoring and by every rank of the mesh."""
    kind = torch.device(device).type
    return EvalPrecision(kind, EVAL_DTYPES.get(kind))


@torch.no_grad()
def position_losses(model, tokens: torch.Tensor, chunk_tokens: int | None = None) -> torch.Tensor:
    """Per-position next-token loss of one batch of windows, in nats, 0 where not scored.

    Args:
        model: any object with the chunk contract ``model(inputs [B, T] int64, cache) -> (logits [B, T, V],
            cache)`` (``HybridLM`` in eval mode; a plain object with ``forward`` works too). The first call
            gets ``cache=None``.
        tokens: [B, W] int64 window bases.
        chunk_tokens: feed the window in consecutive chunks of this many tokens with the carried cache
            (bounded memory); None = one pass.

    Returns:
        [B, W] float64 losses (nats).
    """
    forward = model if callable(model) else model.forward
    return _chunk_losses(forward, tokens, 0, tokens.shape[1], chunk_tokens, None)[0]


def _chunk_losses(forward, tokens: torch.Tensor, start: int, end: int, chunk_tokens: int | None, cache):
    """Losses [B, end - start] float64 of positions ``[start, end)`` of ``tokens`` [B, W] (each predicted from the
    tokens before it), fed in chunks of ``chunk_tokens`` after ``cache`` (the cache of positions ``[0, start)``;
    None when ``start == 0``) -> (losses, the cache of ``[0, end)``)."""
    inputs = shift_inputs(tokens, BOS)
    scored = scored_mask(tokens)
    step = chunk_tokens or (end - start)
    out = []
    # progress (genoctx.progress) of the chunks of a long window; lines only when it takes longer than the interval
    label = f"window chunks ({end - start:,} tokens)"
    with bar(label, -(-(end - start) // step), "chunks") if end - start > CHUNK_PROGRESS_TOKENS else nullcontext() as p:
        for s in range(start, end, step):
            e = min(s + step, end)
            logits, cache = forward(inputs[:, s:e], cache)
            out.append(
                token_losses(
                    logits.float() if logits.dtype == torch.float16 else logits, tokens[:, s:e], scored[:, s:e]
                ).double()
            )
            if p is not None:
                p.advance(tokens=(e - s) * tokens.shape[0])
    return torch.cat(out, dim=1), cache


@dataclass
class BinnedLoss:
    """Per-window, per-bin sums: ``loss_sum`` [windows, bins] float64 nats, ``count`` [windows, bins] int64."""

    edges: list[int]
    loss_sum: np.ndarray
    count: np.ndarray

    def bins(self) -> list[dict]:
        s, c = self.loss_sum.sum(0), self.count.sum(0)
        return [
            {
                "start": self.edges[i],
                "end": self.edges[i + 1],
                "tokens": int(c[i]),
                "loss": float(s[i] / c[i]) if c[i] else None,
            }
            for i in range(len(c))
        ]

    def overall(self) -> dict:
        s, c = float(self.loss_sum.sum()), int(self.count.sum())
        return {"tokens": c, "loss": s / c if c else None}

    def __add__(self, other: BinnedLoss) -> BinnedLoss:
        return BinnedLoss(self.edges, self.loss_sum + other.loss_sum, self.count + other.count)


def view_names(reverse: bool = False, softmask: bool = False) -> list[str]:
    """The views an evaluation reports, main view first: ``"{strand}/{mask}"``."""
    strands = list(STRANDS) if reverse else ["forward"]
    masks = list(MASKS) if softmask else ["all"]
    return [f"{s}/{m}" for s in strands for m in masks]


def rc_window(tokens: np.ndarray, softmask: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Reverse-complement strand of a window whose first ``length`` entries are bases (the rest PAD).

    tokens int [W], softmask bool [W] -> (int64 [W], bool [W]); padding stays at the end, so position p of
    the result is predicted from the p bases before it on that strand.
    """
    t = np.full(tokens.shape[0], PAD, dtype=np.int64)
    m = np.zeros(tokens.shape[0], dtype=bool)
    t[:length] = reverse_complement(np.asarray(tokens[:length]).astype(np.uint8)).astype(np.int64)
    m[:length] = np.asarray(softmask[:length])[::-1]
    return t, m


ScoreFn = Callable[[np.ndarray], np.ndarray]
"""Scores one window: int64 [W] token ids -> float64 [W] loss in nats (0 where not scored)."""


def model_scorer(model, chunk_tokens: int | None = None, device: str | torch.device = "cpu") -> ScoreFn:
    """A :data:`ScoreFn` for a chunk-contract model (see :func:`position_losses`), its forwards in the precision of
    ``device`` (``eval_precision``: bf16 autocast on CUDA, as on the mesh)."""
    if hasattr(model, "eval"):
        model.eval()
    precision = eval_precision(device)

    def score(tokens: np.ndarray) -> np.ndarray:
        t = torch.as_tensor(tokens, dtype=torch.long)[None].to(device)
        with precision.autocast():
            return position_losses(model, t, chunk_tokens)[0].cpu().numpy()

    return score


def model_tail_scorer(model, chunk_tokens: int | None = None, device: str | torch.device = "cpu") -> TailScoreFn:
    """A :data:`genoctx.eval.copyprobe.TailScoreFn` for a chunk-contract model: the prefix ``[0, dst)`` is run once
    and every tail (the unedited one, then each edit) continues from its cache, as ``position_losses`` would score
    the whole edited window (the chunk contract: a chunk after the cache of the positions before it). For the copy
    probe this costs one window plus ``len(tails)`` tails instead of ``1 + len(tails)`` windows. The cache must not
    be changed by the forward that reads it (genoctx's layers build new caches). Forwards in the precision of
    ``device`` (``eval_precision``), as ``model_scorer``'s."""
    if hasattr(model, "eval"):
        model.eval()
    forward = model if callable(model) else model.forward
    precision = eval_precision(device)

    @torch.no_grad()
    def score_tails(tokens: np.ndarray, dst: int, tails: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        with precision.autocast():
            return _score_tails(tokens, dst, tails)

    def _score_tails(tokens: np.ndarray, dst: int, tails: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        t = torch.as_tensor(tokens, dtype=torch.long)[None].to(device)
        W = t.shape[1]
        prefix, cache = _chunk_losses(forward, t, 0, dst, chunk_tokens, None)
        out = []
        for tail in [tokens[dst:], *tails]:
            edited = t.clone()
            edited[0, dst:] = torch.as_tensor(tail, dtype=torch.long, device=t.device)
            out.append(_chunk_losses(forward, edited, dst, W, chunk_tokens, cache)[0][0].cpu().numpy())
        return np.concatenate([prefix[0].cpu().numpy(), out[0]]), out[1:]

    return score_tails


def markov_scorer(markov: MarkovModel) -> ScoreFn:
    """A :data:`ScoreFn` for a fitted :class:`MarkovModel`."""
    return markov.token_losses


def view_parts(views: list[str]) -> tuple[list[str], list[str]]:
    """The strands and masks a list of views needs scored: ``(["forward", "reverse"?], masks in MASKS order)``."""
    strands = ["forward"] + (["reverse"] if any(v.split("/")[0] in ("reverse", "both") for v in views) else [])
    masks = sorted({v.split("/")[1] for v in views}, key=MASKS.index)
    return strands, masks


def window_strands(item: dict, strands: list[str]):
    """``(strand, tokens int64 [W], softmask bool [W])`` of one window (``WindowDataset`` item) per strand asked for:
    forward as stored, reverse its reverse complement (``rc_window``)."""
    tokens, soft = item["tokens"].numpy(), item["softmask"].numpy()
    for strand in strands:
        if strand == "reverse":
            tokens, soft = rc_window(tokens, soft, item["end"] - item["start"])
        yield strand, tokens, soft


def window_sums(
    losses: np.ndarray,
    tokens: np.ndarray,
    soft: np.ndarray,
    bin_of: np.ndarray,
    nb: int,
    masks: list[str],
    mine: np.ndarray | None = None,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """One window's sums per bin and mask: ``{mask: (loss sum float64 [nb] nats, scored count int64 [nb])}``.

    Args:
        losses: float64 [W] token losses (nats; any value where not scored).
        tokens, soft: the window's ids int [W] and soft-mask bool [W]; A/C/G/T (ids 0-3) are scored.
        bin_of: int [W] the bin of each position (``np.searchsorted`` of the inner edges).
        mine: bool [W], the positions this process scored (a context-parallel rank's pieces); None = all.
    """
    scored = (tokens >= 0) & (tokens <= 3)
    if mine is not None:
        scored &= mine
    out = {}
    for mask in masks:
        sel = scored if mask == "all" else scored & (soft if mask == "softmasked" else ~soft)
        b = bin_of[sel]
        out[mask] = (np.bincount(b, weights=losses[sel], minlength=nb), np.bincount(b, minlength=nb))
    return out


def views_of(sums: dict, cnts: dict, views: list[str], edges: list[int]) -> dict[str, BinnedLoss]:
    """``{view: BinnedLoss}`` from per-(strand, mask) arrays ``[windows, bins]`` (``both/*``: forward + reverse)."""
    out = {}
    for v in views:
        strand, mask = v.split("/")
        if strand == "both":
            out[v] = BinnedLoss(edges, sums["forward", mask], cnts["forward", mask]) + BinnedLoss(
                edges, sums["reverse", mask], cnts["reverse", mask]
            )
        else:
            out[v] = BinnedLoss(edges, sums[strand, mask], cnts[strand, mask])
    return out


def score_windows(
    score: ScoreFn,
    ds: WindowDataset,
    edges: list[int],
    max_windows: int | None = None,
    views: list[str] | None = None,
    label: str = "eval",
) -> dict[str, BinnedLoss]:
    """Score the windows of ``ds`` (or the first ``max_windows``) and sum losses per window, bin and view.

    Args:
        score: window scorer (:func:`model_scorer`, :func:`markov_scorer`).
        ds: the windows; ``ds[i]`` gives ``tokens`` [W], ``softmask`` [W], ``start``/``end``.
        edges: bin edges in tokens of context (:func:`parse_bins`).
        views: names from :func:`view_names`; default the main view only.
        label: the progress bar's name (``genoctx.progress``: windows scored, tokens/s; shown on a terminal only).

    Returns:
        ``{view: BinnedLoss}`` with arrays [windows, bins]; ``both/*`` views are forward + reverse sums.
    """
    views = views or [MAIN_VIEW]
    n = len(ds) if max_windows is None else min(len(ds), max_windows)
    nb = len(edges) - 1
    strands, masks = view_parts(views)
    sums = {(s, m): np.zeros((n, nb)) for s in strands for m in masks}
    cnts = {(s, m): np.zeros((n, nb), dtype=np.int64) for s in strands for m in masks}
    bin_of = np.searchsorted(np.asarray(edges[1:-1]), np.arange(ds.window), side="right")
    with bar(label, n, "windows") as progress:
        for i in range(n):
            scored = 0
            for strand, tokens, soft in window_strands(ds[i], strands):
                losses = np.asarray(score(tokens), dtype=np.float64)
                scored += len(tokens)
                for mask, (s_, c_) in window_sums(losses, tokens, soft, bin_of, nb, masks).items():
                    sums[strand, mask][i], cnts[strand, mask][i] = s_, c_
            log.debug("window %d/%d scored", i + 1, n)
            progress.advance(tokens=scored)
    return views_of(sums, cnts, views, edges)


def binned_losses(
    model,
    ds: WindowDataset,
    edges: list[int],
    chunk_tokens: int | None = None,
    max_windows: int | None = None,
    device: str | torch.device = "cpu",
) -> BinnedLoss:
    """Score every window of ``ds`` (or the first ``max_windows``) with a chunk-contract ``model`` and sum
    losses into position bins (forward strand, all scored bases)."""
    return score_windows(model_scorer(model, chunk_tokens, device), ds, edges, max_windows)[MAIN_VIEW]


@dataclass(frozen=True)
class EvalCheckpoint:
    """What evaluation needs to build a checkpoint's model, in one process or on every rank of a mesh, read from its
    small files only (recipe.yaml and state.json, or config.json and tokenizer.json): no tensor is read.

    Attributes:
        path: the checkpoint directory (``resolve_checkpoint``: a run's latest) or HF model directory.
        kind: ``"genoctx"`` (one-process safetensors or DCP shards) or ``"hf"``.
        cfg: the architecture (a run's recipe model with its compute knobs; an HF directory's config.json).
        token_map: genoctx id -> the model's id for a model with a text vocabulary; None for the 8 nucleotide ids.
        loss_vocab: ``full`` or ``nucleotide`` with a token map (``genoctx.model.vocab``), else None.
        head_chunk_tokens: tokens per logits chunk of the text-vocabulary head (``loss.chunk_tokens``).
        lora: a LoRA run's adapters (``genoctx.model.lora.LoRASpec`` of its recipe: built with the model and read
            from the checkpoint), else None.
    """

    path: Path
    kind: str
    cfg: object
    token_map: object | None = None
    loss_vocab: str | None = None
    head_chunk_tokens: int = 2048
    lora: object | None = None


def eval_checkpoint(path: str | Path, loss_vocab: str | None = None) -> EvalCheckpoint:
    """The ``EvalCheckpoint`` of a genoctx checkpoint (or run directory: its latest) or an HF model directory.

    The token map is the run's (state.json) or, for an HF directory with a text vocabulary, built from its
    tokenizer.json; the loss vocabulary is ``loss_vocab`` when given, else the run's ``loss.vocab``, else ``full``.

    Raises:
        GenoctxError: no such checkpoint, an unreadable recipe/state/config, a text vocabulary without a usable
            tokenizer.json.
    """
    from ..model.hf import read_config
    from ..model.vocab import TokenMap
    from ..train.checkpoint import load_recipe_of, read_state

    ck = resolve_checkpoint(path)
    if not _is_hf(ck):
        recipe, state = load_recipe_of(ck), read_state(ck)
        token_map = TokenMap.from_dict(state["token_map"]) if state.get("token_map") else None
        if token_map is not None and token_map.is_identity:
            token_map = None
        vocab = (loss_vocab or state.get("loss_vocab") or recipe.loss.vocab) if token_map is not None else None
        from ..train.loop import lora_spec

        return EvalCheckpoint(ck, "genoctx", recipe.model, token_map, vocab, recipe.loss.chunk_tokens,
                              lora_spec(recipe))  # fmt: skip
    token_map = _hf_token_map(ck)
    cfg, _ = read_config(ck)
    return EvalCheckpoint(ck, "hf", cfg, token_map, (loss_vocab or "full") if token_map is not None else None)


def with_head(model, spec: EvalCheckpoint):
    """``model`` in eval mode with the chunk contract over genoctx's ids: as is for a nucleotide model, else read
    through its token map (``genoctx.model.vocab.MappedLM`` with a ``VocabHead`` of ``spec.loss_vocab``)."""
    from ..model.vocab import MappedLM, VocabHead

    if spec.token_map is None:
        return model.eval()
    return MappedLM(model, VocabHead(spec.token_map, spec.loss_vocab, spec.head_chunk_tokens)).eval()


def load_eval_model(path: str | Path, device: str | torch.device = "cpu", loss_vocab: str | None = None):
    """The model of a genoctx checkpoint (or run directory: its latest checkpoint) or of an HF model directory
    (``config.json`` + safetensors: ``genoctx.model.load_hf``), on ``device``, in eval mode, with the chunk contract
    of :func:`position_losses` over genoctx's ids (:func:`eval_checkpoint`, :func:`with_head`). An HF model is
    loaded in fp32 on the CPU and in the checkpoint's dtype elsewhere; a genoctx checkpoint in fp32.

    Raises:
        GenoctxError: no such checkpoint, unreadable files, a text vocabulary without a usable tokenizer.json.
    """
    from ..model.hf import load_hf

    spec = eval_checkpoint(path, loss_vocab)
    if spec.kind == "genoctx":
        model, _, _ = load_model(spec.path, device)
    else:
        dtype = torch.float32 if torch.device(device).type == "cpu" else None
        model = load_hf(spec.path, dtype=dtype).to(device)
    return with_head(model, spec)


def loss_vocab_of(model) -> str | None:
    """``full`` or ``nucleotide`` for a model read through a token map (``load_eval_model``), None for a model of
    the 8 nucleotide tokens."""
    head = getattr(model, "head", None)
    return getattr(head, "vocab", None)


def _is_hf(ck: Path) -> bool:
    from ..model.hf import is_hf_dir

    return is_hf_dir(ck) and not (ck / "state.json").is_file()


def _hf_token_map(ck: Path):
    """The token map of an HF model directory with a text vocabulary (from its tokenizer.json); None for a genoctx
    checkpoint or a nucleotide model. Reads config.json and tokenizer files only.

    Raises:
        GenoctxError: an unreadable config.json, or a text vocabulary without a usable tokenizer.json.
    """
    from ..model.hf import read_config
    from ..model.vocab import build_token_map

    if not _is_hf(ck):
        return None
    cfg, _ = read_config(ck)
    if cfg.vocab_size == len(VOCAB):
        return None
    return build_token_map(ck / "tokenizer.json", cfg.vocab_size)
