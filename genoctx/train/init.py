"""Starting from a pretrained base: ``genoctx train --init SRC`` (recipe key ``model.init``).

SRC is a local HF model directory (``config.json`` + safetensors, ``genoctx.model.hf.is_hf_dir``), a genoctx
checkpoint or run directory (its weights, architecture and token map, with a fresh optimizer: what an export of it
given to ``--init`` also gives), or a Hub repo id (``org/name``, optionally ``org/name@revision``) resolved by
``huggingface_hub.snapshot_download`` into the usual HF cache: ``HF_HOME`` / ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE=1``
(the cache only) and ``HF_ENDPOINT`` (a mirror) are huggingface_hub's own settings, respected as they are.
genoctx never fetches weights any other way. The revision may be a branch or tag (``refs/<name>`` in the cache),
a full commit, or a short one, expanded here by a unique prefix among the cached ``snapshots/`` (huggingface_hub
does not); a ``--resume`` resolves the repo at the commit the run recorded when it started (``pinned_source``).

The base's config.json fixes the architecture (a recipe may set compute knobs only: ``genoctx.recipes``); the run
records, in every checkpoint's state.json, ``init``: the source as given, the resolved directory, the Hub revision
(commit hash) and a fingerprint of the base's files (sha256 of config and tokenizer files and of each safetensors
header: names, dtypes, shapes and offsets, not the gigabytes of values), plus the ``token_map`` and ``loss_vocab``
that train and eval use (``genoctx.model.vocab``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import struct
from pathlib import Path

from ..data.tokenizer import VOCAB
from ..errors import GenoctxError
from ..model.hf import check_hf, is_hf_dir, read_config, weight_files
from ..model.vocab import TokenMap, VocabHead, build_token_map
from ..recipes import Recipe

log = logging.getLogger("genoctx.train")

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
_SHORT_COMMIT = re.compile(r"[0-9a-fA-F]{4,39}")  # git abbreviates to 7 by default, and to no fewer than 4
_SMALL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json")


def resolve_base(src: str) -> tuple[Path, dict]:
    """The local directory of a base and its record ``{"source", "path", "revision", "kind", "hf_base"}``: ``kind``
    ``hf`` or ``genoctx`` (a checkpoint: ``path`` is its directory), ``hf_base`` the HF directory at the root of the
    lineage (what ``genoctx export`` takes the VL config, vision tower, MTP and tokenizer files from), or None.

    Args:
        src: an HF model directory, a genoctx checkpoint or run directory, or a Hub repo id ``org/name[@revision]``.

    Raises:
        GenoctxError: a directory that is not an HF model directory; a repo id that cannot be resolved (not in the
            cache with ``HF_HUB_OFFLINE=1``, unknown repo or revision, network failure); anything else.
    """
    p = Path(src).expanduser()
    if p.exists() and not is_hf_dir(p) and ((p / "state.json").is_file() or (p / "checkpoints").is_dir()):
        from .checkpoint import read_state, resolve_checkpoint

        ck = resolve_checkpoint(p).resolve()
        parent = read_state(ck).get("init") or {}
        info = {"source": src, "path": str(ck), "revision": None, "kind": "genoctx",
                "hf_base": parent.get("hf_base") or parent.get("path")}  # fmt: skip
        return ck, info
    if p.exists():
        from .checkpoint import looks_like_checkpoint, no_state_line

        if looks_like_checkpoint(p):
            raise GenoctxError(f"--init {src}: {no_state_line(p)}")
        if not is_hf_dir(p):
            raise GenoctxError(f"--init {src}: not an HF model directory (config.json and safetensors weights)")
        return p.resolve(), {"source": src, "path": str(p.resolve()), "revision": None, "kind": "hf",
                             "hf_base": str(p.resolve())}  # fmt: skip
    if not _REPO_ID.match(src):
        raise GenoctxError(f"--init {src}: no such directory, and not a Hub repo id (org/name[@revision])")
    repo, _, revision = src.partition("@")
    path = _hub_snapshot(src, repo, revision or None)
    if not is_hf_dir(path):
        raise GenoctxError(f"--init {src}: {path} has no config.json and safetensors weights")
    revision = path.name if path.parent.name == "snapshots" else None
    return path, {"source": src, "path": str(path), "revision": revision, "kind": "hf", "hf_base": str(path)}


def hub_cache() -> Path:
    """huggingface_hub's cache folder (``HF_HUB_CACHE``, default ``$HF_HOME/hub``) as it resolves it now."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser().resolve()


def expand_revision(repo: str, revision: str | None, where: str) -> str | None:
    """``revision`` with a short commit hash expanded to the full one by a unique prefix match among the cached
    snapshots of ``repo`` (huggingface_hub resolves a branch or tag through ``refs/<name>`` and a full 40-hex
    commit itself, offline too, but not a short commit). A name that ``refs/`` holds, a full commit, a revision
    that matches no cached snapshot (the Hub may know it) and None are returned as given.

    Args:
        repo: ``org/name``; revision: a branch, tag or commit (4 to 40 hex digits), or None (the default branch);
        where: what the error names (``--init org/name@abc1``).

    Raises:
        GenoctxError: a prefix that several cached snapshots share (one line listing them).
    """
    if revision is None or not _SHORT_COMMIT.fullmatch(revision):
        return revision
    folder = hub_cache() / ("models--" + repo.replace("/", "--"))
    if (folder / "refs" / revision).is_file():
        return revision
    snapshots, prefix = folder / "snapshots", revision.lower()
    found = sorted(d.name for d in snapshots.iterdir() if d.name.startswith(prefix)) if snapshots.is_dir() else []
    if len(found) > 1:
        raise GenoctxError(f"{where}: the short commit {revision} is ambiguous in {snapshots}: {', '.join(found)}; "
                           "give more digits")  # fmt: skip
    return found[0] if found else revision


def _hub_snapshot(src: str, repo: str, revision: str | None) -> Path:
    """The snapshot folder of ``repo`` at ``revision`` (None: the default branch), through
    ``huggingface_hub.snapshot_download`` (the cache only with ``HF_HUB_OFFLINE=1``); a short commit is expanded
    first (``expand_revision``).

    Raises:
        GenoctxError: one line naming ``src``: a revision (or a repo) that neither the cache nor the Hub has (the
            repo, the revision and the cache folder named), an incomplete cached snapshot, a Hub error.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, IncompleteSnapshotError, LocalEntryNotFoundError

    rev = expand_revision(repo, revision, f"--init {src}")
    try:
        return Path(snapshot_download(repo, revision=rev))
    except IncompleteSnapshotError as e:
        raise GenoctxError(f"--init {src}: {_first_line(e)}") from None
    except LocalEntryNotFoundError:
        cache = hub_cache()
        folder = cache / ("models--" + repo.replace("/", "--"))
        why = "HF_HUB_OFFLINE is set" if constants.is_offline_mode() else "no network"
        fetch = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
        ref = folder / "refs" / (revision or "main")
        if not folder.is_dir():
            what = f"no {folder.name} in {cache}"
        elif ref.is_file():
            what = f"{ref} names commit {ref.read_text().strip()}, which has no snapshot in {folder / 'snapshots'}"
        else:
            refs = sorted(str(f.relative_to(folder / "refs")) for f in (folder / "refs").rglob("*") if f.is_file())
            snaps = sorted(d.name[:12] for d in (folder / "snapshots").glob("*") if d.is_dir())
            what = (f"revision {revision or 'main'} of {repo} is not in {cache} (cached refs: "
                    f"{', '.join(refs) or 'none'}; snapshots: {', '.join(snaps) or 'none'})")  # fmt: skip
        raise GenoctxError(f"--init {src}: not in the Hugging Face cache: {what}, and the Hub cannot be reached "
                           f"({why}); fetch it first: {fetch}") from None  # fmt: skip
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise GenoctxError(f"--init {src}: cannot resolve on the Hub ({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def pinned_source(src: str, run: Path) -> tuple[str, str | None]:
    """What a ``--resume`` of the run folder ``run`` resolves for ``--init src``: ``(org/name@<commit>, the run's
    recorded source)`` when ``src`` is a Hub repo id of the repo the run started from and its newest readable
    checkpoint recorded the snapshot commit (state.json ``init.revision``); else ``(src, None)`` (a local base,
    another repo, a run with no checkpoint yet). A ``src`` whose revision differs from the recorded one is logged
    as a warning: a resume continues the same run, from the same base.
    """
    if Path(src).expanduser().exists() or not _REPO_ID.match(src):
        return src, None
    from .checkpoint import list_checkpoints, read_state

    init: dict = {}
    for ck in reversed(list_checkpoints(run)):
        try:
            init = read_state(ck).get("init") or {}
        except GenoctxError:
            continue  # a damaged state.json: the resume itself names it (or falls back past it)
        break
    recorded, commit = init.get("source"), init.get("revision")
    if not (isinstance(recorded, str) and isinstance(commit, str) and _REPO_ID.match(recorded)):
        return src, None
    repo = src.partition("@")[0]
    if recorded.partition("@")[0] != repo:
        return src, None
    if src != recorded:
        log.warning("--resume: the run started from %s at commit %s; --init %s is resumed at that commit", recorded,
                    commit, src)  # fmt: skip
    else:
        log.info("--resume: --init %s at commit %s, the one the run started from", src, commit)
    return f"{repo}@{commit}", recorded


def fingerprint(path: Path) -> dict[str, str]:
    """sha256 of the base's small files and of each safetensors header (``{file name: hex}``)."""
    out = {}
    for name in _SMALL_FILES:
        f = path / name
        if f.is_file():
            out[name] = hashlib.sha256(f.read_bytes()).hexdigest()
    out.update(_header_hashes(weight_files(path)))
    return out


def _header_hashes(files) -> dict[str, str]:
    """sha256 of each safetensors file's header (its first 8 bytes and the JSON they size)."""
    out = {}
    for f in files:
        with open(f, "rb") as fh:
            raw = fh.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else 0
            out[f.name + ":header"] = hashlib.sha256(raw + fh.read(min(n, 1 << 30))).hexdigest()
    return out


def resolve_init(recipe: Recipe, run: Path | None = None) -> tuple[Recipe, dict | None]:
    """The recipe with ``model`` set from the base's config.json (plus the recipe's compute knobs) and the base's
    record (``resolve_base`` + ``fingerprint``); ``(recipe, None)`` when it has no ``init``.

    Args:
        recipe: the run's recipe; its ``init`` (``model.init``, ``--init``) names the base (None: no base).
        run: the run folder of a ``--resume`` (None for a new run): a Hub base of the repo the run started from is
            resolved at the snapshot commit its checkpoints recorded, wherever the branch or tag points now
            (``pinned_source``); the record keeps the run's first ``source``.

    Raises:
        GenoctxError: as ``resolve_base``, or a config.json that is not a glm5_next model (named).
    """
    if recipe.init is None:
        return recipe, None
    src, started = pinned_source(recipe.init, run) if run is not None else (recipe.init, None)
    try:
        path, info = resolve_base(src)
    except GenoctxError as e:
        if started is None:
            raise
        raise GenoctxError(f"--resume: {e} (the commit the run started from, in its state.json)") from None
    if started is not None:
        info["source"] = started
    if info["kind"] == "genoctx":
        from .checkpoint import load_recipe_of

        cfg = load_recipe_of(path).model
        info["files"] = {name: hashlib.sha256((path / name).read_bytes()).hexdigest() for name in ("state.json",)}
        if (path / "model.safetensors").is_file():  # (a DCP checkpoint: its state.json records every file's digest)
            info["files"].update(_header_hashes([path / "model.safetensors"]))
    else:
        cfg, _ = read_config(path)
        info["files"] = fingerprint(path)
    cfg = dataclasses.replace(cfg, **recipe.model_knobs)
    if info["kind"] == "hf":  # every tensor present and of its shape, from the headers: before any rank reads
        check_hf(path, cfg)
    return dataclasses.replace(recipe, model=cfg, init=None, model_knobs={}), info


def vocab_head(recipe: Recipe, base: dict | None, state: dict | None = None) -> VocabHead | None:
    """The ``VocabHead`` a run trains through: None for a nucleotide model (``vocab_size`` == 8, identity map);
    for a text base, its token map (from ``state`` when resuming, else built from the base's tokenizer.json).

    A nucleotide model needs no tokenizer: an HF base with the 8 nucleotide tokens (``genoctx export`` of a
    nucleotide run, which has no tokenizer.json) is read as eval reads it (``genoctx.eval.scoring``), without a map.

    Raises:
        GenoctxError: a text vocabulary without a base to read the tokenizer from, or a bad tokenizer
            (``build_token_map``).
    """
    cfg = recipe.model
    if cfg.vocab_size == len(VOCAB) and (base is None or base.get("kind") == "hf"):
        if not (state or {}).get("token_map"):  # (a run that recorded a map keeps it: read below)
            return None
    if base is not None and base.get("kind") == "genoctx":
        if state is None:
            from .checkpoint import read_state

            state = read_state(Path(base["path"]))  # the source run's token map
        if not state.get("token_map"):  # (resuming: this run's state, which recorded the source's map if it had one)
            return None
    if state is not None and state.get("token_map"):
        token_map = TokenMap.from_dict(state["token_map"])
    elif base is not None:
        token_map = build_token_map(Path(base["path"]) / "tokenizer.json", cfg.vocab_size,
                                    recipe.data.window_start_token)  # fmt: skip
    else:
        raise GenoctxError(
            f"model.vocab_size {cfg.vocab_size} is not the {len(VOCAB)} nucleotide tokens: a text vocabulary needs a "
            "base with a tokenizer (--init)"
        )
    if token_map.is_identity:
        return None
    return VocabHead(token_map, recipe.loss.vocab, recipe.loss.chunk_tokens)


def base_source(base: dict):
    """Where ``genoctx.parallel.build.build_model`` reads a base's weights from: ``FromHF`` for an HF directory,
    ``FromCheckpoint`` for a genoctx checkpoint (each rank reads only its own slices; fp32 masters)."""
    from ..parallel.build import FromCheckpoint, FromHF

    if base.get("kind") == "genoctx":
        return FromCheckpoint(Path(base["path"]))
    return FromHF(Path(base["path"]))


def describe(base: dict | None, head: VocabHead | None) -> dict:
    """What goes into state.json: ``init`` (the base record), ``token_map`` and ``loss_vocab``."""
    out: dict = {}
    if base is not None:
        out["init"] = base
    if head is not None:
        out["token_map"] = head.token_map.to_dict()
        out["loss_vocab"] = head.vocab
    return out
