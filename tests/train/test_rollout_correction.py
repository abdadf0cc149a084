"""``loss.rollout_correction`` in the RL update: the trainer's step equals a hand-written
decoupled-PPO gradient step on the same rollout (independent reference: NumPy log-probs and
an unjitted ``jax.grad`` of the weighted surrogate)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models import model as M
from jaxrlhf.train.rl_trainer import build_rl_trainer
from tests.train.test_rl import _adam_first_step, _config, _np_aligned_logprobs, _one_device_mesh


def _weighted_grads(cfg, params, rollout, old, behaviour, adv, *, proximal, weight_fn):
    module = M.build(cfg)
    tokens, mask = jnp.asarray(rollout.tokens), jnp.asarray(rollout.mask)
    resp = jnp.asarray(rollout.response_mask)
    weights = weight_fn(old, behaviour)

    def loss(p):
        logits = M.forward(module, p, tokens, mask)[:, :-1]
        logp = jax.nn.log_softmax(logits)
        logp = jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
        logp = jnp.pad(logp, ((0, 0), (1, 0)))
        ratio = jnp.exp(logp - proximal)
        surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.2) * adv)
        return -(weights * surrogate * resp).sum() / resp.sum()

    return jax.grad(loss)(params), weights


def _token_truncate(old, behaviour):
    return jnp.minimum(jnp.exp(old - behaviour), 1.2)


def _sequence_mask(old, behaviour, resp):
    rho = np.exp(np.where(resp, old - behaviour, 0.0).sum(-1))
    keep = (rho >= 0.5) & (rho <= 1.5)
    return jnp.asarray(np.where(keep, rho, 0.0)[:, None] * resp, jnp.float32)


@pytest.mark.parametrize(
    "setting",
    [
        "{weights: truncate, cap: 1.2}",
        "{weights: mask, level: sequence, cap: 1.5, floor: 0.5}",
        "{proximal: behaviour}",
    ],
)
def test_corrected_update_matches_reference(tmp_path, setting):
    cfg, src = _config(
        tmp_path,
        "grpo",
        "grpo.loss.kl_coef=0.0",
        f"grpo.loss.rollout_correction={setting}",
    )
    trainer = build_rl_trainer(cfg, mesh=_one_device_mesh(), source=src)
    params0 = jax.device_get(trainer.policy_state.params)
    rollout, _ = trainer.rollout(jax.random.key(1))
    resp = rollout.response_mask
    # A stale or mismatched sampler: its log-probs moved by known noise.
    shift = np.random.default_rng(0).normal(0.0, 0.3, resp.shape).astype(np.float32)
    behaviour = np.where(resp, rollout.sampler_logprobs + shift, 0.0).astype(np.float32)
    rollout = rollout.replace(sampler_logprobs=behaviour)
    metrics = trainer.learn(rollout, jax.random.key(2))

    module = M.build(trainer.model_cfg)
    logits = np.asarray(M.forward(module, params0, rollout.tokens, rollout.mask))
    old = jnp.asarray(_np_aligned_logprobs(logits, rollout.tokens), jnp.float32)
    s = rollout.scores.astype(np.float64).reshape(-1, 4)
    adv_seq = ((s - s.mean(1, keepdims=True)) / (s.std(1, ddof=1, keepdims=True) + 1e-6)).ravel()
    adv = jnp.asarray(np.where(resp, adv_seq[:, None], 0.0), jnp.float32)
    rc = cfg.grpo.loss.rollout_correction
    if rc.proximal == "behaviour":
        proximal, weight_fn = jnp.asarray(behaviour), lambda o, b: jnp.ones_like(o)
    elif rc.level == "token":
        proximal, weight_fn = old, _token_truncate
    else:
        proximal, weight_fn = old, lambda o, b: _sequence_mask(np.asarray(o), np.asarray(b), resp)
    grads, weights = _weighted_grads(
        trainer.model_cfg,
        params0,
        rollout,
        old,
        jnp.asarray(behaviour),
        adv,
        proximal=proximal,
        weight_fn=weight_fn,
    )
    expected = _adam_first_step(params0, grads)
    got = jax.device_get(trainer.policy_state.params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=0), got, expected)
    if rc.weights == "none":
        assert not any(k.startswith("is/") for k in metrics)
        return
    w = np.asarray(weights)
    units = resp if rc.level == "token" else resp.any(-1)
    unit_w = w[resp] if rc.level == "token" else w.max(-1)[units]
    np.testing.assert_allclose(metrics["is/weight_mean"], unit_w.mean(), rtol=1e-5)
    assert 0.0 < metrics["is/clip_frac"] < 1.0  # the noise crosses the bound both ways
    assert metrics["is/mismatch_kl"] > 0.01
