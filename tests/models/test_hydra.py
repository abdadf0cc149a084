"""The Hydra model (models/hydra.py) against the plain model it is built from: the policy
branch gives the LM's logits and the value branch a separate critic's values on the same
weights, for families with untied, tied (Gemma) and learned-position (GPT-2) embeddings and
every branch point; one forward gives both, packed or not.

The Hydra model runs the same layers on the same weights as the plain one, split at the
branch: equal to float32 rounding (1e-5; measured 0.0).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxrlhf.models import axes, hydra
from jaxrlhf.models import model as M
from jaxrlhf.models import packing as pk
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.scoring import RolloutForward
from tests.models.hf_fixtures import padded_batch
from tests.tiers import tiered


def _models(family):
    overrides = {}
    if family == "gemma3":  # two RoPE tables; a branch's layers pick theirs by layer id
        overrides["layer_types"] = ("sliding_attention", "full_attention", "sliding_attention")
    cfg = ModelConfig.tiny(family, num_layers=3, **overrides)
    lm = M.init_params(cfg, jax.random.key(0))
    score = M.init_params(cfg, jax.random.key(1), head="scalar")["score"]  # random, not 0
    return cfg, lm, score


@pytest.mark.parametrize(
    "family, branch_layer",
    tiered(
        [(f, b) for b in (0, 1, 2) for f in ("llama", "gemma", "gemma3", "gpt2")],
        [("llama", 1), ("gemma3", 2), ("gpt2", 0)],
    ),
)
def test_branches_equal_the_plain_policy_and_a_separate_critic(family, branch_layer):
    cfg, lm, score = _models(family)
    trunk, policy = hydra.from_plain(lm, branch_layer)
    value = hydra.value_from_plain(lm, branch_layer, score)
    params = {"trunk": trunk, "policy": policy, "value": value}
    tokens, mask = padded_batch(cfg.vocab_size)
    logits, values = M.forward(hydra.HydraModel(cfg, branch_layer), params, tokens, mask)
    want_logits = M.forward(M.build(cfg), lm, tokens, mask)
    critic = {"decoder": lm["decoder"], "score": score}  # critic_init: policy
    want_values = M.forward(M.build(cfg, "scalar"), critic, tokens, mask)
    np.testing.assert_allclose(np.asarray(logits)[mask], np.asarray(want_logits)[mask], atol=1e-5)
    np.testing.assert_allclose(np.asarray(values)[mask], np.asarray(want_values)[mask], atol=1e-5)
    assert np.abs(np.asarray(values)[mask]).max() > 1e-2
    # One head alone reads only its part of the tree.
    lm_only = M.forward(
        hydra.HydraModel(cfg, branch_layer, ("lm",)),
        {"trunk": trunk, "policy": policy},
        tokens,
        mask,
    )
    np.testing.assert_array_equal(np.asarray(lm_only), np.asarray(logits))
    # Back to the plain trees, exactly.
    jax.tree.map(np.testing.assert_array_equal, hydra.to_plain(trunk, policy), lm)
    jax.tree.map(np.testing.assert_array_equal, hydra.to_plain_critic(trunk, value), critic)


def test_the_tree_and_its_logical_axes():
    cfg, _, _ = _models("llama")
    abstract = hydra.abstract_params(cfg, 1, ("lm", "scalar"))
    assert set(abstract) == {"trunk", "policy", "value"}
    assert abstract["trunk"]["layers"]["attn"]["q_kernel"].shape[0] == 1
    assert abstract["policy"]["layers"]["attn"]["q_kernel"].shape[0] == 2
    assert abstract["value"]["score"].shape == (cfg.hidden_size, 1)
    assert "lm_head" in abstract["policy"] and "embed" in abstract["trunk"]
    specs = hydra.logical_specs(cfg, 1, ("lm", "scalar"))
    assert specs["trunk"]["layers"]["attn"]["q_kernel"][0] == axes.LAYERS
    assert tuple(specs["value"]["score"]) == (axes.EMBED, axes.SCALAR)
    assert set(hydra.abstract_params(cfg, 1, ("scalar",))) == {"trunk", "value"}


@pytest.mark.parametrize(
    "group_size, sequences",
    tiered([(1, False), (2, False), (1, True)], [(2, False)]),
    ids=["rows", "groups", "packed"],
)
def test_one_forward_gives_logprobs_and_values(group_size, sequences):
    """``RolloutForward.logprobs_and_values`` of the joint model equals the policy's
    ``logprobs`` and the critic's ``values`` on the response indices: rows as they are, in
    prompt groups, or packed by their real lengths (``models/packing.py``)."""
    cfg, lm, score = _models("llama")
    trunk, policy = hydra.from_plain(lm, 1)
    params = {"trunk": trunk, "policy": policy, "value": hydra.value_from_plain(lm, 1, score)}
    n, p, r = 4, 6, 5
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, cfg.vocab_size, (n // 2, p)).repeat(2, axis=0)
    tokens = np.concatenate([prompt, rng.integers(1, cfg.vocab_size, (n, r))], 1).astype(np.int32)
    mask = np.ones_like(tokens, bool)
    mask[:, p + 3 :] = np.arange(n)[:, None] % 2 == 0  # ragged responses
    if sequences:  # the short rows' prompts left-padded too: two of them fill one packed row
        mask[1::2, :4] = False
    tokens = np.where(mask, tokens, 0)
    joint = RolloutForward(hydra.HydraModel(cfg, 1), r, group_size)
    plan = None
    if sequences:  # one micro-batch on one shard
        plan, stats = pk.plan_rows(tokens, mask, p, np.arange(n)[None], 1)
        assert stats.needed < n  # 2 + 3 tokens twice in one row of p + r = 11
        joint = RolloutForward(joint.module, r, packing=pk.PackedShape(1, stats.needed))
    logp, values = joint.logprobs_and_values(params, tokens, mask, plan)
    plain_lm = RolloutForward(M.build(cfg), r)
    plain_critic = RolloutForward(M.build(cfg, "scalar"), r)
    want_logp, _ = plain_lm.logprobs(lm, tokens, mask)
    want_values = plain_critic.values({"decoder": lm["decoder"], "score": score}, tokens, mask)
    resp = mask.copy()
    resp[:, :p] = False
    np.testing.assert_allclose(np.asarray(logp)[resp], np.asarray(want_logp)[resp], atol=1e-5)
    np.testing.assert_allclose(np.asarray(values)[resp], np.asarray(want_values)[resp], atol=1e-5)
    assert not np.asarray(values)[:, :p].any()


def test_no_kv_cache():
    cfg, lm, score = _models("llama")
    trunk, policy = hydra.from_plain(lm, 1)
    module = hydra.HydraModel(cfg, 1, ("lm",))
    cache = M.init_cache(cfg, 1, 4)
    fn = functools.partial(
        M.forward_with_cache,
        module,
        {"trunk": trunk, "policy": policy},
        np.zeros((1, 1), np.int32),
        np.zeros((1, 1), np.int32),
    )
    with pytest.raises(ValueError, match="does not decode with a KV cache"):
        fn(cache, np.ones((1, 4), bool), np.int32(0))
