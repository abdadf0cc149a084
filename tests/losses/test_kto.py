"""KTO (unpaired) and its reference point vs a NumPy reference of TRL's ``KTOTrainer``."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import losses
from tests.losses.utils import assert_close, check_transforms

B = 8


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def ref_kto(lp, ref, desirable, kl_lp, kl_ref, mask, *, beta, wd, wu, loss_type):
    """TRL: z0 = clamp(mean(KL_logps - ref_KL_logps), min=0); losses concatenated and averaged."""
    idx = [i for i in range(len(lp)) if mask[i]]
    z0 = 0.0
    if loss_type == "kto":
        z0 = max(float(np.mean([float(kl_lp[i]) - float(kl_ref[i]) for i in idx])), 0.0)
    vals, chosen, rejected = [], [], []
    for i in idx:
        x = float(lp[i]) - float(ref[i])
        if desirable[i]:
            loss = 1 - sigmoid(beta * (x - z0)) if loss_type == "kto" else 1 - sigmoid(beta * x)
            vals.append(wd * loss)
            chosen.append(beta * x)
        else:
            loss = 1 - sigmoid(beta * (z0 - x)) if loss_type == "kto" else sigmoid(beta * x)
            vals.append(wu * loss)
            rejected.append(beta * x)
    return np.mean(vals), z0, np.mean(chosen), np.mean(rejected)


def _inputs(seed):
    rng = np.random.default_rng(seed)
    lp, ref, kl_lp, kl_ref = (rng.normal(-3.0, 1.5, B).astype(np.float32) for _ in range(4))
    kl_lp = kl_lp + 0.5  # a positive KL estimate, so z0 is not clamped to 0
    desirable = np.array([1, 0, 1, 1, 0, 0, 1, 0], bool)
    mask = np.ones(B, bool)
    mask[-2:] = False  # padding examples
    return lp, ref, desirable, kl_lp, kl_ref, mask


@pytest.mark.parametrize("loss_type", losses.KTO_LOSS_TYPES)
@pytest.mark.parametrize("wd, wu", [(1.0, 1.0), (1.0, 1.33)])
def test_kto_matches_reference(loss_type, wd, wu):
    lp, ref, desirable, kl_lp, kl_ref, mask = _inputs(0)
    kw = dict(beta=0.3, desirable_weight=wd, undesirable_weight=wu, loss_type=loss_type)
    fn = lambda *a: losses.kto_loss(*a[:5], example_mask=a[5], **kw)
    loss, metrics = jax.jit(fn)(lp, ref, desirable, kl_lp, kl_ref, mask)
    expected, z0, chosen, rejected = ref_kto(
        lp, ref, desirable, kl_lp, kl_ref, mask, beta=0.3, wd=wd, wu=wu, loss_type=loss_type
    )
    if loss_type == "kto":
        assert z0 > 0.1
    assert_close(loss, expected)
    assert_close(metrics["kto/kl"], z0)
    assert_close(metrics["rewards/chosen"], chosen)
    assert_close(metrics["rewards/rejected"], rejected)
    assert_close(metrics["rewards/margin"], chosen - rejected)
    check_transforms(fn, (lp, ref, desirable, kl_lp, kl_ref, mask), _inputs(1), grad_argnums=(0, 3))


def test_kto_hand_case():
    # Desirable x = logp - ref = 1, undesirable x = -1; mismatched-pair log-ratios [0.5, -0.1]
    # -> z0 = max((0.5 - 0.1) / 2, 0) = 0.2. beta 0.5:
    #   desirable:   1 - sigma(0.5 * (1 - 0.2)) = 1 - sigma(0.4) = 0.4013123
    #   undesirable: 1 - sigma(0.5 * (0.2 + 1)) = 1 - sigma(0.6) = 0.3543437
    # undesirable_weight 2: loss = (0.4013123 + 2 * 0.3543437) / 2 = 0.5549999.
    lp, ref = jnp.array([-1.0, -3.0]), jnp.array([-2.0, -2.0])
    desirable = jnp.array([True, False])
    kl_lp, kl_ref = jnp.array([-1.5, -2.1]), jnp.array([-2.0, -2.0])
    loss, metrics = losses.kto_loss(
        lp, ref, desirable, kl_lp, kl_ref, beta=0.5, undesirable_weight=2.0
    )
    assert_close(loss, 0.5549999)
    assert_close(metrics["kto/kl"], 0.2)
    assert_close(metrics["rewards/chosen"], 0.5)
    assert_close(metrics["rewards/rejected"], -0.5)
    # APO-zero unpaired: 1 - sigma(0.5) = 0.3775407 and sigma(-0.5) = 0.3775407: mean 0.3775407.
    apo, apo_metrics = losses.kto_loss(lp, ref, desirable, beta=0.5, loss_type="apo_zero_unpaired")
    assert_close(apo, 0.3775407)
    assert float(apo_metrics["kto/kl"]) == 0.0


def test_kto_reference_point_is_clamped_and_constant():
    # Mean mismatched log-ratio (-0.5 + 0.1) / 2 = -0.2 < 0 -> z0 = 0; the third is padding.
    kl_lp, kl_ref = jnp.array([-2.5, -1.9, 100.0]), jnp.array([-2.0, -2.0, 0.0])
    mask = jnp.array([True, True, False])
    assert float(losses.kto_kl_reference_point(kl_lp, kl_ref, example_mask=mask)) == 0.0
    assert_close(losses.kto_kl_reference_point(kl_lp + 1.0, kl_ref, example_mask=mask), 0.8)
    lp, ref, desirable, kl_lp, kl_ref, mask = _inputs(2)
    grads = jax.grad(lambda *a: losses.kto_loss(*a, example_mask=mask)[0], argnums=(0, 1, 3, 4))(
        lp, ref, desirable, kl_lp, kl_ref
    )
    assert np.asarray(grads[0])[mask].all()  # every real example is trained
    assert not np.asarray(grads[0])[~mask].any()
    assert not any(np.asarray(g).any() for g in grads[1:])  # reference and z0 are constants


def test_kto_validates():
    x = jnp.zeros(2)
    with pytest.raises(ValueError, match="policy_kl_logps"):
        losses.kto_loss(x, x, jnp.array([True, False]))
    with pytest.raises(ValueError, match="loss_type"):
        losses.kto_loss(x, x, jnp.array([True, False]), x, x, loss_type="bco")
    none = jnp.zeros(2, bool)
    assert float(losses.kto_loss(x, x, jnp.array([True, False]), x, x, example_mask=none)[0]) == 0
