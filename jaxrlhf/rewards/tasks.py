"""Programmatic rewards of the built-in tasks, graded in [0, 1].

Each reward gives partial credit, so that a policy that is almost right gets more reward
than one that is far off (RL needs that signal), and gives exactly 1.0 only to the correct
answer. Rewards are plain Python over strings: the trainer decodes completions first.

* ``sort``: prompt ``"sort 31415:"``, answer ``"11345"`` (the digits in ascending order).
  ``r = 0.7 * positional + 0.3 * multiset``, where ``positional`` is the fraction of
  positions holding the right digit and ``multiset`` the fraction of digits that are the
  right ones in any order, both over ``max(len(answer), len(completion))``.
* ``add``: prompt ``"add 23+58="``, answer ``"81"``. ``r`` is the fraction of digit
  positions (aligned from the least significant digit) that match, over the longer of
  answer and completion; a completion with a non-digit character gets 0.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

_SORT = re.compile(r"sort (\d+):")
_ADD = re.compile(r"add (\d+)\+(\d+)=")


def sort_answer(prompt: str) -> str:
    """The correct answer to a sort prompt."""
    m = _SORT.search(prompt)
    if m is None:
        raise ValueError(f"not a sort prompt: {prompt!r}")
    return "".join(sorted(m.group(1)))


def add_answer(prompt: str) -> str:
    """The correct answer to an addition prompt."""
    m = _ADD.search(prompt)
    if m is None:
        raise ValueError(f"not an add prompt: {prompt!r}")
    return str(int(m.group(1)) + int(m.group(2)))


def sort_reward(prompt: str, completion: str) -> float:
    """Graded reward of ``completion`` for a sort prompt (see the module docstring)."""
    target = sort_answer(prompt)
    pred = completion.strip()
    n = max(len(target), len(pred))
    positional = sum(p == t for p, t in zip(pred, target, strict=False)) / n
    overlap = sum((Counter(pred) & Counter(target)).values()) / n
    return 0.7 * positional + 0.3 * overlap


def add_reward(prompt: str, completion: str) -> float:
    """Graded reward of ``completion`` for an addition prompt (see the module docstring)."""
    target = add_answer(prompt)
    pred = completion.strip()
    if not pred or not pred.isdigit():
        return 0.0
    n = max(len(target), len(pred))
    return sum(p == t for p, t in zip(reversed(pred), reversed(target), strict=False)) / n


REWARDS: dict[str, Callable[[str, str], float]] = {"sort": sort_reward, "add": add_reward}
ANSWERS: dict[str, Callable[[str], str]] = {"sort": sort_answer, "add": add_answer}


def task_rewards(task: str, prompts: Sequence[str], completions: Sequence[str]) -> np.ndarray:
    """Rewards ``[B]`` (float32) of a batch of decoded completions for built-in ``task``."""
    if task not in REWARDS:
        raise ValueError(f"unknown built-in task {task!r}; expected one of {sorted(REWARDS)}")
    fn = REWARDS[task]
    return np.asarray(
        [fn(p, c) for p, c in zip(prompts, completions, strict=True)], dtype=np.float32
    )
