"""The RL host loop: iterate, log, summarise, plot and export (``algorithm: ppo | grpo``)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrlhf.config import RunConfig, dump_config, to_dict
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.hf_checkpoint import save_hf
from jaxrlhf.train.loop import CONFIG_FILE, HF_DIR, RunResult
from jaxrlhf.train.metrics import PLOT_FILE, MetricsLogger, Progress, plot_history
from jaxrlhf.train.rl_trainer import build_rl_trainer

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
    metrics.png, summary.json and the final policy in Hugging Face format (hf/)."""
    trainer = build_rl_trainer(cfg, mesh=mesh, source=source)
    main = jax.process_index() == 0
    run_dir = cfg.output_dir or os.path.join("runs", cfg.algorithm)
    if main:
        os.makedirs(run_dir, exist_ok=True)
        dump_config(cfg, os.path.join(run_dir, CONFIG_FILE), header=f"resolved from {source}")
    log = MetricsLogger(run_dir, cfg.logging, to_dict(cfg), enabled=main)
    progress = Progress(cfg.logging.progress, cfg.train.steps, cfg.algorithm, enabled=main)
    logger.info(
        "%s: %s policy parameters, mesh %s, %d rollout rows per iteration",
        cfg.algorithm,
        f"{model_lib.param_count(trainer.policy.state.params):,}",
        dict(trainer.mesh.shape),
        trainer.algo.rollout.rows,
    )
    try:
        for i in range(cfg.train.steps):
            row = log.log(i + 1, trainer.step())
            if (i + 1) % cfg.train.log_every == 0 or i + 1 == cfg.train.steps:
                progress.update(i + 1, row, SUMMARY_KEYS)
            else:
                progress.update(i + 1)
    finally:
        progress.close()
        log.close()
    summary = summarize(log.history)
    if main and summary:
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(f"{cfg.algorithm} summary: {format_summary(summary)}")
    if cfg.checkpoint.export_hf:
        hf_dir = os.path.join(run_dir, HF_DIR)
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
