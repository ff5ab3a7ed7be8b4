"""Triton kernels of genoctx: one module per op, each beside (or naming) its PyTorch reference in ``genoctx.model``.

- ``kernels.indexer_topk``: KPool lightning-indexer scores and per-query top-k in one pass (reference
  ``genoctx.model.dsa.indexer_topk``).
- ``kernels.sparse_mla``: sparse MLA attention in the absorbed MQA form over the indexer's selection, forward and
  backward (reference ``genoctx.model.dsa.sparse_mla`` / ``_SparseMLA``).

Each module registers its kernels as ``torch.library`` custom ops when imported (``genoctx::indexer_topk``,
``genoctx::sparse_mla_fwd``, ``genoctx::sparse_mla_bwd``; no GPU needed): the real kernel runs on CPU (interpreter)
and CUDA tensors, a fake kernel gives shapes and dtypes on fake and meta tensors, and ``sparse_mla_fwd`` carries its
autograd formula, so ``torch.compile(fullgraph=True)`` traces through them. The public functions (``indexer_topk``,
``sparse_mla``) call the ops; ``indexer_topk_launch``, ``sparse_mla_fwd`` and ``sparse_mla_bwd`` are the launchers.

Tested against the references under ``TRITON_INTERPRET=1`` on CPU (``tests/kernels``). Nothing is imported here:
``genoctx.model`` imports a kernel module only when it runs it on CUDA.
"""


def on_device(t):
    """The context a kernel is launched in: ``torch.cuda.device(t.device)`` for a CUDA tensor ``t`` (Triton launches
    on the current CUDA device and its stream, which need not be the tensors' own: ``--device cuda:1`` from a process
    whose current device is 0), a no-op for a CPU tensor (the interpreter)."""
    import contextlib

    import torch

    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()
