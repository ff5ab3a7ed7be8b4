"""Dry run at the real size: build the model of a parallel layout for one simulated rank at a time, in one CPU
process, and count the bytes that rank would hold, from the built model (never from the planner's formulas).

For each simulated rank ``r`` of a layout of ``W`` ranks:

1. ``torch.distributed.init_process_group("fake", rank=r, world_size=W)`` (torch's fake backend: collectives
   return at once, nothing is sent) and ``genoctx.parallel.mesh.init_parallel`` (the real 4-D mesh);
2. ``genoctx.parallel.build.build_model(..., materialize=False)``: the real construction and ``apply_parallel``
   (expert parallel, context parallel, activation checkpointing, FSDP2 with the training ``MixedPrecisionPolicy``)
   on the meta device: every parameter is this rank's piece (an FSDP2 DTensor's ``_local_tensor``), no memory;
3. ``genoctx.train.loop.build_optimizer`` (AdamW, moments in ``optimizer_state_dtype``: ``torch.optim.AdamW``
   for fp32, ``genoctx.train.optim.AdamW`` for bf16) on those parameters and
   ``genoctx.parallel.state.canonical_state``, which creates the zero ``exp_avg``/``exp_avg_sq`` (``zeros_like``
   of each parameter in the optimizer's moment dtype, on meta) as a fresh optimizer about to be loaded holds them;
4. the counts (bytes, from the local tensors' ``numel() x element_size()``):

   - ``weights``: the bytes allocated for the parameters' local pieces (fp32 sharded masters): FSDP2 pads every
     rank's piece to the first one's ``torch.chunk`` size (``FSDPParam.padded_sharded_param_size``; the local shard
     is a view of that storage), so a rank with fewer (or no) rows of a parameter still allocates the padded size;
     ``params_local`` counts the unpadded pieces; ``buffers`` separately (router biases, load counts: replicated,
     not FSDP's);
   - ``gradients``: FSDP2 reduce-scatters each sharded parameter's gradient into the same padded size in the
     master's dtype (``reduce_dtype`` fp32): ``p.grad = torch.zeros_like(p)`` on meta gives the dtype (done here,
     then dropped), the padded size the bytes;
   - ``optimizer_state``: AdamW's ``exp_avg`` + ``exp_avg_sq`` local bytes, read from ``optimizer.state`` (a
     DTensor's ``_local_tensor``, not padded; the scalar ``step`` is not counted): 2 x 4 bytes per local parameter
     with fp32 moments, 2 x 2 with bf16;
   - ``largest_unsharded_group``: FSDP2's largest all-gather: for each FSDP parameter group (a decoder layer; its
     routed experts; under bf16 its fp32 islands; the root), the sum over its parameters of the group's global
     numel (a routed expert: the rank's EP block, the DTensor's global shape) x the group's compute dtype size
     (``MixedPrecisionPolicy.param_dtype``: bf16 = 2 with ``dtype="bf16"``, the fp32 islands 4);
     ``largest_unsharded_layer`` the same summed over all groups of one decoder layer (what the planner's
     ``unsharded_params`` term holds for the current layer).

   Each component is also broken down by name class (``NAME_CLASSES``, ``name_class``).

Processes: every simulated rank is built in its own fresh process, which initialises the fake default process
group, counts and exits. The ranks are forked (at most ``min(cpus, 8)`` at a time) from one server process per
``dry_run`` (``sys.executable -c``, arguments pickled on stdin, the counts as JSON on stdout; or one for many calls
within ``reuse_server``) that imported torch and genoctx once, so a rank costs no import (~2.5 s each on a laptop when
every rank was its own interpreter). The calling process never initialises ``torch.distributed`` nor forks, so
``dry_run`` works the same whether or not it has a process group or threads of its own. One process per rank, not
one for all: DTensor's sharding-propagation caches are keyed by mesh equality (sizes and names, not the rank), so a
second rank built in the same process gets the first rank's mesh and coordinates back (and wrong local shapes).
"""

from __future__ import annotations

import contextlib
import time

import torch

from ..errors import GenoctxError
from ..model.config import KDA, ModelConfig
from ..parallel.layout import DIMS, Layout

NAME_CLASSES = ("embedding/head", "kda", "dsa", "moe_experts", "moe_other", "dense_mlp", "mhc", "norms", "other")
COMPONENTS = ("weights", "buffers", "gradients", "optimizer_state")
DTYPES = {"bf16": torch.bfloat16, "fp32": None}  # FSDP2 param_dtype of the all-gathered parameters


def name_class(name: str, cfg: ModelConfig) -> str:
    """The class of a parameter or buffer by its one-device name.

    ``embed_tokens.*``, ``lm_head.*``: ``embedding/head``; ``norm.*`` (final) and a decoder layer's
    ``input_layernorm``/``post_attention_layernorm``: ``norms``; ``layers.i.self_attn.*``: ``kda`` or ``dsa`` by
    the layer's type (the mixer's own norms included); ``layers.i.mlp.experts.*``: ``moe_experts`` (routed experts);
    the rest of a MoE layer's ``mlp`` (router ``gate`` and its bias, ``shared_experts``, load counts):
    ``moe_other``; a dense layer's ``mlp``: ``dense_mlp``; ``attn_hc``/``ffn_hc``: ``mhc``; anything else
    ``other``.
    """
    parts = name.split(".")
    if parts[0] in ("embed_tokens", "lm_head"):
        return "embedding/head"
    if parts[0] == "norm":
        return "norms"
    if parts[0] != "layers" or len(parts) < 3:
        return "other"
    i, part = int(parts[1]), parts[2]
    if part == "self_attn":
        return "kda" if cfg.layer_types[i] == KDA else "dsa"
    if part == "mlp":
        if cfg.mlp_layer_types[i] != "sparse":
            return "dense_mlp"
        return "moe_experts" if len(parts) > 3 and parts[3] == "experts" else "moe_other"
    if part in ("attn_hc", "ffn_hc"):
        return "mhc"
    if part.endswith("layernorm"):
        return "norms"
    return "other"


def _nbytes(t: torch.Tensor) -> int:
    """Local bytes of ``t`` (a DTensor's ``_local_tensor``), on any device, meta included."""
    local = getattr(t, "_local_tensor", t)
    return local.numel() * local.element_size()


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)


def _padded_numel(model) -> dict[int, int]:
    """``id(parameter) -> elements FSDP2 allocates for its shard on this rank``: every rank's piece is padded to
    the first piece's ``torch.chunk`` size (``FSDPParam.padded_sharded_param_size``), the storage the local shard
    is a view of."""
    from torch.distributed.fsdp import FSDPModule

    out = {}
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            for fp in group.fsdp_params if group is not None else ():
                out[id(fp.sharded_param)] = fp.padded_sharded_param_size.numel()
    return out


def _fsdp_groups(model) -> list[dict]:
    """FSDP2's parameter groups of ``model``: ``[{"module", "params", "bytes"}]``, ``bytes`` the all-gathered size
    (global numel of each managed parameter x its group's ``param_dtype`` size, the parameter's own dtype when
    None). Uses FSDP2's internal state (``_get_fsdp_state()._fsdp_param_group``)."""
    from torch.distributed.fsdp import FSDPModule

    names = {id(m): n for n, m in model.named_modules()}
    seen, groups = set(), []
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = m._get_fsdp_state()._fsdp_param_group
        if group is None or id(group) in seen:
            continue
        seen.add(id(group))
        total, n = 0, 0
        for fp in group.fsdp_params:
            numel = fp._orig_size.numel()
            orig = fp.sharded_param.dtype  # FSDPParam.init_dtype_attrs runs lazily: its rule, from mp_policy
            dt = fp.mp_policy.param_dtype if fp.mp_policy.param_dtype is not None and orig.is_floating_point else orig
            total += numel * torch.empty((), dtype=dt).element_size()
            n += numel
        groups.append({"module": names.get(id(m), "?") or "<root>", "params": n, "bytes": total})
    return groups


def _count_trainable(cfg: ModelConfig, model, dims, trainable: dict) -> dict:
    """What ``train.trainable`` / ``train.lora_rank`` / ``train.frozen_dtype`` change on this rank (issue 44): every
    parameter of a group that does not train is frozen (``requires_grad_(False)``, so that the optimizer built next
    holds none of it) and counted in bf16 at its FSDP2 shard; under fp8 the frozen matmul weights are no parameters
    but the ``FP8Weight`` holders the build made (``build_model``'s ``frozen_fp8``, as training builds them: 1 byte
    per element plus fp32 ``scale_inv`` blocks of 128 x 128), counted as this rank holds them (their buffers' local
    bytes: FSDP2 leaves them whole, expert parallelism slices the routed experts' on dim 0). The LoRA adapters are the
    build's own parameters (``build_model``'s ``lora``: placed by EP and FSDP2 as training places them) and train:
    ``_count_rank`` counts their masters, gradients and moments with the other trainable parameters; here only their
    padded local elements (``adapter_params_local``).

    Returns:
        ``{"frozen", "frozen_params_local", "adapter_params_local"}`` (bytes, or elements for ``*_params_local``)."""
    from ..model.fp8 import holders
    from ..model.groups import group_of, parse_trainable
    from ..model.lora import is_lora_name
    from ..parallel.state import local_targets

    groups = set(parse_trainable(trainable["trainable"]))
    params = dict(model.named_parameters())
    padded = _padded_numel(model) if dims.fsdp else {}
    out = dict.fromkeys(("frozen", "frozen_params_local", "adapter_params_local"), 0)
    for name, (local, _, _) in local_targets(model, dims, buffers=False).items():
        p = params[name]
        held = padded.get(id(p), local.numel())
        if is_lora_name(name):
            out["adapter_params_local"] += held
            continue
        if group_of(name, cfg.layer_types) in groups:
            continue
        p.requires_grad_(False)
        out["frozen_params_local"] += local.numel()
        out["frozen"] += 2 * held
    for h in holders(model).values():  # frozen fp8 (buffers, not FSDP's): what this rank holds of each
        out["frozen_params_local"] += _local(h.weight).numel()
        out["frozen"] += _nbytes(h.weight) + _nbytes(h.scale_inv)
    return out


def _frozen_fp8(cfg: ModelConfig, trainable: dict | None):
    """``build_model``'s ``frozen_fp8`` for ``train.frozen_dtype: fp8`` (``genoctx.train.frozen.frozen_matmuls``, 128 x
    128 blocks: the published checkpoint's), or None (bf16, or nothing frozen to hold)."""
    if trainable is None or trainable["frozen_dtype"] != "fp8":
        return None
    from ..parallel.build import FrozenFP8
    from .frozen import DEFAULT_BLOCK, frozen_matmuls

    names = frozen_matmuls(cfg, trainable["trainable"])
    return FrozenFP8(names, tuple(DEFAULT_BLOCK)) if names else None


def _lora(trainable: dict | None):
    """``build_model``'s ``lora`` (``genoctx.model.lora.LoRASpec``; alpha ``2 r``, any: sizes do not depend on it), or
    None without adapters."""
    if trainable is None or not trainable["lora_rank"]:
        return None
    from ..model.lora import DEFAULT_TARGETS, LoRASpec

    r = trainable["lora_rank"]
    return LoRASpec(r, 2.0 * r, tuple(trainable.get("lora_targets") or ()) or DEFAULT_TARGETS)


def _count_rank(cfg: ModelConfig, layout: Layout, rank: int, activation_checkpointing: bool, dtype: str,
                optimizer_offload: bool, optimizer_state_dtype: str = "fp32",
                trainable: dict | None = None) -> dict:  # fmt: skip
    """One simulated rank, the default process group not yet initialised: init (fake), build, count, destroy.
    ``trainable``: ``{"trainable", "lora_rank", "frozen_dtype", "lora_targets"}`` (``_count_trainable``), or None
    (everything trains)."""
    import torch.distributed as dist

    from ..model.fp8 import SUFFIX
    from ..parallel.build import build_model
    from ..parallel.mesh import init_parallel
    from ..parallel.state import canonical_state, local_targets
    from ..recipes import TrainConfig
    from .loop import build_optimizer

    t0 = time.perf_counter()
    dist.init_process_group("fake", rank=rank, world_size=layout.world)
    try:
        dims = init_parallel(layout.cp, "contiguous", ep=layout.ep, dp_shard=layout.dp_shard,
                             ep_folded=layout.ep_folded, fsdp_one=layout.fsdp_one)
        assert dims.layout == layout, (dims.layout, layout)
        model = build_model(cfg, dims, activation_checkpointing=activation_checkpointing,
                            param_dtype=DTYPES[dtype], offload_optimizer=optimizer_offload,
                            materialize=False, frozen_fp8=_frozen_fp8(cfg, trainable),
                            lora=_lora(trainable))  # fmt: skip
        split = _count_trainable(cfg, model, dims, trainable) if trainable is not None else None
        by_class = {c: dict.fromkeys(NAME_CLASSES, 0) for c in (*COMPONENTS, "params")}
        params = dict(model.named_parameters())
        padded = _padded_numel(model) if dims.fsdp else {}
        for name, (local, _, _) in local_targets(model, dims, buffers=False).items():
            cls = name_class(name, cfg)
            p = params[name]
            if not p.requires_grad:  # frozen (train.trainable): counted by _count_trainable
                continue
            held = padded.get(id(p), local.numel())  # FSDP2 allocates every rank's shard at the padded size
            by_class["weights"][cls] += held * local.element_size()
            by_class["params"][cls] += local.numel()
            if p.requires_grad:  # FSDP2's reduce-scatter output: the shard's padded size, the master's dtype
                p.grad = torch.zeros_like(p)
                by_class["gradients"][cls] += held * _local(p.grad).element_size()
                p.grad = None
        for name, b in model.named_buffers():
            if SUFFIX + "." not in name:  # an fp8 holder's: frozen weights (_count_trainable)
                by_class["buffers"][name_class(name, cfg)] += _nbytes(b)
        state: dict = {}
        if any(p.requires_grad for p in params.values()):  # (the adapters too: build_model made them)
            optimizer, _ = build_optimizer(model, TrainConfig(optimizer_state_dtype=optimizer_state_dtype), 1)
            canonical_state(model, optimizer, dims)  # zero exp_avg / exp_avg_sq (zeros_like, on meta)
            state = optimizer.state
        names = {id(p): n for n, p in params.items()}
        for p, st in state.items():
            cls = name_class(names[id(p)], cfg)
            by_class["optimizer_state"][cls] += sum(_nbytes(st[k]) for k in ("exp_avg", "exp_avg_sq") if k in st)
        groups = _fsdp_groups(model) if dims.fsdp else []
        largest = max(groups, key=lambda g: g["bytes"], default=None)
        per_layer: dict[int, int] = {}
        for g in groups:
            if g["module"].startswith("layers."):
                i = int(g["module"].split(".")[1])
                per_layer[i] = per_layer.get(i, 0) + g["bytes"]
        big = max(per_layer, key=per_layer.get, default=None)
        out = {
            "rank": rank,
            "coordinates": {"cp_rank": dims.cp_rank, "dp_rank": dims.dp_rank, "ep_rank": dims.ep_rank},
            **{c: sum(by_class[c].values()) for c in COMPONENTS},
            "params_local": sum(by_class["params"].values()),
            "largest_unsharded_group": {
                "module": largest["module"] if largest else None,
                "params": largest["params"] if largest else 0,
                "bytes": largest["bytes"] if largest else 0,
            },
            "largest_unsharded_layer": {"layer": big, "bytes": per_layer.get(big, 0) if big is not None else 0},
            "fsdp_groups": len(groups),
            "by_class": {c: {k: v for k, v in d.items() if v} for c, d in by_class.items()},
        }
        if split is not None:  # frozen weights in their dtype (the adapters train: counted above)
            out["trainable_params_local"] = sum(padded.get(id(p), _local(p).numel()) for p in params.values()
                                                if p.requires_grad)  # fmt: skip
            out["frozen"] = split["frozen"]
            out["weights"] += split["frozen"]
            out["params_local"] += split["frozen_params_local"]
            out["adapters"] = {"adapter_params_local": split["adapter_params_local"]}
        out["total_persistent"] = out["weights"] + out["buffers"] + out["gradients"] + out["optimizer_state"]
        out["seconds"] = round(time.perf_counter() - t0, 3)
        return out
    finally:
        dist.destroy_process_group()


def _rank_process(args: tuple) -> dict:
    """A simulated rank: ``_count_rank(*args)`` as ``{"ok": counts}``, or ``{"error": one line}``."""
    torch.set_num_threads(1)
    try:
        return {"ok": _count_rank(*args)}
    except GenoctxError as e:
        return {"error": str(e)}
    except Exception as e:  # noqa: BLE001 -- torch's errors while building: reported by the parent in one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return {"error": f"cannot build the model ({type(e).__name__}: {first})"}


def _fork_ranks(jobs: list[tuple], workers: int) -> dict[int, dict]:
    """Fork one child per job (a ``_count_rank`` argument tuple), at most ``workers`` at a time, each writing its
    ``_rank_process`` dict to a file; ``{rank: dict}`` (a child that died without writing: an ``"error"`` naming
    how). A child's fd 1 is its fd 2: nothing a rank prints reaches the server's answers on stdout."""
    import json
    import os
    import shutil
    import sys
    import tempfile

    tmp = tempfile.mkdtemp(prefix="genoctx-dryrun-")
    running: dict[int, int] = {}  # pid -> rank
    results: dict[int, dict] = {}
    try:
        todo = list(jobs)
        while todo or running:
            while todo and len(running) < workers:
                args = todo.pop(0)
                rank, path = args[2], os.path.join(tmp, f"rank{args[2]}.json")
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:  # the rank: count, write, leave without running the server's exit handlers
                    code = 1
                    try:
                        os.dup2(2, 1)
                        doc = _rank_process(args)
                        with open(path + ".tmp", "w") as f:
                            json.dump(doc, f)
                        os.replace(path + ".tmp", path)
                        code = 0
                    finally:
                        os._exit(code)
                running[pid] = rank
            pid, status = os.wait()
            rank = running.pop(pid)
            path = os.path.join(tmp, f"rank{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    results[rank] = json.load(f)
            else:
                code = os.waitstatus_to_exitcode(status)
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                results[rank] = {"error": f"the rank's process failed ({how})"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def _server_main() -> None:
    """The rank server (``_run``): requests on stdin, each a 4-byte big-endian length and the pickled ``(jobs,
    workers)`` (``_fork_ranks``); for each, ``{rank: dict}`` as one JSON line on stdout; ends at end of input. It
    imports once what every rank needs (torch.distributed's FSDP, genoctx's build, and ``torch._dynamo``, which
    torch imports on a rank's first meta-device ``normal_``: ~1.2 s a rank otherwise) and never initialises a
    process group or builds a model itself, so every rank, of the first request or a later one, is a fork of the
    same state."""
    import json
    import pickle
    import struct
    import sys

    import torch._dynamo  # noqa: F401 -- see the docstring
    import torch.distributed.fsdp  # noqa: F401 -- what every rank imports, imported once before the forks

    from ..parallel import build, mesh, state  # noqa: F401
    from . import loop  # noqa: F401

    inp = sys.stdin.buffer
    while len(head := inp.read(4)) == 4:
        jobs, workers = pickle.loads(inp.read(struct.unpack("!I", head)[0]))
        results = _fork_ranks(jobs, workers)
        sys.stdout.write(json.dumps({str(r): doc for r, doc in results.items()}) + "\n")
        sys.stdout.flush()


_SERVER_CODE = "from genoctx.train.dryrun import _server_main; _server_main()"


class _Server:
    """A rank server (``_server_main``) kept for several ``dry_run`` calls (``reuse_server``); its stderr goes to a
    temporary file, read back when it fails."""

    def __init__(self) -> None:
        import subprocess
        import sys
        import tempfile

        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER_CODE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err)  # fmt: skip

    def ask(self, request: bytes) -> tuple[str, str]:
        """(stdout line, "") for one request (``_run``); ("", its stderr) when the server died (it is then closed)."""
        import struct

        try:
            self.proc.stdin.write(struct.pack("!I", len(request)) + request)
            self.proc.stdin.flush()
            line = self.proc.stdout.readline().decode()
        except OSError:  # a broken pipe: the server is gone
            line = ""
        if line:
            return line, ""
        self.close()
        self.err.seek(0)
        err = self.err.read().decode(errors="replace") or f"exit code {self.proc.returncode}"
        self.err.close()
        return "", err

    def close(self) -> None:
        """End the server (end of its input; killed if it has not exited within 60 s)."""
        import subprocess

        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


_kept: list[_Server | None] = []  # the stack of reuse_server blocks: None until a dry run starts the block's server


@contextlib.contextmanager
def reuse_server():
    """Within the block, every ``dry_run`` of this process asks one rank server, started by the first of them and
    stopped when the block ends, instead of starting one per call (~3 s of imports each on a small CPU). Each
    simulated rank is still a fresh fork of the server's imported state (``_server_main``), so the counts are the
    same; only the server's environment and working directory are those of the first call. For callers that dry
    run many layouts in one process (the tests)."""
    _kept.append(None)
    try:
        yield
    finally:
        server = _kept.pop()
        if server is not None:
            server.close()
            server.err.close()


def _run(cfg, layout, ranks, activation_checkpointing, dtype, optimizer_offload, optimizer_state_dtype,
         trainable=None) -> dict:  # fmt: skip
    """Every rank in its own fresh process, forked from a server process (``_server_main``) that imported torch and
    genoctx once (one per call, or the one of ``reuse_server``): DTensor's sharding-propagation caches are keyed by
    mesh equality, not by rank, so a second rank built in the same process would get the first rank's mesh (and
    coordinates) back; this process never touches ``torch.distributed``."""
    import json
    import os
    import pickle
    import struct
    import subprocess
    import sys

    t0 = time.perf_counter()
    workers = max(1, min(len(ranks), os.cpu_count() or 1, 8))
    jobs = [(cfg, layout, r, activation_checkpointing, dtype, optimizer_offload, optimizer_state_dtype, trainable)
            for r in ranks]  # fmt: skip
    request = pickle.dumps((jobs, workers))
    if _kept:
        if _kept[-1] is None:
            _kept[-1] = _Server()
        out, err = _kept[-1].ask(request)
        if not out:
            _kept[-1] = None  # the next call starts another
    else:
        proc = subprocess.run([sys.executable, "-c", _SERVER_CODE], input=struct.pack("!I", len(request)) + request,
                              capture_output=True)  # fmt: skip
        out, err = proc.stdout.decode(), proc.stderr.decode(errors="replace") or f"exit code {proc.returncode}"
    try:
        docs = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (err.strip().splitlines() or ["no output"])[-1]
        raise GenoctxError(f"dry run {layout.describe()}: the dry run's process failed ({tail})") from None
    results: dict[int, dict] = {}
    for r in ranks:
        doc = docs.get(str(r), {"error": "the rank's process failed (no result)"})
        if "error" in doc:
            raise GenoctxError(f"dry run {layout.describe()} rank {r}: {doc['error']}")
        results[r] = doc["ok"]
    results = [results[r] for r in ranks]
    return {
        "layout": {**{d: getattr(layout, d) for d in DIMS}, "ep_folded": layout.ep_folded, "world": layout.world},
        "dtype": dtype,
        "activation_checkpointing": activation_checkpointing,
        "optimizer_offload": optimizer_offload,
        "optimizer_state_dtype": optimizer_state_dtype,
        **({"trainable": trainable} if trainable is not None else {}),
        "units": "bytes",
        "ranks": results,
        "seconds": round(time.perf_counter() - t0, 3),
        "process": "one fresh process per simulated rank, forked from a preloaded server (fake backend, meta device)",
    }


def dry_run(
    cfg: ModelConfig,
    layout: Layout,
    *,
    ranks: list[int] | str | None = None,
    activation_checkpointing: bool = True,
    dtype: str = "bf16",
    optimizer_offload: bool = False,
    optimizer_state_dtype: str = "fp32",
    trainable: str = "all",
    lora_rank: int = 0,
    frozen_dtype: str = "bf16",
    lora_targets: tuple[str, ...] | None = None,
) -> dict:
    """Build ``cfg`` on ``layout`` for each simulated rank (module docstring) and count its bytes.

    Args:
        cfg: the model (any size: nothing is allocated, the model stays on the meta device).
        layout: ``dp_replicate x ep x dp_shard x cp`` (``Layout``); ``world`` ranks are simulated one at a time.
        ranks: the ranks to build: None = rank 0 and the last rank; ``"all"`` = every rank; or a list of ranks.
        activation_checkpointing: ``apply_ac`` (names and counts are the same either way; run as training runs).
        dtype: ``"bf16"`` (FSDP2 all-gathers bf16, fp32 islands, fp32 masters) or ``"fp32"``.
        optimizer_offload: FSDP2 ``CPUOffloadPolicy`` (the counted pieces then live in host memory).
        optimizer_state_dtype: AdamW's moments, ``"fp32"`` or ``"bf16"`` (``train.optimizer_state_dtype``).
        trainable, lora_rank, frozen_dtype, lora_targets: ``train.trainable`` and its keys (issue 44,
            ``_count_trainable``): frozen tensors counted in ``frozen_dtype`` (no gradient, no moments), the LoRA
            adapters placed as their targets. Each rank then also has ``"frozen"`` (bytes, included in ``weights``),
            ``"trainable_params_local"`` (padded) and ``"adapters"``; ``params_local`` counts every local element.

    Returns:
        A JSON-ready dict: ``{"layout": {dp_replicate, ep, dp_shard, cp, world}, "dtype", "activation_checkpointing",
        "optimizer_offload", "optimizer_state_dtype", "units": "bytes", "seconds", "process", "ranks": [per rank:
        {"rank", "coordinates", "weights", "buffers", "gradients", "optimizer_state", "total_persistent",
        "params_local", "largest_unsharded_group": {"module", "params", "bytes"}, "largest_unsharded_layer":
        {"layer", "bytes"}, "fsdp_groups", "by_class": {component or "params": {class: bytes or params}},
        "seconds"}]}``; all sizes in bytes (ints), ``params_local`` in parameters.

    Raises:
        GenoctxError: a bad ``dtype``, ``optimizer_state_dtype`` or ``ranks``, a layout this model cannot be built
            on (``ep`` not dividing the routed experts, ...), or a failure while building (one line naming the
            layout).
    """
    if dtype not in DTYPES:
        raise GenoctxError(f"dry run: dtype must be bf16 or fp32, got {dtype!r}")
    if optimizer_state_dtype not in DTYPES:
        raise GenoctxError(f"dry run: optimizer_state_dtype must be bf16 or fp32, got {optimizer_state_dtype!r}")
    W = layout.world
    if ranks is None:
        ranks = sorted({0, W - 1})
    elif ranks == "all":
        ranks = list(range(W))
    elif isinstance(ranks, str) or not all(isinstance(r, int) and 0 <= r < W for r in ranks):
        raise GenoctxError(f"dry run: ranks must be 'all' or ranks in [0, {W}), got {ranks!r}")
    moe = "sparse" in cfg.mlp_layer_types
    if (moe and cfg.n_routed_experts % layout.ep) or (not moe and layout.ep > 1):
        raise GenoctxError(
            f"dry run {layout.describe()}: ep {layout.ep} must divide the "
            f"{cfg.n_routed_experts if moe else 0} routed experts"
        )
    tr = None
    if trainable != "all" or lora_rank or frozen_dtype != "bf16" or lora_targets is not None:
        from ..plan.trainable import check_trainable

        try:
            t = check_trainable(trainable, lora_rank, frozen_dtype, lora_targets)
        except ValueError as e:
            raise GenoctxError(f"dry run: {e}") from None
        tr = {"trainable": t.spec, "lora_rank": t.lora_rank, "frozen_dtype": t.frozen_dtype,
              "lora_targets": list(t.lora_targets) if t.lora_targets else None}  # fmt: skip
    if optimizer_offload and not layout.fsdp:
        raise GenoctxError(f"dry run {layout.describe()}: optimizer offload needs FSDP (dp_shard > 1 or cp > 1)")
    try:
        return _run(cfg, layout, list(ranks), activation_checkpointing, dtype, optimizer_offload,
                    optimizer_state_dtype, tr)  # fmt: skip
    except GenoctxError:
        raise
    except Exception as e:  # noqa: BLE001 -- torch's errors while building: one line naming the layout
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise GenoctxError(f"dry run {layout.describe()}: cannot build the model ({type(e).__name__}: {first})") from e


__all__ = ["NAME_CLASSES", "dry_run", "name_class", "reuse_server"]
