"""The ``genoctx`` command line: thin wrappers that parse flags and call one function per verb.

Results go to stdout (JSON, or a table/CSV for ``eval``); logs and progress go to stderr. Exit codes:
0 success, 2 bad input (a one-line message naming the file, record or flag), 1 an internal error.

Help (``--help``) is plain text at most 80 columns wide whatever the terminal (``_HelpFormatter``): option names
are never cut and help text wraps instead of being truncated. One idea has one flag name across verbs
(``--seq-chunk``, ``--gpu-memory-gib``, ``--ep-folded/--no-ep-folded``, ``--cp-layout``); an old name stays
accepted as a hidden alias (``_alias``), and messages name the flag the user typed.

Flags are checked here, before any work (a size flag through :func:`_size`, an output file before scoring), so
a bad value never costs a long run or leaves partial output.

Layout: ``common`` (the Typer ``app``, help formatter, logging, user errors, JSON output, path/size/device checks),
``options`` (the options several verbs share, defined once), and one module per verb: ``prepare``, ``train``,
``eval``, ``export``, ``verify``, ``doctor``, ``plan``, ``model`` (``model info``). Importing this package
registers every verb on ``app`` in that order.
"""

from __future__ import annotations

# re-exported: the helpers tests and scripts import from genoctx.cli
from .common import (  # noqa: F401
    _absolute_paths,
    _alias,
    _at_least,
    _cuda_devices,
    _data_dir,
    _device,
    _emit_json,
    _expandable_segments,
    _one_line,
    _out_dir,
    _set_cuda_device,
    _setup_logging,
    _size,
    _user_errors,
    app,
    model_app,
)

# the verbs register on ``app`` in this order, the order of ``genoctx --help``
# isort: off
from .prepare import prepare
from .train import train
from .eval import eval_
from .export import export
from .verify import verify
from .doctor import doctor
from .plan import plan
from .model import model_info

# isort: on
__all__ = ["app", "doctor", "eval_", "export", "main", "model_app", "model_info", "plan", "prepare", "train", "verify"]


def main() -> None:  # pragma: no cover
    """Run the ``genoctx`` command line (``sys.argv``); exits with its code."""
    app()
