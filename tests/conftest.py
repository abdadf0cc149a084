"""Test-wide JAX setup: 8 fake CPU devices, fixed before any backend initialises, XLA:CPU
flags for fast compiles (tests/compile_flags.py), and one persistent XLA compilation cache
per test session.

Most of the suite's time is XLA:CPU compilation, and many tests (and the training processes
some of them start) compile the very same programs: a fresh on-disk cache, shared through
the environment with every subprocess and removed at exit, compiles each program once per
session. A cached executable is the one the compiler produced for the same program and
options, so results, including bitwise comparisons across processes, are unchanged.
"""

import atexit
import os
import shutil
import tempfile

import pytest

from tests.compile_flags import add_test_flags, default_codegen

# Must run before JAX creates its CPU backend; the device count is fixed at backend init.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU runs each device's share of a multi-device program as a task on one pool of
# max(NPROC or cores, devices) threads, and a share that reaches a collective holds its
# thread until all 8 shares arrive; XLA aborts the process after 40 s of waiting
# (rendezvous.cc "Termination timeout"). With 8 threads for 8 devices, a loaded host hit
# it: eager ops of a loss on the trainer's 8-device arrays, beside two busy processes,
# aborted within 20-40 s in each of two tries (a worker died so in full-suite runs); with
# 16 threads, 2 x 150 s of the same ran clean (benchmarks/RESULTS.md, "The suite's worker
# aborts"). Test subprocesses inherit it.
os.environ.setdefault("NPROC", "16")
# Fast code generation for the suite's tiny programs (tests/compile_flags.py says why);
# test subprocesses inherit it.
os.environ["XLA_FLAGS"] = add_test_flags(os.environ.get("XLA_FLAGS", ""))
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="jaxrlhf-tests-xla-cache-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    # Cache every program, however small or quick to compile.
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# Start the backend now: code under test that sets the CPU device count before JAX starts
# (the dry run's CLI does, for the mesh it plans) must find it fixed at 8 in every worker,
# whichever test a worker happens to run first.
assert len(jax.devices()) == 8

# A test whose xdist worker process dies is rerun once in another worker (tests/crash_rerun.py
# says why); hooks are found by name in a conftest.
from tests.crash_rerun import (  # noqa: E402, F401
    pytest_handlecrashitem,
    pytest_report_teststatus,
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)


@pytest.fixture(name="default_codegen")
def default_codegen_fixture():
    """The test's programs compile with XLA's default code generation
    (``tests/compile_flags.default_codegen``): for learning tests that run hundreds of
    steps, where the suite's fast-compile flags cost more in run time than they save."""
    with default_codegen():
        yield
