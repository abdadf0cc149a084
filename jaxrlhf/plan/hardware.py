"""Device kinds the planner knows (a roofline each) and cluster specs (``h100x8``).

Each :class:`DeviceSpec` holds the peaks a roofline needs: dense bf16 FLOP/s, HBM bandwidth,
the per-device interconnect bandwidth inside a node (NVLink, or a TPU slice's ICI, which
spans the whole slice) and between nodes (InfiniBand / Ethernet per GPU), and HBM capacity.
Figures are the vendors' published peaks (per direction for links); a calibrated run
(``--calibrate``) scales them by measured efficiencies. The CPU has no table entry: its peaks
are measured on the spot (:func:`measure_cpu`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import time

__all__ = [
    "DEVICE_SPECS",
    "Cluster",
    "DeviceSpec",
    "cluster_size",
    "measure_cpu",
    "parse_cluster",
]

GB = 1e9


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One device kind's roofline.

    Attributes:
      name: the kind (``h100``, ``tpu-v5e``, ``cpu``).
      peak_flops: dense bf16 FLOP/s per device.
      memory_bandwidth: device memory bytes/s.
      link_bandwidth: bytes/s each device sends to others in its node (a TPU slice: ICI).
      network_bandwidth: bytes/s each device sends to other nodes.
      memory_bytes: device memory.
      devices_per_node: devices that share ``link_bandwidth`` (TPU: the slice).
    """

    name: str
    peak_flops: float
    memory_bandwidth: float
    link_bandwidth: float
    network_bandwidth: float
    memory_bytes: float
    devices_per_node: int = 8

    def link_for(self, group: int) -> float:
        """Bytes/s of a collective over ``group`` devices: in-node links if the group fits
        in a node, else the network (the slowest hop sets a ring's pace)."""
        return self.link_bandwidth if group <= self.devices_per_node else self.network_bandwidth


_SLICE = 1 << 16  # a TPU slice's ICI connects every chip of it
# Peaks as published, links per direction: NVIDIA A100/H100/H200 SXM datasheets (dense bf16;
# NVLink 600/900 GB/s both directions -> half; 400 Gb/s InfiniBand per GPU); Google Cloud TPU
# system architecture pages (bf16 peak, HBM, ICI per chip: 2400/1600/4800/3584 Gbps for
# v4/v5e/v5p/v6e, both directions -> half; DCN between slices is not modelled).
DEVICE_SPECS: dict[str, DeviceSpec] = {
    "a100": DeviceSpec("a100", 312e12, 2039 * GB, 300 * GB, 25 * GB, 80 * 2**30),
    "h100": DeviceSpec("h100", 989e12, 3350 * GB, 450 * GB, 50 * GB, 80 * 2**30),
    "h200": DeviceSpec("h200", 989e12, 4800 * GB, 450 * GB, 50 * GB, 141 * 2**30),
    "tpu-v4": DeviceSpec("tpu-v4", 275e12, 1200 * GB, 150 * GB, 150 * GB, 32 * 2**30, _SLICE),
    "tpu-v5e": DeviceSpec("tpu-v5e", 197e12, 819 * GB, 100 * GB, 100 * GB, 16 * 2**30, _SLICE),
    "tpu-v5p": DeviceSpec("tpu-v5p", 459e12, 2765 * GB, 300 * GB, 300 * GB, 95 * 2**30, _SLICE),
    "tpu-v6e": DeviceSpec("tpu-v6e", 918e12, 1640 * GB, 224 * GB, 224 * GB, 32 * 2**30, _SLICE),
}


@dataclasses.dataclass(frozen=True)
class Cluster:
    """``count`` devices of one kind (the kind's spec: measured for ``cpu``)."""

    spec: DeviceSpec
    count: int

    @property
    def shared_host(self) -> bool:
        """Whether the devices share one host's cores (JAX CPU devices)."""
        return self.spec.name == "cpu"

    @property
    def label(self) -> str:
        return f"{self.count} x {self.spec.name}"


def cluster_size(text: str) -> tuple[str, int]:
    """``h100x8``, ``8xh100``, ``tpu-v5e-64``, ``cpu-2`` (``cpu``: one) -> (kind, count).

    Raises:
      ValueError: an unknown kind or a count that is not a positive integer (one line).
    """
    raw = text.strip().lower()
    m = (
        re.fullmatch(r"([a-z0-9-]+?)[x-]([0-9]+)", raw)
        or re.fullmatch(r"([0-9]+)x([a-z0-9-]+)", raw)
        or re.fullmatch(r"([a-z0-9-]+)()", raw)
    )
    kind, count = (m.group(1), m.group(2)) if m else (raw, "")
    if m and kind.isdigit():
        kind, count = count, kind
    if kind not in DEVICE_SPECS and kind != "cpu":
        known = ", ".join(sorted([*DEVICE_SPECS, "cpu"]))
        raise ValueError(
            f"cluster {text!r}: unknown device kind {kind!r} (known: {known}; write e.g. "
            "h100x8, tpu-v5e-64, cpu-2)"
        )
    n = int(count) if count else 1
    if n < 1:
        raise ValueError(f"cluster {text!r}: the device count must be >= 1")
    return kind, n


def parse_cluster(text: str, cpu: DeviceSpec | None = None) -> Cluster:
    """The :class:`Cluster` of a spec :func:`cluster_size` reads.

    ``cpu``: the spec of this whole host (:func:`measure_cpu` when None). Each of the
    ``count`` CPU devices has the host's compute and bandwidth while it runs alone (the
    simulator shares them between devices that run at once: ``Cluster.shared_host``) and
    an equal share of its memory.

    Raises:
      ValueError: as :func:`cluster_size`.
    """
    kind, n = cluster_size(text)
    if kind == "cpu":
        whole = cpu if cpu is not None else measure_cpu()
        return Cluster(dataclasses.replace(whole, memory_bytes=whole.memory_bytes / n), n)
    return Cluster(DEVICE_SPECS[kind], n)


def measure_cpu(seconds: float = 0.5) -> DeviceSpec:
    """This host's peaks, measured now: a float32 matmul's FLOP/s and a large copy's bytes/s
    on one JAX CPU device (XLA:CPU uses every core for them); links as fast as memory."""
    import jax
    import numpy as np

    device = jax.devices("cpu")[0]
    n = 1024
    a = jax.device_put(np.ones((n, n), np.float32), device)
    matmul = jax.jit(lambda x: x @ x)
    copy = jax.jit(lambda x: x + 1.0)
    big = jax.device_put(np.ones((64 * 2**20 // 4,), np.float32), device)

    def rate(fn, arg, work: float) -> float:
        fn(arg).block_until_ready()
        best, spent = float("inf"), 0.0
        while spent < seconds:
            start = time.perf_counter()
            fn(arg).block_until_ready()
            took = time.perf_counter() - start
            best, spent = min(best, took), spent + took
        return work / best

    flops = rate(matmul, a, 2 * n**3)
    bandwidth = rate(copy, big, 2 * big.nbytes)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = 16 * 2**30
    return DeviceSpec("cpu", flops, bandwidth, bandwidth, bandwidth, float(memory), 1 << 16)
