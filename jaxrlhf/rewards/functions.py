"""Programmatic rewards: look a function up by name, call it with the rollout, check what it
returns.

A reward function scores a batch of completions::

    def exact_match(prompts, completions, *, answer, **kwargs) -> list[float]: ...

It is called with, for every rollout row (a prompt's ``n`` samples are ``n`` rows):

* ``prompts``, ``completions``: the decoded text (positional);
* ``prompt_ids``, ``completion_ids``: the token ids (lists of ints, no padding);
* every other column of the prompt's dataset record, by its name (e.g. ``answer=`` for
  GSM8K-style records ``{"prompt": ..., "answer": ...}``): one value per row, None where a
  record lacks the column.

Every argument is a list of the rows' values, as in TRL's and verl's reward functions. A
function that takes ``**kwargs`` receives them all; otherwise only the keyword arguments
its signature names (so ``fn(prompts, completions)`` works as it is). It returns one finite
number per row.

Functions are named in the config by a dotted path ``module.attr`` (``__main__.my_reward``
for a notebook's), or ``builtin`` for the built-in task of ``data.train``
(:mod:`jaxrlhf.rewards.builtin`).
"""

from __future__ import annotations

import importlib
import inspect
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxrlhf.data.sources import BUILTIN_PREFIX
from jaxrlhf.rewards.builtin import builtin_reward_fn

RewardFn = Callable[..., Sequence[float]]


class RewardError(ValueError):
    """A reward function that cannot be found, raises, or returns the wrong thing (one
    line naming the function)."""


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
        return builtin_reward_fn(data_train[len(BUILTIN_PREFIX) :])
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


def reward_fn_name(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of a reward function, for messages."""
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', repr(fn))}"


RESERVED = ("prompts", "completions", "prompt_ids", "completion_ids")


def accepts(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` takes a keyword argument ``name`` (by name, or any with ``**kwargs``);
    False for callables without a signature (builtins, C functions)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    p = params.get(name)
    keyword = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return p is not None and p.kind in keyword


def _where(e: BaseException) -> str:
    """``file:line`` of the innermost frame of an exception's traceback."""
    frames = traceback.extract_tb(e.__traceback__)
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def call_reward_fn(
    fn: RewardFn,
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    completion_ids: Sequence[Sequence[int]] | None = None,
    columns: Mapping[str, Sequence[Any]] | None = None,
) -> np.ndarray:
    """``fn``'s scores as a finite float32 ``[N]`` array, or a one-line error.

    Args:
      fn: the reward function (module docstring).
      prompts, completions: ``N`` decoded texts.
      prompt_ids, completion_ids: their token ids (passed when given and accepted).
      columns: other dataset columns, ``N`` values each (passed by name when accepted).

    Raises:
      RewardError: ``fn`` raised, or returned something other than ``N`` finite numbers;
        the message names the function.
    """
    name = reward_fn_name(fn)
    columns = dict(columns or {})
    clash = sorted(set(columns) & set(RESERVED))
    if clash:
        raise RewardError(
            f"reward function {name}: the data has a column {clash[0]!r}, a name reserved for "
            f"the rollout ({', '.join(RESERVED)}); rename the column"
        )
    kwargs = {k: v for k, v in columns.items() if accepts(fn, k)}
    for key, ids in (("prompt_ids", prompt_ids), ("completion_ids", completion_ids)):
        if ids is not None and accepts(fn, key):
            kwargs[key] = [list(map(int, row)) for row in ids]
    try:
        raw = fn(list(prompts), list(completions), **kwargs)
    except Exception as e:  # noqa: BLE001  the user's code: say whose, and where
        first = (str(e).strip().splitlines() or [""])[0]
        raise RewardError(
            f"reward function {name} raised {type(e).__name__}: {first}{_where(e)}"
        ) from e
    try:
        scores = np.asarray(raw, dtype=np.float32)
    except (TypeError, ValueError):
        shown = repr(raw)[:80]
        raise RewardError(
            f"reward function {name} returned {shown}, expected {len(prompts)} numbers"
        ) from None
    if scores.shape != (len(prompts),):
        raise RewardError(
            f"reward function {name} returned shape {scores.shape}, expected ({len(prompts)},)"
        )
    if not np.isfinite(scores).all():
        bad = int(np.flatnonzero(~np.isfinite(scores))[0])
        raise RewardError(
            f"reward function {name} returned a non-finite score ({scores[bad]}) for row {bad}"
        )
    return scores
