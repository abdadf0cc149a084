"""The planner's predictions against measurements on this CPU (issue #21).

Six configurations of GRPO (workload R1's shapes: 8 prompts x 4 samples, 64 + 64 tokens):
bench-S colocated on 1 and on 2 CPU devices, separated (sampler on device 0, learner on
device 1) at staleness 0 and 1; bench-M colocated on 1 device and separated at staleness 1
(the default). Three more of PPO on bench-S (the same shapes with a critic, GAE; the
cheap reward function, no reward model) on 2 CPU devices: colocated, separated at
staleness 1, and interleaved (the critic on device 1, its value forward and update beside
the policy's on device 0).
For each: the planner's prediction at efficiency 1 (``estimate`` with a unit cost model:
the programs compiled as the planner compiles them) and the measured steady-state seconds
per iteration of a real ``python -m jaxrlhf.train`` run (``calibration.measure``, the
trainer's own timeline). Then the cost model is fitted (``calibration.fit``) per model and
cluster (``--calibrate`` times the run being planned on the devices at hand) two ways:

* in-sample: on all of that model's configurations on that cluster;
* leave-one-out: each configuration predicted by a model fitted on the others (where the
  model has several configurations on the cluster).

Reported: predicted vs measured per configuration, the error of each, and whether the
planner's top choice among each model size's configurations is the measured fastest.

    python -m benchmarks.planner                  # the six (about 15 minutes on 2 cores)
    python -m benchmarks.planner --only S-col1 S-sep2-s1 --steps 6
    python -m benchmarks.planner --only P-col2 P-sep2-s1 P-int2
    python -m benchmarks.planner --only S-col2 S-sep2-s0 S-sep2-s1 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from jaxrlhf import platform

CONFIGS = {  # name: (preset, CPU devices, strategy, staleness, algorithm)
    "S-col1": ("bench_s", 1, "colocated", 0, "grpo"),
    "S-col2": ("bench_s", 2, "colocated", 0, "grpo"),
    "S-sep2-s0": ("bench_s", 2, "separated", 0, "grpo"),
    "S-sep2-s1": ("bench_s", 2, "separated", 1, "grpo"),
    "M-col1": ("bench_m", 1, "colocated", 0, "grpo"),
    "M-sep2-s1": ("bench_m", 2, "separated", 1, "grpo"),
    "P-col2": ("bench_s", 2, "colocated", 0, "ppo"),
    "P-sep2-s1": ("bench_s", 2, "separated", 1, "ppo"),
    "P-int2": ("bench_s", 2, "interleaved", 0, "ppo"),
}
SIX = [n for n, c in CONFIGS.items() if c[4] == "grpo"]
ONE = {"data": 1, "fsdp": 1, "tensor": 1}


def run_config(preset: str, algorithm: str = "grpo") -> dict:
    """R1's shapes as a config mapping (the reward: rl_step's cheap function); PPO: the same
    with a critic (R2 without its reward model), GAE with gamma 1, lambda 0.95."""
    section = {
        "rollout": {
            "prompts_per_step": 8,
            "num_samples": 4,
            "max_new_tokens": 64,
            "stop_at_eos": False,
        },
        "loss": {"kl_coef": 0.04, "kl_mode": "loss", "kl_estimator": "k3"},
        "reward": {"function": "benchmarks.rl_step.cheap_reward"},
    }
    if algorithm == "ppo":
        section.update(gamma=1.0, lam=0.95)
    return {
        "algorithm": algorithm,
        "model": {"preset": preset},
        "data": {
            "train": "builtin:sort",
            "max_length": 128,
            "max_prompt_length": 64,
            "builtin_size": 64,
            "eval_size": 0,
        },
        "optimizer": {"lr": 1e-6, "schedule": "constant"},
        "train": {"steps": 4},
        algorithm: section,
    }


def overlay(devices: int, strategy: str, staleness: int, algorithm: str = "grpo") -> dict:
    if devices == 1:
        return {"placement": {"cpu_devices": 1}, "mesh": ONE}
    if strategy == "colocated":  # the best synchronous 2-device placement (RESULTS.md)
        return {
            "placement": {
                "cpu_devices": 2,
                "train_devices": 1,
                "generate_mesh": {"data": 2, "fsdp": 1, "tensor": 1},
            },
            "mesh": ONE,
        }
    if strategy == "interleaved":  # PPO's critic on device 1, the rest on device 0
        return {
            "placement": {
                "cpu_devices": 2,
                "strategy": "interleaved",
                "learner": {"devices": [0], "mesh": ONE},
                "critic": {"devices": [1], "mesh": ONE},
            },
            "mesh": ONE,
        }
    return {
        "placement": {
            "cpu_devices": 2,
            "strategy": "separated",
            "sampler": {"devices": [0], "mesh": ONE},
            "learner": {"devices": [1], "mesh": ONE},
        },
        "mesh": ONE,
        algorithm: {
            "rollout": {"max_staleness": staleness},
            "loss": {"rollout_correction": {"weights": "truncate", "cap": 2.0}}
            if staleness
            else {},
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), default=SIX)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here too")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every configuration this many times, in turn (A B C A B C ...: drift "
        "of the host affects all alike); each is fitted and ranked at its median round",
    )
    args = parser.parse_args()
    platform.set_cpu_devices(2)
    import jax

    jax.config.update("jax_platforms", "cpu")
    from jaxrlhf.config import from_dict
    from jaxrlhf.config import merge_configs as merge
    from jaxrlhf.plan.calibration import fit, measure
    from jaxrlhf.plan.estimate import CostModel, compile_plan, estimate
    from jaxrlhf.plan.hardware import measure_cpu, parse_cluster

    cpu = measure_cpu()
    print(f"CPU: {cpu.peak_flops / 1e9:.0f} GFLOP/s, {cpu.memory_bandwidth / 1e9:.1f} GB/s")
    unit = CostModel(efficiency=dict.fromkeys(("generate", "score", "train", "sync"), 1.0))
    setups, runs = {}, {name: [] for name in args.only}
    with tempfile.TemporaryDirectory(prefix="planner-bench-") as root:
        for name in args.only:
            preset, devices, strategy, staleness, algorithm = CONFIGS[name]
            data = merge(
                run_config(preset, algorithm), overlay(devices, strategy, staleness, algorithm)
            )
            cfg = from_dict(data, source=name)
            compiled = compile_plan(cfg, name)
            cluster = parse_cluster(f"cpu-{devices}", cpu=cpu)
            predicted = estimate(cfg, cluster, unit, compiled=compiled, label=name)
            setups[name] = (data, preset, cfg, cluster, compiled, predicted)
        for round_ in range(args.rounds):
            for name in args.only:
                data, predicted = setups[name][0], setups[name][5]
                workdir = os.path.join(root, f"{name}-{round_}")
                measured = measure(data, name, workdir, steps=args.steps, skip=args.skip)
                runs[name].append(measured)
                print(
                    f"{name}: measured {measured.iteration_s:.3f} s/iteration "
                    f"({', '.join(f'{k} {v:.3f}' for k, v in measured.phases.items())}); "
                    f"roofline {predicted.iteration_s:.3f}",
                    flush=True,
                )
    rows = []
    for name in args.only:
        ordered = sorted(runs[name], key=lambda m: m.iteration_s)
        median = ordered[(len(ordered) - 1) // 2]  # a round's own phases (lower median)
        if args.rounds > 1:
            print(f"{name}: rounds {[round(m.iteration_s, 3) for m in runs[name]]}")
        rows.append((name, *setups[name][1:], median))

    def predict(model, row):
        name, _, cfg, cluster, compiled, _, _ = row
        return estimate(cfg, cluster, model, compiled=compiled, label=name).iteration_s

    # A cost model belongs to the run and the cluster it was calibrated on (--calibrate
    # times the run being planned on the devices at hand): fitted per model and device count.
    def group(row):
        return (row[1], row[2].algorithm, row[3].count)

    out = []
    print(f"\n{'config':<10} {'measured':>9} {'in-sample':>10} {'err':>6} {'loo':>8} {'err':>6}")
    for i, row in enumerate(rows):
        same = [j for j, r in enumerate(rows) if group(r) == group(row)]
        everything = fit([(rows[j][5], rows[j][6]) for j in same], "same model and cluster")
        others = [(rows[j][5], rows[j][6]) for j in same if j != i]
        loo = fit(others, "the others") if others else None
        m, p_in = row[6].iteration_s, predict(everything, row)
        p_loo = predict(loo, row) if loo is not None else float("nan")
        out.append(
            {
                "config": row[0],
                "group": list(group(row)),
                "measured_s": m,
                "in_sample_s": p_in,
                "loo_s": p_loo,
                "measured_phases": dict(row[6].phases),
                "rounds_s": [m.iteration_s for m in runs[row[0]]],
                "model": json.loads(everything.to_json()),
            }  # fmt: skip
        )
        print(
            f"{row[0]:<10} {m:>9.3f} {p_in:>10.3f} {p_in / m - 1:>+6.0%} {p_loo:>8.3f} "
            f"{p_loo / m - 1:>+6.0%}"
        )
    for key in sorted({group(r) for r in rows}):
        mine = [o for r, o in zip(rows, out, strict=True) if group(r) == key]
        print(f"{key[0]} {key[1]} on cpu-{key[2]}: cost model {json.dumps(mine[0]['model'])}")
        if len(mine) > 1:
            best_pred = min(mine, key=lambda o: o["in_sample_s"])["config"]
            best_meas = min(mine, key=lambda o: o["measured_s"])["config"]
            print(f"  planner's top choice {best_pred}, measured fastest {best_meas}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
