"""The plans the planner considers, as config overlays.

A plan is an overlay of the run config: ``placement`` (strategy, device groups, meshes, and
in a separated plan where the reference's forward runs; in an interleaved one the critic's
or the reference's own group), ``mesh`` (the learner's),
``model.remat``, ``train.micro_batch_size``, and the RL section's ``rollout.max_staleness``
and (with the rollout engine) ``rollout.slots``. :func:`layouts` lists the placements and
meshes of a cluster; :func:`memory_variants` the remat, micro-batch and slot settings tried,
cheapest first, when a layout does not fit (they only trade time for memory, so a plan that
fits without them is never slower with them); :func:`staleness_variants` the staleness
bounds of a separated plan (no recompilation: the programs are the same).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

from jaxrlhf.config import RunConfig, rl_section
from jaxrlhf.config import merge_configs as merge
from jaxrlhf.models.config import ModelConfig

__all__ = [
    "configured",
    "describe",
    "flat",
    "layouts",
    "memory_variants",
    "reference_may_move",
    "staleness_variants",
]


def _tensor_sizes(model: ModelConfig, devices: int) -> list[int]:
    """Tensor-parallel sizes that divide ``devices`` and the heads (at most 8: one node)."""
    return [
        t
        for t in (1, 2, 4, 8)
        if devices % t == 0 and model.num_heads % t == 0 and model.kv_heads % t == 0
    ]


def _meshes(model: ModelConfig, devices: int) -> list[dict[str, int]]:
    """(data, fsdp, tensor) shapes over ``devices``: tensor within a node, the rest split
    between data and fsdp at powers of two (data-only and fsdp-only included)."""
    out = []
    for t in _tensor_sizes(model, devices):
        rest = devices // t
        fsdp = 1
        while fsdp <= rest:
            if rest % fsdp == 0:
                out.append({"data": rest // fsdp, "fsdp": fsdp, "tensor": t})
            fsdp *= 2
        if rest > 1 and not any(m["fsdp"] == rest and m["tensor"] == t for m in out):
            out.append({"data": 1, "fsdp": rest, "tensor": t})
    return out


def _sampler_meshes(model: ModelConfig, devices: int) -> list[dict[str, int]]:
    """The sampler's shapes: data-parallel replicas of a tensor-parallel policy."""
    return [{"data": devices // t, "fsdp": 1, "tensor": t} for t in _tensor_sizes(model, devices)]


def layouts(cfg: RunConfig, devices: int, cpu: bool) -> Iterator[dict[str, Any]]:
    """Overlays of the placements and meshes of ``devices`` devices.

    Colocated: every learner mesh, the sampler on the training mesh or on its own
    data x tensor mesh over all devices. Separated (2+ devices): the sampler on the first
    1/4, 1/2 or 3/4 of the devices (or the nearest count both sides can run on: ``_splits``),
    each side's meshes, the reference with the learner and
    (where the run allows it: :func:`reference_may_move`) on the sampler's devices.
    Interleaved (2+ devices): the critic or the reference on a group of its own
    (:func:`_interleaved`).
    """
    model = cfg.model.resolve()
    # Every placement field a plan decides is set, so nothing of the run's own placement
    # (its generate_mesh, groups, sync cadence) leaks into a plan that does not use it.
    base = {
        **({"cpu_devices": devices} if cpu else {}),
        "train_devices": -1,
        "generate_mesh": None,
        "sampler": None,
        "learner": None,
        "critic": None,
        "reference_group": None,
        "weight_sync_every": 1,
        "reference": "learner",
    }
    places = ("learner", "sampler") if reference_may_move(cfg) else ("learner",)
    for mesh in _meshes(model, devices):
        yield {"placement": {**base, "strategy": "colocated"}, "mesh": mesh}
        for gen in _sampler_meshes(model, devices):
            if gen != mesh:
                placement = {**base, "strategy": "colocated", "generate_mesh": gen}
                yield {"placement": placement, "mesh": mesh}
    for k in _splits(cfg, model, devices):
        for smesh in _sampler_meshes(model, k):
            for lmesh, reference in itertools.product(_meshes(model, devices - k), places):
                placement = {
                    **base,
                    "strategy": "separated",
                    "sampler": {"devices": list(range(k)), "mesh": smesh},
                    "learner": {"devices": list(range(k, devices)), "mesh": lmesh},
                    "reference": reference,
                }
                yield {"placement": placement, "mesh": lmesh}
    yield from _interleaved(cfg, model, devices, base, cpu)


def _interleaved(
    cfg: RunConfig, model: ModelConfig, devices: int, base: dict[str, Any], cpu: bool
) -> Iterator[dict[str, Any]]:
    """Interleaved plans (2+ devices): PPO's critic on a group of its own (the first 1/4
    or 1/2 of the devices, with the learner's data shards: the two updates split the rollout
    alike; not a Hydra critic, which shares the policy's trunk, nor a LoRA one, whose
    frozen base the dry run would count on the learner's group only), or the reference on
    a group of its own (``reference: own``, the run permitting: :func:`reference_may_move`;
    its data shards splitting the rollout's rows); the policy and the sampler on the rest,
    each learner mesh. On CPU devices also a one-device side group, and one of the two
    groups always has one device (two programs spanning several CPU devices at once need
    more XLA:CPU client threads than a process has by default: the trainer refuses them,
    ``rl_async.check_concurrency``)."""
    if devices < 2:
        return
    algo = rl_section(cfg)
    rows = algo.rollout.rows // algo.loss.num_minibatches
    sizes = sorted({max(1, round(devices * f)) for f in (0.25, 0.5)} | ({1} if cpu else set()))
    hydra = cfg.algorithm == "ppo" and cfg.ppo.hydra
    for k in sizes:
        if cpu and min(k, devices - k) > 1:
            continue
        learner_meshes = _meshes(model, devices - k)
        placement = {**base, "strategy": "interleaved"}
        group = {"devices": list(range(k))}
        rest = {"devices": list(range(k, devices))}
        if cfg.algorithm == "ppo" and not hydra and cfg.lora is None:
            for lmesh in learner_meshes:
                shards = lmesh["data"] * lmesh["fsdp"]
                if rows % shards or k % shards or k // shards not in _tensor_sizes(model, k):
                    continue
                cmesh = {"data": lmesh["data"], "fsdp": lmesh["fsdp"], "tensor": k // shards}
                yield {
                    "placement": {
                        **placement,
                        "critic": {**group, "mesh": cmesh},
                        "learner": {**rest, "mesh": lmesh},
                    },
                    "mesh": lmesh,
                }
        if reference_may_move(cfg) and algo.rollout.rows % k == 0:
            for lmesh in learner_meshes:
                if rows % (lmesh["data"] * lmesh["fsdp"]):
                    continue
                yield {
                    "placement": {
                        **placement,
                        "reference": "own",
                        "reference_group": {**group, "mesh": {"data": k, "fsdp": 1, "tensor": 1}},
                        "learner": {**rest, "mesh": lmesh},
                    },
                    "mesh": lmesh,
                }


def _splits(cfg: RunConfig, model: ModelConfig, devices: int) -> list[int]:
    """The sampler's device counts of the separated plans: for each of 1/4, 1/2 and 3/4 of
    the devices, the nearest count whose two sides can run: a learner mesh whose data
    shards divide a minibatch's rows and a sampler mesh whose data shards divide the
    prompts (a split neither side can use would only be rejected after compiling)."""
    if devices < 2:
        return []
    algo = rl_section(cfg)
    rows = algo.rollout.rows // algo.loss.num_minibatches
    prompts = algo.rollout.prompts_per_step

    def runs(k: int) -> bool:
        learner = any(rows % (m["data"] * m["fsdp"]) == 0 for m in _meshes(model, devices - k))
        return learner and any(prompts % m["data"] == 0 for m in _sampler_meshes(model, k))

    out = set()
    for fraction in (0.25, 0.5, 0.75):
        want = round(devices * fraction)
        near = sorted(range(1, devices), key=lambda k: (abs(k - want), k))
        out.update(next(([k] for k in near if runs(k)), []))
    return sorted(out)


def reference_may_move(cfg: RunConfig) -> bool:
    """Whether a separated plan of ``cfg`` may put the reference on the sampler's devices
    (``placement.reference: sampler``): not with LoRA or a Hydra critic, whose reference is
    part of the learner's weights, nor with the engine's streamed scoring."""
    r = rl_section(cfg).rollout
    hydra = cfg.algorithm == "ppo" and cfg.ppo.hydra
    streamed = r.engine == "continuous" and r.stream_scoring and r.environment is None
    return cfg.lora is None and not hydra and not streamed


def flat(cfg: RunConfig, devices: int, cpu: bool) -> dict[str, Any]:
    """The flattened plan ReaLHF compares with: every role on every device, one mesh
    (fully sharded data parallel over all of them) for every phase."""
    return next(
        o
        for o in layouts(cfg, devices, cpu)
        if o["placement"]["strategy"] == "colocated"
        and o["placement"]["generate_mesh"] is None
        and o["mesh"] == {"data": 1, "fsdp": devices, "tensor": 1}
        or devices == 1
    )


def _shape(mesh: Any, devices: int) -> dict[str, int]:
    sizes = list(mesh.sizes())
    if -1 in sizes:  # the fill axis takes the devices the others leave
        known = math.prod(s for s in sizes if s != -1)
        sizes = [devices // known if s == -1 else s for s in sizes]
    return dict(zip(("data", "fsdp", "tensor"), sizes, strict=True))


def configured(cfg: RunConfig, layouts: list[dict[str, Any]], devices: int) -> int | None:
    """The index of the layout the config itself describes on ``devices`` (colocated: its
    mesh and its sampler's), None when it is not among them."""
    if cfg.placement.strategy != "colocated" or cfg.placement.train_devices != -1:
        return None
    mesh = _shape(cfg.mesh, devices)
    gen = cfg.placement.generate_mesh
    gen = None if gen is None else _shape(gen, devices)
    for i, o in enumerate(layouts):
        if o["placement"]["strategy"] == "colocated" and o["mesh"] == mesh:
            if o["placement"]["generate_mesh"] == gen:
                return i
    return None


def memory_variants(cfg: RunConfig) -> list[dict[str, Any]]:
    """Overlays that trade time for memory, cheapest first: the config as is, then halved
    micro-batches (down to one row per data shard), then (with the rollout engine) halved
    slots down to one prompt group's (a smaller KV cache, more decode chunks), then full
    remat with each micro-batch size (when the config has none)."""
    out: list[dict[str, Any]] = [{}]
    micro = []
    # Halving from the config's micro-batch (rows per data shard; none: a minibatch, which
    # a layout's data shards divide further, so sizes at or above its share are not new:
    # validation refuses those that do not divide it, and they are skipped) to one row.
    algo = rl_section(cfg)
    size = cfg.train.micro_batch_size or algo.rollout.rows // algo.loss.num_minibatches
    while size > 1:
        size //= 2
        micro.append({"train": {"micro_batch_size": size}})
    out += micro
    r = algo.rollout
    if r.engine == "continuous":
        slots = r.engine_slots
        while slots // 2 >= r.num_samples and (slots // 2) % r.num_samples == 0:
            slots //= 2
            out.append({cfg.algorithm: {"rollout": {"slots": slots}}})
    if cfg.model.resolve().remat == "none":
        out += [merge(m, {"model": {"remat": "full"}}) for m in [{}, *micro]]
    return out


def staleness_variants(cfg: RunConfig, overlay: dict[str, Any]) -> list[dict[str, Any]]:
    """A separated plan at staleness 0, 1 and 2 (the config's own bound included; 0 only
    with a reward model, which asynchronous RL does not take); a colocated one as it is."""
    if overlay.get("placement", {}).get("strategy") != "separated":
        return [overlay]
    section, algo = cfg.algorithm, rl_section(cfg)
    if algo.reward.model_dir is not None:  # asynchronous RL scores with reward functions
        return [merge(overlay, {section: {"rollout": {"max_staleness": 0}}})]
    every = overlay["placement"].get("weight_sync_every", 1)  # lag the cadence already adds
    bounds = sorted(b for b in {0, 1, 2, algo.rollout.max_staleness} if b >= every - 1)
    return [merge(overlay, {section: {"rollout": {"max_staleness": s}}}) for s in bounds]


def describe(overlay: dict[str, Any], algorithm: str) -> str:
    """One line naming a plan: strategy, groups and meshes, memory knobs, staleness."""

    def shape(m: dict[str, int] | None) -> str:
        if not m:
            return "-"
        return "x".join(f"{k[0]}{v}" for k, v in m.items() if v != 1) or "d1"

    p = overlay.get("placement", {})
    parts = []
    if not p:
        parts.append("as configured")
    elif p.get("strategy") == "separated":
        s, lrn = p["sampler"], p["learner"]
        parts.append(
            f"separated sampler {len(s['devices'])}:{shape(s.get('mesh'))} "
            f"learner {len(lrn['devices'])}:{shape(lrn.get('mesh'))}"
        )
        if p.get("reference") == "sampler":
            parts.append("reference on the sampler")
        stale = overlay.get(algorithm, {}).get("rollout", {}).get("max_staleness", 0)
        parts.append(f"staleness {stale}")
    elif p.get("strategy") == "interleaved":
        lrn = p["learner"]
        side = "critic" if p.get("critic") else "reference_group"
        g = p[side]
        parts.append(
            f"interleaved learner {len(lrn['devices'])}:{shape(lrn.get('mesh'))} "
            f"{side.split('_')[0]} {len(g['devices'])}:{shape(g.get('mesh'))}"
        )
    else:
        gen = p.get("generate_mesh")
        parts.append(f"colocated {shape(overlay.get('mesh'))}")
        parts.append(f"sampler {shape(gen) if gen else 'same mesh'}")
    if "train" in overlay:
        parts.append(f"micro {overlay['train']['micro_batch_size']}")
    slots = overlay.get(algorithm, {}).get("rollout", {}).get("slots")
    if slots:
        parts.append(f"slots {slots}")
    if overlay.get("model", {}).get("remat"):
        parts.append(f"remat {overlay['model']['remat']}")
    return ", ".join(parts)
