"""The environment protocol on the host: a scripted environment and a scripted policy give
the exact token sequence and masks; observation tokens carry zero loss weight."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import losses
from jaxrlhf.data.tokenizer import CharTokenizer
from jaxrlhf.generation.environment import (
    EnvError,
    Episode,
    EpisodeConfig,
    Step,
    Turn,
    observation_ids,
    resolve_environment,
    run_episode,
)

TOK = CharTokenizer()


class Scripted:
    """Answers turn 0 with ``"7"``, turn 1 with ``"42"``, then ends with reward 1."""

    def __init__(self, record):
        self.record, self.seen = record, []

    def step(self, turn: Turn) -> Step:
        self.seen.append(turn)
        if turn.index == 0:
            return Step(observation="7", reward=0.25, info={"calls": 1})
        if turn.index == 1:
            return Step(observation="42", info={"calls": 1})
        return Step(reward=1.0)


def scripted_policy(turns):
    """A policy that writes ``turns[k]`` as its k-th turn, whatever it has seen."""
    state = {"k": 0}

    def policy(history, budget):
        ids = TOK.encode(turns[state["k"]])
        state["k"] += 1
        return ids

    return policy


def _episode(env, width=64, **cfg):
    return Episode(env, width, EpisodeConfig(**cfg), lambda t: observation_ids(TOK, t), TOK.decode)


def test_scripted_episode_gives_the_exact_tokens_and_masks():
    env = Scripted({"answer": "x"})
    ep = _episode(env, width=80)
    row, model, seq = run_episode(ep, TOK.encode("q:"), scripted_policy(["ab", "cd", "e"]))
    obs7, obs42 = "<tool_response>7</tool_response>", "<tool_response>42</tool_response>"
    expected = "ab" + obs7 + "cd" + obs42 + "e"
    assert TOK.decode(row) == expected
    n = len(expected)
    want_model = np.zeros(80, bool)
    want_model[0:2] = True  # "ab"
    want_model[2 + len(obs7) : 4 + len(obs7)] = True  # "cd"
    want_model[n - 1] = True  # "e"
    np.testing.assert_array_equal(model, want_model)
    np.testing.assert_array_equal(seq, np.arange(80) < n)
    assert ep.reward == 1.25 and ep.turns == 3 and ep.info == {"calls": 2.0}
    assert [t.text for t in env.seen] == ["ab", "cd", "e"]
    assert [t.index for t in env.seen] == [0, 1, 2] and not any(t.last for t in env.seen)


def test_turn_and_episode_budgets():
    # turn_tokens=3 cuts "abcdef" to "abc"; max_turns=2 marks the second turn last, so its
    # observation is dropped and the episode ends.
    env = Scripted({})
    ep = _episode(env, width=64, turn_tokens=3, max_turns=2)
    row, model, _ = run_episode(ep, [], scripted_policy(["abcdef", "ghijk", "z"]))
    assert TOK.decode(row) == "abc<tool_response>7</tool_response>ghi"
    assert [t.stopped for t in env.seen] == [False, False]
    assert [t.last for t in env.seen] == [False, True]
    assert model.sum() == 6 and ep.reward == 0.25
    # An observation that leaves no room for a model token ends the episode (truncated).
    ep = _episode(Scripted({}), width=20)
    row, model, seq = run_episode(ep, [], scripted_policy(["ab", "cd"]))
    assert TOK.decode(row) == "ab" and seq.sum() == 2 and ep.turns == 1


class Raises:
    def __init__(self, record):
        pass

    def step(self, turn):
        raise RuntimeError("boom\nsecond line")


def test_an_environment_that_raises_ends_with_an_error_observation():
    ep = _episode(Raises({}), width=80)
    row, model, seq = run_episode(ep, [], scripted_policy(["ab"]))
    tail = "<tool_response>environment error: RuntimeError: boom</tool_response>"
    assert TOK.decode(row) == "ab" + tail
    assert model.sum() == 2 and seq.sum() == 2 + len(tail)
    assert ep.reward == 0.0 and ep.errors == 1 and ep.ended
    ep = _episode(Raises({}), width=80)
    ep.end_turn(TOK.encode("ab"), 2, True)
    assert ep.apply("not a step") is None and ep.errors == 1


def echo_env(record, turns):
    """A function environment: echoes the turn back twice, then ends with its length."""
    if len(turns) < 3:
        return Step(observation=turns[-1].text.upper())
    return Step(reward=float(sum(len(t.token_ids) for t in turns)))


def test_function_environments_by_dotted_path():
    factory = resolve_environment("tests.generation.test_environment.echo_env")
    ep = _episode(factory({}), width=96)
    row, _, _ = run_episode(ep, [], scripted_policy(["ab", "c", "d"]))
    want = "ab<tool_response>AB</tool_response>c<tool_response>C</tool_response>d"
    assert TOK.decode(row) == want
    assert ep.reward == 4.0
    assert resolve_environment("tests.generation.test_environment.Scripted") is Scripted
    with pytest.raises(EnvError, match="rollout.environment: cannot import"):
        resolve_environment("tests.nope.Env")
    with pytest.raises(EnvError, match="not a dotted path"):
        resolve_environment("Env")


def test_observation_tokens_get_zero_gradient_weight():
    """d(loss)/d(logprob_t) is 0 at observation tokens for the policy surrogate and the KL
    loss term, and the per-token KL penalty there is 0, while model tokens get gradient."""
    ep = _episode(Scripted({}), width=96)
    _, model, seq = run_episode(ep, [], scripted_policy(["ab", "cd", "e"]))
    mask = jnp.asarray(model)[None].repeat(2, 0)  # [2, T]
    key = jax.random.split(jax.random.key(0), 3)
    logp = -jax.random.uniform(key[0], mask.shape)
    old = logp  # ratio 1: no token is clipped, so every model token has gradient
    ref = logp + 0.1 * jax.random.normal(key[2], mask.shape)
    adv = jnp.asarray([[1.0], [-0.5]]) * jnp.ones(mask.shape)

    def loss(lp):
        pg, _ = losses.ppo_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
        kl, _ = losses.kl_loss(lp, ref, mask, estimator="k3")
        return pg + 0.1 * kl

    grad = np.asarray(jax.grad(loss)(logp))
    obs = np.asarray(~mask) & seq[None]
    assert obs.sum() == 2 * (32 + 33)  # the two observations of both rows
    np.testing.assert_array_equal(grad[obs], 0.0)
    assert (np.abs(grad[np.asarray(mask)]) > 0).all()
    kl = losses.kl_penalty(old, ref, mask, estimator="k1")
    np.testing.assert_array_equal(np.asarray(kl)[obs], 0.0)


def test_hanging_step_times_out():
    from jaxrlhf.generation.environment import call_in_thread, wait_for

    future = call_in_thread(time.sleep, 5)
    assert wait_for(future, time.monotonic() + 10) is None
    assert isinstance(wait_for(future, time.monotonic() - 1), TimeoutError)
    done = call_in_thread(lambda: Step(reward=2.0))
    done.result(timeout=5)
    assert wait_for(done, 0).reward == 2.0


# A Qwen2.5-like template: a default system prompt when the conversation has none, tool
# results as a user turn wrapped in <tool_response>, the assistant's generation prompt.
QWEN_LIKE_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|system|>You are helpful.<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|user|><tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|end|>"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Renders the last message differently, so a longer conversation does not extend a shorter one.
NOT_EXTENDING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if loop.last %}<|end|>{% endif %}{% endfor %}"
)


@pytest.mark.parametrize(
    "template, want",
    [
        (None, "<|tool|>42<|end|><|assistant|>"),  # the fixture's plain role markers
        (QWEN_LIKE_TEMPLATE, "<|user|><tool_response>\n42\n</tool_response><|end|><|assistant|>"),
    ],
    ids=["role_markers", "qwen_like_with_system_prompt"],
)
def test_observations_through_a_hugging_face_chat_template(tmp_path, template, want):
    """With a chat template, an observation is the template's tool message and the
    assistant's generation prompt, exactly, and nothing of the conversation before it (no
    default system prompt, no BOS); an episode appends those ids."""
    from jaxrlhf.config import TokenizerConfig
    from jaxrlhf.data.tokenizer import load_tokenizer
    from tests.data.fixtures import CHAT_TEMPLATE, make_chat_tokenizer

    path = make_chat_tokenizer(str(tmp_path), template or CHAT_TEMPLATE)
    tok = load_tokenizer(TokenizerConfig(path=path))
    assert tok.has_chat_template
    ids = observation_ids(tok, "42")
    assert ids == tok.encode(want)
    assert tok.decode(ids, skip_special_tokens=False) == want

    episode = Episode(
        Scripted({}), 64, EpisodeConfig(), lambda t: observation_ids(tok, t), tok.decode
    )
    turn = episode.end_turn(tok.encode("call"), 4, stopped=True)
    assert episode.apply(episode.step(turn)) == observation_ids(tok, "7")
    assert episode.observations == [(4, 4 + len(observation_ids(tok, "7")))]


def test_a_chat_template_that_does_not_extend_a_conversation_is_refused(tmp_path):
    from jaxrlhf.config import TokenizerConfig
    from jaxrlhf.data.tokenizer import load_tokenizer
    from tests.data.fixtures import make_chat_tokenizer

    tok = load_tokenizer(
        TokenizerConfig(path=make_chat_tokenizer(str(tmp_path), NOT_EXTENDING_TEMPLATE))
    )
    with pytest.raises(ValueError, match="does not extend a conversation"):
        observation_ids(tok, "42")


def test_per_turn_rewards_sit_at_the_last_model_token_of_their_turn():
    """Scripted: 0.25 answering turn 0 ("ab", columns 0-1), nothing for turn 1, 1.0 for the
    last turn ("e"); an environment failure replaces them with one 0 at the failed turn."""
    ep = _episode(Scripted({"answer": "x"}), width=80)
    row, model, _ = run_episode(ep, TOK.encode("q:"), scripted_policy(["ab", "cd", "e"]))
    want = np.zeros(80, np.float32)
    want[1] = 0.25
    want[len(row) - 1] = 1.0
    np.testing.assert_array_equal(ep.turn_rewards(), want)
    assert ep.turn_rewards().sum() == ep.reward
    turn_ends = [i for i in range(79) if model[i] and not model[i + 1]]
    assert set(np.flatnonzero(ep.turn_rewards())) <= set(turn_ends)

    class FailsSecond(Scripted):
        def step(self, turn):
            if turn.index == 1:
                raise RuntimeError("boom")
            return super().step(turn)

    ep = _episode(FailsSecond({}), width=80)
    run_episode(ep, TOK.encode("q:"), scripted_policy(["ab", "cd", "e"]))
    obs7 = "<tool_response>7</tool_response>"
    want = np.zeros(80, np.float32)  # 0 at "d", the failed turn's last token
    np.testing.assert_array_equal(ep.turn_rewards(), want)
    assert ep.reward_columns == [2 + len(obs7) + 1] and ep.reward == 0.0
