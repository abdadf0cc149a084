"""DPO variants beyond sigmoid / IPO / hinge, as TRL's ``DPOTrainer`` computes them, and WPO.

Every loss takes the four summed response log-probs of ``dpo_loss`` (``[B]`` each; reference
log-probs are constants) and returns ``(loss, metrics)`` with the ``rewards/*`` metrics, where
the implicit reward is ``beta (logp - ref)``. The loss is the mean over real pairs
(``pair_mask``; 0 if there are none) of the per-pair losses below, each multiplied by the
constant ``pair_weights`` when given (WPO), as TRL does (no renormalisation by the weights).

Notation: ``c = logp_c - ref_c`` and ``r = logp_r - ref_r`` are the log-ratios; ``s_c`` and
``s_r`` their ``f_divergence_scores`` (``c`` and ``r`` for the default reverse KL), where TRL
applies an f-divergence; ``h = s_c - s_r``; ``sigma`` the logistic function. Each docstring
names the TRL ``loss_type``.

Two losses couple the pairs of a batch: ``bco_pair_loss``'s batch baseline and the AOT losses'
sort. On a batch split into micro-batches (gradient accumulation) they are computed per
micro-batch, so the accumulated loss is not the full-batch value.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.losses.common import Metrics, Scalar, as_float, as_mask, masked_mean
from jaxrlhf.losses.preference import (
    f_divergence_scores,
    log_ratios,
    pair_mean,
    pair_metrics,
    smoothed_sigmoid_loss,
)

PairLogps = Float[Array, " B"]
PairMask = Bool[Array, " B"] | None
PairWeights = Float[Array, " B"] | None
# (c, r, s_c, s_r) -> per-pair loss [B]
_PerPair = Callable[[Array, Array, Array, Array], Array]


def _paired(
    logps: tuple[Array, Array, Array, Array],
    per_pair: _PerPair,
    *,
    beta: float,
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
    pair_weights: Array | None = None,
    pair_mask: Array | None = None,
) -> tuple[Scalar, Metrics]:
    c, r, mask = log_ratios(*logps, pair_mask)
    scores = functools.partial(f_divergence_scores, f_divergence=f_divergence, alpha=f_alpha)
    losses = per_pair(c, r, scores(c), scores(r))
    return pair_mean(losses, mask, pair_weights), pair_metrics(beta * c, beta * r, mask)


def robust_dpo_loss(
    policy_chosen_logps: PairLogps,
    policy_rejected_logps: PairLogps,
    reference_chosen_logps: PairLogps,
    reference_rejected_logps: PairLogps,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.1,
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
    pair_weights: PairWeights = None,
    pair_mask: PairMask = None,
) -> tuple[Scalar, Metrics]:
    """Robust DPO (Chowdhury et al. 2024), TRL ``loss_type="robust"``: unbiased under label noise.

    With ``e`` the probability that a preference label is flipped::

        loss = (-(1 - e) log sigma(beta h) + e log sigma(-beta h)) / (1 - 2 e)

    Unlike cDPO (``dpo_loss`` with ``label_smoothing``), the flipped term enters with a plus
    sign, so the expected loss under noisy labels equals the clean DPO loss. ``e = 0`` is DPO.

    Args:
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps,
        reference_rejected_logps: summed response log-probs, as for ``dpo_loss``.
        beta: inverse temperature.
        label_smoothing: ``e`` in [0, 0.5) (the paper and TRL's docs suggest 0.1).
        f_divergence, f_alpha: see ``f_divergence_scores``.
        pair_weights: constant per-pair weights (WPO), or None.
        pair_mask: True = real pair.

    Returns:
        ``(loss, metrics)``.

    Raises:
        ValueError: ``label_smoothing`` outside [0, 0.5) (TRL only warns).
    """
    e = label_smoothing
    if not 0.0 <= e < 0.5:
        raise ValueError(f"label_smoothing={e}: robust DPO needs 0 <= e < 0.5")

    def per_pair(c, r, s_c, s_r):
        z = beta * (s_c - s_r)
        return (-(1 - e) * jax.nn.log_sigmoid(z) + e * jax.nn.log_sigmoid(-z)) / (1 - 2 * e)

    return _paired(
        (
            policy_chosen_logps,
            policy_rejected_logps,
            reference_chosen_logps,
            reference_rejected_logps,
        ),
        per_pair,
        beta=beta,
        f_divergence=f_divergence,
        f_alpha=f_alpha,
        pair_weights=pair_weights,
        pair_mask=pair_mask,
    )


def bco_pair_loss(
    policy_chosen_logps: PairLogps,
    policy_rejected_logps: PairLogps,
    reference_chosen_logps: PairLogps,
    reference_rejected_logps: PairLogps,
    *,
    beta: float = 0.1,
    baseline: str | float | Array = "batch",
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
    pair_weights: PairWeights = None,
    pair_mask: PairMask = None,
) -> tuple[Scalar, Metrics]:
    """Pairwise BCO (Jung et al. 2024), TRL ``loss_type="bco_pair"``: a binary classifier.

    Chosen responses are classified as good and rejected ones as bad, around a reward
    baseline ``delta`` (a constant)::

        loss = -log sigma(beta s_c - delta) - log sigma(-(beta s_r - delta))

    ``baseline``: ``"batch"`` (default) uses ``delta = mean(beta s_c, beta s_r)`` over the real
    pairs of this batch; a number or scalar array is used as given. TRL before its DPO
    refactor (#3906) kept a running mean of those batch means (``RunningMoments``), whose first
    value is this batch mean; to reproduce it, keep the running mean in your train state and
    pass it here. TRL since #3906 uses no baseline: pass ``baseline=0.0``.

    Args:
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps,
        reference_rejected_logps: summed response log-probs, as for ``dpo_loss``.
        beta: reward scale.
        baseline: ``"batch"`` or the value of ``delta``.
        f_divergence, f_alpha: see ``f_divergence_scores``.
        pair_weights: constant per-pair weights (WPO), or None.
        pair_mask: True = real pair.

    Returns:
        ``(loss, metrics)``, plus ``bco/baseline`` (``delta``).

    Raises:
        ValueError: a string ``baseline`` other than ``"batch"``.
    """
    if isinstance(baseline, str) and baseline != "batch":
        raise ValueError(f"baseline={baseline!r}; expected 'batch' or a number")
    logps = (
        policy_chosen_logps,
        policy_rejected_logps,
        reference_chosen_logps,
        reference_rejected_logps,
    )
    c, r, mask = log_ratios(*logps, pair_mask)
    scores = functools.partial(f_divergence_scores, f_divergence=f_divergence, alpha=f_alpha)
    chosen, rejected = beta * scores(c), beta * scores(r)
    if isinstance(baseline, str):
        delta = (masked_mean(chosen, mask) + masked_mean(rejected, mask)) / 2.0
    else:
        delta = as_float(baseline)
    delta = jax.lax.stop_gradient(delta)
    losses = -jax.nn.log_sigmoid(chosen - delta) - jax.nn.log_sigmoid(-(rejected - delta))
    metrics = pair_metrics(beta * c, beta * r, mask)
    metrics["bco/baseline"] = delta
    return pair_mean(losses, mask, pair_weights), metrics


def nca_pair_loss(
    policy_chosen_logps: PairLogps,
    policy_rejected_logps: PairLogps,
    reference_chosen_logps: PairLogps,
    reference_rejected_logps: PairLogps,
    *,
    beta: float = 0.1,
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
    pair_weights: PairWeights = None,
    pair_mask: PairMask = None,
) -> tuple[Scalar, Metrics]:
    """Pairwise NCA (Chen et al. 2024, noise contrastive alignment), TRL ``"nca_pair"``.

    Optimises absolute likelihoods, not only the margin, so the chosen log-prob cannot fall
    with the rejected one::

        loss = -log sigma(beta s_c) - 1/2 log sigma(-beta s_c) - 1/2 log sigma(-beta s_r)

    Args:
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps,
        reference_rejected_logps: summed response log-probs, as for ``dpo_loss``.
        beta: reward scale.
        f_divergence, f_alpha: see ``f_divergence_scores``.
        pair_weights: constant per-pair weights (WPO), or None.
        pair_mask: True = real pair.

    Returns:
        ``(loss, metrics)``.
    """

    def per_pair(c, r, s_c, s_r):
        lsig = jax.nn.log_sigmoid
        return -lsig(beta * s_c) - 0.5 * lsig(-beta * s_c) - 0.5 * lsig(-beta * s_r)

    return _paired(
        (
            policy_chosen_logps,
            policy_rejected_logps,
            reference_chosen_logps,
            reference_rejected_logps,
        ),
        per_pair,
        beta=beta,
        f_divergence=f_divergence,
        f_alpha=f_alpha,
        pair_weights=pair_weights,
        pair_mask=pair_mask,
    )


def apo_zero_loss(
    policy_chosen_logps: PairLogps,
    policy_rejected_logps: PairLogps,
    reference_chosen_logps: PairLogps,
    reference_rejected_logps: PairLogps,
    *,
    beta: float = 0.1,
    pair_weights: PairWeights = None,
    pair_mask: PairMask = None,
) -> tuple[Scalar, Metrics]:
    """APO-zero (D'Oosterlinck et al. 2024, Eq. 7), TRL ``"apo_zero"``.

    For chosen responses better than the model's own outputs: raise the chosen likelihood
    and lower the rejected one, each against the reference::

        loss = (1 - sigma(beta c)) + sigma(beta r)

    Uses the log-ratios ``c, r`` themselves: TRL applies no f-divergence here.

    Args:
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps,
        reference_rejected_logps: summed response log-probs, as for ``dpo_loss``.
        beta: reward scale.
        pair_weights: constant per-pair weights (WPO), or None.
        pair_mask: True = real pair.

    Returns:
        ``(loss, metrics)``.
    """
    return _paired(
        (
            policy_chosen_logps,
            policy_rejected_logps,
            reference_chosen_logps,
            reference_rejected_logps,
        ),
        lambda c, r, s_c, s_r: (1.0 - jax.nn.sigmoid(beta * c)) + jax.nn.sigmoid(beta * r),
        beta=beta,
        pair_weights=pair_weights,
        pair_mask=pair_mask,
    )


def apo_down_loss(
    policy_chosen_logps: PairLogps,
    policy_rejected_logps: PairLogps,
    reference_chosen_logps: PairLogps,
    reference_rejected_logps: PairLogps,
    *,
    beta: float = 0.1,
    pair_weights: PairWeights = None,
    pair_mask: PairMask = None,
) -> tuple[Scalar, Metrics]:
    """APO-down (D'Oosterlinck et al. 2024, Eq. 8), TRL ``"apo_down"``.

    For chosen responses worse than the model's own outputs: lower the chosen likelihood,
    and the rejected one more::

        loss = sigma(beta c) + (1 - sigma(beta (c - r)))

    No f-divergence: TRL applies one to the second term only (through its ``delta_score``),
    which mixes two definitions; use reverse KL, or ``f_divergence_scores`` yourself.

    Args:
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps,
        reference_rejected_logps: summed response log-probs, as for ``dpo_loss``.
        beta: reward scale.
        pair_weights: constant per-pair weights (WPO), or None.
        pair_mask: True = real pair.

    Returns:
        ``(loss, metrics)``.
    """
    return _paired(
        (
            policy_chosen_logps,
            policy_rejected_logps,
            reference_chosen_logps,
            reference_rejected_logps,
        ),
        lambda c, r, s_c, s_r: jax.nn.sigmoid(beta * c) + (1.0 - jax.nn.sigmoid(beta * (c - r))),
        beta=beta,
        pair_weights=pair_weights,
        pair_mask=pair_mask,
    )


def exo_pair_loss(
    policy_chosen_logps: PairLogps,
    policy_rejected_logps: PairLogps,
    reference_chosen_logps: PairLogps,
    reference_rejected_logps: PairLogps,
    *,
    beta: float = 0.1,
    label_smoothing: float = 1e-3,
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
    pair_weights: PairWeights = None,
    pair_mask: PairMask = None,
) -> tuple[Scalar, Metrics]:
    """EXO-pref (Ji et al. 2024, Eq. 16, K = 2), TRL ``"exo_pair"``: reverse KL to smoothed labels.

    ``KL(q || p)`` between the policy's preference ``q = (sigma(beta h), sigma(-beta h))`` and
    the smoothed label ``p = (1 - e, e)``::

        loss = q_w (log q_w - log(1 - e)) + q_l (log q_l - log e)

    with ``q_w = sigma(beta h)``, ``q_l = sigma(-beta h)``. It is mode-seeking where DPO (the
    forward KL) is mean-seeking; ``e > 0`` keeps ``log e`` finite.

    Args:
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps,
        reference_rejected_logps: summed response log-probs, as for ``dpo_loss``.
        beta: inverse temperature.
        label_smoothing: ``e`` in (0, 1); the paper recommends 1e-3.
        f_divergence, f_alpha: see ``f_divergence_scores``.
        pair_weights: constant per-pair weights (WPO), or None.
        pair_mask: True = real pair.

    Returns:
        ``(loss, metrics)``.

    Raises:
        ValueError: ``label_smoothing`` outside (0, 1) (TRL also rejects 0).
    """
    e = label_smoothing
    if not 0.0 < e < 1.0:
        raise ValueError(f"label_smoothing={e}: EXO needs 0 < e < 1 (the paper uses 1e-3)")

    def per_pair(c, r, s_c, s_r):
        z = beta * (s_c - s_r)
        log_qw, log_ql = jax.nn.log_sigmoid(z), jax.nn.log_sigmoid(-z)
        return jnp.exp(log_qw) * (log_qw - jnp.log1p(-e)) + jnp.exp(log_ql) * (log_ql - jnp.log(e))

    return _paired(
        (
            policy_chosen_logps,
            policy_rejected_logps,
            reference_chosen_logps,
            reference_rejected_logps,
        ),
        per_pair,
        beta=beta,
        f_divergence=f_divergence,
        f_alpha=f_alpha,
        pair_weights=pair_weights,
        pair_mask=pair_mask,
    )


def sppo_hard_loss(
    policy_chosen_logps: PairLogps,
    policy_rejected_logps: PairLogps,
    reference_chosen_logps: PairLogps,
    reference_rejected_logps: PairLogps,
    *,
    beta: float = 0.1,
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
    pair_weights: PairWeights = None,
    pair_mask: PairMask = None,
) -> tuple[Scalar, Metrics]:
    """SPPO with hard labels (Wu et al. 2024, Eq. 4.7 with P = 1 / 0), TRL ``"sppo_hard"``.

    Regresses each log-ratio on its target, ``+1/(2 beta)`` for the winner and ``-1/(2 beta)``
    for the loser (``eta = 1 / beta`` in the paper)::

        loss = (s_c - 1 / (2 beta))^2 + (s_r + 1 / (2 beta))^2

    The paper's soft version estimates P with a preference model outside the trainer.

    Args:
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps,
        reference_rejected_logps: summed response log-probs, as for ``dpo_loss``.
        beta: sets the targets.
        f_divergence, f_alpha: see ``f_divergence_scores``.
        pair_weights: constant per-pair weights (WPO), or None.
        pair_mask: True = real pair.

    Returns:
        ``(loss, metrics)``.
    """
    target = 0.5 / beta
    return _paired(
        (
            policy_chosen_logps,
            policy_rejected_logps,
            reference_chosen_logps,
            reference_rejected_logps,
        ),
        lambda c, r, s_c, s_r: (s_c - target) ** 2 + (s_r + target) ** 2,
        beta=beta,
        f_divergence=f_divergence,
        f_alpha=f_alpha,
        pair_weights=pair_weights,
        pair_mask=pair_mask,
    )


def _aot(
    logps: tuple[Array, Array, Array, Array],
    unpaired: bool,
    beta: float,
    label_smoothing: float,
    pair_mask: Array | None,
) -> tuple[Scalar, Metrics]:
    c, r, mask = log_ratios(*logps, pair_mask)
    if unpaired:
        first, second = c, r
    else:
        pc, pr, rc, rr = (as_float(x) for x in logps)
        first, second = pc - pr, jax.lax.stop_gradient(rc - rr)
    # Slot k < n (n real pairs) holds the k-th smallest real value of each: padding is set to
    # +inf so that it sorts last, and is replaced with 0 before any arithmetic.
    ranked = jnp.arange(c.shape[-1]) < jnp.sum(mask)

    def ranks(x):
        return jnp.where(ranked, jnp.sort(jnp.where(mask, x, jnp.inf)), 0.0)

    delta = ranks(first) - ranks(second)
    losses = smoothed_sigmoid_loss(beta * delta, label_smoothing)
    return masked_mean(losses, ranked), pair_metrics(beta * c, beta * r, mask)


def aot_loss(
    policy_chosen_logps: PairLogps,
    policy_rejected_logps: PairLogps,
    reference_chosen_logps: PairLogps,
    reference_rejected_logps: PairLogps,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    pair_mask: PairMask = None,
) -> tuple[Scalar, Metrics]:
    """AOT for paired data (Melnyk et al. 2024, alignment via optimal transport), TRL ``"aot"``.

    Makes the policy's chosen-minus-rejected margin distribution dominate the reference's
    (first-order stochastic dominance), through their sorted samples over the batch::

        d_(k) = sort_k(logp_c - logp_r) - sort_k(ref_c - ref_r)
        loss  = mean_k [-(1 - e) log sigma(beta d_(k)) - e log sigma(-beta d_(k))]

    The k-th smallest margins are compared, whichever pairs they come from, so the loss
    couples the whole batch. No ``pair_weights``: the sort would misalign per-pair weights
    (TRL refuses them too).

    Args:
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps,
        reference_rejected_logps: summed response log-probs, as for ``dpo_loss``.
        beta: inverse temperature.
        label_smoothing: ``e``.
        pair_mask: True = real pair (padding is sorted out, not compared).

    Returns:
        ``(loss, metrics)``.
    """
    logps = (
        policy_chosen_logps,
        policy_rejected_logps,
        reference_chosen_logps,
        reference_rejected_logps,
    )
    return _aot(logps, False, beta, label_smoothing, pair_mask)


def aot_unpaired_loss(
    policy_chosen_logps: PairLogps,
    policy_rejected_logps: PairLogps,
    reference_chosen_logps: PairLogps,
    reference_rejected_logps: PairLogps,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    pair_mask: PairMask = None,
) -> tuple[Scalar, Metrics]:
    """AOT for unpaired data (Melnyk et al. 2024), TRL ``"aot_unpaired"`` (``"aot_pair"`` before
    TRL #5038 renamed it).

    Makes the distribution of chosen log-ratios dominate that of rejected ones; the two sets
    need not come in pairs::

        d_(k) = sort_k(c) - sort_k(r)
        loss  = mean_k [-(1 - e) log sigma(beta d_(k)) - e log sigma(-beta d_(k))]

    Couples the whole batch like ``aot_loss``; no ``pair_weights``.

    Args:
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps,
        reference_rejected_logps: summed response log-probs, as for ``dpo_loss``.
        beta: inverse temperature.
        label_smoothing: ``e``.
        pair_mask: True = real entry (padding is sorted out, not compared).

    Returns:
        ``(loss, metrics)``.
    """
    logps = (
        policy_chosen_logps,
        policy_rejected_logps,
        reference_chosen_logps,
        reference_rejected_logps,
    )
    return _aot(logps, True, beta, label_smoothing, pair_mask)


def wpo_weights(
    logits: Float[Array, "*B T V"], targets: Int[Array, "*B T"], mask: Bool[Array, "*B T"]
) -> Float[Array, "*B"]:
    """WPO sequence weights (Zhou et al. 2024, Eq. 2, "sampled alignment"), TRL ``use_weighting``.

    How likely the policy is to produce the response itself, per token and normalised by the
    policy's own expected token probability::

        w = exp( (1 / n) sum_t m_t [log p(y_t) - log sum_v p(v)^2] )

    with ``log sum_v p(v)^2 = logsumexp(2 z) - 2 logsumexp(z)`` from the logits ``z`` (float32).
    An empty response gets ``w = 1``. The result is a constant (stop-gradient). A pair's
    weight is ``w_chosen * w_rejected``; pass it as ``pair_weights``. TRL before #3906 also
    capped that product at 1; TRL today does not, nor does this function.

    Args:
        logits: the policy's logits; position ``t`` must already predict ``targets[t]``.
        targets: response token ids (clipped into ``[0, V)``; mask what is not a response).
        mask: True on response tokens.

    Returns:
        One weight per sequence.
    """
    logits = jax.lax.stop_gradient(as_float(logits))
    lse = jax.nn.logsumexp(logits, axis=-1)
    log_sum_sq = jax.nn.logsumexp(2.0 * logits, axis=-1) - 2.0 * lse
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1, mode="clip")[..., 0]
    aligned = picked - lse - log_sum_sq
    return jnp.exp(masked_mean(aligned, as_mask(mask, aligned.shape), axis=-1))
