"""The built-in tasks' reward: the graded score of :mod:`jaxrlhf.data.tasks`, read against
each record's ``answer`` column."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrlhf.data.tasks import ANSWERS, BUILTIN_TASKS, grade


def builtin_reward_fn(task: str) -> Callable[..., np.ndarray]:
    """The reward function of built-in ``task``: ``fn(prompts, completions, *, answer)``.

    A row whose ``answer`` is None (a record without the column) is graded against the
    answer derived from its prompt.

    Raises:
      ValueError: an unknown task.
    """
    if task not in BUILTIN_TASKS:
        raise ValueError(f"unknown built-in task {task!r}; expected one of {list(BUILTIN_TASKS)}")

    def reward(
        prompts: Sequence[str],
        completions: Sequence[str],
        *,
        answer: Sequence[str | None] | None = None,
        **_: Any,
    ) -> np.ndarray:
        return task_rewards(task, prompts, completions, answer)

    reward.__qualname__ = f"builtin_{task}_reward"
    return reward


def task_rewards(
    task: str,
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str | None] | None = None,
) -> np.ndarray:
    """Graded rewards ``[N]`` (float32) of decoded completions for built-in ``task``;
    ``answers`` (one per row, None: derive it from the prompt).

    Raises:
      ValueError: an unknown task.
    """
    if task not in BUILTIN_TASKS:
        raise ValueError(f"unknown built-in task {task!r}; expected one of {list(BUILTIN_TASKS)}")
    answers = list(answers) if answers is not None else [None] * len(prompts)
    return np.asarray(
        [
            grade(task, ANSWERS[task](p) if a is None else str(a), c)
            for p, c, a in zip(prompts, completions, answers, strict=True)
        ],
        dtype=np.float32,
    )
