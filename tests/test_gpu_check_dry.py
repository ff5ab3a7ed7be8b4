"""``bash bench/gpu_check.sh --dry mesh``: the GPU check's mesh section (issue 43) on the CPU, as CI runs it.

The same code as on a GPU at tiny sizes: fla's KDA check skipped with a line saying why (no CUDA), a Ray started by
the section, ``genoctx train --num-workers 1 --gpus-per-worker 0`` (gloo) of the tiny recipe with FSDP2 on the
one worker (``train.fsdp_one``) and ``offload_optimizer``, bf16 autocast, activation checkpointing with
offload_activations and ``--seq-chunk`` (a DCP checkpoint; stopped after step 1, then ``--resume``),
``genoctx eval --num-workers 1`` on the mesh and in one process, the memory plan, and an in-process FSDP2 step with
both offloads on a world-1 mesh. Every line is one JSON measurement of the section; none is an error.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_mesh_section_runs_dry():
    env = {**os.environ, "PYTHON": sys.executable}
    p = subprocess.run(["bash", "bench/gpu_check.sh", "--dry", "mesh"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=480)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [json.loads(ln) for ln in p.stdout.splitlines()]
    assert lines and all(x["bench"] == "gpu_check" and x["section"] == "mesh" for x in lines)
    assert not [x for x in lines if "error" in x], p.stderr[-3000:]
    by = {x["what"]: x for x in lines}
    assert by["kda_fla"]["skipped"].startswith("no CUDA")
    offload = by["mesh_offload_optimizer"]  # world size 1 with train.fsdp_one: FSDP2 and optimizer offload, planned
    assert offload["planner"] == "accepted" and offload["fsdp2_applied"] is True and offload["offload_optimizer"]
    assert offload["layout"] == "dp_replicate=1 ep=1 dp_shard=1 (fsdp) cp=1" and offload["predicted_host_gib"] > 0
    first, resumed = by["mesh_train"], by["mesh_resume"]
    assert (first["step"], first["resumed_from"], resumed["step"], resumed["resumed_from"]) == (1, None, 2, 1)
    for run in (first, resumed):  # the mesh's checkpoint path (DCP shards) of the one-rank FSDP2 layout
        assert run["checkpoint_format"] == "dcp" and run["checkpoint_layout"]["fsdp_one"] is True
    assert [(s, a) for s, a, _ in by["mesh_metrics"]["steps"]] == [(1, 1), (2, 2)]  # step 2 by the resumed attempt
    assert by["mesh_metrics"]["kda_paths"] == ["chunk"]
    ev = by["mesh_eval_vs_one_process"]
    assert math.isfinite(ev["mesh"]) and ev["rel_diff"] <= 1e-4  # the same checkpoint scores the same on the mesh
    host = by["mesh_host"]
    assert host["seq_chunk"] == 128 and host["offloaded_copies"] > 0 and math.isfinite(host["loss"])
    assert host["fsdp2_applied"] is True and host["offload_optimizer"] is True
    assert by["mesh_plan"]["predicted_gib"] > 0
