"""Meshes, logical-axis rules per role and phase, resharding and multi-host setup.

Typical use::

    from jaxrlhf import sharding

    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=-1, tensor=2))
    train_shardings = sharding.logical_to_shardings(
        logical_specs, mesh, sharding.rules_for("policy", "train"), shapes=abstract_params
    )
    gen_shardings = sharding.logical_to_shardings(
        logical_specs, mesh, sharding.rules_for("policy", "generate"), shapes=abstract_params
    )
    gen_params, stats = sharding.reshard(params, gen_shardings)
"""

from jaxrlhf.sharding.distributed import (
    global_batch_from_local,
    initialize,
    is_main_process,
    process_local_slice,
)
from jaxrlhf.sharding.mesh import (
    AXIS_TYPES,
    MESH_AXES,
    MeshConfig,
    MeshError,
    make_mesh,
    resolve_mesh_shape,
)
from jaxrlhf.sharding.reshard import ReshardStats, leaf_bytes_moved, reshard, reshard_bytes
from jaxrlhf.sharding.rules import (
    GENERATE,
    PHASES,
    ROLE_PHASE_RULES,
    ROLES,
    SCORE,
    TRAIN,
    MeshAxes,
    Rules,
    ShardingRuleError,
    activation_sharding,
    logical_to_shardings,
    rules_for,
    spec_to_mesh,
    validate_rules,
)

__all__ = [
    "AXIS_TYPES",
    "GENERATE",
    "MESH_AXES",
    "PHASES",
    "ROLES",
    "ROLE_PHASE_RULES",
    "SCORE",
    "TRAIN",
    "MeshAxes",
    "MeshConfig",
    "MeshError",
    "ReshardStats",
    "Rules",
    "ShardingRuleError",
    "activation_sharding",
    "global_batch_from_local",
    "initialize",
    "is_main_process",
    "leaf_bytes_moved",
    "logical_to_shardings",
    "make_mesh",
    "process_local_slice",
    "reshard",
    "reshard_bytes",
    "resolve_mesh_shape",
    "rules_for",
    "spec_to_mesh",
    "validate_rules",
]
