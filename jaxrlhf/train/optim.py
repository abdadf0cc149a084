"""AdamW with warmup + cosine/linear/constant schedules and global-norm clipping (optax);
with ``stochastic_rounding``, its updates rounded stochastically into bfloat16 params
(``train/rounding.py``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxrlhf.train.config import OptimizerConfig
from jaxrlhf.train.rounding import with_stochastic_rounding

# Leaves that get weight decay: matrices and embeddings, not norm scales or biases. Matched
# on the param's name because stacked layers make even norm scales 2-D ([L, D]).
_DECAYED_SUFFIXES = ("kernel", "embedding", "lm_head", "score", "lora_a", "lora_b")


def make_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Learning rate as a function of the step (0-based), over ``total_steps`` updates."""
    warmup = min(cfg.warmup_steps, total_steps)
    end = cfg.lr * cfg.min_lr_ratio
    decay_steps = max(total_steps - warmup, 1)
    if cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        after = optax.linear_schedule(cfg.lr, end, decay_steps)
    else:
        after = optax.constant_schedule(cfg.lr)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), after], [warmup])


def decay_mask(params: Any) -> Any:
    """True on the leaves that get weight decay (see ``_DECAYED_SUFFIXES``)."""

    def decayed(path: tuple, _: Any) -> bool:
        name = str(getattr(path[-1], "key", path[-1]))
        return name.endswith(_DECAYED_SUFFIXES)

    return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(
    cfg: OptimizerConfig, total_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``(optimizer, lr_fn)``: clip by global norm, then AdamW on the schedule; with
    ``cfg.stochastic_rounding``, both run in float32 and bfloat16 params take their updates
    rounded stochastically (:func:`~jaxrlhf.train.rounding.with_stochastic_rounding`)."""
    lr_fn = make_schedule(cfg, total_steps)
    adamw = optax.adamw(
        lr_fn,
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=decay_mask,
        mu_dtype=None if cfg.mu_dtype is None else jnp.dtype(cfg.mu_dtype),
    )
    optimizer = adamw
    if cfg.max_grad_norm > 0:
        optimizer = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
    if cfg.stochastic_rounding:
        optimizer = with_stochastic_rounding(optimizer)
    return optimizer, lr_fn
