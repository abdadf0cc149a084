"""Placement: which devices the training mesh and the sampler's mesh cover.

By default every phase of a run uses one mesh over all of the process's devices (the
``mesh`` section) and the phases differ only in their sharding rules. The ``placement``
section changes that:

* ``train_devices``: the training mesh (updates and scoring) covers the first N devices
  only (single-process runs).
* ``generate_mesh``: the sampler gets its own mesh over all devices (PPO and GRPO). The
  policy's parameters move to it with ``jax.device_put`` every iteration (the sampler's
  ``to_generate_layout``, timed and counted as the reshard phase); rollouts come back
  through host memory, as they already do for rewards.
* ``cpu_devices``: on CPU, the number of JAX devices the process splits the host into
  (``jax_num_cpu_devices``). It must be set before JAX starts: ``python -m jaxrlhf.train``
  does so from the config; in Python call :func:`jaxrlhf.platform.set_cpu_devices` first.

Why: on a CPU the decode loop runs many small operations per token, and XLA:CPU splits each
over the cores with a synchronisation per operation, so a second core adds little inside
one device; two CPU devices with half the batch each run two independent decode loops, one
per core. The update is the opposite: its large matmuls use both cores well inside one
device, and on two devices it is slower (gradient all-reduce, two sets of buffers). So on a
2-core host::

    placement: {cpu_devices: 2, train_devices: 1, generate_mesh: {data: -1, fsdp: 1}}

trains on one device and samples on two (benchmarks/RESULTS.md has the figures).
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh

from jaxrlhf.sharding.mesh import MeshConfig, MeshError, make_mesh, resolve_mesh_shape

_ALL = -1


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    """Which devices the training mesh and the sampler's mesh cover (docs/sharding.md,
    "Placement").

    Attributes:
      cpu_devices: CPU runs: JAX CPU devices to split the host into, set by ``python -m
        jaxrlhf.train`` before JAX starts (None: JAX's default, one device unless
        ``XLA_FLAGS`` says otherwise). Ignored on GPU/TPU.
      train_devices: devices the training mesh (``mesh``) covers, the first ones of
        ``jax.devices()`` (single-process runs); -1: all of them.
      generate_mesh: PPO/GRPO: the sampler's own mesh over all devices, a mesh section
        (``{data: -1, fsdp: 1, tensor: 1}``); its data shards must divide
        ``rollout.prompts_per_step``. None: the sampler uses the training mesh. Unused by
        the other algorithms (like the ``ppo``/``grpo`` sections).
    """

    cpu_devices: int | None = None
    train_devices: int = _ALL
    generate_mesh: MeshConfig | None = None

    def __post_init__(self) -> None:
        if self.cpu_devices is not None and self.cpu_devices < 1:
            raise ValueError(f"cpu_devices: must be >= 1 or null, got {self.cpu_devices}")
        if self.train_devices < 1 and self.train_devices != _ALL:
            raise ValueError(f"train_devices: must be >= 1 or -1 (all), got {self.train_devices}")


def train_device_count(placement: PlacementConfig, device_count: int) -> int:
    """How many of ``device_count`` devices the training mesh covers.

    Raises:
      MeshError: ``train_devices`` exceeds the devices there are.
    """
    if placement.train_devices == _ALL:
        return device_count
    if placement.train_devices > device_count:
        raise MeshError(
            f"{placement.train_devices} exceeds the {device_count} device(s) of this run"
        )
    return placement.train_devices


def train_mesh(mesh: MeshConfig, placement: PlacementConfig) -> Mesh:
    """The training mesh: ``mesh`` over all devices, or over the first ``train_devices``.

    Raises:
      MeshError: the shape does not fit, or ``train_devices`` is set in a multi-process run
        (each process would need the same leading devices of its own).
    """
    check_cpu_devices(placement.cpu_devices)
    if placement.train_devices in (_ALL, jax.device_count()):
        return make_mesh(mesh)  # all devices, in jax.make_mesh's topology-aware order
    if jax.process_count() > 1:
        raise MeshError("placement.train_devices: only single-process runs can use a subset")
    devices = jax.devices()
    try:
        count = train_device_count(placement, len(devices))
    except MeshError as e:
        raise MeshError(f"placement.train_devices: {e}") from None
    return make_mesh(mesh, devices[:count])


def given_mesh(placement: PlacementConfig, mesh: Mesh, source: str) -> None:
    """Checks a training mesh passed in code (``build_trainer(cfg, mesh=...)``, which takes
    precedence over ``mesh`` and ``placement.train_devices``) against ``placement``.

    Raises:
      MeshError: ``train_devices`` names another size, or JAX lacks ``cpu_devices``.
    """
    check_cpu_devices(placement.cpu_devices)
    wanted = placement.train_devices
    if wanted not in (_ALL, mesh.size):
        raise MeshError(
            f"{source}: placement.train_devices: {wanted}, but the mesh passed in has "
            f"{mesh.size} device(s)"
        )


def generate_mesh(placement: PlacementConfig, train: Mesh) -> Mesh:
    """The sampler's mesh: ``placement.generate_mesh`` over all devices, else ``train``."""
    if placement.generate_mesh is None:
        return train
    return make_mesh(placement.generate_mesh)


def generate_shards(placement: PlacementConfig, device_count: int) -> int | None:
    """Data shards (``data x fsdp``) of the sampler's own mesh; None when it has none.

    Raises:
      MeshError: ``generate_mesh`` does not fit ``device_count`` devices.
    """
    if placement.generate_mesh is None:
        return None
    data, fsdp, _ = resolve_mesh_shape(placement.generate_mesh, device_count)
    return data * fsdp


def check_cpu_devices(want: int | None) -> None:
    """On a CPU run, checks that JAX has the ``want`` CPU devices a placement asks for (None:
    any count).

    Raises:
      MeshError: JAX started with another count (nothing set it before JAX started).
    """
    if want is None or jax.default_backend() != "cpu":
        return
    have = jax.local_device_count()
    if have != want:
        raise MeshError(
            f"placement.cpu_devices: {want} asked, but JAX started with {have} CPU device(s); "
            "`python -m jaxrlhf.train` sets it from the config, or call "
            f"jaxrlhf.platform.set_cpu_devices({want}) before JAX starts"
        )
