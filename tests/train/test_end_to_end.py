"""Each tiny config end to end on CPU (8 fake devices): the loss goes down, the reward model
ranks held-out pairs well above chance, the DPO margin grows; the run directory holds the
resolved config, JSONL metrics and a Hugging Face export that transformers loads and that
matches our model."""

from __future__ import annotations

import functools
import json
import os

import jax
import numpy as np
import pytest

from jaxrlhf.config import load_config, validate
from jaxrlhf.data import eval_batches
from jaxrlhf.models import model as model_lib
from jaxrlhf.train import loop
from tests.train.helpers import config

pytestmark = pytest.mark.slow


def _first_last(result, key):
    rows = result.rows(key)
    return rows[0][1], rows[-1][1]


def _check_run_dir(result, cfg):
    run_dir = result.run_dir
    saved = load_config(os.path.join(run_dir, loop.CONFIG_FILE))
    assert saved == cfg
    validate(saved, 8)  # and it validates for the devices it ran on
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert rows == result.history
    assert rows[-1]["step"] == cfg.train.steps
    assert {"lr", "grad_norm", "time/step_s"} <= set(rows[1])
    assert os.path.exists(os.path.join(run_dir, "hf", "config.json"))
    assert os.path.exists(os.path.join(run_dir, "hf", "tokenizer.json"))


def _eval_batch(trainer, n=8):
    return next(eval_batches(trainer.eval_data, n, trainer.cfg.data.max_length))


def test_sft(tmp_path):
    cfg = config("tiny_sft", tmp_path)
    result = loop.run(cfg)
    _check_run_dir(result, cfg)
    start, end = _first_last(result, "eval/loss/sft")
    assert start > 4.0 and end < 0.5 * start, (start, end)
    train_start, train_end = _first_last(result, "loss/sft")
    assert train_end < 0.3 * train_start
    assert _first_last(result, "eval/sft/accuracy")[1] > 0.7

    # The export is a LlamaForCausalLM with our logits.
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    trainer = result.trainer
    batch = _eval_batch(trainer)
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(result.run_dir, "hf")).eval()
    with torch.no_grad():
        ref = hf(
            input_ids=torch.tensor(batch["tokens"], dtype=torch.long),
            attention_mask=torch.tensor(batch["mask"], dtype=torch.long),
        ).logits.numpy()
    module = model_lib.build(trainer.model_cfg)
    params = jax.device_get(trainer.state.params)
    ours = jax.jit(functools.partial(model_lib.forward, module))(
        params, batch["tokens"], batch["mask"]
    )
    mask = batch["mask"]
    np.testing.assert_allclose(np.asarray(ours)[mask], ref[mask], atol=1e-4, rtol=0)


def test_reward_model(tmp_path):
    cfg = config("tiny_rm", tmp_path)
    result = loop.run(cfg)
    _check_run_dir(result, cfg)
    start, end = _first_last(result, "eval/rm/accuracy")
    assert end > 0.7, (start, end)  # chance is 0.5 (256 held-out pairs: 0.7 is 6 sigma)
    loss_start, loss_end = _first_last(result, "eval/loss/rm")
    assert loss_end < loss_start - 0.15

    # The export is a one-label LlamaForSequenceClassification that scores like our model.
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForSequenceClassification

    trainer = result.trainer
    batch = _eval_batch(trainer)
    tokens = batch["tokens"].reshape(-1, batch["tokens"].shape[-1])
    mask = batch["mask"].reshape(tokens.shape)
    hf = AutoModelForSequenceClassification.from_pretrained(os.path.join(result.run_dir, "hf"))
    with torch.no_grad():
        ref = hf.eval()(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
        ).logits.numpy()[:, 0]
    module = model_lib.build(trainer.model_cfg, "scalar")
    values = model_lib.forward(module, jax.device_get(trainer.state.params), tokens, mask)
    ours = np.asarray(model_lib.last_token_values(values, mask))
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_dpo(tmp_path):
    cfg = config("tiny_dpo", tmp_path)
    result = loop.run(cfg)
    _check_run_dir(result, cfg)
    start, end = _first_last(result, "eval/dpo/margin")
    assert start == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 0
    assert end > 0.2, end
    margins = [v for _, v in result.rows("dpo/margin")]
    assert margins[-1] > margins[0] + 0.2
    loss_start, loss_end = _first_last(result, "eval/loss/dpo")
    assert loss_start == pytest.approx(np.log(2), abs=1e-5) and loss_end < 0.62
    assert _first_last(result, "eval/dpo/accuracy")[1] > 0.7
