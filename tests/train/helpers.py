"""Shared helpers for the trainer tests."""

from __future__ import annotations

import os

from jax.sharding import Mesh

from jaxrlhf.config import RunConfig, load_config
from jaxrlhf.sharding import MeshConfig, make_mesh

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


def config(name: str, tmp_path, *overrides: str, device_count: int = 8) -> RunConfig:
    """``configs/<name>.yaml`` writing into ``tmp_path``, quiet, with ``overrides``."""
    return load_config(
        os.path.join(CONFIGS, f"{name}.yaml"),
        [f"output_dir={tmp_path}", "logging.progress=none", *overrides],
        device_count=device_count,
    )


def mesh(data: int, fsdp: int, tensor: int) -> Mesh:
    """A mesh over the first ``data * fsdp * tensor`` devices."""
    import jax

    n = data * fsdp * tensor
    return make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor), devices=jax.devices()[:n])
