"""DPO family, SimPO, ORPO, Bradley-Terry and SFT losses vs NumPy references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import losses
from tests.losses.utils import (
    assert_close,
    check_transforms,
    make_mask,
    ref_aggregate,
)

B, T, V = 6, 5, 11


def log_sigmoid(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def ref_pair_metrics(chosen, rejected, pair_mask):
    c, r = np.asarray(chosen, np.float64)[pair_mask], np.asarray(rejected, np.float64)[pair_mask]
    return {
        "rewards/chosen": c.mean(),
        "rewards/rejected": r.mean(),
        "rewards/accuracy": (c > r).mean(),
        "rewards/margin": (c - r).mean(),
    }


def check_metrics(metrics, expected):
    for key, value in expected.items():
        assert_close(metrics[key], value)


def _pairs(seed, n_inputs):
    rng = np.random.default_rng(seed)
    xs = [rng.normal(-3.0, 1.5, B).astype(np.float32) for _ in range(n_inputs)]
    pair_mask = np.ones(B, bool)
    pair_mask[-1] = False  # a padding pair
    return xs, pair_mask


# ----------------------------------------------------------------------------- DPO family
def ref_dpo(pc, pr, rc, rr, beta, loss_type, eps, pair_mask):
    vals = []
    for i in range(B):
        if not pair_mask[i]:
            continue
        h = (float(pc[i]) - float(rc[i])) - (float(pr[i]) - float(rr[i]))
        if loss_type == "sigmoid":
            vals.append(-(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h))
        elif loss_type == "ipo":
            vals.append((h - 1 / (2 * beta)) ** 2)
        else:
            vals.append(max(0.0, 1 - beta * h))
    return np.mean(vals)


@pytest.mark.parametrize(
    "loss_type, eps", [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0), ("hinge", 0.0)]
)
def test_dpo_matches_reference(loss_type, eps):
    (pc, pr, rc, rr), pair_mask = _pairs(0, 4)
    kwargs = dict(beta=0.3, loss_type=loss_type, label_smoothing=eps)
    fn = lambda *a: losses.dpo_loss(*a[:4], pair_mask=a[4], **kwargs)
    loss, metrics = jax.jit(fn)(pc, pr, rc, rr, pair_mask)
    assert_close(loss, ref_dpo(pc, pr, rc, rr, 0.3, loss_type, eps, pair_mask))
    check_metrics(metrics, ref_pair_metrics(0.3 * (pc - rc), 0.3 * (pr - rr), pair_mask))
    (pc2, pr2, rc2, rr2), _ = _pairs(1, 4)
    check_transforms(
        fn, (pc, pr, rc, rr, pair_mask), (pc2, pr2, rc2, rr2, pair_mask), grad_argnums=(0, 1)
    )


def test_dpo_hand_case():
    # logp_c - ref_c = 1, logp_r - ref_r = -1 -> h = 2; beta = 0.5 -> beta h = 1.
    #   sigmoid: -log sigma(1) = log(1 + e^-1) = 0.3132617
    #   cDPO e=0.1: 0.9 * 0.3132617 + 0.1 * log(1 + e) = 0.2819355 + 0.1313262 = 0.4132617
    #   ipo: (2 - 1/(2*0.5))^2 = 1;  hinge: relu(1 - 1) = 0
    #   rewards: chosen 0.5, rejected -0.5, accuracy 1, margin 1.
    args = [jnp.array([x]) for x in (-1.0, -5.0, -2.0, -4.0)]
    loss, metrics = losses.dpo_loss(*args, beta=0.5)
    assert_close(loss, 0.3132617)
    check_metrics(
        metrics,
        {
            "rewards/chosen": 0.5,
            "rewards/rejected": -0.5,
            "rewards/accuracy": 1.0,
            "rewards/margin": 1.0,
        },
    )
    assert_close(losses.dpo_loss(*args, beta=0.5, label_smoothing=0.1)[0], 0.4132617)
    assert_close(losses.dpo_loss(*args, beta=0.5, loss_type="ipo")[0], 1.0)
    assert_close(losses.dpo_loss(*args, beta=0.5, loss_type="hinge")[0], 0.0)


def test_dpo_reference_gets_no_gradient_and_validates():
    args = [jnp.array([x]) for x in (-1.0, -5.0, -2.0, -4.0)]
    grads = jax.jit(jax.grad(lambda *a: losses.dpo_loss(*a)[0], argnums=(0, 1, 2, 3)))(*args)
    assert float(grads[0][0]) < 0 < float(grads[1][0])  # push chosen up, rejected down
    assert float(grads[2][0]) == 0.0 and float(grads[3][0]) == 0.0
    with pytest.raises(ValueError, match="loss_type"):
        losses.dpo_loss(*args, loss_type="kto")
    with pytest.raises(ValueError, match="label_smoothing"):
        losses.dpo_loss(*args, loss_type="ipo", label_smoothing=0.1)


def test_pair_losses_with_no_real_pairs_are_zero():
    args = [jnp.array([x]) for x in (-1.0, -5.0, -2.0, -4.0)]
    none = jnp.zeros(1, bool)
    assert float(losses.dpo_loss(*args, pair_mask=none)[0]) == 0.0
    assert float(losses.simpo_loss(*args[:2], pair_mask=none)[0]) == 0.0
    assert float(losses.orpo_odds_ratio_loss(*args[:2], pair_mask=none)[0]) == 0.0
    assert float(losses.bradley_terry_loss(*args[:2], pair_mask=none)[0]) == 0.0


# ----------------------------------------------------------------------------- SimPO
def ref_simpo(c, r, beta, gamma, eps, pair_mask):
    vals = []
    for i in range(B):
        if pair_mask[i]:
            z = beta * (float(c[i]) - float(r[i])) - gamma
            vals.append(-(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z))
    return np.mean(vals)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_simpo_matches_reference(eps):
    (c, r), pair_mask = _pairs(2, 2)
    c, r = c / 3, r / 3  # mean token log-probs are O(1)
    fn = lambda c, r, m: losses.simpo_loss(
        c, r, beta=2.0, gamma=0.5, label_smoothing=eps, pair_mask=m
    )
    loss, metrics = jax.jit(fn)(c, r, pair_mask)
    assert_close(loss, ref_simpo(c, r, 2.0, 0.5, eps, pair_mask))
    check_metrics(metrics, ref_pair_metrics(2.0 * c, 2.0 * r, pair_mask))
    check_transforms(fn, (c, r, pair_mask), (r, c, pair_mask), grad_argnums=(0, 1))


def test_simpo_hand_case():
    # avg_c = -1, avg_r = -2, beta 2, gamma 0.5: z = 2 * 1 - 0.5 = 1.5,
    # loss = log(1 + e^-1.5) = 0.2014133.
    loss, _ = losses.simpo_loss(jnp.array([-1.0]), jnp.array([-2.0]), beta=2.0, gamma=0.5)
    assert_close(loss, 0.2014133)


def test_simpo_from_token_logprobs_with_masks():
    # The documented pipeline: token log-probs -> length-normalised sequence log-probs -> loss.
    rng = np.random.default_rng(3)
    lp_c, lp_r = rng.normal(-1.0, 0.5, (2, B, T)).astype(np.float32)
    m_c, m_r = make_mask(rng, B, T), make_mask(rng, B, T)[::-1]
    avg_c = losses.sequence_logprobs(lp_c, m_c, average=True)
    avg_r = losses.sequence_logprobs(lp_r, m_r, average=True)
    ref_avg = lambda lp, m: np.array([lp[i][m[i]].mean() if m[i].any() else 0.0 for i in range(B)])
    assert_close(avg_c, ref_avg(lp_c, m_c))
    loss, _ = losses.simpo_loss(avg_c, avg_r)
    assert_close(
        loss, ref_simpo(ref_avg(lp_c, m_c), ref_avg(lp_r, m_r), 2.0, 0.5, 0.0, np.ones(B, bool))
    )


# ----------------------------------------------------------------------------- ORPO
def ref_orpo(c, r, beta, pair_mask):
    vals = []
    for i in range(B):
        if pair_mask[i]:
            pc, pr = math.exp(float(c[i])), math.exp(float(r[i]))
            log_odds = math.log(pc / (1 - pc)) - math.log(pr / (1 - pr))
            vals.append(-beta * log_sigmoid(log_odds))
    return np.mean(vals)


def test_orpo_matches_reference():
    (c, r), pair_mask = _pairs(4, 2)
    c, r = -np.abs(c) / 3, -np.abs(r) / 3  # mean token log-probs: negative, O(1)
    fn = lambda c, r, m: losses.orpo_odds_ratio_loss(c, r, beta=0.2, pair_mask=m)
    loss, metrics = jax.jit(fn)(c, r, pair_mask)
    assert_close(loss, ref_orpo(c, r, 0.2, pair_mask))
    check_metrics(metrics, ref_pair_metrics(0.2 * c, 0.2 * r, pair_mask))
    check_transforms(fn, (c, r, pair_mask), (r, c, pair_mask), grad_argnums=(0, 1))


def test_orpo_hand_case():
    # p_c = 0.5 (odds 1), p_r = 0.25 (odds 1/3): log_odds = log 3 = 1.0986123,
    # log sigma(log 3) = log(3/4) = -0.2876821, loss = -0.1 * -0.2876821 = 0.02876821.
    loss, metrics = losses.orpo_odds_ratio_loss(
        jnp.log(jnp.array([0.5])), jnp.log(jnp.array([0.25]))
    )
    assert_close(loss, 0.02876821)
    assert_close(metrics["orpo/log_odds"], np.log(3.0))
    assert_close(metrics["orpo/log_odds_ratio"], np.log(0.75))


def test_orpo_is_stable_near_probability_one():
    # avg log-prob 0 (empty response) and -1e-9 (p within float32 rounding of 1) stay finite,
    # in the value and the gradient; -1e-3 is far enough from the cap to be exact:
    # log(1 - e^-1e-3) = log(9.995e-4) = -6.908255.
    c = jnp.array([0.0, -1e-9, -1e-3])
    r = jnp.full(3, -1.0)
    loss, grads = jax.jit(
        jax.value_and_grad(lambda c, r: losses.orpo_odds_ratio_loss(c, r)[0], (0, 1))
    )(c, r)
    assert np.isfinite(float(loss))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)
    log_odds_last = (-1e-3 + 1.0) - (math.log(-math.expm1(-1e-3)) - math.log(-math.expm1(-1.0)))
    one = losses.orpo_odds_ratio_loss(c[2:], r[2:])[0]
    assert_close(one, -0.1 * log_sigmoid(log_odds_last))


# ----------------------------------------------------------------------------- Bradley-Terry
def ref_bt(c, r, margin, pair_mask):
    vals = [
        -log_sigmoid(float(c[i]) - float(r[i]) - (0.0 if margin is None else float(margin[i])))
        for i in range(B)
        if pair_mask[i]
    ]
    return np.mean(vals)


@pytest.mark.parametrize("with_margin", [False, True])
def test_bradley_terry_matches_reference(with_margin):
    (c, r, margin), pair_mask = _pairs(5, 3)
    margin = np.abs(margin) if with_margin else None
    fn = lambda c, r, m: losses.bradley_terry_loss(c, r, margin=margin, pair_mask=m)
    loss, metrics = jax.jit(fn)(c, r, pair_mask)
    assert_close(loss, ref_bt(c, r, margin, pair_mask))
    check_metrics(metrics, ref_pair_metrics(c, r, pair_mask))
    check_transforms(fn, (c, r, pair_mask), (r, c, pair_mask), grad_argnums=(0, 1))


def test_bradley_terry_hand_case():
    # r_c - r_r = 1: -log sigma(1) = 0.3132617; with margin 1: -log sigma(0) = log 2 = 0.6931472.
    c, r = jnp.array([2.0]), jnp.array([1.0])
    assert_close(losses.bradley_terry_loss(c, r)[0], 0.3132617)
    assert_close(losses.bradley_terry_loss(c, r, margin=1.0)[0], 0.6931472)


# ----------------------------------------------------------------------------- SFT
def _sft_inputs(seed):
    rng = np.random.default_rng(seed)
    logits = (2.0 * rng.normal(size=(B, T, V))).astype(np.float32)
    targets = rng.integers(0, V, (B, T))
    mask = make_mask(rng, B, T)
    targets[~mask] = -100  # an ignore index at padding must not matter
    return logits, targets, mask


def ref_nll(logits, targets, mask):
    out = np.zeros(targets.shape)
    for b, t in np.ndindex(targets.shape):
        if mask[b, t]:
            z = logits[b, t].astype(np.float64)
            out[b, t] = np.log(np.exp(z).sum()) - z[targets[b, t]]
    return out


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_sft_loss_matches_reference(aggregation):
    logits, targets, mask = _sft_inputs(6)
    fn = lambda *a: losses.sft_loss(*a, aggregation=aggregation)
    loss, metrics = jax.jit(fn)(logits, targets, mask)
    nll = ref_nll(logits, targets, mask)
    assert_close(loss, ref_aggregate(nll, mask, aggregation))
    assert_close(metrics["sft/nll"], nll[mask].mean())
    assert_close(metrics["sft/num_tokens"], mask.sum())
    correct = logits.argmax(-1) == targets
    assert_close(metrics["sft/accuracy"], correct[mask].mean())
    check_transforms(fn, (logits, targets, mask), _sft_inputs(7))


def test_sft_hand_case():
    # Uniform logits over V = 4: NLL = log 4 = 1.3862944 per token, whatever the target.
    loss, _ = losses.sft_loss(jnp.zeros((1, 2, 4)), jnp.array([[3, 1]]), jnp.ones((1, 2)))
    assert_close(loss, np.log(4.0))
