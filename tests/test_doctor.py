"""``genoctx doctor`` on a CPU machine (CI's): versions, no GPU, what is missing, exit codes, Ray's resources.

The kernels' ahead-of-time compile itself (about 25 CPU-seconds a target) is what
``tests/kernels/test_compile_targets.py`` runs; here its result's plumbing is checked with a fake worker result and
a worker that cannot start. Ray's resources come from a fake ``ray`` module (a real cluster takes ~10 s to start).
"""

from __future__ import annotations

import json
import sys
import types
from importlib.metadata import version

import pytest
import torch
from typer.testing import CliRunner

from genoctx import doctor
from genoctx.cli import app
from tests.cli_runner import run_genoctx


def _doc(res) -> dict:
    return json.loads(res.stdout)


def test_doctor_on_cpu_reports_versions_no_gpu_and_exits_1():
    res = run_genoctx("doctor")
    assert res.returncode == 1, res.stderr
    doc = _doc(res)
    v = doc["versions"]
    assert v["torch"] == torch.__version__ and v["cuda"] == torch.version.cuda is None
    assert v["nccl"] is None and v["triton"] == version("triton") and v["fla"] == version("fla-core")
    assert v["ray"] == version("ray") and v["genoctx"] == version("genoctx")
    assert doc["gpus"] == [] and doc["ray"] is None and doc["ok"] is False
    assert doc["missing"][0] == "no CUDA GPU"
    assert any("CPU build" in m and "docs/cluster.md" in m for m in doc["missing"])
    assert any(m.startswith("no NCCL") for m in doc["missing"])
    assert list(doc["kernels"]) == ["skipped"] and "--targets sm_90,sm_100" in doc["kernels"]["skipped"]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("genoctx: doctor: missing: no CUDA GPU; "), res.stderr


def test_cpu_ok_reports_the_same_and_exits_0():
    res = run_genoctx("doctor", "--cpu-ok", "--targets", "none")
    assert res.returncode == 0, res.stderr
    doc = _doc(res)
    assert doc["ok"] is True and doc["cpu_ok"] is True and doc["missing"][0] == "no CUDA GPU"
    assert doc["kernels"] == {"skipped": "--targets none"}
    assert "(--cpu-ok: not a failure)" in res.stderr


@pytest.mark.parametrize(
    "args, names",
    [(["--address", "127.0.0.1:1"], "--address 127.0.0.1:1"), (["--targets", "sm_80"], "--targets sm_80")],
)
def test_bad_input_is_one_line_and_exit_2(args, names):
    res = run_genoctx("doctor", *args)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith(f"genoctx: error: {names}") and res.stderr.count("\n") == 1, res.stderr


def test_a_kernel_that_does_not_compile_is_missing_even_with_cpu_ok(monkeypatch):
    rows = [
        {"op": "sparse_mla fwd", "kernel": "_fwd_kernel", "compiled": True, "fits": True, "error": None},
        {"op": "sparse_mla bwd", "kernel": "_bwd_kernel", "compiled": False, "fits": False, "error": "E: no dot"},
        {"op": "indexer_topk", "kernel": "_indexer_topk_kernel", "compiled": True, "fits": False, "error": None},
    ]
    summary = doctor._summarize("sm_90", rows, 1.0)
    assert (summary["launches"], summary["compiled"], summary["fit"], summary["ok"]) == (3, 2, 1, False)
    assert summary["failures"] == [
        "sparse_mla bwd (_bwd_kernel): E: no dot",
        "indexer_topk (_indexer_topk_kernel): does not fit",
    ]
    good = doctor._summarize("sm_100", rows[:1], 1.0)
    assert good["ok"] and good["failures"] == []
    monkeypatch.setattr(doctor, "compile_kernels", lambda targets: {"sm_90": summary, "sm_100": good})
    res = CliRunner().invoke(app, ["doctor", "--targets", "sm_90,sm_100", "--cpu-ok"])
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and set(doc["kernels"]) == {"sm_90", "sm_100"}
    assert doc["missing"][-1] == "genoctx's kernels do not compile for sm_90: " + "; ".join(summary["failures"])
    assert not any("sm_100" in m for m in doc["missing"])


def test_compile_kernels_runs_one_worker_per_target_and_reports_what_fails(monkeypatch):
    """The process plumbing with stand-in workers: rows printed by the worker are summed, a worker that exits with
    an error is its last stderr line, one past the timeout is named, a target outside sm_90/sm_100 is not run."""
    rows = [{"op": "sparse_mla fwd", "kernel": "_fwd_kernel", "compiled": True, "fits": True, "error": None}] * 3
    script = (
        "import json, sys, time\n"
        "t = sys.argv[1]\n"
        f"if t == 'sm_90': print('ptxas noise'); [print(json.dumps(r)) for r in {rows!r}]\n"
        "elif t == 'sm_100': sys.exit('RuntimeError: no ptxas for sm_100')\n"
        "else: time.sleep(30)\n"
    )
    monkeypatch.setattr(doctor, "WORKER", [sys.executable, "-c", script])
    monkeypatch.setattr(doctor, "CHECKED_TARGETS", ("sm_90", "sm_100", "sm_99"))
    out = doctor.compile_kernels(["sm_90", "sm_100", "sm_99", "sm_80"], timeout=5)
    assert list(out) == ["sm_90", "sm_100", "sm_99", "sm_80"]
    assert {k: out["sm_90"][k] for k in ("launches", "compiled", "fit", "ok", "failures")} == {
        "launches": 3, "compiled": 3, "fit": 3, "ok": True, "failures": []
    }  # fmt: skip
    assert out["sm_100"] == {"target": "sm_100", "checked": True, "ok": False,
                             "failures": ["RuntimeError: no ptxas for sm_100"]}  # fmt: skip
    assert out["sm_99"]["failures"] == ["compiling took over 5 s"]
    assert out["sm_80"]["checked"] is False and "sm_90" in out["sm_80"]["why"]


class _FakeRay(types.ModuleType):
    def __init__(self, gpus: float):
        super().__init__("ray")
        self.gpus, self.calls = gpus, []
        self.LoggingConfig = lambda **kw: kw

    def init(self, **kw):
        self.calls.append(("init", kw["address"]))

    def shutdown(self):
        self.calls.append(("shutdown",))

    def nodes(self):
        return [{"Alive": True}, {"Alive": True}, {"Alive": False}]

    def cluster_resources(self):
        return {"CPU": 32.0, "GPU": self.gpus, "memory": 64 * 2**30, "node:10.0.0.1": 1.0, "accelerator_type:H100": 2.0}

    def available_resources(self):
        return {"CPU": 30.0, "GPU": self.gpus / 2, "memory": 60 * 2**30, "node:10.0.0.1": 1.0}


@pytest.mark.parametrize("gpus", [16.0, 0.0])
def test_address_reports_the_clusters_resources(monkeypatch, gpus):
    ray = _FakeRay(gpus)
    monkeypatch.setitem(sys.modules, "ray", ray)
    res = CliRunner().invoke(app, ["doctor", "--address", "auto", "--cpu-ok", "--targets", "none"])
    doc = json.loads(res.stdout)
    assert doc["ray"] == {
        "address": "auto",
        "nodes": 2,
        "total": {"CPU": 32.0, "GPU": gpus, "accelerator_type:H100": 2.0, "memory_gib": 64.0},
        "free": {"CPU": 30.0, "GPU": gpus / 2, "memory_gib": 60.0},
    }
    assert ray.calls == [("init", "auto"), ("shutdown",)]
    if gpus:
        assert res.exit_code == 0 and doc["ok"], res.output
    else:
        assert res.exit_code == 1 and doc["missing"][-1] == "the Ray cluster at auto has no GPU"


def test_a_gpu_machine_as_torch_would_describe_it(monkeypatch):
    """What the doctor reads from torch on an H100 machine (torch's answers stood in): GPUs, their target, NCCL's
    version, and nothing missing."""
    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=85_045_100_544, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 7))
    devices = doctor.gpus()
    assert devices == [
        {"index": i, "name": props.name, "memory_gib": 79.2, "capability": "9.0", "target": "sm_90"} for i in (0, 1)
    ]
    assert doctor._targets(None, devices) == ["sm_90"]
    v = doctor.versions()
    assert (v["cuda"], v["nccl"]) == ("13.0", "2.27.7")
    ok = {"sm_90": {"checked": True, "ok": True, "failures": []}}
    assert doctor._missing(v, devices, ok, None) == ([], [])
