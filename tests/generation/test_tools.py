"""The tool environment: Qwen and Llama 3 tool calls parsed; tools that raise, hang or
return junk give error observations."""

from __future__ import annotations

import time

import pytest

from jaxrlhf.generation.environment import Turn
from jaxrlhf.generation.tools import ToolCall, ToolEnv, parse_tool_calls


def _turn(text, index=0, last=False):
    return Turn(text, (), index, True, last)


def test_parse_qwen_and_llama3_calls():
    qwen = (
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": '
        '"2+3"}}\n</tool_call><tool_call>{"name": "echo", "arguments": "{\\"x\\": 1}"}'
        "</tool_call>"
    )
    assert parse_tool_calls(qwen) == [
        ToolCall("calculator", {"expression": "2+3"}),
        ToolCall("echo", {"x": 1}),
    ]
    llama = '<|python_tag|>{"name": "calculator", "parameters": {"expression": "7*6"}}'
    assert parse_tool_calls(llama) == [ToolCall("calculator", {"expression": "7*6"})]
    assert parse_tool_calls("The answer is 42.") == []
    bad = parse_tool_calls("<tool_call>{name: calculator}</tool_call>")
    assert bad[0].error.startswith("the tool call is not valid JSON")
    assert parse_tool_calls('<tool_call>{"name": "x"')[0].error.endswith("</tool_call>")
    assert parse_tool_calls("<tool_call>[1, 2]</tool_call>")[0].error.startswith("a tool call")


def _hang():
    time.sleep(10)


class Env(ToolEnv):
    tools = {
        "add": lambda a, b: a + b,
        "boom": lambda: 1 / 0,
        "hang": _hang,
        "junk": lambda: object(),
        "nan": lambda: float("nan"),
        "long": lambda: "x" * 1000,
    }
    timeout_s = 0.2
    max_result_chars = 10

    def score(self, answer):
        return float(answer.strip() == self.record["answer"])


def _call(name, **args):
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


@pytest.mark.parametrize(
    "text, observation",
    [
        (_call("add", a=2, b=3), "5"),
        (_call("add", a=2, b=3) + _call("add", a=1, b=1), "5\n2"),
        (_call("boom"), "error: boom raised ZeroDivisionError: division by zero"),
        (_call("hang"), "error: hang timed out after 0.2 s"),
        (_call("junk"), "error: the tool returned a object, not JSON data"),
        (_call("nan"), "error: the tool returned nan"),
        (_call("long"), "x" * 10),
        (_call("nope"), "error: unknown tool 'nope'; tools: add, boom, hang, junk, long, nan"),
        (
            _call("add", a=1),
            "error: add raised TypeError: Env.<lambda>() missing 1 required positional "
            "argument: 'b'",
        ),
        (
            "<tool_call>{oops}</tool_call>",
            "error: the tool call is not valid JSON "
            "(Expecting property name enclosed in double quotes)",
        ),
    ],
)
def test_tool_results_and_errors_are_observations(text, observation):
    env = Env({"answer": "5"})
    start = time.monotonic()
    step = env.step(_turn(text))
    assert time.monotonic() - start < 2
    assert step.observation == observation
    assert step.reward == 0.0
    assert step.info["tool_calls"] == text.count("<tool_call>")
    assert step.info["tool_errors"] == observation.count("error: ")


def test_a_turn_without_a_call_ends_with_the_score():
    env = Env({"answer": "5"})
    assert env.step(_turn(" 5")).observation is None
    assert env.step(_turn(" 5")).reward == 1.0
    assert env.step(_turn("6")).reward == 0.0
    last = env.step(_turn(_call("add", a=2, b=3), last=True))
    assert last.observation is None and last.reward == 0.0
