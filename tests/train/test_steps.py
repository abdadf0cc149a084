"""Steps and their parts: exact gradient accumulation, schedules, weight-decay mask, the
DPO loss variants, reference precomputation and reward models started from an LM export."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.data import (
    BatchIterator,
    CharTokenizer,
    DataConfig,
    Encoder,
    TokenizedDataset,
    TokenizerConfig,
    builtin_records,
    encode_records,
)
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.hf_checkpoint import save_hf
from jaxrlhf.sharding import TRAIN
from jaxrlhf.sharding.micro_batches import split_micro
from jaxrlhf.sharding.model_sharding import param_shardings
from jaxrlhf.train import dpo, loop, sft, steps
from jaxrlhf.train.config import DPO_LOSS_CHOICES
from jaxrlhf.train.optim import OptimizerConfig, decay_mask, make_schedule
from tests.train.helpers import config, mesh

DATA = DataConfig(max_length=32, max_prompt_length=16)


def _batch(kind: str, n: int) -> dict[str, np.ndarray]:
    tok = CharTokenizer()
    records = builtin_records("sort", kind, n, seed=3)
    ds = TokenizedDataset.from_encoded(
        encode_records(records, kind, Encoder(tok, TokenizerConfig()), DATA, "t"), tok.pad_id
    )
    return next(BatchIterator(ds, n, DATA.max_length, seed=0))


def test_accumulation_equals_full_batch_and_is_weighted():
    """4 micro-batches of different response lengths give the full-batch token-mean
    gradient, and not the plain mean of the four micro-batch gradients, which over-weights
    short responses (that differs by > 1e-4). Tolerance 5e-6 abs + 1e-5 rel: float32 sums in
    another order, on gradients up to ~1 (measured 1.5e-6 on an AMD Zen 3 VM, < 1e-6 on an
    Intel one: the matmul kernels sum in different orders)."""
    cfg = ModelConfig.tiny(initializer_range=0.3)
    one = mesh(1, 1, 1)
    params = model_lib.init_params(cfg, jax.random.key(0))
    module = model_lib.build(cfg)
    objective = sft.objective(sft.SFTConfig())
    batch = jax.tree.map(jnp.asarray, _batch("sft", 8))
    shardings = param_shardings(cfg, one, TRAIN)

    learner = steps.Learner(objective, module, None, None, TRAIN, shardings)

    def grads(num_micro):
        fn = functools.partial(steps.accumulate_gradients, learner, num_micro=num_micro, mesh=one)
        grads, aux = jax.jit(fn)(params, batch)
        return grads, aux.metrics

    full, full_metrics = grads(1)
    accumulated, metrics = grads(4)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=5e-6, rtol=1e-5), accumulated, full
    )
    for key in full_metrics:
        np.testing.assert_allclose(metrics[key], full_metrics[key], atol=1e-6, err_msg=key)

    micro = split_micro(batch, 4, one, TRAIN)
    grad_fn = jax.jit(jax.grad(lambda p, b: objective.loss_fn(module, p, b)[0]))
    naive = [grad_fn(params, jax.tree.map(lambda x, i=i: x[i], micro)) for i in range(4)]
    naive = jax.tree.map(lambda *g: sum(g) / 4, *naive)
    diff = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), naive, full)))
    assert diff > 1e-4  # so the test above would catch unweighted accumulation


def test_split_micro_is_strided():
    batch = {"x": jnp.arange(8)}
    out = split_micro(batch, 2, mesh(1, 1, 1), TRAIN)["x"]
    np.testing.assert_array_equal(out, [[0, 2, 4, 6], [1, 3, 5, 7]])


@pytest.mark.parametrize(
    "schedule, expected",
    [
        # 10 steps, warmup 2: 0, lr/2, then decay over 8 steps to lr * 0.1.
        ("cosine", [0.0, 0.5, 1.0, 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 1 / 8)), 0.1]),
        ("linear", [0.0, 0.5, 1.0, 1.0 - 0.9 / 8, 0.1]),
        ("constant", [0.0, 0.5, 1.0, 1.0, 1.0]),
    ],
)
def test_schedules(schedule, expected):
    cfg = OptimizerConfig(lr=1.0, schedule=schedule, warmup_steps=2, min_lr_ratio=0.1)
    fn = make_schedule(cfg, total_steps=10)
    got = [float(fn(s)) for s in (0, 1, 2, 3, 10)]
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_weight_decay_only_on_matrices():
    mask = decay_mask(model_lib.abstract_params(ModelConfig.tiny("gpt2"), "scalar"))
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(mask)}
    assert flat["['decoder']['layers']['attn']['q_kernel']"]
    assert flat["['decoder']['embed']['embedding']"] and flat["['score']"]
    assert not flat["['decoder']['layers']['attn']['q_bias']"]
    assert not flat["['decoder']['layers']['attn_norm']['scale']"]  # 2-D when stacked
    assert not flat["['decoder']['final_norm']['bias']"]


def test_dpo_loss_variants_at_the_reference():
    """At policy == reference: DPO loss log 2, IPO (1 / 2 beta)^2, hinge 1, margins 0; the
    reference-free SimPO and ORPO need no reference log-probs. One jit for all variants.
    TRL's other variants at log-ratios 0 (sigma(0) = 1/2): robust, AOT log 2; BCO, NCA
    2 log 2; APO 1/2 + 1/2; SPPO-hard 1 + 1; EXO (e = 1e-3)
    1/2 (log 1/2 - log 0.999) + 1/2 (log 1/2 - log 0.001) = 2.7612307."""
    model_cfg = ModelConfig.tiny()
    params = model_lib.init_params(model_cfg, jax.random.key(1))
    module = model_lib.build(model_cfg)
    batch = jax.tree.map(jnp.asarray, _batch("preference", 4))
    cfgs = {
        t: dpo.DPOConfig(loss_type=t, beta=0.5, label_smoothing=1e-3 if t == "exo_pair" else 0.0)
        for t in DPO_LOSS_CHOICES
    }

    @jax.jit
    def all_losses(params, batch):
        out = {}
        for name, cfg in cfgs.items():
            b = dict(batch)
            if cfg.needs_reference:
                b["reference_logps"] = dpo.sequence_logps(
                    module, params, batch, average=cfg.average_logps
                )
            out[name] = dpo.loss_fn(cfg, module, params, b)
        return out

    results = jax.device_get(all_losses(params, batch))
    log2 = np.log(2.0)
    expected = {"sigmoid": log2, "ipo": 1.0, "hinge": 1.0, "robust": log2, "aot": log2}
    expected.update(aot_unpaired=log2, bco_pair=2 * log2, nca_pair=2 * log2, apo_zero=1.0)
    expected.update(apo_down=1.0, sppo_hard=2.0, exo_pair=2.7612307)
    for name, (loss, aux) in results.items():
        metrics = aux.metrics
        assert np.isfinite(loss) and all(np.isfinite(v) for v in metrics.values()), name
        if name in expected:
            np.testing.assert_allclose(loss, expected[name], atol=1e-5, err_msg=name)
            np.testing.assert_allclose(metrics["dpo/margin"], 0.0, atol=1e-5, err_msg=name)
        assert (dpo.objective(cfgs[name]).reference is None) == (name in ("simpo", "orpo"))


SMALL = (
    "data.builtin_size=64",
    "data.eval_size=16",
    "train.batch_size=8",
    "train.steps=2",
    "optimizer.warmup_steps=0",
)


@pytest.mark.slow
def test_precomputed_reference_equals_per_batch(tmp_path):
    per_batch = loop.build_trainer(config("tiny_dpo", tmp_path, *SMALL))
    pre = loop.build_trainer(config("tiny_dpo", tmp_path, *SMALL, "dpo.precompute_reference=true"))
    assert pre.train_data.extras["reference_logps"].shape == (len(pre.train_data), 2)
    assert pre.eval_data.extras["reference_logps"].shape == (16, 2)
    a, b = jax.device_get(per_batch.step().metrics), jax.device_get(pre.step().metrics)
    for key in a:
        np.testing.assert_allclose(a[key], b[key], atol=1e-5, err_msg=key)


def test_reward_model_from_a_causal_lm_export(tmp_path):
    """An LM checkpoint starts a reward model; its missing score head starts at zero."""
    model_cfg = ModelConfig.tiny(hidden_size=64, intermediate_size=128)
    save_hf(str(tmp_path / "lm"), model_cfg, model_lib.init_params(model_cfg, jax.random.key(0)))
    trainer = loop.build_trainer(
        config(
            "tiny_rm",
            tmp_path,
            *SMALL,
            "model.preset=null",
            f"model.hf_dir={tmp_path / 'lm'}",
        )
    )
    assert not np.asarray(trainer.state.params["score"]).any()
    metrics = trainer.evaluate()
    assert metrics["eval/rm/margin"] == 0.0
    assert metrics["eval/loss/rm"] == pytest.approx(np.log(2.0), abs=1e-6)


@pytest.mark.slow
def test_bf16_state_keeps_its_dtypes_under_accumulation(tmp_path):
    """bf16 params (trained with stochastic rounding, as validation requires), no mu_dtype,
    2 micro-batches: float32-accumulated gradients must not change the optimizer state's
    dtypes (that changed the state's type and recompiled step 2)."""
    from jaxrlhf.train import loop
    from tests.train.helpers import config

    cfg = config(
        "tiny_sft",
        tmp_path,
        "model.param_dtype=bfloat16",
        "model.dtype=bfloat16",
        "optimizer.stochastic_rounding=true",
        "train.batch_size=32",
        "train.micro_batch_size=2",
        "data.eval_size=32",
    )
    trainer = loop.build_trainer(cfg)
    assert trainer.num_micro == 2
    before = jax.tree.map(lambda x: x.dtype, trainer.state)
    assert jnp.bfloat16 in jax.tree.leaves(before)
    trainer.step()
    assert jax.tree.map(lambda x: x.dtype, trainer.state) == before
