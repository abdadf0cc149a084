"""Pure pieces of one RL iteration: scoring forwards, advantages, and the PPO-style update.

Rollout arrays share one layout, ``[N, T]`` with ``N`` rollout rows and ``T = P + R`` (the
left-padded prompt, then the right-padded response). Per-token quantities are *aligned to the
token they score*: ``x[:, t]`` belongs to token ``t`` (its log-prob given tokens ``< t``, or the
value of the state that produced it), so a response token's entries sit at its own index and
``response_mask`` selects them. Column 0 is never a response token and holds 0; log-probs
are computed for the response columns only (``t >= P``) and hold 0 in the prompt's.

The update runs ``epochs x num_minibatches`` optimizer steps of every learner (policy, and the
critic for PPO) as two nested ``lax.scan``s in one jitted function (PureJaxRL's
``_update_epoch`` / ``_update_minbatch``); gradient accumulation over micro-batches happens
inside each step (``jaxrlhf.train.steps``).

When the update is a single optimizer step on a single micro-batch, its forward runs at the
params that sampled the rollout, so its log-probs *are* the old log-probs: scoring then skips
the separate old-policy forward (see :func:`reuses_policy_forward`); likewise the critic's
update computes the values, GAE advantages and returns from its own forward instead of a
separate scoring forward (see :func:`reuses_value_forward`).

With ``group_size = n > 1`` every forward packs each group of ``n`` consecutive rows (one
prompt, ``n`` responses) into one row, so the prompt runs through the model once
(:mod:`jaxrlhf.models.shared_prefix`); outputs come back in the ``[N, T]`` layout above.
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
from jaxrlhf.losses.common import token_logprobs_and_entropy
from jaxrlhf.models import model as model_lib
from jaxrlhf.models import shared_prefix
from jaxrlhf.sharding.rules import Rules
from jaxrlhf.train import steps
from jaxrlhf.train.rl_config import PolicyLossConfig
from jaxrlhf.train.state import TrainState

Batch = steps.Batch
Metrics = steps.Metrics

# Loss outputs that are per-token arrays, not scalar metrics: rl_update hands them to the
# learners after it and returns them (the name after the prefix).
PER_TOKEN = "per_token/"
LOGPROBS_KEY = PER_TOKEN + "old_logprobs"


def _align(x: Float[Array, "N T1"]) -> Float[Array, "N T"]:
    """Per-position outputs that predict the *next* token, moved onto that token."""
    return jnp.pad(x, ((0, 0), (1, 0)))


def aligned_logprobs(
    module: Any,
    params: Any,
    tokens: Int[Array, "N T"],
    mask: Bool[Array, "N T"],
    start: int = 1,
    group_size: int = 1,
) -> tuple[Float[Array, "N T"], Float[Array, "N T"]]:
    """``(logprobs, entropy)``: log pi(token_t | tokens_<t) and the entropy of that
    distribution, at index t for ``t >= start`` (0 before). float32.

    ``start = P`` (the prompt length) scores the response alone, all that the RL losses read:
    the LM head and the log-softmax then run on R + 1 positions instead of P + R.
    ``group_size > 1`` packs groups sharing a prompt (module docstring; needs ``start = P``).
    """
    if group_size > 1:
        packed = _pack(module, tokens, mask, start, group_size)
        select = functools.partial(shared_prefix.response_inputs, mask=packed.mask)
        logits = model_lib.forward_packed(module, params, packed, select)  # [N, R, V]
        logp, entropy = token_logprobs_and_entropy(logits, tokens[:, start:])
        return _pad_front(logp, start), _pad_front(entropy, start)
    # Position t - 1 predicts token t, so the head runs on positions start - 1 .. T - 1, each
    # scored against the token after it (the last against a dummy, dropped below); slicing
    # the logits instead would copy the whole [N, T', V] array.
    logits = model_lib.forward(module, params, tokens, mask, head_from=start - 1)
    targets = jnp.roll(tokens, -1, axis=1)[:, start - 1 :]
    logp, entropy = token_logprobs_and_entropy(logits, targets)
    return _pad_front(logp[:, :-1], start), _pad_front(entropy[:, :-1], start)


def _pad_front(x: Float[Array, "N R"], start: int) -> Float[Array, "N T"]:
    return jnp.pad(x, ((0, 0), (start, 0)))


def _pack(
    module: Any, tokens: Int[Array, "N T"], mask: Bool[Array, "N T"], start: int, group_size: int
) -> shared_prefix.PackedGroups:
    return shared_prefix.pack_groups(tokens, mask, start, group_size, module.cfg.sliding_window)


def response_start(tokens: Int[Array, "N T"], max_new_tokens: int) -> int:
    """P, the index of the first response slot (the rollout layout is ``[prompt P | R]``)."""
    return max(1, tokens.shape[1] - max_new_tokens)


def aligned_values(
    module: Any,
    params: Any,
    tokens: Int[Array, "N T"],
    mask: Bool[Array, "N T"],
    start: int = 1,
    group_size: int = 1,
) -> Float[Array, "N T"]:
    """V(state before token t) at index t, from a scalar-head model.

    Every index from 1 with ``group_size = 1``; with packed groups (``group_size > 1``,
    ``start = P``) the response's indices ``t >= P`` only (0 before), all that GAE and the
    value loss read.
    """
    if group_size > 1:
        packed = _pack(module, tokens, mask, start, group_size)
        select = functools.partial(shared_prefix.response_inputs, mask=packed.mask)
        return _pad_front(model_lib.forward_packed(module, params, packed, select), start)
    return _align(model_lib.forward(module, params, tokens, mask)[:, :-1])


def sequence_scores(
    module: Any,
    params: Any,
    tokens: Int[Array, "N T"],
    mask: Bool[Array, "N T"],
    start: int = 1,
    group_size: int = 1,
) -> Float[Array, " N"]:
    """Reward-model score of each row: the scalar head at its last real token (packed
    groups as for :func:`aligned_values`)."""
    if group_size > 1:
        packed = _pack(module, tokens, mask, start, group_size)
        select = functools.partial(shared_prefix.last_token_inputs, packed=packed)
        return model_lib.forward_packed(module, params, packed, select)[:, 0]
    return model_lib.last_token_values(model_lib.forward(module, params, tokens, mask), mask)


# ---- objectives ---------------------------------------------------------------------------


def _norm_constant(cfg: PolicyLossConfig, batch: Batch, max_new_tokens: int) -> float | None:
    if cfg.aggregation != "token_sum_norm":
        return None
    return batch["tokens"].shape[0] * max_new_tokens


def reuses_policy_forward(cfg: PolicyLossConfig, num_micro: int) -> bool:
    """Whether the update's forward can stand in for the separate old-log-prob forward.

    True with one epoch of one minibatch in one micro-batch and the KL as a loss term: the
    update's only forward then runs at the params that sampled the rollout, so its log-probs
    equal the old log-probs, and the loss uses ``stop_gradient(logprobs)`` for them (the ratio
    is exactly 1 by construction; verl skips the recompute in the same case). Not with
    ``kl_mode: reward``, whose per-token rewards (hence GAE or the group advantages) need the
    old log-probs before the update, nor with several updates per rollout. Not with gradient
    accumulation either: its per-micro-batch means cannot carry the per-token log-probs (kept
    for inspection) or the exact KL metrics out of the update.
    """
    return cfg.epochs == 1 and cfg.num_minibatches == 1 and num_micro == 1 and cfg.kl_mode == "loss"


def reuses_value_forward(cfg: PolicyLossConfig, num_micro: int) -> bool:
    """Whether the critic's update forward can stand in for the separate value forward.

    True with one epoch of one minibatch in one micro-batch (any ``kl_mode``): the critic's
    only update forward then runs at the params that scored the rollout, so it computes the
    old values; the value loss runs GAE on their ``stop_gradient`` (the returns are its
    regression targets) and hands the advantages to the policy, whose update runs after the
    critic's in the same step. The per-token rewards (score and KL penalty) come from scoring.
    """
    return cfg.epochs == 1 and cfg.num_minibatches == 1 and num_micro == 1


def policy_loss(
    cfg: PolicyLossConfig,
    max_new_tokens: int,
    group_size: int,
    module: Any,
    params: Any,
    batch: Batch,
) -> tuple[jax.Array, Metrics]:
    """Clipped surrogate (+ KL loss term, - entropy bonus) on one micro-batch.

    Without ``batch["old_logprobs"]`` (:func:`reuses_policy_forward`) the old log-probs are
    this forward's, under ``stop_gradient``; the metrics then also carry the rollout's KL
    (``kl/seq_mean``, ``kl/token_mean``, which scoring reports otherwise) and the per-token
    log-probs under :data:`LOGPROBS_KEY`. ``group_size > 1``: packed prompt groups (module
    docstring).
    """
    tokens = batch["tokens"]
    start = response_start(tokens, max_new_tokens)
    logp, entropy = aligned_logprobs(module, params, tokens, batch["mask"], start, group_size)
    resp = batch["response_mask"]
    norm = _norm_constant(cfg, batch, max_new_tokens)
    reused = "old_logprobs" not in batch
    old = jax.lax.stop_gradient(logp) if reused else batch["old_logprobs"]
    loss, m = losses.ppo_policy_loss(
        logp,
        old,
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
    if reused:
        kl = losses.kl_penalty(old, batch["ref_logprobs"], resp, estimator=cfg.kl_estimator)
        metrics.update(_kl_metrics(kl, resp))
        metrics[LOGPROBS_KEY] = old
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


@dataclasses.dataclass(frozen=True)
class GaeConfig:
    """GAE settings for a critic whose update computes the advantages (static)."""

    gamma: float
    lam: float
    whiten: bool


def value_loss(
    clip_range: float | None,
    aggregation: str,
    max_new_tokens: int,
    group_size: int,
    gae: GaeConfig | None,
    module: Any,
    params: Any,
    batch: Batch,
) -> tuple[jax.Array, Metrics]:
    """Squared error of the critic against the GAE returns (optionally value-clipped).

    Without ``batch["old_values"]`` (:func:`reuses_value_forward`) the old values are this
    forward's, under ``stop_gradient``, and GAE (``gae``) runs here on ``batch["token_rewards"]``;
    the metrics then carry the per-token ``old_values``, ``returns`` and ``advantages`` (for
    the policy's update) and the scalar metrics scoring reports otherwise.
    """
    tokens, resp = batch["tokens"], batch["response_mask"]
    start = response_start(tokens, max_new_tokens)
    values = aligned_values(module, params, tokens, batch["mask"], start, group_size)
    extra: Metrics = {}
    if "old_values" in batch:
        old, returns = batch["old_values"], batch["returns"]
    else:
        if gae is None:
            raise ValueError("a batch without old_values needs the GAE settings")
        old = jax.lax.stop_gradient(values)
        adv, returns = gae_and_whiten(
            batch["token_rewards"], old, resp, gamma=gae.gamma, lam=gae.lam, whiten=gae.whiten
        )
        extra = {
            PER_TOKEN + "old_values": old,
            PER_TOKEN + "returns": returns,
            PER_TOKEN + "advantages": adv,
            **value_metrics(adv, returns, old, resp),
        }
    if aggregation == "token_sum_norm":  # value regression is a per-token mean in every variant
        aggregation = "token_mean"
    loss, m = losses.ppo_value_loss(
        values,
        old,
        returns,
        resp,
        clip_range=clip_range,
        aggregation=aggregation,
    )
    return loss, {
        "loss/value": loss,
        "value/mean": m["value_mean"],
        "value/error": m["value_error"],
        **extra,
    }


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


def _weight(aggregation: str, batch: Batch) -> jax.Array:
    resp = batch["response_mask"]
    if aggregation == "token_mean":
        return resp.sum()
    if aggregation == "token_sum_norm":
        return jnp.asarray(resp.shape[0])
    return resp.any(-1).sum()


def policy_objective(
    cfg: PolicyLossConfig, max_new_tokens: int, group_size: int = 1
) -> steps.Objective:
    return steps.Objective(
        name="policy",
        role="policy",
        head="lm",
        data_kind="prompt",
        loss_fn=functools.partial(policy_loss, cfg, max_new_tokens, group_size),
        weight_fn=functools.partial(_weight, cfg.aggregation),
        primary="loss/policy",
        summary=("loss/policy",),
    )


def value_objective(
    clip_range: float | None,
    aggregation: str,
    max_new_tokens: int,
    group_size: int = 1,
    gae: GaeConfig | None = None,
) -> steps.Objective:
    agg = "token_mean" if aggregation == "token_sum_norm" else aggregation
    return steps.Objective(
        name="value",
        role="value",
        head="scalar",
        data_kind="prompt",
        loss_fn=functools.partial(value_loss, clip_range, agg, max_new_tokens, group_size, gae),
        weight_fn=functools.partial(_weight, agg),
        primary="loss/value",
        summary=("loss/value",),
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
) -> tuple[Float[Array, "N T"], Metrics]:
    """Per-token PPO rewards (Ziegler et al. 2019): ``r_t = -beta * kl_t`` on every response
    token (with ``kl_mode: reward``), plus the score on the last one; and the KL metrics.

    ``old_logprobs`` may be None with ``kl_mode: loss`` (:func:`reuses_policy_forward`); the
    KL metrics then come from the update."""
    kl, metrics = _rollout_kl(old_logprobs, ref_logprobs, response_mask, loss_cfg)
    beta = kl_coef if loss_cfg.kl_mode == "reward" else 0.0
    return losses.token_rewards(scores, kl, response_mask, kl_coef=beta), metrics


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
) -> tuple[Float[Array, "N T"], Float[Array, "N T"], Metrics]:
    """GAE advantages and returns from :func:`ppo_token_rewards`.

    Returns ``(advantages, returns, metrics)``; ``metrics["kl/seq_mean"]`` is the mean over
    rows of the summed per-token KL (what the adaptive controller tracks). ``old_logprobs``
    may be None with ``kl_mode: loss``, as there."""
    rewards, metrics = ppo_token_rewards(
        scores, old_logprobs, ref_logprobs, response_mask, kl_coef, loss_cfg=loss_cfg
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
    group_size: int = 1,
) -> tuple[tuple[TrainState, ...], Metrics, Batch]:
    """``epochs`` passes of ``num_minibatches`` shuffled minibatch updates of every learner.

    Args:
      states: one TrainState per learner (donate them).
      rollout: ``[N, ...]`` arrays every objective reads (see the module docstring).
      key: shuffling key.
      learners: static description of each learner, matching ``states``.
      epochs, num_minibatches: PPO's inner loop; ``N`` must divide into the minibatches.
      num_micro: gradient-accumulation micro-batches per minibatch.
      mesh: the mesh.
      group_size: rows per packed prompt group (the learners' objectives must use the same):
        shuffling permutes whole groups and micro-batches take whole groups.

    Returns:
      New states, metrics and per-token outputs. Metrics: the mean over all minibatches
      (``skipped``: the number of updates dropped for a non-finite loss or gradient), plus
      ``first/<key>`` from the first minibatch of the first epoch (its policy ratio is exactly
      1: same params, same forward as the one that produced ``old_logprobs``). Per-token
      ``[N, T]`` outputs of the losses: ``old_logprobs`` when ``rollout`` has none (the
      update's forward stood in for them, :func:`reuses_policy_forward`); ``old_values``,
      ``returns`` and ``advantages`` when it has no ``advantages``
      (:func:`reuses_value_forward`); else ``{}``.
    """
    missing = [k for k in ("old_logprobs", "advantages") if k not in rollout]
    if missing and not epochs == num_minibatches == num_micro == 1:
        raise ValueError(
            f"a rollout without {' and '.join(missing)} needs a single update on a single "
            f"micro-batch, got {epochs} epoch(s) x {num_minibatches} minibatch(es) x "
            f"{num_micro} micro-batch(es)"
        )
    rules = learners[0].rules
    # The critic first: without scored advantages, its loss computes them for the policy
    # (per-token loss outputs the rollout lacks join the batch of the learners after).
    order = sorted(range(len(learners)), key=lambda i: learners[i].objective.role != "value")

    def minibatch_step(states, batch):
        new_states, metrics = list(states), {}
        for i in order:
            learner = learners[i]
            state, m = steps.train_step(
                states[i],
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
                group_size=group_size,
            )
            new_states[i] = state
            outputs = {k[len(PER_TOKEN) :]: m.pop(k) for k in list(m) if k.startswith(PER_TOKEN)}
            batch = {**outputs, **batch}  # what the rollout lacked feeds the learners after
            metrics.update({PER_TOKEN + k: v for k, v in outputs.items()})
            prefix = "" if learner.objective.role == "policy" else f"{learner.objective.role}/"
            metrics.update(
                {
                    (k if k.startswith(("loss/", "value/", "advantages/")) else prefix + k): v
                    for k, v in m.items()
                }
            )
        return tuple(new_states), metrics

    def epoch(states, epoch_key):
        if num_minibatches > 1:
            rows = rollout["tokens"].shape[0]
            perm = jax.random.permutation(epoch_key, rows // group_size)  # whole groups
            perm = (perm[:, None] * group_size + jnp.arange(group_size)).reshape(rows)
            shuffled = jax.tree.map(lambda x: x[perm], rollout)
            minibatches = steps.split_micro(shuffled, num_minibatches, mesh, rules, group_size)
        else:  # one minibatch: no shuffle needed, keep the rollout's row order
            minibatches = jax.tree.map(lambda x: x[None], rollout)
        return jax.lax.scan(minibatch_step, states, minibatches)

    states, metrics = jax.lax.scan(epoch, states, jax.random.split(key, epochs))
    per_token = {
        k[len(PER_TOKEN) :]: metrics.pop(k)[0, 0] for k in list(metrics) if k.startswith(PER_TOKEN)
    }
    out = {k: v.sum() if k.endswith("skipped") else v.mean() for k, v in metrics.items()}
    for k in ("policy/ratio_mean", "policy/ratio_max", "policy/approx_kl", "policy/clip_frac"):
        if k in metrics:
            out[f"first/{k}"] = metrics[k][0, 0]
    return states, out, per_token
