"""Programmatic rewards (built-in tasks) and, later, reward-model scoring."""

from jaxrlhf.rewards.tasks import (
    ANSWERS,
    REWARDS,
    add_answer,
    add_reward,
    sort_answer,
    sort_reward,
    task_rewards,
)

__all__ = [
    "ANSWERS",
    "REWARDS",
    "add_answer",
    "add_reward",
    "sort_answer",
    "sort_reward",
    "task_rewards",
]
