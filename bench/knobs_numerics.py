"""Do the memory knobs change what is learnt? ``cpu-small`` trained with each knob on against off. JSON lines.

Issue 36's knobs (``genoctx plan --knobs``) take memory off the GPU so that 1M-token windows fit fewer GPUs. This
bench trains ``cpu-small`` on the embedded hg38 pieces (train chr1:1-1,000,000 + chr2:1-2,333,275, 16k windows,
random 1k-token crops, the same seed and batches for every case) for ``--steps`` steps (default 300), once per case:

- ``off``: the plain step (``train.activation_checkpointing: true``, so that the only difference below is the knob);
- ``bf16_moments``: ``train.optimizer_state_dtype: bf16`` (AdamW moments stored in bf16: changes numbers);
- ``offload_activations``: ``train.offload_activations: true`` (the checkpointed layers' inputs to host and back:
  exact, so its curve must equal ``off``'s).

(``train.offload_optimizer``, FSDP2's CPU offload, needs an FSDP mesh and is exact: tests/parallel hold it equal.)
Each case's held-out loss is ``genoctx eval --by-position`` on the 18 chr22 windows (whole 16k windows, nats per
base). Prints one JSON line per case: final training loss (mean of the last 20 steps), the largest relative
difference of the training-loss curve from ``off``'s (20-step running means), the held-out loss and its relative
difference from ``off``'s; then a summary line with the band. ``--plot FILE`` draws the curves.

    .venv/bin/python bench/knobs_numerics.py --plot docs/img/knobs_numerics.png     # ~15 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
G = [sys.executable, "-m", "genoctx"]
FASTA = ["hg38_chr1_1-1000000.fa.gz", "hg38_chr2_1-2333275.fa.gz", "hg38_chr22_32000001-32300000.fa"]
CASES = {
    "off": [],
    "bf16_moments": ["train.optimizer_state_dtype=bf16"],
    "offload_activations": ["train.offload_activations=true"],
}
BAND = 0.01  # relative: curves (20-step means) and held-out loss of a knob that changes numbers vs off


def run(cmd: list[str], out: Path | None = None) -> None:
    with open(out, "w") if out else open("/dev/null", "w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.DEVNULL, cwd=REPO)


def smooth(x: np.ndarray, k: int = 20) -> np.ndarray:
    return np.convolve(x, np.ones(k) / k, mode="valid")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated cases to run ('off' always runs)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        data = work / "data"
        if not (data / "manifest.json").exists():
            cmd = [
                *G,
                "prepare",
                "--out",
                str(data),
                "--window",
                "16k",
                "--chroms",
                "chr1,chr2",
                "--eval-chroms",
                "chr22",
            ]
            for f in FASTA:
                cmd += ["--fasta", str(REPO / "data" / "hg38" / f)]
            run(cmd)
        curves, heldout = {}, {}
        wanted = {"off", *args.cases.split(",")}
        for case, sets in CASES.items():
            if case not in wanted:
                continue
            out = work / case
            if (
                not (out / "metrics.jsonl").exists()
                or len((out / "metrics.jsonl").read_text().splitlines()) < args.steps
            ):
                cmd = [*G, "train", "--data", str(data), "--recipe", "recipes/cpu-small.yaml", "--out", str(out),
                       "--steps", str(args.steps), "--set", "train.seq_len=1024", "--set", "train.warmup_steps=20",
                       "--set", "train.checkpoint_every=1000",
                       "--set", "train.activation_checkpointing=true"]  # fmt: skip
                for s in sets:
                    cmd += ["--set", s]
                run(cmd)
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            curves[case] = np.array([r["loss"] for r in rows if "loss" in r][: args.steps])
            if not (work / f"{case}.eval.json").exists() or (work / f"{case}.eval.json").stat().st_size == 0:
                run([*G, "eval", "--by-position", "--data", str(data), "--checkpoint", str(out), "--resamples", "0",
                     "--format", "json"], work / f"{case}.eval.json")  # fmt: skip
            heldout[case] = json.loads((work / f"{case}.eval.json").read_text())["overall"]["loss"]
        ref = smooth(curves["off"])
        worst = 0.0
        for case, c in curves.items():
            rel = float(np.max(np.abs(smooth(c) / ref - 1)))
            dh = heldout[case] / heldout["off"] - 1
            if case != "off":
                worst = max(worst, rel, abs(dh))
            print(json.dumps({"bench": "knobs_numerics", "knob": case, "steps": len(c),
                              "final_train_loss": round(float(c[-20:].mean()), 5),
                              "curve_max_rel_diff": round(rel, 5),
                              "curve_equal": bool(np.array_equal(c, curves["off"])),
                              "heldout_loss": round(heldout[case], 5), "heldout_rel_diff": round(dh, 5)}),
                  flush=True)  # fmt: skip
        print(json.dumps({"bench": "knobs_numerics", "kind": "summary", "band": BAND, "worst_rel_diff": round(worst, 5),
                          "within_band": worst <= BAND}))  # fmt: skip
        if args.plot:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, (ax, dx) = plt.subplots(1, 2, figsize=(12, 4))
            for case, c in curves.items():
                s = smooth(c)
                style = "--" if case == "offload_activations" else "-"
                ax.plot(np.arange(len(s)) + 20, s, style, label=f"{case} (held-out {heldout[case]:.4f} nats)")
                dx.plot(np.arange(len(s)) + 20, 100 * (s / ref - 1), style, label=case)
            ax.set_xlabel("step")
            ax.set_ylabel("training loss, nats per base (20-step mean)")
            ax.set_title(f"cpu-small on hg38 pieces, each memory knob vs off ({args.steps} steps)")
            ax.legend()
            ax.grid(alpha=0.3)
            dx.axhspan(-100 * BAND, 100 * BAND, color="0.9", label=f"band: {100 * BAND:g}%")
            dx.set_xlabel("step")
            dx.set_ylabel("training loss vs off (%, 20-step means)")
            dx.set_title("difference from off")
            dx.legend()
            dx.grid(alpha=0.3)
            fig.tight_layout()
            args.plot.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
