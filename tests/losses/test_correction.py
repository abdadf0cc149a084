"""Rollout correction (importance weights, decoupled PPO) vs NumPy loop references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import losses
from tests.losses.test_ppo import ref_policy
from tests.losses.utils import (
    assert_close,
    check_transforms,
    garbage_like,
    make_mask,
    ref_aggregate,
)

B, T = 5, 7


def ref_weights(target, behaviour, mask, *, mode, level, cap, floor):
    """Loop reference: (weights [B, T], ratios of the units, bounded flags, unit mask)."""
    weights = np.zeros((B, T))
    units, flags = [], []
    for b in range(B):
        toks = [t for t in range(T) if mask[b, t]]
        if level == "token":
            pieces = [(target[b, t] - behaviour[b, t], [t]) for t in toks]
        else:
            pieces = [(sum(target[b, t] - behaviour[b, t] for t in toks), toks)] if toks else []
        for log_rho, where in pieces:
            rho = math.exp(min(max(log_rho, -20.0), 20.0))
            if mode == "truncate":
                w, bounded = min(rho, cap), rho > cap
            else:
                bounded = rho > cap or rho < floor
                w = 0.0 if bounded else rho
            for t in where:
                weights[b, t] = w
            units.append((rho, w))
            flags.append(bounded)
    return weights, units, flags


def _inputs(seed):
    rng = np.random.default_rng(seed)
    mask = make_mask(rng, B, T)
    target = rng.normal(-2.0, 1.0, (B, T)).astype(np.float32)
    behaviour = (target + rng.normal(0.0, 0.8, (B, T))).astype(np.float32)
    lp = (target + rng.normal(0.0, 0.3, (B, T))).astype(np.float32)
    adv = rng.normal(size=(B, T)).astype(np.float32)
    return lp, target, behaviour, adv, mask


SETTINGS = [
    dict(mode="truncate", level="token", cap=1.5, floor=0.0),
    dict(mode="truncate", level="sequence", cap=2.0, floor=0.0),
    dict(mode="mask", level="token", cap=1.5, floor=0.5),
    dict(mode="mask", level="token", cap=2.0, floor=0.0),
    dict(mode="mask", level="sequence", cap=3.0, floor=0.2),
]


@pytest.mark.parametrize("setting", SETTINGS)
def test_importance_weights_match_reference(setting):
    _, target, behaviour, _, mask = _inputs(0)
    fn = jax.jit(lambda t, b, m: losses.importance_weights(t, b, m, **setting))
    weights, metrics = fn(target, behaviour, mask)
    ref, units, flags = ref_weights(target, behaviour, mask, **setting)
    assert_close(weights, ref)
    rho = np.array([u[0] for u in units])
    w = np.array([u[1] for u in units])
    assert_close(metrics["ratio_mean"], rho.mean())
    assert_close(metrics["ratio_max"], rho.max())
    assert_close(metrics["weight_mean"], w.mean())
    assert_close(metrics["weight_max"], w.max())
    assert_close(metrics["clip_frac"], np.mean(flags))
    assert_close(metrics["ess"], w.sum() ** 2 / (len(w) * (w**2).sum()))
    tok = np.exp((target - behaviour)[mask].astype(np.float64))
    assert_close(metrics["mismatch_kl"], np.mean(tok - 1 - np.log(tok)))
    if setting["level"] == "token":  # the inputs exercise both sides of the bound
        assert 0.0 < np.mean(flags) < 1.0

    # Padding never leaks.
    rng = np.random.default_rng(1)
    w2, _ = fn(garbage_like(rng, target, mask), garbage_like(rng, behaviour, mask), mask)
    assert_close(w2, ref)


def test_importance_weights_hand_case():
    # Row 0: two tokens with log-ratios log 3 and log 0.5; row 1: one token, log-ratio log 1.2.
    #  token, truncate cap 2:        weights 2, 0.5 | 1.2           (clip_frac 1/3)
    #  token, mask [0.6, 2]:         weights 0, 0   | 1.2           (clip_frac 2/3)
    #  sequence, truncate cap 2:     row 0 ratio 3 * 0.5 = 1.5 on both tokens | 1.2
    #  sequence, mask [0.6, 1.4]:    row 0 ratio 1.5 > 1.4 -> 0, 0 | 1.2
    behaviour = jnp.zeros((2, 2))
    target = jnp.log(jnp.array([[3.0, 0.5], [1.2, 1.0]]))
    mask = jnp.array([[True, True], [True, False]])
    cases = [
        (dict(mode="truncate", level="token", cap=2.0), [[2.0, 0.5], [1.2, 0.0]], 1 / 3),
        (dict(mode="mask", level="token", cap=2.0, floor=0.6), [[0, 0], [1.2, 0]], 2 / 3),
        (dict(mode="truncate", level="sequence", cap=2.0), [[1.5, 1.5], [1.2, 0.0]], 0.0),
        (dict(mode="mask", level="sequence", cap=1.4, floor=0.6), [[0, 0], [1.2, 0]], 0.5),
    ]
    for kwargs, expected, clip_frac in cases:
        w, m = losses.importance_weights(target, behaviour, mask, **kwargs)
        assert_close(w, np.array(expected))
        assert_close(m["clip_frac"], clip_frac)


@pytest.mark.parametrize("setting", SETTINGS[:3])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_decoupled_ppo_matches_reference(setting, aggregation):
    lp, prox, behaviour, adv, mask = _inputs(2)
    kwargs = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, aggregation=aggregation)
    loss, metrics = jax.jit(lambda *a: losses.decoupled_ppo_loss(*a, **kwargs, **setting))(
        lp, prox, behaviour, adv, mask
    )
    per_token, _, _, _ = ref_policy(
        lp,
        prox,
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=3.0,
        behaviour=None,
        tis_cap=None,
    )
    weights, _, _ = ref_weights(prox, behaviour, mask, **setting)
    assert_close(loss, ref_aggregate(per_token * weights, mask, aggregation))
    assert "is/weight_mean" in metrics and "clip_frac" in metrics

    # The weights are constants: no gradient reaches the proximal or behaviour log-probs.
    grads = jax.grad(
        lambda p, b: losses.decoupled_ppo_loss(lp, p, b, adv, mask, **kwargs, **setting)[0],
        argnums=(0, 1),
    )(prox, behaviour)
    for g in grads:
        assert np.all(np.asarray(g) == 0)


def test_decoupled_token_truncation_is_tis():
    """Token-level truncation is ``ppo_policy_loss``'s TIS weight."""
    lp, prox, behaviour, adv, mask = _inputs(4)
    a, _ = losses.decoupled_ppo_loss(lp, prox, behaviour, adv, mask, cap=1.5)
    b, _ = losses.ppo_policy_loss(lp, prox, adv, mask, behaviour_logprobs=behaviour, tis_cap=1.5)
    assert_close(a, float(b), rtol=1e-6, atol=1e-7)


def test_decoupled_transforms():
    def fn(lp, prox, behaviour, adv, mask):
        return losses.decoupled_ppo_loss(lp, prox, behaviour, adv, mask, level="sequence")

    check_transforms(fn, _inputs(5), _inputs(6))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(mode="clip"),
        dict(level="batch"),
        dict(cap=0.0),
        dict(mode="mask", floor=3.0, cap=2.0),
        dict(mode="truncate", floor=0.5),
    ],
)
def test_importance_weights_reject_bad_settings(kwargs):
    x = jnp.zeros((1, 2))
    with pytest.raises(ValueError):
        losses.importance_weights(x, x, jnp.ones((1, 2), bool), **kwargs)
