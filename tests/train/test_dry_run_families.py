"""Every new family plans a GRPO run with the dry run on an 8-device mesh with expert and
tensor axes (fsdp 4 x tensor 2), each preset cut to 2 layers so the test compiles in seconds
per preset (the full Qwen3-30B-A3B plans are the recipes under configs/recipes/,
docs/dry_run.md). Every phase's programs compile, and the policy's parameter count is the
2-layer model's. A family's other sizes (same code, other widths and head counts) are
checked without compiling: their config validates for the mesh and every parameter gets a
sharding of its shape under the training and generation rules."""

from __future__ import annotations

import math

import jax
import pytest

from jaxrlhf.config import RunConfig, from_dict, validate
from jaxrlhf.models import model as M
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.sharding import MeshConfig, make_mesh, rules_for
from jaxrlhf.sharding.model_sharding import param_shardings
from jaxrlhf.train import dry_run

pytestmark = pytest.mark.slow

# One preset of each family and variant (tied and untied Qwen3 heads) is compiled ...
COMPILED_PRESETS = (
    "llama3_2_1b",
    "qwen3_0_6b",
    "qwen3_8b",
    "qwen3_30b_a3b",
    "mixtral_8x7b",
    "gemma2_2b",
    "gemma3_1b",
    "phi3_mini_4k",
)
# ... and the families' other sizes are sharded on paper.
OTHER_SIZES = ("llama3_2_3b", "qwen3_1_7b", "qwen3_4b", "gemma2_9b", "gemma3_4b")


def _grpo(preset: str) -> RunConfig:
    return from_dict(
        {
            "algorithm": "grpo",
            "output_dir": "runs/unused",
            "model": {
                "preset": preset,
                "num_layers": 2,
                "dtype": "bfloat16",
                "param_dtype": "float32",  # float32 masters, bf16 compute (as the recipes)
                "remat": "full",
                "router_aux_loss_coef": 0.001,
            },
            "tokenizer": {"path": "checkpoints/unused"},
            "data": {"train": "data/prompts.jsonl", "max_length": 96, "max_prompt_length": 32},
            "mesh": {"data": 1, "fsdp": 4, "tensor": 2},
            "train": {"steps": 1, "micro_batch_size": 1},
            "grpo": {
                "rollout": {"prompts_per_step": 4, "num_samples": 2, "max_new_tokens": 16},
                "loss": {"num_minibatches": 2},
                "reward": {"function": "my_rewards.math_reward"},
            },
        }
    )


def _mesh():
    """The 8 devices as fsdp 4 x tensor 2 (expert and tensor axes both in use)."""
    return make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))


@pytest.mark.parametrize("preset", COMPILED_PRESETS)
def test_new_preset_plans_grpo(preset):
    cfg = _grpo(preset)
    mesh = _mesh()
    report = dry_run.plan(cfg, mesh=mesh, source=preset)
    names = {(p.phase, p.name) for p in report.programs}
    assert {("generate", "prefill"), ("generate", "decode"), ("train", "update")} <= names
    model_cfg = getattr(ModelConfig, preset)(num_layers=2)
    assert report.roles[0].params == M.param_count(M.abstract_params(model_cfg))
    assert all(p.peak_bytes > 0 for p in report.programs)


@pytest.mark.parametrize("preset", OTHER_SIZES)
def test_other_sizes_validate_and_split_on_the_mesh(preset):
    """Every matrix divides over its mesh axes (a dim that does not is replicated): per
    device, the training rules hold 1/8 of the parameters and the generation rules 1/2
    (tensor only), besides the replicated norm scales."""
    validate(_grpo(preset), 8, source=preset)
    mesh = _mesh()
    model_cfg = getattr(ModelConfig, preset)(num_layers=2)
    named = jax.tree_util.tree_leaves_with_path(M.abstract_params(model_cfg))
    leaves = [leaf for _, leaf in named]
    total = sum(math.prod(leaf.shape) for leaf in leaves)
    keystr = jax.tree_util.keystr
    norms = sum(math.prod(leaf.shape) for path, leaf in named if "norm" in keystr(path))
    for phase, split in (("train", 8), ("generate", 2)):
        shardings = jax.tree.leaves(param_shardings(model_cfg, mesh, rules_for("policy", phase)))
        assert len(shardings) == len(leaves)
        per_device = sum(
            math.prod(s.shard_shape(leaf.shape)) for s, leaf in zip(shardings, leaves, strict=True)
        )
        assert total / split <= per_device <= total / split + norms, phase


def test_qwen3_moe_recipe_dry_run_fits_8_h100(capsys):
    """The Qwen3-30B-A3B 8 x H100 recipe through the CLI, cut to 4 of its 48 layers (the
    full plan, 64 GiB of 80 at the peak, is in the recipe's header and docs/dry_run.md)."""
    import os

    from jaxrlhf.train.__main__ import main
    from tests.train import helpers

    path = os.path.join(helpers.CONFIGS, "recipes", "qwen3_30b_a3b_grpo_8xh100.yaml")
    args = ["--config", path, "--dry-run", "--device-kind", "h100", "model.num_layers=4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for needle in ("grpo, qwen3_moe, ", "mesh data=1 x fsdp=8 x tensor=1", "decode", "fits:"):
        assert needle in out
