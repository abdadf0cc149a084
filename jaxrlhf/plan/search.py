"""Searching the plans: exhaustive over a small space, simulated annealing over a large one.

Each layout (placement, groups, meshes: ``candidates.layouts``) is compiled once per memory
variant until one fits (``candidates.memory_variants``), then every staleness bound of it is
scored by the simulator alone. :func:`search` visits every layout when there are at most
``exhaustive_limit``, else runs a Metropolis walk over them (a neighbour changes one
group's mesh, or a quarter of the time the strategy; worse plans are accepted with
probability ``exp(-relative slowdown / temperature)``, the temperature falling linearly to
zero) until the time limit. Compiled plans are cached, so re-ranking under a new cost model
(``--calibrate``) recompiles nothing.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxrlhf.config import RunConfig, from_dict, merge_configs
from jaxrlhf.plan import candidates
from jaxrlhf.plan.estimate import (
    USABLE_MEMORY,
    CompiledPlan,
    CostModel,
    PlanEstimate,
    compile_plan,
    estimate,
    invalid_plan_errors,
    state_floor,
)
from jaxrlhf.plan.hardware import Cluster
from jaxrlhf.plan.lengths import BUDGET, LengthModel

__all__ = ["Evaluated", "Searcher", "search"]


@dataclasses.dataclass
class Evaluated:
    """A plan the search compiled: its overlay, config data and compiled programs (None with
    ``error`` when it is not a valid run or does not fit)."""

    overlay: dict[str, Any]
    label: str
    compiled: CompiledPlan | None
    error: str = ""


class Searcher:
    """Compiles and prices plans of one run on one cluster, caching what it compiled."""

    def __init__(
        self,
        base: dict[str, Any],
        cluster: Cluster,
        source: str,
        log=print,
        lengths: LengthModel = BUDGET,
        topology: Any = None,
    ):
        self.base, self.cluster, self.source, self.log = base, cluster, source, log
        self.lengths = lengths  # the response lengths generation is priced at
        # A jaxrlhf.sharding.topology.Topology: compile for its TPU devices (None: CPU).
        self.topology = topology
        # Shorter responses pack into fewer rows: price scoring and the update at that size.
        self.packed_sizes = lengths.kind != "budget"
        self.cfg = from_dict(base, source=source)
        self.evaluated: list[Evaluated] = []
        self._by_layout: dict[str, tuple[float, Evaluated | None]] = {}
        self._exact: dict[str, Evaluated] = {}

    def config(self, overlay: dict[str, Any]) -> RunConfig:
        """The run with ``overlay`` applied, on the cluster's devices: a colocated run's
        training mesh ("all devices") covers the first ``cluster.count`` of this process's
        (which may have more: a test, a notebook)."""
        cfg = from_dict(merge_configs(self.base, overlay), source=self.source)
        p = cfg.placement
        if p.strategy == "colocated" and p.train_devices == -1 and p.generate_mesh is None:
            cfg = cfg.replace(placement=dataclasses.replace(p, train_devices=self.cluster.count))
        return cfg

    def layout(self, overlay: dict[str, Any], model: CostModel) -> float:
        """Compiles ``overlay``'s layout (memory variants until one fits) and records it with
        its staleness variants; returns the best predicted seconds per iteration (inf when
        no variant runs)."""
        return self.best_of(overlay, model)[0]

    def best_of(self, overlay: dict[str, Any], model: CostModel) -> tuple[float, Evaluated | None]:
        """:meth:`layout`'s seconds and its fastest evaluated plan (None: nothing runs)."""
        key = repr(sorted(overlay.items()))
        if key in self._by_layout:
            return self._by_layout[key]
        best, fastest = math.inf, None
        algo = self.cfg.algorithm
        for variant in candidates.memory_variants(self.cfg):
            plan = merge_configs(overlay, variant)
            label = candidates.describe(plan, algo)
            start = time.perf_counter()
            try:
                cfg = self.config(plan)
                floor, usable = state_floor(cfg), USABLE_MEMORY * self.cluster.spec.memory_bytes
                if floor > usable:  # no compile needed to know it does not fit
                    why = (
                        f"the models' states alone need over {floor / 2**30:.1f} GiB per "
                        f"device, above the {usable / 2**30:.1f} GiB usable"
                    )
                    self.evaluated.append(Evaluated(plan, label, None, why))
                    self.log(f"  {label}: rejected, {why}")
                    continue
                compiled = compile_plan(cfg, self.source, self.packed_sizes, self.topology)
            except invalid_plan_errors() as e:
                self.evaluated.append(Evaluated(plan, label, None, _first_line(e)))
                if "micro" in str(e) or "rollout.slots" in str(e):
                    continue  # this micro-batch or slot count does not divide: try smaller
                break  # not a valid layout: memory knobs do not change that
            fits = estimate(cfg, self.cluster, model, compiled=compiled, lengths=self.lengths)
            took = time.perf_counter() - start
            if not fits.fits:
                self.evaluated.append(Evaluated(plan, label, None, fits.rejected))
                self.log(f"  {label}: rejected, {fits.rejected} ({took:.0f} s)")
                continue
            for stale in candidates.staleness_variants(self.cfg, plan):
                e = Evaluated(stale, candidates.describe(stale, algo), compiled)
                try:
                    seconds = self.price(e, model).iteration_s
                    if seconds < best:
                        best, fastest = seconds, e
                except invalid_plan_errors() as err:  # e.g. a staleness bound it refuses
                    e = Evaluated(stale, e.label, None, _first_line(err))
                self.evaluated.append(e)
            self.log(f"  {label}: {best:.3f} s/iteration predicted ({took:.0f} s to compile)")
            break
        self._by_layout[key] = (best, fastest)
        return best, fastest

    def exact(self, overlay: dict[str, Any], model: CostModel) -> PlanEstimate | str:
        """``overlay`` as it is (no memory or staleness variants): its estimate, or why it
        is not a valid run."""
        key = "exact " + repr(sorted(overlay.items()))
        if key not in self._exact:
            try:
                cfg = self.config(overlay)
                self._exact[key] = Evaluated(
                    overlay,
                    candidates.describe(overlay, self.cfg.algorithm),
                    compile_plan(cfg, packed_sizes=self.packed_sizes, topology=self.topology),
                )
            except invalid_plan_errors() as e:
                return f"not a valid run: {_first_line(e)}"
        return self.price(self._exact[key], model)

    def price(self, e: Evaluated, model: CostModel) -> PlanEstimate:
        """The estimate of an evaluated plan under ``model`` (no recompilation)."""
        return estimate(
            self.config(e.overlay),
            self.cluster,
            model,
            compiled=e.compiled,
            overlay=e.overlay,
            label=e.label,
            lengths=self.lengths,
        )

    def ranked(self, model: CostModel) -> tuple[list[PlanEstimate], list[Evaluated]]:
        """Valid plans fastest first, and the rejected ones."""
        ok = [self.price(e, model) for e in self.evaluated if e.compiled is not None]
        return sorted(ok, key=lambda p: p.iteration_s), [
            e for e in self.evaluated if e.compiled is None
        ]


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _strategy(overlay: dict[str, Any]) -> str:
    return overlay.get("placement", {}).get("strategy", "colocated")


def _features(overlay: dict[str, Any]) -> tuple[str, str, str]:
    p = overlay.get("placement", {})
    if p.get("strategy") == "separated":
        return (
            f"separated{len(p['sampler']['devices'])}",
            repr(p["learner"].get("mesh")),
            repr(p["sampler"].get("mesh")),
        )
    if p.get("strategy") == "interleaved":
        side = "critic" if p.get("critic") else "reference_group"
        return (
            f"interleaved-{side}{len(p[side]['devices'])}",
            repr(p["learner"].get("mesh")),
            repr(p[side].get("mesh")),
        )
    return ("colocated", repr(overlay.get("mesh")), repr(p.get("generate_mesh")))


def search(
    searcher: Searcher,
    layouts: Sequence[dict[str, Any]],
    model: CostModel,
    *,
    time_limit_s: float,
    exhaustive_limit: int = 24,
    first: int | None = None,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> str:
    """Visits ``layouts`` (all, or an annealing walk within ``time_limit_s`` from layout
    ``first``, default a random one); returns how (``"exhaustive, N layouts"`` /
    ``"annealing, N of M layouts in S s"``)."""
    if len(layouts) <= exhaustive_limit:
        for overlay in layouts:
            searcher.layout(overlay, model)
        return f"exhaustive, {len(layouts)} layouts"
    rng = random.Random(seed)
    start = clock()
    current = rng.randrange(len(layouts)) if first is None else first
    cost = searcher.layout(layouts[current], model)
    feats = [_features(o) for o in layouts]
    visited = {current}
    while clock() - start < time_limit_s and len(visited) < len(layouts):
        temperature = max(1e-3, 1.0 - (clock() - start) / time_limit_s)
        near = [
            i
            for i in range(len(layouts))
            if i != current
            and sum(a != b for a, b in zip(feats[i], feats[current], strict=True)) <= 1
        ]
        unseen = [i for i in near if i not in visited] or [
            i for i in range(len(layouts)) if i not in visited
        ]
        # A strategy's layouts differ from the other's in every feature: a quarter of the
        # proposals jump to the other strategy, so a short walk sees both.
        other = [i for i in range(len(layouts)) if i not in visited]
        other = [i for i in other if _strategy(layouts[i]) != _strategy(layouts[current])]
        if other and rng.random() < 0.25:
            unseen = other
        proposal = rng.choice(unseen)
        visited.add(proposal)
        new = searcher.layout(layouts[proposal], model)
        if math.isinf(cost) or new <= cost:
            current, cost = proposal, new
        elif not math.isinf(new):
            if rng.random() < math.exp(-(new - cost) / cost / temperature):
                current, cost = proposal, new
    took = clock() - start
    return f"annealing, {len(visited)} of {len(layouts)} layouts in {took:.0f} s"
