"""Resharding between phase layouts: exact values, byte accounting, donation."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.sharding import (
    GENERATE,
    TRAIN,
    MeshConfig,
    ReshardStats,
    leaf_bytes_moved,
    logical_to_shardings,
    make_mesh,
    reshard,
    reshard_bytes,
)

SPECS = {
    "embed": P("vocab", "embed"),
    "layers": {
        "q": P("layers", "embed", "heads", "head_dim"),
        "mlp_in": P("layers", "embed", "mlp"),
        "norm": P("layers", "norm"),
    },
}
SHAPES = {
    "embed": (16, 8),
    "layers": {"q": (2, 8, 4, 4), "mlp_in": (2, 8, 16), "norm": (2, 8)},
}


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))


def _host_params():
    rng = np.random.default_rng(0)
    return jax.tree.map(
        lambda shape: rng.standard_normal(shape).astype(np.float32),
        SHAPES,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def _specs(tree):
    return jax.tree.map(lambda x: x.sharding.spec, tree)


def test_train_generate_train_roundtrip_is_exact(mesh):
    host = _host_params()
    train = logical_to_shardings(SPECS, mesh, TRAIN, shapes=SHAPES)
    gen = logical_to_shardings(SPECS, mesh, GENERATE, shapes=SHAPES)
    params = jax.device_put(host, train)
    with jax.transfer_guard("disallow"):
        gen_params, to_gen = reshard(params, gen)
        back, to_train = reshard(gen_params, train)
    assert _specs(gen_params) == jax.tree.map(lambda s: s.spec, gen)
    assert _specs(back) == jax.tree.map(lambda s: s.spec, train)
    assert _specs(gen_params)["layers"]["q"] == P(None, None, "tensor", None)
    assert _specs(back)["layers"]["q"] == P(None, "fsdp", "tensor", None)
    for a, b, h in zip(
        jax.tree.leaves(gen_params), jax.tree.leaves(back), jax.tree.leaves(host), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), h)
        np.testing.assert_array_equal(np.asarray(b), h)

    total = sum(h.nbytes for h in jax.tree.leaves(host))
    assert to_gen.bytes_total == to_train.bytes_total == total
    assert to_gen.bytes_moved == reshard_bytes(train, gen, host)
    # Dropping fsdp sharding gathers data; going back only slices what is already there.
    assert to_gen.bytes_moved > 0
    assert to_train.bytes_moved == 0
    assert to_gen.seconds >= 0.0


def test_identity_moves_nothing(mesh):
    train = logical_to_shardings(SPECS, mesh, TRAIN, shapes=SHAPES)
    params = jax.device_put(_host_params(), train)
    with jax.transfer_guard("disallow"):
        same, stats = reshard(params, train)
    assert stats.bytes_moved == 0
    assert reshard_bytes(train, train, params) == 0
    assert _specs(same) == _specs(params)


def test_sharded_to_replicated_hand_computed():
    mesh = make_mesh(MeshConfig(fsdp=8))
    x = jax.device_put(np.arange(16, dtype=np.float32), NamedSharding(mesh, P("fsdp")))
    with jax.transfer_guard("disallow"):
        y, stats = reshard(x, NamedSharding(mesh, P()))
    # Each of 8 devices holds 2 of 16 float32 and needs all 16: it receives 14 * 4 bytes.
    assert stats.bytes_moved == 8 * 14 * 4 == 448
    assert stats.bytes_total == 64
    assert y.sharding.spec == P()
    np.testing.assert_array_equal(np.asarray(y), np.arange(16, dtype=np.float32))
    # The reverse keeps a slice of a local replica: nothing moves.
    with jax.transfer_guard("disallow"):
        z, back = reshard(y, NamedSharding(mesh, P("fsdp")))
    assert back.bytes_moved == 0
    np.testing.assert_array_equal(np.asarray(z), np.arange(16, dtype=np.float32))


def test_fsdp_to_tensor_hand_computed(mesh):
    # Mesh (data=1, fsdp=4, tensor=2); device (f, t). x is [8, 4] float32 (128 bytes).
    # P("fsdp", None): device (f, t) holds rows [2f, 2f+2).
    # P("tensor", None): device (f, t) needs rows [4t, 4t+4).
    # Overlap is 2 rows for (f<2, t=0) and (f>=2, t=1), else 0. So 4 devices receive 2 rows
    # and 4 devices receive 4 rows: 24 rows * 4 columns * 4 bytes = 384 bytes.
    x_host = np.arange(32, dtype=np.float32).reshape(8, 4)
    src = NamedSharding(mesh, P("fsdp", None))
    dst = NamedSharding(mesh, P("tensor", None))
    assert leaf_bytes_moved(src, dst, (8, 4), 4) == 384
    x = jax.device_put(x_host, src)
    with jax.transfer_guard("disallow"):
        y, stats = reshard({"w": x}, {"w": dst})
    assert stats == ReshardStats(bytes_moved=384, bytes_total=128, seconds=stats.seconds)
    assert y["w"].sharding.spec == P("tensor", None)
    np.testing.assert_array_equal(np.asarray(y["w"]), x_host)


def test_train_to_generate_kernel_hand_computed(mesh):
    # mlp_in-like kernel [D=8, F=4] float32: TRAIN P("fsdp","tensor") -> GENERATE
    # P(None,"tensor"). Each device holds 2x2 and needs 8x2: receives 12 floats; 8 devices.
    src = NamedSharding(mesh, P("fsdp", "tensor"))
    dst = NamedSharding(mesh, P(None, "tensor"))
    assert reshard_bytes(src, dst, jax.ShapeDtypeStruct((8, 4), np.float32)) == 8 * 12 * 4


def test_host_arrays_count_as_moved(mesh):
    dst = NamedSharding(mesh, P("fsdp", None))
    x = np.ones((8, 4), np.float32)
    # Replicated over tensor=2: two copies of 128 bytes arrive.
    y, stats = reshard(x, dst)
    assert stats.bytes_moved == 256
    assert reshard_bytes(None, dst, x) == 256
    assert y.sharding.spec == P("fsdp", None)


def test_donate_deletes_sources(mesh):
    host = _host_params()
    train = logical_to_shardings(SPECS, mesh, TRAIN, shapes=SHAPES)
    gen = logical_to_shardings(SPECS, mesh, GENERATE, shapes=SHAPES)
    params = jax.device_put(host, train)
    src_leaves = jax.tree.leaves(params)
    with jax.transfer_guard("disallow"):
        gen_params, _ = reshard(params, gen, donate=True)
    changed = [
        x
        for x, s in zip(src_leaves, jax.tree.leaves(gen), strict=True)
        if x.sharding.spec != s.spec
    ]
    assert changed  # embed, q and mlp_in change layout
    assert all(x.is_deleted() for x in changed)
    for a, h in zip(jax.tree.leaves(gen_params), jax.tree.leaves(host), strict=True):
        np.testing.assert_array_equal(np.asarray(a), h)


def test_mismatched_tree_raises(mesh):
    x = {"a": jax.device_put(np.zeros(8, np.float32))}
    with pytest.raises(ValueError, match="destination shardings"):
        reshard(x, {"b": NamedSharding(mesh, P())})
