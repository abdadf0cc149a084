"""Splitting a batch into micro-batches along its rows, without moving data between devices.

Micro-batches are strided (row ``r`` goes to micro-batch ``r % n``): each device's slice of
the batch splits into the same micro-batches locally. Rows can come in *groups* (a prompt and
its ``n`` sampled responses, packed as one row by ``models.scoring``): group ``g`` then goes
to micro-batch ``g % n`` whole and in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from jaxrlhf.models import axes
from jaxrlhf.sharding.rules import Rules, activation_sharding


def _constrain(x: jax.Array, mesh: Mesh | None, rules: Rules | None) -> jax.Array:
    """``[n, rows, ...]`` placed with its rows split like the ``batch`` axis (no-op without a
    mesh)."""
    if mesh is None:
        return x
    names = (None, axes.BATCH) + (None,) * (x.ndim - 2)
    return jax.lax.with_sharding_constraint(x, activation_sharding(mesh, rules, names))


def micro_batches_for(rows: int, micro_rows: int | None) -> int:
    """Micro-batches of at most ``micro_rows`` rows (over every shard) that ``rows`` rows
    split into: one when they fit in one (or ``micro_rows`` is None: no bound).

    Raises:
      ValueError: ``rows`` is above ``micro_rows`` and not a multiple of it.
    """
    if micro_rows is None or rows <= micro_rows:
        return 1
    if rows % micro_rows:
        raise ValueError(f"{rows} rows do not split into micro-batches of {micro_rows} rows")
    return rows // micro_rows


def split_micro(
    batch: Any, num_micro: int, mesh: Mesh | None, rules: Rules | None, group_size: int = 1
) -> Any:
    """Every ``[B, ...]`` leaf of ``batch`` -> ``[num_micro, B / num_micro, ...]``, strided:
    row r -> micro r % n, or with ``group_size > 1`` group g of that many consecutive rows ->
    micro g % n. ``mesh`` and ``rules`` keep the rows' sharding (None: no constraint)."""

    def split(x: jax.Array) -> jax.Array:
        b = x.shape[0]
        x = x.reshape(b // (num_micro * group_size), num_micro, group_size, *x.shape[1:])
        x = x.swapaxes(0, 1).reshape(num_micro, b // num_micro, *x.shape[3:])
        return _constrain(x, mesh, rules)

    return jax.tree.map(split, batch)


def merge_micro(x: jax.Array, group_size: int = 1) -> jax.Array:
    """Inverse of :func:`split_micro` for one array: ``[n, B / n, ...] -> [B, ...]``."""
    num_micro, rows = x.shape[:2]
    x = x.reshape(num_micro, rows // group_size, group_size, *x.shape[2:])
    return x.swapaxes(0, 1).reshape(num_micro * rows, *x.shape[3:])


def map_micro(
    fn: Callable[[Any], Any],
    batch: Any,
    num_micro: int,
    mesh: Mesh | None,
    rules: Rules | None,
    group_size: int = 1,
) -> Any:
    """``fn(batch)`` computed one micro-batch of rows at a time (``lax.map``), for row-wise
    ``fn`` whose outputs all have a leading row axis: only one micro-batch's activations are
    live at once. Micro-batches are those of :func:`split_micro`; the outputs come back in
    the batch's row order."""
    if num_micro == 1:
        return fn(batch)
    out = jax.lax.map(fn, split_micro(batch, num_micro, mesh, rules, group_size))
    return jax.tree.map(lambda x: merge_micro(x, group_size), out)
