"""Supervised fine-tuning: masked next-token cross-entropy on the response tokens."""

from __future__ import annotations

import functools
from typing import Any

import jax

from jaxrlhf import losses
from jaxrlhf.models import model as model_lib
from jaxrlhf.train.config import SFTConfig
from jaxrlhf.train.steps import Batch, LossAux, Objective


def _target_mask(batch: Batch) -> jax.Array:
    # logits[:, t] predict tokens[:, t + 1]: the loss covers targets that are response tokens.
    return batch["response_mask"][:, 1:]


def loss_fn(cfg: SFTConfig, module: Any, params: Any, batch: Batch) -> tuple[jax.Array, LossAux]:
    """Mean NLL of the response tokens of ``batch`` (tokens/mask/response_mask ``[B, T]``)."""
    logits = model_lib.forward(module, params, batch["tokens"], batch["mask"])
    loss, m = losses.sft_loss(
        logits[:, :-1], batch["tokens"][:, 1:], _target_mask(batch), aggregation=cfg.aggregation
    )
    return loss, LossAux({"loss/sft": loss, "sft/accuracy": m["sft/accuracy"]})


def weight_fn(cfg: SFTConfig, batch: Batch) -> jax.Array:
    """Response tokens (token mean) or non-empty responses (sequence mean)."""
    mask = _target_mask(batch)
    if cfg.aggregation == "token_mean":
        return mask.sum()
    return mask.any(-1).sum()


def objective(cfg: SFTConfig) -> Objective:
    return Objective(
        name="sft",
        role="policy",
        head="lm",
        data_kind="sft",
        loss_fn=functools.partial(loss_fn, cfg),
        weight_fn=functools.partial(weight_fn, cfg),
        primary="loss/sft",
        summary=("loss/sft", "sft/accuracy"),
    )
