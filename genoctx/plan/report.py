"""What a plan says to a person: the layout in words, the one-line error of a plan that does not fit, the table."""

from __future__ import annotations

from ..errors import GenoctxError
from ..parallel.layout import Layout


def describe_layout(plan: dict) -> str:
    """``"dp_replicate=1 ep=8 dp_shard=2 cp=4"`` of a plan (``ep=32 (folded)`` when folded: ``Layout.describe``)."""
    return Layout(**{k: v for k, v in plan["layout"].items() if k != "world"}).describe()


def check_fits(plan: dict) -> None:
    """Raise when a plan does not fit its device.

    Raises:
        GenoctxError: ``plan["fits"]`` is False; one line with the layout, the predicted and available GiB, the
            largest components and the peak phase (``genoctx train --force`` overrides it).
    """
    if plan.get("fits", True):
        return
    comps = sorted(plan["components_gib"].items(), key=lambda kv: -kv[1])
    top = ", ".join(f"{k} {v:.1f}" for k, v in comps[:4] if v > 0)
    ac = "" if plan.get("recompute", True) else ", recompute the layers (train.activation_checkpointing)"
    if plan.get("mode") == "eval":
        ac = ", or stream it in chunks (--chunk-tokens)" if not plan.get("chunk_tokens") else ""
    flag = " --eval" if plan.get("mode") == "eval" else ""
    raise GenoctxError(
        f"memory plan: {describe_layout(plan)} needs {plan['total_gib']:.1f} GiB per GPU, more than "
        f"{plan['gpu_memory_gib']:g} GiB (largest: {top}; at {plan['peak_phase']}); choose another layout "
        f"(genoctx plan{flag} --gpus N lists those that fit){ac}, or pass --force"
    )


def format_table(plans: list[dict], limit: int = 10) -> str:
    """A human-readable breakdown of ``plans`` (best first): one line per layout (at most ``limit``), then the
    components of the first (the best) plan. Zero components are left out; GiB, or MiB when the best plan needs
    less than 1 GiB. A row that fits the GPU but not the host says ``host`` under fits, and the table then has a
    ``host GiB`` column; a ``skew`` above a listed layout's EP size is stated (``skew_note``)."""
    if not plans:
        return "no valid layout"
    p0 = plans[0]
    unit, scale = ("GiB", 1) if p0["total_gib"] >= 1 else ("MiB", 1024)
    chunks = any(p.get("seq_chunk_tokens") for p in plans[:limit])
    timed = all("time" in p for p in plans[:limit])
    knobbed = any(p.get("knobs") for p in plans[:limit])
    hosted = any(host_short(p) for p in plans[:limit])  # a row fits the GPU and not the host: its host GiB column
    hours = timed and "trainable" in p0  # a trainable subset's table has room for GPU-hours of HOURS_STEPS steps
    if p0.get("mode") == "eval":
        how = f"mode eval, chunk {p0['chunk_tokens'] or 'whole'}"
        how += f", cp layout {p0['cp_layout']}" if p0.get("cp_layout", "contiguous") != "contiguous" else ""
    else:
        how = f"recompute {p0['recompute']}  offload {p0['optimizer_offload']}"
    lines = [
        f"seq_len {p0['seq_len']}  batch {p0['batch_size']}  dtype {p0['dtype']}  {how}  "
        f"device memory {p0['gpu_memory_gib']:g} GiB",
        "",
        f"{'#':>3}  {'dp_replicate':>12} {'ep':>4} {'dp_shard':>8} {'cp':>4}  {'tokens/rank':>11}  "
        + (f"{'chunk':>7}  " if chunks else "")
        + f"{'a2a GiB':>8}  {unit + '/GPU':>9}  "
        + (f"{'host ' + unit:>9}  " if hosted else "")
        + "fits  "
        + (f"{'step s':>8} {'tokens/s':>9} {'MFU':>6}  {'bound':<20}  " if timed else "")
        + (f"{f'GPU-h/{HOURS_STEPS}':>9}  " if hours else "")
        + (f"{'knobs':<28}  " if knobbed else "")
        + "peak at",
    ]
    for j, p in enumerate(plans[:limit], 1):
        lay = p["layout"]
        ep = f"{lay['ep']}{'f' if lay.get('ep_folded') else ''}"
        chunk = f"{p.get('seq_chunk_tokens') or '-':>7}  " if chunks else ""
        host = (f"{p['host_gib'] * scale:>9.2f}  " if p.get("host_gib") else f"{'-':>9}  ") if hosted else ""
        fits = "yes" if p["fits"] else "host" if host_short(p) else "no"
        lines.append(
            f"{j:>3}  {lay['dp_replicate']:>12} {ep:>4} {lay['dp_shard']:>8} {lay['cp']:>4}  "
            f"{p['tokens_per_rank']:>11}  {chunk}{p.get('all_to_all_gib', 0.0):>8.2f}  {p['total_gib'] * scale:>9.2f}  "
            f"{host}{fits:<4}  {_time_cells(p) if timed else ''}"
            f"{_hours_cell(p, HOURS_STEPS) if hours else ''}"
            f"{(_knob_cell(p) + '  ') if knobbed else ''}{p['peak_phase']}"
        )
    if len(plans) > limit:
        lines.append(f"     ({len(plans) - limit} more; --format json lists them)")
    if plans and not plans[0]["fits"]:
        lines.append(f"     ({short_of(plans[0])})")
    if hosted:
        lines.append(f"     (fits host: the row fits the GPU but not the host's {_host_memory(plans[:limit])} GiB per "
                     f"GPU; host {unit}: what its offloaded state holds per GPU)")  # fmt: skip
    lines.append("     (ep 32f: folded, the EP group drawn from dp_shard x cp; a2a GiB: expert all-to-all each rank "
                 "sends per step, balanced routing)")
    if timed:
        t = p0["time"]
        lines.append(f"     (step s, tokens/s, MFU, bound: the time model on {t['hardware']}, expert skew "
                     f"{t['skew']:g}; genoctx.plan.time; --rank-by throughput orders by tokens/s)")  # fmt: skip
        if note := skew_note(t["skew"], plans[:limit]):
            lines.append(f"     ({note})")
    if knobbed:
        lines.append("     (knobs: offload-act train.offload_activations, bf16-moments train.optimizer_state_dtype: "
                     "bf16, offload-opt train.offload_optimizer)")  # fmt: skip
    if chunks:
        lines.append("     (chunk: train.seq_chunk_tokens, the window trained in chunks of this many tokens by the "
                     "exact chunked backward; tokens/rank: one chunk's)")
    if "trainable" in p0:
        lines.append(_trainable_line(p0))
    lines += ["", f"components of #1 ({describe_layout(p0)}), {unit} per GPU at {p0['peak_phase']}:"]
    for k, v in p0["components_gib"].items():
        if v:
            lines.append(f"  {k:<24} {v * scale:>9.3f}")
    lines.append(f"  {'total':<24} {p0['total_gib'] * scale:>9.3f}")
    if timed:
        t = p0["time"]
        exposed = ", ".join(f"{k} {v:.2f}" for k, v in t["exposed_comm_s"].items())
        by = t.get("compute_by_dtype_s") or {}
        peaks = f" ({', '.join(f'{k} {v:.2f}' for k, v in sorted(by.items(), key=lambda kv: -kv[1]))})" if by else ""
        lines.append(f"time of #1, s per step: compute {t['compute_s']:.2f}{peaks}, memory-bound kernels "
                     f"{t['memory_bound_s']:.2f}, exposed communication: {exposed} (of {sum(t['comm_s'].values()):.2f} "
                     f"in all), launch {t.get('launch_s', 0.0):.2f} ({t.get('ops', 0):,.0f} aten ops on the host; "
                     "genoctx.plan.ops)")  # fmt: skip
    if p0.get("host_gib"):
        lines.append(_host_line(p0))
    others = {k: v for k, v in p0["working_sets_gib"].items() if v and not p0["components_gib"].get(k)}
    if others:
        lines.append(f"largest working sets of other phases ({unit}): "
                     + ", ".join(f"{k} {v * scale:.3f}" for k, v in others.items()))  # fmt: skip
    return "\n".join(lines)


HOURS_STEPS = 80  # the published run's steps, for the GPU-hours column of a trainable subset's table


def _hours_cell(p: dict, steps: int) -> str:
    """GPU-hours of ``steps`` steps of the plan's layout (``genoctx.plan.time.gpu_hours``)."""
    from .time import gpu_hours

    return f"{gpu_hours(p['time']['step_s'], steps, p['layout']['world']):>9.1f}  "


def _trainable_line(p: dict) -> str:
    """What trains in a plan (``plan_memory``'s ``trainable``): groups, LoRA rank, frozen dtype, parameter counts,
    and what the host holds when the host does not fit."""
    t = p["trainable"]
    lora = f", LoRA rank {t['lora_rank']}" if t["lora_rank"] else ""
    line = (f"     (trainable {t['trainable']}{lora}: {t['params_trainable'] / 1e9:.3g}B parameters train "
            f"({t['params_lora'] / 1e9:.3g}B adapters), {t['params_frozen'] / 1e9:.3g}B frozen in "
            f"{t['frozen_dtype']} ({t['frozen_bytes'] / 2**30:.1f} GiB with scales); per GPU #1 holds "
            f"{p['persistent_gib'].get('frozen', 0.0):.2f} GiB frozen, "
            f"{p['persistent_gib']['optimizer_state']:.2f} GiB optimizer state)")  # fmt: skip
    return line


def short_of(p: dict) -> str:
    """What a plan that does not fit is short of, with the numbers: GPU memory (its peak GiB per GPU against the GPU's)
    and/or host memory (the GiB per GPU its offloaded state holds against ``host_memory_gib``); when only the host is
    short, also what it needs on the GPU, which fits."""
    out = []
    if p["total_gib"] > p["gpu_memory_gib"]:
        out.append(f"GPU memory: needs {p['total_gib']:.1f} GiB per GPU, {p['gpu_memory_gib']:g} GiB available "
                   f"({p['total_gib'] - p['gpu_memory_gib']:.1f} short)")  # fmt: skip
    if p.get("host_fits") is False:
        have = p.get("host_memory_gib")
        out.append(f"host memory: needs {p['host_gib']:.1f} GiB per GPU, {have:g} GiB available "
                   f"({p['host_gib'] - have:.1f} short)")  # fmt: skip
    if not out:
        return "#1 does not fit"
    gpu = (f"; it fits the GPU: {p['total_gib']:.1f} GiB per GPU of {p['gpu_memory_gib']:g}"
           if p["total_gib"] <= p["gpu_memory_gib"] else "")  # fmt: skip
    return "#1 does not fit: short of " + "; and of ".join(out) + gpu


def host_short(p: dict) -> bool:
    """Whether a plan fits the GPU and fails only on host memory (its offloaded state, ``host_fits`` False)."""
    return p.get("host_fits") is False and p["total_gib"] <= p["gpu_memory_gib"]


def _host_memory(plans: list[dict]) -> str:
    """The host memory per GPU (GiB) of the plans that checked it, ``"238"`` (or ``"100/238"`` if they differ)."""
    return "/".join(sorted({f"{p['host_memory_gib']:g}" for p in plans if p.get("host_memory_gib")})) or "?"


def skew_note(skew: float, plans: list[dict]) -> str | None:
    """The one line that says a ``--skew`` is more than a layout can show, or None.

    The busiest of ``ep`` expert ranks receives at most every row, ``ep`` times the mean, so the time model takes
    ``min(skew, ep)`` (``genoctx.plan.flops``/``comms``; a layout without EP has no skew at all). Stated when ``skew``
    is above the EP size of one of ``plans`` (the listed ones), with what #1 is timed at."""
    capped = [p for p in plans if skew > p["layout"]["ep"]]
    if skew <= 1 or not capped or not plans:
        return None
    ep0 = plans[0]["layout"]["ep"]
    if len(plans) == 1:
        return (f"--skew {skew:g} is more than this layout can show: the busiest of its {ep0} EP rank"
                f"{'s' if ep0 > 1 else ''} receives at most every row ({ep0} x the mean), so it is timed at skew "
                f"{ep0}")  # fmt: skip
    return (f"--skew {skew:g} is more than {len(capped)} of the {len(plans)} listed layouts can show: the busiest EP "
            f"rank receives at most every row, ep x the mean, so each is timed at min(skew, ep); #1 (ep {ep0}) at "
            f"{min(skew, ep0):g}")  # fmt: skip


def _time_cells(p: dict) -> str:
    """The time columns of a plan's row: step seconds, tokens/s, MFU (%), what bounds it."""
    t = p["time"]
    return f"{t['step_s']:>8.2f} {t['tokens_per_s']:>9.0f} {100 * t['mfu']:>5.1f}%  {t['bound']:<20}  "


KNOB_SHORT = {"offload_activations": "offload-act", "optimizer_state_dtype=bf16": "bf16-moments",
              "optimizer_offload": "offload-opt"}  # fmt: skip


def _knob_cell(p: dict) -> str:
    """The plan's memory knobs, short names, comma-joined (``-`` for none), 28 wide."""
    return f"{','.join(KNOB_SHORT.get(k, k) for k in p.get('knobs') or []) or '-':<28}"


def _host_line(p: dict) -> str:
    """Host memory and host-device traffic of a plan with offload knobs, and what they add to its step."""
    moved = p["host_device_bytes"]
    fit = {True: "fits", False: "does not fit", None: "not checked"}[p.get("host_fits")]
    line = (f"host of #1: {p['host_gib']:.1f} GiB per GPU held ({fit}), {moved['to_host'] / 2**30:.1f} GiB to host "
            f"and {moved['to_device'] / 2**30:.1f} GiB to the device per step")  # fmt: skip
    if moved.get("frozen_fp8"):
        line += f" ({moved['frozen_fp8'] / 2**30:.1f} GiB of it fp8 frozen weights fetched per use)"
    t = p.get("time", {}).get("host_s")
    if t:
        cost = ", ".join(f"{k} {v:.2f} s" if v is not None else f"{k} (no host rates)" for k, v in t.items()
                         if k != "link_needed")  # fmt: skip
        line += f"; added to the step: {cost}"
        if t.get("link_needed"):
            line += f"; the link hides the overlapped copies from {t['link_needed'] / 1e9:.1f} GB/s each way"
    return line
