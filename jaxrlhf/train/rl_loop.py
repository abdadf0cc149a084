"""The RL host loop: iterate, log, summarise, plot and export (``algorithm: ppo | grpo``)."""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrlhf import losses
from jaxrlhf.config import RunConfig, dump_config, to_dict
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.hf_checkpoint import save_hf
from jaxrlhf.train.checkpointing import (
    RunCheckpointer,
    key_data,
    open_checkpointer,
    wrap_key,
)
from jaxrlhf.train.loop import CONFIG_FILE, RunResult, exported_model, run_directory
from jaxrlhf.train.metrics import (
    PLOT_FILE,
    MetricsLogger,
    Progress,
    plot_history,
    read_history,
)
from jaxrlhf.train.preemption import StopSignals, check_skips
from jaxrlhf.train.rl_trainer import RLTrainer, build_rl_trainer

logger = logging.getLogger(__name__)

PHASES = ("reshard", "generate", "reward", "score", "train")
SUMMARY_KEYS = (
    "reward/mean",
    "reward/task_mean",
    "kl/seq_mean",
    "response/length_mean",
    "time/iteration_s",
)
PLOT_KEYS = (
    "reward/mean",
    "reward/task_mean",
    "kl/seq_mean",
    "loss/policy",
    "response/length_mean",
)


def rl_snapshot(trainer: RLTrainer, skip_run: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The arrays and JSON metadata of an RL run's checkpoint: the policy's and critic's
    train states, the run key, the iteration, the prompt position and the KL coefficient."""
    arrays = {"policy": trainer.policy.state, "key": key_data(trainer.key, trainer.mesh)}
    if trainer.value is not None:
        arrays["value"] = trainer.value.state
    meta = {
        "step": trainer.iteration,
        "prompts": trainer.prompts.state(),
        "kl_coef": float(trainer.kl_state.kl_coef),
        "skip_run": skip_run,
        "config": to_dict(trainer.cfg),
    }
    return arrays, meta


def restore_rl(trainer: RLTrainer, ckpt: RunCheckpointer, step: int) -> int:
    """Puts checkpoint ``step`` into ``trainer``; returns its consecutive-skip count."""
    target, _ = rl_snapshot(trainer, 0)
    arrays, meta = ckpt.restore(step, target, to_dict(trainer.cfg))
    trainer.policy.state = arrays["policy"]
    if trainer.value is not None:
        trainer.value.state = arrays["value"]
    trainer.key = wrap_key(arrays["key"], trainer.key)
    trainer.iteration = int(meta["step"])
    trainer.prompts.restore(meta["prompts"])
    if isinstance(trainer.kl_state, losses.AdaptiveKLState):  # a fixed one follows the config
        trainer.kl_state = trainer.kl_state._replace(
            kl_coef=jnp.asarray(meta["kl_coef"], jnp.float32)
        )
    return int(meta["skip_run"])


def summarize(history: list[dict[str, Any]]) -> dict[str, float]:
    """End-of-run summary: reward over the first and last 10% of iterations, final KL, and
    the mean seconds per phase (compile-heavy first iteration excluded when there are more)."""
    rows = [r for r in history if "reward/mean" in r]
    if not rows:
        return {}
    k = max(1, len(rows) // 10)
    steady = rows[1:] or rows
    key = "reward/task_mean" if "reward/task_mean" in rows[0] else "reward/mean"
    out = {
        "reward/first_10pct": float(np.mean([r[key] for r in rows[:k]])),
        "reward/last_10pct": float(np.mean([r[key] for r in rows[-k:]])),
        "kl/seq_mean_last_10pct": float(np.mean([r["kl/seq_mean"] for r in rows[-k:]])),
        "kl/seq_mean_max": float(np.max([r["kl/seq_mean"] for r in rows])),
    }
    for phase in PHASES:
        out[f"time/{phase}_s"] = float(np.mean([r[f"time/{phase}_s"] for r in steady]))
    out["time/iteration_s"] = float(np.mean([r["time/iteration_s"] for r in steady]))
    return out


def format_summary(summary: dict[str, float]) -> str:
    total = summary["time/iteration_s"]
    phases = ", ".join(
        f"{p} {summary[f'time/{p}_s']:.3f}s ({100 * summary[f'time/{p}_s'] / total:.0f}%)"
        for p in PHASES
    )
    return (
        f"task reward {summary['reward/first_10pct']:.3f} (first 10%) -> "
        f"{summary['reward/last_10pct']:.3f} (last 10%); "
        f"KL/seq {summary['kl/seq_mean_last_10pct']:.3f} "
        f"(max {summary['kl/seq_mean_max']:.3f}); {total:.3f} s/iteration: {phases}"
    )


def run_rl(cfg: RunConfig, *, mesh: Mesh | None = None, source: str = "<config>"):
    """Runs ``cfg.train.steps`` RL iterations; writes config.yaml, metrics.jsonl,
    checkpoints/, metrics.png, summary.json and the final policy in Hugging Face format.

    Resumes, checkpoints and stops on signals like :func:`jaxrlhf.train.loop.run`.
    """
    main = jax.process_index() == 0
    run_dir = run_directory(cfg)
    ckpt, resume_step = open_checkpointer(cfg.checkpoint, run_dir)
    trainer = build_rl_trainer(cfg, mesh=mesh, source=source)
    history: list[dict[str, Any]] = []
    skip_run = 0
    if resume_step is not None:
        skip_run = restore_rl(trainer, ckpt, resume_step)
        history = read_history(run_dir, resume_step)
        logger.info("resumed from %s/%d", ckpt.directory, resume_step)
    if main:
        os.makedirs(run_dir, exist_ok=True)
        dump_config(cfg, os.path.join(run_dir, CONFIG_FILE), header=f"resolved from {source}")
    log = MetricsLogger(run_dir, cfg.logging, to_dict(cfg), enabled=main, history=history)
    progress = Progress(cfg.logging.progress, cfg.train.steps, cfg.algorithm, enabled=main)
    sampler_mesh = trainer.sampler.mesh
    logger.info(
        "%s: %s policy parameters, mesh %s%s, %d rollout rows per iteration",
        cfg.algorithm,
        f"{model_lib.param_count(trainer.policy.state.params):,}",
        dict(trainer.mesh.shape),
        "" if sampler_mesh is trainer.mesh else f" (sampler: {dict(sampler_mesh.shape)})",
        trainer.algo.rollout.rows,
    )
    steps = cfg.train.steps
    try:
        with StopSignals() as signals:
            for i in range(trainer.iteration, steps):
                row = log.log(i + 1, trainer.step())
                skipped = row.get("skipped", 0.0) + row.get("value/skipped", 0.0)
                skip_run = skip_run + 1 if skipped > 0 else 0
                check_skips(skip_run, i + 1, cfg.train.max_consecutive_skips, ckpt)
                if (i + 1) % cfg.train.log_every == 0 or i + 1 == steps:
                    progress.update(i + 1, row, SUMMARY_KEYS)
                else:
                    progress.update(i + 1)
                ckpt.after_step(
                    i + 1,
                    steps,
                    functools.partial(rl_snapshot, trainer, skip_run),
                    signals.requested(),
                )
            ckpt.save(steps, *rl_snapshot(trainer, skip_run), wait=True)
    finally:
        ckpt.close()
        progress.close()
        log.close()
    summary = summarize(log.history)
    if main and summary:
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(f"{cfg.algorithm} summary: {format_summary(summary)}")
    if cfg.checkpoint.export_hf:
        hf_dir, _ = exported_model(cfg)
        save_hf(
            hf_dir,
            trainer.model_cfg,
            trainer.policy.state.params,
            dtype=cfg.checkpoint.export_dtype,
        )
        if main:
            trainer.tokenizer.save_pretrained(hf_dir)
            logger.info("exported the policy in Hugging Face format to %s", hf_dir)
    if main and cfg.logging.plot:
        path = plot_history(log.history, PLOT_KEYS, os.path.join(run_dir, PLOT_FILE))
        if path:
            logger.info("wrote %s", path)
    return RunResult(run_dir=run_dir, history=log.history, trainer=trainer)
