"""What one compiled program costs per device: FLOPs, memory traffic and collective traffic.

:func:`program_cost` reads XLA's cost analysis of a compiled program (per device: an SPMD
program is partitioned before it is analysed) and adds the bytes its collectives move, parsed
from the optimised HLO. :func:`roofline_seconds` turns a cost into seconds on a device.

XLA's cost analysis counts the body of a loop (``lax.scan``, ``while``) once, whatever its trip
count: the planner therefore costs programs whose loops are the trainers' repetitions (decode
steps, micro-batches, minibatches, epochs) as one iteration of each, and multiplies by the trip
counts it knows from the config (``estimate.trip_counts``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

__all__ = ["ProgramCost", "collective_bytes", "program_cost", "roofline_seconds"]

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_INSTRUCTION = re.compile(
    r"=\s*(?P<shape>\(?[a-z0-9]+\[[^=]*?)\s+(?P<op>" + "|".join(_COLLECTIVES) + r")(?:-start)?\("
)
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """Per-device cost of one run of a program (loop bodies once: module docstring).

    Attributes:
      flops: floating-point operations per device.
      bytes_accessed: bytes read and written to device memory per device.
      collectives: ``(group size, bytes)`` pairs, one per replica-group size: the bytes each
        device sends over the interconnect in collectives over groups of that many devices
        (ring algorithms: an all-reduce of S bytes over n devices sends 2 (n - 1) / n x S).
      devices: the devices the program spans (its SPMD partitions).
    """

    flops: float
    bytes_accessed: float
    collectives: tuple[tuple[int, float], ...] = ()
    devices: int = 1

    @property
    def collective_bytes(self) -> float:
        """Bytes each device sends in all collectives."""
        return sum(b for _, b in self.collectives)

    def _combine(self, other: ProgramCost, f: Callable[[float, float], float]) -> tuple:
        mine, theirs = dict(self.collectives), dict(other.collectives)
        groups = sorted(set(mine) | set(theirs))
        return tuple((g, f(mine.get(g, 0.0), theirs.get(g, 0.0))) for g in groups)

    def __add__(self, other: ProgramCost) -> ProgramCost:
        return ProgramCost(
            self.flops + other.flops,
            self.bytes_accessed + other.bytes_accessed,
            self._combine(other, lambda a, b: a + b),
            max(self.devices, other.devices),
        )

    def scale(self, factor: float) -> ProgramCost:
        """This cost ``factor`` times over."""
        return ProgramCost(
            self.flops * factor,
            self.bytes_accessed * factor,
            tuple((g, b * factor) for g, b in self.collectives),
            self.devices,
        )

    def extrapolate(self, other: ProgramCost, layers: int) -> ProgramCost:
        """``self`` at 1 decoder layer, ``other`` at 2: the cost at ``layers`` (affine)."""

        def line(a: float, b: float) -> float:
            return max(0.0, a + (layers - 1) * (b - a))

        return ProgramCost(
            line(self.flops, other.flops),
            line(self.bytes_accessed, other.bytes_accessed),
            self._combine(other, line),
            self.devices,
        )


def _array_bytes(shape_text: str) -> int:
    return sum(
        _DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in _ARRAY.findall(shape_text)
    )


def _group_size(line: str, devices: int) -> int:
    """Devices per replica group of a collective (``devices`` when the groups are unstated)."""
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[([0-9]+),([0-9]+)\]", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = dict(re.findall(r"'([^']+)'=([0-9]+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", m.group(2)))
    m = re.search(r"source_target_pairs=\{", line)
    return 2 if m else devices


def collective_bytes(hlo_text: str, devices: int) -> tuple[tuple[int, float], ...]:
    """Bytes each device sends for the collectives of an HLO module's text (each once), per
    replica-group size: ``((group size, bytes), ...)``.

    Ring costs per device for a result of S bytes over a group of n: all-reduce
    ``2 (n-1)/n S``, all-gather and all-to-all ``(n-1)/n S``, reduce-scatter ``(n-1) S``
    (its result is one shard), collective-permute ``S``. An asynchronous collective counts at
    its ``-start``, whose tuple shape holds its operands and then its results: the results
    are counted.
    """
    totals: dict[int, float] = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.search(line)
        if m is None or "-done(" in line:
            continue
        op, shape = m.group("op"), m.group("shape")
        if f"{op}-start(" in line and shape.startswith("("):
            arrays = _ARRAY.findall(shape)
            shape = " ".join(f"{t}[{d}]" for t, d in arrays[len(arrays) // 2 :])
        size, n = _array_bytes(shape), _group_size(line, devices)
        if n <= 1:
            continue
        if op == "all-reduce":
            sent = 2 * (n - 1) / n * size
        elif op == "reduce-scatter":
            sent = (n - 1) * size
        elif op == "collective-permute":
            sent = size
        else:
            sent = (n - 1) / n * size
        totals[n] = totals.get(n, 0.0) + sent
    return tuple(sorted(totals.items()))


def program_cost(compiled: Any, devices: int) -> ProgramCost:
    """The cost of a compiled program (``jitted.lower(...).compile()``) on ``devices``."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per partition
        analysis = analysis[0] if analysis else {}
    analysis = analysis or {}
    return ProgramCost(
        flops=float(analysis.get("flops", 0.0)),
        bytes_accessed=float(analysis.get("bytes accessed", 0.0)),
        collectives=collective_bytes(compiled.as_text(), devices),
        devices=devices,
    )


def roofline_seconds(
    cost: ProgramCost,
    peak_flops: float,
    memory_bandwidth: float,
    link_bandwidth: float | Callable[[int], float],
) -> float:
    """Seconds for ``cost`` at the device's peaks: ``max(flops / peak, bytes / bandwidth)``
    (compute and memory traffic overlap) plus each collective group's bytes over its link
    (not overlapped: XLA's collectives mostly wait on their operands). Units: FLOP/s and
    B/s; ``link_bandwidth``: one figure, or a function of the group size (in-node links or
    the network)."""
    compute = max(cost.flops / peak_flops, cost.bytes_accessed / memory_bandwidth)
    if callable(link_bandwidth):
        return compute + sum(b / link_bandwidth(g) for g, b in cost.collectives)
    return compute + cost.collective_bytes / link_bandwidth
