"""Multi-stage runs: a YAML file whose ``pipeline`` lists stage configs run in order.

::

    # configs/quickstart.yaml
    pipeline:
      - quickstart/sft.yaml    # paths relative to this file
      - quickstart/rm.yaml
      - quickstart/ppo.yaml

Each stage is an ordinary run config, loaded and validated only when its turn comes (a later
stage may read an earlier stage's exported model); only ``placement.cpu_devices`` is read
from every stage before the first runs, since it is fixed when JAX starts. Command-line
overrides apply to every stage. A stage that fails stops the pipeline; finished stages keep
their outputs.
"""

from __future__ import annotations

import logging
import os

import yaml

from jaxrlhf.config import ConfigError, read_config


def pipeline_stages(path: str) -> list[str] | None:
    """The stage config paths of a pipeline file, or None for an ordinary run config."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None  # load_config reports unreadable files with its own message
    if not isinstance(raw, dict) or "pipeline" not in raw:
        return None
    extra = sorted(set(raw) - {"pipeline"})
    if extra:
        raise ConfigError(f"{path}: a pipeline file has only 'pipeline', found also {extra}")
    stages = raw["pipeline"]
    if not isinstance(stages, list) or not stages or not all(isinstance(s, str) for s in stages):
        raise ConfigError(f"{path}: pipeline: expected a non-empty list of config paths")
    base = os.path.dirname(path)
    resolved = [os.path.join(base, s) for s in stages]
    missing = [s for s in resolved if not os.path.exists(s)]
    if missing:
        raise ConfigError(f"{path}: pipeline: stage config {missing[0]} does not exist")
    return resolved


def requested_cpu_devices(stages: list[str], overrides: list[str]) -> int | None:
    """``placement.cpu_devices`` of the run's configs, read before JAX starts (it fixes the
    CPU device count then); None when no stage sets it. A value that is not a positive int is
    left for the config's own validation to report.

    Raises:
      ConfigError: stages of one pipeline ask for different counts.
    """
    asked: dict[str, int] = {}
    for path in stages:
        data, _ = read_config(path, overrides)
        placement = data.get("placement")
        value = placement.get("cpu_devices") if isinstance(placement, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            asked[path] = value
    if len(set(asked.values())) > 1:
        listed = ", ".join(f"{p}: {v}" for p, v in asked.items())
        raise ConfigError(
            f"placement.cpu_devices differs between pipeline stages ({listed}); one process "
            "has one CPU device count, fixed when JAX starts"
        )
    count = next(iter(asked.values()), None)
    others = [p for p in stages if p not in asked]
    if count is not None and others:
        logging.getLogger("jaxrlhf").info(
            "placement.cpu_devices: %d applies to every stage (one count per process), also to "
            "%s, which does not set it",
            count,
            ", ".join(others),
        )
    return count
