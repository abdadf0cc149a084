"""Loss tests compile many tiny programs; skip XLA's optimisation passes while they run."""

import jax
import pytest


@pytest.fixture(autouse=True)
def _cheap_compiles():
    # Scoped to this package and restored afterwards, so other test packages are unaffected.
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", previous)
