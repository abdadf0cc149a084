"""Preference and supervised losses: DPO family, SimPO, ORPO, Bradley-Terry, SFT.

Pairwise losses take one value per pair, ``[B]``: summed (DPO, IPO, hinge, cDPO) or
length-averaged (SimPO, ORPO) response log-probabilities, obtained with
``sequence_logprobs(token_logprobs(...), response_mask, average=...)``. The optional
``pair_mask [B]`` (True = real pair) lets a padded batch keep a fixed shape; the loss is the
mean over real pairs (0 if there are none). Reference log-probs are constants.

Diagnostics follow TRL's names: ``rewards/chosen`` and ``rewards/rejected`` (mean implicit
reward), ``rewards/accuracy`` (fraction with chosen > rejected) and ``rewards/margin`` (mean
chosen - rejected), all over real pairs.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.losses.common import (
    Metrics,
    Scalar,
    aggregate_loss,
    as_float,
    as_mask,
    masked_mean,
    token_logprobs,
)

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")
# Mean log-prob at which ORPO's log(1 - p) is evaluated at most: p = 1 exactly gives -inf.
_ORPO_MAX_LOGP = -1e-6


def _pair_mask(pair_mask: Array | None, like: Array) -> Array:
    return jnp.ones(like.shape, bool) if pair_mask is None else as_mask(pair_mask, like.shape)


def _pair_metrics(chosen: Array, rejected: Array, pair_mask: Array) -> Metrics:
    chosen, rejected = jax.lax.stop_gradient(chosen), jax.lax.stop_gradient(rejected)
    return {
        "rewards/chosen": masked_mean(chosen, pair_mask),
        "rewards/rejected": masked_mean(rejected, pair_mask),
        "rewards/accuracy": masked_mean(chosen > rejected, pair_mask),
        "rewards/margin": masked_mean(chosen - rejected, pair_mask),
    }


def _smoothed_sigmoid_loss(z: Array, label_smoothing: float) -> Array:
    """``-(1 - e) log sigma(z) - e log sigma(-z)``: BCE against a soft label ``1 - e``."""
    positive = jax.nn.log_sigmoid(z)
    negative = jax.nn.log_sigmoid(-z)
    return -(1.0 - label_smoothing) * positive - label_smoothing * negative


def dpo_loss(
    policy_chosen_logps: Float[Array, " B"],
    policy_rejected_logps: Float[Array, " B"],
    reference_chosen_logps: Float[Array, " B"],
    reference_rejected_logps: Float[Array, " B"],
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    pair_mask: Bool[Array, " B"] | None = None,
) -> tuple[Scalar, Metrics]:
    """DPO (Rafailov et al. 2023) and its IPO, hinge and conservative variants.

    With ``h = (logp_c - ref_c) - (logp_r - ref_r)`` (summed response log-probs)::

        sigmoid: -(1 - e) log sigma(beta h) - e log sigma(-beta h)  # e > 0: cDPO
        ipo:     (h - 1 / (2 beta))^2                               # Azar et al. 2023
        hinge:   relu(1 - beta h)                                   # SLiC (Zhao et al. 2023)

    averaged over real pairs. The implicit rewards in the metrics are ``beta (logp - ref)``.
    IPO is defined on whatever log-probs you pass; TRL's ``ipo`` passes length-averaged ones.

    Args:
        policy_chosen_logps: policy log-prob of each chosen response.
        policy_rejected_logps: policy log-prob of each rejected response.
        reference_chosen_logps: reference log-prob of each chosen response.
        reference_rejected_logps: reference log-prob of each rejected response.
        beta: inverse temperature (sigmoid, hinge) / regularisation (IPO).
        loss_type: ``"sigmoid"``, ``"ipo"`` or ``"hinge"``.
        label_smoothing: ``e``, the assumed probability that a label is flipped (sigmoid only).
        pair_mask: True = real pair.

    Returns:
        ``(loss, metrics)`` with the ``rewards/*`` metrics.

    Raises:
        ValueError: unknown ``loss_type``, or ``label_smoothing`` with a non-sigmoid loss.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}; expected one of {DPO_LOSS_TYPES}")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError("label_smoothing only applies to loss_type='sigmoid' (cDPO)")
    chosen_ratio = as_float(policy_chosen_logps) - jax.lax.stop_gradient(
        as_float(reference_chosen_logps)
    )
    rejected_ratio = as_float(policy_rejected_logps) - jax.lax.stop_gradient(
        as_float(reference_rejected_logps)
    )
    mask = _pair_mask(pair_mask, chosen_ratio)
    h = jnp.where(mask, chosen_ratio - rejected_ratio, 0.0)
    if loss_type == "sigmoid":
        losses = _smoothed_sigmoid_loss(beta * h, label_smoothing)
    elif loss_type == "ipo":
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = jax.nn.relu(1.0 - beta * h)
    metrics = _pair_metrics(beta * chosen_ratio, beta * rejected_ratio, mask)
    return masked_mean(losses, mask), metrics


def simpo_loss(
    chosen_avg_logps: Float[Array, " B"],
    rejected_avg_logps: Float[Array, " B"],
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    pair_mask: Bool[Array, " B"] | None = None,
) -> tuple[Scalar, Metrics]:
    """SimPO (Meng et al. 2024): reference-free, length-normalised, with a target margin.

    With ``z = beta (avg_c - avg_r) - gamma`` where ``avg`` is the mean token log-prob of the
    response (``sequence_logprobs(..., average=True)``)::

        loss = -(1 - e) log sigma(z) - e log sigma(-z)

    averaged over real pairs (TRL's CPO trainer with ``loss_type="simpo"``, whose
    ``simpo_gamma`` is this ``gamma``). Implicit rewards are ``beta * avg``.

    Args:
        chosen_avg_logps: mean token log-prob of each chosen response.
        rejected_avg_logps: mean token log-prob of each rejected response.
        beta: reward scale.
        gamma: target reward margin.
        label_smoothing: ``e``.
        pair_mask: True = real pair.

    Returns:
        ``(loss, metrics)`` with the ``rewards/*`` metrics.
    """
    chosen = beta * as_float(chosen_avg_logps)
    rejected = beta * as_float(rejected_avg_logps)
    mask = _pair_mask(pair_mask, chosen)
    z = jnp.where(mask, chosen - rejected - gamma, 0.0)
    losses = _smoothed_sigmoid_loss(z, label_smoothing)
    return masked_mean(losses, mask), _pair_metrics(chosen, rejected, mask)


def _log1mexp(x: Array) -> Array:
    """``log(1 - exp(x))`` for ``x < 0``, accurate at both ends (Maechler 2012)."""
    # Both branches are finite for every x <= _ORPO_MAX_LOGP, so the unused one cannot put a
    # NaN into the gradient.
    return jnp.where(x > -jnp.log(2.0), jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def orpo_odds_ratio_loss(
    chosen_avg_logps: Float[Array, " B"],
    rejected_avg_logps: Float[Array, " B"],
    *,
    beta: float = 0.1,
    pair_mask: Bool[Array, " B"] | None = None,
) -> tuple[Scalar, Metrics]:
    """The odds-ratio term of ORPO (Hong et al. 2024); add it to the chosen-response SFT loss.

    With ``p = exp(avg)`` (mean token log-prob of the response) and ``odds = p / (1 - p)``::

        log_odds = (avg_c - avg_r) - (log(1 - exp(avg_c)) - log(1 - exp(avg_r)))
        loss     = -beta * mean(log sigma(log_odds))

    ``beta`` is the paper's lambda (TRL ``ORPOConfig.beta``). ``log(1 - exp(x))`` is computed
    stably, and ``avg`` is capped at -1e-6 so an empty response (``avg = 0``, ``p = 1``) stays
    finite. Implicit rewards in the metrics are ``beta * avg``.

    Args:
        chosen_avg_logps: mean token log-prob of each chosen response.
        rejected_avg_logps: mean token log-prob of each rejected response.
        beta: weight of the odds-ratio term.
        pair_mask: True = real pair.

    Returns:
        ``(loss, metrics)`` with the ``rewards/*`` metrics plus ``orpo/log_odds_ratio``
        (mean ``log sigma(log_odds)``) and ``orpo/log_odds`` (mean ``log_odds``).
    """
    chosen = as_float(chosen_avg_logps)
    rejected = as_float(rejected_avg_logps)
    mask = _pair_mask(pair_mask, chosen)
    c = jnp.minimum(jnp.where(mask, chosen, -1.0), _ORPO_MAX_LOGP)
    r = jnp.minimum(jnp.where(mask, rejected, -1.0), _ORPO_MAX_LOGP)
    log_odds = (c - r) - (_log1mexp(c) - _log1mexp(r))
    log_sig = jax.nn.log_sigmoid(log_odds)
    metrics = _pair_metrics(beta * chosen, beta * rejected, mask)
    metrics["orpo/log_odds_ratio"] = masked_mean(jax.lax.stop_gradient(log_sig), mask)
    metrics["orpo/log_odds"] = masked_mean(jax.lax.stop_gradient(log_odds), mask)
    return -beta * masked_mean(log_sig, mask), metrics


def bradley_terry_loss(
    chosen_rewards: Float[Array, " B"],
    rejected_rewards: Float[Array, " B"],
    *,
    margin: Float[Array, " B"] | float | None = None,
    pair_mask: Bool[Array, " B"] | None = None,
) -> tuple[Scalar, Metrics]:
    """Bradley-Terry reward-model loss, with the optional margin of Llama 2.

    ::

        loss = -mean(log sigma(r_c - r_r - m))

    Args:
        chosen_rewards: reward-model scores of the chosen responses (receive gradients).
        rejected_rewards: scores of the rejected responses.
        margin: ``m`` per pair or scalar (e.g. from preference strength); None means 0.
        pair_mask: True = real pair.

    Returns:
        ``(loss, metrics)``; ``rewards/*`` metrics are over the raw scores.
    """
    chosen = as_float(chosen_rewards)
    rejected = as_float(rejected_rewards)
    mask = _pair_mask(pair_mask, chosen)
    diff = chosen - rejected
    if margin is not None:
        diff = diff - jax.lax.stop_gradient(as_float(margin))
    losses = -jax.nn.log_sigmoid(jnp.where(mask, diff, 0.0))
    return masked_mean(losses, mask), _pair_metrics(chosen, rejected, mask)


def sft_loss(
    logits: Float[Array, "B T V"],
    targets: Int[Array, "B T"],
    mask: Bool[Array, "B T"],
    *,
    aggregation: str = "token_mean",
    norm_constant: float | None = None,
) -> tuple[Scalar, Metrics]:
    """Masked next-token cross-entropy: ``aggregate(-log softmax(logits)[y_t])``.

    ``logits[:, t]`` must already predict ``targets[:, t]`` (shift before calling). Log-softmax
    runs in float32 via ``token_logprobs``.

    Args:
        logits: model outputs.
        targets: token ids; values at masked positions are ignored (may be -100).
        mask: True on tokens that are trained on (typically response tokens only).
        aggregation: see ``aggregate_loss`` (``"token_mean"`` is the usual SFT choice).
        norm_constant: denominator for ``aggregation="token_sum_norm"``.

    Returns:
        ``(loss, metrics)``; metrics: ``sft/nll`` (token-mean NLL), ``sft/accuracy``
        (argmax = target, token mean), ``sft/num_tokens``.
    """
    mask = as_mask(mask, targets.shape)
    nll = -token_logprobs(logits, targets)
    loss = aggregate_loss(nll, mask, aggregation=aggregation, norm_constant=norm_constant)
    correct = jnp.argmax(logits, axis=-1) == targets
    metrics = {
        "sft/nll": masked_mean(jax.lax.stop_gradient(nll), mask),
        "sft/accuracy": masked_mean(correct, mask),
        "sft/num_tokens": jnp.sum(mask, dtype=jnp.float32),
    }
    return loss, metrics
