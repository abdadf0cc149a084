"""Attention primitives: masks, rotary embeddings and one attention entry point.

Every attention call in jaxrlhf goes through :func:`dot_product_attention`, which picks a
fused kernel (cuDNN flash attention on GPU) where one is available and otherwise runs a plain
XLA implementation that works on every backend, including CPU.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.models.config import ModelConfig


def causal_mask(
    key_mask: Bool[Array, "B S"],
    query_len: int,
    query_offset: Int[Array, ""] | int = 0,
    sliding_window: int | None = None,
) -> Bool[Array, "B T S"]:
    """Which keys each query may attend to.

    Query ``t`` sits at slot ``query_offset + t`` of the key axis (0 without a cache, the
    cache write index with one). It sees key slot ``s`` when ``s <= query_offset + t``, the key
    is a real token (``key_mask``), and, with a sliding window, ``query_offset + t - s <
    sliding_window``. Causality is by slot index, not position id, which is what left- or
    right-padded batches need: real tokens are contiguous, so index gaps equal position gaps.

    Args:
      key_mask: [B, S] True where the key slot holds a real (non-padding) token.
      query_len: T, number of query tokens.
      query_offset: slot of the first query (scalar; may be traced).
      sliding_window: optional window size in tokens.

    Returns:
      [B, T, S] bool mask.
    """
    num_keys = key_mask.shape[-1]
    q_slot = query_offset + jnp.arange(query_len)[:, None]  # [T, 1]
    k_slot = jnp.arange(num_keys)[None, :]  # [1, S]
    allowed = k_slot <= q_slot
    if sliding_window is not None:
        allowed &= q_slot - k_slot < sliding_window
    return allowed[None] & key_mask[:, None, :].astype(bool)


def positions_from_mask(mask: Bool[Array, "B T"]) -> Int[Array, "B T"]:
    """Position ids counting real tokens only: 0 at each row's first real token.

    Padding slots get the position of the nearest real token before them (0 before the
    first), a harmless value since they are masked everywhere.
    """
    mask = mask.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)


def rope_inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[H/2] inverse frequencies θ_i = theta^(-2i/H), with the configured scaling applied.

    Matches transformers' ``default``, ``linear`` and ``llama3`` rope types.
    """
    dim = cfg.dim_per_head
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq.astype(np.float32)
    if scaling.type == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    # llama3: long wavelengths are divided by `factor`, short ones kept, a smooth ramp between.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def apply_rope(
    x: Float[Array, "B T N H"], positions: Int[Array, "B T"], inv_freq: np.ndarray
) -> Float[Array, "B T N H"]:
    """Rotary embedding in the "rotate half" layout of transformers (first/second halves).

    Angles are computed in float32; the result is cast back to ``x.dtype``.
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :].astype(x.dtype)
    sin = jnp.sin(angles)[:, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def xla_attention(q, k, v, mask, scale):
    batch, q_len, num_heads, head_dim = q.shape
    num_kv = k.shape[2]
    groups = num_heads // num_kv
    # Heads-major operands, each kv head's G query heads stacked into one [G*T, H] matrix:
    # one plain batched matmul per (B, K) for q·k and for probs·v. Same math as the einsum
    # "BTKGH,BSKH->BKGTS", but XLA:CPU runs this layout's forward ~30% and backward ~20%
    # faster (bench-S shapes; the 5-D einsum's operands and results are re-laid out around
    # each matmul).
    q = q.reshape(batch, q_len, num_kv, groups, head_dim).transpose(0, 2, 3, 1, 4)
    q = q.reshape(batch, num_kv, groups * q_len, head_dim)  # [B, K, G*T, H]
    k = k.transpose(0, 2, 1, 3)  # [B, K, S, H]
    v = v.transpose(0, 2, 1, 3)
    logits = jnp.einsum("BKMH,BKSH->BKMS", q, k, preferred_element_type=jnp.float32)
    logits = logits.reshape(batch, num_kv, groups, q_len, -1) * scale  # [B, K, G, T, S]
    # A finite floor (not -inf) keeps fully masked rows (padding queries) finite.
    logits = jnp.where(mask[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    probs = probs.reshape(batch, num_kv, groups * q_len, -1)
    out = jnp.einsum("BKMS,BKSH->BKMH", probs, v).reshape(batch, num_kv, groups, q_len, head_dim)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, num_heads, head_dim)


def _cudnn_usable(q: jax.Array) -> bool:
    return jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)


def dot_product_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    mask: Bool[Array, "B T S"],
    *,
    scale: float,
    impl: str = "auto",
) -> Float[Array, "B T N H"]:
    """Grouped-query softmax attention, softmax in float32.

    Args:
      q: queries, N heads.
      k, v: keys and values, K heads with N % K == 0 (query head n reads kv head n // (N/K)).
      mask: True where query t may attend key s.
      scale: multiplier on q·k (usually 1/sqrt(H)).
      impl: ``xla`` (any backend), ``cudnn`` (GPU, fp16/bf16, raises elsewhere) or ``auto``
        (cuDNN when usable, else XLA).

    Returns:
      [B, T, N, H] in v's dtype.
    """
    if impl == "auto":
        impl = "cudnn" if _cudnn_usable(q) else "xla"
    if impl == "xla":
        return xla_attention(q, k, v, mask, scale)
    if impl == "cudnn":
        if not _cudnn_usable(q):
            raise ValueError(
                f"attention_impl='cudnn' needs a GPU backend and fp16/bf16 inputs; got backend "
                f"{jax.default_backend()!r}, dtype {q.dtype}. Use 'auto' or 'xla'."
            )
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask[:, None], scale=scale, implementation="cudnn"
        )
    raise ValueError(f"attention impl {impl!r} is not one of ['auto', 'xla', 'cudnn']")
