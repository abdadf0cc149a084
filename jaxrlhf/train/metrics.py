"""Metric sinks (JSONL always; TensorBoard and W&B when configured and installed), the
progress display and the end-of-run plot.

None of tensorboard, wandb, rich, tqdm or matplotlib is a dependency: each is imported only
when asked for, and a missing one is skipped with a one-line note, never an error.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrlhf.train.config import LoggingConfig

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"


def _scalar(value: Any) -> float | int:
    value = value.item() if hasattr(value, "item") else value
    return value if isinstance(value, int) else float(value)


class MetricsLogger:
    """Writes one JSON object per logged step to ``run_dir/metrics.jsonl`` (and optional
    TensorBoard / W&B). Only the main process writes."""

    def __init__(
        self,
        run_dir: str,
        cfg: LoggingConfig,
        run_config: Mapping[str, Any],
        enabled: bool = True,
        history: Sequence[dict[str, Any]] = (),
    ) -> None:
        """``history``: rows of an earlier run this one resumes (rewritten to the file first;
        not re-sent to TensorBoard or W&B)."""
        self.enabled = enabled
        self.history: list[dict[str, Any]] = list(history)
        self._tb = self._wandb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self._file = open(os.path.join(run_dir, METRICS_FILE), "w", encoding="utf-8")
        for row in self.history:
            self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if cfg.tensorboard:
            self._tb = _tensorboard_writer(os.path.join(run_dir, "tensorboard"))
        if cfg.wandb:
            try:
                import wandb
            except ImportError:
                logger.warning("logging.wandb: wandb is not installed; skipping W&B logging")
            else:
                self._wandb = wandb.init(
                    project=cfg.wandb_project, dir=run_dir, config=dict(run_config)
                )

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        row = {"step": int(step), **{k: _scalar(v) for k, v in metrics.items()}}
        self.history.append(row)
        if not self.enabled:
            return row
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in row.items():
                if key != "step":
                    self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)
        return row

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


CORRUPT_SUFFIX = ".corrupt"


def read_history(run_dir: str, last_step: int) -> list[dict[str, Any]]:
    """The rows of ``run_dir/metrics.jsonl`` up to ``last_step``: a resumed run's past (rows
    an interrupted run logged after its last checkpoint belong to steps it will log again).

    Every intact row is kept, wherever a damaged one sits. Lines that are not a JSON object
    with an integer ``step`` (a torn last line after a kill mid-write, a damaged disk, a
    hand edit) are set aside, appended to ``metrics.jsonl.corrupt`` with their line numbers,
    and a warning says how many; the caller rewrites ``metrics.jsonl`` from the rows kept.
    """
    path = os.path.join(run_dir, METRICS_FILE)
    rows: list[dict[str, Any]] = []
    damaged: list[str] = []
    if not os.path.exists(path):
        return rows
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                damaged.append(f"{number}\t{line.rstrip()}\n")
            elif row["step"] <= last_step:
                rows.append(row)
    if damaged:
        aside = path + CORRUPT_SUFFIX
        with open(aside, "a", encoding="utf-8") as f:
            f.writelines(damaged)
        logger.warning(
            "%s: %d damaged line(s) set aside in %s (line number, then the line); the %d "
            "intact row(s) up to step %d are kept",
            path,
            len(damaged),
            aside,
            len(rows),
            last_step,
        )
    return rows


def _tensorboard_writer(directory: str) -> Any:
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            logger.warning(
                "logging.tensorboard: neither tensorboardX nor tensorboard is installed; "
                "skipping TensorBoard logging"
            )
            return None
    return SummaryWriter(directory)


def format_metrics(metrics: Mapping[str, Any], keys: Sequence[str]) -> str:
    parts = []
    for key in keys:
        if key in metrics:
            value = metrics[key]
            parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    return " | ".join(parts)


class Progress:
    """A progress bar with the key metrics (rich or tqdm on a terminal), or plain lines."""

    def __init__(self, mode: str, total: int, description: str, enabled: bool = True) -> None:
        self.total = total
        self.description = description
        self.mode = self._choose(mode) if enabled else "none"
        self._start = time.perf_counter()
        self._bar: Any = None
        if self.mode == "rich":
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(bar_width=24),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[metrics]}"),
            )
            self._bar.start()
            self._task = self._bar.add_task(description, total=total, metrics="")
        elif self.mode == "tqdm":
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=description, dynamic_ncols=True)

    @staticmethod
    def _choose(mode: str) -> str:
        if mode != "auto":
            return mode
        if not sys.stderr.isatty():
            return "plain"
        for name in ("rich", "tqdm"):
            try:
                __import__(name)
                return name
            except ImportError:
                continue
        return "plain"

    def update(self, step: int, metrics: Mapping[str, Any] | None = None, keys=()) -> None:
        """Called after update ``step`` (1-based); ``metrics`` on logging steps only."""
        text = format_metrics(metrics, keys) if metrics else None
        if self.mode == "rich":
            fields = {"metrics": text} if text is not None else {}
            self._bar.update(self._task, completed=step, **fields)
        elif self.mode == "tqdm":
            self._bar.n = step
            if text is not None:
                self._bar.set_postfix_str(text, refresh=False)
            self._bar.refresh()
        elif self.mode == "plain" and text is not None:
            elapsed = time.perf_counter() - self._start
            width = len(str(self.total))
            print(
                f"{self.description} step {step:>{width}}/{self.total} | {text} | {elapsed:.1f}s",
                flush=True,
            )

    def write(self, line: str) -> None:
        """A line that does not disturb the bar (eval results, notes)."""
        if self.mode == "rich":
            self._bar.console.print(line, markup=False, highlight=False)
        elif self.mode == "tqdm":
            self._bar.write(line)
        elif self.mode == "plain":
            print(line, flush=True)

    def close(self) -> None:
        if self.mode in ("rich", "tqdm"):
            self._bar.close() if self.mode == "tqdm" else self._bar.stop()


def plot_history(
    history: Sequence[Mapping[str, Any]],
    keys: Sequence[str],
    path: str,
    *,
    title: str | None = None,
) -> str | None:
    """Writes a PNG with one panel per key (train and ``eval/`` curves). Returns the path,
    or None when matplotlib is not installed (logged) or there is nothing to plot.

    Args:
      history: logged rows, each with a ``step``.
      keys: metric names, one panel each; a key with no value in any row is left out.
      path: where to write the PNG.
      title: shown above the panels, e.g. the run's name; None for none.
    """
    try:
        fig = history_figure(history, keys, title=title)
    except ImportError:  # matplotlib is the only import there
        logger.info("plot skipped: matplotlib is not installed (metrics are in %s)", METRICS_FILE)
        return None
    if fig is None:
        return None
    fig.savefig(path, dpi=100)
    return path


def history_figure(
    history: Sequence[Mapping[str, Any]], keys: Sequence[str], *, title: str | None = None
) -> Any:
    """The matplotlib Figure that :func:`plot_history` saves, or None with nothing to plot.

    Each panel is titled and y-labelled with its key, x-labelled ``step``, and holds a
    ``train`` line and, when logged, an ``eval`` line with markers. Needs matplotlib.
    """
    # A Figure on its own Agg canvas: pyplot's global backend (a notebook's) is untouched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [k for k in keys if any(k in row or f"eval/{k}" in row for row in history)]
    if not panels:
        return None
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(4.5 * cols, 3.2 * rows + (0.4 if title else 0.0)))
    FigureCanvasAgg(fig)
    axs = fig.subplots(rows, cols, squeeze=False)
    for ax, key in zip(axs.flat, panels, strict=False):
        for name, label in ((key, "train"), (f"eval/{key}", "eval")):
            points = [(r["step"], r[name]) for r in history if name in r]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o" if label == "eval" else None, label=label)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.legend()
    for ax in list(axs.flat)[len(panels) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
