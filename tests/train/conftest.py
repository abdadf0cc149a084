"""Trainer-test fixtures."""

from __future__ import annotations

import jax
import pytest


@pytest.fixture(scope="module")
def fast_compile():
    """Compile with most XLA optimisations off (as Flax's lm1b test does): these tests run
    few steps, so compile time dominates; results stay float32-exact up to summation order.
    Under the suite's own compile flags (tests/compile_flags.py: LLVM at -O0 already) it
    adds little; it matters when the suite runs with XLA's defaults.
    """
    old = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", old)
