"""``python bench/trainable_cpu.py --quick``: the trainable-subset comparison (issue 44 item 6) as a user runs it.

One small run (2k windows, 4 held-out chr22 windows, 3 base steps, 3 steps per variant, six CLI subprocesses) and
what must hold of its one JSON line: the trainable counts it measures from each run's optimizer state equal
``genoctx.train.loop.trainable_counts`` of the model (LoRA rank 8 included), all > experts frozen > lora; the groups
each run changed bit for bit are exactly the ones it trains (experts unchanged by the experts-frozen run, only the
adapters by the LoRA run); the three runs start from the same base (equal first-step loss); the held-out rows are
the eval's bins with intervals around their values; the plot is a PNG.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def expected_counts() -> dict[str, int]:
    """What each variant trains of cpu-small, from the model code (meta device)."""
    from genoctx.model.config import preset
    from genoctx.model.groups import GROUPS
    from genoctx.model.lora import apply_lora
    from genoctx.model.model import HybridLM
    from genoctx.recipes import TrainConfig
    from genoctx.train.loop import trainable_counts

    with torch.device("meta"):
        model = HybridLM(preset("cpu-small"))
        frozen = trainable_counts(model, ",".join(g for g in GROUPS if g != "experts"))
        total = frozen["parameters"]
        apply_lora(model, 8, TrainConfig().lora_alpha, TrainConfig().lora_targets, seed=0)
        lora = trainable_counts(model, "lora")
    return {"all": total, "experts_frozen": frozen["trainable_parameters"], "lora": lora["trainable_parameters"],
            "lora_total": lora["parameters"]}  # fmt: skip


@pytest.mark.slow  # six CLI processes (~3 s of imports each) and an eval of four models: ~1 min on 2 idle cores
def test_trainable_cpu_quick(tmp_path):
    png = tmp_path / "img" / "t.png"
    p = subprocess.run([sys.executable, "bench/trainable_cpu.py", "--quick", "--work", str(tmp_path / "w"), "--plot",
                        str(png)], cwd=ROOT, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert len(lines) == 1
    check_quick(json.loads(lines[0]), png)


def check_quick(r: dict, png: Path) -> None:
    """What must hold of the ``--quick`` JSON line ``r`` and its plot ``png``."""
    from genoctx.model.groups import GROUPS

    assert r["bench"] == "trainable_cpu" and r["quick"] is True and (r["base_steps"], r["steps"]) == (3, 3)
    assert (r["window"], r["eval_windows"], r["edges"]) == (2048, 4, [0, 1024, 2048])
    v = r["variants"]
    assert list(v) == ["all", "experts_frozen", "lora"]

    # trainable parameters: measured from optimizer.pt, equal to what the model code says each spec trains
    want = expected_counts()
    assert r["base"]["trainable_parameters"] == r["base"]["parameters"] == want["all"]
    for name in ("all", "experts_frozen", "lora"):
        assert v[name]["trainable_parameters"] == want[name], name
    assert want["all"] > want["experts_frozen"] > want["lora"] > 0
    assert v["lora"]["parameters"] == want["lora_total"] == want["all"] + want["lora"]
    assert v["experts_frozen"]["trainable"] == ",".join(g for g in GROUPS if g != "experts")
    assert (v["all"]["trainable"], v["lora"]["trainable"]) == ("all", "lora")

    # what moved, bit for bit against the base: exactly what each run trains
    assert v["all"]["changed_groups"] == sorted(GROUPS) and v["all"]["unchanged_groups"] == []
    assert v["experts_frozen"]["unchanged_groups"] == ["experts"]
    assert v["experts_frozen"]["changed_groups"] == sorted(g for g in GROUPS if g != "experts")
    assert v["lora"]["changed_groups"] == ["lora"] and v["lora"]["unchanged_groups"] == sorted(GROUPS)

    # one starting point: the first step's loss is the base's on the same batch (LoRA's B starts at zero)
    firsts = {v[n]["train_loss_first"] for n in v}
    assert len(firsts) == 1
    for name, run in {"base": r["base"], **v}.items():
        assert run["steps"] == 3 and len(run["train_loss_curve"]) == 3
        for k in ("train_loss_first", "train_loss_last", "train_loss_last10"):
            assert math.isfinite(run[k]) and 0 < run[k] < 3, (name, k)
        assert run["step_time_s"] > 0 and run["peak_rss_bytes"] > 2**20 and run["train_cpu_s"] > 0
        assert run["tokens_per_step"] == (4 * 256 if name == "base" else 1024)

        # held-out rows: the eval's bins, tokens adding up, each interval around its value
        h = run["heldout"]
        assert [(b["start"], b["end"]) for b in h["bins"]] == [(0, 1024), (1024, 2048)]
        assert sum(b["tokens"] for b in h["bins"]) == h["overall"]["tokens"] == 4 * 2048
        for row in (*h["bins"], h["overall"]):
            lo, hi = row["loss_ci"]
            assert math.isfinite(row["loss"]) and lo <= row["loss"] <= hi
            if name == "base":
                assert "relative_change" not in row
            else:
                lo, hi = row["relative_change_ci"]
                assert lo <= row["relative_change"] <= hi and row["relative_change"] != 0
        if name != "base":
            assert "change_difference_ci" in h["last_vs_first_bin"]
    assert r["base"]["heldout"]["overall"]["loss"] not in {v[n]["heldout"]["overall"]["loss"] for n in v}

    assert r["plot"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
