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

- ``kernels.launch``: ``on_device``, the context every launch runs in (the tensors' CUDA device).

Tested against the references under ``TRITON_INTERPRET=1`` on CPU (``tests/kernels``). Nothing is imported or defined
here (under pytest ``tests/kernels`` can make ``kernels`` a namespace package, where only submodules resolve):
``genoctx.model`` imports a kernel module only when it runs it on CUDA.
"""
