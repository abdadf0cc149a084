"""The sampler's KV cache: one entry per layer, head-major, in one of two forms.

With n > 1 samples per prompt, a prompt prefix shared by each group of n samples plus the
per-sample cache of generated tokens (B prompts, R = B * n rows, P prompt slots, T new
tokens)::

    prefix_k  [B, K, H, P]   keys of the prompt, written once by prefill
    prefix_v  [B, K, P, H]   values of the prompt
    k         [R, K, H, T]   keys of the generated tokens, one slot written per step
    v         [R, K, T, H]   values of the generated tokens

With n = 1 there is nothing to share: ``prefix_k``/``prefix_v`` are empty and ``k``/``v``
hold prompt and generated slots together, ``[B, K, H, P + T]`` and ``[B, K, P + T, H]`` (the
prompt copied in once by prefill), so that each attention is one matmul instead of two.

Why this layout (the measurements are in benchmarks/RESULTS.md):

* Head-major ``[.., K, H, S]`` keys and ``[.., K, S, H]`` values make both attention matmuls
  plain batched matmuls over ``(batch, kv_head)``, reading the cache in place. The model's
  own cache is ``[L, B, S, K, H]``; decoding against it transposes every layer's cache on
  every step (the largest single cost of a naive decode loop).
* One array per layer (not stacked over layers): the per-step write is in place (a
  ``dynamic_update_slice`` of one slot, or of one slot per row: a scatter, or on CPU the
  attention kernel's own write, ``kernels.decode_attention.write_and_attend``) and the
  attention reads the array directly. Slicing a stacked ``[L, ...]`` cache inside the loop
  copies the layer's slice on every step.
* With n > 1 the prompt prefix is stored once per prompt, not once per sample: the n samples
  of a group attend to it as n * G query rows of one matmul, so a GRPO group reads its
  prompt's cache once per step instead of n times, and prefill never copies it n times.

Logical axes (``CACHE_BATCH``, ``CACHE_HEADS``, ``CACHE_LENGTH``) are mapped to mesh axes by
the generation rule set (``jaxrlhf.sharding.GENERATE``): batch over the data axes, kv heads
over ``tensor``, length never split (each step writes one position).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jaxrlhf.models import axes
from jaxrlhf.models.config import ModelConfig

K_AXES = (axes.CACHE_BATCH, axes.CACHE_HEADS, None, axes.CACHE_LENGTH)  # [B, K, H, S]
V_AXES = (axes.CACHE_BATCH, axes.CACHE_HEADS, axes.CACHE_LENGTH, None)  # [B, K, S, H]


@flax.struct.dataclass
class DecodeCache:
    """Per-layer KV cache of a batch of sample groups (see the module docstring).

    Attributes:
      prefix_k: L x [B, K, H, P] shared prompt keys (RoPE applied); empty when n = 1.
      prefix_v: L x [B, K, P, H] shared prompt values; empty when n = 1.
      k: L x [R, K, H, T] generated-token keys ([B, K, H, P + T] with the prompt when n = 1).
      v: L x [R, K, T, H] generated-token values ([B, K, P + T, H] when n = 1).
    """

    prefix_k: tuple[jax.Array, ...]
    prefix_v: tuple[jax.Array, ...]
    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def shared_prefix(self) -> bool:
        """Whether the prompt lives in ``prefix_k``/``prefix_v`` (n > 1)."""
        return len(self.prefix_k) > 0

    @staticmethod
    def logical_axes(num_layers: int, shared_prefix: bool) -> DecodeCache:
        """A DecodeCache whose leaves are the logical axis names of each array."""
        ks, vs = (K_AXES,) * num_layers, (V_AXES,) * num_layers
        if not shared_prefix:
            return DecodeCache(prefix_k=(), prefix_v=(), k=ks, v=vs)
        return DecodeCache(prefix_k=ks, prefix_v=vs, k=ks, v=vs)


def with_generated_slots(prompt_cache: DecodeCache, n: int, max_new_tokens: int) -> DecodeCache:
    """The decode cache for n samples per prompt, from prefill's prompt-only cache.

    Args:
      prompt_cache: ``prefix_k``/``prefix_v`` hold the prompts; ``k``/``v`` are empty.
      n: samples per prompt.
      max_new_tokens: generated slots per sample.

    Returns:
      The shared-prefix form for n > 1, the joint form for n = 1 (see the module docstring).
    """
    pk, pv = prompt_cache.prefix_k, prompt_cache.prefix_v
    batch, kv, h, _ = pk[0].shape
    k_zeros = jnp.zeros((batch * n, kv, h, max_new_tokens), pk[0].dtype)
    v_zeros = jnp.zeros((batch * n, kv, max_new_tokens, h), pv[0].dtype)
    if n > 1:
        return DecodeCache(
            prefix_k=pk,
            prefix_v=pv,
            k=tuple(k_zeros for _ in pk),
            v=tuple(v_zeros for _ in pv),
        )
    return DecodeCache(
        prefix_k=(),
        prefix_v=(),
        k=tuple(jnp.concatenate([k, k_zeros], axis=3) for k in pk),
        v=tuple(jnp.concatenate([v, v_zeros], axis=2) for v in pv),
    )


def generated_view(cache: DecodeCache, prompt_len: int, size: int) -> DecodeCache:
    """A copy of ``cache`` keeping only its first ``size`` generated-token slots.

    Used by the decode loop's phases: early tokens attend over (and read) a cache sized to
    what has been generated so far instead of the whole ``max_new_tokens``.
    """
    keep = size if cache.shared_prefix else prompt_len + size
    return cache.replace(
        k=tuple(k[..., :keep] for k in cache.k), v=tuple(v[..., :keep, :] for v in cache.v)
    )


def write_generated(full: DecodeCache, part: DecodeCache) -> DecodeCache:
    """``full`` with the slots of ``part`` (from ``generated_view``) written back in place."""

    def put(fulls: tuple[jax.Array, ...], parts: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        return tuple(
            jax.lax.dynamic_update_slice(f, p, (0,) * f.ndim)
            for f, p in zip(fulls, parts, strict=True)
        )

    return full.replace(k=put(full.k, part.k), v=put(full.v, part.v))


def abstract_cache(
    cfg: ModelConfig,
    batch: int,
    prompt_len: int,
    max_new_tokens: int,
    n: int = 1,
    dtype: Any = None,
) -> DecodeCache:
    """ShapeDtypeStructs of the cache for ``batch`` prompts (no memory used)."""
    dtype = jnp.dtype(dtype or cfg.compute_dtype)
    k_, h, L = cfg.kv_heads, cfg.dim_per_head, cfg.num_layers

    def sds(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype)

    if n == 1:
        total = prompt_len + max_new_tokens
        return DecodeCache(
            prefix_k=(),
            prefix_v=(),
            k=(sds(batch, k_, h, total),) * L,
            v=(sds(batch, k_, total, h),) * L,
        )
    return DecodeCache(
        prefix_k=(sds(batch, k_, h, prompt_len),) * L,
        prefix_v=(sds(batch, k_, prompt_len, h),) * L,
        k=(sds(batch * n, k_, h, max_new_tokens),) * L,
        v=(sds(batch * n, k_, max_new_tokens, h),) * L,
    )


def cache_nbytes(cache: Any) -> int:
    """Total bytes of a (possibly abstract) cache, all devices together."""
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(cache))
