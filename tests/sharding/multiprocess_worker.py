"""One process of the 2-process localhost test (``test_distributed.py``).

Run as ``python tests/sharding/multiprocess_worker.py PORT PROCESS_ID OUT.npz DATA FSDP
TENSOR`` with ``JAX_PLATFORMS=cpu`` and the repo root on ``PYTHONPATH``. Each process gets 4
CPU devices, so the job has 8 global devices arranged as a ``(DATA, FSDP, TENSOR)`` mesh.
The test also imports ``compute`` and runs it in one process on 8 devices, where the local
batch is the global batch.

To check a real model multi-host, replace ``compute`` (keep its signature): build the
params from a seed with their logical specs, place them with ``logical_to_shardings``, and
return small, fully gathered numpy arrays.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.models import axes as ax
from jaxrlhf.sharding import (
    TRAIN,
    MeshConfig,
    activation_sharding,
    distributed,
    logical_to_shardings,
    make_mesh,
)

NUM_PROCESSES = 2
LOCAL_DEVICES = 4
SEED = 0
B, D, F = 16, 8, 32  # batch, model width, MLP width

LOGICAL_SPECS = {"w_in": P(ax.EMBED, ax.MLP), "w_out": P(ax.MLP, ax.EMBED)}


def make_batch() -> np.ndarray:
    """The global input batch [B, D], the same in every process."""
    return np.random.default_rng(SEED + 1).standard_normal((B, D)).astype(np.float32)


def make_params() -> dict[str, np.ndarray]:
    """Host copies of the MLP weights, deterministic from ``SEED``."""
    rng = np.random.default_rng(SEED)
    return {
        "w_in": (rng.standard_normal((D, F)) / np.sqrt(D)).astype(np.float32),
        "w_out": (rng.standard_normal((F, D)) / np.sqrt(F)).astype(np.float32),
    }


def batch_spec(mesh: Mesh) -> P:
    """Mesh-axis spec of the [B, D] batch under the TRAIN rules."""
    return activation_sharding(mesh, TRAIN, (ax.BATCH, ax.ACT_EMBED)).spec


def compute(mesh: Mesh, local_batch: np.ndarray) -> dict[str, np.ndarray]:
    """2-layer MLP forward with FSDP-sharded weights; results gathered to every process.

    Args:
      mesh: the global mesh.
      local_batch: this process's rows of ``make_batch()`` (all rows with one process).

    Returns:
      ``{"rows": [B] per-row sum of outputs, "loss": [] mean of squared outputs}`` as numpy.
    """
    host = make_params()
    shardings = logical_to_shardings(LOGICAL_SPECS, mesh, TRAIN, shapes=host)
    # make_array_from_callback builds each process's shards from the host copy, without
    # assuming the sharding is fully addressable.
    params = {
        name: jax.make_array_from_callback(value.shape, shardings[name], lambda i, v=value: v[i])
        for name, value in host.items()
    }
    x = distributed.global_batch_from_local(local_batch, mesh, batch_spec(mesh))
    # On a (1, 8, 1) mesh the fsdp axis spans both processes, so the weight all-gathers
    # cross the process boundary; on (2, 4, 1) the batch reduction of the loss does.
    assert params["w_in"].sharding.spec == P("fsdp", "tensor"), params["w_in"].sharding
    assert x.sharding.spec == P(("data", "fsdp"), None), x.sharding

    rows_sharding = NamedSharding(mesh, P(("data", "fsdp")))

    @jax.jit
    def forward(params, x):
        h = jnp.tanh(x @ params["w_in"])
        y = h @ params["w_out"]
        rows = jax.lax.with_sharding_constraint(jnp.sum(y, axis=-1), rows_sharding)
        return rows, jnp.mean(y**2)

    rows, loss = forward(params, x)
    # jit drops size-1 mesh axes from output specs (P("fsdp") on a data=1 mesh), so
    # compare layouts, not spellings.
    assert rows.sharding.is_equivalent_to(rows_sharding, rows.ndim), rows.sharding
    return {
        "rows": np.asarray(multihost_utils.process_allgather(rows, tiled=True)),
        "loss": np.asarray(multihost_utils.process_allgather(loss, tiled=True)),
    }


def main(argv: list[str]) -> None:
    port, process_id, out_path = int(argv[0]), int(argv[1]), argv[2]
    data, fsdp, tensor = (int(a) for a in argv[3:6])
    # Before anything initialises the backend: 4 devices per process.
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    distributed.initialize(
        coordinator_address=f"localhost:{port}",
        num_processes=NUM_PROCESSES,
        process_id=process_id,
    )
    distributed.initialize()  # idempotent
    assert jax.process_count() == NUM_PROCESSES, jax.process_count()
    assert jax.device_count() == NUM_PROCESSES * LOCAL_DEVICES, jax.device_count()
    assert distributed.is_main_process() == (process_id == 0)

    mesh = make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))
    batch = make_batch()
    local = batch[distributed.process_local_slice(mesh, batch_spec(mesh), batch.shape)]
    assert local.shape == (B // NUM_PROCESSES, D), local.shape
    result = compute(mesh, local)
    np.savez(out_path, process_index=jax.process_index(), **result)


if __name__ == "__main__":
    main(sys.argv[1:])
