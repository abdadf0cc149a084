"""Orbax checkpoints of a whole run, and resuming from them.

A checkpoint is one Orbax step directory ``<directory>/<step>/`` with two items:

- ``state``: the arrays - every trained role's :class:`TrainState` (params, optimizer
  state, update counter) and the run's PRNG key (as raw ``uint32`` key data);
- ``meta``: JSON - the step, the data-iterator position, the KL controller, running metric
  sums, the consecutive-skip count and the resolved config.

Orbax writes a step into a temporary directory and renames it when complete, so a crash
during a save leaves the previous checkpoint as the newest usable one. Arrays are restored
straight into the shardings of the run being resumed, so a run saved on one mesh resumes on
any other. Frozen roles (the reference, a reward model) are not saved: they are rebuilt
from the config exactly as the first run built them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.models.safetensors_io import CheckpointError
from jaxrlhf.train.config import CheckpointConfig
from jaxrlhf.train.preemption import Preempted

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
# Config sections that must match between a checkpoint and the run resuming it: anything
# else (steps, learning rate, mesh, logging) may change on resume.
MUST_MATCH = ("algorithm", "model")


class NonFiniteStateError(RuntimeError):
    """Refused to save a checkpoint whose parameters are not all finite."""


def checkpoint_directory(cfg: CheckpointConfig, run_dir: str) -> str:
    """Where a run's checkpoints live: ``checkpoint.directory`` or ``<run_dir>/checkpoints``."""
    return os.path.abspath(cfg.directory or os.path.join(run_dir, CHECKPOINT_DIR))


def abstract_like(tree: Any) -> Any:
    """``ShapeDtypeStruct``s (with shardings) of ``tree``'s arrays: a restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


@jax.jit
def _finite(leaves: list[jax.Array]) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _all_finite(tree: Any) -> bool:
    """Whether every floating-point leaf of ``tree`` is finite: one program per set of
    devices the leaves live on (a placement's groups hold different roles' states, and one
    program cannot take arrays from disjoint device sets)."""
    by_devices: dict[Any, list[jax.Array]] = {}
    for x in jax.tree.leaves(tree):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            sharding = getattr(x, "sharding", None)
            # A mesh orders its devices: arrays on one device set in two orders are apart.
            key = getattr(sharding, "mesh", None) or frozenset(getattr(sharding, "device_set", ()))
            by_devices.setdefault(key, []).append(x)
    return all(bool(_finite(leaves)) for leaves in by_devices.values())


class RunCheckpointer:
    """Saves and restores one run's checkpoints (a thin layer over Orbax's manager).

    Args:
      directory: the checkpoint directory (created on the first save).
      cfg: interval, number kept and async saving.
    """

    def __init__(self, directory: str, cfg: CheckpointConfig) -> None:
        self.directory = directory
        self.cfg = cfg
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            enable_async_checkpointing=cfg.async_save,
            create=False,
        )
        try:
            self._manager = ocp.CheckpointManager(
                directory, item_names=("state", "meta"), options=options
            )
        except Exception as e:  # noqa: BLE001 - any Orbax failure is a bad directory here
            raise CheckpointError(
                f"{directory}: not a usable checkpoint directory: {_line(e)}"
            ) from None
        self.last_saved: int | None = self.latest()

    def latest(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        self._manager.reload()
        return self._manager.latest_step()

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def due(self, step: int) -> bool:
        """Whether the interval asks for a checkpoint after ``step``."""
        return bool(self.cfg.every) and step % self.cfg.every == 0

    def save(self, step: int, arrays: Any, meta: dict[str, Any], *, wait: bool = False) -> None:
        """Saves ``arrays`` (a pytree of jax arrays) and ``meta`` (JSON) as ``step``.

        Returns once the arrays are copied off the devices (the caller may then donate
        them); the files are written in the background unless ``wait`` or async saving is
        off. Refuses (``NonFiniteStateError``) when a float array is not finite.
        """
        if step == self.last_saved:
            if wait:
                self.wait()
            return
        if not _all_finite(arrays):
            raise NonFiniteStateError(
                f"step {step}: the run state has non-finite values; not saving a checkpoint "
                f"(the newest good one is step {self.last_saved} in {self.directory})"
            )
        os.makedirs(self.directory, exist_ok=True)
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(_jsonable(meta))
            ),
            force=True,
        )
        self.last_saved = step
        if wait:
            self.wait()
        logger.info("checkpoint: step %d -> %s", step, self.directory)

    def restore(
        self, step: int, target: Any, config: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Arrays of ``step`` placed like ``target`` (arrays or ``ShapeDtypeStruct``s with
        shardings), and its metadata.

        Args:
          step: the checkpoint to read.
          target: the arrays' structure, shapes, dtypes and shardings to restore into.
          config: this run's config (``to_dict``); checked against the saved one first
            (see :func:`check_compatible`).

        Raises:
          CheckpointError: the step is missing, incomplete, corrupted, from another model
            or algorithm, or shaped differently.
        """
        path = os.path.join(self.directory, str(step))
        try:
            meta = self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )["meta"]
        except Exception as e:  # noqa: BLE001 - Orbax raises many types
            raise CheckpointError(f"{path}: cannot read the checkpoint: {_line(e)}") from None
        if config is not None:
            check_compatible(meta.get("config", {}), config, path)
        try:
            out = self._manager.restore(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_like(target))),
            )
        except Exception as e:  # noqa: BLE001 - Orbax/TensorStore raise many types
            earlier = [s for s in self.steps() if s < step]
            hint = (
                f"; if it is damaged, delete it to resume from step {earlier[-1]}"
                if earlier
                else ""
            )
            raise CheckpointError(
                f"{path}: cannot restore the run state ({_line(e)}){hint}"
            ) from None
        return out["state"], dict(meta)

    def after_step(
        self,
        step: int,
        last_step: int,
        snapshot: Callable[[], tuple[Any, dict[str, Any]]],
        stop_signal: int | None,
    ) -> None:
        """What every training loop does after a step: save when the interval asks, and on a
        stop signal save, wait for the files and raise :class:`Preempted`. The final step is
        left to the loop (it saves once more after its last evaluation).

        Args:
          step: steps (RL: iterations) done.
          last_step: the run's last step.
          snapshot: builds ``(arrays, meta)``; called only when saving.
          stop_signal: the agreed stop signal (``StopSignals.requested()``), or None.
        """
        if step == last_step:
            return
        if stop_signal is not None:
            self.save(step, *snapshot(), wait=True)
            raise Preempted(stop_signal, step, self.directory)
        if self.due(step):
            self.save(step, *snapshot())

    def wait(self) -> None:
        """Blocks until a background save has finished writing."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finishes any background save and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.generic, jax.Array, np.ndarray)):
        return np.asarray(value).item()
    return value


def open_checkpointer(cfg: CheckpointConfig, run_dir: str) -> tuple[RunCheckpointer, int | None]:
    """The run's checkpointer and the step to resume from (None: start fresh).

    Applies ``cfg.resume``: ``auto`` resumes from the newest checkpoint if there is one,
    ``always`` requires one, ``never`` refuses a directory that already holds some.

    Raises:
      CheckpointError: one line naming the directory and what is wrong.
    """
    directory = checkpoint_directory(cfg, run_dir)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: checkpoint.directory exists and is not a directory")
    ckpt = RunCheckpointer(directory, cfg)
    latest = ckpt.latest() if os.path.isdir(directory) else None
    if latest is None and cfg.resume == "always":
        raise CheckpointError(
            f"{directory}: no checkpoint to resume from (--resume / checkpoint.resume=always)"
        )
    if latest is not None and cfg.resume == "never":
        raise CheckpointError(
            f"{directory}: already holds checkpoints (steps {ckpt.steps()}) and "
            "checkpoint.resume=never; resume (checkpoint.resume=auto) or choose another "
            "output_dir"
        )
    return ckpt, latest


def check_compatible(saved_config: dict[str, Any], config: dict[str, Any], path: str) -> None:
    """Raises CheckpointError when the checkpoint was written by a different algorithm or
    model; logs the other config fields that changed (allowed on resume)."""
    for section in MUST_MATCH:
        if saved_config.get(section) != config.get(section):
            raise CheckpointError(
                f"{path}: the checkpoint was written with a different `{section}` "
                f"({saved_config.get(section)!r}, this run: {config.get(section)!r}); "
                "use another output_dir or checkpoint.directory"
            )
    changed = sorted(_diff(saved_config, config))
    if changed:
        logger.info("resuming with changed config fields: %s", ", ".join(changed))


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def key_data(key: jax.Array, mesh: Mesh) -> jax.Array:
    """A typed PRNG key as raw ``uint32`` data replicated over ``mesh`` (what checkpoints
    store: Orbax saves only global arrays, and a key usually lives on one device)."""
    data = np.asarray(jax.device_get(jax.random.key_data(key)))
    return jax.device_put(data, NamedSharding(mesh, P()))


def wrap_key(data: jax.Array, like: jax.Array) -> jax.Array:
    """The inverse of :func:`key_data`, with ``like``'s PRNG implementation."""
    host = np.asarray(jax.device_get(data))  # back on the default device, like a fresh key
    return jax.random.wrap_key_data(host, impl=jax.random.key_impl(like))
