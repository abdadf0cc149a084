"""Workload R3: asynchronous GRPO on two CPU devices against the synchronous run.

R3 (defined here; shared/bench/WORKLOADS.md has R1/R2): GRPO on the built-in ``sort`` task,
16 prompts x 4 samples per iteration, on a CPU host split into two JAX devices
(``placement.cpu_devices: 2``), the same number of iterations (so the same number of
samples) in two placements:

* ``sync``: synchronous and colocated, the best synchronous placement of the seventh session
  (training on device 0, the sampler data-parallel over both devices; benchmarks/RESULTS.md).
* ``async``: ``placement.strategy: separated`` (the sampler on device 0, the learner on device
  1) with ``rollout.max_staleness: 1`` and truncated importance weights (cap 2): the sampler
  samples iteration i + 1 with the weights of version i while the learner trains on i.
* ``async-ref``: ``async`` with ``placement.reference: sampler`` (the reference's forward on
  the sampler's device, after each batch).
* ``one-device`` / ``interleaved-ref``: synchronous, sampler and learner on device 0, the
  reference's forward there too or on device 1 (``placement.strategy: interleaved``,
  ``reference: own``), beside the learner's old-policy forward.
* ``async-over`` / ``async-partial``: ``async`` through the rollout engine, over-sampling 4
  groups and keeping the first 16 to finish; the rest cancelled (over) or carried into the
  next rollout (``rollout.partial_rollouts``, at ``max_staleness`` 2 so that carried tokens,
  a version older, stay within the bound). Reported also: decoded tokens per trained token.

Each run is a ``python -m jaxrlhf.train`` process. Reported per run: iterations per second
after the first ``--skip`` iterations (compilation), each device's busy fraction over the same
iterations (from ``timeline.json``: the union of the phases that ran on it), the host's cores
the process kept busy over them (CPU seconds per wall second, from the timeline's CPU-time
samples: on a CPU host both JAX devices' programs run on the same cores, so a busy device
does not mean a busy core), and the task reward (mean of the last 5 iterations). Targets:
async >= 1.3x the sync iterations per second with both devices busy >= 85% of the time, and
the final task reward within the seeds' spread of the sync runs.

    python -m benchmarks.async_rl                         # tiny model, 3 seeds, 40 iterations
    python -m benchmarks.async_rl --model bench_s --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from jaxrlhf.train.timeline import CpuSample, Phase, host_cores, summarize

PLACEMENTS = {
    "sync": {
        "cpu_devices": 2,
        "train_devices": 1,
        "generate_mesh": {"data": -1, "fsdp": 1, "tensor": 1},
    },
    "async": {
        "cpu_devices": 2,
        "strategy": "separated",
        "sampler": {"devices": [0]},
        "learner": {"devices": [1]},
    },
    "async-ref": {
        "cpu_devices": 2,
        "strategy": "separated",
        "sampler": {"devices": [0]},
        "learner": {"devices": [1]},
        "reference": "sampler",
    },
}
# The reference interleaved on its own device (synchronous; the sampler and the learner on
# device 0) against the same run with the reference beside them on device 0.
PLACEMENTS["one-device"] = {"cpu_devices": 2, "train_devices": 1}
PLACEMENTS["interleaved-ref"] = {
    "cpu_devices": 2,
    "strategy": "interleaved",
    "learner": {"devices": [0]},
    "reference": "own",
    "reference_group": {"devices": [1]},
}
PROMPTS, SAMPLES = 16, 4  # per iteration
# The asynchronous run through the rollout engine, over-sampling OVERSAMPLE groups (the
# first 16 to finish are kept): cancelled (over) or carried into the next rollout (partial).
OVERSAMPLE = 4
for _mode in ("async-over", "async-partial"):
    PLACEMENTS[_mode] = PLACEMENTS["async"]


def run_config(mode: str, seed: int, args: argparse.Namespace, out: str) -> dict:
    rollout = {
        "prompts_per_step": PROMPTS,
        "num_samples": SAMPLES,
        "max_new_tokens": args.max_new_tokens,
    }
    loss = {"epochs": 1, "num_minibatches": 2, "clip_high": 0.28}
    if mode.startswith("async"):
        rollout["max_staleness"] = 1
        loss["rollout_correction"] = {"weights": "truncate", "cap": 2.0}
    if mode in ("async-over", "async-partial"):
        rollout.update(
            engine="continuous",
            stream_scoring=False,
            oversample_groups=OVERSAMPLE,
            chunk_tokens=16,
            partial_rollouts=mode == "async-partial",
            max_staleness=2 if mode == "async-partial" else 1,  # carried tokens 1 older
        )
    return {
        "algorithm": "grpo",
        "output_dir": out,
        "model": {"preset": args.model},
        "tokenizer": {"path": "builtin"},
        "data": {
            "train": "builtin:sort",
            "eval_size": 0,
            "max_length": 16 + max(16, args.max_new_tokens),
            "max_prompt_length": 16,
            "seed": seed,
        },
        "mesh": {"data": 1, "fsdp": -1, "tensor": 1},
        "placement": PLACEMENTS[mode],
        "optimizer": {"lr": args.lr, "schedule": "constant", "warmup_steps": 0},
        "train": {"steps": args.steps, "log_every": 10**6, "seed": seed},
        "logging": {"progress": "none", "plot": False},
        "checkpoint": {"every": 0, "export_hf": False},
        "grpo": {
            "rollout": rollout,
            "loss": loss,
            "reward": {"function": "builtin", "overlong_buffer": 1, "overlong_penalty": 0.5},
        },
    }


def measure(mode: str, seed: int, args: argparse.Namespace, root: str) -> dict:
    out = os.path.join(root, f"{mode}-{seed}")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "r3.yaml")
    with open(path, "w") as f:
        json.dump(run_config(mode, seed, args, out), f)  # JSON is YAML
    subprocess.run(
        [sys.executable, "-m", "jaxrlhf.train", "--config", path],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    rows = [r for r in rows if "reward/mean" in r]
    timeline = json.load(open(os.path.join(out, "timeline.json")))
    phases = [Phase(**{**p, "devices": tuple(p["devices"])}) for p in timeline["phases"]]
    # Skip the compile-heavy first iterations: the learner's and the sampler's phases of
    # steps (rollout indices) >= skip.
    phases = [p for p in phases if p.step >= args.skip]
    groups = {k: tuple(v) for k, v in timeline["groups"].items()}
    summary = summarize(phases, groups)
    timed = [p for p in phases if p.group == "learner" and p.name == "update"]
    first = min(p.start for p in phases)
    span = max(p.end for p in timed) - first
    cpu = [CpuSample(**c) for c in timeline["cpu"] if c["step"] >= args.skip]
    key = "reward/task_mean" if "reward/task_mean" in rows[0] else "reward/mean"
    return {
        "mode": mode,
        "seed": seed,
        "it_per_s": (args.steps - args.skip) / span,
        "device0_busy": summary["device0/busy_frac"],
        "device1_busy": summary.get("device1/busy_frac", 0.0),  # one-device: unused
        "overlap": summary.get("reference_overlap_frac", summary["overlap_frac"]),
        "host_cores": host_cores(cpu),
        "reward_curve": [r[key] for r in rows],
        "final_reward": float(np.mean([r[key] for r in rows[-5:]])),
        "staleness_max": max(
            r.get("rollout/staleness_max", r.get("rollout/staleness", 0.0)) for r in rows
        ),
        # Decoded tokens per trained response token (1.0: nothing decoded in vain).
        "decode_per_trained": float(
            np.mean(
                [
                    r["rollout/decoded_tokens"] / (r["response/length_mean"] * PROMPTS * SAMPLES)
                    for r in rows[args.skip :]
                    if "rollout/decoded_tokens" in r
                ]
                or [1.0]
            )
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=10,
        help="R3 uses 10; longer budgets give long-tailed lengths (a random model's EOS)",
    )
    parser.add_argument("--modes", nargs="+", default=list(PLACEMENTS), choices=list(PLACEMENTS))
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="r3-") as root:
        for seed in args.seeds:
            for mode in args.modes:
                r = measure(mode, seed, args, root)
                results.append(r)
                print(
                    f"{mode:>9} seed {seed}: {r['it_per_s']:.2f} it/s, busy device0 "
                    f"{r['device0_busy']:.0%} device1 {r['device1_busy']:.0%}, overlap "
                    f"{r['overlap']:.0%}, host cores busy {r['host_cores']:.2f}, final task reward "
                    f"{r['final_reward']:.3f}, "
                    f"max staleness {r['staleness_max']:.0f}, decoded per trained token "
                    f"{r['decode_per_trained']:.2f}",
                    flush=True,
                )
    by = {m: [r for r in results if r["mode"] == m] for m in args.modes}
    sync_speed = np.mean([r["it_per_s"] for r in by.get("sync", [])] or [np.nan])
    sync_final = [r["final_reward"] for r in by.get("sync", [])] or [np.nan]
    print(
        f"sync: final task reward {np.mean(sync_final):.3f} "
        f"(range {min(sync_final):.3f}-{max(sync_final):.3f})"
    )
    for mode in args.modes:
        if mode == "sync":
            continue
        speed = np.mean([r["it_per_s"] for r in by[mode]]) / sync_speed
        print(
            f"{mode} / sync iterations per second: {speed:.2f}x; final task reward "
            f"{np.mean([r['final_reward'] for r in by[mode]]):.3f}; host cores busy "
            f"{np.mean([r['host_cores'] for r in by[mode]]):.2f} (sync "
            f"{np.mean([r['host_cores'] for r in by.get('sync', [])] or [np.nan]):.2f})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
