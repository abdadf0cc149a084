"""Checks on a run's ``output_dir`` before anything is written into it.

The run directory is created late (after the model, data and checkpoints are set up), so a
path that can never hold it (a file, a file among its parents, an unwritable parent) would
otherwise surface as an ``OSError`` traceback from Orbax or ``os.makedirs`` minutes in.
"""

from __future__ import annotations

import os

from jaxrlhf.config import ConfigError


def check_output_dir(path: str) -> None:
    """Raises unless ``path`` is, or can be created as, a writable directory.

    Nothing is created: call it on every process before the run's first write. A path that
    does not exist yet is judged by its nearest existing ancestor.

    Args:
      path: the run directory (``output_dir``, or its default).

    Raises:
      ConfigError: one line, ``output_dir: PATH ...`` saying what is in the way.
    """
    absolute = os.path.abspath(path)
    existing = absolute
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        if existing == absolute:
            raise ConfigError(f"output_dir: {path} is a file, not a directory; choose another")
        raise ConfigError(
            f"output_dir: {path} cannot be created: {existing} is a file, not a directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == absolute else f" cannot be created: {existing}"
        raise ConfigError(f"output_dir: {path}{where} is not writable by this user")
