"""Host plans of the sequence-packed RL programs (``rollout.pack_sequences``).

After generation the host knows every row's real length. Before each packed program runs,
:class:`PackingPlanner` lays its micro-batches out exactly as the program will (the scoring
micro-batches; the update's shuffled minibatches and their micro-batches, from the same
keys), packs each data shard's rows of each micro-batch (:func:`jaxrlhf.models.packing.plan_rows`)
and picks the packed size ``m``: the most packed rows any shard needs, rounded up to one of
``rollout.pack_buckets`` sizes. The program then runs with ``m`` as a static argument, so it
compiles once per size it meets, at most ``pack_buckets`` times. Packing is used when it
runs no more slots than the phase's rows would unpacked (or in packed prompt groups,
``rollout.shared_prefix``: with long prompts and responses near the budget, one prompt per
group can beat a prompt per packed row); otherwise the program runs with ``None`` there
(one more compile), and the plan is None.

The micro-batches keep the padded path's rows: each padded micro-batch becomes one packed
micro-batch of the same sequences, so the gradient accumulation weights (tokens, sequences)
and every metric are those of the padded update.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jaxrlhf.models import shared_prefix
from jaxrlhf.models.packing import PlanStats, RowPacking, bucket_for, plan_rows
from jaxrlhf.sharding.distributed import to_host
from jaxrlhf.sharding.micro_batches import micro_batches_for, split_micro
from jaxrlhf.train.rl_config import GRPOConfig, PPOConfig, RLLayout
from jaxrlhf.train.rl_steps import epoch_row_order


@dataclasses.dataclass(frozen=True)
class PhasePlan:
    """One packed program call's plan.

    Attributes:
      packing: each row's place, numpy ``[N]`` (scoring) or ``[N, E]`` (the update's
        epochs).
      rows: m, the packed rows per data shard of every micro-batch (the static argument).
      slots: slots one pass over the rollout runs (micro-batches x shards x m x L); for
        the update, per epoch.
      tokens: real tokens one pass places (a shared prompt once); the update's: per epoch,
        averaged over the epochs.
    """

    packing: RowPacking
    rows: int
    slots: int
    tokens: float


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _epoch_orders(key: jax.Array, rows: int, group_size: int, epochs: int) -> jax.Array:
    """[E, rows] each epoch's row order, as ``rl_steps.rl_update`` draws it from ``key``."""
    keys = jax.random.split(key, epochs)
    return jax.vmap(lambda k: epoch_row_order(k, rows, group_size))(keys)


@dataclasses.dataclass(frozen=True)
class PackingPlanner:
    """Plans the packed phases of a run (a phase with 0 rows per shard runs padded).

    Attributes:
      prompt_len: P, the rollout's prompt slots.
      shards: the training mesh's data shards.
      buckets: ``rollout.pack_buckets``.
      share_prompts: rows with one prompt may share a copy of it (``rollout.shared_prefix``).
      score_rows, update_rows: rows per data shard in each micro-batch of the phase; 0 =
        not packed (``RLLayout.packing``).
      score_micro_rows, score_group: rows (over every shard) in one scoring micro-batch
        (None: no bound, ``RLLayout.score_micro_rows``) and its row groups.
      epochs, num_minibatches, num_micro, update_group: the update's loop and row groups.
    """

    prompt_len: int
    shards: int
    buckets: int
    share_prompts: bool
    score_rows: int
    score_micro_rows: int | None
    score_group: int
    update_rows: int
    epochs: int
    num_minibatches: int
    num_micro: int
    update_group: int

    @classmethod
    def of(
        cls, algo: PPOConfig | GRPOConfig, rl: RLLayout, shards: int, prompt_len: int
    ) -> PackingPlanner:
        """The planner of a run with ``rl`` on ``shards`` data shards."""
        r, loss = algo.rollout, algo.loss
        return cls(
            prompt_len=prompt_len,
            shards=shards,
            buckets=r.pack_buckets,
            share_prompts=r.shared_prefix,
            score_rows=rl.packing.score,
            score_micro_rows=rl.score_micro_rows,
            score_group=rl.groups.score,
            update_rows=rl.packing.update,
            epochs=loss.epochs,
            num_minibatches=loss.num_minibatches,
            num_micro=rl.num_micro,
            update_group=rl.groups.update,
        )

    def _plan(self, tokens, mask, micro_rows) -> tuple[RowPacking, PlanStats]:
        return plan_rows(
            np.asarray(tokens),
            np.asarray(mask),
            self.prompt_len,
            micro_rows,
            self.shards,
            self.share_prompts,
        )

    def _unpacked_slots(self, shape: tuple[int, int], group: int) -> float:
        """Slots a pass over the rows runs without sequence packing (prompt groups of
        ``group`` rows packed)."""
        rows, length = shape
        fraction = shared_prefix.flops_fraction(self.prompt_len, length - self.prompt_len, group)
        return rows * length * fraction

    def unpacked_score_pass(self, mask: np.ndarray) -> tuple[float, float]:
        """``(slots, real tokens)`` the scoring forwards run on the host rows ``[N, T]``
        unpacked (prompt groups of ``score_group`` rows run their prompt once)."""
        prompt, response = mask[:, : self.prompt_len].sum(), mask[:, self.prompt_len :].sum()
        tokens = float(response + prompt / self.score_group)
        return self._unpacked_slots(mask.shape, self.score_group), tokens

    def score(self, tokens: np.ndarray, mask: np.ndarray) -> PhasePlan | None:
        """The scoring forwards' (and the reward model's) plan of the host rows
        ``[N, T]``, or None when scoring runs them unpacked.

        The rows are the whole rollout, or (streamed scoring, ``rl_stream``) one batch of
        its finished groups: the packed sizes are steps of the rows each data shard holds in
        a micro-batch of *these* rows, so each row count compiles at most ``buckets`` sizes.
        """
        if not self.score_rows:
            return None
        rows, length = mask.shape
        num_micro = micro_batches_for(rows, self.score_micro_rows)
        per_shard = rows // (num_micro * self.shards)
        if per_shard < 2:
            return None
        micro = split_micro(np.arange(rows), num_micro, None, None, self.score_group)
        packing, stats = self._plan(tokens, mask, micro)
        m = bucket_for(stats.needed, per_shard, self.buckets)
        slots = num_micro * self.shards * m * length
        if slots > self._unpacked_slots(mask.shape, self.score_group):
            return None
        return PhasePlan(packing=packing, rows=m, slots=slots, tokens=float(stats.tokens))

    def update_micro_rows(self, rows: int, key: jax.Array) -> np.ndarray:
        """[E, num_minibatches * num_micro, B] the rollout rows of each micro-batch of each
        epoch, in the order the update holds them (``rl_steps.rl_update``, ``steps``)."""
        if self.num_minibatches > 1:
            orders = to_host(_epoch_orders(key, rows, self.update_group, self.epochs))
        else:  # one minibatch keeps the rollout's row order
            orders = np.tile(np.arange(rows), (self.epochs, 1))
        group = self.update_group
        out = []
        for order in orders:
            minibatches = split_micro(order, self.num_minibatches, None, None, group)
            out.append(
                np.concatenate(
                    [split_micro(mb, self.num_micro, None, None, group) for mb in minibatches]
                )
            )
        return np.stack(out)

    def update(self, tokens: np.ndarray, mask: np.ndarray, key: jax.Array) -> PhasePlan | None:
        """The update's plan (one per epoch) for the host rows ``[N, T]`` shuffled by the
        update's ``key``, or None when the update runs them unpacked."""
        if not self.update_rows:
            return None
        rows, length = mask.shape
        plans = [self._plan(tokens, mask, micro) for micro in self.update_micro_rows(rows, key)]
        needed = max(stats.needed for _, stats in plans)
        m = bucket_for(needed, self.update_rows, self.buckets)
        slots = self.num_minibatches * self.num_micro * self.shards * m * length
        if slots > self._unpacked_slots(mask.shape, self.update_group):
            return None
        packing = jax.tree.map(lambda *xs: np.stack(xs, axis=1), *[p for p, _ in plans])
        return PhasePlan(
            packing=packing,
            rows=m,
            slots=slots,
            tokens=float(np.mean([stats.tokens for _, stats in plans])),
        )


def _phase_metrics(name: str, rows: int, slots: float, tokens: float) -> dict[str, float]:
    return {
        f"packing/{name}_rows": float(rows),
        f"packing/{name}_slots": float(slots),
        f"packing/{name}_fill": tokens / slots,
    }


def plan_metrics(score: PhasePlan | None, update: PhasePlan | None) -> dict[str, float]:
    """``packing/*`` metrics of an iteration's plans: each packed phase's packed rows per
    shard (``*_rows``), slots run per pass (``*_slots``) and the share of them that hold
    real tokens (``*_fill``)."""
    out = {}
    for name, plan in (("score", score), ("update", update)):
        if plan is not None:
            out.update(_phase_metrics(name, plan.rows, plan.slots, plan.tokens))
    return out


def streamed_score_metrics(
    plans: list[PhasePlan | None], unpacked: list[tuple[float, float]]
) -> dict[str, float]:
    """:func:`plan_metrics`' ``packing/score_*`` of streamed scoring (``rl_stream``): its
    micro-batches' ``plans`` (None where one ran unpacked) and each one's ``unpacked``
    ``(slots, real tokens)`` (:meth:`PackingPlanner.unpacked_score_pass`) summed as one
    pass: the most packed rows any took, and the slots and real tokens all of them ran
    (a padded last micro-batch's repeated rows included); empty when none packed."""
    if all(plan is None for plan in plans):
        return {}
    slots = tokens = 0.0
    for plan, (u_slots, u_tokens) in zip(plans, unpacked, strict=True):
        slots += u_slots if plan is None else plan.slots
        tokens += u_tokens if plan is None else plan.tokens
    rows = max(plan.rows for plan in plans if plan is not None)
    return _phase_metrics("score", rows, slots, tokens)
