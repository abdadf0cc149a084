"""Reruns, once, a test whose pytest-xdist worker process died under it (a hook plugin that
``tests/conftest.py`` imports; ``-p tests.crash_rerun`` loads it into another session).

Why: in full runs of the suite (two pytest-xdist workers, ~27 minutes) a worker has died
of SIGABRT raised in a native thread, with no message, at the same test twice
(``tests/train/test_dpo_variants.py``, ``aot_unpaired``) and not at all in other full runs;
neither that test's file alone nor the worker's sequence of files in one process
reproduced it. A dead worker takes no assertion with it, but pytest-xdist reports its test
as failed, so one such abort fails CI.

What: the test the worker was running goes back into the queue once and runs in another
worker process (pytest-xdist's ``pytest_handlecrashitem``). The crash stays visible: the
first report is counted as ``rerun`` in the summary line, and a section at the end names
every test whose worker died and how often. A test whose worker dies twice fails, as does
every ordinary failure (nothing else is rerun).
"""

from __future__ import annotations

from typing import Any

import pytest

RERUNS = 1
_deaths: dict[str, int] = {}  # test id -> times a worker died running it (this session)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched: Any) -> None:
    deaths = _deaths[crashitem] = _deaths.get(crashitem, 0) + 1
    if deaths <= RERUNS:
        sched.mark_test_pending(crashitem)
        report.outcome = "rerun"  # type: ignore[assignment]


def pytest_report_teststatus(report: pytest.TestReport) -> tuple[str, str, str] | None:
    if report.outcome == "rerun":
        return "rerun", "R", "RERUN"
    return None


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _deaths:
        return
    terminalreporter.write_sep("=", "worker processes that died", red=True)
    for test, deaths in _deaths.items():
        then = "rerun in another worker" if deaths <= RERUNS else "not rerun again: failed"
        terminalreporter.write_line(f"{test}: its worker died {deaths}x ({then})")
