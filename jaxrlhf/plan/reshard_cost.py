"""Bytes a layout change moves: each destination device receives what it does not hold yet.

A tree moving from one sharding to another (``jax.device_put`` between the training and the
sampler's layouts, or between two role groups) costs, per destination device, the bytes of
its new shards that the same device does not already hold in the source layout. Indices
come from ``Sharding.devices_indices_map``, so any mesh, spec or device subset is handled
alike; no array is touched.
"""

from __future__ import annotations

import math
from typing import Any

import jax

__all__ = ["reshard_bytes"]


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(
        (s.start or 0, dim if s.stop is None else s.stop)
        for s, dim in zip(index, shape, strict=True)
    )


def _overlap(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> int:
    return math.prod(
        max(0, min(ah, bh) - max(al, bl)) for (al, ah), (bl, bh) in zip(a, b, strict=True)
    )


def reshard_bytes(abstract: Any, source: Any, target: Any) -> dict[Any, int]:
    """Bytes each device of ``target`` receives when ``abstract`` moves from ``source``.

    Args:
      abstract: a tree of arrays or ``jax.ShapeDtypeStruct`` (shapes and dtypes).
      source, target: trees of ``jax.sharding.Sharding`` matching ``abstract``.

    Returns:
      device -> bytes it must receive (devices of ``target`` only; 0 where it holds all).
    """
    received: dict[Any, int] = {}
    leaves = jax.tree.leaves(abstract)
    for leaf, src, dst in zip(
        leaves, jax.tree.leaves(source), jax.tree.leaves(target), strict=True
    ):
        shape, itemsize = tuple(leaf.shape), leaf.dtype.itemsize
        held = {d: _box(i, shape) for d, i in src.devices_indices_map(shape).items()}
        for device, index in dst.devices_indices_map(shape).items():
            want = _box(index, shape)
            size = math.prod(hi - lo for lo, hi in want)
            have = _overlap(want, held[device]) if device in held else 0
            received[device] = received.get(device, 0) + (size - have) * itemsize
    return received
