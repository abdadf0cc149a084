"""The sampler's decode path equals the model's forward pass.

Decode re-expresses attention against the sampler's head-major, prefix-shared cache
(generation/decode.py); this pins it to ``models.model.forward`` for every family.
Tolerance 1e-4 abs on fp32 logits of size ~1-10 (the model tolerance of tests/models): a
[R, 1] decode matmul and a [B, T] training matmul sum in different orders (~1e-6 observed).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.generation import SamplingParams, init_state
from jaxrlhf.generation import decode as decode_lib
from jaxrlhf.generation.sampler import forward_step
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.transformer import Decoder, no_constraint
from tests.generation.helpers import FAMILIES, jit_forward, prompts, tiny_cfg, tiny_params


@pytest.mark.parametrize(
    "family, n, shards, block",
    [(f, 2, 1, 64) for f in FAMILIES]
    + [("llama", 1, 1, 0), ("mistral", 1, 1, 64), ("llama", 2, 1, 0), ("llama", 2, None, 0)]
    + [("gpt2", 2, None, 64), ("qwen2", 2, 2, 64), ("gemma", 1, 2, 0)]
    + [("llama", 2, {"attn": None, "mlp": 2, "head": 2}, 64)]
    + [("gemma2", 1, 1, 0), ("gemma3", 1, 2, 64), ("mixtral", 1, 2, 64), ("qwen3_moe", 1, None, 0)],
)
def test_decode_logits_equal_full_forward(family, n, shards, block):
    """Prefill a left-padded batch, feed fixed tokens one by one: the logits of every step
    equal a full forward over prompt + fed tokens. With n = 2 samples per prompt, each fed
    different tokens, the shared prompt cache and the per-sample cache both matter; n = 1
    uses the joint prompt + generated cache (see generation/cache.py). ``shards`` is how the
    q/k/v and gate/up kernels are fused (decode_weights): None keeps them apart, 2
    interleaves them as for a two-way tensor-parallel layout (here on one device, which
    checks that the split after the fused matmul undoes the interleaving); a dict decides
    per block. ``block`` 64 multiplies by weight blocks (the sampler's default on CPU; the
    tiny models' 32-128 wide kernels give blocks of 64 and, per shard, 32), 0 by the plain
    kernels (accelerators)."""
    cfg, params = tiny_cfg(family), tiny_params(family)
    new = 5
    prompt, mask = prompts(cfg.vocab_size, lengths=(6, 4, 2), total=6, seed=1)
    fed = np.random.default_rng(2).integers(1, cfg.vocab_size, (3 * n, new)).astype(np.int32)
    statics = SamplingParams(max_new_tokens=new, n=n).static()

    @jax.jit
    def run(params, prompt, mask, fed):
        state = init_state(cfg, no_constraint, statics, params, prompt, mask, jax.random.key(0))
        weights = decode_lib.decode_weights(params, cfg.num_layers, shards, block)
        ropes = decode_lib.rope_tables(cfg, prompt.shape[1] + new)

        def feed(state, t):
            state = state.replace(tokens=state.tokens.at[:, t].set(fed[:, t]), step=t + 1)
            state = forward_step(cfg, no_constraint, params, weights, ropes, state)
            return state, state.logits

        _, rest = jax.lax.scan(feed, state, jnp.arange(new - 1))
        return jnp.concatenate([state.logits[:, None], rest.transpose(1, 0, 2)], 1)

    got = np.asarray(run(params, prompt, mask, fed))  # [R, new, V]
    layers, head = jax.eval_shape(
        lambda p: decode_lib.decode_weights(p, cfg.num_layers, shards, block), params
    )
    kernels = {**layers[0]["attn"], **layers[0].get("mlp", {})}  # (MoE layers: no "mlp")
    # Blocked: fused [S, M/b, D, b] (plain [D, S, M]); o and down [N/b, in, b] (plain 2-D).
    block_ndim = {"qkv_kernel": 4, "gate_up_kernel": 4, "o_kernel": 3, "down_kernel": 3}
    blocked = {k for k, v in kernels.items() if k in block_ndim and block_ndim[k] == v.ndim}
    if head is not None and head.ndim == 3:
        blocked.add("head")
    if block and shards is not None:
        assert blocked, "block > 0 made no weight blocks"
    else:
        assert not blocked
    full_tokens = np.concatenate([np.repeat(prompt, n, 0), fed], 1)
    full_mask = np.concatenate([np.repeat(mask, n, 0), np.ones_like(fed, bool)], 1)
    ref = np.asarray(jit_forward(cfg)(params, full_tokens, full_mask))
    expected = ref[:, prompt.shape[1] - 1 : -1]
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    assert np.abs(expected).max() > 0.5


@pytest.mark.parametrize("shards", [1, 2, 4])
@pytest.mark.parametrize("width", [256, 96, 40])
def test_blocked_matmul_equals_numpy(shards, width):
    """``blocked_matmul`` over ``_blocks`` of a kernel equals ``x @ w`` column for column
    (NumPy float64 reference; sums of 48 float32 products, outputs up to ~30: 1e-5
    relative, measured <= 5e-6 absolute), for every shard count: 256 columns split into
    blocks of 64 per shard, 96 into 32 where 64 does not divide, and 40 (or 40 / shards)
    into none, where the kernel stays as it is."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 48)).astype(np.float32)
    w = rng.standard_normal((48, width)).astype(np.float32)
    blocks = decode_lib._blocks(jnp.asarray(w), shards, 64)
    per_shard = width // shards
    expected_block = next((b for b in (64, 32) if per_shard % b == 0), None)
    if expected_block is None:
        assert blocks.shape == w.shape
    else:
        assert blocks.shape == (width // expected_block, 48, expected_block)
    expected = x.astype(np.float64) @ w
    got = np.asarray(decode_lib.blocked_matmul(jnp.asarray(x), blocks))
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
    # A fused kernel [K, S, M] keeps its shard axis: [S, M / b, K, b].
    fused = decode_lib._blocks(jnp.asarray(w.reshape(48, shards, -1)), shards, 64, True)
    if expected_block is None:
        assert fused.shape == (48, shards, per_shard)
    else:
        assert fused.shape == (shards, per_shard // expected_block, 48, expected_block)
        flat = fused.reshape(-1, *fused.shape[2:])
        got = np.asarray(decode_lib.blocked_matmul(jnp.asarray(x), flat))
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert decode_lib._blocks(jnp.asarray(w), shards, 0).shape == w.shape  # block 0: none


@pytest.mark.parametrize("block", [0, 64])
@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_lm_head_without_blocks_for_an_odd_vocab(family, shards, block):
    """A vocab of 131 splits into no blocks of 64 or 32, nor evenly over 2 shards: the
    untied head stays [D, V] and the tied one the embedding (``decode_weights`` returns
    None). Logits equal the plain head's (NumPy reference, 1e-5 on logits of size ~1)."""
    cfg = dataclasses.replace(tiny_cfg(family), vocab_size=131)
    params = model_lib.init_params(cfg, jax.random.key(0))
    _, head = decode_lib.decode_weights(params, cfg.num_layers, shards, block)
    if cfg.tie_embeddings:
        assert head is None
        table = np.asarray(params["decoder"]["embed"]["embedding"]).T
    else:
        assert head.shape == (cfg.hidden_size, 131)
        table = np.asarray(params["lm_head"])
    hidden = np.random.default_rng(3).standard_normal((4, cfg.hidden_size)).astype(np.float32)
    decoder = Decoder(cfg, no_constraint).bind({"params": params["decoder"]})
    logits = np.asarray(decode_lib.lm_head(cfg, decoder, head, jnp.asarray(hidden)))
    np.testing.assert_allclose(logits, hidden.astype(np.float64) @ table, atol=1e-5, rtol=0)
