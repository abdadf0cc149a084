"""TRL's other paired DPO loss types through the DPO trainer: a couple of steps run, and the
step's ``loss/dpo`` equals the pure ``jaxrlhf.losses`` function on the same log-probs."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrlhf import losses
from jaxrlhf.models import model as model_lib
from jaxrlhf.train import dpo, loop
from jaxrlhf.train.config import DPO_LOSS_CHOICES, DPO_VARIANT_LOSSES
from jaxrlhf.train.reward_model import pair_mask
from tests.tiers import tiered
from tests.train.helpers import config

SMALL = (
    "data.builtin_size=64",
    "data.eval_size=16",
    "train.batch_size=8",
    "train.steps=3",
    "optimizer.warmup_steps=0",
    "optimizer.lr=1e-2",  # so that one step moves the policy away from the reference
)

# loss_type -> (the pure function, its non-default options, the same as config overrides)
CASES = {
    "robust": (losses.robust_dpo_loss, {"label_smoothing": 0.2}),
    "bco_pair": (losses.bco_pair_loss, {"f_divergence": "js_divergence"}),
    "nca_pair": (losses.nca_pair_loss, {"f_divergence": "alpha_divergence", "f_alpha": 0.3}),
    "apo_zero": (losses.apo_zero_loss, {}),
    "apo_down": (losses.apo_down_loss, {}),
    "exo_pair": (losses.exo_pair_loss, {"label_smoothing": 0.01}),
    "sppo_hard": (losses.sppo_hard_loss, {"f_divergence": "forward_kl"}),
    "aot": (losses.aot_loss, {"label_smoothing": 0.1}),
    "aot_unpaired": (losses.aot_unpaired_loss, {}),
}


def test_every_trl_variant_is_a_loss_type():
    assert set(CASES) == set(DPO_LOSS_CHOICES) - {"sigmoid", "ipo", "hinge", "simpo", "orpo"}
    assert set(dpo.VARIANT_LOSS_FNS) == set(DPO_VARIANT_LOSSES) == set(CASES)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"loss_type": "exo_pair"}, "exo_pair needs it > 0"),
        ({"loss_type": "nca_pair", "label_smoothing": 0.1}, "only applies to loss_type"),
        ({"loss_type": "apo_zero", "f_divergence": "forward_kl"}, "only applies to loss_type"),
        ({"loss_type": "ipo", "f_divergence": "js_divergence"}, "only applies to loss_type"),
        ({"f_divergence": "kl"}, "expected one of"),
    ],
)
def test_config_rejects_options_a_loss_type_ignores(options, message):
    with pytest.raises(ValueError, match=message):
        dpo.DPOConfig(**options)


# The trainer dispatches every loss type through one path (the pure losses are checked
# against TRL in tests/losses): three types with different options (label smoothing, an
# f-divergence, the unpaired layout) check the dispatch; one of them in the default tier.
@pytest.mark.parametrize("loss_type", tiered(["robust", "sppo_hard", "aot_unpaired"], ["robust"]))
def test_dpo_steps_with_variant_loss_equal_the_pure_function(tmp_path, loss_type):
    """Step 1 moves the policy off the reference; step 2's loss (at the pre-step params) is
    compared with the pure function on log-probs computed here. Tolerance 1e-5 abs + 1e-5
    rel: the summed log-probs (~-50) come from two different jitted programs, whose float32
    sums may differ in order by a few ulps (~4e-6 each)."""
    fn, options = CASES[loss_type]
    overrides = [f"dpo.{k}={v}" for k, v in options.items()]
    cfg = config(
        "tiny_dpo", tmp_path, *SMALL, f"dpo.loss_type={loss_type}", "dpo.beta=0.5", *overrides
    )
    trainer = loop.build_trainer(cfg)
    first = jax.device_get(trainer.step().metrics)
    batch = trainer.next_batch()
    params = jax.device_get(trainer.state.params)  # a host copy: the step donates the state
    second = jax.device_get(trainer.step(batch).metrics)
    third = jax.device_get(trainer.step().metrics)
    for metrics in (first, second, third):
        assert all(np.isfinite(v) for v in metrics.values()), metrics

    # The reference runs on host copies, i.e. on one device. On the trainer's 8-device mesh
    # every eager op of the pure function below would be a multi-device program, several in
    # flight at once; on a loaded host those starve XLA:CPU's client thread pool, whose
    # rendezvous then aborts the process (docs/sharding.md, "Two programs in flight on
    # XLA:CPU"): this test's worker died so in full-suite runs.
    batch = jax.device_get(batch)
    module = model_lib.build(trainer.model_cfg)
    logps = jax.jit(lambda p, b: dpo.sequence_logps(module, p, b, average=False))(params, batch)
    ref = batch["reference_logps"]
    real = pair_mask(batch)
    assert bool(real.all())
    c, r = np.asarray(logps - ref).T
    assert np.abs(c - r).max() > 1e-2  # the policy has moved: a loss that ignored it would show
    loss, m = fn(
        logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], beta=0.5, pair_mask=real, **options
    )
    np.testing.assert_allclose(second["loss/dpo"], loss, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(second["dpo/margin"], m["rewards/margin"], atol=1e-5, rtol=1e-5)
