"""The one construction path (genoctx.parallel.build): meta -> parallelism -> to_empty -> this rank's shards.

- Memory: 4 gloo ranks (FSDP=4, FSDP=2 x EP=2) build a model from an HF checkpoint of more than 50 MB; each rank's
  peak allocated bytes during construction and load stay within its share + one decoder layer + one checkpoint
  tensor (+10%), while the old path (the whole model on every rank, then sharded) exceeds that bound.
- Fresh initialisation is layout-free: the same seed gives the same model in one process and in five layouts.
- Uneven shards (``A_log`` of 2 heads and mHC ``scale`` of 3 over 4 ranks, 6 experts over EP=2 x FSDP=2) save,
  reshard and load exactly; a one-process checkpoint loads by slices.
- fp8 block-scaled checkpoints (edge blocks, per-expert and stacked experts) read by slices equal a dequantization
  written out here.
- A misshapen tensor is the same one-line error on every rank.
The losses and gradients of sharded loads are checked in test_mesh.py (every layout loads its slices of an HF
export of the one-process model there).
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from cli_runner import run_genoctx  # tests/cli_runner.py: tests/ is on sys.path (its conftest.py)

from genoctx.errors import GenoctxError
from genoctx.model.config import DSA, KDA, preset
from genoctx.model.hf import load_hf, read_hf_into, save_hf
from genoctx.model.init import BLOCK_ELEMENTS, Init, draw_slice, init_spec, whole
from genoctx.model.model import HybridLM

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import build_worker  # noqa: E402
from cp_worker import THREE_LAYERS  # noqa: E402
from mesh_runner import fork_ranks  # noqa: E402


def _three(**overrides):
    """KDA, a full DSA layer and a shared one; a dense MLP then two MoE layers (cp_worker.THREE_LAYERS)."""
    return preset("tiny", **THREE_LAYERS, **overrides)


def _spawn(tmp: Path, case: str, world: int = 4, **args) -> list[dict]:
    torch.save(args, tmp / "args.pt")
    # build_worker.py's ranks, forked from the preloaded server (as ``python build_worker.py TMP ARGS WORLD CASE``)
    init = tempfile.mktemp(prefix="genoctx-gloo-")
    fork_ranks(build_worker.run, (world, init, str(tmp), str(tmp / "args.pt"), case), world)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _one_process_state(model: HybridLM) -> dict:
    sd = model.state_dict()
    if model.cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return {k: v.detach().clone() for k, v in sd.items()}


# ---------------------------------------------------------------- one process


@pytest.mark.parametrize("shape", [(7,), (5, 3), (300, 17), (3, 40, 9)])
def test_draw_slice_is_the_slice_of_the_whole_draw(shape, monkeypatch):
    """Any box of a tensor is drawn equal to that box of the whole tensor (row blocks crossing the box's edges)."""
    monkeypatch.setattr("genoctx.model.init.BLOCK_ELEMENTS", 64)
    spec = Init("normal", 1.0)
    full = draw_slice(spec, shape, 5, "x", tuple(slice(0, n) for n in shape))
    assert full.std() > 0.5
    for lo, hi in [(0, 1), (1, shape[0]), (shape[0] // 2, shape[0]), (0, 0)]:
        box = (slice(lo, hi), *(slice(1 % n, n) for n in shape[1:]))
        got = draw_slice(spec, shape, 5, "x", box)
        assert torch.equal(got, full[box]), (shape, lo, hi)
    other = draw_slice(spec, shape, 6, "x", tuple(slice(0, n) for n in shape))
    assert not torch.equal(other, full)  # another seed, another model
    assert BLOCK_ELEMENTS == 1 << 22


def test_init_spec_covers_every_tensor_with_the_modules_distributions():
    cfg = preset("tiny")
    with torch.device("meta"):
        model = HybridLM(cfg)
    spec = init_spec(model)
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    assert names <= set(spec)
    torch.manual_seed(3)
    m = HybridLM(cfg)
    gate = m.layers[0].self_attn.forget_gate
    assert (gate.A_log == 0).all() if cfg.linear_lower_bound is not None else (gate.A_log > 0).all()
    dt = torch.nn.functional.softplus(gate.dt_bias)
    assert dt.min() >= 1e-4 - 1e-9 and dt.max() <= 0.1 + 1e-6
    assert torch.equal(m.layers[0].attn_hc.scale, torch.ones(3))
    assert float(m.layers[0].attn_hc.fn.detach().std()) == pytest.approx(cfg.initializer_range, rel=0.1)
    torch.manual_seed(3)
    _same(_one_process_state(HybridLM(cfg)), _one_process_state(m))  # the seed fixes the model


def _quantize(w: torch.Tensor, block=(5, 7)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block-wise fp8 of the last two dims (leading dims: stacked experts): (fp8, scale_inv, dequantized)."""
    b0, b1 = block
    R, C = w.shape[-2:]
    scale = torch.empty(*w.shape[:-2], math.ceil(R / b0), math.ceil(C / b1))
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    d = torch.empty(w.shape)
    for i in range(scale.shape[-2]):
        for j in range(scale.shape[-1]):
            blk = (..., slice(i * b0, (i + 1) * b0), slice(j * b1, (j + 1) * b1))
            s = w[blk].abs().amax(dim=(-1, -2)).clamp_min(1e-12) / 448.0
            q[blk] = (w[blk] / s[..., None, None]).to(torch.float8_e4m3fn)
            scale[..., i, j] = s
            d[blk] = q[blk].float() * s[..., None, None]
    return q, scale, d


def test_fp8_slices_equal_the_dequantization(tmp_path):
    """An fp8 checkpoint (5 x 7 blocks: edge blocks everywhere; layer 1's experts per expert, layer 2's stacked
    under transformers' in-memory names) read into uneven row slices equals the dequantized tensors' slices."""
    from safetensors.torch import save_file

    cfg = preset("tiny", num_hidden_layers=3, layer_types=[KDA, DSA, KDA], indexer_types=["full"] * 3,
                 mlp_layer_types=["dense", "sparse", "sparse"])  # fmt: skip
    torch.manual_seed(0)
    model = HybridLM(cfg)
    save_hf(model, tmp_path / "bf")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "bf" / "model.safetensors"), "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    pre = "model.language_model.layers.2.mlp.experts."
    for k in [k for k in tensors if k.startswith(pre)]:
        del tensors[k]
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    tensors[pre + "gate_up_proj"] = model.layers[2].mlp.experts.gate_up_proj.detach().clone()
    tensors[pre + "down_proj"] = model.layers[2].mlp.experts.down_proj.detach().clone()
    out, want = {}, {}
    for k, w in tensors.items():
        if w.dim() >= 2 and ("proj" in k or "experts" in k) and "visual" not in k and w.shape[-1] > 1:
            q, s, d = _quantize(w.float())
            out[k], out[k + "_scale_inv"], want[k] = q, s, d
        else:
            out[k] = w
    assert any(w.dim() == 3 for k, w in out.items() if k.endswith("gate_up_proj"))
    (tmp_path / "fp8").mkdir()
    save_file(out, str(tmp_path / "fp8" / "model.safetensors"))
    import json

    conf = json.loads((tmp_path / "bf" / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [5, 7]}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(conf))
    ref = load_hf(tmp_path / "fp8", dtype=torch.float32)  # whole tensors
    with torch.no_grad():  # the dequantization written out here, placed by hand
        assert torch.equal(ref.layers[2].mlp.experts.gate_up_proj, want[pre + "gate_up_proj"])
        e1 = "model.language_model.layers.1.mlp.experts.3."
        assert torch.equal(ref.layers[1].mlp.experts.gate_up_proj[3, :I], want[e1 + "gate_proj.weight"])
        assert torch.equal(ref.layers[1].mlp.experts.down_proj[3], want[e1 + "down_proj.weight"])
    full = {n: t for n, (t, _, _) in whole(ref).items()}
    for rank, world in [(0, 4), (1, 4), (3, 4), (1, 3)]:  # torch.chunk-style row slices, uneven, some empty
        with torch.device("meta"):
            shell = HybridLM(cfg)
        targets = {}
        for n, (_, shape, _) in whole(shell).items():
            rows = -(-shape[0] // world) if shape else 0
            lo, hi = min(rank * rows, shape[0]), min((rank + 1) * rows, shape[0])
            box = (slice(lo, hi), *(slice(0, d) for d in shape[1:]))
            targets[n] = (torch.full((hi - lo, *shape[1:]), float("nan")), shape, box)
        read_hf_into(tmp_path / "fp8", cfg, {k: v for k, v in targets.items() if k in ref.state_dict()})
        for n, (t, _, box) in targets.items():
            if n in ref.state_dict() and t.numel():
                assert torch.equal(t, full[n][box]), (n, rank, world)
    assert E % 2 == 0
    # a scale of the wrong shape is one error naming it, before anything is read
    bad = e1 + "down_proj.weight_scale_inv"
    (tmp_path / "bad").mkdir()
    save_file({**out, bad: out[bad][:-1].contiguous()}, str(tmp_path / "bad" / "model.safetensors"))
    (tmp_path / "bad" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(GenoctxError, match=f"model.safetensors: {bad} has shape"):
        load_hf(tmp_path / "bad", dtype=torch.float32)


# ---------------------------------------------------------------- many ranks


def _big_config():
    """Six layers (KDA/DSA, five MoE layers of 8 experts of width 512 at hidden 256): about 17M parameters."""
    return preset("tiny", num_hidden_layers=6, hidden_size=256, moe_intermediate_size=512, n_routed_experts=8,
                  intermediate_size=512, layer_types=[KDA, DSA, KDA, DSA, KDA, KDA],
                  indexer_types=["full"] * 6, mlp_layer_types=["dense"] + ["sparse"] * 5)  # fmt: skip


@pytest.fixture(scope="module")
def big_hf(tmp_path_factory):
    cfg = _big_config()
    torch.manual_seed(0)
    model = HybridLM(cfg)
    path = tmp_path_factory.mktemp("big") / "hf"
    save_hf(model, path, max_shard_bytes=20_000_000)  # four shards and an index
    return cfg, path, _one_process_state(model)


def test_each_rank_allocates_its_share_not_the_model(big_hf, tmp_path):
    cfg, path, ref = big_hf
    files = sorted(path.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    assert total > 50e6 and len(files) > 1
    from safetensors import safe_open

    largest = 0
    for f in files:
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                largest = max(largest, math.prod(sl.get_shape()) * 4)
    ranks = _spawn(tmp_path, "memory", cfg=cfg, hf=str(path))
    for layout in ("fsdp4", "fsdp2_ep2"):
        for r, res in enumerate(ranks):
            got = res[layout]
            bound = 1.1 * (got["share"] + got["layer"] + largest)
            assert got["share"] < 0.4 * total, (layout, r)  # a quarter of the model, give or take uneven shards
            assert got["peak"] <= bound, (layout, r, got["peak"], bound)
            assert got["old_peak"] > bound, (layout, r, got["old_peak"], bound)  # the test sees the difference
        _same(ranks[0][layout]["state"], ref)  # and what was loaded is the model


def test_fresh_init_is_the_same_in_every_layout(tmp_path):
    cfg = _three(n_routed_experts=8)
    torch.manual_seed(0)
    want = _one_process_state(HybridLM(cfg))
    ranks = _spawn(tmp_path, "fresh", cfg=cfg)
    assert len(ranks[0]) == 6
    for r in range(4):
        for got in ranks[r].values():
            _same(got, want)
    torch.manual_seed(1)
    assert not torch.equal(HybridLM(cfg).layers[0].self_attn.q_proj.weight, want["layers.0.self_attn.q_proj.weight"])


def test_uneven_shards_save_reshard_and_load_exactly(tmp_path):
    from genoctx.recipes import Recipe, TrainConfig
    from genoctx.train.checkpoint import save_checkpoint

    cfg = _three(n_routed_experts=6, num_experts_per_tok=2, n_group=1, topk_group=1)
    assert cfg.linear_num_heads == 2  # A_log [2] and mHC scale [3]: fewer rows than 4 ranks
    torch.manual_seed(1)
    model = HybridLM(cfg)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b))
    from safetensors.torch import save_file

    assert save_hf(model, tmp_path / "hf", max_shard_bytes=20_000)["shards"] > 2  # shards and an index
    # a leftover model.safetensors beside the index, holding one of its tensors with other values: no rank reads it
    stray = "model.language_model.layers.1.mlp.experts.0.gate_proj.weight"
    gate = model.layers[1].mlp.experts.gate_up_proj[0, : cfg.moe_intermediate_size]
    save_file({stray: torch.full_like(gate, 9.0)}, str(tmp_path / "hf" / "model.safetensors"))
    one = save_checkpoint(tmp_path / "one", 1, model, None, None, Recipe(model=cfg, train=TrainConfig()), {})
    want = _one_process_state(load_hf(tmp_path / "hf", dtype=torch.float32))
    _same(want, _one_process_state(model))
    ranks = _spawn(tmp_path, "uneven", cfg=cfg, hf=str(tmp_path / "hf"), one_ckpt=str(one))
    assert {ranks[r]["local_rows"]["layers.0.self_attn.forget_gate.A_log"] for r in range(4)} == {0, 1}
    assert sorted(ranks[r]["local_rows"]["layers.1.mlp.experts.gate_up_proj"] for r in range(4)) == [1, 1, 2, 2]
    # folded EP 2 over FSDP 4: a block of 3 experts over efsdp = 2 ranks is split on dim 1, not padded on dim 0
    assert ranks[0]["placements"]["fsdp4_fep2"][-1] == "S(1)"  # (replicas, efsdp): Replicate, Shard(1)
    assert ranks[0]["placements"]["fsdp4"][-1] == "S(0)"
    for key, got in ranks[0].items():
        if key not in ("local_rows", "placements"):
            _same(got, want)


def _misshapen_export(tmp_path: Path, cfg, key: str, cut: tuple) -> Path:
    """An HF export of a seeded ``HybridLM(cfg)`` whose tensor ``key`` is cut to ``cut`` (an index)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    torch.manual_seed(0)
    save_hf(HybridLM(cfg), tmp_path / "hf")
    f = tmp_path / "hf" / "model.safetensors"
    with safe_open(str(f), "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    tensors[key] = tensors[key][cut].contiguous()
    save_file(tensors, str(f))
    return tmp_path / "hf"


def test_a_misshapen_tensor_is_one_error_on_every_rank(tmp_path):
    cfg = _three(n_routed_experts=8)
    bad = "model.language_model.layers.1.mlp.experts.5.down_proj.weight"  # only EP rank 1's experts
    _misshapen_export(tmp_path, cfg, bad, (slice(None), slice(0, -1)))
    ranks = _spawn(tmp_path, "bad", cfg=cfg, hf=str(tmp_path / "hf"))
    errors = {r["error"] for r in ranks}
    assert len(errors) == 1, errors
    (msg,) = errors
    assert "layers.1.mlp.experts.5.down_proj.weight" in msg and "model.safetensors" in msg and "\n" not in msg


def test_train_on_a_mesh_refuses_a_misshapen_base_before_any_worker(prepared, tmp_path):
    """``genoctx train --init BAD --num-workers 2 --fsdp 2``: the driver finds the misshapen tensor in the headers
    (``check_hf``) and exits 2 with one line naming it and its file; no Ray is started, ``--out`` is not made."""
    cfg = _three(n_routed_experts=8)
    _misshapen_export(tmp_path, cfg, "model.language_model.layers.2.mlp.experts.7.up_proj.weight", (slice(0, -1),))
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml"
    out = tmp_path / "run"
    r = run_genoctx("train", "--data", prepared, "--recipe", recipe, "--out", out, "--init", tmp_path / "hf",
                    "--num-workers", "2", "--fsdp", "2", "--steps", "1", "--set", "model.preset=null", timeout=300)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "layers.2.mlp.experts.7.up_proj.weight" in lines[0] and "model.safetensors" in lines[0]
    assert not out.exists() and "Traceback" not in r.stderr
