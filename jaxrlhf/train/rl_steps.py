"""Pure pieces of one RL iteration: the learners' losses, advantages, and the PPO-style update.

Arrays have the rollout layout of :mod:`jaxrlhf.train.rl_types` (``[N, T]``, per-token values
aligned to the token they score). The losses read a :class:`~jaxrlhf.train.rl_types.LearnerBatch`
and apply their model through a :class:`~jaxrlhf.models.scoring.RolloutForward`, which fixes
the prompt-group packing when the objective is built.

The update runs ``epochs x num_minibatches`` optimizer steps of every learner (policy, and the
critic for PPO) as two nested ``lax.scan``s in one jitted function (PureJaxRL's
``_update_epoch`` / ``_update_minbatch``); gradient accumulation over micro-batches happens
inside each step (``jaxrlhf.train.steps``).

When the update is a single optimizer step on a single micro-batch, its forward runs at the
params that sampled the rollout, so its log-probs *are* the old log-probs: scoring then skips
the separate old-policy forward (``rl_config.reuses_policy_forward``); likewise the critic's
update computes the values, GAE advantages and returns from its own forward instead of a
separate scoring forward (``rl_config.reuses_value_forward``). Those per-token results come
out of the losses as :class:`~jaxrlhf.train.rl_types.ForwardOutputs`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float

from jaxrlhf import losses
from jaxrlhf.models.scoring import RolloutForward
from jaxrlhf.sharding.micro_batches import split_micro
from jaxrlhf.train import steps
from jaxrlhf.train.rl_config import PolicyLossConfig
from jaxrlhf.train.rl_types import ForwardOutputs, LearnerBatch, UpdateOutput
from jaxrlhf.train.state import TrainState

Metrics = steps.Metrics


# ---- objectives ---------------------------------------------------------------------------


def _norm_constant(cfg: PolicyLossConfig, batch: LearnerBatch, max_new_tokens: int):
    if cfg.aggregation != "token_sum_norm":
        return None
    return batch.tokens.shape[0] * max_new_tokens


def policy_loss(
    cfg: PolicyLossConfig, forward: RolloutForward, params: Any, batch: LearnerBatch
) -> tuple[jax.Array, steps.LossAux]:
    """Clipped surrogate (+ KL loss term, - entropy bonus) on one micro-batch.

    With ``loss.rollout_correction`` the surrogate is decoupled PPO: clipped against the old
    (proximal) log-probs and weighted by the bounded importance weights ``pi_old / mu`` from
    ``batch.behaviour_logprobs`` (``is/*`` metrics), or clipped against the behaviour
    log-probs themselves (``proximal: behaviour``).

    Without ``batch.old_logprobs`` (``reuse_policy_forward``) the old log-probs are this
    forward's, under ``stop_gradient``; the metrics then also carry the rollout's KL
    (``kl/seq_mean``, ``kl/token_mean``, which scoring reports otherwise) and the outputs the
    per-token log-probs.
    """
    logp, entropy = forward.logprobs(params, batch.tokens, batch.mask, batch.packing)
    resp = batch.response_mask
    norm = _norm_constant(cfg, batch, forward.max_new_tokens)
    reused = batch.old_logprobs is None
    old = jax.lax.stop_gradient(logp) if reused else batch.old_logprobs
    rc = cfg.rollout_correction
    proximal = batch.behaviour_logprobs if rc.proximal == "behaviour" else old
    weights, is_metrics = None, {}
    if rc.weights != "none":
        weights, is_metrics = losses.importance_weights(
            old,
            batch.behaviour_logprobs,
            resp,
            mode=rc.weights,
            level=rc.level,
            cap=rc.cap,
            floor=rc.floor,
        )
    loss, m = losses.ppo_policy_loss(
        logp,
        proximal,
        batch.advantages,
        resp,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        dual_clip=cfg.dual_clip,
        token_weights=weights,
        aggregation=cfg.aggregation,
        norm_constant=norm,
    )
    metrics = {f"is/{k}": v for k, v in is_metrics.items()}
    metrics |= {
        "loss/policy": loss,
        "policy/clip_frac": m["clip_frac"],
        "policy/approx_kl": m["approx_kl"],
        "policy/ratio_mean": m["ratio_mean"],
        "policy/ratio_max": m["ratio_max"],
        "policy/entropy": losses.masked_mean(entropy, resp),
    }
    outputs = None
    if reused:
        kl = losses.kl_penalty(old, batch.ref_logprobs, resp, estimator=cfg.kl_estimator)
        metrics.update(_kl_metrics(kl, resp))
        outputs = ForwardOutputs(old_logprobs=old)
    if cfg.kl_mode == "loss":
        kl, _ = losses.kl_loss(
            logp,
            batch.ref_logprobs,
            resp,
            estimator=cfg.kl_estimator,
            aggregation=cfg.aggregation,
            norm_constant=norm,
        )
        loss = loss + batch.kl_coef.mean() * kl
        metrics["kl/loss_term"] = kl
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * metrics["policy/entropy"]
    metrics["loss/total_policy"] = loss
    return loss, steps.LossAux(metrics, outputs)


@dataclasses.dataclass(frozen=True)
class GaeConfig:
    """GAE settings for a critic whose update computes the advantages (static)."""

    gamma: float
    lam: float
    whiten: bool


def value_loss(
    clip_range: float | None,
    aggregation: str,
    gae: GaeConfig | None,
    forward: RolloutForward,
    params: Any,
    batch: LearnerBatch,
) -> tuple[jax.Array, steps.LossAux]:
    """Squared error of the critic against the GAE returns (optionally value-clipped).

    Without ``batch.old_values`` (``reuse_value_forward``) the old values are this forward's,
    under ``stop_gradient``, and GAE (``gae``) runs here on ``batch.token_rewards``; the
    outputs then carry the per-token old values, returns and advantages (for the policy's
    update) and the metrics the scalars scoring reports otherwise.
    """
    resp = batch.response_mask
    values = forward.values(params, batch.tokens, batch.mask, batch.packing)
    extra: Metrics = {}
    outputs = None
    if batch.old_values is not None:
        old, returns = batch.old_values, batch.returns
    else:
        if gae is None:
            raise ValueError("a batch without old_values needs the GAE settings")
        old = jax.lax.stop_gradient(values)
        adv, returns = gae_and_whiten(
            batch.token_rewards, old, resp, gamma=gae.gamma, lam=gae.lam, whiten=gae.whiten
        )
        outputs = ForwardOutputs(old_values=old, returns=returns, advantages=adv)
        extra = value_metrics(adv, returns, old, resp)
    if aggregation == "token_sum_norm":  # value regression is a per-token mean in every variant
        aggregation = "token_mean"
    loss, m = losses.ppo_value_loss(
        values, old, returns, resp, clip_range=clip_range, aggregation=aggregation
    )
    metrics = {"loss/value": loss, "value/mean": m["value_mean"], "value/error": m["value_error"]}
    return loss, steps.LossAux({**metrics, **extra}, outputs)


def value_metrics(
    adv: Float[Array, "N T"],
    returns: Float[Array, "N T"],
    values: Float[Array, "N T"],
    mask: Bool[Array, "N T"],
) -> Metrics:
    """``value/explained_var`` (1 - Var[returns - values] / Var[returns] over ``mask``) and
    ``advantages/abs_mean``."""
    explained = 1 - losses.masked_var(returns - values, mask) / jnp.maximum(
        losses.masked_var(returns, mask), 1e-8
    )
    return {
        "value/explained_var": explained,
        "advantages/abs_mean": losses.masked_mean(jnp.abs(adv), mask),
    }


def _weight(aggregation: str, batch: LearnerBatch) -> jax.Array:
    resp = batch.response_mask
    if aggregation == "token_mean":
        return resp.sum()
    if aggregation == "token_sum_norm":
        return jnp.asarray(resp.shape[0])
    return resp.any(-1).sum()


def policy_objective(cfg: PolicyLossConfig, row_group: int = 1) -> steps.Objective:
    """The policy's objective. Its learner's ``module`` is the policy's RolloutForward, whose
    ``group_size`` must be ``row_group`` (micro-batches then keep packed groups whole)."""
    return steps.Objective(
        name="policy",
        role="policy",
        head="lm",
        data_kind="prompt",
        loss_fn=functools.partial(policy_loss, cfg),
        weight_fn=functools.partial(_weight, cfg.aggregation),
        primary="loss/policy",
        summary=("loss/policy",),
        row_group=row_group,
    )


def value_objective(
    clip_range: float | None,
    aggregation: str,
    row_group: int = 1,
    gae: GaeConfig | None = None,
) -> steps.Objective:
    """The critic's objective (its learner's ``module``: the critic's RolloutForward, as for
    :func:`policy_objective`). Value regression is a per-token mean in every aggregation but
    the sequence ones."""
    agg = "token_mean" if aggregation == "token_sum_norm" else aggregation
    return steps.Objective(
        name="value",
        role="value",
        head="scalar",
        data_kind="prompt",
        loss_fn=functools.partial(value_loss, clip_range, agg, gae),
        weight_fn=functools.partial(_weight, agg),
        primary="loss/value",
        summary=("loss/value",),
        row_group=row_group,
    )


# ---- advantages ---------------------------------------------------------------------------


def _rollout_kl(
    old_logprobs: Float[Array, "N T"] | None,
    ref_logprobs: Float[Array, "N T"],
    response_mask: Bool[Array, "N T"],
    loss_cfg: PolicyLossConfig,
) -> tuple[Float[Array, "N T"], Metrics]:
    """Per-token KL penalty of the rollout and its metrics; zeros and no metrics when the old
    log-probs come from the update instead (only allowed when the KL is not in the reward)."""
    if old_logprobs is None:
        if loss_cfg.kl_mode == "reward":
            raise ValueError("kl_mode 'reward' needs the old log-probs before the update")
        return jnp.zeros_like(ref_logprobs), {}
    kl = losses.kl_penalty(
        old_logprobs, ref_logprobs, response_mask, estimator=loss_cfg.kl_estimator
    )
    return kl, _kl_metrics(kl, response_mask)


def ppo_token_rewards(
    scores: Float[Array, " N"],
    old_logprobs: Float[Array, "N T"] | None,
    ref_logprobs: Float[Array, "N T"],
    response_mask: Bool[Array, "N T"],
    kl_coef: Float[Array, ""],
    *,
    loss_cfg: PolicyLossConfig,
    turn_rewards: Float[Array, "N T"] | None = None,
) -> tuple[Float[Array, "N T"], Metrics]:
    """Per-token PPO rewards (Ziegler et al. 2019): ``r_t = -beta * kl_t`` on every response
    token (with ``kl_mode: reward``), plus the score on the last one; and the KL metrics.

    ``turn_rewards`` (multi-turn episodes' per-turn rewards, each at its turn's last model
    token) are part of the scores: they are paid where they sit and the rest of each score,
    ``scores - turn_rewards.sum(-1)``, on the last token, so a row's rewards sum to its score
    (minus the KL) either way. ``old_logprobs`` may be None with ``kl_mode: loss``
    (:func:`reuses_policy_forward`); the KL metrics then come from the update."""
    kl, metrics = _rollout_kl(old_logprobs, ref_logprobs, response_mask, loss_cfg)
    beta = kl_coef if loss_cfg.kl_mode == "reward" else 0.0
    if turn_rewards is None:
        return losses.token_rewards(scores, kl, response_mask, kl_coef=beta), metrics
    paid = jnp.where(response_mask, turn_rewards, 0.0)
    rest = scores - paid.sum(axis=-1)
    return losses.token_rewards(rest, kl, response_mask, kl_coef=beta) + paid, metrics


def gae_and_whiten(
    rewards: Float[Array, "N T"],
    values: Float[Array, "N T"],
    response_mask: Bool[Array, "N T"],
    *,
    gamma: float,
    lam: float,
    whiten: bool,
) -> tuple[Float[Array, "N T"], Float[Array, "N T"]]:
    """``(advantages, returns)``: GAE, advantages whitened over the response tokens when
    ``whiten``; the returns are not whitened."""
    advantages, returns = losses.gae_advantages(
        rewards, values, response_mask, gamma=gamma, lam=lam
    )
    if whiten:
        advantages = losses.masked_whiten(advantages, response_mask)
    return advantages, returns


def ppo_advantages(
    scores: Float[Array, " N"],
    old_logprobs: Float[Array, "N T"] | None,
    ref_logprobs: Float[Array, "N T"],
    values: Float[Array, "N T"],
    response_mask: Bool[Array, "N T"],
    kl_coef: Float[Array, ""],
    *,
    loss_cfg: PolicyLossConfig,
    gamma: float,
    lam: float,
    whiten: bool,
    turn_rewards: Float[Array, "N T"] | None = None,
) -> tuple[Float[Array, "N T"], Float[Array, "N T"], Metrics]:
    """GAE advantages and returns from :func:`ppo_token_rewards`.

    Returns ``(advantages, returns, metrics)``; ``metrics["kl/seq_mean"]`` is the mean over
    rows of the summed per-token KL (what the adaptive controller tracks). ``old_logprobs``
    may be None with ``kl_mode: loss``, and ``turn_rewards`` as there."""
    rewards, metrics = ppo_token_rewards(
        scores,
        old_logprobs,
        ref_logprobs,
        response_mask,
        kl_coef,
        loss_cfg=loss_cfg,
        turn_rewards=turn_rewards,
    )
    advantages, returns = gae_and_whiten(
        rewards, values, response_mask, gamma=gamma, lam=lam, whiten=whiten
    )
    return advantages, returns, metrics


def grpo_advantages(
    scores: Float[Array, " N"],
    old_logprobs: Float[Array, "N T"] | None,
    ref_logprobs: Float[Array, "N T"],
    response_mask: Bool[Array, "N T"],
    kl_coef: Float[Array, ""],
    *,
    loss_cfg: PolicyLossConfig,
    advantage: str,
    group_size: int,
) -> tuple[Float[Array, "N T"], Metrics]:
    """Critic-free advantages of the GRPO family, broadcast over response tokens.

    ``grpo``: (s - mean_g) / std_g; ``dr_grpo``: s - mean_g; ``rloo``: s - mean of the
    other n-1; ``reinforce_pp``: per-token returns of ``r_t`` (score at the last token, minus
    ``beta * kl_t`` when the KL is in the reward), whitened over the whole batch.
    With ``kl_mode: reward`` the group methods subtract the summed KL from each score first.
    ``old_logprobs`` may be None with ``kl_mode: loss``, as for :func:`ppo_advantages`.
    """
    kl, metrics = _rollout_kl(old_logprobs, ref_logprobs, response_mask, loss_cfg)
    beta = kl_coef if loss_cfg.kl_mode == "reward" else 0.0
    if advantage == "reinforce_pp":
        rewards = losses.token_rewards(scores, kl, response_mask, kl_coef=beta)
        adv, _ = losses.reinforce_pp_advantages(rewards, response_mask)
        return adv, metrics
    shaped = scores - beta * kl.sum(-1)
    fn = {
        "grpo": losses.grpo_advantages,
        "dr_grpo": losses.dr_grpo_advantages,
        "rloo": losses.rloo_advantages,
    }[advantage]
    per_seq = fn(shaped, group_size=group_size)
    return losses.broadcast_sequence_advantages(per_seq, response_mask), metrics


def _kl_metrics(kl: Float[Array, "N T"], mask: Bool[Array, "N T"]) -> Metrics:
    return {"kl/seq_mean": kl.sum(-1).mean(), "kl/token_mean": losses.masked_mean(kl, mask)}


# ---- the update ---------------------------------------------------------------------------


def _prefixed(role: str, metrics: Metrics) -> Metrics:
    """A learner's metrics under its role's namespace (the policy's unprefixed)."""
    prefix = "" if role == "policy" else f"{role}/"
    return {
        (k if k.startswith(("loss/", "value/", "advantages/")) else prefix + k): v
        for k, v in metrics.items()
    }


def epoch_row_order(key: jax.Array, rows: int, group_size: int) -> jax.Array:
    """[rows] the order an epoch of several minibatches visits the rows: a permutation of
    whole groups of ``group_size`` consecutive rows. The host plan of a packed update
    (``train.rl_packing``) evaluates the same function on the same keys."""
    perm = jax.random.permutation(key, rows // group_size)
    return (perm[:, None] * group_size + jnp.arange(group_size)).reshape(rows)


def rl_update(
    states: tuple[TrainState, ...],
    batch: LearnerBatch,
    key: jax.Array,
    frozen: tuple[Any, ...] | None = None,
    packed_rows: int | None = None,
    *,
    learners: tuple[steps.Learner, ...],
    epochs: int,
    num_minibatches: int,
    num_micro: int,
    mesh: Mesh | None,
) -> tuple[tuple[TrainState, ...], UpdateOutput]:
    """``epochs`` passes of ``num_minibatches`` shuffled minibatch updates of every learner.

    Args:
      states: one TrainState per learner (donate them).
      batch: the rollout's ``[N, ...]`` rows with their scores; with ``packing`` ([N, E]),
        epoch ``e``'s minibatches carry column ``e`` of it.
      key: shuffling key (and LoRA dropout's).
      frozen: each learner's frozen base (LoRA; see ``steps.Learner.combine``) or None, in
        the order of ``states``; None: no learner has one.
      packed_rows: with sequence packing (the learners' forwards pack, ``batch.packing``
        set), the packed rows per shard of every micro-batch (static: one compile per
        size); None otherwise.
      learners: static description of each learner, matching ``states``; their objectives'
        ``row_group`` (the packing of prompt groups) must agree: shuffling permutes whole
        groups and micro-batches take whole groups.
      epochs, num_minibatches: PPO's inner loop; ``N`` must divide into the minibatches.
      num_micro: gradient-accumulation micro-batches per minibatch.
      mesh: the training mesh (None: one device, no sharding constraints).

    Returns:
      New states and an :class:`UpdateOutput`: metrics are the mean over all minibatches
      (``skipped``: the number of updates dropped for a non-finite loss or gradient), plus
      ``first/<key>`` from the first minibatch of the first epoch (its policy ratio is exactly
      1: same params, same forward as the one that produced ``old_logprobs``); outputs are
      the per-token results the update's forwards computed for a batch without them.
    """
    missing = [k for k in ("old_logprobs", "advantages") if getattr(batch, k) is None]
    if missing and not epochs == num_minibatches == num_micro == 1:
        raise ValueError(
            f"a batch without {' and '.join(missing)} needs a single update on a single "
            f"micro-batch, got {epochs} epoch(s) x {num_minibatches} minibatch(es) x "
            f"{num_micro} micro-batch(es)"
        )
    if (packed_rows is None) != (batch.packing is None):
        raise ValueError("a packed update needs both the batch's packing plan and packed_rows")
    group_sizes = {learner.objective.row_group for learner in learners}
    if len(group_sizes) > 1:
        raise ValueError(f"the learners pack prompt groups differently: {sorted(group_sizes)}")
    group_size = group_sizes.pop()
    rules = learners[0].rules
    frozen = (None,) * len(learners) if frozen is None else frozen
    learners = tuple(
        dataclasses.replace(learner, module=learner.module.with_packed_rows(packed_rows))
        for learner in learners
    )
    # The critic first: without scored advantages, its loss computes them for the policy
    # (what the batch lacks joins the batch of the learners after).
    order = sorted(range(len(learners)), key=lambda i: learners[i].objective.role != "value")

    def minibatch_step(states, minibatch):
        new_states, metrics, produced = list(states), {}, ForwardOutputs()
        for i in order:
            learner = learners[i]
            new_states[i], m, outputs = steps.train_step(
                states[i],
                minibatch,
                key,
                learner=learner,
                num_micro=num_micro,
                mesh=mesh,
                frozen=frozen[i],
            )
            if outputs is not None:
                minibatch = outputs.fill(minibatch)
                produced = produced.merge(outputs)
            metrics.update(_prefixed(learner.objective.role, m))
        return tuple(new_states), (metrics, produced)

    def epoch(states, xs):
        epoch_key, index = xs
        rows = batch
        if batch.packing is not None:  # this epoch's plan
            rows = batch.replace(packing=jax.tree.map(lambda x: x[:, index], batch.packing))
        if num_minibatches > 1:
            perm = epoch_row_order(epoch_key, rows.tokens.shape[0], group_size)
            shuffled = jax.tree.map(lambda x: x[perm], rows)
            minibatches = split_micro(shuffled, num_minibatches, mesh, rules, group_size)
        else:  # one minibatch: no shuffle needed, keep the rollout's row order
            minibatches = jax.tree.map(lambda x: x[None], rows)
        return jax.lax.scan(minibatch_step, states, minibatches)

    xs = (jax.random.split(key, epochs), jnp.arange(epochs))
    states, (metrics, produced) = jax.lax.scan(epoch, states, xs)
    outputs = jax.tree.map(lambda x: x[0, 0], produced)
    out = {k: v.sum() if k.endswith("skipped") else v.mean() for k, v in metrics.items()}
    for k in ("policy/ratio_mean", "policy/ratio_max", "policy/approx_kl", "policy/clip_frac"):
        if k in metrics:
            out[f"first/{k}"] = metrics[k][0, 0]
    return states, UpdateOutput(metrics=out, outputs=outputs)
