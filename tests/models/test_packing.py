"""Sequence packing (models/packing.py) against the padded rollout rows.

The reference is the plain ``RolloutForward`` over the ``[N, P + R]`` rows, each row on its
own. Packing computes the same sums over the same keys (block mask, reset positions), so
outputs agree to float32 reduction order: 1e-5 absolute on log-probs, entropies, values
and scores of size ~1-10 (measured <= 4e-6); parameter gradients of size up to ~30 (sums
over ~60 tokens with cancellation, a shared prompt's now one sum over its rows) 5e-5
absolute plus 2e-5 relative (measured <= 4e-5 absolute), as for packed prompt groups
(tests/models/test_shared_prefix.py).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models import model as M
from jaxrlhf.models import packing as pk
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.scoring import RolloutForward
from tests.tiers import tiered

G, N_SAMPLES, P, R = 3, 4, 6, 5
ROWS = G * N_SAMPLES


def _rollout(vocab: int, seed: int = 0):
    """G groups of N_SAMPLES rows: left-padded prompts of 6, 3 and 1 tokens; right-padded
    responses of random lengths 0..R (row 0 at the budget, row 1 empty); row 7's prompt
    differs from its group's in one token (it shares no prompt copy)."""
    rng = np.random.default_rng(seed)
    prompts = np.repeat(rng.integers(1, vocab, (G, P)), N_SAMPLES, 0)
    prompts[7, -1] = prompts[7, -1] % (vocab - 1) + 1
    prompt_mask = np.repeat(np.arange(P)[None] >= P - np.array([6, 3, 1])[:, None], N_SAMPLES, 0)
    lengths = rng.integers(0, R + 1, ROWS)
    lengths[:2] = R, 0
    mask = np.concatenate([prompt_mask, np.arange(R)[None] < lengths[:, None]], 1)
    tokens = np.concatenate([prompts, rng.integers(1, vocab, (ROWS, R))], 1)
    return np.where(mask, tokens, 0).astype(np.int32), mask


def _plan(tokens, mask, shards, share=True, micro=1):
    rows = np.arange(ROWS).reshape(-1, micro).T  # strided micro-batches, as split_micro
    plan, stats = pk.plan_rows(tokens, mask, P, rows, shards, share)
    return jax.tree.map(jnp.asarray, plan), stats


def _params(cfg, head="lm"):
    return M.init_params(cfg.replace(initializer_range=0.3), jax.random.key(0), head)


def test_plan_and_layout_by_hand():
    """One shard, rows of 8 slots (P = 4): a (prompt x of 2 + 3), b (prompt x + 1), c
    (prompt y of 3, empty response), d (prompt z of 1 + 4). First-fit decreasing: a, d,
    then b joins a's prompt copy in packed row 0 and c fits after d in packed row 1."""
    x, y, z = [5, 6], [7, 8, 9], [4]
    rows = [(x, [11, 12, 13]), (x, [21]), (y, []), (z, [41, 42, 43, 44])]
    tokens = np.zeros((4, 8), np.int32)
    for i, (prompt, response) in enumerate(rows):
        tokens[i, 4 - len(prompt) : 4] = prompt
        tokens[i, 4 : 4 + len(response)] = response
    mask = tokens > 0
    plan, stats = pk.plan_rows(tokens, mask, 4, np.arange(4)[None], 1)
    assert stats == pk.PlanStats(needed=2, tokens=5 + 1 + 3 + 5)
    np.testing.assert_array_equal(plan.row, [0, 0, 1, 1])
    np.testing.assert_array_equal(plan.prompt_slot, [0, 0, 5, 0])
    np.testing.assert_array_equal(plan.response_slot, [2, 5, 8, 1])
    unshared, stats = pk.plan_rows(tokens, mask, 4, np.arange(4)[None], 1, share_prompts=False)
    assert stats.needed == 2 and stats.tokens == 5 + 3 + 3 + 5
    np.testing.assert_array_equal(unshared.row, [0, 0, 1, 1])  # b: its own copy of x
    np.testing.assert_array_equal(unshared.prompt_slot, [0, 5, 5, 0])
    np.testing.assert_array_equal(unshared.response_slot, [2, 7, 8, 1])

    packed = pk.pack(jnp.asarray(tokens), jnp.asarray(mask), plan, pk.PackedShape(1, 2), 4)
    np.testing.assert_array_equal(
        packed.tokens, [[5, 6, 11, 12, 13, 21, 0, 0], [4, 41, 42, 43, 44, 7, 8, 9]]
    )
    np.testing.assert_array_equal(
        packed.positions, [[0, 1, 2, 3, 4, 2, 0, 0], [0, 1, 2, 3, 4, 0, 1, 2]]
    )
    # Row 0: b's token (slot 5) sees the shared prompt and itself, not a's response.
    np.testing.assert_array_equal(packed.mask[0, 5], [1, 1, 0, 0, 0, 1, 0, 0])
    np.testing.assert_array_equal(packed.mask[0, 4], [1, 1, 1, 1, 1, 0, 0, 0])
    assert not np.asarray(packed.mask[0, 6:]).any()  # padding queries see nothing
    # Row 1: c's prompt (slots 5-7) is causal on its own; d's tokens do not see it.
    np.testing.assert_array_equal(packed.mask[1, 7], [0, 0, 0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(packed.mask[1, 4], [1, 1, 1, 1, 1, 0, 0, 0])
    # The head runs on the 8 real response tokens, each predicted by the slot before it
    # (the first by its prompt's last slot); c's score reads its prompt's last token.
    np.testing.assert_array_equal(packed.head_slots[0, :8], [1, 2, 3, 1, 8, 9, 10, 11])
    np.testing.assert_array_equal(packed.head_targets[0, :8], [11, 12, 13, 21, 41, 42, 43, 44])
    np.testing.assert_array_equal(packed.last_slots[0], [4, 5, 15, 12])
    back = pk.unpack_responses(jnp.arange(1.0, 17.0)[None], packed)
    np.testing.assert_array_equal(back[:, 4:], [[1, 2, 3, 0], [4, 0, 0, 0], [0] * 4, [5, 6, 7, 8]])
    assert not np.asarray(back[:, :4]).any()


@pytest.mark.parametrize(
    ("family", "shards", "share"),
    tiered(
        [
            ("llama", 1, True),
            ("llama", 2, False),
            ("mistral", 2, True),
            ("gemma2", 1, True),
            ("gpt2", 1, True),
            ("qwen3_moe", 2, True),
        ],
        [("llama", 1, True), ("llama", 2, False)],
    ),
)
def test_packed_logprobs_and_gradients_equal_padded(family, shards, share):
    """Also a sliding window (Mistral), sliding and full layers with soft-caps (Gemma 2:
    the packed batch carries both masks), learned positions (GPT-2: reset per sequence)
    and a dropless MoE (routing is per token); two data shards each pack their own rows;
    shared prompt copies or one per row."""
    cfg = ModelConfig.tiny(family, **({"sliding_window": 4} if family == "mistral" else {}))
    module, params = M.build(cfg), _params(cfg)
    tokens, mask = _rollout(cfg.vocab_size)
    plan, stats = _plan(tokens, mask, shards, share)
    assert stats.needed < ROWS // shards  # fewer rows than padded
    padded = RolloutForward(module, R)
    packed = RolloutForward(module, R, packing=pk.PackedShape(shards, stats.needed))

    @functools.partial(jax.jit, static_argnums=1)
    def logprobs(p, fwd):
        return fwd.logprobs(p, tokens, mask, plan if fwd.packing else None)

    (lp1, ent1), (lpn, entn) = logprobs(params, padded), logprobs(params, packed)
    resp = mask.copy()
    resp[:, :P] = False
    np.testing.assert_allclose(lpn[resp], lp1[resp], atol=1e-5, rtol=0)
    np.testing.assert_allclose(entn[resp], ent1[resp], atol=1e-5, rtol=0)
    assert not np.asarray(lpn)[~resp].any() and not np.asarray(entn)[~resp].any()

    def loss(p, fwd):
        return jnp.where(resp, logprobs(p, fwd)[0], 0.0).sum()

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    g1, gn = grad(params, padded), grad(params, packed)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=5e-5, rtol=2e-5), gn, g1)


@pytest.mark.slow
def test_packed_values_and_reward_scores_equal_padded():
    """Two micro-batches of two shards: values on the response tokens and each row's score
    at its last real token (the prompt's for the empty row 1)."""
    cfg = ModelConfig.tiny("qwen2")
    module, params = M.build(cfg, "scalar"), _params(cfg, "scalar")
    tokens, mask = _rollout(cfg.vocab_size, seed=1)
    padded = RolloutForward(module, R)
    v1, s1 = padded.values(params, tokens, mask), padded.sequence_scores(params, tokens, mask)
    rows = np.arange(ROWS).reshape(-1, 2).T  # [2, 6] strided micro-batches
    plan, stats = pk.plan_rows(tokens, mask, P, rows, 2)
    packed = RolloutForward(module, R, packing=pk.PackedShape(2, stats.needed))
    resp = mask.copy()
    resp[:, :P] = False
    for micro in rows:
        part = jax.tree.map(lambda x, m=micro: jnp.asarray(x[m]), plan)
        vn = packed.values(params, tokens[micro], mask[micro], part)
        np.testing.assert_allclose(vn[resp[micro]], v1[micro][resp[micro]], atol=1e-5, rtol=0)
        sn = packed.sequence_scores(params, tokens[micro], mask[micro], part)
        np.testing.assert_allclose(sn, s1[micro], atol=1e-5, rtol=0)
    assert abs(s1[1] - s1[0]) > 1e-4  # the empty and the full response read different tokens


def test_buckets_and_refusals():
    assert pk.bucket_sizes(8, 4) == (2, 4, 6, 8)
    assert pk.bucket_sizes(2, 4) == (1, 2)
    assert pk.bucket_sizes(32, 4) == (8, 13, 21, 32)  # geometric: 32 * 4 ** (i / 3 - 1)
    assert pk.bucket_sizes(32, 1) == (32,)
    for b, n in ((32, 4), (48, 8), (5, 3)):  # a size holds at least 1 / ratio of itself
        sizes = pk.bucket_sizes(b, n)
        assert len(sizes) <= n and sizes[-1] == b and sizes[0] == -(-b // n)
        for needed in range(sizes[0], b + 1):
            assert pk.bucket_for(needed, b, n) <= math.ceil(needed * n ** (1 / (n - 1)))
    assert pk.bucket_for(5, 8, 4) == 6 and pk.bucket_for(1, 1, 4) == 1
    tokens = jnp.zeros((6, 8), jnp.int32)
    plan = pk.RowPacking(*(jnp.zeros(6, jnp.int32) for _ in range(3)))
    with pytest.raises(ValueError, match="6 rollout rows do not split over 4 data shards"):
        pk.pack(tokens, tokens > 0, plan, pk.PackedShape(4, 1), 4)
    holes = np.array([[0, 1, 1, 1, 1, 0, 0, 0], [0, 1, 0, 1, 1, 1, 0, 0]], bool)
    with pytest.raises(ValueError, match="rollout row 1: real tokens must be a left-padded"):
        pk.plan_rows(holes.astype(np.int32), holes, 4, np.arange(2)[None], 1)
    forward = RolloutForward(M.build(ModelConfig.tiny()), 4, packing=pk.PackedShape(1, 2))
    with pytest.raises(ValueError, match="needs the rows' packing plan"):
        forward.logprobs(None, tokens, tokens > 0)
