"""Promises about the repository itself."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _fenced_commands(text: str) -> list[str]:
    blocks = text.split("```bash\n")[1:]
    return [b.split("```")[0].strip() for b in blocks]


def test_ci_runs_exactly_the_readme_test_command():
    readme_commands = _fenced_commands((ROOT / "README.md").read_text())
    setup = [c for c in readme_commands if c.startswith("pip install")]
    assert len(setup) == 2, setup  # exactly two set-up commands for a newcomer
    test_command = next(c for c in setup if "pytest" in c)
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    # As written, or followed by `|| exit 1` (`set -e` does not stop inside an && list).
    assert test_command in ci_lines or f"{test_command} || exit 1" in ci_lines


def test_chat_template_renderer_is_a_dependency():
    """transformers renders chat templates with jinja2 without depending on it: a fresh
    install must get it from us, or ``chat_template: auto`` fails on any instruct model."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    assert "jinja2" in names
