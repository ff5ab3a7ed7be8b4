"""Layer recomputation (``genoctx.parallel.fsdp.apply_ac``) leaves what the first forward recorded: router loads
counted once, the forward's ``aux_loss`` tensors (no recomputed graph kept alive), its ``stats``; loss and every
gradient equal to the model without recomputation."""

import copy

import torch

from genoctx.data.tokenizer import BOS
from genoctx.model.config import preset
from genoctx.model.model import HybridLM
from genoctx.parallel.fsdp import apply_ac
from genoctx.train.loop import shift_inputs


def _step(model, tokens):
    logits, _ = model(shift_inputs(tokens, BOS))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    auxes = {name: m.aux_loss for name, m in model.named_modules() if torch.is_tensor(getattr(m, "aux_loss", None))}
    (loss + model.aux_loss()).backward()
    return loss.detach(), auxes


def test_recomputed_layers_count_router_loads_once_and_keep_the_forward_aux_loss():
    torch.manual_seed(0)
    cfg = preset("tiny", moe_aux_loss_coef=0.1, num_hidden_layers=4, layer_types="KDKD", indexer_types=None,
                 mlp_layer_types=["dense"] + ["sparse"] * 3)
    plain = HybridLM(cfg).double()
    ac = copy.deepcopy(plain)
    assert apply_ac(ac) == 4
    tokens = torch.randint(0, 4, (2, 96))
    loss0, aux0 = _step(plain, tokens)
    loss1, aux1 = _step(ac, tokens)
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=1e-12)
    assert set(aux1) == set(aux0) and len(aux1) == 5  # 3 MoE balance losses, 2 indexer KLs (DSA layers 1 and 3)
    for name, a in aux1.items():
        assert ac.get_submodule(name).aux_loss is a, name  # the forward's tensor, not a recomputed one
        torch.testing.assert_close(a.detach(), aux0[name].detach(), rtol=0, atol=1e-12)
    for (name, p0), p1 in zip(plain.named_parameters(), ac.parameters(), strict=True):
        torch.testing.assert_close(p1.grad, p0.grad, rtol=0, atol=1e-10, msg=name)
    moes = [(m0, m1) for m0, m1 in zip(plain.modules(), ac.modules(), strict=True) if hasattr(m0, "load_counts")]
    assert len(moes) == 3
    for m0, m1 in moes:
        assert int(m1.load_counts.sum()) == 2 * 96 * cfg.num_experts_per_tok  # each token routed once, not twice
        assert torch.equal(m1.load_counts, m0.load_counts)
        assert torch.equal(m1.stats["tokens_per_expert"], m0.stats["tokens_per_expert"])
    assert ac.layer_stats() == plain.layer_stats()
