"""The train state pytree and its shardings."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


@flax.struct.dataclass
class TrainState:
    """Everything a train step replaces: donated to the step, returned new.

    Attributes:
      step: [] int32, optimizer updates done so far.
      params: model params (unboxed tree).
      opt_state: optax state of ``params``.
    """

    step: jax.Array
    params: Any
    opt_state: Any


def create_state(params: Any, optimizer: optax.GradientTransformation) -> TrainState:
    """A fresh state at step 0 (use under jit with ``out_shardings``)."""
    return TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params)
    )


def state_shardings(
    abstract_params: Any,
    param_shardings: Any,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    trainable: Any = None,
) -> TrainState:
    """Shardings of the whole state: optimizer moments follow their params (FSDP shards
    them too), counters and other non-param leaves are replicated. ``trainable``: the bool
    tree of the leaves an optimizer that trains part of the params updates (the
    ``optax.multi_transform`` of ``Objective.trainable``; no moments elsewhere)."""
    replicated = NamedSharding(mesh, P())
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    moment_shardings = param_shardings
    if trainable is not None:
        moment_shardings = jax.tree.map(
            lambda sharding, train: sharding if train else optax.MaskedNode(),
            param_shardings,
            trainable,
        )
    opt_shardings = optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        abstract_opt,
        moment_shardings,
        transform_non_params=lambda _: replicated,
    )
    return TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)


def init_state(
    params: Any, optimizer: optax.GradientTransformation, shardings: TrainState
) -> TrainState:
    """``create_state`` jitted into ``shardings``; ``params`` are donated (reused, not copied)."""
    fn = jax.jit(
        lambda p: create_state(p, optimizer),
        in_shardings=(shardings.params,),
        out_shardings=shardings,
        donate_argnums=0,
    )
    return fn(params)
