"""Shared test setup. TRITON_INTERPRET must be set before any @triton.jit is defined: without CUDA the Triton
kernels (kernels/) run under the interpreter on CPU tensors. ``import torch`` imports no Triton."""

import os

# One OpenMP thread per process unless the caller chose: set before torch is imported, so that subprocesses, gloo
# ranks and Ray workers inherit it. On 2 cores, 2+ ranks each running 2 threads oversubscribe (~3x slower suite).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray Train's controller polls its workers every 2 s by default, so a finished run ends up to 2 s (measured ~3 s with
# the checkpoint's report) after its last step; the Ray clusters the tests start inherit a shorter poll. Its timeout
# for a hanging worker (10 min) is unchanged.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
from genoctx.heap import keep_freed_memory  # noqa: E402

keep_freed_memory()  # the tests' steps run on the CPU: as genoctx's CLI does there (genoctx.heap)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
REALDNA = REPO / "data" / "hg38"


# Tests that start Ray (or many processes at once) run one after another on one pytest-xdist worker (`-n 2 --dist
# loadgroup`, pyproject's addopts): two local Ray clusters on 2 cores would starve each other's placement timeouts.
# The group is the suite's critical path on its worker: what starts no Ray (test_bench_trainable.py: one CLI
# subprocess at a time) stays out of it.
SERIAL_FILES = {
    "test_cluster.py", "test_cluster_logs.py", "test_distributed.py", "test_mesh_eval.py", "test_gpu_check_dry.py",
    "test_worker_env.py", "test_eval_precision.py", "test_no_silent_drops.py", "test_doctor.py", "test_cli.py",
    "test_progress_lines.py",
}  # fmt: skip


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks into the node ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SERIAL_FILES:
            item.add_marker(pytest.mark.xdist_group("serial"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def realdna() -> Path:
    """Folder with the embedded real hg38 pieces (chr1, chr2, chr22, chrM)."""
    return REALDNA


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> Path:
    """A small prepared data set from real DNA: train = chrM (2k windows), eval = the chr22 piece."""
    from genoctx.data.windows import prepare

    out = tmp_path_factory.mktemp("prepared")
    prepare(
        [REALDNA / "hg38_chrM.fa", REALDNA / "hg38_chr22_32000001-32300000.fa"],
        out,
        window=2048,
        train_chroms=["chrM"],
        eval_chroms=["chr22"],
        progress=False,
    )
    return out
