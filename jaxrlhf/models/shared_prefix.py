"""Shared-prompt packing: run each group's prompt through the model once, not n times.

A GRPO-style rollout holds ``n`` responses per prompt: rows ``g*n .. g*n + n - 1`` share one
left-padded prompt of ``P`` slots, each followed by its own right-padded response of ``R``
slots. Causal attention makes the prompt's activations independent of what follows, so the
``[G*n, P + R]`` layout computes them ``n`` times. :func:`pack_groups` lays the rollout out as
``[G, P + n*R]`` rows instead, the prompt once and then the ``n`` responses side by side::

    packed row g:  [ prompt (P) | response 0 (R) | response 1 (R) | ... | response n-1 (R) ]

and :class:`SharedPrefixMask` lets each response attend to the prompt and to its own earlier
tokens only. Position ids continue from the prompt in every response, so every token sees
exactly the keys, values and positions it sees in the unpacked layout: same math, to float
rounding (the prompt's gradient is now one sum over its ``n`` responses). The layers then run
on ``P + n*R`` instead of ``n*(P + R)`` tokens per group: 62.5% at ``P = R``, ``n = 4``.
(The same idea as "Prefix Grouper", Liu et al. 2025, for GRPO training.)

Attention in this layout never forms the ``[P + nR] x [P + nR]`` score matrix: the prompt
attends to itself (``P x P``) and each response to the prompt (``R x P``) and to itself
(``R x R``), with one softmax over the two key blocks. It is plain XLA on every backend: a
model's ``attention_impl: cudnn`` applies to its unpacked forwards and to generation only.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.models.attention import (
    LayerMasks,
    block_causal_attention,
    causal_blocks,
    positions_from_mask,
    softcap,
)


@flax.struct.dataclass
class SharedPrefixMask:
    """Attention mask of a packed batch (see the module docstring); True = may attend.

    Attributes:
      prefix: [G, P, P] prompt query t -> prompt key s (causal, real keys).
      cross: [G, n, R, P] query r of response i -> prompt key s (real keys).
      suffix: [G, n, R, R] query r of response i -> key r' of the same response (causal, real
        keys).
    """

    prefix: Bool[Array, "G P P"]
    cross: Bool[Array, "G n R P"]
    suffix: Bool[Array, "G n R R"]

    @property
    def prefix_len(self) -> int:
        return self.prefix.shape[-1]

    @property
    def group_size(self) -> int:
        return self.suffix.shape[1]

    @property
    def response_len(self) -> int:
        return self.suffix.shape[-1]


@flax.struct.dataclass
class PackedGroups:
    """A rollout packed one group per row.

    Attributes:
      tokens: [G, P + n*R] token ids.
      positions: [G, P + n*R] position ids (each response continues from its prompt).
      mask: the block attention mask of full-attention layers.
      response_mask: [G, n, R] True at real response tokens.
      sliding: the same mask windowed to ``sliding_window`` positions, for sliding layers
        (None without a window).
    """

    tokens: Int[Array, "G L"]
    positions: Int[Array, "G L"]
    mask: SharedPrefixMask
    response_mask: Bool[Array, "G n R"]
    sliding: SharedPrefixMask | None = None

    @property
    def token_mask(self) -> Bool[Array, "G L"]:
        """[G, P + n*R] True at real tokens: the prompt's (the prefix mask's diagonal) and
        the responses'."""
        prompt = jnp.diagonal(self.mask.prefix, axis1=1, axis2=2)
        return jnp.concatenate([prompt, self.response_mask.reshape(prompt.shape[0], -1)], axis=1)

    def layer_masks(self) -> SharedPrefixMask | LayerMasks:
        """The mask argument of the model: both masks when there is a window (the model
        picks per layer, ``ModelConfig.layer_types``), else the full one."""
        if self.sliding is None:
            return self.mask
        return LayerMasks(full=self.mask, sliding=self.sliding)


def pack_groups(
    tokens: Int[Array, "N T"],
    mask: Bool[Array, "N T"],
    prefix_len: int,
    group_size: int,
    sliding_window: int | None = None,
) -> PackedGroups:
    """Packs ``[G*n, P + R]`` rollout rows into ``[G, P + n*R]`` (module docstring).

    Args:
      tokens: [N, T] rows ``[prompt | response]``, groups of ``group_size`` consecutive rows
        with the same prompt (only each group's first row's prompt is read).
      mask: [N, T] True at real tokens: left-padded prompts, right-padded responses.
      prefix_len: P, the prompt slots (the first response slot's index).
      group_size: n, rows per group (must divide N).
      sliding_window: the model's attention window in positions, if any: the result then
        carries a windowed mask too, for the model's sliding layers.

    Returns:
      The packed batch; its outputs are read back with :func:`response_inputs` or
      :func:`last_token_inputs`.
    """
    rows, total = tokens.shape
    if rows % group_size:
        raise ValueError(f"{rows} rollout rows do not split into groups of {group_size}")
    if not 0 < prefix_len < total:
        raise ValueError(f"prefix length {prefix_len} must be in [1, {total})")
    g, n, p, r = rows // group_size, group_size, prefix_len, total - prefix_len
    mask = mask.astype(bool)
    positions = positions_from_mask(mask)

    def first_of_group(x):
        return x[:, :p].reshape(g, n, p)[:, 0]

    pre_tokens, pre_mask, pre_pos = (
        first_of_group(tokens),
        first_of_group(mask),
        first_of_group(positions),
    )
    resp_mask = mask[:, p:].reshape(g, n, r)
    resp_pos = positions[:, p:].reshape(g, n, r)
    prefix = jnp.tril(jnp.ones((p, p), bool))[None] & pre_mask[:, None, :]
    cross = jnp.broadcast_to(pre_mask[:, None, None, :], (g, n, r, p))
    suffix = jnp.tril(jnp.ones((r, r), bool))[None, None] & resp_mask[:, :, None, :]
    full = SharedPrefixMask(prefix=prefix, cross=cross, suffix=suffix)
    sliding = None
    if sliding_window is not None:
        # Real tokens are contiguous in the unpacked rows, so the window is in positions.
        sliding = SharedPrefixMask(
            prefix=prefix & (pre_pos[:, :, None] - pre_pos[:, None, :] < sliding_window),
            cross=cross & (resp_pos[..., None] - pre_pos[:, None, None, :] < sliding_window),
            suffix=suffix & (resp_pos[..., :, None] - resp_pos[..., None, :] < sliding_window),
        )
    return PackedGroups(
        tokens=jnp.concatenate([pre_tokens, tokens[:, p:].reshape(g, n * r)], axis=1),
        positions=jnp.concatenate([pre_pos, resp_pos.reshape(g, n * r)], axis=1),
        mask=full,
        response_mask=resp_mask,
        sliding=sliding,
    )


def response_inputs(hidden: Float[Array, "G L D"], mask: SharedPrefixMask) -> Float[Array, "N R D"]:
    """Per rollout row, the hidden states that predict its R response tokens.

    Response token ``r`` of row ``g*n + i`` is predicted by the prompt's last slot (``r = 0``)
    or by response token ``r - 1`` of the same response: the unpacked layout's positions
    ``P - 1 .. P + R - 2``. Built from slices (no gather), so the backward is slices too.
    """
    g, d = hidden.shape[0], hidden.shape[-1]
    p, n, r = mask.prefix_len, mask.group_size, mask.response_len
    last_prompt = jnp.broadcast_to(hidden[:, None, p - 1 : p], (g, n, 1, d))
    responses = hidden[:, p:].reshape(g, n, r, d)[:, :, : r - 1]
    return jnp.concatenate([last_prompt, responses], axis=2).reshape(g * n, r, d)


def last_token_inputs(hidden: Float[Array, "G L D"], packed: PackedGroups) -> Float[Array, "N 1 D"]:
    """Per rollout row, the hidden state at its last real token (the reward model's readout):
    the response's last token, or the prompt's last slot for an empty response."""
    g, d = hidden.shape[0], hidden.shape[-1]
    p, n, r = packed.mask.prefix_len, packed.mask.group_size, packed.mask.response_len
    lengths = packed.response_mask.sum(-1)  # [G, n]; responses are right-padded
    slot = jnp.where(lengths > 0, p + jnp.arange(n)[None, :] * r + lengths - 1, p - 1)
    picked = jnp.take_along_axis(hidden, slot[..., None], axis=1)  # [G, n, D]
    return picked.reshape(g * n, 1, d)


def shared_prefix_attention(
    q: Float[Array, "G L N H"],
    k: Float[Array, "G L K H"],
    v: Float[Array, "G L K H"],
    mask: SharedPrefixMask,
    *,
    scale: float,
    logit_cap: float | None = None,
) -> Float[Array, "G L N H"]:
    """Grouped-query softmax attention over a packed batch, softmax in float32.

    The prompt block is ordinary causal attention. A response's queries score the prompt's
    keys and their own response's keys as two matmuls and share one softmax over both. Both
    run in causal query blocks (:func:`~jaxrlhf.models.attention.causal_blocks`): a block of
    response queries scores its response's keys up to the block's end only. Fully masked
    (padding) queries get a finite, meaningless output, as in the unpacked attention.
    """
    g, _, num_heads, head_dim = q.shape
    num_kv = k.shape[2]
    groups = num_heads // num_kv
    p, n, r = mask.prefix_len, mask.group_size, mask.response_len
    out_prefix = block_causal_attention(q[:, :p], k[:, :p], v[:, :p], mask.prefix, scale, logit_cap)
    # [G, K, n, groups, R, H] queries; [G, K, P, H] prompt and [G, K, n, R, H] response keys.
    qs = q[:, p:].reshape(g, n, r, num_kv, groups, head_dim).transpose(0, 3, 1, 4, 2, 5)
    kp, vp = (x[:, :p].transpose(0, 2, 1, 3) for x in (k, v))
    ks, vs = (x[:, p:].reshape(g, n, r, num_kv, head_dim).transpose(0, 3, 1, 2, 4) for x in (k, v))
    blocks = [
        _response_block(
            qs[:, :, :, :, a:b],
            (kp, vp),
            (ks[:, :, :, :b], vs[:, :, :, :b]),
            mask.cross[:, :, a:b],
            mask.suffix[:, :, a:b, :b],
            scale,
            logit_cap,
        )
        for a, b in causal_blocks(r)
    ]
    out = blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=4)
    out_resp = out.transpose(0, 2, 4, 1, 3, 5).reshape(g, n * r, num_heads, head_dim)
    return jnp.concatenate([out_prefix, out_resp.astype(out_prefix.dtype)], axis=1)


def _response_block(qs, prompt_kv, response_kv, cross, suffix, scale, logit_cap):
    """Attention of response queries ``qs`` [G, K, n, groups, Rq, H] over the prompt's keys
    and values ([G, K, P, H]) and their own response's first ``Rk`` ([G, K, n, Rk, H]), with
    masks ``cross`` [G, n, Rq, P] and ``suffix`` [G, n, Rq, Rk]: [G, K, n, groups, Rq, H].

    One plain batched matmul per (group, kv head) against the prompt, per (group, kv head,
    response) against the response (the layout of ``attention.xla_attention``)."""
    (kp, vp), (ks, vs) = prompt_kv, response_kv
    g, num_kv, n, groups, rq, head_dim = qs.shape
    p, rk = kp.shape[2], ks.shape[3]
    f32 = jnp.float32
    floor = jnp.finfo(f32).min
    flat = qs.reshape(g, num_kv, n, groups * rq, head_dim)
    logits_p = jnp.einsum(
        "BKMH,BKSH->BKMS",
        flat.reshape(g, num_kv, n * groups * rq, head_dim),
        kp,
        preferred_element_type=f32,
    ).reshape(g, num_kv, n, groups, rq, p)
    logits_s = jnp.einsum("BKNMH,BKNSH->BKNMS", flat, ks, preferred_element_type=f32)
    logits_s = logits_s.reshape(g, num_kv, n, groups, rq, rk)
    logits_p, logits_s = softcap(logits_p * scale, logit_cap), softcap(logits_s * scale, logit_cap)
    logits_p = jnp.where(cross[:, None, :, None], logits_p, floor)
    logits_s = jnp.where(suffix[:, None, :, None], logits_s, floor)
    top = jax.lax.stop_gradient(jnp.maximum(logits_p.max(-1), logits_s.max(-1)))[..., None]
    exp_p, exp_s = jnp.exp(logits_p - top), jnp.exp(logits_s - top)
    denom = exp_p.sum(-1, keepdims=True) + exp_s.sum(-1, keepdims=True)  # [G, K, n, groups, Rq, 1]
    # Normalised after the values' matmuls, as in attention.xla_attention.
    exp_p = exp_p.astype(vp.dtype).reshape(g, num_kv, n * groups * rq, p)
    exp_s = exp_s.astype(vs.dtype).reshape(g, num_kv, n, groups * rq, rk)
    out = jnp.einsum("BKMS,BKSH->BKMH", exp_p, vp).reshape(g, num_kv, n, groups * rq, head_dim)
    out = out + jnp.einsum("BKNMS,BKNSH->BKNMH", exp_s, vs)
    out = out.reshape(g, num_kv, n, groups, rq, head_dim) / denom
    return out.astype(vs.dtype)


def flops_fraction(prefix_len: int, response_len: int, group_size: int) -> float:
    """Packed over unpacked tokens per group: the share of per-token layer work that remains."""
    packed = prefix_len + group_size * response_len
    return packed / (group_size * (prefix_len + response_len))


def prompts_match(
    tokens: np.ndarray, mask: np.ndarray, prefix_len: int, group_size: int
) -> np.ndarray:
    """Host check, per group: do all rows carry the same prompt (tokens and mask)? [G] bool."""
    rows = tokens.shape[0]
    g = rows // group_size
    tok = np.where(mask[:, :prefix_len], tokens[:, :prefix_len], -1).reshape(g, group_size, -1)
    return (tok == tok[:, :1]).all(axis=(1, 2))
