"""The fp32 islands of mixed-precision training, named, and a switchable record of the dtypes they ran in.

Under bf16 autocast (``train.dtype: bf16``; the parameters stay fp32 masters) the matmuls of the projections, experts
and head run in bf16. A few computations must not: their values are sums over many terms, exponentials, or
discrete choices that a 2^-8 rounding would change. Each one is computed in fp32 (fp64 for an fp64 model), with
autocast disabled wherever autocast would lower it (CPU and CUDA autocast differ: CPU autocast runs softmax and
LayerNorm in bf16), and each marks its tensor with ``island(name, t)``; ``ISLANDS`` names them all, with where
they are. The gradients handed back from chunk to chunk by the chunked backward (``genoctx.train.chunked``) that
sum the contributions of every later chunk are islands too: a bf16 sum would round once per chunk.

``island`` costs one global read when nothing records. ``record_islands()`` (tests) collects, for each name, the
set of dtypes its tensors had, forward and backward (recomputations included), so a test can assert that every
island ran, in fp32, during a real training step rather than by reading this code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

ISLANDS: dict[str, str] = {
    "norm.rms": "RMSNorm's normalisation (norms.RMSNorm: the pre-norms, the q/kv LoRA norms, the final norm)",
    "norm.gated": "KDA's gated output norm (kda.GatedRMSNorm)",
    "norm.indexer_k": "the indexer's key LayerNorm (dsa.Indexer.keys)",
    "mhc.coeffs": "the mHC coefficients pre, post and comb, Sinkhorn included (hyper.HyperConnection.coefficients)",
    "moe.router.scores": "the router's sigmoid affinities (moe.TopkRouter)",
    "moe.router.topk": "the biased affinities the (group-limited) top-k of experts runs on (moe.TopkRouter.select)",
    "moe.router.weights": "the top-k combine weights",
    "moe.combine": "the routed experts' outputs weighted and summed over a token's slots (moe.Experts)",
    "kda.conv": "KDA's short convolution and SiLU",
    "kda.qk": "KDA's L2-normalised queries and keys",
    "kda.gate": "KDA's per-channel log decay g (kda.ForgetGate)",
    "kda.beta": "KDA's delta-rule write strength (the sigmoid of its logits)",
    "kda.state": "KDA's recurrent state after each block of chunk_kda (the core's compute dtype)",
    "dsa.indexer.pool": "the indexer's pooled keys (softmax over each pool's tokens)",
    "dsa.indexer.scores": "the indexer's scores: those the top-k of pools runs on (dsa.indexer_topk), the KL's logits",
    "dsa.indexer.kl": "the indexer KL: its target attention's scores and its log-softmax over the pools",
    "dsa.attn.lse": "sparse attention's softmax statistics: the per-row log-sum-exp saved for backward",
    "dsa.attn.dkv": "sparse attention's latent-gradient accumulator over query tiles (backward)",
    "loss.logits": "the logits the cross-entropy reads (model.token_losses; the head's bf16 matmul output upcast)",
    "loss.tokens": "the per-token losses",
    "loss.sum": "one pass's sum of token losses (genoctx.train.loop.forward_backward)",
    "loss.chunk_sum": "a chunk's sum of token losses (genoctx.train.chunked)",
    "loss.window_sum": "the window's sum of the chunks' sums (fp64)",
    "chunked.grad.KDACache.state": "the KDA state's gradient handed back across a chunk boundary",
    "chunked.grad.DSACache.latent": "the DSA latents' gradient handed back (sums every later chunk's)",
    "chunked.grad.DSACache.pool_k": "the pooled indexer keys' gradient handed back (sums every later chunk's)",
}
FP64_ISLANDS = ("loss.window_sum",)  # accumulators kept in fp64 whatever the model dtype

_RECORD: dict[str, set[torch.dtype]] | None = None  # a module global, not thread-local: autograd may use threads


def island(name: str, t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as (a value of) the fp32 island ``name`` and return it unchanged.

    Args:
        name: the island, a key of ``ISLANDS``, e.g. ``"moe.router.scores"``.
        t: the tensor the island computed (any shape).

    Returns:
        ``t`` itself. While ``record_islands()`` is active, ``t.dtype`` is added to the record under ``name``.
    """
    rec = _RECORD
    if rec is not None:
        rec.setdefault(name, set()).add(t.dtype)
    return t


@contextlib.contextmanager
def record_islands() -> Iterator[dict[str, set[torch.dtype]]]:
    """Record the dtypes of every ``island`` call inside the block.

    Yields:
        ``{island name: {dtypes seen}}``, filled while the block runs (backward passes inside it included).
        Nested use records into the innermost record only; the outer one resumes after it.
    """
    global _RECORD
    old, _RECORD = _RECORD, {}
    try:
        yield _RECORD
    finally:
        _RECORD = old
