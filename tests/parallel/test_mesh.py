"""The 4-D mesh (dp_replicate x ep x dp_shard x cp) trains exactly as one process (issue 13).

Two runs of ``mesh_worker.py``'s ranks (two and four gloo processes, ``mesh_runner.fork_ranks``) train two AdamW
steps in each layout: FSDP=2, EP=2 and DP=2 on two ranks; EP=2 x CP=2, FSDP=2 x CP=2, DP=2 x EP=2, FSDP=2 x EP=2 and
HSDP (2 replicas x FSDP=2) on four; folded EP (the EP group drawn from dp_shard x cp, issue 23): CP=2 and FSDP=2
with EP=2 on two ranks, FSDP=2 x CP=2 with EP=4 on four, each with and without activation checkpointing. One process
trains the same model on all the data ranks' windows batched. Every layout must give its loss (1e-5 relative) and
every gradient (1e-4) at both steps, so the first optimizer step (sharded AdamW state, the global gradient norm used
for clipping, the router-bias update from all-reduced loads) is checked by the second step.

The model (``mesh_worker.mesh_config``): KDA, a full DSA layer and a shared one, a dense MLP and two MoE layers of 8
routed experts (top-2) with re-drawn router biases and mHC bases; the windows are real hg38 (chrM).

Layouts equal one process to the tolerances above, on CPU and GPU alike: a different layout sums in a different order,
so not even ``train.deterministic: true`` makes them equal bit for bit (it makes the same layout repeat its bits).
"""

import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from genoctx.data.fasta import iter_records
from genoctx.data.tokenizer import encode
from genoctx.parallel.layout import Layout
from genoctx.train.loop import build_optimizer, train_step

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import mesh_worker  # noqa: E402
from mesh_runner import fork_ranks  # noqa: E402
from mesh_worker import (  # noqa: E402
    CASES,
    CHUNK,
    FP8_BLOCK,
    FROZEN_SPEC,
    RESHARD,
    STEPS,
    fp8_spec,
    lora_spec,
    mesh_config,
    mesh_model,
    train_config,
)

L = 160  # window tokens: CP=2 pieces of 80
TWO = ["fsdp2", "ep2", "dp2", "ep2_ac", "fsdp2_offload", "cp2_fep2", "cp2_fep2_ac", "fsdp2_fep2", "fsdp2_fep2_ac",
       "fsdp2_chunk", "cp2_chunk"]
FOUR = ["ep2_cp2", "fsdp2_cp2", "dp2_ep2", "fsdp2_ep2", "hsdp2_2", "fsdp2_cp2_ac", "fsdp2_ep2_ac", "fsdp2_cp2_fep4",
        "fsdp2_cp2_fep4_ac", "fsdp2_ep2_chunk_ac", "fsdp2_cp2_chunk_ac", "hsdp2_2_offact_ac"]


@pytest.fixture(scope="module")
def windows() -> torch.Tensor:
    realdna = Path(__file__).resolve().parents[2] / "data" / "hg38"
    ((_, chrm),) = iter_records(realdna / "hg38_chrM.fa")
    m = torch.from_numpy(encode(chrm)[0].astype("int64"))
    return torch.stack([m[2000 + 3000 * i : 2000 + 3000 * i + L] for i in range(4)])


def _lora_model() -> torch.nn.Module:
    """``mesh_model()`` with the "_lora" cases' adapters added in one process (``apply_lora``, A from train.seed)."""
    from genoctx.model.lora import apply_lora

    model = mesh_model()
    spec = lora_spec(train_config())
    apply_lora(model, spec.rank, spec.alpha, spec.targets, seed=spec.seed)
    return model


def _fp8_lora_model() -> torch.nn.Module:
    """The "_fp8_lora" cases in one process: ``mesh_model()``, the matmul weights lora freezes quantized into fp8
    holders (``fp8_spec``: ``freeze_to_fp8``, as ``build_model(frozen_fp8=...)`` holds them), then the adapters."""
    from genoctx.model.fp8 import freeze_to_fp8
    from genoctx.model.lora import apply_lora

    model = mesh_model()
    spec = fp8_spec()
    freeze_to_fp8(model, spec.names, spec.block)
    lspec = lora_spec(train_config())
    apply_lora(model, lspec.rank, lspec.alpha, lspec.targets, seed=lspec.seed)
    return model


def _reference(batch: torch.Tensor, trainable: str = "all", fp8: bool = False) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _fp8_lora_model() if fp8 else _lora_model() if trainable == "lora" else mesh_model()
        cfg = train_config()
        cfg.trainable = trainable
        opt, sched = build_optimizer(model, cfg, cfg.steps)
        steps = []
        for _ in range(STEPS):
            m = train_step(model, opt, sched, batch, cfg, nullcontext())
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            steps.append({"metrics": m, "grads": grads, "biases": biases, "params": params})
    finally:
        torch.set_num_threads(threads)
    return steps


@pytest.fixture(scope="module")
def reference(windows):
    cache = {}

    def get(dp: int) -> list[dict]:
        if dp not in cache:
            cache[dp] = _reference(windows[:dp])
        return cache[dp]

    return get


def _spawn(windows, out: Path, world: int, cases: list[str], **extra) -> list[dict]:
    from genoctx.model.hf import save_hf

    save_hf(mesh_model(), out / "hf")  # every layout loads its own slices of it (genoctx.parallel.build)
    torch.save({"windows": windows, "hf_dir": str(out / "hf"), **extra}, out / "windows.pt")
    # mesh_worker.py's ranks, forked from the preloaded server (as ``python mesh_worker.py OUT WINDOWS WORLD CASES``)
    init = tempfile.mktemp(prefix="genoctx-gloo-")
    fork_ranks(mesh_worker.run, (world, init, str(out), str(out / "windows.pt"), cases), world)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def two(windows, tmp_path_factory):
    return _spawn(windows, tmp_path_factory.mktemp("mesh2"), 2, [*TWO, "bf16", "bf16_chunks", "foreach",
                                                                    "fsdp2_fep2_frozen"])  # fmt: skip


@pytest.fixture(scope="module")
def four(windows, tmp_path_factory):
    return _spawn(windows, tmp_path_factory.mktemp("mesh4"), 4, FOUR)


def _expert_rows(name: str, grad: torch.Tensor, offsets: dict, ref: torch.Tensor) -> torch.Tensor:
    """The rows of the one-process gradient that a rank's expert block holds (its full gradient otherwise)."""
    module = name.rsplit(".", 1)[0]
    if module in offsets and grad.shape != ref.shape:
        return ref[offsets[module] : offsets[module] + grad.shape[0]]
    return ref


def _assert_layout_equals_one_process(ranks: list[dict], case: str, ref: list[dict]) -> None:
    model = _fp8_lora_model() if "_fp8" in case else _lora_model() if "_lora" in case else mesh_model()
    sizes = {n: p.numel() for n, p in model.named_parameters()}  # every parameter, frozen ones included
    full = sum(sizes.values())
    for r, res in enumerate(ranks):
        got = res[case]
        lay = got["layout"]
        experts = sum(v for n, v in sizes.items() if ".mlp.experts." in n)
        # what this rank holds: dense parameters / dense_shard, routed experts / (ep x expert_shard) (FSDP pads
        # uneven shards by < 1 row per parameter); AdamW keeps two moments of the same shape
        layout = Layout(**lay)
        want = (full - experts) / layout.dense_shard + experts / (layout.ep * layout.expert_shard)
        assert want * 0.9 <= got["local_numel"] <= want * 1.1, (case, got["local_numel"], want, full)
        assert got["optimizer_numel"] == 2 * got["trainable_numel"]  # no state for a frozen tensor (train.trainable)
        assert got["trainable_numel"] == got["local_numel"] or got["frozen"], case
        # recomputed in backward; chunked: a forward sweep over the chunks, then each chunk again in backward
        chunks = -(-L // (CHUNK * layout.cp)) if "_chunk" in case else 0  # under CP: rounds of cp chunks
        per_step = (2 if case.endswith("_ac") else 1) if not chunks else chunks * (3 if case.endswith("_ac") else 2)
        assert got["mixer_forwards"] == STEPS * per_step
        if chunks:
            assert got["steps"][0]["metrics"]["seq_chunk_tokens"] == CHUNK
            assert got["steps"][0]["metrics"]["seq_chunks"] == chunks
        for step in range(STEPS):
            g_step, r_step = got["steps"][step], ref[step]
            assert g_step["metrics"]["scored_tokens"] == r_step["metrics"]["scored_tokens"]
            assert g_step["metrics"]["loss"] == pytest.approx(r_step["metrics"]["loss"], rel=1e-5), (case, r, step)
            assert g_step["metrics"]["grad_norm"] == pytest.approx(r_step["metrics"]["grad_norm"], rel=1e-4)
            assert set(g_step["grads"]) == set(r_step["grads"]), case
            for name, g in g_step["grads"].items():
                want = _expert_rows(name, g, got["offsets"], r_step["grads"][name])
                tol = 1e-4 * float(want.abs().max()) + 1e-9
                torch.testing.assert_close(g, want, rtol=1e-4, atol=tol, msg=f"{case} rank {r} step {step} {name}")
            for name, b in g_step["biases"].items():
                torch.testing.assert_close(b, r_step["biases"][name], rtol=0, atol=1e-7)


@pytest.mark.parametrize("case", [*TWO, *FOUR])
def test_layout_equals_one_process(request, reference, case):
    """Each layout (two ranks or four) trains as one process over the data ranks' windows batched."""
    ranks = request.getfixturevalue("two" if case in TWO else "four")
    ep, dp_shard, cp, *folded = CASES[case]
    layout = Layout(**ranks[0][case]["layout"])
    assert (layout.ep, layout.dp_shard, layout.cp, layout.ep_folded) == (ep, dp_shard, cp, bool(folded))
    _assert_layout_equals_one_process(ranks, case, reference(layout.dp))


def test_frozen_groups_on_a_mesh(two, windows):
    """``train.trainable`` (issue 44) on FSDP=2 with folded EP=2: the routed experts, dense MLP, embedding and head
    frozen. Their local shards stay bit-identical over the steps and get no gradient (FSDP2 reduce-scatters, and the
    global norm sums, the trainable ones alone), the optimizer holds the trainable shards alone, and the run equals one
    process with the same groups frozen (loss, norm, every gradient, router biases)."""
    ref = _reference(windows[:2], FROZEN_SPEC)
    for res in two:
        got = res["fsdp2_fep2_frozen"]
        assert got["frozen_changed"] == [] and any(".mlp.experts." in n for n in got["frozen"])
        assert "embed_tokens.weight" in got["frozen"] and "lm_head.weight" in got["frozen"]
        assert not set(got["frozen"]) & set(got["steps"][-1]["grads"])
        assert 0 < got["trainable_numel"] < got["local_numel"] / 2
    _assert_layout_equals_one_process(two, "fsdp2_fep2_frozen", ref)


LORA_TWO = ["fsdp2_fep2_lora", "cp2_fep2_lora_ac", "fsdp2_chunk_lora"]


@pytest.fixture(scope="module")
def lora_two(windows, tmp_path_factory):
    return _spawn(windows, tmp_path_factory.mktemp("mesh2_lora"), 2, LORA_TWO)


@pytest.mark.parametrize("case", LORA_TWO)
def test_lora_on_a_mesh_equals_one_process(lora_two, windows, case):
    """``train.trainable: lora`` (issue 44) on two ranks: FSDP=2 with folded EP=2 (the routed experts' adapters split
    with their experts and run inside the EP exchange), CP=2 with folded EP=2 and activation checkpointing, FSDP=2 with
    the chunked backward (three chunks). The adapters are built on meta and each rank draws its pieces of the
    one-process draws (``build_model(lora=...)``): they start equal to one process's ``apply_lora`` for the same seed.
    Every base tensor's local shard stays bit-identical over the steps; only adapters train, get gradients and
    optimizer state (two moments of each trainable shard); loss, norm, every adapter gradient at both steps and the
    adapters after the steps equal one process's (the mesh tolerances)."""
    from genoctx.model.lora import is_lora_name

    lay = Layout(**lora_two[0][case]["layout"])
    ref = _reference(windows[: lay.dp], "lora")
    params = dict(_lora_model().named_parameters())
    start = {n: p for n, p in params.items() if is_lora_name(n)}
    for r, res in enumerate(lora_two):
        got = res[case]
        assert got["trainable"] and all(is_lora_name(n) for n in got["trainable"])
        assert set(got["adapters"]) == set(start) == set(got["trainable"])
        assert any("experts.gate_up_proj_lora_A" in n for n in got["adapters"])
        assert got["frozen_changed"] == [] and set(got["frozen"]) == set(params) - set(start)  # the whole base
        assert set(got["steps"][-1]["grads"]) == set(start)  # no base tensor got a gradient
        assert 0 < got["trainable_numel"] < got["local_numel"] / 2
        # the run's sharded checkpoint built again as the mesh evaluation builds it: adapters and base as trained
        assert got["evaluated"] == {"lora": True, "names": True, "differ": []}, (case, r)
        # the run's sharded checkpoint built again as the mesh evaluation builds it: adapters and base as trained
        assert got["evaluated"] == {"lora": True, "names": True, "differ": []}, (case, r)
        for name, a in got["adapters_start"].items():  # as drawn: one process's A (B zeros) under every layout
            assert torch.equal(a, _expert_rows(name, a, got["offsets"], start[name].detach())), (case, r, name)
        for name, a in got["adapters"].items():  # after the steps: both A and B moved, as in one process
            want = _expert_rows(name, a, got["offsets"], ref[-1]["params"][name])
            if ".experts." not in name:  # (an expert no token reached would keep its zero B)
                assert not torch.equal(a, got["adapters_start"][name]), name
            # AdamW moves each element by about lr whatever its gradient's size: an element whose gradient is near 0
            # moves by an amount its rounding decides. So 1e-3 of lr absolute (4.3e-6 measured, chunked), 1e-4 relative
            torch.testing.assert_close(a, want, rtol=1e-4, atol=1e-3 * train_config().lr,
                                       msg=lambda m, n=name, r=r: f"{case} rank {r} {n}: {m}")  # fmt: skip
    _assert_layout_equals_one_process(lora_two, case, ref)


def _three_steps(batch: torch.Tensor, ckpt_dir: Path | None = None) -> list[float]:
    """Losses of three uninterrupted one-process steps (seeded as the worker's ``_train``); with ``ckpt_dir``, the
    safetensors checkpoint after step 1 is written there."""
    from genoctx.recipes import Recipe
    from genoctx.train.checkpoint import save_checkpoint

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(1)
        model = mesh_model()
        cfg = train_config()
        cfg.steps = 3
        opt, sched = build_optimizer(model, cfg, cfg.steps)
        losses = []
        for step in range(3):
            losses.append(train_step(model, opt, sched, batch, cfg, nullcontext())["loss"])
            if step == 0 and ckpt_dir is not None:
                save_checkpoint(ckpt_dir, 1, model, opt, sched, Recipe(model=mesh_config(), train=cfg), {})
    finally:
        torch.set_num_threads(threads)
    return losses


@pytest.fixture(scope="module")
def reshard(windows, tmp_path_factory):
    out = tmp_path_factory.mktemp("reshard")
    ref = _three_steps(windows, out / "one")
    ranks = _spawn(windows, out, 4, ["reshard"], one_ckpt=str(out / "one" / "checkpoints" / "step_000001"))
    return ref, ranks, out


@pytest.mark.parametrize("pair", [f"{a}->{b}" for a, b in RESHARD])
def test_sharded_checkpoint_resumes_in_another_layout(reshard, pair):
    """Save after step 1 in one layout, load into a freshly initialised model of another, train steps 2 and 3: the
    uninterrupted run's losses. Step 3 depends on the AdamW moments restored at step 1 (and step 2 on the weights):
    a load that skipped either would differ."""
    ref, ranks, out = reshard
    for r, res in enumerate(ranks):
        got = res[pair]
        if got["first"] is not None:
            assert got["first"][0] == pytest.approx(ref[0], rel=1e-5)
        assert got["after"] == pytest.approx(ref[1:], rel=1e-5), (pair, r)


def test_sharded_checkpoint_loads_in_one_process(reshard):
    """The FSDP=2 x EP=2 checkpoint read by one process (whole tensors, no process group): steps 2 and 3 equal."""
    from genoctx.train.checkpoint import load_training_state, read_state
    from genoctx.train.sharded import is_sharded

    ref, _, out = reshard
    ckpt = out / "reshard_fsdp2_ep2_hsdp2_2" / "checkpoints" / "step_000001"
    assert is_sharded(ckpt) and not (ckpt / "model.safetensors").exists()
    assert read_state(ckpt)["layout"] == {"dp_replicate": 1, "ep": 2, "dp_shard": 2, "cp": 1, "ep_folded": False}
    torch.manual_seed(5)
    from genoctx.model.model import HybridLM

    model = HybridLM(mesh_config())
    cfg = train_config()
    cfg.steps = 3
    opt, sched = build_optimizer(model, cfg, cfg.steps)
    load_training_state(ckpt, model, opt, sched)
    losses = [train_step(model, opt, sched, windows_of(out), cfg, nullcontext())["loss"] for _ in range(2)]
    assert losses == pytest.approx(ref[1:], rel=1e-5)


def windows_of(out: Path) -> torch.Tensor:
    return torch.load(out / "windows.pt")["windows"]


def test_export_consolidates_a_sharded_checkpoint_one_tensor_at_a_time(reshard, tmp_path):
    """``genoctx export`` of the FSDP=2 x EP=2 checkpoint: every tensor read once, alone (the experts' stacked
    tensor serves its per-expert published tensors), and the HF directory loads back to the checkpoint's values."""
    from genoctx.model.hf import load_hf, save_hf
    from genoctx.train.sharded import lazy_state, read_full_tensors

    _, _, out = reshard
    ckpt = out / "reshard_fsdp2_ep2_hsdp2_2" / "checkpoints" / "step_000001"
    state = lazy_state(ckpt, mesh_config())
    reads = []
    read = state._read
    state._read = lambda name: reads.append(name) or read(name)
    save_hf(state, tmp_path / "hf")
    assert sorted(reads) == sorted(set(reads))  # each tensor read once (LazyState keeps the last two read)
    full = read_full_tensors(ckpt)
    assert set(reads) == set(full)
    got = load_hf(tmp_path / "hf").state_dict()
    for name, t in full.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0, msg=name)


def test_fsdp_bf16_params_keep_the_fp32_islands_and_fp32_masters(two, windows):
    """MixedPrecisionPolicy(param_dtype=bf16): matrices compute with bf16 parameters, the fp32 islands (router, the
    KDA mixer with its decay gate, mHC) with fp32 ones; the sharded masters and AdamW moments stay fp32; the loss is
    the one-process bf16-autocast loss to bf16 rounding."""
    for res in two:
        got = res["bf16"]
        assert got["seen"] == {"router": "torch.float32", "shared_expert": "torch.bfloat16", "mhc": "torch.float32",
                               "kda_forget_gate": "torch.float32", "kda_q_proj": "torch.float32",
                               "dsa_q_proj": "torch.bfloat16"}  # fmt: skip
        assert got["masters"] == {"torch.float32"} and got["moments"] == {"torch.float32"}
    model = mesh_model()
    cfg = train_config()
    opt, sched = build_optimizer(model, cfg, cfg.steps)
    autocast = torch.autocast(device_type="cpu", dtype=torch.bfloat16)
    ref = train_step(model, opt, sched, windows[:2], cfg, autocast)["loss"]
    assert two[0]["bf16"]["loss"] == pytest.approx(ref, rel=2e-2)


def test_fsdp_bf16_params_carry_fp32_streams_and_caches(two):
    """Issue 43 item 4: bf16 parameters under FSDP2 keep the residual streams, the KDA state and the pooled indexer keys
    fp32 at every module boundary (``cast_forward_inputs=False``; ``fsdp._dtype_boundaries``). Streamed in chunks (no
    grad, as the mesh eval streams), every carried cache tensor equals that of an fp32-parameter run holding the same
    bf16-rounded values (bf16-parameter precision; the DSA latents, bf16 as planned, equal its latents rounded to
    bf16), and so does a ``seq_chunk_tokens`` step's loss. FSDP's default input cast rounded the caches to bf16 at
    each layer (state 5e-4, pooled keys 3e-3 relative; loss 8e-6) while the islands still recorded fp32."""
    for res in two:
        got, ref = res["bf16_chunks"]["bf16"], res["bf16_chunks"]["fp32"]
        fp32 = {"x", "KDACache.state", "DSACache.pool_k"}  # the streams, and the states summed over chunks
        assert {k for k, dtype in got["seen"] if dtype == "torch.float32"} >= fp32
        assert {k for k, dtype in ref["seen"] if dtype == "torch.float32"} >= fp32
        # the latents' gradient handed back over chunks is bf16 with bf16 latents (the planned cache dtype): excluded
        islands = {k: v for k, v in got["islands"].items() if k != "chunked.grad.DSACache.latent"}
        assert all(v == ["torch.float64"] if k == "loss.window_sum" else v == ["torch.float32"]
                   for k, v in islands.items()), got["islands"]  # fmt: skip
        assert {"kda.state", "dsa.indexer.pool", "chunked.grad.KDACache.state"} <= set(islands)
        assert len(got["carried"]) == 3  # chunks of CHUNK tokens
        for a, b in zip(got["carried"], ref["carried"], strict=True):
            for x, y in zip(a, b, strict=True):
                torch.testing.assert_close(x, y.to(x.dtype), rtol=1e-5, atol=1e-6)
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)


def test_foreach_adamw_over_the_dense_and_expert_meshes_equals_single_tensor(two):
    """``torch.optim.AdamW``'s foreach path (its default on CUDA, where every parameter is a CUDA DTensor) over one
    param group that holds DTensors of two meshes (FSDP=2 dense parameters, the routed experts on the folded EP=2
    mesh): forced on the CPU, two steps equal the single-tensor path's bit for bit (issue 43, item 15)."""
    for res in two:
        got = res["foreach"]
        assert got["calls"] == {True: 2 * STEPS, False: 0}  # two param groups (decay, no decay) per step
        assert len(got["meshes"]) == 2, got["meshes"]
        assert got["max_abs_diff"] == 0.0
        assert any(".experts." in n for n in got["moved"]) and len(got["moved"]) > 20  # both meshes stepped


FP8_TWO = ["fsdp2_fep2_fp8_lora", "cp2_fep2_fp8_lora_ac", "fsdp2_fep2_fp8_lora_offload"]


@pytest.fixture(scope="module")
def fp8_two(windows, tmp_path_factory):
    return _spawn(windows, tmp_path_factory.mktemp("mesh2_fp8"), 2, FP8_TWO)


@pytest.mark.parametrize("case", FP8_TWO)
def test_fp8_lora_on_a_mesh_equals_one_process(fp8_two, windows, case):
    """``train.frozen_dtype: fp8`` with ``train.trainable: lora`` (issue 44) on two ranks, folded EP=2 under FSDP=2 and
    under CP=2 (with activation checkpointing), and with ``train.offload_optimizer`` (the holders host-held and
    fetched per use: ``genoctx.model.fp8.hold_on_host``): built on meta, the holders EP-sliced with their experts,
    each rank quantizing its slice of the fp32 HF base. Each rank's holders are bit for bit the one-process holders (its
    experts' rows of the routed ones, the dense ones whole) and stay so over the steps; it holds only its experts'
    bytes (dense + routed / ep, counted); only the adapters train and have optimizer state; loss, norm, every adapter
    gradient and the adapters after the steps equal the one-process fp8 run's (the mesh tolerances)."""
    from genoctx.model.fp8 import holders
    from genoctx.model.lora import is_lora_name

    lay = Layout(**fp8_two[0][case]["layout"])
    ref = _reference(windows[: lay.dp], "lora", fp8=True)
    one = _fp8_lora_model()
    want_h = {n: (h.weight.view(torch.uint8), h.scale_inv) for n, h in holders(one).items()}
    assert any(".mlp.experts." in n for n in want_h) and any(".self_attn." in n for n in want_h)
    assert all(h.block == FP8_BLOCK for h in holders(one).values())
    dense = sum(w.numel() + 4 * s.numel() for n, (w, s) in want_h.items() if ".mlp.experts." not in n)
    routed = sum(w.numel() + 4 * s.numel() for n, (w, s) in want_h.items() if ".mlp.experts." in n)
    start = {n: p for n, p in one.named_parameters() if is_lora_name(n)}
    for r, res in enumerate(fp8_two):
        got = res[case]
        assert set(got["fp8"]) == set(want_h), (case, r)
        assert got["fp8_changed"] == [], (case, r)
        assert got["fp8_bytes"] == dense + routed // lay.ep, (case, r, got["fp8_bytes"])
        if case.endswith("_offload"):  # train.offload_optimizer: every holder host-held, fetched per use
            assert got["fp8_host_bytes"] == got["fp8_bytes"] and got["fp8_compute"] == ["cpu"], (case, r)
        else:
            assert got["fp8_host_bytes"] is None and got["fp8_compute"] == ["None"], (case, r)
        for name, (w, s) in got["fp8"].items():
            ww, ws = want_h[name]
            if ".mlp.experts." in name:  # this rank's experts only
                off = got["offsets"][name.rpartition(".")[0]]
                assert w.shape[0] == ww.shape[0] // lay.ep, name
                ww, ws = ww[off : off + w.shape[0]], ws[off : off + w.shape[0]]
            assert torch.equal(w, ww) and torch.equal(s, ws), (case, r, name)
        assert set(got["trainable"]) == set(start) and all(is_lora_name(n) for n in got["trainable"])
        assert got["frozen_changed"] == [] and set(got["steps"][-1]["grads"]) == set(start)
        for name, a in got["adapters"].items():
            want = _expert_rows(name, a, got["offsets"], ref[-1]["params"][name])
            torch.testing.assert_close(a, want, rtol=1e-4, atol=1e-3 * train_config().lr,
                                       msg=lambda m, n=name, r=r: f"{case} rank {r} {n}: {m}")  # fmt: skip
    _assert_layout_equals_one_process(fp8_two, case, ref)
