"""Test-wide setup: the two tiers, 8 fake CPU devices fixed before any backend starts, and
one persistent XLA compilation cache per session.

Tiers. ``python -m pytest -q`` runs the default tier: every test not marked ``slow``. The
full tier adds the ``slow`` tests (learning runs, notebooks, docs pages that train,
multi-process and kill/resume tests, recipe dry runs, planner CLI runs, benchmark scripts,
anything over ~5 s): ``python -m pytest -q --run-slow``, or ``JAXRLHF_RUN_SLOW=1`` in the
environment (for scripts that run ``pytest -k`` subsets). ``-m slow --run-slow`` runs the
slow tests alone. Tests marked ``tpu`` need the TPU compiler (``pip install -e ".[tpu]"``)
and are skipped where libtpu is absent; those that compile whole runs are slow too.

Compilation. One setting per process, chosen before JAX starts and never changed while it
runs. The full tier compiles with XLA's defaults, as users do. The default tier, which
compiles hundreds of tiny programs and runs each a few times, compiles them fast:
``FAST_COMPILE_FLAGS`` (LLVM at -O0 without its expensive passes, XLA:CPU's older loop
emitters) go into ``XLA_FLAGS`` (a flag of the same name the user set there wins). That
changes float32 results in rounding only, and both sides of every comparison in a process
compile alike. Tests that start processes are in the full tier, where every process
compiles at XLA's defaults; ``JAXRLHF_TEST_FAST_COMPILE=0`` runs the default tier at them
too.

The compilation cache. Many tests (and the processes some start) compile the same
programs: an on-disk cache compiles each once per pytest-xdist worker, and the processes a
test starts inherit its worker's (``.ci/run`` keeps one between its runs). A cached
executable is the one the compiler produced for the same program and options, so results,
bitwise comparisons included, are unchanged. Each worker has a directory of its own: JAX
writes an entry with a plain ``write_bytes`` and reads entries without a lock, so a worker
could read an entry another worker was still writing (it happened once). A size limit would
make JAX lock its files, but then every write scans every entry of the directory, which
made the default tier's compiles markedly slower with thousands of entries.

Threads. XLA:CPU runs each device's share of a multi-device program as a task on one pool
of ``max(NPROC or cores, devices)`` threads, and a share that reaches a collective blocks
its thread until every share of that program arrives; with more than one multi-device
program in flight the blocked shares can hold every thread while a share they wait for is
still queued, and XLA aborts the process after its rendezvous timeout (40 s, hard-coded in
XLA:CPU until openxla/xla#32115 made it a flag; jax-ml/jax#31818). docs/sharding.md ("Two
programs in flight on XLA:CPU") has the measurements: asynchronously dispatched eager ops
on arrays sharded over 8 devices aborted a loaded host's process in 3 of 3 tries with 8
threads and in none with 16 (``benchmarks/cpu_eager_collectives.py``), so the suite sets
``NPROC=16``. That holds the eager ops the tests run, not any two programs (two 8-device
programs in flight need 24 threads); tests of the library's own check of this (async RL
on CPU) set ``NPROC`` themselves. No upstream report of the pool's sizing was found.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

import pytest

RUN_SLOW_ENV = "JAXRLHF_RUN_SLOW"
FAST_COMPILE_ENV = "JAXRLHF_TEST_FAST_COMPILE"
FAST_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
)


def _run_slow_requested() -> bool:
    """Whether this process runs the full tier, decided before JAX starts: from the
    environment or the command line (``pytest_configure`` checks it against the parsed
    option)."""
    if os.environ.get(RUN_SLOW_ENV, "") not in ("", "0"):
        return True
    return "--run-slow" in sys.argv[1:] + os.environ.get("PYTEST_ADDOPTS", "").split()


def _with_fast_compile_flags(xla_flags: str) -> str:
    """``xla_flags`` followed by each of ``FAST_COMPILE_FLAGS`` whose name it lacks."""
    have = xla_flags.split()
    names = {flag.split("=", 1)[0] for flag in have}
    return " ".join(have + [f for f in FAST_COMPILE_FLAGS if f.split("=", 1)[0] not in names])


RUN_SLOW = _run_slow_requested()
if RUN_SLOW:
    os.environ[RUN_SLOW_ENV] = "1"  # pytest-xdist's workers decide alike
elif os.environ.get(FAST_COMPILE_ENV, "1") != "0":
    os.environ["XLA_FLAGS"] = _with_fast_compile_flags(os.environ.get("XLA_FLAGS", ""))

# Must run before JAX creates its CPU backend; the device count is fixed at backend init.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("NPROC", "16")  # see "Threads" above
CACHE_BASE_ENV = "JAXRLHF_TEST_XLA_CACHE"  # the session's cache; workers use subdirectories
if "JAX_COMPILATION_CACHE_DIR" in os.environ and CACHE_BASE_ENV not in os.environ:
    os.environ[CACHE_BASE_ENV] = os.environ["JAX_COMPILATION_CACHE_DIR"]  # e.g. .ci/run's
if CACHE_BASE_ENV not in os.environ:
    os.environ[CACHE_BASE_ENV] = tempfile.mkdtemp(prefix="jaxrlhf-tests-xla-cache-")
    atexit.register(shutil.rmtree, os.environ[CACHE_BASE_ENV], ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(
    os.environ[CACHE_BASE_ENV], os.environ.get("PYTEST_XDIST_WORKER", "main")
)
# Cache every program, however small or quick to compile.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# Start the backend now: code under test that sets the CPU device count before JAX starts
# (the dry run's CLI does, for the mesh it plans) must find it fixed at 8 in every worker,
# whichever test a worker happens to run first.
assert len(jax.devices()) == 8


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=False,
        help=f"run the full tier: the tests marked slow too (or set {RUN_SLOW_ENV}=1)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("run_slow") and not RUN_SLOW:
        raise pytest.UsageError(
            f"--run-slow came too late to choose how this process compiles (tests/conftest.py "
            f"reads the command line and PYTEST_ADDOPTS): set {RUN_SLOW_ENV}=1 instead"
        )


_deselected_slow: list[int] = []  # how many slow tests this session's default tier left out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The default tier deselects the slow tests (the summary line counts them)."""
    if RUN_SLOW:
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]
        _deselected_slow.append(len(slow))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Says that the full tier was left out (with the count where this process collected:
    under pytest-xdist the workers collect and the controller does not know it)."""
    if RUN_SLOW:
        return
    count = f"{_deselected_slow[-1]} " if _deselected_slow else ""
    terminalreporter.write_line(
        f"the full tier's {count}slow tests were deselected: add --run-slow or set "
        f"{RUN_SLOW_ENV}=1 to run them"
    )
