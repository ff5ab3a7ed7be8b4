"""Checkpoint integrity: the size and xxh3_64 digest of every file a checkpoint holds, recorded when it is written and
checked before it is read.

safetensors checks a file's header and ``torch.load`` its zip framing, not the bytes of the tensors: 64 zeroed bytes
inside a weight load silently as a wrong weight. So every save records, in ``state.json`` (written last: what marks a
checkpoint complete), ``"files": {name: {"bytes": n, "xxh3_64": hex}}`` for each file it wrote: ``model.safetensors``,
``optimizer.pt``, ``recipe.yaml`` (one process); ``dcp/__R_i.distcp``, ``dcp/.metadata``, ``scheduler.json``,
``recipe.yaml`` (DCP). A file is hashed by reading it back after it was written, so the digest describes the bytes
on disk; under DCP each rank hashes its own shard files and rank 0 gathers them. ``state.json`` holds the digests and
is not hashed itself (a damaged one fails to parse, or its ``step`` check).

Readers check the files they read before loading anything (``--no-verify`` / ``train.verify_checkpoints: false``
skips it):

- ``genoctx eval``, ``export`` and ``train --init CKPT``: the weights and recipe (``WEIGHTS``: every recorded file
  but ``optimizer.pt`` and ``scheduler.json``). A run directory whose newest checkpoint does not verify is refused,
  naming the newest one that does (``refuse_unverified``): an eval measures one specific model.
- ``train --resume``: every file; the newest checkpoint that verifies is resumed from, each newer one skipped with a
  warning and set aside as ``step_N.broken`` (``set_aside``), so that keep-N pruning never counts it.

A checkpoint folder without state.json (``checkpoints/step_N/``: an interrupted copy; a save renames its folder into
place only after state.json is written) is never read: ``genoctx verify`` reports it (status ``incomplete``, exit
1), and a reader of a run's newest checkpoint refuses the run when it is newer than the newest complete one, or
names it in a warning when older (``genoctx.train.checkpoint.resolve_checkpoint``).

A damaged file is one line naming it and what differs (``size``: bytes on disk vs recorded; ``mismatch``: the digest;
``missing``). A checkpoint written before digests were recorded loads with one warning ("no digests recorded; not
verified"). On a mesh (``dims`` distributed) the hashing is spread over the ranks (recorded file ``i``, in name order,
on rank ``i % world``), the results are gathered, and every rank reaches the same verdict (an ``AgreedError`` on
every rank, as ``genoctx.parallel.build.agree`` raises): at the real size a checkpoint is terabytes.

xxh3_64 (the ``xxhash`` package) hashes at memory speed (``bench/verify.py``: well under a save's time); it finds
damage (bit rot, truncation, a torn copy), not tampering: it is not a cryptographic hash.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from ..errors import AgreedError, GenoctxError
from .checkpoint import (
    ALGO,
    CKPT_DIR,
    FILES_KEY,
    base_problem,
    file_digest,
    incomplete_checkpoints,
    incomplete_line,
    is_partial,
    list_checkpoints,
    read_state,
    step_of,
    validate_checkpoint,
)

log = logging.getLogger("genoctx.train")

TRAINING_ONLY = ("optimizer.pt", "scheduler.json")  # recorded files only --resume reads
ALL, WEIGHTS = "all", "weights"  # which recorded files a reader checks
STATUSES = ("ok", "mismatch", "missing", "size", "unrecorded")


def stored_files(root: Path) -> list[str]:
    """Every file of a checkpoint directory but ``state.json``, relative to it, sorted."""
    root = Path(root)
    out = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            if rel != "state.json":
                out.append(rel)
    return sorted(out)


def _mesh(dims) -> tuple[int, int]:
    """(rank, world) of the mesh of ``dims``; (0, 1) for one process."""
    if dims is None or not dims.is_distributed:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _recorded(ckpt: Path) -> tuple[int | None, dict | None, str | None]:
    """(step, recorded digests or None, error) from ``ckpt/state.json``; never raises."""
    try:
        state = read_state(ckpt)
    except GenoctxError as e:
        return None, None, str(e)
    files = state.get(FILES_KEY)
    if files is not None and not (isinstance(files, dict) and all(isinstance(v, dict) for v in files.values())):
        return state["step"], None, f"{Path(ckpt) / 'state.json'}: '{FILES_KEY}' is not a map of file digests"
    return state["step"], files, None


def _check_file(root: Path, name: str, rec: dict) -> dict:
    """One recorded file against the disk: ``{"bytes", "expected", "actual", "status"}`` (``actual_bytes`` when the
    size differs, ``error`` when it cannot be read); its bytes are read only when the size matches."""
    out = {"bytes": rec.get("bytes"), "expected": rec.get(ALGO), "actual": None}
    if not isinstance(rec.get(ALGO), str) or not isinstance(rec.get("bytes"), int):
        return {**out, "status": "unrecorded"}
    path = Path(root) / name
    try:
        size = path.stat().st_size
        if size != rec["bytes"]:
            return {**out, "actual_bytes": size, "status": "size"}
        got = file_digest(path)
    except FileNotFoundError:
        return {**out, "status": "missing"}
    except OSError as e:
        return {**out, "status": "missing", "error": f"{type(e).__name__}: {e.strerror or e}"}
    if got["bytes"] != rec["bytes"]:  # changed while being read
        return {**out, "actual_bytes": got["bytes"], "status": "size"}
    return {**out, "actual": got[ALGO], "status": "ok" if got[ALGO] == rec[ALGO] else "mismatch"}


def check_checkpoint(ckpt: Path, what: str = ALL, dims=None, validate_unrecorded: bool = False) -> dict:
    """Check the files of one checkpoint against the sizes and digests its state.json records (a collective when
    ``dims`` is distributed: every rank of the mesh calls it and gets the same report).

    Args:
        ckpt: the checkpoint directory.
        what: ``ALL`` recorded files, or ``WEIGHTS`` (those a model reader reads: not ``TRAINING_ONLY``).
        dims: the mesh (``genoctx.parallel.mesh.ParallelDims``) whose ranks share the hashing; None = this process.
        validate_unrecorded: for a checkpoint without digests, also check that its files can be read
            (``validate_checkpoint``: state, safetensors header, optimizer state), as a resume needs.

    Returns:
        ``{"path", "step", "recorded" (bool), "ok" (bool), "error" (a one-line problem not of one file, or None),
        "files": {name: {"bytes", "expected", "actual", "status"}}, "bytes_hashed", "seconds"}``; ``status`` is one
        of ``STATUSES``. ``ok`` is False when ``error`` is set or a file is ``mismatch``, ``missing`` or ``size``.
    """
    t0 = time.perf_counter()
    ckpt = Path(ckpt)
    rank, world = _mesh(dims)
    info = [_recorded(ckpt)] if rank == 0 else [None]
    if world > 1:
        from ..parallel import collectives as coll

        coll.broadcast_object_list(info, src=0)
    step, files, error = info[0]
    report = {"path": str(ckpt), "step": step, "recorded": files is not None, "ok": False, "error": error,
              "files": {}, "bytes_hashed": 0, "seconds": 0.0}  # fmt: skip
    if files is not None:
        names = sorted(n for n in files if what == ALL or n not in TRAINING_ONLY)
        mine = {n: _check_file(ckpt, n, files[n]) for n in names[rank::world]}
        if world > 1:
            from ..parallel import collectives as coll

            parts = [None] * world
            coll.all_gather_object(parts, mine)
            mine = {k: v for p in parts for k, v in p.items()}
        report["files"] = {n: mine[n] for n in names}
    elif error is None:
        report["files"] = {n: {"bytes": _size(ckpt / n), "expected": None, "actual": None, "status": "unrecorded"}
                           for n in stored_files(ckpt) if what == ALL or n not in TRAINING_ONLY}  # fmt: skip
        if validate_unrecorded:
            report["error"] = _agreed_validation(ckpt, rank, world)
    report["bytes_hashed"] = sum(f["bytes"] for f in report["files"].values() if f["actual"] is not None)
    fine = all(f["status"] in ("ok", "unrecorded") for f in report["files"].values())
    report["ok"] = report["error"] is None and fine
    report["seconds"] = round(time.perf_counter() - t0, 4)
    return report


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _agreed_validation(ckpt: Path, rank: int, world: int) -> str | None:
    """``validate_checkpoint``'s error (rank 0 reads, the mesh hears it), or None."""
    err = [None]
    if rank == 0:
        try:
            validate_checkpoint(ckpt)
        except GenoctxError as e:
            err = [str(e)]
    if world > 1:
        from ..parallel import collectives as coll

        coll.broadcast_object_list(err, src=0)
    return err[0]


def problem(report: dict) -> str | None:
    """The one-line problem of a ``check_checkpoint`` report (the first damaged file, named by its path, and what
    differs; ``(and N more files)`` when there are more), or None when it verifies."""
    if report["error"] is not None:
        return report["error"]
    bad = [(n, f) for n, f in report["files"].items() if f["status"] in ("mismatch", "missing", "size")]
    if not bad:
        return None
    name, f = bad[0]
    path = Path(report["path"]) / name
    if f["status"] == "missing":
        why = f"missing ({f['error']})" if f.get("error") else "missing"
        line = f"{path}: {why}; state.json records {f['bytes']} bytes"
    elif f["status"] == "size":
        line = (f"{path}: {f['actual_bytes']} bytes on disk, {f['bytes']} recorded in state.json (truncated or "
                "overwritten)")  # fmt: skip
    else:
        line = (f"{path}: {ALGO} digest {f['actual']} on disk, {f['expected']} recorded in state.json (damaged after "
                "it was written)")  # fmt: skip
    return line + (f" (and {len(bad) - 1} more file{'s' * (len(bad) > 2)})" if len(bad) > 1 else "")


def warn_unrecorded(report: dict, dims=None) -> None:
    """One warning line (rank 0) for a checkpoint without digests."""
    if not report["recorded"] and report["error"] is None and _mesh(dims)[0] == 0:
        log.warning("%s: no digests recorded; not verified", report["path"])


def _fail(message: str, dims) -> GenoctxError:
    return AgreedError(message) if _mesh(dims)[1] > 1 else GenoctxError(message)


def verify_checkpoint(ckpt: Path, what: str = ALL, dims=None) -> dict:
    """``check_checkpoint`` that raises on a damaged checkpoint and warns once for one without digests; returns
    the report (a collective when ``dims`` is distributed).

    Raises:
        GenoctxError: one line naming the first damaged file and what differs (an ``AgreedError``, the same line on
            every rank, on a mesh).
    """
    report = check_checkpoint(ckpt, what, dims)
    bad = problem(report)
    if bad is not None:
        raise _fail(f"{bad}; --no-verify loads it anyway", dims)
    warn_unrecorded(report, dims)
    return report


def run_of(given: str | Path) -> Path | None:
    """``given`` when it is a run directory (``checkpoints/`` and no state.json of its own), else None."""
    p = Path(given)
    return p if (p / "checkpoints").is_dir() and not (p / "state.json").is_file() else None


def refuse_unverified(ckpt: Path, given: str | Path, run: Path | None, flag: str, use: str, what: str = WEIGHTS,
                      dims=None) -> dict:  # fmt: skip
    """Verify the checkpoint ``ckpt`` that ``given`` (a checkpoint, or a run directory meaning its newest) resolved
    to, for a reader of one specific model (eval, export, ``--init``); a collective when ``dims`` is distributed.

    Args:
        ckpt, given: the checkpoint directory and the argument as the user gave it (for the message).
        run: the run directory ``given`` names (``run_of(given)``, computed where ``given`` was given), or None.
        flag, use: how the message names the argument (``--checkpoint``) and what the reader does (``evaluate it``).
        what, dims: as ``check_checkpoint``'s.

    Returns:
        The ``check_checkpoint`` report.

    Raises:
        GenoctxError: the checkpoint does not verify (its damaged file named); for a run directory also naming the
            newest checkpoint of the run that verifies ("pass it explicitly to ..."), never silently reading it.
    """
    report = check_checkpoint(ckpt, what, dims)
    bad = problem(report)
    if bad is None:
        warn_unrecorded(report, dims)
        return report
    if run is None:
        raise _fail(f"{flag} {given}: {bad}; --no-verify reads it anyway", dims)
    older = [c for c in list_checkpoints(run) if (step_of(c) or 0) < (step_of(ckpt) or 0)]
    good = next((c for c in reversed(older) if check_checkpoint(c, what, dims)["ok"]), None)
    tail = (f"the newest checkpoint that verifies is {good}: pass it explicitly to {use}" if good is not None
            else f"no older checkpoint of {run} verifies")  # fmt: skip
    raise _fail(f"{flag} {given}: its newest checkpoint {ckpt.name} does not verify ({bad}); {tail}", dims)


def set_aside(ckpt: Path) -> Path:
    """Rename a checkpoint found broken to ``step_N.broken`` (``.broken-2``, ... when taken) beside it: no longer a
    checkpoint of the run (``list_checkpoints``), never resumed from or counted by keep-N pruning, kept for a look.
    Only the run's single writer calls this. Returns the new path."""
    target = ckpt.with_name(ckpt.name + ".broken")
    n = 2
    while target.exists():
        target = ckpt.with_name(f"{ckpt.name}.broken-{n}")
        n += 1
    os.replace(ckpt, target)
    return target


def incomplete_report(ckpt: Path) -> dict:
    """The ``verify`` entry of a checkpoint folder without state.json (``incomplete_checkpoints``): as a
    ``check_checkpoint`` report, ``ok`` False, ``error`` its ``incomplete_line``, ``status`` ``incomplete``, and
    the files it holds listed as ``unrecorded`` (with their sizes)."""
    ckpt = Path(ckpt)
    files = {n: {"bytes": _size(ckpt / n), "expected": None, "actual": None, "status": "unrecorded"}
             for n in stored_files(ckpt)}  # fmt: skip
    return {"path": str(ckpt), "step": step_of(ckpt), "recorded": False, "ok": False, "error": incomplete_line(ckpt),
            "files": files, "bytes_hashed": 0, "seconds": 0.0, "status": "incomplete"}  # fmt: skip


def _order(report: dict) -> int:
    """A report's place in ``verify``'s list: the step of its folder's name (``step_N``), else its recorded step."""
    step = step_of(Path(report["path"]))
    return step if step is not None else report["step"] if report["step"] is not None else -1


def verify_path(path: str | Path) -> dict:
    """What ``genoctx verify PATH`` prints: every checkpoint of a run directory (or the one checkpoint) checked, and
    every checkpoint folder without state.json (``incomplete_checkpoints``: an interrupted copy) reported.

    Returns:
        ``{"path", "ok", "checkpoints": [reports, by step], "seconds", "gb_hashed"}`` (``gb_hashed`` in 10^9 bytes;
        ``ok``: no checkpoint damaged or incomplete, no base changed). A report is ``check_checkpoint``'s with
        ``status`` ``ok``, ``damaged`` or ``base_changed`` (a partial checkpoint, which holds only what trains,
        whose base differs from the one it records, or is missing: its ``base`` entry, ``_base_report``), or
        ``incomplete_report``'s (``status`` ``incomplete``).

    Raises:
        GenoctxError: no such path, or neither a checkpoint (``state.json``, or a ``checkpoints/step_N`` folder
            without it) nor a run directory with one.
    """
    p = Path(path)
    if not p.exists():
        raise GenoctxError(f"{p}: no such run or checkpoint directory")
    if (p / "state.json").is_file():
        ckpts, partial = [p], []
    elif p.is_dir() and step_of(p) is not None and p.parent.name == CKPT_DIR:
        ckpts, partial = [], [p]
    elif p.is_dir() and (list_checkpoints(p) or incomplete_checkpoints(p)):
        ckpts, partial = list_checkpoints(p), incomplete_checkpoints(p)
    else:
        raise GenoctxError(f"{p}: not a checkpoint (no state.json) nor a run directory with {CKPT_DIR}/step_*/")
    t0 = time.perf_counter()
    reports = [check_checkpoint(c) for c in ckpts]
    bases: dict[str, dict] = {}  # the checkpoints of a run share their base: checked once
    for c, r in zip(ckpts, reports, strict=True):
        warn_unrecorded(r)
        r["status"] = "ok" if r["ok"] else "damaged"
        base = _base_report(c, bases)
        if base is not None:
            r["base"] = base
            if base["status"] != "ok" and r["ok"]:
                r.update(ok=False, status="base_changed", error=base["error"])
    reports = sorted(reports + [incomplete_report(c) for c in partial], key=_order)
    return {
        "path": str(p),
        "ok": all(r["ok"] for r in reports),
        "checkpoints": reports,
        "seconds": round(time.perf_counter() - t0, 3),
        "gb_hashed": round(sum(r["bytes_hashed"] for r in reports) / 1e9, 6),
    }


def _base_report(ckpt: Path, seen: dict[str, dict]) -> dict | None:
    """``verify``'s ``base`` entry of a partial checkpoint (``genoctx.train.checkpoint.is_partial``): ``{"path",
    "kind", "status": "ok" | "changed", "error"}`` (``base_problem``: the base recomputed against the digest the
    checkpoint records); None for a whole checkpoint or an unreadable state.json (reported already). ``seen``
    caches the verdict by the base record, so a run's checkpoints hash their base once."""
    import json

    try:
        state = read_state(ckpt)
    except GenoctxError:
        return None
    if not is_partial(state):
        return None
    init = state.get("init") or {}
    key = json.dumps(init, sort_keys=True)
    if key not in seen:
        err = base_problem(state, ckpt)  # "<ckpt>: its base ...": kept without the checkpoint, named below
        seen[key] = {"path": init.get("path"), "kind": init.get("kind"), "status": "ok" if err is None else "changed",
                     "error": None if err is None else err[len(f"{ckpt}: ") :]}  # fmt: skip
    out = dict(seen[key])
    if out["error"] is not None:
        out["error"] = f"{ckpt}: {out['error']}"
    return out


def resume_choice(run: Path, dims=None) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The checkpoint a ``--resume`` of ``run`` loads: the newest whose files all verify (one without digests: whose
    files are readable, ``validate_checkpoint``), and the newer ones passed over, each with its one-line problem,
    newest first. A collective when ``dims`` is distributed. ``(None, skipped)`` when none verifies."""
    skipped: list[tuple[Path, str]] = []
    for ck in reversed(list_checkpoints(run)):
        report = check_checkpoint(ck, ALL, dims, validate_unrecorded=True)
        bad = problem(report)
        if bad is None:
            warn_unrecorded(report, dims)
            return ck, skipped
        skipped.append((ck, bad))
    return None, skipped


def skip_line(label: str, why: str, aside: Path | None) -> str:
    """The warning for a checkpoint a resume passed over (``label`` names it) and where it was set aside."""
    where = f"; set aside as {aside.name}" if aside is not None else ""
    return f"--resume: skipping checkpoint {label} ({why}){where}"
