"""DPO variants (TRL loss types), f-divergence DPO and WPO weights vs NumPy references.

References are float64 loops over the real pairs, written from the equations (TRL's
``DPOTrainer._compute_loss``); the inputs are float32, so the tolerance is the package's 1e-5.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import losses
from tests.losses.utils import assert_close, check_transforms, make_mask

B, T, V = 6, 5, 11


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def log_sigmoid(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def ref_score(x, f, alpha):
    if f == "reverse_kl" or (f == "alpha_divergence" and alpha == 0.0):
        return x
    if f == "forward_kl":
        return -math.exp(-x)
    if f == "js_divergence":
        return log_sigmoid(x)
    return -math.exp(-alpha * x) / alpha


def ref_pair_losses(name, c, r, beta, eps, f, alpha, delta):
    """Per-pair loss of one pair from its log-ratios c, r (floats)."""
    sc, sr = ref_score(c, f, alpha), ref_score(r, f, alpha)
    z = beta * (sc - sr)
    if name == "sigmoid":
        return -log_sigmoid(z)
    if name == "hinge":
        return max(0.0, 1.0 - z)
    if name == "robust":
        return (-(1 - eps) * log_sigmoid(z) + eps * log_sigmoid(-z)) / (1 - 2 * eps)
    if name == "bco_pair":
        return -log_sigmoid(beta * sc - delta) - log_sigmoid(-(beta * sr - delta))
    if name == "nca_pair":
        bc, br = beta * sc, beta * sr
        return -log_sigmoid(bc) - 0.5 * log_sigmoid(-bc) - 0.5 * log_sigmoid(-br)
    if name == "apo_zero":
        return (1 - sigmoid(beta * c)) + sigmoid(beta * r)
    if name == "apo_down":
        return sigmoid(beta * c) + (1 - sigmoid(beta * (c - r)))
    if name == "exo_pair":
        qw, ql = sigmoid(z), sigmoid(-z)
        return qw * (log_sigmoid(z) - math.log(1 - eps)) + ql * (log_sigmoid(-z) - math.log(eps))
    if name == "sppo_hard":
        return (sc - 0.5 / beta) ** 2 + (sr + 0.5 / beta) ** 2
    raise AssertionError(name)


def ref_variant(name, logps, mask, *, beta, eps=0.0, f="reverse_kl", alpha=0.5, weights=None):
    pc, pr, rc, rr = (np.asarray(x, np.float64) for x in logps)
    idx = [i for i in range(len(pc)) if mask[i]]
    c = [pc[i] - rc[i] for i in idx]
    r = [pr[i] - rr[i] for i in idx]
    rewards = [beta * ref_score(x, f, alpha) for x in c + r]
    delta = sum(rewards) / len(rewards)  # bco_pair's batch baseline
    w = [1.0 if weights is None else float(weights[i]) for i in idx]
    vals = [
        wi * ref_pair_losses(name, ci, ri, beta, eps, f, alpha, delta)
        for wi, ci, ri in zip(w, c, r, strict=True)
    ]
    return sum(vals) / len(vals)


def ref_aot(logps, mask, *, beta, eps, unpaired):
    pc, pr, rc, rr = (np.asarray(x, np.float64)[mask] for x in logps)
    if unpaired:
        d = np.sort(pc - rc) - np.sort(pr - rr)
    else:
        d = np.sort(pc - pr) - np.sort(rc - rr)
    return np.mean([-(1 - eps) * log_sigmoid(beta * x) - eps * log_sigmoid(-beta * x) for x in d])


def ref_metrics(logps, mask, beta):
    pc, pr, rc, rr = (np.asarray(x, np.float64)[mask] for x in logps)
    c, r = beta * (pc - rc), beta * (pr - rr)
    return {
        "rewards/chosen": c.mean(),
        "rewards/rejected": r.mean(),
        "rewards/accuracy": (c > r).mean(),
        "rewards/margin": (c - r).mean(),
    }


def _inputs(seed):
    rng = np.random.default_rng(seed)
    logps = tuple(rng.normal(-3.0, 1.5, B).astype(np.float32) for _ in range(4))
    pair_mask = np.ones(B, bool)
    pair_mask[-1] = False  # a padding pair
    weights = rng.uniform(0.2, 1.5, B).astype(np.float32)
    return logps, pair_mask, weights


# name -> (function, extra kwargs, supports f_divergence, supports pair_weights)
VARIANTS = {
    "robust": (losses.robust_dpo_loss, {"label_smoothing": 0.2}, True, True),
    "bco_pair": (losses.bco_pair_loss, {}, True, True),
    "nca_pair": (losses.nca_pair_loss, {}, True, True),
    "apo_zero": (losses.apo_zero_loss, {}, False, True),
    "apo_down": (losses.apo_down_loss, {}, False, True),
    "exo_pair": (losses.exo_pair_loss, {"label_smoothing": 1e-3}, True, True),
    "sppo_hard": (losses.sppo_hard_loss, {}, True, True),
}
F_CASES = [
    ("reverse_kl", 0.5),
    ("forward_kl", 0.5),
    ("js_divergence", 0.5),
    ("alpha_divergence", 0.3),
    ("alpha_divergence", 0.0),  # the reverse-KL limit
]


def _cases():
    for name, (_, _, f_ok, _) in VARIANTS.items():
        for f, alpha in F_CASES if f_ok else F_CASES[:1]:
            yield name, f, alpha


@pytest.mark.parametrize("name, f, alpha", list(_cases()))
def test_variant_matches_reference(name, f, alpha):
    fn, extra, f_ok, _ = VARIANTS[name]
    logps, pair_mask, weights = _inputs(0)
    kw = dict(beta=0.3, pair_mask=pair_mask, **extra)
    if f_ok:
        kw.update(f_divergence=f, f_alpha=alpha)
    loss, metrics = jax.jit(lambda *a: fn(*a, **kw))(*logps)
    eps = extra.get("label_smoothing", 0.0)
    expected = ref_variant(name, logps, pair_mask, beta=0.3, eps=eps, f=f, alpha=alpha)
    assert_close(loss, expected)
    for key, value in ref_metrics(logps, pair_mask, 0.3).items():
        assert_close(metrics[key], value)
    # WPO-style constant weights multiply each pair's loss; the mean is not renormalised.
    weighted = fn(*logps, pair_weights=weights, **kw)[0]
    w_expected = ref_variant(
        name, logps, pair_mask, beta=0.3, eps=eps, f=f, alpha=alpha, weights=weights
    )
    assert_close(weighted, w_expected)
    check_transforms(
        lambda *a: fn(*a[:4], pair_weights=a[4], **kw),
        (*logps, weights),
        (*_inputs(1)[0], _inputs(1)[2]),
        grad_argnums=(0, 1, 4),
    )


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge"])
@pytest.mark.parametrize("f, alpha", F_CASES[1:4])
def test_f_divergence_dpo_matches_reference(loss_type, f, alpha):
    logps, pair_mask, weights = _inputs(2)
    kw = dict(beta=0.3, loss_type=loss_type, f_divergence=f, f_alpha=alpha, pair_mask=pair_mask)
    loss, _ = jax.jit(lambda *a: losses.dpo_loss(*a, **kw))(*logps)
    assert_close(loss, ref_variant(loss_type, logps, pair_mask, beta=0.3, f=f, alpha=alpha))
    weighted = losses.dpo_loss(*logps, pair_weights=weights, **kw)[0]
    assert_close(
        weighted,
        ref_variant(loss_type, logps, pair_mask, beta=0.3, f=f, alpha=alpha, weights=weights),
    )


def test_f_divergence_scores_hand_case():
    # u = pi / pi_ref = 2 (log u = 0.6931472): reverse KL log 2; forward KL -1/u = -0.5;
    # JS log(u / (1 + u)) = log(2/3) = -0.4054651; alpha 0.5: -u^-0.5 / 0.5 = -1.4142136;
    # alpha 1 is forward KL again (-0.5).
    x = jnp.log(jnp.array([2.0]))
    scores = lambda f, a=0.5: losses.f_divergence_scores(x, f_divergence=f, alpha=a)
    assert_close(scores("reverse_kl"), [0.6931472])
    assert_close(scores("forward_kl"), [-0.5])
    assert_close(scores("js_divergence"), [-0.4054651])
    assert_close(scores("alpha_divergence"), [-1.4142136])
    assert_close(scores("alpha_divergence", 1.0), [-0.5])
    # f-DPO with forward KL: chosen u = 2, rejected u = 1/2 -> s_c = -0.5, s_r = -2, h = 1.5,
    # beta 1: -log sigma(1.5) = 0.2014133 (plain DPO would give -log sigma(1.3862944)).
    args = [jnp.log(jnp.array([v])) for v in (2.0, 0.5, 1.0, 1.0)]
    assert_close(losses.dpo_loss(*args, beta=1.0, f_divergence="forward_kl")[0], 0.2014133)


def test_f_divergence_scores_stay_finite():
    # log u = -200: exp(200) overflows float32; the exponent is capped at 80 (value -exp(80),
    # zero gradient), so a DPO loss on it stays finite.
    x = jnp.array([-200.0, 0.0])
    out = losses.f_divergence_scores(x, f_divergence="forward_kl")
    assert_close(out, [-math.exp(80.0), -1.0], rtol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(losses.f_divergence_scores(x, f_divergence="forward_kl")))(x)
    assert_close(grad, [0.0, 1.0])


# One pair with log-ratios c = logp_c - ref_c = 1 and r = logp_r - ref_r = -1, beta 0.5:
# beta c = 0.5, beta r = -0.5, beta h = 1. sigma(1) = 0.7310586, log sigma(1) = -0.3132617,
# log sigma(-1) = -1.3132617, sigma(0.5) = 0.6224593, log sigma(0.5) = -0.4740770,
# log sigma(-0.5) = -0.9740770.
HAND = [jnp.array([x]) for x in (-1.0, -5.0, -2.0, -4.0)]
HAND_CASES = {
    # (0.9 * 0.3132617 - 0.1 * 1.3132617) / 0.8 = (0.2819355 - 0.1313262) / 0.8
    "robust": (losses.robust_dpo_loss, {"label_smoothing": 0.1}, 0.1882617),
    # baseline 0: 2 * -log sigma(0.5) = 0.9481540 (the batch baseline (0.5 - 0.5) / 2 is also 0)
    "bco_pair": (losses.bco_pair_loss, {"baseline": 0.0}, 0.9481540),
    # 0.4740770 + 0.5 * 0.9740770 + 0.5 * 0.4740770
    "nca_pair": (losses.nca_pair_loss, {}, 1.1981540),
    # (1 - sigma(0.5)) + sigma(-0.5) = 0.3775407 * 2
    "apo_zero": (losses.apo_zero_loss, {}, 0.7550813),
    # sigma(0.5) + 1 - sigma(1) = 0.6224593 + 0.2689414
    "apo_down": (losses.apo_down_loss, {}, 0.8914008),
    # 0.7310586 * (-0.3132617 - log 0.999) + 0.2689414 * (-1.3132617 - log 0.001)
    #   = 0.7310586 * -0.3122612 + 0.2689414 * 5.5944936 = -0.2282812 + 1.5045911
    "exo_pair": (losses.exo_pair_loss, {"label_smoothing": 1e-3}, 1.2763098),
    # targets +-1/(2 * 0.5) = +-1: (1 - 1)^2 + (-1 + 1)^2
    "sppo_hard": (losses.sppo_hard_loss, {}, 0.0),
}


@pytest.mark.parametrize("name", list(HAND_CASES))
def test_variant_hand_cases(name):
    fn, kw, expected = HAND_CASES[name]
    loss, metrics = fn(*HAND, beta=0.5, **kw)
    assert_close(loss, expected)
    assert_close(metrics["rewards/margin"], 1.0)


def test_bco_pair_batch_baseline_and_sppo_hand_cases():
    # c = 1, r = 0, beta 0.5: delta = (0.5 + 0) / 2 = 0.25 (the batch baseline),
    # loss = -log sigma(0.25) - log sigma(0.25) = 2 * log(1 + e^-0.25) = 1.1518788.
    args = [jnp.array([x]) for x in (-1.0, -4.0, -2.0, -4.0)]
    loss, metrics = losses.bco_pair_loss(*args, beta=0.5)
    assert_close(loss, 1.1518788)
    assert_close(metrics["bco/baseline"], 0.25)
    # SPPO-hard with c = 2, r = 0, beta 0.5: (2 - 1)^2 + (0 + 1)^2 = 2.
    args = [jnp.array([x]) for x in (0.0, -4.0, -2.0, -4.0)]
    assert_close(losses.sppo_hard_loss(*args, beta=0.5)[0], 2.0)


def test_bco_pair_baseline_is_a_constant():
    # d loss / d logp_c with the batch baseline: only the sigmoid term, as for a fixed delta.
    args = [jnp.array([x]) for x in (-1.0, -4.0, -2.0, -4.0)]
    g_batch = jax.grad(lambda a: losses.bco_pair_loss(a, *args[1:], beta=0.5)[0])(args[0])
    g_fixed = jax.grad(lambda a: losses.bco_pair_loss(a, *args[1:], beta=0.5, baseline=0.25)[0])(
        args[0]
    )
    # d/d logp_c of -log sigma(beta c - delta) at beta c = 0.5, delta = 0.25:
    # -beta (1 - sigma(0.25)) = -0.5 * 0.4378235 = -0.2189118; delta contributes nothing.
    assert_close(g_batch, g_fixed)
    assert_close(g_batch, [-0.5 * (1 - sigmoid(0.25))])


# ----------------------------------------------------------------------------- AOT
@pytest.mark.parametrize("unpaired", [False, True])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_aot_matches_reference(unpaired, eps):
    fn = losses.aot_unpaired_loss if unpaired else losses.aot_loss
    logps, pair_mask, _ = _inputs(3)
    kw = dict(beta=0.3, label_smoothing=eps)
    loss, metrics = jax.jit(lambda *a: fn(*a[:4], pair_mask=a[4], **kw))(*logps, pair_mask)
    assert_close(loss, ref_aot(logps, pair_mask, beta=0.3, eps=eps, unpaired=unpaired))
    for key, value in ref_metrics(logps, pair_mask, 0.3).items():
        assert_close(metrics[key], value)
    # Padding is sorted out whatever it holds (here +-1e4), and gets no gradient.
    garbage = tuple(
        np.where(pair_mask, x, s * 1e4).astype(np.float32)
        for x, s in zip(logps, (1, -1, 1, -1), strict=True)
    )
    assert_close(fn(*garbage, pair_mask=pair_mask, **kw)[0], loss)
    grads = jax.grad(lambda *a: fn(*a, pair_mask=pair_mask, **kw)[0], argnums=(0, 1))(*garbage)
    assert all(float(g[-1]) == 0.0 for g in grads)
    check_transforms(
        lambda *a: fn(*a[:4], pair_mask=a[4], **kw),
        (*logps, pair_mask),
        (*_inputs(4)[0], pair_mask),
        grad_argnums=(0, 1),
    )


def test_aot_hand_cases():
    # Paired: policy margins logp_c - logp_r = [3, -1], reference margins [0, 2]. Sorted:
    # [-1, 3] - [0, 2] = [-1, 1]; beta 1: (-log sigma(-1) - log sigma(1)) / 2
    # = (1.3132617 + 0.3132617) / 2 = 0.8132617 (pair by pair it would be [3, -3]: 1.5485874).
    pc, pr = jnp.array([0.0, -2.0]), jnp.array([-3.0, -1.0])
    rc, rr = jnp.array([-1.0, -1.0]), jnp.array([-1.0, -3.0])
    assert_close(losses.aot_loss(pc, pr, rc, rr, beta=1.0)[0], 0.8132617)
    # Unpaired: c = [1, -2], r = [-3, 0]. Sorted: [-2, 1] - [-3, 0] = [1, 1]:
    # -log sigma(1) = 0.3132617 (pair by pair [4, -2]: 1.0725390).
    zeros = jnp.zeros(2)
    c, r = jnp.array([1.0, -2.0]), jnp.array([-3.0, 0.0])
    assert_close(losses.aot_unpaired_loss(c, r, zeros, zeros, beta=1.0)[0], 0.3132617)


# ----------------------------------------------------------------------------- validation
def test_variants_validate_their_arguments():
    with pytest.raises(ValueError, match="label_smoothing"):
        losses.robust_dpo_loss(*HAND, label_smoothing=0.5)
    with pytest.raises(ValueError, match="label_smoothing"):
        losses.exo_pair_loss(*HAND, label_smoothing=0.0)
    with pytest.raises(ValueError, match="baseline"):
        losses.bco_pair_loss(*HAND, baseline="running")
    with pytest.raises(ValueError, match="f_divergence"):
        losses.nca_pair_loss(*HAND, f_divergence="kl")
    with pytest.raises(ValueError, match="ipo"):
        losses.dpo_loss(*HAND, loss_type="ipo", f_divergence="forward_kl")


@pytest.mark.parametrize(
    "fn",
    [
        losses.robust_dpo_loss,
        losses.bco_pair_loss,
        losses.nca_pair_loss,
        losses.apo_zero_loss,
        losses.apo_down_loss,
        losses.exo_pair_loss,
        losses.sppo_hard_loss,
        losses.aot_loss,
        losses.aot_unpaired_loss,
    ],
)
def test_variants_with_no_real_pairs_are_zero_and_ignore_the_reference(fn):
    none = jnp.zeros(1, bool)
    assert float(fn(*HAND, pair_mask=none)[0]) == 0.0
    grads = jax.grad(lambda *a: fn(*a)[0], argnums=(0, 1, 2, 3))(*HAND)
    assert float(grads[2][0]) == 0.0 and float(grads[3][0]) == 0.0


# ----------------------------------------------------------------------------- WPO
def ref_wpo(logits, targets, mask):
    out = np.ones(logits.shape[0])
    for b in range(logits.shape[0]):
        vals = []
        for t in range(logits.shape[1]):
            if mask[b, t]:
                z = logits[b, t].astype(np.float64)
                p = np.exp(z - z.max())
                p /= p.sum()
                vals.append(math.log(p[targets[b, t]] / np.sum(p**2)))
        if vals:
            out[b] = math.exp(sum(vals) / len(vals))
    return out


def test_wpo_weights_match_reference():
    rng = np.random.default_rng(5)
    logits = (2.0 * rng.normal(size=(B, T, V))).astype(np.float32)
    targets = rng.integers(0, V, (B, T))
    mask = make_mask(rng, B, T)  # row 0 empty: weight 1
    out = jax.jit(losses.wpo_weights)(logits, targets, mask)
    assert_close(out, ref_wpo(logits, targets, mask))
    assert float(out[0]) == 1.0
    grad = jax.grad(lambda z: jnp.sum(losses.wpo_weights(z, targets, mask)))(logits)
    assert not np.asarray(grad).any()  # a constant weight


def test_wpo_weights_hand_case():
    # Logits [log 3, 0]: p = [0.75, 0.25], sum p^2 = 0.625. Target 0: log(0.75 / 0.625) =
    # log 1.2; target 1: log(0.25 / 0.625) = log 0.4. Mean of the two, exponentiated:
    # sqrt(1.2 * 0.4) = sqrt(0.48) = 0.6928203. Uniform logits: p(y) = sum p^2, weight 1.
    logits = jnp.array([[[math.log(3.0), 0.0]] * 2, [[0.0, 0.0]] * 2])
    out = losses.wpo_weights(logits, jnp.array([[0, 1], [1, 1]]), jnp.ones((2, 2)))
    assert_close(out, [0.6928203, 1.0])
