"""Platform tuning in one place: what a run does differently on a CPU host.

Everything here is a policy about the machine, not about the algorithm; general code paths
ask this module instead of testing ``platform == "cpu"`` themselves. ``python -m
jaxrlhf.train`` calls :func:`configure_cpu_host` before JAX starts; notebooks and scripts
can call it too (first thing, before any JAX computation).

* **Devices.** :func:`set_cpu_devices` splits a CPU host into N JAX devices
  (``jax_num_cpu_devices``, fixed when the backend starts); ``sharding.placement``'s
  ``check_cpu_devices`` checks that a run got what its ``placement.cpu_devices`` asks for.
* **Cores.** :func:`usable_cores`: the cores this process may use (affinity mask capped by a
  cgroup v2 quota).
* **Decode weight blocks.** :func:`decode_weight_blocks` says whether the sampler's decode
  loop should multiply by contiguous weight blocks (``generation.decode.decode_weights``):
  on CPU devices of at most two cores each wherever the C++ block-matmul kernel
  (:mod:`jaxrlhf.kernels.block_matmul`) is available (any rows); without it, where each CPU
  device runs on about one core, and for a decode of at most :data:`FEW_DECODE_ROWS` rows
  per device where a device has at most two cores. Devices of more cores keep the plain
  kernels (neither blocked product has been measured against XLA:CPU's dot on many
  threads), and so do accelerators.
* **One program in flight.** :func:`serialize_programs` waits for a tree when the mesh is
  on CPU devices (see its docstring for the deadlock it avoids).
* **Programs in flight at once.** :func:`cpu_client_threads` / :func:`set_cpu_client_threads`:
  the XLA:CPU client runs each device's share of a multi-device program as a task on one
  thread pool of ``max(NPROC or cores, devices)`` threads, and a share that reaches a
  collective blocks its thread in a rendezvous until every share of that program arrives.
  The pool is sized for *one* program spanning every device: with two multi-device
  programs in flight (on disjoint devices or not) the blocked shares of both can hold every
  thread while a share the rendezvous waits for is still queued, and XLA aborts the process
  after 40 s (``benchmarks/cpu_concurrency.py`` reproduces it: 4 + 4 devices of 8 deadlock
  with 8 threads and run with 16; 8 + 8 need 24). Single-device programs run on the calling
  thread and never wait for another share. Asynchronous RL on CPU therefore needs either a
  one-device sampler (or learner) or ``NPROC`` of at least twice the devices both programs
  span, set before JAX starts; the trainer checks it.
* **Host memory.** :func:`reuse_freed_host_memory`, below.

Host memory. XLA:CPU allocates each execution's temporary buffer (all of a step's
intermediates) with ``malloc`` and frees it when the execution ends. glibc serves any
allocation above 32 MiB with a fresh ``mmap`` and unmaps it on free, so every step
page-faults its whole temporary buffer in again (benchmarks/forward_backward.py and
benchmarks/RESULTS.md measure the cost). :func:`reuse_freed_host_memory` removes it with two
process-wide settings:

* ``jax_cpu_enable_async_dispatch = False``: executions run on the thread that calls them, so
  their buffers come from that thread's malloc arena, the process's main heap (an XLA worker
  thread's arena cannot hold more than 64 MiB in one piece and falls back to ``mmap``).
* glibc's ``mallopt``: no ``mmap`` for large allocations (``M_MMAP_MAX = 0``) and no trimming
  of the heap's top (``M_TRIM_THRESHOLD = -1``), so the next step reuses the freed buffer.
  A bound would not do: the largest one ``mallopt`` takes is an ``int`` (2 GiB), and an
  update's temporary buffer is larger than that at modest sizes (bench-M's R1-long update:
  7.1 GiB). glibc then returned it to the system after every execution and the next one
  faulted all of it in again.

Not every step: now and then a small allocation made between two steps takes a piece of the
freed buffer, the next step's no longer fits there, and the heap grows by one buffer that is
faulted in fresh (tests/test_platform.py). The costs: freed host memory stays with the
process (its resident size stays at its peak, as an accelerator's allocator keeps its pool;
the process's own later allocations reuse it; :func:`release_freed_host_memory` gives it
back), and Python waits for each computation it dispatches (on a CPU the host and the
computation share the cores anyway). ``JAXRLHF_HOST_MEMORY=system`` keeps glibc's and JAX's
defaults.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh

# glibc <malloc.h> mallopt parameters.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
NEVER_TRIM = -1  # mallopt(3): "Setting M_TRIM_THRESHOLD to -1 disables trimming completely."
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
    mallopt = _glibc_function("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is None:
        return "no mallopt (not glibc)"
    if not (mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, NEVER_TRIM)):
        return "mallopt refused the settings"
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return None


def release_freed_host_memory() -> bool:
    """Gives the process's freed heap memory back to the system (glibc's ``malloc_trim(0)``):
    the top of the heap that :func:`reuse_freed_host_memory` keeps, and free pages inside it.

    For a process that goes on after training (a notebook kernel) and wants its resident size
    back; the next step would fault its buffers in again. Returns whether any memory was
    released (False as well where the C library is not glibc).
    """
    malloc_trim = _glibc_function("malloc_trim", [ctypes.c_size_t])
    return malloc_trim is not None and bool(malloc_trim(0))


def _glibc_function(name: str, argtypes: list[Any]) -> Any:
    """``name`` from the C library this process runs on, returning an ``int``; None where
    it has none (not glibc)."""
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return function


def configure_cpu_host(cpu_devices: int | None = None) -> list[str]:
    """What ``python -m jaxrlhf.train`` does before JAX starts: ``cpu_devices`` CPU devices
    (None: JAX's default) and the host-memory settings. Returns notes on what was not
    applied (e.g. JAX had already started), for a debug log."""
    notes = []
    if cpu_devices is not None:
        why = set_cpu_devices(cpu_devices)
        if why:
            notes.append(f"cpu_devices {cpu_devices} not set: {why}")
    why = reuse_freed_host_memory()
    if why:
        notes.append(f"host memory defaults kept: {why}")
    return notes


def set_cpu_devices(count: int) -> str | None:
    """Asks JAX for ``count`` CPU devices; call it before JAX starts (first computation).

    Returns:
      None when set; otherwise why not: JAX has already started (its device count is fixed).
    """
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        return "JAX has already started"
    return None


CLIENT_THREADS_ENV = "NPROC"  # read by XLA's DefaultThreadPoolSize() when the client starts


def cpu_client_threads() -> int:
    """Threads of the XLA:CPU client's pool: ``max(NPROC or usable cores, devices)``."""
    try:
        threads = int(os.environ.get(CLIENT_THREADS_ENV, ""))
    except ValueError:
        threads = usable_cores()
    return max(threads, jax.local_device_count())


def set_cpu_client_threads(count: int) -> str | None:
    """Sizes the XLA:CPU client's thread pool (``NPROC``) for programs in flight at once; call
    it before JAX starts. Returns None when set, else why not."""
    if _backends_started():
        return "JAX has already started"
    os.environ[CLIENT_THREADS_ENV] = str(count)
    return None


def client_threads_needed(*devices: int) -> int:
    """XLA:CPU client threads that programs over ``devices[i]`` CPU devices each need to be
    in flight at once (module docstring): none when at most one of them spans several
    devices (single-device programs run on their calling thread), else twice the devices
    the multi-device ones span."""
    multi = [d for d in devices if d > 1]
    return 0 if len(multi) <= 1 else 2 * sum(multi)


def concurrent_programs_fit(*devices: int) -> bool:
    """Whether programs over ``devices[i]`` CPU devices each can be in flight at once without
    starving the client's pool (:func:`client_threads_needed`)."""
    return cpu_client_threads() >= client_threads_needed(*devices)


def usable_cores(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """CPU cores this process may run on: its affinity mask, capped by the cgroup v2 CPU
    quota in ``cpu_max`` (a container limited to 2 CPUs on a large host counts 2)."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(cores, 1)


def _device_list(devices: Mesh | Sequence[Any]) -> list[Any]:
    return list(devices.devices.flat) if isinstance(devices, Mesh) else list(devices)


# A decode of at most this many rows per CPU device multiplies by weight blocks even where
# each device has two cores (``decode_weight_blocks``' ``rows``).
FEW_DECODE_ROWS = 4


def decode_weight_blocks(
    devices: Mesh | AbstractMesh | Sequence[Any],
    rows: int | None = None,
    block_kernel: Callable[[], bool] | None = None,
) -> bool:
    """Whether a decode loop on ``devices`` (a mesh or a list of devices) multiplies by
    contiguous weight blocks. On CPU devices of at most two cores each: always where
    ``block_kernel()`` is true (whether :mod:`jaxrlhf.kernels.block_matmul` is available;
    called only there, as it builds the kernel on first use), else for a
    decode of at most :data:`FEW_DECODE_ROWS` ``rows`` per device; on CPU devices at least
    as many as the process's usable cores (about one core each): always. An AbstractMesh
    has no devices to look at and plans as an accelerator (False).

    A decode step streams the weights from memory. The kernel multiplies any number of rows
    by the blocks faster than XLA:CPU's dot against ``[in, out]`` kernels, measured from 1
    to 32 rows on devices of two cores. Without it, XLA:CPU's dot of 2-4 rows against an
    ``[in, out]`` kernel reads the weights more slowly than its batched dot over the blocks,
    while from 8 rows on the plain dot is faster (``benchmarks/decode_matmuls.py``;
    benchmarks/RESULTS.md, "Weight blocks for the engine's few-row views" and "A CPU kernel
    for the decode's weight matmuls"). More cores per device are unmeasured: they keep the
    plain kernels."""
    if isinstance(devices, AbstractMesh):
        return False
    devices = _device_list(devices)
    if any(d.platform != "cpu" for d in devices):
        return False
    cores = usable_cores()
    if cores <= 2 * len(devices):
        if rows is not None and rows <= FEW_DECODE_ROWS:
            return True
        if block_kernel is not None and block_kernel():
            return True
    return len(devices) >= cores


def serialize_programs(mesh: Mesh | None, tree: Any) -> Any:
    """Waits for ``tree`` when ``mesh`` (None: the default device) is on CPU devices; a
    no-op elsewhere. Returns ``tree``.

    XLA:CPU runs each device's part of a program on a shared thread pool, and two
    *different* multi-device programs in flight at once can deadlock in their collectives
    (each holds threads in a rendezvous the other needs; the process aborts after 40 s:
    seen with DPO's reference scoring overlapping the train step on 8 fake devices). On
    CPU a run therefore keeps one program in flight: each step, scoring and eval batch is
    awaited before the next is dispatched, which costs little there (host and "devices"
    share the same cores). GPUs and TPUs order programs on streams and keep the
    asynchronous dispatch.
    """
    device = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
    if device.platform == "cpu":
        jax.block_until_ready(tree)
    return tree
