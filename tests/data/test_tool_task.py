"""The built-in tool task ``builtin:calc``: its short call syntax, its environment and its
SFT data as the quickstart config loads it."""

from __future__ import annotations

import pytest

from jaxrlhf.config import load_config
from jaxrlhf.data.dataset import load_datasets
from jaxrlhf.data.tokenizer import CharTokenizer
from jaxrlhf.data.tool_task import (
    STOP,
    TOOL_SFT_FRACTION,
    CalculatorEnv,
    parse_calc_calls,
    tool_call,
    tool_use_response,
)
from jaxrlhf.generation.environment import Turn
from jaxrlhf.generation.tools import ToolCall


def _turn(text: str, last: bool = False) -> Turn:
    ids = CharTokenizer().encode(text)
    return Turn(text=text, token_ids=ids, index=0, stopped=True, last=last)


def test_short_and_json_calls_are_read():
    assert tool_call("1+2") == "<calc>1+2</calc>" and tool_call("1+2").endswith(STOP)
    assert parse_calc_calls("<calc>12+30</calc>") == [
        ToolCall("calculator", {"expression": "12+30"})
    ]
    assert parse_calc_calls("<calc>12+3")[0].error.endswith(STOP)
    qwen = '<tool_call>{"name":"calculator","arguments":{"expression":"2*3"}}</tool_call>'
    assert parse_calc_calls(qwen) == [ToolCall("calculator", {"expression": "2*3"})]
    assert parse_calc_calls("1252442") == []


def test_calculator_env_answers_a_call_and_grades_the_answer():
    env = CalculatorEnv({"answer": "1252442"})
    step = env.step(_turn(tool_call("481239+771203")))
    assert step.observation == "1252442"
    assert env.step(_turn("<calc>one+two</calc>")).observation.startswith("error: calculator")
    final = env.step(_turn("1252442"))
    assert final.observation is None and final.reward == pytest.approx(1.0)
    response = tool_use_response(481239, 771203)
    assert response == "<calc>481239+771203</calc><tool_response>1252442</tool_response>1252442"


def test_quickstart_sft_keeps_the_tool_examples():
    """Every record fits ``data.max_length`` (an overlong one would be dropped, and the
    tool examples are the long ones)."""
    cfg = load_config("configs/quickstart/tool_sft.yaml", ["data.builtin_size=512"])
    train, _ = load_datasets("sft", cfg.data, CharTokenizer(), cfg.tokenizer)
    assert len(train) == 512
    tools = sum("<calc>" in r["response"] for r in train.records) / len(train)
    assert abs(tools - TOOL_SFT_FRACTION) < 0.08
