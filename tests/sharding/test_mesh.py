"""Mesh config validation, -1 filling, device-count errors and axis types."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.sharding import MESH_AXES, MeshConfig, MeshError, make_mesh, resolve_mesh_shape


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        (MeshConfig(), (1, 8, 1)),
        (MeshConfig(data=2, fsdp=-1, tensor=2), (2, 2, 2)),
        (MeshConfig(data=-1, fsdp=1, tensor=2), (4, 1, 2)),
        (MeshConfig(data=1, fsdp=4, tensor=-1), (1, 4, 2)),
        (MeshConfig(data=2, fsdp=4, tensor=1), (2, 4, 1)),
    ],
)
def test_resolve_fills_minus_one(cfg, expected):
    assert resolve_mesh_shape(cfg, 8) == expected


def test_wrong_device_count_is_one_line_naming_the_numbers():
    with pytest.raises(MeshError) as info:
        resolve_mesh_shape(MeshConfig(data=2, fsdp=4, tensor=2), 8)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg == "mesh data=2 x fsdp=4 x tensor=2 needs 16 devices but 8 are available"


def test_fill_that_cannot_divide_is_one_line():
    with pytest.raises(MeshError) as info:
        resolve_mesh_shape(MeshConfig(data=3, fsdp=-1), 8)
    msg = str(info.value)
    assert "\n" not in msg
    assert "data=3" in msg and "8 devices" in msg and "3" in msg


def test_mesh_error_is_a_value_error():
    assert issubclass(MeshError, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"fsdp": 0}, "mesh.fsdp must be >= 1 or -1"),
        ({"data": -2}, "mesh.data must be >= 1 or -1"),
        ({"data": -1, "fsdp": -1}, "at most one mesh axis may be -1"),
        ({"tensor": 2.0}, "mesh.tensor must be an int"),
        ({"tensor": True}, "mesh.tensor must be an int"),
        ({"axis_type": "manual"}, "('auto', 'explicit')"),
    ],
)
def test_config_validation(kwargs, fragment):
    with pytest.raises(MeshError) as info:
        MeshConfig(**kwargs)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_config_is_frozen_and_kw_only():
    cfg = MeshConfig()
    with pytest.raises(AttributeError):
        cfg.data = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        MeshConfig(1, 8, 1)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("axis_type", "jax_type"), [("auto", AxisType.Auto), ("explicit", AxisType.Explicit)]
)
def test_make_mesh_honours_axis_type(axis_type, jax_type):
    mesh = make_mesh(MeshConfig(data=2, fsdp=-1, tensor=2, axis_type=axis_type))
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert mesh.axis_types == (jax_type,) * 3

    # A sharded computation runs on either kind and keeps the requested layout.
    x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    sharding = NamedSharding(mesh, P(("data", "fsdp"), "tensor"))
    out_sharding = NamedSharding(mesh, P(("data", "fsdp")))
    xs = jax.device_put(x, sharding)
    out = jax.jit(lambda a: jnp.sum(2.0 * a, axis=1), out_shardings=out_sharding)(xs)
    assert out.sharding.spec == P(("data", "fsdp"))
    np.testing.assert_array_equal(np.asarray(out), 2.0 * x.sum(axis=1))


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_make_mesh_on_given_devices(axis_type):
    devices = jax.devices()[4:]
    mesh = make_mesh(MeshConfig(fsdp=-1, tensor=2, axis_type=axis_type), devices=devices)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 2}
    assert list(mesh.devices.flat) == devices
    assert mesh.axis_types == ((AxisType.Auto if axis_type == "auto" else AxisType.Explicit),) * 3


def test_make_mesh_wrong_count_on_given_devices():
    with pytest.raises(MeshError, match="needs 8 devices but 3 are available"):
        make_mesh(MeshConfig(fsdp=8), devices=jax.devices()[:3])
