"""The jitted programs of an RL run (``algorithm: ppo | grpo``), built once from the config,
the meshes and abstract shapes: no parameters, data or devices are touched.

One iteration, each arrow one of these programs with its own shardings::

    policy params --reshard--> sampler.prefill_program / decode_program --> Rollout (host)
        --> reward (reward model, or a function on the host)
        --> score: reference (and old-policy, critic) forwards + advantages --> Scored
        --> update: epochs x minibatches of policy (and critic) steps --> new states

:class:`RLPrograms` holds them; the trainer (``rl_trainer``) runs them on real arrays, the dry
run (``dry_run_phases``) lowers and compiles the same objects against ``ShapeDtypeStruct``
arguments. Packing prompt groups (``rollout.shared_prefix``) and packing sequences by
their real lengths (``rollout.pack_sequences``) are decided here, by the
:class:`~jaxrlhf.models.scoring.RolloutForward` each program applies its models through.
A sequence-packed program takes its rows' plan with the rows and the packed size as its
last (static) argument; :class:`~jaxrlhf.train.rl_packing.PackingPlanner` makes both on
the host (``RLPrograms.planner``), and the programs compile once per packed size.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf import losses
from jaxrlhf.config import RunConfig, RunLayout, rl_section
from jaxrlhf.generation import Sampler, SamplingParams
from jaxrlhf.generation.engine import Engine
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.packing import PackedShape, RowPacking
from jaxrlhf.models.scoring import RolloutForward
from jaxrlhf.rewards.model import reward_model_scores
from jaxrlhf.sharding import rules_for
from jaxrlhf.sharding.distributed import put_global, to_host
from jaxrlhf.sharding.micro_batches import map_micro
from jaxrlhf.sharding.model_sharding import build_sharded, param_shardings
from jaxrlhf.sharding.rules import Rules
from jaxrlhf.train import rl_steps, steps
from jaxrlhf.train.optim import make_optimizer
from jaxrlhf.train.rl_config import GRPOConfig, PPOConfig
from jaxrlhf.train.rl_packing import PackingPlanner
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
    ``row_group``: the rows each scoring micro-batch keeps together (prompt groups).
    """

    algo: PPOConfig | GRPOConfig
    reference: RolloutForward
    policy: RolloutForward | None  # None: reuse_policy_forward
    value: RolloutForward | None  # None: GRPO, or reuse_value_forward
    has_critic: bool
    num_micro: int
    row_group: int
    mesh: Mesh
    rules: Rules

    def forwards(
        self,
        policy_params: Any,
        ref_params: Any,
        value_params: Any,
        rows: RolloutRows,
        packed_rows: int | None = None,
    ) -> Scored:
        """The scoring forwards, ``num_micro`` micro-batches of whole groups at a time;
        sequence-packed forwards pack into ``packed_rows`` rows per shard (static; None: the
        rows run unpacked, and ``rows.packing`` is None)."""
        scoring = self.with_packed_rows(packed_rows)

        def run(r: RolloutRows) -> Scored:
            ref, _ = scoring.reference.logprobs(ref_params, r.tokens, r.mask, r.packing)
            old = values = None
            if scoring.policy is not None:
                old, _ = scoring.policy.logprobs(policy_params, r.tokens, r.mask, r.packing)
            if scoring.value is not None:
                values = scoring.value.values(value_params, r.tokens, r.mask, r.packing)
            return Scored(ref_logprobs=ref, old_logprobs=old, old_values=values)

        return map_micro(run, rows, self.num_micro, self.mesh, self.rules, self.row_group)

    def with_packed_rows(self, rows: int | None) -> Scoring:
        """These forwards packing sequences into ``rows`` packed rows per shard, or (None)
        not packing sequences."""

        def packed(forward: RolloutForward | None) -> RolloutForward | None:
            return None if forward is None else forward.with_packed_rows(rows)

        return dataclasses.replace(
            self,
            reference=packed(self.reference),
            policy=packed(self.policy),
            value=packed(self.value),
        )

    def __call__(
        self,
        policy_params: Any,
        ref_params: Any,
        value_params: Any,
        rows: RolloutRows,
        scores: jax.Array,
        kl_coef: jax.Array,
        packed_rows: int | None = None,
    ) -> Scored:
        """``rows`` [N, T] with their ``scores`` [N] (shaped) scored under ``kl_coef`` [];
        sequence-packed forwards pack into ``packed_rows`` rows per shard (static)."""
        out = self.forwards(policy_params, ref_params, value_params, rows, packed_rows)
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
      score: ``(policy_params, ref_params, value_params, rows, scores, kl_coef,
        packed_rows) -> Scored``.
      score_forwards: ``(policy_params, ref_params, value_params, rows, packed_rows) ->
        Scored`` of the forwards alone (reference, old policy, critic) on any whole groups of
        rows: what streaming runs on finished groups while the tail decodes (sequence-packed
        like ``score``, by the planner's plan of those rows).
      score_advantages: ``(forwards, response_mask, scores, kl_coef) -> Scored``: the rest
        of ``score`` once the whole rollout's forwards are in.
      reward: ``(rm_params, tokens, mask, packing, packed_rows) -> [N] scores`` of the
        reward model, or None.
      update: ``(states, LearnerBatch, key, packed_rows) -> (states, UpdateOutput)``; the
        states tuple is ``(policy,)`` or ``(policy, value)`` and is donated.
      planner: the host plans of the sequence-packed programs; a program that does not
        pack takes ``packing`` (in the rows) and ``packed_rows`` None.
      engine: the rollout engine (``rollout.engine: continuous``), or None.
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
    planner: PackingPlanner
    engine: Engine | None = None

    def rows(self, ndim: int) -> NamedSharding:
        """Rollout rows split over the training mesh's data shards (score rules)."""
        return steps.batch_sharding(self.mesh, rules_for("policy", "score"), ndim)

    def put_rows(self, tree: Any) -> Any:
        """A host pytree of ``[N, ...]`` rows on the training mesh, split like the rows."""
        return put_global(tree, jax.tree.map(lambda x: self.rows(np.ndim(x)), tree))

    def reward_scores(self, rm_params: Any, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """[N] the reward model's scores of the host rows (packed as scoring packs)."""
        plan = self.planner.score(tokens, mask)
        args = self.put_rows((tokens, mask, None if plan is None else plan.packing))
        return to_host(self.reward(rm_params, *args, None if plan is None else plan.rows))

    @property
    def state_shardings(self) -> tuple[TrainState, ...]:
        """The update's state shardings, ``(policy,)`` or ``(policy, value)``."""
        return (self.policy_shardings,) + (
            () if self.value_shardings is None else (self.value_shardings,)
        )


def _forward(module: Any, max_new_tokens: int, group: int, packed: int, shards: int):
    """A phase's RolloutForward: packing prompt groups of ``group`` rows, and, where the
    phase may pack sequences (``packed`` rows per shard), their largest packed shape (each
    call picks its size, or none)."""
    shape = PackedShape(shards, packed) if packed else None
    return RolloutForward(module, max_new_tokens, group, shape)


def _learner(
    model: ModelConfig,
    mesh: Mesh,
    role: str,
    head: str,
    optimizer_cfg: Any,
    updates: int,
    objective: steps.Objective,
    max_new_tokens: int,
    layout: RunLayout,
) -> tuple[steps.Learner, TrainState]:
    """The learner of ``role`` (train rules): its model applied through a RolloutForward that
    packs the update's sequences, or else the objective's ``row_group``."""
    rules = rules_for(role, "train")
    param_sh = param_shardings(model, mesh, rules, head)
    optimizer, lr_fn = make_optimizer(optimizer_cfg, updates)
    shardings = state_shardings(model_lib.abstract_params(model, head), param_sh, optimizer, mesh)
    forward = _forward(
        build_sharded(model, mesh, rules, head),
        max_new_tokens,
        objective.row_group,
        layout.rl.packing.update,
        layout.data_shards,
    )
    learner = steps.Learner(objective, forward, optimizer, lr_fn, rules, param_sh)
    return learner, shardings


def _learners(
    cfg: RunConfig, layout: RunLayout, model: ModelConfig, mesh: Mesh
) -> tuple[steps.Learner, TrainState, steps.Learner | None, TrainState | None]:
    """``(policy, its state shardings, critic or None, its shardings or None)``."""
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
        layout,
    )
    if not isinstance(algo, PPOConfig):
        return policy, policy_sh, None, None
    critic_opt = cfg.optimizer
    if algo.critic_lr is not None:
        critic_opt = dataclasses.replace(cfg.optimizer, lr=algo.critic_lr)
    gae = rl_steps.GaeConfig(algo.gamma, algo.lam, algo.whiten_advantages)
    value, value_sh = _learner(
        model,
        mesh,
        "value",
        "scalar",
        critic_opt,
        rl.updates,
        rl_steps.value_objective(algo.value_clip, algo.loss.aggregation, group, gae),
        r,
        layout,
    )
    return policy, policy_sh, value, value_sh


def _reward_program(
    reward_model: ModelConfig, layout: RunLayout, r: int, mesh: Mesh
) -> tuple[Callable[..., jax.Array], Any]:
    """The jitted reward-model scoring and the reward model's parameter shardings."""
    rm_rules, score_rules = rules_for("reward", "score"), rules_for("policy", "score")
    rl = layout.rl
    forward = _forward(
        build_sharded(reward_model, mesh, rm_rules, "scalar"),
        r,
        rl.groups.score,
        rl.packing.score,
        layout.data_shards,
    )
    params_sh = param_shardings(reward_model, mesh, rm_rules, "scalar")
    rows2 = steps.batch_sharding(mesh, score_rules, 2)
    rows1 = steps.batch_sharding(mesh, score_rules, 1)
    program = jax.jit(
        functools.partial(
            reward_model_scores,
            forward,
            num_micro=rl.score_micro,
            mesh=mesh,
            rules=score_rules,
            group_size=rl.groups.score,
        ),
        in_shardings=(params_sh, rows2, rows2, None),  # a plan (or None) comes placed
        out_shardings=rows1,
        static_argnums=4,  # packed_rows
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
    packing = scoring.reference.packing
    length = cfg.data.max_prompt_length + r.max_new_tokens
    rows = abstract_rows(r.rows, length, packed=packing is not None)
    lm, critic = model_lib.abstract_params(model), model_lib.abstract_params(model, "scalar")
    abstract = jax.eval_shape(
        functools.partial(scoring, packed_rows=None if packing is None else packing.rows),
        lm,
        lm,
        critic if scoring.has_critic else None,
        rows,
        jax.ShapeDtypeStruct((r.rows,), jnp.float32),
        jax.ShapeDtypeStruct((), jnp.float32),
    )
    out = jax.tree.map(lambda _: rows2, abstract.replace(metrics={}))
    row_sh = RolloutRows(rows2, rows2, rows2, None)  # a plan (or None) comes placed
    return jax.jit(
        scoring,
        in_shardings=(*shardings, row_sh, rows1, replicated),
        out_shardings=out.replace(metrics=replicated),
        static_argnums=6,  # packed_rows
    )


def abstract_rows(rows: int, length: int, packed: bool) -> RolloutRows:
    """``RolloutRows`` of ``rows x length`` as ShapeDtypeStructs, with a plan when the
    scoring forwards pack sequences (``packed``)."""
    plan = None
    if packed:
        plan = RowPacking(*(jax.ShapeDtypeStruct((rows,), jnp.int32) for _ in range(3)))
    return RolloutRows(
        tokens=jax.ShapeDtypeStruct((rows, length), jnp.int32),
        mask=jax.ShapeDtypeStruct((rows, length), bool),
        response_mask=jax.ShapeDtypeStruct((rows, length), bool),
        packing=plan,
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
    policy, policy_sh, value, value_sh = _learners(cfg, layout, model, mesh)
    score_rules = rules_for("policy", "score")

    def scoring_forward(module: Any) -> RolloutForward:
        return _forward(module, r, groups.score, rl.packing.score, layout.data_shards)

    # Old log-probs and values come from the learners' own (train-rule) modules, so the first
    # minibatch's forward is the scoring forward's computation (its ratio is 1).
    scoring = Scoring(
        algo=algo,
        reference=scoring_forward(
            build_sharded(model, mesh, rules_for("reference", "score"), "lm")
        ),
        policy=None if rl.reuse_policy_forward else scoring_forward(policy.module.module),
        value=None
        if value is None or rl.reuse_value_forward
        else scoring_forward(value.module.module),
        has_critic=value is not None,
        num_micro=rl.score_micro,
        row_group=groups.score,
        mesh=mesh,
        rules=score_rules,
    )
    replicated = NamedSharding(mesh, P())
    rows2 = steps.batch_sharding(mesh, score_rules, 2)
    learners = (policy,) + (() if value is None else (value,))
    state_sh = (policy_sh,) + (() if value_sh is None else (value_sh,))
    update = jax.jit(
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
        static_argnums=3,  # packed_rows
    )
    reward = reward_sh = None
    if reward_model is not None:
        reward, reward_sh = _reward_program(reward_model, layout, r, mesh)
    params_sh = (
        policy_sh.params,
        param_shardings(model, mesh, rules_for("reference", "score")),
        None if value_sh is None else value_sh.params,
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
            in_shardings=(*params_sh, RolloutRows(rows2, rows2, rows2, None)),
            out_shardings=rows2,
            static_argnums=4,  # packed_rows
        ),
        score_advantages=jax.jit(scoring.advantages),
        reward=reward,
        update=update,
        planner=PackingPlanner.of(algo, rl, layout.data_shards, cfg.data.max_prompt_length),
        engine=_engine(algo, sampler),
    )


def _engine(algo: PPOConfig | GRPOConfig, sampler: Sampler) -> Engine | None:
    """The rollout engine of ``rollout.engine: continuous`` (its slots default to every row
    the iteration starts)."""
    r = algo.rollout
    if r.engine != "continuous":
        return None
    slots = r.slots or r.started_prompts * r.num_samples
    return Engine(sampler, slots=slots, chunk=r.chunk_tokens)
