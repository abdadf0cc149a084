"""Reward sources for RL: a programmatic function named in the config, or a reward model.

A programmatic reward is ``fn(prompts: list[str], completions: list[str]) -> [N] floats``,
named by a dotted path (``my_pkg.rewards.exact_match``) or ``builtin`` for the built-in
task of ``data.train`` (``builtin:sort`` -> the sort reward).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

import numpy as np

from jaxrlhf.data.sources import BUILTIN_PREFIX
from jaxrlhf.rewards.tasks import task_rewards

RewardFn = Callable[[Sequence[str], Sequence[str]], np.ndarray]


class RewardError(ValueError):
    """A reward function that cannot be found or returns the wrong thing."""


def resolve_reward_fn(function: str, data_train: str) -> RewardFn:
    """The callable named by ``function`` (see the module docstring).

    Raises:
      RewardError: ``builtin`` without a built-in dataset, or a path that does not import.
    """
    if function == "builtin":
        if not data_train.startswith(BUILTIN_PREFIX):
            raise RewardError(
                f"reward.function: 'builtin' needs a built-in dataset (data.train: builtin:TASK), "
                f"got data.train={data_train!r}"
            )
        task = data_train[len(BUILTIN_PREFIX) :]
        return lambda prompts, completions: task_rewards(task, prompts, completions)
    module_name, _, attr = function.rpartition(".")
    if not module_name:
        raise RewardError(f"reward.function: {function!r} is not a dotted path module.attr")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise RewardError(f"reward.function: cannot import {function!r} ({e})") from None
    if not callable(fn):
        raise RewardError(f"reward.function: {function!r} is not callable")
    return fn


def call_reward_fn(fn: RewardFn, prompts: Sequence[str], completions: Sequence[str]) -> np.ndarray:
    """``fn``'s scores as a finite float32 ``[N]`` array, or a clear error."""
    scores = np.asarray(fn(list(prompts), list(completions)), dtype=np.float32)
    if scores.shape != (len(prompts),):
        raise RewardError(
            f"reward function returned shape {scores.shape}, expected ({len(prompts)},)"
        )
    if not np.isfinite(scores).all():
        raise RewardError("reward function returned non-finite scores")
    return scores


def overlong_penalty(
    lengths: np.ndarray, stopped: np.ndarray, max_new_tokens: int, buffer: int, penalty: float
) -> np.ndarray:
    """DAPO's soft overlong punishment ``[N]`` (to subtract from the scores).

    Responses longer than ``max_new_tokens - buffer`` pay linearly up to ``penalty`` at the
    budget; responses cut off at the budget (no stop token) pay ``penalty`` in full.
    """
    if buffer <= 0 or penalty <= 0:
        return np.zeros(len(lengths), np.float32)
    over = np.clip((lengths - (max_new_tokens - buffer)) / buffer, 0.0, 1.0)
    return (np.where(stopped, over, 1.0) * penalty).astype(np.float32)
