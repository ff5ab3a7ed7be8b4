"""``--device cuda:N`` makes device N the process's current CUDA device before anything runs (issue 43 item 6).

Triton launches on the current device (and NCCL and ``torch.cuda`` calls without a device use it): with tensors on
``cuda:1`` and the current device 0 a kernel reads the wrong GPU's memory. Without a GPU the CUDA side is replaced by
genoctx's own functions (``genoctx.cli.common._cuda_devices``, ``_set_cuda_device``, ``_expandable_segments``);
torch.cuda itself is never patched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def cli(monkeypatch, tmp_path):
    """``run(verb, *args) -> (result, calls)``: ``genoctx train|eval`` in-process on a machine said to have 2 GPUs,
    the work itself replaced by a recorder; ``calls`` lists, in order, the allocator setting ("alloc"), each
    ``set_device`` index and the device the verb's function got."""
    from typer.testing import CliRunner

    from genoctx.cli import app

    calls: list = []
    monkeypatch.setattr("genoctx.cli.common._cuda_devices", lambda: 2)
    monkeypatch.setattr("genoctx.cli.common._expandable_segments", lambda: calls.append("alloc"))
    monkeypatch.setattr("genoctx.cli.common._set_cuda_device", lambda index: calls.append(index))
    monkeypatch.setattr("genoctx.eval.position.evaluate", lambda c, d, **kw: calls.append(kw["device"]) or {"ok": 1})
    monkeypatch.setattr("genoctx.train.loop.train", lambda d, r, o, **kw: calls.append(kw["device"]) or {"ok": 1})
    (tmp_path / "manifest.json").write_text("{}")

    def run(verb, *args):
        calls.clear()
        if verb == "eval":
            argv = ["eval", "--data", str(tmp_path), "--markov", "2", "--format", "json", *args]
        else:
            argv = ["train", "--data", str(tmp_path), "--recipe", str(REPO / "recipes" / "tiny.yaml"), "--out",
                    str(tmp_path / "run"), *args]  # fmt: skip
        return CliRunner().invoke(app, argv), list(calls)

    return run


@pytest.mark.parametrize("verb", ["train", "eval"])
def test_device_cuda_n_is_made_current_before_the_verb_runs(cli, verb):
    res, calls = cli(verb, "--device", "cuda:1")
    assert res.exit_code == 0 and json.loads(res.stdout) == {"ok": 1}, res.output
    assert calls == ["alloc", 1, "cuda:1"]
    res, calls = cli(verb, "--device", "cuda")
    assert calls == ["alloc", 0, "cuda"]
    res, calls = cli(verb, "--device", "cpu")
    assert calls == ["cpu"]  # no CUDA call at all


def test_a_device_index_past_the_last_gpu_is_one_line(cli):
    res, calls = cli("train", "--device", "cuda:2")
    assert res.exit_code == 2 and calls == [], res.output
    assert res.stderr == "genoctx: error: --device cuda:2: this machine has 2 CUDA devices (cuda:0 to cuda:1)\n"


def test_every_triton_launch_runs_on_its_tensors_device():
    """Each ``kernel[grid](...)`` in kernels/ is inside ``with on_device(tensor)`` (``torch.cuda.device`` of the
    tensors' device on CUDA, nothing on the CPU's interpreter), so a library call with tensors on ``cuda:1`` launches
    there whatever the current device is."""
    import ast

    import torch

    from kernels.launch import on_device

    launches = []
    for path in sorted((REPO / "kernels").glob("*.py")):
        tree = ast.parse(path.read_text())
        guarded = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.With) and any(
                isinstance(i.context_expr, ast.Call) and getattr(i.context_expr.func, "id", None) == "on_device"
                for i in node.items
            ):
                guarded |= {id(n) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):  # kernel[grid](...)
                launches.append((path.name, node.lineno, id(node) in guarded))
    assert {name for name, _, _ in launches} == {"indexer_topk.py", "sparse_mla.py"}
    assert [x for x in launches if not x[2]] == []
    with on_device(torch.zeros(1)):  # the interpreter's CPU tensors: no CUDA call
        pass
