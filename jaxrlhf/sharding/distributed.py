"""Multi-process (multi-host) setup: ``jax.distributed`` init and per-process batches.

jaxrlhf uses JAX's own multi-controller runtime: every host runs the same program, sees
all devices of the job in ``jax.devices()``, and addresses its local ones. Call
``initialize()`` first thing in the program, before anything touches a JAX device.

How to launch:

* **Cloud TPU pod slice**: run the same command on every worker, e.g.
  ``gcloud compute tpus tpu-vm ssh NAME --worker=all --command="python -m jaxrlhf.train
  --config configs/X.yaml"``. ``initialize()`` with no arguments lets JAX read the
  coordinator, process count and id from the TPU metadata.
* **GPU cluster**: under Slurm (``srun --ntasks-per-node=GPUS_PER_NODE python ...``) or
  Open MPI (``mpirun``), ``initialize()`` with no arguments auto-detects everything and
  gives each process one GPU. On Kubernetes install ``jax[k8s]``. Elsewhere pass the
  arguments, or set ``JAX_COORDINATOR_ADDRESS`` and pass ``num_processes`` / ``process_id``.
* **Locally with 2 processes** (CPU; how the tests check multi-host code)::

      JAX_PLATFORMS=cpu python prog.py 0 & JAX_PLATFORMS=cpu python prog.py 1

  where ``prog.py`` does ``jax.config.update("jax_num_cpu_devices", 4)`` and then
  ``initialize(coordinator_address="localhost:12355", num_processes=2,
  process_id=int(sys.argv[1]))``; the job then has 8 global CPU devices. CPU collectives
  across processes use gloo.

A single process with no arguments and no cluster environment is a no-op, so the same
program runs unchanged on a laptop.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

logger = logging.getLogger(__name__)

# jax raises exactly this when no address was given and no cluster was auto-detected.
_NO_COORDINATOR = "coordinator_address should be defined"


def initialize(
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
) -> None:
    """Initialises ``jax.distributed`` when running as one of several processes.

    Idempotent: a second call (or a call after JAX was initialised elsewhere) does
    nothing. With no arguments, JAX auto-detects a TPU pod, Slurm, Open MPI or Kubernetes
    environment; when none is found this is a no-op (single process).

    On CPU, cross-process collectives need a collectives implementation; this selects gloo
    unless another one (e.g. ``"mpi"``) was configured. jax 0.10.2 already defaults to
    gloo, older versions to none (which makes multi-process CPU computations fail).

    Args:
      coordinator_address: ``host:port`` of process 0's coordinator service.
      num_processes: number of processes in the job.
      process_id: this process's index in ``[0, num_processes)``.
      local_device_ids: restricts this process to these local devices.

    Raises:
      RuntimeError: when arguments are given but JAX has already initialised its backend
        (``initialize`` must run before any computation or ``jax.devices()``).
      ValueError: for inconsistent arguments (from ``jax.distributed.initialize``).
    """
    if jax.distributed.is_initialized():
        return
    explicit = any(
        a is not None for a in (coordinator_address, num_processes, process_id, local_device_ids)
    )
    if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
        # Only the CPU client reads this; it must be set before the backend exists.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            local_device_ids=local_device_ids,
        )
    except ValueError as e:
        if explicit or not str(e).startswith(_NO_COORDINATOR):
            raise
        logger.debug("no cluster environment detected; running as a single process")
        return
    except RuntimeError:
        if explicit:
            raise
        # The backend is already up (JAX was used before this call). Without arguments
        # that means a single-process program, or a runtime that set itself up (TPU).
        logger.debug("jax already initialised with %d process(es)", jax.process_count())
        return
    logger.info(
        "jax.distributed initialised: process %d of %d, %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def initialize_from_env(environ: dict[str, str] | None = None) -> None:
    """:func:`initialize` as the CLI calls it: auto-detection, or an explicit job.

    An explicit job is described by ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` (with
    ``JAX_COORDINATOR_ADDRESS=host:port``, which JAX reads itself): start the same command
    on every host with its own ``JAX_PROCESS_ID``. Without them, TPU pods, Slurm, Open MPI
    and Kubernetes are detected, and a lone process is left alone.

    Raises:
      MeshError: the variables are incomplete or not integers (one line).
    """
    env = os.environ if environ is None else environ
    num, pid = env.get("JAX_NUM_PROCESSES"), env.get("JAX_PROCESS_ID")
    if num is None and pid is None:
        initialize()
        return
    from jaxrlhf.sharding.mesh import MeshError

    if num is None or pid is None or "JAX_COORDINATOR_ADDRESS" not in env:
        raise MeshError(
            "an explicit multi-process job needs JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES "
            f"and JAX_PROCESS_ID; got JAX_NUM_PROCESSES={num}, JAX_PROCESS_ID={pid}, "
            f"JAX_COORDINATOR_ADDRESS={env.get('JAX_COORDINATOR_ADDRESS')}"
        )
    try:
        num_processes, process_id = int(num), int(pid)
    except ValueError:
        raise MeshError(
            f"JAX_NUM_PROCESSES={num!r} and JAX_PROCESS_ID={pid!r} must be integers"
        ) from None
    if not 0 <= process_id < num_processes:
        raise MeshError(f"JAX_PROCESS_ID={process_id} is not in [0, {num_processes})")
    initialize(num_processes=num_processes, process_id=process_id)


def is_main_process() -> bool:
    """Whether this is process 0 (the one that logs and writes shared files)."""
    return jax.process_index() == 0


def to_host(tree: Any) -> Any:
    """Every leaf of ``tree`` as a numpy array holding the whole value, on every process.

    With one process this is ``jax.device_get``. With several, a leaf sharded over devices
    of other processes is all-gathered (``process_allgather``), so every process sees the
    same full values, e.g. a rollout that host code (reward functions, decoding) reads.
    A fully replicated leaf is read from a local copy without communication. All
    processes must call this with the same tree (the all-gathers are collectives).

    Args:
      tree: pytree of ``jax.Array`` (or host values, returned as numpy).

    Returns:
      The same pytree of ``np.ndarray``.
    """

    def leaf(x: Any) -> np.ndarray:
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(leaf, tree)


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def global_batch_from_local(local_arrays: Any, mesh: Mesh, spec: P | Any) -> Any:
    """Assembles global arrays from the data each process holds.

    Each process passes its own slice of the global batch (e.g. the rows its data loader
    read; see ``process_local_slice``); the result is one global ``jax.Array`` per leaf,
    sharded over ``mesh``. With one process, the local data is the global data.

    Args:
      local_arrays: pytree of ``np.ndarray`` (this process's slice of each array).
      mesh: the global mesh.
      spec: ``PartitionSpec`` of mesh axes for every leaf, or a pytree of them matching
        ``local_arrays`` (e.g. ``P(("data", "fsdp"))`` for ``[B, T]`` token batches, or
        ``activation_sharding(mesh, rules, (BATCH, LENGTH)).spec``).

    Returns:
      Pytree of global ``jax.Array`` with the structure of ``local_arrays``.
    """
    if isinstance(spec, P):
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(
                NamedSharding(mesh, spec), np.asarray(x)
            ),
            local_arrays,
        )
    return jax.tree.map(
        lambda s, x: jax.make_array_from_process_local_data(NamedSharding(mesh, s), np.asarray(x)),
        spec,
        local_arrays,
        is_leaf=_is_spec,
    )


def process_local_slice(mesh: Mesh, spec: P, global_shape: Sequence[int]) -> tuple[slice, ...]:
    """The block of a global array that this process must provide.

    Use it in data loaders: ``local = global_data[process_local_slice(mesh, spec, shape)]``
    is what ``global_batch_from_local`` expects from this process.

    Args:
      mesh: the global mesh.
      spec: ``PartitionSpec`` of mesh axes of the array.
      global_shape: the global shape.

    Returns:
      One ``slice`` per dim.

    Raises:
      ValueError: when this process's devices hold a non-contiguous part of the array
        (a device order that ``make_array_from_process_local_data`` cannot express as one
        local block).
    """
    shape = tuple(global_shape)
    index_map = NamedSharding(mesh, spec).addressable_devices_indices_map(shape)
    boxes = {
        tuple(sl.indices(size)[:2] for sl, size in zip(index, shape, strict=True))
        for index in index_map.values()
    }
    lo = [min(b[d][0] for b in boxes) for d in range(len(shape))]
    hi = [max(b[d][1] for b in boxes) for d in range(len(shape))]
    covered = sum(math.prod(stop - start for start, stop in b) for b in boxes)
    if covered != math.prod(h - lo_ for lo_, h in zip(lo, hi, strict=True)):
        raise ValueError(
            f"process {jax.process_index()} holds a non-contiguous part of an array of"
            f" shape {shape} under {spec}"
        )
    return tuple(slice(start, stop) for start, stop in zip(lo, hi, strict=True))


def put_global(tree: Any, shardings: Any) -> Any:
    """A host pytree (the whole value of every leaf, the same on every process) as global
    arrays in ``shardings`` (a matching pytree of NamedShardings): ``jax.device_put`` with one
    process; with several, each process places the block its devices hold."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def put(x: Any, sharding: NamedSharding) -> jax.Array:
        x = np.asarray(x)
        local = x[process_local_slice(sharding.mesh, sharding.spec, x.shape)]
        return global_batch_from_local(local, sharding.mesh, sharding.spec)

    return jax.tree.map(put, tree, shardings)
