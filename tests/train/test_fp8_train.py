"""``train.frozen_dtype: fp8`` in one process (issue 44): a tiny HF base stored in block-scaled fp8 trained with its
frozen matmul weights kept as loaded. The slow reference is the same run with ``bf16`` (plain parameters) whose frozen
weights are the dequantized fp8 values: equal loss and trainable gradients at step 1, bit for bit. Frozen fp8 bytes
and scales bit-identical after the steps, the optimizer holding only what trains, no dequantized stack ever made,
checkpoints holding the fp8 bytes (no bf16 copy), resume exact, bad values one line with exit 2."""

import json
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from cli_runner import run_genoctx  # tests/cli_runner.py: tests/ is on sys.path (its conftest.py)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import genoctx.model.fp8 as fp8
from genoctx.errors import GenoctxError
from genoctx.model.fp8 import holders, quantize_fp8
from genoctx.model.groups import group_of
from genoctx.model.hf import load_hf, read_config
from genoctx.model.lora import DEFAULT_TARGETS, apply_lora, is_lora_name
from genoctx.parallel.build import FromHF, build_model
from genoctx.recipes import TrainConfig, load_recipe
from genoctx.train.checkpoint import load_model
from genoctx.train.frozen import frozen_fp8
from genoctx.train.loop import build_optimizer, train, train_step, trainable_counts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from glm5_reference import build, save, text_config  # noqa: E402

sys.path.pop(0)

BLOCK = (8, 7)  # ragged: 7 divides few widths; 8 divides the experts' halves (I = 16), so they are kept as stored
BF16_STORED = "indexer.weights_proj"  # left in bf16 in the base: quantized at load


@pytest.fixture(scope="module")
def fp8_base(tmp_path_factory):
    """A tiny nucleotide glm5_next (4 layers K K K D, 8 experts) whose 2-D block weights are stored as fp8 +
    ``weight_scale_inv`` in (8, 7) blocks, except the indexer's ``weights_proj`` (bf16)."""
    root = tmp_path_factory.mktemp("fp8base")
    save(build(text_config(vocab_size=8), seed=0), root / "bf16")
    tensors = load_file(root / "bf16" / "model.safetensors")
    config = json.loads((root / "bf16" / "config.json").read_text())
    out = {}
    skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "visual", BF16_STORED)
    for name, w in tensors.items():
        if w.dim() == 2 and name.endswith(".weight") and not any(s in name for s in skip):
            out[name], out[name + "_scale_inv"] = quantize_fp8(w, BLOCK)
        else:
            out[name] = w.to(torch.bfloat16) if w.is_floating_point() and w.dim() == 2 else w
    dst = root / "fp8"
    dst.mkdir()
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    save_file(out, str(dst / "model.safetensors"))
    return dst


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _plain(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def _models(base: Path, spec: str, ac: bool):
    """The fp8 model (``frozen_dtype: fp8``) and its slow reference: bf16 frozen parameters holding the fp8 model's
    dequantized values (fp32 masters, as training builds them); both with the same LoRA adapters when ``spec``
    names lora; both with activation checkpointing when ``ac``."""
    cfg = read_config(base)[0]
    frozen = frozen_fp8(TrainConfig(trainable=spec, frozen_dtype="fp8"), cfg, {"kind": "hf", "path": str(base)})
    assert frozen.block == BLOCK
    model = build_model(cfg, None, source=FromHF(base), frozen_fp8=frozen, activation_checkpointing=ac)
    ref = build_model(cfg, None, source=FromHF(base), activation_checkpointing=ac)
    held = holders(model)
    assert {_plain(n) for n in held} == set(frozen.names) and model.build_info["fp8"]["quantized"] > 0
    with torch.no_grad():
        for name, h in held.items():
            ref.get_parameter(name).copy_(h.dequantize())
    if "lora" in spec:
        for m in (model, ref):
            apply_lora(m, 4, 8.0, DEFAULT_TARGETS, seed=0)
    return model, ref, frozen


@pytest.mark.parametrize("spec, ac", [("lora", False), ("kda,norms", True)])
def test_fp8_frozen_training_equals_the_dequantized_bf16_run(fp8_base, spec, ac, monkeypatch):
    """(a) Step 1's loss and every trainable gradient equal the reference run's bit for bit (forward and backward
    through fp8_linear, the per-expert path, LoRA over fp8 weights, kv_b_proj's merged weight); every fp8 byte and
    scale is bit-identical after 3 steps and equal to the base's stored blocks (or, for the bf16-stored weight, to
    its quantization at load); the optimizer holds exactly the trainable tensors. (b) The frozen matmul weights exist
    only as uint8-sized e4m3 holders (no parameter or buffer of them in a float dtype) and every dequantization in
    the steps is of one 2-D weight (one expert's, never an [E, ...] stack or the model). ``kda,norms`` runs under
    activation checkpointing (the recompute dequantizes again; the names carry the wrapper's infix)."""
    model, ref, frozen = _models(fp8_base, spec, ac)
    kept = holders(load_hf(fp8_base, keep_fp8=True))  # the base's fp8 blocks as stored (tests/model/test_fp8.py)
    plain = load_hf(fp8_base, dtype=torch.float32)
    held = {_plain(n): h for n, h in holders(model).items()}
    assert any(BF16_STORED in n for n in held) and not any(BF16_STORED in n for n in kept)
    for name, h in held.items():  # as stored, or quantized once at load
        q, s = (
            (kept[name].weight, kept[name].scale_inv)
            if name in kept
            else quantize_fp8(plain.get_parameter(name), BLOCK)
        )
        assert torch.equal(_bits(h.weight), _bits(q)) and torch.equal(h.scale_inv, s), name
    # (b) no float copy of a frozen matmul weight: not a parameter, not a buffer; the holders are 1-byte e4m3
    floats = {
        _plain(n) for n, t in [*model.named_parameters(), *model.named_buffers()] if t.dtype != torch.float8_e4m3fn
    }
    assert not floats & set(frozen.names)
    assert all(h.weight.dtype == torch.float8_e4m3fn and h.scale_inv.dtype == torch.float32 for h in held.values())
    assert ".mlp.experts." in " ".join(held) and "self_attn.kv_b_proj.weight" in " ".join(held)
    cfg = TrainConfig(steps=3, lr=1e-2, warmup_steps=0, grad_clip=1e9, trainable=spec, frozen_dtype="fp8")
    opt, sched = build_optimizer(model, cfg, cfg.steps)
    ropt, rsched = build_optimizer(ref, TrainConfig(**{**cfg.__dict__, "frozen_dtype": "bf16"}), cfg.steps)
    assert trainable_counts(model, spec) == trainable_counts(ref, spec)  # the fp8 weights counted in their groups
    assert model.num_parameters() == ref.num_parameters()
    params = dict(model.named_parameters())
    trained = {n for n, p in params.items() if p.requires_grad}
    assert trained and all(is_lora_name(n) or group_of(n, model.cfg.layer_types) in spec.split(",") for n in trained)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(params[n]) for n in trained}
    start = {n: (h.weight.clone(), h.scale_inv.clone()) for n, h in held.items()}
    shapes = []
    real = fp8.dequant_fp8
    monkeypatch.setattr(fp8, "dequant_fp8", lambda *a, **k: shapes.append(tuple(a[0].shape)) or real(*a, **k))
    tokens = torch.randint(0, 4, (2, 96), generator=torch.Generator().manual_seed(0))
    m, mr = (train_step(x, o, s, tokens, cfg, nullcontext()) for x, o, s in ((model, opt, sched), (ref, ropt, rsched)))
    assert m["loss"] == mr["loss"] and m["grad_norm"] == mr["grad_norm"]
    rparams = dict(ref.named_parameters())
    for n in trained:
        assert torch.equal(params[n].grad, rparams[n].grad), n
    assert {n for n, p in rparams.items() if p.grad is not None} == trained  # the reference freezes the same
    print(
        f"{spec}: step-1 loss {m['loss']:.6f} fp8 == bf16 of the dequantized weights; {len(trained)} trainable tensors"
    )
    for _ in range(2):
        train_step(model, opt, sched, tokens, cfg, nullcontext())
    assert {id(p) for p in opt.state} == {id(params[n]) for n in trained}
    for name, h in holders(model).items():
        w, sc = start[_plain(name)]
        assert torch.equal(_bits(h.weight), _bits(w)) and torch.equal(h.scale_inv, sc), name
    per_weight = max(h.weight[0].numel() if h.weight.dim() == 3 else h.weight.numel() for h in held.values())
    assert shapes and all(len(s) == 2 for s in shapes) and max(s[0] * s[1] for s in shapes) <= per_weight


def test_fp8_from_scratch_quantizes_the_fresh_init():
    """No base: the frozen matmul weights are the fresh init quantized in 128 x 128 blocks (one partial block per
    tiny matrix, per expert for the experts), bit for bit ``quantize_fp8`` of the same seed's bf16-free build; the
    trainable ones stay the fresh parameters."""
    from genoctx.model.config import preset

    cfg = preset("tiny")
    frozen = frozen_fp8(TrainConfig(trainable="kda,norms", frozen_dtype="fp8"), cfg)
    assert frozen.block == (128, 128)
    torch.manual_seed(3)
    model = build_model(cfg, None, frozen_fp8=frozen)
    torch.manual_seed(3)
    ref = build_model(cfg, None)
    held = holders(model)
    assert set(held) == set(frozen.names) and model.build_info["fp8"]["quantized"] == len(held)
    assert (
        "layers.1.mlp.experts.gate_up_proj" in held and held["layers.1.mlp.experts.gate_up_proj"].scale_inv.dim() == 3
    )
    for name, h in held.items():
        q, sc = quantize_fp8(ref.get_parameter(name), (128, 128))
        assert torch.equal(_bits(h.weight), _bits(q)) and torch.equal(h.scale_inv, sc), name
    rp = dict(ref.named_parameters())
    assert all(torch.equal(p, rp[n]) for n, p in model.named_parameters())


def _recipe(base, *extra):
    keys = ["train.steps=4", "train.seq_len=128", "train.warmup_steps=1", "train.checkpoint_every=2",
            "train.keep_checkpoints=0", "train.lr=1e-2", "train.trainable=lora", "train.lora_rank=4"]  # fmt: skip
    return load_recipe(None, [f"model.init={base}", *keys, "train.frozen_dtype=fp8", *extra])


def test_fp8_checkpoints_hold_the_fp8_bytes_and_resume_exactly(prepared, fp8_base, tmp_path):
    """A run trained whole and one stopped after step 2 and resumed: every step's lr and loss equal; the checkpoint
    holds what trains and names the fp8 base (no frozen weight in any dtype); eval's loader rebuilds the holders from
    the base, byte for byte; export writes the dequantized + merged model;
    a resume with frozen_dtype bf16 is refused."""
    rec = _recipe(fp8_base)
    train(prepared, rec, tmp_path / "full")
    train(prepared, rec, tmp_path / "cut", stop_after=2)
    with pytest.raises(GenoctxError, match="train.frozen_dtype is 'bf16' but the run was trained with 'fp8'"):
        train(prepared, _recipe(fp8_base, "train.frozen_dtype=bf16"), tmp_path / "cut", resume=True)
    assert train(prepared, rec, tmp_path / "cut", resume=True)["resumed_from"] == 2
    full, cut = ([json.loads(x) for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()]
                 for r in ("full", "cut"))  # fmt: skip
    assert [(r["step"], r["lr"], r["loss"]) for r in cut] == [(r["step"], r["lr"], r["loss"]) for r in full]
    ck = tmp_path / "full" / "checkpoints" / "step_000004"
    assert json.loads((ck / "state.json").read_text())["frozen_fp8"]["block"] == list(BLOCK)
    kept = holders(load_hf(fp8_base, keep_fp8=True))
    state = json.loads((ck / "state.json").read_text())
    assert state["holds"] == "trainable" and state["init"]["path"] == str(Path(fp8_base).resolve())
    with safe_open(str(ck / "model.safetensors"), framework="pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    # a run from a base holds what trains and names the base: no frozen weight, neither its fp8 bytes nor a copy
    assert dtypes and all(is_lora_name(k) for k in dtypes), sorted(dtypes)[:5]  # train.trainable: lora
    assert not any(name in dtypes or f"{name}_fp8.weight" in dtypes for name in kept)
    a, b = (load_model(tmp_path / r)[0] for r in ("full", "cut"))
    hb = holders(b)
    assert set(holders(a)) == set(hb) and len(hb) > len(kept)
    for name, h in kept.items():  # eval's loader rebuilt the holders from the base, byte for byte
        assert torch.equal(_bits(hb[name].weight), _bits(h.weight)) and torch.equal(hb[name].scale_inv, h.scale_inv)
    for name, h in holders(a).items():
        assert torch.equal(_bits(h.weight), _bits(hb[name].weight)) and torch.equal(h.scale_inv, hb[name].scale_inv)
    pb = dict(b.named_parameters())
    for name, p in a.named_parameters():
        assert torch.equal(p, pb[name]), name
    r = run_genoctx("export", str(tmp_path / "full"), "--out", str(tmp_path / "exp"), "--no-base", "--merge")
    assert r.returncode == 0, r.stderr
    merged = load_hf(tmp_path / "exp", dtype=torch.float32)
    assert not holders(merged)
    q, ex = b.layers[0].self_attn.q_proj, b.layers[1].mlp.experts  # W (dequantized) + s B A, as merge_lora sums
    want = hb["layers.0.self_attn.q_proj.weight"].dequantize() + q.scaling * (q.lora_B @ q.lora_A)
    assert torch.equal(merged.get_parameter("layers.0.self_attn.q_proj.weight"), want)
    dn = hb["layers.1.mlp.experts.down_proj"].dequantize()
    want = dn + torch.bmm(ex.down_proj_lora_B, ex.down_proj_lora_A) * ex.lora_scale
    assert torch.equal(merged.get_parameter("layers.1.mlp.experts.down_proj"), want)
    assert not torch.equal(want, dn)  # the adapters moved


@pytest.mark.parametrize(
    "over, message",
    [
        (["train.frozen_dtype=fp16"], "train.frozen_dtype must be 'bf16' or 'fp8', got 'fp16'"),
        (["train.frozen_dtype=fp8"], "train.frozen_dtype: fp8 holds frozen weights, but train.trainable is all"),
    ],
)
def test_bad_frozen_dtype_is_one_line_exit_2(prepared, tmp_path, over, message):
    sets = [a for o in over for a in ("--set", o)]
    out = tmp_path / "run"
    r = run_genoctx("train", "--data", str(prepared), "--recipe", "recipes/tiny.yaml", "--out", str(out), *sets)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()


def test_fp8_on_a_mesh_is_refused_only_with_compile():
    """``train.frozen_dtype: fp8`` runs on a mesh (tests/parallel/test_mesh.py's "_fp8" cases); only with
    ``train.compile`` is it refused, as one line naming both keys."""
    from genoctx.errors import GenoctxError
    from genoctx.recipes import TrainConfig
    from genoctx.train.frozen import check_frozen_dtype

    cfg = TrainConfig(frozen_dtype="fp8", trainable="lora")
    check_frozen_dtype(cfg, mesh=True)
    cfg.compile = True
    with pytest.raises(GenoctxError, match="fp8 with train.compile runs in one process only"):
        check_frozen_dtype(cfg, mesh=True)
