"""End-to-end sampler behaviour on tiny random models (unsharded; see test_sharded.py).

Token equality is exact. Log-prob tolerances: 1e-4 abs in fp32 (the model tolerance). The
sampler's log-probs are log-softmax of the decode step's float32 logits; the reference
recomputes them with a training-style forward over prompt + response. Both are the same
float32 model, but a [R, 1] decode matmul and a [B, T] training matmul sum in different
orders, which moves logits by ~1e-6 here (logits ~1-10); that is the only difference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh

from jaxrlhf import platform
from jaxrlhf.generation import Sampler, SamplingParams
from jaxrlhf.generation.sampler import default_matmul_block
from jaxrlhf.kernels import block_matmul as kernel_lib
from jaxrlhf.losses import token_logprobs
from jaxrlhf.sharding import MeshConfig, make_mesh
from tests.generation.helpers import (
    FAMILIES,
    greedy_reference,
    prompts,
    recompute_logits,
    sampler,
    tiny_cfg,
    tiny_params,
)

NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=NEW)


def _np(out):
    return jax.tree.map(np.asarray, out)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_no_cache_reference(family):
    cfg, params = tiny_cfg(family), tiny_params(family)
    tokens, mask = prompts(cfg.vocab_size)
    out = _np(sampler(family).generate(params, tokens, mask, jax.random.key(0), GREEDY))
    np.testing.assert_array_equal(out.tokens, greedy_reference(cfg, params, tokens, mask, NEW))
    assert out.response_mask.all() and (out.lengths == NEW).all() and not out.stopped.any()
    np.testing.assert_array_equal(out.logprobs, 0.0)  # greedy: a point mass


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_equal_training_forward_recompute(family):
    """Plain temperature-1 sampling: the sampling and the model distribution coincide, and
    the sampler's log-probs equal the training forward's, for every family."""
    cfg, params = tiny_cfg(family), tiny_params(family)
    tokens, mask = prompts(cfg.vocab_size)
    out = _np(sampler(family).generate(params, tokens, mask, jax.random.key(3), SAMPLED))
    expected = np.asarray(token_logprobs(recompute_logits(cfg, params, out), out.tokens))
    np.testing.assert_allclose(out.model_logprobs, expected, atol=1e-4, rtol=0)
    np.testing.assert_allclose(out.logprobs, expected, atol=1e-4, rtol=0)
    assert np.abs(expected).max() > 1.0  # not a comparison of near-zeros


def test_truncated_sampling_logprobs_equal_recompute():
    """temperature 0.7, top-k 20, top-p 0.9: ``logprobs`` are those of the truncated,
    renormalised distribution; ``model_logprobs`` those of the raw model."""
    cfg, params = tiny_cfg("qwen2"), tiny_params("qwen2")
    tokens, mask = prompts(cfg.vocab_size)
    sp = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=NEW)
    out = _np(sampler("qwen2").generate(params, tokens, mask, jax.random.key(4), sp))
    logits = recompute_logits(cfg, params, out)  # [R, T, V]
    np.testing.assert_allclose(
        out.model_logprobs, np.asarray(token_logprobs(logits, out.tokens)), atol=1e-4, rtol=0
    )
    # NumPy reference of the truncation: top-20 by logit, then the nucleus of mass 0.9.
    scaled = logits / 0.7
    kth = -np.sort(-scaled, -1)[..., 19:20]
    scaled = np.where(scaled >= kth, scaled, -np.inf)
    probs = np.exp(scaled - scaled.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ranked = -np.sort(-probs, -1)
    above = np.cumsum(ranked, -1) - ranked
    threshold = np.where(above < 0.9, ranked, np.inf).min(-1, keepdims=True)
    allowed = probs >= threshold
    picked = np.take_along_axis(allowed, out.tokens[..., None], -1)[..., 0]
    assert picked.all(), "sampled outside the top-k/top-p set"
    kept = np.where(allowed, probs, 0.0)
    expected = np.log(np.take_along_axis(kept, out.tokens[..., None], -1)[..., 0] / kept.sum(-1))
    np.testing.assert_allclose(out.logprobs, expected, atol=1e-4, rtol=0)


def test_top_k_1_is_greedy():
    cfg, params = tiny_cfg("qwen2"), tiny_params("qwen2")
    tokens, mask = prompts(cfg.vocab_size)
    s = sampler("qwen2")
    greedy = _np(s.generate(params, tokens, mask, jax.random.key(0), GREEDY))
    # top_p < 1 only to share the compiled program of the test above (same static switches).
    top1 = SamplingParams(temperature=1.0, top_k=1, top_p=0.99, max_new_tokens=NEW)
    out = _np(s.generate(params, tokens, mask, jax.random.key(5), top1))
    np.testing.assert_array_equal(out.tokens, greedy.tokens)
    np.testing.assert_allclose(out.logprobs, 0.0, atol=1e-6)  # the only allowed token


def test_left_padding_invariance():
    """Row 0 alone (no padding) and row 0 left-padded in a batch give the same sampled tokens
    (row 0 draws the same uniforms in both: a row's draw depends only on the key, the step
    and its index), and right padding gives the same as left padding."""
    cfg, params = tiny_cfg("llama"), tiny_params("llama")
    s = sampler("llama")
    tokens, mask = prompts(cfg.vocab_size, lengths=(3, 7, 5, 6), seed=5)
    batch = _np(s.generate(params, tokens, mask, jax.random.key(6), SAMPLED))
    alone = _np(s.generate(params, tokens[:1, -3:], mask[:1, -3:], jax.random.key(6), SAMPLED))
    np.testing.assert_array_equal(alone.tokens[0], batch.tokens[0])
    np.testing.assert_allclose(alone.model_logprobs[0], batch.model_logprobs[0], atol=1e-5)
    right, right_mask = prompts(cfg.vocab_size, lengths=(3, 7, 5, 6), seed=5, left=False)
    right_out = _np(s.generate(params, right, right_mask, jax.random.key(6), SAMPLED))
    np.testing.assert_array_equal(right_out.tokens, batch.tokens)


def test_stop_tokens_end_rows_and_mask_the_rest():
    cfg, params = tiny_cfg("gemma"), tiny_params("gemma")
    s = sampler("gemma")
    tokens, mask = prompts(cfg.vocab_size, seed=7)
    free = _np(s.generate(params, tokens, mask, jax.random.key(0), GREEDY)).tokens
    # Row 0 stops at column 2 at the latest, row 1 at once, rows 2 and 3 by column 1.
    stop = (int(free[0, 2]), int(free[1, 0]), int(free[2, 1]), int(free[3, 1]))
    sp = SamplingParams(temperature=0.0, max_new_tokens=NEW, stop_token_ids=stop, pad_token_id=5)
    state = s.prefill(params, tokens, mask, jax.random.key(0), sp)
    _, out = s.decode(params, state, sp)
    out = _np(out)
    for row in range(len(free)):
        length = np.flatnonzero(np.isin(free[row], stop))[0] + 1
        assert out.lengths[row] == length and out.stopped[row]
        np.testing.assert_array_equal(out.tokens[row, :length], free[row, :length])
        np.testing.assert_array_equal(out.tokens[row, length:], 5)  # pad_token_id
        np.testing.assert_array_equal(out.response_mask[row], np.arange(NEW) < length)
        np.testing.assert_array_equal(out.model_logprobs[row, length:], 0.0)
    assert out.lengths[1] == 1 and out.lengths.max() <= 3

    # The while_loop gives the same output, and stops once every row has ended.
    state = s.prefill(params, tokens, mask, jax.random.key(0), sp)
    final, out_while = s.decode(params, state, sp, loop="while")
    jax.tree.map(np.testing.assert_array_equal, _np(out_while), out)
    assert int(final.step) <= 3 < NEW


def test_group_sampling_equals_repeated_prompts():
    cfg, params = tiny_cfg("llama"), tiny_params("llama")
    s = sampler("llama")
    tokens, mask = prompts(cfg.vocab_size, lengths=(7, 3), seed=8)
    n = 2
    group = SamplingParams(temperature=1.0, max_new_tokens=NEW, n=n)
    out = _np(s.generate(params, tokens, mask, jax.random.key(9), group))
    rep = _np(
        s.generate(
            params, np.repeat(tokens, n, 0), np.repeat(mask, n, 0), jax.random.key(9), SAMPLED
        )
    )
    np.testing.assert_array_equal(out.tokens, rep.tokens)
    np.testing.assert_array_equal(out.prompt_tokens, rep.prompt_tokens)
    np.testing.assert_allclose(out.logprobs, rep.logprobs, atol=1e-5, rtol=0)
    np.testing.assert_allclose(out.model_logprobs, rep.model_logprobs, atol=1e-5, rtol=0)
    assert (out.tokens[0] != out.tokens[1]).any()  # a group's samples differ


def test_same_key_same_output_and_no_recompile_for_new_values():
    cfg, params = tiny_cfg("llama"), tiny_params("llama")
    s = sampler("llama")
    tokens, mask = prompts(cfg.vocab_size, seed=10)
    a = _np(s.generate(params, tokens, mask, jax.random.key(11), SAMPLED))
    b = _np(s.generate(params, tokens, mask, jax.random.key(11), SAMPLED))
    c = _np(s.generate(params, tokens, mask, jax.random.key(12), SAMPLED))
    jax.tree.map(np.testing.assert_array_equal, a, b)
    assert (a.tokens != c.tokens).any()
    prefill_fn = s.prefill_program(SAMPLED.static(), *tokens.shape)
    decode_fn = s.decode_program(SAMPLED.static(), "scan", *tokens.shape)
    sizes = (prefill_fn._cache_size(), decode_fn._cache_size())
    hotter = SamplingParams(temperature=1.7, max_new_tokens=NEW)
    d = _np(s.generate(params, tokens, mask, jax.random.key(11), hotter))
    assert (prefill_fn._cache_size(), decode_fn._cache_size()) == sizes  # no recompile
    assert (d.tokens != a.tokens).any()


def test_decode_donates_the_state():
    cfg, params = tiny_cfg("llama"), tiny_params("llama")
    s = sampler("llama")
    tokens, mask = prompts(cfg.vocab_size)
    state = s.prefill(params, tokens, mask, jax.random.key(0), GREEDY)
    cache_leaf = state.cache.k[0]
    s.decode(params, state, GREEDY)
    assert cache_leaf.is_deleted()  # updated in place, not copied


def test_prompt_validation():
    cfg, params = tiny_cfg("llama"), tiny_params("llama")
    tokens, mask = prompts(cfg.vocab_size)
    with pytest.raises(ValueError, match="loop='for' is not one of"):
        sampler("llama").generate(params, tokens, mask, jax.random.key(0), GREEDY, loop="for")
    mask[1] = False
    with pytest.raises(ValueError, match="every prompt needs at least one real token"):
        sampler("llama").generate(params, tokens, mask, jax.random.key(0), GREEDY)


def test_decode_phases_equal_one_loop():
    """Decoding in phases with growing cache views (3 phases: 2, 4, 6 generated slots) gives
    the single loop's tokens, also with a sliding window (Mistral, window 4); log-probs agree
    to rounding (the attention sums over fewer masked slots, in a different order)."""
    cfg, params = tiny_cfg("mistral"), tiny_params("mistral")
    tokens, mask = prompts(cfg.vocab_size, seed=13)
    phased = Sampler(cfg, decode_phases=3, min_phase_tokens=2)
    ref = _np(sampler("mistral").generate(params, tokens, mask, jax.random.key(14), GREEDY))
    for loop in ("scan", "while"):
        out = _np(phased.generate(params, tokens, mask, jax.random.key(14), GREEDY, loop=loop))
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        np.testing.assert_allclose(out.model_logprobs, ref.model_logprobs, atol=1e-5, rtol=0)


def test_weight_blocks_change_only_rounding():
    """Decode with weight blocks of 64 (decode.decode_weights) and with the plain kernels:
    same sampled tokens, log-probs equal to rounding (a batched and a plain matmul sum in
    different orders, ~1e-6 here); a negative block is refused."""
    cfg, params = tiny_cfg("qwen2"), tiny_params("qwen2")
    tokens, mask = prompts(cfg.vocab_size, seed=15)
    blocked, plain = Sampler(cfg, matmul_block=64), Sampler(cfg, matmul_block=0)
    ref = _np(plain.generate(params, tokens, mask, jax.random.key(16), SAMPLED))
    out = _np(blocked.generate(params, tokens, mask, jax.random.key(16), SAMPLED))
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_allclose(out.model_logprobs, ref.model_logprobs, atol=1e-5, rtol=0)

    assert _batched_matmuls(blocked, params, tokens, mask, SAMPLED) > 0
    assert _batched_matmuls(plain, params, tokens, mask, SAMPLED) == 0
    with pytest.raises(ValueError, match="matmul_block=-1"):
        Sampler(cfg, matmul_block=-1)


def _batched_matmuls(s: Sampler, params, tokens, mask, sampling: SamplingParams) -> int:
    """How many of decode.blocked_matmul's products over weight blocks (the CPU kernel's
    custom calls, or XLA's batched dots where it is off) the compiled decode program has."""
    state = s.prefill(params, tokens, mask, jax.random.key(16), sampling)
    fn = s.decode_program(sampling.static(), "scan", *tokens.shape)
    hlo = fn.lower(params, state, sampling.arrays()).compile().as_text()
    return hlo.count("PMK,PKB->PMB") + hlo.count(f'custom_call_target="{kernel_lib.TARGET}"')


@pytest.mark.slow
def test_a_decode_of_a_few_rows_uses_weight_blocks(monkeypatch):
    """Without the block-matmul kernel, a default sampler on one CPU device with a spare
    core (plain kernels) decodes 4 rows (4 prompts) with weight blocks, as the engine's tail
    views do, and 8 (n = 2) with the plain kernels; the 4 rows sample the plain sampler's
    tokens (log-probs to rounding)."""
    monkeypatch.setattr(platform, "usable_cores", lambda: 2)
    monkeypatch.setattr(kernel_lib, "available", lambda: False)
    cfg, params = tiny_cfg("qwen2"), tiny_params("qwen2")
    tokens, mask = prompts(cfg.vocab_size, seed=15)  # 4 prompts
    sampler, plain = Sampler(cfg), Sampler(cfg, matmul_block=0)
    assert sampler.matmul_block == 0
    assert _batched_matmuls(sampler, params, tokens, mask, SAMPLED) > 0
    two = SamplingParams(temperature=1.0, max_new_tokens=NEW, n=2)
    assert _batched_matmuls(sampler, params, tokens, mask, two) == 0
    assert _batched_matmuls(plain, params, tokens, mask, SAMPLED) == 0
    ref = _np(plain.generate(params, tokens, mask, jax.random.key(16), SAMPLED))
    out = _np(sampler.generate(params, tokens, mask, jax.random.key(16), SAMPLED))
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_allclose(out.model_logprobs, ref.model_logprobs, atol=1e-5, rtol=0)
    # On a mesh the rows per device decide: 2 prompts x 4 samples over 4 data shards are 2
    # rows per device (the 2 prompts alone do not split 4 ways), 8 x 4 are 8.
    monkeypatch.setattr(platform, "usable_cores", lambda: 16)  # two cores per device
    sharded = Sampler(cfg, make_mesh(MeshConfig(data=4, fsdp=1, tensor=2)))
    four = SamplingParams(temperature=1.0, max_new_tokens=NEW, n=4)
    two_prompts = prompts(cfg.vocab_size, lengths=(7, 4), seed=15)
    eight_prompts = prompts(cfg.vocab_size, lengths=(7, 4, 2, 5) * 2, seed=15)
    assert _batched_matmuls(sharded, params, *two_prompts, four) > 0
    assert _batched_matmuls(sharded, params, *eight_prompts, four) == 0


def test_default_matmul_block(monkeypatch):
    """Without the block-matmul kernel: blocks where each of the sampler's CPU devices has
    about one core (at least as many devices as cores) or where a decode has at most 4 rows
    per device of at most two cores, plain kernels where XLA can split a wider matmul over
    spare cores, and on accelerators. With it: blocks on CPU devices of at most two cores
    at any rows."""
    cpus = jax.devices("cpu")
    monkeypatch.setattr(kernel_lib, "available", lambda: False)
    monkeypatch.setattr(platform, "usable_cores", lambda: 2)
    assert default_matmul_block(cpus[:1]) == 0
    if len(cpus) >= 2:
        assert default_matmul_block(cpus[:2]) == 64
    monkeypatch.setattr(platform, "usable_cores", lambda: 1)
    assert default_matmul_block(cpus[:1]) == 64
    assert default_matmul_block(Mesh(np.array(cpus[:1]), ("data",))) == 64
    assert Sampler(tiny_cfg("llama")).matmul_block == 64  # one (CPU) device, one core
    assert default_matmul_block(AbstractMesh((1,), ("data",))) == 0  # no devices: as on GPU
    monkeypatch.setattr(platform, "usable_cores", lambda: 2)
    # A decode of a few rows per device (the engine's tail views) streams faster in blocks.
    assert [default_matmul_block(cpus[:1], rows) for rows in (1, 4, 5, 32)] == [64, 64, 0, 0]
    assert default_matmul_block(AbstractMesh((1,), ("data",)), rows=2) == 0
    monkeypatch.setattr(platform, "usable_cores", lambda: 16)  # unmeasured: plain kernels
    assert default_matmul_block(cpus[:1], rows=2) == 0
    monkeypatch.setattr(platform, "usable_cores", lambda: 1)  # rows never turn blocks off
    assert default_matmul_block(cpus[:1], rows=32) == 64

    class Accelerator:
        platform = "gpu"

    assert default_matmul_block([Accelerator()]) == 0
    assert default_matmul_block([Accelerator()], rows=2) == 0

    monkeypatch.setattr(kernel_lib, "available", lambda: True)
    monkeypatch.setattr(platform, "usable_cores", lambda: 2)
    assert default_matmul_block(cpus[:1]) == 64
    assert [default_matmul_block(cpus[:1], rows) for rows in (1, 4, 5, 32)] == [64] * 4
    # The kernel multiplies float32 only: bfloat16 keeps XLA's rule (blocks to 4 rows).
    bf16 = [default_matmul_block(cpus[:1], rows, jnp.bfloat16) for rows in (4, 5, None)]
    assert bf16 == [64, 0, 0]
    monkeypatch.setattr(platform, "usable_cores", lambda: 16)  # unmeasured: plain kernels
    assert default_matmul_block(cpus[:1]) == 0
    assert default_matmul_block(cpus[:1], rows=32) == 0
    assert default_matmul_block([Accelerator()]) == 0
