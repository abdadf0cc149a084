"""KL estimators, KL penalty / loss and the KL controllers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import losses
from tests.losses.utils import (
    assert_close,
    check_transforms,
    garbage_like,
    make_mask,
    ref_aggregate,
)

B, T = 5, 7


def ref_kl(lp, ref, estimator):
    out = np.zeros(lp.shape)
    for idx in np.ndindex(lp.shape):
        log_r = float(lp[idx]) - float(ref[idx])
        if estimator == "k1":
            out[idx] = log_r
        elif estimator == "k2":
            out[idx] = 0.5 * log_r * log_r
        else:  # k3 with r = pi_ref / pi
            r = math.exp(-log_r)
            out[idx] = (r - 1) - math.log(r)
    return out


def _inputs(seed):
    rng = np.random.default_rng(seed)
    lp = rng.normal(-2.0, 1.0, (B, T)).astype(np.float32)
    ref = (lp + rng.normal(0.0, 0.5, (B, T))).astype(np.float32)
    return lp, ref, make_mask(rng, B, T)


@pytest.mark.parametrize("estimator", losses.KL_ESTIMATORS)
def test_kl_penalty_and_loss_match_reference(estimator):
    lp, ref, mask = _inputs(0)
    expected = np.where(mask, ref_kl(lp, ref, estimator), 0.0)
    assert_close(losses.kl_estimate(lp, ref, estimator=estimator), ref_kl(lp, ref, estimator))
    penalty = jax.jit(lambda *a: losses.kl_penalty(*a, estimator=estimator))
    assert_close(penalty(lp, ref, mask), expected)
    for aggregation in ("token_mean", "seq_mean_token_mean"):
        loss_fn = jax.jit(
            lambda *a, g=aggregation: losses.kl_loss(*a, estimator=estimator, aggregation=g)
        )
        loss, metrics = loss_fn(lp, ref, mask)
        assert_close(loss, ref_aggregate(expected, mask, aggregation))
        assert_close(metrics["kl/mean"], expected[mask].mean())
        assert_close(metrics["kl/max"], expected[mask].max())
    # Padding does not leak.
    rng = np.random.default_rng(1)
    lp_g, ref_g = garbage_like(rng, lp, mask), garbage_like(rng, ref, mask)
    assert_close(penalty(lp_g, ref_g, mask), expected)
    check_transforms(
        lambda *a: losses.kl_loss(*a, estimator=estimator), (lp_g, ref_g, mask), _inputs(2)
    )


def test_kl_estimators_hand_case():
    # log(pi / pi_ref) = log 2: k1 = 0.693147, k2 = 0.5 * 0.693147^2 = 0.240227,
    # k3 = (1/2 - 1) - log(1/2) = -0.5 + 0.693147 = 0.193147.
    lp, ref = jnp.log(jnp.array([0.5])), jnp.log(jnp.array([0.25]))
    assert_close(losses.kl_estimate(lp, ref, estimator="k1"), [0.6931472])
    assert_close(losses.kl_estimate(lp, ref, estimator="k2"), [0.2402265])
    assert_close(losses.kl_estimate(lp, ref, estimator="k3"), [0.1931472])


def test_kl_loss_gradient_flows_to_logprobs_only():
    # d k3 / d logp = 1 - exp(-(logp - ref)); with logp = log 0.5, ref = log 0.25: 1 - 0.5 = 0.5.
    lp, ref = jnp.log(jnp.array([[0.5]])), jnp.log(jnp.array([[0.25]]))
    g_lp, g_ref = jax.jit(
        jax.grad(lambda a, b: losses.kl_loss(a, b, jnp.ones((1, 1)))[0], argnums=(0, 1))
    )(lp, ref)
    assert_close(g_lp, [[0.5]])
    assert float(g_ref[0, 0]) == 0.0


def test_kl_estimate_rejects_unknown():
    with pytest.raises(ValueError, match="estimator"):
        losses.kl_estimate(jnp.zeros(2), jnp.zeros(2), estimator="k4")
    with pytest.raises(ValueError, match="k3_clamp"):
        losses.kl_estimate(jnp.zeros(2), jnp.zeros(2), estimator="k1", k3_clamp=10.0)
    with pytest.raises(ValueError, match="k3_clamp"):
        losses.kl_loss(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2)), k3_clamp=0.0)


# ----------------------------------------------------------------------------- k3 clamp
def ref_k3_clamped(lp, ref, clamp):
    log_r = np.clip(lp.astype(np.float64) - ref.astype(np.float64), -20.0, 20.0)
    k3 = np.exp(-log_r) - 1.0 + log_r
    return k3 if clamp is None else np.clip(k3, -clamp, clamp)


def test_k3_clamp_hand_case():
    # log_r = logp - ref: -20 -> k3 = e^20 - 1 - 20 = 485165195.41 - 21 = 4.8516517e8 unclamped
    # (the verl case: finite, but it would dominate any mean); -25 is first clamped to -20,
    # so the same; +20 -> e^-20 - 1 + 20 = 19.0; 0.5 -> e^-0.5 - 0.5 = 0.1065307.
    # With k3_clamp=10: [10, 10, 10, 0.1065307].
    lp = jnp.array([-25.0, -30.0, -5.0, -4.5])
    ref = jnp.array([-5.0, -5.0, -25.0, -5.0])
    unclamped = losses.kl_estimate(lp, ref, estimator="k3")
    assert_close(unclamped, [485165174.4, 485165174.4, 19.0, 0.1065307])
    clamped = losses.kl_estimate(lp, ref, estimator="k3", k3_clamp=10.0)
    assert_close(clamped, [10.0, 10.0, 10.0, 0.1065307])
    # Clipped tokens get no gradient; the last keeps d k3 / d logp = 1 - e^-0.5 = 0.3934693.
    grad = jax.jit(
        jax.grad(lambda a: losses.kl_loss(a[None], ref[None], jnp.ones((1, 4)), k3_clamp=10.0)[0])
    )(lp)
    assert_close(grad, [0.0, 0.0, 0.0, 0.3934693 / 4])


@pytest.mark.parametrize("clamp", [None, 10.0, 0.5])
def test_k3_clamp_matches_reference(clamp):
    rng = np.random.default_rng(4)
    lp = rng.normal(-3.0, 1.0, (B, T)).astype(np.float32)
    ref = (lp + rng.normal(0.0, 4.0, (B, T))).astype(np.float32)  # |log_r| up to ~12
    mask = make_mask(rng, B, T)
    expected = np.where(mask, ref_k3_clamped(lp, ref, clamp), 0.0)
    assert ref_k3_clamped(lp, ref, None)[mask].max() > 100  # so the clamps at 10 and 0.5 bite
    assert_close(losses.kl_penalty(lp, ref, mask, estimator="k3", k3_clamp=clamp), expected)
    fn = lambda *a: losses.kl_loss(*a, k3_clamp=clamp, aggregation="seq_mean_token_mean")
    loss, metrics = jax.jit(fn)(lp, ref, mask)
    assert_close(loss, ref_aggregate(expected, mask, "seq_mean_token_mean"))
    assert_close(metrics["kl/max"], expected[mask].max())
    check_transforms(fn, (lp, ref, mask), _inputs(5))


# ----------------------------------------------------------------------------- controllers
def ref_adaptive(value, target, horizon, current, n_steps):
    error = min(max(current / target - 1, -0.2), 0.2)
    return value * (1 + error * n_steps / horizon)


def test_adaptive_controller_hand_case():
    # trlX defaults: init 0.05, target 6, horizon 10000, batch 256. Measured KL 9:
    # error = clip(9/6 - 1, -0.2, 0.2) = 0.2 -> mult = 1 + 0.2 * 256 / 10000 = 1.00512,
    # so the coefficient becomes 0.05 * 1.00512 = 0.050256. Measured KL 5.4: error -0.1,
    # mult = 1 - 0.1 * 256 / 10000 = 0.99744 -> 0.0498720.
    state = losses.AdaptiveKLState(kl_coef=0.05, target=6.0, horizon=10000.0)
    assert_close(losses.kl_controller_update(state, 9.0, 256).kl_coef, 0.050256)
    assert_close(losses.kl_controller_update(state, 5.4, 256).kl_coef, 0.049872)


def test_adaptive_controller_matches_reference_over_steps_under_jit():
    rng = np.random.default_rng(3)
    update = jax.jit(losses.kl_controller_update)
    state = losses.AdaptiveKLState(kl_coef=jnp.float32(0.1), target=6.0, horizon=1000.0)
    value = 0.1
    for current in rng.uniform(0.0, 15.0, 10):
        state = update(state, current, 64)
        value = ref_adaptive(value, 6.0, 1000.0, current, 64)
        assert isinstance(state, losses.AdaptiveKLState)
        assert_close(state.kl_coef, value)
    # It is a pytree: it flattens to its three leaves and survives jit round trips.
    assert len(jax.tree_util.tree_leaves(state)) == 3


def test_fixed_controller_is_unchanged():
    state = losses.FixedKL(kl_coef=0.2)
    new = jax.jit(losses.kl_controller_update)(state, 100.0, 10)
    assert isinstance(new, losses.FixedKL)
    assert_close(new.kl_coef, 0.2)
    with pytest.raises(TypeError):
        losses.kl_controller_update((0.1,), 1.0, 1)


def test_adaptive_controller_vmaps_over_states():
    states = losses.AdaptiveKLState(
        kl_coef=jnp.array([0.1, 0.2]), target=jnp.array([6.0, 6.0]), horizon=jnp.array([1e4, 1e4])
    )
    out = jax.vmap(losses.kl_controller_update)(
        states, jnp.array([9.0, 3.0]), jnp.array([256, 256])
    )
    assert_close(
        out.kl_coef, [ref_adaptive(0.1, 6, 1e4, 9, 256), ref_adaptive(0.2, 6, 1e4, 3, 256)]
    )
