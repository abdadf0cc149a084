"""KTO (Ethayarajh et al. 2024) on unpaired desirable / undesirable examples, as TRL computes it.

Inputs are one value per example, ``[B]``: the summed response log-prob under the policy and
the reference, and a bool ``desirable`` label (TRL's ``label``). KTO's reference point
``z0`` is estimated from *mismatched* examples: TRL pairs prompt ``i`` with the completion of
example ``i - 1`` (a cyclic shift of the completions, in dataset order) and scores those
sequences with both models; ``policy_kl_logps`` / ``reference_kl_logps`` are their summed
completion log-probs.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from jaxrlhf.losses.common import Metrics, Scalar, as_float, as_mask, masked_mean

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


def kto_kl_reference_point(
    policy_kl_logps: Float[Array, " B"],
    reference_kl_logps: Float[Array, " B"],
    *,
    example_mask: Bool[Array, " B"] | None = None,
) -> Scalar:
    """KTO's reference point: ``z0 = max(mean_i (logp_kl_i - ref_kl_i), 0)``, a constant.

    A batch estimate of ``KL(pi || pi_ref)`` from mismatched (prompt, completion) pairs, as
    TRL's ``KTOTrainer``: the mean over the batch's real examples, clamped at 0 and
    stop-gradiented. TRL averages per-process means; over one global batch (as under
    ``jax.jit``) that is the same number when processes hold equal numbers of examples.

    Args:
        policy_kl_logps: policy log-prob of each mismatched completion (summed).
        reference_kl_logps: reference log-prob of the same.
        example_mask: True = real example; None = all.

    Returns:
        Scalar ``z0 >= 0`` (0 when no example is real).
    """
    diff = as_float(policy_kl_logps) - as_float(reference_kl_logps)
    mask = jnp.ones(diff.shape, bool) if example_mask is None else as_mask(example_mask, diff.shape)
    return jax.lax.stop_gradient(jnp.maximum(masked_mean(diff, mask), 0.0))


def kto_loss(
    policy_logps: Float[Array, " B"],
    reference_logps: Float[Array, " B"],
    desirable: Bool[Array, " B"],
    policy_kl_logps: Float[Array, " B"] | None = None,
    reference_kl_logps: Float[Array, " B"] | None = None,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
    example_mask: Bool[Array, " B"] | None = None,
) -> tuple[Scalar, Metrics]:
    """KTO loss (TRL ``KTOTrainer``, ``loss_type="kto"``) and its APO-zero unpaired variant.

    With ``x_i = logp_i - ref_i`` and ``z0 = kto_kl_reference_point(...)``::

        kto, desirable:            l_i = 1 - sigma(beta (x_i - z0))
        kto, undesirable:          l_i = 1 - sigma(beta (z0 - x_i))
        apo_zero_unpaired, desir.: l_i = 1 - sigma(beta x_i)       # no z0
        apo_zero_unpaired, undes.: l_i = sigma(beta x_i)
        loss = mean_i lambda_i l_i  over real examples

    with ``lambda = desirable_weight`` or ``undesirable_weight``. As TRL, the loss is a plain
    mean over all examples (not normalised by the weights); TRL suggests weights such that
    ``lambda_D n_D / (lambda_U n_U)`` lies in [1, 4/3].

    Args:
        policy_logps: policy log-prob of each example's completion (summed).
        reference_logps: reference log-prob of the same.
        desirable: True = desirable (chosen), False = undesirable (rejected).
        policy_kl_logps: policy log-prob of the mismatched completions (``kto`` only).
        reference_kl_logps: reference log-prob of the mismatched completions (``kto`` only).
        beta: reward scale.
        desirable_weight: ``lambda_D``.
        undesirable_weight: ``lambda_U``.
        loss_type: one of ``KTO_LOSS_TYPES``.
        example_mask: True = real example; None = all.

    Returns:
        ``(loss, metrics)``: ``rewards/chosen`` and ``rewards/rejected`` (mean ``beta x`` over
        the desirable / undesirable real examples; 0 if there are none), ``rewards/margin``
        (their difference) and ``kto/kl`` (``z0``; 0 for ``apo_zero_unpaired``).

    Raises:
        ValueError: unknown ``loss_type``, or ``kto`` without the mismatched log-probs.
    """
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}; expected one of {KTO_LOSS_TYPES}")
    x = as_float(policy_logps) - jax.lax.stop_gradient(as_float(reference_logps))
    mask = jnp.ones(x.shape, bool) if example_mask is None else as_mask(example_mask, x.shape)
    x = jnp.where(mask, x, 0.0)
    good = as_mask(desirable, x.shape)
    if loss_type == "kto":
        if policy_kl_logps is None or reference_kl_logps is None:
            raise ValueError("loss_type='kto' needs policy_kl_logps and reference_kl_logps")
        z0 = kto_kl_reference_point(policy_kl_logps, reference_kl_logps, example_mask=mask)
        losses = 1.0 - jax.nn.sigmoid(beta * jnp.where(good, x - z0, z0 - x))
    else:
        z0 = jnp.zeros((), x.dtype)
        losses = jnp.where(good, 1.0 - jax.nn.sigmoid(beta * x), jax.nn.sigmoid(beta * x))
    losses = jnp.where(good, desirable_weight, undesirable_weight) * losses
    rewards = jax.lax.stop_gradient(beta * x)
    chosen = masked_mean(rewards, mask & good)
    rejected = masked_mean(rewards, mask & ~good)
    metrics = {
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/margin": chosen - rejected,
        "kto/kl": z0,
    }
    return masked_mean(losses, mask), metrics
