"""Host-side metrics of RL iterations: rollout statistics, model FLOPs and MFU, and the
end-of-run summary."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxrlhf.models import shared_prefix
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.train.rl_types import Rollout

if TYPE_CHECKING:
    from jaxrlhf.train.rl_programs import RLPrograms

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

# Peak dense bf16 FLOP/s per device, for the MFU estimate where the device is known.
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100": 312e12,
}


def device_peak_flops(device: jax.Device) -> float | None:
    """Peak FLOP/s of ``device`` if its kind is in :data:`PEAK_FLOPS` (None for CPUs)."""
    kind = getattr(device, "device_kind", "")
    return next((v for k, v in PEAK_FLOPS.items() if kind.startswith(k)), None)


def flops_per_token(cfg: ModelConfig) -> float:
    """Forward FLOPs per token: 2 x the matmul parameters (embedding lookups are free)."""
    d, f, n, k, h = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.kv_heads,
        cfg.dim_per_head,
    )
    per_layer = d * h * (2 * n + 2 * k) + d * f * (3 if cfg.gated_mlp else 2)
    return 2.0 * (cfg.num_layers * per_layer + d * cfg.vocab_size)


def rollout_metrics(rollout: Rollout, timings: dict[str, float]) -> dict[str, float]:
    """Reward and response statistics of a rollout, and the generation throughput."""
    m = {
        "reward/mean": float(rollout.scores.mean()),
        "reward/std": float(rollout.scores.std()),
        "response/length_mean": float(rollout.lengths.mean()),
        "response/stopped_frac": float(rollout.stopped.mean()),
        "throughput/generate_tok_s": float(rollout.lengths.sum())
        / max(timings["time/generate_s"], 1e-9),
    }
    if rollout.task_scores is not None:
        m["reward/task_mean"] = float(rollout.task_scores.mean())
    return m


def throughput_metrics(
    programs: RLPrograms, rollout: Rollout, timings: dict[str, float]
) -> dict[str, float]:
    """Model TFLOP/s of the iteration (and MFU where the device's peak is known).

    Model FLOPs (forward 2N per token, backward 4N) of the tokens each phase runs:
    generation (prefill + decode), scoring (one forward per scored model) and the update
    (policy and critic). Packed prompt groups run (P + nR) of every n(P + R) tokens
    (``rollout.shared_prefix``); a phase that packs sequences by their real lengths runs its
    packed slots, ``packing/score_slots`` and ``packing/update_slots`` (per epoch) in
    ``timings`` (``rollout.pack_sequences``).
    """
    rl, algo = programs.layout.rl, programs.algo
    n_rows, total_len = rollout.tokens.shape
    new = algo.rollout.max_new_tokens
    prompt = total_len - new
    seq_tokens = n_rows * total_len
    scored_models = (
        1  # the reference; policy and critic unless their update forwards stand in
        + (not rl.reuse_policy_forward)
        + (programs.value is not None and not rl.reuse_value_forward)
        + (programs.reward is not None)
    )
    fpt = flops_per_token(programs.model)
    n = algo.rollout.num_samples  # the sampler prefills each prompt once per group
    score_tokens = timings.get(
        "packing/score_slots",
        seq_tokens * shared_prefix.flops_fraction(prompt, new, rl.groups.score),
    )
    update_tokens = timings.get(
        "packing/update_slots",
        seq_tokens * shared_prefix.flops_fraction(prompt, new, rl.groups.update),
    )
    flops = (
        fpt * seq_tokens * shared_prefix.flops_fraction(prompt, new, n)
        + fpt * score_tokens * scored_models
        + 3 * fpt * update_tokens * algo.loss.epochs * (1 + (programs.value is not None))
    )
    seconds = timings["time/iteration_s"]
    out = {"throughput/model_tflops": flops / seconds / 1e12}
    peak = device_peak_flops(programs.mesh.devices.flat[0])
    if peak:  # over every device the phases use (the sampler may have a mesh of its own)
        devices = {*programs.mesh.devices.flat, *programs.sampler.mesh.devices.flat}
        out["throughput/mfu"] = flops / seconds / (peak * len(devices))
    return out


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
    """The summary as one line: task reward first -> last 10%, KL, seconds per phase."""
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
