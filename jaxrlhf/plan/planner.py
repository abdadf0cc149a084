"""The planner's command: read the run, search plans, calibrate, print, write the overlay.

:func:`cli` is what ``python -m jaxrlhf.plan`` runs; :func:`format_plans` prints the table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import yaml

from jaxrlhf import platform
from jaxrlhf.config import RL_ALGORITHMS, ConfigError, merge_configs, read_configs
from jaxrlhf.plan import candidates
from jaxrlhf.plan.calibration import fit, measure
from jaxrlhf.plan.estimate import CostModel, PlanEstimate, gib
from jaxrlhf.plan.hardware import cluster_size, parse_cluster
from jaxrlhf.plan.search import Evaluated, Searcher, search

__all__ = ["cli", "format_plans", "read_run"]

_ASSUMPTIONS = (
    "every sample generates max_new_tokens tokens; costs from XLA:CPU's compilation of the "
    "trainers' programs on fake devices (cost analysis per device, depth extrapolated from 1 "
    "and 2 layers above 4); roofline at the device kind's peaks times each phase's "
    "efficiency; memory usable up to 90% of the device's."
)


def read_run(paths: Sequence[str], overrides: Sequence[str]) -> dict[str, Any]:
    """The run's config mapping: the files merged in order (later wins), then overrides."""
    return read_configs(list(paths), overrides)[0]


def format_plans(
    plans: Sequence[PlanEstimate], rejected: Sequence[Evaluated], top: int, header: str
) -> str:
    """The ranked table (best first), the rejected plans' reasons, the assumptions."""
    lines = [
        header,
        "",
        f"{'#':>2} {'s/iter':>8} {'generate':>9} {'score':>8} {'train':>8} {'sync':>8} "
        f"{'peak/dev':>11} {'reshard':>10} {'idle':>5}  plan",
    ]
    for i, p in enumerate(plans[:top]):
        ph = p.phases
        lines.append(
            f"{i + 1:>2} {p.iteration_s:>8.3f} {ph['generate']:>9.3f} {ph['score']:>8.3f} "
            f"{ph['train']:>8.3f} {ph['sync']:>8.3f} {gib(p.peak_bytes):>11} "
            f"{gib(p.reshard_bytes):>10} {p.idle_fraction:>5.0%}  {p.label}"
        )
    if rejected:
        lines += ["", f"rejected ({len(rejected)}):"]
        seen = set()
        for e in rejected:
            if (e.label, e.error) in seen:
                continue
            seen.add((e.label, e.error))
            lines.append(f"  {e.label}: {e.error}")
            if len(seen) >= top:
                lines.append(f"  ... ({len(rejected) - len(seen)} more)")
                break
    lines += ["", f"assumptions: {_ASSUMPTIONS}"]
    return "\n".join(lines)


def _load_model(path: str | None) -> CostModel:
    if path is None or not os.path.exists(path):
        return CostModel()
    with open(path, encoding="utf-8") as f:
        return CostModel.from_json(f.read(), path)


def cli(args: argparse.Namespace) -> int:
    """Runs the planner; 0 when a plan fits, 1 when none does."""
    if args.top < 1 or args.calibrate_plans < 1 or args.calibrate_steps < 3:
        raise ConfigError(
            "command line: --top and --calibrate-plans must be >= 1, --calibrate-steps >= 3"
        )
    data = read_run(args.config, args.set)
    kind, count = cluster_size(args.cluster)  # read before JAX starts
    platform.set_cpu_devices(count)
    import jax

    jax.config.update("jax_platforms", "cpu")
    if len(jax.devices("cpu")) < count:
        raise ConfigError(f"--cluster {args.cluster}: could not get {count} CPU devices")
    cluster = parse_cluster(args.cluster)
    is_cpu = kind == "cpu"
    if args.calibrate and not is_cpu:
        raise ConfigError(
            f"--calibrate times plans on this machine's devices; --cluster {args.cluster} is "
            "not here (calibrate on the target with --cluster of its kind, or plan uncalibrated)"
        )
    source = args.config[0]
    searcher = Searcher(data, cluster, source, log=lambda s: print(s, file=sys.stderr))
    if searcher.cfg.algorithm not in RL_ALGORITHMS:
        raise ConfigError(f"{source}: algorithm: the planner plans RL runs (ppo, grpo)")
    model = _load_model(args.cost_model)
    layouts = list(candidates.layouts(searcher.cfg, count, is_cpu))
    print(f"planning {source} on {cluster.label}: {len(layouts)} layouts", file=sys.stderr)
    how = search(
        searcher,
        layouts,
        model,
        time_limit_s=args.time_limit,
        exhaustive_limit=args.exhaustive_limit,
        first=candidates.configured(searcher.cfg, layouts, count),  # annealing starts there
    )
    references = {  # what the best plan is compared with
        "flat": candidates.flat(searcher.cfg, count, is_cpu),
        "as configured": {},
    }
    for overlay in references.values():
        searcher.layout(overlay, model)
    plans, rejected = searcher.ranked(model)
    if args.calibrate and plans:
        model = _calibrate(searcher, plans[: args.calibrate_plans], args)
        path = args.cost_model or "plan_cost_model.json"
        with open(path, "w", encoding="utf-8") as f:
            f.write(model.to_json())
        print(f"cost model written to {path}", file=sys.stderr)
        plans, rejected = searcher.ranked(model)
    fitted = f"calibrated on {model.calibrated_on}" if model.calibrated_on else "uncalibrated"
    header = (
        f"plans for {source} ({searcher.cfg.algorithm}) on {cluster.label} ({how}; cost model "
        f"{fitted}; seconds per iteration, bytes per device)"
    )
    print(format_plans(plans, rejected, args.top, header))
    for name, overlay in references.items():
        print(_compare(searcher, plans, overlay, name, model))
    if not plans:
        print("error: no plan fits (rejected plans above)", file=sys.stderr)
        return 1
    if args.out:
        write_overlay(plans[0], args.out, source)
        print(
            f"\nbest plan written to {args.out}: python -m jaxrlhf.train --config {source} "
            f"--config {args.out}"
        )
    return 0


def _compare(
    searcher: Searcher, plans: Sequence[PlanEstimate], overlay: dict, name: str, model
) -> str:
    """One line: the best plan's predicted speedup over a reference plan."""
    seconds, fastest = searcher.best_of(overlay, model)
    if fastest is None or not plans:
        return f"{name}: does not run ({_reason(searcher, overlay)})"
    ref = searcher.price(fastest, model)
    speedup = ref.iteration_s / plans[0].iteration_s
    return f"best plan vs {name} ({ref.label}): {ref.iteration_s:.3f} s -> {speedup:.2f}x"


def _reason(searcher: Searcher, overlay: dict) -> str:
    reasons = [e.error for e in searcher.evaluated if e.error and _within(overlay, e.overlay)]
    return reasons[-1] if reasons else "not evaluated"


def _within(small: dict, big: dict) -> bool:
    return all(
        _within(v, big.get(k, {})) if isinstance(v, dict) else big.get(k) == v
        for k, v in small.items()
    )


def _calibrate(searcher: Searcher, plans: Sequence[PlanEstimate], args) -> CostModel:
    """Runs ``plans`` here, fits the cost model on them."""
    unit = CostModel(efficiency=dict.fromkeys(("generate", "score", "train", "sync"), 1.0))
    pairs = []
    with tempfile.TemporaryDirectory(prefix="jaxrlhf-calibrate-") as root:
        for i, plan in enumerate(plans):
            print(f"calibrating on {plan.label} ...", file=sys.stderr, flush=True)
            run = merge_configs(searcher.base, dict(plan.overlay))
            m = measure(run, plan.label, os.path.join(root, str(i)), steps=args.calibrate_steps)
            evaluated = next(e for e in searcher.evaluated if e.label == plan.label)
            pairs.append((searcher.price(evaluated, unit), m))
            print(f"  measured {m.iteration_s:.3f} s/iteration", file=sys.stderr)
    return fit(pairs, "; ".join(p.label for p in plans))


def write_overlay(plan: PlanEstimate, path: str, source: str) -> None:
    """Writes ``plan``'s overlay as YAML with a header saying what it is."""
    head = (
        f"# Plan by python -m jaxrlhf.plan for {source}: {plan.label}\n"
        f"# predicted {plan.iteration_s:.3f} s/iteration, peak {gib(plan.peak_bytes)} per "
        f"device.\n# Run: python -m jaxrlhf.train --config {source} --config {path}\n"
    )
    with open(path, "w", encoding="utf-8") as f:
        f.write(head)
        yaml.safe_dump(_plain(plan.overlay), f, sort_keys=False)


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x
