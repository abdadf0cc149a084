"""``python -m jaxrlhf.plan --config RUN.yaml --cluster SPEC [--calibrate] [--out PLAN.yaml]``,
or ``--topology v5e:8x8`` instead of ``--cluster`` to price programs compiled by XLA:TPU.

Prints the best plans for the run on the cluster, ranked by predicted seconds per iteration,
and writes the best as a config overlay: ``python -m jaxrlhf.train --config RUN.yaml
--config PLAN.yaml`` runs it. User errors print one line ``error: ...`` and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

# XLA warns about every inefficient resharding of every layout it compiles (dozens); the
# cost model counts their collectives, so the planner keeps its output readable. XLA reads
# the level when its library loads: before anything here imports jax.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _parser() -> argparse.ArgumentParser:
    from jaxrlhf.plan.calibration import DEFAULT_COST_MODEL

    parser = argparse.ArgumentParser(
        prog="python -m jaxrlhf.plan",
        description="Choose placement, meshes, remat, micro-batches and staleness for an RL "
        "run (ppo | grpo) from a cost model over its compiled programs.",
    )
    add = parser.add_argument
    add("--config", action="append", required=True, help="run config(s), merged in order")
    add("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field")
    add(
        "--cluster",
        help="device kind and count: h100x8, a100x16, tpu-v5e-64, cpu-2 (cpu: this host, "
        "split into that many JAX devices); with --topology, the slice's by default",
    )
    add(
        "--topology",
        metavar="NAME",
        help="a TPU slice (v5e:2x2, v5e:8x8, v5p:2x2x2, v4:2x2x1, v6e:4x4): compile every "
        "plan's programs with the TPU compiler for it on this host and price them from its "
        "cost and memory analyses (needs libtpu: pip install -e '.[tpu]')",
    )
    add("--out", metavar="PLAN.yaml", help="write the best plan here as a config overlay")
    add("--top", type=int, default=8, help="plans to print (default 8)")
    add("--calibrate", action="store_true", help="time the best plans here and fit the model")
    add("--calibrate-plans", type=int, default=2, help="plans --calibrate runs (default 2)")
    add("--calibrate-steps", type=int, default=5, help="iterations per calibration run")
    add(
        "--cost-model",
        metavar="FILE",
        default=DEFAULT_COST_MODEL,
        help="cost model JSON: read when it exists and was calibrated on this cluster (a "
        "previous --calibrate), written by --calibrate (default: %(default)s)",
    )
    add(
        "--lengths",
        default="budget",
        metavar="DIST",
        help="response lengths generation is priced at: 'budget' (every sample runs to "
        "max_new_tokens; default) or 'lognormal:MEDIAN,SIGMA' in tokens, capped at the "
        "budget (G2's long tail: lognormal:48,1.439); the rollout engine gains from short "
        "samples, the static sampler does not",
    )
    add(
        "--strategies",
        nargs="+",
        choices=("colocated", "separated", "interleaved"),
        default=("colocated", "separated", "interleaved"),
        help="placement strategies to search (default: all); the flat plan and the run as "
        "configured are priced too, for the comparison",
    )
    add("--time-limit", type=float, default=600.0, help="search seconds for large spaces")
    add("--exhaustive-limit", type=int, default=24, help="layouts searched exhaustively")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from jaxrlhf.config import ConfigError
    from jaxrlhf.plan import planner
    from jaxrlhf.sharding import MeshError, ShardingRuleError

    try:
        return planner.cli(args)
    except (ConfigError, MeshError, ShardingRuleError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
