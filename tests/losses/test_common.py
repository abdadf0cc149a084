"""Masked helpers, aggregation modes, token log-probs and entropy vs NumPy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import losses
from jaxrlhf.losses.common import token_logprobs_and_entropy
from tests.losses.utils import (
    assert_close,
    check_transforms,
    garbage_like,
    make_mask,
    ref_aggregate,
)

B, T, V = 5, 7, 11


# ----------------------------------------------------------------------------- references
def ref_masked_mean(x, m, axis=None):
    if axis is None:
        vals = [x[i] for i in np.ndindex(x.shape) if m[i]]
        return sum(vals) / max(len(vals), 1)
    return np.array([ref_masked_mean(x[b], m[b]) for b in range(x.shape[0])])


def ref_var(x, m, ddof=0):
    vals = np.array([x[i] for i in np.ndindex(x.shape) if m[i]], np.float64)
    if len(vals) == 0:
        return 0.0
    return float(((vals - vals.mean()) ** 2).sum() / max(len(vals) - ddof, 1))


def ref_logprobs(logits, targets):
    out = np.zeros(targets.shape)
    for idx in np.ndindex(targets.shape):
        z = logits[idx].astype(np.float64)
        out[idx] = z[targets[idx]] - (z.max() + np.log(np.exp(z - z.max()).sum()))
    return out


def ref_entropy(logits):
    out = np.zeros(logits.shape[:-1])
    for idx in np.ndindex(out.shape):
        z = logits[idx].astype(np.float64)
        p = np.exp(z - z.max())
        p /= p.sum()
        out[idx] = -sum(pi * np.log(pi) for pi in p if pi > 0)
    return out


def _inputs(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T)).astype(np.float32)
    mask = make_mask(rng, B, T, holes=True)
    return x, mask


# ----------------------------------------------------------------------------- masked stats
def test_masked_sum_mean_match_reference():
    x, mask = _inputs(0)
    assert_close(losses.masked_sum(x, mask), float(np.sum(x[mask], dtype=np.float64)))
    assert_close(losses.masked_mean(x, mask), ref_masked_mean(x, mask))
    assert_close(losses.masked_mean(x, mask, axis=-1), ref_masked_mean(x, mask, axis=-1))
    assert float(losses.masked_mean(x, mask, axis=-1)[0]) == 0.0  # empty row
    # Any mask dtype is accepted.
    assert_close(losses.masked_mean(x, mask.astype(np.int32)), ref_masked_mean(x, mask))


def test_masked_var_and_whiten_match_reference():
    x, mask = _inputs(1)
    assert_close(losses.masked_var(x, mask), ref_var(x, mask))
    assert_close(losses.masked_var(x, mask, unbiased=True), ref_var(x, mask, ddof=1))
    mu, var = ref_masked_mean(x, mask), ref_var(x, mask)
    expected = np.where(mask, (x - mu) / np.sqrt(var + 1e-8), 0.0)
    assert_close(losses.masked_whiten(x, mask), expected)
    assert_close(losses.masked_whiten(x, mask, shift_mean=False), np.where(mask, expected + mu, 0))
    var1 = ref_var(x, mask, ddof=1)
    unbiased = np.where(mask, (x - mu) / np.sqrt(var1 + 1e-8), 0.0)
    assert_close(losses.masked_whiten(x, mask, unbiased=True), unbiased)


def test_masked_stats_hand_case():
    # x = [1, 2, 3, (4 masked)]: sum 6, mean 2, biased var = (1 + 0 + 1) / 3 = 2/3, unbiased 1;
    # whitened = (x - 2) / sqrt(2/3) = [-1.224745, 0, 1.224745] and 0 at the masked slot.
    x, mask = jnp.array([1.0, 2.0, 3.0, 4.0]), jnp.array([1, 1, 1, 0])
    assert_close(losses.masked_sum(x, mask), 6.0)
    assert_close(losses.masked_mean(x, mask), 2.0)
    assert_close(losses.masked_var(x, mask), 2.0 / 3.0)
    assert_close(losses.masked_var(x, mask, unbiased=True), 1.0)
    assert_close(losses.masked_whiten(x, mask), [-1.2247449, 0.0, 1.2247449, 0.0])
    # Unbiased var 1: (x - 2) / sqrt(1 + 1e-8) = [-1, 0, 1] (to 5e-9).
    assert_close(losses.masked_whiten(x, mask, unbiased=True), [-1.0, 0.0, 1.0, 0.0])


def test_unbiased_whiten_of_one_position_is_finite():
    # n = 1: n - 1 = 0, so the variance is 0 / max(0, 1) = 0 and the output (x - mu) = 0.
    x, mask = jnp.array([3.0, 7.0]), jnp.array([True, False])
    out, grad = jax.jit(
        jax.value_and_grad(lambda x: jnp.sum(losses.masked_whiten(x, mask, unbiased=True)))
    )(x)
    assert float(losses.masked_var(x, mask, unbiased=True)) == 0.0
    assert float(out) == 0.0 and np.all(np.isfinite(np.asarray(grad)))


def test_masked_stats_empty_mask_are_finite_with_finite_grads():
    x = jnp.ones((2, 3))
    empty = jnp.zeros((2, 3), bool)
    for fn in (losses.masked_mean, losses.masked_var, losses.masked_whiten):
        out, grad = jax.jit(jax.value_and_grad(lambda x, fn=fn: jnp.sum(fn(x, empty))))(x)
        assert float(out) == 0.0
        assert np.all(np.asarray(grad) == 0.0)


def test_masked_stats_transforms():
    check_transforms(lambda x, m: losses.masked_whiten(x, m), _inputs(2), _inputs(3))
    check_transforms(lambda x, m: losses.masked_mean(x, m, axis=-1), _inputs(2), _inputs(3))


# ----------------------------------------------------------------------------- aggregation
@pytest.mark.parametrize("mode", losses.AGGREGATIONS)
def test_aggregate_loss_matches_reference(mode):
    x, mask = _inputs(4)
    out = losses.aggregate_loss(x, mask, aggregation=mode, norm_constant=B * T)
    assert_close(out, ref_aggregate(x, mask, mode, norm=B * T))
    # Padding values do not leak.
    rng = np.random.default_rng(5)
    out2 = losses.aggregate_loss(
        garbage_like(rng, x, mask), mask, aggregation=mode, norm_constant=B * T
    )
    assert_close(out2, out)
    check_transforms(
        lambda x, m: losses.aggregate_loss(x, m, aggregation=mode, norm_constant=B * T),
        (x, mask),
        _inputs(6),
    )


def test_aggregate_loss_hand_case():
    # Row 0 counts [1, 2], row 1 is empty, row 2 counts [7, 8, 9]:
    #   token_mean          = (1 + 2 + 7 + 8 + 9) / 5 = 5.4
    #   seq_mean_token_mean = (1.5 + 8) / 2 = 4.75   (the empty row is not averaged in)
    #   seq_mean_token_sum  = (3 + 24) / 2 = 13.5
    #   token_sum_norm(10)  = 27 / 10 = 2.7
    loss = jnp.arange(1.0, 10.0).reshape(3, 3)
    mask = jnp.array([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    expected = {
        "token_mean": 5.4,
        "seq_mean_token_mean": 4.75,
        "seq_mean_token_sum": 13.5,
        "token_sum_norm": 2.7,
    }
    for mode, value in expected.items():
        assert_close(losses.aggregate_loss(loss, mask, aggregation=mode, norm_constant=10.0), value)


def test_aggregate_loss_all_empty_is_zero_with_zero_grad():
    for mode in losses.AGGREGATIONS:
        fn = lambda x, mode=mode: losses.aggregate_loss(
            x, jnp.zeros((2, 3)), aggregation=mode, norm_constant=6.0
        )
        value, grad = jax.jit(jax.value_and_grad(fn))(jnp.ones((2, 3)))
        assert float(value) == 0.0 and np.all(np.asarray(grad) == 0.0)


def test_aggregate_loss_rejects_bad_modes():
    with pytest.raises(ValueError, match="expected one of"):
        losses.aggregate_loss(jnp.ones((2, 2)), jnp.ones((2, 2)), aggregation="mean")
    with pytest.raises(ValueError, match="norm_constant"):
        losses.aggregate_loss(jnp.ones((2, 2)), jnp.ones((2, 2)), aggregation="token_sum_norm")


# ----------------------------------------------------------------------------- logprobs
def _logit_inputs(seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    logits = (3.0 * rng.normal(size=(B, T, V))).astype(dtype)
    targets = rng.integers(0, V, size=(B, T))
    return logits, targets


def test_token_logprobs_matches_reference():
    logits, targets = _logit_inputs(7)
    out = losses.token_logprobs(logits, targets)
    assert out.dtype == jnp.float32
    assert_close(out, ref_logprobs(logits, targets))
    check_transforms(losses.token_logprobs, (logits, targets), _logit_inputs(8))


def test_token_logprobs_bf16_logits_upcast_to_float32():
    logits, targets = _logit_inputs(9)
    bf16 = jnp.asarray(logits, jnp.bfloat16)
    out = losses.token_logprobs(bf16, targets)
    assert out.dtype == jnp.float32
    # Reference on the same bf16-rounded values, so only the float32 arithmetic is compared.
    assert_close(out, ref_logprobs(np.asarray(bf16, np.float32), targets))


def test_token_logprobs_hand_case():
    # logits [0, log 3]: softmax = [1/4, 3/4]; log p(1) = log 0.75 = -0.287682,
    # log p(0) = log 0.25 = -1.386294.
    logits = jnp.array([[[0.0, np.log(3.0)], [0.0, np.log(3.0)]]])
    assert_close(losses.token_logprobs(logits, jnp.array([[1, 0]])), [[-0.2876821, -1.3862944]])


def test_token_logprobs_chunked_equals_unchunked():
    logits, targets = _logit_inputs(10)
    logits, targets = logits[:, :6], targets[:, :6]
    full = losses.token_logprobs(logits, targets)
    assert_close(losses.token_logprobs(logits, targets, chunk_size=2), full, atol=1e-6)
    jitted = jax.jit(losses.token_logprobs, static_argnames="chunk_size")
    assert_close(jitted(logits, targets, chunk_size=3), full, atol=1e-6)
    with pytest.raises(ValueError, match="divide"):
        losses.token_logprobs(logits, targets, chunk_size=4)


def test_entropy_matches_reference():
    logits, _ = _logit_inputs(11)
    assert_close(losses.entropy_from_logits(logits), ref_entropy(logits))
    check_transforms(losses.entropy_from_logits, (logits,), (_logit_inputs(12)[0],))


def test_entropy_hand_cases_and_masked_vocab():
    # Uniform over 4 entries: H = log 4 = 1.386294. With one entry at -inf the distribution is
    # uniform over the remaining 3: H = log 3 = 1.098612, and the gradient stays finite.
    assert_close(losses.entropy_from_logits(jnp.zeros((1, 4))), [np.log(4.0)])
    masked = jnp.array([[0.0, 0.0, 0.0, -jnp.inf]])
    assert_close(losses.entropy_from_logits(masked), [np.log(3.0)])
    grad = jax.jit(jax.grad(lambda z: losses.entropy_from_logits(z).sum()))(masked)
    assert np.all(np.isfinite(np.asarray(grad)))
    # dH/dz_i = -p_i (log p_i + H), 0 at the -inf entry: for z = [1, 0, 0, -inf].
    z = jnp.array([[1.0, 0.0, 0.0, -jnp.inf]])
    p = np.exp([1.0, 0.0, 0.0]) / np.exp([1.0, 0.0, 0.0]).sum()
    h = -(p * np.log(p)).sum()
    assert_close(losses.entropy_from_logits(z), [h])
    grad = jax.grad(lambda z: losses.entropy_from_logits(z).sum())(z)
    assert_close(grad, [list(-p * (np.log(p) + h)) + [0.0]])
    # A position with every logit at -inf (nothing to choose from) has entropy 0, not NaN.
    assert_close(losses.entropy_from_logits(jnp.full((1, 4), -jnp.inf)), [0.0])
    _, entropy = token_logprobs_and_entropy(jnp.concatenate([z, z]), jnp.array([0, 1]))
    assert_close(entropy, [h, h])


def test_sequence_logprobs_hand_case():
    # Row 0: [-1, -2, -3] with mask [1, 0, 1] -> sum -4, mean -2. Row 1 is empty -> 0 and 0.
    lp = jnp.array([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    mask = jnp.array([[1, 0, 1], [0, 0, 0]])
    assert_close(losses.sequence_logprobs(lp, mask), [-4.0, 0.0])
    assert_close(losses.sequence_logprobs(lp, mask, average=True), [-2.0, 0.0])


def test_sequence_logprobs():
    x, mask = _inputs(13)
    sums = [sum(x[b, t] for t in range(T) if mask[b, t]) for b in range(B)]
    assert_close(losses.sequence_logprobs(x, mask), sums)
    assert_close(losses.sequence_logprobs(x, mask, average=True), ref_masked_mean(x, mask, axis=-1))
    check_transforms(
        lambda x, m: losses.sequence_logprobs(x, m, average=True), _inputs(13), _inputs(14)
    )
