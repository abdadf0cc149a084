"""Model behaviour beyond HF parity: padding invariance, KV cache, scan, remat, dtypes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models import model as M
from jaxrlhf.models.attention import causal_mask, positions_from_mask
from jaxrlhf.models.config import ModelConfig

FAMILIES = ["llama", "mistral", "qwen2", "gemma", "gpt2"]


def _random_params(cfg, head="lm", seed=0):
    """Params with std 0.3 so that errors are visible (default init is 0.02)."""
    params = M.init_params(cfg.replace(initializer_range=0.3), jax.random.key(seed), head)
    return params


@pytest.mark.parametrize("family", FAMILIES)
def test_padding_invariance(family):
    """A row alone, left-padded and right-padded in a batch gives the same per-token logits.

    fp32; 1e-5 abs: the padded variants compute the same sums with extra exactly-zero
    attention weights, so only reduction order may differ.
    """
    cfg = ModelConfig.tiny(family, sliding_window=3 if family == "mistral" else None)
    params = _random_params(cfg)
    module = M.build(cfg)
    row = np.random.default_rng(0).integers(1, cfg.vocab_size, size=7).astype(np.int32)
    alone = M.forward(module, params, row[None], np.ones((1, 7), bool))[0]
    pad = 5
    left = np.concatenate([np.zeros(pad, np.int32), row])[None]
    left_mask = np.arange(12)[None] >= pad
    right = np.concatenate([row, np.zeros(pad, np.int32)])[None]
    right_mask = np.arange(12)[None] < 7
    got_left = M.forward(module, params, left, left_mask)[0, pad:]
    got_right = M.forward(module, params, right, right_mask)[0, :7]
    np.testing.assert_allclose(got_left, alone, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got_right, alone, atol=1e-5, rtol=0)
    assert np.isfinite(np.asarray(M.forward(module, params, left, left_mask))).all()


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2"])
def test_kv_cache_prefill_then_decode_equals_full_forward(family):
    """Prefill a left-padded prompt batch, decode 4 tokens one by one: each step's logits
    equal the full no-cache forward over the whole sequence.

    fp32, 1e-4 abs (the model tolerance): a [B, 1] decode matmul and a [B, T] one sum in
    different orders; with logits up to ~6 that shows as ~1e-5 differences.
    """
    cfg = ModelConfig.tiny(family, sliding_window=4 if family == "mistral" else None)
    params = _random_params(cfg)
    module = M.build(cfg)
    rng = np.random.default_rng(1)
    prompt_len, new, batch = 6, 4, 3
    total = prompt_len + new
    tokens = rng.integers(1, cfg.vocab_size, size=(batch, total)).astype(np.int32)
    mask = np.ones((batch, total), bool)
    mask[1, :2] = False  # left padding in the prompt
    mask[2, :5] = False
    tokens = np.where(mask, tokens, 0)
    positions = np.asarray(positions_from_mask(mask))
    full = np.asarray(M.forward(module, params, tokens, mask))

    cache = M.init_cache(cfg, batch, total)
    cache_mask = np.zeros((batch, total), bool)
    cache_mask[:, :prompt_len] = mask[:, :prompt_len]
    logits, cache = M.forward_with_cache(
        module, params, tokens[:, :prompt_len], positions[:, :prompt_len], cache, cache_mask, 0
    )
    np.testing.assert_allclose(
        np.asarray(logits)[mask[:, :prompt_len]],
        full[:, :prompt_len][mask[:, :prompt_len]],
        atol=1e-4,
        rtol=0,
    )
    for t in range(prompt_len, total):
        cache_mask[:, t] = True
        logits, cache = M.forward_with_cache(
            module,
            params,
            tokens[:, t : t + 1],
            positions[:, t : t + 1],
            cache,
            cache_mask,
            jnp.asarray(t),
        )
        np.testing.assert_allclose(np.asarray(logits)[:, 0], full[:, t], atol=1e-4, rtol=0)


def test_layers_are_scanned_so_program_size_does_not_grow_with_depth():
    def n_ops(layers):
        cfg = ModelConfig.tiny("llama", num_layers=layers)
        module = M.build(cfg)
        params = M.abstract_params(cfg)
        tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
        mask = jax.ShapeDtypeStruct((2, 8), bool)
        fn = lambda p, t, m: M.forward(module, p, t, m).sum()
        return len(jax.make_jaxpr(jax.grad(fn))(params, tokens, mask).jaxpr.eqns)

    assert n_ops(2) == n_ops(16)


@pytest.mark.parametrize("policy", ["full", "dots", "dots_no_batch"])
def test_remat_gives_identical_gradients(policy):
    cfg = ModelConfig.tiny("llama")
    params = _random_params(cfg)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 8)).astype(np.int32)
    mask = np.ones((2, 8), bool)

    def loss(p, c):
        return M.forward(M.build(c), p, tokens, mask).std()

    g_plain = jax.grad(loss)(params, cfg)
    g_remat = jax.grad(loss)(params, cfg.replace(remat=policy))
    # Recomputation repeats the same float32 ops; XLA may fuse differently, hence 1e-6.
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), g_plain, g_remat
    )


def test_bfloat16_compute_is_close_to_float32():
    cfg = ModelConfig.tiny("llama")
    params = _random_params(cfg)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 8)).astype(np.int32)
    mask = np.ones((2, 8), bool)
    ref = np.asarray(M.forward(M.build(cfg), params, tokens, mask))
    bf16 = M.forward(M.build(cfg.replace(dtype="bfloat16")), params, tokens, mask)
    assert bf16.dtype == jnp.float32  # logits are returned in float32 whatever the compute dtype
    # bf16 keeps ~3 significant digits (8-bit mantissa); through 2 layers of std-0.3 weights
    # single logits drift by up to a few percent of the logit scale, the average far less.
    err = np.abs(np.asarray(bf16) - ref)
    scale = np.abs(ref).max()
    assert err.max() <= 0.06 * scale and err.mean() <= 0.01 * scale, (err.max(), err.mean())
    bf16_params = M.init_params(cfg.replace(param_dtype="bfloat16"), jax.random.key(0))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf16_params))


def test_causal_mask_hand_checked():
    key_mask = np.array([[False, True, True, True]])
    got = np.asarray(causal_mask(key_mask, 4, 0, sliding_window=2))[0]
    expected = np.array(
        [
            [0, 0, 0, 0],  # query 0 is padding: sees nothing real
            [0, 1, 0, 0],
            [0, 1, 1, 0],
            [0, 0, 1, 1],  # window 2: keys 2 and 3 only
        ],
        bool,
    )
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(np.asarray(positions_from_mask(key_mask)), [[0, 0, 1, 2]])


def test_reward_readout_at_last_real_token():
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    mask = np.array([[1, 1, 0, 0], [0, 1, 1, 1], [0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(np.asarray(M.last_token_values(values, mask)), [1.0, 7.0, 8.0])


def test_config_validation_messages():
    with pytest.raises(ValueError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
        ModelConfig.tiny("llama", num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match=r"remat='sometimes' is not one of"):
        ModelConfig.tiny("llama", remat="sometimes")
    with pytest.raises(ValueError, match="model head 'policy' is not one of"):
        M.build(ModelConfig.tiny("llama"), "policy")


def test_cudnn_attention_refused_on_cpu_with_clear_error():
    cfg = ModelConfig.tiny("llama", attention_impl="cudnn")
    with pytest.raises(ValueError, match="attention_impl='cudnn' needs a GPU"):
        M.forward(
            M.build(cfg),
            M.init_params(cfg, jax.random.key(0)),
            np.zeros((1, 4), np.int32),
            np.ones((1, 4), bool),
        )
