"""``--calibrate``: time plans on the actual devices and fit the cost model's efficiencies.

:func:`measure` runs a plan as ``python -m jaxrlhf.train`` would (a subprocess: the CPU
device count is fixed when JAX starts) for a few iterations and reads its ``timeline.json``
(the trainer's own record of when each phase ran): per phase the mean seconds per iteration
after the compile-heavy first ones, and the steady-state period (update end to update end).
:func:`fit` compares them with the roofline prediction at efficiency 1: a phase's efficiency
is predicted seconds / measured seconds (the mean over the runs, weighted by time), and the
per-iteration time no phase accounts for (host work between programs) becomes
``host_seconds``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from jaxrlhf.config import ConfigError
from jaxrlhf.plan.estimate import PHASES, CostModel, PlanEstimate

__all__ = ["Measurement", "fit", "measure"]

_TIMELINE_PHASES = {"sample": "generate", "score": "score", "update": "train", "sync": "sync"}


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One plan's measured seconds per iteration: per phase and the steady period."""

    label: str
    phases: Mapping[str, float]
    iteration_s: float


def from_timeline(data: Mapping[str, Any], label: str, skip: int) -> Measurement:
    """A measurement from a run's ``timeline.json`` content, iterations ``>= skip`` only.

    Raises:
      ValueError: fewer than two timed iterations.
    """
    phases = [p for p in data["phases"] if p["step"] >= skip]
    updates = sorted(p["end"] for p in phases if p["name"] == "update")
    if len(updates) < 2:
        raise ValueError(f"{label}: fewer than 2 iterations after the first {skip} to time")
    steps = len(updates)
    seconds = dict.fromkeys(PHASES, 0.0)
    for p in phases:
        name = _TIMELINE_PHASES.get(p["name"])
        if name is not None:
            seconds[name] += p["end"] - p["start"]
    per_iteration = {k: v / steps for k, v in seconds.items()}
    period = (updates[-1] - updates[0]) / (steps - 1)
    return Measurement(label, per_iteration, period)


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


def fit(pairs: Sequence[tuple[PlanEstimate, Measurement]], calibrated_on: str) -> CostModel:
    """The cost model whose predictions best match ``pairs`` of (prediction at efficiency 1
    and no host time, measurement) of the same plans."""
    efficiency, host = {}, {}
    for phase in ("generate", "score", "train", "sync"):
        predicted = sum(p.phases[phase] for p, _ in pairs)
        measured = sum(m.phases[phase] for _, m in pairs)
        if predicted > 0 and measured > 0:
            efficiency[phase] = predicted / measured
    # Host time between phases: the colocated runs' period less their phases' sum.
    gaps = [m.iteration_s - sum(m.phases.values()) for p, m in pairs if set(p.groups) == {"all"}]
    if gaps:
        host["score"] = max(0.0, sum(gaps) / len(gaps))
    return CostModel(
        efficiency={**CostModel().efficiency, **efficiency},
        host_seconds=host,
        calibrated_on=calibrated_on,
    )
