"""genoctx.heap: glibc told to keep freed memory, so that a second identical step on the CPU reuses its buffers
instead of faulting fresh pages in (counted with getrusage's minor faults, no timing)."""

import json
import subprocess
import sys

import pytest

from genoctx.heap import keep_freed_memory

STEP = """
import json, resource, sys, torch
import torch.nn.functional as F
if sys.argv[1] == "keep":
    from genoctx.heap import keep_freed_memory
    assert keep_freed_memory()
from genoctx.model.config import preset
from genoctx.model.model import HybridLM
torch.set_num_threads(1)
m = HybridLM(preset("cpu-small"), seed=0)
ids = torch.randint(3, 7, (1, 2048), generator=torch.Generator().manual_seed(0))
def step():
    logits, _ = m(ids)
    F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    m.zero_grad(set_to_none=True)
step()
step()
faults = []
for _ in range(2 if sys.argv[1] == "keep" else 1):  # kept: the fewer of two (a loaded machine once faulted 25k)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(min(faults)))
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", STEP, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_second_step_reuses_the_heap():
    assert keep_freed_memory() and keep_freed_memory()  # glibc took it; a second call is the cached answer
    kept, default = _faults("keep"), _faults("default")
    # default glibc: the step's buffers above its mmap threshold come back as new pages (~150k 4 KiB faults at 2k)
    assert default > 10_000 and kept < default / 20, (kept, default)
