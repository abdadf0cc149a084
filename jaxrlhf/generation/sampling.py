"""Choosing the next token from float32 logits, with the log-prob of the choice.

Order of operations (as in transformers' logits processors): temperature, then top-k, then
top-p on what top-k kept. The truncations are thresholds on values: top-k keeps every token
whose logit is >= the k-th largest, top-p every token whose probability is >= the smallest
probability in the nucleus, so tied tokens at a boundary are all kept.

Sampling uses one uniform number per row and the inverse CDF (first token whose cumulative
probability reaches u), not the Gumbel trick: Gumbel needs V random numbers per row and step
(threefry), which on CPU cost more than a bench-S decode step's attention. A token whose
probability is exactly 0 (truncated away) can never be chosen: the search only accepts
tokens with probability > 0.

Log-probs are computed as in training (``jaxrlhf.losses.token_logprobs``: gather minus
logsumexp, float32), so the sampler and the trainer agree by construction:

* ``logprobs``: under the distribution actually sampled from (after temperature and
  truncation, renormalised); 0 for greedy, whose distribution is a point mass.
* ``model_logprobs``: under the unmodified model distribution (temperature 1, nothing
  truncated), the one PPO's importance ratio needs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.generation.params import SamplingStatics
from jaxrlhf.losses import token_logprobs

_NEG_INF = -jnp.inf


def _gather_logprob(logits: Float[Array, "B V"], tokens: Int[Array, " B"]) -> Float[Array, " B"]:
    return token_logprobs(logits[:, None, :], tokens[:, None])[:, 0]


def truncate(
    logits: Float[Array, "B V"],
    top_k: Int[Array, ""],
    top_p: Float[Array, ""],
    *,
    use_top_k: bool,
    use_top_p: bool,
) -> Float[Array, "B V"]:
    """Sets logits outside the top-k / top-p set to -inf (see the module docstring).

    Args:
      logits: temperature-scaled float32 logits.
      top_k: k (traced); 0 keeps everything.
      top_p: p in (0, 1] (traced).
      use_top_k, use_top_p: static switches; with both off no sort is compiled.

    Returns:
      Logits of the same shape; every row keeps at least its most likely token.
    """
    if not (use_top_k or use_top_p):
        return logits
    vocab = logits.shape[-1]
    ranked = -jnp.sort(-logits, axis=-1)  # [B, V] descending
    if use_top_k:
        k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
        kth = jax.lax.dynamic_index_in_dim(ranked, k - 1, axis=-1)  # [B, 1]
        logits = jnp.where(logits >= kth, logits, _NEG_INF)
        ranked = jnp.where(jnp.arange(vocab) < k, ranked, _NEG_INF)
    if use_top_p:
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each ranked token
        # Keep ranked tokens while the mass above them is < p; the first is always kept.
        keep = (before < top_p) | (jnp.arange(vocab) == 0)
        last = jnp.sum(keep, axis=-1, keepdims=True) - 1
        threshold = jnp.take_along_axis(ranked, last, axis=-1)
        logits = jnp.where(logits >= threshold, logits, _NEG_INF)
    return logits


def _first(hit: Bool[Array, "B N"], valid: Bool[Array, "B N"]) -> Int[Array, " B"]:
    """Index of the first True of ``hit``; where ``hit`` has none (possible only through
    float rounding at the very end of the CDF), the last True of ``valid``."""
    width = hit.shape[-1]
    last_valid = width - 1 - jnp.argmax(jnp.flip(valid, axis=-1), axis=-1)
    return jnp.where(hit.any(-1), jnp.argmax(hit, axis=-1), last_valid)


def sample_from_logits(
    logits: Float[Array, "B V"],
    uniform: Float[Array, " B"],
    *,
    block: int = 128,
) -> Int[Array, " B"]:
    """Inverse-CDF sampling: the first token whose cumulative probability reaches ``u``.

    The CDF is searched in two levels (which block of ``block`` tokens, then which token in
    it), so the only scans are over V / block block masses and one block: a scan over all V
    tokens per step costs more on CPU than the rest of the sampling.

    Args:
      logits: float32 logits; -inf entries have probability 0 and are never returned.
      uniform: one number per row in (0, 1].
      block: tokens per block of the first level.

    Returns:
      int32 token ids.
    """
    probs = jax.nn.softmax(logits, axis=-1)
    rows, vocab = probs.shape
    block = min(block, vocab)
    blocks = jnp.pad(probs, ((0, 0), (0, -vocab % block))).reshape(rows, -1, block)
    mass = blocks.sum(-1)  # [B, V / block]
    cdf = jnp.cumsum(mass, axis=-1)
    # u times the total, not u: the float32 sums need not add up to exactly 1.
    target = (uniform * cdf[:, -1])[:, None]
    chosen = _first((cdf >= target) & (mass > 0), mass > 0)  # [B]
    inner = jnp.take_along_axis(blocks, chosen[:, None, None], axis=1)[:, 0]  # [B, block]
    before = jnp.take_along_axis(cdf - mass, chosen[:, None], axis=1)
    inner_cdf = before + jnp.cumsum(inner, axis=-1)
    offset = _first((inner_cdf >= target) & (inner > 0), inner > 0)
    return (chosen * block + offset).astype(jnp.int32)


def draw_uniforms(key: jax.Array, rows: int, steps: int) -> Float[Array, "R T"]:
    """The uniform numbers of a whole sampling call, in (0, 1]: ``[r, t]`` for row r, step t.

    Drawn once, before the token loop: a threefry draw inside the loop runs as its own
    small XLA loop on every step. With threefry's partitionable mode (the JAX default) the
    value at ``[r, t]`` depends only on the key, r, t and ``steps``, not on the number of
    rows or on the sharding: a prompt alone and in a batch (row 0) draw the same numbers.
    """
    # 1 - U[0, 1) lies in (0, 1]: u = 0 would select token 0 whatever its probability.
    return 1.0 - jax.random.uniform(key, (rows, steps), jnp.float32)


def next_tokens(
    logits: Float[Array, "B V"],
    uniform: Float[Array, " B"],
    arrays: dict[str, jax.Array],
    statics: SamplingStatics,
) -> tuple[Int[Array, " B"], Float[Array, " B"], Float[Array, " B"] | None]:
    """One sampling step.

    Args:
      logits: float32 next-token logits of each row.
      uniform: one number per row in (0, 1] (``draw_uniforms``); unused when greedy.
      arrays: ``SamplingParams.arrays()``.
      statics: ``SamplingParams.static()``.

    Returns:
      ``(tokens, logprobs, model_logprobs)``; ``model_logprobs`` is None unless
      ``statics.return_model_logprobs``.
    """
    model_lp = None
    if statics.greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logprobs = jnp.zeros(tokens.shape, jnp.float32)
    else:
        scaled = logits / arrays["temperature"]
        scaled = truncate(
            scaled,
            arrays["top_k"],
            arrays["top_p"],
            use_top_k=statics.use_top_k,
            use_top_p=statics.use_top_p,
        )
        tokens = sample_from_logits(scaled, uniform)
        logprobs = _gather_logprob(scaled, tokens)
    if statics.return_model_logprobs:
        model_lp = _gather_logprob(logits, tokens)
    return tokens, logprobs, model_lp
