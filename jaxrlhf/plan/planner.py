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
from jaxrlhf.plan.calibration import DEFAULT_COST_MODEL, fit, measure
from jaxrlhf.plan.estimate import CostModel, PlanEstimate, gib
from jaxrlhf.plan.hardware import cluster_size, parse_cluster
from jaxrlhf.plan.lengths import BUDGET, LengthModel, parse_lengths
from jaxrlhf.plan.search import Evaluated, Searcher, search
from jaxrlhf.sharding.topology import Topology, load_topology, no_persistent_cache

__all__ = ["cli", "format_plans", "read_run"]

_ASSUMPTIONS = (
    "the static sampler decodes max_new_tokens steps per row; the rollout engine's chunks "
    "and admissions replayed on those lengths (its ragged-tail views priced from the views "
    "it compiles); sequence-packed scoring and the update at the packed size the trainer "
    "picks for those lengths (each size compiled; prompts at full length; streamed scoring "
    "as one pass); costs from {compiler}'s compilation of the "
    "trainers' programs on {devices} (its cost analysis per device; models over 16 layers "
    "extrapolated from 1-4 layer compiles); roofline at the device kind's peaks divided by "
    "each phase's efficiency (uncalibrated: generate 0.5, score 0.5, train 0.4, sync 0.7), "
    "collectives not overlapped with compute, each over in-node links or the network by its "
    "group size; the optimizer step counted once per micro-batch; host work (a reward "
    "function) only as calibrated (0 otherwise); memory usable up to 90% of the device's; "
    "'flat' is the best plan evaluated with every role on one mesh over all devices."
)


def read_run(paths: Sequence[str], overrides: Sequence[str]) -> dict[str, Any]:
    """The run's config mapping: the files merged in order (later wins), then overrides."""
    return read_configs(list(paths), overrides)[0]


def format_plans(
    plans: Sequence[PlanEstimate],
    rejected: Sequence[Evaluated],
    top: int,
    header: str,
    lengths: LengthModel = BUDGET,
    topology: str | None = None,
) -> str:
    """The ranked table (best first), the rejected plans' reasons, the assumptions (the
    response lengths generation was priced at first; ``topology``: the TPU slice the
    programs were compiled for, None: fake CPU devices)."""
    lines = [
        header,
        "",
        f"{'#':>2} {'s/iter':>8} {'generate':>9} {'score':>8} {'train':>8} {'sync':>8} "
        f"{'peak/dev':>11} {'reshard':>10} {'idle':>5}  plan",
    ]
    for i, p in enumerate(plans[:top]):
        ph = p.phases
        # An interleaved plan's side groups run beside the learner's phases: named apart.
        side = ", ".join(f"{k} {v:.3f}" for k, v in ph.items() if ":" in k)
        lines.append(
            f"{i + 1:>2} {p.iteration_s:>8.3f} {ph['generate']:>9.3f} {ph['score']:>8.3f} "
            f"{ph['train']:>8.3f} {ph['sync']:>8.3f} {gib(p.peak_bytes):>11} "
            f"{gib(p.reshard_bytes):>10} {p.idle_fraction:>5.0%}  {p.label}"
            + (f" (beside: {side})" if side else "")
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
    compiled = (
        ("XLA:CPU", "fake devices")
        if topology is None
        else (f"XLA:TPU {topology}", "its compile-only devices")
    )
    assumptions = _ASSUMPTIONS.format(compiler=compiled[0], devices=compiled[1])
    lines += ["", f"assumptions: {lengths.describe()}; {assumptions}"]
    return "\n".join(lines)


def _load_model(path: str, cluster: str, explicit: bool) -> CostModel:
    """The cost model at ``path`` (defaults when absent). One calibrated on another cluster
    is an error when the user named the file, else ignored with a note."""
    if not os.path.exists(path):
        return CostModel()
    with open(path, encoding="utf-8") as f:
        model = CostModel.from_json(f.read(), path)
    if model.cluster and model.cluster != cluster:
        if explicit:
            raise ConfigError(
                f"--cost-model {path}: calibrated on {model.cluster}, not {cluster} "
                "(calibrate there, or plan without it)"
            )
        print(f"note: {path} was calibrated on {model.cluster}: not used", file=sys.stderr)
        return CostModel()
    return model


def _progress(line: str) -> None:
    print(line, file=sys.stderr)


def cli(args: argparse.Namespace) -> int:
    """Runs the planner; 0 when a plan fits, 1 when none does."""
    if args.top < 1 or args.calibrate_plans < 1 or args.calibrate_steps < 4:
        raise ConfigError(
            "command line: --top and --calibrate-plans must be >= 1, --calibrate-steps >= 4 "
            "(the first 2 iterations compile; 2 more are timed at least)"
        )
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        raise ConfigError(f"--out {args.out}: its directory does not exist")
    lengths = parse_lengths(args.lengths)
    data = read_run(args.config, args.set)
    topology = None
    if args.topology is not None:  # the cluster is the slice's
        import jax

        jax.config.update("jax_platforms", "cpu")  # compiles only: the TPU runtime never starts
        no_persistent_cache()
        topology = load_topology(args.topology)
        spec = _topology_cluster(topology, args.cluster)
    elif args.cluster is None:
        raise ConfigError(
            "command line: give --cluster (h100x8, tpu-v5e-64, cpu-2) or --topology (v5e:8x8)"
        )
    else:
        spec = args.cluster
    kind, count = cluster_size(spec)  # read before JAX starts
    if topology is None:
        platform.set_cpu_devices(count)
        import jax

        jax.config.update("jax_platforms", "cpu")
        if len(jax.devices("cpu")) < count:
            raise ConfigError(f"--cluster {spec}: could not get {count} CPU devices")
    cluster = parse_cluster(spec)
    is_cpu = kind == "cpu"
    if args.calibrate and not is_cpu:
        raise ConfigError(
            f"--calibrate times plans on this machine's CPU devices (--cluster cpu-N); "
            f"{spec} is not here: plan it uncalibrated"
        )
    source = args.config[0]
    searcher = Searcher(data, cluster, source, log=_progress, lengths=lengths, topology=topology)
    if searcher.cfg.algorithm not in RL_ALGORITHMS:
        raise ConfigError(f"{source}: algorithm: the planner plans RL runs (ppo, grpo)")
    explicit = args.cost_model != DEFAULT_COST_MODEL
    model = _load_model(args.cost_model, cluster.label, explicit)
    chosen = set(args.strategies)
    layouts = [
        o
        for o in candidates.layouts(searcher.cfg, count, is_cpu)
        if o["placement"]["strategy"] in chosen
    ]
    if not layouts:
        raise ConfigError(
            f"--strategies {' '.join(args.strategies)}: no such layout of this run on "
            f"{cluster.label}"
        )
    print(f"planning {source} on {cluster.label}: {len(layouts)} layouts", file=sys.stderr)
    how = search(
        searcher,
        layouts,
        model,
        time_limit_s=args.time_limit,
        exhaustive_limit=args.exhaustive_limit,
        first=candidates.configured(searcher.cfg, layouts, count),  # annealing starts there
    )
    searcher.layout(candidates.flat(searcher.cfg, count, is_cpu), model)  # a flat reference
    as_configured = searcher.exact({}, model)
    everything, rejected = searcher.ranked(model)
    plans = _of(everything, chosen)
    if args.calibrate and plans:
        model = _calibrate(searcher, plans[: args.calibrate_plans], args)
        path = args.cost_model
        with open(path, "w", encoding="utf-8") as f:
            f.write(model.to_json())
        print(f"cost model written to {path}", file=sys.stderr)
        everything, rejected = searcher.ranked(model)
        plans = _of(everything, chosen)
    fitted = f"calibrated on {model.calibrated_on}" if model.calibrated_on else "uncalibrated"
    compiled = "" if topology is None else f"compiled by {topology.compiler}; "
    header = (
        f"plans for {source} ({searcher.cfg.algorithm}) on {cluster.label} ({compiled}{how}; "
        f"cost model {fitted}; seconds per iteration, bytes per device)"
    )
    name = None if topology is None else topology.name
    print(format_plans(plans, rejected, args.top, header, lengths, name))
    if plans:
        flat = _flat(everything)  # evaluated whatever --strategies says
        print(_compare(plans, flat, "flat (the best plan with every role on one mesh)"))
        configured = searcher.exact({}, model) if args.calibrate else as_configured
        print(_compare(plans, configured, "the run as configured"))
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


def _topology_cluster(topology: Topology, cluster: str | None) -> str:
    """The cluster spec of a TPU slice (``tpu-v5e-64``); ``cluster`` (``--cluster``, None:
    not given) must name the same kind and count.

    Raises:
      ConfigError: they differ, or the slice's chip has no roofline here and no
        ``--cluster`` says which to price it as.
    """
    count = len(topology.devices)
    if topology.kind is None:
        if cluster is None or cluster_size(cluster)[1] != count:
            raise ConfigError(
                f"--topology {topology.name}: no roofline for {topology.device_kind} here; "
                f"give --cluster KIND-{count} to price it as a known kind"
            )
        return cluster
    spec = f"{topology.kind}-{count}"
    if cluster is not None and cluster_size(cluster) != cluster_size(spec):
        raise ConfigError(
            f"--cluster {cluster} is not --topology {topology.name} ({count} x "
            f"{topology.kind}): give one of them"
        )
    return spec


def _of(plans: Sequence[PlanEstimate], strategies: set[str]) -> list[PlanEstimate]:
    """The ``plans`` of ``strategies``, in order (the flat reference is evaluated whatever
    ``--strategies`` says)."""
    return [p for p in plans if p.overlay.get("placement", {}).get("strategy") in strategies]


def _flat(plans: Sequence[PlanEstimate]) -> PlanEstimate | None:
    """ReaLHF's baseline: every role on all devices, one mesh for every phase (the best such
    plan evaluated; the search always evaluates the fully sharded one)."""
    flat = [
        p
        for p in plans
        if p.overlay.get("placement", {}).get("strategy") == "colocated"
        and p.overlay["placement"].get("generate_mesh") is None
    ]
    return min(flat, key=lambda p: p.iteration_s, default=None)


def _compare(plans: Sequence[PlanEstimate], ref: PlanEstimate | str | None, name: str) -> str:
    """One line: the best plan's predicted speedup over ``ref`` (a plan, or why none)."""
    if not isinstance(ref, PlanEstimate):
        return f"{name}: {ref or 'none evaluated'}"
    if ref.rejected:
        return f"{name}: does not fit ({ref.rejected})"
    speedup = ref.iteration_s / plans[0].iteration_s
    return (
        f"best plan vs {name} ({ref.label}): {ref.iteration_s:.3f} -> "
        f"{plans[0].iteration_s:.3f} s/iteration, {speedup:.2f}x"
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
    return fit(pairs, "; ".join(p.label for p in plans), searcher.cluster.label)


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
