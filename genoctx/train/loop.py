"""The training loop: train -> train_step -> forward_backward, with the loss arithmetic written out.

Loss normalisation: every window contributes (sum of per-token losses in nats, number of scored tokens);
the step's loss is the sum over its windows divided once by the total count. A window with no scored tokens
(all N) adds 0 to both, so it can never produce a NaN.

Data order is a pure function of (seed, step): sample k = step * batch_size + b is window
``perm(seed, epoch)[k mod N]`` of epoch ``k // N``, cropped (when ``seq_len`` is set) at an offset drawn
from ``numpy.random.default_rng([seed, k])``. A resumed run therefore sees exactly the windows an
uninterrupted one would have.

A run directory is continued, never redone: each attempt (a process, or a Ray worker group after a restart) loads
the newest complete checkpoint whose files verify (``genoctx.train.integrity``: a newer damaged one is skipped with a
warning and set aside), deletes the temporaries of a save that was killed, cuts ``metrics.jsonl`` back to
the loaded step (so it holds each step once) and records itself in ``RUN/events.jsonl``: a ``start`` line (attempt
number, step loaded, checkpoint, temporaries removed) and an ``end`` line (status, last step, optimizer steps this
attempt ran). Every metrics row names the attempt that computed it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import resource
import sys
import time
import uuid
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch

from ..data.dataset import WindowDataset, load_manifest, scored_mask
from ..data.tokenizer import BOS, VOCAB
from ..errors import GenoctxError
from ..model.fp8 import holders
from ..model.groups import GROUPS, LORA, group_of, parse_trainable
from ..model.host import read
from ..model.lora import LoRASpec, adapter_draws, is_lora_name
from ..model.model import HybridLM, shift_inputs, token_losses
from ..model.precision import island
from ..parallel.context import all_reduce_moe_loads, all_reduce_sum, shard_sequence
from ..parallel.fsdp import clip_grad_norm, reduce_gradients
from ..parallel.mesh import ParallelDims
from ..progress import bar
from ..recipes import Recipe, TrainConfig
from .checkpoint import (
    CKPT_DIR,
    HOLDS,
    TRAINABLE,
    base_of,
    check_base_chain,
    has_lora,
    latest_checkpoint,
    load_training_state,
    partial_record,
    read_state,
    remove_partial_checkpoints,
    save_checkpoint,
)
from .chunked import chunked_forward_backward
from .faults import maybe_kill
from .frozen import check_frozen_dtype, describe_fp8, frozen_fp8
from .init import base_source, describe, resolve_init, vocab_head
from .integrity import refuse_unverified, resume_choice, run_of, set_aside, skip_line
from .metrics import MetricsLog, check_loggers

log = logging.getLogger("genoctx.train")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: CUDA max allocated on GPU, the process's peak resident set size on CPU (bytes)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def lr_lambda(cfg: TrainConfig, total_steps: int):
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` at ``total_steps``."""

    def f(step: int) -> float:
        if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(1, total_steps - cfg.warmup_steps)
        t = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return f


def freeze_for_indexer_warmup(model: HybridLM) -> int:
    """The DSA indexer warm-up stage (DeepSeek-V3.2, stage 1): attention runs dense and every parameter but the
    lightning indexers' is frozen, so only the indexer KL loss against the dense attention distribution trains.

    Returns the number of parameters left trainable (0 when the stage is not ``warmup``: nothing is frozen).

    Raises:
        GenoctxError: ``indexer_stage: warmup`` without ``dsa_mode: dense`` (the warm-up fits the indexer to
            the dense distribution while the model attends densely), or a model with no DSA layer.
    """
    cfg = model.cfg
    if cfg.indexer_stage != "warmup":
        return 0
    if cfg.dsa_mode != "dense":
        raise GenoctxError(
            "model.indexer_stage=warmup needs model.dsa_mode=dense (DeepSeek-V3.2's warm-up attends densely "
            "and trains only the indexer); set both, then switch to indexer_stage=sparse, dsa_mode=sparse"
        )
    trainable = 0
    for name, p in model.named_parameters():
        p.requires_grad_(is_indexer_parameter(name))
        trainable += p.numel() if p.requires_grad else 0
    if trainable == 0:
        raise GenoctxError(
            "model.indexer_stage=warmup: the model has no DSA layer with a 'full' indexer "
            "(model.layer_types has no indexed_attention / 'D')"
        )
    return trainable


def is_indexer_parameter(name: str) -> bool:
    """True for a parameter of a DSA layer's lightning indexer (``layers.{i}.self_attn.indexer.*``, the
    ``HybridLM.named_parameters`` names): what the indexer warm-up trains."""
    return ".self_attn.indexer." in f".{name}"


def check_trainable(spec: str, mesh: bool = False, compile: bool = False) -> tuple[str, ...]:
    """The groups ``train.trainable`` names (``genoctx.model.groups.parse_trainable``), refusing what cannot run yet.

    Args:
        spec: ``train.trainable``.
        mesh: the run is distributed (``--num-workers``, EP). LoRA runs in every mesh layout (FSDP2, folded EP, CP,
            HSDP, the chunked backward, activation checkpointing): the flag is kept for callers and refuses nothing.
        compile: ``train.compile`` (LoRA is not compiled yet).

    Raises:
        GenoctxError: a bad spec; ``lora`` with ``compile``.
    """
    try:
        groups = parse_trainable(spec)
    except ValueError as e:
        raise GenoctxError(str(e)) from None
    if LORA in groups and compile:
        raise GenoctxError("train.trainable: lora with train.compile is not supported yet (issue 44): set "
                           "train.compile=false")  # fmt: skip
    return groups


def lora_spec(recipe) -> LoRASpec | None:
    """``build_model``'s ``lora`` for a recipe: ``train.lora_rank``, ``lora_alpha``, ``lora_targets`` and A's seed
    ``train.seed`` when ``train.trainable`` names ``lora``, else None (``genoctx.parallel.build.build_model``)."""
    t = recipe.train
    if not has_lora(recipe):
        return None
    return LoRASpec(t.lora_rank, t.lora_alpha, t.lora_targets, t.seed)


def group_or_lora(name: str, layer_types) -> str:
    """``genoctx.model.groups.group_of``, with a LoRA adapter (``genoctx.model.lora.is_lora_name``) in ``lora``."""
    return LORA if is_lora_name(name) else group_of(name, layer_types)


def freeze_untrained(model: HybridLM, spec: str) -> None:
    """``train.trainable``: ``requires_grad_(False)`` on every parameter whose group (``genoctx.model.groups.group_of``
    of its name and ``model.cfg.layer_types``) is not in ``spec``; the others are left as they are (the indexer
    warm-up may have frozen them). ``"all"`` changes nothing. Works on a plain or a parallelized model (FSDP2/DTensor
    parameters keep their names; call it before the first forward, as ``build_optimizer`` does, so that FSDP2's
    unsharded parameters take the flag). A frozen parameter then gets no gradient (``p.grad`` stays None) and no
    optimizer state.

    Raises:
        GenoctxError: as ``check_trainable``; a spec that leaves no parameter to train.
    """
    groups = check_trainable(spec)
    if groups == GROUPS:
        return
    names = [n for n, _ in model.named_parameters()]
    if LORA in groups and not any(is_lora_name(n) for n in names):  # a caller that built no adapters
        raise GenoctxError(f"train.trainable {spec}: the model has no LoRA adapters (build it with "
                           "build_model(lora=lora_spec(recipe)))")  # fmt: skip
    for name, p in model.named_parameters():
        if group_or_lora(name, model.cfg.layer_types) not in groups:
            p.requires_grad_(False)
    if not any(p.requires_grad for p in model.parameters()):  # e.g. "head" of a tied model: lm_head is embed_tokens
        raise GenoctxError(f"train.trainable {spec}: no parameter of this model is left to train (a tied lm_head is "
                           "the embed group; under model.indexer_stage=warmup only the indexer trains)")  # fmt: skip


def trainable_counts(model: HybridLM, spec: str) -> dict:
    """Parameters (global element counts; a DTensor counts its full size) of ``model`` by group, and how many of them
    ``spec`` trains. Returns ``{"trainable": spec, "trainable_parameters": int, "parameters": int, "groups":
    {group: int}}``. Works on the meta device."""
    groups = parse_trainable(spec)
    by_group: dict[str, int] = {}
    tensors = [(n, p.numel()) for n, p in model.named_parameters()]
    tensors += [(n, h.weight.numel()) for n, h in holders(model).items()]  # frozen fp8 weights (train.frozen_dtype)
    for name, numel in tensors:
        g = group_or_lora(name, model.cfg.layer_types)
        by_group[g] = by_group.get(g, 0) + numel
    trained = sum(n for g, n in by_group.items() if g in groups)
    return {"trainable": spec, "trainable_parameters": trained, "parameters": sum(by_group.values()),
            "groups": by_group}  # fmt: skip


def describe_trainable(counts: dict) -> str:
    """``trainable_counts`` as one log line: ``trainable: kda,dsa (12.3M of 313.3B parameters)``."""
    return (f"trainable: {counts['trainable']} ({_human(counts['trainable_parameters'])} of "
            f"{_human(counts['parameters'])} parameters)")  # fmt: skip


def _human(n: int) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def build_optimizer(model: HybridLM, cfg: TrainConfig, total_steps: int):
    """AdamW (decoupled weight decay on matrices only) and its warm-up + cosine LambdaLR schedule.

    Only parameters that require grad are optimised; during the indexer warm-up stage
    (``freeze_for_indexer_warmup``, applied here) those are the indexers' alone, and of those only the groups of
    ``cfg.trainable`` (``freeze_untrained``, applied here: a frozen tensor has no optimizer state).
    ``cfg.optimizer_state_dtype`` ``"fp32"``: ``torch.optim.AdamW`` (moments in the parameters' dtype, 8 bytes per
    fp32 parameter); ``"bf16"``: ``genoctx.train.optim.AdamW`` with bf16 moments (4 bytes per parameter, the same
    update computed in fp32).

    ``torch.optim.AdamW`` runs its foreach path (one ``_foreach_*`` op per update term over all the parameters of a
    group, plus two host reads of each tensor's step count: about 2 ops per parameter tensor instead of about 10) on
    every device, the CPU included (torch's default would pick single-tensor there: ~1.1k ops per cpu-small step,
    ~240 with foreach), except with
    ``offload_optimizer``, whose host AdamW keeps the single-tensor path (foreach's whole-group temporaries would
    double the host bytes ``genoctx.plan.memory`` counts for the offloaded optimizer). The two paths agree bit for
    bit (``tests/parallel/test_mesh.py::test_foreach_adamw_over_the_dense_and_expert_meshes_equals_single_tensor``,
    ``tests/train/test_optim_foreach.py``).
    """
    from .optim import STATE_DTYPES, AdamW

    freeze_for_indexer_warmup(model)
    freeze_untrained(model, cfg.trainable)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer_state_dtype == "fp32":
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                                foreach=not cfg.offload_optimizer)  # fmt: skip
    else:
        opt = AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                    state_dtype=STATE_DTYPES[cfg.optimizer_state_dtype])  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total_steps))
    return opt, sched


def window_order(num_windows: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation of window indices used in ``epoch`` (int64 [num_windows])."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_windows, generator=g)


def sample_batch(
    ds: WindowDataset, cfg: TrainConfig, step: int, dp: int = 1, dp_rank: int = 0
) -> tuple[torch.Tensor, dict]:
    """The windows of optimizer step ``step``: tokens [batch_size, L] int64 and the data-order state.

    With data parallelism the global batch is ``batch_size * dp`` samples; DP rank ``d`` takes samples
    ``k = (step * dp + d) * batch_size + b``, so DP = 2 with batch 1 sees what one process with batch 2 sees.
    """
    n = len(ds)
    rows = []
    for b in range(cfg.batch_size):
        k = (step * dp + dp_rank) * cfg.batch_size + b
        epoch, pos = divmod(k, n)
        idx = int(window_order(n, cfg.seed, epoch)[pos])
        tokens = ds[idx]["tokens"]
        if cfg.seq_len is not None and cfg.seq_len < tokens.numel():
            off = int(np.random.default_rng([cfg.seed, k]).integers(0, tokens.numel() - cfg.seq_len + 1))
            tokens = tokens[off : off + cfg.seq_len]
        rows.append(tokens)
    k_next = (step + 1) * cfg.batch_size * dp
    return torch.stack(rows), {"epoch": k_next // n, "position": k_next % n, "num_windows": n}


def train_autocast(dtype: str, device: torch.device | str):
    """The context every training forward runs in: ``torch.autocast(device, bfloat16)`` for ``train.dtype: bf16``
    (parameters, gradients and optimizer state stay fp32; the fp32 islands of ``genoctx.model.precision`` turn
    autocast off for themselves), a no-op context for ``fp32``. A fresh, reusable context manager."""
    dev = torch.device(device)
    return torch.autocast(device_type=dev.type, dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()


@contextmanager
def deterministic_mode(on: bool):
    """The kernels a training step runs, for ``train.deterministic`` (restored on exit).

    ``on``: ``torch.use_deterministic_algorithms(True, warn_only=True)``, which selects the sparse MLA backward
    without atomics (``kernels.sparse_mla``: dQ, then dKV over an inverse index), the MoE combine as a fixed-order
    sum over each token's slots (``genoctx.model.moe.combine_slots``, also under expert parallelism) and torch's
    deterministic CUDA kernels (``index_add_``/``index_put_`` by sorting, deterministic cuBLAS: it sets
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless set). ``warn_only``: an op that has no deterministic CUDA kernel
    (torch lists floating ``cumsum``, which the PyTorch KDA core runs) warns, naming itself, instead of failing.
    Off: deterministic algorithms off (float atomics: the same run differs in the last bits on a GPU). On a CPU
    both modes give the same bits from run to run. The path that ran is in each step's metrics (``train_step``).
    """
    prev = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])


def _reset_kernel_paths() -> None:
    """Forget the sparse MLA backward an earlier step (or another model in this process) ran, so that
    ``_kernel_paths`` reports this step's."""
    mla = sys.modules.get("kernels.sparse_mla")
    if mla is not None:
        mla.LAST_BACKWARD = None


def _kernel_paths(model) -> dict:
    """What the last step ran where ``train.deterministic`` chooses: ``moe_combine`` (the MoE layers' combines,
    ``"index_add"``/``"slot_sum"``, None without MoE) and ``sparse_mla_backward`` (``kernels.sparse_mla``'s backward
    in this step, None when the Triton kernel did not run: ``_reset_kernel_paths`` before the step)."""
    from ..model.moe import MoE

    combines = sorted({m.stats.get("combine") for m in model.modules() if isinstance(m, MoE) and m.stats} - {None})
    mla = sys.modules.get("kernels.sparse_mla")
    return {"moe_combine": ",".join(combines) or None, "sparse_mla_backward": getattr(mla, "LAST_BACKWARD", None)}


def forward_backward(
    model: HybridLM,
    tokens: torch.Tensor,
    autocast,
    dims: ParallelDims | None = None,
    head=None,
    seq_chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One forward and backward over a batch of windows (``_forward_backward``, the auxiliary loss read as a float).

    tokens: [B, L] int64 window bases (this data-parallel rank's windows, whole; this rank's CP pieces are cut
    here, in the layout ``dims.cp_layout``: ``shard_sequence``).
    Returns (sum of token losses in nats, scored-token count, aux loss), all over the global batch.

    Single process (``dims`` None or one rank): the backward pass uses loss = sum / max(count, 1) + aux.
    Distributed (``dims.world > 1``, ``genoctx.parallel.fsdp.apply_parallel`` already applied):

        count_g  = all-reduce_{mesh}(count)                          scored tokens of the global batch
        q_local  = B x (L / cp)                                      queries (positions) on this rank, either layout
        q_g      = q_local x world                                   (world = cp x dp; EP ranks are data ranks)
        objective_rank = loss_sum_rank / max(count_g, 1) + aux_rank x q_local / q_g
        grad     = sum over the ranks holding each parameter of grad objective_rank     never divided again
                   (FSDP: reduce-scatter + replica all-reduce in backward, divide factor 1; replicated: all-reduce
                   over the mesh, routed experts over the ranks holding the same block: ``reduce_gradients``)

    The ranks' objectives add up to the one-process objective (the auxiliary losses are means over queries),
    so the gradients equal one process's over the whole batch. A rank with no scored token (an all-N slice)
    contributes 0 / count_g: no NaN.

    ``head`` (a ``genoctx.model.vocab.VocabHead``, for a base with a text vocabulary): inputs are mapped to the
    base's ids and the loss runs through its chunked head (``full`` or ``nucleotide`` vocabulary); None = the
    model's own logits over the 8 nucleotide tokens.

    ``seq_chunk_tokens`` (``train.seq_chunk_tokens``): windows longer than it (per rank: under CP, pieces longer than
    it) are trained as consecutive chunks by the exact chunked backward (``genoctx.train.chunked``), with the same
    objective; under CP each rank chunks its piece, one round of ``cp`` chunks at a time; None = one pass.
    """
    loss_sum, count, aux = _forward_backward(model, tokens, autocast, dims, head, seq_chunk_tokens)
    return loss_sum, count, float(read(aux, label="step.aux")) if aux is not None else 0.0


def _forward_backward(model, tokens, autocast, dims=None, head=None, seq_chunk_tokens=None):
    """``forward_backward`` with the auxiliary loss left on the device (a 0-dim tensor, or None without one): the
    step reads it with its other metrics in one host copy (``train_step``)."""
    inputs = shift_inputs(tokens, BOS)
    scored = scored_mask(tokens)
    cp = dims.cp if dims is not None else 1
    chunked = seq_chunk_tokens is not None and seq_chunk_tokens * cp < tokens.shape[1]
    if chunked and (dims is None or not dims.is_distributed):
        count = scored.sum()
        loss_sum, aux = chunked_forward_backward(
            model, inputs, tokens, scored, seq_chunk_tokens, count, autocast=autocast, head=head
        )
        return loss_sum, count, aux
    if dims is None or not dims.is_distributed:
        losses = _token_losses(model, inputs, tokens, scored, autocast, head)
        loss_sum = island("loss.sum", losses.sum())
        count = scored.sum()
        loss = loss_sum / count.clamp(min=1)
        aux = model.aux_loss()
        total = loss + aux if aux is not None else loss
        total.backward()
        return loss_sum.detach(), count, aux.detach() if aux is not None else None
    window = inputs, tokens, scored
    if dims.cp > 1:
        inputs, tokens, scored = (
            shard_sequence(t, dims.cp, dims.cp_rank, dims.cp_layout) for t in (inputs, tokens, scored)
        )
    group = dims.dp_cp_group
    count = scored.sum()
    count_g = all_reduce_sum(count, group)
    share = 1.0 / dims.world  # q_local / q_g: every rank holds B x L / cp positions
    if chunked:  # every data rank trains its whole windows in chunks (the same number on every rank)
        loss_sum, aux_share = chunked_forward_backward(
            model, *window, seq_chunk_tokens, count_g, autocast=autocast, head=head, aux_scale=share,
            cp=dims if dims.cp > 1 else None,
        )  # fmt: skip
    else:
        loss_sum = island("loss.sum", _token_losses(model, inputs, tokens, scored, autocast, head).sum())
        aux = model.aux_loss()
        aux_share = aux * share if aux is not None else None  # this rank's part of the global mean
        total = loss_sum / count_g.clamp(min=1)
        if aux_share is not None:
            total = total + aux_share
        total.backward()
    reduce_gradients(model, dims)  # a sum over the ranks holding each parameter (FSDP: done in backward)
    zero = loss_sum.new_zeros((), dtype=torch.float64)
    sums = torch.stack([loss_sum.detach().double(), aux_share.detach().double() if aux_share is not None else zero])
    sums = all_reduce_sum(sums, group)
    return sums[0], count_g, sums[1]


def _token_losses(model, inputs, tokens, scored, autocast, head) -> torch.Tensor:
    """Per-token losses [B, T] fp32 (nats, 0 where not scored): the model's logits, or ``head``'s chunked loss."""
    with autocast:
        if head is not None:
            return head.token_losses(model, inputs, tokens, scored).float()
        logits, _ = model(inputs)
    return token_losses(logits, tokens, scored)


def train_step(
    model, optimizer, scheduler, tokens, cfg: TrainConfig, autocast, dims: ParallelDims | None = None, head=None
) -> dict:
    """Forward, backward, clip, optimizer and schedule step, router-bias update. Returns step metrics.

    With ``dims`` (distributed), gradients are summed in ``forward_backward`` (FSDP: in backward), clipped by their
    global norm (``genoctx.parallel.fsdp.clip_grad_norm``) and the MoE expert loads are all-reduced over the mesh
    before the router-bias update, so every rank takes the same step.
    """
    optimizer.zero_grad(set_to_none=True)
    cp = dims.cp if dims is not None else 1  # under CP a chunk is each rank's part of a round of cp x chunk tokens
    chunk = (
        cfg.seq_chunk_tokens
        if cfg.seq_chunk_tokens is not None and cfg.seq_chunk_tokens * cp < tokens.shape[1]
        else None
    )
    _reset_kernel_paths()
    with deterministic_mode(cfg.deterministic):  # the kernels train.deterministic selects (recorded below)
        loss_sum, count, aux = _forward_backward(model, tokens, autocast, dims, head, chunk)
        if dims is not None and dims.is_distributed:
            all_reduce_moe_loads(model, dims.dp_cp_group)
            grad_norm = clip_grad_norm(model, cfg.grad_clip, dims)  # the global norm over sharded/EP gradients
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
    scheduler.step()
    # the indexer warm-up keeps the main model frozen, MoE routing biases included; a frozen router (train.trainable
    # without "router") keeps its biases too, its load statistics still read
    if model.cfg.indexer_stage == "warmup":
        moe = []
    else:
        moe = model.update_router_biases(read_now=False, update="router" in parse_trainable(cfg.trainable))
    # the step's one host read: every metric and every MoE layer's load ratio in one copy (genoctx.model.host)
    loss = loss_sum / count.clamp(min=1)  # on the device, in loss_sum's dtype (as loss_sum / max(int(count), 1))
    loss, count, aux, grad_norm, *ratios = read(
        loss, count, aux, grad_norm, *(m["load_max_over_mean"] for m in moe), label="step.metrics"
    )
    return {
        "loss": float(loss),
        "aux_loss": float(aux) if aux is not None else 0.0,
        "scored_tokens": int(count),
        "grad_norm": float(grad_norm),
        "lr": lr,
        "moe_load_max_over_mean": max(map(float, ratios), default=None),
        # the path that ran: one pass over the window (None) or the chunked backward with chunks of this many tokens
        # (per rank: under CP each of the seq_chunks rounds is cp chunks of the window)
        "seq_chunk_tokens": chunk,
        "seq_chunks": -(-tokens.shape[1] // (chunk * cp)) if chunk else 1,
        "deterministic": cfg.deterministic,  # train.deterministic, and what it selected:
        **_kernel_paths(model),
    }


# what a resume must keep (the run's data order, objective and window start); other train keys may change
_RESUME_KEEPS = (("train", "seed"), ("train", "batch_size"), ("train", "seq_len"), ("loss", "vocab"),
                 ("data", "window_start_token"), ("train", "trainable"), ("train", "lora_rank"),
                 ("train", "lora_alpha"), ("train", "lora_targets"), ("train", "frozen_dtype"))  # fmt: skip


def check_resume(recipe: Recipe, ckpt: Path, state: dict, base: dict | None = None) -> None:
    """Refuse a ``--resume`` whose recipe changes what the run is: the model architecture (any ``ModelConfig`` field
    but the compute knobs), the seed, batch, crop length, loss vocabulary or window-start token. A changed step
    budget or schedule key (``train.steps``, ``lr``, ``warmup_steps``, ``min_lr_ratio``) is allowed: the resumed
    steps follow the new recipe's schedule (``restore_schedule``), stated in one warning
    (``describe_resumed_schedule``).

    Raises:
        GenoctxError: one line naming the key, both values, the run's recipe.yaml and, for a run that started from
            a base (``--init``) resumed without it, the ``--init`` to pass.
    """
    from .checkpoint import load_recipe_of

    saved = load_recipe_of(ckpt)
    where = f"{Path(ckpt) / 'recipe.yaml'}"
    started = state.get("init") or {}
    for f in dataclasses.fields(type(recipe.model)):
        if f.name in type(recipe.model)._runtime:
            continue
        new, old = getattr(recipe.model, f.name), getattr(saved.model, f.name)
        if new != old:
            hint = (f"; the run started from --init {started['source']}: pass it again"
                    if started.get("source") and base is None else "; resume with the run's recipe")  # fmt: skip
            raise GenoctxError(
                f"--resume: model.{f.name} is {_short(new)} but the run's is {_short(old)} ({where}){hint}"
            )
    for section, key in _RESUME_KEEPS:
        new, old = getattr(getattr(recipe, section), key), getattr(getattr(saved, section), key)
        if new != old:
            raise GenoctxError(
                f"--resume: {section}.{key} is {new!r} but the run was trained with {old!r} ({where}); a resume "
                "continues the same run: use the run's value, or start a new --out (--init RUN starts from its weights)"
            )
    if recipe.train.optimizer_state_dtype != saved.train.optimizer_state_dtype:
        log.warning("--resume: train.optimizer_state_dtype changed from %s to %s: the AdamW moments are cast",
                    saved.train.optimizer_state_dtype, recipe.train.optimizer_state_dtype)  # fmt: skip
    changed = [f"train.{k} {getattr(saved.train, k)} -> {getattr(recipe.train, k)}" for k in _SCHEDULE_KEYS
               if getattr(recipe.train, k) != getattr(saved.train, k)]  # fmt: skip
    if changed:
        log.warning(describe_resumed_schedule(recipe.train, int(state.get("step", 0)), changed))


_SCHEDULE_KEYS = ("steps", "lr", "warmup_steps", "min_lr_ratio")


def describe_resumed_schedule(cfg: TrainConfig, step: int, changed: list[str]) -> str:
    """The one line a ``--resume`` with other schedule keys logs: the rule (the resumed run follows the schedule of
    an uninterrupted run of the new recipe, ``lr_lambda(cfg, cfg.steps)``: the lr is a function of the step and the
    new keys, ``genoctx.train.checkpoint.restore_schedule``) and the rate of the first resumed step ``step + 1``.

    Args:
        cfg: the resumed recipe's train section; step: the checkpoint's step; changed: ``"train.steps 4 -> 6"`` items.
    """
    first = step + 1
    if first > cfg.steps:
        return (f"--resume: {', '.join(changed)}: the run already has {step} steps; nothing is trained")
    lr = cfg.lr * lr_lambda(cfg, cfg.steps)(step)
    return (f"--resume: {', '.join(changed)}: steps {first}..{cfg.steps} follow the schedule of an uninterrupted "
            f"{cfg.steps}-step run (warm-up {cfg.warmup_steps}, cosine from lr {cfg.lr:.3g} to "
            f"{cfg.lr * cfg.min_lr_ratio:.3g} at step {cfg.steps}); step {first} trains at lr {lr:.3e}")


def check_run_to_resume(out: Path) -> None:
    """A ``--resume`` must name a run: ``out`` exists and holds ``checkpoints/`` or ``events.jsonl`` (a run killed
    before its first checkpoint still resumes, from step 0). A typo in ``--out`` must not start a new run silently.

    Raises:
        GenoctxError: one line naming ``--out`` and the path.
    """
    out = Path(out)
    if not out.is_dir():
        raise GenoctxError(f"--resume: --out {out} does not exist: check the path, or drop --resume to start a new run")
    if not (out / CKPT_DIR).is_dir() and not (out / EVENTS).is_file():
        raise GenoctxError(f"--resume: --out {out} holds no run (no checkpoints/, no {EVENTS}): check the path, or "
                           "drop --resume to start a new run there")  # fmt: skip


def check_global_batch(ckpt: Path, state: dict, dp: int, tokens_per_rank: int, allow: bool) -> dict | None:
    """Refuse a ``--resume`` that changes the global batch: tokens per optimizer step = data-parallel ranks
    (``dp_replicate x ep x dp_shard``, the ``dp`` in the checkpoint's state.json; 1 for a one-process run) x
    ``train.batch_size`` x window tokens (``tokens_per_rank``; batch and window are kept by ``check_resume``). A
    different ``dp`` changes the step's batch, the data each step reads and so the run.

    Args:
        ckpt: the checkpoint resumed from (named in the message); ``state``: its state.json.
        dp: the data-parallel size of this invocation; ``tokens_per_rank``: batch x window tokens per data rank.
        allow: ``--allow-batch-change``: accept it (logged, and returned to be recorded).

    Returns:
        None when the batch is the run's; else (``allow``) the change to record in state.json's ``batch_changes``:
        ``{"step", "from_tokens", "to_tokens", "from_dp", "to_dp"}`` (tokens per optimizer step).

    Raises:
        GenoctxError: the batch changes and ``allow`` is False: one line with both sizes and what to pass.
    """
    old_dp = int(state.get("dp", 1))
    if old_dp == dp:
        return None
    old, new = old_dp * tokens_per_rank, dp * tokens_per_rank
    change = {"step": int(state["step"]), "from_tokens": old, "to_tokens": new, "from_dp": old_dp, "to_dp": dp}
    if not allow:
        where = Path(ckpt) / "state.json"
        raise GenoctxError(
            f"--resume: the run trained {old} tokens per step ({old_dp} data-parallel rank(s), {where}) but this "
            f"invocation would train {new} ({dp}): resume with --num-workers / --cp = {old_dp}, or pass "
            "--allow-batch-change"
        )
    log.warning("--resume --allow-batch-change: %d -> %d tokens per step from step %d (data-parallel ranks %d -> %d)",
                old, new, change["step"], old_dp, dp)  # fmt: skip
    return change


def carry_batch_changes(extra: dict, state: dict | None, change: dict | None) -> None:
    """Put the run's ``batch_changes`` (state.json: the ones ``state`` recorded, plus ``change``) into ``extra``, the
    fields every later checkpoint's state.json carries."""
    changes = list((state or {}).get("batch_changes") or []) + ([change] if change else [])
    if changes:
        extra["batch_changes"] = changes


def warn_newer_incomplete(out: Path, chosen: Path | None) -> None:
    """Warn (one line each) about checkpoint folders of ``out`` newer than ``chosen`` that have no state.json
    (``genoctx.train.checkpoint.newer_incomplete``): a resume does not read them."""
    from .checkpoint import incomplete_line, newer_incomplete

    for p in newer_incomplete(out, chosen):
        log.warning("%s; --resume loads %s", incomplete_line(p), chosen if chosen is not None else "nothing (step 0)")


def check_seq_len(cfg: TrainConfig, window: int, data_dir: Path) -> None:
    """Raises: GenoctxError when ``train.seq_len`` (a crop, in tokens) is longer than the data's windows."""
    if cfg.seq_len is not None and cfg.seq_len > window:
        raise GenoctxError(
            f"train.seq_len {cfg.seq_len} is longer than the {window}-token windows of {data_dir}; use at most "
            f"{window} (or null: whole windows)"
        )


def unused_seq_chunk(cfg: TrainConfig, window: int, cp: int | None = None) -> tuple[str, bool] | None:
    """Whether ``train.seq_chunk_tokens`` has no effect: each window (the crop ``train.seq_len`` when set; under
    ``train.cp`` C, each worker's 1/C of it) is at or below the chunk, so the step runs in one pass
    (``_forward_backward`` chunks only when ``chunk x cp < tokens``).

    Args:
        cfg: the train section; window: the data's window in tokens; cp: the context-parallel size (default
            ``cfg.cp``).

    Returns:
        None when the chunk is unset or chunks the step; else ``(line, by_crop)``: one line saying why, and whether
        it is the crop that stops it (the whole windows would be chunked: ``--set train.seq_len=null`` does that).
    """
    chunk, cp = cfg.seq_chunk_tokens, cp or cfg.cp
    length = cfg.seq_len or window
    if chunk is None or chunk * cp < length:
        return None
    cropped = cfg.seq_len is not None and cfg.seq_len < window
    what = f"the {length}-token crops (train.seq_len) of the {window}-token windows" if cropped else \
        f"the {window}-token windows"  # fmt: skip
    per = f", {length // cp} tokens per worker under --cp {cp}," if cp > 1 else ""
    line = f"train.seq_chunk_tokens {chunk} has no effect: {what}{per} are at or below it and train in one pass"
    by_crop = cropped and chunk * cp < window
    if by_crop:
        line += f"; --set train.seq_len=null trains the whole windows in chunks of {chunk}"
    return line, by_crop


def describe_window(cfg: TrainConfig, window: int, cp: int | None = None) -> str:
    """What one window of a step is, for the run's log: ``"windows of 1048576 tokens, random 256-token crops
    (train.seq_len), one pass"`` or ``"... in chunks of 65536 tokens (train.seq_chunk_tokens)"``."""
    length = cfg.seq_len or window
    text = f"windows of {window} tokens"
    if length < window:
        text += f", random {length}-token crops (train.seq_len)"
    if cfg.seq_chunk_tokens is not None and cfg.seq_chunk_tokens * (cp or cfg.cp) < length:
        return text + f", in chunks of {cfg.seq_chunk_tokens} tokens (train.seq_chunk_tokens)"
    return text + ", one pass"


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _check_manifest(data_dir: Path) -> dict:
    manifest = load_manifest(data_dir)
    if list(manifest.get("vocabulary", [])) != list(VOCAB):
        raise GenoctxError(
            f"{data_dir}/manifest.json: vocabulary {manifest.get('vocabulary')} is not genoctx's "
            f"{list(VOCAB)}; prepare the data again with this version"
        )
    return manifest


def log_step(step: int, steps: int, m: dict, tokens_per_s: float, extra: str = "") -> None:
    """One progress line on stderr (the log): step, loss in nats/token and bits/base, lr, tokens/s, ``extra``."""
    log.info(
        "step %d/%d  loss %.4f nats (%.4f bits/base)  lr %.2e  %.0f tok/s  %s",
        step,
        steps,
        m["loss"],
        m["loss"] / math.log(2),
        m["lr"],
        tokens_per_s,
        extra,
    )


def save_run_checkpoint(
    out: Path,
    step: int,
    model,
    optimizer,
    scheduler,
    recipe: Recipe,
    data_state: dict,
    dims=None,
    extra: dict | None = None,
) -> Path:
    """``RUN/checkpoints/step_{step}`` with the data position and seed (and the CP x DP sizes of ``dims``; ``extra``:
    the base, token map and loss vocabulary of ``genoctx.train.init.describe``), keeping
    ``recipe.train.keep_checkpoints``; see ``genoctx.train.checkpoint.save_checkpoint``. Returns its directory."""
    state = {"data": data_state, "seed": recipe.train.seed, **(extra or {})}
    if dims is not None:
        state.update(cp=dims.cp, dp=dims.dp)
    return save_checkpoint(out, step, model, optimizer, scheduler, recipe, state, keep=recipe.train.keep_checkpoints)


def _resume_choice(out: Path, verify: bool) -> Path:
    """The checkpoint a one-process ``--resume`` of ``out`` loads: with ``verify`` the newest that verifies
    (``genoctx.train.integrity.resume_choice``; each newer one skipped is warned about and set aside), else the
    newest.

    Raises:
        GenoctxError: no checkpoint of the run verifies (the newest one's problem named).
    """
    if not verify:
        chosen = latest_checkpoint(out)
        warn_newer_incomplete(out, chosen)
        return chosen
    chosen, skipped = resume_choice(out)
    if chosen is None:
        raise GenoctxError(f"--resume: no checkpoint of {out} verifies; the newest: {skipped[0][1]}; --no-verify loads "
                           "it anyway, or start a new --out")  # fmt: skip
    for ck, why in skipped:
        log.warning(skip_line(str(ck), why, set_aside(ck)))
    warn_newer_incomplete(out, chosen)
    return chosen


def train(
    data_dir: str | Path,
    recipe: Recipe,
    out: str | Path,
    resume: bool = False,
    device: str = "cpu",
    stop_after: int | None = None,
    wait: bool = False,
    allow_batch_change: bool = False,
) -> dict:
    """Post-train ``recipe.model`` on the train split of ``data_dir`` into the run folder ``out``, its one writer:
    ``genoctx.lock.output_lock`` is held for the whole run (another writer is refused naming this PID, or waits
    with ``wait``). See ``train_unlocked`` for the arguments, the summary and the errors.

    Raises:
        GenoctxError: also when another process holds ``out`` (and ``wait`` is False).
    """
    from ..lock import output_lock

    manifest = _check_manifest(Path(data_dir))
    check_seq_len(recipe.train, int(manifest["window"]), Path(data_dir))
    if resume:
        check_run_to_resume(Path(out))
    check_loggers(recipe.train.loggers)  # a logger's missing package: an error before --out is touched
    # a bad base or tokenizer: an error before --out is touched; a resumed Hub base at the run's recorded commit
    recipe, base = resolve_init(recipe, Path(out) if resume else None)
    vocab_head(recipe, base)
    check_base_chain(base)  # --init of a run whose checkpoints hold what trains: its base unchanged
    with output_lock(out, wait=wait, what="train"):
        return train_unlocked(data_dir, recipe, out, resume=resume, device=device, stop_after=stop_after, base=base,
                              allow_batch_change=allow_batch_change)  # fmt: skip


def train_unlocked(
    data_dir: str | Path,
    recipe: Recipe,
    out: str | Path,
    resume: bool = False,
    device: str = "cpu",
    stop_after: int | None = None,
    base: dict | None = None,
    allow_batch_change: bool = False,
) -> dict:
    """Post-train ``recipe.model`` on the train split of ``data_dir``; write checkpoints and metrics to ``out``
    (metrics.jsonl, and ``recipe.train.loggers``' TensorBoard/MLflow/W&B: ``genoctx.train.metrics``). On a terminal
    (``genoctx.progress``) a bar shows the steps and tokens/s.

    ``recipe.train.steps == 0`` writes the untrained (initialised) model as checkpoint ``step_000000``.
    ``stop_after`` ends this invocation after that step (with a checkpoint), as a scheduler time limit would;
    the learning-rate schedule still spans ``recipe.train.steps``, so ``resume`` continues the same run: the model,
    AdamW moments, the schedule's step and the optimizer's current learning rate (``restore_schedule``) are the
    uninterrupted run's. A resume of a run trained on more data-parallel ranks changes the global batch and is
    refused unless ``allow_batch_change`` (``check_global_batch``; recorded in state.json's ``batch_changes``).
    ``recipe.init`` (or ``base``, its record as ``genoctx.train.init.resolve_init`` returns it, with ``recipe``
    already resolved) starts from a pretrained base: its weights, and for a text vocabulary its token map and the
    ``recipe.loss`` head (``genoctx.model.vocab``), all recorded in each checkpoint's state.json.

    Returns:
        A summary dict (run dir, steps, final loss in nats/token, tokens/s, last checkpoint).

    Raises:
        GenoctxError: bad data dir, a run dir that already holds checkpoints without ``resume``, an unusable base
            (``genoctx.train.init``) or a genoctx base whose files do not verify, a ``resume`` from a run whose
            model differs or none of whose checkpoints verifies (``recipe.train.verify_checkpoints`` false: not
            checked).
    """
    cfg = recipe.train
    data_dir, out = Path(data_dir), Path(out)
    _check_manifest(data_dir)
    ds = WindowDataset(data_dir, "train")
    check_seq_len(cfg, ds.window, data_dir)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    dev = torch.device(device)

    if recipe.init is not None:  # a pretrained base fixes the architecture (genoctx.train.init)
        recipe, base = resolve_init(recipe, out if resume else None)
    start, loaded, state = 0, None, None
    latest = latest_checkpoint(out)
    if latest is not None and not resume:
        raise GenoctxError(
            f"{out} already holds checkpoints (latest {latest.name}); pass --resume to continue or choose a new --out"
        )
    resuming = resume and latest is not None
    change = None
    if resuming:
        latest = _resume_choice(out, cfg.verify_checkpoints)  # the newest that verifies
        saved = read_state(latest)
        check_resume(recipe, latest, saved, base)
        per_rank = cfg.batch_size * (cfg.seq_len or ds.window)
        change = check_global_batch(latest, saved, 1, per_rank, allow_batch_change)
    elif base is not None and base.get("kind") == "genoctx" and cfg.verify_checkpoints:
        refuse_unverified(Path(base["path"]), base["source"], run_of(base["source"]), "--init", "start from it")
    from ..parallel.build import Fresh, Zeros, build_model

    # a run from a base training a subset: checkpoints hold what trains and name the base (checked when resumed)
    partial = partial_record(cfg.trainable, base, saved if resuming else None, latest)
    if resuming:
        source = base_of({"init": partial}) if partial is not None else Zeros()
    else:
        source = base_source(base) if base is not None else Fresh()
    check_frozen_dtype(cfg, mesh=False)
    fp8 = frozen_fp8(cfg, recipe.model, base, saved if resuming else None)  # train.frozen_dtype (genoctx.train.frozen)
    # the one construction path (mesh of 1); train.compile: each decoder layer compiled (genoctx.parallel.compile);
    # train.activation_checkpointing / offload_activations: each layer recomputed, its input kept in host memory
    # train.trainable: lora: the adapters are built on meta with the model and drawn after the base is filled (a resume
    # then loads the saved ones)
    check_trainable(cfg.trainable, compile=cfg.compile)
    model = build_model(recipe.model, None, source=source, device=dev, compile=cfg.compile,
                        activation_checkpointing=cfg.activation_checkpointing,
                        offload_activations=cfg.offload_activations, frozen_fp8=fp8,
                        lora=lora_spec(recipe))  # fmt: skip
    if fp8 is not None:
        log.info("frozen matmul weights in fp8: %d (%d quantized at load), %s blocks", len(fp8.names),
                 model.build_info["fp8"]["quantized"], "x".join(map(str, fp8.block)))  # fmt: skip
    if base is not None and not resuming:
        log.info("initialised from %s (%s)", base["source"], base.get("revision") or base["path"])
    if has_lora(recipe):
        log.info("LoRA: rank %d, alpha %g on %d projections (%s)", cfg.lora_rank, cfg.lora_alpha,
                 len(adapter_draws(model)) // 2, cfg.lora_targets)  # fmt: skip
    optimizer, scheduler = build_optimizer(model, cfg, cfg.steps)
    if cfg.trainable != "all":
        log.info(describe_trainable(trainable_counts(model, cfg.trainable)))
    if resuming:
        state = load_training_state(latest, model, optimizer, scheduler)
        start, loaded = int(state["step"]), latest
        log.info("resuming from %s (step %d)", latest, start)
    head = vocab_head(recipe, base, state)
    extra = {**describe(base, head), **describe_fp8(fp8)}
    if resuming and state.get("init") and base is None:
        extra["init"] = state["init"]  # keep the record of where the run started
    carry_batch_changes(extra, state, change)
    if partial is not None:
        extra.update({"init": partial, HOLDS: TRAINABLE})
    if head is not None:
        log.info("token map %s (window start %r), loss over the %s vocabulary", head.token_map.ids[:5],
                 head.token_map.window_start_token, head.vocab)  # fmt: skip
    if not resuming and resume:
        log.info("--resume: %s holds no complete checkpoint yet; starting at step 0", out)
        warn_newer_incomplete(out, None)  # (as the distributed driver does)
    out.mkdir(parents=True, exist_ok=True)
    attempt = begin_attempt(out, start, loaded, invocation=uuid.uuid4().hex[:12])
    if change is not None:
        record_event(out, {"event": "batch_change", **change})

    autocast = train_autocast(cfg.dtype, dev)
    params = model.num_parameters()
    if (unused := unused_seq_chunk(cfg, ds.window)) is not None:
        log.warning(unused[0])
    log.info(
        "model: %d parameters (%d active per token); %d train %s; steps %d..%d",
        params["total"],
        params["active"],
        len(ds),
        describe_window(cfg, ds.window),
        start,
        cfg.steps,
    )

    data_state = {"epoch": 0, "position": 0, "num_windows": len(ds)}
    last = None
    tokens_seen = steps_run = 0
    t_run = time.perf_counter()
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    ckpt = latest if start >= end else None
    status = "failed"
    try:
        with (
            MetricsLog(out, cfg.loggers, start, recipe, attempt["attempt"]) as metrics,
            bar("train", end, "steps", start) as progress,
        ):
            for step in range(start, end):
                maybe_kill("step", 0, step, out)
                t0 = time.perf_counter()
                tokens, data_state = sample_batch(ds, cfg, step)
                model.train()
                m = train_step(model, optimizer, scheduler, tokens.to(dev), cfg, autocast, head=head)
                steps_run += 1
                dt = time.perf_counter() - t0
                tokens_seen += tokens.numel()
                last = {
                    "step": step + 1,
                    "attempt": attempt["attempt"],
                    **m,
                    "tokens": tokens.numel(),
                    "tokens_per_s": tokens.numel() / dt,
                    "peak_memory_bytes": peak_memory_bytes(dev),
                    "layers": model.layer_stats(),
                }
                metrics.write(last)
                progress.advance(tokens=tokens.numel())
                if (step + 1) % cfg.log_every == 0 or step + 1 == end:
                    paths = ",".join(s.get("path", "?") for s in last["layers"])
                    if cfg.deterministic:  # what train.deterministic selected (deterministic_mode)
                        paths += f" deterministic (moe {m['moe_combine']}, mla bwd {m['sparse_mla_backward']})"
                    log_step(step + 1, cfg.steps, m, last["tokens_per_s"], f"paths {paths}")
                if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == end:
                    ckpt = save_run_checkpoint(out, step + 1, model, optimizer, scheduler, recipe, data_state,
                                               extra=extra)  # fmt: skip
        if ckpt is None:  # nothing trained and nothing on disk: write the initial model (steps == 0)
            ckpt = save_run_checkpoint(out, start, model, optimizer, scheduler, recipe, data_state, extra=extra)
        status = "completed"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        end_attempt(out, attempt, status, steps_run)
    elapsed = time.perf_counter() - t_run
    return {
        "run": str(out),
        "checkpoint": str(ckpt),
        "steps": cfg.steps,
        "step": max(start, end),
        "resumed_from": start if loaded is not None else None,
        "steps_run": steps_run,
        "removed_partial_checkpoints": attempt["removed_partial"],
        "final_loss": last["loss"] if last else None,
        "tokens_trained": tokens_seen,
        "tokens_per_s": tokens_seen / elapsed if tokens_seen else None,
        "peak_memory_bytes": peak_memory_bytes(dev),
        "parameters": params,
    }


EVENTS = "events.jsonl"


def record_event(out: Path, event: dict) -> None:
    """Append one JSON line (with a Unix ``time``) to ``RUN/events.jsonl``, the run's log of attempts."""
    with open(Path(out) / EVENTS, "a") as f:
        f.write(json.dumps({"time": round(time.time(), 3), **event}) + "\n")


def read_events(out: Path) -> list[dict]:
    """The lines of ``RUN/events.jsonl`` (none when absent); a torn last line (a kill mid-write) is skipped."""
    path = Path(out) / EVENTS
    rows = []
    if path.is_file():
        for ln in path.read_text().splitlines():
            try:
                rows.append(json.loads(ln))
            except ValueError:
                continue
    return rows


def next_attempt(out: Path) -> int:
    """The number of the attempt about to start in ``out``: 1 + the ``start`` events already recorded."""
    return 1 + sum(e.get("event") == "start" for e in read_events(out))


def begin_attempt(out: Path, start: int, checkpoint: Path | None, invocation: str, workers: int = 1) -> dict:
    """Start an attempt in ``out`` (its single writer): remove abandoned checkpoint temporaries, cut metrics.jsonl
    back to ``start`` and record a ``start`` event. Returns the event (``attempt``, ``step``, ``checkpoint``,
    ``removed_partial``)."""
    removed = remove_partial_checkpoints(out)
    if removed:
        log.warning("removed %d unfinished checkpoint(s) of a killed save: %s", len(removed), ", ".join(removed))
    _truncate_metrics(out / "metrics.jsonl", start)
    event = {
        "event": "start",
        "attempt": next_attempt(out),
        "invocation": invocation,
        "step": start,
        "checkpoint": str(checkpoint) if checkpoint is not None else None,
        "removed_partial": removed,
        "workers": workers,
        "pid": os.getpid(),
    }
    record_event(out, event)
    return event


def end_attempt(out: Path, start_event: dict, status: str, steps_run: int) -> None:
    """Record the ``end`` of the attempt ``begin_attempt`` started: ``status`` (completed, interrupted, failed), the
    last step reached and ``steps_run``, the optimizer steps this attempt ran."""
    record_event(
        out,
        {
            "event": "end",
            "attempt": start_event["attempt"],
            "invocation": start_event["invocation"],
            "status": status,
            "step": start_event["step"] + steps_run,
            "steps_run": steps_run,
        },
    )


def invocation_attempts(out: Path, invocation: str) -> list[dict]:
    """The attempts of one invocation (``begin_attempt``'s ``invocation``), oldest first: ``attempt``,
    ``resumed_from`` (the step loaded, None when it started from the initialised model), ``steps_run`` (optimizer
    steps it ran; None when it was killed before its ``end`` line) and ``status``."""
    attempts: dict[int, dict] = {}
    for e in read_events(out):
        if e.get("invocation") != invocation:
            continue
        if e.get("event") == "start":
            attempts[e["attempt"]] = {
                "attempt": e["attempt"],
                "resumed_from": e["step"] if e.get("checkpoint") else None,
                "steps_run": None,
                "status": "killed",
                "removed_partial": e.get("removed_partial", []),
            }
        elif e.get("event") == "end" and e.get("attempt") in attempts:
            attempts[e["attempt"]].update(steps_run=e["steps_run"], status=e["status"])
    return [attempts[k] for k in sorted(attempts)]


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines past ``step`` (left by an attempt that stopped after its last checkpoint; a torn line of a
    killed write too), atomically."""
    if not path.is_file():
        return
    keep = []
    for ln in path.read_text().splitlines():
        try:
            if json.loads(ln).get("step", 0) <= step:
                keep.append(ln)
        except ValueError:
            continue
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(ln + "\n" for ln in keep))
    tmp.replace(path)
