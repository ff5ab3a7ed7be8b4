"""The README and the user guide (docs/, built with MkDocs).

- README.md is short (at most 300 lines) and starts with the two commands for a fresh machine: the demo and the
  test command that `.ci/run` runs.
- Every relative link in README.md points at a file of the repository.
- `mkdocs build --strict` of the guide passes with no warning, so a broken link, a broken anchor or a page left out
  of the nav fails the suite (and CI, which runs it); a copy of the guide with a broken link and a broken anchor is
  refused, naming both.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

DEMO = "bash examples/demo.sh"
TESTS = (
    "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e '.[dev]' && .venv/bin/ruff check . "
    "&& .venv/bin/pytest -q"
)

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _mkdocs(config: Path, site: Path) -> subprocess.CompletedProcess:
    """Run `mkdocs build --strict` of `config` into `site` with this interpreter; stdout and stderr together."""
    try:
        import material  # noqa: F401
        import mkdocs  # noqa: F401
    except ImportError as e:  # pragma: no cover - the [dev] extra installs both
        pytest.fail(f"{e.name} is not installed: pip install -e '.[dev]' (mkdocs and mkdocs-material are in [dev])")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        cwd=config.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's end-of-life banner, not a build warning
    )


def test_readme_is_short_and_starts_with_the_two_commands():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; at most 300 (move the rest into docs/)"
    blocks = [b.strip() for b in FENCE.findall(text)]
    assert blocks[:2] == [DEMO, TESTS], blocks[:2]
    # Before the first command: the title and what genoctx is, no section yet.
    before = text[: text.index("```")]
    assert before.startswith("# genoctx\n") and "\n## " not in before


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    # .ci/run quiets pip; otherwise it is the README's command.
    assert TESTS in ci.replace("pip install -q ", "pip install "), ci


def test_every_relative_link_in_the_readme_points_at_a_file():
    targets = [a or b for a, b in LINK.findall(README.read_text())]
    relative = [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]
    assert len(relative) >= 10, relative  # the README links into the guide
    missing = [t for t in relative if not (ROOT / t.split("#", 1)[0]).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
    docs = {t.split("#", 1)[0] for t in relative if t.startswith("docs/")}
    for page in ("prepare", "train", "eval", "plan", "export", "model", "cluster", "checkpoints",
                 "context_parallel", "reproduction", "benchmarks", "eval_schema", "design"):  # fmt: skip
        assert f"docs/{page}.md" in docs, f"README.md does not link to docs/{page}.md"


def test_the_guide_builds_strict_without_a_warning(tmp_path):
    site = tmp_path / "site"
    run = _mkdocs(ROOT / "mkdocs.yml", site)
    assert run.returncode == 0, run.stdout
    assert "WARNING" not in run.stdout, run.stdout
    # Every page of docs/ is built, and the home page includes the README's demo section (one source).
    pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
    for page in pages:
        assert (site / ("index.html" if page == "index" else f"{page}/index.html")).is_file(), page
    home = (site / "index.html").read_text()
    assert "How to read the table" in home and "markov-8: +3.60" in home


def test_a_broken_link_or_anchor_fails_the_strict_build(tmp_path):
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copy(README, tmp_path / "README.md")  # the home page includes a section of it
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    page = tmp_path / "docs" / "train.md"
    page.write_text(page.read_text() + "\n[gone](no_such_page.md) and [nowhere](plan.md#no-such-section)\n")
    run = _mkdocs(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert run.returncode != 0, run.stdout
    assert "no_such_page.md" in run.stdout and "no-such-section" in run.stdout, run.stdout
    assert "strict" in run.stdout.lower(), run.stdout
