"""Partial rollouts in the engine: the groups still running when a call has kept enough are
handed out and resumed by the next call (their tokens fed back, then sampling on). Under
the same weights a resumed sample ends exactly as the uninterrupted static sampler's row
(tokens exact, log-probs to 1e-5: other batch shapes round differently); under new weights
its carried tokens keep their log-probs and versions."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrlhf.generation import Sampler, SamplingParams
from jaxrlhf.generation.engine import Engine
from jaxrlhf.generation.partials import concat_partials
from tests.generation.test_engine import STOP, B, P, T
from tests.generation.test_engine import setup as engine_setup  # noqa: F401, F811 (a fixture)

N = 2  # samples per prompt


@pytest.fixture(scope="module")
def setup(engine_setup):  # noqa: F811 (the fixture imported above)
    """test_engine's model and prompts (mixed lengths), sampled with its stop ids."""
    cfg, params, tokens, mask = engine_setup
    sampling = SamplingParams(max_new_tokens=T, n=N, stop_token_ids=STOP, pad_token_id=0)
    return cfg, params, tokens, mask, sampling


def _first_call(cfg, params, tokens, mask, sampling, key):
    engine = Engine(Sampler(cfg), slots=4, chunk=3)
    out = engine.generate(
        params, tokens, mask, key, sampling, keep_groups=1, keep_partials=True, version=0
    )
    return engine, out


def test_resumed_samples_end_as_uninterrupted_ones(setup):
    cfg, params, tokens, mask, sampling = setup
    key = jax.random.key(3)
    ref = jax.device_get(Sampler(cfg).generate(params, tokens, mask, key, sampling))
    engine, first = _first_call(cfg, params, tokens, mask, sampling, key)
    carry = first.partials
    assert carry is not None and first.carried_groups == 0
    # 4 slots hold two groups at a time, freed slots take the next: one group is kept, the
    # others started are carried, the rest (never started) are aborted, nothing of them held.
    assert len(first.kept_groups) == 1 and carry.groups >= 1
    assert first.aborted_groups == B - 1 - carry.groups
    running = ~carry.finished & (carry.lengths > 0)
    assert running.any()  # a sample stopped mid-way, to be resumed
    assert (carry.versions[carry.versions >= 0] == 0).all()
    no_prompts = (np.zeros((0, P), np.int32), np.zeros((0, P), bool))
    second = engine.generate(
        params, *no_prompts, jax.random.key(9), sampling, carry=carry, version=1
    )
    assert second.carried_groups == carry.groups
    assert list(second.kept_groups) == list(range(carry.groups))
    done = second.finished
    rows = (carry.prompt_ids[:, None] * N + np.arange(N)).reshape(-1)  # the first call's rows
    np.testing.assert_array_equal(done.rows, np.arange(carry.groups * N))
    np.testing.assert_array_equal(done.tokens, ref.tokens[rows])
    np.testing.assert_array_equal(done.lengths, ref.lengths[rows])
    np.testing.assert_array_equal(done.stopped, ref.stopped[rows])
    for name in ("logprobs", "model_logprobs"):
        np.testing.assert_allclose(getattr(done, name), getattr(ref, name)[rows], atol=1e-5)
    # Versions: the carried tokens 0, the ones sampled after resuming 1, -1 past the end.
    for i in range(carry.groups * N):
        fed, length = int(carry.lengths[i]), int(done.lengths[i])
        expect = np.r_[np.zeros(fed), np.ones(length - fed), -np.ones(T - length)]
        np.testing.assert_array_equal(done.versions[i], expect)
        if carry.finished[i]:
            assert fed == length
    kept = first.finished
    kept_rows = int(first.kept_groups[0]) * N + np.arange(N)
    np.testing.assert_array_equal(kept.tokens, ref.tokens[kept_rows])


def test_resumed_under_new_weights_keeps_the_carried_log_probs(setup):
    cfg, params, tokens, mask, sampling = setup
    key = jax.random.key(3)
    engine, first = _first_call(cfg, params, tokens, mask, sampling, key)
    carry = first.partials
    new = jax.tree.map(lambda x: x * 1.5, params)  # other weights: other continuations
    fresh = tokens[:2], mask[:2]
    second = engine.generate(
        new,
        *fresh,
        jax.random.key(9),
        sampling,
        carry=carry,
        keep_groups=carry.groups + 2,
        version=7,
    )
    assert second.carried_groups == carry.groups
    done = second.finished
    carried = done.rows < carry.groups * N
    assert carried.sum() == carry.groups * N  # carried groups are resumed first
    for i in np.flatnonzero(carried):
        r = int(done.rows[i])
        fed = int(carry.lengths[r])
        np.testing.assert_array_equal(done.tokens[i, :fed], carry.tokens[r, :fed])
        np.testing.assert_array_equal(done.logprobs[i, :fed], carry.logprobs[r, :fed])
        np.testing.assert_array_equal(done.model_logprobs[i, :fed], carry.model_logprobs[r, :fed])
        assert (done.versions[i, :fed] == 0).all()
        assert (done.versions[i, fed : done.lengths[i]] == 7).all()
    fresh_rows = ~carried
    assert (done.versions[fresh_rows][done.response_mask[fresh_rows]] == 7).all()


def test_partials_select_and_concatenate(setup):
    cfg, params, tokens, mask, sampling = setup
    _, first = _first_call(cfg, params, tokens, mask, sampling, jax.random.key(3))
    carry = first.partials
    g = carry.groups
    both = concat_partials([carry, carry])
    assert both.groups == 2 * g and both.tokens.shape == (2 * g * N, T)
    again = both.select(np.arange(g, 2 * g))
    for name in ("tokens", "versions", "lengths", "prompt_tokens"):
        np.testing.assert_array_equal(getattr(again, name), getattr(carry, name))
    assert concat_partials([None]) is None
    assert carry.oldest()[0] == 0


def test_partials_refuse_episodes_and_other_shapes(setup):
    cfg, params, tokens, mask, sampling = setup
    engine, first = _first_call(cfg, params, tokens, mask, sampling, jax.random.key(3))
    wide = SamplingParams(max_new_tokens=T + 4, n=N, pad_token_id=0)
    with pytest.raises(ValueError, match="carried partials of 8 prompt and 12 generated"):
        engine.generate(params, tokens, mask, jax.random.key(1), wide, carry=first.partials)
    with pytest.raises(ValueError, match="partial rollouts do not resume multi-turn"):
        engine.generate(
            params,
            tokens,
            mask,
            jax.random.key(1),
            sampling,
            keep_partials=True,
            environments=object(),
        )


@pytest.mark.slow
def test_a_call_that_ends_soon_after_resuming_carries_the_samples_on(setup):
    """One-token chunks and one group kept, the new group ending after one step: the call
    ends right after the carried samples were resumed. They leave with their carried tokens
    (and versions) unchanged and whatever they sampled since (version 1) after them: a
    resumed sample never goes back (its prompt and tokens are prefilled in one pass)."""
    cfg, params, tokens, mask, sampling = setup
    engine = Engine(Sampler(cfg), slots=4, chunk=1)
    first = engine.generate(
        params, tokens, mask, jax.random.key(3), sampling, keep_groups=1, keep_partials=True
    )
    carry = first.partials
    second = engine.generate(
        params,
        tokens[:1],
        mask[:1],
        jax.random.key(4),
        sampling,
        max_new_tokens=[1],  # the new group ends after one step
        carry=carry,
        keep_groups=1,
        keep_partials=True,
        version=1,
    )
    again = second.partials
    assert again is not None
    compared = 0
    for k, g in enumerate(again.prompt_ids):
        if g >= carry.groups:
            continue  # the new group
        rows, back = slice(g * N, (g + 1) * N), slice(k * N, (k + 1) * N)
        for before, after in zip(range(g * N, (g + 1) * N), range(k * N, (k + 1) * N), strict=True):
            fed = int(carry.lengths[before])
            assert again.lengths[after] >= fed
            np.testing.assert_array_equal(again.tokens[after, :fed], carry.tokens[before, :fed])
            np.testing.assert_array_equal(again.versions[after, :fed], carry.versions[before, :fed])
            new = again.versions[after, fed : again.lengths[after]]
            assert (new == 1).all()
            compared += int(not carry.finished[before] and fed > 0)
        assert (again.finished[back] >= carry.finished[rows]).all()
    assert compared > 0  # a resumed, unfinished sample was carried on
