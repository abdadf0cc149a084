"""JAX's persistent compilation cache for ``python -m jaxrlhf.train`` runs, on by default.

A GPU or TPU run compiles its programs (prefill, decode chunks, scoring, the update) for
16-77 s before its first step; a rerun, a resume after preemption or the next stage of a
pipeline compiles the same programs again. JAX can keep compiled executables on disk and
load them instead: the command turns that on before the first compile, in

1. ``JAX_COMPILATION_CACHE_DIR``, when the user set it (JAX's own setting wins);
2. ``JAXRLHF_COMPILATION_CACHE=DIR``;
3. otherwise ``$XDG_CACHE_HOME/jaxrlhf/xla`` (``~/.cache/jaxrlhf/xla``),

and ``JAXRLHF_COMPILATION_CACHE=off`` turns it off. Only programs that took at least
:data:`MIN_COMPILE_SECONDS` to compile are stored (JAX's default threshold: a CPU run's small
programs compile faster than they load).

Processes of one host (a pipeline's stages, two runs side by side) may share the directory:
a directory jaxrlhf chose gets a size limit (:data:`MAX_BYTES`, least recently used entries
go first), which also makes JAX take a file lock around every read and write; without a
limit JAX writes an entry with a plain file write and reads entries unlocked, so a second
process could read an entry that is still being written. The user's own
``JAX_COMPILATION_CACHE_DIR`` gets no limit from us: other jobs may write it without one,
and a limited writer fails on their entries (it reads an access-time file that only
limited writers leave). An entry is keyed by the program, the
compile options, the devices and the jax/jaxlib versions, so a cached executable is the
one the compiler would produce.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import jax

SETTING_ENV = "JAXRLHF_COMPILATION_CACHE"
JAX_DIR_ENV = "JAX_COMPILATION_CACHE_DIR"
OFF = "off"
MIN_COMPILE_SECONDS = 1.0
MAX_BYTES = 20 << 30


@dataclasses.dataclass(frozen=True)
class CacheChoice:
    """Where the run's compiled programs are cached.

    Attributes:
      directory: the cache directory; None: no persistent cache.
      source: what chose it (``JAX_COMPILATION_CACHE_DIR``, ``JAXRLHF_COMPILATION_CACHE``,
        ``default``), for the log line.
    """

    directory: str | None
    source: str


def choose(environ: Mapping[str, str], home: str) -> CacheChoice:
    """The cache a run uses, from the environment (see the module docstring); pure.

    Args:
      environ: the process environment.
      home: the user's home directory (for ``~/.cache``).
    """
    if environ.get(JAX_DIR_ENV):
        return CacheChoice(environ[JAX_DIR_ENV], JAX_DIR_ENV)
    setting = environ.get(SETTING_ENV, "").strip()
    if setting.lower() == OFF:
        return CacheChoice(None, SETTING_ENV)
    if setting:
        if setting == "~" or setting.startswith("~/"):
            setting = home + setting[1:]
        return CacheChoice(setting, SETTING_ENV)
    base = environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    return CacheChoice(os.path.join(base, "jaxrlhf", "xla"), "default")


def enable(environ: Mapping[str, str] | None = None) -> CacheChoice:
    """Turns the persistent compilation cache on as :func:`choose` says; call it before the
    run's first compile (JAX reads the cache settings once, at the first compile that finds
    a directory). The cache settings the user set through JAX's own environment variables
    (``JAX_COMPILATION_CACHE_DIR``, ``JAX_COMPILATION_CACHE_MAX_SIZE``,
    ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``) are kept."""
    environ = os.environ if environ is None else environ
    choice = choose(environ, os.path.expanduser("~"))
    if choice.directory is None or choice.source == JAX_DIR_ENV:
        return choice  # off, or JAX configured itself from its own variables
    jax.config.update("jax_compilation_cache_dir", choice.directory)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in environ:
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return choice
