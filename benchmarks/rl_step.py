"""Workloads R1 (GRPO step) and R2 (PPO step) of shared/bench/WORKLOADS.md.

    python benchmarks/rl_step.py                          # R1 and R2 on bench-S
    python benchmarks/rl_step.py --models bench-s bench-m --steps 5

R1: 8 prompts x 4 samples = 32 sequences, 64 random prompt tokens, 64 new tokens (no early
stop), a cheap programmatic reward, reference log-probs, one AdamW update (lr 1e-6) of the
policy over the 32 sequences in one micro-batch, KL beta 0.04 (k3 loss term).
R2: R1 plus a critic and a reward model of the same architecture (random weights, loaded
from a Hugging Face directory like a real one), GAE (gamma 1, lambda 0.95), one epoch, one
micro-batch. Metric: seconds per full iteration, median over the timed iterations after one
warm-up (compile) iteration, with the per-phase split the trainer reports, the process's
median CPU seconds per iteration and the highest 1-minute load average seen (other jobs share
this machine's cores: trust wall times taken at a load below ~2.5).

The same step in plain PyTorch + transformers (benchmarks/pytorch_rl.py: what TRL and
OpenRLHF run per step, without their overhead) runs in the same process on the same machine,
its iterations alternating with jaxrlhf's, so the ratio (PyTorch seconds / jaxrlhf seconds,
median of the per-iteration ratios) holds whatever the machine; ``--skip-pytorch`` leaves it
out. The issue's targets (R1 <= 0.95 s, R2 <= 1.4 s on the first benchmark VM) were about
half of the PyTorch stacks' time there: a ratio of 2.

``--cpu-devices 2`` splits the host into two JAX CPU devices and runs each workload twice:
placement ``one`` (everything on device 0, the second idle) and ``split`` (training on
device 0, the sampler on a data-parallel mesh over both; see docs/sharding.md,
"Placement")::

    python benchmarks/rl_step.py --cpu-devices 2
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
import types

import jax
import numpy as np
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrlhf import platform as jaxrlhf_platform  # noqa: E402
from jaxrlhf.config import load_config  # noqa: E402
from jaxrlhf.models import model as model_lib  # noqa: E402
from jaxrlhf.models.config import ModelConfig  # noqa: E402
from jaxrlhf.models.hf_checkpoint import save_hf  # noqa: E402
from jaxrlhf.train.rl_metrics import PHASES  # noqa: E402
from jaxrlhf.train.rl_trainer import build_rl_trainer  # noqa: E402

MODELS = {"bench-s": "bench_s", "bench-m": "bench_m"}
PLACEMENTS = {
    "all": {},  # every phase on the whole mesh (one device unless --cpu-devices)
    "one": {"train_devices": 1},  # every phase on device 0
    "split": {"train_devices": 1, "generate_mesh": {"data": -1, "fsdp": 1, "tensor": 1}},
}
PROMPTS, SAMPLES, PROMPT_LEN, NEW_TOKENS = 8, 4, 64, 64


def cheap_reward(prompts: list[str], completions: list[str]) -> np.ndarray:
    """A cheap programmatic reward: the fraction of completion characters that are digits."""
    return np.asarray([sum(c.isdigit() for c in s) / max(len(s), 1) for s in completions])


class RandomPrompts:
    """Endless [8, 64] batches of random prompt tokens (no padding), all from one empty
    record (the reward function reads no columns)."""

    dataset = types.SimpleNamespace(columns=lambda index, exclude=(): {})

    def __init__(self, vocab: int, seed: int = 0):
        self.seed, self.vocab, self.batches = seed, vocab, 0
        self.rng = np.random.default_rng(seed)

    def state(self) -> dict[str, int]:
        """Where the stream is (the trainer keeps it with each rollout it launches)."""
        return {"batches": self.batches}

    def restore(self, state: dict[str, int]) -> None:
        self.rng = np.random.default_rng(self.seed)
        for _ in range(state["batches"]):
            self.rng.integers(4, self.vocab, (PROMPTS, PROMPT_LEN))
        self.batches = state["batches"]

    def __next__(self) -> dict[str, np.ndarray]:
        self.batches += 1
        tokens = self.rng.integers(4, self.vocab, (PROMPTS, PROMPT_LEN)).astype(np.int32)
        index = np.zeros(PROMPTS, np.int32)
        return {"tokens": tokens, "mask": np.ones_like(tokens, bool), "index": index}


def _config(
    workload: str,
    preset: str,
    rm_dir: str | None,
    out: str,
    placement: str = "all",
    model: dict | None = None,
):
    """The workload's run config, written to ``out/{workload}.yaml`` and loaded; ``model``
    adds fields to its model section (e.g. ``{"dtype": "bfloat16"}`` on an accelerator)."""
    algo = "grpo" if workload == "R1" else "ppo"
    section = {
        "rollout": {
            "prompts_per_step": PROMPTS,
            "num_samples": SAMPLES,
            "max_new_tokens": NEW_TOKENS,
            "stop_at_eos": False,
        },
        "loss": {
            "epochs": 1,
            "num_minibatches": 1,
            "kl_coef": 0.04,
            "kl_mode": "loss",
            "kl_estimator": "k3",
        },
    }
    if algo == "grpo":
        section["reward"] = {"function": "benchmarks.rl_step.cheap_reward"}
    else:
        section.update(reward={"function": None, "model_dir": rm_dir}, gamma=1.0, lam=0.95)
    raw = {
        "algorithm": algo,
        "output_dir": out,
        "model": {"preset": preset, **(model or {})},
        "data": {
            "train": "builtin:sort",
            "max_length": PROMPT_LEN + NEW_TOKENS,
            "max_prompt_length": PROMPT_LEN,
            "builtin_size": 64,
            "eval_size": 0,
        },
        "mesh": {"data": 1, "fsdp": -1, "tensor": 1},
        "placement": PLACEMENTS[placement],
        "optimizer": {"lr": 1e-6, "schedule": "constant"},
        "train": {"steps": 1},
        algo: section,
    }
    path = os.path.join(out, f"{workload}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    return load_config(path, [])


def run(
    workload: str,
    model: str,
    steps: int,
    tmp: str,
    pytorch: bool,
    placement: str = "all",
    model_fields: dict | None = None,
) -> dict[str, float]:
    """One workload's timed iterations; ``model`` is a name of :data:`MODELS` or a
    ``ModelConfig`` preset, ``model_fields`` extra model-section fields (dtypes)."""
    preset = MODELS.get(model, model)
    rm_dir = None
    if workload == "R2":
        rm_dir = os.path.join(tmp, f"rm_{preset}")
        if not os.path.exists(rm_dir):
            cfg = getattr(ModelConfig, preset)()
            save_hf(
                rm_dir, cfg, model_lib.init_params(cfg, jax.random.key(1), "scalar"), head="scalar"
            )
    trainer = build_rl_trainer(_config(workload, preset, rm_dir, tmp, placement, model_fields))
    trainer.prompts = RandomPrompts(trainer.model_cfg.vocab_size)
    trainer.task_fn = None  # the built-in task reward does not apply to random prompts
    start = time.perf_counter()
    trainer.step()  # warm-up: compiles every phase
    compile_s = time.perf_counter() - start
    baseline = None
    if pytorch:
        from benchmarks.pytorch_rl import TorchRLStep

        cfg = trainer.model_cfg
        baseline = TorchRLStep(
            cfg, model_lib.init_params(cfg, jax.random.key(0)), workload, SAMPLES, NEW_TOKENS, 2
        )
        torch_prompts = RandomPrompts(cfg.vocab_size, seed=1)
        baseline.step(next(torch_prompts)["tokens"], seed=0)  # warm-up
    rows, cpu_s, torch_rows = [], [], []
    load_start = os.getloadavg()[0]
    for i in range(steps):
        # Alternate which framework goes first, so both see the same drift in machine speed.
        if baseline is not None and i % 2:
            torch_rows.append(baseline.step(next(torch_prompts)["tokens"], seed=i + 1))
        cpu = time.process_time()
        rows.append(trainer.step().metrics)
        cpu_s.append(time.process_time() - cpu)
        if baseline is not None and not i % 2:
            torch_rows.append(baseline.step(next(torch_prompts)["tokens"], seed=i + 1))
    out = {
        "compile_s": compile_s,
        "step_s": float(np.median([r["time/iteration_s"] for r in rows])),
        # CPU seconds of this process (all threads): steadier than wall time when other jobs
        # share the cores, and equal to it when XLA runs the step on one thread.
        "cpu_s": float(np.median(cpu_s)),
        "load": max(load_start, os.getloadavg()[0]),
    }
    for phase in PHASES:
        out[phase] = float(np.median([r[f"time/{phase}_s"] for r in rows]))
    out["generate_tok_s"] = float(np.median([r["throughput/generate_tok_s"] for r in rows]))
    if torch_rows:
        for key in ("total", "generate", "score", "train"):
            out[f"torch_{key}"] = float(np.median([r[key] for r in torch_rows]))
        ratios = [t["total"] / r["time/iteration_s"] for t, r in zip(torch_rows, rows, strict=True)]
        out["ratio"] = float(np.median(ratios))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["bench-s"], choices=sorted(MODELS))
    parser.add_argument("--workloads", nargs="+", default=["R1", "R2"], choices=["R1", "R2"])
    parser.add_argument("--steps", type=int, default=5, help="timed iterations after warm-up")
    parser.add_argument(
        "--skip-pytorch", action="store_true", help="leave out the PyTorch + transformers run"
    )
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=1,
        help="JAX CPU devices to split the host into (placement.cpu_devices); with 2 or more, "
        "each workload runs with placements 'one' and 'split'",
    )
    args = parser.parse_args()
    if args.cpu_devices < 1:
        parser.error("--cpu-devices must be >= 1")
    if args.cpu_devices > 1 and jaxrlhf_platform.set_cpu_devices(args.cpu_devices) is not None:
        parser.error("--cpu-devices: JAX has already started")  # set before JAX starts
    placements = ["all"] if args.cpu_devices == 1 else ["one", "split"]
    host = jaxrlhf_platform.reuse_freed_host_memory()  # as `python -m jaxrlhf.train` on CPU
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    print(
        f"# {time.strftime('%Y-%m-%d')}, jax {jax.__version__}, {jax.device_count()} "
        f"{jax.default_backend()} device(s), {os.cpu_count()} cores, {cpu}; "
        f"host memory reuse: {host or 'on'}"
    )
    header = (
        "workload",
        "model",
        "placement",
        "s/step",
        *PHASES,
        "gen tok/s",
        "compile s",
        "cpu s/step",
        "load",
        "pytorch s/step (generate / score / train)",
        "pytorch / jaxrlhf",
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for workload in args.workloads:
                for placement in placements:
                    r = run(workload, model, args.steps, tmp, not args.skip_pytorch, placement)
                    print(
                        "| " + " | ".join(_cells(r, workload, model, placement)) + " |", flush=True
                    )


def _cells(r: dict[str, float], workload: str, model: str, placement: str) -> list[str]:
    return [
        workload,
        model,
        placement,
        f"{r['step_s']:.3f}",
        *(f"{r[p]:.3f}" for p in PHASES),
        f"{r['generate_tok_s']:.0f}",
        f"{r['compile_s']:.1f}",
        f"{r['cpu_s']:.3f}",
        f"{r['load']:.1f}",
        "-"
        if "ratio" not in r
        else f"{r['torch_total']:.3f} ({r['torch_generate']:.3f} / "
        f"{r['torch_score']:.3f} / {r['torch_train']:.3f})",
        "-" if "ratio" not in r else f"{r['ratio']:.2f}x",
    ]


if __name__ == "__main__":
    main()
