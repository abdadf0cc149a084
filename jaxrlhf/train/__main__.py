"""``python -m jaxrlhf.train --config FILE [overrides]``: parse, load the config, run.

User errors (config, data, checkpoint, mesh) print one line ``error: ...`` and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

from jaxrlhf.config import (
    ConfigError,
    describe_fields,
    load_config,
    override_paths,
    read_config,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxrlhf.train",
        description="Train with jaxrlhf (algorithm: sft | reward_model | dpo | ppo | grpo) "
        "from a YAML config, or run a pipeline file that lists stage configs.",
        epilog="config fields (override any with section.field=value):\n" + describe_fields(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config", required=True, help="YAML run config, e.g. configs/tiny_sft.yaml"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field"
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="same as --set")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="compile every phase on abstract inputs (CPU, no data or weights read) and print "
        "parameters per role and memory per device per phase; then exit",
    )
    parser.add_argument(
        "--device-memory", metavar="SIZE", help="with --dry-run: check the peak fits SIZE (80GB)"
    )
    parser.add_argument(
        "--device-kind",
        metavar="KIND",
        help="with --dry-run: check against a known device's "
        "memory (h100, a100-40gb, tpu-v5e, tpu-v5p, ...)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in the run directory; error if there is "
        "none (same as checkpoint.resume=always; the default, auto, resumes when one exists)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("jaxrlhf").setLevel(logging.INFO)

    from jaxrlhf.data import DataError
    from jaxrlhf.models.safetensors_io import CheckpointError
    from jaxrlhf.rewards import RewardError
    from jaxrlhf.sharding import MeshError, ShardingRuleError
    from jaxrlhf.train.checkpointing import NonFiniteStateError
    from jaxrlhf.train.pipeline import pipeline_stages
    from jaxrlhf.train.preemption import Preempted, TrainingDiverged

    try:
        if args.dry_run:  # exit 1 when a phase does not fit the device memory
            from jaxrlhf.train import dry_run

            overrides = [*args.set, *args.overrides]
            return dry_run.cli(
                args.config, overrides, memory=args.device_memory, kind=args.device_kind
            )
        if args.device_memory is not None or args.device_kind is not None:
            raise ConfigError("command line: --device-memory and --device-kind need --dry-run")
        from jaxrlhf import platform
        from jaxrlhf.sharding.distributed import initialize_from_env

        stages = pipeline_stages(args.config) or [args.config]
        overrides = [*args.set, *args.overrides]
        cpu_devices = requested_cpu_devices(stages, overrides)
        for note in platform.configure_cpu_host(cpu_devices):  # before the backend starts
            logging.getLogger("jaxrlhf").debug("%s", note)
        initialize_from_env()  # joins a TPU pod / Slurm / MPI job; a no-op on one machine
        platform.check_cpu_devices(cpu_devices)  # before sizes are checked
        from jaxrlhf.train import loop

        for i, path in enumerate(stages):
            if len(stages) > 1:
                print(f"== stage {i + 1}/{len(stages)}: {path}", flush=True)
            overrides = [*args.set, *args.overrides]
            if args.resume:  # a pipeline's later stages may not have started yet
                overrides.append(f"checkpoint.resume={'always' if i == 0 else 'auto'}")
            cfg = load_config(path, overrides)
            loop.run(cfg, source=path, override_paths=tuple(override_paths(overrides)))
    except (
        ConfigError,
        DataError,
        CheckpointError,
        MeshError,
        ShardingRuleError,
        RewardError,
    ) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (TrainingDiverged, NonFiniteStateError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Preempted as e:
        print(e, file=sys.stderr)
        return e.exit_code
    return 0


def requested_cpu_devices(stages: list[str], overrides: list[str]) -> int | None:
    """``placement.cpu_devices`` of the run's configs, read before JAX starts (it fixes the
    CPU device count then); None when no stage sets it. A value that is not a positive int is
    left for the config's own validation to report.

    Raises:
      ConfigError: stages of one pipeline ask for different counts.
    """
    asked: dict[str, int] = {}
    for path in stages:
        data, _ = read_config(path, overrides)
        placement = data.get("placement")
        value = placement.get("cpu_devices") if isinstance(placement, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            asked[path] = value
    if len(set(asked.values())) > 1:
        listed = ", ".join(f"{p}: {v}" for p, v in asked.items())
        raise ConfigError(
            f"placement.cpu_devices differs between pipeline stages ({listed}); one process "
            "has one CPU device count, fixed when JAX starts"
        )
    count = next(iter(asked.values()), None)
    others = [p for p in stages if p not in asked]
    if count is not None and others:
        logging.getLogger("jaxrlhf").info(
            "placement.cpu_devices: %d applies to every stage (one count per process), also to "
            "%s, which does not set it",
            count,
            ", ".join(others),
        )
    return count


if __name__ == "__main__":
    sys.exit(main())
