"""PNG of held-out loss (or relative change vs the baseline) against token position, with interval bands."""

from __future__ import annotations

import math
from pathlib import Path


def _mid(b: dict) -> float:
    """Geometric centre of a bin [start, end) in tokens (start 0 counts as 1 on the log axis)."""
    return max(1.0, math.sqrt(max(b["start"], 1) * b["end"]))


def plot(doc: dict, path: str | Path, metric: str = "loss") -> Path:
    """Write a PNG: one line per model (checkpoints, Markov reference) at the bins' geometric centres on a
    log-2 position axis, with the bootstrap interval as a shaded band.

    Args:
        doc: a document of :func:`genoctx.eval.position.evaluate` (or the bare ``bins``/``overall`` form).
        path: output PNG; written to a temporary name and renamed (no partial file on failure).
        metric: ``"loss"`` (nats per base) or ``"relative_change"`` (% vs the baseline; the baseline itself
            is the zero line).

    Raises:
        GenoctxError: unknown metric, or relative change requested without a baseline.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..errors import GenoctxError

    if metric not in ("loss", "relative_change"):
        raise GenoctxError(f"--plot-metric {metric!r}: expected loss or relative_change")
    models = doc.get("models") or [{"name": Path(doc.get("checkpoint") or "model").name, "bins": doc["bins"]}]
    if metric == "relative_change" and not any(m.get("baseline") for m in models):
        raise GenoctxError("--plot-metric relative_change needs a baseline (two or more checkpoints)")
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for m in models:
        if metric == "relative_change" and m.get("baseline"):
            continue
        rows = [b for b in m["bins"] if b["tokens"] and b.get("loss") is not None]
        key, ci_key, scale = (
            ("loss", "loss_ci", 1.0) if metric == "loss" else ("relative_change", "relative_change_ci", 100.0)
        )
        rows = [b for b in rows if b.get(key) is not None]
        if not rows:
            continue
        xs = [_mid(b) for b in rows]
        ys = [scale * b[key] for b in rows]
        style = "s--" if m.get("kind") == "markov" else "o-"
        label = m["name"] + (" (baseline)" if m.get("baseline") else "")
        (line,) = ax.plot(xs, ys, style, label=label)
        cis = [b.get(ci_key) for b in rows]
        if all(cis):
            ax.fill_between(
                xs, [scale * c[0] for c in cis], [scale * c[1] for c in cis], color=line.get_color(), alpha=0.2
            )
    if metric == "relative_change":
        ax.axhline(0.0, color="grey", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context before the token (bases; bin geometric centre, log scale)")
    level = (doc.get("confidence") or {}).get("level", 0.95)
    ax.set_ylabel("held-out loss (nats per base)" if metric == "loss" else "change in loss vs baseline (%)")
    ax.set_title(
        f"loss by position, split {doc.get('split', '?')} ({doc.get('windows', '?')} windows of "
        f"{doc.get('window', '?')}); bands: {100 * level:.0f}% bootstrap CI",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.tight_layout()
    try:
        fig.savefig(tmp, dpi=120)
        tmp.replace(path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path
