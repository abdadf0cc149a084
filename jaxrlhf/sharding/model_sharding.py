"""Shardings of a model's params and activations on a mesh, under a rule set.

The bridge between ``jaxrlhf.models`` (logical names only) and the mesh: resolves the
model's logical specs into NamedShardings, builds a module whose activation constraints use
the same rules, and reports per-device memory.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding

from jaxrlhf.models import model as model_lib
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.lora import LoraSpec
from jaxrlhf.models.transformer import Constrain
from jaxrlhf.sharding.rules import Rules, activation_sharding, logical_to_shardings


def param_shardings(
    cfg: ModelConfig, mesh: Mesh, rules: Rules, head: str = "lm", lora: LoraSpec | None = None
) -> Any:
    """NamedSharding tree matching ``model_lib.abstract_params(cfg, head, lora)`` (LoRA
    adapters included with ``lora``).

    Dims not divisible by their mesh axes are replicated with a logged warning.
    """
    return logical_to_shardings(
        model_lib.logical_specs(cfg, head, lora),
        mesh,
        rules,
        shapes=model_lib.abstract_params(cfg, head, lora),
    )


def activation_constraint(mesh: Mesh, rules: Rules) -> Constrain:
    """A ``constrain(x, logical_names)`` that pins activations to ``rules`` on ``mesh``.

    The rules are bound explicitly (not read from flax's ambient context, which the jit
    cache ignores), so one model traced under train and generate rules compiles twice.
    """

    def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
        sharding = activation_sharding(mesh, rules, names, shape=x.shape)
        return jax.lax.with_sharding_constraint(x, sharding)

    return constrain


def build_sharded(
    cfg: ModelConfig, mesh: Mesh, rules: Rules, head: str = "lm", lora: LoraSpec | None = None
) -> nn.Module:
    """``model_lib.build`` with activation constraints for ``rules`` on ``mesh``."""
    return model_lib.build(cfg, head, activation_constraint(mesh, rules), lora)


def bytes_per_device(shardings: Any, abstract: Any) -> dict[Any, int]:
    """Bytes each device holds for ``abstract`` (ShapeDtypeStructs) laid out in ``shardings``."""
    totals: dict[Any, int] = {}
    for sharding, leaf in zip(jax.tree.leaves(shardings), jax.tree.leaves(abstract), strict=True):
        shard_shape = sharding.shard_shape(leaf.shape)
        nbytes = math.prod(shard_shape) * leaf.dtype.itemsize
        for device in sharding.device_set:
            totals[device] = totals.get(device, 0) + nbytes
    return totals


def replicated(mesh: Mesh) -> NamedSharding:
    """A fully replicated sharding on ``mesh``."""
    return NamedSharding(mesh, jax.sharding.PartitionSpec())
