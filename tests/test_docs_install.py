"""docs/cluster.md's install line for CUDA machines: it cannot run in CI (no network, no GPU), so its form is held.

The line installs genoctx with the ``[gpu]`` extra (which pyproject.toml defines, with fla-core), pins the torch
that the tests run (README's test line pins the same version, and CI's torch is it), takes torch from a CUDA index
of PyTorch's (``https://download.pytorch.org/whl/cuNNN``) and everything else from PyPI, and is followed by
``genoctx doctor``, which checks what was installed.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


def _gpu_install() -> tuple[list[str], list[str]]:
    """(the pip arguments of the one install line that names the [gpu] extra, the block's other lines)."""
    text = (ROOT / "docs" / "cluster.md").read_text()
    found = []
    for block in FENCE.findall(text):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if "pip install" in line and "[gpu]" in line:
                found.append((line, lines[i + 1 :]))
    assert len(found) == 1, found
    line, rest = found[0]
    words = shlex.split(line)
    return words[words.index("install") + 1 :], rest


def _option(args: list[str], name: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == name]


def test_the_cuda_install_line_names_the_gpu_extra_the_tests_torch_and_a_cuda_index():
    args, rest = _gpu_install()
    assert _option(args, "-e") == [".[gpu]"]
    pins = [a for a in args if a.startswith("torch")]
    assert pins == ["torch==2.13.0"]
    assert pins[0] == "torch==" + torch.__version__.split("+")[0]  # the torch the tests run on CPU
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"pip install torch==2\.13\.0 -e '\.\[dev\]'", readme)  # the CPU line pins the same version
    (index,) = _option(args, "--index-url")
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu1[2-9]\d", index), index
    assert _option(args, "--extra-index-url") == ["https://pypi.org/simple"]
    assert any(ln.split("#")[0].split()[-1:] == ["doctor"] for ln in rest)  # then checked: genoctx doctor


def test_the_gpu_extra_exists_and_brings_fla():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("fla-core") for dep in extras["gpu"])
