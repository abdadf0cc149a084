"""The XLA:CPU flags every test process compiles with, and the environment for the
subprocesses that must compile alike.

Most of the suite's time is XLA:CPU compiling tiny programs, and most of that is code
generation: LLVM's optimisation passes and the MLIR fusion emitters. The suite compiles
with LLVM at -O0 and XLA's older loop emitters (``TEST_XLA_FLAGS``), which compile the
tests' programs about twice as fast and run them somewhat slower
(``benchmarks/compile_flags.py``; the figures are in benchmarks/RESULTS.md, "The suite's
compile flags"). Both settings change float32 results only in rounding (e.g. where
multiply-adds are fused), so a comparison between two JAX programs holds only when both
were compiled alike; the comparisons with NumPy, PyTorch or transformers keep their
tolerances.

A test that starts a process to compare its results with this one's gives it the same
flags: ``subprocess_xla_flags`` (or the inherited ``XLA_FLAGS``). So do the notebooks' and
the docs' runs, which then compile as fast and share the session's compilation cache with
the tests. The CLI's own test (``tests/train/test_cli.py``) drops ``XLA_FLAGS``: it runs
the command as a user does, with XLA's defaults, so those stay exercised; so does
``tests/test_platform.py``'s memory probe, which runs one large program many times. A flag of the
same name already in ``XLA_FLAGS`` is kept over the tests' value;
``JAXRLHF_TEST_XLA_FLAGS=`` (empty) runs the whole suite with XLA's defaults.

The tests that run one program hundreds of times (the learning tests) spend more on the
flags' slower code than they save on compiles: inside ``default_codegen()`` they compile
with XLA's default code generation, as per-compile options over the process's flags.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
TEST_XLA_FLAGS = os.environ.get("JAXRLHF_TEST_XLA_FLAGS", FAST_COMPILE_FLAGS).strip()
_DEVICE_COUNT = "--xla_force_host_platform_device_count"


def _name(flag: str) -> str:
    return flag.split("=", 1)[0]


def add_test_flags(xla_flags: str) -> str:
    """``xla_flags`` followed by each of the tests' compile flags whose name it does not
    hold yet."""
    have = xla_flags.split()
    names = {_name(f) for f in have}
    return " ".join(have + [f for f in TEST_XLA_FLAGS.split() if _name(f) not in names])


def subprocess_xla_flags(*flags: str) -> str:
    """``XLA_FLAGS`` for a test's subprocess: this process's flags without its CPU device
    count, then ``flags`` (e.g. the subprocess's own device count), then any of the tests'
    compile flags not there yet."""
    inherited = [f for f in os.environ.get("XLA_FLAGS", "").split() if _name(f) != _DEVICE_COUNT]
    return add_test_flags(" ".join([*inherited, *flags]))


# XLA's own values of the two settings FAST_COMPILE_FLAGS changes, as per-compile options.
DEFAULT_CODEGEN_OPTIONS = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}


@contextlib.contextmanager
def default_codegen() -> Iterator[None]:
    """Inside, programs compile with XLA's default code generation: ``jax.jit`` passes
    ``DEFAULT_CODEGEN_OPTIONS`` as its ``compiler_options`` (per compile, over the process's
    flags, a user's ``XLA_FLAGS`` included; a call's own options win), and
    ``jax_disable_most_optimizations``, which the ``fast_compile`` fixtures set, is off.

    A jit wrapper made before entering keeps the flags' code generation (unless first
    compiled inside, for ``jax_disable_most_optimizations``); the results differ from the
    flags' in rounding only, so only tests that compare with nothing compiled elsewhere may
    use it. JAX refuses ``compiler_options`` on a jit nested in a traced function: a wrapper
    made inside and called from another jit's trace raises (no test's path does). With the
    suite at XLA's defaults (``JAXRLHF_TEST_XLA_FLAGS=``), ``jax.jit`` is left alone."""
    import jax  # here, not at import: tests/conftest.py sets XLA_FLAGS before JAX starts

    original = jax.jit

    def jit(*args, **kwargs):
        kwargs["compiler_options"] = {
            **DEFAULT_CODEGEN_OPTIONS,
            **(kwargs.get("compiler_options") or {}),
        }
        return original(*args, **kwargs)

    disabled = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    if TEST_XLA_FLAGS:
        jax.jit = jit
    try:
        yield
    finally:
        jax.jit = original
        jax.config.update("jax_disable_most_optimizations", disabled)
