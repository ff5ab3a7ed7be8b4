"""Run by tests/parallel/test_mesh.py: gloo processes train two steps in each layout of the 4-D mesh.

Usage: python tests/parallel/mesh_worker.py OUT_DIR WINDOWS.pt WORLD CASE[,CASE...]
WINDOWS.pt holds {"windows": [4, L] int64} real-DNA windows. A case names a layout (``CASES``); the data ranks
(dp_replicate x ep x dp_shard) take windows 0..dp-1, one each. Each rank writes OUT_DIR/rank{r}.pt with, per case
and step: the step metrics (loss, grad norm), every gradient gathered to full size (a routed expert block: its rows,
with its offset), the router biases after the step, and this rank's coordinates and MoE EP statistics. Besides the
layouts: ``bf16`` (``run_bf16``), ``reshard`` (``RESHARD``) and ``foreach`` (``run_foreach``: AdamW's foreach path over
the dense and the expert mesh against its single-tensor path).
"""

import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from genoctx.model.config import ModelConfig, preset
from genoctx.model.model import HybridLM
from genoctx.parallel.mesh import leaving_mesh
from genoctx.recipes import TrainConfig

sys.path.insert(0, str(Path(__file__).parent))
from cp_worker import THREE_LAYERS  # noqa: E402

# layout name -> (ep, dp_shard, cp[, ep_folded]); dp_replicate is the rest of the world
CASES = {
    "fsdp2": (1, 2, 1),
    "ep2": (2, 1, 1),
    "dp2": (1, 1, 1),
    "ep2_cp2": (2, 1, 2),
    "fsdp2_cp2": (1, 2, 2),
    "dp2_ep2": (2, 1, 1),
    "fsdp2_ep2": (2, 2, 1),
    "hsdp2_2": (1, 2, 1),
    "dp4": (1, 1, 1),
    "ep2_ac": (2, 1, 1),  # "_ac": with activation checkpointing (each decoder layer recomputed in backward)
    "fsdp2_cp2_ac": (1, 2, 2),
    "fsdp2_offload": (1, 2, 1),  # CPUOffloadPolicy: sharded parameters, gradients and AdamW state in CPU memory
    "hsdp2_2_offact_ac": (1, 2, 1),  # "_offact": train.offload_activations (the layer inputs to host and back)
    "fsdp2_ep2_ac": (2, 2, 1),
    # folded EP ("fep"): the EP group drawn from the dp_shard x cp ranks (Layout.ep_folded)
    "cp2_fep2": (2, 1, 2, True),
    "cp2_fep2_ac": (2, 1, 2, True),
    "fsdp2_fep2": (2, 2, 1, True),
    "fsdp2_fep2_ac": (2, 2, 1, True),
    "fsdp2_cp2_fep4": (4, 2, 2, True),
    "fsdp2_cp2_fep4_ac": (4, 2, 2, True),
    "fsdp4_fep2": (2, 4, 1, True),
    "fsdp4_fep4": (4, 4, 1, True),
    # "_chunk": each data rank trains its window in chunks of CHUNK tokens (the exact chunked backward)
    "fsdp2_chunk": (1, 2, 1),
    "fsdp2_ep2_chunk_ac": (2, 2, 1),
    # with CP each rank chunks its piece: rounds of CP x CHUNK tokens, each rank a CHUNK-token piece of each round
    "cp2_chunk": (1, 1, 2),
    "fsdp2_cp2_chunk_ac": (1, 2, 2),
    # "_frozen": train.trainable FROZEN_SPEC (issue 44): the routed experts, dense MLPs, embedding and head frozen
    "fsdp2_fep2_frozen": (2, 2, 1, True),
    # "_lora": train.trainable lora (LORA: the default targets, the routed experts' adapters included), the base frozen
    "fsdp2_fep2_lora": (2, 2, 1, True),
    "cp2_fep2_lora_ac": (2, 1, 2, True),
    "fsdp2_chunk_lora": (1, 2, 1),
    # "_fp8": train.frozen_dtype fp8 (FP8_BLOCK blocks): the frozen matmul weights held as block-scaled e4m3
    "fsdp2_fep2_fp8_lora": (2, 2, 1, True),
    "cp2_fep2_fp8_lora_ac": (2, 1, 2, True),
    # ... with train.offload_optimizer: the holders in host memory too, fetched to the compute device per use
    "fsdp2_fep2_fp8_lora_offload": (2, 2, 1, True),
}
FP8_BLOCK = (8, 8)  # scale blocks of the "_fp8" cases: several per weight and per expert of mesh_config()
FROZEN_SPEC = "kda,dsa,indexer,router,mhc,norms"
LORA = dict(rank=4, alpha=8.0)  # train.lora_rank / lora_alpha of the "_lora" cases (A drawn from train.seed)
CHUNK = 64  # tokens: a window of 160 is three chunks, the last one 32 long (CP=2: two rounds, the last one 32)
STEPS = 2
# resharding checkpoints: (save layout, load layout) pairs of four ranks with the same four data ranks; "one" is a
# one-process safetensors checkpoint written by the test (ONE_CKPT in the windows file), loaded by the mesh
RESHARD = [("fsdp2_ep2", "hsdp2_2"), ("hsdp2_2", "fsdp2_ep2"), ("one", "fsdp2_ep2"), ("fsdp2_ep2", "dp4"),
           ("fsdp2_ep2", "fsdp4_fep2"), ("fsdp4_fep4", "fsdp2_ep2")]  # fmt: skip


def mesh_config() -> ModelConfig:
    """``cp_worker.THREE_LAYERS`` (KDA, a full DSA layer and a shared one; a dense MLP then two MoE layers) with 8
    routed experts (top-2) and moe_chunk_tokens 32 (several dispatch chunks per window)."""
    return preset("tiny", **THREE_LAYERS, n_routed_experts=8, moe_chunk_tokens=32)


def mesh_model() -> HybridLM:
    """Seeded model whose zero-initialised parameters and buffers are re-drawn (mHC base, router bias), so every
    path carries signal."""
    torch.manual_seed(0)
    model = HybridLM(mesh_config())
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("hc.base", "e_score_correction_bias")):
                t.copy_(torch.randn_like(t.float()).to(t.dtype) * 0.1)
    return model


def lora_spec(cfg: TrainConfig):
    """The adapters of the "_lora" cases (``genoctx.model.lora.LoRASpec``): ``LORA``, default targets, ``cfg.seed``."""
    from genoctx.model.lora import DEFAULT_TARGETS, LoRASpec

    return LoRASpec(LORA["rank"], LORA["alpha"], DEFAULT_TARGETS, cfg.seed)


def fp8_spec():
    """The "_fp8" cases' ``FrozenFP8``: every matmul weight ``train.trainable: lora`` freezes, in ``FP8_BLOCK``."""
    from genoctx.parallel.build import FrozenFP8
    from genoctx.train.frozen import frozen_matmuls

    return FrozenFP8(frozen_matmuls(mesh_config(), "lora"), FP8_BLOCK)


def _holders(model) -> dict:
    """This rank's fp8 holders by the weight they hold (one-device names): (fp8 bytes as uint8, scale_inv), copied."""
    from genoctx.model.fp8 import holders

    plain = lambda n: n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")  # noqa: E731
    return {plain(n): (h.weight.view(torch.uint8).clone(), h.scale_inv.clone()) for n, h in holders(model).items()}


def train_config() -> TrainConfig:
    return TrainConfig(steps=STEPS, lr=1e-2, warmup_steps=0, min_lr_ratio=1.0, grad_clip=0.05, weight_decay=0.1)


def _full_grads(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name] = g.detach().clone()
    return out


def _expert_offsets(model) -> dict:
    out = {}
    for name, m in model.named_modules():
        if hasattr(m, "expert_offset"):
            out[name] = int(m.expert_offset)
    return out


def init_case(name: str):
    """``init_parallel`` for the layout ``name`` of ``CASES``."""
    from genoctx.parallel.mesh import init_parallel

    ep, dp_shard, cp, *folded = CASES[name]
    return init_parallel(cp=cp, ep=ep, dp_shard=dp_shard, ep_folded=bool(folded and folded[0]))


def run_case(name: str, windows: torch.Tensor, hf_dir: str) -> dict:
    from genoctx.parallel.build import FromHF, build_model
    from genoctx.train.loop import build_optimizer, train_step

    dims = init_case(name)
    cfg = train_config()
    if "_chunk" in name:
        cfg.seq_chunk_tokens = CHUNK
    if "_frozen" in name:
        cfg.trainable = FROZEN_SPEC
    lora = None
    if "_lora" in name:  # the adapters built on meta, split and sharded with the model, drawn as one process draws them
        cfg.trainable, cfg.lora_rank, cfg.lora_alpha, lora = "lora", LORA["rank"], LORA["alpha"], lora_spec(cfg)
    # the one construction path: meta -> parallelism -> to_empty -> this rank's slices of mesh_model()'s HF export
    model = build_model(mesh_config(), dims, source=FromHF(Path(hf_dir)), activation_checkpointing=name.endswith("_ac"),
                        offload_optimizer=name.endswith("_offload"), offload_activations="_offact" in name,
                        lora=lora, frozen_fp8=fp8_spec() if "_fp8" in name else None)  # fmt: skip
    calls = [0]  # forwards of layer 0's mixer: one per step, two when the layer is recomputed in backward
    model.layers[0].self_attn.register_forward_pre_hook(lambda m, a: calls.__setitem__(0, calls[0] + 1))
    adapters_start = _full_params(model, lora is not None)
    opt, sched = build_optimizer(model, cfg, cfg.steps)
    start, named = _locals(model), dict(model.named_parameters())
    frozen = {n: t for n, t in start.items() if not named[n].requires_grad}  # this rank's frozen shards
    fp8_start = _holders(model)
    tokens = windows[dims.dp_rank][None]
    steps = []
    for _ in range(STEPS):
        m = train_step(model, opt, sched, tokens, cfg, nullcontext(), dims)
        # the gradients left by the step: summed over the ranks and clipped by the global norm, as one process's
        steps.append({"metrics": m, "grads": _full_grads(model), "biases": _biases(model), "moe": _moe_stats(model)})
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    after = _locals(model)
    lora_eval = "_lora" in name and "_fp8" not in name  # (the mesh evaluation builds no fp8 holders yet)
    evaluated = _eval_rebuild(model, opt, sched, cfg, dims, Path(hf_dir).parent / name) if lora_eval else None
    from genoctx.model.fp8 import fp8_bytes, holders

    fp8_after = _holders(model)
    return {
        "evaluated": evaluated,
        "mixer_forwards": calls[0],
        "local_numel": local,  # parameters this rank holds (sharded: about full / shard size)
        "trainable_numel": sum(after[n].numel() for n, p in named.items() if p.requires_grad),
        # the frozen parameters' local shards (train.trainable): their names, and those the steps changed
        "frozen": sorted(frozen),
        "frozen_changed": [n for n, t in frozen.items() if not torch.equal(after[n], t)],
        # train.frozen_dtype fp8: this rank's holders as filled, the bytes it holds, and the holders the steps changed
        "fp8": fp8_start,
        "fp8_bytes": fp8_bytes(model),
        "fp8_host_bytes": (getattr(model, "build_info", {}).get("fp8") or {}).get("host_bytes"),
        "fp8_compute": sorted({str(h.compute_device) for h in holders(model).values()}),
        "fp8_changed": [
            n
            for n, (w, sc) in fp8_start.items()
            if not (torch.equal(fp8_after[n][0], w) and torch.equal(fp8_after[n][1], sc))
        ],  # fmt: skip
        "optimizer_numel": sum(
            t.numel() if not hasattr(t, "to_local") else t.to_local().numel()
            for st in opt.state.values()
            for t in st.values()
            if torch.is_tensor(t) and t.dim()
        ),
        "trainable": sorted(n for n, p in named.items() if p.requires_grad),
        # LoRA: the adapters (whole; a routed expert's: this rank's block of experts) as drawn and after the steps
        "adapters_start": adapters_start,
        "adapters": _full_params(model, lora is not None),
        "layout": dims.layout.to_dict(),
        "coords": dims.coordinates(),
        "offsets": _expert_offsets(model),
        "steps": steps,
    }


def _eval_rebuild(model, opt, sched, cfg, dims, run_dir: Path) -> dict:
    """Save a sharded checkpoint of the trained LoRA ``model`` and build it again on the same mesh as the mesh
    evaluation does (``genoctx.eval.distributed.build_eval_model``: the adapters built from the run's recipe and read
    from the checkpoint). Returns the names of this rank's local tensors that differ from the trained model's."""
    from genoctx.eval.distributed import build_eval_model
    from genoctx.eval.scoring import eval_checkpoint
    from genoctx.recipes import Recipe
    from genoctx.train.sharded import save_sharded

    ckpt = save_sharded(run_dir, cfg.steps, model, opt, sched, Recipe(model=mesh_config(), train=cfg), {}, dims)
    spec = eval_checkpoint(ckpt)
    rebuilt = build_eval_model(spec, dims, "cpu", None)
    want, got = _locals(model), _locals(rebuilt)
    return {"lora": spec.lora is not None, "names": sorted(got) == sorted(want),
            "differ": [n for n in want if n in got and not torch.equal(got[n], want[n])]}  # fmt: skip


def _full_params(model, lora: bool) -> dict:
    """The LoRA adapters of ``model`` gathered to full size (a routed expert's: its rows of this rank's block, at
    ``_expert_offsets``), copied; {} when ``lora`` is False. A collective under FSDP (every rank calls it)."""
    from genoctx.model.lora import is_lora_name

    out = {}
    for name, p in model.named_parameters() if lora else ():
        if is_lora_name(name):
            out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


def _biases(model) -> dict:
    return {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}


def _moe_stats(model) -> dict:
    out = {}
    for i, layer in enumerate(model.layers):
        stats = getattr(layer.mlp, "stats", None) or {}
        out[i] = {k: v for k, v in stats.items() if k.startswith("ep_")}
    return out


def run_bf16(windows: torch.Tensor) -> dict:
    """FSDP=2 with MixedPrecisionPolicy(param_dtype=bf16) under bf16 autocast: the dtypes of the parameters each
    module computes with (hooks), and the first step's loss."""
    from genoctx.parallel.fsdp import apply_parallel
    from genoctx.parallel.mesh import init_parallel
    from genoctx.train.loop import build_optimizer, train_step

    dims = init_parallel(dp_shard=2)
    model = mesh_model()
    apply_parallel(model, dims, param_dtype=torch.bfloat16)
    seen = {}

    def record(name):
        def hook(module, args):
            seen[name] = str(next(module.parameters()).dtype)

        return hook

    layer = model.layers[1]
    kda = model.layers[0].self_attn
    watched = {
        "router": layer.mlp.gate,
        "shared_expert": layer.mlp.shared_experts.gate_proj,
        "kda_forget_gate": kda.forget_gate,
        "kda_q_proj": kda.q_proj,
        "dsa_q_proj": layer.self_attn.q_a_proj,
    }
    for name, mod in watched.items():
        mod.register_forward_pre_hook(record(name))
    hc, coefficients = layer.attn_hc, layer.attn_hc.coefficients  # mHC runs through pre/post, not forward

    def recorded(x):
        seen["mhc"] = str(hc.fn.dtype)
        return coefficients(x)

    hc.coefficients = recorded
    cfg = train_config()
    opt, sched = build_optimizer(model, cfg, cfg.steps)
    autocast = torch.autocast(device_type="cpu", dtype=torch.bfloat16)
    m = train_step(model, opt, sched, windows[dims.dp_rank][None], cfg, autocast, dims)
    masters = {str(p.dtype) for p in model.parameters()}
    moments = {str(t.dtype) for st in opt.state.values() for k, t in st.items() if k != "step"}
    return {"seen": seen, "loss": m["loss"], "masters": masters, "moments": moments}


def _bf16_rounded_model() -> HybridLM:
    """``mesh_model()`` with every parameter outside the fp32 islands (``fsdp._islands``) rounded to bf16: the values
    a bf16 ``MixedPrecisionPolicy`` computes with, held in fp32 parameters."""
    from genoctx.parallel.fsdp import _islands

    model = mesh_model()
    kept = {id(p) for layer in model.layers for m in _islands(layer) for p in m.parameters()}
    with torch.no_grad():
        for p in model.parameters():
            if id(p) not in kept:
                p.copy_(p.bfloat16().float())
    return model


def run_bf16_chunks(windows: torch.Tensor) -> dict:
    """FSDP=2 with bf16 parameters against FSDP=2 with fp32 parameters holding the same bf16-rounded values, both under
    bf16 autocast: the caches carried over a window streamed in CHUNK-token chunks (no grad, as the mesh eval streams),
    the dtypes reaching each decoder layer and mixer (residual streams, KDA state, pooled keys, latents), the islands'
    dtypes and the first loss of a ``seq_chunk_tokens`` training step."""
    from genoctx.model.precision import record_islands
    from genoctx.parallel.fsdp import apply_parallel
    from genoctx.parallel.mesh import init_parallel
    from genoctx.train.loop import build_optimizer, train_step

    out = {}
    for name, make, dtype in (("bf16", mesh_model, torch.bfloat16), ("fp32", _bf16_rounded_model, None)):
        dims = init_parallel(dp_shard=2)
        model = make()
        apply_parallel(model, dims, param_dtype=dtype)
        seen = set()

        def record(module, args, kwargs, _seen=seen):
            x, cache = args[0], args[1] if len(args) > 1 else kwargs.get("cache")
            _seen.add(("x", x.dtype))
            for k, v in vars(cache).items() if cache is not None else ():
                if torch.is_tensor(v) and v.is_floating_point():
                    _seen.add((f"{type(cache).__name__}.{k}", v.dtype))

        for layer in model.layers:
            layer.register_forward_pre_hook(record, with_kwargs=True)
        autocast = torch.autocast(device_type="cpu", dtype=torch.bfloat16)
        tokens = windows[dims.dp_rank][None]
        carried, cache = [], None
        with torch.no_grad(), autocast:
            for s in range(0, tokens.shape[1], CHUNK):
                _, cache = model(tokens[:, s : s + CHUNK], cache)
                carried.append([t.clone() for t in cache.tensors()])
        cfg = train_config()
        cfg.seq_chunk_tokens = CHUNK
        opt, sched = build_optimizer(model, cfg, cfg.steps)
        with record_islands() as islands:
            loss = train_step(model, opt, sched, tokens, cfg, autocast, dims)["loss"]
        out[name] = {"carried": carried, "seen": sorted((k, str(v)) for k, v in seen), "loss": loss,
                     "islands": {k: sorted(map(str, v)) for k, v in islands.items()}}  # fmt: skip
    return out


def run_foreach(windows: torch.Tensor) -> dict:
    """FSDP=2 with EP=2 folded into it (dense parameters on the dp_shard mesh, routed experts on the expert mesh, both
    in each AdamW param group): two steps with ``torch.optim.AdamW``'s foreach path forced (the CUDA default over
    DTensors; the CPU default is the single-tensor path), then the same from the same start with foreach off. Returns
    the number of foreach AdamW calls of each run, the meshes of the parameters, the largest difference of this
    rank's parameters after the steps and the names of those the steps changed."""
    import torch.optim.adam as adam

    from genoctx.parallel.fsdp import apply_parallel
    from genoctx.train.loop import build_optimizer, train_step

    calls, multi = [0], adam._multi_tensor_adam

    def counted(*a, **k):
        calls[0] += 1
        return multi(*a, **k)

    adam._multi_tensor_adam = counted  # looked up at each step (``torch.optim.adam.adam``)
    res: dict = {"calls": {}, "params": {}}
    try:
        for foreach in (True, False):
            dims = init_case("fsdp2_fep2")
            model = mesh_model()
            apply_parallel(model, dims)
            cfg = train_config()
            opt, sched = build_optimizer(model, cfg, cfg.steps)
            for group in opt.param_groups:
                group["foreach"] = foreach
            calls[0] = 0
            res["params"]["start"] = _locals(model)
            for _ in range(STEPS):
                train_step(model, opt, sched, windows[dims.dp_rank][None], cfg, nullcontext(), dims)
            res["calls"][foreach] = calls[0]
            res["params"][foreach] = _locals(model)
            res["meshes"] = sorted({str(p.device_mesh.mesh_dim_names) for p in model.parameters()
                                    if hasattr(p, "device_mesh")})  # fmt: skip
    finally:
        adam._multi_tensor_adam = multi
    params = res.pop("params")
    a, b, start = params[True], params[False], params["start"]
    res["max_abs_diff"] = max(float((a[n] - b[n]).abs().max()) for n in a)
    res["moved"] = [n for n in a if not torch.equal(a[n], start[n])]  # the parameters the steps changed here
    return res


def _locals(model) -> dict:
    """This rank's pieces of the parameters (a DTensor's local shard), copied."""
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in model.named_parameters()}


def _train(name: str, windows: torch.Tensor, steps: int, save: Path | None = None, load: Path | None = None):
    """``steps`` steps in layout ``name`` (after loading ``load``; saving a sharded checkpoint at ``save``).
    Returns the losses and, for the second layout of a pair, nothing else."""
    from genoctx.parallel.build import Zeros, build_model
    from genoctx.parallel.fsdp import apply_parallel
    from genoctx.recipes import Recipe
    from genoctx.train.loop import build_optimizer, train_step
    from genoctx.train.sharded import load_any, save_sharded

    dims = init_case(name)
    torch.manual_seed(1)
    if load is None:
        model = mesh_model()
        apply_parallel(model, dims)
    else:  # zeros: loading must replace every value
        model = build_model(mesh_config(), dims, source=Zeros())
    cfg = train_config()
    cfg.steps = 3
    opt, sched = build_optimizer(model, cfg, cfg.steps)
    if load is not None:
        load_any(load, model, opt, sched, dims)
    tokens = windows[dims.dp_rank][None]
    losses = [train_step(model, opt, sched, tokens, cfg, nullcontext(), dims)["loss"] for _ in range(steps)]
    if save is not None:
        save_sharded(save.parent.parent, 1, model, opt, sched, Recipe(model=mesh_config(), train=cfg), {}, dims)
    return losses


def run_reshard(src: str, dst: str, windows: torch.Tensor, out: Path, one_ckpt: str | None) -> dict:
    """Train one step in ``src`` and save, then load into ``dst`` and train steps 2 and 3."""
    run_dir = out / f"reshard_{src}_{dst}"
    ckpt = run_dir / "checkpoints" / "step_000001"
    first = None
    if src == "one":
        ckpt = Path(one_ckpt)
    else:
        first = _train(src, windows, 1, save=ckpt)
    dist.barrier()
    return {"first": first, "after": _train(dst, windows, 2, load=ckpt)}


def run(rank: int, world: int, init_file: str, out_dir: str, windows_path: str, cases: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with leaving_mesh():
        data = torch.load(windows_path)
        windows = data["windows"]
        res = {}
        for name in cases:
            if name == "bf16":
                res[name] = run_bf16(windows)
            elif name == "bf16_chunks":
                res[name] = run_bf16_chunks(windows)
            elif name == "foreach":
                res[name] = run_foreach(windows)
            elif name == "reshard":
                for src, dst in RESHARD:
                    res[f"{src}->{dst}"] = run_reshard(src, dst, windows, Path(out_dir), data.get("one_ckpt"))
            else:
                res[name] = run_case(name, windows, data["hf_dir"])
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


if __name__ == "__main__":
    init = tempfile.mktemp(prefix="genoctx-gloo-")
    world = int(sys.argv[3])
    # fork, not spawn: the ranks do not import torch and genoctx again
    args = (world, init, sys.argv[1], sys.argv[2], sys.argv[4].split(","))
    mp.start_processes(run, args=args, nprocs=world, start_method="fork")
