"""Advantage estimators, returns and reward assembly vs NumPy loop references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import losses
from tests.losses.utils import assert_close, check_transforms, garbage_like, make_mask

B, T, N = 6, 7, 3  # 2 prompts x 3 samples


# ----------------------------------------------------------------------------- references
def ref_gae(r, v, mask, gamma, lam):
    """Loop GAE over the valid tokens of each row, in order; the value after the last is 0."""
    adv, ret = np.zeros(r.shape), np.zeros(r.shape)
    for b in range(r.shape[0]):
        idx = [t for t in range(r.shape[1]) if mask[b, t]]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(idx):
            delta = r[b, t] + gamma * next_value - v[b, t]
            adv[b, t] = delta + gamma * lam * next_adv
            ret[b, t] = adv[b, t] + v[b, t]
            next_value, next_adv = v[b, t], adv[b, t]
    return adv, ret


def ref_returns(r, mask, gamma):
    out = np.zeros(r.shape)
    for b in range(r.shape[0]):
        g = 0.0
        for t in reversed(range(r.shape[1])):
            if mask[b, t]:
                g = r[b, t] + gamma * g
                out[b, t] = g
    return out


def ref_global_whiten(x, mask, eps, shift_mean=True, ddof=0):
    vals = x[mask].astype(np.float64)
    mu, var = vals.mean(), vals.var(ddof=ddof)
    out = (x - mu) / np.sqrt(var + eps) + (0.0 if shift_mean else mu)
    return np.where(mask, out, 0.0)


def ref_group(scores, n, kind, eps=1e-6):
    out = np.zeros(len(scores))
    for start in range(0, len(scores), n):
        g = [float(s) for s in scores[start : start + n]]
        mean = sum(g) / n
        std = (sum((s - mean) ** 2 for s in g) / (n - 1)) ** 0.5 if n > 1 else 0.0
        for i, s in enumerate(g):
            if kind == "grpo":
                out[start + i] = (s - mean) / (std + eps)
            elif kind == "dr_grpo":
                out[start + i] = s - mean
            else:  # rloo
                out[start + i] = s - (sum(g) - s) / (n - 1)
    return out


def _token_inputs(seed, holes=False):
    rng = np.random.default_rng(seed)
    mask = make_mask(rng, B, T, holes=holes)
    rewards = rng.normal(size=(B, T)).astype(np.float32)
    values = rng.normal(size=(B, T)).astype(np.float32)
    return rewards, values, mask


# ----------------------------------------------------------------------------- GAE / returns
@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_reference(holes):
    r, v, mask = _token_inputs(0, holes)
    fn = jax.jit(lambda *a: losses.gae_advantages(*a, gamma=0.95, lam=0.9))
    adv, ret = fn(r, v, mask)
    ref_adv, ref_ret = ref_gae(r, v, mask, 0.95, 0.9)
    assert_close(adv, ref_adv)
    assert_close(ret, ref_ret)
    # Values and rewards outside the mask (before or after the response) never leak.
    rng = np.random.default_rng(1)
    adv2, ret2 = fn(garbage_like(rng, r, mask), garbage_like(rng, v, mask), mask)
    assert_close(adv2, adv)
    assert_close(ret2, ret)
    check_transforms(
        lambda *a: losses.gae_advantages(*a, gamma=0.95, lam=0.9),
        (r, v, mask),
        _token_inputs(2, holes),
        grad_argnums=(0, 1),
    )


def test_gae_hand_cases():
    # gamma 0.9, lambda 0.8 (gamma * lambda = 0.72).
    # Row 0, all valid, r = [0, 0, 1], V = 0: delta = [0, 0, 1]; A_2 = 1, A_1 = 0.72,
    #   A_0 = 0.5184; returns = A + V = A.
    # Row 1, mask [1, 1, 0], r = [0, 1, 5], V = [0.5, 0.5, 9] (position 2 is padding):
    #   t=1: delta = 1 + 0.9 * 0 - 0.5 = 0.5 (no bootstrap past the last valid token), A = 0.5
    #   t=0: delta = 0 + 0.9 * 0.5 - 0.5 = -0.05, A = -0.05 + 0.72 * 0.5 = 0.31
    #   returns = [0.81, 1.0, 0].
    rewards = jnp.array([[0.0, 0.0, 1.0], [0.0, 1.0, 5.0]])
    values = jnp.array([[0.0, 0.0, 0.0], [0.5, 0.5, 9.0]])
    mask = jnp.array([[1, 1, 1], [1, 1, 0]])
    adv, ret = losses.gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    assert_close(adv, [[0.5184, 0.72, 1.0], [0.31, 0.5, 0.0]])
    assert_close(ret, [[0.5184, 0.72, 1.0], [0.81, 1.0, 0.0]])


def test_discounted_returns_matches_reference_and_hand_case():
    r, _, mask = _token_inputs(3, holes=True)
    fn = jax.jit(lambda r, m: losses.discounted_returns(r, m, gamma=0.9))
    assert_close(fn(r, mask), ref_returns(r, mask, 0.9))
    # r = [1, 2, (pad 7)], gamma 0.5: G_1 = 2, G_0 = 1 + 0.5 * 2 = 2.
    out = losses.discounted_returns(jnp.array([[1.0, 2.0, 7.0]]), jnp.array([[1, 1, 0]]), gamma=0.5)
    assert_close(out, [[2.0, 2.0, 0.0]])


# ----------------------------------------------------------------------------- group advantages
def _scores(seed):
    return np.random.default_rng(seed).normal(size=B).astype(np.float32)


@pytest.mark.parametrize(
    "kind, fn",
    [
        ("grpo", lambda s: losses.grpo_advantages(s, group_size=N)),
        ("dr_grpo", lambda s: losses.dr_grpo_advantages(s, group_size=N)),
        ("dr_grpo", lambda s: losses.grpo_advantages(s, group_size=N, normalize_std=False)),
        ("rloo", lambda s: losses.rloo_advantages(s, group_size=N)),
    ],
)
def test_group_advantages_match_reference(kind, fn):
    scores = _scores(4)
    assert_close(jax.jit(fn)(scores), ref_group(scores, N, kind))
    check_transforms(fn, (scores,), (_scores(5),))


def test_group_advantages_hand_cases():
    # Groups of 2: [1, 0] and [0, 1]. Mean 0.5 each; unbiased std = sqrt(0.5) = 0.707107.
    #   GRPO    = +-0.5 / (0.707107 + 1e-6) = +-0.7071058
    #   Dr.GRPO = +-0.5
    #   RLOO    = s_i - s_other = +-1
    s = jnp.array([1.0, 0.0, 0.0, 1.0])
    g = 0.5 / (np.sqrt(0.5) + 1e-6)
    assert_close(losses.grpo_advantages(s, group_size=2), [g, -g, -g, g])
    assert_close(losses.dr_grpo_advantages(s, group_size=2), [0.5, -0.5, -0.5, 0.5])
    assert_close(losses.rloo_advantages(s, group_size=2), [1.0, -1.0, -1.0, 1.0])
    # One group of 3, [3, 0, 0]: RLOO = [3 - 0, 0 - 1.5, 0 - 1.5] = [3, -1.5, -1.5]
    # (= 3/2 * (s - 1)).
    assert_close(losses.rloo_advantages(jnp.array([3.0, 0.0, 0.0]), group_size=3), [3, -1.5, -1.5])


def test_grpo_identical_scores_give_zero_with_finite_grad():
    s = jnp.ones(4)
    adv, grad = jax.jit(
        jax.value_and_grad(lambda s: losses.grpo_advantages(s, group_size=2).sum())
    )(s)
    assert float(adv) == 0.0 and np.all(np.isfinite(np.asarray(grad)))
    assert_close(losses.grpo_advantages(s, group_size=2), np.zeros(4))


def test_group_advantages_validate_group_size():
    with pytest.raises(ValueError, match="multiple"):
        losses.grpo_advantages(jnp.zeros(5), group_size=2)
    with pytest.raises(ValueError, match=">= 2"):
        losses.rloo_advantages(jnp.zeros(4), group_size=1)
    with pytest.raises(ValueError, match=">= 2"):
        losses.grpo_advantages(jnp.zeros(4), group_size=1)
    # Without std normalisation a group of one is allowed (advantage 0).
    assert_close(losses.dr_grpo_advantages(jnp.arange(3.0), group_size=1), np.zeros(3))


def test_broadcast_sequence_advantages():
    # [2, -1] over mask [[1, 0, 1], [0, 0, 0]] -> [[2, 0, 2], [0, 0, 0]].
    out = losses.broadcast_sequence_advantages(
        jnp.array([2.0, -1.0]), jnp.array([[1, 0, 1], [0, 0, 0]])
    )
    assert_close(out, [[2.0, 0.0, 2.0], [0.0, 0.0, 0.0]])


# ----------------------------------------------------------------------------- REINFORCE++
def test_reinforce_pp_matches_reference():
    r, _, mask = _token_inputs(6)
    fn = jax.jit(lambda r, m: losses.reinforce_pp_advantages(r, m, gamma=0.99))
    adv, ret = fn(r, mask)
    expected_ret = ref_returns(r, mask, 0.99)
    assert_close(ret, expected_ret)
    assert_close(adv, ref_global_whiten(expected_ret, mask, 1e-8))
    rng = np.random.default_rng(7)
    assert_close(fn(garbage_like(rng, r, mask), mask)[0], adv)
    check_transforms(
        lambda r, m: losses.reinforce_pp_advantages(r, m), (r, mask), _token_inputs(8)[::2]
    )


def test_reinforce_pp_hand_case():
    # Terminal rewards 1 and 3, gamma 1: returns [[1, 1], [3, 3]]; mean 2, var 1,
    # so advantages = (G - 2) / sqrt(1 + 1e-8) = [[-1, -1], [1, 1]].
    adv, _ = losses.reinforce_pp_advantages(jnp.array([[0.0, 1.0], [0.0, 3.0]]), jnp.ones((2, 2)))
    assert_close(adv, [[-1.0, -1.0], [1.0, 1.0]])


def test_reinforce_pp_baseline_matches_reference():
    scores = _scores(9)
    mask = make_mask(np.random.default_rng(10), B, T)
    fn = jax.jit(lambda s, m: losses.reinforce_pp_baseline_advantages(s, m, group_size=N))
    baselined = ref_group(scores, N, "dr_grpo")
    expected = ref_global_whiten(np.where(mask, baselined[:, None], 0.0), mask, 1e-8)
    assert_close(fn(scores, mask), expected)
    check_transforms(
        lambda s, m: losses.reinforce_pp_baseline_advantages(s, m, group_size=N),
        (scores, mask),
        (_scores(11), mask),
    )


def test_reinforce_pp_baseline_hand_case():
    # One group of 2 with scores [2, 0]: baselined [1, -1]. Tokens: row 0 has 1 token, row 1
    # has 3 -> values [1, -1, -1, -1]: mean -0.5, var 0.75, so A = [1.5, -0.5] / sqrt(0.75)
    # = [1.732051, -0.577350].
    mask = jnp.array([[1, 0, 0], [1, 1, 1]])
    out = losses.reinforce_pp_baseline_advantages(jnp.array([2.0, 0.0]), mask, group_size=2)
    a, b = 1.5 / np.sqrt(0.75), -0.5 / np.sqrt(0.75)
    assert_close(out, [[a, 0, 0], [b, b, b]])


# ----------------------------------------------------------------------------- rewards
def test_whiten_rewards_matches_reference():
    r, _, mask = _token_inputs(12, holes=True)
    assert_close(losses.whiten_rewards(r, mask), ref_global_whiten(r, mask, 1e-8, shift_mean=False))
    assert_close(losses.whiten_rewards(r, mask, shift_mean=True), ref_global_whiten(r, mask, 1e-8))


def test_whiten_rewards_hand_case():
    # Rewards [1, 5, (pad 100)]: mean 3, biased var 4. Scale only: (r - 3) / 2 + 3 = [2, 4];
    # with shift_mean: (r - 3) / 2 = [-1, 1]. Padding stays 0.
    r, mask = jnp.array([[1.0, 5.0, 100.0]]), jnp.array([[1, 1, 0]])
    assert_close(losses.whiten_rewards(r, mask), [[2.0, 4.0, 0.0]])
    assert_close(losses.whiten_rewards(r, mask, shift_mean=True), [[-1.0, 1.0, 0.0]])


def ref_token_rewards(score, kl, mask, kl_coef, clip):
    out = np.zeros(kl.shape)
    for b in range(kl.shape[0]):
        valid = [t for t in range(kl.shape[1]) if mask[b, t]]
        for t in valid:
            out[b, t] = -kl_coef * kl[b, t]
        if valid:
            s = score[b] if clip is None else min(max(score[b], -clip), clip)
            out[b, valid[-1]] += s
    return out


@pytest.mark.parametrize("clip", [None, 0.5])
def test_token_rewards_matches_reference(clip):
    rng = np.random.default_rng(13)
    mask = make_mask(rng, B, T, holes=True)
    score = rng.normal(size=B).astype(np.float32)
    kl = rng.normal(size=(B, T)).astype(np.float32)
    fn = jax.jit(lambda *a: losses.token_rewards(*a, kl_coef=0.1, clip_reward=clip))
    expected = ref_token_rewards(score, kl, mask, 0.1, clip)
    assert_close(fn(score, kl, mask), expected)
    assert_close(fn(score, garbage_like(rng, kl, mask), mask), expected)
    check_transforms(
        lambda *a: losses.token_rewards(*a, kl_coef=0.1), (score, kl, mask), (score + 1, kl, mask)
    )


def test_token_rewards_hand_case():
    # Row 0: mask [0, 1, 1, 0] (left and right padding), kl [.1, .2, .3, .4], kl_coef 0.5,
    #   score 2 -> [0, -0.1, -0.15 + 2, 0] = [0, -0.1, 1.85, 0]; with clip_reward 1: 0.85.
    # Row 1: empty mask -> all zeros (no score is placed anywhere).
    kl = jnp.array([[0.1, 0.2, 0.3, 0.4], [1.0, 1.0, 1.0, 1.0]])
    mask = jnp.array([[0, 1, 1, 0], [0, 0, 0, 0]])
    out = losses.token_rewards(jnp.array([2.0, 5.0]), kl, mask, kl_coef=0.5)
    assert_close(out, [[0, -0.1, 1.85, 0], [0, 0, 0, 0]])
    out = losses.token_rewards(jnp.array([2.0, 5.0]), kl, mask, kl_coef=0.5, clip_reward=1.0)
    assert_close(out, [[0, -0.1, 0.85, 0], [0, 0, 0, 0]])


def test_whitening_advantages_pass_unbiased_through():
    # Bessel's correction (n - 1) where TRL / verl whiten; the default stays n (see above).
    r, _, mask = _token_inputs(13, holes=True)
    assert_close(
        losses.whiten_rewards(r, mask, unbiased=True),
        ref_global_whiten(r, mask, 1e-8, shift_mean=False, ddof=1),
    )
    adv, ret = losses.reinforce_pp_advantages(r, mask, unbiased=True)
    assert_close(adv, ref_global_whiten(ref_returns(r, mask, 1.0), mask, 1e-8, ddof=1))
    scores = _scores(14)
    expected = ref_global_whiten(
        np.where(mask, ref_group(scores, N, "dr_grpo")[:, None], 0.0), mask, 1e-8, ddof=1
    )
    assert_close(
        losses.reinforce_pp_baseline_advantages(scores, mask, group_size=N, unbiased=True),
        expected,
    )


def test_whiten_rewards_unbiased_hand_case():
    # Rewards [1, 5, (pad)]: mean 3, unbiased var (4 + 4) / 1 = 8, std 2.828427:
    # scale only: (r - 3) / 2.828427 + 3 = [2.292893, 3.707107].
    r, mask = jnp.array([[1.0, 5.0, 100.0]]), jnp.array([[1, 1, 0]])
    assert_close(losses.whiten_rewards(r, mask, unbiased=True), [[2.2928932, 3.7071068, 0.0]])
