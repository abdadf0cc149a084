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
overrides apply to every stage, and so do overlay files given after the pipeline file
(``--config PIPELINE.yaml --config PLAN.yaml``: each stage is its config merged with
PLAN.yaml, see :func:`run_stages`). A stage that fails stops the pipeline; finished stages
keep their outputs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import yaml

from jaxrlhf.config import ConfigError, read_configs

Stage = tuple[str, ...]  # one run: its config files, merged in order


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


def run_stages(paths: Sequence[str]) -> list[Stage]:
    """The runs that the ``--config`` files ``paths`` ask for, each as the config files it
    merges: one run of them all, or, when the first is a pipeline file, each of its stages
    merged with the files after it (overlays that apply to every stage, like overrides).

    Raises:
      ConfigError: a pipeline file that is not the first ``--config``, or a bad pipeline.
    """
    for path in paths[1:]:
        if pipeline_stages(path) is not None:
            raise ConfigError(f"{path}: a pipeline file can only be the first --config")
    stages = pipeline_stages(paths[0])
    if stages is None:
        return [tuple(paths)]
    return [(stage, *paths[1:]) for stage in stages]


def requested_cpu_devices(stages: Sequence[Stage | str], overrides: list[str]) -> int | None:
    """``placement.cpu_devices`` of the run's configs (stages as :func:`run_stages` gives
    them, or single files), read before JAX starts (it fixes the
    CPU device count then); None when no stage sets it. A value that is not a positive int is
    left for the config's own validation to report.

    Raises:
      ConfigError: stages of one pipeline ask for different counts.
    """
    stages = [(s,) if isinstance(s, str) else tuple(s) for s in stages]
    asked: dict[str, int] = {}
    for files in stages:
        path = files[0]
        data, _ = read_configs(files, overrides)
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
    others = [files[0] for files in stages if files[0] not in asked]
    if count is not None and others:
        logging.getLogger("jaxrlhf").info(
            "placement.cpu_devices: %d applies to every stage (one count per process), also to "
            "%s, which does not set it",
            count,
            ", ".join(others),
        )
    return count
