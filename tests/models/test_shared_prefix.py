"""Packed prompt groups (models/shared_prefix.py) against the plain unpacked forward.

The reference is ``model.forward`` over the ``[G*n, P + R]`` rollout rows, each row's prompt
repeated. Packing computes the same sums, so outputs agree to float32 reduction order: 1e-5
absolute on log-probs, values and scores of size ~1-10 (measured <= 1e-6); on parameter
gradients of size up to ~10 (summed over ~60 tokens with cancellation; the prompt's is now
one sum over the group instead of n partial sums) 5e-5 absolute plus 2e-5 relative
(measured <= 3e-5, at |g| ~ 0.03 to 10).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.losses.common import token_logprobs_and_entropy
from jaxrlhf.models import model as M
from jaxrlhf.models import shared_prefix as sp
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.scoring import RolloutForward
from tests.tiers import tiered

G, N_SAMPLES, P, R = 3, 4, 6, 5


def _rollout(vocab: int, seed: int = 0):
    """G groups of N_SAMPLES rows: left-padded prompts of 6, 3 and 1 tokens; right-padded
    responses of random lengths 0..R (row 0 full, row 1 empty)."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(1, vocab, (G, P))
    prompt_mask = np.arange(P)[None] >= P - np.array([6, 3, 1])[:, None]
    lengths = rng.integers(0, R + 1, G * N_SAMPLES)
    lengths[:2] = R, 0
    resp_mask = np.arange(R)[None] < lengths[:, None]
    mask = np.concatenate([np.repeat(prompt_mask, N_SAMPLES, 0), resp_mask], 1)
    tokens = np.concatenate(
        [np.repeat(prompts, N_SAMPLES, 0), rng.integers(1, vocab, (G * N_SAMPLES, R))], 1
    )
    return jnp.asarray(np.where(mask, tokens, 0), jnp.int32), jnp.asarray(mask), resp_mask


def _params(cfg, head="lm"):
    return M.init_params(cfg.replace(initializer_range=0.3), jax.random.key(0), head)


@pytest.mark.parametrize(
    "family",
    tiered(["llama", "mistral", "gpt2", "gemma", "gemma2", "qwen3_moe"], ["llama", "gemma2"]),
)
def test_packed_logprobs_and_gradients_equal_unpacked(family):
    """Also Gemma 2 (a sliding and a full layer: the packed batch carries both masks, each
    layer picks its own; soft-caps) and a dropless MoE (routing is per token)."""
    cfg = ModelConfig.tiny(family, **({"sliding_window": 4} if family == "mistral" else {}))
    module, params = M.build(cfg), _params(cfg)
    tokens, mask, resp = _rollout(cfg.vocab_size)

    @functools.partial(jax.jit, static_argnums=1)
    def logprobs(p, group_size):
        return RolloutForward(module, R, group_size).logprobs(p, tokens, mask)

    (lp1, ent1), (lpn, entn) = logprobs(params, 1), logprobs(params, N_SAMPLES)
    cols = np.s_[:, P:]
    np.testing.assert_allclose(lpn[cols][resp], lp1[cols][resp], atol=1e-5, rtol=0)
    np.testing.assert_allclose(entn[cols][resp], ent1[cols][resp], atol=1e-5, rtol=0)
    assert not np.asarray(lpn[:, :P]).any()  # prompt columns hold 0, as unpacked

    # Hand-indexed reference for one row: its own full forward, no batch at all.
    row = 2 * N_SAMPLES + 3
    own = np.asarray(mask[row])
    alone = M.forward(module, params, tokens[row][own][None], np.ones((1, own.sum()), bool))[0]
    first = int(np.argmax(own))  # row's first real token
    want, _ = token_logprobs_and_entropy(alone[P - 1 - first : -1], tokens[row, P:][resp[row]])
    np.testing.assert_allclose(lpn[row, P:][resp[row]], want, atol=1e-5, rtol=0)

    def loss(p, group_size):
        return jnp.where(resp, logprobs(p, group_size)[0][cols], 0.0).sum()

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    g1, gn = grad(params, 1), grad(params, N_SAMPLES)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=5e-5, rtol=2e-5), gn, g1)


def test_packed_values_and_reward_scores_equal_unpacked():
    cfg = ModelConfig.tiny("qwen2")
    module, params = M.build(cfg, "scalar"), _params(cfg, "scalar")
    tokens, mask, resp = _rollout(cfg.vocab_size, seed=1)
    one, packed = RolloutForward(module, R, 1), RolloutForward(module, R, N_SAMPLES)
    v1 = one.values(params, tokens, mask)
    vn = packed.values(params, tokens, mask)
    np.testing.assert_allclose(vn[:, P:][resp], v1[:, P:][resp], atol=1e-5, rtol=0)
    # Scores read each row's last real token; row 1's response is empty, so the prompt's.
    s1 = one.sequence_scores(params, tokens, mask)
    sn = packed.sequence_scores(params, tokens, mask)
    np.testing.assert_allclose(sn, s1, atol=1e-5, rtol=0)
    assert s1[1] != s1[0]  # the empty and the full response are read at different tokens


def test_packed_layout_by_hand():
    """Tokens, positions and the three mask blocks of a 1-group, 2-sample batch."""
    tokens = jnp.array([[0, 7, 8, 1, 2, 0], [0, 7, 8, 3, 0, 0]])
    mask = tokens > 0
    packed = sp.pack_groups(tokens, mask, prefix_len=3, group_size=2)
    np.testing.assert_array_equal(packed.tokens, [[0, 7, 8, 1, 2, 0, 3, 0, 0]])
    np.testing.assert_array_equal(packed.positions, [[0, 0, 1, 2, 3, 3, 2, 2, 2]])
    np.testing.assert_array_equal(packed.mask.prefix[0], [[0, 0, 0], [0, 1, 0], [0, 1, 1]])
    np.testing.assert_array_equal(packed.mask.cross[0, 1], [[0, 1, 1]] * 3)
    np.testing.assert_array_equal(packed.mask.suffix[0, 0], [[1, 0, 0], [1, 1, 0], [1, 1, 0]])
    np.testing.assert_array_equal(packed.mask.suffix[0, 1], [[1, 0, 0], [1, 0, 0], [1, 0, 0]])
    hidden = jnp.arange(9.0)[None, :, None]  # hidden state = packed slot index
    got = sp.response_inputs(hidden, packed.mask)[..., 0]
    np.testing.assert_array_equal(got, [[2, 3, 4], [2, 6, 7]])  # slot P-1, then own tokens
    np.testing.assert_array_equal(sp.last_token_inputs(hidden, packed)[:, 0, 0], [4, 6])


def test_fully_masked_queries_stay_finite():
    cfg = ModelConfig.tiny("llama")
    module, params = M.build(cfg), _params(cfg)
    tokens, mask, _ = _rollout(cfg.vocab_size)
    packed = sp.pack_groups(tokens, mask, P, N_SAMPLES)
    select = functools.partial(sp.response_inputs, mask=packed.mask)
    assert np.isfinite(np.asarray(M.forward_packed(module, params, packed, select))).all()


def test_bad_groups_are_refused():
    tokens = jnp.zeros((6, 8), jnp.int32)
    with pytest.raises(ValueError, match="6 rollout rows do not split into groups of 4"):
        sp.pack_groups(tokens, tokens > 0, 4, 4)
    same = sp.prompts_match(
        np.array([[1, 2, 5], [1, 2, 6], [1, 3, 5], [1, 2, 5]]), np.ones((4, 3), bool), 2, 2
    )
    np.testing.assert_array_equal(same, [True, False])


def test_flops_fraction():
    assert sp.flops_fraction(64, 64, 4) == 0.625  # R1: 64 + 4 * 64 of 4 * 128 tokens
    assert sp.flops_fraction(64, 64, 1) == 1.0


@pytest.mark.parametrize("family", tiered(["llama", "gemma2"], ["gemma2"]))
def test_long_prompts_and_responses_in_causal_blocks_equal_full_attention(family, monkeypatch):
    """A 130-slot prompt and 160-slot responses: the prompt and each response attend in 2
    causal query blocks (``attention.causal_blocks``). Log-probs and gradients equal the same
    packed forward with one block (full attention), and the unpacked rows' (Gemma 2: a
    sliding and a full layer, soft-capped scores)."""
    from jaxrlhf.models import attention

    p, r, n = 130, 160, 2
    assert len(attention.causal_blocks(p)) == len(attention.causal_blocks(r)) == 2
    cfg = ModelConfig.tiny(family, max_position_embeddings=512)
    module, params = M.build(cfg), _params(cfg)
    rng = np.random.default_rng(5)
    prompt = rng.integers(1, cfg.vocab_size, (1, p))
    lengths = np.array([r, 97])
    mask = np.concatenate([np.ones((n, p), bool), np.arange(r)[None] < lengths[:, None]], axis=1)
    tokens = np.concatenate([np.repeat(prompt, n, 0), rng.integers(1, cfg.vocab_size, (n, r))], 1)
    tokens, mask = jnp.asarray(np.where(mask, tokens, 0), jnp.int32), jnp.asarray(mask)
    resp = np.asarray(mask[:, p:])

    def run(group_size):
        def loss(params):
            lp, _ = RolloutForward(module, r, group_size).logprobs(params, tokens, mask)
            return jnp.where(resp, lp[:, p:], 0.0).sum(), lp

        (_, lp), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        return lp, grads

    blocked, blocked_grads = run(n)
    unpacked, _ = run(1)
    monkeypatch.setattr(attention, "causal_blocks", lambda length: [(0, length)])
    monkeypatch.setattr(sp, "causal_blocks", lambda length: [(0, length)])
    full, full_grads = run(n)
    cols = np.s_[:, p:]
    np.testing.assert_allclose(blocked[cols][resp], full[cols][resp], atol=1e-5, rtol=0)
    np.testing.assert_allclose(blocked[cols][resp], unpacked[cols][resp], atol=1e-5, rtol=0)
    # A gradient entry sums ~450 token contributions, and one block and two sum them in a
    # different order, so its f32 rounding scales with the leaf's largest entries, not with
    # the entry itself: atol is 1e-5 of the leaf's largest magnitude (an Intel Emerald Rapids
    # VM measured 1.2e-4 on an entry of 1.0 in an embedding gradient whose entries reach ~13).
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5 * np.abs(b).max(), rtol=2e-5),
        blocked_grads,
        full_grads,
    )
