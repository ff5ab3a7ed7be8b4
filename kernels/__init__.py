"""Triton kernels of genoctx: one module per op, each beside (or naming) its PyTorch reference in ``genoctx.model``.

- ``kernels.indexer_topk``: KPool lightning-indexer scores and per-query top-k in one pass (reference
  ``genoctx.model.dsa.indexer_topk``).
- ``kernels.sparse_mla``: sparse MLA attention in the absorbed MQA form over the indexer's selection, forward and
  backward (reference ``genoctx.model.dsa.sparse_mla`` / ``_SparseMLA``).

Tested against the references under ``TRITON_INTERPRET=1`` on CPU (``tests/kernels``). Nothing is imported here:
``genoctx.model`` imports a kernel module only when it runs it on CUDA.
"""
