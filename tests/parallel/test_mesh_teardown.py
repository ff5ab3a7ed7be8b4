"""Leaving the mesh (``genoctx.parallel.mesh.leaving_mesh`` / ``destroy_parallel``) frees every gloo group first.

A group still alive at interpreter exit is destroyed during finalisation, where gloo's threads can end the rank with
SIGABRT ("terminate called without an active exception"); that failed CI once. Here two gloo ranks build the mesh
(cp=2: several groups, each with its own gloo threads), keep it in a reference cycle and in a failing frame, and
leave: afterwards the process has no more native threads than before ``init_process_group``, the default group is
gone, an error comes through unchanged, and the ranks exit 0 with nothing from ``std::terminate`` on stderr.
Without ``leaving_mesh`` (mode ``bare``) the gloo threads are still there: the count would catch its absence.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("teardown_worker.py")


def _run(tmp: Path, mode: str) -> tuple[list[dict], str]:
    p = subprocess.run([sys.executable, str(WORKER), str(tmp), mode], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)], p.stderr


@pytest.mark.parametrize("mode", ["ok", "error"])
def test_leaving_the_mesh_joins_every_gloo_thread(tmp_path, mode):
    ranks, stderr = _run(tmp_path, mode)
    for r in ranks:
        assert r["during"] > r["before"], r  # the groups had threads
        assert r["after"] <= r["before"], r  # and none is left
        assert r["initialized"] is False
        assert r["raised"] == ("a failure on the mesh" if mode == "error" else None)
    assert "terminate called" not in stderr


def test_without_leaving_the_mesh_gloo_threads_stay(tmp_path):
    ranks, _ = _run(tmp_path, "bare")
    for r in ranks:
        assert r["after"] > r["before"], r
