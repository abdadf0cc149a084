"""The data that flows between the phases of an RL iteration, as typed pytrees.

::

    sampler + rewards --> Rollout (host) --RolloutRows--> score --> Scored
        Rollout + Scored --> LearnerBatch --> update --> UpdateOutput (+ new states)

Every per-token array has the rollout layout ``[N, T]``: ``N`` rows (prompt-major: a
prompt's ``n`` samples are consecutive rows) and ``T = P + R`` columns, the left-padded
prompt then the right-padded response; per-token quantities sit at the index of the token
they score (``jaxrlhf.models.scoring``) and are 0 outside ``response_mask``. Fields that a
configuration does not compute are None (a pytree without those leaves).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.models.packing import RowPacking

Metrics = dict[str, Any]


@flax.struct.dataclass
class Rollout:
    """One iteration's samples and their rewards (host numpy arrays, or device arrays).

    Attributes:
      tokens: [N, T] int32, ``[prompt | response]`` (pad ids outside ``mask``).
      mask: [N, T] bool, real tokens (prompt and response).
      response_mask: [N, T] bool, the response tokens (the stop token included).
      lengths: [N] int32 response lengths.
      stopped: [N] bool, the response ended on a stop token (else it hit the budget).
      sampler_logprobs: [N, T] float32, each response token's log-prob under the model as the
        sampler computed it (temperature 1, no truncation), 0 elsewhere.
      scores: [N] float32 raw rewards: the reward function's or the reward model's, minus the
        overlong penalty, before normalisation and clipping.
      task_scores: [N] float32, the built-in task's own graded reward (logged whatever
        drives RL), or None.
      turn_rewards: [N, T] float32, a multi-turn PPO rollout's environment rewards at the
        last model token of the turns they answered (rows sum to the episodes' rewards,
        which ``scores`` include; not with ``reward.normalize``, which scales only the
        totals), or None: the whole score is paid on the last token.
      ref_logprobs: [N, T] float32, each response token's log-prob under the frozen
        reference (0 before the response, as scoring computes them), scored on the sampler's
        group (``placement.reference: sampler``), or None: scoring computes them.
    """

    tokens: Int[Array, "N T"]
    mask: Bool[Array, "N T"]
    response_mask: Bool[Array, "N T"]
    lengths: Int[Array, " N"]
    stopped: Bool[Array, " N"]
    sampler_logprobs: Float[Array, "N T"]
    scores: Float[Array, " N"]
    task_scores: Float[Array, " N"] | None = None
    turn_rewards: Float[Array, "N T"] | None = None
    ref_logprobs: Float[Array, "N T"] | None = None

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    def select(self, rows: Any) -> Rollout:
        """The rollout restricted to ``rows`` (an index array or slice), in that order."""
        return jax.tree.map(lambda x: x[rows], self)

    @property
    def device_rows(self) -> RolloutRows:
        """The arrays scoring and the update read."""
        return RolloutRows(tokens=self.tokens, mask=self.mask, response_mask=self.response_mask)


@flax.struct.dataclass
class RolloutRows:
    """The rollout arrays that scoring reads (on the training mesh).

    Attributes:
      tokens, mask, response_mask: [N, T] as in :class:`Rollout`.
      packing: where each row sits in its scoring micro-batch's packed rows ([N] leaves)
        when scoring packs sequences (``rollout.pack_sequences``), else None.
      turn_rewards: [N, T] the rollout's ``turn_rewards``, for PPO's per-token rewards; or
        None.
      ref_logprobs: [N, T] the rollout's ``ref_logprobs`` (scored on the sampler's group),
        which scoring then takes as they are; or None.
    """

    tokens: Int[Array, "N T"]
    mask: Bool[Array, "N T"]
    response_mask: Bool[Array, "N T"]
    packing: RowPacking | None = None
    turn_rewards: Float[Array, "N T"] | None = None
    ref_logprobs: Float[Array, "N T"] | None = None


def concatenate(rollouts: list[Rollout]) -> Rollout:
    """Host rollouts stacked along their rows."""
    return jax.tree.map(lambda *xs: np.concatenate(xs), *rollouts)


@flax.struct.dataclass
class Scored:
    """What scoring adds to a rollout (device arrays, rows sharded like the rollout's).

    Attributes:
      ref_logprobs: [N, T] the reference model's log-probs.
      old_logprobs: [N, T] the policy's log-probs at the params that sampled, or None when
        the update's forward stands in for them (``RLLayout.reuse_policy_forward``).
      old_values: [N, T] the critic's values (PPO), or None (GRPO, or the critic's update
        forward stands in: ``RLLayout.reuse_value_forward``).
      returns: [N, T] GAE returns, the critic's targets (with ``old_values``).
      advantages: [N, T] advantages broadcast over the response, or None when the critic's
        update computes them.
      token_rewards: [N, T] per-token rewards (score on the last response token, KL penalty
        per token) for a critic whose update runs GAE, else None.
      metrics: scalar metrics of scoring (``kl/seq_mean``, ``advantages/abs_mean``, ...).
    """

    ref_logprobs: Float[Array, "N T"]
    old_logprobs: Float[Array, "N T"] | None = None
    old_values: Float[Array, "N T"] | None = None
    returns: Float[Array, "N T"] | None = None
    advantages: Float[Array, "N T"] | None = None
    token_rewards: Float[Array, "N T"] | None = None
    metrics: Metrics = flax.struct.field(default_factory=dict)


@flax.struct.dataclass
class LearnerBatch:
    """The update's input: a rollout's tokens with their scores (rows of ``[N, ...]``).

    Attributes:
      tokens, mask, response_mask: [N, T] as in :class:`Rollout`.
      kl_coef: [N] float32 copies of the KL coefficient ``beta`` (rows split cleanly over
        micro-batches).
      ref_logprobs, old_logprobs, old_values, returns, advantages, token_rewards: as in
        :class:`Scored`; None where the update computes them itself.
      packing: when the update packs sequences, each row's place in its micro-batch's packed
        rows per epoch ([N, E] leaves: the update hands each epoch's column to the losses,
        which see [B] leaves); else None.
      behaviour_logprobs: [N, T] the sampler's per-token log-probs (``Rollout``'s
        ``sampler_logprobs``) when the loss corrects with them
        (``loss.rollout_correction``), else None.
    """

    tokens: Int[Array, "N T"]
    mask: Bool[Array, "N T"]
    response_mask: Bool[Array, "N T"]
    kl_coef: Float[Array, " N"]
    ref_logprobs: Float[Array, "N T"]
    old_logprobs: Float[Array, "N T"] | None = None
    old_values: Float[Array, "N T"] | None = None
    returns: Float[Array, "N T"] | None = None
    advantages: Float[Array, "N T"] | None = None
    token_rewards: Float[Array, "N T"] | None = None
    packing: RowPacking | None = None
    behaviour_logprobs: Float[Array, "N T"] | None = None

    @classmethod
    def of(
        cls,
        rows: RolloutRows,
        scored: Scored,
        kl_coef: Float[Array, " N"],
        behaviour_logprobs: Float[Array, "N T"] | None = None,
    ) -> LearnerBatch:
        """The update's input for ``rows`` as ``scored``, with ``kl_coef`` per row (and the
        sampler's log-probs when the loss corrects with them)."""
        return cls(
            tokens=rows.tokens,
            mask=rows.mask,
            response_mask=rows.response_mask,
            kl_coef=kl_coef,
            ref_logprobs=scored.ref_logprobs,
            old_logprobs=scored.old_logprobs,
            old_values=scored.old_values,
            returns=scored.returns,
            advantages=scored.advantages,
            token_rewards=scored.token_rewards,
            behaviour_logprobs=behaviour_logprobs,
        )


@flax.struct.dataclass
class ForwardOutputs:
    """Per-token results of an update's forward that scoring did not compute (None where it
    did), handed from one learner to the next and returned by the update.

    Attributes:
      old_logprobs: [N, T] from the policy's forward (``reuse_policy_forward``).
      old_values, returns, advantages: [N, T] from the critic's forward and GAE
        (``reuse_value_forward``).
    """

    old_logprobs: Float[Array, "N T"] | None = None
    old_values: Float[Array, "N T"] | None = None
    returns: Float[Array, "N T"] | None = None
    advantages: Float[Array, "N T"] | None = None

    def fill(self, batch: LearnerBatch) -> LearnerBatch:
        """``batch`` with the fields it lacks taken from these outputs."""
        return batch.replace(
            **{
                name: getattr(self, name)
                for name in ("old_logprobs", "old_values", "returns", "advantages")
                if getattr(batch, name) is None and getattr(self, name) is not None
            }
        )

    def merge(self, other: ForwardOutputs | None) -> ForwardOutputs:
        """These outputs with ``other``'s non-None fields added."""
        if other is None:
            return self
        return ForwardOutputs(
            **{
                name: getattr(other, name)
                if getattr(other, name) is not None
                else getattr(self, name)
                for name in ("old_logprobs", "old_values", "returns", "advantages")
            }
        )


@flax.struct.dataclass
class UpdateOutput:
    """What the update returns beside the new states.

    Attributes:
      metrics: means over every minibatch update (``skipped``: sums), plus ``first/<key>``
        from the first minibatch of the first epoch.
      outputs: the per-token results of the update's forwards (:class:`ForwardOutputs`).
    """

    metrics: Metrics
    outputs: ForwardOutputs
