"""Reward-model scoring: a scalar-head model's score of each rollout row, pure and jittable.

The score of a row is the head's value at its last real token (the convention of the RM
trainer, ``jaxrlhf.train.reward_model``, and of transformers' ``*ForSequenceClassification``).
"""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.models.packing import RowPacking
from jaxrlhf.models.scoring import RolloutForward
from jaxrlhf.sharding.micro_batches import map_micro
from jaxrlhf.sharding.rules import Rules


def reward_model_scores(
    forward: RolloutForward,
    params: Any,
    tokens: Int[Array, "N T"],
    mask: Bool[Array, "N T"],
    plan: RowPacking | None = None,
    packed_rows: int | None = None,
    *,
    num_micro: int = 1,
    mesh: Mesh | None = None,
    rules: Rules | None = None,
    group_size: int | None = None,
) -> Float[Array, " N"]:
    """``[N]`` float32 scores of the rows ``[prompt | response]``.

    Args:
      forward: the reward model over rollout rows (its packing decides how prompt groups
        or sequences run; the scores are the same either way up to float rounding).
      params: the reward model's parameters.
      tokens, mask: ``[N, T]`` rollout rows.
      plan, packed_rows: a sequence-packed forward's plan of the rows (``[N]`` leaves) and
        packed rows per shard; None otherwise.
      num_micro: score this many micro-batches of rows one after another (bounds activation
        memory), with ``mesh`` and ``rules`` placing them.
      group_size: rows each micro-batch keeps together (default: the forward's prompt
        groups).
    """
    forward = forward.with_packed_rows(packed_rows)
    rows = {"tokens": tokens, "mask": mask, "plan": plan}
    return map_micro(
        lambda r: forward.sequence_scores(params, r["tokens"], r["mask"], r["plan"]),
        rows,
        num_micro,
        mesh,
        rules,
        forward.group_size if group_size is None else group_size,
    )
