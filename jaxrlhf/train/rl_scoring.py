"""The score program of an RL iteration: reference (and old-policy, critic) forwards over the
rollout, then the advantages (``rl_steps``), as one pure function jitted with its shardings.

With sequence packing in scoring (``rollout.pack_sequences``), the rows carry their plan
(``RolloutRows.packing``) and the program takes the packed size as its last, static
argument (``train.rl_packing``): it compiles once per size.
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
from jaxrlhf.config import RunConfig
from jaxrlhf.models.lora import combine
from jaxrlhf.models.packing import PackedShape, RowPacking
from jaxrlhf.models.scoring import RolloutForward
from jaxrlhf.sharding.micro_batches import map_micro, micro_batches_for
from jaxrlhf.sharding.rules import Rules
from jaxrlhf.train import rl_steps, steps
from jaxrlhf.train.rl_config import GRPOConfig, PPOConfig
from jaxrlhf.train.rl_types import RolloutRows, Scored


def phase_forward(forward: RolloutForward, group: int, packed: int, shards: int) -> RolloutForward:
    """``forward`` as a phase (scoring or the update) applies it: packing prompt groups of
    ``group`` rows and, where the phase may pack sequences (``packed`` rows per shard,
    ``RLLayout.packing``; 0: it does not), holding their largest packed shape (each call
    picks its size, or none)."""
    shape = PackedShape(shards, packed) if packed else None
    return dataclasses.replace(forward, group_size=group, packing=shape)


@dataclasses.dataclass(frozen=True)
class Scoring:
    """The score program's pure function (static fields; call it under ``jax.jit``).

    Reference log-probs always; old log-probs unless the policy's update forward stands in;
    for PPO the critic's values, GAE advantages and returns (or only the per-token rewards
    when the critic's update forward runs GAE); for GRPO the group advantages.
    ``micro_rows``: rows (over every shard) in one scoring forward, None: no bound
    (``RLLayout.score_micro_rows``); ``row_group``: the rows each scoring micro-batch keeps
    together (prompt groups).
    """

    algo: PPOConfig | GRPOConfig
    reference: RolloutForward | None  # None: the rows carry them (placement.reference)
    policy: RolloutForward | None  # None: reuse_policy_forward
    value: RolloutForward | None  # None: GRPO, or reuse_value_forward
    has_critic: bool
    micro_rows: int | None
    row_group: int
    mesh: Mesh
    rules: Rules
    joint: RolloutForward | None = None  # a Hydra model: one forward for both

    def forwards(
        self,
        policy_params: Any,
        ref_params: Any,
        value_params: Any,
        rows: RolloutRows,
        packed_rows: int | None = None,
    ) -> Scored:
        """The scoring forwards, micro-batches of at most ``micro_rows`` rows (whole groups)
        at a time; sequence-packed forwards pack into ``packed_rows`` rows per shard
        (static; None: the rows run unpacked, and ``rows.packing`` is None). With a Hydra
        critic (``joint``) the old log-probs and values come from one forward of the shared
        trunk and both branches."""
        scoring = self.with_packed_rows(packed_rows)

        def run(r: RolloutRows) -> Scored:
            if scoring.reference is None:
                ref = r.ref_logprobs  # scored on the sampler's group
            else:
                ref, _ = scoring.reference.logprobs(ref_params, r.tokens, r.mask, r.packing)
            old = values = None
            if (
                scoring.joint is not None
                and scoring.policy is not None
                and scoring.value is not None
            ):
                both = combine(policy_params, value_params)  # trunk + both branches
                old, values = scoring.joint.logprobs_and_values(both, r.tokens, r.mask, r.packing)
                return Scored(ref_logprobs=ref, old_logprobs=old, old_values=values)
            if scoring.policy is not None:
                old, _ = scoring.policy.logprobs(policy_params, r.tokens, r.mask, r.packing)
            if scoring.value is not None:
                values = scoring.value.values(value_params, r.tokens, r.mask, r.packing)
            return Scored(ref_logprobs=ref, old_logprobs=old, old_values=values)

        num_micro = micro_batches_for(rows.tokens.shape[0], self.micro_rows)
        return map_micro(run, rows, num_micro, self.mesh, self.rules, self.row_group)

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
            joint=packed(self.joint),
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
        return self.advantages(out, rows.response_mask, scores, kl_coef, rows.turn_rewards)

    def advantages(
        self,
        out: Scored,
        response_mask: jax.Array,
        scores: jax.Array,
        kl_coef: jax.Array,
        turn_rewards: jax.Array | None = None,
    ) -> Scored:
        """The forwards' ``out`` of the whole rollout completed with the advantages (and
        returns, or per-token rewards) from ``scores`` [N] under ``kl_coef`` []; PPO pays
        ``turn_rewards`` [N, T] (a part of each score) at their tokens, the GRPO family reads
        the scores alone."""
        algo, resp = self.algo, response_mask
        ref, old = out.ref_logprobs, out.old_logprobs
        if self.has_critic and out.old_values is None:  # the critic's update runs GAE
            rewards, m = rl_steps.ppo_token_rewards(
                scores, old, ref, resp, kl_coef, loss_cfg=algo.loss, turn_rewards=turn_rewards
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
                turn_rewards=turn_rewards,
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


def score_program(
    scoring: Scoring,
    cfg: RunConfig,
    shardings: tuple[Any, Any, Any],
    abstract_models: tuple[Any, Any, Any],
) -> Callable[..., Scored]:
    """``scoring`` jitted with its shardings: the three models' parameters as given, rollout
    rows over the data shards, the scalars replicated; the outputs' per-token arrays like
    the rows, the metrics replicated. ``abstract_models``: the policy's, the reference's and
    the critic's (None) abstract params as the forwards apply them. The program's last
    argument, ``packed_rows``, is static (one compile per packed size)."""
    mesh, rules = scoring.mesh, scoring.rules
    rows2, rows1 = steps.batch_sharding(mesh, rules, 2), steps.batch_sharding(mesh, rules, 1)
    replicated = NamedSharding(mesh, P())
    r = scoring.algo.rollout
    forwards = (scoring.reference, scoring.policy, scoring.value, scoring.joint)
    packing = next((f.packing for f in forwards if f is not None), None)
    length = cfg.data.max_prompt_length + r.max_new_tokens
    rows = abstract_rows(r.rows, length, packed=packing is not None)
    if scoring.reference is None:
        rows = rows.replace(ref_logprobs=jax.ShapeDtypeStruct((r.rows, length), jnp.float32))
    abstract = jax.eval_shape(
        functools.partial(scoring, packed_rows=None if packing is None else packing.rows),
        *abstract_models,
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
