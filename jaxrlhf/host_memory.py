"""On the CPU backend: reuse freed host memory instead of faulting fresh pages in every step.

XLA:CPU allocates each execution's temporary buffer (all of a step's intermediates: 445 MiB
for the R1 benchmark's update on bench-S) with ``malloc`` and frees it when the execution
ends. glibc serves any allocation above 32 MiB with a fresh ``mmap`` and unmaps it on free,
so every step page-faults its whole temporary buffer in again: measured on a bench-S
forward+backward ([32, 128] tokens, 669 MiB), 167,000 minor faults and ~0.5 s of kernel time
per call, ~25% of its wall time (benchmarks/forward_backward.py, benchmarks/RESULTS.md).

:func:`reuse_freed_host_memory` removes that cost with two process-wide settings:

* ``jax_cpu_enable_async_dispatch = False``: executions run on the thread that calls them, so
  their buffers come from that thread's malloc arena, the process's main heap (an XLA worker
  thread's arena cannot hold more than 64 MiB in one piece and falls back to ``mmap``).
* glibc's ``mallopt``: no ``mmap`` for large allocations (``M_MMAP_MAX = 0``) and freed memory
  at the top of the heap kept up to 2 GiB (``M_TRIM_THRESHOLD``), so the next step reuses it.

Measured on the same forward+backward: 408 faults, 4 ms of kernel time, 1,300 -> 993 ms;
compile time unchanged. Not every step: now and then a small allocation made between two
steps takes a piece of the freed buffer, the next step's no longer fits there, and the heap
grows by one buffer that is faulted in fresh (in a small test program, 0-3 of 14 steps, most
often among the first few; tests/test_host_memory.py).

The costs: the process keeps up to 2 GiB of freed memory mapped (beyond that it is
returned), and Python waits for each computation it dispatches (on a CPU the host and the
computation share the cores anyway). It is for the CPU backend only: on
GPU/TPU the host does not hold the step's buffers. ``python -m jaxrlhf.train`` applies it when
the run is on CPU; ``JAXRLHF_HOST_MEMORY=system`` keeps glibc's and JAX's defaults.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os

import jax

# glibc <malloc.h> mallopt parameters.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
KEEP_FREED_BYTES = 2**31 - 1  # the largest value mallopt takes (an int): ~2 GiB
OPT_OUT_ENV = "JAXRLHF_HOST_MEMORY"


def cpu_backend_expected() -> bool:
    """Whether JAX will run on CPU in this process, decided without starting a backend:
    ``JAX_PLATFORMS`` (``jax_platforms``) names only ``cpu``, or no accelerator plugin (CUDA,
    ROCm, TPU) is installed."""
    platforms = _configured_platforms()
    if platforms:
        return {p.strip() for p in platforms.split(",")} == {"cpu"}
    plugins = importlib.metadata.entry_points(group="jax_plugins")
    if any(plugins) or importlib.util.find_spec("libtpu") is not None:
        return False
    try:
        import jax_plugins  # namespace package of the CUDA/ROCm plugins
    except ImportError:
        return True
    return not list(getattr(jax_plugins, "__path__", []))


def _configured_platforms() -> str | None:
    return jax.config.jax_platforms


def _backends_started() -> bool:
    from jax._src import xla_bridge  # no public API says whether a backend exists yet

    return xla_bridge.backends_are_initialized()


def reuse_freed_host_memory() -> str | None:
    """Applies the settings of this module's docstring, before JAX's CPU backend starts.

    Returns:
      None when applied; otherwise why not, in a few words: ``JAXRLHF_HOST_MEMORY=system``
      is set, JAX will not run on CPU (:func:`cpu_backend_expected`), a JAX backend already
      exists (the dispatch setting only applies to a backend created after it), or the C
      library has no ``mallopt`` (not glibc). Nothing is changed then.
    """
    if os.environ.get(OPT_OUT_ENV, "").lower() == "system":
        return f"{OPT_OUT_ENV}=system"
    if not cpu_backend_expected():
        return "not a CPU run"
    if _backends_started():
        return "a JAX backend already exists"
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    except (OSError, AttributeError):
        return "no mallopt (not glibc)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, KEEP_FREED_BYTES)):
        return "mallopt refused the settings"
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return None
