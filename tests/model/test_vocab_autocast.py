"""The mapped head of a text-vocabulary model (``genoctx.model.vocab.VocabHead.log_probs``) keeps its own precision
under a bf16 autocast forward (issue 43 item 13): the 5 nucleotide rows in fp32 and the full vocabulary in the
weight's dtype, as ``genoctx.model.head`` does. Shown with CPU autocast (bf16), which rounds a matmul as CUDA's does.
"""

import pytest
import torch
from torch import nn

from genoctx.model.vocab import TokenMap, VocabHead

V, D = 40, 24


class _Hidden:
    """``model.hidden(ids, cache)`` returning fixed fp32 hidden states [B, T, D]; ``lm_head`` [V, D] fp32."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.h = torch.randn(2, 9, D, generator=g)
        self.lm_head = nn.Linear(D, V, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.randn(V, D, generator=g))

    def hidden(self, ids, cache):
        return self.h[:, : ids.shape[1]], cache


@pytest.mark.parametrize("vocab", ["nucleotide", "full"])
def test_head_log_probs_are_the_same_under_bf16_autocast(vocab):
    model = _Hidden()
    head = VocabHead(TokenMap((10, 11, 12, 13, 14, 3, 3, 3)), vocab, chunk_tokens=5)  # chunks of 5 of 18 rows
    inputs = torch.randint(0, 8, (2, 9), generator=torch.Generator().manual_seed(1))
    want, _ = head.log_probs(model, inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = head.log_probs(model, inputs)
        product = model.h.reshape(-1, D) @ model.lm_head.weight.t()  # what a product under autocast gives
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    assert product.dtype == torch.bfloat16  # (the autocast is on: a product inside it would be bf16)
