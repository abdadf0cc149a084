"""Placement: which devices the training mesh and the sampler's mesh cover.

By default every phase of a run uses one mesh over all of the process's devices (the
``mesh`` section) and the phases differ only in their sharding rules. The ``placement``
section changes that:

* ``train_devices``: the training mesh (updates and scoring) covers the first N devices
  only (single-process runs).
* ``generate_mesh``: the sampler gets its own mesh over all devices (PPO and GRPO). The
  policy's parameters move to it with ``jax.device_put`` every iteration (the sampler's
  ``to_generate_layout``, timed and counted as the reshard phase); rollouts come back
  through host memory, as they already do for rewards.
* ``cpu_devices``: on CPU, the number of JAX devices the process splits the host into
  (``jax_num_cpu_devices``). It must be set before JAX starts: ``python -m jaxrlhf.train``
  does so from the config; in Python call :func:`jaxrlhf.platform.set_cpu_devices` first.

Why: on a CPU the decode loop runs many small operations per token, and XLA:CPU splits each
over the cores with a synchronisation per operation, so a second core adds little inside
one device; two CPU devices with half the batch each run two independent decode loops, one
per core. The update is the opposite: its large matmuls use both cores well inside one
device, and on two devices it is slower (gradient all-reduce, two sets of buffers). So on a
2-core host::

    placement: {cpu_devices: 2, train_devices: 1, generate_mesh: {data: -1, fsdp: 1}}

trains on one device and samples on two (benchmarks/RESULTS.md has the figures).

Strategies (``strategy``) put roles on device groups of their own:

* ``colocated`` (the default): the above; every role time-shares the training mesh (the
  sampler possibly spanning all devices through ``generate_mesh``).
* ``separated``: the sampler on the ``sampler`` group, the learners (policy, reference,
  critic, reward model) on the ``learner`` group (default: every device the sampler does not
  take), disjoint. The policy's weights go to the sampler with ``jax.device_put`` after each
  update, or every ``weight_sync_every`` updates; with ``rollout.max_staleness >= 1`` the
  sampler then generates the next batches while the learner trains. With ``reference:
  sampler`` the frozen reference's forward runs on the sampler's group too, right after
  each batch is sampled (its copy of the reference is placed there once): the learner,
  usually the busier side, keeps only the policy's (and critic's) work.
* ``interleaved``: independent roles on exclusive groups, running at once. PPO: the critic
  on a ``critic`` group of its own, the policy (and reference) on the ``learner`` group:
  the critic's value forward and update run while the policy's scoring forwards and update
  run (a host thread dispatches the critic's update); the groups' data shards (data x
  fsdp) must be equal, so both updates split the rollout alike. Not with a Hydra critic
  (``ppo.value.branch_layer``): it shares the policy's trunk. Every RL algorithm (the GRPO
  family needs it, having no critic): ``reference: own`` puts the frozen reference on a
  ``reference_group`` of its own, whose scoring forward runs (from a host thread) while the
  learner's old-policy forward runs; its log-probs then join the learner's advantages. The
  sampler samples on its ``sampler`` group if one is given, else on the learner's.

A group is ``{devices: [i, ...]}`` (indices into ``jax.devices()``) or ``{fraction: f}`` (the
next ``round(f * n)`` devices not taken), with an optional ``mesh`` shape over it (default:
every device on ``data``). Overlapping, empty or oversized groups are one-line errors.
Several processes: a group is a list of global device indices and may span processes (each
process then runs every program of the groups it has devices in); a weight sync between
groups whose device sets differ across processes goes through the hosts
(``sharding.reshard``: all-gathered, then placed), which multi-controller JAX's
``device_put`` refuses to do directly. Asynchronous sampling (``max_staleness >= 1``) is
single-process: its two threads would start cross-process programs in different orders.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh

from jaxrlhf.sharding.mesh import MeshConfig, MeshError, make_mesh, resolve_mesh_shape

_ALL = -1
STRATEGIES = ("colocated", "separated", "interleaved")
ROLE_GROUPS = ("sampler", "learner", "critic", "reference_group")
REFERENCE_PLACES = ("learner", "sampler", "own")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceGroup:
    """The devices of one role group (``placement.sampler`` / ``placement.learner``).

    Attributes:
      devices: indices into ``jax.devices()``; or
      fraction: this share of the devices (the next ``round(fraction * n)`` not taken).
      mesh: the group's mesh shape (None: the learner group uses the ``mesh`` section, the
        sampler group ``{data: -1}``).
    """

    devices: tuple[int, ...] = ()
    fraction: float | None = None
    mesh: MeshConfig | None = None

    def __post_init__(self) -> None:
        if bool(self.devices) == (self.fraction is not None):
            raise ValueError("set exactly one of devices and fraction")
        if self.fraction is not None and not 0 < self.fraction < 1:
            raise ValueError(f"fraction: must be in (0, 1), got {self.fraction}")
        if any(i < 0 for i in self.devices) or len(set(self.devices)) != len(self.devices):
            raise ValueError(f"devices: must be distinct indices >= 0, got {list(self.devices)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    """Which devices the training mesh and the sampler's mesh cover (docs/sharding.md,
    "Placement").

    Attributes:
      cpu_devices: CPU runs: JAX CPU devices to split the host into, set by ``python -m
        jaxrlhf.train`` before JAX starts (None: JAX's default, one device unless
        ``XLA_FLAGS`` says otherwise). Ignored on GPU/TPU.
      train_devices: devices the training mesh (``mesh``) covers, the first ones of
        ``jax.devices()`` (single-process runs); -1: all of them.
      generate_mesh: PPO/GRPO: the sampler's own mesh over all devices, a mesh section
        (``{data: -1, fsdp: 1, tensor: 1}``); its data shards must divide
        ``rollout.prompts_per_step``. None: the sampler uses the training mesh. Unused by
        the other algorithms (like the ``ppo``/``grpo`` sections).
      strategy: ``colocated`` (roles time-share the training mesh) or ``separated`` (the
        sampler on its own devices: module docstring).
      sampler, learner, critic, reference_group: the device groups (:class:`DeviceGroup`) of
        ``separated`` (sampler, learner) and ``interleaved`` (learner, critic and/or
        reference_group, optionally sampler); the learner group defaults to every device the
        others do not take.
      weight_sync_every: the sampler gets the policy's weights after every this many updates
        (1: each; more: the sampler samples with weights up to that many versions old, which
        ``loss.rollout_correction`` can correct).
      reference: where the frozen reference's scoring forward runs: ``learner`` (with the
        other scoring forwards) or ``sampler`` (``separated`` only: on the sampler's group,
        after each batch is sampled, so the learner's devices do less; a second copy of the
        reference lives on the sampler's devices) or ``own`` (``interleaved`` only: on
        ``reference_group``, its forward beside the learner's scoring forwards; the
        reference lives there only).
    """

    cpu_devices: int | None = None
    train_devices: int = _ALL
    generate_mesh: MeshConfig | None = None
    strategy: str = "colocated"
    sampler: DeviceGroup | None = None
    learner: DeviceGroup | None = None
    critic: DeviceGroup | None = None
    reference_group: DeviceGroup | None = None
    weight_sync_every: int = 1
    reference: str = "learner"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy: expected one of {list(STRATEGIES)}, got {self.strategy!r}")
        if self.reference not in REFERENCE_PLACES:
            raise ValueError(
                f"reference: expected one of {list(REFERENCE_PLACES)}, got {self.reference!r}"
            )
        if self.reference == "sampler" and self.strategy != "separated":
            raise ValueError(
                "reference: sampler runs the reference on the sampler's own devices; it needs "
                f"strategy: separated (got {self.strategy})"
            )
        if self.reference == "own" and self.strategy != "interleaved":
            raise ValueError(
                "reference: own runs the reference on a group of its own; it needs strategy: "
                f"interleaved (got {self.strategy})"
            )
        if (self.reference == "own") != (self.reference_group is not None):
            raise ValueError(
                "reference_group: set it exactly when reference: own (the reference's group)"
            )
        if self.weight_sync_every < 1:
            raise ValueError(f"weight_sync_every: must be >= 1, got {self.weight_sync_every}")
        if self.strategy == "colocated":
            for role in ROLE_GROUPS:
                if getattr(self, role) is not None:
                    raise ValueError(
                        f"{role}: device groups need strategy: separated or interleaved"
                    )
        else:
            if self.strategy == "separated" and self.sampler is None:
                raise ValueError("sampler: strategy separated needs the sampler's group")
            if self.strategy == "separated" and self.critic is not None:
                raise ValueError("critic: a critic group needs strategy: interleaved")
            if self.strategy == "interleaved" and self.critic is None and self.reference != "own":
                raise ValueError(
                    "critic: strategy interleaved needs the critic's group, the reference's "
                    "(reference: own with reference_group), or both"
                )
            if self.train_devices != _ALL or self.generate_mesh is not None:
                raise ValueError(
                    f"strategy: {self.strategy} places roles with the sampler/learner groups, "
                    "not train_devices/generate_mesh"
                )
        if self.cpu_devices is not None and self.cpu_devices < 1:
            raise ValueError(f"cpu_devices: must be >= 1 or null, got {self.cpu_devices}")
        if self.train_devices < 1 and self.train_devices != _ALL:
            raise ValueError(f"train_devices: must be >= 1 or -1 (all), got {self.train_devices}")


def role_devices(placement: PlacementConfig, device_count: int) -> dict[str, tuple[int, ...]]:
    """Device indices of each role group (``{}`` for ``colocated``): explicit lists first,
    then fractions in role order over the devices not taken; the learner group defaults to
    the rest.

    Raises:
      MeshError: ``"placement.<role>...: problem"``: an index past the devices, a group that
        overlaps another, is empty, or more devices than there are.
    """
    if placement.strategy == "colocated":
        return {}
    groups: dict[str, tuple[int, ...]] = {}
    taken: dict[int, str] = {}
    for role in ROLE_GROUPS:
        group = getattr(placement, role)
        if group is None or not group.devices:
            continue
        for i in group.devices:
            if i >= device_count:
                raise MeshError(
                    f"placement.{role}.devices: device {i} does not exist ({device_count} devices)"
                )
            if i in taken:
                raise MeshError(
                    f"placement.{role}.devices: device {i} is also in placement.{taken[i]}"
                )
            taken[i] = role
        groups[role] = tuple(group.devices)
    for role in ROLE_GROUPS:
        group = getattr(placement, role)
        if group is None or group.fraction is None:
            continue
        want = round(group.fraction * device_count)
        free = [i for i in range(device_count) if i not in taken]
        if want < 1:
            raise MeshError(
                f"placement.{role}.fraction: {group.fraction} of {device_count} devices is "
                "no device"
            )
        if want > len(free):
            raise MeshError(
                f"placement.{role}.fraction: {group.fraction} of {device_count} devices needs "
                f"{want}, but only {len(free)} are not taken"
            )
        groups[role] = tuple(free[:want])
        taken.update({i: role for i in free[:want]})
    if "learner" not in groups:
        rest = tuple(i for i in range(device_count) if i not in taken)
        if not rest:
            raise MeshError("placement.learner: the other groups leave no device to learn on")
        groups["learner"] = rest
    return groups


def role_mesh_config(placement: PlacementConfig, role: str, train: MeshConfig) -> MeshConfig:
    """The mesh shape of ``role``'s group: its own ``mesh``, else ``train`` (learner) or every
    device on ``data`` (sampler)."""
    group = getattr(placement, role)
    if group is not None and group.mesh is not None:
        return group.mesh
    return train if role == "learner" else MeshConfig(data=_ALL, fsdp=1, tensor=1)


def _group_mesh(placement: PlacementConfig, role: str, train: MeshConfig) -> Mesh:
    devices = jax.devices()
    ids = role_devices(placement, len(devices))[role]
    return make_mesh(role_mesh_config(placement, role, train), [devices[i] for i in ids])


def train_device_count(placement: PlacementConfig, device_count: int) -> int:
    """How many of ``device_count`` devices the training mesh covers.

    Raises:
      MeshError: ``train_devices`` exceeds the devices there are.
    """
    if placement.strategy != "colocated":
        return len(role_devices(placement, device_count)["learner"])
    if placement.train_devices == _ALL:
        return device_count
    if placement.train_devices > device_count:
        raise MeshError(
            f"{placement.train_devices} exceeds the {device_count} device(s) of this run"
        )
    return placement.train_devices


def train_mesh(mesh: MeshConfig, placement: PlacementConfig) -> Mesh:
    """The training mesh: ``mesh`` over all devices, or over the first ``train_devices``.

    Raises:
      MeshError: the shape does not fit, or ``train_devices`` is set in a multi-process run
        (each process would need the same leading devices of its own).
    """
    check_cpu_devices(placement.cpu_devices)
    if placement.strategy != "colocated":
        return _group_mesh(placement, "learner", mesh)
    if placement.train_devices in (_ALL, jax.device_count()):
        return make_mesh(mesh)  # all devices, in jax.make_mesh's topology-aware order
    if jax.process_count() > 1:
        raise MeshError("placement.train_devices: only single-process runs can use a subset")
    devices = jax.devices()
    try:
        count = train_device_count(placement, len(devices))
    except MeshError as e:
        raise MeshError(f"placement.train_devices: {e}") from None
    return make_mesh(mesh, devices[:count])


def given_mesh(placement: PlacementConfig, mesh: Mesh, source: str) -> None:
    """Checks a training mesh passed in code (``build_trainer(cfg, mesh=...)``, which takes
    precedence over ``mesh`` and ``placement.train_devices``) against ``placement``.

    Raises:
      MeshError: ``train_devices`` names another size, or JAX lacks ``cpu_devices``.
    """
    check_cpu_devices(placement.cpu_devices)
    wanted = placement.train_devices
    if placement.strategy != "colocated":
        wanted = train_device_count(placement, jax.device_count())
    if wanted not in (_ALL, mesh.size):
        raise MeshError(
            f"{source}: placement.train_devices: {wanted}, but the mesh passed in has "
            f"{mesh.size} device(s)"
        )


def critic_mesh(placement: PlacementConfig, train: MeshConfig) -> Mesh | None:
    """The critic's own mesh (``interleaved``; its group's ``mesh``, else every device on
    ``data``), or None."""
    if placement.strategy != "interleaved" or placement.critic is None:
        return None
    return _group_mesh(placement, "critic", train)


def reference_mesh(placement: PlacementConfig) -> Mesh | None:
    """The reference's own mesh (``reference: own``; its group's ``mesh``, else every device
    on ``data``), or None."""
    if placement.reference != "own":
        return None
    return _group_mesh(placement, "reference_group", MeshConfig())


def reference_shards(placement: PlacementConfig, device_count: int) -> int | None:
    """Data shards (``data x fsdp``) of the reference's own mesh; None when it has none.

    Raises:
      MeshError: its group or mesh does not fit ``device_count`` devices.
    """
    if placement.reference != "own":
        return None
    size = len(role_devices(placement, device_count)["reference_group"])
    try:
        data, fsdp, _ = resolve_mesh_shape(
            role_mesh_config(placement, "reference_group", MeshConfig()), size
        )
    except MeshError as e:
        raise MeshError(f"placement.reference_group.mesh: {e}") from None
    return data * fsdp


def generate_mesh(placement: PlacementConfig, train: Mesh) -> Mesh:
    """The sampler's mesh: its group's (``separated``), ``placement.generate_mesh`` over all
    devices, else ``train``."""
    if placement.strategy != "colocated" and placement.sampler is not None:
        return _group_mesh(placement, "sampler", MeshConfig())
    if placement.generate_mesh is None:
        return train
    return make_mesh(placement.generate_mesh)


def generate_shards(placement: PlacementConfig, device_count: int) -> int | None:
    """Data shards (``data x fsdp``) of the sampler's own mesh; None when it has none.

    Raises:
      MeshError: ``generate_mesh`` does not fit ``device_count`` devices.
    """
    if placement.strategy != "colocated":
        if placement.sampler is None:
            return None
        size = len(role_devices(placement, device_count)["sampler"])
        data, fsdp, _ = resolve_mesh_shape(
            role_mesh_config(placement, "sampler", MeshConfig()), size
        )
        return data * fsdp
    if placement.generate_mesh is None:
        return None
    data, fsdp, _ = resolve_mesh_shape(placement.generate_mesh, device_count)
    return data * fsdp


def check_cpu_devices(want: int | None) -> None:
    """On a CPU run, checks that JAX has the ``want`` CPU devices a placement asks for (None:
    any count).

    Raises:
      MeshError: JAX started with another count (nothing set it before JAX started).
    """
    if want is None or jax.default_backend() != "cpu":
        return
    have = jax.local_device_count()
    if have != want:
        raise MeshError(
            f"placement.cpu_devices: {want} asked, but JAX started with {have} CPU device(s); "
            "`python -m jaxrlhf.train` sets it from the config, or call "
            f"jaxrlhf.platform.set_cpu_devices({want}) before JAX starts"
        )
