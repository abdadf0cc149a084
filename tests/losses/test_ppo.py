"""PPO policy and value losses vs NumPy loop references."""

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


def ref_policy(lp, old, adv, mask, *, clip_low, clip_high, dual_clip, behaviour, tis_cap):
    """Returns (per-token loss [B, T], clipped [B, T], lower-clipped [B, T], ratio [B, T])."""
    loss = np.zeros((B, T))
    clipped = np.zeros((B, T), bool)
    lower = np.zeros((B, T), bool)
    ratio = np.ones((B, T))
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            r = math.exp(lp[b, t] - old[b, t])
            a = adv[b, t]
            unclipped = -a * r
            clip = -a * min(max(r, 1 - clip_low), 1 + clip_high)
            value = max(unclipped, clip)
            clipped[b, t] = clip > unclipped
            if dual_clip is not None and a < 0:
                lower[b, t] = value > -a * dual_clip
                value = min(value, -a * dual_clip)
            if behaviour is not None:
                w = math.exp(old[b, t] - behaviour[b, t])
                value *= w if tis_cap is None else min(w, tis_cap)
            loss[b, t] = value
            ratio[b, t] = r
    return loss, clipped, lower, ratio


def _inputs(seed):
    rng = np.random.default_rng(seed)
    mask = make_mask(rng, B, T)
    old = rng.normal(-2.0, 1.0, (B, T)).astype(np.float32)
    lp = (old + rng.normal(0.0, 0.4, (B, T))).astype(np.float32)  # ratios spread across clips
    adv = rng.normal(size=(B, T)).astype(np.float32)
    behaviour = (old + rng.normal(0.0, 0.5, (B, T))).astype(np.float32)
    return lp, old, adv, mask, behaviour


CONFIGS = [
    dict(clip_low=0.2, clip_high=0.2, dual_clip=None, tis=False, tis_cap=None),
    dict(clip_low=0.2, clip_high=0.28, dual_clip=None, tis=False, tis_cap=None),
    dict(clip_low=0.2, clip_high=0.2, dual_clip=1.5, tis=False, tis_cap=None),
    dict(clip_low=0.1, clip_high=0.3, dual_clip=2.0, tis=True, tis_cap=1.5),
    dict(clip_low=0.2, clip_high=0.2, dual_clip=None, tis=True, tis_cap=None),
]


# Every clipping config with token_mean, plus the other aggregations once (aggregate_loss has its
# own tests; here we only check that the per-token loss reaches it unchanged).
CASES = [(cfg, "token_mean") for cfg in CONFIGS] + [
    (CONFIGS[3], "seq_mean_token_mean"),
    (CONFIGS[3], "token_sum_norm"),
]


@pytest.mark.parametrize("cfg, aggregation", CASES)
def test_policy_loss_matches_reference(cfg, aggregation):
    lp, old, adv, mask, behaviour = _inputs(0)
    kwargs = dict(
        clip_low=cfg["clip_low"],
        clip_high=cfg["clip_high"],
        dual_clip=cfg["dual_clip"],
        tis_cap=cfg["tis_cap"],
        aggregation=aggregation,
        norm_constant=float(B * T),
    )

    def fn(lp, old, adv, mask, behaviour):
        return losses.ppo_policy_loss(
            lp, old, adv, mask, behaviour_logprobs=behaviour if cfg["tis"] else None, **kwargs
        )

    loss, metrics = jax.jit(fn)(lp, old, adv, mask, behaviour)
    ref_loss, clipped, lower, ratio = ref_policy(
        lp,
        old,
        adv,
        mask,
        clip_low=cfg["clip_low"],
        clip_high=cfg["clip_high"],
        dual_clip=cfg["dual_clip"],
        behaviour=behaviour if cfg["tis"] else None,
        tis_cap=cfg["tis_cap"],
    )
    assert_close(loss, ref_aggregate(ref_loss, mask, aggregation, norm=B * T))
    n = mask.sum()
    assert_close(metrics["clip_frac"], clipped[mask].sum() / n)
    assert_close(metrics["ratio_mean"], ratio[mask].mean())
    assert_close(metrics["approx_kl"], np.mean(ratio[mask] - 1 - np.log(ratio[mask])))
    if cfg["dual_clip"] is not None:
        assert_close(metrics["clip_frac_lower"], lower[mask].sum() / n)
    assert 0.0 < float(metrics["clip_frac"]) < 1.0  # the inputs exercise both branches

    # Padding does not leak, into the value or the gradient.
    rng = np.random.default_rng(1)
    garbage = [garbage_like(rng, x, mask) for x in (lp, old, adv, behaviour)]
    loss2, _ = jax.jit(fn)(garbage[0], garbage[1], garbage[2], mask, garbage[3])
    assert_close(loss2, loss)
    grad = jax.jit(jax.grad(lambda lp: fn(lp, *garbage[1:3], mask, garbage[3])[0]))(garbage[0])
    assert np.all(np.isfinite(np.asarray(grad))) and np.all(np.asarray(grad)[~mask] == 0)


def test_policy_loss_transforms():
    fn = lambda *a: losses.ppo_policy_loss(*a[:4], behaviour_logprobs=a[4], dual_clip=3.0)
    check_transforms(fn, _inputs(2), _inputs(3))


def test_policy_loss_hand_cases():
    # One token each, clip 0.2, token_mean:
    #  A=+1, r=1.5 : max(-1.5, -1.2)  = -1.2  (clipped at 1 + 0.2)
    #  A=-1, r=0.5 : max( 0.5,  0.8)  =  0.8  (clipped at 1 - 0.2)
    #  A=-1, r=5   : max( 5.0,  1.2)  =  5.0, dual-clip c=3 -> min(5, 3) = 3
    #  A=+1, r=1.1 : inside the clip range, -1.1
    # mean = (-1.2 + 0.8 + 3 - 1.1) / 4 = 0.375; clip_frac = 2/4; clip_frac_lower = 1/4.
    ratio = jnp.array([[1.5, 0.5, 5.0, 1.1]])
    adv = jnp.array([[1.0, -1.0, -1.0, 1.0]])
    loss, metrics = losses.ppo_policy_loss(
        jnp.log(ratio), jnp.zeros((1, 4)), adv, jnp.ones((1, 4)), dual_clip=3.0
    )
    assert_close(loss, 0.375)
    assert_close(metrics["clip_frac"], 0.5)
    assert_close(metrics["clip_frac_lower"], 0.25)
    assert_close(metrics["ratio_max"], 5.0)
    # Clip-higher: clip_high=0.6 lets r=1.5 through: -1.5 instead of -1.2.
    loss, _ = losses.ppo_policy_loss(
        jnp.log(ratio[:, :1]), jnp.zeros((1, 1)), adv[:, :1], jnp.ones((1, 1)), clip_high=0.6
    )
    assert_close(loss, -1.5)
    # TIS: behaviour log-prob log(1/4) below old (0): weight exp(0 - log 0.25) = 4, capped at 2,
    # so -1.2 * 2 = -2.4.
    loss, metrics = losses.ppo_policy_loss(
        jnp.log(ratio[:, :1]),
        jnp.zeros((1, 1)),
        adv[:, :1],
        jnp.ones((1, 1)),
        behaviour_logprobs=jnp.full((1, 1), np.log(0.25)),
        tis_cap=2.0,
    )
    assert_close(loss, -2.4)
    assert_close(metrics["tis/weight_mean"], 2.0)


def test_policy_loss_all_masked_is_zero():
    lp, old, adv, _, _ = _inputs(4)
    loss, grad = jax.jit(
        jax.value_and_grad(lambda lp: losses.ppo_policy_loss(lp, old, adv, np.zeros((B, T)))[0])
    )(lp)
    assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0)


def test_policy_loss_rejects_bad_arguments():
    lp, old, adv, mask, _ = _inputs(5)
    with pytest.raises(ValueError, match="dual_clip"):
        losses.ppo_policy_loss(lp, old, adv, mask, dual_clip=0.5)
    with pytest.raises(ValueError, match="broadcast_sequence_advantages"):
        losses.ppo_policy_loss(lp, old, adv[:, 0], mask)


# ----------------------------------------------------------------------------- value loss
def ref_value(v, old, ret, mask, clip):
    loss = np.zeros((B, T))
    clipped = np.zeros((B, T), bool)
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                e = (v[b, t] - ret[b, t]) ** 2
                if clip is not None:
                    vc = old[b, t] + min(max(v[b, t] - old[b, t], -clip), clip)
                    ec = (vc - ret[b, t]) ** 2
                    clipped[b, t] = ec > e
                    e = max(e, ec)
                loss[b, t] = 0.5 * e
    return loss, clipped


def _value_inputs(seed):
    rng = np.random.default_rng(seed)
    mask = make_mask(rng, B, T, holes=True)
    old = rng.normal(size=(B, T)).astype(np.float32)
    v = (old + rng.normal(0.0, 0.5, (B, T))).astype(np.float32)
    ret = rng.normal(size=(B, T)).astype(np.float32)
    return v, old, ret, mask


@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum"])
def test_value_loss_matches_reference(clip, aggregation):
    v, old, ret, mask = _value_inputs(6)
    fn = jax.jit(lambda *a: losses.ppo_value_loss(*a, clip_range=clip, aggregation=aggregation))
    loss, metrics = fn(v, old, ret, mask)
    ref_loss, clipped = ref_value(v, old, ret, mask, clip)
    assert_close(loss, ref_aggregate(ref_loss, mask, aggregation))
    assert_close(metrics["value_mean"], v[mask].mean())
    if clip is not None:
        assert_close(metrics["vf_clip_frac"], clipped[mask].mean())
    rng = np.random.default_rng(7)
    garbage = [garbage_like(rng, x, mask) for x in (v, old, ret)]
    assert_close(fn(*garbage, mask)[0], loss)


def test_value_loss_hand_case():
    # v=2, old=1, R=0, eps=0.5: unclipped (2-0)^2 = 4; clipped v = 1.5 -> 2.25; 0.5 * max = 2.
    # Without clipping: 0.5 * 4 = 2 as well; with R=3: unclipped 1, clipped (1.5-3)^2 = 2.25,
    # so the clipped branch wins: 0.5 * 2.25 = 1.125.
    one = jnp.ones((1, 1))
    assert_close(losses.ppo_value_loss(2 * one, one, 0 * one, one, clip_range=0.5)[0], 2.0)
    assert_close(losses.ppo_value_loss(2 * one, one, 3 * one, one, clip_range=0.5)[0], 1.125)
    assert_close(losses.ppo_value_loss(2 * one, one, 3 * one, one)[0], 0.5)


def test_value_loss_transforms():
    fn = lambda *a: losses.ppo_value_loss(*a, clip_range=0.2)
    check_transforms(fn, _value_inputs(8), _value_inputs(9))
