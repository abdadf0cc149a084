"""The learners of an RL run (the policy, and PPO's critic), built from the config and the
mesh: each one's model (a RolloutForward under its train rules), optimizer, objective and
TrainState shardings.

A learner may train part of its model; the rest is frozen and passed to the programs beside
its state (``steps.Learner.combine``): LoRA's base (``lora:``, ``train/adapters.py``) or a
Hydra model's trunk (``ppo.value.branch_layer``, ``train/hydra_setup.py``). Either way the
learner's forward packs the update's sequences where the update does
(``RLLayout.packing.update``, ``rl_scoring.phase_forward``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from jaxrlhf.config import RunConfig, RunLayout, rl_section
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.lora import LoraSpec, combine_fn
from jaxrlhf.models.scoring import RolloutForward
from jaxrlhf.sharding import rules_for
from jaxrlhf.sharding.model_sharding import build_sharded, param_shardings
from jaxrlhf.train import rl_steps, steps
from jaxrlhf.train.adapters import LoraLayout, lora_layout, lora_spec
from jaxrlhf.train.hydra_setup import HydraLayout, combine_parts, hydra_forward, hydra_layout
from jaxrlhf.train.optim import make_optimizer
from jaxrlhf.train.rl_config import PPOConfig
from jaxrlhf.train.rl_scoring import phase_forward
from jaxrlhf.train.state import TrainState, state_shardings


@dataclasses.dataclass(frozen=True)
class LearnerSetup:
    """One learner with its TrainState shardings and, when part of its model is frozen,
    that part (abstract and sharded).

    Attributes:
      learner: the learner (static).
      shardings: its TrainState's shardings.
      abstract: its trained params, abstract.
      frozen, frozen_shardings: the frozen part, abstract and sharded, or None.
      lora: its LoRA layout (``lora:``), else None.
    """

    learner: steps.Learner
    shardings: TrainState
    abstract: Any
    frozen: Any = None
    frozen_shardings: Any = None
    lora: LoraLayout | None = None

    @property
    def model_shardings(self) -> Any:
        """Shardings of the params its forwards apply (trained and frozen combined)."""
        return self.learner.model_params(self.shardings.params, self.frozen_shardings)

    @property
    def abstract_model(self) -> Any:
        """The abstract params its forwards apply."""
        return self.learner.model_params(self.abstract, self.frozen)


def _learner(
    model: ModelConfig,
    mesh: Mesh,
    role: str,
    optimizer_cfg: Any,
    updates: int,
    objective: steps.Objective,
    max_new_tokens: int,
    layout: RunLayout,
    spec: LoraSpec | None = None,
) -> LearnerSetup:
    """The learner of ``role`` (train rules): its model applied through a RolloutForward that
    packs the update's sequences, or else the objective's ``row_group``; with ``spec``, LoRA
    adapters are its trainable part."""
    rules, head = rules_for(role, "train"), objective.head
    optimizer, lr_fn = make_optimizer(optimizer_cfg, updates)
    forward = phase_forward(
        RolloutForward(build_sharded(model, mesh, rules, head, spec), max_new_tokens),
        objective.row_group,
        layout.rl.packing.update,
        layout.data_shards,
    )
    if spec is None:
        param_sh = param_shardings(model, mesh, rules, head)
        abstract = model_lib.abstract_params(model, head)
        shardings = state_shardings(abstract, param_sh, optimizer, mesh)
        learner = steps.Learner(objective, forward, optimizer, lr_fn, rules, param_sh)
        return LearnerSetup(learner, shardings, abstract)
    lora = lora_layout(model, mesh, rules, head, spec)
    param_sh, abstract = lora.trainable_shardings, lora.trainable
    shardings = state_shardings(abstract, param_sh, optimizer, mesh)
    learner = steps.Learner(objective, forward, optimizer, lr_fn, rules, param_sh, combine_fn(spec))
    return LearnerSetup(learner, shardings, abstract, lora.frozen, lora.frozen_shardings, lora)


def _hydra_learner(
    model: ModelConfig,
    mesh: Mesh,
    hydra: HydraLayout,
    head: str,
    optimizer_cfg: Any,
    updates: int,
    objective: steps.Objective,
    max_new_tokens: int,
    layout: RunLayout,
) -> LearnerSetup:
    """A Hydra branch as a learner: the policy's (``head`` lm) or the critic's (scalar)."""
    role = "policy" if head == "lm" else "value"
    rules = rules_for(role, "train")
    optimizer, lr_fn = make_optimizer(optimizer_cfg, updates)
    forward = phase_forward(
        hydra_forward(model, mesh, rules, hydra.branch_layer, (head,), max_new_tokens, 1),
        objective.row_group,
        layout.rl.packing.update,
        layout.data_shards,
    )
    abstract = hydra.policy if head == "lm" else hydra.value
    param_sh = hydra.policy_shardings if head == "lm" else hydra.value_shardings
    shardings = state_shardings(abstract, param_sh, optimizer, mesh)
    learner = steps.Learner(objective, forward, optimizer, lr_fn, rules, param_sh, combine_parts)
    return LearnerSetup(learner, shardings, abstract, hydra.trunk, hydra.trunk_shardings)


def learners(
    cfg: RunConfig,
    layout: RunLayout,
    model: ModelConfig,
    mesh: Mesh,
    critic_mesh: Mesh | None = None,
) -> tuple[LearnerSetup, LearnerSetup | None, HydraLayout | None]:
    """``(policy, critic or None, the Hydra layout or None)``; with ``lora:`` both train
    adapters, with a Hydra critic both train their branch of the shared trunk. The critic
    lives on ``critic_mesh`` (``placement.strategy: interleaved``; None: ``mesh``)."""
    algo, rl, spec = rl_section(cfg), layout.rl, lora_spec(cfg)
    r, group = algo.rollout.max_new_tokens, rl.groups.update
    policy_objective = rl_steps.policy_objective(algo.loss, group)
    if not isinstance(algo, PPOConfig):
        policy = _learner(
            model, mesh, "policy", cfg.optimizer, rl.updates, policy_objective, r, layout, spec
        )
        return policy, None, None
    critic_opt = cfg.optimizer
    if algo.critic_lr is not None:
        critic_opt = dataclasses.replace(cfg.optimizer, lr=algo.critic_lr)
    gae = rl_steps.GaeConfig(algo.gamma, algo.lam, algo.whiten_advantages)
    value_objective = rl_steps.value_objective(algo.value_clip, algo.loss.aggregation, group, gae)
    if algo.hydra:
        hydra = hydra_layout(model, mesh, algo.value.branch_layer)
        policy = _hydra_learner(
            model, mesh, hydra, "lm", cfg.optimizer, rl.updates, policy_objective, r, layout
        )
        value = _hydra_learner(
            model, mesh, hydra, "scalar", critic_opt, rl.updates, value_objective, r, layout
        )
        return policy, value, hydra
    policy = _learner(
        model, mesh, "policy", cfg.optimizer, rl.updates, policy_objective, r, layout, spec
    )
    value = _learner(
        model,
        critic_mesh or mesh,
        "value",
        critic_opt,
        rl.updates,
        value_objective,
        r,
        layout,
        spec,
    )
    return policy, value, None
