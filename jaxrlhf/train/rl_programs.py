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
from jaxrlhf.generation.engine import Engine
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.scoring import RolloutForward
from jaxrlhf.rewards.model import reward_model_scores
from jaxrlhf.sharding import rules_for
from jaxrlhf.sharding.micro_batches import map_micro
from jaxrlhf.sharding.model_sharding import build_sharded, param_shardings
from jaxrlhf.sharding.rules import Rules
from jaxrlhf.train import rl_steps, steps
from jaxrlhf.train.optim import make_optimizer
from jaxrlhf.train.rl_config import GRPOConfig, PPOConfig
from jaxrlhf.train.rl_types import RolloutRows, Scored, UpdateOutput
from jaxrlhf.train.state import TrainState, state_shardings


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
        out = self.forwards(policy_params, ref_params, value_params, rows)
        return self.advantages(out, rows.response_mask, scores, kl_coef)

    def advantages(
        self,
        out: Scored,
        response_mask: jax.Array,
        scores: jax.Array,
        kl_coef: jax.Array,
    ) -> Scored:
        """The forwards' ``out`` of the whole rollout completed with the advantages (and
        returns, or per-token rewards) from ``scores`` [N] under ``kl_coef`` []."""
        algo, resp = self.algo, response_mask
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
      score_forwards: ``(policy_params, ref_params, value_params, rows) -> Scored`` of the
        forwards alone (reference, old policy, critic) on any whole groups of rows: what
        streaming runs on finished groups while the tail decodes.
      score_advantages: ``(forwards, response_mask, scores, kl_coef) -> Scored``: the rest
        of ``score`` once the whole rollout's forwards are in.
      reward: ``(rm_params, tokens, mask) -> [N] scores`` of the reward model, or None.
      update: ``(states, LearnerBatch, key) -> (states, UpdateOutput)``; the states tuple is
        ``(policy,)`` or ``(policy, value)`` and is donated.
      critic_mesh: ``placement.strategy: interleaved``: the critic's own mesh (its learner,
        value forward and update live there; ``update`` is then the policy's alone), else
        None.
      score_values: interleaved: ``(value_params, rows) -> [N, T]`` values on the critic mesh.
      update_value: interleaved: the critic's ``update`` on its mesh (same shuffling key,
        same minibatches: the joint update's math).
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
    score_forwards: Callable[..., Scored]
    score_advantages: Callable[..., Scored]
    reward: Callable[..., jax.Array] | None
    update: Callable[..., tuple[tuple[TrainState, ...], UpdateOutput]]
    engine: Engine | None = None
    critic_mesh: Mesh | None = None
    score_values: Callable[..., jax.Array] | None = None
    update_value: Callable[..., tuple[tuple[TrainState, ...], UpdateOutput]] | None = None

    def critic_rows(self, ndim: int) -> NamedSharding:
        """Rollout rows split over the critic mesh's data shards (``interleaved``)."""
        return steps.batch_sharding(self.critic_mesh, rules_for("value", "score"), ndim)

    def rows(self, ndim: int) -> NamedSharding:
        """Rollout rows split over the training mesh's data shards (score rules)."""
        return steps.batch_sharding(self.mesh, rules_for("policy", "score"), ndim)

    @property
    def state_shardings(self) -> tuple[TrainState, ...]:
        """The update's state shardings, ``(policy,)`` or ``(policy, value)``."""
        return (self.policy_shardings,) + (
            () if self.value_shardings is None else (self.value_shardings,)
        )


def _learner(
    model: ModelConfig,
    mesh: Mesh,
    role: str,
    head: str,
    optimizer_cfg: Any,
    updates: int,
    objective: steps.Objective,
    max_new_tokens: int,
) -> tuple[steps.Learner, TrainState]:
    """The learner of ``role`` (train rules): its model applied through a RolloutForward that
    packs the objective's ``row_group``."""
    rules = rules_for(role, "train")
    param_sh = param_shardings(model, mesh, rules, head)
    optimizer, lr_fn = make_optimizer(optimizer_cfg, updates)
    shardings = state_shardings(model_lib.abstract_params(model, head), param_sh, optimizer, mesh)
    forward = RolloutForward(
        build_sharded(model, mesh, rules, head), max_new_tokens, objective.row_group
    )
    learner = steps.Learner(objective, forward, optimizer, lr_fn, rules, param_sh)
    return learner, shardings


def _learners(
    cfg: RunConfig, layout: RunLayout, model: ModelConfig, mesh: Mesh, critic_mesh: Mesh
) -> tuple[steps.Learner, TrainState, steps.Learner | None, TrainState | None]:
    """``(policy, its state shardings, critic or None, its shardings or None)``; the critic
    on ``critic_mesh``."""
    algo, rl = rl_section(cfg), layout.rl
    r, group = algo.rollout.max_new_tokens, rl.groups.update
    policy, policy_sh = _learner(
        model,
        mesh,
        "policy",
        "lm",
        cfg.optimizer,
        rl.updates,
        rl_steps.policy_objective(algo.loss, group),
        r,
    )
    if not isinstance(algo, PPOConfig):
        return policy, policy_sh, None, None
    critic_opt = cfg.optimizer
    if algo.critic_lr is not None:
        critic_opt = dataclasses.replace(cfg.optimizer, lr=algo.critic_lr)
    gae = rl_steps.GaeConfig(algo.gamma, algo.lam, algo.whiten_advantages)
    value, value_sh = _learner(
        model,
        critic_mesh,
        "value",
        "scalar",
        critic_opt,
        rl.updates,
        rl_steps.value_objective(algo.value_clip, algo.loss.aggregation, group, gae),
        r,
    )
    return policy, policy_sh, value, value_sh


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
) -> Callable[..., Scored]:
    """``scoring`` jitted with its shardings: the three models' parameters as given, rollout
    rows over the data shards, the scalars replicated; the outputs' per-token arrays like
    the rows, the metrics replicated."""
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
    lm, critic = model_lib.abstract_params(model), model_lib.abstract_params(model, "scalar")
    abstract = jax.eval_shape(
        scoring,
        lm,
        lm,
        critic if scoring.has_critic else None,
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
    critic_mesh: Mesh | None = None,
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
      critic_mesh: the critic's own mesh (``interleaved``); None: ``mesh``.
    """
    algo, rl = rl_section(cfg), layout.rl
    r, groups = algo.rollout.max_new_tokens, rl.groups
    apart = critic_mesh is not None
    policy, policy_sh, value, value_sh = _learners(cfg, layout, model, mesh, critic_mesh or mesh)
    score_rules = rules_for("policy", "score")
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
        if value is None or rl.reuse_value_forward or apart
        else dataclasses.replace(value.module, group_size=groups.score),
        has_critic=value is not None,
        num_micro=rl.score_micro,
        mesh=mesh,
        rules=score_rules,
    )
    rows2 = steps.batch_sharding(mesh, score_rules, 2)
    together = value is not None and not apart
    learners = (policy,) + ((value,) if together else ())
    state_sh = (policy_sh,) + ((value_sh,) if together else ())
    update = _update_program(algo, rl, learners, state_sh, mesh)
    score_values = update_value = None
    if apart:
        critic_rows2 = steps.batch_sharding(critic_mesh, rules_for("value", "score"), 2)
        forward = dataclasses.replace(value.module, group_size=groups.score)
        score_values = jax.jit(
            lambda params, rows: map_micro(
                lambda r: forward.values(params, r.tokens, r.mask),
                rows,
                rl.score_micro,
                critic_mesh,
                rules_for("value", "score"),
                groups.score,
            ),
            in_shardings=(value_sh.params, RolloutRows(*(critic_rows2,) * 3)),
            out_shardings=critic_rows2,
        )
        update_value = _update_program(algo, rl, (value,), (value_sh,), critic_mesh)
    reward = reward_sh = None
    if reward_model is not None:
        reward, reward_sh = _reward_program(reward_model, layout, r, mesh)
    params_sh = (
        policy_sh.params,
        param_shardings(model, mesh, rules_for("reference", "score")),
        None if value_sh is None or apart else value_sh.params,
    )
    sampler = Sampler(model, generate_mesh, matmul_block=matmul_block)
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
        reference_shardings=param_shardings(model, mesh, rules_for("reference", "score")),
        reward_shardings=reward_sh,
        score=_score_program(scoring, cfg, model, params_sh),
        score_forwards=jax.jit(
            scoring.forwards,
            in_shardings=(*params_sh, RolloutRows(rows2, rows2, rows2)),
            out_shardings=rows2,
        ),
        score_advantages=jax.jit(scoring.advantages),
        reward=reward,
        update=update,
        engine=_engine(algo, sampler),
        critic_mesh=critic_mesh,
        score_values=score_values,
        update_value=update_value,
    )


def _update_program(
    algo: PPOConfig | GRPOConfig,
    rl: Any,
    learners: tuple[steps.Learner, ...],
    state_sh: tuple[TrainState, ...],
    mesh: Mesh,
) -> Callable[..., tuple[tuple[TrainState, ...], UpdateOutput]]:
    """The jitted ``rl_update`` of ``learners`` on ``mesh``, their states donated."""
    replicated = NamedSharding(mesh, P())
    rows2 = steps.batch_sharding(mesh, rules_for("policy", "score"), 2)
    return jax.jit(
        functools.partial(
            rl_steps.rl_update,
            learners=learners,
            epochs=algo.loss.epochs,
            num_minibatches=algo.loss.num_minibatches,
            num_micro=rl.num_micro,
            mesh=mesh,
        ),
        in_shardings=(state_sh, None, replicated),
        out_shardings=(state_sh, UpdateOutput(metrics=replicated, outputs=rows2)),
        donate_argnums=0,  # the old states' buffers are reused for the new ones
    )


def _engine(algo: PPOConfig | GRPOConfig, sampler: Sampler) -> Engine | None:
    """The rollout engine of ``rollout.engine: continuous`` (its slots default to every row
    the iteration starts)."""
    r = algo.rollout
    if r.engine != "continuous":
        return None
    slots = r.slots or r.started_prompts * r.num_samples
    return Engine(sampler, slots=slots, chunk=r.chunk_tokens)
