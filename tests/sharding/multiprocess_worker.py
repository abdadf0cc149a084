"""One process of the 2-process localhost test (``test_distributed.py``).

Run as ``python tests/sharding/multiprocess_worker.py PORT PROCESS_ID OUT.npz DATA FSDP
TENSOR`` with ``JAX_PLATFORMS=cpu`` and the repo root on ``PYTHONPATH``. Each process gets 4
CPU devices, so the job has 8 global devices arranged as a ``(DATA, FSDP, TENSOR)`` mesh.
The test also imports ``compute`` and runs it in one process on 8 devices, where the local
batch is the global batch.

``compute`` runs the tiny Llama model sharded under the TRAIN rules and returns fully
gathered numpy arrays.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrlhf.models import axes as ax
from jaxrlhf.models import model as M
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.sharding import TRAIN, MeshConfig, activation_sharding, distributed, make_mesh
from jaxrlhf.sharding.model_sharding import build_sharded, param_shardings

NUM_PROCESSES = 2
LOCAL_DEVICES = 4
SEED = 0
B, T = 16, 8  # batch rows, sequence length


def model_config() -> ModelConfig:
    return ModelConfig.tiny("llama", initializer_range=0.3)


def make_batch() -> dict[str, np.ndarray]:
    """The global left-padded batch (tokens [B, T], mask [B, T]), the same in every process."""
    rng = np.random.default_rng(SEED + 1)
    tokens = rng.integers(1, model_config().vocab_size, (B, T)).astype(np.int32)
    lengths = rng.integers(2, T + 1, B)
    mask = np.arange(T)[None] >= (T - lengths)[:, None]
    return {"tokens": np.where(mask, tokens, 0).astype(np.int32), "mask": mask}


def batch_spec(mesh: Mesh) -> P:
    """Mesh-axis spec of [B, T] batch arrays under the TRAIN rules."""
    return activation_sharding(mesh, TRAIN, (ax.BATCH, ax.LENGTH)).spec


def compute(mesh: Mesh, local_batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Sharded forward of the tiny Llama model; results gathered to every process.

    Params are initialised directly in their TRAIN shardings (FSDP on the model width,
    tensor parallel on heads/MLP/vocab), so on a (1, 8, 1) mesh every layer's weight
    all-gather crosses the process boundary.

    Args:
      mesh: the global mesh.
      local_batch: this process's rows of ``make_batch()`` (all rows with one process).

    Returns:
      ``{"logits": [B, T, V], "loss": []}`` as numpy, identical on every process.
    """
    cfg = model_config()
    shardings = param_shardings(cfg, mesh, TRAIN)
    params = M.init_params(cfg, jax.random.key(SEED), shardings=shardings)
    batch = distributed.global_batch_from_local(local_batch, mesh, batch_spec(mesh))
    module = build_sharded(cfg, mesh, TRAIN)

    @jax.jit
    def forward(params, tokens, mask):
        logits = M.forward(module, params, tokens, mask)
        logp = jax.nn.log_softmax(logits[:, :-1])
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
        target_mask = mask[:, 1:] & mask[:, :-1]
        return logits, (nll * target_mask).sum() / target_mask.sum()

    logits, loss = forward(params, batch["tokens"], batch["mask"])
    return {
        "logits": np.asarray(multihost_utils.process_allgather(logits, tiled=True)),
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
    rows = distributed.process_local_slice(mesh, batch_spec(mesh), (B, T))
    local = {k: v[rows] for k, v in batch.items()}
    assert local["tokens"].shape == (B // NUM_PROCESSES, T), local["tokens"].shape
    result = compute(mesh, local)
    np.savez(out_path, process_index=jax.process_index(), **result)


if __name__ == "__main__":
    main(sys.argv[1:])
