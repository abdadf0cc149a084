"""Logical-axis rule sets per role and phase, and their resolution to NamedShardings.

A rule set is a plain, hashable tuple of ``(logical_name, mesh_axes)`` pairs, where
``mesh_axes`` is ``None`` (replicate), one mesh axis name, or a tuple of them (the dim is
split over their product). Models annotate parameters and activations with logical names
from ``jaxrlhf.models.axes``; only this module knows the mesh axes ``("data", "fsdp",
"tensor")``. Because rule sets are hashable they can be static arguments of jitted
functions, so each role/phase compiles with its own rules instead of relying on flax's
ambient ``logical_axis_rules`` context (which is not part of the jit cache key).

Resolution (``spec_to_mesh``) follows flax's conventions:

* A name missing from the rules is an error (``ShardingRuleError``), never a silent
  replication.
* A mesh axis is used at most once per array: a later dim whose rule needs an axis that an
  earlier dim already took is replicated.
* A name may appear in several rules; they are tried in order and the first whose mesh
  axes are all still free (and, when the shape is known, divide the dim) wins.
* When a dim is not divisible by the product of its mesh axis sizes, it is replicated and a
  warning names the param path, the dim and the sizes.
"""

from __future__ import annotations

import functools
import logging
import math
import types
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.models import axes as ax

logger = logging.getLogger(__name__)

MeshAxes: TypeAlias = str | tuple[str, ...] | None
Rules: TypeAlias = tuple[tuple[str, MeshAxes], ...]

ROLES: tuple[str, ...] = ("policy", "reference", "reward", "value")
PHASES: tuple[str, ...] = ("train", "score", "generate")


class ShardingRuleError(ValueError):
    """A logical axis without a rule, or a rule that does not fit the mesh."""


# KV-cache axes are only used by the sampler, but every rule set maps them so that any
# rule set can resolve any annotated array. The cache is split like the decode batch and
# on heads, never on length (each decode step writes one position).
_CACHE_RULES: Rules = (
    (ax.CACHE_BATCH, ("data", "fsdp")),
    (ax.CACHE_HEADS, "tensor"),
    (ax.CACHE_LENGTH, None),
)

# Expert parallelism (mixture-of-experts layers, models/moe.py). The experts of an MoE
# kernel [E, D, F] are split over "fsdp": each device holds E / fsdp whole experts (each
# split on F over "tensor") instead of a 1/fsdp slice of every expert's width, so XLA
# partitions the grouped matmul by expert: the tokens of the fsdp group are gathered, each
# device multiplies the rows routed to its own experts, and the partial outputs are summed
# over the group. Expert parallelism thus rides on the FSDP axis (as DeepSpeed-MoE's expert
# groups ride on data parallelism); a dim that "fsdp" does not divide (8 experts on 16
# devices) is replicated with a warning and the kernel falls back to FSDP on its D axis.
_EXPERT_RULES: Rules = ((ax.EXPERT, "fsdp"),)

# FSDP + tensor parallelism for training. Parameters are split on "fsdp" along the model
# width (gathered per layer inside the step) and on "tensor" along heads / MLP / vocab;
# the batch is split over both data-like axes.
TRAIN: Rules = (
    _EXPERT_RULES
    + (
        # parameters
        (ax.VOCAB, "tensor"),
        (ax.EMBED, "fsdp"),
        (ax.HEADS, "tensor"),
        (ax.KV_HEADS, "tensor"),
        (ax.HEAD_DIM, None),
        (ax.MLP, "tensor"),
        (ax.LAYERS, None),
        (ax.NORM, None),
        (ax.POSITIONS, None),
        (ax.SCALAR, None),
        (ax.LORA_RANK, None),
        # activations
        (ax.BATCH, ("data", "fsdp")),
        (ax.LENGTH, None),
        (ax.ACT_EMBED, None),
        (ax.ACT_HEADS, "tensor"),
        (ax.ACT_MLP, "tensor"),
        (ax.ACT_VOCAB, "tensor"),
    )
    + _CACHE_RULES
)

# Autoregressive decoding. Each step processes one token per row, so the per-layer
# all-gathers of FSDP would be paid once per generated token on a tiny amount of compute.
# Parameters therefore carry nothing on "fsdp" (replicated across it, still split on
# "tensor"), and "fsdp" acts as a second data axis for the batch and the KV cache. The
# price is memory: each fsdp replica holds a full tensor-parallel slice of the weights.
# Experts are the exception: they stay split over "fsdp" (expert parallelism). An MoE's
# experts are most of its weights but each token uses k of them, so replicating them would
# multiply the largest part of the model by the fsdp size to save two small collectives per
# layer and step (gathering the step's B x k routed rows over the fsdp group and summing
# their outputs), which carry a few rows, not weights.
GENERATE: Rules = (
    _EXPERT_RULES
    + (
        # parameters
        (ax.VOCAB, "tensor"),
        (ax.EMBED, None),
        (ax.HEADS, "tensor"),
        (ax.KV_HEADS, "tensor"),
        (ax.HEAD_DIM, None),
        (ax.MLP, "tensor"),
        (ax.LAYERS, None),
        (ax.NORM, None),
        (ax.POSITIONS, None),
        (ax.SCALAR, None),
        (ax.LORA_RANK, None),
        # activations
        (ax.BATCH, ("data", "fsdp")),
        (ax.LENGTH, None),
        (ax.ACT_EMBED, None),
        (ax.ACT_HEADS, "tensor"),
        (ax.ACT_MLP, "tensor"),
        (ax.ACT_VOCAB, "tensor"),
    )
    + _CACHE_RULES
)

# Forward-only scoring (reference logprobs, reward and value scores, the policy's own
# logprobs before an update). Same layout as TRAIN, on purpose:
# * Frozen roles (reference, reward) are as large as the policy; keeping them FSDP-sharded
#   is what lets four models share the devices. Replicating them over "fsdp" would multiply
#   their memory by the fsdp size.
# * Scoring runs one forward pass over the whole rollout batch (B x T tokens), so the
#   per-layer all-gathers are amortised over many tokens, unlike decoding (B x 1 per step).
# * The policy and value model score in exactly their training layout, so no reshard is
#   needed between scoring and the update.
SCORE: Rules = TRAIN

ROLE_PHASE_RULES: Mapping[tuple[str, str], Rules] = types.MappingProxyType(
    {
        ("policy", "train"): TRAIN,
        ("policy", "score"): SCORE,
        ("policy", "generate"): GENERATE,
        ("reference", "score"): SCORE,
        # A reward model is trained (RM trainer) before it is frozen and used for scoring.
        ("reward", "train"): TRAIN,
        ("reward", "score"): SCORE,
        ("value", "train"): TRAIN,
        ("value", "score"): SCORE,
    }
)
"""Rule set of each valid (role, phase). Read-only; use ``rules_for``."""


def rules_for(role: str, phase: str) -> Rules:
    """Returns the rule set of ``role`` in ``phase``.

    Args:
      role: one of ``ROLES``.
      phase: one of ``PHASES``.

    Returns:
      The rule set (a hashable tuple of ``(logical_name, mesh_axes)``).

    Raises:
      ShardingRuleError: for an unknown role/phase or a combination that does not exist
        (e.g. ``("reference", "train")``); the message lists the valid combinations.
    """
    try:
        return ROLE_PHASE_RULES[(role, phase)]
    except KeyError:
        valid = ", ".join(f"{r}/{p}" for r, p in ROLE_PHASE_RULES)
        raise ShardingRuleError(
            f"no sharding rules for role {role!r} in phase {phase!r}; valid: {valid}"
        ) from None


def _as_axes(mesh_axes: MeshAxes) -> tuple[str, ...]:
    if mesh_axes is None:
        return ()
    if isinstance(mesh_axes, str):
        return (mesh_axes,)
    return tuple(mesh_axes)


def _pack(mesh_axes: Sequence[str]) -> MeshAxes:
    """The PartitionSpec entry for a dim split over ``mesh_axes``."""
    if not mesh_axes:
        return None
    if len(mesh_axes) == 1:
        return mesh_axes[0]
    return tuple(mesh_axes)


def validate_rules(rules: Rules, mesh: Mesh | None = None) -> None:
    """Checks the form of a rule set and, given a mesh, that its mesh axes exist.

    Raises:
      ShardingRuleError: on a malformed entry or an unknown mesh axis.
    """
    for entry in rules:
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)):
            raise ShardingRuleError(f"rule {entry!r} is not a (logical_name, mesh_axes) pair")
        mesh_axes = entry[1]
        if not (
            mesh_axes is None
            or isinstance(mesh_axes, str)
            or (isinstance(mesh_axes, tuple) and all(isinstance(a, str) for a in mesh_axes))
        ):
            raise ShardingRuleError(
                f"rule for {entry[0]!r} maps to {mesh_axes!r}; expected None, a mesh axis"
                " name or a tuple of them"
            )
        if mesh is not None:
            for a in _as_axes(mesh_axes):
                if a not in mesh.shape:
                    raise ShardingRuleError(
                        f"rule for {entry[0]!r} uses mesh axis {a!r}, which is not in the"
                        f" mesh axes {tuple(mesh.axis_names)}"
                    )


def spec_to_mesh(
    spec: P,
    rules: Rules,
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
    path: str = "",
) -> P:
    """Resolves a PartitionSpec of logical names to one of mesh axes.

    Args:
      spec: ``PartitionSpec`` whose entries are ``None``, a logical name or a tuple of
        logical names (the dim is split over all their mesh axes).
      rules: the rule set.
      shape: the array's shape; with ``mesh``, enables the divisibility check.
      mesh: the mesh; with ``shape``, enables the divisibility check, and checks that the
        rules' mesh axes exist.
      path: the param path, used in error and warning messages.

    Returns:
      A ``PartitionSpec`` of mesh axes, as long as ``spec``.

    Raises:
      ShardingRuleError: when a logical name has no rule, when ``spec`` has more entries
        than ``shape`` has dims, or when a rule names a mesh axis the mesh lacks.
    """
    where = f" of {path!r}" if path else ""
    if shape is not None and len(spec) > len(shape):
        raise ShardingRuleError(
            f"spec {spec} has {len(spec)} entries but the array{where} has shape {tuple(shape)}"
        )
    used: set[str] = set()
    out: list[MeshAxes] = []
    for dim, entry in enumerate(spec):
        if entry is None or entry is P.UNCONSTRAINED:
            out.append(entry)
            continue
        names = (entry,) if isinstance(entry, str) else tuple(entry)
        dim_axes: list[str] = []
        for name in names:
            prior = math.prod(mesh.shape[a] for a in dim_axes) if mesh is not None else 1
            dim_axes.extend(_resolve_name(name, rules, used, dim, shape, mesh, where, prior))
        out.append(_pack(dim_axes))
    return P(*out)


def _resolve_name(
    name: str,
    rules: Rules,
    used: set[str],
    dim: int,
    shape: Sequence[int] | None,
    mesh: Mesh | None,
    where: str,
    prior_size: int,
) -> tuple[str, ...]:
    """Mesh axes for one logical name of dim ``dim``; marks them used.

    ``prior_size`` is the product of the mesh axes already assigned to this dim by earlier
    logical names of the same entry (``P(("batch", "length"))``).
    """
    candidates = [_as_axes(mesh_axes) for logical, mesh_axes in rules if logical == name]
    if not candidates:
        raise ShardingRuleError(
            f"logical axis {name!r} (dim {dim}{where}) has no sharding rule; add it to the rule set"
        )
    indivisible: list[tuple[tuple[str, ...], int]] = []
    for mesh_axes in candidates:
        if any(a in used for a in mesh_axes):
            continue
        if mesh is not None:
            for a in mesh_axes:
                if a not in mesh.shape:
                    raise ShardingRuleError(
                        f"rule for {name!r}{where} uses mesh axis {a!r}, which is not in the"
                        f" mesh axes {tuple(mesh.axis_names)}"
                    )
        if shape is not None and mesh is not None and mesh_axes:
            size = math.prod(mesh.shape[a] for a in mesh_axes)
            if shape[dim] % (prior_size * size):
                indivisible.append((mesh_axes, size))
                continue
        used.update(mesh_axes)
        return mesh_axes
    for mesh_axes, size in indivisible:
        _warn_once(
            f"replicating dim {dim} (size {shape[dim] if shape is not None else -1}, logical"
            f" {name!r}){where}: not divisible by mesh axes {mesh_axes} of total size {size}"
        )
    return ()


@functools.lru_cache(maxsize=4096)
def _warn_once(message: str) -> None:
    """Logs ``message`` the first time only: activation constraints resolve the same specs
    on every trace of every layer, which repeated one warning dozens of times per compile."""
    logger.warning(message)


def _path_str(path: Sequence[Any]) -> str:
    """Renders a pytree key path as ``decoder/layers/attn/q_kernel``."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            parts.append(str(key.key))
        else:
            parts.append(str(key))
    # NNX State leaves sit under a Variable's ``value`` attribute; it names no param.
    if parts and parts[-1] in ("value", "raw_value"):
        parts.pop()
    return "/".join(parts)


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _shape_of(x: Any) -> tuple[int, ...] | None:
    if x is None:
        return None
    if hasattr(x, "shape"):
        return tuple(x.shape)
    return tuple(x)


def logical_to_shardings(
    logical_specs: Any,
    mesh: Mesh,
    rules: Rules,
    shapes: Any = None,
) -> Any:
    """Maps a pytree of logical PartitionSpecs to a pytree of NamedShardings.

    Works on plain dicts and on NNX ``State`` (e.g. from ``nnx.get_partition_spec``).

    Args:
      logical_specs: pytree whose leaves are ``PartitionSpec`` of logical names.
      mesh: the target mesh.
      rules: the rule set.
      shapes: optional pytree with the same structure whose leaves are shape tuples,
        ``jax.ShapeDtypeStruct`` or arrays; enables the divisibility check (indivisible
        dims are replicated with a warning).

    Returns:
      A pytree of ``NamedSharding`` with the structure of ``logical_specs``.

    Raises:
      ShardingRuleError: when a logical name has no rule (the message names the param
        path) or the rules do not fit the mesh.
    """
    validate_rules(rules, mesh)

    def one(path: Sequence[Any], spec: P, shape: Any = None) -> NamedSharding:
        mesh_spec = spec_to_mesh(
            spec, rules, shape=_shape_of(shape), mesh=mesh, path=_path_str(path)
        )
        return NamedSharding(mesh, mesh_spec)

    if shapes is None:
        return jax.tree_util.tree_map_with_path(one, logical_specs, is_leaf=_is_spec)
    return jax.tree_util.tree_map_with_path(one, logical_specs, shapes, is_leaf=_is_spec)


def activation_sharding(
    mesh: Mesh,
    rules: Rules,
    names: tuple[str | None, ...],
    shape: Sequence[int] | None = None,
) -> NamedSharding:
    """NamedSharding of an activation annotated with logical ``names``.

    Use it for ``jax.lax.with_sharding_constraint`` inside a step and for the
    ``in_shardings`` / ``out_shardings`` of batches, e.g.
    ``activation_sharding(mesh, rules, (axes.BATCH, axes.LENGTH))``.

    Args:
      mesh: the mesh.
      rules: the rule set.
      names: one logical name (or None) per dim.
      shape: optional shape for the divisibility check.

    Returns:
      The ``NamedSharding``.
    """
    return NamedSharding(mesh, spec_to_mesh(P(*names), rules, shape=shape, mesh=mesh))
