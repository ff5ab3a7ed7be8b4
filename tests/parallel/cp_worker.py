"""Run by tests/parallel/test_context.py: gloo processes check CP (both layouts) and DP against one process.

Usage: python tests/parallel/cp_worker.py OUT_DIR WINDOWS.pt [WORLD]
WINDOWS.pt holds {"dna": [L] int64, "n_start": [L] int64, "pair": [2, L] int64, "short": [L4] int64} real-DNA
windows. WORLD 2 (default): CP=2 contiguous and zigzag on "dna" and "n_start", DP=2 on "pair". WORLD 4: CP=4
contiguous and zigzag on "short" (the KDA fold over 4 and 8 pieces). Each rank writes OUT_DIR/rank{r}.pt with
the loss sums, counts, aux losses, gradients and per-layer stats (DSA keys scored/attended, indexer kind, path)
of each case. The model is ``cp_config()``: KDA, a full DSA layer, then a shared DSA layer that reuses its
selection (pools of 4 tokens with the tail, top-16 tokens).
"""

import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from genoctx.model import dsa
from genoctx.model.config import DSA, KDA, ModelConfig, preset
from genoctx.model.host import SyncCounter
from genoctx.model.model import HybridLM
from genoctx.parallel.context import apply_cp, shard_sequence
from genoctx.parallel.mesh import init_parallel, leaving_mesh
from genoctx.train.loop import forward_backward

# three layers: KDA, a "full" DSA layer and a "shared" DSA layer that reuses its selection; MLP, MoE, MoE
THREE_LAYERS = {
    "num_hidden_layers": 3,
    "layer_types": [KDA, DSA, DSA],
    "indexer_types": ["full", "full", "shared"],
    "mlp_layer_types": ["dense", "sparse", "sparse"],
}


def cp_config() -> ModelConfig:
    """The tiny preset (index_kpool 4 with the tail, index_topk 16) with ``THREE_LAYERS``."""
    return preset("tiny", **THREE_LAYERS)


def tiny_model() -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(cp_config())


def _case(model, tokens, dims, seq_chunk=None):
    model.zero_grad(set_to_none=True)
    calls = [0]  # forwards of layer 0's mixer: 1 for one pass, 2 per round for the chunked backward
    hook = model.layers[0].self_attn.register_forward_pre_hook(lambda m, a: calls.__setitem__(0, calls[0] + 1))
    topk = [0, 0]  # indexer top-k calls without / with grad (the chunked grad pass reuses the sweep's selections)
    orig_topk = dsa.indexer_topk

    def count_topk(*a, **kw):
        topk[int(torch.is_grad_enabled())] += 1
        return orig_topk(*a, **kw)

    dsa.indexer_topk = count_topk
    try:
        with SyncCounter() as syncs:  # host reads (genoctx.model.host): the MoE split sizes and the aux loss only
            loss_sum, count, aux = forward_backward(model, tokens, nullcontext(), dims, None, seq_chunk)
    finally:
        dsa.indexer_topk = orig_topk
    hook.remove()
    stats = model.layer_stats()
    return {
        "syncs": (dict(syncs.reads), dict(syncs.ops)),
        "mixer_calls": calls[0],
        "topk_calls": tuple(topk),
        "loss_sum": float(loss_sum),
        "count": int(count),
        "aux": aux,
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
        "keys_scored": [s.get("keys_scored") for s in stats],
        "keys_attended": [s.get("keys_attended") for s in stats],
        "indexer": [s.get("indexer") for s in stats],
        "path": [s.get("path") for s in stats],
    }


# chunked training under CP (genoctx.train.chunked): tokens per rank per round, for (cp, layout). Rounds of 2 x 70 and
# 2 x 50 tokens cut L = 324 into [0, 140) [140, 280) [280, 324) (last pieces 22) and 3 x 100 + 24 (zigzag pieces of
# 25, the last 6); CP=4 zigzag 4 x 20 cuts L4 = 264 into 3 x 80 + 24 (pieces of 10, the last 3 = the conv tail)
SEQ_CHUNK = {(2, "contiguous"): 70, (2, "zigzag"): 50, (4, "zigzag"): 20}


def _cp_cases(res: dict, cp: int, layout: str, windows: dict[str, torch.Tensor]) -> None:
    """``res[name]`` for each window, on a model with CP applied in ``layout`` (removed afterwards); and
    ``res[name + "_chunk"]``, the same window trained by each rank in chunks (``SEQ_CHUNK``)."""
    dims = init_parallel(cp=cp, layout=layout)
    assert (dims.cp, dims.dp, dims.cp_layout) == (cp, 1, layout)
    model = tiny_model()
    handles = apply_cp(model, dims.cp_group, dims.cp_layout)
    assert all("forward" in vars(layer.self_attn) for layer in model.layers)
    for name, tokens in windows.items():
        res[name] = _case(model, tokens[None], dims)
        if (cp, layout) in SEQ_CHUNK:
            res[name + "_chunk"] = _case(model, tokens[None], dims, SEQ_CHUNK[cp, layout])
    for h in handles:
        h.remove()
    assert not any("forward" in vars(layer.self_attn) for layer in model.layers)  # the class forward is back


STREAM_CHUNK = 13  # tokens per chunk of the streamed CP case: no piece length (162, 81) is a multiple of it


def _stream_case(res: dict, windows: dict[str, torch.Tensor]) -> None:
    """``res["stream_<name>"]``: the forward loss sum of CP=2 zigzag with every piece streamed through each mixing
    layer in chunks of ``STREAM_CHUNK`` tokens (``apply_cp(..., chunk_tokens)``, eval's path, no grad), and the
    lengths of the chunks each mixer class's forward received (the streaming happened)."""
    from genoctx.data.dataset import scored_mask
    from genoctx.data.tokenizer import BOS
    from genoctx.model.dsa import DeepSeekSparseAttention
    from genoctx.model.kda import KimiDeltaAttention
    from genoctx.model.model import shift_inputs, token_losses

    dims = init_parallel(cp=2, layout="zigzag")
    model = tiny_model().eval()
    apply_cp(model, dims.cp_group, dims.cp_layout, chunk_tokens=STREAM_CHUNK)
    seen = {"kda": [], "dsa": []}
    originals = {cls: cls.forward for cls in (KimiDeltaAttention, DeepSeekSparseAttention)}

    def counting(cls, key):
        def forward(self, x, *args, **kwargs):
            seen[key].append(x.shape[1])
            return originals[cls](self, x, *args, **kwargs)

        return forward

    KimiDeltaAttention.forward = counting(KimiDeltaAttention, "kda")
    DeepSeekSparseAttention.forward = counting(DeepSeekSparseAttention, "dsa")
    try:
        for name, tokens in windows.items():
            t = tokens[None]
            parts = (shift_inputs(t, BOS), t, scored_mask(t))
            inputs, targets, scored = (shard_sequence(x, 2, dims.cp_rank, "zigzag") for x in parts)
            seen["kda"].clear()
            seen["dsa"].clear()
            with torch.no_grad():
                logits, _ = model(inputs)
            res[f"stream_{name}"] = {"loss_sum": float(token_losses(logits, targets, scored).sum()),
                                     "count": int(scored.sum()), "chunks": {k: list(v) for k, v in seen.items()}}
    finally:
        for cls, f in originals.items():
            cls.forward = f


def run(rank: int, world: int, init_file: str, out_dir: str, windows_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with leaving_mesh():
        w = torch.load(windows_path)
        res = {}
        if world == 2:
            _cp_cases(res, 2, "contiguous", {"cp2": w["dna"], "cp2_n": w["n_start"]})
            _cp_cases(res, 2, "zigzag", {"cp2z": w["dna"], "cp2z_n": w["n_start"]})
            _stream_case(res, {"dna": w["dna"], "n_start": w["n_start"]})
            dims = init_parallel(cp=1)
            assert (dims.cp, dims.dp) == (1, 2)
            res["dp2"] = _case(tiny_model(), w["pair"][dims.dp_rank][None], dims)
        else:
            _cp_cases(res, world, "contiguous", {f"cp{world}": w["short"]})
            _cp_cases(res, world, "zigzag", {f"cp{world}z": w["short"]})
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


if __name__ == "__main__":
    world = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    init = tempfile.mktemp(prefix="genoctx-gloo-")
    # fork, not spawn: the ranks do not import torch and genoctx again
    mp.start_processes(run, args=(world, init, sys.argv[1], sys.argv[2]), nprocs=world, start_method="fork")
