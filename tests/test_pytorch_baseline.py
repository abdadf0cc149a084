"""The PyTorch baseline of benchmarks/rl_step.py computes the same advantages as jaxrlhf.

benchmarks/pytorch_rl.py stands for what TRL and OpenRLHF run per step; its ratio to jaxrlhf
only means something if both do the same math. Its GRPO and GAE advantages are checked here
against ``jaxrlhf.losses`` on random inputs (float32; 1e-5 abs: the two sum in different
orders over at most 64 steps of O(1) values).
"""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from benchmarks import pytorch_rl  # noqa: E402
from jaxrlhf.losses import gae_advantages, grpo_advantages  # noqa: E402


def test_grpo_advantages_equal_jaxrlhf():
    scores = np.random.default_rng(0).random(32).astype(np.float32)
    got = pytorch_rl.grpo_advantages(torch.from_numpy(scores), group_size=4).numpy()
    want = np.asarray(grpo_advantages(jnp.asarray(scores), group_size=4))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_gae_equals_jaxrlhf():
    rng = np.random.default_rng(1)
    rewards = rng.normal(size=(8, 64)).astype(np.float32)
    values = rng.normal(size=(8, 64)).astype(np.float32)
    adv, ret = pytorch_rl.gae(torch.from_numpy(rewards), torch.from_numpy(values))
    want_adv, want_ret = gae_advantages(
        jnp.asarray(rewards),
        jnp.asarray(values),
        jnp.ones(rewards.shape, bool),
        gamma=pytorch_rl.GAMMA,
        lam=pytorch_rl.LAM,
    )
    np.testing.assert_allclose(adv.numpy(), np.asarray(want_adv), atol=1e-5, rtol=0)
    np.testing.assert_allclose(ret.numpy(), np.asarray(want_ret), atol=1e-5, rtol=0)
