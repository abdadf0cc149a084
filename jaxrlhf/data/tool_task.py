"""The built-in tool task ``builtin:calc``: add two 6-digit numbers, which a tiny model
cannot do reliably in its head but can with a ``calculator`` tool.

A prompt ``"calc 481239+771203="`` has the answer ``"1252442"``. The SFT records show the
tool on a substantial minority of the examples (:data:`TOOL_SFT_FRACTION`)::

    <calc>481239+771203</calc><tool_response>1252442</tool_response>1252442

(one line, no newlines: the observation is what :class:`CalculatorEnv` answers, as the
built-in character tokenizer frames it), and the bare answer on the rest. GRPO with
``rollout.environment: jaxrlhf.data.tool_task.CalculatorEnv`` and ``reward.function:
environment`` then rewards the final answer (``tasks.grade_add``), and the policy learns to
call the tool (configs/tool_grpo.yaml).

The call is the task's short syntax ``<calc>EXPR</calc>`` (20 characters for two 6-digit
numbers) rather than the Qwen JSON ``<tool_call>{"name":"calculator","arguments":
{"expression":"EXPR"}}</tool_call>`` (77): with one character per token, a tiny model learns
the short call from a few hundred SFT examples and samples it, which GRPO needs. The
environment reads both (``ToolEnv.parse_calls``), so a real chat model's Qwen or Llama 3
calls work against it too.
"""

from __future__ import annotations

import re

from jaxrlhf.data.tasks import TOOL_SFT_FRACTION, grade_add, tool_use_response
from jaxrlhf.generation.environment import NO_TEMPLATE_OBSERVATION
from jaxrlhf.generation.tools import ToolCall, ToolEnv, parse_tool_calls

__all__ = [
    "NO_TEMPLATE_OBSERVATION",
    "TOOL_SFT_FRACTION",
    "CalculatorEnv",
    "calculator",
    "parse_calc_calls",
    "tool_call",
    "tool_use_response",
]
STOP = "</calc>"  # ends the model's tool-call turn (rollout.stop_strings)
_SHORT = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_EXPR = re.compile(r"^\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*$")


def calculator(expression: str) -> str:
    """``a+b``, ``a-b`` or ``a*b`` of integers, exactly.

    Raises:
      ValueError: anything else.
    """
    m = _EXPR.match(str(expression))
    if m is None:
        raise ValueError(f"cannot evaluate {expression!r}; use a+b, a-b or a*b")
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def tool_call(expression: str) -> str:
    """The model's call of the calculator in the task's short syntax."""
    return f"<calc>{expression}{STOP}"


def parse_calc_calls(text: str) -> list[ToolCall]:
    """The calls in a turn: short ``<calc>EXPR</calc>`` blocks, else the Qwen / Llama 3 JSON
    calls of :func:`jaxrlhf.generation.tools.parse_tool_calls`."""
    blocks = _SHORT.findall(text)
    if blocks:
        return [ToolCall("calculator", {"expression": b.strip()}) for b in blocks]
    if "<calc>" in text:  # opened and never closed (cut by the budget)
        return [ToolCall(None, {}, f"the call is not closed with {STOP}")]
    return parse_tool_calls(text)


class CalculatorEnv(ToolEnv):
    """The ``calc`` task's environment: a ``calculator`` tool called as ``<calc>EXPR</calc>``
    (or Qwen / Llama 3 JSON); the final answer graded against the record's ``answer``
    (``tasks.grade_add``, partial credit per digit). Its observations are
    ``NO_TEMPLATE_OBSERVATION``-framed results, as ``tool_use_response`` shows."""

    tools = {"calculator": calculator}
    timeout_s = 2.0

    def parse_calls(self, text: str) -> list[ToolCall]:
        return parse_calc_calls(text)

    def score(self, answer: str) -> float:
        return grade_add(str(self.record["answer"]), answer)
