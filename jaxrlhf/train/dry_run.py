"""``--dry-run``: will this run fit? Parameters per role and compiled memory per phase.

:func:`plan` builds every role's parameters as ``jax.ShapeDtypeStruct`` (no device memory),
jits each phase's programs exactly as the trainers do (same functions, shardings and
donation), lowers and compiles them against abstract inputs on the configured mesh, and
reads XLA's memory analysis of each compiled program (bytes per device: arguments, outputs,
aliased (donated) buffers, temporaries). :func:`format_report` prints the table;
:func:`cli` is what ``python -m jaxrlhf.train --config FILE [--config OVERLAY] --dry-run``
runs (on the files merged, as a real run would).

Phases and their programs::

    generate  prefill, decode      the sampler (KV cache, n samples per prompt)
    score     reward, score        reward model (if any); policy/reference/value forwards
    train     update | train_step  RL: epochs x minibatches x micro-batches; else one step

A program's peak per device is ``arguments + outputs - aliased + temporaries`` plus
everything else that stays on the device while it runs (``resident``: the other roles'
parameters and optimizer states, the generate-layout copy of the policy), counted from the
shardings. ``state`` is the analytic part alone: parameters and optimizer states present
during the phase, without activations.

Where the numbers come from, and what they are worth:

* By default programs are compiled by XLA:CPU on fake CPU devices (``jax_num_cpu_devices``),
  whatever machine runs the dry run, so no accelerator time is spent and a 64-chip mesh
  plans on a laptop. XLA:CPU is an *estimate* of GPU/TPU memory: it fuses and schedules
  differently, may keep bf16 matmul operands in float32, and knows nothing of allocator
  fragmentation, cuDNN workspaces or the runtime's reserve (JAX on GPU preallocates 75% of
  memory unless ``XLA_PYTHON_CLIENT_MEM_FRACTION`` says otherwise). Leave headroom.
* With ``--topology NAME`` (``v5e:2x2``; :mod:`jaxrlhf.sharding.topology`) they are compiled
  by XLA:TPU for that slice's compile-only devices on this host (the TPU compiler's memory
  and cost analyses; still no allocator fragmentation or runtime reserve). The run's mesh
  must cover the slice (a ``-1`` axis fills it), and the fit is checked against the chip's
  HBM unless ``--device-memory`` or ``--device-kind`` says otherwise.
* A mesh needs as many devices as it has; :func:`cli` sets the CPU device count before JAX
  starts, or re-runs itself in a subprocess when this process already started JAX with
  fewer devices. A ``-1`` (fill) mesh axis fills the devices this process sees. With a
  ``placement``, the training programs compile on the first ``train_devices`` and the
  sampler's on its own mesh; bytes per device are the busiest device's (the sampler's copy
  of the policy is counted on every sampler device, an upper bound).
* Nothing is read but the config: no data, no tokenizer, no weights. A model section must
  therefore name a ``preset`` (or an ``hf_dir`` whose config.json exists); a reward model
  or DPO reference whose checkpoint is absent is planned with the policy's architecture
  (the report says so). In a pipeline, a path to what an earlier stage exports is planned
  from that stage's model config (:class:`_PendingExports`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from jaxrlhf import platform
from jaxrlhf.config import (
    COMMAND_LINE,
    RL_ALGORITHMS,
    ConfigError,
    RunConfig,
    from_dict,
    load_config,
    read_configs,
    validate,
)
from jaxrlhf.sharding import MeshConfig, MeshError, make_mesh
from jaxrlhf.sharding.placement import (
    ROLE_GROUPS,
    PlacementConfig,
    role_devices,
    role_mesh_config,
    train_device_count,
)
from jaxrlhf.sharding.topology import (
    Topology,
    load_topology,
    no_persistent_cache,
    topology_mesh,
)
from jaxrlhf.train import dry_run_json, dry_run_rl
from jaxrlhf.train import dry_run_phases as phases
from jaxrlhf.train.dry_run_phases import DryRunError, EngineLayout, ProgramMemory, RoleMemory

__all__ = [
    "DEVICE_KINDS",
    "DryRunError",
    "DryRunReport",
    "EngineLayout",
    "ProgramMemory",
    "RoleMemory",
    "cli",
    "device_memory",
    "format_report",
    "parse_memory",
    "plan",
]

GiB = 2**30
_CHILD_ENV = "JAXRLHF_DRY_RUN_CHILD"

# HBM per device of known accelerators (GiB, as sold; the usable part is a little less).
DEVICE_KINDS: dict[str, float] = {
    "h100": 80,
    "h200": 141,
    "b200": 180,
    "a100-80gb": 80,
    "a100-40gb": 40,
    "l4": 24,
    "a10g": 24,
    "tpu-v4": 32,
    "tpu-v5e": 16,
    "tpu-v5p": 95,
    "tpu-v6e": 32,
}

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_memory(text: str) -> int:
    """``"80GB"`` -> 80e9 bytes. Units B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB.

    Raises:
      ValueError: not a positive number with one of those units (one-line message).
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(
            f"cannot read {text!r} as a memory size (expected a positive number and a unit, "
            "e.g. 80GB, 16GiB, 512MB)"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def device_memory(memory: str | None, kind: str | None) -> tuple[int | None, str]:
    """Bytes per device from ``--device-memory`` or ``--device-kind``, and a label.

    Raises:
      ConfigError: both given, an unreadable size or an unknown kind (one line).
    """
    if memory is not None and kind is not None:
        raise ConfigError(f"{COMMAND_LINE}: give --device-memory or --device-kind, not both")
    if memory is not None:
        try:
            return parse_memory(memory), memory.strip()
        except ValueError as e:
            raise ConfigError(f"{COMMAND_LINE}: --device-memory: {e}") from None
    if kind is not None:
        key = kind.strip().lower()
        if key not in DEVICE_KINDS:
            raise ConfigError(
                f"{COMMAND_LINE}: --device-kind: unknown kind {kind!r} (known: "
                f"{', '.join(DEVICE_KINDS)}; or give --device-memory)"
            )
        return int(DEVICE_KINDS[key] * GiB), f"{key}, {DEVICE_KINDS[key]:g} GiB"
    return None, ""


# ---- the report -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DryRunReport:
    """What :func:`plan` found; :func:`format_report` prints it."""

    source: str
    algorithm: str
    model: str
    mesh: dict[str, int]
    platform: str
    shapes: str
    roles: tuple[RoleMemory, ...]
    programs: tuple[ProgramMemory, ...]
    device_memory: int | None
    device_label: str
    seconds: float
    notes: tuple[str, ...] = ()
    sync_bytes: tuple[int, int] | None = None  # LoRA policy: (adapter, full) sync per iteration
    critic_bytes: tuple[int, int] | None = None  # Hydra critic: (its, a separate one's) per device
    reshard_bytes: int = 0  # RL: bytes a sampler device receives when the policy moves to it
    engine_layout: EngineLayout | None = None  # RL with the rollout engine: its slots
    packing: Any = None  # RL: the run's rl_packing.PackingPlanner (its packed sizes)
    topology: str | None = None  # the TPU topology compiled for (--topology), if any
    device_kind: str = "cpu"  # the devices' kind as JAX names it ("TPU v5 lite")

    @property
    def compiler(self) -> str:
        """The compiler whose analyses the report holds: ``XLA:TPU v5e:2x2`` for a
        topology, ``XLA:CPU estimate`` on CPU devices (a proxy of accelerator memory)."""
        if self.topology is not None:
            return f"XLA:TPU {self.topology}"
        if self.platform.startswith("XLA:CPU"):
            return "XLA:CPU estimate"
        return self.platform

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def peak(self) -> ProgramMemory:
        return max(self.programs, key=lambda p: p.peak_bytes)

    @property
    def fits(self) -> bool | None:
        """Whether every program's peak fits ``device_memory`` (None: not checked)."""
        if self.device_memory is None:
            return None
        return self.peak.peak_bytes <= self.device_memory

    def reason(self) -> str:
        """One line: the verdict."""
        p = self.peak
        where = f"{p.phase}/{p.name} peaks at {_gib(p.peak_bytes)} per device"
        if self.device_memory is None:
            return f"{where}; fit not checked (give --device-memory or --device-kind)"
        head = self.device_memory - p.peak_bytes
        if head < 0:
            return f"does not fit: {where}, over {_gib(self.device_memory)} ({self.device_label})"
        pct = 100 * head / self.device_memory
        return f"fits: {where}, {_gib(head)} ({pct:.0f}%) headroom of {_gib(self.device_memory)}"


def _gib(n: int | None) -> str:
    if n is None:
        return "-"
    if n == 0:
        return "0"
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.2f} MiB"


def format_report(report: DryRunReport) -> str:
    """The dry-run table (roles, then one row per compiled program) and the verdict."""
    mesh = " x ".join(f"{k}={v}" for k, v in report.mesh.items())
    lines = [
        f"dry run of {report.source}: {report.algorithm}, {report.model}",
        f"mesh {mesh} ({report.devices} device(s)); {report.shapes}",
        "",
        f"{'role':<10} {'head':<7} {'parameters':>15} {'params/device':>14} "
        f"{'generate/dev':>13} {'optimizer/dev':>14}",
    ]
    for r in report.roles:
        lines.append(
            f"{r.role:<10} {r.head:<7} {r.params:>15,} {_gib(r.param_bytes):>14} "
            f"{_gib(r.generate_bytes):>13} {_gib(r.optimizer_bytes or None):>14}"
            + (f"  ({r.note})" if r.note else "")
        )
    fit_col = report.device_memory is not None
    lines += [
        "",
        f"bytes per device, compiled by {report.compiler} (memory analysis) + resident "
        "(other roles' state):",
        f"{'phase':<9} {'program':<11} {'arguments':>11} {'outputs':>11} {'aliased':>11} "
        f"{'temp':>11} {'resident':>11} {'peak':>11} {'state':>11} {'compile':>8}"
        + ("  fits" if fit_col else ""),
    ]
    for p in report.programs:
        row = (
            f"{p.phase:<9} {p.name:<11} {_gib(p.argument_bytes):>11} {_gib(p.output_bytes):>11} "
            f"{_gib(p.alias_bytes):>11} {_gib(p.temp_bytes):>11} {_gib(p.resident_bytes):>11} "
            f"{_gib(p.peak_bytes):>11} {_gib(p.state_bytes):>11} {p.compile_s:>7.1f}s"
        )
        if fit_col:
            row += "  yes" if p.peak_bytes <= report.device_memory else "  NO"
        lines.append(row)
    if report.topology is not None:
        how = "the TPU compiler's memory analysis (no allocator fragmentation or runtime reserve)"
    else:
        how = (
            "an estimate of accelerator memory (XLA:CPU fuses and schedules differently and "
            "may keep bf16 operands in f32; no allocator fragmentation or runtime reserve)"
        )
    lines += [
        "",
        f"{report.reason()}.",
        "state = parameters + optimizer state per device (analytic, no activations; streamed "
        "scoring adds the rollout engine's slots and the forwards it holds). Compiled "
        f"by {report.platform} in {report.seconds:.0f} s: {how}.",
    ]
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)


# ---- entry points -----------------------------------------------------------------------------


def plan(
    cfg: RunConfig,
    *,
    mesh: Mesh | None = None,
    source: str = "<config>",
    override_paths: Sequence[str] | Mapping[str, str] = (),
    device_memory: int | None = None,
    device_label: str = "",
    packed_sizes: bool = False,
    topology: Topology | None = None,
) -> DryRunReport:
    """Compiles every phase of ``cfg`` against abstract inputs and reports its memory.

    Args:
      cfg: the run config.
      mesh: the mesh to compile for (default: ``cfg.mesh`` over this process's CPU devices,
        which must be enough; see :func:`cli` for getting them).
      source, override_paths: where the config came from, for messages (as
        ``config.from_dict`` takes them).
      device_memory: bytes per device to check the peak against (None: not checked).
      device_label: how to name that memory in the verdict.
      packed_sizes: also compile the learner's sequence-packed scoring and update programs
        at each smaller packed size (``score@k``, ``update@k``: k packed rows per shard;
        run 0 times), for the planner to price the size a length distribution gives.
      topology: compile with XLA:TPU for this slice's devices
        (:func:`jaxrlhf.sharding.topology.load_topology`) instead of on CPU devices; the
        run must use every one of them. Not with ``mesh``.

    Raises:
      ConfigError, MeshError, ShardingRuleError: one-line user errors (a run whose devices
        do not match the topology's is a MeshError).
    """
    start = time.perf_counter()
    placement = cfg.placement
    if topology is not None:
        if mesh is not None:
            raise ValueError("plan: give a mesh or a topology, not both")
        devices = list(topology.devices)
        what = f"mesh {cfg.mesh.describe()}" if placement == PlacementConfig() else "this run"
        topology.check_devices(run_devices(cfg.mesh, placement), what)
        try:
            train_count = train_device_count(placement, len(devices))
        except MeshError as e:
            raise MeshError(f"placement.train_devices: {e}") from None
        mesh = topology_mesh(cfg.mesh, devices[:train_count])
    elif mesh is None:
        devices = jax.devices("cpu")
        total = run_devices(cfg.mesh, placement) or len(devices)
        if total > len(devices):
            what = f"mesh {cfg.mesh.describe()}" if placement == PlacementConfig() else "this run"
            raise MeshError(
                f"{what} needs {total} devices; this process has "
                f"{len(devices)} CPU devices (use jaxrlhf.train.dry_run.cli)"
            )
        devices = devices[:total]
        try:
            train_count = train_device_count(placement, total)
        except MeshError as e:
            raise MeshError(f"placement.train_devices: {e}") from None
        mesh = make_mesh(cfg.mesh, devices=devices[:train_count])
    else:
        devices = list(mesh.devices.flat)
        if placement.generate_mesh is not None:
            devices = jax.devices("cpu")
    # On a TPU slice, each mesh in the order a run there gets it.
    mesh_of = make_mesh if topology is None else topology_mesh
    gen_mesh, ref_mesh, critic_mesh = mesh, None, None
    if placement.generate_mesh is not None and cfg.algorithm in RL_ALGORITHMS:
        gen_mesh = mesh_of(placement.generate_mesh, devices=devices)
    if placement.strategy != "colocated":  # the learner's, the sampler's and side groups
        groups = role_devices(placement, len(devices))
        learner = [devices[i] for i in groups["learner"]]
        mesh = mesh_of(role_mesh_config(placement, "learner", cfg.mesh), learner)
        gen_mesh = mesh
        if "sampler" in groups and cfg.algorithm in RL_ALGORITHMS:
            sampler = [devices[i] for i in groups["sampler"]]
            gen_mesh = mesh_of(role_mesh_config(placement, "sampler", cfg.mesh), sampler)
        if "reference_group" in groups and cfg.algorithm in RL_ALGORITHMS:
            own = [devices[i] for i in groups["reference_group"]]
            ref_mesh = mesh_of(role_mesh_config(placement, "reference_group", cfg.mesh), own)
        if "critic" in groups and cfg.algorithm == "ppo":  # interleaved: the critic's own
            critic = [devices[i] for i in groups["critic"]]
            critic_mesh = mesh_of(role_mesh_config(placement, "critic", cfg.mesh), critic)
    layout = validate(
        cfg,
        len(devices),
        mesh=mesh,
        source=source,
        override_paths=override_paths,
    )
    model_cfg = layout.model
    planner = phases.Planner(
        cfg, model_cfg, mesh, gen_mesh, ref_mesh, critic_mesh, packed_sizes=packed_sizes
    )
    if cfg.algorithm in RL_ALGORITHMS:
        shapes = dry_run_rl.plan_rl(planner, layout)
    else:
        shapes = phases.plan_supervised(planner, layout)
    device = mesh.devices.flat[0]
    platform = f"XLA:{device.platform.upper()}"
    if topology is not None:
        platform = f"{topology.compiler} ({len(topology.devices)} x {topology.device_kind})"
    elif device.platform == "cpu":
        platform += f" on {len(set(devices) | set(mesh.devices.flat))} CPU device(s)"
    return DryRunReport(
        source=source,
        algorithm=cfg.algorithm,
        model=(
            f"{model_cfg.family}, {_parameters(planner.roles, cfg)} ({model_cfg.param_dtype} "
            f"params, {model_cfg.dtype} compute, remat {model_cfg.remat})"
        ),
        mesh=dict(mesh.shape),
        platform=platform,
        shapes=shapes,
        roles=tuple(planner.roles),
        programs=tuple(planner.programs),
        device_memory=device_memory,
        device_label=device_label,
        seconds=time.perf_counter() - start,
        notes=tuple(planner.notes),
        sync_bytes=planner.sync_bytes,
        critic_bytes=planner.critic_bytes,
        reshard_bytes=planner.reshard_bytes,
        engine_layout=planner.engine_layout,
        packing=planner.packing,
        topology=None if topology is None else topology.name,
        device_kind=device.device_kind,
    )


def _parameters(roles: Sequence[RoleMemory], cfg: RunConfig) -> str:
    """The trained model's size: its parameters, or a LoRA model's base and adapters."""
    trunk = [r for r in roles if r.role == "trunk"]
    if trunk:  # Hydra: the policy's branch is roles[0]
        return f"{trunk[0].params + roles[0].params:,} parameters"
    if len(roles) > 1 and roles[1].role == "base":
        return (
            f"{roles[1].params:,} parameters + {roles[0].params:,} LoRA (rank {cfg.lora.rank}, "
            f"{', '.join(cfg.lora.targets)})"
        )
    return f"{roles[0].params:,} parameters"


def mesh_devices(mesh: MeshConfig) -> int | None:
    """Devices the mesh needs, or None when an axis is -1 (fill whatever is there)."""
    sizes = mesh.sizes()
    return None if -1 in sizes else math.prod(sizes)


def run_devices(mesh: MeshConfig, placement: PlacementConfig) -> int | None:
    """Devices the whole run needs, or None when a -1 (fill) axis leaves it open: the
    sampler's own mesh if it has one; with role groups, ``cpu_devices`` or, when every group
    (the learner's included) lists its devices, every device they name; else the training mesh
    (its ``train_devices``)."""
    if placement.generate_mesh is not None:
        return mesh_devices(placement.generate_mesh)
    if placement.strategy != "colocated":  # role groups: every device they name
        if placement.cpu_devices is not None:
            return placement.cpu_devices
        groups = tuple(getattr(placement, role) for role in ROLE_GROUPS)
        named = [i for group in groups if group is not None for i in group.devices]
        listed = placement.learner is not None and all(g is None or g.devices for g in groups)
        if named and listed:
            return max(named) + 1
        return None  # a fraction, or the learner taking the rest: every device there is
    if placement.train_devices != -1:
        return placement.train_devices
    return mesh_devices(mesh)


def _configured_devices(paths: Sequence[str], overrides: Sequence[str]) -> int | None:
    """Devices the run of the config files ``paths`` (merged) asks for (:func:`run_devices`),
    read before JAX starts; None when unreadable (load_config reports any error properly
    later)."""
    try:
        data, _ = read_configs(paths, overrides)
        raw = dict(data.get("placement") or {})
        if raw.get("generate_mesh") is not None:
            raw["generate_mesh"] = MeshConfig(**raw["generate_mesh"])
        return run_devices(MeshConfig(**(data.get("mesh") or {})), PlacementConfig(**raw))
    except (ConfigError, TypeError, ValueError, AttributeError):
        return None


def _cpu_devices(n: int | None) -> bool:
    """Points JAX, if it has not started yet, at ``n`` CPU devices (None: as configured);
    returns whether this process has at least ``n``."""
    if n is not None:
        platform.set_cpu_devices(n)  # a no-op once JAX has started: its count is fixed
    try:
        jax.config.update("jax_platforms", "cpu")  # read when JAX starts, ignored after
    except RuntimeError:
        pass
    return n is None or len(jax.devices("cpu")) >= n


def _run_child(
    paths: Sequence[str],
    overrides: Sequence[str],
    flags: Sequence[str],
    n: int,
    stages: list[dict[str, Any]] | None = None,
) -> int:
    """The dry run of one config (its files ``paths``) in a fresh process with ``n`` CPU
    devices; appends its JSON entries to ``stages`` (None: no JSON wanted)."""
    import tempfile

    env = dict(os.environ, JAX_PLATFORMS="cpu", **{_CHILD_ENV: "1"})
    cmd = [sys.executable, "-m", "jaxrlhf.train", "--dry-run", *flags]
    cmd += [f"--config={p}" for p in paths] + [f"--set={o}" for o in overrides]
    with tempfile.TemporaryDirectory(prefix="jaxrlhf-dry-run-") as tmp:
        report = os.path.join(tmp, "report.json")
        if stages is not None:
            cmd.append(f"--json={report}")
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if stages is not None:
            stages.extend(dry_run_json.read_stages(report))
    sys.stdout.write(out.stdout)
    sys.stderr.write(out.stderr)
    return out.returncode


def cli(
    paths: str | Sequence[str],
    overrides: Sequence[str] = (),
    *,
    memory: str | None = None,
    kind: str | None = None,
    topology: str | None = None,
    json_path: str | None = None,
) -> int:
    """``--dry-run`` of a config or pipeline file and any overlay files after it (merged in
    order, :func:`jaxrlhf.train.pipeline.run_stages`): prints each stage's table.

    Args:
      paths, overrides: the config files (merged in order) and ``key=value`` overrides.
      memory, kind: ``--device-memory`` / ``--device-kind`` (:func:`device_memory`).
      topology: ``--topology``: compile with XLA:TPU for that slice
        (:mod:`jaxrlhf.sharding.topology`); the fit is then checked against its chip's HBM
        unless ``memory`` or ``kind`` is given.
      json_path: ``--json``: also write every stage's report there
        (:mod:`jaxrlhf.train.dry_run_json`).

    Returns:
      0 when every stage fits (or no device memory was given), 1 when one does not (its
      reason is printed as one line on stderr).

    Raises:
      ConfigError, MeshError, ShardingRuleError: one-line user errors (the CLI exits 2):
        among them no TPU compiler, an unknown topology, or a mesh of another size.
    """
    from jaxrlhf.train.pipeline import run_stages

    if json_path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(json_path))):
        raise ConfigError(f"{COMMAND_LINE}: --json {json_path}: its directory does not exist")
    target = None
    if topology is not None:
        _cpu_devices(None)  # this process compiles only: the TPU runtime never starts here
        no_persistent_cache()
        target = load_topology(topology)
        if memory is None and kind is None:
            kind = target.kind  # the chip's HBM (None: a chip without figures: not checked)
    limit, label = device_memory(memory, kind)
    flags = [f"--device-memory={memory}"] * (memory is not None)
    flags += [f"--device-kind={kind}"] * (kind is not None)
    stages = run_stages([paths] if isinstance(paths, str) else paths)
    status = 0
    reports: list[dict[str, Any]] | None = [] if json_path is not None else None
    # A pipeline stage often loads the model an earlier stage exports; that export does not
    # exist before a real run, so those stages are planned from a stand-in directory holding
    # the config.json the earlier stage would write (the dry run reads nothing else).
    exports = _PendingExports()
    try:
        for i, stage in enumerate(stages):
            if len(stages) > 1:
                print(f"== stage {i + 1}/{len(stages)}: {stage[0]}", flush=True)
            stage_overrides = [*overrides, *exports.overrides_for(stage, overrides)]
            needed = None if target is not None else _configured_devices(stage, stage_overrides)
            cfg = None
            if not _cpu_devices(needed):
                if os.environ.get(_CHILD_ENV):
                    raise MeshError(f"could not get {needed} CPU devices for the dry run")
                status = max(status, _run_child(stage, stage_overrides, flags, needed, reports))
            else:
                data, origins = read_configs(stage, stage_overrides)
                cfg = from_dict(data, source=stage[0], override_paths=origins)
                done = _plan_and_report(cfg, stage, origins, limit, label, target, reports)
                status = max(status, done)
            if i + 1 < len(stages):
                exports.add(cfg, stage, stage_overrides, i + 1)
    finally:
        exports.close()
        if json_path is not None:
            dry_run_json.write_report(json_path, reports)
    return status


def _plan_and_report(
    cfg: RunConfig,
    stage: Sequence[str],
    origins: Mapping[str, str],
    limit: int | None,
    label: str | None,
    topology: Topology | None = None,
    reports: list[dict[str, Any]] | None = None,
) -> int:
    """Plans one stage (its config files; on ``topology``'s devices if given) and prints its
    table, appending its JSON entry to ``reports`` (None: none wanted); 1 when it does not
    fit or compile, else 0."""
    files = " + ".join(stage)
    try:
        report = plan(
            cfg,
            source=stage[0],
            override_paths=origins,
            device_memory=limit,
            device_label=label,
            topology=topology,
        )
    except DryRunError as e:
        print(f"error: {files}: {e}", file=sys.stderr)
        if reports is not None:
            reports.append(dry_run_json.error_entry(files, str(e)))
        return 1
    report = dataclasses.replace(report, source=files)  # the table names every file merged
    if reports is not None:
        reports.append(dry_run_json.report_entry(report))
    print(format_report(report), flush=True)
    if report.fits is False:
        print(f"error: {files}: {report.reason()}", file=sys.stderr)
        return 1
    return 0


class _PendingExports:
    """The Hugging Face exports earlier pipeline stages would write, as stand-in directories
    holding only their ``config.json``; later stages' paths to them are redirected there."""

    def __init__(self) -> None:
        self._root: str | None = None
        self._by_path: dict[str, tuple[str, int, str]] = {}  # export -> (stand-in, stage)

    def add(
        self,
        cfg: RunConfig | None,
        stage: Sequence[str],
        overrides: Sequence[str],
        number: int,
    ) -> None:
        """Records what ``stage`` (the ``number``-th, its config files) exports; ``cfg``
        None = load it here."""
        import json
        import tempfile

        from jaxrlhf.models.hf_config import to_hf_config
        from jaxrlhf.train.loop import exported_model

        if cfg is None:  # planned in a child process: only its model config is needed here
            try:
                cfg = load_config(stage, overrides)
            except ConfigError:
                return  # the child reported it
        if not cfg.checkpoint.export_hf:
            return
        export, head = exported_model(cfg)
        export = os.path.abspath(export)
        if self._root is None:
            self._root = tempfile.mkdtemp(prefix="jaxrlhf-dry-run-")
        stand_in = os.path.join(self._root, f"stage{number}")
        os.makedirs(stand_in, exist_ok=True)
        with open(os.path.join(stand_in, "config.json"), "w") as f:
            json.dump(to_hf_config(cfg.model.resolve(), head), f)  # validated when loaded
        self._by_path[export] = (stand_in, number, stage[0])

    def overrides_for(self, stage: Sequence[str], overrides: Sequence[str]) -> list[str]:
        """``key=stand-in`` overrides for the settings of ``stage`` (its config files) that
        name a pending export which does not exist yet; prints a note for each."""
        if not self._by_path:
            return []
        try:
            data, _ = read_configs(stage, overrides)
        except ConfigError:
            return []  # load_config reports it
        out = []
        for key, value in _string_settings(data):
            found = self._by_path.get(os.path.abspath(value))
            if found is None or os.path.exists(os.path.join(value, "config.json")):
                continue
            stand_in, number, source = found
            print(
                f"note: {key}: {value} is written by stage {number} ({source}), which has not"
                " run: planned with the model that stage exports",
                flush=True,
            )
            out.append(f"{key}={stand_in}")
        return out

    def close(self) -> None:
        import shutil

        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)


def _string_settings(data: dict, prefix: str = "") -> list[tuple[str, str]]:
    """``(dotted.key, value)`` for every string value in nested mappings."""
    out = []
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out.extend(_string_settings(value, f"{dotted}."))
        elif isinstance(value, str):
            out.append((dotted, value))
    return out
