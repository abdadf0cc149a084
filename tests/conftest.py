"""Test-wide JAX setup: 8 fake CPU devices, fixed before any backend initialises."""

import os

# Must run before JAX creates its CPU backend; the device count is fixed at backend init.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
