"""Fixtures of the kernel tests: the device they run on and tensor views whose offsets pass 2^31 elements."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def device() -> str:
    """CUDA when present (the compiled kernels), else CPU (the kernels under TRITON_INTERPRET=1, tests/conftest.py)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def huge(tmp_path):
    """``huge(src, stride)``: a view with ``src``'s values and the given element strides over a sparse file.

    The view spans more than 2^31 elements, yet only the pages its elements touch are ever written: the file is
    created sparse (``truncate``) and memory-mapped shared (``torch.from_file``), so neither RAM nor disk holds more
    than a few pages. A kernel that computed offsets in 32 bits would address outside the mapping (a crash) or
    read the wrong elements.
    """
    paths = []

    def make(src: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
        n = 1 + sum((s - 1) * st for s, st in zip(src.shape, stride, strict=True))
        path = tmp_path / f"huge{len(paths)}.bin"
        paths.append(path)
        with open(path, "wb") as f:
            f.truncate(n * src.element_size())
        view = torch.from_file(str(path), shared=True, size=n, dtype=src.dtype).as_strided(src.shape, stride)
        view.copy_(src)
        return view

    yield make
    for path in paths:  # gigabytes of apparent size (a few pages on disk): do not leave them to pytest's tmp rotation
        path.unlink(missing_ok=True)
