"""The sampler's decode path equals the model's forward pass.

Decode re-expresses attention against the sampler's head-major, prefix-shared cache
(generation/decode.py); this pins it to ``models.model.forward`` for every family.
Tolerance 1e-4 abs on fp32 logits of size ~1-10 (the model tolerance of tests/models): a
[R, 1] decode matmul and a [B, T] training matmul sum in different orders (~1e-6 observed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.generation import SamplingParams, init_state
from jaxrlhf.generation import decode as decode_lib
from jaxrlhf.generation.sampler import forward_step
from jaxrlhf.models.transformer import no_constraint
from tests.generation.helpers import FAMILIES, jit_forward, prompts, tiny_cfg, tiny_params


@pytest.mark.parametrize(
    "family, n, shards",
    [(f, 2, 1) for f in FAMILIES]
    + [("llama", 1, 1), ("mistral", 1, 1), ("llama", 2, None), ("gpt2", 2, None)]
    + [("qwen2", 2, 2), ("gemma", 1, 2), ("llama", 2, {"attn": None, "mlp": 2})],
)
def test_decode_logits_equal_full_forward(family, n, shards):
    """Prefill a left-padded batch, feed fixed tokens one by one: the logits of every step
    equal a full forward over prompt + fed tokens. With n = 2 samples per prompt, each fed
    different tokens, the shared prompt cache and the per-sample cache both matter; n = 1
    uses the joint prompt + generated cache (see generation/cache.py). ``shards`` is how the
    q/k/v and gate/up kernels are fused (decode_weights): None keeps them apart, 2
    interleaves them as for a two-way tensor-parallel layout (here on one device, which
    checks that the split after the fused matmul undoes the interleaving); a dict decides
    per block."""
    cfg, params = tiny_cfg(family), tiny_params(family)
    new = 5
    prompt, mask = prompts(cfg.vocab_size, lengths=(6, 4, 2), total=6, seed=1)
    fed = np.random.default_rng(2).integers(1, cfg.vocab_size, (3 * n, new)).astype(np.int32)
    statics = SamplingParams(max_new_tokens=new, n=n).static()

    @jax.jit
    def run(params, prompt, mask, fed):
        state = init_state(cfg, no_constraint, statics, params, prompt, mask, jax.random.key(0))
        weights = decode_lib.decode_weights(params, cfg.num_layers, shards)

        def feed(state, t):
            state = state.replace(tokens=state.tokens.at[:, t].set(fed[:, t]), step=t + 1)
            state = forward_step(cfg, no_constraint, params, weights, state)
            return state, state.logits

        _, rest = jax.lax.scan(feed, state, jnp.arange(new - 1))
        return jnp.concatenate([state.logits[:, None], rest.transpose(1, 0, 2)], 1)

    got = np.asarray(run(params, prompt, mask, fed))  # [R, new, V]
    full_tokens = np.concatenate([np.repeat(prompt, n, 0), fed], 1)
    full_mask = np.concatenate([np.repeat(mask, n, 0), np.ones_like(fed, bool)], 1)
    ref = np.asarray(jit_forward(cfg)(params, full_tokens, full_mask))
    expected = ref[:, prompt.shape[1] - 1 : -1]
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    assert np.abs(expected).max() > 0.5
