"""A GRPO iteration with multi-turn episodes: observation tokens are in the sequence, out of
the loss mask, with behaviour log-probs 0; the episodes' rewards are the scores."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrlhf.config import ConfigError
from jaxrlhf.data.tokenizer import CharTokenizer
from jaxrlhf.generation.environment import Step
from jaxrlhf.train.rl_trainer import build_rl_trainer
from tests.train.test_rl import _config, _one_device_mesh

OBS = "<tool_response>ok</tool_response>"


def observe_once(record, turns):
    """Turn 0: an observation; turn 1: the end, rewarded with the prompt's length parity."""
    if len(turns) == 1:
        return Step(observation="ok", info={"calls": 1.0})
    return Step(reward=float(len(record["prompt"]) % 2) + 0.1 * len(turns[-1].token_ids))


def _trainer(tmp_path, *overrides):
    cfg, src = _config(
        tmp_path,
        "grpo",
        "grpo.rollout.engine=continuous",
        "grpo.rollout.environment=tests.train.test_rl_multiturn.observe_once",
        "grpo.rollout.max_new_tokens=48",
        "grpo.rollout.turn_tokens=4",
        "grpo.reward.function=environment",
        "data.max_length=64",
        *overrides,
    )
    return build_rl_trainer(cfg, mesh=_one_device_mesh(), source=src)


@pytest.mark.slow
def test_episode_rollout_masks_observations_out_of_the_loss(tmp_path):
    trainer = _trainer(tmp_path)
    rollout, timings = trainer.rollout(jax.random.key(0))
    tok = CharTokenizer()
    obs_cols = rollout.mask & ~rollout.response_mask
    obs_cols[:, : rollout.tokens.shape[1] - 48] = False  # the prompt
    for row in range(rollout.rows):  # turn (<= 4 tokens), observation, turn (<= 4 tokens)
        assert tok.decode(rollout.tokens[row][obs_cols[row]]) == OBS
        assert 2 <= rollout.response_mask[row].sum() <= 8
    assert obs_cols.sum() == rollout.rows * len(OBS)
    np.testing.assert_array_equal(rollout.sampler_logprobs[obs_cols], 0.0)
    assert (rollout.sampler_logprobs[rollout.response_mask] < 0).all()
    assert timings["env/tool_use_rate"] == 1.0 and timings["env/calls_mean"] == 1.0
    assert timings["env/turns_mean"] == 2.0
    metrics = trainer.step().metrics
    assert np.isfinite(metrics["loss/policy"])


def test_an_environment_that_does_not_import_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="grpo.rollout.environment: cannot import"):
        _trainer(tmp_path, "grpo.rollout.environment=tests.nope.Env")


def test_a_run_names_where_the_environment_was_set(tmp_path):
    """``python -m jaxrlhf.train`` (``loop.run``) blames the command line for a value set
    there, not the YAML file."""
    from jaxrlhf.config import override_paths
    from jaxrlhf.train import loop

    overrides = [
        "grpo.rollout.engine=continuous",
        "grpo.rollout.environment=tests.nope.Env",
        "grpo.reward.function=environment",
    ]
    cfg, src = _config(tmp_path, "grpo", *overrides)
    with pytest.raises(ConfigError, match="^command line: grpo.rollout.environment: cannot"):
        loop.run(cfg, source=src, override_paths=override_paths(overrides))


# ---- per-turn rewards (PPO) ----------------------------------------------------------------


def test_ppo_token_rewards_pay_each_turn_where_it_ended():
    """Hand case, KL in the reward (beta 0.5): row 0's turns end at columns 2 and 5 with
    rewards 0.3 and (the rest of its score 1.0) 0.7; row 1 has no per-turn part, so its
    rewards are exactly those without ``turn_rewards``."""
    from jaxrlhf.train.rl_config import PolicyLossConfig
    from jaxrlhf.train.rl_steps import ppo_token_rewards

    resp = np.zeros((2, 8), bool)
    resp[0, [1, 2, 5]] = True  # model tokens; 3-4 an observation
    resp[1, 1:5] = True
    old = np.zeros((2, 8), np.float32)
    ref = np.full((2, 8), -0.2, np.float32)  # kl_t = old - ref = 0.2 on response tokens
    turn = np.zeros((2, 8), np.float32)
    turn[0, 2] = 0.3
    scores = np.float32([1.0, -2.0])
    cfg = PolicyLossConfig(kl_mode="reward")
    got, _ = ppo_token_rewards(scores, old, ref, resp, 0.5, loss_cfg=cfg, turn_rewards=turn)
    want = np.where(resp, -0.5 * 0.2, 0.0).astype(np.float32)
    want[0, 2] += 0.3
    want[0, 5] += 0.7
    want[1, 4] += -2.0
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    plain, _ = ppo_token_rewards(scores, old, ref, resp, 0.5, loss_cfg=cfg)
    np.testing.assert_allclose(got[1], plain[1], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got.sum(-1), plain.sum(-1), rtol=1e-6, atol=1e-6)


def reward_each_turn(record, turns):
    """0.5 for the first turn (with an observation), then 1.0 and the end."""
    if len(turns) == 1:
        return Step(observation="ok", reward=0.5)
    return Step(reward=1.0)


def _ppo_trainer(tmp_path, *overrides):
    """PPO over :func:`reward_each_turn`'s two-turn episodes, rewarded by the environment."""
    cfg, src = _config(
        tmp_path,
        "ppo",
        "ppo.rollout.engine=continuous",
        "ppo.rollout.environment=tests.train.test_rl_multiturn.reward_each_turn",
        "ppo.rollout.max_new_tokens=48",
        "ppo.rollout.turn_tokens=4",
        "ppo.reward.function=environment",
        "data.max_length=64",
        *overrides,
    )
    return cfg, build_rl_trainer(cfg, mesh=_one_device_mesh(), source=src)


def _at_turn_ends(response_mask, first, last):
    """``[N, T]``: ``first`` on each row's first turn's last model token (the one before
    the observation) and ``last`` on its last model token."""
    out = np.zeros(response_mask.shape, np.float32)
    for row, resp in enumerate(response_mask):
        cols = np.flatnonzero(resp)
        out[row, cols[np.flatnonzero(np.diff(cols) > 1)[0]]] = first
        out[row, cols[-1]] = last
    return out


@pytest.mark.slow
def test_ppo_episode_rewards_reach_the_critic_at_their_turns(tmp_path):
    """A PPO iteration over two-turn episodes: the rollout carries 0.5 at the first turn's
    last model token and 1.0 at the last one, its scores 1.5; the update's per-token
    rewards (KL off) are the same, nothing elsewhere."""
    cfg, trainer = _ppo_trainer(tmp_path, "ppo.loss.kl_coef=0.0")
    rollout, _ = trainer.rollout(jax.random.key(0))
    np.testing.assert_allclose(rollout.scores, 1.5)
    want = _at_turn_ends(rollout.response_mask, 0.5, 1.0)
    np.testing.assert_array_equal(rollout.turn_rewards, want)
    trainer.learn(rollout, jax.random.key(1))
    rewards = trainer.last_scored.token_rewards
    assert rewards is not None  # the critic's update runs GAE on these (reuse_value_forward)
    np.testing.assert_allclose(jax.device_get(rewards), want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_normalised_ppo_rewards_are_paid_on_the_last_token(tmp_path):
    """reward.normalize scales the batch's totals only: the rollout then carries no per-turn
    parts (a per-turn part scaled by 1/std of nearly equal totals would dwarf them)."""
    cfg, trainer = _ppo_trainer(tmp_path, "ppo.reward.normalize=true")
    rollout, _ = trainer.rollout(jax.random.key(0))
    assert rollout.turn_rewards is None
    np.testing.assert_allclose(rollout.scores, 1.5)
    metrics = trainer.learn(rollout, jax.random.key(1))
    assert np.isfinite(metrics["loss/policy"])


@pytest.mark.slow
def test_ppo_gae_in_scoring_uses_the_per_turn_rewards(tmp_path):
    """With two epochs the critic's values are scored up front and GAE runs in scoring: its
    returns equal ``losses.gae_advantages`` of the per-turn token rewards (0.5 and 1.0 at
    the two turns' last tokens, KL off) and the scored values, to 1e-6."""
    from jaxrlhf import losses

    cfg, trainer = _ppo_trainer(tmp_path, "ppo.loss.kl_coef=0.0", "ppo.loss.epochs=2")
    rollout, _ = trainer.rollout(jax.random.key(0))
    trainer.learn(rollout, jax.random.key(1))
    scored = jax.device_get(trainer.last_scored)
    assert scored.token_rewards is None  # GAE ran in scoring
    resp = rollout.response_mask
    _, want = losses.gae_advantages(
        rollout.turn_rewards, scored.old_values, resp, gamma=cfg.ppo.gamma, lam=cfg.ppo.lam
    )
    np.testing.assert_allclose(scored.returns, want, rtol=1e-6, atol=1e-6)
    last = np.zeros(resp.shape, np.float32)  # the whole score on the last model token
    last[np.arange(rollout.rows), resp.shape[1] - 1 - np.argmax(resp[:, ::-1], axis=1)] = 1.0
    _, plain = losses.gae_advantages(
        last * rollout.scores[:, None],
        scored.old_values,
        resp,
        gamma=cfg.ppo.gamma,
        lam=cfg.ppo.lam,
    )
    assert np.abs(np.asarray(plain) - np.asarray(want)).max() > 0.05  # placement matters
