"""The built-in tool environment: parses the model's tool calls, runs registered Python
tools with a timeout, and answers with their results as the observation.

Tool calls are read in the two JSON styles of the common chat templates:

* Qwen (Hermes): ``<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}
  </tool_call>``, one block per call, anywhere in the turn;
* Llama 3: the whole turn is one JSON object ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``).

A turn with no call is the final answer: the episode ends with :meth:`ToolEnv.score` of its
text. Each call's result is one line of the observation (several calls: several lines, in
order). A tool that raises, runs past ``timeout_s``, returns something that is not a
string, number, bool, list or dict (JSON), or is called with bad JSON, an unknown name or
wrong arguments gives the line ``error: ...`` instead; the episode goes on and the run never
stops for it. Subclass :class:`ToolEnv` with ``tools`` and ``score`` (``jaxrlhf.data.
tool_task.CalculatorEnv`` is one) and name it in ``rollout.environment``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from typing import Any, ClassVar

from jaxrlhf.generation.environment import Step, Turn, call_in_thread

_QWEN = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A parsed call (``error`` set when the call could not be read)."""

    name: str | None
    arguments: dict[str, Any]
    error: str | None = None


def _read_call(text: str, args_key: str | None = None) -> ToolCall:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return ToolCall(None, {}, f"the tool call is not valid JSON ({e.msg})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, {}, 'a tool call is a JSON object with a "name"')
    keys = (args_key,) if args_key else ("arguments", "parameters")
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):  # some templates put the arguments in as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return ToolCall(obj["name"], {}, "the tool call's arguments are not a JSON object")
    return ToolCall(obj["name"], args)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls in a model turn (module docstring): Qwen ``<tool_call>`` blocks, or a
    Llama 3 turn that is one JSON object with a ``name``; [] for a turn without a call."""
    blocks = _QWEN.findall(text)
    if blocks:
        return [_read_call(b.strip()) for b in blocks]
    if "<tool_call>" in text:  # opened and never closed (cut by the budget)
        return [ToolCall(None, {}, "the tool call is not closed with </tool_call>")]
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :].strip()
    if body.startswith("{") and '"name"' in body:
        return [_read_call(body)]
    return []


def _json_result(value: Any) -> str:
    """A tool's result as observation text, or ValueError for junk (not JSON data, or a
    non-finite number)."""
    if isinstance(value, str):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"the tool returned {value}")
    if isinstance(value, bool | int | float | list | dict) or value is None:
        try:
            return json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"the tool returned data that is not JSON ({e})") from None
    raise ValueError(f"the tool returned a {type(value).__name__}, not JSON data")


class ToolEnv:
    """An environment whose observations are tool results (module docstring).

    Class attributes (override in a subclass):
      tools: name -> Python callable, called with the call's arguments as keywords.
      timeout_s: a tool running longer gives an error line (its thread is abandoned).
      max_result_chars: longer results are cut to this many characters.
    """

    tools: ClassVar[dict[str, Callable[..., Any]]] = {}
    timeout_s: ClassVar[float] = 5.0
    max_result_chars: ClassVar[int] = 200

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record
        self.calls = 0

    def score(self, answer: str) -> float:
        """The episode's reward for the final answer text (a turn without a tool call)."""
        return 0.0

    def run_tool(self, call: ToolCall) -> str:
        """One call's observation line (``error: ...`` for every failure)."""
        if call.error is not None:
            return f"error: {call.error}"
        fn = self.tools.get(call.name)
        if fn is None:
            return f"error: unknown tool {call.name!r}; tools: {', '.join(sorted(self.tools))}"
        future = call_in_thread(lambda: fn(**call.arguments))
        try:
            value = future.result(timeout=self.timeout_s)
        except TimeoutError:
            return f"error: {call.name} timed out after {self.timeout_s:g} s"
        except Exception as e:  # noqa: BLE001  the tool's code: the model reads what went wrong
            first = (str(e).strip().splitlines() or [""])[0]
            return f"error: {call.name} raised {type(e).__name__}: {first}"
        try:
            return _json_result(value)[: self.max_result_chars]
        except ValueError as e:
            return f"error: {e}"

    def parse_calls(self, text: str) -> list[ToolCall]:
        """The calls in a model turn: :func:`parse_tool_calls` (a subclass may add a syntax)."""
        return parse_tool_calls(text)

    def step(self, turn: Turn) -> Step:
        calls = self.parse_calls(turn.text)
        if not calls:
            return Step(reward=float(self.score(turn.text)), info={"tool_calls": 0.0})
        self.calls += len(calls)
        lines = [self.run_tool(c) for c in calls]
        errors = sum(line.startswith("error: ") for line in lines)
        info = {"tool_calls": float(len(calls)), "tool_errors": float(errors)}
        if turn.last:  # no turn left to answer in
            return Step(reward=0.0, info=info)
        return Step(observation="\n".join(lines), info=info)
