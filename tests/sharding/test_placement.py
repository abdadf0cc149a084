"""jaxrlhf.sharding.placement on the 8-device CPU mesh of the test suite."""

from __future__ import annotations

import jax
import pytest

from jaxrlhf.platform import set_cpu_devices
from jaxrlhf.sharding import MeshConfig, MeshError
from jaxrlhf.sharding.placement import (
    PlacementConfig,
    check_cpu_devices,
    generate_mesh,
    generate_shards,
    given_mesh,
    train_device_count,
    train_mesh,
)


def test_train_mesh_covers_the_first_devices():
    mesh = train_mesh(MeshConfig(data=1, fsdp=-1), PlacementConfig(train_devices=2))
    assert list(mesh.devices.flat) == jax.devices()[:2]
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 1}
    everywhere = train_mesh(MeshConfig(data=1, fsdp=-1), PlacementConfig())
    assert everywhere.size == 8
    all_eight = train_mesh(MeshConfig(data=1, fsdp=-1), PlacementConfig(train_devices=8))
    assert list(all_eight.devices.flat) == list(everywhere.devices.flat)  # make_mesh's order


def test_a_mesh_passed_in_must_agree_with_train_devices():
    placement = PlacementConfig(train_devices=2)
    given_mesh(placement, train_mesh(MeshConfig(fsdp=-1), placement), "x.yaml")
    with pytest.raises(MeshError, match="x.yaml: placement.train_devices: 2, but the mesh passed"):
        given_mesh(placement, train_mesh(MeshConfig(fsdp=-1), PlacementConfig()), "x.yaml")


def test_generate_mesh_is_its_own_or_the_training_mesh():
    train = train_mesh(MeshConfig(fsdp=1), PlacementConfig(train_devices=1))
    assert generate_mesh(PlacementConfig(), train) is train
    placed = PlacementConfig(train_devices=1, generate_mesh=MeshConfig(data=-1, fsdp=1, tensor=2))
    gen = generate_mesh(placed, train)
    assert dict(gen.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    assert set(gen.devices.flat) == set(jax.devices())
    assert generate_shards(placed, 8) == 4 and generate_shards(PlacementConfig(), 8) is None


def test_counts_and_errors():
    assert train_device_count(PlacementConfig(), 8) == 8
    assert train_device_count(PlacementConfig(train_devices=3), 8) == 3
    with pytest.raises(MeshError, match="placement.train_devices: 9 exceeds the 8 device"):
        train_mesh(MeshConfig(fsdp=-1), PlacementConfig(train_devices=9))
    with pytest.raises(ValueError, match="train_devices: must be >= 1 or -1"):
        PlacementConfig(train_devices=0)
    with pytest.raises(ValueError, match="cpu_devices: must be >= 1 or null"):
        PlacementConfig(cpu_devices=0)


def test_cpu_devices_are_fixed_once_jax_has_started():
    assert jax.device_count() == 8  # started (conftest asked for 8 CPU devices)
    assert set_cpu_devices(2) == "JAX has already started"
    check_cpu_devices(8)
    check_cpu_devices(None)
    with pytest.raises(MeshError, match="placement.cpu_devices: 2 asked, but JAX started with 8"):
        check_cpu_devices(2)
