"""Reward-model training: Bradley-Terry on (chosen, rejected) pairs, accuracy reported.

The reward is the scalar head's value at each sequence's last real token (its EOS for
plain-text data, the end-of-turn marker for templated data).
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from jaxrlhf import losses
from jaxrlhf.models import model as model_lib
from jaxrlhf.train.config import RewardModelConfig
from jaxrlhf.train.steps import Batch, LossAux, Objective


def pair_mask(batch: Batch) -> jax.Array:
    """[B] True for real pairs (padding rows have no response tokens)."""
    return batch["response_mask"].any(-1).all(-1)


def pair_rewards(module: Any, params: Any, batch: Batch) -> jax.Array:
    """``[B, 2]`` rewards of each pair's chosen (0) and rejected (1) sequence."""
    b, two, t = batch["tokens"].shape
    tokens = batch["tokens"].reshape(b * two, t)
    mask = batch["mask"].reshape(b * two, t)
    values = model_lib.forward(module, params, tokens, mask)
    return model_lib.last_token_values(values, mask).reshape(b, two)


def loss_fn(
    cfg: RewardModelConfig, module: Any, params: Any, batch: Batch
) -> tuple[jax.Array, LossAux]:
    rewards = pair_rewards(module, params, batch)
    real = pair_mask(batch)
    loss, m = losses.bradley_terry_loss(rewards[:, 0], rewards[:, 1], pair_mask=real)
    if cfg.center_coef:
        loss = loss + cfg.center_coef * losses.masked_mean(rewards.sum(-1) ** 2, real)
    return loss, LossAux(
        {
            "loss/rm": loss,
            "rm/accuracy": m["rewards/accuracy"],
            "rm/margin": m["rewards/margin"],
            "rm/chosen": m["rewards/chosen"],
            "rm/rejected": m["rewards/rejected"],
        }
    )


def weight_fn(batch: Batch) -> jax.Array:
    return pair_mask(batch).sum()


def objective(cfg: RewardModelConfig) -> Objective:
    return Objective(
        name="reward_model",
        role="reward",
        head="scalar",
        data_kind="preference",
        loss_fn=functools.partial(loss_fn, cfg),
        weight_fn=weight_fn,
        primary="loss/rm",
        summary=("loss/rm", "rm/accuracy"),
    )
