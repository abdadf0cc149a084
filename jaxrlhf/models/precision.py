"""Weights in the compute dtype, cast once: what the model would cast at every use.

The model stores its weights in ``ModelConfig.param_dtype`` and casts them to the compute
dtype (``ModelConfig.dtype``) inside every matmul and embedding lookup
(``models.transformer.param``, ``nn.Embed(dtype=...)``, the decode loop's ``astype``). A
copy that is only read, never trained (the sampler's weights, a frozen reference), can
instead be cast once: the forward then sees the same values, and the copy and every move of
it take ``itemsize(dtype) / itemsize(param_dtype)`` of the bytes (half for float32 masters
and bfloat16 compute).

The exception is the norms' ``scale`` and ``bias``: ``models.transformer.Norm`` reads them
in float32 (Gemma's ``1 + w``, LayerNorm), so they keep their stored dtype; they are ``D``
numbers per norm, a negligible share of the bytes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxrlhf.models.config import ModelConfig

# Leaf names of models.transformer.Norm's params, which the model reads in float32; no
# other param of the model has these names.
NORM_PARAMS = ("scale", "bias")


def _leaf_name(path: tuple) -> str:
    last = path[-1]
    return str(getattr(last, "key", getattr(last, "name", last)))


def cast_on_use(path: tuple, leaf: Any) -> bool:
    """Whether the model casts the param at ``path`` (a key path) to the compute dtype at
    every use: every floating leaf but a norm's (:data:`NORM_PARAMS`)."""
    return jnp.issubdtype(leaf.dtype, jnp.floating) and _leaf_name(path) not in NORM_PARAMS


def compute_dtype_params(params: Any, cfg: ModelConfig) -> Any:
    """``params`` with every leaf the model casts at use (:func:`cast_on_use`) in
    ``cfg.dtype``; the other leaves, and leaves already in that dtype, are returned as they
    are (the same arrays). Works on arrays (call it under ``jax.jit`` to keep their
    shardings) and on ``jax.ShapeDtypeStruct`` trees (abstract params: the copy's layout)."""
    dtype = cfg.compute_dtype

    def cast(path: tuple, leaf: Any) -> Any:
        if not cast_on_use(path, leaf) or leaf.dtype == dtype:
            return leaf
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=leaf.sharding)
        return leaf.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, params)


def needs_cast(params: Any, cfg: ModelConfig) -> bool:
    """Whether :func:`compute_dtype_params` would change any leaf of ``params`` (False for a
    model stored in its compute dtype, e.g. a frozen bfloat16 role)."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    return any(cast_on_use(p, x) and x.dtype != cfg.compute_dtype for p, x in leaves)


def frozen_copy(params: Any, cfg: ModelConfig) -> Any:
    """A new copy of ``params`` for a frozen role (e.g. the reference made from the initial
    policy): :func:`compute_dtype_params`, with every leaf a fresh array (none shares a
    buffer with ``params``, which a train step may donate). Eager: each leaf keeps its
    sharding."""
    cast = compute_dtype_params(params, cfg)  # a leaf it leaves alone is the same array
    return jax.tree.map(lambda new, old: jnp.copy(new) if new is old else new, cast, params)
