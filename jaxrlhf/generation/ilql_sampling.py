"""ILQL's advantage-weighted decoding (trlX ``AutoModelForCausalLMWithILQLHeads.generate``).

At each step the next token is drawn from::

    scores = log_softmax(logits) + beta * (min_k Q_target^k(s, .) - V(s))
    scores = top_k(scores)                 # the rest -inf (top_k 0: every token)
    token ~ softmax(scores / temperature)  # argmax at temperature 0

``beta = 0`` samples the behaviour-cloned language model itself.

The decode is KV-cached over an :class:`~jaxrlhf.models.ilql.ILQLModel` (one forward per
step gives logits, target Q and V together); prompts are left-padded, so every row's next
token is written at the same cache column. Rows stop at any of ``stop_ids``; later positions
are padding.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.models import model as model_lib
from jaxrlhf.models.attention import positions_from_mask


def advantage_weighted_scores(
    logits: Float[Array, "B V"],
    target_q: Float[Array, "K B V"],
    values: Float[Array, " B"],
    *,
    beta: float,
    top_k: int = 0,
) -> Float[Array, "B V"]:
    """``log_softmax(logits) + beta (min_k target_q - V)``, outside the ``top_k`` best set
    to ``-inf`` (``top_k`` 0 keeps every token; ties at the k-th score are all kept)."""
    q = jnp.min(target_q.astype(jnp.float32), axis=0)
    scores = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    scores = scores + beta * (q - values.astype(jnp.float32)[:, None])
    if top_k and top_k < scores.shape[-1]:
        kth = jax.lax.top_k(scores, top_k)[0][:, -1:]
        scores = jnp.where(scores >= kth, scores, -jnp.inf)
    return scores


def generate(
    module: Any,
    params: Any,
    tokens: Int[Array, "B P"],
    mask: Bool[Array, "B P"],
    key: jax.Array,
    *,
    max_new_tokens: int,
    beta: float,
    top_k: int = 0,
    temperature: float = 1.0,
    stop_ids: tuple[int, ...] = (),
    pad_id: int = 0,
) -> tuple[Int[Array, "B N"], Bool[Array, "B N"]]:
    """Advantage-weighted samples of ``max_new_tokens`` tokens after each prompt.

    Args:
      module, params: an ``ilql`` model (``models.model.build(cfg, "ilql")``) and its params.
      tokens, mask: left-padded prompts and their real tokens (every row has one).
      key: sampling key (unused at temperature 0).
      max_new_tokens: ``N``.
      beta, top_k, temperature: the module docstring's.
      stop_ids: tokens that stop a row (kept in it); empty: every row runs ``N`` tokens.
      pad_id: written after a row stops.

    Returns:
      ``(completions [B, N] int32, completion_mask [B, N])``, the mask True up to and with
      each row's stop token.
    """
    b, p = tokens.shape
    cache = model_lib.init_cache(module.cfg, b, p + max_new_tokens)
    cache_mask = jnp.zeros((b, p + max_new_tokens), bool).at[:, :p].set(mask)
    out, cache = model_lib.forward_with_cache(
        module, params, tokens, positions_from_mask(mask), cache, cache_mask, jnp.int32(0)
    )

    def last(out: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
        return out.logits[:, -1], out.target_q[:, :, -1], out.values[:, -1]

    def choose(heads: tuple[jax.Array, jax.Array, jax.Array], k: jax.Array) -> jax.Array:
        scores = advantage_weighted_scores(*heads, beta=beta, top_k=top_k)
        if temperature == 0:
            return jnp.argmax(scores, axis=-1).astype(jnp.int32)
        return jax.random.categorical(k, scores / temperature, axis=-1).astype(jnp.int32)

    def step(carry, xs):
        heads, cache, cache_mask, position, done = carry
        i, k = xs
        token = jnp.where(done, pad_id, choose(heads, k))
        alive = ~done
        if stop_ids:
            done = done | (token[:, None] == jnp.asarray(stop_ids, jnp.int32)).any(-1)
        column = p + i
        cache_mask = cache_mask.at[:, column].set(True)
        out, cache = model_lib.forward_with_cache(
            module, params, token[:, None], position[:, None], cache, cache_mask, column
        )
        return (last(out), cache, cache_mask, position + 1, done), (token, alive)

    position = mask.sum(axis=-1).astype(jnp.int32)
    keys = jax.random.split(key, max_new_tokens)
    carry = (last(out), cache, cache_mask, position, jnp.zeros((b,), bool))
    _, (new_tokens, alive) = jax.lax.scan(step, carry, (jnp.arange(max_new_tokens), keys))
    return new_tokens.T, alive.T
