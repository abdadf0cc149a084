"""Built-in tasks: synthetic text problems, their answers and their graded scores.

Nothing is downloaded. A source ``builtin:sort`` or ``builtin:add`` in the data config
yields records of the kind the trainer needs:

* SFT: ``{"prompt", "response"}`` with the correct answer;
* preference: ``{"prompt", "chosen", "rejected"}`` where two candidates (the correct
  answer or a perturbation of it: swapped, replaced, dropped or inserted digits) are graded
  (:func:`grade`) and the higher one is chosen, so the pairs range from easy (right vs.
  garbled) to subtle (one swap vs. two);
* prompt: ``{"prompt", "answer"}`` for RL; the ``answer`` column reaches reward functions
  as a keyword argument (``jaxrlhf.rewards``);
* offline (ILQL): ``{"prompt", "response", "reward", "answer"}``, one behaviour sample per
  prompt: the correct answer (40%) or a perturbation of it, rewarded with its grade.

Problems are small enough for a 2-layer, width-64 model to learn in a few hundred steps on
a CPU: ``sort`` asks for 3-6 digits in ascending order (``"sort 31415:"`` -> ``"11345"``),
``add`` for the sum of two numbers below 100 (``"add 23+58="`` -> ``"81"``); ``calc`` for
the sum of two 6-digit numbers, the tool task of :mod:`jaxrlhf.data.tool_task` (its SFT
records show a ``calculator`` tool call on some examples).

Grades give partial credit, so that a policy that is almost right gets more reward than one
that is far off (RL needs that signal), and exactly 1.0 only to the correct answer:

* ``sort``: ``0.7 * positional + 0.3 * multiset``, where ``positional`` is the fraction of
  positions holding the right digit and ``multiset`` the fraction of digits that are the
  right ones in any order, both over ``max(len(answer), len(completion))``.
* ``add``: the fraction of digit positions (aligned from the least significant digit) that
  match, over the longer of answer and completion; a completion with a non-digit character
  gets 0.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Collection
from typing import Any

import numpy as np

_SORT = re.compile(r"sort (\d+):")
_ADD = re.compile(r"add (\d+)\+(\d+)=")
_CALC = re.compile(r"calc (\d+)\+(\d+)=")


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


def calc_answer(prompt: str) -> str:
    """The correct answer to a calc prompt (``jaxrlhf.data.tool_task``)."""
    m = _CALC.search(prompt)
    if m is None:
        raise ValueError(f"not a calc prompt: {prompt!r}")
    return str(int(m.group(1)) + int(m.group(2)))


def grade_sort(answer: str, completion: str) -> float:
    """Graded score of ``completion`` against a sort ``answer`` (module docstring)."""
    pred = completion.strip()
    n = max(len(answer), len(pred))
    if n == 0:
        return 1.0
    positional = sum(p == t for p, t in zip(pred, answer, strict=False)) / n
    overlap = sum((Counter(pred) & Counter(answer)).values()) / n
    return 0.7 * positional + 0.3 * overlap


def grade_add(answer: str, completion: str) -> float:
    """Graded score of ``completion`` against an addition ``answer`` (module docstring)."""
    pred = completion.strip()
    if not pred or not pred.isdigit():
        return 0.0
    n = max(len(answer), len(pred))
    return sum(p == t for p, t in zip(reversed(pred), reversed(answer), strict=False)) / n


ANSWERS: dict[str, Callable[[str], str]] = {
    "sort": sort_answer,
    "add": add_answer,
    "calc": calc_answer,
}
GRADERS: dict[str, Callable[[str, str], float]] = {
    "sort": grade_sort,
    "add": grade_add,
    "calc": grade_add,
}


def grade(task: str, answer: str, completion: str) -> float:
    """Graded score in [0, 1] of ``completion`` for built-in ``task`` given its ``answer``."""
    if task not in GRADERS:
        raise ValueError(f"unknown built-in task {task!r}; expected one of {sorted(GRADERS)}")
    return GRADERS[task](answer, completion)


def sort_reward(prompt: str, completion: str) -> float:
    """Graded score of ``completion`` for a sort prompt (the answer derived from it)."""
    return grade_sort(sort_answer(prompt), completion)


def add_reward(prompt: str, completion: str) -> float:
    """Graded score of ``completion`` for an addition prompt (the answer derived from it)."""
    return grade_add(add_answer(prompt), completion)


BUILTIN_TASKS = ("sort", "add", "calc")
RECORD_KINDS = ("sft", "preference", "prompt", "offline")


def make_problem(task: str, rng: np.random.Generator) -> tuple[str, str]:
    """One random ``(prompt, answer)`` of ``task``."""
    if task == "sort":
        digits = "".join(str(d) for d in rng.integers(0, 10, int(rng.integers(3, 7))))
        prompt = f"sort {digits}:"
    elif task == "add":
        a, b = (int(x) for x in rng.integers(0, 100, 2))
        prompt = f"add {a}+{b}="
    elif task == "calc":  # the tool task (jaxrlhf.data.tool_task)
        a, b = (int(x) for x in rng.integers(100_000, 1_000_000, 2))
        prompt = f"calc {a}+{b}="
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


TOOL_SFT_FRACTION = 0.4  # calc SFT records that show the calculator tool


def tool_use_response(a: int, b: int) -> str:
    """A calc SFT response that calls the ``calculator`` tool in the task's short syntax
    (``<calc>a+b</calc>``, ``tool_task.CalculatorEnv``), reads its answer (framed as
    ``generation.environment.NO_TEMPLATE_OBSERVATION``, what the environment answers through
    the character tokenizer), then answers."""
    return f"<calc>{a}+{b}</calc><tool_response>{a + b}</tool_response>{a + b}"


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
      kind: ``"sft"``, ``"preference"``, ``"prompt"`` or ``"offline"``.
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
        if kind == "sft" and task == "calc" and rng.random() < TOOL_SFT_FRACTION:
            a, b = (int(x) for x in _CALC.search(prompt).groups())
            records.append({"prompt": prompt, "response": tool_use_response(a, b)})
        elif kind == "sft":
            records.append({"prompt": prompt, "response": answer})
        elif kind == "prompt":
            records.append({"prompt": prompt, "answer": answer})
        elif kind == "offline":
            response = _candidate(answer, rng)
            reward = grade(task, answer, response)
            records.append(
                {"prompt": prompt, "response": response, "reward": reward, "answer": answer}
            )
        else:
            a, b = _candidate(answer, rng), _candidate(answer, rng)
            ra, rb = grade(task, answer, a), grade(task, answer, b)
            if ra == rb:
                continue
            chosen, rejected = (a, b) if ra > rb else (b, a)
            records.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return records
