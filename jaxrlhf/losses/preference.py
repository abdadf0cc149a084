"""Preference and supervised losses: DPO family, SimPO, ORPO, Bradley-Terry, SFT.

Pairwise losses take one value per pair, ``[B]``: summed (DPO, IPO, hinge, cDPO) or
length-averaged (SimPO, ORPO) response log-probabilities, obtained with
``sequence_logprobs(token_logprobs(...), response_mask, average=...)``. The optional
``pair_mask [B]`` (True = real pair) lets a padded batch keep a fixed shape; the loss is the
mean over real pairs (0 if there are none). Reference log-probs are constants.

``dpo_loss`` also takes f-DPO's ``f_divergence`` (``f_divergence_scores``) and per-pair
``pair_weights`` (WPO); TRL's other DPO loss types are in ``preference_variants``.

Diagnostics follow TRL's names: ``rewards/chosen`` and ``rewards/rejected`` (mean implicit
reward), ``rewards/accuracy`` (fraction with chosen > rejected) and ``rewards/margin`` (mean
chosen - rejected), all over real pairs.
"""

import functools

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
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# Mean log-prob at which ORPO's log(1 - p) is evaluated at most: p = 1 exactly gives -inf.
_ORPO_MAX_LOGP = -1e-6
# Largest exponent in the f-divergence scores: exp(80) ~ 5.5e34 is finite in float32 (TRL's cap).
_MAX_EXPONENT = 80.0


def _pair_mask(pair_mask: Array | None, like: Array) -> Array:
    return jnp.ones(like.shape, bool) if pair_mask is None else as_mask(pair_mask, like.shape)


def log_ratios(
    policy_chosen: Array,
    policy_rejected: Array,
    reference_chosen: Array,
    reference_rejected: Array,
    pair_mask: Array | None,
) -> tuple[Array, Array, Array]:
    """``(logp_c - ref_c, logp_r - ref_r, mask)``, references constant, padding pairs 0."""
    chosen = as_float(policy_chosen) - jax.lax.stop_gradient(as_float(reference_chosen))
    rejected = as_float(policy_rejected) - jax.lax.stop_gradient(as_float(reference_rejected))
    mask = _pair_mask(pair_mask, chosen)
    return jnp.where(mask, chosen, 0.0), jnp.where(mask, rejected, 0.0), mask


def pair_mean(losses: Array, mask: Array, pair_weights: Array | None) -> Array:
    """Mean over real pairs of ``w * loss`` (WPO's weights are constants; TRL: no renorm)."""
    if pair_weights is not None:
        losses = losses * jax.lax.stop_gradient(as_float(pair_weights))
    return masked_mean(losses, mask)


def f_divergence_scores(
    log_ratios: Float[Array, "*B"], *, f_divergence: str = "reverse_kl", alpha: float = 0.5
) -> Float[Array, "*B"]:
    """``f'(u)`` of f-DPO (Wang et al. 2023) at ``u = pi / pi_ref``, up to an additive constant.

    f-DPO replaces the log-ratio ``log u`` inside a DPO-style loss by ``f'(u)`` of the
    divergence that regularises the policy (TRL ``f_divergence_type``)::

        reverse_kl:        log u                         # standard DPO
        forward_kl:        -1 / u = -exp(-log u)
        js_divergence:     log(u / (1 + u)) = log sigma(log u)
        alpha_divergence:  (1 - u^-alpha) / alpha -> -exp(-alpha log u) / alpha

    The constants dropped (``+1``, ``log 2``, ``1 / alpha``) cancel in ``s_c - s_r``. ``alpha``
    follows the paper and TRL's documented ``u^-alpha`` form: ``alpha -> 0`` is reverse KL
    (``|alpha| < 1e-6`` returns ``log u``) and ``alpha = 1`` is forward KL. TRL's code since
    its DPO refactor (#3906) uses ``(u^(a - 1) - 1) / (a - 1)``, i.e. ``a = 1 - alpha``; both
    agree at the default 0.5. Exponents are capped at 80 (as TRL) so the scores stay finite
    in float32; a capped score has zero gradient.

    Args:
        log_ratios: ``log pi(y) - log pi_ref(y)``, e.g. summed over a response.
        f_divergence: one of ``F_DIVERGENCES``.
        alpha: the alpha-divergence coefficient (``alpha_divergence`` only).

    Returns:
        The scores, same shape.

    Raises:
        ValueError: unknown ``f_divergence``.
    """
    if f_divergence not in F_DIVERGENCES:
        raise ValueError(f"f_divergence={f_divergence!r}; expected one of {F_DIVERGENCES}")
    x = as_float(log_ratios)
    if f_divergence == "reverse_kl" or (f_divergence == "alpha_divergence" and abs(alpha) < 1e-6):
        return x
    if f_divergence == "js_divergence":
        return jax.nn.log_sigmoid(x)
    if f_divergence == "forward_kl":
        alpha = 1.0
    return -jnp.exp(jnp.minimum(-alpha * x, _MAX_EXPONENT)) / alpha


def pair_metrics(chosen: Array, rejected: Array, pair_mask: Array) -> Metrics:
    chosen, rejected = jax.lax.stop_gradient(chosen), jax.lax.stop_gradient(rejected)
    return {
        "rewards/chosen": masked_mean(chosen, pair_mask),
        "rewards/rejected": masked_mean(rejected, pair_mask),
        "rewards/accuracy": masked_mean(chosen > rejected, pair_mask),
        "rewards/margin": masked_mean(chosen - rejected, pair_mask),
    }


def smoothed_sigmoid_loss(z: Array, label_smoothing: float) -> Array:
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
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
    pair_weights: Float[Array, " B"] | None = None,
    pair_mask: Bool[Array, " B"] | None = None,
) -> tuple[Scalar, Metrics]:
    """DPO (Rafailov et al. 2023) and its IPO, hinge, conservative and f-divergence variants.

    With ``s = f_divergence_scores(logp - ref)`` (the log-ratio itself for the default
    ``reverse_kl``) of summed response log-probs and ``h = s_c - s_r``::

        sigmoid: -(1 - e) log sigma(beta h) - e log sigma(-beta h)  # e > 0: cDPO
        ipo:     (h - 1 / (2 beta))^2                               # Azar et al. 2023
        hinge:   relu(1 - beta h)                                   # SLiC (Zhao et al. 2023)

    then ``mean_i w_i loss_i`` over real pairs (``w = pair_weights``, e.g. WPO's, constant; 1
    when None). The implicit rewards in the metrics are ``beta (logp - ref)``. IPO is defined
    on whatever log-probs you pass; TRL's ``ipo`` passes length-averaged ones.

    ``f_divergence`` other than reverse KL is f-DPO (TRL ``f_divergence_type``); not with IPO,
    which TRL applies to the length-average of the *scores*: with length-averaged log-probs
    passed in, only reverse KL gives the same number.

    Args:
        policy_chosen_logps: policy log-prob of each chosen response.
        policy_rejected_logps: policy log-prob of each rejected response.
        reference_chosen_logps: reference log-prob of each chosen response.
        reference_rejected_logps: reference log-prob of each rejected response.
        beta: inverse temperature (sigmoid, hinge) / regularisation (IPO).
        loss_type: ``"sigmoid"``, ``"ipo"`` or ``"hinge"``.
        label_smoothing: ``e``, the assumed probability that a label is flipped (sigmoid only).
        f_divergence: one of ``F_DIVERGENCES`` (see ``f_divergence_scores``).
        f_alpha: the alpha-divergence coefficient.
        pair_weights: per-pair loss weights (WPO: ``wpo_weights`` of chosen times rejected).
        pair_mask: True = real pair.

    Returns:
        ``(loss, metrics)`` with the ``rewards/*`` metrics.

    Raises:
        ValueError: unknown ``loss_type``, ``label_smoothing`` with a non-sigmoid loss, or an
            f-divergence with IPO.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}; expected one of {DPO_LOSS_TYPES}")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError("label_smoothing only applies to loss_type='sigmoid' (cDPO)")
    if f_divergence != "reverse_kl" and loss_type == "ipo":
        raise ValueError(f"f_divergence={f_divergence!r} is not defined for loss_type='ipo'")
    chosen_ratio, rejected_ratio, mask = log_ratios(
        policy_chosen_logps,
        policy_rejected_logps,
        reference_chosen_logps,
        reference_rejected_logps,
        pair_mask,
    )
    scores = functools.partial(f_divergence_scores, f_divergence=f_divergence, alpha=f_alpha)
    h = scores(chosen_ratio) - scores(rejected_ratio)
    if loss_type == "sigmoid":
        losses = smoothed_sigmoid_loss(beta * h, label_smoothing)
    elif loss_type == "ipo":
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = jax.nn.relu(1.0 - beta * h)
    metrics = pair_metrics(beta * chosen_ratio, beta * rejected_ratio, mask)
    return pair_mean(losses, mask, pair_weights), metrics


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
    losses = smoothed_sigmoid_loss(z, label_smoothing)
    return masked_mean(losses, mask), pair_metrics(chosen, rejected, mask)


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
    metrics = pair_metrics(beta * chosen, beta * rejected, mask)
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
    return masked_mean(losses, mask), pair_metrics(chosen, rejected, mask)


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
