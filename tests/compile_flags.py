"""The XLA:CPU flags every test process compiles with, and the environment for the
subprocesses that must compile alike.

Most of the suite's time is XLA:CPU compiling tiny programs, and most of that is code
generation: LLVM's optimisation passes and the MLIR fusion emitters. The suite compiles
with LLVM at -O0 and XLA's older loop emitters (``TEST_XLA_FLAGS``): a tiny model's
train step compiles 2.4x faster, and the full suite ran in 44 min against 55 min with
XLA's defaults (benchmarks/RESULTS.md, "The suite's compile flags"). Both settings change
float32 results only in rounding (fused multiply-adds and the order of a few vectorised
sums), and every comparison in the suite is between programs compiled alike.

Tests that start a process to compare it against this one must give it the same flags:
``subprocess_xla_flags``. Runs of the user's commands as a user would run them (the CLI,
the notebooks, the docs' snippets, the planner's calibration) keep XLA's defaults, so the
defaults stay exercised. ``JAXRLHF_TEST_XLA_FLAGS=`` (empty) runs the whole suite with
XLA's defaults.
"""

from __future__ import annotations

import os

FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
TEST_XLA_FLAGS = os.environ.get("JAXRLHF_TEST_XLA_FLAGS", FAST_COMPILE_FLAGS).strip()


def add_test_flags(xla_flags: str) -> str:
    """``xla_flags`` followed by those of the tests' compile flags it does not hold yet."""
    have = xla_flags.split()
    return " ".join(have + [f for f in TEST_XLA_FLAGS.split() if f not in have])


def subprocess_xla_flags(*flags: str) -> str:
    """``XLA_FLAGS`` for a test's subprocess: ``flags`` (e.g. its device count) and the
    tests' compile flags, none of this process's others."""
    return add_test_flags(" ".join(flags))
