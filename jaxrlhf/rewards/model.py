"""Reward-model scoring: a scalar-head model's score of each rollout row, pure and jittable.

The score of a row is the head's value at its last real token (the convention of the RM
trainer, ``jaxrlhf.train.reward_model``, and of transformers' ``*ForSequenceClassification``).
"""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.models.scoring import RolloutForward
from jaxrlhf.sharding.micro_batches import map_micro
from jaxrlhf.sharding.rules import Rules


def reward_model_scores(
    forward: RolloutForward,
    params: Any,
    tokens: Int[Array, "N T"],
    mask: Bool[Array, "N T"],
    *,
    num_micro: int = 1,
    mesh: Mesh | None = None,
    rules: Rules | None = None,
) -> Float[Array, " N"]:
    """``[N]`` float32 scores of the rows ``[prompt | response]``.

    Args:
      forward: the reward model over rollout rows (its packing decides how prompt groups
        run; the scores are the same either way up to float rounding).
      params: the reward model's parameters.
      tokens, mask: ``[N, T]`` rollout rows.
      num_micro: score this many micro-batches of rows one after another (bounds activation
        memory; whole prompt groups each), with ``mesh`` and ``rules`` placing them.
    """
    rows = {"tokens": tokens, "mask": mask}
    return map_micro(
        lambda r: forward.sequence_scores(params, r["tokens"], r["mask"]),
        rows,
        num_micro,
        mesh,
        rules,
        forward.group_size,
    )
