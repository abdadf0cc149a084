"""The protocol between the host loop and a trainer (supervised or RL).

The loop (``jaxrlhf.train.loop.run``) owns everything that is the same for every algorithm:
resume, checkpoints and preemption, metric windows, logging and plots, the divergence check,
evaluation cadence and the final export. A trainer owns its state and its programs and
exposes only what the loop needs.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax

from jaxrlhf.config import RunConfig


class StepOutput(NamedTuple):
    """One step's results.

    Attributes:
      metrics: flat dict of scalars (device arrays, summed on device between logs, or host
        floats).
      skipped: updates of this step dropped for a non-finite loss or gradient (device or
        host scalar); the loop stops the run after ``train.max_consecutive_skips`` steps in a
        row with skips.
    """

    metrics: dict[str, Any]
    skipped: Any


class Trainable(Protocol):
    """What the host loop drives.

    Attributes:
      cfg: the run config.
      steps_done: steps done so far (optimizer updates, or RL iterations).
      log_window: steps each logged row averages (``train.log_every``; 1: every step).
      summary_keys: metrics shown in progress lines.
      plot_keys: metrics drawn in ``metrics.png``.
    """

    cfg: RunConfig
    steps_done: int
    log_window: int
    summary_keys: tuple[str, ...]
    plot_keys: tuple[str, ...]

    def describe(self) -> str:
        """One line for the log when the run starts."""

    def step(self) -> StepOutput:
        """One step (an update, or an RL iteration); advances ``steps_done``."""

    def status(self) -> dict[str, float]:
        """Host values that describe the run as it is now (the data ``epoch``, the ``lr`` of
        the last update), added to every logged row in place of the window's means."""

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (``eval/`` keys), or {} when there is nothing to evaluate."""

    def snapshot(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(arrays, meta)`` of a checkpoint: pytrees for Orbax, JSON metadata (``step``
        included). The arrays also serve as the restore target."""

    def restore(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        """Puts a checkpoint's arrays and metadata back."""

    def export(self, hf_dir: str) -> None:
        """Writes the trained model (and tokenizer) in Hugging Face format."""

    def summary(self, history: list[dict[str, Any]]) -> dict[str, float]:
        """An end-of-run summary of the logged rows ({}: none)."""

    def format_summary(self, summary: dict[str, float]) -> str:
        """The summary as one line."""


def add_metrics(total: dict[str, Any] | None, metrics: dict[str, Any]) -> dict[str, Any]:
    """Elementwise sum of two metric dicts (device arrays or floats)."""
    if total is None:
        return dict(metrics)
    return jax.tree.map(lambda a, b: a + b, total, metrics)
