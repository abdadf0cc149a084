"""Pure pieces of one RL iteration: scoring forwards, advantages, and the PPO-style update.

Rollout arrays share one layout, ``[N, T]`` with ``N`` rollout rows and ``T = P + R`` (the
left-padded prompt, then the right-padded response). Per-token quantities are *aligned to the
token they score*: ``x[:, t]`` belongs to token ``t`` (its log-prob given tokens ``< t``, or the
value of the state that produced it), so a response token's entries sit at its own index and
``response_mask`` selects them. Column 0 is never a response token and holds 0.

The update runs ``epochs x num_minibatches`` optimizer steps of every learner (policy, and the
critic for PPO) as two nested ``lax.scan``s in one jitted function (PureJaxRL's
``_update_epoch`` / ``_update_minbatch``); gradient accumulation over micro-batches happens
inside each step (``jaxrlhf.train.steps``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf import losses
from jaxrlhf.models import model as model_lib
from jaxrlhf.sharding.rules import Rules
from jaxrlhf.train import steps
from jaxrlhf.train.rl_config import PolicyLossConfig
from jaxrlhf.train.state import TrainState

Batch = steps.Batch
Metrics = steps.Metrics


def _align(x: Float[Array, "N T1"]) -> Float[Array, "N T"]:
    """Per-position outputs that predict the *next* token, moved onto that token."""
    return jnp.pad(x, ((0, 0), (1, 0)))


def aligned_logprobs(
    module: Any, params: Any, tokens: Int[Array, "N T"], mask: Bool[Array, "N T"]
) -> tuple[Float[Array, "N T"], Float[Array, "N T"]]:
    """``(logprobs, entropy)``: log pi(token_t | tokens_<t) and the entropy of that
    distribution, at index t (0 at t = 0). float32."""
    logits = model_lib.forward(module, params, tokens, mask)[:, :-1]
    logp = losses.token_logprobs(logits, tokens[:, 1:])
    return _align(logp), _align(losses.entropy_from_logits(logits))


def aligned_values(
    module: Any, params: Any, tokens: Int[Array, "N T"], mask: Bool[Array, "N T"]
) -> Float[Array, "N T"]:
    """V(state before token t) at index t, from a scalar-head model."""
    return _align(model_lib.forward(module, params, tokens, mask)[:, :-1])


def sequence_scores(
    module: Any, params: Any, tokens: Int[Array, "N T"], mask: Bool[Array, "N T"]
) -> Float[Array, " N"]:
    """Reward-model score of each row: the scalar head at its last real token."""
    return model_lib.last_token_values(model_lib.forward(module, params, tokens, mask), mask)


# ---- objectives ---------------------------------------------------------------------------


def _norm_constant(cfg: PolicyLossConfig, batch: Batch, max_new_tokens: int) -> float | None:
    if cfg.aggregation != "token_sum_norm":
        return None
    return batch["tokens"].shape[0] * max_new_tokens


def policy_loss(
    cfg: PolicyLossConfig,
    max_new_tokens: int,
    module: Any,
    params: Any,
    batch: Batch,
) -> tuple[jax.Array, Metrics]:
    """Clipped surrogate (+ KL loss term, - entropy bonus) on one micro-batch."""
    logp, entropy = aligned_logprobs(module, params, batch["tokens"], batch["mask"])
    resp = batch["response_mask"]
    norm = _norm_constant(cfg, batch, max_new_tokens)
    loss, m = losses.ppo_policy_loss(
        logp,
        batch["old_logprobs"],
        batch["advantages"],
        resp,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        dual_clip=cfg.dual_clip,
        aggregation=cfg.aggregation,
        norm_constant=norm,
    )
    metrics = {
        "loss/policy": loss,
        "policy/clip_frac": m["clip_frac"],
        "policy/approx_kl": m["approx_kl"],
        "policy/ratio_mean": m["ratio_mean"],
        "policy/ratio_max": m["ratio_max"],
        "policy/entropy": losses.masked_mean(entropy, resp),
    }
    if cfg.kl_mode == "loss":
        kl, _ = losses.kl_loss(
            logp,
            batch["ref_logprobs"],
            resp,
            estimator=cfg.kl_estimator,
            aggregation=cfg.aggregation,
            norm_constant=norm,
        )
        loss = loss + batch["kl_coef"].mean() * kl  # [N] copies of beta: rows split cleanly
        metrics["kl/loss_term"] = kl
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * metrics["policy/entropy"]
    metrics["loss/total_policy"] = loss
    return loss, metrics


def value_loss(
    clip_range: float | None, aggregation: str, module: Any, params: Any, batch: Batch
) -> tuple[jax.Array, Metrics]:
    """Squared error of the critic against the GAE returns (optionally value-clipped)."""
    values = aligned_values(module, params, batch["tokens"], batch["mask"])
    if aggregation == "token_sum_norm":  # value regression is a per-token mean in every variant
        aggregation = "token_mean"
    loss, m = losses.ppo_value_loss(
        values,
        batch["old_values"],
        batch["returns"],
        batch["response_mask"],
        clip_range=clip_range,
        aggregation=aggregation,
    )
    return loss, {
        "loss/value": loss,
        "value/mean": m["value_mean"],
        "value/error": m["value_error"],
    }


def _weight(aggregation: str, batch: Batch) -> jax.Array:
    resp = batch["response_mask"]
    if aggregation == "token_mean":
        return resp.sum()
    if aggregation == "token_sum_norm":
        return jnp.asarray(resp.shape[0])
    return resp.any(-1).sum()


def policy_objective(cfg: PolicyLossConfig, max_new_tokens: int) -> steps.Objective:
    return steps.Objective(
        name="policy",
        role="policy",
        head="lm",
        data_kind="prompt",
        loss_fn=functools.partial(policy_loss, cfg, max_new_tokens),
        weight_fn=functools.partial(_weight, cfg.aggregation),
        primary="loss/policy",
        summary=("loss/policy",),
    )


def value_objective(clip_range: float | None, aggregation: str) -> steps.Objective:
    agg = "token_mean" if aggregation == "token_sum_norm" else aggregation
    return steps.Objective(
        name="value",
        role="value",
        head="scalar",
        data_kind="prompt",
        loss_fn=functools.partial(value_loss, clip_range, agg),
        weight_fn=functools.partial(_weight, agg),
        primary="loss/value",
        summary=("loss/value",),
    )


# ---- advantages ---------------------------------------------------------------------------


def ppo_advantages(
    scores: Float[Array, " N"],
    old_logprobs: Float[Array, "N T"],
    ref_logprobs: Float[Array, "N T"],
    values: Float[Array, "N T"],
    response_mask: Bool[Array, "N T"],
    kl_coef: Float[Array, ""],
    *,
    loss_cfg: PolicyLossConfig,
    gamma: float,
    lam: float,
    whiten: bool,
) -> tuple[Float[Array, "N T"], Float[Array, "N T"], Metrics]:
    """GAE advantages and returns from per-token rewards (Ziegler et al. 2019):
    ``r_t = -beta * kl_t`` on every response token, plus the score on the last one.

    Returns ``(advantages, returns, metrics)``; ``metrics["kl/seq_mean"]`` is the mean over
    rows of the summed per-token KL (what the adaptive controller tracks)."""
    kl = losses.kl_penalty(
        old_logprobs, ref_logprobs, response_mask, estimator=loss_cfg.kl_estimator
    )
    beta = kl_coef if loss_cfg.kl_mode == "reward" else 0.0
    rewards = losses.token_rewards(scores, kl, response_mask, kl_coef=beta)
    advantages, returns = losses.gae_advantages(
        rewards, values, response_mask, gamma=gamma, lam=lam
    )
    if whiten:
        advantages = losses.masked_whiten(advantages, response_mask)
    return advantages, returns, _kl_metrics(kl, response_mask)


def grpo_advantages(
    scores: Float[Array, " N"],
    old_logprobs: Float[Array, "N T"],
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
    """
    kl = losses.kl_penalty(
        old_logprobs, ref_logprobs, response_mask, estimator=loss_cfg.kl_estimator
    )
    beta = kl_coef if loss_cfg.kl_mode == "reward" else 0.0
    if advantage == "reinforce_pp":
        rewards = losses.token_rewards(scores, kl, response_mask, kl_coef=beta)
        adv, _ = losses.reinforce_pp_advantages(rewards, response_mask)
        return adv, _kl_metrics(kl, response_mask)
    shaped = scores - beta * kl.sum(-1)
    fn = {
        "grpo": losses.grpo_advantages,
        "dr_grpo": losses.dr_grpo_advantages,
        "rloo": losses.rloo_advantages,
    }[advantage]
    per_seq = fn(shaped, group_size=group_size)
    return losses.broadcast_sequence_advantages(per_seq, response_mask), _kl_metrics(
        kl, response_mask
    )


def _kl_metrics(kl: Float[Array, "N T"], mask: Bool[Array, "N T"]) -> Metrics:
    return {"kl/seq_mean": kl.sum(-1).mean(), "kl/token_mean": losses.masked_mean(kl, mask)}


# ---- the update ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Learner:
    """One trained model inside the RL update (static: closed over, never traced).

    Attributes:
      objective: loss and weight of a micro-batch.
      module: the sharded Linen module (train rules).
      optimizer, lr_fn: its optax transform and schedule.
      rules: its train rule set.
      grad_shardings: gradient (= param) shardings.
    """

    objective: steps.Objective
    module: Any
    optimizer: optax.GradientTransformation
    lr_fn: optax.Schedule
    rules: Rules
    grad_shardings: Any


def rl_update(
    states: tuple[TrainState, ...],
    rollout: Batch,
    key: jax.Array,
    *,
    learners: tuple[Learner, ...],
    epochs: int,
    num_minibatches: int,
    num_micro: int,
    mesh: Mesh,
) -> tuple[tuple[TrainState, ...], Metrics]:
    """``epochs`` passes of ``num_minibatches`` shuffled minibatch updates of every learner.

    Args:
      states: one TrainState per learner (donate them).
      rollout: ``[N, ...]`` arrays every objective reads (see the module docstring).
      key: shuffling key.
      learners: static description of each learner, matching ``states``.
      epochs, num_minibatches: PPO's inner loop; ``N`` must divide into the minibatches.
      num_micro: gradient-accumulation micro-batches per minibatch.
      mesh: the mesh.

    Returns:
      New states and metrics: the mean over all minibatches (``skipped``: the number of
      updates dropped for a non-finite loss or gradient), plus ``first/<key>`` from the
      first minibatch of the first epoch (its policy ratio is exactly 1: same params, same
      forward as the one that produced ``old_logprobs``).
    """
    rules = learners[0].rules

    def minibatch_step(states, batch):
        new_states, metrics = [], {}
        for state, learner in zip(states, learners, strict=True):
            state, m = steps.train_step(
                state,
                batch,
                key,
                objective=learner.objective,
                module=learner.module,
                optimizer=learner.optimizer,
                lr_fn=learner.lr_fn,
                num_micro=num_micro,
                mesh=mesh,
                rules=learner.rules,
                grad_shardings=learner.grad_shardings,
            )
            new_states.append(state)
            prefix = "" if learner.objective.role == "policy" else f"{learner.objective.role}/"
            metrics.update(
                {(k if k.startswith(("loss/", "value/")) else prefix + k): v for k, v in m.items()}
            )
        return tuple(new_states), metrics

    def epoch(states, epoch_key):
        if num_minibatches > 1:
            perm = jax.random.permutation(epoch_key, rollout["tokens"].shape[0])
            shuffled = jax.tree.map(lambda x: x[perm], rollout)
            minibatches = steps.split_micro(shuffled, num_minibatches, mesh, rules)
        else:  # one minibatch: no shuffle needed, keep the rollout's row order
            minibatches = jax.tree.map(lambda x: x[None], rollout)
        return jax.lax.scan(minibatch_step, states, minibatches)

    states, metrics = jax.lax.scan(epoch, states, jax.random.split(key, epochs))
    out = {k: v.sum() if k.endswith("skipped") else v.mean() for k, v in metrics.items()}
    for k in ("policy/ratio_mean", "policy/ratio_max", "policy/approx_kl", "policy/clip_frac"):
        if k in metrics:
            out[f"first/{k}"] = metrics[k][0, 0]
    return states, out
