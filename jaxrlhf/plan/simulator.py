"""A list-scheduling simulator: tasks on device groups, their makespan and idle time.

A :class:`Task` occupies one or more device groups (``"learner"``, ``"sampler"``, ...) for
``seconds`` once every task it depends on has finished. :func:`simulate` is a list
scheduler: it keeps starting the ready task that can start earliest, when its dependencies
are done and all its groups are free; a group runs one task at a time.
:func:`iteration_tasks` unrolls the RL iteration of a placement (generate, reshard, score,
update, weight sync; an interleaved placement's critic or reference group beside the
learner) over several iterations with bounded staleness, the graph
:mod:`jaxrlhf.plan.estimate` times.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

__all__ = ["Schedule", "Task", "iteration_tasks", "side_phases", "simulate"]


@dataclasses.dataclass(frozen=True)
class Task:
    """``seconds`` of work on ``groups`` after ``deps`` (task names) have finished."""

    name: str
    groups: tuple[str, ...]
    seconds: float
    deps: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When each task ran: ``start[name]``, ``end[name]`` (seconds from 0)."""

    tasks: tuple[Task, ...]
    start: Mapping[str, float]
    end: Mapping[str, float]

    @property
    def makespan(self) -> float:
        return max(self.end.values(), default=0.0)

    def busy(self, group: str, since: float = 0.0, until: float | None = None) -> float:
        """Seconds ``group`` is busy in ``[since, until]``."""
        until = self.makespan if until is None else until
        return sum(
            max(0.0, min(self.end[t.name], until) - max(self.start[t.name], since))
            for t in self.tasks
            if group in t.groups
        )


def simulate(
    tasks: Sequence[Task], *, shared_host: bool = False, contention: float = 1.0
) -> Schedule:
    """List-schedules ``tasks``: repeatedly starts, among the tasks whose dependencies are
    scheduled, the one that can start earliest (ties: the earlier in ``tasks``), at the time
    its dependencies are done and its groups free. A group runs one task at a time and a
    started task is not interrupted.

    ``shared_host``: the groups are devices of one host that share its cores (JAX CPU
    devices): ``seconds`` is a task's time alone on the host, and ``k`` tasks running at
    once each progress at ``1 / (1 + contention x (k - 1))``: ``contention`` 1 shares the
    host as a fluid (no gain from overlap), 0 not at all (devices as independent as
    accelerators); calibration fits it.

    Raises:
      ValueError: a name repeats, or a dependency names no task (or a cycle).
    """
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise ValueError(f"task {next(n for n in names if names.count(n) > 1)!r} appears twice")
    if shared_host:
        return _simulate_shared(tasks, contention)
    start: dict[str, float] = {}
    end: dict[str, float] = {}
    free: dict[str, float] = {}
    pending = list(tasks)
    while pending:
        best, best_at = None, float("inf")
        for task in pending:
            if all(d in end for d in task.deps):
                at = max(
                    [0.0, *(end[d] for d in task.deps), *(free.get(g, 0.0) for g in task.groups)]
                )
                if at < best_at:
                    best, best_at = task, at
        if best is None:
            missing = next(d for t in pending for d in t.deps if d not in end)
            raise ValueError(f"task {pending[0].name!r}: dependency {missing!r} never runs")
        start[best.name], end[best.name] = best_at, best_at + best.seconds
        for g in best.groups:
            free[g] = end[best.name]
        pending.remove(best)
    return Schedule(tuple(tasks), start, end)


def _simulate_shared(tasks: Sequence[Task], contention: float) -> Schedule:
    """:func:`simulate` on a shared host: starts every ready task whose groups are free (in
    ``tasks`` order), then advances to the next completion, the running tasks slowed by
    each other meanwhile."""
    start: dict[str, float] = {}
    end: dict[str, float] = {}
    remaining: dict[str, float] = {}
    by_name = {t.name: t for t in tasks}
    pending, busy, now = list(tasks), set(), 0.0
    while pending or remaining:
        for task in list(pending):
            ready = all(d in end for d in task.deps)
            if ready and not busy.intersection(task.groups):
                start[task.name], remaining[task.name] = now, task.seconds
                busy.update(task.groups)
                pending.remove(task)
        if not remaining:
            missing = next(d for t in pending for d in t.deps if d not in end)
            raise ValueError(f"task {pending[0].name!r}: dependency {missing!r} never runs")
        step = min(remaining.values())
        now += step * (1 + contention * (len(remaining) - 1))
        for name in list(remaining):
            remaining[name] -= step
            if remaining[name] <= 1e-12:
                end[name] = now
                del remaining[name]
                busy.difference_update(by_name[name].groups)
    return Schedule(tuple(tasks), start, end)


def side_phases(phases: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """The side groups' phases among ``phases``: ``"score:critic"`` -> ``{"critic":
    {"score": seconds}}`` (an ``interleaved`` placement's critic or reference group)."""
    out: dict[str, dict[str, float]] = {}
    for key, seconds in phases.items():
        phase, _, group = key.partition(":")
        if group:
            out.setdefault(group, {})[phase] = seconds
    return out


def iteration_tasks(
    phases: Mapping[str, float],
    *,
    separated: bool,
    iterations: int,
    max_staleness: int = 0,
    weight_sync_every: int = 1,
) -> list[Task]:
    """The tasks of ``iterations`` RL iterations.

    Args:
      phases: seconds of ``generate``, ``score`` (reward and scoring forwards), ``train``
        (the update) and ``sync`` (moving the policy's weights to the sampler's layout); an
        ``interleaved`` placement's side groups as ``"score:GROUP"`` (its forward: the
        critic's values, the reference's log-probs) and ``"train:GROUP"`` (its update: the
        critic's).
      separated: the sampler on a ``sampler`` group of its own (else every phase on
        ``all``, one after the other, or with side groups, on ``learner``).
      max_staleness: iteration ``i`` may sample with the weights of update ``i - 1 - s``
        for ``s <= max_staleness`` (0: each rollout uses the latest weights).
      weight_sync_every: the weights move after every this many updates.

    Colocated: ``sync -> generate -> score -> train`` per iteration on ``all``. Separated:
    ``generate_i`` on ``sampler`` waits for the weights of update ``i - 1 - max_staleness``
    (the sync after it, which the sampler runs between its batches); ``score_i`` and
    ``train_i`` run on ``learner``. A side group scores rollout ``i`` beside the learner's
    ``score_i`` (both after ``generate_i``) and updates beside ``train_i`` (both once every
    forward is in: the advantages need them); the next iteration's scoring, and the weight
    sync, wait for both updates (the trainer learns one iteration at a time).
    """
    side = side_phases(phases)
    tasks: list[Task] = []

    def stage(phase: str, i: int, after: tuple[str, ...]) -> tuple[str, ...]:
        """Iteration ``i``'s ``phase`` (``score`` or ``train``) on the learner and on each
        side group that has it, all after ``after``; returns their names."""
        tasks.append(Task(f"{phase}{i}", (main,), phases[phase], after))
        names = [f"{phase}{i}"]
        for group, ph in side.items():
            if ph.get(phase, 0.0) > 0:
                tasks.append(Task(f"{phase}{i}:{group}", (group,), ph[phase], after))
                names.append(f"{phase}{i}:{group}")
        return tuple(names)

    if not separated:
        main = "learner" if side else "all"
        prev: tuple[str, ...] = ()
        for i in range(iterations):
            sync = i % weight_sync_every == 0 and phases["sync"] > 0
            if sync:
                tasks.append(Task(f"sync{i}", (main,), phases["sync"], prev))
                prev = (f"sync{i}",)
            tasks.append(Task(f"generate{i}", (main,), phases["generate"], prev))
            prev = stage("train", i, stage("score", i, (f"generate{i}",)))
        return tasks
    main = "learner"
    synced: dict[int, str] = {}  # update index -> the sync task that carried its weights
    learned: tuple[str, ...] = ()  # the previous iteration's updates (all its groups')
    for i in range(iterations):
        deps = []
        needed = i - 1 - max_staleness  # the oldest update this rollout may lag behind
        if needed >= 0:
            carrier = next((synced[u] for u in range(needed, i) if u in synced), None)
            if carrier is None:
                raise ValueError(
                    f"weights synced every {weight_sync_every} updates fall up to "
                    f"{weight_sync_every - 1} versions behind, beyond max_staleness "
                    f"{max_staleness}"
                )
            deps.append(carrier)
        tasks.append(Task(f"generate{i}", ("sampler",), phases["generate"], tuple(deps)))
        # The learner takes one iteration at a time: its next scoring (and a side group's)
        # waits for every update of the last, and so does the weight sync.
        learned = stage("train", i, stage("score", i, (f"generate{i}", *learned)))
        if (i + 1) % weight_sync_every == 0:
            # The sampler takes the new weights between its batches: the copy occupies it.
            tasks.append(Task(f"sync{i}", ("sampler",), phases["sync"], learned))
            synced[i] = f"sync{i}"
    return tasks
