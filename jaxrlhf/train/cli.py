"""The command line of ``python -m jaxrlhf.train`` (``__main__`` calls :func:`main`):
``--config FILE [--config OVERLAY ...] [overrides]``, parse, load the config (the files
merged in order), run every stage, or with ``--dry-run`` compile and report.

User errors (config, data, checkpoint, mesh, reward) print one line ``error: ...`` and exit
2; a diverged, non-finite or out-of-memory run exits 1; a preempted one with its own code.
"""

from __future__ import annotations

import argparse
import logging
import sys

from jaxrlhf.config import ConfigError, describe_fields


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (its epilog lists every config field)."""
    parser = argparse.ArgumentParser(
        prog="python -m jaxrlhf.train",
        description="Train with jaxrlhf (algorithm: sft | reward_model | dpo | ilql | ppo | grpo) "
        "from a YAML config, or run a pipeline file that lists stage configs.",
        epilog="config fields (override any with section.field=value):\n" + describe_fields(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add(
        "--config",
        required=True,
        action="append",
        metavar="FILE",
        help="YAML run config, e.g. configs/tiny_sft.yaml; repeat it to merge overlays in order "
        "(sections merge key by key, later values win)",
    )
    add("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field")
    add("overrides", nargs="*", metavar="KEY=VALUE", help="same as --set")
    add(
        "--dry-run",
        action="store_true",
        help="compile every phase on abstract inputs (CPU, no data or weights read) and print "
        "parameters per role and memory per device per phase; then exit",
    )
    add("--device-memory", metavar="SIZE", help="with --dry-run: check the peak fits SIZE (80GB)")
    add(
        "--device-kind",
        metavar="KIND",
        help="with --dry-run: check against a known device's memory (h100, tpu-v5e, ...)",
    )
    add(
        "--topology",
        metavar="NAME",
        help="with --dry-run: compile every program with the TPU compiler for this TPU slice "
        "(v5e:2x2, v5e:8x8, v5p:2x2x2, v4:2x2x1, v6e:4x4) on this host, and check the fit "
        "against its chip's HBM; needs libtpu (pip install -e '.[tpu]')",
    )
    add(
        "--json",
        metavar="FILE",
        help="with --dry-run: also write the report (per program: memory and cost analysis) "
        "as JSON to FILE",
    )
    add(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in the run directory; error if there is "
        "none (same as checkpoint.resume=always; the default, auto, resumes when one exists)",
    )
    return parser


def _train(args: argparse.Namespace) -> None:
    """Every stage of the config (a run or a pipeline), each validated when its turn comes."""
    from jaxrlhf import platform
    from jaxrlhf.config import from_dict, read_configs
    from jaxrlhf.sharding.distributed import initialize_from_env
    from jaxrlhf.sharding.placement import check_cpu_devices
    from jaxrlhf.train import compilation_cache
    from jaxrlhf.train.pipeline import requested_cpu_devices, run_stages

    stages = run_stages(args.config)
    cpu_devices = requested_cpu_devices(stages, [*args.set, *args.overrides])
    for note in platform.configure_cpu_host(cpu_devices):  # before the backend starts
        logging.getLogger("jaxrlhf").debug("%s", note)
    initialize_from_env()  # joins a TPU pod / Slurm / MPI job; a no-op on one machine
    cache = compilation_cache.enable()
    logging.getLogger("jaxrlhf").info(
        "compilation cache: %s", cache.directory or f"off ({compilation_cache.SETTING_ENV})"
    )
    check_cpu_devices(cpu_devices)  # before sizes are checked
    from jaxrlhf.train import loop

    for i, files in enumerate(stages):
        if len(stages) > 1:
            print(f"== stage {i + 1}/{len(stages)}: {files[0]}", flush=True)
        overrides = [*args.set, *args.overrides]
        if args.resume:  # a pipeline's later stages may not have started yet
            overrides.append(f"checkpoint.resume={'always' if i == 0 else 'auto'}")
        data, origins = read_configs(files, overrides)
        cfg = from_dict(data, source=files[0], override_paths=origins)
        loop.run(cfg, source=files[0], override_paths=origins)


def main(argv: list[str] | None = None) -> int:
    """Runs the command line ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    args = build_parser().parse_args(argv)
    import jax  # (no backend starts here: the CPU host is configured in _train first)

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("jaxrlhf").setLevel(logging.INFO)
    from jaxrlhf.data import DataError
    from jaxrlhf.models.safetensors_io import CheckpointError
    from jaxrlhf.rewards import RewardError
    from jaxrlhf.sharding import MeshError, ShardingRuleError
    from jaxrlhf.train.checkpointing import NonFiniteStateError
    from jaxrlhf.train.preemption import (
        OutOfDeviceMemory,
        Preempted,
        TrainingDiverged,
        is_out_of_memory,
        out_of_memory_message,
    )

    user_errors = (ConfigError, DataError, CheckpointError, MeshError, ShardingRuleError)

    try:
        if args.dry_run:  # exit 1 when a phase does not fit the device memory
            from jaxrlhf.train import dry_run

            overrides = [*args.set, *args.overrides]
            return dry_run.cli(
                args.config,
                overrides,
                memory=args.device_memory,
                kind=args.device_kind,
                topology=args.topology,
                json_path=args.json,
            )
        dry_run_only = ("device_memory", "device_kind", "topology", "json")
        if any(getattr(args, name) is not None for name in dry_run_only):
            raise ConfigError(
                "command line: --device-memory, --device-kind, --topology and --json need --dry-run"
            )
        _train(args)
    except (*user_errors, RewardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (TrainingDiverged, NonFiniteStateError, OutOfDeviceMemory) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except jax.errors.JaxRuntimeError as e:  # out of memory outside the steps
        if not is_out_of_memory(e):
            raise
        where = "while setting up, restoring or exporting the run"
        print(f"error: {out_of_memory_message(e, where)}", file=sys.stderr)
        return 1
    except Preempted as e:
        print(e, file=sys.stderr)
        return e.exit_code
    return 0
