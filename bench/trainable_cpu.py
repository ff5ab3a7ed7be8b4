"""What training only part of the model changes: ``cpu-small`` post-trained three ways from one base. One JSON line.

Issue 44 item 6. On the embedded hg38 pieces (train chr1:1-1,000,000 + chr2:1-2,333,275, held out
chr22:32.0-32.3 Mb), every step a user would run, as subprocesses (``python -m genoctx ...``):

1. ``genoctx prepare`` (16k windows; ``--quick``: 2k windows and the first 8,192 bases of the chr22 piece);
2. the common starting point: ``genoctx train`` of ``cpu-small`` from scratch for ``--base-steps`` steps on
   4 random 1k-token crops each (short context, as ``examples/demo.sh``'s base), saved in ``WORK/base``;
3. three post-training runs ``--init WORK/base`` for ``--steps`` steps on 4k-token crops (one per step, the recipe's
   length; ``--quick``: 1k), the same seed, data order, lr (1e-3, warm-up 5) and schedule, differing only in
   ``train.trainable``:
   - ``all``: every parameter;
   - ``experts_frozen``: every group of ``genoctx.model.groups.GROUPS`` but ``experts`` (the routed experts,
     97% of the published model, stay as the base has them);
   - ``lora``: ``train.trainable: lora``, ``train.lora_rank: 8`` (default alpha 32 and targets): only the adapters;
4. one ``genoctx eval --by-position`` of the base and the three runs on every held-out chr22 window (whole windows,
   log2 position bins), the base first: each run's change vs the base with paired 95% bootstrap intervals
   (the same resampled windows for every model).

Per run it reports: training loss (first and last step, mean of the last 10), held-out loss by position bin with
its interval and the change vs the base with its paired interval, the trainable parameter count (elements with
AdamW state in the run's last ``optimizer.pt``: what the optimizer actually holds, not what the recipe says), the
parameter groups whose weights differ bit for bit from the base's in the last checkpoint and those identical to it,
the median step time (seconds, steps after the first, from ``metrics.jsonl``) and the train process's peak resident
set size (bytes, ``getrusage`` as ``genoctx train`` reports it) and CPU time (seconds, startup included). The load
average before and after is printed too: step times on a shared machine are not the code's. ``--plot`` draws
held-out loss by position and the change vs the base (with intervals) beside the training curves.

    .venv/bin/python bench/trainable_cpu.py  # 19 min on 2 shared cores (OMP_NUM_THREADS=1); docs/img/trainable_cpu.png
    .venv/bin/python bench/trainable_cpu.py --quick --plot /tmp/t.png   # a smoke run, 1-4 min

On a machine shared with other jobs, ``OMP_NUM_THREADS=1`` keeps torch's threads from spinning against them (steps
of 30-80 s instead of ~3.5 s were seen here without it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
G = [sys.executable, "-m", "genoctx"]
HG38 = REPO / "data" / "hg38"
TRAIN_FASTA = ["hg38_chr1_1-1000000.fa.gz", "hg38_chr2_1-2333275.fa.gz"]
EVAL_FASTA = "hg38_chr22_32000001-32300000.fa"
QUICK_EVAL_BASES = 8192


def variants() -> dict[str, list[str]]:
    """The three post-training runs: name -> their ``--set`` keys (everything else is shared)."""
    from genoctx.model.groups import GROUPS

    return {
        "all": ["train.trainable=all"],
        "experts_frozen": ["train.trainable=" + ",".join(g for g in GROUPS if g != "experts")],
        "lora": ["train.trainable=lora", "train.lora_rank=8"],
    }


def run(cmd: list[str], log: Path, stdout: Path | None = None) -> float:
    """Run ``cmd`` in the repository (stderr to ``log``, stdout to the file ``stdout`` by a rename); return the
    process's CPU time (user + system, seconds). A failure raises with the log's tail."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "w") as err:
        p = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise SystemExit(f"trainable_cpu: {' '.join(cmd[2:5])} ... failed (exit {p.returncode}):\n{tail}")
    if stdout is not None:
        tmp = stdout.with_suffix(".tmp")
        tmp.write_text(p.stdout)
        tmp.rename(stdout)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def prepare(work: Path, quick: bool) -> Path:
    """``genoctx prepare`` of the embedded pieces into ``work/data`` (skipped when already there)."""
    data = work / "data"
    if (data / "manifest.json").exists():
        return data
    held_out = HG38 / EVAL_FASTA
    if quick:  # the first QUICK_EVAL_BASES bases of the chr22 piece (4 windows of 2k)
        lines = held_out.read_text().splitlines()
        seq = "".join(lines[1:])[:QUICK_EVAL_BASES]
        held_out = work / "chr22_quick.fa"
        held_out.write_text(lines[0] + "\n" + "\n".join(seq[i : i + 60] for i in range(0, len(seq), 60)) + "\n")
    cmd = [*G, "prepare", "--out", str(data), "--window", "2k" if quick else "16k", "--chroms", "chr1,chr2",
           "--eval-chroms", "chr22", "--fasta", str(held_out)]  # fmt: skip
    for f in TRAIN_FASTA:
        cmd += ["--fasta", str(HG38 / f)]
    run(cmd, work / "prepare.log")
    return data


def train(data: Path, out: Path, steps: int, sets: list[str], init: Path | None = None) -> dict:
    """``genoctx train`` of ``recipes/cpu-small.yaml`` into ``out`` (a finished run is reused); its summary JSON, with
    ``cpu_s``: the train process's CPU time (user + system, seconds; startup included)."""
    summary = out.with_name(out.name + ".summary.json")
    if not summary.exists():
        cmd = [*G, "train", "--data", str(data), "--recipe", "recipes/cpu-small.yaml", "--out", str(out),
               "--steps", str(steps), "--set", "train.checkpoint_every=100000", "--set", "train.seed=0"]  # fmt: skip
        if init is not None:
            cmd += ["--init", str(init), "--set", "model.preset=null"]  # the base's config.json fixes the model
        for s in sets:
            cmd += ["--set", s]
        cpu = run(cmd, out.with_name(out.name + ".log"), summary)
        summary.write_text(json.dumps({**json.loads(summary.read_text()), "cpu_s": cpu}))
    return json.loads(summary.read_text())


def optimizer_elements(ckpt: Path) -> int:
    """Elements of the parameters holding AdamW state (``exp_avg``) in ``ckpt/optimizer.pt``."""
    from genoctx.train.checkpoint import read_optimizer

    state = read_optimizer(ckpt / "optimizer.pt")["optimizer"]["state"]
    return sum(int(s["exp_avg"].numel()) for s in state.values())


def changed_groups(base_model, ckpt: Path) -> tuple[list[str], list[str]]:
    """Parameter groups (``genoctx.train.loop.group_or_lora``) of the model in ``ckpt`` whose tensors differ bit for
    bit from ``base_model``'s, and those identical to it; a tensor the base lacks (a LoRA adapter) counts as changed.
    """
    import torch

    from genoctx.train.checkpoint import load_model
    from genoctx.train.loop import group_or_lora

    model, _, _ = load_model(ckpt)
    base = dict(base_model.named_parameters())
    changed, same = set(), set()
    for name, p in model.named_parameters():
        g = group_or_lora(name, model.cfg.layer_types)
        b = base.get(name)
        (same if b is not None and torch.equal(b, p) else changed).add(g)
    same -= changed
    return sorted(changed), sorted(same)


def train_metrics(out: Path, summary: dict) -> dict:
    """Training loss (first, last, mean of the last 10 steps), median step time (s, steps after the first; from
    ``tokens / tokens_per_s`` of ``metrics.jsonl``), the process's peak RSS (bytes) and CPU time (s) of run ``out``."""
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    times = [r["tokens"] / r["tokens_per_s"] for r in rows]
    return {
        "steps": len(rows),
        "tokens_per_step": rows[0]["tokens"],
        "train_loss_first": rows[0]["loss"],
        "train_loss_last": rows[-1]["loss"],
        "train_loss_last10": statistics.fmean(r["loss"] for r in rows[-10:]),
        "train_loss_curve": [round(r["loss"], 5) for r in rows],
        "step_time_s": statistics.median(times[1:] or times),
        "peak_rss_bytes": summary["peak_memory_bytes"],
        "train_cpu_s": summary.get("cpu_s"),
        "parameters": summary["parameters"]["total"],
    }


def heldout(model: dict) -> dict:
    """One model of the eval document: its loss by position bin and overall, with intervals and change vs the base."""
    keys = ("start", "end", "tokens", "loss", "loss_ci", "relative_change", "relative_change_ci")
    row = lambda r: {k: r[k] for k in keys if k in r}  # noqa: E731
    out = {"bins": [row(b) for b in model["bins"]], "overall": row(model["overall"])}
    lvf = model.get("last_vs_first_bin")
    if lvf:
        out["last_vs_first_bin"] = {k: lvf[k] for k in ("change_difference", "change_difference_ci")}
    return out


def plot(result: dict, path: Path) -> None:
    """Held-out loss by position (95% intervals), change vs the base (paired intervals), training loss curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {"base": result["base"], **result["variants"]}
    fig, (ax, dx, tx) = plt.subplots(1, 3, figsize=(16, 4.4))
    for i, (name, r) in enumerate(runs.items()):
        bins = r["heldout"]["bins"]
        x = [max(b["start"], 1) * (b["end"] / max(b["start"], 1)) ** 0.5 for b in bins]  # geometric bin centres
        label = name if name == "base" else f"{name} ({r['trainable_parameters']:,} trained)"
        ax.plot(x, [b["loss"] for b in bins], "o-", color=f"C{i}", label=label)
        if bins[0].get("loss_ci"):
            ax.fill_between(x, [b["loss_ci"][0] for b in bins], [b["loss_ci"][1] for b in bins], color=f"C{i}",
                            alpha=0.15)  # fmt: skip
        if name != "base":
            dx.errorbar([v * (1 + 0.04 * (i - 2)) for v in x], [100 * b["relative_change"] for b in bins],
                        yerr=[[100 * (b["relative_change"] - b["relative_change_ci"][0]) for b in bins],
                              [100 * (b["relative_change_ci"][1] - b["relative_change"]) for b in bins]]
                        if bins[0].get("relative_change_ci") else None, fmt="o-", color=f"C{i}", capsize=3,
                        label=name)  # fmt: skip
            curve = r["train_loss_curve"]
            tx.plot(range(1, len(curve) + 1), curve, color=f"C{i}", label=name)
    for a in (ax, dx):
        a.set_xscale("log", base=2)
        a.set_xlabel("context (bases before the token)")
        a.grid(alpha=0.3)
    dx.axhline(0, color="0.5", lw=0.8)
    ax.set_ylabel("held-out chr22 loss, nats per base")
    ax.set_title(f"held-out loss by position ({result['eval_windows']} windows, 95% CI)")
    dx.set_ylabel("change vs base (%), paired 95% CI")
    dx.set_title("each post-training vs its base")
    tx.set_xlabel("post-training step")
    tx.set_ylabel("training loss, nats per base")
    tx.set_title(f"cpu-small from one base ({result['base_steps']} steps), {result['steps']} steps each")
    tx.grid(alpha=0.3)
    for a in (ax, dx, tx):
        a.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    fig.savefig(tmp, dpi=100)
    tmp.rename(path)


def bench(work: Path, base_steps: int, steps: int, quick: bool) -> dict:
    """The whole comparison in ``work`` (finished steps there are reused); the result document."""
    from genoctx.train.checkpoint import load_model, resolve_checkpoint

    load_before = os.getloadavg()[0]
    data = prepare(work, quick)
    seq = 1024 if quick else 4096
    base_sets = [f"train.seq_len={seq // 4}", "train.batch_size=4", "train.lr=3e-3", "train.warmup_steps=10",
                 "train.log_every=20"]  # fmt: skip
    runs = {"base": (work / "base", train(data, work / "base", base_steps, base_sets), "all")}
    post = [f"train.seq_len={seq}", "train.batch_size=1", "train.lr=1e-3", "train.warmup_steps=5", "train.log_every=5"]
    for name, sets in variants().items():
        runs[name] = (
            work / name,
            train(data, work / name, steps, [*post, *sets], init=work / "base"),
            sets[0].split("=", 1)[1],
        )
    doc_path = work / "eval.json"
    if not doc_path.exists():
        cmd = [*G, "eval", "--by-position", "--data", str(data), "--format", "json", "--seed", "0"]
        for out, _, _ in runs.values():
            cmd += ["--checkpoint", str(out)]
        run(cmd, work / "eval.log", doc_path)
    doc = json.loads(doc_path.read_text())
    scored = [m for m in doc["models"] if m["kind"] == "checkpoint"]  # in --checkpoint order: base first
    assert [Path(m["path"]).parent.parent.name for m in scored] == list(runs), "eval.json is not of these runs"
    base_model, _, _ = load_model(work / "base")
    result = {"bench": "trainable_cpu", "quick": quick, "base_steps": base_steps, "steps": steps,
              "base_seq_len": seq // 4, "base_batch": 4, "seq_len": seq, "window": doc["window"],
              "eval_windows": doc["windows"], "edges": doc["edges"], "confidence": doc["confidence"],
              "base": None, "variants": {}}  # fmt: skip
    for (name, (out, summary, spec)), scored_model in zip(runs.items(), scored, strict=True):
        ckpt = resolve_checkpoint(out)
        r = {"trainable": spec, "trainable_parameters": optimizer_elements(ckpt), **train_metrics(out, summary)}
        if name != "base":
            r["changed_groups"], r["unchanged_groups"] = changed_groups(base_model, ckpt)
        r["heldout"] = heldout(scored_model)
        if name == "base":
            result["base"] = r
        else:
            result["variants"][name] = r
    result["load_average_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="post-training steps per run (default 30; --quick 3)")
    ap.add_argument("--base-steps", type=int, default=None, help="steps of the common base (default 60; --quick 3)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2k windows, 4 held-out windows, few steps")
    ap.add_argument("--plot", type=Path, default=REPO / "docs" / "img" / "trainable_cpu.png", help="PNG to write")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--work", type=Path, default=None, help="keep the runs here and reuse them (default: a temp dir)")
    args = ap.parse_args()
    steps = args.steps if args.steps is not None else 3 if args.quick else 30
    base_steps = args.base_steps if args.base_steps is not None else 3 if args.quick else 60
    if steps < 2 or base_steps < 1:
        raise SystemExit("trainable_cpu: --steps must be >= 2 and --base-steps >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = bench(work, base_steps, steps, args.quick)
        if not args.no_plot:
            plot(result, args.plot)
            result["plot"] = str(args.plot)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
