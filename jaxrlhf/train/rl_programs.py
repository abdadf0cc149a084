"""The jitted programs of an RL run (``algorithm: ppo | grpo``), built once from the config,
the meshes and abstract shapes: no parameters, data or devices are touched.

One iteration, each arrow one of these programs with its own shardings::

    policy params --reshard--> sampler.prefill_program / decode_program --> Rollout (host)
        --> reward (reward model, or a function on the host)
        --> score: reference (and old-policy, critic) forwards + advantages --> Scored
        --> update: epochs x minibatches of policy (and critic) steps --> new states

:class:`RLPrograms` holds them; the trainer (``rl_trainer``) runs them on real arrays, the dry
run (``dry_run_phases``) lowers and compiles the same objects against ``ShapeDtypeStruct``
arguments. Packing prompt groups (``rollout.shared_prefix``) is decided here, by the
:class:`~jaxrlhf.models.scoring.RolloutForward` each program applies its models through.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf import losses
from jaxrlhf.config import RunConfig, RunLayout, rl_section
from jaxrlhf.generation import Sampler, SamplingParams
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.lora import LoraParams, LoraSpec, combine_fn
from jaxrlhf.models.scoring import RolloutForward
from jaxrlhf.rewards.model import reward_model_scores
from jaxrlhf.sharding import rules_for
from jaxrlhf.sharding.micro_batches import map_micro
from jaxrlhf.sharding.model_sharding import build_sharded, param_shardings
from jaxrlhf.sharding.rules import Rules
from jaxrlhf.train import rl_steps, steps
from jaxrlhf.train.adapters import LoraLayout, lora_layout, lora_spec
from jaxrlhf.train.optim import make_optimizer
from jaxrlhf.train.rl_config import GRPOConfig, PPOConfig
from jaxrlhf.train.rl_types import RolloutRows, Scored, UpdateOutput
from jaxrlhf.train.state import TrainState, state_shardings
from jaxrlhf.train.weight_sync import AdapterSync


def sampling_params(
    algo: PPOConfig | GRPOConfig, eos_id: int | None = None, pad_id: int = 0
) -> SamplingParams:
    """The rollout's sampling: ``rollout`` settings, stopping at ``eos_id`` when
    ``rollout.stop_at_eos`` (None: no stop token), padding with ``pad_id``, the model's own
    log-probs returned (the behaviour log-probs)."""
    r = algo.rollout
    return SamplingParams(
        temperature=r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        stop_token_ids=(eos_id,) if r.stop_at_eos and eos_id is not None else (),
        n=r.num_samples,
        pad_token_id=pad_id,
        return_model_logprobs=True,
    )


@dataclasses.dataclass(frozen=True)
class Scoring:
    """The score program's pure function (static fields; call it under ``jax.jit``).

    Reference log-probs always; old log-probs unless the policy's update forward stands in;
    for PPO the critic's values, GAE advantages and returns (or only the per-token rewards
    when the critic's update forward runs GAE); for GRPO the group advantages.
    """

    algo: PPOConfig | GRPOConfig
    reference: RolloutForward
    policy: RolloutForward | None  # None: reuse_policy_forward
    value: RolloutForward | None  # None: GRPO, or reuse_value_forward
    has_critic: bool
    num_micro: int
    mesh: Mesh
    rules: Rules

    def forwards(self, policy_params, ref_params, value_params, rows: RolloutRows) -> Scored:
        """The scoring forwards, ``num_micro`` micro-batches of whole groups at a time."""

        def run(r: RolloutRows) -> Scored:
            ref, _ = self.reference.logprobs(ref_params, r.tokens, r.mask)
            old = values = None
            if self.policy is not None:
                old, _ = self.policy.logprobs(policy_params, r.tokens, r.mask)
            if self.value is not None:
                values = self.value.values(value_params, r.tokens, r.mask)
            return Scored(ref_logprobs=ref, old_logprobs=old, old_values=values)

        return map_micro(
            run, rows, self.num_micro, self.mesh, self.rules, self.reference.group_size
        )

    def __call__(
        self,
        policy_params: Any,
        ref_params: Any,
        value_params: Any,
        rows: RolloutRows,
        scores: jax.Array,
        kl_coef: jax.Array,
    ) -> Scored:
        """``rows`` [N, T] with their ``scores`` [N] (shaped) scored under ``kl_coef`` []."""
        algo, resp = self.algo, rows.response_mask
        out = self.forwards(policy_params, ref_params, value_params, rows)
        ref, old = out.ref_logprobs, out.old_logprobs
        if self.has_critic and out.old_values is None:  # the critic's update runs GAE
            rewards, m = rl_steps.ppo_token_rewards(
                scores, old, ref, resp, kl_coef, loss_cfg=algo.loss
            )
            return out.replace(token_rewards=rewards, metrics=m)
        if self.has_critic:
            adv, ret, m = rl_steps.ppo_advantages(
                scores,
                old,
                ref,
                out.old_values,
                resp,
                kl_coef,
                loss_cfg=algo.loss,
                gamma=algo.gamma,
                lam=algo.lam,
                whiten=algo.whiten_advantages,
            )
            m.update(rl_steps.value_metrics(adv, ret, out.old_values, resp))
            return out.replace(returns=ret, advantages=adv, metrics=m)
        adv, m = rl_steps.grpo_advantages(
            scores,
            old,
            ref,
            resp,
            kl_coef,
            loss_cfg=algo.loss,
            advantage=algo.advantage,
            group_size=algo.rollout.num_samples,
        )
        m["advantages/abs_mean"] = losses.masked_mean(jnp.abs(adv), resp)
        return out.replace(advantages=adv, metrics=m)


@dataclasses.dataclass(frozen=True)
class RLPrograms:
    """Every jitted program of an RL run and the shardings they take (module docstring).

    Attributes:
      algo: the run's ``ppo`` or ``grpo`` section.
      layout: the sizes validation derived (micro-batches, packing, forward reuse).
      model: the policy's ModelConfig.
      mesh: the training mesh (updates and scoring).
      sampler: the sampler on its mesh (the training mesh, or ``placement.generate_mesh``);
        its ``prefill_program`` / ``decode_program`` are the generation programs.
      sampling: the sampling parameters (stop ids and pad id from the tokenizer).
      policy, value: the learners (value None for GRPO).
      policy_shardings, value_shardings: their TrainState shardings.
      reference_shardings: the frozen reference's parameter shardings (score rules).
      reward_shardings: the reward model's parameter shardings, or None (a function).
      score: ``(policy_params, ref_params, value_params, rows, scores, kl_coef) -> Scored``.
      reward: ``(rm_params, tokens, mask) -> [N] scores`` of the reward model, or None.
      update: ``(states, LearnerBatch, key, frozen) -> (states, UpdateOutput)``; the states
        tuple is ``(policy,)`` or ``(policy, value)`` and is donated; ``frozen`` holds each
        learner's frozen base (LoRA) or None, in the same order.
      policy_lora, value_lora: the LoRA learners' frozen/trainable layouts (``lora:``), else
        None. A LoRA learner's TrainState holds its trainable part; the score program takes
        its params as ``models.lora.LoraParams``.
      sync: how the LoRA policy reaches the sampler (``weight_sync.AdapterSync``), else None.
    """

    algo: PPOConfig | GRPOConfig
    layout: RunLayout
    model: ModelConfig
    mesh: Mesh
    sampler: Sampler
    sampling: SamplingParams
    policy: steps.Learner
    value: steps.Learner | None
    policy_shardings: TrainState
    value_shardings: TrainState | None
    reference_shardings: Any
    reward_shardings: Any | None
    score: Callable[..., Scored]
    reward: Callable[..., jax.Array] | None
    update: Callable[..., tuple[tuple[TrainState, ...], UpdateOutput]]
    policy_lora: LoraLayout | None = None
    value_lora: LoraLayout | None = None
    sync: AdapterSync | None = None

    def rows(self, ndim: int) -> NamedSharding:
        """Rollout rows split over the training mesh's data shards (score rules)."""
        return steps.batch_sharding(self.mesh, rules_for("policy", "score"), ndim)

    @property
    def state_shardings(self) -> tuple[TrainState, ...]:
        """The update's state shardings, ``(policy,)`` or ``(policy, value)``."""
        return (self.policy_shardings,) + (
            () if self.value_shardings is None else (self.value_shardings,)
        )


@dataclasses.dataclass(frozen=True)
class LearnerSetup:
    """One learner with its TrainState shardings and, for LoRA, its frozen/trainable layout."""

    learner: steps.Learner
    shardings: TrainState
    lora: LoraLayout | None = None

    @property
    def model_shardings(self) -> Any:
        """Shardings of the params its forwards apply (``LoraParams`` with LoRA)."""
        if self.lora is None:
            return self.shardings.params
        return LoraParams(self.lora.frozen_shardings, self.lora.trainable_shardings, None)

    @property
    def abstract_model(self) -> Any:
        """The abstract params its forwards apply (``LoraParams`` with LoRA)."""
        if self.lora is None:
            module = self.learner.module.module
            return model_lib.abstract_params(module.cfg, self.learner.objective.head)
        return LoraParams(self.lora.frozen, self.lora.trainable, None)


def _learner(
    model: ModelConfig,
    mesh: Mesh,
    role: str,
    optimizer_cfg: Any,
    updates: int,
    objective: steps.Objective,
    max_new_tokens: int,
    spec: LoraSpec | None = None,
) -> LearnerSetup:
    """The learner of ``role`` (train rules): its model applied through a RolloutForward that
    packs the objective's ``row_group``; with ``spec``, LoRA adapters are its trainable part."""
    rules, head = rules_for(role, "train"), objective.head
    optimizer, lr_fn = make_optimizer(optimizer_cfg, updates)
    forward = RolloutForward(
        build_sharded(model, mesh, rules, head, spec), max_new_tokens, objective.row_group
    )
    if spec is None:
        param_sh = param_shardings(model, mesh, rules, head)
        abstract, lora, combine = model_lib.abstract_params(model, head), None, None
    else:
        lora = lora_layout(model, mesh, rules, head, spec)
        param_sh, abstract, combine = lora.trainable_shardings, lora.trainable, combine_fn(spec)
    shardings = state_shardings(abstract, param_sh, optimizer, mesh)
    learner = steps.Learner(objective, forward, optimizer, lr_fn, rules, param_sh, combine)
    return LearnerSetup(learner, shardings, lora)


def _learners(
    cfg: RunConfig, layout: RunLayout, model: ModelConfig, mesh: Mesh
) -> tuple[LearnerSetup, LearnerSetup | None]:
    """``(policy, critic or None)``; with ``lora:`` both train adapters."""
    algo, rl, spec = rl_section(cfg), layout.rl, lora_spec(cfg)
    r, group = algo.rollout.max_new_tokens, rl.groups.update
    policy = _learner(
        model,
        mesh,
        "policy",
        cfg.optimizer,
        rl.updates,
        rl_steps.policy_objective(algo.loss, group),
        r,
        spec,
    )
    if not isinstance(algo, PPOConfig):
        return policy, None
    critic_opt = cfg.optimizer
    if algo.critic_lr is not None:
        critic_opt = dataclasses.replace(cfg.optimizer, lr=algo.critic_lr)
    gae = rl_steps.GaeConfig(algo.gamma, algo.lam, algo.whiten_advantages)
    value = _learner(
        model,
        mesh,
        "value",
        critic_opt,
        rl.updates,
        rl_steps.value_objective(algo.value_clip, algo.loss.aggregation, group, gae),
        r,
        spec,
    )
    return policy, value


def _reward_program(
    reward_model: ModelConfig, layout: RunLayout, r: int, mesh: Mesh
) -> tuple[Callable[..., jax.Array], Any]:
    """The jitted reward-model scoring and the reward model's parameter shardings."""
    rm_rules, score_rules = rules_for("reward", "score"), rules_for("policy", "score")
    forward = RolloutForward(
        build_sharded(reward_model, mesh, rm_rules, "scalar"), r, layout.rl.groups.score
    )
    params_sh = param_shardings(reward_model, mesh, rm_rules, "scalar")
    rows2 = steps.batch_sharding(mesh, score_rules, 2)
    program = jax.jit(
        functools.partial(
            reward_model_scores,
            forward,
            num_micro=layout.rl.score_micro,
            mesh=mesh,
            rules=score_rules,
        ),
        in_shardings=(params_sh, rows2, rows2),
        out_shardings=steps.batch_sharding(mesh, score_rules, 1),
    )
    return program, params_sh


def _score_program(
    scoring: Scoring,
    cfg: RunConfig,
    model: ModelConfig,
    shardings: tuple[Any, Any, Any],
    abstract_models: tuple[Any, Any],
) -> Callable[..., Scored]:
    """``scoring`` jitted with its shardings: the three models' parameters as given, rollout
    rows over the data shards, the scalars replicated; the outputs' per-token arrays like
    the rows, the metrics replicated. ``abstract_models``: the policy's and critic's (None)
    abstract params as the forwards apply them."""
    mesh, rules = scoring.mesh, scoring.rules
    rows2, rows1 = steps.batch_sharding(mesh, rules, 2), steps.batch_sharding(mesh, rules, 1)
    replicated = NamedSharding(mesh, P())
    r = scoring.algo.rollout
    n, t = r.rows, cfg.data.max_prompt_length + r.max_new_tokens
    rows = RolloutRows(
        tokens=jax.ShapeDtypeStruct((n, t), jnp.int32),
        mask=jax.ShapeDtypeStruct((n, t), bool),
        response_mask=jax.ShapeDtypeStruct((n, t), bool),
    )
    abstract = jax.eval_shape(
        scoring,
        abstract_models[0],
        model_lib.abstract_params(model),
        abstract_models[1],
        rows,
        jax.ShapeDtypeStruct((n,), jnp.float32),
        jax.ShapeDtypeStruct((), jnp.float32),
    )
    out = jax.tree.map(lambda _: rows2, abstract.replace(metrics={}))
    return jax.jit(
        scoring,
        in_shardings=(*shardings, RolloutRows(rows2, rows2, rows2), rows1, replicated),
        out_shardings=out.replace(metrics=replicated),
    )


def build_rl_programs(
    cfg: RunConfig,
    layout: RunLayout,
    model: ModelConfig,
    mesh: Mesh,
    generate_mesh: Mesh,
    sampling: SamplingParams,
    *,
    reward_model: ModelConfig | None = None,
    matmul_block: int | None = None,
) -> RLPrograms:
    """Jits every program of an RL run.

    Args:
      cfg: the run config (``algorithm: ppo | grpo``).
      layout: ``config.validate``'s result for ``cfg`` on these meshes.
      model: the policy's (and reference's, critic's) ModelConfig.
      mesh: the training mesh; ``generate_mesh``: the sampler's (may be ``mesh``).
      sampling: the sampling parameters the sampler's programs are compiled for.
      reward_model: the reward model's architecture when ``reward.model_dir`` is set.
      matmul_block: the sampler's decode weight blocks (None: the platform's choice).
    """
    algo, rl = rl_section(cfg), layout.rl
    r, groups = algo.rollout.max_new_tokens, rl.groups
    policy_setup, value_setup = _learners(cfg, layout, model, mesh)
    policy, policy_sh = policy_setup.learner, policy_setup.shardings
    value = None if value_setup is None else value_setup.learner
    value_sh = None if value_setup is None else value_setup.shardings
    score_rules = rules_for("policy", "score")
    # The reference is the frozen model without adapters: with LoRA, the policy's own base.
    ref_sh = param_shardings(model, mesh, rules_for("reference", "score"))
    if policy_setup.lora is not None:
        ref_sh = policy_setup.lora.frozen_shardings
    # Old log-probs and values come from the learners' own (train-rule) modules, so the first
    # minibatch's forward is the scoring forward's computation (its ratio is 1).
    scoring = Scoring(
        algo=algo,
        reference=RolloutForward(
            build_sharded(model, mesh, rules_for("reference", "score"), "lm"), r, groups.score
        ),
        policy=None
        if rl.reuse_policy_forward
        else dataclasses.replace(policy.module, group_size=groups.score),
        value=None
        if value is None or rl.reuse_value_forward
        else dataclasses.replace(value.module, group_size=groups.score),
        has_critic=value is not None,
        num_micro=rl.score_micro,
        mesh=mesh,
        rules=score_rules,
    )
    replicated = NamedSharding(mesh, P())
    rows2 = steps.batch_sharding(mesh, score_rules, 2)
    setups = (policy_setup,) + (() if value_setup is None else (value_setup,))
    learners = tuple(s.learner for s in setups)
    state_sh = tuple(s.shardings for s in setups)
    frozen_sh = tuple(None if s.lora is None else s.lora.frozen_shardings for s in setups)
    update = jax.jit(
        functools.partial(
            rl_steps.rl_update,
            learners=learners,
            epochs=algo.loss.epochs,
            num_minibatches=algo.loss.num_minibatches,
            num_micro=rl.num_micro,
            mesh=mesh,
        ),
        in_shardings=(state_sh, None, replicated, frozen_sh),
        out_shardings=(state_sh, UpdateOutput(metrics=replicated, outputs=rows2)),
        donate_argnums=0,  # the old states' buffers are reused for the new ones
    )
    reward = reward_sh = None
    if reward_model is not None:
        reward, reward_sh = _reward_program(reward_model, layout, r, mesh)
    sampler = Sampler(model, generate_mesh, matmul_block=matmul_block)
    sync = None
    if policy_setup.lora is not None:
        sync = AdapterSync.build(policy_setup.lora, sampler, cfg.lora.sync)
    return RLPrograms(
        algo=algo,
        layout=layout,
        model=model,
        mesh=mesh,
        sampler=sampler,
        sampling=sampling,
        policy=policy,
        value=value,
        policy_shardings=policy_sh,
        value_shardings=value_sh,
        reference_shardings=ref_sh,
        reward_shardings=reward_sh,
        score=_score_program(
            scoring,
            cfg,
            model,
            (
                policy_setup.model_shardings,
                ref_sh,
                None if value_setup is None else value_setup.model_shardings,
            ),
            (
                policy_setup.abstract_model,
                None if value_setup is None else value_setup.abstract_model,
            ),
        ),
        reward=reward,
        update=update,
        policy_lora=policy_setup.lora,
        value_lora=None if value_setup is None else value_setup.lora,
        sync=sync,
    )
