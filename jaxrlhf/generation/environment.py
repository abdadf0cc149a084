"""Environments for multi-turn rollouts: the protocol, one episode's bookkeeping, and the
host threads that run environment steps while the engine keeps decoding.

An episode starts from a dataset record. The model writes a turn; the environment reads
it and answers with a :class:`Step`: an observation to append (the model then writes the
next turn after it) or the end of the episode. Either may carry a reward; the episode's
reward is the sum (trajectory-level rewards: return it with the last step; per-turn
rewards: return them as they come). Each reward belongs to the turn it answers: PPO pays it
on that turn's last model token (:meth:`Episode.turn_rewards`; with ``reward.normalize`` the
normalised sum on the last token), GRPO's advantages read the episode's sum::

    class Guess:                                   # a class: one instance per episode
        def __init__(self, record):
            self.answer = record["answer"]

        def step(self, turn: Turn) -> Step:
            if turn.text.strip() == self.answer:
                return Step(reward=1.0)            # observation None: the episode ends
            if turn.last:
                return Step(reward=0.0)
            return Step(observation="wrong, try again")

    def echo(record, turns: list[Turn]) -> Step:   # or a function of the turns so far
        ...

Environments are named in the config by dotted path (``rollout.environment``), like reward
functions. Budgets: ``rollout.max_new_tokens`` is the episode's (model and observation
tokens together, the width of the rollout's response region); ``rollout.turn_tokens`` a
model turn's; ``rollout.max_turns`` the number of model turns. An observation that does not
leave room for one more model token ends the episode (truncated, its reward 0 unless the
environment gave one earlier).

Observation text becomes tokens through the tokenizer's chat template as a ``tool`` message
followed by the assistant's generation prompt (:func:`observation_ids`); a tokenizer
without a template (the built-in character tokenizer) appends
``<tool_response>TEXT</tool_response>``. Observation tokens sit in the sequence (the model
attends to them) but out of the loss and the KL: the rollout's ``response_mask`` holds the
model's tokens only, and their behaviour log-probs are 0.

An environment that raises, returns something other than a :class:`Step`, or takes more
than ``rollout.env_timeout_s`` ends its episode with reward 0 (the rewards of its earlier
turns included) and an error observation (``environment error: ...``) appended; the run
goes on. Steps run on daemon threads: a step
that hangs is abandoned, not killed (Python cannot kill a thread).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np

NO_TEMPLATE_OBSERVATION = "<tool_response>{}</tool_response>"


@dataclasses.dataclass(frozen=True)
class Turn:
    """One model turn, as the environment sees it.

    Attributes:
      text: the turn's decoded text (special tokens skipped).
      token_ids: its token ids (the stop token included).
      index: 0 for the first turn.
      stopped: it ended on a stop token or string (else on a token budget).
      last: no further turn will be sampled (``max_turns`` reached or the episode budget
        spent): an observation returned now is dropped and the episode ends.
    """

    text: str
    token_ids: tuple[int, ...]
    index: int
    stopped: bool
    last: bool


@dataclasses.dataclass(frozen=True)
class Step:
    """An environment's answer to a turn.

    Attributes:
      observation: text to append before the model's next turn; None ends the episode.
      reward: this step's reward (the episode's reward is the sum over its steps).
      info: counters summed over the episode and logged (``env/<name>_mean``).
    """

    observation: str | None = None
    reward: float = 0.0
    info: dict[str, float] = dataclasses.field(default_factory=dict)


class Environment(Protocol):
    def step(self, turn: Turn) -> Step: ...


EnvFactory = Callable[[dict[str, Any]], Environment]


class EnvError(ValueError):
    """An environment that cannot be found (one line naming it)."""


class _FunctionEnv:
    """A function ``fn(record, turns) -> Step`` as an :class:`Environment`."""

    def __init__(self, fn: Callable[..., Step], record: dict[str, Any]) -> None:
        self.fn, self.record, self.turns = fn, record, []

    def step(self, turn: Turn) -> Step:
        self.turns.append(turn)
        return self.fn(self.record, list(self.turns))


def resolve_environment(path: str) -> EnvFactory:
    """The factory ``record -> Environment`` named by the dotted path ``module.attr``: a
    class (called with the record) or a function ``fn(record, turns) -> Step``.

    Raises:
      EnvError: the path does not import or names no class or function.
    """
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise EnvError(f"rollout.environment: {path!r} is not a dotted path module.attr")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise EnvError(f"rollout.environment: cannot import {path!r} ({e})") from None
    if inspect.isclass(obj):
        return obj
    if callable(obj):
        return lambda record: _FunctionEnv(obj, record)
    raise EnvError(f"rollout.environment: {path!r} is not a class or function")


def observation_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of an observation: a ``tool`` message then the assistant's generation
    prompt in the tokenizer's chat template (rendered after a dummy user turn and cut off
    it, so templates that open with a system prompt add none), or
    ``<tool_response>TEXT</tool_response>`` without a template."""
    if not getattr(tokenizer, "has_chat_template", False):
        return list(tokenizer.encode(NO_TEMPLATE_OBSERVATION.format(text)))
    before = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    head = tokenizer.render_chat(before, add_generation_prompt=False)
    full = tokenizer.render_chat(
        [*before, {"role": "tool", "content": text}], add_generation_prompt=True
    )
    if not full.startswith(head):
        raise ValueError("observation_ids: the chat template does not extend a conversation")
    return list(tokenizer.encode(full[len(head) :]))


def call_in_thread(fn: Callable[..., Any], *args: Any) -> Future:
    """``fn(*args)`` on a new daemon thread; its result (or exception) in the future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001  handed to whoever reads the future
            future.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return future


@dataclasses.dataclass(frozen=True)
class EpisodeConfig:
    """Per-episode limits (``rollout.max_turns``, ``turn_tokens``, ``env_timeout_s``)."""

    max_turns: int = 4
    turn_tokens: int | None = None
    timeout_s: float = 30.0


class Episode:
    """One episode's host bookkeeping, in the columns of its response region ``[0, width)``.

    The engine (or :func:`run_episode`) samples model tokens from ``start`` up to
    ``budget()``; :meth:`end_turn` hands the turn to the environment, :meth:`apply` its
    answer: the observation's ids to append (they fill ``[length, length + k)``, and the
    next turn starts after them) or None once the episode is over.
    """

    def __init__(
        self,
        env: Environment | None,
        width: int,
        cfg: EpisodeConfig,
        encode_observation: Callable[[str], list[int]],
        decode: Callable[[Sequence[int]], str],
        error: str | None = None,
    ) -> None:
        self.env, self.width, self.cfg = env, width, cfg
        self.encode_observation, self.decode = encode_observation, decode
        self.start = 0  # the current turn's first column
        self.turns = 0
        self.observations: list[tuple[int, int]] = []  # [start, end) columns
        self.rewards: list[float] = []
        self.reward_columns: list[int] = []  # each reward's turn's last model token
        self.info: dict[str, float] = {}
        self.error_ids: list[int] = []  # an error observation after the last turn
        self.errors = 0
        self.ended = False
        self.length = 0
        self.pending_turn: Turn | None = None
        self.stopped = False  # the last turn ended on a stop (else on a budget)
        if error is not None:  # the environment could not even be built
            self._fail(error, 0)

    def budget(self) -> int:
        """The column at which the current turn must stop (one token for an episode whose
        environment could not be built)."""
        if self.ended:
            return min(self.width, self.start + 1)
        if self.cfg.turn_tokens is None:
            return self.width
        return min(self.width, self.start + self.cfg.turn_tokens)

    def end_turn(self, row: Sequence[int], length: int, stopped: bool) -> Turn:
        """The turn in ``row[start:length]`` (a response row's ids), as the environment
        sees it."""
        ids = tuple(int(i) for i in row[self.start : length])
        self.length, self.stopped = length, stopped
        self.turns += 1
        last = self.turns >= self.cfg.max_turns or length + 2 > self.width
        turn = Turn(self.decode(ids), ids, self.turns - 1, stopped, last)
        self.pending_turn = turn
        return turn

    def step(self, turn: Turn) -> Step:
        """The environment's step (run on a host thread)."""
        return self.env.step(turn)

    def apply(self, result: Step | BaseException) -> list[int] | None:
        """Takes the environment's answer to the pending turn: returns the observation ids
        to append, or None when the episode has ended."""
        turn, self.pending_turn = self.pending_turn, None
        if isinstance(result, BaseException):
            first = (str(result).strip().splitlines() or [""])[0]
            return self._fail(f"{type(result).__name__}: {first}", self.length)
        if not isinstance(result, Step):
            return self._fail(f"step returned {type(result).__name__}, not a Step", self.length)
        self.rewards.append(float(result.reward))
        self.reward_columns.append(max(self.length - 1, 0))
        for name, value in result.info.items():
            self.info[name] = self.info.get(name, 0.0) + float(value)
        if result.observation is None or turn.last:
            self.ended = True
            return None
        ids = self.encode_observation(str(result.observation))
        if not ids or self.length + len(ids) + 1 > self.width:
            self.ended = True  # truncated: no room for the observation and a model token
            return None
        self.observations.append((self.length, self.length + len(ids)))
        self.start = self.length + len(ids)
        return ids

    def _fail(self, message: str, length: int) -> None:
        self.errors += 1
        self.rewards, self.reward_columns = [0.0], [max(length - 1, 0)]
        self.ended = True
        self.error_ids = self.encode_observation(f"environment error: {message}")
        return None

    def tail(self, length: int) -> list[int]:
        """The error observation's ids that fit after ``length`` columns ([] if none)."""
        return self.error_ids[: max(0, self.width - length)]

    @property
    def reward(self) -> float:
        return float(sum(self.rewards))

    def turn_rewards(self) -> np.ndarray:
        """``[width]`` float32: each reward at the column of the last model token of the turn
        it answered (0 elsewhere); sums to :attr:`reward`."""
        out = np.zeros(self.width, np.float32)
        np.add.at(out, np.asarray(self.reward_columns, np.int64), np.float32(self.rewards))
        return out

    def masks(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """``(model_mask, sequence_mask)`` [width] of the finished episode of ``length``
        sampled-or-forced columns: model tokens, and every real token (observations and an
        error tail included)."""
        seq = np.arange(self.width) < length + len(self.tail(length))
        model = np.arange(self.width) < length
        for a, b in self.observations:
            model[a:b] = False
        return model, seq


@dataclasses.dataclass(frozen=True)
class Episodes:
    """What the engine needs to run one batch of prompts' episodes.

    Attributes:
      make_env: ``record -> Environment`` (:func:`resolve_environment`).
      records: each prompt's dataset record, in the prompt batch's order.
      cfg: the per-episode limits.
      encode_observation: observation text -> ids (:func:`observation_ids`).
      decode: ids -> text (the turn's text for the environment).
    """

    make_env: EnvFactory
    records: Sequence[dict[str, Any]]
    cfg: EpisodeConfig
    encode_observation: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]

    def start(self, prompt: int, width: int) -> Episode:
        """A new episode of prompt ``prompt`` in ``width`` columns (an environment whose
        constructor raises gives an episode that ends after its first turn with an error)."""
        env, error = None, None
        try:
            env = self.make_env(dict(self.records[prompt]))
        except Exception as e:  # noqa: BLE001  the environment's code
            error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
        return Episode(env, width, self.cfg, self.encode_observation, self.decode, error)


def run_episode(
    episode: Episode, prompt_ids: Sequence[int], policy_fn: Callable[[list[int], int], list[int]]
) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Runs one episode with ``policy_fn(history_ids, budget) -> turn ids`` (at most
    ``budget`` ids; a host policy, e.g. scripted) synchronously: the protocol without the
    engine. Returns the response ids and the model and sequence masks [width]."""
    row: list[int] = []
    while True:
        room = episode.budget() - len(row)
        turn_ids = list(policy_fn(list(prompt_ids) + row, room))[:room]
        row += turn_ids
        turn = episode.end_turn(row, len(row), stopped=len(turn_ids) < room)
        try:
            result = episode.step(turn)
        except Exception as e:  # noqa: BLE001  the environment's code
            result = e
        ids = episode.apply(result)
        if ids is None:
            break
        row += ids
    length = len(row)
    model, seq = episode.masks(length)
    return row + episode.tail(length), model, seq


def wait_for(future: Future, deadline: float) -> Step | BaseException | None:
    """The future's result or exception if it is done, a TimeoutError past ``deadline``,
    else None (still running)."""
    if future.done():
        e = future.exception()
        return e if e is not None else future.result()
    if time.monotonic() > deadline:
        return TimeoutError("environment step timed out")
    return None
