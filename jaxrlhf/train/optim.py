"""AdamW with warmup + cosine/linear/constant schedules and global-norm clipping (optax)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("cosine", "linear", "constant")
# Leaves that get weight decay: matrices and embeddings, not norm scales or biases. Matched
# on the param's name because stacked layers make even norm scales 2-D ([L, D]).
_DECAYED_SUFFIXES = ("kernel", "embedding", "lm_head", "score")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW and its learning-rate schedule.

    Attributes:
      lr: peak learning rate.
      schedule: after warmup, ``"cosine"`` or ``"linear"`` decay to ``lr * min_lr_ratio`` at
        the last step, or ``"constant"``.
      warmup_steps: linear warmup from 0 over this many steps.
      min_lr_ratio: final learning rate as a fraction of ``lr``.
      weight_decay: decoupled weight decay on matrices and embeddings.
      b1, b2, eps: Adam moments.
      max_grad_norm: clip the global gradient norm to this; 0 disables clipping.
      mu_dtype: dtype of the first moment (e.g. ``"bfloat16"`` to halve its memory); None
        keeps the param dtype.
    """

    lr: float = 1e-4
    schedule: str = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    mu_dtype: str | None = None

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {list(SCHEDULES)}, got {self.schedule!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay: must be >= 0, got {self.weight_decay}")
        for name in ("b1", "b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}: must be in [0, 1), got {getattr(self, name)}")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm: must be >= 0 (0 disables), got {self.max_grad_norm}")
        if self.mu_dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(
                f"mu_dtype: expected null, float32, bfloat16 or float16, got {self.mu_dtype!r}"
            )


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
    """``(optimizer, lr_fn)``: clip by global norm, then AdamW on the schedule."""
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
    if cfg.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw), lr_fn
    return adamw, lr_fn
