"""Attention primitives: masks, rotary embeddings and one attention entry point.

Every attention call in jaxrlhf goes through :func:`dot_product_attention`, which picks a
fused kernel (cuDNN flash attention on GPU) where one is available and otherwise runs a plain
XLA implementation that works on every backend, including CPU.
"""

from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.models.config import ModelConfig, RopeScaling


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


@flax.struct.dataclass
class LayerMasks:
    """The two attention masks of a model whose layers differ (``ModelConfig.layer_types``):
    ``full`` for full-attention layers, ``sliding`` (windowed) for sliding ones. Either may
    be a ``[B, T, S]`` bool mask or a :class:`~jaxrlhf.models.shared_prefix.SharedPrefixMask`."""

    full: Any
    sliding: Any


def layer_masks(
    cfg: ModelConfig,
    key_mask: Bool[Array, "B S"],
    query_len: int,
    query_offset: Int[Array, ""] | int = 0,
) -> Bool[Array, "B T S"] | LayerMasks:
    """:func:`causal_mask` for every layer of ``cfg``: one mask when all layers attend alike
    (windowed or not), :class:`LayerMasks` when sliding and full layers mix."""
    sliding = set(cfg.sliding_layers)
    if sliding == {False}:
        return causal_mask(key_mask, query_len, query_offset)
    windowed = causal_mask(key_mask, query_len, query_offset, cfg.sliding_window)
    if sliding == {True}:
        return windowed
    return LayerMasks(full=causal_mask(key_mask, query_len, query_offset), sliding=windowed)


def positions_from_mask(mask: Bool[Array, "B T"]) -> Int[Array, "B T"]:
    """Position ids counting real tokens only: 0 at each row's first real token.

    Padding slots get the position of the nearest real token before them (0 before the
    first), a harmless value since they are masked everywhere.
    """
    mask = mask.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)


def rope_inverse_frequencies(cfg: ModelConfig, layer: int | None = None) -> np.ndarray:
    """[R/2] inverse frequencies θ_i = theta^(-2i/R) of the R = ``cfg.rotary_dim`` rotated
    head dims, with the configured scaling applied.

    Matches transformers' ``default``, ``linear`` and ``llama3`` rope types. With
    ``cfg.local_rope_theta`` (Gemma 3), a sliding ``layer`` uses that base and no scaling.
    """
    if layer is not None and cfg.local_rope_theta is not None and cfg.sliding_layers[layer]:
        return _inverse_frequencies(cfg.rotary_dim, cfg.local_rope_theta, None)
    return _inverse_frequencies(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)


def layer_rope_table(cfg: ModelConfig) -> np.ndarray:
    """[L, R/2] inverse frequencies of every layer (rows differ only with local_rope_theta)."""
    return np.stack([rope_inverse_frequencies(cfg, i) for i in range(cfg.num_layers)])


def _inverse_frequencies(dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
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


def distinct_rope_tables(cfg: ModelConfig) -> tuple[np.ndarray, tuple[int, ...]]:
    """The model's distinct inverse-frequency tables ``[K, R/2]`` (K = 1, or 2 for Gemma 3's
    sliding and full layers) and, per layer, the row of the table it uses."""
    rows: dict[bytes, int] = {}
    tables: list[np.ndarray] = []
    index: list[int] = []
    for row in layer_rope_table(cfg):
        if row.tobytes() not in rows:
            rows[row.tobytes()] = len(tables)
            tables.append(row)
        index.append(rows[row.tobytes()])
    return np.stack(tables), tuple(index)


@flax.struct.dataclass
class RopeAngles:
    """cos and sin ``[K, B, T, R/2]`` (computed in float32, stored in the model's compute
    dtype, which ``apply_rope`` casts to anyway) of every token's RoPE angles under each of
    the model's K distinct frequency tables (:func:`distinct_rope_tables`); ``index[l]``: the
    table layer l uses. Made once per forward (:func:`rope_angles`) for every layer.

    Computed inside each layer instead, as the angles were before, the scanned layer loop
    evaluates them in every layer's q and k fusions again for every head and element. An
    unrolled stack gains nothing: there XLA:CPU fuses the shared tables back into each
    consumer."""

    cos: Float[Array, "K B T R2"]
    sin: Float[Array, "K B T R2"]
    index: tuple[int, ...] = flax.struct.field(pytree_node=False)

    def layer(
        self, layer: Int[Array, ""] | int
    ) -> tuple[Float[Array, "B T R2"], Float[Array, "B T R2"]]:
        """Layer ``layer``'s cos and sin ``[B, T, R/2]`` (``layer`` may be traced)."""
        if self.cos.shape[0] == 1:
            return self.cos[0], self.sin[0]
        which = jnp.asarray(self.index)[layer]
        return self.cos[which], self.sin[which]


def rope_angles(cfg: ModelConfig, positions: Int[Array, "B T"]) -> RopeAngles | None:
    """Every token's RoPE cos and sin under each distinct table (None without RoPE)."""
    if cfg.position_embedding != "rope":
        return None
    tables, index = distinct_rope_tables(cfg)
    cos, sin = rope_cos_sin(positions[None], tables[:, None, None])  # [K, B, T, R/2]
    dtype = cfg.compute_dtype
    return RopeAngles(cos=cos.astype(dtype), sin=sin.astype(dtype), index=index)


def apply_rope(
    x: Float[Array, "B T N H"], cos: Float[Array, "B T R2"], sin: Float[Array, "B T R2"]
) -> Float[Array, "B T N H"]:
    """Rotary embedding in the "rotate half" layout of transformers (first/second halves of
    the first R = 2 * cos.shape[-1] dims; any dims after them pass unrotated, as with
    ``partial_rotary_factor`` < 1), by the angle tables of :func:`rope_cos_sin` (float32),
    cast to ``x.dtype`` first."""
    return rotate(x, cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype))


def rope_cos_sin(
    positions: Int[Array, "..."], inv_freq: np.ndarray | jax.Array
) -> tuple[Float[Array, "... R2"], Float[Array, "... R2"]]:
    """float32 cos and sin ``[..., R/2]`` of the angles ``position * θ_i``: the tables
    :func:`rotate` takes (the model makes them once per forward, :func:`rope_angles`;
    ``generation.decode.rope_tables`` once per decode call)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles), jnp.sin(angles)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x`` [..., H] rotated by angle tables [..., R/2] (broadcast against x's leading dims):
    the "rotate half" arithmetic on the first R dims, the rest unchanged."""
    rot = 2 * cos.shape[-1]
    x1, x2 = jnp.split(x[..., :rot], 2, axis=-1)
    out = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if rot < x.shape[-1]:
        out.append(x[..., rot:])
    return jnp.concatenate(out, axis=-1)


def softcap(scores: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(scores / cap)`` (Gemma 2's soft-capping of attention scores and logits),
    or ``scores`` unchanged where ``cap`` is None."""
    if cap is None:
        return scores
    return jnp.tanh(scores / cap) * cap


def xla_attention(q, k, v, mask, scale, logit_cap=None):
    batch, q_len, num_heads, head_dim = q.shape
    num_kv = k.shape[2]
    groups = num_heads // num_kv
    # Heads-major operands, each kv head's G query heads stacked into one [G*T, H] matrix:
    # one plain batched matmul per (B, K) for q·k and for probs·v. Same math as the einsum
    # "BTKGH,BSKH->BKGTS", but XLA:CPU runs this layout's forward and backward faster (the
    # 5-D einsum's operands and results are re-laid out around each matmul).
    q = q.reshape(batch, q_len, num_kv, groups, head_dim).transpose(0, 2, 3, 1, 4)
    q = q.reshape(batch, num_kv, groups * q_len, head_dim)  # [B, K, G*T, H]
    k = k.transpose(0, 2, 1, 3)  # [B, K, S, H]
    v = v.transpose(0, 2, 1, 3)
    logits = jnp.einsum("BKMH,BKSH->BKMS", q, k, preferred_element_type=jnp.float32)
    logits = logits.reshape(batch, num_kv, groups, q_len, -1) * scale  # [B, K, G, T, S]
    logits = softcap(logits, logit_cap)
    # A finite floor (not -inf) keeps fully masked rows (padding queries) finite.
    logits = jnp.where(mask[:, None, None], logits, jnp.finfo(jnp.float32).min)
    # Softmax normalised after the values' matmul: (sum_s e_s v_s) / sum_s e_s divides the
    # [.., H] output instead of the [.., S] weights, which on CPU saves whole passes over the
    # scores in the forward and the backward (benchmarks/RESULTS.md).
    top = jax.lax.stop_gradient(logits.max(-1, keepdims=True))
    weights = jnp.exp(logits - top)  # [B, K, G, T, S]
    denom = weights.sum(-1)[..., None]  # [B, K, G, T, 1]
    weights = weights.astype(v.dtype).reshape(batch, num_kv, groups * q_len, -1)
    out = jnp.einsum("BKMS,BKSH->BKMH", weights, v).reshape(batch, num_kv, groups, q_len, head_dim)
    out = (out / denom).astype(v.dtype)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, num_heads, head_dim)


# Query blocks of the block-causal XLA path: at least this many query slots per block, and at
# most this many blocks. n blocks skip (n - 1) / 2n of the scores (44% for 8, 47% for 16), but
# each block is one more pair of matmuls and a softmax in every layer's forward and backward:
# 16 blocks compiled several times slower than 8 for 3% more of the scores.
CAUSAL_BLOCK_MIN = 64
CAUSAL_BLOCKS_MAX = 8


def causal_blocks(length: int) -> list[tuple[int, int]]:
    """The query blocks ``[start, end)`` of :func:`block_causal_attention` over ``length``
    slots: ``min(CAUSAL_BLOCKS_MAX, length // CAUSAL_BLOCK_MIN)`` blocks (at least one) of
    near-equal size covering ``0 .. length``."""
    count = max(1, min(CAUSAL_BLOCKS_MAX, length // CAUSAL_BLOCK_MIN))
    edges = np.linspace(0, length, count + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def block_causal_attention(q, k, v, mask, scale, logit_cap=None):
    """:func:`xla_attention` for a causal mask (False wherever key slot s > query slot t,
    with T == S): query block ``[a, b)`` attends keys ``[0, b)`` only, so the key blocks above
    the diagonal, masked for every query of the block, are never computed (with n blocks,
    (n + 1) / 2n of the scores). The same result as :func:`xla_attention` at every query
    with at least one visible key (a masked key's weight is exactly 0 there). A query that
    sees no key (a padding slot) gets another meaningless finite value: the mean of fewer
    values instead of the whole row's."""
    blocks = causal_blocks(q.shape[1])
    outs = [
        xla_attention(q[:, a:b], k[:, :b], v[:, :b], mask[:, a:b, :b], scale, logit_cap)
        for a, b in blocks
    ]
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def _cudnn_usable(q: jax.Array, logit_cap: float | None = None) -> bool:
    return (
        jax.default_backend() == "gpu"
        and q.dtype in (jnp.bfloat16, jnp.float16)
        and logit_cap is None  # jax.nn.dot_product_attention has no soft-capping
    )


def dot_product_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    mask: Bool[Array, "B T S"],
    *,
    scale: float,
    impl: str = "auto",
    logit_cap: float | None = None,
    causal: bool = False,
) -> Float[Array, "B T N H"]:
    """Grouped-query softmax attention, softmax in float32.

    Args:
      q: queries, N heads.
      k, v: keys and values, K heads with N % K == 0 (query head n reads kv head n // (N/K)).
      mask: True where query t may attend key s.
      scale: multiplier on q·k (usually 1/sqrt(H)).
      impl: ``xla`` (any backend), ``cudnn`` (GPU, fp16/bf16, no ``logit_cap``; raises
        elsewhere) or ``auto`` (cuDNN when usable, else XLA).
      logit_cap: soft-cap of the scaled scores (:func:`softcap`), None for none.
      causal: the caller guarantees that ``mask`` is False wherever key slot s > query slot
        t (T == S: the queries are the keys' own slots, as in every forward without a
        cache); the XLA path then skips the blocks above the diagonal
        (:func:`block_causal_attention`).

    Returns:
      [B, T, N, H] in v's dtype.
    """
    if impl == "auto":
        impl = "cudnn" if _cudnn_usable(q, logit_cap) else "xla"
    if impl == "xla":
        if causal and q.shape[1] == k.shape[1]:
            return block_causal_attention(q, k, v, mask, scale, logit_cap)
        return xla_attention(q, k, v, mask, scale, logit_cap)
    if impl == "cudnn":
        if not _cudnn_usable(q, logit_cap):
            raise ValueError(
                f"attention_impl='cudnn' needs a GPU backend, fp16/bf16 inputs and no logit "
                f"soft-cap; got backend {jax.default_backend()!r}, dtype {q.dtype}, cap "
                f"{logit_cap}. Use 'auto' or 'xla'."
            )
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask[:, None], scale=scale, implementation="cudnn"
        )
    raise ValueError(f"attention impl {impl!r} is not one of ['auto', 'xla', 'cudnn']")
