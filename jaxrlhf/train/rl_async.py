"""Rollouts produced ahead of the learner: bounded staleness (``rollout.max_staleness``) and
the sampler's own copy of the weights (``placement.weight_sync_every``).

Rollout ``j`` (the batch iteration ``j`` trains on) is sampled with the policy of version
``v(j) >= max(j - k, b(j))``: ``k`` is the staleness bound, and ``b(j)`` the last drain point
at or before ``j`` (a multiple of ``checkpoint.every``, or the step the process started or
resumed from). With partial rollouts (``rollout.partial_rollouts``) a rollout also finishes
groups the previous one left running, whose first tokens are one version older: rollouts
then launch at ``v(j) >= max(j - k + 1, b(j))`` and a carried group with a token older than
``max(j - k, b(j))`` is dropped, so no trained token is more than ``k`` versions old.
Version ``v`` is the policy after ``v`` updates. :meth:`RolloutProducer.take`
refreshes the sampler's weights when due (every ``weight_sync_every`` updates, and at
drain points), launches every rollout whose bound the sampler's version meets, then waits
for rollout ``i``; with ``k >= 1`` the launched ones run on a host thread (sampling on
the sampler's devices, rewards on the host) while the main thread scores and updates: the
two device groups work at once (with ``placement.reference: sampler`` the thread also scores
the reference's log-probs on the sampler's devices). With ``k = 0`` each rollout runs inline
right before its update, which is the synchronous iteration, bit for bit.

The sampler's weights are a copy (``jax.device_put`` to its layout, timed as ``sync``) the
update cannot donate away, so a producer may hold it across updates; with
``weight_sync_every = m <= k + 1`` rollouts launch in bursts after each refresh and are up to
``k`` versions old all the same.

Checkpoints: nothing is in flight at a drain point (no rollout past it may use older
weights, and none is launched before the learner reaches it), so a checkpoint saved there
holds the whole state and a resumed run repeats the uninterrupted one. A checkpoint saved
elsewhere (a stop signal) records the prompt position of the first rollout not yet trained
on: the resumed run samples those prompts again with the restored weights (no prompt lost or
repeated; the in-flight samples themselves are dropped). Partial rollouts: a drain point
drops every carried group (each holds a token older than it), as does a restore, so a run
resumed at one repeats the uninterrupted run there too; the dropped groups' prompts are not
sampled again (like over-sampled groups the engine cancels), and each rollout skips as many
newly drawn prompts as it resumes carried groups (``rollout/prompts_skipped``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxrlhf import platform
from jaxrlhf.sharding.mesh import MeshError
from jaxrlhf.train.timeline import Timeline


def check_concurrency(meshes: Mapping[str, Any]) -> None:
    """On CPU devices, refuses meshes whose programs, in flight at once, would starve the
    XLA:CPU client's thread pool (``jaxrlhf.platform``): concurrency is never switched off
    quietly. ``meshes``: the config field that puts each mesh in flight -> the mesh.

    Raises:
      MeshError: two or more of them span several CPU devices and the pool is too small.
    """
    sizes = {field: mesh.size for field, mesh in meshes.items()}
    first = next(iter(meshes.values()))
    if first.devices.flat[0].platform != "cpu" or platform.concurrent_programs_fit(*sizes.values()):
        return
    need = platform.client_threads_needed(*sizes.values())
    fields = ", ".join(f for f, n in sizes.items() if n > 1)
    counts = " and ".join(str(n) for n in sizes.values())
    raise MeshError(
        f"{fields}: programs on {counts} CPU devices at once need {need} XLA:CPU client "
        f"threads, this process has {platform.cpu_client_threads()}; set "
        f"{platform.CLIENT_THREADS_ENV}={need} before JAX starts, or give all but one group "
        "one device"
    )


@dataclasses.dataclass
class Pending:
    """A launched rollout: its index, policy version, the prompt position before its prompts
    were drawn, and its result (or the future that will hold it)."""

    index: int
    version: int
    prompts_state: dict[str, Any]
    future: concurrent.futures.Future | None = None
    result: Any = None

    def get(self) -> Any:
        return self.result if self.future is None else self.future.result()


class RolloutProducer:
    """Launches and hands out the rollouts of an RL trainer (module docstring).

    Args:
      trainer: the ``RLTrainer`` (its prompts, policy state, sampler and ``sample``).
      max_staleness: ``k``.
      sync_every: ``placement.weight_sync_every``.
      drain_every: ``checkpoint.every`` (0: only the start is a drain point).
      timeline: where the sync and sample phases are recorded.
    """

    def __init__(
        self,
        trainer: Any,
        *,
        max_staleness: int,
        sync_every: int,
        drain_every: int,
        timeline: Timeline,
    ):
        self.trainer = trainer
        self.k, self.sync_every, self.drain_every = max_staleness, sync_every, drain_every
        # Partial rollouts: carried tokens are one version older than their rollout's own,
        # so rollouts launch one version fresher (k - 1) and carried tokens may be k old.
        self.slack = 1 if trainer.algo.rollout.partial_rollouts else 0
        self.timeline = timeline
        self.executor = None
        if max_staleness > 0:  # (the trainer checked that its groups can run at once)
            self.executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="jaxrlhf-sampler"
            )
        # The sampler's copy is kept across updates when it may be reused.
        self.hold = max_staleness > 0 or sync_every > 1
        sampler_devices = set(trainer.sampler.mesh.devices.flat)
        self.shared_devices = bool(sampler_devices & set(trainer.mesh.devices.flat))
        self.reset(trainer.steps_done)

    def reset(self, step: int) -> None:
        """Drops whatever is in flight (restore): the run continues from ``step``."""
        for p in getattr(self, "pending", {}).values():
            if p.future is not None:
                p.future.cancel()
                concurrent.futures.wait([p.future])
        self.pending: dict[int, Pending] = {}
        self.trainer.partials = None  # partial rollouts restart from fresh prompts
        self.start, self.launched = step, step
        self.sampler_params, self.sampler_version = None, None

    def bound(self, j: int, slack: int = 0) -> int:
        """The oldest policy version any token of rollout ``j`` may come from; with
        ``slack``, that many versions newer (the launch bound of partial rollouts)."""
        drained = self.start
        if self.drain_every:
            drained = max(drained, j // self.drain_every * self.drain_every)
        return max(j - self.k + slack, drained)

    def prompts_state(self) -> dict[str, Any]:
        """The prompt position of the first rollout not yet trained on (for checkpoints)."""
        if self.pending:
            return self.pending[min(self.pending)].prompts_state
        return self.trainer.prompts.state()

    def take(
        self, step: int, last_step: int, key_fn: Callable[[int], jax.Array]
    ) -> tuple[Any, int]:
        """Syncs the sampler's weights when due, launches every rollout they are recent
        enough for (up to ``last_step``), then returns rollout ``step``'s result
        (``(rollout, timings, forwards)``) and its policy version."""
        timings = {"time/reshard_s": 0.0, "reshard/bytes_moved": 0.0}
        version, slack = self.sampler_version, self.slack
        stale = version is not None and version < self.bound(step, slack)
        if version is None or step - version >= self.sync_every or stale:
            timings = self._sync(step)
        while (
            self.launched < last_step and self.bound(self.launched, slack) <= self.sampler_version
        ):
            self._launch(self.launched, key_fn(self.launched), timings)
            timings = {"time/reshard_s": 0.0, "reshard/bytes_moved": 0.0}  # counted once
            self.launched += 1
        if step not in self.pending:  # a step past last_step (tests driving step() on)
            self._launch(step, key_fn(step), timings)
            self.launched = max(self.launched, step + 1)
        if not self.hold:
            self.sampler_params = None  # the next update donates what it may alias
        pending = self.pending.pop(step)
        return pending.get(), pending.version

    def _sync(self, step: int) -> dict[str, float]:
        """The sampler's copy of the policy's weights at version ``step``."""
        trainer = self.trainer
        start = self.timeline.now()
        params, stats = trainer.generate_params()  # LoRA: merged adapters; Hydra: rebuilt
        if self.hold and self.shared_devices:
            # An own copy: the update donates the training buffers this may share (on other
            # devices, device_put has copied already).
            params = jax.tree.map(jnp.copy, params)
        jax.block_until_ready(params)
        end = self.timeline.now()
        self.timeline.record("sync", "sampler", step, start, end)
        self.sampler_params, self.sampler_version = params, step
        return {"time/reshard_s": end - start, "reshard/bytes_moved": float(stats.bytes_moved)}

    def _launch(self, j: int, key: jax.Array, timings: dict[str, float]) -> None:
        trainer = self.trainer
        state = trainer.prompts.state()
        prompts = next(trainer.prompts)
        params, version = self.sampler_params, self.sampler_version

        def run():
            start = self.timeline.now()
            rollout, sample_timings, forwards = trainer.sample(
                key, prompts, params, version=version, oldest=self.bound(j)
            )
            self.timeline.record("sample", "sampler", j, start, self.timeline.now())
            if trainer.reference_on_sampler_group:  # placement.reference: sampler
                start = self.timeline.now()
                rollout, sample_timings["time/reference_s"] = trainer.score_reference_apart(rollout)
                self.timeline.record("reference", "sampler", j, start, self.timeline.now())
            return rollout, {**timings, **sample_timings}, forwards

        pending = Pending(j, version, state)
        if self.executor is None:
            pending.result = run()
        else:
            pending.future = self.executor.submit(run)
        self.pending[j] = pending
