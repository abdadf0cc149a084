"""Rewards for RL: programmatic reward functions (lookup, calling with the data's columns,
checking), the built-in tasks' reward, host-side score shaping, and reward-model scoring.

``jaxrlhf.rewards`` imports jaxrlhf.data (the built-in tasks and their answers); the data
layer never imports it.
"""

from jaxrlhf.data.tasks import add_answer, add_reward, sort_answer, sort_reward
from jaxrlhf.rewards.builtin import builtin_reward_fn, task_rewards
from jaxrlhf.rewards.functions import (
    RewardError,
    RewardFn,
    call_reward_fn,
    resolve_reward_fn,
    reward_fn_name,
)
from jaxrlhf.rewards.shaping import overlong_penalty, shape_scores

__all__ = [
    "RewardError",
    "RewardFn",
    "add_answer",
    "add_reward",
    "builtin_reward_fn",
    "call_reward_fn",
    "overlong_penalty",
    "resolve_reward_fn",
    "reward_fn_name",
    "shape_scores",
    "sort_answer",
    "sort_reward",
    "task_rewards",
]
