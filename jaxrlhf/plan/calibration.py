"""``--calibrate``: time plans on the actual devices and fit the cost model's efficiencies.

:func:`measure` runs a plan as ``python -m jaxrlhf.train`` would (a subprocess: the CPU
device count is fixed when JAX starts) for a few iterations and reads its ``timeline.json``
(the trainer's own record of when each phase ran): per phase the mean seconds per iteration
after the compile-heavy first ones (an interleaved run's critic and reference groups apart,
keyed as the planner keys them: ``score:critic``), and the steady-state period (update end
to update end).
:func:`fit` compares them with the roofline prediction at efficiency 1: a phase's efficiency
is predicted seconds / measured seconds (summed over the runs), per phase and per phase and
device span; the per-iteration time no phase accounts for (host work between programs)
becomes ``host_seconds``; on CPU devices sharing a host, the contention between phases
running at once is fitted to the measured periods.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from jaxrlhf.config import ConfigError
from jaxrlhf.plan.estimate import DEFAULT_CONTENTION, PHASES, CostModel, PlanEstimate, phase_of

__all__ = ["DEFAULT_COST_MODEL", "Measurement", "fit", "from_timeline", "measure"]

DEFAULT_COST_MODEL = "plan_cost_model.json"  # where --calibrate writes, and the planner reads
_TIMELINE_PHASES = {"sample": "generate", "score": "score", "update": "train", "sync": "sync"}
# An interleaved run's side groups (the timeline's group names are the planner's): the
# critic's value forward and update, the reference's forward on its own group.
_SIDE_PHASES = {("score", "critic"), ("update", "critic"), ("reference", "reference")}


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One plan's measured seconds per iteration: per phase, the steady period, and per
    phase the fraction of its time another device group was busy too (``overlap``)."""

    label: str
    phases: Mapping[str, float]
    iteration_s: float
    overlap: Mapping[str, float] = dataclasses.field(default_factory=dict)


def _covered(start: float, end: float, intervals: Sequence[tuple[float, float]]) -> float:
    """Seconds of ``[start, end]`` inside the union of ``intervals`` (sorted, disjoint)."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in intervals)


def _union(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def from_timeline(data: Mapping[str, Any], label: str, skip: int) -> Measurement:
    """A measurement from a run's ``timeline.json`` content, iterations ``>= skip`` only.

    Raises:
      ValueError: fewer than two timed iterations.
    """
    phases = [p for p in data["phases"] if p["step"] >= skip]
    ends: dict[int, float] = {}  # each iteration's last update (the learner's or a critic's)
    for p in phases:
        if p["name"] == "update":
            ends[p["step"]] = max(ends.get(p["step"], p["end"]), p["end"])
    updates = sorted(ends.values())
    if len(updates) < 2:
        raise ValueError(f"{label}: fewer than 2 iterations after the first {skip} to time")
    steps = len(updates)
    by_group: dict[str, list[tuple[float, float]]] = {}
    for p in phases:
        by_group.setdefault(p.get("group", "learner"), []).append((p["start"], p["end"]))
    seconds = dict.fromkeys(PHASES, 0.0)
    overlapped = dict.fromkeys(PHASES, 0.0)
    for p in phases:
        group = p.get("group", "learner")
        name = _TIMELINE_PHASES.get(p["name"])
        if (p["name"], group) in _SIDE_PHASES:  # as the planner keys them: "score:critic"
            name = f"{_TIMELINE_PHASES.get(p['name'], 'score')}:{group}"
        if name is None:
            continue
        seconds[name] = seconds.get(name, 0.0) + p["end"] - p["start"]
        others = _union([iv for g, ivs in by_group.items() if g != group for iv in ivs])
        overlapped[name] = overlapped.get(name, 0.0) + _covered(p["start"], p["end"], others)
    per_iteration = {k: v / steps for k, v in seconds.items()}
    overlap = {k: overlapped[k] / v if v > 0 else 0.0 for k, v in seconds.items()}
    period = (updates[-1] - updates[0]) / (steps - 1)
    return Measurement(label, per_iteration, period, overlap)


def measure(
    data: Mapping[str, Any], label: str, workdir: str, *, steps: int = 5, skip: int = 2
) -> Measurement:
    """Runs the config ``data`` (a mapping, the plan applied) for ``steps`` iterations in a
    fresh ``python -m jaxrlhf.train`` process and times it (iterations ``>= skip``).

    Raises:
      ConfigError: the run failed (its last error line).
    """
    os.makedirs(workdir, exist_ok=True)
    run = dict(data)
    run["output_dir"] = os.path.join(workdir, "run")
    run["train"] = {**dict(run.get("train") or {}), "steps": steps}
    run["checkpoint"] = {**dict(run.get("checkpoint") or {}), "every": 0, "export_hf": False}
    path = os.path.join(workdir, "plan.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(run, f)
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the run sets its own CPU device count
    out = subprocess.run(
        [sys.executable, "-m", "jaxrlhf.train", "--config", path],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ConfigError(f"calibration run of {label} failed: {last}")
    with open(os.path.join(run["output_dir"], "timeline.json"), encoding="utf-8") as f:
        return from_timeline(json.load(f), label, skip)


def _alone(m: Measurement, phase: str, contention: float) -> float:
    """Seconds ``phase`` would have taken per iteration without the other group running
    (two groups on one host: ``k = 2`` in ``simulator.simulate``)."""
    d, f = m.phases[phase], m.overlap.get(phase, 0.0)
    return d * (1 - f) + d * f / (1 + contention)


def _efficiencies(
    pairs: Sequence[tuple[PlanEstimate, Measurement]], contention: float
) -> dict[str, float]:
    """Per ``phase`` and per ``phase@devices``: predicted (at efficiency 1) over alone
    seconds, summed over the runs (so longer runs weigh more)."""
    predicted: dict[str, float] = {}
    measured: dict[str, float] = {}
    for p, m in pairs:
        for name, seconds in p.phases.items():  # an interleaved plan's side groups too
            if name not in m.phases:
                continue
            alone = _alone(m, name, contention)
            phase = phase_of(name)
            for key in (phase, f"{phase}@{p.phase_devices.get(name, 1)}"):
                predicted[key] = predicted.get(key, 0.0) + seconds
                measured[key] = measured.get(key, 0.0) + alone
    return {k: predicted[k] / measured[k] for k in predicted if predicted[k] > 0 < measured[k]}


def _period_error(pairs, efficiency, host, contention) -> float:
    """Sum of squared log errors of the predicted periods."""
    model = CostModel(efficiency=efficiency, host_seconds=host, contention=contention)
    total = 0.0
    for p, m in pairs:
        phases = {
            k: v / model.efficiency_of(phase_of(k), p.phase_devices.get(k, 1)) if v > 0 else 0.0
            for k, v in p.phases.items()
        }
        for k, v in host.items():
            phases[k] = phases.get(k, 0.0) + v
        total += math.log(p.schedule.period(phases, contention) / m.iteration_s) ** 2
    return total


def fit(
    pairs: Sequence[tuple[PlanEstimate, Measurement]], calibrated_on: str, cluster: str = ""
) -> CostModel:
    """The cost model whose predictions best match ``pairs`` of (prediction at efficiency 1
    and no host time, measurement) of the same plans.

    Efficiencies: per phase (and per phase and device span), predicted over measured
    seconds with the time a phase ran beside another group's phase discounted for the
    host's contention. Host time: the colocated runs' period less their phases. Contention
    (devices sharing a host, when some run overlapped): the value in [0, 1] (steps of 0.05)
    whose predicted periods are closest to the measured ones.
    """
    gaps = [  # colocated runs, whose phases follow one another (no side groups)
        m.iteration_s - sum(m.phases.values())
        for p, m in pairs
        if p.schedule is not None and not p.schedule.separated and set(p.phases) <= set(PHASES)
    ]
    host = {"score": max(0.0, sum(gaps) / len(gaps))} if gaps else {}
    shared = any(p.schedule is not None and p.schedule.shared_host for p, _ in pairs)
    overlapped = any(v > 0 for _, m in pairs for v in m.overlap.values())
    grid = [i / 20 for i in range(21)] if shared and overlapped else [DEFAULT_CONTENTION]
    contention = min(grid, key=lambda c: _period_error(pairs, _efficiencies(pairs, c), host, c))
    return CostModel(
        efficiency={**CostModel().efficiency, **_efficiencies(pairs, contention)},
        host_seconds=host,
        contention=contention,
        calibrated_on=calibrated_on,
        cluster=cluster,
    )
