"""Trainer-test fixtures."""

from __future__ import annotations

import jax
import pytest


@pytest.fixture(scope="module")
def fast_compile():
    """Compile with most XLA optimisations off (as Flax's lm1b test does): these tests run
    few steps, so compile time dominates; results stay float32-exact up to summation order.
    """
    old = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", old)
