"""Reruns, once, a test whose pytest-xdist worker process died under it (a hook plugin that
``tests/conftest.py`` imports; ``-p tests.crash_rerun`` loads it into a session that does
not load that conftest).

Why: in full runs of the suite (two pytest-xdist workers, ~27 minutes) a worker has died
of SIGABRT raised in a native thread, with no message, at the same test twice
(``tests/train/test_dpo_variants.py``, ``aot_unpaired``) and not at all in other full runs;
neither that test's file alone nor the worker's sequence of files in one process
reproduced it. A dead worker takes no assertion with it, but pytest-xdist reports its test
as failed, so one such abort fails CI.

What: the test the worker was running goes back into the queue once (pytest-xdist's
``pytest_handlecrashitem``) and runs in another worker process. The crash stays visible: the
first report is counted as ``rerun`` in the summary line, and a section at the end names
every test whose worker died, how often and what followed. A test whose worker dies twice
fails, as does every ordinary failure (nothing else is rerun), a test that the ``--dist``
mode cannot requeue (only ``load`` and ``worksteal`` can), and a requeued test that never
ran again (no worker left, e.g. ``--max-worker-restart`` reached): the session then ends
with a failed report for it and a non-zero exit status.
"""

from __future__ import annotations

from typing import Any

import pytest

RERUNS = 1
_deaths: dict[str, int] = {}  # test id -> times a worker died running it (this session)
_requeued: dict[str, int] = {}  # test id -> times it went back into the queue
_owed: set[str] = set()  # requeued tests with no report since


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched: Any) -> None:
    deaths = _deaths[crashitem] = _deaths.get(crashitem, 0) + 1
    if deaths > RERUNS:
        return
    try:
        sched.mark_test_pending(crashitem)
    except NotImplementedError:  # this --dist mode cannot requeue a test: it stays failed
        return
    _requeued[crashitem] = _requeued.get(crashitem, 0) + 1
    _owed.add(crashitem)
    report.outcome = "rerun"  # type: ignore[assignment]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.outcome != "rerun":
        _owed.discard(report.nodeid)


def pytest_report_teststatus(report: pytest.TestReport) -> tuple[str, str, str] | None:
    if report.outcome == "rerun":
        return "rerun", "R", "RERUN"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    for test in sorted(_owed):  # requeued, never run again: a failure, not a silent pass
        report = pytest.TestReport(
            nodeid=test,
            location=(test.split("::")[0], None, test),
            keywords={},
            outcome="failed",
            longrepr="its worker process died and no worker ran it again",
            when="call",
        )
        session.config.hook.pytest_runtest_logreport(report=report)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _deaths:
        return
    terminalreporter.write_sep("=", "worker processes that died", red=True)
    for test, deaths in _deaths.items():
        if test in _owed:
            then = "requeued but never run again: failed"
        elif deaths > _requeued.get(test, 0):
            then = "not rerun: failed"
        else:
            then = "rerun in another worker"
        terminalreporter.write_line(f"{test}: its worker died {deaths}x ({then})")
