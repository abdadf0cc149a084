"""The built-in tool task ``builtin:calc``: add two 6-digit numbers, which a tiny model
cannot do reliably in its head but can with a ``calculator`` tool.

A prompt ``"calc 481239+771203="`` has the answer ``"1252442"``. The SFT records show the
tool on a quarter of the examples (:data:`TOOL_SFT_FRACTION`)::

    <tool_call>{"name":"calculator","arguments":{"expression":"481239+771203"}}</tool_call>
    <tool_response>1252442</tool_response>1252442

(one line, no newlines: the observation is what :class:`CalculatorEnv` answers, as the
built-in character tokenizer frames it), and the bare answer on the rest. GRPO with
``rollout.environment: jaxrlhf.data.tool_task.CalculatorEnv`` and ``reward.function:
environment`` then rewards the final answer (``tasks.grade_add``), and the policy learns to
call the tool (configs/tool_grpo.yaml).
"""

from __future__ import annotations

import json
import re

from jaxrlhf.data.tasks import TOOL_SFT_FRACTION, grade_add, tool_use_response
from jaxrlhf.generation.environment import NO_TEMPLATE_OBSERVATION
from jaxrlhf.generation.tools import ToolEnv

__all__ = [
    "NO_TEMPLATE_OBSERVATION",
    "TOOL_SFT_FRACTION",
    "CalculatorEnv",
    "calculator",
    "tool_call",
    "tool_use_response",
]
STOP = "</tool_call>"  # ends the model's tool-call turn (rollout.stop_strings)
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
    """The model's call of the calculator (compact Qwen-style JSON)."""
    body = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(body, separators=(',', ':'))}</tool_call>"


class CalculatorEnv(ToolEnv):
    # its observations are NO_TEMPLATE_OBSERVATION-framed results, as tool_use_response shows
    """The ``calc`` task's environment: a ``calculator`` tool; the final answer graded
    against the record's ``answer`` (``tasks.grade_add``, partial credit per digit)."""

    tools = {"calculator": calculator}
    timeout_s = 2.0

    def score(self, answer: str) -> float:
        return grade_add(str(self.record["answer"]), answer)
