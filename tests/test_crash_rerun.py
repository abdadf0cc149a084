"""tests/crash_rerun.py: a test whose xdist worker dies runs once more in another worker; a
second death, a rerun that never happens, and every ordinary failure still fail the run.

Each case runs a small pytest session in a temporary folder (its own ``pytest.ini``, so no
configuration of this repository applies; no colours; no core files)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# Environment settings of the outer session that would change the inner one's output.
OUTER_SETTINGS = (
    "PYTEST_ADDOPTS",
    "PYTEST_PLUGINS",
    "PYTEST_DISABLE_PLUGIN_AUTOLOAD",
    "PY_COLORS",
    "FORCE_COLOR",
)

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


def _session(tmp_path: Path, *args: str) -> tuple[int, str, list[str]]:
    """Runs the tests of ``TESTS`` named by ``-k`` in ``args``: (exit status, stdout, the
    summary line's counts)."""
    (tmp_path / "test_crash.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if k not in OUTER_SETTINGS}
    env["CRASH_MARK"] = str(tmp_path / "mark")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "--color=no", "-p", "tests.crash_rerun"]
    pytest_cmd += ["-p", "no:cacheprovider", *args, "test_crash.py"]
    # No core files from the aborts. A shell sets the limit: a preexec_fn would run Python
    # in a fork of this multithreaded (JAX) process.
    out = subprocess.run(
        ["sh", "-c", 'ulimit -c 0 && exec "$@"', "sh", *pytest_cmd],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = out.stdout.strip().splitlines()
    assert lines, out.stderr[-3000:]
    return out.returncode, out.stdout, lines[-1].split(" in ")[0].split(", ")


def test_a_dead_worker_s_test_runs_once_more(tmp_path):
    status, stdout, counts = _session(tmp_path, "-n", "2")
    assert status == 1, stdout[-3000:]
    for count in ("2 failed", "2 passed", "2 rerun"):  # whatever else the line counts
        assert count in counts, counts
    assert "test_crash.py::test_dies_once: its worker died 1x (rerun" in stdout
    assert "test_crash.py::test_dies_always: its worker died 2x (not rerun" in stdout
    assert "FAILED test_crash.py::test_fails" in stdout


def test_a_rerun_that_passes_passes_the_session(tmp_path):
    status, stdout, counts = _session(tmp_path, "-n", "2", "-k", "dies_once or ok")
    assert status == 0, stdout[-3000:]
    assert counts == ["2 passed", "1 rerun"], counts


@pytest.mark.parametrize(
    "args", [["--max-worker-restart=0"], ["--dist", "loadfile"]], ids=["no_worker", "loadfile"]
)
def test_a_test_not_run_again_fails(tmp_path, args):
    """No worker left to run it (the restart limit reached), or a --dist mode that cannot
    requeue a test: the death is a failure, never a silent 'rerun'."""
    status, stdout, counts = _session(tmp_path, "-n", "1", *args, "-k", "dies_once")
    assert status == 1, stdout[-3000:]
    assert "1 failed" in counts, counts
