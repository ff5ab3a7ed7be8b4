"""An image (PNG by default) of held-out loss against token position with interval bands, beside it the change of
every model vs the baseline (paired intervals) and the copy probe's gain by distance when the document has them."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

from ..errors import GenoctxError

# file suffixes the plot can be written as (matplotlib's Agg canvas; pgf needs LaTeX, raw/rgba are not images)
FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp")


def plot_format(path: str | Path) -> str:
    """The image format of ``path`` from its suffix (no suffix: png).

    Raises:
        GenoctxError: a suffix that is not one of :data:`FORMATS` (named with the ``--plot`` flag).
    """
    suffix = Path(path).suffix.lower().lstrip(".")
    if not suffix:
        return "png"
    if suffix not in FORMATS:
        raise GenoctxError(
            f"--plot {path}: cannot write .{suffix} images; use .png, .pdf or .svg (or {', '.join(FORMATS[3:])})"
        )
    return suffix


def prepare_plot_path(path: str | Path) -> list[Path]:
    """Check before any work that :func:`plot` can write ``path``: a known suffix, not a directory, its folder
    created if missing (``mkdir -p``) and a file can be created in it (probed with a temporary file).

    Returns:
        The folders it created, outermost first: pass them to :func:`remove_folders` if the work fails later.

    Raises:
        GenoctxError: the message names ``--plot``, the path and the reason (nothing is left behind).
    """
    p = Path(path)
    plot_format(p)
    created: list[Path] = []
    try:
        if p.is_dir():
            raise GenoctxError(f"--plot {p}: is a directory; give a file name such as {p / 'loss.png'}")
        missing, anc = [], p.parent
        while not anc.exists() and anc != anc.parent:
            missing.append(anc)
            anc = anc.parent
        if not anc.is_dir():
            raise GenoctxError(f"--plot {p}: cannot create its folder: {anc} is not a directory")
        for d in reversed(missing):
            d.mkdir()
            created.append(d)
        with tempfile.TemporaryFile(dir=p.parent):
            pass
    except (OSError, ValueError) as e:  # permission, read-only, a NUL byte, a name too long
        remove_folders(created)
        raise GenoctxError(f"--plot {p}: cannot write there: {getattr(e, 'strerror', None) or e}") from None
    return created


def remove_folders(folders: list[Path]) -> None:
    """Remove the (empty) folders :func:`prepare_plot_path` created, innermost first; never raises."""
    for d in reversed(folders):
        try:
            d.rmdir()
        except OSError:
            return


def _mid(b: dict) -> float:
    """Geometric centre of a bin [start, end) in tokens (start 0 counts as 1 on the log axis)."""
    return max(1.0, math.sqrt(max(b["start"], 1) * b["end"]))


# line styles by model kind: references dashed (Markov chain) and dotted (repeat reference), models solid
_STYLES = {"markov": "s--", "reference": "^:"}


def _style(m: dict) -> str:
    """The matplotlib format string of a model entry's line (:data:`_STYLES`, else ``"o-"``)."""
    return _STYLES.get(m.get("kind"), "o-")


def _plot_copy_probe(ax, doc: dict, models: list[dict]) -> None:
    """The copy probe panel: per model, the gain (in-place loss minus loss on the copy, nats per base) against the
    copy's distance (log 2 axis) with its bootstrap band; the reach threshold as a dotted line."""
    for i, m in enumerate(models):
        rows = [r for r in (m.get("copy_probe") or {}).get("rows", []) if r.get("gain") is not None]
        if not rows:
            continue
        xs = [r["distance"] for r in rows]
        style = _style(m)
        (line,) = ax.plot(xs, [r["gain"] for r in rows], style, color=f"C{i}", label=m["name"])
        cis = [r.get("gain_ci") for r in rows]
        if all(cis):
            ax.fill_between(xs, [c[0] for c in cis], [c[1] for c in cis], color=line.get_color(), alpha=0.2)
    ax.axhline(0.0, color="grey", lw=1)
    ax.axhline(doc["copy_probe"].get("reach_gain", 0.1), color="grey", lw=1, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("distance from the copy to its source (bases, log scale)")
    ax.set_ylabel("gain on the copy: in-place loss - copy loss (nats/base)")
    ax.set_title(f"copy probe: a {doc['copy_probe']['segment']}-base segment copied to the window's end", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_panels(doc: dict, metric: str = "loss") -> list[str]:
    """The panels :func:`plot` draws for ``doc``, left to right: ``metric`` by position; then, when that is the loss
    and a baseline was scored, ``"relative_change"`` (every other model's change vs the baseline, paired intervals:
    the comparison that means something, e.g. post-trained and Markov vs the base); then ``"copy_probe"`` when the
    document has one."""
    models = _models(doc)
    panels = [metric]
    if metric == "loss" and any(m.get("baseline") for m in models):
        if any(b.get("relative_change") is not None for m in models if not m.get("baseline") for b in m["bins"]):
            panels.append("relative_change")
    if doc.get("copy_probe") and any(m.get("copy_probe") for m in models):
        panels.append("copy_probe")
    return panels


def _models(doc: dict) -> list[dict]:
    return doc.get("models") or [{"name": Path(doc.get("checkpoint") or "model").name, "bins": doc["bins"]}]


def _plot_bins(ax, doc: dict, models: list[dict], metric: str) -> None:
    """One panel of ``metric`` (``loss`` in nats per base, or ``relative_change`` in % vs the baseline, which is
    then the zero line) against position: a line per model at the bins' geometric centres, its interval a band."""
    baseline = next((m["name"] for m in models if m.get("baseline")), None)
    key, ci_key, scale = (
        ("loss", "loss_ci", 1.0) if metric == "loss" else ("relative_change", "relative_change_ci", 100.0)
    )
    for i, m in enumerate(models):  # a model keeps its colour (C{i}) in every panel
        if metric == "relative_change" and m.get("baseline"):
            continue
        rows = [b for b in m["bins"] if b["tokens"] and b.get("loss") is not None and b.get(key) is not None]
        if not rows:
            continue
        xs = [_mid(b) for b in rows]
        style = _style(m)
        label = m["name"] + (" (baseline)" if m.get("baseline") else "")
        (line,) = ax.plot(xs, [scale * b[key] for b in rows], style, color=f"C{i}", label=label)
        cis = [b.get(ci_key) for b in rows]
        if all(cis):
            ax.fill_between(
                xs, [scale * c[0] for c in cis], [scale * c[1] for c in cis], color=line.get_color(), alpha=0.2
            )
    level = (doc.get("confidence") or {}).get("level", 0.95)
    if metric == "relative_change":
        ax.axhline(0.0, color="grey", lw=1)
        ax.set_ylabel(f"change in loss vs {baseline or 'the baseline'} (%)")
        ax.set_title(
            f"change vs {baseline or 'the baseline'}; bands: paired {100 * level:.0f}% bootstrap CI", fontsize=9
        )
    else:
        ax.set_ylabel("held-out loss (nats per base)")
        ax.set_title(
            f"loss by position, split {doc.get('split', '?')} ({doc.get('windows', '?')} windows of "
            f"{doc.get('window', '?')}); bands: {100 * level:.0f}% bootstrap CI",
            fontsize=9,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context before the token (bases; bin geometric centre, log scale)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot(doc: dict, path: str | Path, metric: str = "loss") -> Path:
    """Write the plot (PNG, or the format of the suffix), one panel each of :func:`plot_panels`: ``metric`` by
    position, one line per model (checkpoints solid, Markov chain dashed, repeat reference dotted: ``_style``) at the
    bins' geometric centres on a log-2 position axis with the bootstrap interval as a shaded band; with a baseline,
    the change of every other model vs it; with a copy probe in ``doc``, each model's gain on the copy by distance
    (``_plot_copy_probe``).

    Args:
        doc: a document of :func:`genoctx.eval.position.evaluate` (or the bare ``bins``/``overall`` form).
        path: output image, in the format of its suffix (:data:`FORMATS`; no suffix: PNG); its folder is created
            if missing; written to a temporary name and renamed (no partial file on failure).
        metric: ``"loss"`` (nats per base) or ``"relative_change"`` (% vs the baseline; the baseline itself
            is the zero line).

    Raises:
        GenoctxError: unknown metric, relative change requested without a baseline, an image format that cannot
            be written, or a file or folder that cannot be created (the message names ``--plot`` and the path).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fmt = plot_format(path)
    if metric not in ("loss", "relative_change"):
        raise GenoctxError(f"--plot-metric {metric!r}: expected loss or relative_change")
    models = _models(doc)
    if metric == "relative_change" and not any(m.get("baseline") for m in models):
        raise GenoctxError("--plot-metric relative_change needs a baseline (two or more checkpoints)")
    panels = plot_panels(doc, metric)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "copy_probe":
            _plot_copy_probe(ax, doc, models)
        else:
            _plot_bins(ax, doc, models, panel)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{fmt}")
    fig.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(tmp, dpi=120, format=fmt)
        tmp.replace(path)
    except OSError as e:
        raise GenoctxError(f"--plot {path}: cannot write: {e.strerror or e}") from None
    finally:
        plt.close(fig)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # its folder could not be created: nothing to remove
            pass
    return path
