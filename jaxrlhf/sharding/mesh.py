"""Device meshes from a typed config.

Every jaxrlhf mesh has the same three named axes, in this order:

  data    pure data parallelism: parameters replicated, batch split.
  fsdp    fully sharded data parallelism: batch split *and* parameters sharded, gathered
          layer by layer when used (ZeRO-3 style).
  tensor  tensor (model) parallelism: heads / MLP width / vocab split across devices.

An axis of size 1 costs nothing, so one rule set works on every mesh shape. Which logical
axis goes to which mesh axis is decided by the rule sets in ``jaxrlhf.sharding.rules``.

Axis types: jax 0.10 makes ``jax.make_mesh`` default to ``AxisType.Explicit``, where the
sharding becomes part of each array's type and ``with_sharding_constraint`` behaves
differently. Rule-based (pjit-style) sharding, which jaxrlhf uses, wants ``AxisType.Auto``:
the compiler propagates shardings from the ``in_shardings`` / ``out_shardings`` and the
activation constraints we give it. We therefore always pass ``axis_types`` explicitly, and
``MeshConfig.axis_type`` picks between the two knowingly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

MESH_AXES: tuple[str, str, str] = ("data", "fsdp", "tensor")
AXIS_TYPES: tuple[str, ...] = ("auto", "explicit")

_AXIS_TYPE = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


class MeshError(ValueError):
    """A mesh shape that does not fit the available devices."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Shape and axis type of the ``("data", "fsdp", "tensor")`` mesh.

    Attributes:
      data: size of the data-parallel axis, or -1 to fill with the remaining devices.
      fsdp: size of the FSDP axis, or -1 to fill (the default: all devices do FSDP).
      tensor: size of the tensor-parallel axis, or -1 to fill.
      axis_type: ``"auto"`` (rule-based sharding; what jaxrlhf's steps expect) or
        ``"explicit"`` (sharding-in-types).
    """

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    axis_type: str = "auto"

    def __post_init__(self) -> None:
        sizes = self.sizes()
        for name, size in zip(MESH_AXES, sizes, strict=True):
            if isinstance(size, bool) or not isinstance(size, int):
                raise MeshError(f"mesh.{name} must be an int, got {size!r}")
            if size < 1 and size != -1:
                raise MeshError(f"mesh.{name} must be >= 1 or -1 (fill), got {size}")
        if sizes.count(-1) > 1:
            raise MeshError(f"at most one mesh axis may be -1 (fill), got {self.describe()}")
        if self.axis_type not in AXIS_TYPES:
            raise MeshError(f"mesh.axis_type must be one of {AXIS_TYPES}, got {self.axis_type!r}")

    def sizes(self) -> tuple[int, int, int]:
        """The configured sizes in ``MESH_AXES`` order (may contain -1)."""
        return (self.data, self.fsdp, self.tensor)

    def describe(self) -> str:
        """Human-readable shape such as ``data=2 x fsdp=-1 x tensor=1``."""
        return _describe(self.sizes())

    def axis_types(self) -> tuple[AxisType, AxisType, AxisType]:
        """The ``jax.sharding.AxisType`` of each mesh axis."""
        return (_AXIS_TYPE[self.axis_type],) * len(MESH_AXES)


def _describe(sizes: Sequence[int]) -> str:
    return " x ".join(f"{name}={size}" for name, size in zip(MESH_AXES, sizes, strict=True))


def resolve_mesh_shape(cfg: MeshConfig, n_devices: int) -> tuple[int, int, int]:
    """Fills the -1 axis of ``cfg`` so that the mesh covers exactly ``n_devices``.

    Args:
      cfg: the mesh config.
      n_devices: how many devices the mesh must cover.

    Returns:
      ``(data, fsdp, tensor)`` with no -1 and product ``n_devices``.

    Raises:
      MeshError: when the shape cannot cover ``n_devices`` exactly.
    """
    sizes = list(cfg.sizes())
    if -1 in sizes:
        fill = sizes.index(-1)
        known = math.prod(s for s in sizes if s != -1)
        if n_devices % known:
            raise MeshError(
                f"mesh {cfg.describe()} cannot fill {MESH_AXES[fill]}: {n_devices} devices"
                f" are not divisible by the other axes' product {known}"
            )
        sizes[fill] = n_devices // known
    shape = (sizes[0], sizes[1], sizes[2])
    if math.prod(shape) != n_devices:
        raise MeshError(
            f"mesh {_describe(shape)} needs {math.prod(shape)} devices"
            f" but {n_devices} are available"
        )
    return shape


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the ``("data", "fsdp", "tensor")`` mesh described by ``cfg``.

    Args:
      cfg: the mesh config.
      devices: devices to lay out, in order (e.g. a subset for a role on a submesh).
        ``None`` uses all global devices through ``jax.make_mesh``, which orders them for
        the physical topology (ICI rings on TPU).

    Returns:
      A ``jax.sharding.Mesh`` with axis types from ``cfg.axis_type``.

    Raises:
      MeshError: when the shape does not fit the devices.
    """
    if devices is None:
        shape = resolve_mesh_shape(cfg, jax.device_count())
        return jax.make_mesh(shape, MESH_AXES, axis_types=cfg.axis_types())
    devices = list(devices)
    shape = resolve_mesh_shape(cfg, len(devices))
    return Mesh(np.array(devices).reshape(shape), MESH_AXES, axis_types=cfg.axis_types())
