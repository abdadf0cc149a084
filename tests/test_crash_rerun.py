"""tests/crash_rerun.py: a test whose xdist worker dies runs once more in another worker; a
second death, and every ordinary failure, still fails the run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

TESTS = """
import os
from pathlib import Path

MARK = Path(os.environ["CRASH_MARK"])


def test_ok():
    pass


def test_dies_once():
    if not MARK.exists():
        MARK.write_text("died")
        os.abort()


def test_dies_always():
    os.abort()


def test_fails():
    assert 0
"""


def test_a_dead_worker_s_test_runs_once_more(tmp_path):
    (tmp_path / "test_crash.py").write_text(TESTS)
    env = {**os.environ, "CRASH_MARK": str(tmp_path / "mark"), "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "tests.crash_rerun"]
        + ["-p", "no:cacheprovider", "test_crash.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    summary = out.stdout.strip().splitlines()[-1]
    assert out.returncode == 1, out.stdout[-3000:]
    for count in ("2 failed", "2 passed", "2 rerun"):  # whatever else the line counts
        assert count in summary.split(" in ")[0].split(", "), summary
    assert "test_crash.py::test_dies_once: its worker died 1x (rerun" in out.stdout
    assert "test_crash.py::test_dies_always: its worker died 2x (not rerun" in out.stdout
    assert "FAILED test_crash.py::test_fails" in out.stdout
