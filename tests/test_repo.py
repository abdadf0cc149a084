"""Promises about the repository itself."""

from pathlib import Path

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
    assert test_command in ci_lines
