"""Implicit Language Q-Learning losses (Snell et al. 2022), as implemented in trlX.

This is trlX's ``ILQLConfig.loss`` (``trlx/models/modeling_ilql.py``) written over arrays. One
row is one trajectory of ``T`` actions (generated tokens) and ``T + 1`` states; state ``t`` is
the prefix before action ``t`` and state ``T`` the prefix after the last action.
``nonterminal_mask [B, T+1]`` is trlX's ``dones`` (despite the name, 1 = *not* done): True
for every state that is followed by a real action, so ``nonterminal_mask[:, :-1]`` is the
action mask and ``nonterminal_mask[:, 1:]`` says whether ``V(s_{t+1})`` is bootstrapped. For
a trajectory of ``n`` actions it is ``[1]*n + [0]*(T+1-n)``.

Every term is a sum over real actions divided by ``max(#actions in batch, 1)`` (trlX's
``n_nonterminal``), i.e. a token mean. Targets are constants: ``Q_target`` (target heads, min
over heads), ``V(s_{t+1})`` in the Q target, and the AWAC weight.

Variant notes (all as trlX, which differs from the paper in places):
* CQL term: plain cross-entropy of the Q-head logits against the taken action,
  ``logsumexp_a Q(s, a) - Q(s, a_t)``, with no extra temperature or weight inside.
* AWAC term: cross-entropy of the *language-model* logits against the taken action weighted
  by ``exp(beta (Q_target - V))``; trlX's default ``beta = 0`` makes it plain behaviour
  cloning on the dataset. The weight is not clipped or normalised.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.losses.common import (
    Metrics,
    Scalar,
    as_float,
    as_mask,
    masked_mean,
    token_logprobs,
)


def _gather(logits: Array, actions: Array) -> Array:
    return jnp.take_along_axis(as_float(logits), actions[..., None], axis=-1, mode="clip")[..., 0]


def ilql_q_loss(
    q: Float[Array, "B T"],
    rewards: Float[Array, "B T"],
    next_values: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    *,
    gamma: float = 0.99,
) -> Scalar:
    """Q regression: ``sum_t m_t (Q(s_t, a_t) - (r_t + gamma V(s_{t+1})))^2 / max(n, 1)``.

    Args:
        q: Q of the taken actions (one head; receives gradients).
        rewards: per-action rewards.
        next_values: ``V(s_{t+1})``, already 0 where ``s_{t+1}`` is terminal (constant).
        mask: True on real actions.
        gamma: discount.

    Returns:
        Scalar loss.
    """
    target = as_float(rewards) + gamma * jax.lax.stop_gradient(as_float(next_values))
    return masked_mean((as_float(q) - target) ** 2, mask)


def ilql_value_loss(
    target_q: Float[Array, "B T"],
    values: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    *,
    tau: float = 0.7,
) -> Scalar:
    """Expectile regression of ``V`` towards the target Q (IQL, Kostrikov et al. 2021).

    ``u = Q_target(s_t, a_t) - V(s_t)``; ``L = sum_t m_t |tau - 1[u < 0]| u^2 / max(n, 1)``,
    i.e. weight ``tau`` when ``Q_target >= V`` and ``1 - tau`` otherwise.

    Args:
        target_q: target-head Q of the taken actions (constant).
        values: ``V(s_t)`` (receives gradients).
        mask: True on real actions.
        tau: expectile; > 0.5 pushes V towards the upper expectile of Q.

    Returns:
        Scalar loss.
    """
    mask = as_mask(mask, jnp.shape(values))
    u = jnp.where(mask, jax.lax.stop_gradient(as_float(target_q)) - as_float(values), 0.0)
    weight = jnp.where(u >= 0, tau, 1.0 - tau)
    return masked_mean(weight * u**2, mask)


def ilql_cql_loss(
    q_logits: Float[Array, "B T V"], actions: Int[Array, "B T"], mask: Bool[Array, "B T"]
) -> Scalar:
    """CQL term as in trlX: ``sum_t m_t (logsumexp_a Q(s_t, a) - Q(s_t, a_t)) / max(n, 1)``.

    Args:
        q_logits: one Q head's values over the vocabulary.
        actions: taken token ids.
        mask: True on real actions.

    Returns:
        Scalar loss.
    """
    return masked_mean(-token_logprobs(q_logits, actions), mask)


def ilql_awac_loss(
    logits: Float[Array, "B T V"],
    actions: Int[Array, "B T"],
    target_q: Float[Array, "B T"],
    values: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    *,
    beta: float = 0.0,
) -> tuple[Scalar, Float[Array, "B T"]]:
    """AWAC-style policy term: ``sum_t m_t w_t CE_t / max(n, 1)``.

    ``CE_t = -log softmax(logits_t)[a_t]`` and ``w_t = exp(beta (Q_target - V))`` (a constant;
    0 where masked).

    Args:
        logits: language-model logits at the action positions (receive gradients).
        actions: taken token ids.
        target_q: target-head Q of the taken actions.
        values: ``V(s_t)``.
        mask: True on real actions.
        beta: advantage temperature; 0 gives behaviour cloning.

    Returns:
        ``(loss, weights)`` with the per-action weights for logging.
    """
    mask = as_mask(mask, actions.shape)
    adv = jnp.where(mask, as_float(target_q) - as_float(values), 0.0)
    weight = jax.lax.stop_gradient(jnp.where(mask, jnp.exp(beta * adv), 0.0))
    return masked_mean(-token_logprobs(logits, actions) * weight, mask), weight


def ilql_loss(
    logits: Float[Array, "B T V"],
    q_logits: Sequence[Float[Array, "B T V"]],
    target_q_logits: Sequence[Float[Array, "B T V"]],
    values: Float[Array, "B T+1"],
    actions: Int[Array, "B T"],
    rewards: Float[Array, "B T"],
    nonterminal_mask: Bool[Array, "B T+1"],
    *,
    gamma: float = 0.99,
    tau: float = 0.7,
    cql_scale: float = 0.1,
    awac_scale: float = 1.0,
    beta: float = 0.0,
) -> tuple[Scalar, Metrics]:
    """Full ILQL loss (trlX ``ILQLConfig.loss``; defaults are trlX's ``default_ilql_config``).

    With ``m = nonterminal_mask[:, :-1]`` (real actions), ``V_t = values[:, t]``,
    ``V'_t = values[:, t+1] * nonterminal_mask[:, t+1]``, ``Q^k_t = q_logits[k][a_t]`` and
    ``Qt_t = min_k target_q_logits[k][a_t]``::

        L_Q    = sum_k ilql_q_loss(Q^k, r, V', m; gamma)
        L_V    = ilql_value_loss(Qt, V, m; tau)
        L_CQL  = sum_k ilql_cql_loss(q_logits[k], a, m)
        L_AWAC = ilql_awac_loss(logits, a, Qt, V, m; beta)
        loss   = L_Q + L_V + cql_scale * L_CQL + awac_scale * L_AWAC

    Args:
        logits: language-model logits at the action positions.
        q_logits: one or two Q heads (trlX ``two_qs``) over the vocabulary.
        target_q_logits: the matching target (Polyak-averaged) heads; treated as constants.
        values: ``V(s_t)`` for the ``T + 1`` states.
        actions: taken token ids.
        rewards: per-action rewards (trlX puts the sequence reward on the last action).
        nonterminal_mask: trlX ``dones``; see the module docstring.
        gamma: discount.
        tau: expectile of the value loss.
        cql_scale: weight of the CQL term.
        awac_scale: weight of the AWAC term.
        beta: AWAC advantage temperature.

    Returns:
        ``(loss, metrics)``; metrics: ``loss/q``, ``loss/v``, ``loss/cql``, ``loss/awac``,
        ``values/mean``, ``qvalues/mean`` (head 0), ``awac_weight/mean``.
    """
    nonterminal = as_mask(nonterminal_mask)
    mask = nonterminal[..., :-1]
    values = as_float(values)
    v = values[..., :-1]
    v_next = jnp.where(nonterminal[..., 1:], values[..., 1:], 0.0)

    qs = [_gather(q, actions) for q in q_logits]
    target_q = jax.lax.stop_gradient(
        jnp.min(jnp.stack([_gather(q, actions) for q in target_q_logits]), axis=0)
    )
    loss_q = sum(ilql_q_loss(q, rewards, v_next, mask, gamma=gamma) for q in qs)
    loss_v = ilql_value_loss(target_q, v, mask, tau=tau)
    loss_cql = sum(ilql_cql_loss(q, actions, mask) for q in q_logits)
    loss_awac, weight = ilql_awac_loss(
        logits, actions, target_q, jax.lax.stop_gradient(v), mask, beta=beta
    )
    loss = loss_q + loss_v + cql_scale * loss_cql + awac_scale * loss_awac
    metrics = {
        "loss/q": loss_q,
        "loss/v": loss_v,
        "loss/cql": loss_cql,
        "loss/awac": loss_awac,
        "values/mean": masked_mean(jax.lax.stop_gradient(v), mask),
        "qvalues/mean": masked_mean(jax.lax.stop_gradient(qs[0]), mask),
        "awac_weight/mean": masked_mean(weight, mask),
    }
    return loss, metrics
