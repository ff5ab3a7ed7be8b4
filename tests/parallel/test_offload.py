"""Activation offloading (``train.offload_activations``, ``genoctx.parallel.offload``): the checkpointed decoder
layers' inputs kept in host memory between forward and recompute. Exact (losses, gradients and weights equal to
checkpointing without offload, bit for bit), one copy each way per layer call with the formula's bytes, the device
input freed after its layer, composing with FSDP2 x CP x folded EP and the chunked backward, and a run checkpointed
with the knob on resumes with it off."""

import copy
import json
import sys
import tempfile
import weakref
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from genoctx.data.tokenizer import BOS
from genoctx.errors import GenoctxError
from genoctx.model.config import preset
from genoctx.parallel.build import build_model
from genoctx.parallel.fsdp import apply_ac
from genoctx.parallel.offload import OffloadStats
from genoctx.recipes import RecipeValueError, TrainConfig, load_recipe
from genoctx.train.loop import build_optimizer, shift_inputs, train, train_step

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import offload_worker  # noqa: E402
from mesh_runner import fork_ranks  # noqa: E402

# KDA, DSA, KDA, DSA; a dense MLP then MoE layers (aux losses, router loads restored after each recompute)
CFG = dict(num_hidden_layers=4, layer_types="KDKD", indexer_types=None, mlp_layer_types=["dense"] + ["sparse"] * 3,
           moe_aux_loss_coef=0.1)  # fmt: skip
B, T = 2, 96


def _train(offload: bool, tokens: torch.Tensor, seq_chunk_tokens: int | None = None) -> dict:
    """Two AdamW steps of the ``CFG`` model with activation checkpointing (one process, fp32, CPU)."""
    torch.manual_seed(0)
    model = build_model(preset("tiny", **CFG), activation_checkpointing=True, offload_activations=offload)
    cfg = TrainConfig(steps=2, lr=1e-2, warmup_steps=0, min_lr_ratio=1.0, seq_chunk_tokens=seq_chunk_tokens)
    opt, sched = build_optimizer(model, cfg, cfg.steps)
    OffloadStats.reset()
    m1 = train_step(model, opt, sched, tokens, cfg, nullcontext())
    after_one = dict(vars(OffloadStats))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    m2 = train_step(model, opt, sched, tokens, cfg, nullcontext())
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": [m1["loss"], m2["loss"]], "aux": [m1["aux_loss"], m2["aux_loss"]], "grads": grads,
            "weights": weights, "stats": after_one, "model": model}  # fmt: skip


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, 4, (B, T))


@pytest.mark.parametrize("chunk", [None, 40], ids=["one_pass", "chunked"])
def test_offload_is_exact_and_moves_each_layer_input_once_each_way(tokens, chunk):
    off, on = _train(False, tokens, chunk), _train(True, tokens, chunk)
    # exact: the layers compute on the same values (a copy changes no bit), so torch.equal, no tolerance
    assert on["losses"] == off["losses"] and on["aux"] == off["aux"]
    assert set(on["grads"]) == set(off["grads"]) and len(on["grads"]) > 0
    for n, g in off["grads"].items():
        assert torch.equal(on["grads"][n], g), n
    for n, w in off["weights"].items():
        assert torch.equal(on["weights"][n], w), n
    # what moves in one step: each decoder layer's input [B, T_pass, n, D] once to host (forward with grad) and once
    # back (its recompute); chunked: once per chunk (the no-grad forward sweep copies nothing), T summed over chunks
    cfg = on["model"].cfg
    passes = 1 if chunk is None else -(-T // chunk)
    per_layer = B * T * cfg.hc_mult * cfg.hidden_size * 4  # fp32 residual streams, bytes, summed over the passes
    L = cfg.num_hidden_layers
    assert on["stats"] == {"to_host": L * passes, "to_host_bytes": L * per_layer,
                           "to_device": L * passes, "to_device_bytes": L * per_layer}  # fmt: skip
    assert off["stats"] == {"to_host": 0, "to_host_bytes": 0, "to_device": 0, "to_device_bytes": 0}


def test_the_device_input_is_freed_after_its_layer(tokens):
    """After the forward (before backward) no layer's device input is alive with offload; without it the
    checkpoint keeps every one (the control: the probe sees what is kept)."""
    torch.manual_seed(0)
    base = build_model(preset("tiny", **CFG))
    alive = {}
    for offload in (False, True):
        model = copy.deepcopy(base)
        apply_ac(model, offload=offload)
        refs = []
        for layer in model.layers:
            layer.register_forward_pre_hook(lambda mod, args, refs=refs: refs.append(weakref.ref(args[0])))
        logits, _ = model(shift_inputs(tokens, BOS))
        alive[offload] = [r() is not None for r in refs]
        logits.sum().backward()
    assert alive == {False: [True] * 4, True: [False] * 4}


def test_the_knob_needs_activation_checkpointing():
    with pytest.raises(RecipeValueError, match="train.offload_activations") as e:
        TrainConfig(offload_activations=True)
    assert e.value.key == "train.offload_activations" and "\n" not in str(e.value)
    assert TrainConfig(offload_activations=True, activation_checkpointing=True).offload_activations
    with pytest.raises(ValueError, match="activation_checkpointing"):
        build_model(preset("tiny"), offload_activations=True, materialize=False)


def test_offload_on_a_mesh_equals_offload_off(tmp_path):
    """Two gloo ranks: CP=2 with FSDP over the CP ranks and EP=2 folded, one pass and the chunked backward; with
    offload on, every loss and every weight after two steps equal offload off's (bit for bit), and each rank moves
    its pieces' layer inputs once each way per layer and chunk."""
    from mesh_worker import CHUNK, mesh_config

    from genoctx.data.fasta import iter_records
    from genoctx.data.tokenizer import encode

    realdna = Path(__file__).resolve().parents[2] / "data" / "hg38"
    ((_, chrm),) = iter_records(realdna / "hg38_chrM.fa")
    m = torch.from_numpy(encode(chrm)[0].astype("int64"))
    L = 160
    torch.save({"windows": torch.stack([m[2000 + 3000 * i : 2000 + 3000 * i + L] for i in range(2)])},
               tmp_path / "windows.pt")  # fmt: skip
    cases = ["cp2_fep2", "cp2_fep2_chunk"]
    init = tempfile.mktemp(prefix="genoctx-gloo-")
    fork_ranks(offload_worker.run, (2, init, str(tmp_path), str(tmp_path / "windows.pt"), cases), 2)
    cfg = mesh_config()
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt")
        for case in cases:
            off, on = res[case][False], res[case][True]
            assert [x["loss"] for x in on["metrics"]] == [x["loss"] for x in off["metrics"]], (case, r)
            assert [x["grad_norm"] for x in on["metrics"]] == [x["grad_norm"] for x in off["metrics"]], (case, r)
            for n, w in off["weights"].items():
                assert torch.equal(on["weights"][n], w), (case, r, n)
            piece = on["piece_tokens"]  # 80: this rank's CP piece of the 160-token window
            passes = -(-piece // CHUNK) if case.endswith("_chunk") else 1
            per_layer = 1 * piece * cfg.hc_mult * cfg.hidden_size * 4  # per step, summed over the chunks
            want = {"to_host": 2 * on["layers"] * passes, "to_host_bytes": 2 * on["layers"] * per_layer}
            want.update(to_device=want["to_host"], to_device_bytes=want["to_host_bytes"])
            assert on["stats"] == want, (case, r)
            assert off["stats"]["to_host"] == 0


def _recipe(steps, *extra):
    over = [f"train.steps={steps}", "train.seq_len=256", "train.checkpoint_every=2", "train.warmup_steps=1",
            "train.keep_checkpoints=0", "train.activation_checkpointing=true", *extra]  # fmt: skip
    return load_recipe("recipes/tiny.yaml", over)


def _losses(run: Path) -> list[float]:
    return [json.loads(ln)["loss"] for ln in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_run_checkpointed_with_offload_resumes_without_it(prepared, tmp_path):
    """The knob changes no state: 2 of 4 steps with offload on, resumed for 2 more with it off, equal an uninterrupted
    run without offload (bit for bit: the checkpoint holds the fp32 weights and AdamW state exactly)."""
    OffloadStats.reset()
    train(prepared, _recipe(4, "train.offload_activations=true"), tmp_path / "run", stop_after=2)
    assert OffloadStats.to_host > 0  # one-process training applied it
    OffloadStats.reset()
    train(prepared, _recipe(4), tmp_path / "run", resume=True)
    assert OffloadStats.to_host == 0
    train(prepared, _recipe(4), tmp_path / "full")
    assert _losses(tmp_path / "run") == _losses(tmp_path / "full")


def test_a_recipe_with_offload_but_no_recompute_is_one_line(prepared, tmp_path):
    with pytest.raises(GenoctxError, match="train.offload_activations.*activation_checkpointing"):
        load_recipe("recipes/tiny.yaml", ["train.offload_activations=true"])
