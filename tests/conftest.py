"""Test-wide setup: the two tiers, 8 fake CPU devices fixed before any backend starts, and
one persistent XLA compilation cache per session.

Tiers. ``python -m pytest -q`` runs the default tier: every test not marked ``slow``. The
full tier adds the ``slow`` tests (learning runs, notebooks, docs pages that train,
multi-process and kill/resume tests, recipe dry runs, planner CLI runs, benchmark scripts,
anything over ~5 s): ``python -m pytest -q --run-slow``, or ``JAXRLHF_RUN_SLOW=1`` in the
environment (for scripts that run ``pytest -k`` subsets). ``-m slow --run-slow`` runs the
slow tests alone. Tests marked ``tpu`` compile for a TPU topology with the TPU compiler
(``pip install -e ".[tpu]"``); they are slow, and skipped where libtpu is absent.

Compilation. Every test process compiles with XLA's defaults, as users do: no test flags,
no per-test compiler settings, nothing that changes between tests of one process. Test
subprocesses inherit the environment, so a comparison across processes compares programs
compiled alike.

The compilation cache. Many tests (and the processes some start) compile the same
programs: one on-disk cache, shared through the environment with every worker and
subprocess, compiles each once per session (``.ci/run`` shares one between its runs). A
cached executable is the one the compiler produced for the same program and options, so
results, bitwise comparisons included, are unchanged. JAX writes a cache entry with a plain
``write_bytes`` and, unless the cache has a size limit, reads it without a lock, so a worker
could read an entry another was still writing; the limit below makes JAX take its file lock
around every read and write.

Threads. XLA:CPU runs each device's share of a multi-device program as a task on one pool
of ``max(NPROC or cores, devices)`` threads, and a share that reaches a collective blocks
its thread until every share of that program arrives; with two multi-device programs in
flight (asynchronous dispatch of eager ops on 8-device arrays is enough) the blocked shares
of both can hold all 8 threads while a share they wait for is still queued, and XLA aborts
the process after its rendezvous timeout (docs/sharding.md, "Two programs in flight on
XLA:CPU", and ``benchmarks/cpu_eager_collectives.py`` reproduce it). A pool of twice the
devices holds two programs, so the suite sets ``NPROC=16``; tests of the library's own
check of this set ``NPROC`` themselves.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

RUN_SLOW_ENV = "JAXRLHF_RUN_SLOW"

# Must run before JAX creates its CPU backend; the device count is fixed at backend init.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("NPROC", "16")  # see "Threads" above
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="jaxrlhf-tests-xla-cache-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
# Cache every program, however small or quick to compile.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# A size limit turns on JAX's file lock around cache reads and writes (see above).
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(16 << 30))
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The default tier deselects the slow tests (the summary line counts them)."""
    if config.getoption("run_slow") or os.environ.get(RUN_SLOW_ENV, "") not in ("", "0"):
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]
