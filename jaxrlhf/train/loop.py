"""The host loop, one for every algorithm: build the trainer, then step, log, evaluate,
checkpoint, resume and export.

``run(cfg)`` is what ``python -m jaxrlhf.train`` calls. ``build_trainer(cfg)`` returns the
trainer (supervised or RL) for notebooks and tests that drive steps themselves. The loop only
talks to a trainer through the protocol of :mod:`jaxrlhf.train.trainable`; metrics are summed
where the trainer returns them (on device for the supervised steps) and fetched on logging
steps only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrlhf.config import (
    RL_ALGORITHMS,
    RunConfig,
    RunLayout,
    config_files,
    dump_config,
    to_dict,
    validate,
)
from jaxrlhf.rewards import RewardError
from jaxrlhf.train.checkpointing import RunCheckpointer, open_checkpointer
from jaxrlhf.train.metrics import (
    PLOT_FILE,
    MetricsLogger,
    Progress,
    format_metrics,
    plot_history,
    read_history,
)
from jaxrlhf.train.preemption import (
    OutOfDeviceMemory,
    Preempted,
    StopSignals,
    TrainingDiverged,
    check_skips,
    first_line,
    is_out_of_memory,
    out_of_memory_message,
)
from jaxrlhf.train.rl_trainer import RLTrainer, build_rl_trainer
from jaxrlhf.train.run_dir import RunLock, check_output_dir
from jaxrlhf.train.supervised import (
    OBJECTIVES,
    SupervisedTrainer,
    build_supervised_trainer,
    objective_for,
)
from jaxrlhf.train.trainable import Trainable, add_metrics

logger = logging.getLogger(__name__)

TRAINERS = OBJECTIVES  # the supervised algorithms' objective factories
CONFIG_FILE = "config.yaml"
HF_DIR = "hf"
SUMMARY_FILE = "summary.json"


def run_directory(cfg: RunConfig) -> str:
    """Where a run writes its files: ``output_dir``, default ``runs/<algorithm>``."""
    return cfg.output_dir or os.path.join("runs", cfg.algorithm)


def exported_model(cfg: RunConfig) -> tuple[str, str]:
    """``(directory, head)`` of the Hugging Face model a run exports at its end (when
    ``checkpoint.export_hf``): the trained model, or the policy of an RL run."""
    if cfg.algorithm in RL_ALGORITHMS:
        head = "lm"
    else:  # ILQL exports its language model without the value and Q heads
        objective = objective_for(cfg)
        head = "lm" if objective.export_lm is not None else objective.head
    return os.path.join(run_directory(cfg), HF_DIR), head


def build_trainer(
    cfg: RunConfig,
    *,
    mesh: Mesh | None = None,
    source: str = "<config>",
    override_paths: Sequence[str] | Mapping[str, str] = (),
    layout: RunLayout | None = None,
) -> SupervisedTrainer | RLTrainer:
    """The trainer of ``cfg``'s algorithm, validated, loaded and jitted (see
    ``supervised.build_supervised_trainer`` and ``rl_trainer.build_rl_trainer``)."""
    build = build_rl_trainer if cfg.algorithm in RL_ALGORITHMS else build_supervised_trainer
    return build(cfg, mesh=mesh, source=source, override_paths=override_paths, layout=layout)


@dataclasses.dataclass
class RunResult:
    """What ``run`` leaves behind: the run directory, the logged rows and the trainer."""

    run_dir: str
    history: list[dict[str, Any]]
    trainer: Trainable

    def rows(self, key: str) -> list[tuple[int, float]]:
        """``(step, value)`` of every logged row that has ``key``."""
        return [(r["step"], r[key]) for r in self.history if key in r]


@dataclasses.dataclass
class _Window:
    """The metrics summed since the last logged row, and the consecutive-skip counters."""

    running: dict[str, Any] | None = None
    count: int = 0
    skip_run: int = 0
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def meta(self) -> dict[str, Any]:
        host = {} if self.running is None else jax.device_get(self.running)
        return {
            "running": {k: [float(v), str(np.asarray(v).dtype)] for k, v in host.items()},
            "running_count": self.count,
            "skip_run": self.skip_run,
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> _Window:
        """The window a checkpoint saved (RL checkpoints of earlier versions saved only
        ``skip_run``: an empty window)."""
        saved = meta.get("running", {})
        running = {k: np.asarray(v, dtype) for k, (v, dtype) in saved.items()}
        count = int(meta.get("running_count", 0))
        return cls(running or None, count, int(meta.get("skip_run", 0)))


def _snapshot(trainer: Trainable, window: _Window) -> tuple[dict[str, Any], dict[str, Any]]:
    arrays, meta = trainer.snapshot()
    return arrays, {**meta, **window.meta(), "config": to_dict(trainer.cfg)}


def _restore(trainer: Trainable, ckpt: RunCheckpointer, step: int) -> _Window:
    target, _ = trainer.snapshot()
    arrays, meta = ckpt.restore(step, target, to_dict(trainer.cfg))
    trainer.restore(arrays, meta)
    return _Window.from_meta(meta)


def _finish(trainer: Trainable, run_dir: str, history: list[dict[str, Any]], main: bool) -> None:
    """The end-of-run summary, export and plot."""
    cfg = trainer.cfg
    summary = trainer.summary(history)
    if main and summary:
        with open(os.path.join(run_dir, SUMMARY_FILE), "w") as f:
            json.dump(summary, f, indent=2)
        print(f"{cfg.algorithm} summary: {trainer.format_summary(summary)}")
    if cfg.checkpoint.export_hf:
        hf_dir, _ = exported_model(cfg)
        trainer.export(hf_dir)
        if main:
            logger.info("exported the trained model in Hugging Face format to %s", hf_dir)
    timeline = getattr(trainer, "timeline", None)
    if main and timeline is not None:
        logger.info("wrote %s", timeline.write(run_dir, plot=cfg.logging.plot))
    if main and cfg.logging.plot:
        title = f"{cfg.algorithm}: {os.path.basename(os.path.normpath(run_dir))}"
        path = plot_history(
            history, trainer.plot_keys, os.path.join(run_dir, PLOT_FILE), title=title
        )
        if path:
            logger.info("wrote %s", path)


@dataclasses.dataclass
class _Doing:
    """What the training loop is doing, for an out-of-memory message ("in step 4")."""

    what: str = "before the first step"


@contextlib.contextmanager
def _saved_on_stop(trainer: Trainable, ckpt: RunCheckpointer, window: _Window):
    """Saves the last good state when a run stops on bad input (a reward function that
    fails or returns non-finite scores), diverges (too many skipped updates) or runs out of
    device memory, then lets the error go on (out of memory as :class:`OutOfDeviceMemory`,
    one line saying what the loop was doing: the yielded :class:`_Doing`). A step that
    raises leaves the trainer as it was before it (its data is drawn again), and a skipped
    update changes nothing. What :func:`_save_last_good` cannot save, the line says."""
    doing = _Doing()
    try:
        yield doing
    except (RewardError, TrainingDiverged) as e:
        where = _save_last_good(trainer, ckpt, window, every_process=True)
        raise type(e)(f"{e} The last good state: {where}.") from e
    except jax.errors.JaxRuntimeError as e:
        if not is_out_of_memory(e):
            raise
        where = _save_last_good(trainer, ckpt, window, every_process=False)
        message = out_of_memory_message(e, doing.what)
        raise OutOfDeviceMemory(f"{message} The last good state: {where}.") from e


def _save_last_good(
    trainer: Trainable, ckpt: RunCheckpointer, window: _Window, *, every_process: bool
) -> str:
    """Saves the trainer's state unless its step is saved already, and says where the last
    good state is. Nothing is saved from a state a failed step consumed (a donated buffer
    deleted), nor with several processes when the error may not have reached them all
    (``every_process`` False: a save is collective); a save that fails itself is told."""
    step = trainer.steps_done
    arrays, meta = _snapshot(trainer, window)
    consumed = any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(arrays))
    alone = not every_process and jax.process_count() > 1
    failed = ""
    if step > 0 and step not in ckpt.steps() and not consumed and not alone:
        try:
            ckpt.save(step, arrays, meta, wait=True)
        except Exception as e:  # noqa: BLE001  out of memory again, say: tell it
            failed = f" (saving step {step} failed: {first_line(e)})"
    if ckpt.last_saved is not None:
        return f"checkpoint {ckpt.last_saved} in {ckpt.directory}{failed}"
    if step == 0:
        return "nothing to save (no step had finished)"
    return f"none (no checkpoint had been saved){failed}"


def _train(
    trainer: Trainable,
    ckpt: RunCheckpointer,
    log: MetricsLogger,
    progress: Progress,
    window: _Window,
) -> None:
    """Steps from ``trainer.steps_done`` to ``train.steps``: logs a row every ``log_window``
    steps (the window's mean), shows a progress line every ``train.log_every``, evaluates
    every ``train.eval_every``, checkpoints when due."""
    t = trainer.cfg.train
    first, every = trainer.steps_done, trainer.log_window
    eval_keys = tuple(f"eval/{k}" for k in trainer.summary_keys)

    def evaluate(step: int) -> None:
        metrics = trainer.evaluate()
        if metrics:
            row = log.log(step, metrics)
            progress.write(f"eval step {step} | {format_metrics(row, eval_keys)}")

    with StopSignals() as signals, _saved_on_stop(trainer, ckpt, window) as doing:
        if first == 0:
            doing.what = "in the evaluation before the first step"
            evaluate(0)
        window.start = time.perf_counter()  # the first row times steps, not the evaluation
        # Counts of consecutive steps with skipped updates (the longest run since the last
        # check), kept where the trainer's metrics live, so checking them needs no per-step
        # host sync.
        skips = worst = window.skip_run
        for i in range(first, t.steps):
            doing.what = f"in step {i + 1}"
            out = trainer.step()
            doing.what = f"after step {i + 1}"
            skips = jnp.where(out.skipped > 0, skips + 1, 0)
            worst = jnp.maximum(worst, skips)
            window.running = add_metrics(window.running, out.metrics)
            window.count += 1
            done = i + 1
            row = None
            if done % every == 0 or done == t.steps:
                host = jax.device_get(window.running)
                row = {k: float(v) / window.count for k, v in host.items()}
                row["time/step_s"] = (time.perf_counter() - window.start) / window.count
                row = log.log(done, {**row, **trainer.status()})
                window.running, window.count, window.start = None, 0, time.perf_counter()
            if row is not None and (done % t.log_every == 0 or done == t.steps):
                progress.update(done, row, trainer.summary_keys)
            else:
                progress.update(done)
            if done % every == 0 or ckpt.due(done) or done == t.steps:
                check_skips(int(worst), done, t.max_consecutive_skips)
                window.skip_run = int(skips)
                worst = skips
            if t.eval_every and done % t.eval_every == 0 and done != t.steps:
                doing.what = f"in the evaluation after step {done}"
                evaluate(done)
                doing.what = f"after step {done}"
            ckpt.after_step(
                done, t.steps, functools.partial(_snapshot, trainer, window), signals.requested()
            )
        if first < t.steps:
            doing.what = "in the final evaluation"
            evaluate(t.steps)
        doing.what = f"saving the final checkpoint {t.steps}"
        ckpt.save(t.steps, *_snapshot(trainer, window), wait=True)


def run(
    cfg: RunConfig,
    *,
    mesh: Mesh | None = None,
    source: str = "<config>",
    override_paths: Sequence[str] | Mapping[str, str] = (),
) -> RunResult:
    """Trains as configured; writes config.yaml, metrics.jsonl, checkpoints/, metrics.png,
    summary.json (RL) and hf/.

    Validates the config once (``config.validate``), evaluates on the held-out split (where
    there is one) before the first step, every ``train.eval_every`` steps and after the last
    one; resumes from the newest checkpoint as ``checkpoint.resume`` says; saves every
    ``checkpoint.every`` steps, at the end and on SIGTERM/SIGINT. ``source`` and
    ``override_paths`` (as ``config.from_dict`` takes them) say where fields came from, for
    messages and the header of the saved config.

    Raises:
      ConfigError, DataError, CheckpointError, MeshError, RewardError: one-line user errors.
      Preempted: a signal stopped the run (after saving a checkpoint).
      TrainingDiverged: ``train.max_consecutive_skips`` non-finite updates in a row.
      OutOfDeviceMemory: a step ran out of device memory (after saving the last good state).
      These last three come without tracebacks into the run: whoever keeps one (a notebook
      keeps the last error) does not keep the trainer's device memory.
    """
    layout = validate(
        cfg,
        mesh=mesh,
        source=source,
        override_paths=override_paths,
    )
    run_dir = run_directory(cfg)
    check_output_dir(run_dir)
    with RunLock(run_dir):
        files = config_files(source, override_paths)
        try:
            return _run(
                cfg,
                layout,
                run_dir,
                mesh=mesh,
                source=source,
                override_paths=override_paths,
                files=files,
            )
        except (OutOfDeviceMemory, TrainingDiverged, Preempted) as e:
            stop = e
    raise _without_frames(stop)


def _without_frames(error: BaseException) -> BaseException:
    """``error`` with its traceback, and those of the errors chained to it, dropped; the
    messages and the chain stay. Raised from :func:`run`, a stop that saved the run's state
    (out of memory, diverged, preempted) then holds none of the run's frames: a notebook keeps
    the last error it showed (IPython's ``sys.last_value``), and through those frames it would
    keep the trainer and every device buffer, so a retry with smaller sizes would run out of
    memory again. Other errors keep their tracebacks: they point at a bug."""
    pending, seen = [error], set()
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        pending += [e.__cause__, e.__context__]
    return error


def _run(
    cfg: RunConfig,
    layout: RunLayout,
    run_dir: str,
    *,
    mesh: Mesh | None,
    source: str,
    override_paths: Sequence[str] | Mapping[str, str],
    files: str,
) -> RunResult:
    """:func:`run` once the run directory is held (``files``: every config file it merged)."""
    main = jax.process_index() == 0
    ckpt, resume_step = open_checkpointer(cfg.checkpoint, run_dir)
    trainer = build_trainer(
        cfg, mesh=mesh, source=source, override_paths=override_paths, layout=layout
    )
    history: list[dict[str, Any]] = []
    window = _Window()
    if resume_step is not None:
        window = _restore(trainer, ckpt, resume_step)
        history = read_history(run_dir, resume_step)
        logger.info("resumed from %s/%d", ckpt.directory, resume_step)
    if main:
        os.makedirs(run_dir, exist_ok=True)
        dump_config(cfg, os.path.join(run_dir, CONFIG_FILE), header=f"resolved from {files}")
    log = MetricsLogger(run_dir, cfg.logging, to_dict(cfg), enabled=main, history=history)
    logger.info("%s", trainer.describe())
    if trainer.steps_done >= cfg.train.steps:
        logger.info(
            "the run is complete (step %d of %d); nothing to train",
            trainer.steps_done,
            cfg.train.steps,
        )
    progress = Progress(cfg.logging.progress, cfg.train.steps, cfg.algorithm, enabled=main)
    try:
        _train(trainer, ckpt, log, progress, window)
    finally:
        ckpt.close()
        progress.close()
        log.close()
    _finish(trainer, run_dir, log.history, main)
    return RunResult(run_dir=run_dir, history=log.history, trainer=trainer)
