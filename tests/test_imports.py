"""The import arrows point down only (docs/design.md, "Layout"):

    cli -> cluster -> {train, eval} -> {plan, parallel} -> model -> kernels        (data beside)

Every module under ``genoctx/`` and ``kernels/`` is parsed with ``ast``; every import counts, at any depth (a lazy
import inside a function is still an arrow), relative imports resolved against the importing module's package.
Only ``genoctx/cluster.py`` (and the CLI above it) imports Ray; the training and eval workers that run inside Ray get
what they need of it from ``genoctx.cluster`` as a handed session object.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("genoctx", "kernels")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            found[_module_name(path)] = path
    return found


def _is_package(name: str) -> bool:
    path = _modules().get(name)
    return path is not None and path.name == "__init__.py"


def _resolve(name: str, module: str, level: int) -> str:
    """The absolute name of ``from <level dots><name> import ...`` written in ``module``."""
    if level == 0:
        return name
    base = module.split(".")
    if not _is_package(module):
        base = base[:-1]  # a module's relative imports start from its package
    if level > 1:
        base = base[: -(level - 1)]
    return ".".join([*base, name] if name else base)


@cache
def imports_of(module: str) -> frozenset[str]:
    """Every module ``module`` imports (top-level or inside functions): ``import a.b`` gives ``a.b``;
    ``from a import b`` gives ``a`` and, when ``a.b`` is a module of the tree, ``a.b``."""
    tree = ast.parse(_modules()[module].read_text(), filename=str(_modules()[module]))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.module == "__future__":
                continue
            target = _resolve(node.module or "", module, node.level)
            out.add(target)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in _modules():
                    out.add(sub)
    out.discard(module)
    return frozenset(out)


def _under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _violations(importers: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{m} imports {t}" for m in _modules() if _under(m, *importers) for t in imports_of(m) if _under(t, *forbidden)
    )


def test_the_tree_is_found():
    mods = _modules()
    for name in ("genoctx.cli", "genoctx.cluster", "genoctx.parallel.mesh", "genoctx.train.loop", "kernels"):
        assert name in mods, name
    assert "genoctx.model.config" in imports_of("genoctx.parallel.build")  # "from ..model.config import ..."
    assert "genoctx.parallel.fsdp" in imports_of("genoctx.parallel.build")  # "from .fsdp import ..." in a function
    assert "genoctx.errors" in imports_of("genoctx.cluster")  # "from .errors import ..." at the top level


LOW = ("genoctx.parallel", "genoctx.model", "genoctx.data", "kernels")
HIGH = ("genoctx.train", "genoctx.eval", "genoctx.plan", "genoctx.cluster", "genoctx.cli", "ray")


def test_parallel_model_data_kernels_import_nothing_above_them():
    assert _violations(LOW, HIGH) == []


def test_only_cluster_and_cli_import_ray():
    users = sorted(m for m in _modules() if any(_under(t, "ray") for t in imports_of(m)))
    assert set(users) <= {"genoctx.cluster", "genoctx.cli"}, users


def test_cluster_knows_nothing_of_training_or_eval():
    assert _violations(("genoctx.cluster",), ("genoctx.train", "genoctx.eval", "genoctx.cli")) == []


@pytest.mark.parametrize(
    "importers, forbidden",
    [
        (("genoctx.train", "genoctx.eval"), ("genoctx.cluster", "genoctx.cli")),
        (("genoctx.plan",), ("genoctx.train", "genoctx.eval", "genoctx.cluster", "genoctx.cli")),
        (("genoctx.model", "kernels"), ("genoctx.parallel", "genoctx.train")),
        (("genoctx.data",), ("genoctx.model",)),
        (("kernels",), ("genoctx",)),
        (("genoctx.progress",), ("genoctx",)),  # a leaf: train and eval draw bars without importing the CLI
    ],
)
def test_arrows_point_down(importers, forbidden):
    assert _violations(importers, forbidden) == []


def test_no_two_modules_import_each_other():
    mods = _modules()
    pairs = sorted(f"{a} <-> {b}" for a in mods for b in imports_of(a) if a < b and b in mods and a in imports_of(b))
    assert pairs == []
