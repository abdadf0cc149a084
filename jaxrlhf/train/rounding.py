"""Stochastic rounding of updates into bfloat16 weights (``optimizer.stochastic_rounding``).

Training keeps float32 master weights by default (``model.param_dtype: float32``, compute in
``model.dtype``). Weights *stored* in bfloat16 cannot take small updates by rounding to
nearest: bfloat16 keeps 8 significant bits, so a weight of magnitude 0.02 sits on a grid of
spacing 2**-13 ~ 1.2e-4, and an AdamW update of ~lr = 1e-6 is under half a spacing and
rounds away (10 such steps change ~2% of a matrix's entries, against all of them in float32).

Stochastic rounding rounds ``w + u`` up or down to its two bfloat16 neighbours with
probabilities proportional to closeness, so the stored weight is unbiased:
``E[round(w + u)] = w + u``. An update of a tenth of a spacing moves a weight by one whole
spacing one time in ten; over many weights and steps the trajectory follows the float32 one
on average, with rounding noise of standard deviation ``sqrt(steps * |u| * spacing)`` per
weight that float32 masters do not have. It saves the master copy: 2 bytes per parameter
instead of 4.

The rounding is the classic bit trick: add 16 uniformly random bits below a float32's
bfloat16 part, then truncate to the bfloat16 part (the top 16 bits).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float


def stochastic_round_bf16(x: Float[Array, "*S"], key: jax.Array) -> Float[Array, "*S"]:
    """``x`` rounded to bfloat16, up or down with probability proportional to closeness
    (unbiased: ``E[result] = x`` for finite ``x`` within bfloat16's range); non-finite
    values stay as they are. ``key``: a PRNG key, drawn once per element."""
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    noise = jax.random.bits(key, x.shape, jnp.uint32) >> 16  # uniform in [0, 2**16)
    rounded = jax.lax.bitcast_convert_type((bits + noise) & jnp.uint32(0xFFFF0000), jnp.float32)
    return jnp.where(jnp.isfinite(x), rounded, x).astype(jnp.bfloat16)


class StochasticRoundingState(NamedTuple):
    """State of :func:`with_stochastic_rounding`.

    Attributes:
      count: [] int32, updates so far; update ``t`` draws its noise from ``key(seed, t)``.
      inner: the wrapped optimizer's state, whose moments are float32 (mu aside where the
        inner optimizer sets its dtype).
    """

    count: jax.Array
    inner: optax.OptState


def _float32(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def with_stochastic_rounding(
    inner: optax.GradientTransformation, seed: int = 0
) -> optax.GradientTransformation:
    """``inner`` run in float32 for bfloat16 params, its updates rounded stochastically.

    ``inner`` sees float32 gradients and float32 copies of the params (so its moments are
    float32: a bfloat16 second moment could not grow by its ``1 - b2`` steps either). Its
    update ``u`` of a bfloat16 param ``w`` is replaced by ``r - w`` (float32, exact), where
    ``r = stochastic_round_bf16(w + u)``: ``optax.apply_updates`` then stores exactly
    ``r``. Updates of other params (float32 heads, norms of a float32 model) pass unchanged.
    """

    def init(params: Any) -> StochasticRoundingState:
        return StochasticRoundingState(jnp.zeros((), jnp.int32), inner.init(_float32(params)))

    def update(
        updates: Any, state: StochasticRoundingState, params: Any = None
    ) -> tuple[Any, StochasticRoundingState]:
        if params is None:
            raise ValueError("with_stochastic_rounding needs the params in update()")
        masters = _float32(params)
        new, inner_state = inner.update(_float32(updates), state.inner, masters)
        key = jax.random.fold_in(jax.random.key(seed), state.count)
        flat, treedef = jax.tree.flatten(params)
        new_flat, masters_flat = treedef.flatten_up_to(new), treedef.flatten_up_to(masters)
        out = []
        for i, (p, u, w) in enumerate(zip(flat, new_flat, masters_flat, strict=True)):
            if p.dtype == jnp.bfloat16:
                u = stochastic_round_bf16(w + u, jax.random.fold_in(key, i)).astype(jnp.float32)
                u = u - w
            out.append(u)
        return treedef.unflatten(out), StochasticRoundingState(state.count + 1, inner_state)

    return optax.GradientTransformation(init, update)
