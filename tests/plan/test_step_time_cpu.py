"""bench/step_time_cpu.py's arithmetic on made-up measurements (nothing timed here): the CPU hardware profile built
from microbenchmark results, and the summary's error band and rankings."""

import importlib.util
from pathlib import Path

import pytest

from genoctx.model.config import preset
from genoctx.parallel.layout import Layout
from genoctx.plan.hardware import hardware_from_dict
from genoctx.plan.time import plan_time

PATH = Path(__file__).resolve().parents[2] / "bench" / "step_time_cpu.py"
spec = importlib.util.spec_from_file_location("step_time_cpu", PATH)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def _rank(gemm_s: float, mem_s: float) -> dict:
    return {
        "gemm": [{"flops": 2e9, "seconds": gemm_s}, {"flops": 1e9, "seconds": gemm_s}],  # 3e9 FLOPs in 2 gemm_s
        "bmm": [{"shape": [128, 64, 32, 64], "flops": 6e8, "seconds": 0.05},
                {"shape": [2048, 4, 64, 271], "flops": 4e8, "seconds": 0.2}],  # 1e9 FLOPs in 0.25 s
        "memory": {"bytes": 3e9, "seconds": mem_s},
        "eager": [{"op": "add", "bytes": 1e9, "seconds": mem_s}, {"op": "exp", "bytes": 5e8, "seconds": mem_s}],
        "gather": {"bytes": 3e8, "seconds": mem_s, "shape": [2048, 64, 64]},
        "op": {"ops": 200, "seconds": 2e-3},
    }


def test_profile_dict_means_over_ranks_and_measured_efficiencies():
    pair = {"all_gather": {"wire_bytes": 1e9, "seconds": 2.0}, "all_reduce": {"wire_bytes": 1e9, "seconds": 4.0},
            "latency_s": 1e-4}  # fmt: skip
    meas = {
        "ranks": 4,
        "threads": 1,
        "comm_threads": 1,
        "compute": [_rank(0.1, 1.0), _rank(0.3, 0.5)],  # GEMM 15 and 5 GFLOP/s; memory 3 and 6 GB/s
        "comm": [pair, pair],
        "act": [2048, 4, 128, 4, 32, 64],
    }
    op_s, doc = bench.profile_dict(meas, memory_gib=24.0, cores=2)
    assert op_s == pytest.approx(1e-5)
    assert doc["dtype_flops"] == {"fp32": pytest.approx(10e9), "bf16": pytest.approx(10e9)}
    assert doc["hbm_bytes_per_s"] == pytest.approx(4.5e9)
    assert doc["intra_node_bytes_per_s"] == doc["inter_node_bytes_per_s"] == pytest.approx(5e8)  # the all_gather's
    assert doc["collective_latency_s"] == pytest.approx(1e-4)
    assert doc["gpus_per_node"] == 4 and doc["memory_gib"] == pytest.approx(6.0)
    # bmm 4 GFLOP/s over GEMM 10 GFLOP/s; the eager basket 0.75 and 1.5 GB/s (1.125), the gathers 0.3 and 0.6 GB/s
    # (0.45) over the add's 4.5 GB/s; matmul and collective 1.0 (the microbenchmarks are the achieved rates)
    assert doc["efficiency"] == {"matmul": 1.0, "memory": pytest.approx(0.25), "gather": pytest.approx(0.1),
                                 "collective": 1.0, "attention": pytest.approx(0.4)}  # fmt: skip
    assert doc["memory_model"] == "eager"
    hw = hardware_from_dict(doc)
    assert hw.memory_model == "eager" and hw.efficiency["gather"] == pytest.approx(0.1)
    p = plan_time(preset("cpu-small"), 1024, Layout(dp_shard=2, cp=2), hw, recompute=False, dtype="fp32")
    assert p["bound"] in ("compute", "memory-bound kernels") and p["exposed_comm_s"]["inter-node"] == 0.0
    assert p["compute_s"] == pytest.approx(sum(p["compute_by_component_s"].values()))


def test_summary_band_and_rankings():
    def case(layout, L, pred, meas, dp):
        return {"layout": layout, "seq_len": L, "predicted_s": pred, "measured_s": meas, "ratio": pred / meas,
                "predicted_tokens_per_s": dp * L / pred, "measured_tokens_per_s": dp * L / meas}  # fmt: skip

    cases = [case("single", 1024, 1.0, 2.0, 1), case("fsdp2-cp2", 1024, 1.5, 2.5, 2),
             case("single", 2048, 2.0, 3.0, 1), case("fsdp2-cp2", 2048, 4.5, 5.0, 2)]  # fmt: skip
    s = bench.summary(cases)
    assert s["ratio_min"] == pytest.approx(0.5) and s["ratio_max"] == pytest.approx(0.9)
    assert s["rank_by_predicted_s"] == ["single@1024", "fsdp2-cp2@1024", "single@2048", "fsdp2-cp2@2048"]
    assert s["rank_by_measured_s"] == s["rank_by_predicted_s"] and s["ranking_agrees"]
    # 2048: predicted 1024 vs 910 tokens/s (one process), measured 683 vs 819 (FSDP x CP)
    assert s["layout_choice"]["1024"] == {"predicted": "fsdp2-cp2", "measured": "fsdp2-cp2", "agree": True}
    assert s["layout_choice"]["2048"] == {"predicted": "single", "measured": "fsdp2-cp2", "agree": False}
    assert s["layout_choice_agrees"] is False


def test_gemm_shapes_follow_the_config():
    cfg = preset("cpu-small")
    shapes = bench.gemm_shapes(cfg, 2048)
    assert shapes[0] == (2048, 128, 512) and shapes[1] == (2048, 256, 128)
    assert shapes[4] == (2048 * 2 // 8, 128, 128)  # a routed expert's rows: rows x top-k / E


def test_bmm_shapes_follow_the_config():
    cfg = preset("cpu-small")
    kda, qk, pv, idx = bench.bmm_shapes(cfg, 2048)
    assert kda == (4 * 2048 // 64, 64, 32, 64)  # heads x chunks, C x d_k x C
    assert qk == (2048, 4, 64, 271) and pv == (2048, 4, 271, 64)  # 256 selected tokens + 15 tail slots
    assert idx == (1, 256 * 4, 32, 2048 // 16)
