"""DNA in a pretrained base's own vocabulary: the token map and the two loss vocabularies.

Prepared shards hold genoctx's nucleotide ids (``genoctx.data.tokenizer.VOCAB``: A C G T N <pad> <bos> <eos>,
soft-masking in a separate channel). A model trained from scratch has exactly these 8 tokens. A pretrained text
base (GLM-5.3-Flash: 154,880 tokens) reads them through a ``TokenMap``: the ids of its single-character tokens
``A``, ``C``, ``G``, ``T``, ``N`` (looked up in its ``tokenizer.json`` with the ``tokenizers`` library) and of the
token that starts each window (``data.window_start_token``; default: the tokenizer's ``bos_token``, else its
``eos_token`` -- for GLM ``<|endoftext|>``, the boundary between pretraining documents), which also stands for
``<pad>`` and ``<eos>`` (never scored).

Two loss vocabularies (``loss.vocab``):

- ``full`` (the default for a text base): the next-token softmax over the base's whole vocabulary, as the base was
  trained; a base is scored in nats (and bits) per base, where probability given to non-DNA tokens is lost. The
  head and cross-entropy run in chunks of ``loss.chunk_tokens`` tokens (``genoctx.model.head.head_token_losses``):
  never ``[L, V]`` logits.
- ``nucleotide``: the softmax restricted to the rows of A, C, G, T, N: a different objective (a 5-way
  classifier that ignores the other 154,875 rows), cheaper, with a lower loss than ``full`` for the same weights.
  Eval's JSON records which one was used (``loss_vocab``).

For evaluation a mapped model is a callable with the chunk contract of ``genoctx.eval.position``: it returns
log-probabilities over genoctx's 8 ids, in which ``<eos>`` holds the mass of every base token that is not A, C,
G, T or N (``full``) so that the 8-way cross-entropy of a base equals the full-vocabulary one exactly.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from ..data.tokenizer import BOS, EOS, PAD, VOCAB
from ..errors import GenoctxError

LOSS_VOCABS = ("full", "nucleotide")
BASES = "ACGTN"  # genoctx ids 0..4, the mapped rows of the nucleotide vocabulary
_NEG = -1.0e30  # a log-probability for impossible ids: exp() is 0, and 0 x it is 0 (never -inf x 0 = NaN)


@dataclass(frozen=True)
class TokenMap:
    """Base-vocabulary id of each genoctx token, in ``VOCAB`` order (A C G T N <pad> <bos> <eos>).

    ``window_start_token`` is the base token that ``<bos>`` (and ``<pad>``, ``<eos>``) map to; ``tokenizer`` and
    ``tokenizer_sha256`` say where the map came from. The identity map (a nucleotide model) has no tokenizer.
    """

    ids: tuple[int, ...]
    window_start_token: str | None = None
    tokenizer: str | None = None
    tokenizer_sha256: str | None = None

    @classmethod
    def identity(cls) -> TokenMap:
        return cls(tuple(range(len(VOCAB))))

    @property
    def is_identity(self) -> bool:
        return self.ids == tuple(range(len(VOCAB)))

    def to_dict(self) -> dict:
        return {**asdict(self), "ids": list(self.ids), "tokens": list(VOCAB)}

    @classmethod
    def from_dict(cls, d: dict) -> TokenMap:
        """Raises: GenoctxError: not a token map of ``len(VOCAB)`` integer ids."""
        ids = d.get("ids") if isinstance(d, dict) else None
        if not isinstance(ids, list) or len(ids) != len(VOCAB) or not all(isinstance(i, int) for i in ids):
            raise GenoctxError(
                f"token_map: expected {len(VOCAB)} integer ids (one per {', '.join(VOCAB)}), got {ids!r}"
            )
        return cls(tuple(ids), d.get("window_start_token"), d.get("tokenizer"), d.get("tokenizer_sha256"))


def build_token_map(tokenizer_json: Path, vocab_size: int, window_start_token: str | None = None) -> TokenMap:
    """The token map of a base from its ``tokenizer.json`` (and ``tokenizer_config.json`` beside it, for the
    default window-start token).

    Args:
        tokenizer_json: the base's ``tokenizer.json`` (Hugging Face ``tokenizers`` format).
        vocab_size: the base model's vocabulary size (every mapped id must be below it).
        window_start_token: the token that starts each window; None = ``bos_token`` of tokenizer_config.json, else
            its ``eos_token``.

    Raises:
        GenoctxError: a missing or unreadable tokenizer file, no single-character token for one of A C G T N, no
            window-start token (none given and none in tokenizer_config.json), or an id beyond ``vocab_size``; the
            file (or ``data.window_start_token``) is named.
    """
    from tokenizers import Tokenizer

    path = Path(tokenizer_json)
    if not path.is_file():
        raise GenoctxError(f"{path}: no tokenizer.json (a base with a text vocabulary needs it to map A C G T N)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 -- the tokenizers library raises its own Exception subclass
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GenoctxError(f"{path}: not a readable tokenizers file ({first})") from None
    ids = []
    for ch in BASES:
        i = tok.token_to_id(ch)
        if i is None or tok.decode([i]) != ch:
            raise GenoctxError(f"{path}: no single-character token for {ch!r}: cannot read DNA base by base")
        ids.append(i)
    where = "data.window_start_token"
    if window_start_token is None:
        window_start_token, where = _default_window_start(path.parent / "tokenizer_config.json")
    start = tok.token_to_id(window_start_token)
    if start is None:
        raise GenoctxError(f"{where}: {window_start_token!r} is not a token of {path}")
    ids += [start, start, start]  # <pad>, <bos>, <eos>
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise GenoctxError(f"{path}: token id {bad[0]} is beyond the model's vocab_size {vocab_size}")
    assert len(ids) == len(VOCAB) and (PAD, BOS, EOS) == (5, 6, 7)
    return TokenMap(tuple(ids), window_start_token, str(path), hashlib.sha256(path.read_bytes()).hexdigest())


def _default_window_start(config: Path) -> tuple[str, str]:
    """``bos_token``, else ``eos_token``, of tokenizer_config.json (a string or ``{"content": ...}``)."""
    raw = {}
    if config.is_file():
        try:
            raw = json.loads(config.read_text())
        except (OSError, ValueError) as e:
            raise GenoctxError(f"{config}: not readable JSON ({e})") from None
    for key in ("bos_token", "eos_token"):
        v = raw.get(key) if isinstance(raw, dict) else None
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str) and v:
            return v, f"{config} {key}"
    raise GenoctxError(
        f"{config}: no bos_token or eos_token to start windows with; set data.window_start_token (e.g. --set "
        "data.window_start_token='<|endoftext|>')"
    )


class VocabHead:
    """How a model with a ``TokenMap`` is fed and scored: inputs mapped to base ids, the loss over the ``full``
    vocabulary or the ``nucleotide`` rows, in chunks of ``chunk_tokens`` tokens.

    Args:
        token_map: genoctx id -> base id.
        vocab: ``full`` or ``nucleotide`` (module docstring).
        chunk_tokens: tokens per chunk of logits (``head_token_losses``).

    Raises:
        GenoctxError: an unknown ``vocab``.
    """

    def __init__(self, token_map: TokenMap, vocab: str = "full", chunk_tokens: int = 2048):
        if vocab not in LOSS_VOCABS:
            raise GenoctxError(f"loss.vocab must be one of {', '.join(LOSS_VOCABS)}, got {vocab!r}")
        self.token_map, self.vocab, self.chunk_tokens = token_map, vocab, chunk_tokens
        self._ids = torch.tensor(token_map.ids, dtype=torch.long)
        self._ids_on: dict[torch.device, torch.Tensor] = {}

    def _ids_at(self, device: torch.device) -> torch.Tensor:
        """The id map on ``device``, copied there once (a host -> device copy per call would be a sync per chunk)."""
        ids = self._ids_on.get(device)
        if ids is None:
            ids = self._ids_on[device] = self._ids.to(device)
        return ids

    def map_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """genoctx ids [B, T] int64 -> base ids [B, T] int64."""
        return self._ids_at(tokens.device)[tokens]

    def token_losses(self, model, inputs: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy (nats, fp32, 0 where not scored, differentiable) of genoctx ``targets`` [B, T]
        given genoctx ``inputs`` [B, T] (``<bos>``-shifted), through ``model.hidden`` and the chunked head."""
        return self.token_losses_cached(model, inputs, targets, scored)[0]

    def token_losses_cached(self, model, inputs: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor, cache=None):
        """``token_losses`` of one chunk of a sequence under the chunk contract: ``cache`` is what the previous chunk
        returned (None at the start). Returns (losses [B, T] fp32 nats, the cache for the next chunk)."""
        from .head import head_token_losses

        h, cache = model.hidden(self.map_ids(inputs), cache)
        B, T, D = h.shape
        weight = model.lm_head.weight
        flat_scored = scored.reshape(-1)
        if self.vocab == "full":
            tgt = self.map_ids(targets).reshape(-1)
            rows = None
        else:  # targets index the rows A C G T N (unscored ids are clamped in range; their loss is masked)
            tgt = targets.reshape(-1).clamp(max=len(BASES) - 1)
            rows = self._ids_at(h.device)[: len(BASES)]
        # ids in range by construction (the token map was checked against vocab_size): no value check, no host read
        losses = head_token_losses(
            h.reshape(B * T, D), weight, tgt, flat_scored, self.chunk_tokens, rows=rows, check_values=False
        )
        return losses.view(B, T), cache

    @torch.no_grad()
    def log_probs(self, model, inputs: torch.Tensor, cache=None):
        """The chunk contract of ``genoctx.eval.position``: genoctx ``inputs`` [B, T] -> (log-probabilities [B, T, 8]
        fp32 over genoctx's ids, the cache). ``full``: A C G T N get their full-vocabulary log-probabilities and
        ``<eos>`` the rest of the mass; ``nucleotide``: the 5-way softmax. Logits are computed ``chunk_tokens``
        tokens at a time, outside autocast (the model's hidden states may come from a bf16 autocast forward): the
        ``full`` product in the weight's dtype, the ``nucleotide`` one in fp32."""
        h, cache = model.hidden(self.map_ids(inputs), cache)
        B, T, D = h.shape
        h = h.reshape(B * T, D)
        weight = model.lm_head.weight
        rows = self._ids_at(h.device)[: len(BASES)]
        out = torch.full((B * T, len(VOCAB)), _NEG, dtype=torch.float32, device=h.device)
        # the head's own precision, not autocast's (which would run both products in bf16 under a bf16 forward), as
        # genoctx.model.head's: the full vocabulary in the weight's dtype, the 5 nucleotide rows in fp32
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, B * T, self.chunk_tokens):
                hs = h[s : s + self.chunk_tokens].float()
                if self.vocab == "full":
                    logits = (hs.to(weight.dtype) @ weight.t()).float()  # [chunk, V] in the weight's dtype, then fp32
                    lp = logits[:, rows] - torch.logsumexp(logits, dim=-1, keepdim=True)
                    rest = torch.log1p(-torch.exp(torch.logsumexp(lp, dim=-1)).clamp(max=1.0))
                    out[s : s + len(hs), EOS] = rest.clamp(min=_NEG)  # <eos>: every other token of the base
                else:
                    lp = torch.log_softmax(hs @ weight[rows].float().t(), dim=-1)
                out[s : s + len(hs), : len(BASES)] = lp
        return out.view(B, T, len(VOCAB)), cache


class MappedLM(nn.Module):
    """A model read through a ``VocabHead``, with the chunk contract ``(inputs [B, T], cache) -> (log-probs
    [B, T, 8], cache)`` of ``genoctx.eval.position`` (genoctx ids in and out)."""

    def __init__(self, model: nn.Module, head: VocabHead):
        super().__init__()
        self.model, self.head = model, head

    def forward(self, inputs: torch.Tensor, cache=None):
        return self.head.log_probs(self.model, inputs, cache)
