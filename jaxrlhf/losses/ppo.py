"""PPO policy and value losses over per-token arrays.

Inputs are per-token ``[B, T]`` arrays (any leading axes work); ``mask`` is True on response
tokens that count. Old log-probs, behaviour log-probs, advantages, returns and old values are
treated as constants (``stop_gradient``), so only ``logprobs`` / ``values`` receive gradients.
Diagnostics are token means over the mask, whatever ``aggregation`` the loss uses.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from jaxrlhf.losses.common import Metrics, Scalar, aggregate_loss, as_float, as_mask, masked_mean

# exp() of a log-ratio beyond this overflows float32 soon after; verl clamps at the same value.
_MAX_LOG_RATIO = 20.0


def _log_ratio(num: Array, den: Array, mask: Array) -> Array:
    # Padding may hold arbitrary values: zero them before exp so they cannot overflow, and clamp
    # the real ones (gradient is 0 beyond the clamp, which only hits pathological ratios).
    return jnp.clip(jnp.where(mask, num - den, 0.0), -_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def ppo_policy_loss(
    logprobs: Float[Array, "B T"],
    old_logprobs: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    behaviour_logprobs: Float[Array, "B T"] | None = None,
    tis_cap: float | None = None,
    token_weights: Float[Array, "B T"] | None = None,
    aggregation: str = "token_mean",
    norm_constant: float | None = None,
) -> tuple[Scalar, Metrics]:
    """Clipped-surrogate PPO loss with clip-higher, dual-clip and truncated importance weights.

    Per token, with ``r = exp(logp - logp_old)`` and advantage ``A``::

        l   = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))      # clip-higher (DAPO)
        l   = min(l, -A c)           if A < 0 and dual_clip = c > 1      # dual-clip (Ye et al.)
        l  *= min(exp(logp_old - logp_behaviour), tis_cap)              # TIS, if behaviour given
        l  *= w                                                         # token_weights, if given

    The truncated importance weight (TIS; Yao et al. 2025, verl ``tis_imp_ratio_cap``) corrects
    for rollouts sampled by an engine whose log-probs ``logp_behaviour`` differ from the
    trainer's recomputed ``logp_old``; it is a constant. ``tis_cap=None`` leaves the weight
    untruncated. ``token_weights`` multiplies each token's loss by a given constant weight (the
    bounded importance weights of ``jaxrlhf.losses.correction``). Log-ratios are clamped to
    [-20, 20] before ``exp``.

    Args:
        logprobs: current policy log-probs of the sampled tokens (receives gradients).
        old_logprobs: log-probs of the policy that produced the advantages (trainer-side).
        advantages: per-token advantages (use ``broadcast_sequence_advantages`` for [B] ones).
        mask: True on tokens that count (response tokens).
        clip_low: ratio lower bound is ``1 - clip_low``.
        clip_high: ratio upper bound is ``1 + clip_high``.
        dual_clip: ``c > 1`` bounds the loss of negative-advantage tokens at ``-A c``.
        behaviour_logprobs: log-probs from the sampling engine; enables the TIS weight.
        tis_cap: truncation of the TIS weight.
        token_weights: per-token constant weights (e.g. ``importance_weights``), or None.
        aggregation: see ``aggregate_loss``.
        norm_constant: denominator for ``aggregation="token_sum_norm"``.

    Returns:
        ``(loss, metrics)``; metrics (token means over the mask): ``clip_frac`` (surrogate
        clipped), ``approx_kl`` (k3 estimate of KL(old || new), ``(r - 1) - log r``),
        ``ratio_mean``, ``ratio_max``; with dual-clip ``clip_frac_lower``; with TIS
        ``tis/weight_mean`` and ``tis/clip_frac``.

    Raises:
        ValueError: ``dual_clip`` not greater than 1, or ``advantages`` not per-token.
    """
    if jnp.ndim(advantages) != jnp.ndim(logprobs):
        # A [B] advantage would silently broadcast against the T axis of [B, T].
        raise ValueError(
            f"advantages must be per-token like logprobs {jnp.shape(logprobs)}, got "
            f"{jnp.shape(advantages)}; use broadcast_sequence_advantages for per-sequence ones"
        )
    logprobs = as_float(logprobs)
    mask = as_mask(mask, logprobs.shape)
    old = jax.lax.stop_gradient(as_float(old_logprobs))
    adv = jax.lax.stop_gradient(jnp.where(mask, as_float(advantages), 0.0))

    log_ratio = _log_ratio(logprobs, old, mask)
    ratio = jnp.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg = jnp.maximum(pg1, pg2)
    metrics = {"clip_frac": masked_mean(pg2 > pg1, mask)}

    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        pg3 = -adv * dual_clip
        negative = adv < 0
        metrics["clip_frac_lower"] = masked_mean(negative & (pg > pg3), mask)
        pg = jnp.where(negative, jnp.minimum(pg, pg3), pg)

    if behaviour_logprobs is not None:
        behaviour = jax.lax.stop_gradient(as_float(behaviour_logprobs))
        weight = jnp.exp(_log_ratio(old, behaviour, mask))
        if tis_cap is not None:
            metrics["tis/clip_frac"] = masked_mean(weight > tis_cap, mask)
            weight = jnp.minimum(weight, tis_cap)
        metrics["tis/weight_mean"] = masked_mean(weight, mask)
        pg = pg * weight

    if token_weights is not None:
        pg = pg * jax.lax.stop_gradient(jnp.where(mask, as_float(token_weights), 0.0))

    loss = aggregate_loss(pg, mask, aggregation=aggregation, norm_constant=norm_constant)
    ratio_c = jax.lax.stop_gradient(ratio)
    metrics["approx_kl"] = masked_mean((ratio_c - 1.0) - jax.lax.stop_gradient(log_ratio), mask)
    metrics["ratio_mean"] = masked_mean(ratio_c, mask)
    metrics["ratio_max"] = jnp.max(jnp.where(mask, ratio_c, 0.0))
    return loss, metrics


def ppo_value_loss(
    values: Float[Array, "B T"],
    old_values: Float[Array, "B T"],
    returns: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    *,
    clip_range: float | None = None,
    aggregation: str = "token_mean",
    norm_constant: float | None = None,
) -> tuple[Scalar, Metrics]:
    """Squared-error value loss with optional PPO-style value clipping.

    Per token, with return ``R``::

        l = 1/2 (V - R)^2                                                  # clip_range=None
        l = 1/2 max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2)  # clip_range=eps

    The 1/2 factor follows trlX and verl.

    Args:
        values: current value predictions (receive gradients).
        old_values: predictions at rollout time (constants).
        returns: regression targets, e.g. from ``gae_advantages`` (constants).
        mask: True on tokens that count.
        clip_range: ``eps``; None disables clipping.
        aggregation: see ``aggregate_loss``.
        norm_constant: denominator for ``aggregation="token_sum_norm"``.

    Returns:
        ``(loss, metrics)``; metrics: ``value_mean``, ``value_error`` (mean squared error,
        unclipped), and with clipping ``vf_clip_frac`` (clipped branch was larger).
    """
    values = as_float(values)
    mask = as_mask(mask, values.shape)
    old = jax.lax.stop_gradient(jnp.where(mask, as_float(old_values), 0.0))
    target = jax.lax.stop_gradient(jnp.where(mask, as_float(returns), 0.0))
    values = jnp.where(mask, values, 0.0)

    err = (values - target) ** 2
    metrics = {
        "value_mean": masked_mean(jax.lax.stop_gradient(values), mask),
        "value_error": masked_mean(jax.lax.stop_gradient(err), mask),
    }
    if clip_range is not None:
        clipped = old + jnp.clip(values - old, -clip_range, clip_range)
        err_clipped = (clipped - target) ** 2
        metrics["vf_clip_frac"] = masked_mean(err_clipped > err, mask)
        err = jnp.maximum(err, err_clipped)
    loss = aggregate_loss(0.5 * err, mask, aggregation=aggregation, norm_constant=norm_constant)
    return loss, metrics
