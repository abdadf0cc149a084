"""PPO with a Hydra critic (``ppo.value.branch_layer``; the model is ``models/hydra.py``).

The frozen trunk (embeddings and the layers below the branch) is held once and passed to
every program as the learners' frozen part (``steps.Learner.combine``); the policy's
TrainState holds its branch, the critic's its own branch with the value head. Nothing of the
trunk is trained, checkpointed or has optimizer state. The reference is the trunk plus a
frozen copy of the policy's initial branch; the sampler gets the plain model rebuilt from the
trunk and the policy branch (:class:`HydraSync`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrlhf.generation import Sampler
from jaxrlhf.models import hydra
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.lora import combine
from jaxrlhf.models.precision import compute_dtype_params
from jaxrlhf.models.scoring import RolloutForward
from jaxrlhf.sharding import ReshardStats, reshard, reshard_bytes
from jaxrlhf.sharding.model_sharding import activation_constraint, param_shardings
from jaxrlhf.sharding.rules import TRAIN, logical_to_shardings

HEADS = ("lm", "scalar")


@dataclasses.dataclass(frozen=True)
class HydraLayout:
    """The Hydra model's three parts, abstract and in their training shardings (static).

    Attributes:
      branch_layer: the first layer of the branches.
      trunk, policy, value: abstract trees of ``{"trunk": ...}``, ``{"policy": ...}``,
        ``{"value": ...}`` (the keys of the Hydra model's param tree).
      trunk_shardings, policy_shardings, value_shardings: their NamedSharding trees.
    """

    branch_layer: int
    trunk: Any
    policy: Any
    value: Any
    trunk_shardings: Any
    policy_shardings: Any
    value_shardings: Any


def hydra_layout(model: ModelConfig, mesh: Mesh, branch_layer: int) -> HydraLayout:
    """The parts of ``model`` as a Hydra model branching at ``branch_layer`` (train rules,
    which are also the score rules)."""
    abstract = hydra.abstract_params(model, branch_layer, HEADS)
    specs = hydra.logical_specs(model, branch_layer, HEADS)
    shardings = logical_to_shardings(specs, mesh, TRAIN, shapes=abstract)

    def part(tree: Any, name: str) -> dict[str, Any]:
        return {name: tree[name]}

    return HydraLayout(
        branch_layer,
        part(abstract, "trunk"),
        part(abstract, "policy"),
        part(abstract, "value"),
        part(shardings, "trunk"),
        part(shardings, "policy"),
        part(shardings, "value"),
    )


def hydra_forward(
    model: ModelConfig,
    mesh: Mesh,
    rules: Any,
    branch_layer: int,
    heads: tuple[str, ...],
    max_new_tokens: int,
    group_size: int,
) -> RolloutForward:
    """A RolloutForward of the Hydra model with ``heads`` under ``rules``."""
    module = hydra.HydraModel(model, branch_layer, heads, activation_constraint(mesh, rules))
    return RolloutForward(module, max_new_tokens, group_size)


def combine_parts(frozen: Any, trainable: Any, key: jax.Array | None) -> dict[str, Any]:
    """``steps.Learner.combine`` of a Hydra learner: the trunk and its branch as one tree
    (no randomness: ``key`` is unused)."""
    del key
    return combine(frozen, trainable)


def initial_parts(params: Any, layout: HydraLayout, score_dtype: Any) -> tuple[Any, Any, Any, Any]:
    """``(trunk, policy branch, value branch, reference branch)`` from the initial plain
    policy ``params``, each a fresh copy in its shardings; the value branch copies the
    policy's top layers with a zero value head, the reference branch is a frozen copy of
    the policy's."""
    b = layout.branch_layer
    hidden = jax.tree.leaves(layout.value["value"]["score"])[0].shape[0]

    def split(p: Any) -> tuple[Any, ...]:
        trunk, policy = hydra.from_plain(p, b)
        value = hydra.value_from_plain(p, b, jnp.zeros((hidden, 1), score_dtype))
        reference = jax.tree.map(jnp.copy, policy)
        return {"trunk": trunk}, {"policy": policy}, {"value": value}, {"policy": reference}

    out_sh = (
        layout.trunk_shardings,
        layout.policy_shardings,
        layout.value_shardings,
        layout.policy_shardings,
    )
    return jax.jit(split, out_shardings=out_sh)(params)


def _to_plain(frozen: Any, trainable: Any) -> Any:
    return hydra.to_plain(frozen["trunk"], trainable["policy"])


def _to_plain_compute(frozen: Any, trainable: Any, *, model: ModelConfig) -> Any:
    return compute_dtype_params(_to_plain(frozen, trainable), model)


def plain_policy(frozen: Any, trainable: Any) -> Any:
    """The plain LM's params (``models.model`` tree) of the trunk and the policy branch."""
    return jax.jit(_to_plain)(frozen, trainable)


@dataclasses.dataclass(frozen=True)
class HydraSync:
    """The policy for the sampler: the plain model rebuilt from trunk and policy branch by
    one jitted program (a full sync: the whole model moves), in the compute dtype
    (``models.precision.compute_dtype_params``: the values the decode reads, half the bytes
    of float32 masters for bfloat16 compute). Its output is in the sampler's
    layout when the sampler runs on the training devices; on another mesh
    (``placement.generate_mesh``) it is in the training layout and is then resharded, as a
    full-weight policy is. Same interface as ``weight_sync.AdapterSync``."""

    layout: HydraLayout
    sampler: Sampler
    program: Any
    full_bytes: int
    via_train: bool = False  # the sampler's devices differ: rebuild, then reshard
    mode: str = "full"

    @classmethod
    def build(cls, layout: HydraLayout, sampler: Sampler) -> HydraSync:
        model = sampler.cfg
        train_mesh = jax.tree.leaves(layout.trunk_shardings)[0].mesh
        train = param_shardings(model, train_mesh, TRAIN)
        via_train = set(train_mesh.devices.flat) != set(sampler.mesh.devices.flat)
        program = jax.jit(
            functools.partial(_to_plain_compute, model=model),
            in_shardings=(layout.trunk_shardings, layout.policy_shardings),
            out_shardings=train if via_train else sampler.param_shardings,
        )
        abstract = compute_dtype_params(model_lib.abstract_params(model), model)
        full = reshard_bytes(train, sampler.param_shardings, abstract)
        return cls(layout, sampler, program, full, via_train)

    def generate_params(
        self, frozen: Any, resident: Any, trainable: Any
    ) -> tuple[Any, ReshardStats]:
        """The plain policy in the sampler's layout and the bytes that moved (counted as a
        reshard of the plain model from its training layout)."""
        del resident
        start = time.perf_counter()
        params = self.program(frozen, trainable)
        if self.via_train:
            params, stats = reshard(params, self.sampler.param_shardings, donate=True)
            return params, ReshardStats(
                stats.bytes_moved, stats.bytes_total, time.perf_counter() - start
            )
        params = jax.block_until_ready(params)
        total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
        return params, ReshardStats(self.full_bytes, total, time.perf_counter() - start)

    def bytes_per_iteration(self) -> tuple[int, int]:
        """``(moved, full sync)``: both the whole plain model's reshard."""
        return self.full_bytes, self.full_bytes
