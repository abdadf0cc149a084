"""Block-causal attention (``dot_product_attention(..., causal=True)``) against the full XLA
attention and a NumPy softmax; the RoPE angles each layer takes against NumPy.

Tolerances: both sides compute in float32; skipping a key block whose weights are exactly 0
changes only the summation order of the softmax's sum and of probs · v (observed ~1e-7 on
outputs of magnitude ~1), so 1e-6 on outputs and 1e-5 on gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models import attention as A
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.packing import PackedShape, pack, plan_rows


def _qkv(batch, length, heads=4, kv_heads=2, dim=8, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, length, heads, dim)).astype(np.float32)
    k = rng.normal(size=(batch, length, kv_heads, dim)).astype(np.float32)
    v = rng.normal(size=(batch, length, kv_heads, dim)).astype(np.float32)
    return q, k, v


def _numpy_attention(q, k, v, mask, scale):
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    scores = np.einsum("btnh,bsnh->bnts", q, k).astype(np.float64) * scale
    scores = np.where(mask[:, None], scores, -1e30)  # exp() of a masked score is 0
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", weights, v)


def test_causal_blocks_cover_the_row_in_near_equal_blocks():
    assert A.causal_blocks(100) == [(0, 100)]  # under two minimum blocks: one block
    assert A.causal_blocks(512) == [(64 * i, 64 * (i + 1)) for i in range(8)]
    blocks = A.causal_blocks(576)  # capped at CAUSAL_BLOCKS_MAX = 8 blocks
    assert blocks == [(72 * i, 72 * (i + 1)) for i in range(8)]
    assert A.causal_blocks(4096)[-1] == (3584, 4096)
    blocks = A.causal_blocks(200)  # 3 blocks of 66-67
    assert [b - a for a, b in blocks] == [67, 66, 67]
    assert all(b == c for (_, b), (c, _) in zip(blocks, blocks[1:], strict=False))


@pytest.mark.parametrize("left", [True, False], ids=["left_pad", "right_pad"])
@pytest.mark.parametrize("cap", [None, 5.0], ids=["no_cap", "softcap"])
def test_block_causal_equals_full_attention_and_numpy(left, cap):
    batch, length = 3, 200  # 3 query blocks
    q, k, v = _qkv(batch, length)
    real = np.array([200, 131, 40])
    cols = np.arange(length)[None]
    key_mask = cols >= length - real[:, None] if left else cols < real[:, None]
    mask = np.asarray(A.causal_mask(jnp.asarray(key_mask), length))
    scale = 8**-0.5
    full = A.dot_product_attention(q, k, v, mask, scale=scale, impl="xla", logit_cap=cap)
    blocked = A.dot_product_attention(
        q, k, v, mask, scale=scale, impl="xla", logit_cap=cap, causal=True
    )
    seen = mask.any(-1)  # queries with a visible key (all but left padding)
    np.testing.assert_allclose(np.asarray(blocked)[seen], np.asarray(full)[seen], atol=1e-6)
    if cap is None:
        expected = _numpy_attention(q, k, v, mask, scale)
        np.testing.assert_allclose(np.asarray(blocked)[seen], expected[seen], atol=1e-6)

    def loss(fn_causal, q, k, v):
        out = A.dot_product_attention(
            q, k, v, mask, scale=scale, impl="xla", logit_cap=cap, causal=fn_causal
        )
        return jnp.sum(jnp.where(jnp.asarray(seen)[..., None, None], out, 0.0) ** 2)

    grads = [jax.grad(loss, argnums=(1, 2, 3))(c, q, k, v) for c in (False, True)]
    for a, b in zip(*grads, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def test_block_causal_on_packed_sequences_block_mask():
    """Sequence packing's block-diagonal causal mask (several sequences per row)."""
    prompt, response = 16, 184
    lengths = np.array([184, 30, 7, 90, 3, 60])
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 50, size=(6, prompt + response)).astype(np.int32)
    mask = np.zeros_like(tokens, bool)
    for i, n in enumerate(lengths):
        mask[i, : prompt + n] = True
    plan, stats = plan_rows(tokens, mask, prompt, np.arange(6)[None], 1)
    packed = pack(jnp.asarray(tokens), jnp.asarray(mask), plan, PackedShape(1, 3), prompt)
    assert stats.needed == 3
    q, k, v = _qkv(3, prompt + response, seed=2)
    scale = 0.3
    block = np.asarray(packed.mask)
    full = A.dot_product_attention(q, k, v, block, scale=scale, impl="xla")
    blocked = A.dot_product_attention(q, k, v, block, scale=scale, impl="xla", causal=True)
    seen = block.any(-1)
    assert seen.sum() == stats.tokens
    np.testing.assert_allclose(np.asarray(blocked)[seen], np.asarray(full)[seen], atol=1e-6)
    expected = _numpy_attention(q, k, v, block, scale)
    np.testing.assert_allclose(np.asarray(blocked)[seen], expected[seen], atol=1e-6)


def test_causal_flag_skips_keys_above_the_diagonal():
    """The flag is a promise about the mask: with a mask that breaks it (every key visible),
    the blocked path ignores the keys above each block, so the results differ."""
    q, k, v = _qkv(1, 128)  # 2 blocks of 64
    everything = np.ones((1, 128, 128), bool)
    full = A.dot_product_attention(q, k, v, everything, scale=0.3, impl="xla")
    blocked = A.dot_product_attention(q, k, v, everything, scale=0.3, impl="xla", causal=True)
    np.testing.assert_allclose(np.asarray(blocked)[:, 64:], np.asarray(full)[:, 64:], atol=1e-6)
    assert np.abs(np.asarray(blocked)[:, :64] - np.asarray(full)[:, :64]).max() > 1e-2


@pytest.mark.slow
def test_the_model_takes_the_block_path_without_a_cache(monkeypatch):
    """A forward without a cache runs block-causal attention in every layer (and its logits
    equal the full attention's); prefill, which writes a cache, does not."""
    from jaxrlhf.generation.decode import prefill
    from jaxrlhf.models import model as M

    cfg = ModelConfig.bench_s(num_layers=2, vocab_size=64, max_position_embeddings=256)
    params = M.init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 160), 0, 64)
    mask = jnp.arange(160)[None] < jnp.array([[160], [97]])
    calls = []
    blocked = A.block_causal_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape[1])
        return blocked(*args, **kwargs)

    monkeypatch.setattr(A, "block_causal_attention", counting)
    logits = M.forward(M.build(cfg), params, tokens, mask)
    assert calls == [160] * cfg.num_layers
    monkeypatch.setattr(A, "block_causal_attention", lambda *a, **k: A.xla_attention(*a, **k))
    full = M.forward(M.build(cfg), params, tokens, mask)
    np.testing.assert_allclose(np.asarray(logits)[mask], np.asarray(full)[mask], atol=1e-5)
    calls.clear()
    monkeypatch.setattr(A, "block_causal_attention", counting)
    prefill(cfg, lambda x, names: x, params, tokens[:, :96], mask[:, :96])
    assert calls == []


GEMMA3_LAYERS = ("full_attention",) + ("sliding_attention",) * 4 + ("full_attention",)


@pytest.mark.parametrize(
    "family, overrides, tables",
    [
        ("llama", {}, 1),
        ("gemma3", {}, 2),
        # Table rows (0, 1, 1, 1, 1, 0) differ from the layer numbers past layer 1.
        ("gemma3", dict(num_layers=6, layer_types=GEMMA3_LAYERS), 2),
        ("gpt2", {}, 0),
    ],
)
def test_rope_angles_give_each_layer_its_own_tables_cos_and_sin(family, overrides, tables):
    """The angles made once per forward (``rope_angles``) and picked per layer with a traced
    layer index (as the layer scan does) equal cos and sin of each layer's own inverse
    frequencies, computed here in float64 from the same float32 angle. Tolerance 1e-6: XLA's
    float32 cos and sin are within a few float32 ulps (1.2e-7 at magnitude 1) of the exact
    values for these angles (|angle| < 40)."""
    cfg = ModelConfig.tiny(family, **overrides)
    positions = jnp.asarray([[0, 1, 2, 3, 4, 5], [7, 8, 9, 20, 30, 39]], jnp.int32)
    angles = A.rope_angles(cfg, positions)
    if tables == 0:
        assert angles is None
        return
    assert angles.cos.shape[0] == tables
    pick = jax.jit(angles.layer)
    for layer in range(cfg.num_layers):
        inv_freq = A.rope_inverse_frequencies(cfg, layer)
        theta = (np.asarray(positions, np.float32)[..., None] * inv_freq).astype(np.float64)
        cos, sin = pick(jnp.int32(layer))
        np.testing.assert_allclose(np.asarray(cos), np.cos(theta), rtol=0, atol=1e-6)
        np.testing.assert_allclose(np.asarray(sin), np.sin(theta), rtol=0, atol=1e-6)
    if family == "gemma3":  # its sliding and full layers use different bases
        first, second = pick(jnp.int32(0))[0], pick(jnp.int32(1))[0]
        assert cfg.sliding_layers[0] != cfg.sliding_layers[1]
        assert not np.allclose(np.asarray(first), np.asarray(second))
