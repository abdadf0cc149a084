"""Built-in tasks: graded rewards, correct SFT answers, preference pairs ordered by reward,
and the built-in tokenizer (which must load in transformers after export)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrlhf.data import BUILTIN_TASKS, CharTokenizer, builtin_records, make_problem
from jaxrlhf.rewards import add_reward, sort_answer, sort_reward, task_rewards


def test_sort_reward_is_graded():
    p = "sort 31415:"
    assert sort_answer(p) == "11345"
    assert sort_reward(p, "11345") == 1.0
    assert sort_reward(p, " 11345\n") == 1.0  # surrounding whitespace is ignored
    # One swap keeps the multiset (0.3) and 3 of 5 positions: 0.7 * 3/5 + 0.3.
    assert sort_reward(p, "11435") == pytest.approx(0.7 * 3 / 5 + 0.3)
    # Right digits in the wrong order still beat wrong digits.
    assert sort_reward(p, "54311") > sort_reward(p, "99999") == 0.0
    assert 0.0 < sort_reward(p, "1134") < 1.0  # a dropped digit: partial credit
    assert sort_reward(p, "") == 0.0


def test_add_reward_is_graded():
    p = "add 23+58="
    assert add_reward(p, "81") == 1.0
    assert add_reward(p, "71") == 0.5  # ones digit right
    assert add_reward(p, "181") == pytest.approx(2 / 3)
    assert add_reward(p, "8a") == 0.0


def test_task_rewards_batch():
    np.testing.assert_allclose(
        task_rewards("sort", ["sort 21:", "sort 21:"], ["12", "21"]), [1.0, 0.3], atol=1e-6
    )
    with pytest.raises(ValueError, match="unknown built-in task"):
        task_rewards("chess", [], [])


@pytest.mark.parametrize("task", BUILTIN_TASKS)
def test_records(task):
    rng = np.random.default_rng(0)
    prompt, answer = make_problem(task, rng)
    assert task_rewards(task, [prompt], [answer])[0] == 1.0
    sft = builtin_records(task, "sft", 50, seed=0)
    # calc: a tool-use response's final answer follows the tool's response
    for r in sft:
        final = r["response"].rsplit("</tool_response>", 1)[-1]
        assert task_rewards(task, [r["prompt"]], [final])[0] == 1.0
    assert sft == builtin_records(task, "sft", 50, seed=0)  # deterministic
    prefs = builtin_records(task, "preference", 200, seed=0)
    rewards = np.array(
        [task_rewards(task, [r["prompt"]] * 2, [r["chosen"], r["rejected"]]) for r in prefs]
    )
    assert (rewards[:, 0] > rewards[:, 1]).all()
    # A mix of easy and subtle pairs: some chosen answers are wrong, some rejected are close.
    assert 0.2 < (rewards[:, 0] < 1.0).mean() < 0.8
    assert (rewards[:, 1] > 0.5).mean() > 0.1
    held_out = {r["prompt"] for r in builtin_records(task, "prompt", 30, seed=1)}
    train = builtin_records(task, "sft", 100, seed=0, exclude_prompts=held_out)
    assert not held_out & {r["prompt"] for r in train}


def test_char_tokenizer_round_trip_and_hf_export(tmp_path):
    tok = CharTokenizer()
    text = "sort 31415:\n11345 ~"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert max(ids) < tok.vocab_size <= 128  # fits ModelConfig.tiny
    assert tok.encode("é") == [tok.unk_id]
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text
    tok.save_pretrained(str(tmp_path))
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert hf(text, add_special_tokens=False)["input_ids"] == ids
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 0)
