"""The shell pipelines in examples/ parse, and the demo is reproduce-small with its own budgets (one pipeline)."""

import re
import subprocess
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.sh")))
def test_example_parses(script):
    r = subprocess.run(["bash", "-n", str(EXAMPLES / script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_demo_runs_reproduce_small_with_smaller_budgets():
    demo = (EXAMPLES / "demo.sh").read_text()
    full = (EXAMPLES / "reproduce-small.sh").read_text()
    assert 'exec bash "$(dirname "$0")/reproduce-small.sh"' in demo

    def default(text: str, var: str) -> int:
        return int(re.search(rf"{var}=\$\{{{var}:-(\d+)\}}", text).group(1))

    for var in ("BASE_STEPS", "POST_STEPS"):
        assert default(demo, var) < default(full, var)
    assert default(demo, "COPY_PROBE") == 0 and default(full, "COPY_PROBE") == 1
    # the comparison that means something: base vs post-trained, the order-8 Markov chain alongside
    assert re.search(r'--checkpoint "\$OUT/base" --checkpoint "\$OUT/post" --markov 8', full)
