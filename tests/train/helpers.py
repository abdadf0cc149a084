"""Shared helpers for the trainer tests."""

from __future__ import annotations

import os

from jax.sharding import Mesh

from jaxrlhf.config import RunConfig, load_config, validate
from jaxrlhf.sharding import MeshConfig, make_mesh

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


def config(name: str, tmp_path, *overrides: str, device_count: int | None = 8) -> RunConfig:
    """``configs/<name>.yaml`` writing into ``tmp_path``, quiet, with ``overrides``; validated
    for ``device_count`` devices (None: not validated here)."""
    path = os.path.join(CONFIGS, f"{name}.yaml")
    cfg = load_config(path, [f"output_dir={tmp_path}", "logging.progress=none", *overrides])
    if device_count is not None:
        validate(cfg, device_count, source=path)
    return cfg


def mesh(data: int, fsdp: int, tensor: int) -> Mesh:
    """A mesh over the first ``data * fsdp * tensor`` devices."""
    import jax

    n = data * fsdp * tensor
    return make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor), devices=jax.devices()[:n])
