"""One checkpoint, one precision: evaluation in one process and on the mesh run their forwards under the policy of
``genoctx.eval.scoring.eval_precision`` (issue 43 item 12: one-GPU eval ran fp32 while the mesh ran bf16 autocast,
so the same checkpoint scored differently).

On CUDA the policy is bf16 autocast (and bf16 all-gathers on the mesh); the CPU runs fp32. To see the policy act
without a GPU, the CPU entry of ``EVAL_DTYPES`` is set to bf16 (CPU autocast rounds as CUDA's does): both paths must
then give the same losses, bit for bit, and not the fp32 ones. The mesh is one rank in this process (a gloo group of
size 1 around the real ``_eval_worker``), so the patched table is what it reads too.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from genoctx.eval.distributed import MeshEval
from genoctx.eval.position import evaluate
from genoctx.eval.scoring import EVAL_DTYPES, eval_precision

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "parallel"))
from mesh_runner import LocalSession  # noqa: E402
from mesh_worker import mesh_config, mesh_model  # noqa: E402

REALDNA = HERE.parents[1] / "data" / "hg38"


def in_process(worker_fn, config, *, num_workers, **_):
    """``run_workers`` as one rank in this process (a gloo group of size 1): the worker sees this process's state."""
    import torch.distributed as dist

    from genoctx.cluster import WorkerRun
    from genoctx.parallel.mesh import leaving_mesh

    assert num_workers == 1
    threads = torch.get_num_threads()  # the worker sets its own (worker_threads): this process's are put back
    glog = logging.getLogger("genoctx")  # and its logging (worker_logging): later tests log through the root again
    saved = glog.handlers[:], glog.level, glog.propagate
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with leaving_mesh():
            return WorkerRun(0.0, worker_fn(config, LocalSession()))
    finally:
        torch.set_num_threads(threads)
        glog.handlers[:], glog.level, glog.propagate = saved


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from genoctx.data.windows import prepare
    from genoctx.recipes import Recipe, TrainConfig
    from genoctx.train.checkpoint import save_checkpoint

    root = tmp_path_factory.mktemp("precision")
    seq = "".join(ln.strip() for ln in (REALDNA / "hg38_chr22_32000001-32300000.fa").read_text().splitlines()[1:])
    seq = seq[30_000:].replace("N", "").replace("n", "")
    (root / "d.fa").write_text(f">chrE\n{seq[:64]}\n>chrT\n{seq[1000:3000]}\n")
    prepare([root / "d.fa"], root / "data", window=64, train_chroms=["chrT"], eval_chroms=["chrE"], progress=False)
    save_checkpoint(root / "run", 1, mesh_model(), None, None, Recipe(model=mesh_config(), train=TrainConfig()), {})
    return root / "run", root / "data"


def test_cuda_evaluates_in_bf16_autocast_and_the_cpu_in_fp32():
    cuda, cpu = eval_precision("cuda:1"), eval_precision("cpu")
    assert (cuda.device_type, cuda.dtype, cuda.param_dtype) == ("cuda", torch.bfloat16, torch.bfloat16)
    assert (cpu.dtype, cpu.param_dtype, cpu.describe()) == (None, None, "fp32")
    with cpu.autocast():
        assert not torch.is_autocast_enabled("cpu")


def test_one_process_and_the_mesh_score_a_checkpoint_in_the_same_precision(setup, monkeypatch):
    run, data = setup
    args = dict(bins="linear:2", resamples=10, seed=0)
    fp32 = evaluate([run], data, **args)["models"][0]["overall"]["loss"]
    monkeypatch.setitem(EVAL_DTYPES, "cpu", torch.bfloat16)
    one = evaluate([run], data, **args)["models"][0]["overall"]["loss"]
    mesh = evaluate([run], data, mesh=MeshEval(in_process, 1), **args)["models"][0]["overall"]["loss"]
    assert one == mesh  # the same policy: bit for bit
    assert one != fp32 and one == pytest.approx(fp32, rel=2e-2)  # and it did act (bf16 rounding, not another model)
