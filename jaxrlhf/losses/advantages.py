"""Advantage estimators, returns, and per-token reward assembly.

Token-level functions take ``[B, T]`` arrays with ``mask`` True on response tokens; the
response may sit anywhere in the row (left padding, right padding, or both). Masked positions
are skipped by the backward recursions: a token's "next" value/advantage is that of the next
*valid* token in the row, and after the last valid token it is 0 (terminal). Masked outputs
are 0. Group-level functions take one score per sequence, ``scores [B]``, where rows are
contiguous groups of ``group_size`` samples of one prompt (prompt ``i`` owns rows
``i*n .. i*n+n-1``), and return one advantage per sequence; spread it over tokens with
``broadcast_sequence_advantages``.

Nothing here calls ``stop_gradient``: these are formulas over rollout data, and the PPO losses
treat advantages and returns as constants.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from jaxrlhf.losses.common import as_float, as_mask, masked_whiten, safe_sqrt


def _reverse_scan(step, init, *xs: Array):
    """Runs ``step`` from the last time index to the first; xs are [..., T], outputs [..., T]."""
    _, ys = jax.lax.scan(step, init, tuple(jnp.moveaxis(x, -1, 0) for x in xs), reverse=True)
    return jnp.moveaxis(ys, 0, -1)


def gae_advantages(
    rewards: Float[Array, "B T"],
    values: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    *,
    gamma: float,
    lam: float,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """Generalised advantage estimation (Schulman et al. 2016), masked.

    Over valid tokens, with ``t+1`` meaning the next valid token of the row::

        delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V(s_t)                      # the value target ("returns")

    ``V`` and ``A`` after the last valid token are 0 (no bootstrap past the response). Masked
    positions get ``A = R = 0`` and are skipped, so the values and rewards there never leak.
    Computed with ``lax.scan`` over reversed time.

    Args:
        rewards: per-token rewards (e.g. from ``token_rewards``).
        values: value predictions ``V(s_t)`` at each token.
        mask: True on response tokens.
        gamma: discount.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, both ``[B, T]``, 0 where masked.
    """
    rewards = as_float(rewards)
    mask = as_mask(mask, rewards.shape)
    rewards = jnp.where(mask, rewards, 0.0)
    values = jnp.where(mask, as_float(values), 0.0)

    def step(carry, x):
        next_value, next_adv = carry
        r, v, m = x
        adv = r + gamma * next_value - v + gamma * lam * next_adv
        # Masked steps pass the carry through untouched and emit 0.
        return (jnp.where(m, v, next_value), jnp.where(m, adv, next_adv)), jnp.where(m, adv, 0.0)

    zeros = jnp.zeros(rewards.shape[:-1], rewards.dtype)
    adv = _reverse_scan(step, (zeros, zeros), rewards, values, mask)
    return adv, jnp.where(mask, adv + values, 0.0)


def discounted_returns(
    rewards: Float[Array, "B T"], mask: Bool[Array, "B T"], *, gamma: float = 1.0
) -> Float[Array, "B T"]:
    """Reward-to-go ``G_t = r_t + gamma * G_{t+1}`` over valid tokens, 0 after the last one.

    Args:
        rewards: per-token rewards.
        mask: True on response tokens; masked positions are skipped and output 0.
        gamma: discount.

    Returns:
        ``[B, T]`` returns.
    """
    rewards = as_float(rewards)
    mask = as_mask(mask, rewards.shape)
    rewards = jnp.where(mask, rewards, 0.0)

    def step(next_ret, x):
        r, m = x
        ret = r + gamma * next_ret
        return jnp.where(m, ret, next_ret), jnp.where(m, ret, 0.0)

    return _reverse_scan(step, jnp.zeros(rewards.shape[:-1], rewards.dtype), rewards, mask)


def _groups(scores: Array, group_size: int, min_size: int = 1) -> Array:
    if group_size < min_size:
        raise ValueError(f"group_size must be >= {min_size}, got {group_size}")
    if scores.shape[-1] % group_size:
        raise ValueError(f"batch {scores.shape[-1]} is not a multiple of group_size {group_size}")
    return as_float(scores).reshape(*scores.shape[:-1], -1, group_size)


def grpo_advantages(
    scores: Float[Array, " B"],
    *,
    group_size: int,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> Float[Array, " B"]:
    """Group-relative advantages (GRPO, Shao et al. 2024).

    For sequence ``i`` in group ``g`` of ``n = group_size`` samples::

        A_i = (s_i - mean_g(s)) / (std_g(s) + eps)     # normalize_std=True
        A_i =  s_i - mean_g(s)                         # normalize_std=False (= Dr.GRPO)

    ``std_g`` is the unbiased (Bessel, ``n - 1``) standard deviation, as in TRL and verl
    (``torch.std``). A group with identical scores gets ``A = 0``.

    Args:
        scores: one scalar reward per sequence, ordered as contiguous groups.
        group_size: ``n``; must divide ``B`` (and be >= 2 when ``normalize_std``).
        normalize_std: divide by the group standard deviation.
        eps: added to the standard deviation.

    Returns:
        ``[B]`` per-sequence advantages.

    Raises:
        ValueError: ``group_size`` does not divide ``B`` or is too small.
    """
    g = _groups(scores, group_size, 2 if normalize_std else 1)
    centred = g - jnp.mean(g, axis=-1, keepdims=True)
    if normalize_std:
        std = safe_sqrt(jnp.sum(centred**2, axis=-1, keepdims=True) / (group_size - 1))
        centred = centred / (std + eps)
    return centred.reshape(scores.shape)


def dr_grpo_advantages(scores: Float[Array, " B"], *, group_size: int) -> Float[Array, " B"]:
    """Dr.GRPO advantages (Liu et al. 2025): ``A_i = s_i - mean_g(s)``, no std division.

    Pair with ``aggregation="token_sum_norm"`` in the policy loss (the other half of Dr.GRPO's
    fix). Same as ``grpo_advantages(..., normalize_std=False)``.

    Args:
        scores: one scalar reward per sequence, ordered as contiguous groups.
        group_size: samples per prompt; must divide ``B``.

    Returns:
        ``[B]`` per-sequence advantages.
    """
    return grpo_advantages(scores, group_size=group_size, normalize_std=False)


def rloo_advantages(scores: Float[Array, " B"], *, group_size: int) -> Float[Array, " B"]:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024).

    Each sample's baseline is the mean of the *other* ``n - 1`` samples of its group::

        A_i = s_i - (sum_{j != i} s_j) / (n - 1) = n / (n - 1) * (s_i - mean_g(s))

    Args:
        scores: one scalar reward per sequence, ordered as contiguous groups.
        group_size: ``n >= 2``; must divide ``B``.

    Returns:
        ``[B]`` per-sequence advantages.
    """
    g = _groups(scores, group_size, 2)
    loo_mean = (jnp.sum(g, axis=-1, keepdims=True) - g) / (group_size - 1)
    return (g - loo_mean).reshape(scores.shape)


def reinforce_pp_advantages(
    rewards: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    *,
    gamma: float = 1.0,
    unbiased: bool = False,
    eps: float = 1e-8,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """REINFORCE++ (Hu 2025; OpenRLHF ``reinforce``): returns, globally batch-normalised.

    ::

        G_t = r_t + gamma * G_{t+1}                     # discounted_returns
        A_t = (G_t - mean(G)) / sqrt(var(G) + eps)     # mean/var over ALL valid tokens of batch

    ``rewards`` are per-token, normally ``token_rewards(score, kl, mask, kl_coef=...)`` so the
    KL penalty sits in the reward. The variance is the biased one (OpenRLHF) unless
    ``unbiased`` (see ``masked_whiten``).

    For **REINFORCE++ with baseline** (OpenRLHF ``reinforce_baseline``), subtract the group
    mean from the scores first: see ``reinforce_pp_baseline_advantages``.

    Args:
        rewards: per-token rewards.
        mask: True on response tokens.
        gamma: discount (1.0 in OpenRLHF).
        unbiased: Bessel's correction in the variance.
        eps: added to the variance.

    Returns:
        ``(advantages, returns)``, both ``[B, T]``, 0 where masked.
    """
    returns = discounted_returns(rewards, mask, gamma=gamma)
    return masked_whiten(returns, mask, unbiased=unbiased, eps=eps), returns


def reinforce_pp_baseline_advantages(
    scores: Float[Array, " B"],
    mask: Bool[Array, "B T"],
    *,
    group_size: int,
    unbiased: bool = False,
    eps: float = 1e-8,
) -> Float[Array, "B T"]:
    """REINFORCE++-baseline: group-mean baseline, then global batch normalisation.

    ::

        b_i = s_i - mean_g(s)                          # per-prompt baseline
        A_t = (b_i - mean(b)) / sqrt(var(b) + eps)     # over ALL valid tokens of the batch

    With the score as the only (terminal) reward and ``gamma = 1`` every token of a sequence
    has return ``b_i``. KL is expected as a loss term (``kl_loss``), as OpenRLHF recommends for
    this estimator. To keep a KL reward penalty instead, compose::

        reinforce_pp_advantages(
            token_rewards(dr_grpo_advantages(scores, group_size=n), kl, mask, kl_coef=c), mask)

    Args:
        scores: one scalar reward per sequence, ordered as contiguous groups.
        mask: True on response tokens.
        group_size: samples per prompt; must divide ``B``.
        unbiased: Bessel's correction in the variance (default biased, as OpenRLHF).
        eps: added to the variance.

    Returns:
        ``[B, T]`` advantages, 0 where masked.
    """
    baselined = dr_grpo_advantages(scores, group_size=group_size)
    tokens = broadcast_sequence_advantages(baselined, mask)
    return masked_whiten(tokens, mask, unbiased=unbiased, eps=eps)


def broadcast_sequence_advantages(
    advantages: Float[Array, " B"], mask: Bool[Array, "B T"]
) -> Float[Array, "B T"]:
    """Spreads one advantage per sequence over its tokens: ``A_bt = A_b`` where ``mask``, else 0.

    Args:
        advantages: per-sequence values.
        mask: True on response tokens.

    Returns:
        ``[B, T]`` per-token advantages.
    """
    mask = as_mask(mask)
    return jnp.where(mask, as_float(advantages)[..., None], 0.0)


def whiten_rewards(
    rewards: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    *,
    shift_mean: bool = False,
    unbiased: bool = False,
    eps: float = 1e-8,
) -> Float[Array, "B T"]:
    """Reward whitening before GAE (TRL ``whiten_rewards``): ``masked_whiten`` over the batch.

    ``r' = (r - mu) / sqrt(var + eps) [+ mu]``; by default the mean is kept
    (``shift_mean=False``) so only the scale changes, which preserves the sign of sparse
    rewards. Statistics are over every valid token of the batch.

    Args:
        rewards: per-token rewards.
        mask: True on response tokens; masked outputs are 0.
        shift_mean: also subtract the mean.
        unbiased: Bessel's correction in the variance (TRL's ``masked_whiten`` applies it;
            the default here is biased, see ``masked_whiten``).
        eps: added to the variance.

    Returns:
        ``[B, T]`` whitened rewards.
    """
    return masked_whiten(rewards, mask, shift_mean=shift_mean, unbiased=unbiased, eps=eps)


def token_rewards(
    score: Float[Array, " B"],
    kl: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    *,
    kl_coef: float | Array,
    clip_reward: float | None = None,
) -> Float[Array, "B T"]:
    """Per-token rewards from a sequence score and a per-token KL (Ziegler et al. 2019).

    ::

        r_t = -kl_coef * kl_t + [t = last valid token] * clip(score, -c, c)

    Positions outside ``mask`` get 0; a row with no valid token gets no score.

    Args:
        score: one reward-model score per sequence.
        kl: per-token KL, e.g. ``kl_penalty(...)``.
        mask: True on response tokens.
        kl_coef: KL coefficient (e.g. ``state.kl_coef`` of a KL controller).
        clip_reward: ``c``; clips the score (trlX ``cliprange_reward``). None: no clipping.

    Returns:
        ``[B, T]`` rewards.
    """
    mask = as_mask(mask)
    score = as_float(score)
    if clip_reward is not None:
        score = jnp.clip(score, -clip_reward, clip_reward)
    t = mask.shape[-1]
    last = t - 1 - jnp.argmax(mask[..., ::-1], axis=-1)  # argmax finds the first True
    is_last = (jnp.arange(t) == last[..., None]) & jnp.any(mask, axis=-1, keepdims=True)
    penalty = -kl_coef * jnp.where(mask, as_float(kl), 0.0)
    return penalty + jnp.where(is_last, score[..., None], 0.0)
