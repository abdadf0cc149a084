"""KL estimators (k1, k2, k3), as a per-token reward penalty or a loss, and KL controllers.

Estimators follow Schulman, "Approximating KL Divergence" (2020). Tokens are sampled from the
policy ``pi``; with ``log_r = log pi(y_t) - log pi_ref(y_t)``, each is a per-token estimate of
``KL(pi || pi_ref)``:

* ``k1 = log_r``: unbiased, high variance, can be negative.
* ``k2 = 1/2 log_r^2``: biased, low variance, non-negative.
* ``k3 = exp(-log_r) - 1 + log_r``: unbiased, low variance, non-negative (GRPO's KL term;
  verl ``low_var_kl``).

k3 grows like ``exp(-log_r)`` where the policy puts far less mass than the reference on a
token: ``log_r`` is clamped to [-20, 20] so it stays finite in float32, which still allows
``k3 = e^20 - 21 ~ 4.9e8`` for one token. ``k3_clamp=c`` also clips the k3 value to
``[-c, c]``, as verl's ``low_var_kl`` does with ``c = 10``.

The controllers are small ``NamedTuple`` pytrees with a pure update, so they can live in a
jitted train state.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from jaxrlhf.losses.common import Metrics, Scalar, aggregate_loss, as_float, as_mask, masked_mean

KL_ESTIMATORS = ("k1", "k2", "k3")
_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: keeps k3 finite in float32


def kl_estimate(
    logprobs: Float[Array, "*B T"],
    ref_logprobs: Float[Array, "*B T"],
    *,
    estimator: str = "k1",
    k3_clamp: float | None = None,
) -> Float[Array, "*B T"]:
    """Per-token KL estimate ``k1``, ``k2`` or ``k3`` of ``KL(pi || pi_ref)``, unmasked.

    ``log_r = logprobs - ref_logprobs``; ``k1 = log_r``, ``k2 = log_r^2 / 2``,
    ``k3 = exp(-log_r) - 1 + log_r`` (``log_r`` clamped to [-20, 20] for k3 only), then
    ``clip(k3, -k3_clamp, k3_clamp)`` when ``k3_clamp`` is set (verl: 10).

    The clamp is off by default: it biases the estimate and zeroes the gradient of every token
    it clips, and today's results stay bit-identical. Turn it on (10, as verl) for a k3 loss or
    penalty when a few tokens with a very unlikely policy log-prob must not dominate the batch
    mean (one token at ``log_r = -20`` gives 4.9e8).

    Args:
        logprobs: policy log-probs of the sampled tokens.
        ref_logprobs: reference-model log-probs of the same tokens.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        k3_clamp: ``c > 0``: clip the k3 value to ``[-c, c]``; None = no clip (k3 only).

    Returns:
        Float32 per-token estimates.

    Raises:
        ValueError: unknown estimator; ``k3_clamp`` with another estimator or not > 0.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator={estimator!r}; expected one of {KL_ESTIMATORS}")
    if k3_clamp is not None and (estimator != "k3" or not k3_clamp > 0):
        raise ValueError(
            f"k3_clamp={k3_clamp!r} needs estimator='k3' (got {estimator!r}) and a value > 0"
        )
    log_r = as_float(logprobs) - as_float(ref_logprobs)
    if estimator == "k1":
        return log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    log_r = jnp.clip(log_r, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    k3 = jnp.expm1(-log_r) + log_r
    return k3 if k3_clamp is None else jnp.clip(k3, -k3_clamp, k3_clamp)


def kl_penalty(
    logprobs: Float[Array, "B T"],
    ref_logprobs: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    *,
    estimator: str = "k1",
    k3_clamp: float | None = None,
) -> Float[Array, "B T"]:
    """Per-token KL for the reward: ``kl_t = k(log_r_t)`` where ``mask``, else 0.

    Feed the result to ``token_rewards`` (which applies ``-kl_coef``). Not stop-gradiented: the
    PPO losses treat advantages as constants, which is where rewards end up.

    Args:
        logprobs: policy (rollout) log-probs of the sampled tokens.
        ref_logprobs: reference log-probs of the same tokens.
        mask: True on response tokens; other positions are 0 and never touched by ``exp``.
        estimator: ``"k1"`` (PPO-RLHF default, as in Ziegler et al.), ``"k2"`` or ``"k3"``.
        k3_clamp: clip k3 to ``[-k3_clamp, k3_clamp]`` (see ``kl_estimate``); None = off.

    Returns:
        Masked per-token KL estimates.
    """
    logprobs = as_float(logprobs)
    mask = as_mask(mask, logprobs.shape)
    ref = jnp.where(mask, as_float(ref_logprobs), 0.0)
    kl = kl_estimate(jnp.where(mask, logprobs, 0.0), ref, estimator=estimator, k3_clamp=k3_clamp)
    return jnp.where(mask, kl, 0.0)


def kl_loss(
    logprobs: Float[Array, "B T"],
    ref_logprobs: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    *,
    estimator: str = "k3",
    k3_clamp: float | None = None,
    aggregation: str = "token_mean",
    norm_constant: float | None = None,
) -> tuple[Scalar, Metrics]:
    """KL as a loss term (GRPO): ``aggregate(k(log_r))`` with gradients through ``logprobs``.

    ``ref_logprobs`` is a constant. Multiply the loss by your KL coefficient. Note that the
    gradient of a sampled ``k1`` is 0 in expectation; ``k3`` (default) or ``k2`` is the usual
    choice for a loss.

    Args:
        logprobs: current policy log-probs (receive gradients).
        ref_logprobs: reference log-probs.
        mask: True on tokens that count.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        k3_clamp: clip k3 to ``[-k3_clamp, k3_clamp]`` (verl: 10; see ``kl_estimate``);
            None = off. Clipped tokens get no gradient.
        aggregation: see ``aggregate_loss``.
        norm_constant: denominator for ``aggregation="token_sum_norm"``.

    Returns:
        ``(loss, metrics)``; metrics: ``kl/mean`` (token mean of the estimate) and ``kl/max``
        (0 when nothing counts).
    """
    ref = jax.lax.stop_gradient(as_float(ref_logprobs))
    kl = kl_penalty(logprobs, ref, mask, estimator=estimator, k3_clamp=k3_clamp)
    loss = aggregate_loss(kl, mask, aggregation=aggregation, norm_constant=norm_constant)
    kl_c = jax.lax.stop_gradient(kl)
    mask = as_mask(mask, kl.shape)
    metrics = {
        "kl/mean": masked_mean(kl_c, mask),
        "kl/max": jnp.where(jnp.any(mask), jnp.max(jnp.where(mask, kl_c, -jnp.inf)), 0.0),
    }
    return loss, metrics


class AdaptiveKLState(NamedTuple):
    """Adaptive KL coefficient (Ziegler et al. 2019; trlX ``AdaptiveKLController``).

    Attributes:
        kl_coef: current coefficient (the reward penalty is ``-kl_coef * kl``).
        target: KL the controller steers towards.
        horizon: steps over which a 20% error changes the coefficient by 20%.
    """

    kl_coef: float | Array
    target: float | Array
    horizon: float | Array


class FixedKL(NamedTuple):
    """Constant KL coefficient; ``kl_controller_update`` returns it unchanged.

    Attributes:
        kl_coef: the coefficient.
    """

    kl_coef: float | Array


def kl_controller_update(
    state: AdaptiveKLState | FixedKL, current_kl: ArrayLike, n_steps: ArrayLike
) -> AdaptiveKLState | FixedKL:
    """Pure controller update; returns a new state.

    Adaptive (Ziegler et al. / trlX)::

        e = clip(current_kl / target - 1, -0.2, 0.2)
        kl_coef <- kl_coef * (1 + e * n_steps / horizon)

    Fixed: unchanged.

    Args:
        state: ``AdaptiveKLState`` or ``FixedKL``.
        current_kl: measured KL (e.g. mean per-sequence KL of the last batch).
        n_steps: samples (trlX: batch size) since the last update.

    Returns:
        The updated state, same type.

    Raises:
        TypeError: any other state type.
    """
    if isinstance(state, FixedKL):
        return state
    if not isinstance(state, AdaptiveKLState):
        raise TypeError(f"expected AdaptiveKLState or FixedKL, got {type(state).__name__}")
    error = jnp.clip(as_float(current_kl) / state.target - 1.0, -0.2, 0.2)
    mult = 1.0 + error * n_steps / state.horizon
    return state._replace(kl_coef=state.kl_coef * mult)
