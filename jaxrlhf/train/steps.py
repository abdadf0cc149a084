"""Pure train and eval steps shared by every trainer.

A trainer is an :class:`Objective`: a loss over one micro-batch plus the *weight* of that
micro-batch, i.e. how many units (tokens, pairs) its mean loss averages over. The step
splits the global batch into ``num_micro`` micro-batches, runs them with ``lax.scan`` and
adds their gradients weighted by ``weight / total weight``. For mean losses this is exact:
accumulating over micro-batches gives the same gradient (up to float rounding) as one
full-batch step, whatever the split, the padding or the device count.

Micro-batches are strided (``jaxrlhf.sharding.micro_batches``): each device's slice of the
batch splits into the same micro-batches locally, so the split moves no data between
devices. An objective whose rows come in groups (RL's packed prompt groups) says so in
``row_group``; its micro-batches then take whole groups.

Batches are pytrees whose leaves have a leading row axis: the supervised trainers' dicts of
arrays, RL's typed ``LearnerBatch``.

A learner may train only part of its model (LoRA's adapters): the state then holds the
trainable part, and the frozen rest reaches the step as its own argument (never donated),
combined with it by the learner's ``combine`` before the loss sees the params.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from jaxrlhf.models import axes, moe
from jaxrlhf.sharding.micro_batches import split_micro
from jaxrlhf.sharding.rules import Rules, activation_sharding
from jaxrlhf.train.state import TrainState

Batch = Any  # a pytree of [B, ...] arrays: a dict for the supervised trainers
Metrics = dict[str, jax.Array]


class LossAux(NamedTuple):
    """What a loss returns beside its value.

    Attributes:
      metrics: flat dict of scalars with namespaced keys (``loss/...``, ``policy/...``).
      outputs: per-row results of the loss's forward that later computations read (RL: the
        old log-probs or values when the update's forward stands in for scoring's); None for
        most losses. Only with one micro-batch (they cannot be averaged over micro-batches).
    """

    metrics: Metrics
    outputs: Any = None


LossFn = Callable[[Any, Any, Batch], tuple[jax.Array, LossAux]]  # (module, params, batch)
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
      name: the algorithm (``"sft"``, ``"reward_model"``, ``"dpo"``, ``"ilql"``).
      role: sharding role of the trained model (``"policy"`` or ``"reward"``).
      head: model head, ``"lm"``, ``"scalar"`` or ``"ilql"``.
      data_kind: dataset kind, ``"sft"``, ``"preference"`` or ``"offline"``.
      loss_fn: mean loss and metrics (flat dict, namespaced keys) of a micro-batch.
      weight_fn: number of units the micro-batch's mean is over (0 for padding rows).
      primary: the main metric, shown in progress lines and plots.
      summary: metrics shown in progress lines.
      reference: a reference model, for losses that need one.
      row_group: rows that must stay together in a micro-batch (RL's packed prompt groups,
        chosen with the forward when the objective is built); 1 for independent rows.
      trainable: ``params -> bool tree``, the leaves the optimizer updates (the others get a
        zero update whatever their gradient, and no optimizer state); None: every leaf.
      after_update: ``(params, step) -> params`` applied after each optimizer update
        (``step``: updates before it), e.g. ILQL's Polyak-averaged target heads; None: none.
      export_lm: ``params -> params`` of the causal LM exported as ``*ForCausalLM`` (ILQL
        drops its heads); None: the params are exported with ``head``.
      export_extras: ``(hf_dir, params) -> None`` writes what ``export_lm`` leaves out
        beside the export (ILQL's heads); None: nothing.
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
    row_group: int = 1
    trainable: Callable[[Any], Any] | None = None
    after_update: Callable[[Any, jax.Array], Any] | None = None
    export_lm: Callable[[Any], Any] | None = None
    export_extras: Callable[[str, Any], None] | None = None


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int) -> NamedSharding:
    """Rows split like the ``batch`` activation axis, every other dim replicated."""
    return activation_sharding(mesh, rules, (axes.BATCH,) + (None,) * (ndim - 1))


@dataclasses.dataclass(frozen=True)
class Learner:
    """One trained model as the update sees it (static: closed over, never traced).

    Attributes:
      objective: loss and weight of a micro-batch.
      module: the model as the objective's loss applies it (its first argument): a Linen
        module (sharded under the train rules, or plain without a mesh), or for the RL
        learners a ``models.scoring.RolloutForward``.
      optimizer, lr_fn: its optax transform and schedule.
      rules: its train rule set (None without a mesh).
      grad_shardings: gradient (= param) shardings (None without a mesh).
      combine: ``(frozen, trainable, key) -> params`` for a learner that trains part of its
        model (``models.lora.LoraParams`` for LoRA; ``key``: this micro-batch's dropout
        key); None: the state's params are the whole model.
    """

    objective: Objective
    module: Any
    optimizer: optax.GradientTransformation
    lr_fn: optax.Schedule
    rules: Rules | None = None
    grad_shardings: Any = None
    combine: Callable[[Any, Any, jax.Array], Any] | None = None

    def model_params(self, params: Any, frozen: Any, key: jax.Array | None = None) -> Any:
        """The params the loss applies: ``params`` alone, or combined with ``frozen``."""
        if self.combine is None:
            return params
        return self.combine(frozen, params, key)


def _constrain(tree: Any, shardings: Any) -> Any:
    return tree if shardings is None else jax.lax.with_sharding_constraint(tree, shardings)


def _with_router_loss(learner: Learner, frozen: Any) -> Callable[..., Any]:
    """The learner's loss as a function of ``(trainable params, batch, dropout key)``, with
    the MoE hook (jaxrlhf/models/moe.py): ``loss_fn`` plus ``router_aux_loss_coef`` times the
    router's load-balancing loss, and router metrics (per-expert load); unchanged for dense
    models, whose forwards capture nothing."""
    loss_fn, module = learner.objective.loss_fn, learner.module

    def wrapped(params: Any, batch: Batch, key: jax.Array | None) -> tuple[jax.Array, LossAux]:
        with moe.capture_router_logits() as routed:
            loss, aux = loss_fn(module, learner.model_params(params, frozen, key), batch)
        loss, metrics = moe.add_router_loss(module.cfg, loss, aux.metrics, routed)
        return loss, aux._replace(metrics=metrics)

    return wrapped


def accumulate_gradients(
    learner: Learner,
    params: Any,
    batch: Batch,
    *,
    num_micro: int,
    mesh: Mesh | None,
    frozen: Any = None,
    key: jax.Array | None = None,
) -> tuple[Any, LossAux]:
    """Weighted-mean gradients and metrics over ``num_micro`` micro-batches of ``batch``.

    Gradients (of ``params``, the trainable part; ``frozen`` is the rest, see
    :class:`Learner`) are accumulated in float32 and kept in the params' shardings.
    Micro-batches take whole groups of ``learner.objective.row_group`` rows and each gets
    ``key`` folded with its index (dropout). The loss's per-row ``outputs`` come back with a
    single micro-batch only (None otherwise).
    """
    objective = learner.objective
    loss_fn = _with_router_loss(learner, frozen)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if num_micro == 1:
        (_, aux), grads = grad_fn(params, batch, key)
        return grads, aux
    micro = split_micro(batch, num_micro, mesh, learner.rules, objective.row_group)
    weights = jax.vmap(objective.weight_fn)(micro).astype(jnp.float32)  # [n]
    weights = weights / jnp.maximum(weights.sum(), 1.0)
    keys = (
        None
        if key is None
        else jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(num_micro))
    )

    def body(carry, xs):
        mb, w, k = xs
        (_, aux), grads = grad_fn(params, mb, k)
        grads = _constrain(grads, learner.grad_shardings)
        return jax.tree.map(
            lambda c, x: c + w * x.astype(jnp.float32), carry, (grads, aux.metrics)
        ), None

    abstract_metrics = jax.eval_shape(
        lambda p, b, k: loss_fn(p, b, k)[1].metrics,
        params,
        jax.tree.map(lambda x: x[0], micro),
        key,
    )
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), (params, abstract_metrics))
    zeros = (_constrain(zeros[0], learner.grad_shardings), zeros[1])
    (grads, metrics), _ = jax.lax.scan(body, zeros, (micro, weights, keys))
    return grads, LossAux(metrics)


def train_step(
    state: TrainState,
    batch: Batch,
    key: jax.Array,
    *,
    learner: Learner,
    num_micro: int,
    mesh: Mesh | None,
    frozen: Any = None,
) -> tuple[TrainState, Metrics, Any]:
    """One optimizer update on ``batch``: ``(state, batch, key) -> (state, metrics, outputs)``.

    ``key`` (folded with the state's step) drives LoRA's adapter dropout when the learner
    combines its params with ``frozen`` (:class:`Learner`); the models have no other
    randomness.
    Metrics add ``grad_norm`` (before clipping), ``lr`` (of this update) and ``skipped``
    (1.0 when the update was dropped because a ``loss/*`` metric, the gradient or the
    optimizer's update was not finite: the returned state then equals ``state``).
    ``outputs``: the loss's per-row outputs (:class:`LossAux`).
    """
    key = None if learner.combine is None else jax.random.fold_in(key, state.step)
    grads, aux = accumulate_gradients(
        learner, state.params, batch, num_micro=num_micro, mesh=mesh, frozen=frozen, key=key
    )
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm)
    for name, value in aux.metrics.items():
        if name.startswith("loss/"):
            finite = finite & jnp.all(jnp.isfinite(value))
    updates, opt_state = learner.optimizer.update(grads, state.opt_state, state.params)
    # Gradients are accumulated in float32; optax would then promote bf16 moments (with no
    # mu_dtype) to float32, changing the state's dtypes and recompiling the next step.
    opt_state = jax.tree.map(lambda new, old: new.astype(old.dtype), opt_state, state.opt_state)
    finite = finite & jnp.isfinite(optax.tree.norm(updates))  # e.g. a bad lr or epsilon
    params = optax.apply_updates(state.params, updates)
    if learner.objective.after_update is not None:
        params = learner.objective.after_update(params, state.step)
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
    # A non-finite loss or gradient leaves params, optimizer moments and the step
    # counter exactly as they were; the host counts the skips.
    new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state)
    metrics = dict(
        aux.metrics,
        grad_norm=grad_norm,
        lr=learner.lr_fn(state.step),
        skipped=(~finite).astype(jnp.float32),
    )
    return new_state, metrics, aux.outputs


def eval_step(
    params: Any, batch: Batch, *, objective: Objective, module: Any
) -> tuple[Metrics, jax.Array]:
    """``(metrics * weight, weight)`` of one batch; sum both over batches and divide.
    ``params``: the whole model's (a LoRA model's ``LoraParams`` without a dropout key)."""
    _, aux = objective.loss_fn(module, params, batch)
    weight = objective.weight_fn(batch).astype(jnp.float32)
    return jax.tree.map(lambda m: m * weight, aux.metrics), weight
