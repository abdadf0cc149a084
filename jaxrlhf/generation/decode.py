"""The model, run for generation: prompt prefill and one-token decode steps.

Prefill is the model itself (``jaxrlhf.models.transformer.Decoder`` with its own KV cache),
so prompt processing is the training forward pass; only the LM head is applied to each row's
last real token instead of every position.

Decode runs the same parameters through a loop over layers written for one new token per
row against the head-major cache of ``generation/cache.py``, with the weights split per
layer, q/k/v and gate/up fused and, on CPU, the kernels cut into contiguous column blocks,
once per call (``decode_weights``). It reuses the model's ``Norm`` module (and ``Mlp`` where
gate/up are not fused), its embedding, tied head and RoPE and the parameter names; only the
attention block and the matmuls are re-expressed, because the model's attention reads its
``[L, B, S, K, H]`` cache through a layer scan that copies and transposes the cache on every
step (see the cache module docstring).
Per-layer differences (sliding or full attention, Gemma 3's RoPE base per layer type) are
static here: the loop is Python, one traced block per layer. MoE layers run the model's own
``MoeMlp``. tests/generation/test_decode.py checks decode logits against
``models.model.forward`` for every family.

Attention of a decode query at position ``q`` sees a prompt slot that holds a real token at
position ``p <= q`` and every generated slot up to its own; with a sliding window ``W`` only
keys with ``q - p < W``. Positions, not slot indices, decide, so left and right padding both
work.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.generation.cache import DecodeCache
from jaxrlhf.kernels.block_matmul import block_matmul
from jaxrlhf.kernels.decode_attention import write_and_attend, write_slot
from jaxrlhf.models import axes
from jaxrlhf.models.attention import (
    distinct_rope_tables,
    layer_masks,
    positions_from_mask,
    rope_cos_sin,
    rotate,
    softcap,
)
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.model import init_cache, last_token_index
from jaxrlhf.models.transformer import ACTIVATIONS, Constrain, Decoder, Mlp, MoeMlp, Norm

Params = Any
_MASKED = jnp.finfo(jnp.float32).min  # finite, as in models/attention.py


def lm_head(
    cfg: ModelConfig, decoder: Decoder, kernel: jax.Array | None, hidden: Float[Array, "B D"]
) -> Float[Array, "B V"]:
    """The CausalLM head on final hidden states, float32: ``kernel`` [D, V] or its blocks
    [V / b, D, b] (:func:`decode_weights`; blocks of the embedding's transpose when tied),
    or, where ``kernel`` is None, the tied embedding itself."""
    if kernel is None:
        logits = decoder.attend(hidden)
    else:
        logits = blocked_matmul(hidden, kernel.astype(cfg.compute_dtype))
    return softcap(logits.astype(jnp.float32), cfg.final_logit_softcap)


def prefill(
    cfg: ModelConfig,
    constrain: Constrain,
    params: Params,
    tokens: Int[Array, "B P"],
    mask: Bool[Array, "B P"],
) -> tuple[Float[Array, "B V"], DecodeCache, Int[Array, "B P"]]:
    """Runs the prompts through the model once.

    Args:
      cfg, constrain: the model config and its activation constraint.
      params: LM params (``{"decoder": ..., "lm_head": ...}``).
      tokens: [B, P] prompt ids, any padding side.
      mask: [B, P] True at real tokens; every row needs at least one.

    Returns:
      ``(logits, cache, positions)``: next-token float32 logits [B, V] at each row's last
      real token; a DecodeCache holding the prompt prefix (its generated-token part is
      empty tuples, filled by the sampler); the prompt position ids [B, P].
    """
    batch, length = tokens.shape
    positions = positions_from_mask(mask)
    decoder = Decoder(cfg, constrain).bind({"params": params["decoder"]})
    attn_mask = layer_masks(cfg, mask, length)
    model_cache = init_cache(cfg, batch, length)
    hidden, model_cache = decoder(tokens, positions, attn_mask, model_cache, jnp.asarray(0))
    last = jnp.take_along_axis(hidden, last_token_index(mask)[:, None, None], axis=1)[:, 0]
    logits = lm_head(cfg, decoder, params.get("lm_head"), last)
    layers = range(cfg.num_layers)
    # [L, B, P, K, H] -> per layer [B, K, H, P] and [B, K, P, H], once per prefill.
    cache = DecodeCache(
        prefix_k=tuple(model_cache.k[i].transpose(0, 2, 3, 1) for i in layers),
        prefix_v=tuple(model_cache.v[i].transpose(0, 2, 1, 3) for i in layers),
        k=(),
        v=(),
    )
    return logits, cache, positions


def decode_weights(
    params: Params,
    num_layers: int,
    shards: int | None | dict[str, int | None] = 1,
    block: int = 0,
) -> tuple[list[Params], jax.Array | None]:
    """The weights as the decode loop reads them: one tree per layer, q/k/v and gate/up fused.

    Called once per decode call, before the token loop. Three things happen:

    * The stacked ``[L, ...]`` layer params are split into one tree per layer, so the loop
      reads each layer's weights in place (a layer scan inside the loop would dynamic-slice,
      and on CPU copy, every layer's weights on every step).
    * With ``shards`` set, the q/k/v kernels become one ``qkv_kernel`` and gate/up one
      ``gate_up_kernel`` (biases alike), so each layer runs two wide matmuls where it ran five
      narrow ones (measurably faster decode; benchmarks/RESULTS.md). ``shards`` is the number of
      devices the heads and MLP axes are split over in the generation layout; the kernels are
      interleaved per shard (``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``) so that every device's slice of
      the fused kernel is its own heads' q, k and v and the split after the matmul needs no
      communication. ``None`` keeps the kernels apart (a layout where the axes are split unevenly)
      and makes no blocks. A dict (:func:`fused_shards`) gives the count per matmul: ``"attn"``
      (q/k/v), ``"mlp"`` (gate/up), ``"o"``, ``"down"``, ``"head"`` (their output axes); a missing
      or None entry leaves that matmul unfused and unblocked. An int ``n`` means ``{"attn": n,
      "mlp": n, "head": n, "o": 1, "down": 1}``: the generation layout splits heads, MLP units and
      the vocab alike and never the hidden axis that o and down produce.
    * With ``block`` > 0 (the sampler's default on CPU devices of at most two cores,
      ``sampler.default_matmul_block``), the matmul kernels (fused q/k/v and gate/up, o, down
      next to a fused gate/up, the LM head) become column blocks ``[N / b, in, b]``
      (:func:`_blocks`) that :func:`blocked_matmul` multiplies (the CPU block-matmul kernel,
      or XLA's batched matmul). A decode step multiplies a few rows by every weight, which on
      CPU streams the weights from memory; contiguous blocks stream faster than the rows of
      an ``[in, out]`` kernel (the G1 figures are in benchmarks/RESULTS.md).

    Unblocked kernels keep the model's ``[in, out]`` layout (``[D, N, H]`` for ``q_kernel``,
    ``[F, D]`` for ``down_kernel``, ``[D, V]`` for ``lm_head``; ``o_kernel`` flattened to
    ``[N*H, D]``), which XLA:CPU's matmuls of a few rows ran faster than a transposed
    (contracted dims last) layout (benchmarks/RESULTS.md).

    Returns:
      ``(layers, lm_head)``: per-layer param trees (fused kernels ``[D, shards, rows]`` or
      blocks ``[shards, rows / b, D, b]``; ``o_kernel`` ``[N*H, D]`` or blocks
      ``[D / b, N*H, b]``; ``down_kernel`` ``[F, D]`` or ``[D / b, F, b]``), and the LM head
      ``[D, V]`` or blocks ``[V / b, D, b]`` (None: the tied embedding, used as it is).
    """
    stacked = params["decoder"]["layers"]
    layers = [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(num_layers)]
    if isinstance(shards, dict):
        by_block = shards
    elif shards is None:
        by_block = dict.fromkeys(SHARD_KEYS, None)
    else:
        by_block = {"attn": shards, "mlp": shards, "head": shards, "o": 1, "down": 1}
    layers = [_to_blocks(_fuse(layer, by_block), by_block, block) for layer in layers]
    head = params.get("lm_head")
    if head is not None:
        head = _blocks(head, by_block.get("head"), block)
    elif block:  # tied: blocks of the embedding's transpose, where they exist
        blocks = _blocks(params["decoder"]["embed"]["embedding"].T, by_block.get("head"), block)
        head = blocks if blocks.ndim == 3 else None
    # The barrier makes the per-layer slices and fused kernels arrays of their own, built
    # once before the token loop, whatever XLA would otherwise fold into the loop's operands.
    # (XLA:CPU removes barriers before fusion; there the token loop's boundary does it.)
    return jax.lax.optimization_barrier((layers, head))


_FUSED = {"attn": ("qkv", ("q", "k", "v")), "mlp": ("gate_up", ("gate", "up"))}
SHARD_KEYS = ("attn", "mlp", "o", "down", "head")


def _fuse(layer: Params, shards: dict[str, int | None]) -> Params:
    """One layer with q/k/v and gate/up kernels (and biases) interleaved per shard into
    ``qkv_*`` / ``gate_up_*``: kernels ``[D, shards, rows]`` (a ``[D, N, H]`` kernel gives
    each shard ``N*H / shards`` rows), biases ``[shards, rows]``. A block whose
    ``shards`` entry is None keeps its kernels apart."""
    layer = dict(layer)
    for block, (fused, names) in _FUSED.items():
        if block not in layer:  # an MoE layer has experts, not "mlp"
            continue
        p = dict(layer[block])
        if shards.get(block) is None or f"{names[0]}_kernel" not in p:  # (ungated MLP)
            continue
        count = shards[block]
        for suffix in ("kernel", "bias"):
            if f"{names[0]}_{suffix}" not in p:
                continue
            parts = [p.pop(f"{name}_{suffix}") for name in names]
            if suffix == "kernel":  # [D, ...] -> [D, shards, rows]
                rows = [x.reshape(x.shape[0], count, -1) for x in parts]
                p[f"{fused}_{suffix}"] = jnp.concatenate(rows, axis=2)
            else:  # [...] -> [shards, rows]
                rows = [x.reshape(count, -1) for x in parts]
                p[f"{fused}_{suffix}"] = jnp.concatenate(rows, axis=1)
        layer[block] = p
    return layer


# Output columns per weight block of the decode matmuls on CPU (see decode_weights).
CPU_MATMUL_BLOCK = 64


def _blocks(
    kernel: jax.Array, shards: int | None, block: int, keep_shards: bool = False
) -> jax.Array:
    """A kernel ``[K, N]`` (or fused ``[K, S, M]``) as column blocks ``[N / b, K, b]``: block
    ``j`` holds columns ``j*b .. j*b + b - 1``, b = ``block`` or half of it (0: no blocks).

    ``shards`` is the number of devices the N columns are split over (S for a fused
    kernel); blocks never straddle two of them, and the kernel is returned unchanged if its
    ``N / shards`` columns per device do not split into blocks (or ``shards`` is None or
    does not divide N: an uneven split). ``keep_shards`` returns a fused kernel's blocks as
    ``[S, M / b, K, b]``.
    """
    n = int(np.prod(kernel.shape[1:]))
    if not block or shards is None or n % shards:
        return kernel
    k = kernel.shape[0]
    per_shard = kernel.reshape(k, shards, -1)
    for b in (block, block // 2):
        if b and per_shard.shape[2] % b == 0:
            blocks = per_shard.reshape(k, shards, -1, b).transpose(1, 2, 0, 3)
            return blocks if keep_shards else blocks.reshape(-1, k, b)
    return kernel


def blocked_matmul(x: Float[Array, "R K"], kernel: jax.Array) -> Float[Array, "R N"]:
    """``x @ w`` for ``kernel`` = ``w`` ``[K, N]`` or its column blocks ``[N / b, K, b]``.

    The blocked form is :func:`jaxrlhf.kernels.block_matmul.block_matmul`: on CPU a C++
    kernel that streams each contiguous block once with the rows' sums in registers (where
    it cannot be built, and elsewhere, XLA's batched matmul over the blocks). With a few
    rows, as in decode, the weights come from memory on every step and this decides the
    speed (benchmarks/RESULTS.md).
    """
    if kernel.ndim == 2:
        return jnp.dot(x, kernel)
    return block_matmul(x, kernel).reshape(x.shape[0], -1)


def _to_blocks(layer: Params, shards: dict[str, int | None], block: int) -> Params:
    """One layer (after :func:`_fuse`) with its fused kernels (``[S, M / b, D, b]``),
    ``o_kernel`` and, next to a fused gate/up, ``down_kernel`` as :func:`_blocks`."""
    layer = {**layer, "attn": dict(layer["attn"]), "mlp": dict(layer.get("mlp", {}))}
    attn, mlp = layer["attn"], layer["mlp"]
    if "moe" in layer:
        del layer["mlp"]
    for p, fused, name in ((attn, "qkv", "attn"), (mlp, "gate_up", "mlp")):
        if f"{fused}_kernel" in p:
            kernel = p[f"{fused}_kernel"]
            p[f"{fused}_kernel"] = _blocks(kernel, shards[name], block, keep_shards=True)
    o = attn["o_kernel"]  # [N, H, D] -> [N*H, D]
    attn["o_kernel"] = _blocks(o.reshape(-1, o.shape[-1]), shards.get("o"), block)
    if "gate_up_kernel" in mlp:
        mlp["down_kernel"] = _blocks(mlp["down_kernel"], shards.get("down"), block)
    return layer


def _fused_matmul(
    cfg: ModelConfig, p: Params, x: Float[Array, "R D"], fused: str, widths: tuple[int, ...]
) -> list[jax.Array]:
    """``x`` times a kernel of :func:`_fuse`, split back into one ``[R, width]`` output per
    original kernel (``widths`` their output sizes, in fusion order)."""
    kernel = p[f"{fused}_kernel"].astype(cfg.compute_dtype)  # [D, S, M] or [S, M/b, D, b]
    if kernel.ndim == 4:
        shards = kernel.shape[0]
        out = blocked_matmul(x, kernel.reshape(-1, *kernel.shape[2:]))
    else:
        shards = kernel.shape[1]
        # One 2-D matmul: the same product as einsum "RD,DSM->RSM", which XLA:CPU ran
        # slower.
        out = jnp.dot(x, kernel.reshape(kernel.shape[0], -1))
    out = out.reshape(x.shape[0], shards, -1)
    if f"{fused}_bias" in p:
        out = out + p[f"{fused}_bias"].astype(cfg.compute_dtype)
    bounds = np.cumsum([w // shards for w in widths])[:-1].tolist()
    return [y.reshape(x.shape[0], -1) for y in jnp.split(out, bounds, axis=-1)]


def fused_shards(cfg: ModelConfig, shardings: Params | None) -> dict[str, int | None]:
    """The ``shards`` argument of :func:`decode_weights` for params laid out by ``shardings``
    (the sampler's param shardings; None = one device): into how many pieces each decode
    matmul's output axis is split (``"attn"``: q/k/v, ``"mlp"``: gate/up, ``"o"``, ``"down"``,
    ``"head"``: the LM head or tied embedding), or None where the kernels of a block are not
    split alike (e.g. kv heads replicated while query heads are split)."""
    if shardings is None:
        return dict.fromkeys(SHARD_KEYS, 1)
    layers = shardings["decoder"]["layers"]
    d, h, f, layers_n = cfg.hidden_size, cfg.dim_per_head, cfg.intermediate_size, cfg.num_layers
    shapes = {
        "attn": {
            "q_kernel": (layers_n, d, cfg.num_heads, h),
            "k_kernel": (layers_n, d, cfg.kv_heads, h),
            "v_kernel": (layers_n, d, cfg.kv_heads, h),
        },
        "mlp": {"up_kernel": (layers_n, d, f)},
    }
    if cfg.gated_mlp:
        shapes["mlp"]["gate_kernel"] = (layers_n, d, f)
    if cfg.num_experts:  # experts are not fused or blocked
        del shapes["mlp"]

    def output_split(sharding: Any, shape: tuple[int, ...], axis: int) -> int:
        return shape[axis] // sharding.shard_shape(shape)[axis]

    out: dict[str, int | None] = {}
    for block, kernels in shapes.items():
        counts = set()
        for name, shape in kernels.items():
            sharding = layers[block][name]
            if len(shape) == 4 and sharding.shard_shape(shape)[3] != shape[3]:
                counts.add(None)  # split inside a head: per-head interleaving cannot line up
            else:
                counts.add(output_split(sharding, shape, axis=2))  # heads / MLP units
        out[block] = counts.pop() if len(counts) == 1 else None
    out["o"] = output_split(layers["attn"]["o_kernel"], (layers_n, cfg.num_heads, h, d), axis=3)
    out["mlp"] = out.get("mlp")
    out["down"] = None
    if not cfg.num_experts:
        out["down"] = output_split(layers["mlp"]["down_kernel"], (layers_n, f, d), axis=2)
    if cfg.tie_embeddings:
        embedding = shardings["decoder"]["embed"]["embedding"]
        out["head"] = output_split(embedding, (cfg.vocab_size, d), axis=0)
    else:
        out["head"] = output_split(shardings["lm_head"], (d, cfg.vocab_size), axis=1)
    return out


def _project(
    cfg: ModelConfig, p: Params, x: Float[Array, "R 1 D"], name: str
) -> Float[Array, "R 1 N H"]:
    """q/k/v projection with the model's kernel ``[D, N, H]`` (unfused, see decode_weights)."""
    kernel = p[f"{name}_kernel"].astype(cfg.compute_dtype)
    d, heads, h = kernel.shape
    out = jnp.dot(x[:, 0], kernel.reshape(d, heads * h))
    out = out.reshape(x.shape[0], 1, heads, h)
    if cfg.qkv_bias:
        out = out + p[f"{name}_bias"].astype(cfg.compute_dtype)
    return out


RopeTables = tuple[Float[Array, "K W R2"], Float[Array, "K W R2"]] | None


def rope_tables(cfg: ModelConfig, width: int) -> RopeTables:
    """float32 cos and sin ``[K, W, R/2]`` of positions ``0 .. W - 1`` under each of the
    model's K distinct frequency tables (``models.attention.distinct_rope_tables``: Gemma 3's
    sliding and full layers have two), as the model's ``rope_angles``; None without RoPE.

    Made before the token loop; each step gathers its rows' positions from them
    (:func:`decode_step`). Computed inside the step instead, XLA:CPU fuses the cos and sin
    into every layer's and head's consumer and evaluates them again for every element
    (an ``optimization_barrier`` does not stop it: XLA:CPU removes barriers before fusion),
    about 4% of a bench-M decode step. ``width`` must exceed every position the loop
    decodes (the cache's prompt plus generated slots)."""
    if cfg.position_embedding != "rope":
        return None
    tables, _ = distinct_rope_tables(cfg)
    return rope_cos_sin(jnp.arange(width)[None], tables[:, None])


def _layer_ropes(
    cfg: ModelConfig, positions: Int[Array, " R"], tables: RopeTables
) -> list[tuple[jax.Array, jax.Array] | None]:
    """Each layer's cos and sin ``[rows, 1, 1, R/2]`` of the rows' positions, gathered from
    :func:`rope_tables` once. ``clip``: a finished engine slot whose prompt and budget
    filled its region sits one past the last position; its step's logits and cache write
    are discarded, and clipping keeps them finite."""
    if tables is None:
        return [None] * cfg.num_layers

    def rows(table: jax.Array) -> jax.Array:  # [K, W, R/2] -> [K, rows, 1, 1, R/2]
        picked = jnp.take(table, positions, axis=1, mode="clip")
        return picked[:, :, None, None, :].astype(cfg.compute_dtype)

    cos, sin = rows(tables[0]), rows(tables[1])
    return [(cos[k], sin[k]) for k in distinct_rope_tables(cfg)[1]]


def _group(x: jax.Array, groups: int, n: int) -> jax.Array:
    """[B*n, K, G, X] sample rows -> [B, K, n*G, X]: a group's rows side by side per head."""
    rows, k, g, last = x.shape
    return x.reshape(groups, n, k, g, last).transpose(0, 2, 1, 3, 4).reshape(groups, k, n * g, last)


def _ungroup(x: jax.Array, n: int) -> jax.Array:
    """Inverse of :func:`_group`."""
    groups, k, ng, last = x.shape
    g = ng // n
    return x.reshape(groups, k, n, g, last).transpose(0, 2, 1, 3, 4).reshape(groups * n, k, g, last)


def _attend_shared(q, layer, prefix_ok, generated_ok, scale, cap):
    """Attention over a shared prompt prefix plus per-sample generated slots (n > 1)."""
    prefix_k, prefix_v, gen_k, gen_v = layer
    rows, groups = q.shape[0], prefix_k.shape[0]
    n = rows // groups
    dtype = q.dtype
    scores_prefix = jnp.einsum(
        "BKMH,BKHP->BKMP",
        _group(q, groups, n),
        prefix_k.astype(dtype),
        preferred_element_type=jnp.float32,
    )  # [B, K, n*G, P]: the n samples of a group as n*G query rows of one matmul
    scores_prefix = jnp.where(prefix_ok, softcap(scores_prefix * scale, cap), _MASKED)
    scores_gen = jnp.einsum(
        "RKGH,RKHT->RKGT", q, gen_k.astype(dtype), preferred_element_type=jnp.float32
    )
    scores_gen = jnp.where(generated_ok, softcap(scores_gen * scale, cap), _MASKED)
    scores = jnp.concatenate([_ungroup(scores_prefix, n), scores_gen], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    prompt_len = prefix_k.shape[-1]
    out_prefix = jnp.einsum(
        "BKMP,BKPH->BKMH", _group(probs[..., :prompt_len], groups, n), prefix_v.astype(dtype)
    )
    out_gen = jnp.einsum("RKGT,RKTH->RKGH", probs[..., prompt_len:], gen_v.astype(dtype))
    return _ungroup(out_prefix, n) + out_gen


def _attend_joint(q, layer, ok, scale, cap):
    """Attention over one per-row cache holding prompt and generated slots (n = 1) with
    soft-capped scores, in XLA (without a cap, :func:`_attention` writes and attends by
    :func:`~jaxrlhf.kernels.decode_attention.write_and_attend`: on CPU, for float32 and a
    head size that is a multiple of 16, a kernel that reads each row's cache only where it
    attends)."""
    _, _, k, v = layer
    scores = jnp.einsum("RKGH,RKHS->RKGS", q, k.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = jnp.where(ok, softcap(scores * scale, cap), _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("RKGS,RKSH->RKGH", probs, v.astype(q.dtype))


def _attention(
    cfg: ModelConfig,
    constrain: Constrain,
    p: Params,
    x: Float[Array, "R 1 D"],
    rope: tuple[jax.Array, jax.Array] | None,
    layer: tuple[jax.Array | None, jax.Array | None, jax.Array, jax.Array],
    slot: Int[Array, ""] | Int[Array, " R"],
    masks: tuple[jax.Array, ...],
) -> tuple[Float[Array, "R 1 D"], jax.Array, jax.Array]:
    prefix_k, prefix_v, gen_k, gen_v = layer
    rows = x.shape[0]
    n_heads, kv, h = cfg.num_heads, cfg.kv_heads, cfg.dim_per_head
    names = (axes.BATCH, axes.LENGTH, axes.ACT_HEADS, None)
    if "qkv_kernel" in p:
        widths = (n_heads * h, kv * h, kv * h)
        q, k, v = _fused_matmul(cfg, p, x[:, 0], "qkv", widths)
        q, k, v = (y.reshape(rows, 1, -1, h) for y in (q, k, v))
    else:
        q, k, v = (_project(cfg, p, x, name) for name in ("q", "k", "v"))
    q, k, v = (constrain(y, names) for y in (q, k, v))
    if cfg.qk_norm:
        norm = Norm(cfg)
        q = norm.apply({"params": p["q_norm"]}, q)
        k = norm.apply({"params": p["k_norm"]}, k)
    if rope is not None:
        q, k = rotate(q, *rope), rotate(k, *rope)
    q = q.reshape(rows, kv, n_heads // kv, h)  # [R, K, G, H]; query head n reads kv head n // G
    scale, cap = cfg.attn_scale, cfg.attn_logit_softcap
    if prefix_k is None and cap is None:
        # One region per row: write this token's key/value into each row's slot (in place:
        # the cache is the loop carry) and attend, in one kernel on CPU.
        out, gen_k, gen_v = write_and_attend(
            q, gen_k, gen_v, masks[0][:, 0, 0, :], k[:, 0], v[:, 0], slot, scale,
        )  # fmt: skip
        return _out_projection(cfg, p, out), gen_k, gen_v
    # Soft-capped scores or the shared-prompt cache: XLA writes (in place: the cache is the
    # loop carry) and attends.
    gen_k, gen_v = write_slot(gen_k, gen_v, k[:, 0], v[:, 0], slot)
    layer = (prefix_k, prefix_v, gen_k, gen_v)
    if prefix_k is None:
        out = _attend_joint(q, layer, *masks, scale=scale, cap=cap)
    else:
        out = _attend_shared(q, layer, *masks, scale=scale, cap=cap)
    return _out_projection(cfg, p, out), gen_k, gen_v


def _out_projection(cfg: ModelConfig, p: Params, out: Float[Array, "R K G H"]) -> jax.Array:
    """The attention's output projection: [R, K, G, H] heads -> [R, 1, D]."""
    rows = out.shape[0]
    o_kernel = p["o_kernel"].astype(cfg.compute_dtype)  # [N*H, D] or its blocks
    out = blocked_matmul(out.reshape(rows, -1), o_kernel)[:, None, :]
    if cfg.out_bias:
        out = out + p["o_bias"].astype(cfg.compute_dtype)
    return out


def _fused_mlp(
    cfg: ModelConfig, constrain: Constrain, p: Params, x: Float[Array, "R 1 D"]
) -> Float[Array, "R 1 D"]:
    """The model's gated ``Mlp`` with gate and up as one :func:`_fuse` kernel."""
    f = cfg.intermediate_size
    gate, up = _fused_matmul(cfg, p, x[:, 0], "gate_up", (f, f))
    hidden = constrain(ACTIVATIONS[cfg.activation](gate) * up, (axes.BATCH, axes.ACT_MLP))
    out = blocked_matmul(hidden, p["down_kernel"].astype(cfg.compute_dtype))
    if cfg.mlp_bias:
        out = out + p["down_bias"].astype(cfg.compute_dtype)
    return out[:, None, :]


def _step_masks(
    cfg: ModelConfig,
    cache: DecodeCache,
    step: Int[Array, ""] | Int[Array, " R"],
    positions: Int[Array, " R"],
    prefix_mask: Bool[Array, "B P"],
    prefix_positions: Int[Array, "B P"],
) -> tuple[dict[bool, tuple[jax.Array, ...]], Int[Array, ""]]:
    """The attention masks of one decode step, ``{sliding: masks}`` for the layer kinds the
    model has (windowed for sliding layers), and the slot this step writes.

    Generated slot j holds this row's token j; prompt slots hold real tokens where
    prefix_mask is True. ``step`` is one index for every row ([]), or each row's own ([R], the
    engine's slots; joint cache only). A row whose step is past the generated slots (an
    engine slot that does not decode this step: its write is dropped, and so is its output)
    attends to nothing, so the CPU attention kernel reads none of its cache.
    """
    rows, groups = positions.shape[0], prefix_mask.shape[0]
    n = rows // groups
    num_gen = cache.k[0].shape[-1] - (0 if cache.shared_prefix else prefix_mask.shape[1])
    gen_slots = jnp.arange(num_gen)
    if step.ndim == 1:
        if cache.shared_prefix:
            raise ValueError("per-row decode steps need the joint cache (one region per row)")
        step = step[:, None]  # [R, 1] against [T] slots
    out = {}
    for sliding in set(cfg.sliding_layers):
        prefix_ok = prefix_mask
        generated_ok = gen_slots <= step
        if sliding:
            q_pos = positions.reshape(groups, n)[:, :1]  # the samples of a group share positions
            prefix_ok &= q_pos - prefix_positions < cfg.sliding_window
            generated_ok &= step - gen_slots < cfg.sliding_window
        if cache.shared_prefix:  # [B, 1, 1, P] and [T]
            out[sliding] = (prefix_ok[:, None, None, :], generated_ok)
        else:  # one [R, 1, 1, P + T] mask over the joint cache
            ok = jnp.concatenate([prefix_ok, jnp.broadcast_to(generated_ok, (rows, num_gen))], 1)
            if step.ndim == 2:
                ok &= step < num_gen
            out[sliding] = (ok[:, None, None, :],)
    if step.ndim == 2:
        step = step[:, 0]
    slot = step if cache.shared_prefix else prefix_mask.shape[1] + step
    return out, slot


def decode_step(
    cfg: ModelConfig,
    constrain: Constrain,
    params: Params,
    weights: tuple[list[Params], jax.Array | None],
    ropes: RopeTables,
    tokens: Int[Array, " R"],
    positions: Int[Array, " R"],
    cache: DecodeCache,
    step: Int[Array, ""] | Int[Array, " R"],
    prefix_mask: Bool[Array, "B P"],
    prefix_positions: Int[Array, "B P"],
) -> tuple[Float[Array, "R V"], DecodeCache]:
    """Forward of one new token per row, written into generated slot ``step``.

    Args:
      cfg, constrain: model config and activation constraint.
      params: LM params; ``weights`` is ``decode_weights(params, L)``.
      ropes: :func:`rope_tables` over at least every position decoded, made before the loop.
      tokens: [R] the new token of each sample row (R = B * n, prompt-major).
      positions: [R] its position id.
      cache: the cache; generated slots ``> step`` may hold anything (they are masked).
      step: index of the new token among the generated ones: [] for every row, or [R] each
        row's own (the engine's slots; joint cache only).
      prefix_mask: [B] x [P] real prompt tokens; prefix_positions: their position ids.

    Returns:
      ``(logits [R, V] float32, cache with slot step written)``.
    """
    decoder = Decoder(cfg, constrain).bind({"params": params["decoder"]})
    residual = (axes.BATCH, axes.LENGTH, axes.ACT_EMBED)
    x = decoder.embed(tokens[:, None])
    if cfg.scale_embeddings:
        x = x * jnp.asarray(cfg.hidden_size**0.5, dtype=cfg.compute_dtype)
    if cfg.position_embedding == "learned":
        x = x + decoder.pos_embed(positions[:, None])
    x = constrain(x, residual)

    masks, slot = _step_masks(cfg, cache, step, positions, prefix_mask, prefix_positions)
    ropes = _layer_ropes(cfg, positions, ropes)
    norm = Norm(cfg)
    layers, head = weights
    new_k, new_v = [], []
    for i, p in enumerate(layers):
        if cache.shared_prefix:
            layer_cache = (cache.prefix_k[i], cache.prefix_v[i], cache.k[i], cache.v[i])
        else:
            layer_cache = (None, None, cache.k[i], cache.v[i])
        h = norm.apply({"params": p["attn_norm"]}, x)
        layer_masks_i = masks[cfg.sliding_layers[i]]
        attn_out, k, v = _attention(
            cfg, constrain, p["attn"], h, ropes[i], layer_cache, slot, layer_masks_i
        )
        if cfg.post_norms:
            attn_out = norm.apply({"params": p["post_attn_norm"]}, attn_out)
        x = constrain(x + attn_out, residual)
        h = norm.apply({"params": p["mlp_norm"]}, x)
        if "moe" in p:
            mlp_out = MoeMlp(cfg, constrain).apply({"params": p["moe"]}, h)
        elif "gate_up_kernel" in p["mlp"]:
            mlp_out = _fused_mlp(cfg, constrain, p["mlp"], h)
        else:
            mlp_out = Mlp(cfg, constrain).apply({"params": p["mlp"]}, h)
        if cfg.post_norms:
            mlp_out = norm.apply({"params": p["post_mlp_norm"]}, mlp_out)
        x = constrain(x + mlp_out, residual)
        new_k.append(k)
        new_v.append(v)
    hidden = decoder.final_norm(x)[:, 0]
    logits = lm_head(cfg, decoder, head, hidden)
    logits = constrain(logits, (axes.BATCH, axes.ACT_VOCAB))
    return logits, cache.replace(k=tuple(new_k), v=tuple(new_v))
