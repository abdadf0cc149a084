"""ILQL losses vs a NumPy loop transcription of trlX's ``ILQLConfig.loss``."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import losses
from tests.losses.utils import assert_close, check_transforms

B, T, V = 5, 6, 7


def logsumexp(z):
    z = np.asarray(z, np.float64)
    return z.max() + math.log(np.exp(z - z.max()).sum())


def ref_ilql(logits, qs, tqs, values, actions, rewards, nonterminal, *, gamma, tau, beta):
    """Per-term sums over real actions divided by max(#actions, 1), as trlX's loss does."""
    mask = nonterminal[:, :-1]
    n = max(int(mask.sum()), 1)
    lq = lv = lcql = lawac = 0.0
    for b, t in zip(*np.nonzero(mask), strict=True):
        a = actions[b, t]
        v = float(values[b, t])
        v_next = float(values[b, t + 1]) * float(nonterminal[b, t + 1])
        target_q = min(float(q[b, t, a]) for q in tqs)
        for q in qs:
            lq += (float(q[b, t, a]) - (float(rewards[b, t]) + gamma * v_next)) ** 2
            lcql += logsumexp(q[b, t]) - float(q[b, t, a])
        u = target_q - v
        lv += (tau if u >= 0 else 1 - tau) * u * u
        lawac += math.exp(beta * u) * (logsumexp(logits[b, t]) - float(logits[b, t, a]))
    return lq / n, lv / n, lcql / n, lawac / n


def _inputs(seed, n_heads=2):
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([[0, T], rng.integers(1, T + 1, B - 2)])  # empty and full rows
    nonterminal = np.arange(T + 1)[None, :] < lengths[:, None]  # trlX dones: [1]*n + [0]*...
    logits = rng.normal(size=(B, T, V)).astype(np.float32)
    qs = tuple(rng.normal(size=(B, T, V)).astype(np.float32) for _ in range(n_heads))
    tqs = tuple((q + rng.normal(0, 0.3, q.shape)).astype(np.float32) for q in qs)
    values = rng.normal(size=(B, T + 1)).astype(np.float32)
    actions = rng.integers(0, V, (B, T))
    rewards = rng.normal(size=(B, T)).astype(np.float32)
    return logits, qs, tqs, values, actions, rewards, nonterminal


HPARAMS = dict(gamma=0.9, tau=0.7, beta=0.5)


@pytest.mark.parametrize("n_heads", [1, 2])
def test_ilql_loss_matches_trlx_reference(n_heads):
    args = _inputs(0, n_heads)
    fn = lambda *a: losses.ilql_loss(*a, cql_scale=0.1, awac_scale=1.0, **HPARAMS)
    loss, metrics = jax.jit(fn)(*args)
    lq, lv, lcql, lawac = ref_ilql(*args, **HPARAMS)
    assert_close(metrics["loss/q"], lq)
    assert_close(metrics["loss/v"], lv)
    assert_close(metrics["loss/cql"], lcql)
    assert_close(metrics["loss/awac"], lawac)
    assert_close(loss, lq + lv + 0.1 * lcql + 1.0 * lawac)
    mask = args[-1][:, :-1]
    assert_close(metrics["values/mean"], args[3][:, :-1][mask].mean())
    # Padding (values / Q / rewards past each trajectory) does not leak.
    rng = np.random.default_rng(1)
    logits, qs, tqs, values, actions, rewards, nonterminal = args
    values2 = np.where(nonterminal, values, rng.normal(0, 50, values.shape)).astype(np.float32)
    rewards2 = np.where(mask, rewards, 1e3).astype(np.float32)
    assert_close(jax.jit(fn)(logits, qs, tqs, values2, actions, rewards2, nonterminal)[0], loss)
    check_transforms(fn, args, _inputs(2, n_heads), grad_argnums=(0, 1, 3))


def test_ilql_gradients_follow_trlx_detaching():
    # trlX detaches the target heads, V(s_{t+1}) in the Q target and the AWAC weight, so the
    # only gradient into `values` is from the expectile loss:
    #   dL_V / dV_t = -2 |tau - 1[u < 0]| u_t / n   with u = Q_target - V, for real actions t,
    # and none at all into the target heads.
    logits, qs, tqs, values, actions, rewards, nonterminal = _inputs(3)
    g_values, g_tqs = jax.jit(
        jax.grad(
            lambda v, tq: losses.ilql_loss(
                logits, qs, tq, v, actions, rewards, nonterminal, **HPARAMS
            )[0],
            argnums=(0, 1),
        )
    )(values, tqs)
    mask = nonterminal[:, :-1]
    n = mask.sum()
    expected = np.zeros(values.shape)
    for b, t in zip(*np.nonzero(mask), strict=True):
        u = min(float(q[b, t, actions[b, t]]) for q in tqs) - float(values[b, t])
        expected[b, t] = -2 * (0.7 if u >= 0 else 0.3) * u / n
    assert_close(g_values, expected)
    assert all(np.all(np.asarray(g) == 0) for g in g_tqs)


def test_ilql_all_terminal_batch_is_zero():
    args = list(_inputs(4))
    args[-1] = np.zeros_like(args[-1])
    loss, metrics = losses.ilql_loss(*args)
    assert float(loss) == 0.0
    assert all(np.isfinite(float(m)) for m in metrics.values())


def test_ilql_component_hand_cases():
    one = jnp.ones((1, 2))
    # Expectile, tau 0.7: u = Q_target - V = [1 - 0, 0 - 1] = [1, -1]
    #   -> [0.7 * 1, 0.3 * 1], mean 0.5.
    assert_close(
        losses.ilql_value_loss(jnp.array([[1.0, 0.0]]), jnp.array([[0.0, 1.0]]), one, tau=0.7), 0.5
    )
    # Q loss, gamma 0.5: targets r + 0.5 V' = [1 + 0.5 * 2, 0 + 0] = [2, 0]; Q = [3, 1]:
    #   errors [1, 1] -> mean 1.
    q_loss = losses.ilql_q_loss(
        jnp.array([[3.0, 1.0]]), jnp.array([[1.0, 0.0]]), jnp.array([[2.0, 0.0]]), one, gamma=0.5
    )
    assert_close(q_loss, 1.0)
    # CQL: Q logits [0, 0] over 2 actions -> logsumexp = log 2, minus Q(a) = 0: log 2 each.
    assert_close(losses.ilql_cql_loss(jnp.zeros((1, 2, 2)), jnp.array([[0, 1]]), one), np.log(2.0))
    # AWAC: uniform logits -> CE = log 2; beta 1 and Q_target - V = [0, log 3] -> weights
    #   [1, 3]; mean(log 2 * [1, 3]) = 2 log 2 = 1.3862944. Only the first token real: log 2.
    awac, w = losses.ilql_awac_loss(
        jnp.zeros((1, 2, 2)),
        jnp.array([[0, 1]]),
        jnp.array([[0.0, np.log(3.0)]]),
        jnp.zeros((1, 2)),
        one,
        beta=1.0,
    )
    assert_close(awac, 2 * np.log(2.0))
    assert_close(w, [[1.0, 3.0]])
    awac, _ = losses.ilql_awac_loss(
        jnp.zeros((1, 2, 2)),
        jnp.array([[0, 1]]),
        jnp.array([[0.0, np.log(3.0)]]),
        jnp.zeros((1, 2)),
        jnp.array([[1, 0]]),
        beta=1.0,
    )
    assert_close(awac, np.log(2.0))


def test_ilql_loss_hand_case():
    # One trajectory with a single action (nonterminal [1, 0]), V = 2 vocabulary entries, two
    # heads, all logits / Q / V zero, reward 1, gamma 0.99:
    #   V' = V(s_1) * 0 = 0, so each head's Q target is 1 and L_Q = 2 * (0 - 1)^2 = 2
    #   u = Q_target - V = 0, so L_V = 0
    #   L_CQL = 2 * (log 2 - 0) = 2 log 2;  L_AWAC = e^0 * log 2 = log 2
    #   loss = 2 + 0 + 0.1 * 2 log 2 + 1 * log 2 = 2 + 1.2 log 2 = 2.8317766
    zeros = jnp.zeros((1, 1, 2))
    loss, metrics = losses.ilql_loss(
        zeros,
        (zeros, zeros),
        (zeros, zeros),
        jnp.zeros((1, 2)),
        jnp.array([[1]]),
        jnp.ones((1, 1)),
        jnp.array([[1, 0]]),
    )
    assert_close(metrics["loss/q"], 2.0)
    assert_close(metrics["loss/v"], 0.0)
    assert_close(loss, 2.0 + 1.2 * np.log(2.0))
