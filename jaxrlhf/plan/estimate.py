"""One plan's predicted seconds per iteration, memory per device and idle time.

A plan is the run config with an overlay applied (placement, meshes, remat, micro-batches,
staleness). :func:`estimate` prices it:

1. **Compile** every program of the plan as the dry run does (``dry_run.plan``: the
   trainers' own programs on abstract shapes, fake CPU devices). A model deeper than
   :data:`FULL_DEPTH_LAYERS` (whose layers run as a scan) compiles shallow instead: its
   programs' costs (XLA's cost analysis: FLOPs, bytes accessed, collective bytes) from
   unrolled stacks of 1 and 2 layers, its peak memory from scanned stacks of 2 and 4, each
   extrapolated affinely to its depth: four shallow compiles price a 70B model on a laptop;
   layers are identical, so costs and stacked activations are affine in depth (tests check
   it against a full-depth compile).
2. **Time** each program as its runs per iteration (decode steps, micro-batches x
   minibatches x epochs, ...; ``ProgramMemory.runs``; the rollout engine's decode steps and
   admissions replayed on the response-length distribution, :mod:`jaxrlhf.plan.lengths`)
   times its roofline seconds on the
   cluster's device kind, divided by the phase's efficiency (the :class:`CostModel`:
   defaults, or fitted by ``--calibrate``). The weight sync moves the bytes the dry run
   measured between the training and sampling layouts over the links.
3. **Schedule** several iterations on the placement's device groups
   (:mod:`jaxrlhf.plan.simulator`): the steady-state period is the predicted seconds per
   iteration; idle is the share of device-seconds no phase uses. JAX CPU devices share one
   host's cores: there a program spanning k devices costs k times its per-device roofline
   and phases running at once share the host (``Cluster.shared_host``).
4. **Reject** plans whose peak per device exceeds the usable memory, with the reason.

Assumptions (stated in every report): the response lengths (``--lengths``; by default every
sample generates ``max_new_tokens`` tokens; the static sampler decodes that many steps
whatever the lengths); sequence-packed scoring and the update at the packed size the
trainer's planner picks for those lengths (:func:`_packed_costs`); programs
compiled by XLA:CPU (its fusion and cost analysis stand in for the accelerator's), or with
``--topology`` by XLA:TPU for that slice (the TPU compiler's own analyses); the
update's optimizer step is counted once per micro-batch (an overestimate when
``num_micro > 1``); a host reward function costs what the cost model says (0 uncalibrated).
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxrlhf.config import ConfigError, RunConfig
from jaxrlhf.plan.hardware import Cluster
from jaxrlhf.plan.lengths import BUDGET, LengthModel, engine_replay
from jaxrlhf.plan.simulator import Schedule, iteration_tasks, simulate
from jaxrlhf.sharding import MeshError, ShardingRuleError
from jaxrlhf.train.program_cost import ProgramCost, roofline_seconds

__all__ = [
    "DEFAULT_EFFICIENCY",
    "PHASES",
    "USABLE_MEMORY",
    "CostModel",
    "PlanEstimate",
    "ProgramEstimate",
    "ScheduleShape",
    "CompiledPlan",
    "compile_plan",
    "estimate",
    "invalid_plan_errors",
    "phase_of",
    "state_floor",
    "view_cost_model",
    "with_layers",
]

PHASES = ("generate", "score", "train", "sync")
# Fractions of the roofline an uncalibrated plan assumes each phase reaches (typical of
# large-model JAX programs: dense training near 40-50% MFU, decode near half the HBM
# bandwidth); --calibrate replaces them with measured ones.
DEFAULT_EFFICIENCY = {"generate": 0.5, "score": 0.5, "train": 0.4, "sync": 0.7}
USABLE_MEMORY = 0.9  # of a device's memory: runtime reserve and fragmentation
FULL_DEPTH_LAYERS = 16  # deeper models (scanned layers) are compiled shallow, extrapolated
DEFAULT_CONTENTION = 0.5  # CPU devices of one host, uncalibrated: halfway


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Roofline efficiencies per phase and host seconds per iteration.

    Attributes:
      efficiency: achieved fraction of the roofline (predicted = roofline / efficiency) per
        ``phase@devices`` (the phase's programs spanning that many devices) or, where that
        key is absent, per ``phase``.
      host_seconds: phase -> seconds per iteration spent on the host (the reward function,
        Python between programs), added as they are.
      contention: devices sharing one host (CPU): how much phases running at once slow
        each other (``simulator.simulate``; 1: as a fluid, 0: not at all).
      calibrated_on: what the factors were fitted on (empty: the defaults).
      cluster: the cluster they were fitted on (``Cluster.label``; empty: any).
    """

    efficiency: Mapping[str, float] = dataclasses.field(
        default_factory=lambda: dict(DEFAULT_EFFICIENCY)
    )
    host_seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)
    contention: float = DEFAULT_CONTENTION
    calibrated_on: str = ""
    cluster: str = ""

    def efficiency_of(self, phase: str, devices: int) -> float:
        """The efficiency of ``phase`` whose programs span ``devices`` devices."""
        key = f"{phase}@{devices}"
        if key in self.efficiency:
            return self.efficiency[key]
        return self.efficiency.get(phase, DEFAULT_EFFICIENCY[phase])

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str) -> CostModel:
        """Reads :meth:`to_json`'s output.

        Raises:
          ConfigError: not such a file (one line naming ``source``).
        """
        try:
            data = json.loads(text)
            model = cls(
                efficiency={k: float(v) for k, v in data["efficiency"].items()},
                host_seconds={k: float(v) for k, v in data.get("host_seconds", {}).items()},
                contention=float(data.get("contention", DEFAULT_CONTENTION)),
                calibrated_on=str(data.get("calibrated_on", "")),
                cluster=str(data.get("cluster", "")),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{source}: not a cost model written by --calibrate ({e})") from None
        bad = [k for k, v in model.efficiency.items() if k.split("@")[0] not in PHASES or not v > 0]
        if bad:
            raise ConfigError(f"{source}: efficiency {bad[0]!r}: expected a phase with a value > 0")
        return model


@dataclasses.dataclass(frozen=True)
class ProgramEstimate:
    """One program of a plan at the model's depth.

    Attributes:
      phase, name: as the dry run names them.
      runs: times its (loop body) cost is paid per iteration.
      cost: per-device cost of one run.
      peak_bytes: its peak bytes per device (XLA memory analysis + resident state).
      seconds: predicted seconds per iteration (runs x roofline / efficiency).
      group: the side group it runs on (an interleaved plan's ``critic`` or ``reference``),
        "" for its phase's own group.
    """

    phase: str
    name: str
    runs: float
    cost: ProgramCost
    peak_bytes: int
    seconds: float
    group: str = ""


@dataclasses.dataclass(frozen=True)
class PlanEstimate:
    """What :func:`estimate` predicts for one plan.

    Attributes:
      label: the plan in one line.
      overlay: the config overlay that makes the run follow this plan.
      phases: predicted seconds per iteration of ``generate``, ``score``, ``train``, ``sync``
        (the sampler's and the learner's), and an interleaved plan's side groups' as
        ``"score:GROUP"`` / ``"train:GROUP"`` (``critic``, ``reference``).
      iteration_s: predicted steady-state seconds per iteration (the simulator's period).
      idle_fraction: share of device-seconds no phase uses in the steady state.
      programs: per program.
      reshard_bytes: bytes a sampler device receives per weight sync.
      peak_bytes: the largest program peak per device.
      rejected: why the plan cannot run ("" when it can).
      groups: device group -> devices.
    """

    label: str
    overlay: Mapping[str, Any]
    phases: Mapping[str, float]
    iteration_s: float
    idle_fraction: float
    programs: tuple[ProgramEstimate, ...]
    reshard_bytes: int
    peak_bytes: int
    rejected: str = ""
    groups: Mapping[str, int] = dataclasses.field(default_factory=dict)
    schedule: ScheduleShape | None = None
    phase_devices: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return not self.rejected


@dataclasses.dataclass(frozen=True)
class ScheduleShape:
    """How a plan's phases are scheduled: on separate groups or not, the staleness bound,
    the sync cadence, whether its devices share one host."""

    separated: bool
    staleness: int
    sync_every: int
    shared_host: bool

    def period(self, phases: Mapping[str, float], contention: float) -> float:
        """Steady-state seconds per iteration of ``phases`` scheduled this way."""
        return _steady_state(phases, self, contention)[1]


def with_layers(cfg: RunConfig, layers: int, loop: str = "auto") -> RunConfig:
    """``cfg`` with its model cut to ``layers`` decoder layers run as ``loop``. A Hydra
    critic branches at the last layer (a one-layer branch: the added layers are priced as
    frozen trunk, an underestimate of the update when the real branch is deeper)."""
    spec = cfg.model
    overrides = {**spec.overrides, "num_layers": layers, "layer_loop": loop}
    cfg = cfg.replace(model=dataclasses.replace(spec, overrides=overrides))
    if cfg.algorithm == "ppo" and cfg.ppo.value.branch_layer is not None:
        value = dataclasses.replace(cfg.ppo.value, branch_layer=layers - 1)
        cfg = cfg.replace(ppo=dataclasses.replace(cfg.ppo, value=value))
    return cfg


def _sync_bytes(report: Any) -> int:
    """Bytes a sampler device receives per weight sync (LoRA: the adapters or the merged
    model, as ``lora.sync`` says; Hydra: the merged policy)."""
    return report.reshard_bytes


def _affine(a: float, b: float, at: int, step: int, depth: int) -> float:
    """The value at ``depth`` of the line through ``a`` (at ``at`` layers) and ``b`` (at
    ``at + step``)."""
    return a + (depth - at) * (b - a) / step


def _compiled_programs(
    cfg: RunConfig, source: str, packed_sizes: bool = False, topology: Any = None
) -> tuple[list, int, Any, Any]:
    """The dry run's programs at the model's depth: ``[(phase, name, runs, cost, peak)]``,
    the weight-sync bytes, a report (for its source) and the rollout engine's
    :class:`~jaxrlhf.train.dry_run.EngineLayout` (None without the engine).

    A model of at most :data:`FULL_DEPTH_LAYERS` layers compiles as it is. A deeper one runs
    its layers as a scan, whose body XLA's cost analysis counts once: its costs come from
    unrolled compiles at 1 and 2 layers, its memory and sync bytes from scanned compiles at
    2 and 4 layers (the deep model's buffers: stacked per-layer activations), each
    extrapolated affinely to the depth. ``topology``: compiled by XLA:TPU for that slice
    (:class:`jaxrlhf.sharding.topology.Topology`) instead of on CPU devices.
    """
    from jaxrlhf.train import dry_run

    depth = cfg.model.resolve().num_layers

    def plan(c: RunConfig) -> Any:
        return dry_run.plan(c, source=source, packed_sizes=packed_sizes, topology=topology)

    if depth <= FULL_DEPTH_LAYERS:  # shallow enough to compile as it is
        report = plan(cfg)
        programs = [(p.phase, p.name, p.runs, p.cost, p.peak_bytes) for p in report.programs]
        return programs, _sync_bytes(report), report, report.engine_layout
    one, two = (plan(with_layers(cfg, k, "unroll")) for k in (1, 2))
    low, high = (plan(with_layers(cfg, k, "scan")) for k in (2, 4))
    programs = []
    for a, b, m2, m4 in zip(one.programs, two.programs, low.programs, high.programs, strict=True):
        peak = _affine(m2.peak_bytes, m4.peak_bytes, 2, 2, depth)
        programs.append((a.phase, a.name, a.runs, a.cost.extrapolate(b.cost, depth), int(peak)))
    sync = _affine(_sync_bytes(low), _sync_bytes(high), 2, 2, depth)
    layout = one.engine_layout
    if layout is not None:  # the KV bytes per slot and position grow with the layers
        kv = _affine(layout.kv_bytes, two.engine_layout.kv_bytes, 1, 1, depth)
        layout = dataclasses.replace(layout, kv_bytes=kv)
    return programs, int(sync), one, layout


def _replay(cfg: RunConfig, lengths: LengthModel, compiled: CompiledPlan) -> Any:
    """The rollout engine's :func:`~jaxrlhf.plan.lengths.engine_replay` of one iteration
    with response lengths from ``lengths`` (on the rows it starts, ending with the groups it
    keeps), or None without the engine."""
    from jaxrlhf.config import rl_section

    r = rl_section(cfg).rollout
    layout = compiled.engine_layout
    if r.engine != "continuous" or layout is None:
        return None
    t = r.max_new_tokens
    return engine_replay(
        lengths.lengths(r.started_prompts * r.num_samples, t),
        layout.local_slots * layout.shards,
        r.chunk_steps,
        r.num_samples,
        shards=layout.shards,
        max_new_tokens=t,
        views=bool(layout.views),
        keep_groups=r.prompts_per_step,
        token_budget=r.token_budget,
    )


def _engine_runs(
    cfg: RunConfig, compiled: CompiledPlan, replay: Any
) -> tuple[dict[str, int], ProgramCost | None] | None:
    """The rollout engine's ``decode`` steps and ``admit`` calls per iteration as
    ``replay`` (:func:`_replay`) has them, and the decode step's mean cost over those
    chunks, each on the view it decodes on (None: every chunk costs the whole state's).
    None without the engine (the static sampler's steps do not depend on the lengths).

    A step on a view is priced by :func:`view_cost_model` from the whole state's chunk and
    the views the dry run compiles."""
    from jaxrlhf.config import rl_section
    from jaxrlhf.train.dry_run_rl import view_program_name

    if replay is None:
        return None
    r = rl_section(cfg).rollout
    layout = compiled.engine_layout
    generate = {name: c for ph, name, _, c, _ in compiled.programs if ph == "generate"}
    full = generate["decode"]
    views = {v: generate[view_program_name(*v)] for v in layout.views}
    runs = {"decode": replay.chunks * r.chunk_steps, "admit": replay.admits}
    if not views:
        return runs, None
    view_cost = view_cost_model(
        full,
        views,
        layout.local_slots,
        r.max_new_tokens,
        cfg.data.max_prompt_length,
        r.chunk_steps,
        layout.kv_bytes,
    )
    total = full.scale(0.0)
    for view, count in collections.Counter(replay.views).items():
        total = total + (full if view is None else view_cost(*view)).scale(count)
    return runs, total.scale(1 / replay.chunks)


# Programs packed by another planner than the learner's scoring and update (a reference
# on its own group packs over that group's data shards): priced at their largest size.
_OWN_PACKING = ("reference",)


def _packed_costs(
    cfg: RunConfig, lengths: LengthModel, compiled: CompiledPlan, replay: Any
) -> dict[str, Callable[[str, ProgramCost], ProgramCost]]:
    """Per sequence-packed phase (``score``, ``train``): how one of its programs' cost at
    the largest packed size becomes its cost at the packed size the trainer's own planner
    (``rl_packing.PackingPlanner``) picks for rows of ``lengths``.

    The learner's program (``score``, ``update``) is compiled at every packed size with
    ``compile_plan(packed_sizes=True)`` (the dry run's ``score@k``, ``update@k``): at the
    planner's size ``m`` it costs exactly that compile. The other programs packed by the
    same plan (the reward model's forward, an interleaved critic's forward and update)
    scale by the learner program's ratio at ``m``, field by field; a reference on its own
    group (another planner) keeps its largest size. The rows: the rollout's prompt groups
    with full-length prompts and the lengths' responses (``LengthModel.lengths``, as the
    engine replay draws them); with the engine's over-sampling, the groups the ``replay``
    keeps. Scoring streamed in batches while the tail decodes is priced as one pass over
    the rollout. Empty when the lengths are the budget's (nothing shrinks), or a phase does
    not pack or runs unpacked at these lengths (priced at its largest packed size)."""
    import jax

    from jaxrlhf.config import rl_section
    from jaxrlhf.train.dry_run_rl import packed_program_name

    planner = compiled.packing
    if planner is None or lengths.kind == "budget":
        return {}
    r = rl_section(cfg).rollout
    prompt, t, n = cfg.data.max_prompt_length, r.max_new_tokens, r.num_samples
    if replay is not None and r.started_prompts > r.prompts_per_step:  # the kept groups
        started = lengths.lengths(r.started_prompts * n, t).reshape(-1, n)
        drawn = started[list(replay.kept)].reshape(-1)
    else:
        drawn = np.asarray(lengths.lengths(r.rows, t))
    rows = len(drawn)
    mask = np.zeros((rows, prompt + t), bool)
    mask[:, :prompt] = True
    mask[:, prompt:] = np.arange(t)[None, :] < drawn[:, None]
    tokens = np.zeros(mask.shape, np.int32)
    tokens[:, :prompt] = 1 + np.arange(rows)[:, None] // n  # one prompt per group
    plans = {
        "score": ("score", planner.score(tokens, mask)),
        "train": ("update", planner.update(tokens, mask, jax.random.key(0))),
    }
    costs = {(ph, name): c for ph, name, _, c, _ in compiled.programs}
    out = {}
    for phase, (learner, plan) in plans.items():
        high = costs.get((phase, learner))
        at = None if plan is None else costs.get((phase, packed_program_name(learner, plan.rows)))
        if high is None or at is None:  # unpacked here, at the largest size, or not compiled
            continue
        ratio = (
            at.flops / high.flops if high.flops else 1.0,
            at.bytes_accessed / high.bytes_accessed if high.bytes_accessed else 1.0,
        )

        def scaled(name: str, c: ProgramCost, learner=learner, at=at, ratio=ratio) -> ProgramCost:
            if name == learner:
                return at
            if name in _OWN_PACKING:
                return c
            return ProgramCost(
                c.flops * ratio[0],
                c.bytes_accessed * ratio[1],
                tuple((g, b * ratio[1]) for g, b in c.collectives),
                c.devices,
            )

        out[phase] = scaled
    return out


def view_cost_model(
    full: ProgramCost,
    views: Mapping[tuple[int, int], ProgramCost],
    local: int,
    width: int,
    prompt_len: int,
    chunk: int,
    kv_bytes: float,
) -> Callable[[int, int], ProgramCost]:
    """``(rows, width) -> cost`` of one decode step of a chunk on a view of ``rows`` slots
    per shard whose generated cache is cut to ``width`` columns.

    XLA's cost analysis counts a loop's body once, so a compiled chunk program costs one
    step plus what it does once per chunk. The whole-state chunk (``full``: ``local`` slots,
    ``width`` = max_new_tokens) is one step, ``body(local, width)``; a view's program also
    moves its slots' ``[prompt | width]`` cache regions (``kv_bytes`` per slot and position)
    out of the state and back, read and written each way, and passes the state through,
    once per chunk::

        body(r, w) = a + b r + c r w                  weights once; each slot's work
        copy(r, w) = K + 4 kv_bytes r (prompt_len + w) bytes only (no FLOPs, no collectives)

    ``a, b, c, K`` per field (FLOPs, bytes, collective bytes) by least squares on ``full``
    and the compiled ``views`` after taking the regions' bytes out (exact with the four the
    dry run compiles: the largest, the fewest rows, the narrowest width, and the whole state
    taken as a view; with fewer, the last of ``a, K, c, b`` are left out). The regions'
    bytes are not fitted: within a view they grow with ``r`` and ``r w`` as the body does,
    so no set of views tells them apart. A step on a view costs ``body + copy / chunk``;
    clamped at 0.
    """
    points = [((local, width), full, False)] + [(v, c, True) for v, c in views.items()]
    terms = min(len(points), 4)

    def features(r: int, w: int, view: bool) -> list[float]:
        return [1.0, float(view), r * w, r][:terms]  # a, K, c, b: left out from the end

    def regions(r: int, w: int) -> float:
        return 4.0 * kv_bytes * r * (prompt_len + w)

    groups = sorted({g for _, c, _ in points for g, _ in c.collectives})

    def fields(c: ProgramCost) -> list[float]:
        per_group = dict(c.collectives)
        return [c.flops, c.bytes_accessed] + [per_group.get(g, 0.0) for g in groups]

    design = np.array([features(*v, view) for v, _, view in points])
    targets = np.array([fields(c) for _, c, _ in points])  # [points, fields]
    for i, (v, _, view) in enumerate(points):
        targets[i, 1] -= regions(*v) if view else 0.0
    coef = np.linalg.lstsq(design, targets, rcond=None)[0]  # [terms, fields]

    def cost(r: int, w: int) -> ProgramCost:
        f = features(r, w, True)
        if terms >= 2:
            f[1] /= chunk  # the state passed through, once per chunk
        out = np.array(f) @ coef
        out[1] += regions(r, w) / chunk
        out = np.maximum(out, 0.0)
        return ProgramCost(
            float(out[0]),
            float(out[1]),
            tuple((g, float(x)) for g, x in zip(groups, out[2:], strict=True)),
            full.devices,
        )

    return cost


# The placement's side groups as the planner (and the trainer's timeline) names them.
SIDE_GROUPS = {"critic": "critic", "reference_group": "reference"}


def _groups(cfg: RunConfig, devices: int) -> dict[str, int]:
    """Devices per group: ``all`` (colocated), or ``learner`` and any of ``sampler``,
    ``critic``, ``reference`` (separated, interleaved)."""
    from jaxrlhf.sharding.placement import role_devices

    if cfg.placement.strategy == "colocated":
        return {"all": devices}
    return {SIDE_GROUPS.get(k, k): len(v) for k, v in role_devices(cfg.placement, devices).items()}


@dataclasses.dataclass(frozen=True)
class CompiledPlan:
    """A plan's programs at the model's depth (what :func:`compile_plan` extrapolated):
    ``programs`` as ``(phase, name, runs, cost, peak bytes)``, the weight-sync bytes, and
    ``groups``: ``(phase, name)`` -> the side group of an interleaved plan's programs that
    run on one (the critic's values and update, the reference's forward)."""

    programs: tuple[tuple[str, str, float, ProgramCost, int], ...]
    sync_bytes: int
    source: str
    engine_layout: Any = None  # jaxrlhf.train.dry_run.EngineLayout with the rollout engine
    groups: Mapping[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    packing: Any = None  # the run's rl_packing.PackingPlanner (its packed sizes)


def compile_plan(
    cfg: RunConfig, source: str = "<plan>", packed_sizes: bool = False, topology: Any = None
) -> CompiledPlan:
    """Compiles ``cfg``'s programs (this process must have the devices its placement
    names, as CPU devices) and extrapolates them to the model's depth. ``packed_sizes``:
    also the sequence-packed scoring and update at each smaller packed size, so that
    :func:`estimate` prices them at the packed size a length distribution gives.
    ``topology`` (a :class:`jaxrlhf.sharding.topology.Topology`): compiled by XLA:TPU for
    that slice's devices instead (its costs and memory are the TPU compiler's).

    Raises:
      ConfigError, MeshError, ShardingRuleError, DryRunError: the plan is not a valid run
        (:func:`invalid_plan_errors`).
    """
    programs, sync, report, layout = _compiled_programs(cfg, source, packed_sizes, topology)
    groups = {(p.phase, p.name): SIDE_GROUPS[p.group] for p in report.programs if p.group}
    return CompiledPlan(tuple(programs), sync, report.source, layout, groups, report.packing)


def estimate(
    cfg: RunConfig,
    cluster: Cluster,
    model: CostModel,
    *,
    compiled: CompiledPlan | None = None,
    overlay: Mapping[str, Any] | None = None,
    label: str = "",
    lengths: LengthModel = BUDGET,
) -> PlanEstimate:
    """Predicts ``cfg`` on ``cluster`` from its compiled programs (:func:`compile_plan`,
    compiled here when None), its samples' response lengths drawn from ``lengths``.

    Raises:
      the errors of :func:`compile_plan`.
    """
    from jaxrlhf.config import rl_section

    spec = cluster.spec
    compiled = compile_plan(cfg) if compiled is None else compiled
    programs, sync_bytes = compiled.programs, compiled.sync_bytes
    groups = _groups(cfg, cluster.count)
    separated = "sampler" in groups
    side_of = compiled.groups
    spans = dict.fromkeys(PHASES, 1)
    for phase, name, _, cost, _ in programs:
        key = _phase_key(phase, side_of.get((phase, name), ""))
        spans[key] = max(spans.get(key, 1), cost.devices)
    spans["sync"] = groups.get("sampler", groups.get("learner", groups.get("all", 1)))
    phases = dict.fromkeys(PHASES, 0.0)
    priced = []
    replay = _replay(cfg, lengths, compiled)
    engine = _engine_runs(cfg, compiled, replay)
    packed = _packed_costs(cfg, lengths, compiled, replay)
    for phase, name, runs, cost, peak in programs:
        priced_cost = cost
        if engine is not None and phase == "generate" and name in engine[0]:
            runs = engine[0][name]
            if name == "decode" and engine[1] is not None:  # the views' mean step
                priced_cost = engine[1]
        if phase in packed and runs > 0:  # at the packed size of the lengths
            priced_cost = packed[phase](name, cost)
        one = roofline_seconds(priced_cost, spec.peak_flops, spec.memory_bandwidth, spec.link_for)
        # The reference's forward on the sampler's group (placement.reference: sampler) is
        # a scoring forward in the sampler's time: scoring's efficiency, generate's devices.
        like = "score" if (phase, name) == ("generate", "reference") else phase
        group = side_of.get((phase, name), "")
        key = _phase_key(phase, group)
        span = cost.devices if like != phase else spans[key]
        seconds = runs * one / model.efficiency_of(like, span)
        if cluster.shared_host:  # its devices' shards run on the same cores
            seconds *= cost.devices
        priced.append(ProgramEstimate(phase, name, runs, cost, peak, seconds, group))
        phases[key] = phases.get(key, 0.0) + seconds
    link = spec.link_for(cluster.count if separated else groups.get("learner", cluster.count))
    phases["sync"] = sync_bytes / link / model.efficiency_of("sync", spans["sync"])
    for phase, seconds in model.host_seconds.items():
        phases[phase] = phases.get(phase, 0.0) + seconds
    algo = rl_section(cfg)
    shape = ScheduleShape(
        separated=separated,
        staleness=algo.rollout.max_staleness if separated else 0,
        sync_every=cfg.placement.weight_sync_every,
        shared_host=cluster.shared_host,
    )
    schedule, period = _steady_state(phases, shape, model.contention)
    idle = _idle(schedule, groups, period)
    peak = max(priced, key=lambda p: p.peak_bytes)
    usable = USABLE_MEMORY * spec.memory_bytes
    rejected = ""
    if peak.peak_bytes > usable:
        rejected = (
            f"{peak.phase}/{peak.name} needs {peak.peak_bytes / 2**30:.1f} GiB per device, over "
            f"the {usable / 2**30:.1f} GiB usable of a {spec.name} ({USABLE_MEMORY:.0%})"
        )
    return PlanEstimate(
        label=label or compiled.source,
        overlay=dict(overlay or {}),
        phases=phases,
        iteration_s=period,
        idle_fraction=idle,
        programs=tuple(priced),
        reshard_bytes=sync_bytes,
        peak_bytes=peak.peak_bytes,
        rejected=rejected,
        groups=groups,
        schedule=shape,
        phase_devices=spans,
    )


def _phase_key(phase: str, group: str) -> str:
    """The key of ``phase`` on ``group`` in a plan's phases (``"score:critic"``; the phase
    itself on its own group)."""
    return f"{phase}:{group}" if group else phase


def phase_of(key: str) -> str:
    """The phase of a key of :attr:`PlanEstimate.phases` (``"score:critic"`` -> ``score``)."""
    return key.partition(":")[0]


def _steady_state(
    phases: Mapping[str, float], shape: ScheduleShape, contention: float
) -> tuple[tuple[Schedule, float, float], float]:
    """The schedule of enough iterations to reach the steady state, its window and period."""
    staleness, sync_every = shape.staleness, shape.sync_every
    n = 10 + 3 * staleness + 3 * sync_every
    schedule = simulate(
        iteration_tasks(
            phases,
            separated=shape.separated,
            iterations=n,
            max_staleness=staleness,
            weight_sync_every=sync_every,
        ),
        shared_host=shape.shared_host,
        contention=contention,
    )
    # The window: past the start-up (the sampler running ahead to its bound) and before the
    # end (where the sampler has no further rollouts to make).
    first, last = n // 3, n - 2 - staleness - sync_every
    start, end = schedule.end[f"train{first}"], schedule.end[f"train{last}"]
    period = (end - start) / (last - first) if end > start else schedule.makespan / n
    return (schedule, start, end), period


def _idle(window: tuple[Schedule, float, float], groups: Mapping[str, int], period: float) -> float:
    schedule, start, end = window
    if end <= start or period <= 0:
        return 0.0
    total = sum(groups.values())
    busy = sum(schedule.busy(g, start, end) * n for g, n in groups.items())
    return max(0.0, 1.0 - busy / (total * (end - start)))


def state_floor(cfg: RunConfig) -> int:
    """A lower bound of the bytes per device that the models' states need, without
    compiling, on the busiest device group: on the learner's, every trained model's
    parameters and Adam moments at the parameter dtype (3 copies) and every frozen one's
    parameters over its fsdp x tensor shards, plus (colocated) the sampler's copy of the
    policy where its layout differs; on a separated sampler's, that copy (and the reference
    with ``placement.reference: sampler``, which the learner's then lacks); on an
    interleaved plan's critic group, the critic's state, on its reference group, the
    reference (the learner's then lacks them). The sampler keeps
    the policy whole on each data x fsdp replica, sharded over tensor only. 0 for LoRA and
    Hydra runs (their trained part is small; the compile decides)."""
    from jaxrlhf.config import rl_section
    from jaxrlhf.models import model as model_lib

    algo = rl_section(cfg)
    if cfg.lora is not None or getattr(getattr(algo, "value", None), "branch_layer", None):
        return 0
    model = cfg.model.resolve()
    itemsize = 2 if model.param_dtype in ("bfloat16", "float16") else 4
    lm = model_lib.param_count(model_lib.abstract_params(model))
    scalar = model_lib.param_count(model_lib.abstract_params(model, "scalar"))
    p = cfg.placement
    ref_apart = p.strategy == "separated" and p.reference == "sampler"
    ref_own = p.strategy == "interleaved" and p.reference == "own"
    critic_own = p.strategy == "interleaved" and p.critic is not None
    # the policy trained, the reference frozen
    copies = 3 * lm + (0 if ref_apart or ref_own else lm)
    side = [0]  # an interleaved plan's side groups: the critic's state, the reference
    if cfg.algorithm == "ppo":
        if critic_own:
            side.append(3 * scalar * itemsize // _shards(p.critic.mesh))
        else:
            copies += 3 * scalar  # the critic
    if ref_own:
        side.append(lm * itemsize // _shards(p.reference_group.mesh))
    if algo.reward.model_dir is not None:
        copies += scalar  # the reward model (planned with the policy's architecture)
    learner = cfg.mesh if p.learner is None or p.learner.mesh is None else p.learner.mesh
    learner_tensor = max(1, learner.tensor)
    learner_bytes = copies * itemsize // (max(1, learner.fsdp) * learner_tensor)
    if p.strategy == "interleaved" and p.sampler is None:  # the sampler on the learner's
        differs = learner.fsdp > 1
        return max(learner_bytes + (lm * itemsize // learner_tensor if differs else 0), *side)
    learner_bytes = max(learner_bytes, *side)
    if p.strategy != "colocated":
        sampler = p.sampler.mesh if p.sampler is not None and p.sampler.mesh else None
        copy = lm * itemsize // max(1, sampler.tensor if sampler is not None else 1)
        if ref_apart:  # and the reference, sharded as the sampler's rules shard it (>= this)
            copy += lm * itemsize // max(1, (sampler.fsdp * sampler.tensor) if sampler else 1)
        return max(learner_bytes, copy)
    sampler_tensor = max(1, (p.generate_mesh or learner).tensor)
    differs = learner.fsdp > 1 or sampler_tensor != learner_tensor
    return learner_bytes + (lm * itemsize // sampler_tensor if differs else 0)


def _shards(mesh: Any) -> int:
    """The fsdp x tensor shards of a group's mesh (None: data-parallel only)."""
    return 1 if mesh is None else max(1, mesh.fsdp) * max(1, mesh.tensor)


def invalid_plan_errors() -> tuple[type[Exception], ...]:
    """The exceptions that mean "this plan is not a valid run" (rejected, not a crash)."""
    from jaxrlhf.train.dry_run_phases import DryRunError

    return (ConfigError, MeshError, ShardingRuleError, DryRunError)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
