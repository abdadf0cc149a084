"""The suite's compile settings (tests/compile_flags.py): flag merging for subprocesses, and
``default_codegen`` for the learning tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import compile_flags
from tests.compile_flags import (
    DEFAULT_CODEGEN_OPTIONS,
    add_test_flags,
    default_codegen,
    subprocess_xla_flags,
)


def test_a_flag_already_named_wins_over_the_tests_value(monkeypatch):
    monkeypatch.setattr(compile_flags, "TEST_XLA_FLAGS", "--a=0 --b=false")
    assert add_test_flags("--a=2 --c=1") == "--a=2 --c=1 --b=false"
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --c=1")
    assert subprocess_xla_flags("--xla_force_host_platform_device_count=2") == (
        "--c=1 --xla_force_host_platform_device_count=2 --a=0 --b=false"
    )


def _program(x):
    for _ in range(4):
        x = jnp.tanh(x @ x.T) @ x + jnp.sin(x)
    return x


@pytest.mark.skipif(not compile_flags.TEST_XLA_FLAGS, reason="the suite runs XLA's defaults")
def test_default_codegen_compiles_with_xla_defaults_options_and_restores_jit():
    """Inside, a program compiles as with DEFAULT_CODEGEN_OPTIONS given by hand (bitwise the
    same results); afterwards ``jax.jit`` and ``jax_disable_most_optimizations`` are back."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(32, 32)), jnp.float32) / 8
    original = jax.jit
    by_hand = jax.jit(_program, compiler_options=DEFAULT_CODEGEN_OPTIONS)(x)
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        with default_codegen():
            assert jax.jit is not original
            assert not jax.config.read("jax_disable_most_optimizations")
            inside = jax.jit(_program)(x)
        assert jax.jit is original and jax.config.read("jax_disable_most_optimizations")
    finally:
        jax.config.update("jax_disable_most_optimizations", before)
    np.testing.assert_array_equal(np.asarray(inside), np.asarray(by_hand))


@pytest.mark.skipif(not compile_flags.TEST_XLA_FLAGS, reason="the suite runs XLA's defaults")
def test_default_codegen_keeps_a_calls_own_options_and_arguments(monkeypatch):
    """What the patched ``jax.jit`` hands JAX's: the call's arguments unchanged, and the
    defaults with the call's own options over them."""
    calls = []
    monkeypatch.setattr(jax, "jit", lambda *args, **kwargs: calls.append((args, kwargs)))
    with default_codegen():
        jax.jit(_program, static_argnums=0, compiler_options={"xla_backend_optimization_level": 0})
        jax.jit(donate_argnums=1)  # the decorator-factory form
    assert calls == [
        (
            (_program,),
            {
                "static_argnums": 0,
                "compiler_options": {
                    "xla_backend_optimization_level": 0,
                    "xla_cpu_use_fusion_emitters": True,
                },
            },
        ),
        ((), {"donate_argnums": 1, "compiler_options": DEFAULT_CODEGEN_OPTIONS}),
    ]
