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
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.config import RunConfig, RunLayout, rl_section
from jaxrlhf.generation import Sampler, SamplingParams
from jaxrlhf.generation.engine import Engine
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.lora import combine
from jaxrlhf.models.precision import compute_dtype_params
from jaxrlhf.models.scoring import RolloutForward
from jaxrlhf.rewards.model import reward_model_scores
from jaxrlhf.sharding import rules_for
from jaxrlhf.sharding.distributed import put_global, to_host
from jaxrlhf.sharding.micro_batches import map_micro
from jaxrlhf.sharding.model_sharding import build_sharded, param_shardings
from jaxrlhf.sharding.rules import TRAIN
from jaxrlhf.train import rl_steps, steps
from jaxrlhf.train.adapters import LoraLayout
from jaxrlhf.train.hydra_setup import HEADS as HYDRA_HEADS
from jaxrlhf.train.hydra_setup import HydraLayout, HydraSync, hydra_forward
from jaxrlhf.train.rl_config import GRPOConfig, PPOConfig, RLLayout
from jaxrlhf.train.rl_learners import LearnerSetup, learners
from jaxrlhf.train.rl_packing import PackingPlanner
from jaxrlhf.train.rl_scoring import Scoring, phase_forward, score_program
from jaxrlhf.train.rl_types import RolloutRows, Scored, UpdateOutput
from jaxrlhf.train.state import TrainState
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
      update: ``(states, LearnerBatch, key, frozen, packed_rows) -> (states,
        UpdateOutput)``; the states tuple is ``(policy,)`` or ``(policy, value)`` and is
        donated; ``frozen`` holds each learner's frozen part (LoRA base, Hydra trunk) or
        None, in the same order.
      planner: the host plans of the sequence-packed programs; a program that does not
        pack takes ``packing`` (in the rows) and ``packed_rows`` None.
      policy_lora, value_lora: the LoRA learners' frozen/trainable layouts (``lora:``), else
        None. A LoRA learner's TrainState holds its trainable part; the score program takes
        its params as ``models.lora.LoraParams``.
      sync: how a LoRA or Hydra policy reaches the sampler (``weight_sync.AdapterSync``,
        ``hydra_setup.HydraSync``), else None (the policy's params are resharded).
      hydra: the Hydra model's parts (``ppo.value.branch_layer``), else None; both learners'
        frozen part is then its trunk.
      reference_abstract: the reference's abstract params.
      engine: the rollout engine (``rollout.engine: continuous``), else None.
      critic_mesh: ``placement.strategy: interleaved``: the critic's own mesh (its learner,
        value forward and update live there; ``update`` is then the policy's alone), else
        None.
      score_values: interleaved: ``(value_params, rows, packed_rows) -> [N, T]`` values on
        the critic mesh (rows sequence-packed by scoring's plan, like ``score``).
      update_value: interleaved: the critic's ``update`` on its mesh (same shuffling key,
        same minibatches, same packing plan: the joint update's math).
      reference_apart: ``placement.reference: sampler | own``: ``(ref_params, rows,
        packed_rows) -> [N, T]`` the reference's log-probs on ``reference_mesh`` (rows
        sequence-packed by ``reference_planner``'s scoring plan), else None; ``score`` then
        reads them from the rows.
      reference_apart_shardings: the reference's parameter shardings on ``reference_mesh``.
      reference_planner: that reference forward's packing plans (its mesh's data shards).
      reference_mesh: where ``reference_apart`` runs: the sampler's mesh (``sampler``) or
        the reference group's (``own``); None: the reference is scored with the learner.
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
    policy_lora: LoraLayout | None = None
    value_lora: LoraLayout | None = None
    sync: AdapterSync | HydraSync | None = None
    hydra: HydraLayout | None = None
    reference_abstract: Any = None
    engine: Engine | None = None
    critic_mesh: Mesh | None = None
    score_values: Callable[..., jax.Array] | None = None
    update_value: Callable[..., tuple[tuple[TrainState, ...], UpdateOutput]] | None = None
    reference_apart: Callable[..., jax.Array] | None = None
    reference_apart_shardings: Any = None
    reference_planner: PackingPlanner | None = None
    reference_mesh: Mesh | None = None

    def reference_rows(self, ndim: int) -> NamedSharding:
        """Rollout rows split over ``reference_mesh``'s data shards (score rules)."""
        return steps.batch_sharding(self.reference_mesh, rules_for("policy", "score"), ndim)

    def reference_apart_logprobs(self, ref_params: Any, tokens: Any, mask: Any) -> np.ndarray:
        """[N, T] the reference's log-probs of the host rows on ``reference_mesh``
        (``ref_params`` placed there), packed as its planner plans, back on the host."""
        plan = self.reference_planner.score(tokens, mask)
        rows = RolloutRows(tokens, mask, mask, None if plan is None else plan.packing)
        rows = put_global(rows, jax.tree.map(lambda x: self.reference_rows(np.ndim(x)), rows))
        return to_host(self.reference_apart(ref_params, rows, plan and plan.rows))

    def critic_rows(self, ndim: int) -> NamedSharding:
        """Rollout rows split over the critic mesh's data shards (``interleaved``)."""
        return steps.batch_sharding(self.critic_mesh, rules_for("value", "score"), ndim)

    def put_critic_rows(self, tree: Any) -> Any:
        """A pytree of ``[N, ...]`` rows (host or device) on the critic mesh."""
        return jax.device_put(tree, jax.tree.map(lambda x: self.critic_rows(np.ndim(x)), tree))

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


def _reward_program(
    reward_model: ModelConfig, layout: RunLayout, r: int, mesh: Mesh
) -> tuple[Callable[..., jax.Array], Any]:
    """The jitted reward-model scoring and the reward model's parameter shardings."""
    rm_rules, score_rules = rules_for("reward", "score"), rules_for("policy", "score")
    rl = layout.rl
    forward = phase_forward(
        RolloutForward(build_sharded(reward_model, mesh, rm_rules, "scalar"), r),
        rl.groups.score,
        rl.packing.score,
        layout.data_shards,
    )
    params_sh = param_shardings(reward_model, mesh, rm_rules, "scalar")
    rows2 = steps.batch_sharding(mesh, score_rules, 2)
    rows1 = steps.batch_sharding(mesh, score_rules, 1)

    def scores(
        params: Any, tokens: jax.Array, mask: jax.Array, plan: Any, packed_rows: int | None
    ) -> jax.Array:
        return reward_model_scores(
            forward,
            params,
            tokens,
            mask,
            plan,
            packed_rows,
            num_micro=rl.score_micro_of(tokens.shape[0]),  # the rollout, or a streamed batch
            mesh=mesh,
            rules=score_rules,
            group_size=rl.groups.score,
        )

    program = jax.jit(
        scores,
        in_shardings=(params_sh, rows2, rows2, None),  # a plan (or None) comes placed
        out_shardings=rows1,
        static_argnums=4,  # packed_rows
    )
    return program, params_sh


def _reference(
    model: ModelConfig,
    mesh: Mesh,
    policy: LearnerSetup,
    hydra: HydraLayout | None,
    r: int,
) -> tuple[RolloutForward, Any, Any]:
    """``(forward, shardings, abstract params)`` of the frozen reference: the plain model in
    its compute dtype (``rl_setup.initial_states``; with LoRA: the policy's own base), or
    for a Hydra critic the trunk with a frozen copy of the policy's initial branch."""
    rules = rules_for("reference", "score")
    if hydra is not None:
        forward = hydra_forward(model, mesh, rules, hydra.branch_layer, ("lm",), r, 1)
        shardings = combine(hydra.trunk_shardings, hydra.policy_shardings)
        return forward, shardings, combine(hydra.trunk, hydra.policy)
    forward = RolloutForward(build_sharded(model, mesh, rules, "lm"), r)
    if policy.lora is not None:
        return forward, policy.lora.frozen_shardings, policy.lora.frozen
    abstract = compute_dtype_params(model_lib.abstract_params(model), model)
    return forward, param_shardings(model, mesh, rules), abstract


def _reference_apart_program(
    ref_rl: RLLayout, model: ModelConfig, mesh: Mesh, shards: int, r: int
) -> tuple[Callable[..., jax.Array], Any]:
    """``placement.reference: sampler | own``: the reference's scoring forward on the
    sampler's or its own group's ``mesh`` (``shards`` data shards, ``ref_rl``'s
    micro-batches, groups and packed rows):
    ``(ref_params, rows, packed_rows) -> [N, T]`` log-probs, and the params' shardings."""
    rules, row_rules = rules_for("reference", "score"), rules_for("policy", "score")
    forward = phase_forward(
        RolloutForward(build_sharded(model, mesh, rules, "lm"), r),
        ref_rl.groups.score,
        ref_rl.packing.score,
        shards,
    )
    params_sh = param_shardings(model, mesh, rules)
    rows2 = steps.batch_sharding(mesh, row_rules, 2)

    def logprobs(params: Any, rows: RolloutRows, packed_rows: int | None = None) -> jax.Array:
        f = forward.with_packed_rows(packed_rows)
        return map_micro(
            lambda x: f.logprobs(params, x.tokens, x.mask, x.packing)[0],
            rows,
            ref_rl.score_micro_of(rows.tokens.shape[0]),
            mesh,
            row_rules,
            ref_rl.groups.score,
        )

    program = jax.jit(
        logprobs,
        in_shardings=(params_sh, RolloutRows(rows2, rows2, rows2, None)),
        out_shardings=rows2,
        static_argnums=2,  # packed_rows
    )
    return program, params_sh


def _scoring(
    algo: PPOConfig | GRPOConfig,
    rl: RLLayout,
    reference: RolloutForward | None,
    policy: steps.Learner,
    value: steps.Learner | None,
    joint: RolloutForward | None,
    mesh: Mesh,
    shards: int,
    critic_apart: bool = False,
) -> Scoring:
    """The score program's function: every forward packs scoring's prompt groups, or its
    sequences (``rl.packing.score`` rows per shard of ``shards``). Old log-probs and values
    come from the learners' own (train-rule) modules, so the first minibatch's forward is
    the scoring forward's computation (its ratio is 1). ``critic_apart``: the critic's values
    are scored on its own mesh (``interleaved``), not here. ``reference`` None: the reference
    is scored apart (``placement.reference: sampler``: the rows carry its log-probs;
    ``own``: they join the forwards' output before the advantages)."""
    group = rl.groups.score

    def scoring(forward: RolloutForward | None) -> RolloutForward | None:
        return None if forward is None else phase_forward(forward, group, rl.packing.score, shards)

    return Scoring(
        algo=algo,
        reference=scoring(reference),
        policy=None if rl.reuse_policy_forward else scoring(policy.module),
        value=None
        if value is None or rl.reuse_value_forward or critic_apart
        else scoring(value.module),
        has_critic=value is not None,
        micro_rows=rl.score_micro_rows,
        row_group=group,
        mesh=mesh,
        rules=rules_for("policy", "score"),
        joint=scoring(joint),
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
    reference_mesh: Mesh | None = None,
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
      reference_mesh: the reference's own mesh (``placement.reference: own``); None: the
        sampler's with ``reference: sampler``, else ``mesh``.
    """
    algo, rl = rl_section(cfg), layout.rl
    r = algo.rollout.max_new_tokens
    apart = critic_mesh is not None
    policy_setup, value_setup, hydra = learners(cfg, layout, model, mesh, critic_mesh)
    if apart and hydra is not None:
        raise ValueError("placement.strategy: interleaved cannot split a Hydra critic's trunk")
    policy, policy_sh = policy_setup.learner, policy_setup.shardings
    value = None if value_setup is None else value_setup.learner
    value_sh = None if value_setup is None else value_setup.shardings
    score_rules = rules_for("policy", "score")
    reference, ref_sh, ref_abstract = _reference(model, mesh, policy_setup, hydra, r)
    reference_apart = apart_ref_sh = reference_planner = None
    if layout.reference_rl is not None:  # placement.reference: sampler | own
        reference_mesh = reference_mesh or generate_mesh
        shards = reference_mesh.shape["data"] * reference_mesh.shape["fsdp"]
        reference_apart, apart_ref_sh = _reference_apart_program(
            layout.reference_rl, model, reference_mesh, shards, r
        )
        reference_planner = PackingPlanner.of(
            algo, layout.reference_rl, shards, cfg.data.max_prompt_length
        )
        reference = None
    joint = None
    if hydra is not None:
        joint = hydra_forward(model, mesh, TRAIN, hydra.branch_layer, HYDRA_HEADS, r, 1)
    scoring = _scoring(algo, rl, reference, policy, value, joint, mesh, layout.data_shards, apart)
    rows2 = steps.batch_sharding(mesh, score_rules, 2)
    together = value_setup is not None and not apart
    setups = (policy_setup,) + ((value_setup,) if together else ())
    update = _update_program(algo, rl, setups, mesh)
    score_values = update_value = None
    if apart:
        score_values = _values_program(rl, value_setup, critic_mesh, layout.data_shards)
        update_value = _update_program(algo, rl, (value_setup,), critic_mesh)
    reward = reward_sh = None
    if reward_model is not None:
        reward, reward_sh = _reward_program(reward_model, layout, r, mesh)
    model_sh = (
        policy_setup.model_shardings,
        None if reference is None else ref_sh,  # None: scored on the sampler's mesh
        None if value_setup is None or apart else value_setup.model_shardings,
    )
    abstract_models = (
        policy_setup.abstract_model,
        None if reference is None else ref_abstract,
        None if value_setup is None else value_setup.abstract_model,
    )
    sampler = Sampler(model, generate_mesh, matmul_block=matmul_block)
    sync = None
    if policy_setup.lora is not None:
        sync = AdapterSync.build(policy_setup.lora, sampler, cfg.lora.sync)
    elif hydra is not None:
        sync = HydraSync.build(hydra, sampler)
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
        score=score_program(scoring, cfg, model_sh, abstract_models),
        score_forwards=jax.jit(
            scoring.forwards,
            in_shardings=(*model_sh, RolloutRows(rows2, rows2, rows2, None)),
            out_shardings=rows2,
            static_argnums=4,  # packed_rows
        ),
        score_advantages=jax.jit(scoring.advantages),
        reward=reward,
        update=update,
        planner=PackingPlanner.of(algo, rl, layout.data_shards, cfg.data.max_prompt_length),
        policy_lora=policy_setup.lora,
        value_lora=None if value_setup is None else value_setup.lora,
        sync=sync,
        hydra=hydra,
        reference_abstract=ref_abstract,
        engine=_engine(algo, sampler),
        critic_mesh=critic_mesh,
        score_values=score_values,
        update_value=update_value,
        reference_apart=reference_apart,
        reference_apart_shardings=apart_ref_sh,
        reference_planner=reference_planner,
        reference_mesh=reference_mesh if reference_apart is not None else None,
    )


def _update_program(
    algo: PPOConfig | GRPOConfig,
    rl: RLLayout,
    setups: tuple[LearnerSetup, ...],
    mesh: Mesh,
) -> Callable[..., tuple[tuple[TrainState, ...], UpdateOutput]]:
    """The jitted ``rl_update`` of ``setups``' learners on ``mesh``: ``(states, batch, key,
    frozen, packed_rows)``, the states donated."""
    replicated = NamedSharding(mesh, P())
    rows2 = steps.batch_sharding(mesh, rules_for("policy", "score"), 2)
    state_sh = tuple(s.shardings for s in setups)
    frozen_sh = tuple(s.frozen_shardings for s in setups)
    return jax.jit(
        functools.partial(
            rl_steps.rl_update,
            learners=tuple(s.learner for s in setups),
            epochs=algo.loss.epochs,
            num_minibatches=algo.loss.num_minibatches,
            num_micro=rl.num_micro,
            mesh=mesh,
        ),
        in_shardings=(state_sh, None, replicated, frozen_sh),
        out_shardings=(state_sh, UpdateOutput(metrics=replicated, outputs=rows2)),
        donate_argnums=0,  # the old states' buffers are reused for the new ones
        static_argnums=4,  # packed_rows
    )


def _values_program(
    rl: RLLayout, critic: LearnerSetup, mesh: Mesh, shards: int
) -> Callable[..., jax.Array]:
    """``interleaved``: the critic's scoring forward on its own mesh, ``(value_params, rows,
    packed_rows) -> [N, T]`` values (sequence-packed like scoring's forwards)."""
    rules = rules_for("value", "score")
    forward = phase_forward(critic.learner.module, rl.groups.score, rl.packing.score, shards)
    rows2 = steps.batch_sharding(mesh, rules, 2)

    def values(params: Any, rows: RolloutRows, packed_rows: int | None = None) -> jax.Array:
        f = forward.with_packed_rows(packed_rows)
        return map_micro(
            lambda r: f.values(params, r.tokens, r.mask, r.packing),
            rows,
            rl.score_micro_of(rows.tokens.shape[0]),
            mesh,
            rules,
            rl.groups.score,
        )

    return jax.jit(
        values,
        in_shardings=(critic.model_shardings, RolloutRows(rows2, rows2, rows2, None)),
        out_shardings=rows2,
        static_argnums=2,  # packed_rows
    )


def _engine(algo: PPOConfig | GRPOConfig, sampler: Sampler) -> Engine | None:
    """The rollout engine of ``rollout.engine: continuous`` (its slots default to every row
    the iteration starts)."""
    r = algo.rollout
    if r.engine != "continuous":
        return None
    return Engine(sampler, slots=r.engine_slots, chunk=r.chunk_steps)
