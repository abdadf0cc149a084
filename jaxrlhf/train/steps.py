"""Pure train and eval steps shared by every trainer.

A trainer is an :class:`Objective`: a loss over one micro-batch plus the *weight* of that
micro-batch, i.e. how many units (tokens, pairs) its mean loss averages over. The step
splits the global batch into ``num_micro`` micro-batches, runs them with ``lax.scan`` and
adds their gradients weighted by ``weight / total weight``. For mean losses this is exact:
accumulating over micro-batches gives the same gradient (up to float rounding) as one
full-batch step, whatever the split, the padding or the device count.

Micro-batches are strided (row ``r`` goes to micro-batch ``r % num_micro``): each device's
slice of the batch splits into the same micro-batches locally, so the split moves no data
between devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from jaxrlhf.models import axes, moe
from jaxrlhf.sharding.rules import Rules, activation_sharding
from jaxrlhf.train.state import TrainState

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
LossFn = Callable[[Any, Any, Batch], tuple[jax.Array, Metrics]]  # (module, params, batch)
WeightFn = Callable[[Batch], jax.Array]


@dataclasses.dataclass(frozen=True)
class Reference:
    """A frozen reference model whose per-pair log-probs a loss needs.

    Attributes:
      logps_fn: ``(module, params, batch) -> [B, 2]`` log-probs of each pair's sequences.
      hf_dir: checkpoint of the reference; None = a frozen copy of the initial policy.
      precompute: score the whole dataset once before training and free the reference.
    """

    logps_fn: Callable[[Any, Any, Batch], jax.Array]
    hf_dir: str | None = None
    precompute: bool = False


@dataclasses.dataclass(frozen=True)
class Objective:
    """What a trainer optimises and what it needs.

    Attributes:
      name: the algorithm (``"sft"``, ``"reward_model"``, ``"dpo"``).
      role: sharding role of the trained model (``"policy"`` or ``"reward"``).
      head: model head, ``"lm"`` or ``"scalar"``.
      data_kind: dataset kind, ``"sft"`` or ``"preference"``.
      loss_fn: mean loss and metrics (flat dict, namespaced keys) of a micro-batch.
      weight_fn: number of units the micro-batch's mean is over (0 for padding rows).
      primary: the main metric, shown in progress lines and plots.
      summary: metrics shown in progress lines.
      reference: a reference model, for losses that need one.
    """

    name: str
    role: str
    head: str
    data_kind: str
    loss_fn: LossFn
    weight_fn: WeightFn
    primary: str
    summary: tuple[str, ...]
    reference: Reference | None = None


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int) -> NamedSharding:
    """Rows split like the ``batch`` activation axis, every other dim replicated."""
    return activation_sharding(mesh, rules, (axes.BATCH,) + (None,) * (ndim - 1))


def split_micro(
    batch: Batch, num_micro: int, mesh: Mesh, rules: Rules, group_size: int = 1
) -> Batch:
    """``[B, ...] -> [num_micro, B / num_micro, ...]``, strided: row r -> micro r % n.

    With ``group_size > 1``, strided by groups of that many consecutive rows (group g ->
    micro g % n), which stay whole and in order (packed prompt groups, rl_steps).
    """

    def split(x: jax.Array) -> jax.Array:
        b = x.shape[0]
        x = x.reshape(b // (num_micro * group_size), num_micro, group_size, *x.shape[1:])
        x = x.swapaxes(0, 1).reshape(num_micro, b // num_micro, *x.shape[3:])
        names = (None, axes.BATCH) + (None,) * (x.ndim - 2)
        return jax.lax.with_sharding_constraint(x, activation_sharding(mesh, rules, names))

    return jax.tree.map(split, batch)


def merge_micro(x: jax.Array, group_size: int = 1) -> jax.Array:
    """Inverse of :func:`split_micro` for one array: ``[n, B / n, ...] -> [B, ...]``."""
    num_micro, rows = x.shape[:2]
    x = x.reshape(num_micro, rows // group_size, group_size, *x.shape[2:])
    return x.swapaxes(0, 1).reshape(num_micro * rows, *x.shape[3:])


def map_micro(
    fn: Callable[[Batch], Any],
    batch: Batch,
    num_micro: int,
    mesh: Mesh,
    rules: Rules,
    group_size: int = 1,
) -> Any:
    """``fn(batch)`` computed one micro-batch of rows at a time (``lax.map``), for row-wise
    ``fn`` whose outputs all have a leading row axis: only one micro-batch's activations are
    live at once. Micro-batches are those of :func:`split_micro` (whole groups of
    ``group_size`` rows); the outputs come back in the batch's row order."""
    if num_micro == 1:
        return fn(batch)
    out = jax.lax.map(fn, split_micro(batch, num_micro, mesh, rules, group_size))
    return jax.tree.map(lambda x: merge_micro(x, group_size), out)


def _with_router_loss(loss_fn: LossFn, module: Any) -> Callable[[Any, Batch], Any]:
    """MoE hook (jaxrlhf/models/moe.py): ``loss_fn`` plus ``router_aux_loss_coef`` times the
    router's load-balancing loss, and router metrics (per-expert load); unchanged for dense
    models, whose forwards capture nothing."""

    def wrapped(params: Any, batch: Batch) -> tuple[jax.Array, Metrics]:
        with moe.capture_router_logits() as routed:
            loss, metrics = loss_fn(module, params, batch)
        return moe.add_router_loss(module.cfg, loss, metrics, routed)

    return wrapped


def accumulate_gradients(
    objective: Objective,
    module: Any,
    params: Any,
    batch: Batch,
    *,
    num_micro: int,
    mesh: Mesh,
    rules: Rules,
    grad_shardings: Any,
    group_size: int = 1,
) -> tuple[Any, Metrics]:
    """Weighted-mean gradients and metrics over ``num_micro`` micro-batches of ``batch``.

    Gradients are accumulated in float32 and kept in the params' shardings. Micro-batches
    take whole groups of ``group_size`` rows (:func:`split_micro`).
    """
    loss_fn = _with_router_loss(objective.loss_fn, module)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if num_micro == 1:
        (_, metrics), grads = grad_fn(params, batch)
        return grads, metrics
    micro = split_micro(batch, num_micro, mesh, rules, group_size)
    weights = jax.vmap(objective.weight_fn)(micro).astype(jnp.float32)  # [n]
    weights = weights / jnp.maximum(weights.sum(), 1.0)

    def body(carry, xs):
        mb, w = xs
        (_, metrics), grads = grad_fn(params, mb)
        grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        return jax.tree.map(
            lambda c, x: c + w * x.astype(jnp.float32), carry, (grads, metrics)
        ), None

    abstract_metrics = jax.eval_shape(
        lambda p, b: loss_fn(p, b)[1],
        params,
        jax.tree.map(lambda x: x[0], micro),
    )
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), (params, abstract_metrics))
    zeros = (jax.lax.with_sharding_constraint(zeros[0], grad_shardings), zeros[1])
    (grads, metrics), _ = jax.lax.scan(body, zeros, (micro, weights))
    return grads, metrics


def train_step(
    state: TrainState,
    batch: Batch,
    key: jax.Array,
    *,
    objective: Objective,
    module: Any,
    optimizer: optax.GradientTransformation,
    lr_fn: optax.Schedule,
    num_micro: int,
    mesh: Mesh,
    rules: Rules,
    grad_shardings: Any,
    group_size: int = 1,
) -> tuple[TrainState, Metrics]:
    """One optimizer update on ``batch``: ``(state, batch, key) -> (state, metrics)``.

    ``key`` is unused by the supervised and preference objectives (the models have no
    dropout); it keeps the signature every trainer's step shares (RL steps sample).
    Metrics add ``grad_norm`` (before clipping), ``lr`` (of this update) and ``skipped``
    (1.0 when the update was dropped because a ``loss/*`` metric, the gradient or the
    optimizer's update was not finite: the returned state then equals ``state``).
    ``group_size``: micro-batches take whole groups of that many rows (:func:`split_micro`).
    """
    del key
    grads, metrics = accumulate_gradients(
        objective,
        module,
        state.params,
        batch,
        num_micro=num_micro,
        mesh=mesh,
        rules=rules,
        grad_shardings=grad_shardings,
        group_size=group_size,
    )
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm)
    for name, value in metrics.items():
        if name.startswith("loss/"):
            finite = finite & jnp.all(jnp.isfinite(value))
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    # Gradients are accumulated in float32; optax would then promote bf16 moments (with no
    # mu_dtype) to float32, changing the state's dtypes and recompiling the next step.
    opt_state = jax.tree.map(lambda new, old: new.astype(old.dtype), opt_state, state.opt_state)
    finite = finite & jnp.isfinite(optax.tree.norm(updates))  # e.g. a bad lr or epsilon
    params = optax.apply_updates(state.params, updates)
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
    # A non-finite loss or gradient leaves params, optimizer moments and the step
    # counter exactly as they were; the host counts the skips.
    new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state)
    metrics = dict(
        metrics,
        grad_norm=grad_norm,
        lr=lr_fn(state.step),
        skipped=(~finite).astype(jnp.float32),
    )
    return new_state, metrics


def eval_step(
    params: Any, batch: Batch, *, objective: Objective, module: Any
) -> tuple[Metrics, jax.Array]:
    """``(metrics * weight, weight)`` of one batch; sum both over batches and divide."""
    _, metrics = objective.loss_fn(module, params, batch)
    weight = objective.weight_fn(batch).astype(jnp.float32)
    return jax.tree.map(lambda m: m * weight, metrics), weight
