"""Sampling rules on forced distributions, against NumPy references."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.generation import SamplingParams, draw_uniforms, next_tokens, sample_from_logits

# One row of 12 distinct probabilities (sorted: 0.30 0.20 0.15 0.10 0.08 ...).
PROBS = np.array([0.02, 0.30, 0.01, 0.10, 0.15, 0.005, 0.08, 0.20, 0.06, 0.04, 0.025, 0.01])
PROBS = PROBS / PROBS.sum()
LOGITS = np.log(PROBS).astype(np.float32) + 3.0  # an offset: logits need not be normalised
DRAWS = 4000


def _allowed(probs: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """NumPy reference: the renormalised sampling distribution (temperature, top-k, top-p)."""
    logits = np.log(probs) / temperature
    p = np.exp(logits - logits.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros(len(p), bool)
    keep[order[: top_k or len(p)]] = True
    if top_p < 1.0:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        mass = 0.0
        nucleus = np.zeros(len(p), bool)
        for i in order:  # most likely first, until the kept mass reaches top_p
            if not keep[i]:
                break
            nucleus[i] = True
            mass += q[i]
            if mass >= top_p:
                break
        keep = nucleus
    out = np.where(keep, p, 0.0)
    return out / out.sum()


@functools.partial(jax.jit, static_argnames="statics")
def _draw(logits, key, arrays, statics):
    """DRAWS independent samples of one logits row [V]: DRAWS rows, one uniform each."""
    uniforms = draw_uniforms(key, DRAWS, 1)[:, 0]
    return next_tokens(
        jnp.broadcast_to(logits, (DRAWS, logits.shape[-1])), uniforms, arrays, statics
    )


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.0, 0, 0.6), (1.3, 5, 0.8), (1.0, 1, 1.0)],
)
def test_samples_stay_in_allowed_set_with_the_right_frequencies(temperature, top_k, top_p):
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    tokens, logprobs, model_lp = _draw(LOGITS, jax.random.key(0), sp.arrays(), sp.static())
    tokens, logprobs, model_lp = (np.asarray(x) for x in (tokens, logprobs, model_lp))
    expected = _allowed(PROBS, temperature, top_k, top_p)
    assert expected[tokens].min() > 0, "sampled a token outside the allowed set"
    # Every allowed token shows up, with its probability (4000 draws: std <= 0.008).
    freq = np.bincount(tokens, minlength=len(PROBS)) / DRAWS
    np.testing.assert_allclose(freq, expected, atol=0.03)
    # Log-probs: of the renormalised sampling distribution, and of the raw model.
    np.testing.assert_allclose(logprobs, np.log(expected[tokens]), atol=1e-5, rtol=0)
    np.testing.assert_allclose(model_lp, np.log(PROBS[tokens]), atol=1e-5, rtol=0)


def test_top_p_allowed_set_by_hand():
    """Sorted probs 0.30 0.20 0.15 0.10 ...: top_p = 0.6 needs 0.30 + 0.20 + 0.15 = 0.65, so
    exactly tokens {1, 7, 4} are allowed; top_p = 0.5 needs only {1, 7} (0.30 + 0.20 = 0.5)."""
    np.testing.assert_array_equal(np.flatnonzero(_allowed(PROBS, 1.0, 0, 0.6)), [1, 4, 7])
    np.testing.assert_array_equal(np.flatnonzero(_allowed(PROBS, 1.0, 0, 0.5 - 1e-9)), [1, 7])
    sp = SamplingParams(top_p=0.6)
    tokens = np.asarray(_draw(LOGITS, jax.random.key(1), sp.arrays(), sp.static())[0])
    assert set(np.unique(tokens)) == {1, 4, 7}


def test_greedy_is_argmax_with_zero_sampling_logprob():
    sp = SamplingParams(temperature=0.0)
    logits = jnp.asarray(np.stack([LOGITS, LOGITS[::-1]]))
    tokens, logprobs, model_lp = next_tokens(logits, jnp.ones(2), sp.arrays(), sp.static())
    np.testing.assert_array_equal(tokens, [1, 10])
    np.testing.assert_array_equal(logprobs, [0.0, 0.0])  # a point mass
    np.testing.assert_allclose(model_lp, np.log(PROBS[[1, 1]]), atol=1e-6)


def test_inverse_cdf_never_picks_zero_probability_tokens():
    logits = jnp.asarray([[-jnp.inf, 0.0, -jnp.inf, 0.0, -jnp.inf]])
    for u, expected in ((1e-9, 1), (0.5, 1), (0.5001, 3), (1.0, 3)):
        got = sample_from_logits(logits, jnp.asarray([u], jnp.float32))
        assert int(got[0]) == expected, (u, int(got[0]))


def test_sort_is_compiled_only_when_truncating():
    logits = jnp.zeros((2, 16))

    def has_sort(sp):
        jaxpr = jax.make_jaxpr(lambda lg, a: next_tokens(lg, jnp.ones(2), a, sp.static()))(
            logits, sp.arrays()
        )
        return " sort[" in str(jaxpr)

    assert not has_sort(SamplingParams(temperature=0.8))
    assert has_sort(SamplingParams(top_k=4))
    assert has_sort(SamplingParams(top_p=0.9))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1.0), r"temperature=-1.0 must be >= 0 \(0 = greedy\)"),
        (dict(top_k=-2), r"top_k=-2 must be an int >= 0"),
        (dict(top_p=0.0), r"top_p=0.0 is not in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p=1.5 is not in \(0, 1\]"),
        (dict(max_new_tokens=0), r"max_new_tokens=0 must be an int >= 1"),
        (dict(n=0), r"n=0 must be an int >= 1"),
        (dict(stop_token_ids=(3, -1)), r"stop_token_ids=\(3, -1\) must be token ids >= 0"),
    ],
)
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_vocab_checks_and_static_split():
    with pytest.raises(ValueError, match=r"stop_token_ids \[200\] not in \[0, 128\)"):
        SamplingParams(stop_token_ids=(5, 200)).check_vocab(128)
    with pytest.raises(ValueError, match=r"top_k=300 is not in \[0, 128\]"):
        SamplingParams(top_k=300).check_vocab(128)
    a, b = SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.3, top_k=50)
    assert a.static() == b.static()  # values are arrays: one compiled program serves both
    assert SamplingParams(temperature=0.0).static().greedy
    assert not SamplingParams(temperature=0.0, top_k=5).static().use_top_k


def test_two_level_inverse_cdf_matches_searchsorted():
    """V = 300 (not a multiple of the block), some zero-probability tokens, 2000 values of u:
    the token is the float64 searchsorted of u in the CDF, except where u lies within float32
    rounding (1e-5) of a CDF step."""
    rng = np.random.default_rng(3)
    probs = rng.dirichlet(np.full(300, 0.3))
    probs[rng.choice(300, 40, replace=False)] = 0.0
    probs /= probs.sum()
    logits = np.where(probs > 0, np.log(np.maximum(probs, 1e-300)), -np.inf).astype(np.float32)
    u = np.linspace(1e-6, 1.0, 2000).astype(np.float32)
    got = np.asarray(
        jax.jit(sample_from_logits, static_argnames="block")(
            jnp.asarray(np.repeat(logits[None], len(u), 0)), jnp.asarray(u), block=64
        )
    )
    cdf = np.cumsum(probs)
    expected = np.searchsorted(cdf, u, side="left")
    near_step = np.abs(cdf[:, None] - u[None]).min(0) < 1e-5
    assert probs[got].min() > 0
    np.testing.assert_array_equal(got[~near_step], expected[~near_step])
    assert (~near_step).sum() > 1900
