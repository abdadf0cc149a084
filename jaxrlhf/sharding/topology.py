"""TPU topologies to compile for on a host without TPUs (``--topology v5e:2x2``).

With the TPU compiler installed (libtpu: ``pip install -e ".[tpu]"``),
``jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name=NAME)`` gives a
slice's devices as *compile-only* devices: a mesh over them lowers and compiles programs with
XLA:TPU on this CPU host, whose ``memory_analysis()`` and ``cost_analysis()`` are the TPU
compiler's, and nothing can run or be allocated on them. MaxText's ``train_compile.py``
works this way. :func:`load_topology` gets them, :func:`topology_mesh` lays a mesh over
them in the order a run on that slice would.

Names are JAX's: ``v4:2x2x2``, ``v5e:2x2``, ``v5e:8x8``, ``v5p:2x2x2``, ``v6e:4x4``
(chips along each axis of the slice). A v4 chip's two TensorCores are one device
(megacore, as JAX runs them on a v4 slice); v5p chips are megacore already; v5e and v6e
chips have one core.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from jaxrlhf.sharding.mesh import MESH_AXES, MeshConfig, MeshError, make_mesh, resolve_mesh_shape

__all__ = [
    "INSTALL_HINT",
    "Topology",
    "TopologyError",
    "load_topology",
    "no_persistent_cache",
    "topology_mesh",
    "tpu_compiler_installed",
]

INSTALL_HINT = "pip install -e '.[tpu]'"

# A TPU device's ``device_kind`` -> the device kind jaxrlhf knows its memory and peaks by
# (``dry_run.DEVICE_KINDS``, ``plan.hardware.DEVICE_SPECS``).
_KINDS = {
    "TPU v4": "tpu-v4",
    "TPU v5 lite": "tpu-v5e",
    "TPU v5e": "tpu-v5e",
    "TPU v5": "tpu-v5p",
    "TPU v5p": "tpu-v5p",
    "TPU v6 lite": "tpu-v6e",
    "TPU v6e": "tpu-v6e",
}

# Options of ``get_topology_desc`` per generation (the name's prefix): one device per v4
# chip, as JAX runs a v4 slice (its default for a compile-only topology is one per core).
_OPTIONS = {"v4": {"chip_config_name": "megacore"}}

# libtpu, started on a host that is not a TPU VM, looks its worker names and host bounds up
# in the VM's metadata and logs an error for each it cannot find. The compile-only devices
# do not depend on them (the same compiled HLO either way): one host, itself. libtpu also
# takes /tmp/libtpu_lockfile so that one process at a time drives the chips; a process that
# only compiles drives none, and without the override a second one (two dry runs at once,
# two test workers) fails to load the compiler.
_QUIET_HOST = {
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_HOST_BOUNDS": "1,1,1",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}


class TopologyError(MeshError):
    """A topology that cannot be had here: no TPU compiler, or a name it does not know.
    The message is one line."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """A TPU slice's compile-only devices.

    Attributes:
      name: as given (``v5e:2x2``).
      devices: its devices (one per chip), in JAX's order.
      kind: the device kind jaxrlhf knows its chip by (``tpu-v5e``), None for a chip it has
        no figures for.
    """

    name: str
    devices: tuple[jax.Device, ...]
    kind: str | None

    @property
    def device_kind(self) -> str:
        """The chip as JAX names it (``TPU v5 lite``)."""
        return self.devices[0].device_kind

    @property
    def compiler(self) -> str:
        """How reports name the compiler: ``XLA:TPU v5e:2x2``."""
        return f"XLA:TPU {self.name}"

    def check_devices(self, needed: int | None, what: str) -> None:
        """Raises a one-line :class:`MeshError` unless ``needed`` (devices a run asks for;
        None: it fills whatever there is) equals this slice's device count. ``what`` names
        the run's shape in the message (``mesh data=1 x fsdp=8 x tensor=1``)."""
        if needed is not None and needed != len(self.devices):
            raise MeshError(
                f"{what} needs {needed} devices; topology {self.name} has "
                f"{len(self.devices)} ({self.device_kind}): give a mesh of "
                f"{len(self.devices)} devices (or -1 to fill) or another topology"
            )


def tpu_compiler_installed() -> bool:
    """Whether the TPU compiler (libtpu) can be loaded by JAX here."""
    if os.environ.get("TPU_LIBRARY_PATH"):
        return True
    return importlib.util.find_spec("libtpu") is not None


def load_topology(name: str) -> Topology:
    """The compile-only devices of the TPU slice ``name`` (``v5e:2x2``).

    Loads the TPU compiler into this process (seconds, once). When this process runs on
    CPU only (``jax_platforms="cpu"``, as the dry run and the planner set it), libtpu's
    lookups of a TPU VM's metadata are answered first (one host), so that it logs nothing.

    Raises:
      TopologyError: libtpu is not installed, or ``name`` is not a topology it knows.
    """
    name = name.strip()
    if not tpu_compiler_installed():
        raise TopologyError(f"--topology needs the TPU compiler (libtpu): {INSTALL_HINT}")
    if (jax.config.jax_platforms or "") == "cpu":  # the TPU runtime never starts here
        for key, value in _QUIET_HOST.items():
            os.environ.setdefault(key, value)
    from jax.experimental import topologies

    options = _OPTIONS.get(name.partition(":")[0].lower(), {})
    try:
        devices = topologies.get_topology_desc(
            platform="tpu", topology_name=name, **options
        ).devices
    except (jax.errors.JaxRuntimeError, RuntimeError, ValueError) as e:
        text = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise TopologyError(
            f"--topology {name}: no such TPU topology ({text}); write "
            "GENERATION:SHAPE, e.g. v4:2x2x1, v5e:2x2, v5e:8x8, v5p:2x2x2, v6e:4x4"
        ) from None
    if not devices:
        raise TopologyError(f"--topology {name}: the TPU compiler gave no devices")
    return Topology(name, tuple(devices), _KINDS.get(devices[0].device_kind))


def no_persistent_cache() -> None:
    """Keeps this process's compiled programs out of JAX's persistent compilation cache:
    an executable compiled for compile-only devices cannot be loaded back from it (JAX
    warns and compiles again), so writing it there is wasted. Takes effect only before the
    process's first compilation (JAX decides once); for a command that only compiles for a
    topology (the dry run's and the planner's ``--topology``)."""
    jax.config.update("jax_enable_compilation_cache", False)


def topology_mesh(cfg: MeshConfig, devices: Sequence[jax.Device]) -> Mesh:
    """The ``cfg`` mesh over TPU ``devices`` in the physical order ``jax.make_mesh`` gives
    them (neighbouring chips along an axis, as :func:`jaxrlhf.sharding.make_mesh` lays a
    run out on the slice itself); where JAX cannot place that shape on those devices, in
    ``devices``' order.

    Raises:
      MeshError: the shape does not cover ``devices`` exactly.
    """
    devices = list(devices)
    shape = resolve_mesh_shape(cfg, len(devices))
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=cfg.axis_types(), devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        return make_mesh(cfg, devices)
