"""Functional entry points: build a model, get its abstract params and logical specs,
initialise it directly sharded, and run it as a pure function of ``params``.

Linen keeps parameters outside the module, so every jitted step is ``apply(params, ...)``.
Parameters here are always *unboxed* (plain arrays); their logical axis names live in a
parallel tree from :func:`logical_specs`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.models import moe
from jaxrlhf.models.attention import causal_mask, layer_masks, positions_from_mask
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.ilql import ILQLModel
from jaxrlhf.models.lora import LoraParams, LoraSpec, split_params
from jaxrlhf.models.packing import PackedSequences
from jaxrlhf.models.shared_prefix import PackedGroups
from jaxrlhf.models.transformer import HEADS, Constrain, KVCache, no_constraint

# Every model the trainers build, by head: the transformer's and ILQL's (LM + value + Q heads).
MODELS: dict[str, Any] = {**HEADS, "ilql": ILQLModel}

# A nested dict of arrays ({"decoder": ..., "lm_head" | "score": ...}), or for a LoRA model a
# models.lora.LoraParams (frozen base and trainable adapters).
Params = Any


def build(
    cfg: ModelConfig,
    head: str = "lm",
    constrain: Constrain = no_constraint,
    lora: LoraSpec | None = None,
) -> nn.Module:
    """The Linen module for ``head`` in {"lm", "scalar", "ilql"}, with LoRA adapters when
    ``lora``."""
    if head not in MODELS:
        raise ValueError(f"model head {head!r} is not one of {sorted(MODELS)}")
    return MODELS[head](cfg, constrain, lora)


def _init_fn(module: nn.Module, key: jax.Array) -> Any:
    tokens = jnp.zeros((1, 1), jnp.int32)
    mask = jnp.ones((1, 1), bool)
    return module.init(key, tokens, jnp.zeros((1, 1), jnp.int32), causal_mask(mask, 1))["params"]


def logical_specs(cfg: ModelConfig, head: str = "lm", lora: LoraSpec | None = None) -> Any:
    """Tree of PartitionSpecs of logical axis names, matching the param tree (adapters
    included with ``lora``)."""
    boxed = jax.eval_shape(
        functools.partial(_init_fn, build(cfg, head, lora=lora)), jax.random.key(0)
    )
    return nn.get_partition_spec(boxed)


def abstract_params(cfg: ModelConfig, head: str = "lm", lora: LoraSpec | None = None) -> Any:
    """Tree of ``jax.ShapeDtypeStruct`` for the (unboxed) params; no device memory used.
    With ``lora`` the tree holds the adapters too (split it with ``lora.split_params``)."""
    return nn.unbox(
        jax.eval_shape(functools.partial(_init_fn, build(cfg, head, lora=lora)), jax.random.key(0))
    )


def init_params(
    cfg: ModelConfig, key: jax.Array, head: str = "lm", shardings: Any | None = None
) -> Params:
    """Random params, created directly in ``shardings`` (a NamedSharding tree) when given.

    Initialisation is one jitted function with ``out_shardings``, so each device only ever
    materialises its own shards; no full replicated copy exists at any point.
    """
    module = build(cfg, head)
    init = jax.jit(lambda k: nn.unbox(_init_fn(module, k)), out_shardings=shardings)
    return init(key)


def init_adapters(
    cfg: ModelConfig, lora: LoraSpec, key: jax.Array, shardings: Any | None = None
) -> Any:
    """Fresh LoRA adapters (``A`` uniform, ``B`` zero; no ``score`` head), created directly in
    ``shardings`` when given (only the adapters are computed)."""
    module = build(cfg, "lm", lora=lora)

    def init(k: jax.Array) -> Any:
        _, trainable = split_params(nn.unbox(_init_fn(module, k)))
        return trainable

    return jax.jit(init, out_shardings=shardings)(key)


def _apply(module: nn.Module, params: Params, token_mask: jax.Array, *args, **kwargs) -> Any:
    """``module.apply`` returning the model output; inside
    :func:`jaxrlhf.models.moe.capture_router_logits`, an MoE model's router logits are
    collected too (``token_mask`` [B, T]: the real tokens of the rows that ran). A
    :class:`~jaxrlhf.models.lora.LoraParams` is applied as its combined tree, with its
    dropout key (if any) as the ``dropout`` rng."""
    if isinstance(params, LoraParams):
        if params.dropout_key is not None:
            kwargs["rngs"] = {"dropout": params.dropout_key}
        params = params.tree()
    sink = moe.router_sink()
    if sink is None or not module.cfg.num_experts:
        out, _ = module.apply({"params": params}, *args, **kwargs)
        return out
    (out, _), state = module.apply({"params": params}, *args, mutable=["intermediates"], **kwargs)
    (logits,) = state["intermediates"]["decoder"]["layers"]["moe"]["router_logits"]
    sink.append(moe.RouterLogits(logits=logits, token_mask=token_mask.astype(bool)))
    return out


def forward(
    module: nn.Module,
    params: Params,
    tokens: Int[Array, "B T"],
    mask: Bool[Array, "B T"],
    positions: Int[Array, "B T"] | None = None,
    *,
    head_from: int = 0,
) -> Float[Array, "B T ..."]:
    """Full-sequence forward with per-row padding.

    Args:
      module: from :func:`build`.
      params: unboxed params.
      tokens: [B, T] token ids; padding may be on either side.
      mask: [B, T] True at real tokens. Outputs at padding positions are finite but
        meaningless.
      positions: [B, T] position ids; default counts real tokens from 0 in each row.
      head_from: outputs for positions ``head_from:`` only (the whole sequence still runs
        through the layers); skips the head's work where only the tail is read.

    Returns:
      [B, T, V] float32 logits for an LM, [B, T] float32 values for a scalar head (``T -
      head_from`` positions).
    """
    if positions is None:
        positions = positions_from_mask(mask)
    attn_mask = layer_masks(module.cfg, mask, tokens.shape[1])
    return _apply(module, params, mask, tokens, positions, attn_mask, head_from=head_from)


def forward_packed(
    module: nn.Module,
    params: Params,
    packed: PackedGroups | PackedSequences,
    select: Callable[[Float[Array, "G L D"]], Float[Array, "N M D"]],
) -> Float[Array, "N M ..."]:
    """Forward of a packed rollout: prompt groups one per row (models/shared_prefix.py) or
    sequences packed by their real lengths (models/packing.py).

    Args:
      module, params: as for :func:`forward`.
      packed: from :func:`jaxrlhf.models.shared_prefix.pack_groups` or
        :func:`jaxrlhf.models.packing.pack`.
      select: picks, from the ``[G, L, D]`` final hidden states of the packed rows, the
        ``[N, M, D]`` positions the head runs on (e.g.
        :func:`~jaxrlhf.models.shared_prefix.response_inputs`,
        :func:`~jaxrlhf.models.packing.response_inputs`).

    Returns:
      [N, M, V] float32 logits for an LM, [N, M] float32 values for a scalar head.
    """
    masks = packed.layer_masks()
    return _apply(
        module, params, packed.token_mask, packed.tokens, packed.positions, masks, select=select
    )


def forward_with_cache(
    module: nn.Module,
    params: Params,
    tokens: Int[Array, "B T"],
    positions: Int[Array, "B T"],
    cache: KVCache,
    cache_mask: Bool[Array, "B S"],
    cache_index: Int[Array, ""],
) -> tuple[Float[Array, "B T ..."], KVCache]:
    """Forward T new tokens written at slots [cache_index, cache_index + T) of the cache.

    ``cache_mask`` marks which slots hold real tokens *including* the new ones. Used for
    prefill (T = prompt length, cache_index = 0) and decode (T = 1).
    """
    attn_mask = layer_masks(module.cfg, cache_mask, tokens.shape[1], cache_index)
    return module.apply({"params": params}, tokens, positions, attn_mask, cache, cache_index)


def init_cache(
    cfg: ModelConfig, batch: int, length: int, dtype: jnp.dtype | None = None
) -> KVCache:
    """Zero KV cache [L, B, S, K, H] for ``length`` slots."""
    shape = (cfg.num_layers, batch, length, cfg.kv_heads, cfg.dim_per_head)
    dtype = dtype or cfg.compute_dtype
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def last_token_index(mask: Bool[Array, "B T"]) -> Int[Array, " B"]:
    """Index of each row's last real token (0 for an all-padding row)."""
    t = mask.shape[-1]
    idx = t - 1 - jnp.argmax(jnp.flip(mask.astype(bool), axis=-1), axis=-1)
    return jnp.where(mask.any(-1), idx, 0)


def last_token_values(values: Float[Array, "B T"], mask: Bool[Array, "B T"]) -> Float[Array, " B"]:
    """Reward-model readout: the scalar head's value at each row's last real token."""
    idx = last_token_index(mask)
    return jnp.take_along_axis(values, idx[:, None], axis=-1)[:, 0]


def param_count(params_or_abstract: Any) -> int:
    """Total number of parameters in a (possibly abstract) param tree."""
    return sum(int(x.size) for x in jax.tree.leaves(params_or_abstract))
