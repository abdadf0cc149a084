"""When each phase of an RL run ran, on which devices: the per-phase timeline.

The trainer records one :class:`Phase` per piece of work (sampling a batch, syncing the
sampler's weights, scoring, updating) with host wall-clock start and end (``perf_counter``
seconds since the trainer started; a phase ends when its results are on the host or its
outputs are ready) and the device ids it ran on. :func:`summarize` turns them into each
device group's busy fraction (the union of its phases' intervals over the span), its idle
fraction, and the fraction of the span in which the sampler and the learner were busy at
once (their overlap). The loop writes ``timeline.json`` and ``timeline.png`` to the run
directory.

A device's busy fraction says a program was running on it, not how much of the machine it
used: on a CPU host every JAX device's programs share the host's cores (XLA:CPU runs a
one-device program's operations on threads of one pool), so the timeline also samples the
process's CPU time (``time.process_time``, every thread's user and system seconds) whenever
a phase ends: :func:`host_cores` is the cores the process kept busy, on average, between
two samples.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

TIMELINE_FILE = "timeline.json"
TIMELINE_PLOT = "timeline.png"


@dataclasses.dataclass(frozen=True)
class Phase:
    """One recorded piece of work.

    Attributes:
      name: ``sample``, ``reference`` (its forward on the sampler's group or its own),
        ``sync``, ``score`` or ``update``.
      group: the device group it ran on (``sampler``, ``learner``, and in an interleaved
        placement ``critic`` or ``reference``).
      step: the iteration (rollout index for ``sample``) it belongs to.
      start, end: seconds since the timeline started.
      devices: the device ids it ran on.
    """

    name: str
    group: str
    step: int
    start: float
    end: float
    devices: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class CpuSample:
    """The process's CPU seconds (all threads, user + system) at ``wall`` seconds since the
    timeline started, and the step of the phase whose end took it."""

    wall: float
    cpu: float
    step: int


class Timeline:
    """A thread-safe recorder of :class:`Phase` entries (the producer thread records too)
    and of the process's CPU time at each phase's end (:class:`CpuSample`)."""

    def __init__(self, groups: dict[str, tuple[int, ...]]):
        self.groups = groups
        self.origin = time.perf_counter()
        self.phases: list[Phase] = []
        self.cpu: list[CpuSample] = []
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def record(self, name: str, group: str, step: int, start: float, end: float) -> None:
        phase = Phase(name, group, step, start, end, self.groups[group])
        sample = CpuSample(self.now(), time.process_time(), step)
        with self._lock:
            self.phases.append(phase)
            self.cpu.append(sample)

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            phases, cpu = list(self.phases), list(self.cpu)
        summary = summarize(phases, self.groups)
        if len(cpu) > 1:
            summary["host/cpu_cores"] = host_cores(cpu)
        return {
            "groups": {k: list(v) for k, v in self.groups.items()},
            "phases": [dataclasses.asdict(p) for p in phases],
            "cpu": [dataclasses.asdict(c) for c in cpu],
            "summary": summary,
        }

    def write(self, run_dir: str, *, plot: bool = True) -> str:
        """Writes ``timeline.json`` (and ``timeline.png``) to ``run_dir``; returns the json
        path."""
        data = self.to_json()
        path = os.path.join(run_dir, TIMELINE_FILE)
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
        if plot and data["phases"]:
            plot_timeline(data, os.path.join(run_dir, TIMELINE_PLOT))
        return path


def host_cores(samples: Sequence[CpuSample]) -> float:
    """The cores the process kept busy on average from the first sample to the last: CPU
    seconds over wall seconds (2.0 = two cores all the time)."""
    first, last = min(samples, key=lambda c: c.wall), max(samples, key=lambda c: c.wall)
    return (last.cpu - first.cpu) / max(last.wall - first.wall, 1e-12)


def _union_length(intervals: Sequence[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _intersection(
    xs: Sequence[tuple[float, float]], ys: Sequence[tuple[float, float]]
) -> list[tuple[float, float]]:
    out = []
    for a, b in xs:
        for c, d in ys:
            lo, hi = max(a, c), min(b, d)
            if hi > lo:
                out.append((lo, hi))
    return out


def summarize(phases: Sequence[Phase], groups: dict[str, tuple[int, ...]]) -> dict[str, float]:
    """Busy / idle fraction per device group and device, and the sampler-learner overlap.

    The span runs from the first phase's start to the last phase's end. A device is busy
    while any phase that ran on it is; a group's busy fraction is its devices' mean.
    ``overlap_frac``: the fraction of the span in which a sampler phase and a learner phase
    ran at once (0 when every phase waits for the last); ``critic_overlap_frac`` and
    ``reference_overlap_frac`` likewise for the learner and the critic or reference group
    of an interleaved placement.
    """
    if not phases:
        return {}
    t0, t1 = min(p.start for p in phases), max(p.end for p in phases)
    span = max(t1 - t0, 1e-12)
    out: dict[str, float] = {"span_s": span}
    busy_dev = {}
    for d in sorted({d for ids in groups.values() for d in ids}):
        busy_dev[d] = _union_length([(p.start, p.end) for p in phases if d in p.devices]) / span
        out[f"device{d}/busy_frac"] = busy_dev[d]
    for name, ids in groups.items():
        busy = sum(busy_dev[d] for d in ids) / max(len(ids), 1)
        out[f"{name}/busy_frac"] = busy
        out[f"{name}/idle_frac"] = 1.0 - busy
    by_group = {g: [(p.start, p.end) for p in phases if p.group == g] for g in groups}
    both = _intersection(by_group["sampler"], by_group["learner"])
    out["overlap_frac"] = _union_length(both) / span
    for other in ("critic", "reference"):  # interleaved groups beside the learner
        if other in groups:
            both = _intersection(by_group["learner"], by_group[other])
            out[f"{other}_overlap_frac"] = _union_length(both) / span
    return out


def plot_timeline(data: dict[str, Any], path: str) -> str | None:
    """Draws the phases as bars per device (matplotlib; None when it is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    colors = {
        "sample": "tab:blue",
        "reference": "tab:cyan",
        "sync": "tab:purple",
        "score": "tab:orange",
    }
    devices = sorted({d for ids in data["groups"].values() for d in ids})
    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.4 * len(devices)))
    for p in data["phases"]:
        for d in p["devices"]:
            ax.broken_barh(
                [(p["start"], p["end"] - p["start"])],
                (devices.index(d) - 0.4, 0.8),
                color=colors.get(p["name"], "tab:green"),
            )
    ax.set_yticks(range(len(devices)), [f"device {d}" for d in devices])
    ax.set_xlabel("seconds")
    summary = data["summary"]
    ax.set_title(
        "timeline: sample (blue), reference (cyan), sync (purple), score (orange), "
        "update (green); "
        f"overlap {summary.get('overlap_frac', 0.0):.0%}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
