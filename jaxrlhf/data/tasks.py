"""Built-in tasks: synthetic text problems with programmatic rewards, generated on the fly.

Nothing is downloaded. A source ``builtin:sort`` or ``builtin:add`` in the data config
yields records of the kind the trainer needs:

* SFT: ``{"prompt", "response"}`` with the correct answer;
* preference: ``{"prompt", "chosen", "rejected"}`` where two candidates (the correct
  answer or a perturbation of it: swapped, replaced, dropped or inserted digits) are scored
  with the task's reward (``jaxrlhf.rewards``) and the higher one is chosen, so the pairs
  range from easy (right vs. garbled) to subtle (one swap vs. two);
* prompt: ``{"prompt", "answer"}`` for RL.

Problems are small enough for a 2-layer, width-64 model to learn in a few hundred steps on
a CPU: ``sort`` asks for 3-6 digits in ascending order (``"sort 31415:"`` -> ``"11345"``),
``add`` for the sum of two numbers below 100 (``"add 23+58="`` -> ``"81"``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np

from jaxrlhf.rewards.tasks import ANSWERS, REWARDS

BUILTIN_TASKS = ("sort", "add")
RECORD_KINDS = ("sft", "preference", "prompt")


def make_problem(task: str, rng: np.random.Generator) -> tuple[str, str]:
    """One random ``(prompt, answer)`` of ``task``."""
    if task == "sort":
        digits = "".join(str(d) for d in rng.integers(0, 10, int(rng.integers(3, 7))))
        prompt = f"sort {digits}:"
    elif task == "add":
        a, b = (int(x) for x in rng.integers(0, 100, 2))
        prompt = f"add {a}+{b}="
    else:
        raise ValueError(f"unknown built-in task {task!r}; expected one of {BUILTIN_TASKS}")
    return prompt, ANSWERS[task](prompt)


def perturb(answer: str, rng: np.random.Generator) -> str:
    """``answer`` with 1-3 random digit edits (swap, replace, drop, insert); never empty."""
    s = list(answer)
    for _ in range(int(rng.integers(1, 4))):
        op = int(rng.integers(4))
        i = int(rng.integers(len(s)))
        if op == 0 and len(s) > 1:
            j = int(rng.integers(len(s)))
            s[i], s[j] = s[j], s[i]
        elif op == 1:
            s[i] = str(rng.integers(10))
        elif op == 2 and len(s) > 1:
            del s[i]
        else:
            s.insert(i, str(rng.integers(10)))
    return "".join(s)


def _candidate(answer: str, rng: np.random.Generator) -> str:
    return answer if rng.random() < 0.4 else perturb(answer, rng)


def builtin_records(
    task: str,
    kind: str,
    n: int,
    seed: int,
    exclude_prompts: Collection[str] = (),
) -> list[dict[str, Any]]:
    """``n`` generated records of ``kind`` for built-in ``task``.

    Args:
      task: one of ``BUILTIN_TASKS``.
      kind: ``"sft"``, ``"preference"`` or ``"prompt"``.
      n: number of records.
      seed: generator seed (same seed, same records).
      exclude_prompts: prompts never to generate (e.g. the held-out set's).

    Returns:
      A list of record dicts (see the module docstring).
    """
    if task not in BUILTIN_TASKS:
        raise ValueError(f"unknown built-in task {task!r}; expected one of {BUILTIN_TASKS}")
    if kind not in RECORD_KINDS:
        raise ValueError(f"unknown record kind {kind!r}; expected one of {RECORD_KINDS}")
    rng = np.random.default_rng([seed, BUILTIN_TASKS.index(task)])
    reward = REWARDS[task]
    excluded = set(exclude_prompts)
    records: list[dict[str, Any]] = []
    attempts = 0
    while len(records) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"builtin:{task} cannot generate {n} distinct-enough records")
        prompt, answer = make_problem(task, rng)
        if prompt in excluded:
            continue
        if kind == "sft":
            records.append({"prompt": prompt, "response": answer})
        elif kind == "prompt":
            records.append({"prompt": prompt, "answer": answer})
        else:
            a, b = _candidate(answer, rng), _candidate(answer, rng)
            ra, rb = reward(prompt, a), reward(prompt, b)
            if ra == rb:
                continue
            chosen, rejected = (a, b) if ra > rb else (b, a)
            records.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return records
