"""Rule sets, logical -> mesh resolution, and the resulting device layouts."""

import logging
import math

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.models import axes as ax
from jaxrlhf.sharding import (
    GENERATE,
    PHASES,
    ROLE_PHASE_RULES,
    ROLES,
    SCORE,
    TRAIN,
    MeshConfig,
    ShardingRuleError,
    activation_sharding,
    logical_to_shardings,
    make_mesh,
    rules_for,
    spec_to_mesh,
    validate_rules,
)
from jaxrlhf.sharding import rules as rules_lib

ALL_RULE_SETS = {"TRAIN": TRAIN, "GENERATE": GENERATE, "SCORE": SCORE} | {
    f"{role}/{phase}": rules for (role, phase), rules in ROLE_PHASE_RULES.items()
}


def _mesh(shape):
    data, fsdp, tensor = shape
    return make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))


@pytest.mark.parametrize("name", list(ALL_RULE_SETS))
def test_every_axis_has_a_rule(name):
    rules = ALL_RULE_SETS[name]
    names = [logical for logical, _ in rules]
    assert set(ax.ALL_AXES) <= set(names), set(ax.ALL_AXES) - set(names)
    assert len(names) == len(set(names)), "duplicate rules make the table ambiguous to read"
    validate_rules(rules, _mesh((2, 2, 2)))
    hash(rules)  # static argument of jitted functions


def test_generate_puts_no_parameter_on_fsdp():
    """Except the experts of MoE layers, which stay split over fsdp (expert parallelism)."""
    for logical, mesh_axes in GENERATE:
        if logical in ax.PARAM_AXES and logical != ax.EXPERT:
            assert mesh_axes is None or "fsdp" not in mesh_axes, logical
    assert dict(GENERATE)[ax.EXPERT] == dict(TRAIN)[ax.EXPERT] == "fsdp"
    assert dict(GENERATE)[ax.CACHE_BATCH] == ("data", "fsdp")
    assert dict(GENERATE)[ax.CACHE_HEADS] == "tensor"
    assert dict(GENERATE)[ax.CACHE_LENGTH] is None


def test_score_is_train():
    assert SCORE == TRAIN


def test_rules_for_valid_and_invalid():
    assert rules_for("policy", "generate") is GENERATE
    assert rules_for("policy", "train") is TRAIN
    assert rules_for("reference", "score") is SCORE
    assert set(role for role, _ in ROLE_PHASE_RULES) == set(ROLES)
    assert set(phase for _, phase in ROLE_PHASE_RULES) == set(PHASES)
    with pytest.raises(ShardingRuleError) as info:
        rules_for("reference", "train")
    msg = str(info.value)
    assert "\n" not in msg
    assert "'reference'" in msg and "policy/generate" in msg and "value/train" in msg
    with pytest.raises(ShardingRuleError):
        rules_for("critic", "train")
    with pytest.raises(TypeError):
        ROLE_PHASE_RULES[("reference", "train")] = TRAIN  # read-only table


def test_missing_name_names_axis_and_path():
    with pytest.raises(ShardingRuleError) as info:
        spec_to_mesh(P("embed", "experts"), TRAIN, path="decoder/moe/w_in")
    msg = str(info.value)
    assert "\n" not in msg
    assert "'experts'" in msg and "decoder/moe/w_in" in msg


def test_missing_name_path_from_pytree():
    specs = {"decoder": {"layers": {"attn": {"q_kernel": P("layers", "embed", "qheads")}}}}
    with pytest.raises(ShardingRuleError, match="decoder/layers/attn/q_kernel"):
        logical_to_shardings(specs, _mesh((1, 8, 1)), TRAIN)


def test_unknown_mesh_axis_raises():
    rules = ((ax.EMBED, "tp"),)
    with pytest.raises(ShardingRuleError, match="'tp'"):
        logical_to_shardings({"w": P("embed")}, _mesh((1, 8, 1)), rules)


def test_duplicate_mesh_axis_is_used_once():
    rules = (("a", "fsdp"), ("b", "fsdp"), ("c", ("data", "fsdp")))
    assert spec_to_mesh(P("a", "b"), rules) == P("fsdp", None)
    assert spec_to_mesh(P("b", None, "a"), rules) == P("fsdp", None, None)
    # A multi-axis rule is skipped whole when one of its axes is taken.
    assert spec_to_mesh(P("a", "c"), rules) == P("fsdp", None)
    # Realistic case: activations [B, D] where B already took "fsdp".
    train_like = ((ax.BATCH, ("data", "fsdp")), (ax.EMBED, "fsdp"))
    assert spec_to_mesh(P("batch", "embed"), train_like) == P(("data", "fsdp"), None)


def test_fallback_rules_in_order():
    rules = (("a", "fsdp"), ("b", "fsdp"), ("b", "tensor"))
    assert spec_to_mesh(P("a", "b"), rules) == P("fsdp", "tensor")
    assert spec_to_mesh(P("b", "a"), rules) == P("fsdp", None)


def test_tuple_of_names_in_one_dim():
    rules = (("x", "data"), ("y", "fsdp"), ("z", None))
    assert spec_to_mesh(P(("x", "y"), "z"), rules) == P(("data", "fsdp"), None)


def test_indivisible_dim_is_replicated_with_warning(caplog):
    mesh = _mesh((1, 4, 2))
    rules_lib._warn_once.cache_clear()  # each message is logged once per process
    with caplog.at_level(logging.WARNING, logger="jaxrlhf.sharding.rules"):
        for _ in range(3):  # e.g. the same activation constraint in every traced layer
            spec = spec_to_mesh(
                P("embed", "kv_heads"), TRAIN, shape=(6, 4), mesh=mesh, path="decoder/k"
            )
    # embed=6 is not divisible by fsdp=4 -> replicated; kv_heads=4 divides tensor=2.
    assert spec == P(None, "tensor")
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 1
    assert "decoder/k" in messages[0] and "dim 0" in messages[0]
    assert "size 6" in messages[0] and "total size 4" in messages[0]


def test_divisible_dims_do_not_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxrlhf.sharding.rules"):
        spec = spec_to_mesh(P("embed", "heads"), TRAIN, shape=(8, 4), mesh=_mesh((1, 4, 2)))
    assert spec == P("fsdp", "tensor")
    assert not caplog.records


def test_size_one_axes_map_harmlessly(caplog):
    # tensor has size 1 on this mesh: any dim size divides it, so the rule applies as is,
    # without a warning; a mesh axis is still used once per array.
    with caplog.at_level(logging.WARNING, logger="jaxrlhf.sharding.rules"):
        spec = spec_to_mesh(P("kv_heads", "mlp"), TRAIN, shape=(3, 5), mesh=_mesh((8, 1, 1)))
    assert spec == P("tensor", None)
    assert not caplog.records


# A small synthetic parameter tree. kv_heads=1 stands for grouped-query attention with fewer
# KV heads than tensor-parallel devices: it cannot be split on tensor=2 meshes.
SPECS = {
    "embed": P("vocab", "embed"),
    "layers": {
        "q": P("layers", "embed", "heads", "head_dim"),
        "k": P("layers", "embed", "kv_heads", "head_dim"),
        "mlp_in": P("layers", "embed", "mlp"),
        "norm": P("layers", "norm"),
    },
    "value_head": P("embed", "scalar"),
}
SHAPES = {
    "embed": (16, 8),
    "layers": {"q": (2, 8, 4, 4), "k": (2, 8, 1, 4), "mlp_in": (2, 8, 16), "norm": (2, 8)},
    "value_head": (8, 1),
}
MESHES = [(8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 4, 2)]


def _expected(rules_name, mesh_shape):
    kv = "tensor" if mesh_shape[2] == 1 else None  # kv_heads=1 divides only tensor=1
    if rules_name == "TRAIN":
        return {
            "embed": P("tensor", "fsdp"),
            "layers": {
                "q": P(None, "fsdp", "tensor", None),
                "k": P(None, "fsdp", kv, None),
                "mlp_in": P(None, "fsdp", "tensor"),
                "norm": P(None, None),
            },
            "value_head": P("fsdp", None),
        }
    return {
        "embed": P("tensor", None),
        "layers": {
            "q": P(None, None, "tensor", None),
            "k": P(None, None, kv, None),
            "mlp_in": P(None, None, "tensor"),
            "norm": P(None, None),
        },
        "value_head": P(None, None),
    }


def _is_spec(x):
    return isinstance(x, P)


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("rules_name", ["TRAIN", "GENERATE"])
def test_resolved_specs_and_layout(rules_name, mesh_shape):
    rules = {"TRAIN": TRAIN, "GENERATE": GENERATE}[rules_name]
    mesh = _mesh(mesh_shape)
    shardings = logical_to_shardings(SPECS, mesh, rules, shapes=SHAPES)
    got = jax.tree.map(lambda s: s.spec, shardings)
    assert got == _expected(rules_name, mesh_shape)

    rng = np.random.default_rng(0)
    host = jax.tree.map(
        lambda shape: rng.standard_normal(shape).astype(np.float32),
        SHAPES,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    params = jax.device_put(host, shardings)
    for x, h, s in zip(
        jax.tree.leaves(params), jax.tree.leaves(host), jax.tree.leaves(shardings), strict=True
    ):
        assert x.sharding.spec == s.spec
        np.testing.assert_array_equal(np.asarray(x), h)
        # Every device holds exactly total / (number of distinct shards) bytes.
        shards = math.prod(
            mesh.shape[a]
            for entry in s.spec
            if entry is not None
            for a in ((entry,) if isinstance(entry, str) else entry)
        )
        for shard in x.addressable_shards:
            assert shard.data.nbytes == h.nbytes // shards


def test_train_layout_per_device_bytes_fsdp_tp():
    # On (1,4,2) under TRAIN, q [L=2, D=8, N=4, H=4] is split 4 ways on D and 2 on N.
    mesh = _mesh((1, 4, 2))
    s = logical_to_shardings(SPECS, mesh, TRAIN, shapes=SHAPES)["layers"]["q"]
    assert s.shard_shape((2, 8, 4, 4)) == (2, 2, 2, 4)
    total = 2 * 8 * 4 * 4 * 4
    x = jax.device_put(np.zeros((2, 8, 4, 4), np.float32), s)
    assert {shard.data.nbytes for shard in x.addressable_shards} == {total // 8}


def test_shapes_may_be_shape_dtype_structs():
    mesh = _mesh((1, 4, 2))
    abstract = jax.tree.map(
        lambda shape: jax.ShapeDtypeStruct(shape, np.float32),
        SHAPES,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    shardings = logical_to_shardings(SPECS, mesh, TRAIN, shapes=abstract)
    assert jax.tree.map(lambda s: s.spec, shardings) == _expected("TRAIN", (1, 4, 2))


@pytest.mark.parametrize("rules", [TRAIN, GENERATE], ids=["train", "generate"])
def test_activation_sharding_in_a_jitted_function(rules):
    mesh = _mesh((2, 2, 2))
    btd = activation_sharding(mesh, rules, (ax.BATCH, ax.LENGTH, ax.ACT_EMBED))
    btv = activation_sharding(mesh, rules, (ax.BATCH, ax.LENGTH, ax.ACT_VOCAB))
    assert btd.spec == P(("data", "fsdp"), None, None)
    assert btv.spec == P(("data", "fsdp"), None, "tensor")

    x = np.arange(4 * 3 * 8, dtype=np.float32).reshape(4, 3, 8)
    w = np.linspace(-1.0, 1.0, 8 * 16, dtype=np.float32).reshape(8, 16)

    def f(x, w):
        return jax.lax.with_sharding_constraint(x @ w, btv)

    out = jax.jit(f, in_shardings=(btd, None))(jax.device_put(x, btd), w)
    assert out.sharding.spec == P(("data", "fsdp"), None, "tensor")
    np.testing.assert_allclose(np.asarray(out), x @ w, rtol=1e-5, atol=1e-5)


def test_nnx_state_specs_and_paths():
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.q_kernel = nnx.Param(
                nnx.with_partitioning(init, (ax.EMBED, ax.HEADS))(rngs.params(), (8, 4))
            )
            self.bad = nnx.Param(
                nnx.with_partitioning(init, (ax.EMBED, "experts"))(rngs.params(), (8, 4))
            )

    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: Block(nnx.Rngs(0)))
    state = nnx.state(model)
    specs = nnx.get_partition_spec(state)
    mesh = _mesh((1, 4, 2))
    with pytest.raises(ShardingRuleError, match="of 'bad'"):
        logical_to_shardings(specs, mesh, TRAIN, shapes=state)
    del model.bad
    state = nnx.state(model)
    shardings = logical_to_shardings(nnx.get_partition_spec(state), mesh, TRAIN, shapes=state)
    leaves = [s for s in jax.tree.leaves(shardings) if isinstance(s, NamedSharding)]
    assert [s.spec for s in leaves] == [P("fsdp", "tensor")]


@pytest.mark.parametrize(
    "rules",
    [(("embed",),), (("embed", 3),), (("embed", ("fsdp", 1)),), ((1, "fsdp"),)],
)
def test_malformed_rules_raise(rules):
    with pytest.raises(ShardingRuleError):
        validate_rules(rules)


@pytest.mark.parametrize("rules", [TRAIN, GENERATE], ids=["train", "generate"])
def test_experts_split_over_fsdp_or_fall_back_to_fsdp_on_width(rules):
    """An MoE kernel [L, E, D, F] puts whole experts on fsdp devices (F on tensor); with
    more fsdp devices than experts the experts are replicated and, in TRAIN, the width D
    takes fsdp instead (plain FSDP)."""
    spec = P(ax.LAYERS, ax.EXPERT, ax.EMBED, ax.MLP)
    mesh = _mesh((1, 4, 2))
    got = spec_to_mesh(spec, rules, shape=(2, 8, 32, 64), mesh=mesh)
    assert got == P(None, "fsdp", None, "tensor")
    got = spec_to_mesh(spec, rules, shape=(2, 2, 32, 64), mesh=mesh)  # 2 experts, fsdp 4
    assert got == P(None, None, "fsdp" if rules is TRAIN else None, "tensor")
