"""jaxrlhf.rewards: calling reward functions with the data's columns, and their errors."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrlhf.rewards import (
    RewardError,
    builtin_reward_fn,
    call_reward_fn,
    overlong_penalty,
    shape_scores,
)
from jaxrlhf.rewards.functions import accepts

PROMPTS, COMPLETIONS = ["sort 21:", "sort 312:"], ["12", "213"]
COLUMNS = {"answer": ["12", "123"], "source": ["a", None]}
IDS = [[5, 6], [7]]


def test_a_function_receives_only_what_its_signature_takes():
    seen = {}

    def plain(prompts, completions):
        seen["plain"] = (prompts, completions)
        return [1.0, 2.0]

    def wants_answer(prompts, completions, *, answer):
        seen["answer"] = answer
        return [0.0, 0.0]

    def wants_all(prompts, completions, **kwargs):
        seen["all"] = kwargs
        return [0.0, 0.0]

    kwargs = dict(prompt_ids=IDS, completion_ids=IDS, columns=COLUMNS)
    np.testing.assert_array_equal(call_reward_fn(plain, PROMPTS, COMPLETIONS, **kwargs), [1, 2])
    assert seen["plain"] == (PROMPTS, COMPLETIONS)
    call_reward_fn(wants_answer, PROMPTS, COMPLETIONS, **kwargs)
    assert seen["answer"] == ["12", "123"]
    call_reward_fn(wants_all, PROMPTS, COMPLETIONS, **kwargs)
    assert seen["all"] == {**COLUMNS, "prompt_ids": IDS, "completion_ids": IDS}
    assert accepts(wants_answer, "answer") and not accepts(wants_answer, "source")
    assert not accepts(len, "answer")  # no signature to read


def test_the_builtin_reward_reads_the_answer_column():
    """Graded against the record's answer (not the prompt): "12" for "sort 21:" scores 1.0;
    against a wrong answer "99", no digit matches: 0.7 * 0/2 + 0.3 * 0/2 = 0."""
    fn = builtin_reward_fn("sort")
    got = call_reward_fn(fn, PROMPTS[:1] * 2, ["12", "12"], columns={"answer": ["12", "99"]})
    np.testing.assert_allclose(got, [1.0, 0.0])
    # Without the column (a hand-made prompt set), the answer comes from the prompt.
    np.testing.assert_allclose(call_reward_fn(fn, PROMPTS, COMPLETIONS), [1.0, 0.7 / 3 + 0.3])


def failing(prompts, completions):
    return {"not": "numbers"}[prompts[0]]


def test_errors_name_the_function_in_one_line():
    with pytest.raises(RewardError) as e:
        call_reward_fn(failing, PROMPTS, COMPLETIONS)
    message = str(e.value)
    assert message.startswith(f"reward function {__name__}.failing raised KeyError: 'sort 21:'")
    assert f"{__file__}:" in message and "\n" not in message

    def strings(prompts, completions):
        return ["a", "b"]

    with pytest.raises(RewardError, match=r"strings returned \['a', 'b'\], expected 2 numbers"):
        call_reward_fn(strings, PROMPTS, COMPLETIONS)
    with pytest.raises(RewardError, match=r"returned shape \(3,\), expected \(2,\)"):
        call_reward_fn(lambda p, c: [1, 2, 3], PROMPTS, COMPLETIONS)
    with pytest.raises(RewardError, match=r"non-finite score \(inf\) for row 1"):
        call_reward_fn(lambda p, c: [0.0, np.inf], PROMPTS, COMPLETIONS)
    with pytest.raises(RewardError, match="a column 'completions', a name reserved"):
        call_reward_fn(lambda p, c: [0, 0], PROMPTS, COMPLETIONS, columns={"completions": [1, 2]})


def test_shaping_by_hand():
    # Whitening [1, 3]: mean 2, std 1 -> [-1, 1] (eps 1e-6), then clipped to [-0.5, 0.5].
    np.testing.assert_allclose(
        shape_scores(np.array([1.0, 3.0]), normalize=True, clip=0.5), [-0.5, 0.5], atol=1e-6
    )
    # Budget 10, buffer 4: length 8 pays 2/4 of the penalty; a response cut at the budget pays
    # all of it.
    got = overlong_penalty(np.array([5, 8, 10]), np.array([1, 1, 0], bool), 10, 4, 0.5)
    np.testing.assert_allclose(got, [0.0, 0.25, 0.5])
