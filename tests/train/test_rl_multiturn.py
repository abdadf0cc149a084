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
