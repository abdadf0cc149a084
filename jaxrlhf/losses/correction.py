"""Rollout correction: importance weights between the policy that sampled a rollout (the
behaviour policy) and the policy the learner scores it with, and decoupled PPO.

Two things make the sampler's policy differ from the learner's: the sampler computes the same
model in another layout or precision (an inference engine's log-probs are not the trainer's,
Yao et al. 2025), and in asynchronous RL it samples with weights up to ``k`` versions old.
Both are corrected the same way. With the behaviour log-probs ``log mu_t`` kept per token and
a target ``log pi_t`` (the learner's *proximal* policy, recomputed at the parameters the update
starts from), the per-token log-ratio is ``log rho_t = m_t (log pi_t - log mu_t)``:

* ``level="token"``: ``rho_t = exp(log rho_t)``, one weight per token.
* ``level="sequence"``: ``rho_b = exp(sum_t log rho_t)``, the whole sequence's likelihood
  ratio, the same weight on every token of the row.

and ``mode`` bounds it:

* ``"truncate"`` (TIS): ``w = min(rho, cap)``.
* ``"mask"`` (MIS, rejection): ``w = rho * 1[floor <= rho <= cap]``; tokens (or sequences)
  whose ratio leaves the range get weight 0 and so no gradient; they still count in the
  loss's denominator.

Decoupled PPO (Hilton et al. 2022; AReaL) clips the policy ratio against the proximal policy,
not the behaviour one, and carries the behaviour correction as a separate constant weight::

    l_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)),
    r_t = pi_theta / pi_prox,  w_t = bounded pi_prox / mu   (this module's weights)

so the trust region is around the policy the update starts from, however stale the sampler.
Every weight is a constant (``stop_gradient``). Log-ratios are clamped to [-20, 20] before
``exp`` (a sequence's summed log-ratio too); whether a ratio is inside ``[floor, cap]`` is
decided on the unclamped log-ratio. ``docs/losses.md`` has the equations.
"""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from jaxrlhf.losses.common import Metrics, Scalar, as_float, as_mask, masked_mean
from jaxrlhf.losses.ppo import ppo_policy_loss

IS_MODES = ("truncate", "mask")
IS_LEVELS = ("token", "sequence")
_MAX_LOG_RATIO = 20.0


def _check(mode: str, level: str, cap: float, floor: float) -> None:
    if mode not in IS_MODES:
        raise ValueError(f"mode={mode!r}; expected one of {IS_MODES}")
    if level not in IS_LEVELS:
        raise ValueError(f"level={level!r}; expected one of {IS_LEVELS}")
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if not 0 <= floor < cap:
        raise ValueError(f"floor must be in [0, cap), got {floor} (cap {cap})")
    if mode == "truncate" and floor:
        raise ValueError("floor: only mode='mask' uses a lower bound (truncation is min(rho, cap))")


def importance_weights(
    target_logprobs: Float[Array, "B T"],
    behaviour_logprobs: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    *,
    mode: str = "truncate",
    level: str = "token",
    cap: float = 2.0,
    floor: float = 0.0,
) -> tuple[Float[Array, "B T"], Metrics]:
    """Bounded importance weights ``pi_target / mu`` per token (module docstring).

    Args:
        target_logprobs: log-probs of the sampled tokens under the policy being corrected to
            (the learner's proximal policy).
        behaviour_logprobs: their log-probs under the policy that sampled them.
        mask: True on the tokens that count (response tokens).
        mode: ``"truncate"`` (``min(rho, cap)``) or ``"mask"`` (``rho`` inside
            ``[floor, cap]``, else 0).
        level: ``"token"`` (per-token ratios) or ``"sequence"`` (the row's product of ratios,
            broadcast over its tokens).
        cap: the upper bound ``C``.
        floor: the lower bound of ``mode="mask"`` (0: none).

    Returns:
        ``(weights, metrics)``: weights [B, T], constants, 0 outside the mask. Metrics, over the
        counted units (tokens, or rows with at least one token for ``level="sequence"``):
        ``ratio_mean``, ``ratio_max`` (of the unbounded ``rho``, the log-ratio clamped at 20),
        ``weight_mean``, ``weight_max``, ``clip_frac`` (units truncated or masked), ``ess``
        (normalised effective sample size ``(sum w)^2 / (n sum w^2)``, 1 when every weight is
        equal) and ``mismatch_kl`` (k3 estimate of KL(mu || pi_target) per token,
        ``E_mu[rho - 1 - log rho]``).

    Raises:
        ValueError: unknown ``mode`` / ``level``, or bounds out of range.
    """
    _check(mode, level, cap, floor)
    target = jax.lax.stop_gradient(as_float(target_logprobs))
    behaviour = jax.lax.stop_gradient(as_float(behaviour_logprobs))
    mask = as_mask(mask, target.shape)
    log_rho = jnp.where(mask, target - behaviour, 0.0)  # [B, T]
    token_log_rho = jnp.clip(log_rho, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    token_rho = jnp.exp(token_log_rho)
    metrics = {"mismatch_kl": masked_mean(token_rho - 1.0 - token_log_rho, mask)}
    if level == "token":
        unit_log_rho, unit_mask = log_rho, mask
    else:
        unit_log_rho, unit_mask = log_rho.sum(-1), mask.any(-1)  # [B]
    rho = jnp.exp(jnp.clip(unit_log_rho, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    above = unit_log_rho > math.log(cap)
    if mode == "truncate":
        weight, bounded = jnp.minimum(rho, cap), above
    else:
        below = unit_log_rho < (math.log(floor) if floor > 0 else -jnp.inf)
        bounded = above | below
        weight = jnp.where(bounded, 0.0, rho)
    weight = jnp.where(unit_mask, weight, 0.0)
    n = jnp.maximum(unit_mask.sum(), 1)
    metrics.update(
        ratio_mean=masked_mean(rho, unit_mask),
        ratio_max=jnp.max(jnp.where(unit_mask, rho, 0.0)),
        weight_mean=masked_mean(weight, unit_mask),
        weight_max=jnp.max(weight),
        clip_frac=masked_mean(bounded, unit_mask),
        ess=weight.sum() ** 2 / jnp.maximum(n * (weight**2).sum(), 1e-30),
    )
    if level == "sequence":
        weight = jnp.where(mask, weight[..., None], 0.0)
    return jax.lax.stop_gradient(weight), metrics


def decoupled_ppo_loss(
    logprobs: Float[Array, "B T"],
    proximal_logprobs: Float[Array, "B T"],
    behaviour_logprobs: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    mode: str = "truncate",
    level: str = "token",
    cap: float = 2.0,
    floor: float = 0.0,
    aggregation: str = "token_mean",
    norm_constant: float | None = None,
) -> tuple[Scalar, Metrics]:
    """Decoupled PPO: the clipped surrogate against the proximal policy, times the bounded
    importance weight ``pi_prox / mu`` (:func:`importance_weights`)::

        l_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))
        r_t = exp(logp_t - logp_prox_t)

    (with ``dual_clip`` as in :func:`~jaxrlhf.losses.ppo_policy_loss`), then
    ``aggregate_loss``. With ``mode="truncate"``, ``level="token"`` this is
    ``ppo_policy_loss(..., behaviour_logprobs=mu, tis_cap=cap)``.

    Args:
        logprobs: current policy log-probs (receive gradients).
        proximal_logprobs: the learner's log-probs at the parameters the update starts from.
        behaviour_logprobs: the sampler's log-probs of the same tokens.
        advantages, mask, clip_low, clip_high, dual_clip, aggregation, norm_constant: as in
            ``ppo_policy_loss``.
        mode, level, cap, floor: as in :func:`importance_weights`.

    Returns:
        ``(loss, metrics)``: ``ppo_policy_loss``'s metrics plus the weights' under ``is/``.
    """
    weights, is_metrics = importance_weights(
        proximal_logprobs, behaviour_logprobs, mask, mode=mode, level=level, cap=cap, floor=floor
    )
    loss, metrics = ppo_policy_loss(
        logprobs,
        proximal_logprobs,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        token_weights=weights,
        aggregation=aggregation,
        norm_constant=norm_constant,
    )
    metrics.update({f"is/{k}": v for k, v in is_metrics.items()})
    return loss, metrics
