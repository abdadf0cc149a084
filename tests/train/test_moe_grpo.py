"""A tiny random mixture of experts learns with GRPO, its load-balancing loss on.

configs/moe_grpo_quickstart.yaml's two stages (SFT, then GRPO of the export on the built-in
task's reward), shortened, on one CPU device: the task reward rises, every iteration logs
the router's aux loss and each expert's share of the routed tokens, and the shares stay
near balance.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxrlhf.config import load_config
from jaxrlhf.train import loop
from tests.train.helpers import CONFIGS, mesh

pytestmark = pytest.mark.slow


def test_tiny_moe_grpo_learns_with_the_load_balancing_loss(tmp_path):
    stage = os.path.join(CONFIGS, "quickstart")
    quiet = ["logging.progress=none", "logging.plot=false", "mesh.fsdp=1"]
    sft_cfg = load_config(
        os.path.join(stage, "moe_grpo_sft.yaml"),
        [f"output_dir={tmp_path}/sft", "train.steps=60", *quiet],
    )
    assert sft_cfg.model.resolve().num_experts == 4
    sft = loop.run(sft_cfg, mesh=mesh(1, 1, 1))
    assert sft.rows("moe/aux_loss"), "SFT logs the router's aux loss"

    grpo_cfg = load_config(
        os.path.join(stage, "moe_grpo.yaml"),
        [
            f"output_dir={tmp_path}/grpo",
            f"model.hf_dir={tmp_path}/sft/hf",
            "train.steps=80",
            *quiet,
        ],
    )
    model_cfg = grpo_cfg.model.resolve()
    assert model_cfg.family == "qwen3_moe" and model_cfg.router_aux_loss_coef == 0.01
    result = loop.run(grpo_cfg, mesh=mesh(1, 1, 1))
    rewards = [v for _, v in result.rows("reward/task_mean")]
    first, last = np.mean(rewards[:10]), np.mean(rewards[-10:])
    assert last > first + 0.05, (first, last)  # measured 0.37 -> 0.50

    row = result.history[-1]
    loads = np.array([row[f"moe/load/e{j}"] for j in range(4)])
    np.testing.assert_allclose(loads.sum(), 1.0, atol=1e-5)  # shares of the routed tokens
    assert loads.min() > 0.1, loads  # every expert still gets work
    # k = 2 is the aux loss of a perfectly balanced router (moe.load_balancing_loss).
    assert 2.0 - 1e-3 < row["moe/aux_loss"] < 2.5, row["moe/aux_loss"]
