"""Moving pytrees between shardings (train <-> generate layouts), with measured cost.

``reshard`` is the one place where parameters change layout between phases on the same
devices (the seeds' "parameter reallocation"). It is ``jax.device_put`` plus accounting:
how many bytes had to move between devices (``reshard_bytes``, computable before any
transfer from shardings and shapes alone) and how long the move took.

Byte accounting: for every leaf and every destination device, the bytes of the
destination shard that the same device does not already hold in the source layout. So an
identical layout moves 0 bytes; replicated -> sharded moves 0 (each device keeps a slice of
its replica); sharded over n devices -> replicated moves (n - 1) / n of every replica.
This counts data that arrives on a device, not the collective algorithm XLA picks, so it is
a lower bound on link traffic and a good proxy for its cost.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from jaxrlhf.sharding.distributed import put_global, to_host

logger = logging.getLogger(__name__)

_Box = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class ReshardStats:
    """Cost of one reshard.

    Attributes:
      bytes_moved: bytes that arrived on a device which did not hold them before, summed
        over leaves and destination devices (see the module docstring).
      bytes_total: logical size of the tree (each leaf counted once, not per replica).
      seconds: wall time of the transfer, until every output buffer was ready.
    """

    bytes_moved: int
    bytes_total: int
    seconds: float


def _is_sharding(x: Any) -> bool:
    return isinstance(x, Sharding)


def _box(index: tuple[slice, ...], shape: Sequence[int]) -> _Box:
    """Normalises a tuple of slices (from ``devices_indices_map``) to (start, stop) pairs."""
    box = []
    for dim, size in enumerate(shape):
        sl = index[dim] if dim < len(index) else slice(None)
        start, stop, step = sl.indices(size)
        if step != 1:  # never produced by jax shardings; refuse rather than miscount
            raise ValueError(f"strided shard index {sl} is not supported")
        box.append((start, stop))
    return tuple(box)


def _volume(box: _Box) -> int:
    return math.prod(max(0, stop - start) for start, stop in box)


def _overlap(a: _Box, b: _Box) -> int:
    return math.prod(
        max(0, min(a1, b1) - max(a0, b0)) for (a0, a1), (b0, b1) in zip(a, b, strict=True)
    )


def leaf_bytes_moved(
    src: Sharding | None, dst: Sharding, shape: Sequence[int], itemsize: int
) -> int:
    """Bytes that ``dst`` needs on each device beyond what ``src`` holds there, summed.

    Args:
      src: the source sharding, or None for host data (everything moves).
      dst: the destination sharding.
      shape: the global shape.
      itemsize: bytes per element.

    Returns:
      The number of bytes moved for this array.
    """
    shape = tuple(shape)
    src_boxes = (
        {d: _box(i, shape) for d, i in src.devices_indices_map(shape).items()}
        if src is not None
        else {}
    )
    elements = 0
    for device, index in dst.devices_indices_map(shape).items():
        need = _box(index, shape)
        have = src_boxes.get(device)
        elements += _volume(need) - (_overlap(need, have) if have is not None else 0)
    return elements * itemsize


def bytes_received(src_shardings: Any, dst_shardings: Any, shapes_dtypes: Any) -> dict[Any, int]:
    """:func:`reshard_bytes` per destination device: device -> the bytes it receives (what
    its new shards hold that the same device did not hold before; 0 where nothing moves).
    Arguments as :func:`reshard_bytes`."""
    leaves, treedef = jax.tree.flatten(shapes_dtypes)
    if src_shardings is None:
        srcs: list[Sharding | None] = [None] * len(leaves)
    else:
        srcs = list(_flat_shardings(src_shardings, treedef, "source shardings"))
    dsts = _flat_shardings(dst_shardings, treedef, "destination shardings")
    received: dict[Any, int] = {}
    for src, dst, leaf in zip(srcs, dsts, leaves, strict=True):
        shape, itemsize = tuple(leaf.shape), np.dtype(leaf.dtype).itemsize
        held = (
            {d: _box(i, shape) for d, i in src.devices_indices_map(shape).items()}
            if src is not None
            else {}
        )
        for device, index in dst.devices_indices_map(shape).items():
            need = _box(index, shape)
            have = held.get(device)
            missing = _volume(need) - (_overlap(need, have) if have is not None else 0)
            received[device] = received.get(device, 0) + missing * itemsize
    return received


def _flat_shardings(shardings: Any, treedef: Any, what: str) -> list[Sharding]:
    """Leaves of ``shardings`` aligned with ``treedef`` (a single Sharding broadcasts)."""
    if isinstance(shardings, Sharding):
        return [shardings] * treedef.num_leaves
    try:
        full = jax.tree.broadcast(shardings, treedef.unflatten([0] * treedef.num_leaves))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{what} do not match the tree structure: {e}".splitlines()[0]) from e
    return jax.tree.leaves(full, is_leaf=_is_sharding)


def reshard_bytes(src_shardings: Any, dst_shardings: Any, shapes_dtypes: Any) -> int:
    """Estimates the bytes a reshard moves, before any transfer.

    Args:
      src_shardings: pytree of source ``Sharding`` matching ``shapes_dtypes`` (or a prefix
        of it, or a single ``Sharding``); ``None`` means host data (everything moves).
      dst_shardings: pytree of destination ``Sharding`` (or a single one).
      shapes_dtypes: pytree of ``jax.ShapeDtypeStruct`` or arrays (anything with
        ``.shape`` and ``.dtype``).

    Returns:
      Total bytes moved, as defined in the module docstring.
    """
    return sum(bytes_received(src_shardings, dst_shardings, shapes_dtypes).values())


def _buffer_pointers(x: jax.Array) -> set[int]:
    return {shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards}


def _crosses_hosts(x: Any, dst: Sharding) -> bool:
    """Whether moving ``x`` to ``dst`` changes the device set of an array that spans
    several processes: multi-controller JAX's ``device_put`` refuses that on GPU and CPU."""
    return (
        isinstance(x, jax.Array)
        and not x.is_fully_addressable
        and set(x.sharding.device_set) != set(dst.device_set)
    )


def _device_put(leaves: list[Any], dsts: list[Sharding]) -> list[Any]:
    """``jax.device_put`` of ``leaves``; in a multi-process run, a leaf moving between two
    device sets that span processes (a separated placement's groups) goes through the hosts
    instead: all-gathered to every process, then each process places its devices' blocks."""
    if jax.process_count() == 1:
        return jax.device_put(leaves, dsts)
    out = list(leaves)
    direct = [i for i, (x, d) in enumerate(zip(leaves, dsts, strict=True))
              if not _crosses_hosts(x, d)]  # fmt: skip
    for i, y in zip(direct, jax.device_put([leaves[i] for i in direct],
                                           [dsts[i] for i in direct]),
                    strict=True):  # fmt: skip
        out[i] = y
    for i in sorted(set(range(len(leaves))) - set(direct)):
        out[i] = put_global(to_host(leaves[i]), dsts[i])
    return out


def reshard(tree: Any, dst_shardings: Any, *, donate: bool = False) -> tuple[Any, ReshardStats]:
    """Moves ``tree`` to ``dst_shardings`` with ``jax.device_put`` and measures the cost.

    Args:
      tree: pytree of ``jax.Array`` (host arrays are accepted and count as fully moved).
      dst_shardings: pytree of ``Sharding`` matching ``tree`` (or a prefix of it, or a
        single ``Sharding``).
      donate: whether the source buffers are freed. Use it for train -> generate
        resharding so both layouts never coexist in memory. After the transfer each
        source leaf that shares no buffer with its output is deleted. ``device_put``'s own
        ``donate`` is not used: it does not free the source on every backend (on CPU in
        jax 0.10.2 it never does), and on CPU a source it was given crashed the process
        when next touched. Leaves that do share a buffer with the output (an unchanged
        layout, or an output shard that aliases the source) are left alive, since
        deleting them would free the output too.

    Returns:
      ``(new_tree, stats)``. The transfer has completed when this returns.
    """
    leaves, treedef = jax.tree.flatten(tree)
    dsts = _flat_shardings(dst_shardings, treedef, "destination shardings")
    srcs = [x.sharding if isinstance(x, jax.Array) else None for x in leaves]
    moved = sum(
        leaf_bytes_moved(src, dst, np.shape(x), np.dtype(x.dtype).itemsize)
        for src, dst, x in zip(srcs, dsts, leaves, strict=True)
    )
    total = sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in leaves)

    start = time.perf_counter()
    # Donation is done here, not by device_put: on XLA:CPU (jax 0.10.2) a source donated to
    # device_put across device sets crashed the process when next touched (is_deleted).
    out_leaves = _device_put(leaves, dsts)
    jax.block_until_ready(out_leaves)
    seconds = time.perf_counter() - start

    if donate:
        for x, y in zip(leaves, out_leaves, strict=True):
            if isinstance(x, jax.Array) and not x.is_deleted() and x is not y:
                if not _buffer_pointers(x) & _buffer_pointers(y):
                    x.delete()

    stats = ReshardStats(bytes_moved=moved, bytes_total=total, seconds=seconds)
    logger.debug(
        "reshard: moved %.3f MiB of %.3f MiB in %.3f s",
        moved / 2**20,
        total / 2**20,
        seconds,
    )
    return jax.tree.unflatten(treedef, out_leaves), stats
