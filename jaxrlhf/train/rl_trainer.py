"""The RL trainer (``algorithm: ppo | grpo``): runs :class:`~jaxrlhf.train.rl_programs.RLPrograms`
on real arrays, one iteration per :meth:`RLTrainer.step`.

One iteration: reshard the policy to the sampler's layout, sample a batch of prompts
(:class:`~jaxrlhf.train.rl_types.Rollout`, on the host, where reward functions read it),
score it (:class:`~jaxrlhf.train.rl_types.Scored`), and update the policy (and critic).
Every phase is timed (after ``block_until_ready``) and reshards report the bytes they move.
The host loop (``jaxrlhf.train.loop``) drives it through the same small protocol as the
supervised trainers: ``step``, ``snapshot``, ``restore``, ``export``.

Rollouts come from a :class:`~jaxrlhf.train.rl_async.RolloutProducer`: inline before each
update (``rollout.max_staleness: 0``), or ahead of the learner on a host thread with weights
up to k versions old. With ``placement.strategy: interleaved`` the critic's value forward and
update run on its own devices beside the policy's (``_score_interleaved``,
``_update_interleaved``). Every phase is recorded on the ``timeline``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf import losses
from jaxrlhf.config import ConfigError, RunConfig, RunLayout, rl_section, source_of, validate
from jaxrlhf.data import BatchIterator, TokenizedDataset, load_datasets, load_tokenizer
from jaxrlhf.data.sources import BUILTIN_PREFIX
from jaxrlhf.data.tokenizer import Tokenizer
from jaxrlhf.generation import SampleOutput
from jaxrlhf.generation.environment import (
    EnvError,
    EnvFactory,
    EpisodeConfig,
    Episodes,
    observation_ids,
    resolve_environment,
)
from jaxrlhf.generation.partials import Partials
from jaxrlhf.models import model as model_lib
from jaxrlhf.models import shared_prefix
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.hf_checkpoint import save_hf
from jaxrlhf.rewards import (
    RewardError,
    RewardFn,
    call_reward_fn,
    overlong_penalty,
    resolve_reward_fn,
    shape_scores,
)
from jaxrlhf.sharding.distributed import put_global, to_host
from jaxrlhf.sharding.placement import (
    critic_mesh,
    generate_mesh,
    given_mesh,
    reference_mesh,
    train_mesh,
)
from jaxrlhf.train import rl_metrics, rl_packing
from jaxrlhf.train.adapters import export_lora
from jaxrlhf.train.checkpointing import key_data, wrap_key
from jaxrlhf.train.hydra_setup import plain_policy
from jaxrlhf.train.model_setup import model_with_tokenizer_ids
from jaxrlhf.train.rl_async import RolloutProducer, check_concurrency
from jaxrlhf.train.rl_config import GRPOConfig, PPOConfig
from jaxrlhf.train.rl_programs import RLPrograms, build_rl_programs, sampling_params
from jaxrlhf.train.rl_setup import (
    initial_states,
    kl_controller,
    reward_model_config,
    reward_model_params,
)
from jaxrlhf.train.rl_stream import (
    StreamedScoring,
    concurrency_blocker,
    streamed_batch_rows,
    with_prompts,
)
from jaxrlhf.train.rl_types import LearnerBatch, Rollout, Scored, concatenate
from jaxrlhf.train.state import TrainState
from jaxrlhf.train.timeline import Timeline
from jaxrlhf.train.trainable import StepOutput

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RLTrainer:
    """Everything an RL run holds between iterations; the states are replaced by each update.

    Attributes:
      cfg: the config.
      programs: the jitted programs (their shardings, the sampler, the run's layout).
      tokenizer: decodes completions for reward functions; exported with the policy.
      prompts: the prompt batches (record indices included, for the reward's columns).
      reward_fn: the programmatic reward, or None with a reward model (``rm_params``).
      task_fn: the built-in task's reward (logged whatever drives RL), or None.
      policy_state, value_state: the learners' states (value None for GRPO).
      ref_params, rm_params: the frozen reference (None: it lives on the sampler's or its
        own devices, ``apart_ref_params``) and reward model (rm None: a function).
      kl_state: the KL controller.
      policy_frozen, value_frozen: the LoRA learners' frozen bases (``lora:``), else None;
        the reference is then ``policy_frozen`` itself.
      sampler_base: with ``lora.sync: adapters``, the policy's base in the sampler's layout,
        resident for the whole run (``weight_sync.AdapterSync``); else None.
      key: the run's PRNG key (each iteration folds in ``steps_done``).
      steps_done: iterations done.
      last_scored: the last iteration's scored arrays, with what the update's forwards
        computed in place of scoring filled in (for inspection: tests, notebooks).
      env_factory: ``rollout.environment``'s factory (multi-turn episodes), or None.
      apart_ref_params: ``placement.reference: sampler | own``: the reference on the
        sampler's mesh or its own group's (placed once), else None.
      partials: ``rollout.partial_rollouts``: the groups the last engine call left running
        (their ``prompt_ids`` are dataset indices), resumed by the next; else None.
      timeline: when each phase ran on which devices (``jaxrlhf.train.timeline``).
      producer: launches the rollouts, ahead of the learner with ``rollout.max_staleness``
        (``jaxrlhf.train.rl_async``).
    """

    cfg: RunConfig
    programs: RLPrograms
    tokenizer: Tokenizer
    prompts: BatchIterator
    reward_fn: RewardFn | None
    task_fn: RewardFn | None
    policy_state: TrainState
    value_state: TrainState | None
    ref_params: Any
    rm_params: Any | None
    kl_state: losses.AdaptiveKLState | losses.FixedKL
    key: jax.Array
    policy_frozen: Any = None
    value_frozen: Any = None
    sampler_base: Any = None
    steps_done: int = 0
    last_scored: Scored | None = None
    env_factory: EnvFactory | None = None
    apart_ref_params: Any = None
    partials: Partials | None = None
    timeline: Timeline | None = None
    producer: RolloutProducer | None = None

    def __post_init__(self) -> None:
        groups = {
            "sampler": tuple(int(d.id) for d in self.sampler.mesh.devices.flat),
            "learner": tuple(int(d.id) for d in self.mesh.devices.flat),
        }
        # Every mesh whose programs can be in flight at once (threads and the producer).
        in_flight = {"mesh": self.mesh}
        sampler_apart = set(self.sampler.mesh.devices.flat) != set(self.mesh.devices.flat)
        if self.algo.rollout.max_staleness > 0 and sampler_apart:
            in_flight["rollout.max_staleness"] = self.sampler.mesh
        if self.programs.critic_mesh is not None:
            groups["critic"] = tuple(int(d.id) for d in self.programs.critic_mesh.devices.flat)
            in_flight["placement.critic"] = self.programs.critic_mesh
        if self.reference_own:
            ref_mesh = self.programs.reference_mesh
            groups["reference"] = tuple(int(d.id) for d in ref_mesh.devices.flat)
            in_flight["placement.reference_group"] = ref_mesh
        check_concurrency(in_flight)
        self.stream_blocker = self._stream_blocker()
        self.timeline = Timeline(groups)
        self.producer = RolloutProducer(
            self,
            max_staleness=self.algo.rollout.max_staleness,
            sync_every=self.cfg.placement.weight_sync_every,
            drain_every=self.cfg.checkpoint.every,
            timeline=self.timeline,
        )

    def _stream_blocker(self) -> str | None:
        """Why streamed scoring runs between decode chunks, not on a background thread
        (``rollout.stream_concurrent``); warns once when the config asked for the thread."""
        r = self.algo.rollout
        if self.programs.engine is None or not r.stream_scoring or r.environment is not None:
            return "no streamed scoring"
        if not r.stream_concurrent:
            return "rollout.stream_concurrent: false"
        blocker = concurrency_blocker(self.sampler.mesh, self.mesh)
        if blocker is not None:
            logger.warning(
                "rollout.stream_concurrent: streamed batches are scored between decode chunks: %s",
                blocker,
            )
        return blocker

    log_window = 1  # every iteration is a row of metrics.jsonl
    summary_keys = rl_metrics.SUMMARY_KEYS
    plot_keys = rl_metrics.PLOT_KEYS

    @property
    def reference_on_sampler_group(self) -> bool:
        """``placement.reference: sampler``: the reference is scored after sampling, on the
        sampler's devices."""
        apart = self.programs.reference_apart is not None
        return apart and self.cfg.placement.reference == "sampler"

    @property
    def reference_own(self) -> bool:
        """``placement.reference: own``: the reference is scored on its own group, beside the
        learner's scoring forwards."""
        apart = self.programs.reference_apart is not None
        return apart and self.cfg.placement.reference == "own"

    @property
    def layout(self) -> RunLayout:
        """What validation derived from the config (``programs.layout``)."""
        return self.programs.layout

    @property
    def algo(self) -> PPOConfig | GRPOConfig:
        return self.programs.algo

    @property
    def mesh(self) -> Mesh:
        return self.programs.mesh

    @property
    def sampler(self):
        return self.programs.sampler

    @property
    def model_cfg(self) -> ModelConfig:
        return self.programs.model

    @property
    def dataset(self) -> TokenizedDataset:
        return self.prompts.dataset

    @property
    def policy_params(self) -> Any:
        """The policy as its forwards apply it: the state's params, or combined with its
        frozen part (LoRA: a ``LoraParams``; Hydra: the trunk and the policy branch)."""
        return self.programs.policy.model_params(self.policy_state.params, self.policy_frozen)

    @property
    def value_params(self) -> Any:
        """The critic as its forwards apply it (as :attr:`policy_params`), or None."""
        if self.value_state is None:
            return None
        return self.programs.value.model_params(self.value_state.params, self.value_frozen)

    def describe(self) -> str:
        """One line for the log: parameters, meshes, rollout size."""
        sampler_mesh = self.sampler.mesh
        placed = "" if sampler_mesh is self.mesh else f" (sampler: {dict(sampler_mesh.shape)})"
        trained = model_lib.param_count(self.policy_state.params)
        size = f"{trained:,} policy parameters"
        if self.programs.hydra is not None:
            size += (
                f" trained above a frozen trunk of {model_lib.param_count(self.policy_frozen):,}"
            )
        elif self.policy_frozen is not None:
            total = trained + model_lib.param_count(self.policy_frozen)
            size = f"{trained:,} trained (LoRA) of {total:,} policy parameters"
        return (
            f"{self.cfg.algorithm}: {size}, mesh {dict(self.mesh.shape)}{placed}, "
            f"{self.algo.rollout.rows} rollout rows per iteration"
        )

    def generate_params(self) -> tuple[Any, Any]:
        """The policy in the sampler's layout and the reshard's stats: the whole policy
        resharded, or with LoRA the merged adapters (``weight_sync``)."""
        sync = self.programs.sync
        if sync is None:
            return self.sampler.to_generate_layout(self.policy_state.params)
        return sync.generate_params(self.policy_frozen, self.sampler_base, self.policy_state.params)

    # ---- one iteration -----------------------------------------------------------------

    def rollout(self, key: jax.Array) -> tuple[Rollout, dict[str, float]]:
        """Reshard, sample one batch of prompts and score it with the reward: a host
        Rollout and the phases' timings."""
        rollout, timings, _ = self._rollout(key)
        return rollout, timings

    def _rollout(
        self, key: jax.Array, reference: bool = True
    ) -> tuple[Rollout, dict[str, float], Scored | None]:
        """:meth:`rollout`, and the scoring forwards when the engine streamed them;
        ``reference`` False leaves a sampler-side reference's log-probs to the caller."""
        host_prompts = next(self.prompts)
        start = time.perf_counter()
        gen_params, stats = self.generate_params()
        timings = {
            "time/reshard_s": time.perf_counter() - start,
            "reshard/bytes_moved": float(stats.bytes_moved),
        }
        rollout, more, forwards = self.sample(key, host_prompts, gen_params)
        del gen_params  # the sampler's copy is not needed by the reference's forward
        if reference and self.reference_on_sampler_group:
            rollout, more["time/reference_s"] = self.score_reference_apart(rollout)
        return rollout, {**timings, **more}, forwards

    def score_reference_apart(self, rollout: Rollout) -> tuple[Rollout, float]:
        """``placement.reference: sampler | own``: ``rollout`` with the reference's log-probs
        of its rows, computed on the reference's mesh (the sampler's or its group's); and the
        seconds it took."""
        start = time.perf_counter()
        ref = self.programs.reference_apart_logprobs(
            self.apart_ref_params, rollout.tokens, rollout.mask
        )
        return rollout.replace(ref_logprobs=ref), time.perf_counter() - start

    def sample(
        self,
        key: jax.Array,
        host_prompts: dict[str, np.ndarray],
        gen_params: Any,
        *,
        version: int = 0,
        oldest: int = 0,
    ) -> tuple[Rollout, dict[str, float], Scored | None]:
        """Samples ``host_prompts`` with ``gen_params`` (the sampler's layout) and scores the
        samples with the reward: a host Rollout, the phases' timings, and the scoring
        forwards when the engine streamed them. ``version``: the policy version of
        ``gen_params``; ``oldest``: the oldest version a carried partial group's tokens may
        have (``rollout.partial_rollouts``: older groups are dropped)."""
        timings: dict[str, float] = {}
        if self.programs.engine is not None:
            return self._engine_rollout(gen_params, host_prompts, key, timings, version, oldest)
        start = time.perf_counter()
        out = self.sampler.generate(
            gen_params,
            host_prompts["tokens"],
            host_prompts["mask"],
            key,
            self.programs.sampling,
        )
        out = to_host(out)  # the whole rollout on every process (reward functions read it)
        del gen_params
        timings["time/generate_s"] = time.perf_counter() - start
        start = time.perf_counter()
        index = np.repeat(host_prompts["index"], self.algo.rollout.num_samples)
        tokens = np.concatenate([out.prompt_tokens, out.tokens], axis=1).astype(np.int32)
        mask = np.concatenate([out.prompt_mask, out.response_mask], axis=1)
        task_scores, scores = self.row_scores(out, tokens, mask, index)
        rollout = self._as_rollout(out, scores, task_scores)
        timings["time/reward_s"] = time.perf_counter() - start
        return rollout, timings, None

    def _engine_rollout(
        self,
        gen_params: Any,
        prompts: dict[str, np.ndarray],
        key: jax.Array,
        timings: dict,
        version: int = 0,
        oldest: int = 0,
    ) -> tuple[Rollout, dict[str, float], Scored | None]:
        """The rollout engine's samples of ``prompts`` (the first ``prompts_per_step``
        groups to finish), their rewards and, with ``stream_scoring``, their scoring
        forwards, computed between decode chunks. With ``partial_rollouts`` the groups
        carried from the last call come first (those with a token older than ``oldest``
        dropped) and the groups still running are carried to the next."""
        r, programs = self.algo.rollout, self.programs
        carry, skip = None, 0
        if r.partial_rollouts:
            carry, prompts, dropped = self._carried(prompts, oldest)  # carried groups first
            skip = 0 if carry is None else carry.groups
            timings["rollout/partials_dropped"] = float(dropped)
            timings["rollout/prompts_skipped"] = float(skip)  # drawn, replaced by carried
        stream = None
        if r.stream_scoring and self.env_factory is None:
            micro = streamed_batch_rows(self.algo, programs.layout)
            stream = StreamedScoring(self, prompts, micro, self.stream_blocker is None)
            timings["rollout/stream_concurrent"] = float(stream.concurrent)
        start = time.perf_counter()
        try:  # until every streamed batch is scored: no scoring thread outlives a failure
            out = programs.engine.generate(
                gen_params,
                prompts["tokens"][skip:],  # the engine puts the carried prompts first itself
                prompts["mask"][skip:],
                key,
                programs.sampling,
                keep_groups=r.prompts_per_step,
                token_budget=r.token_budget,
                stop_strings=r.stop_strings,
                decode=self.tokenizer.decode,
                on_finished=None if stream is None else stream.add,
                environments=self._episodes(prompts),
                carry=carry,
                keep_partials=r.partial_rollouts,
                version=version,
            )
            del gen_params
            if r.partial_rollouts:  # the engine numbers its groups over ``prompts``: map them back
                self.partials = out.partials and dataclasses.replace(
                    out.partials, prompt_ids=prompts["index"][out.partials.prompt_ids]
                )
                versions = out.finished.versions
                held = versions[out.finished.response_mask]
                timings["rollout/oldest_version"] = float(held.min(initial=version))
                carried = (versions >= 0) & (versions < version)  # -1: past the response
                timings["rollout/partial_rows"] = float(carried.any(-1).sum())
                timings["rollout/carried_groups"] = float(
                    0 if self.partials is None else self.partials.groups
                )
            if stream is not None:
                stream.close()
        finally:
            if stream is not None:
                stream.cancel()
        timings["time/generate_s"] = time.perf_counter() - start
        timings["rollout/aborted_groups"] = float(out.aborted_groups)
        timings["rollout/decoded_tokens"] = float(out.generated_tokens)
        timings["rollout/decode_chunks"] = float(out.chunks)
        start = time.perf_counter()
        if self.env_factory is not None:
            rollout = self._episode_rollout(out, prompts, timings)
            timings["time/reward_s"] = time.perf_counter() - start
            return rollout, timings, None
        rows = out.finished.rows
        sample = with_prompts(out.finished, prompts, r.num_samples)
        forwards = None
        if stream is None:
            tokens = np.concatenate([sample.prompt_tokens, sample.tokens], axis=1)
            mask = np.concatenate([sample.prompt_mask, sample.response_mask], axis=1)
            index = prompts["index"][rows // r.num_samples]
            task_scores, scores = self.row_scores(sample, tokens.astype(np.int32), mask, index)
        else:
            scores, task_scores, forwards = stream.result(rows)
            timings["time/score_streamed_s"] = stream.seconds
            timings["time/score_streamed_wait_s"] = stream.wait_seconds
            timings.update(stream.packing_metrics())
            timings["time/generate_s"] -= stream.wait_seconds
        rollout = self._as_rollout(sample, scores, task_scores)
        timings["time/reward_s"] = time.perf_counter() - start
        return rollout, timings, forwards

    def _carried(
        self, prompts: dict[str, np.ndarray], oldest: int
    ) -> tuple[Partials | None, dict[str, np.ndarray], int]:
        """The partial groups carried from the last engine call whose tokens are all of
        version ``oldest`` or newer, and the prompts of the call: theirs, then as many of
        ``prompts`` as leave the call ``len(prompts)`` groups (tokens, mask and dataset
        index); and how many groups were dropped as too old."""
        carry, self.partials = self.partials, None
        if carry is None:
            return None, prompts, 0
        recent = carry.oldest() >= oldest
        dropped = int((~recent).sum())
        carry = carry.select(np.flatnonzero(recent)) if dropped else carry
        if not carry.groups:
            return None, prompts, dropped
        # The carried groups take the place of as many new prompts: the call starts
        # ``started_prompts`` groups in all, so over-sampling decodes no more than without
        # partial rollouts (the prompts left out are skipped, like cancelled ones).
        fresh = max(0, len(prompts["index"]) - carry.groups)
        combined = {
            k: np.concatenate([c, prompts[k][:fresh]])
            for k, c in (
                ("tokens", carry.prompt_tokens),
                ("mask", carry.prompt_mask),
                ("index", carry.prompt_ids),
            )
        }
        return carry, combined, dropped

    def _episodes(self, prompts: dict[str, np.ndarray]) -> Episodes | None:
        """The iteration's multi-turn episodes (None: single-turn): each prompt's dataset
        record (with its ``prompt`` text) goes to its environments."""
        if self.env_factory is None:
            return None
        r = self.algo.rollout
        columns = self.dataset.columns(prompts["index"])
        records = [{k: v[i] for k, v in columns.items()} for i in range(len(prompts["index"]))]
        for record, tokens, mask in zip(records, prompts["tokens"], prompts["mask"], strict=True):
            record.setdefault("prompt", self.tokenizer.decode(tokens[mask]))
        return Episodes(
            self.env_factory,
            records,
            EpisodeConfig(r.max_turns, r.turn_tokens, r.env_timeout_s),
            functools.partial(observation_ids, self.tokenizer),
            self.tokenizer.decode,
        )

    def _episode_rollout(self, out: Any, prompts: dict[str, np.ndarray], timings: dict) -> Rollout:
        """The engine's finished episodes as a Rollout: observation tokens in ``mask`` but not
        in ``response_mask`` (out of the loss and the KL), behaviour log-probs 0 there; the
        episodes' rewards as scores (``reward.function: environment``) or the reward
        function's on the whole response text (observations included)."""
        f, r = out.finished, self.algo.rollout
        prompt = f.rows // r.num_samples
        p_tokens, p_mask = prompts["tokens"][prompt], prompts["mask"][prompt]
        if self.algo.reward.function == "environment":
            scores = f.rewards
        else:
            texts = [
                self.tokenizer.decode(t[m]) for t, m in zip(f.tokens, f.sequence_mask, strict=True)
            ]
            _, scores = self.row_scores(
                with_prompts(f, prompts, r.num_samples),
                np.concatenate([p_tokens, f.tokens], 1),
                np.concatenate([p_mask, f.sequence_mask], 1),
                prompts["index"][prompt],
                completions=texts,
            )
        scores = scores - overlong_penalty(
            f.lengths,
            f.stopped,
            r.max_new_tokens,
            self.algo.reward.overlong_buffer,
            self.algo.reward.overlong_penalty,
        )
        timings["env/turns_mean"] = float(f.turns.mean())
        timings["env/tool_use_rate"] = float((f.observations > 0).mean())
        timings["env/observations_mean"] = float(f.observations.mean())
        timings["env/errors"] = float(f.errors.sum())
        timings["env/reward_mean"] = float(f.rewards.mean())
        names = sorted({k for info in out.episode_info.values() for k in info})
        for name in names:
            values = [info.get(name, 0.0) for info in out.episode_info.values()]
            timings[f"env/{name}_mean"] = float(np.mean(values))
        zeros = np.zeros(p_mask.shape, np.float32)
        turn_rewards = None  # PPO pays each environment reward at the turn it answered
        reward_cfg = self.algo.reward
        if reward_cfg.function == "environment" and self.cfg.algorithm == "ppo":
            if not reward_cfg.normalize:  # (normalised, only the totals have a scale)
                turn_rewards = np.concatenate([zeros, f.turn_rewards], 1)
        return Rollout(
            tokens=np.concatenate([p_tokens, f.tokens], 1).astype(np.int32),
            mask=np.concatenate([p_mask, f.sequence_mask], 1),
            response_mask=np.concatenate([np.zeros_like(p_mask), f.response_mask], 1),
            lengths=f.lengths,
            stopped=f.stopped,
            sampler_logprobs=np.concatenate([zeros, f.model_logprobs], 1),
            scores=np.asarray(scores, np.float32),
            task_scores=f.rewards if self.task_fn is not None else None,
            turn_rewards=turn_rewards,
        )

    def _as_rollout(
        self, out: SampleOutput, scores: np.ndarray, task_scores: np.ndarray | None
    ) -> Rollout:
        """Sampled rows (with their prompts) and their raw scores as a Rollout, the overlong
        penalty applied."""
        tokens = np.concatenate([out.prompt_tokens, out.tokens], axis=1).astype(np.int32)
        mask = np.concatenate([out.prompt_mask, out.response_mask], axis=1)
        reward_cfg = self.algo.reward
        scores = scores - overlong_penalty(
            np.asarray(out.lengths),
            np.asarray(out.stopped),
            self.algo.rollout.max_new_tokens,
            reward_cfg.overlong_buffer,
            reward_cfg.overlong_penalty,
        )
        zeros = np.zeros(out.prompt_mask.shape, np.float32)
        return Rollout(
            tokens=tokens,
            mask=mask,
            response_mask=np.concatenate([np.zeros_like(out.prompt_mask), out.response_mask], 1),
            lengths=np.asarray(out.lengths),
            stopped=np.asarray(out.stopped),
            sampler_logprobs=np.concatenate([zeros, out.model_logprobs], axis=1),
            scores=scores.astype(np.float32),
            task_scores=task_scores,
        )

    def row_scores(
        self,
        out: SampleOutput,
        tokens: np.ndarray,
        mask: np.ndarray,
        index: np.ndarray,
        completions: list[str] | None = None,
    ) -> tuple[np.ndarray | None, np.ndarray]:
        """``(task scores or None, raw scores)`` of the rows: the reward function's on the
        decoded text (the built-in task's, when it is the reward, counts as both) or the
        reward model's."""
        task, raw = self.function_scores(out, index, completions)
        if raw is None:
            raw = self.programs.reward_scores(self.rm_params, tokens, mask)
        return task, raw

    def function_scores(
        self,
        out: SampleOutput,
        index: np.ndarray,
        completions: list[str] | None = None,
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """``(task scores or None, raw scores or None)``: what the reward and task functions
        give the rows on the host (their decoded text); raw is None when the reward model
        scores the rows (``row_scores`` runs it)."""
        if self.reward_fn is None and self.task_fn is None:
            return None, None
        data = self.cfg.data
        prompt_ids = [t[m] for t, m in zip(out.prompt_tokens, out.prompt_mask, strict=True)]
        completion_ids = [t[m] for t, m in zip(out.tokens, out.response_mask, strict=True)]
        texts = dict(
            prompts=[self.tokenizer.decode(ids) for ids in prompt_ids],
            completions=completions or [self.tokenizer.decode(ids) for ids in completion_ids],
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            columns=self.dataset.columns(index, exclude=(data.prompt_key, data.messages_key)),
        )
        task = None if self.task_fn is None else call_reward_fn(self.task_fn, **texts)
        if self.reward_fn is None:  # a reward model drives RL; the task reward is logged
            return task, None
        if self.reward_fn is self.task_fn:
            return task, task
        return task, call_reward_fn(self.reward_fn, **texts)

    def dynamic_rollout(self, key: jax.Array) -> tuple[Rollout, dict[str, float]]:
        """GRPO/DAPO dynamic sampling: keep groups whose scores differ; refill."""
        n = self.algo.rollout.num_samples
        want = self.algo.rollout.prompts_per_step
        kept, flat, timings = [], [], {}
        for attempt in range(1 + self.algo.max_refills):
            rollout, t, _ = self._rollout(jax.random.fold_in(key, attempt), reference=False)
            for k, v in t.items():
                timings[k] = timings.get(k, 0.0) + v
            informative = rollout.scores.reshape(-1, n).std(-1) > 0
            for g, ok in enumerate(informative):
                (kept if ok else flat).append(rollout.select(slice(g * n, (g + 1) * n)))
            if len(kept) >= want:
                break
        timings["dynamic/rollouts"] = float(attempt + 1)
        timings["dynamic/informative_frac"] = len(kept) / ((attempt + 1) * want)
        chosen = (kept + flat)[:want]  # short of informative groups: flat ones add 0 signal
        return concatenate(chosen), timings  # learn() scores a sampler-side reference

    def step(self) -> StepOutput:
        """One full RL iteration; its host metrics (rewards, KL, losses, timings).

        An iteration that raises leaves the trainer as it was before it: its learner and KL
        states (if the update had run, the ones it started from: deleted where it donated
        them, which a checkpoint then refuses), its prompts, drawn again by the next call
        (or resumed from a checkpoint saved now), and the rollouts launched ahead, cancelled
        and launched again as after a restore (at ``max_staleness`` 0, the same samples)."""
        before = self.producer.prompts_state()
        states = self.policy_state, self.value_state, self.kl_state
        try:
            return self._step()
        except Exception:
            self.policy_state, self.value_state, self.kl_state = states
            self.producer.reset(self.steps_done)
            self.prompts.restore(before)
            raise

    def _step(self) -> StepOutput:
        key = jax.random.fold_in(self.key, self.steps_done)
        sample_key, update_key = jax.random.split(key)
        iter_start = time.perf_counter()
        forwards, version = None, self.steps_done
        if isinstance(self.algo, GRPOConfig) and self.algo.dynamic_sampling:
            rollout, timings = self.dynamic_rollout(sample_key)
        else:
            (rollout, timings, forwards), version = self.producer.take(
                self.steps_done, self.cfg.train.steps, self._sample_key
            )
        timings["rollout/policy_version"] = float(version)
        timings["rollout/staleness"] = float(self.steps_done - version)
        if "rollout/oldest_version" in timings:  # partial rollouts: the oldest token's
            timings["rollout/staleness_max"] = self.steps_done - timings["rollout/oldest_version"]
        metrics = self.learn(rollout, update_key, timings, forwards=forwards)
        metrics["time/iteration_s"] = time.perf_counter() - iter_start
        metrics.update(rl_metrics.rollout_metrics(rollout, metrics))
        metrics.update(rl_metrics.throughput_metrics(self.programs, rollout, metrics))
        metrics["kl/coef"] = float(self.kl_state.kl_coef)
        self.kl_state = losses.kl_controller_update(
            self.kl_state, metrics["kl/seq_mean"], rollout.rows
        )
        self.steps_done += 1
        skipped = metrics.get("skipped", 0.0) + metrics.get("value/skipped", 0.0)
        return StepOutput(metrics=metrics, skipped=skipped)

    def _sample_key(self, step: int) -> jax.Array:
        """Rollout ``step``'s sampling key (the same whenever it is launched)."""
        return jax.random.split(jax.random.fold_in(self.key, step))[0]

    def learn(
        self,
        rollout: Rollout,
        key: jax.Array,
        timings: dict[str, float] | None = None,
        *,
        forwards: Scored | None = None,
    ) -> dict[str, float]:
        """Scores ``rollout`` (old/reference log-probs, values, advantages) and runs the
        update; replaces the policy (and critic) state. Returns host metrics.

        ``forwards``: the rollout's scoring forwards, already computed (streamed while the
        engine decoded); only the advantages are left to score then."""
        timings = dict(timings or {})
        programs = self.programs
        if self.reference_on_sampler_group and rollout.ref_logprobs is None:
            rollout, timings["time/reference_s"] = self.score_reference_apart(rollout)
        start, t_score = time.perf_counter(), self.timeline.now()
        # Sequence packing's host plans (None: the phase runs its rows unpacked). Streamed
        # forwards were planned micro-batch by micro-batch as they ran (rl_stream).
        plan = None
        if forwards is None:
            plan = programs.planner.score(rollout.tokens, rollout.mask)
        update_plan = programs.planner.update(rollout.tokens, rollout.mask, key)
        self._check_groups(rollout, plan is None, update_plan is None)
        reward_cfg = self.algo.reward
        rows = programs.put_rows(
            rollout.device_rows.replace(
                packing=plan and plan.packing,
                turn_rewards=rollout.turn_rewards,
                ref_logprobs=rollout.ref_logprobs,
            )
        )
        shaped = shape_scores(rollout.scores, normalize=reward_cfg.normalize, clip=reward_cfg.clip)
        kl_coef = jnp.asarray(self.kl_state.kl_coef, jnp.float32)
        scores = put_global(shaped, programs.rows(1))
        interleaved = programs.critic_mesh is not None or self.reference_own
        if interleaved:
            scored, reference_s = self._score_interleaved(
                rollout, rows, scores, kl_coef, plan, forwards
            )
            if reference_s is not None:
                timings["time/reference_s"] = reference_s
        elif forwards is None:
            scored = programs.score(
                self.policy_params,
                self.ref_params,
                self.value_params,
                rows,
                scores,
                kl_coef,
                plan and plan.rows,
            )
        else:
            scored = programs.score_advantages(
                forwards, rows.response_mask, scores, kl_coef, rows.turn_rewards
            )
        jax.block_until_ready(scored)
        timings["time/score_s"] = time.perf_counter() - start
        t_update = self.timeline.now()
        if not interleaved:  # (an interleaved score records the learner's own phases)
            self.timeline.record("score", "learner", self.steps_done, t_score, t_update)

        start = time.perf_counter()
        behaviour = None
        if self.algo.loss.rollout_correction.uses_behaviour:
            behaviour = put_global(np.asarray(rollout.sampler_logprobs), programs.rows(2))
        batch = LearnerBatch.of(rows, scored, jnp.full((rollout.rows,), kl_coef), behaviour)
        if update_plan is not None:
            batch = batch.replace(packing=programs.put_rows(update_plan.packing))
        packed_rows = update_plan and update_plan.rows
        if programs.critic_mesh is not None:
            update, update_metrics = self._update_interleaved(batch, key, packed_rows, t_update)
        else:
            states = (self.policy_state,) + (
                () if self.value_state is None else (self.value_state,)
            )
            frozen = (self.policy_frozen,) + (
                () if self.value_state is None else (self.value_frozen,)
            )
            states, update = programs.update(states, batch, key, frozen, packed_rows)
            self.policy_state = states[0]
            if self.value_state is not None:
                self.value_state = states[1]
            update_metrics = to_host(update.metrics)
        timings["time/train_s"] = time.perf_counter() - start
        if programs.critic_mesh is None:  # (an interleaved update records the learner's own)
            self.timeline.record(
                "update", "learner", self.steps_done, t_update, self.timeline.now()
            )
        filled = update.outputs.fill(batch)
        self.last_scored = scored.replace(
            old_logprobs=filled.old_logprobs,
            old_values=filled.old_values,
            returns=filled.returns,
            advantages=filled.advantages,
        )
        metrics = {k: float(v) for k, v in update_metrics.items()}
        metrics.update({k: float(v) for k, v in to_host(scored.metrics).items()})
        metrics.update(rl_packing.plan_metrics(plan, update_plan))
        metrics.update(timings)
        return metrics

    def _score_interleaved(
        self,
        rollout: Rollout,
        rows: Any,
        scores: jax.Array,
        kl_coef: jax.Array,
        plan: Any,
        forwards: Scored | None,
    ) -> tuple[Scored, float | None]:
        """``interleaved``: the old-policy forward (and the reference's, unless it has its own
        group) on the learner's devices, or those the engine streamed, while host threads
        run the critic's value forward on its group and the reference's (``reference:
        own``) on its own; the values and reference log-probs then join the advantages on
        the learner's. Every side packs the rows by its own plan (scoring's, or the
        reference mesh's planner). The learner's forwards and advantages are recorded as
        its own ``score`` phases (the caller records none), so the timeline's overlap is
        the groups' real concurrency. Returns the scored rows and the reference's seconds
        (None: not scored apart here)."""
        programs, step = self.programs, self.steps_done
        own_ref = self.reference_own and rollout.ref_logprobs is None
        critic = programs.critic_mesh is not None
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            reference = pool.submit(self._reference_on_group, rollout) if own_ref else None
            values = pool.submit(self._values_on_critic, rows, plan) if critic else None
            if forwards is None:
                start = self.timeline.now()
                forwards = jax.block_until_ready(
                    programs.score_forwards(
                        self.policy_params,
                        self.ref_params,
                        None if critic else self.value_params,
                        rows,
                        plan and plan.rows,
                    )
                )
                self.timeline.record("score", "learner", step, start, self.timeline.now())
            reference_s = None
            if values is not None:
                forwards = forwards.replace(old_values=values.result())
            if reference is not None:
                ref, reference_s = reference.result()
                forwards = forwards.replace(ref_logprobs=put_global(ref, programs.rows(2)))
        start = self.timeline.now()
        scored = jax.block_until_ready(
            programs.score_advantages(
                forwards, rows.response_mask, scores, kl_coef, rows.turn_rewards
            )
        )
        self.timeline.record("score", "learner", step, start, self.timeline.now())
        return scored, reference_s

    def _values_on_critic(self, rows: Any, plan: Any) -> jax.Array:
        """``interleaved``: [N, T] the critic's values of ``rows`` scored on its group,
        placed like the learner's rows; recorded on the timeline."""
        programs = self.programs
        start = self.timeline.now()
        critic_rows = programs.put_critic_rows(rows.replace(turn_rewards=None))  # unread there
        values = jax.block_until_ready(
            programs.score_values(self.value_params, critic_rows, plan and plan.rows)
        )
        self.timeline.record("score", "critic", self.steps_done, start, self.timeline.now())
        return jax.device_put(values, programs.rows(2))

    def _reference_on_group(self, rollout: Rollout) -> tuple[np.ndarray, float]:
        """``reference: own``: [N, T] the reference's log-probs of ``rollout``'s rows on its
        group (host), timed and recorded on the timeline."""
        start = self.timeline.now()
        with_ref, seconds = self.score_reference_apart(rollout)
        self.timeline.record("reference", "reference", self.steps_done, start, self.timeline.now())
        return with_ref.ref_logprobs, seconds

    def _update_interleaved(
        self, batch: LearnerBatch, key: jax.Array, packed_rows: int | None, start: float
    ) -> tuple[Any, dict]:
        """``interleaved``: the critic's update on its devices (dispatched from a host thread)
        while the policy's runs on the learner's; the same key and packing plan, so the same
        minibatches as the joint update. The learner's update is recorded on the timeline
        from ``start`` to when the policy's is done (not when the critic's is: each group's
        own time). Returns the policy's UpdateOutput and both updates' metrics."""
        programs = self.programs
        critic_batch = programs.put_critic_rows(batch)
        critic_key = jax.device_put(key, NamedSharding(programs.critic_mesh, P()))

        def critic_update():
            start = self.timeline.now()
            (state,), out = programs.update_value(
                (self.value_state,), critic_batch, critic_key, (self.value_frozen,), packed_rows
            )
            metrics = to_host(out.metrics)
            self.timeline.record("update", "critic", self.steps_done, start, self.timeline.now())
            return state, metrics

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(critic_update)
            (policy_state,), update = programs.update(
                (self.policy_state,), batch, key, (self.policy_frozen,), packed_rows
            )
            metrics = to_host(update.metrics)
            self.timeline.record("update", "learner", self.steps_done, start, self.timeline.now())
            value_state, critic_metrics = future.result()
        # Both or neither: a critic update that fails leaves the policy's version too.
        self.policy_state, self.value_state = policy_state, value_state
        return update, {**critic_metrics, **metrics}

    def _check_groups(self, rollout: Rollout, score_groups: bool, update_groups: bool) -> None:
        """Packed prompt groups need each group's rows to carry one prompt (the sampler's
        groups do; a hand-built rollout might not). Checked for the phases that run their
        rows unpacked (``*_groups``): sequence packing compares the prompts itself."""
        groups = self.layout.rl.groups
        n = max(groups.score if score_groups else 1, groups.update if update_groups else 1)
        if n == 1:
            return
        prompt_len = rollout.tokens.shape[1] - self.algo.rollout.max_new_tokens
        same = shared_prefix.prompts_match(rollout.tokens, rollout.mask, prompt_len, n)
        if not same.all():
            raise ValueError(
                f"rollout group {int(np.argmin(same))} (rows of {n}) does not share one prompt; "
                f"{self.cfg.algorithm}.rollout.shared_prefix needs each group's rows to carry "
                "the same prompt tokens and mask (set it to false otherwise)"
            )

    # ---- the host loop's protocol ------------------------------------------------------

    def status(self) -> dict[str, float]:
        return {"epoch": self.prompts.state()["epoch"]}

    def evaluate(self) -> dict[str, float]:
        """RL runs have no held-out evaluation."""
        return {}

    def snapshot(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The arrays and JSON metadata of a checkpoint: the learners' states, the run key,
        the iteration, the prompt position and the KL coefficient."""
        arrays = {"policy": self.policy_state, "key": key_data(self.key, self.mesh)}
        if self.value_state is not None:
            arrays["value"] = self.value_state
        meta = {
            "step": self.steps_done,
            "prompts": self.producer.prompts_state(),
            "kl_coef": float(self.kl_state.kl_coef),
        }
        return arrays, meta

    def restore(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        """Puts a checkpoint's ``snapshot`` back."""
        self.policy_state = arrays["policy"]
        if self.value_state is not None:
            self.value_state = arrays["value"]
        self.key = wrap_key(arrays["key"], self.key)
        self.steps_done = int(meta["step"])
        self.producer.reset(self.steps_done)  # what was in flight is sampled again
        self.prompts.restore(meta["prompts"])
        if isinstance(self.kl_state, losses.AdaptiveKLState):  # a fixed one follows the config
            self.kl_state = self.kl_state._replace(
                kl_coef=jnp.asarray(meta["kl_coef"], jnp.float32)
            )

    def export(self, hf_dir: str) -> None:
        """The policy in Hugging Face format (``*ForCausalLM``) with the tokenizer; with LoRA
        the merged policy, and the adapters alone in PEFT's format beside it."""
        lora = self.programs.policy_lora
        if self.programs.hydra is not None:
            save_hf(
                hf_dir,
                self.model_cfg,
                plain_policy(self.policy_frozen, self.policy_state.params),
                dtype=self.cfg.checkpoint.export_dtype,
            )
        elif lora is not None:
            export_lora(
                hf_dir,
                self.cfg,
                self.model_cfg,
                lora.spec,
                "lm",
                self.policy_frozen,
                self.policy_state.params,
            )
        else:
            save_hf(
                hf_dir,
                self.model_cfg,
                self.policy_state.params,
                dtype=self.cfg.checkpoint.export_dtype,
            )
        if jax.process_index() == 0:
            self.tokenizer.save_pretrained(hf_dir)

    def summary(self, history: list[dict[str, Any]]) -> dict[str, float]:
        """End-of-run summary (:func:`rl_metrics.summarize`), with the device groups' busy,
        idle and overlap fractions of this process's timeline (``timeline/`` keys)."""
        out = rl_metrics.summarize(history)
        if not out:
            return out
        timeline = self.timeline.to_json()["summary"]
        out.update({f"timeline/{k}": v for k, v in timeline.items() if "device" not in k})
        return out

    def format_summary(self, summary: dict[str, float]) -> str:
        return rl_metrics.format_summary(summary)


# ---- building ----------------------------------------------------------------------------


def build_rl_trainer(
    cfg: RunConfig,
    *,
    mesh: Mesh | None = None,
    source: str = "<config>",
    override_paths: Sequence[str] | Mapping[str, str] = (),
    layout: RunLayout | None = None,
) -> RLTrainer:
    """Validates ``cfg`` (unless its ``layout`` is given), loads prompts, models and reward,
    and builds the programs.

    Args:
      cfg: the run config (``algorithm: ppo | grpo``).
      mesh: the training mesh (default: ``cfg.mesh`` over all devices, or over the first
        ``placement.train_devices``).
      source, override_paths: where the config came from, for messages.
      layout: ``config.validate``'s result, when the caller has it.

    Raises:
      ConfigError, DataError, CheckpointError, MeshError: one-line user errors.
    """
    if layout is None:
        layout = validate(
            cfg,
            mesh=mesh,
            source=source,
            override_paths=override_paths,
        )
    if mesh is None:
        mesh = train_mesh(cfg.mesh, cfg.placement)
    else:
        given_mesh(cfg.placement, mesh, source)
    algo = rl_section(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer)
    train_prompts, _ = load_datasets("prompt", cfg.data, tokenizer, cfg.tokenizer)
    reward_fn = rm_cfg = task_fn = env_factory = None
    try:
        if algo.rollout.environment is not None:
            env_factory = resolve_environment(algo.rollout.environment)
        if algo.reward.model_dir is None and algo.reward.function != "environment":
            reward_fn = resolve_reward_fn(algo.reward.function, cfg.data.train)
    except (EnvError, RewardError) as e:  # "rollout.environment: ..." / "reward.function: ..."
        field = f"{cfg.algorithm}.{str(e).partition(': ')[0]}"
        where = source_of(source, override_paths, field)
        raise ConfigError(f"{where}: {cfg.algorithm}.{e}") from None
    rm_source = source_of(source, override_paths, f"{cfg.algorithm}.reward.model_dir")
    if algo.reward.model_dir is not None:
        rm_cfg = reward_model_config(cfg, rm_source, layout.model.dtype)
    if cfg.data.train.startswith(BUILTIN_PREFIX):  # logged whatever drives RL
        task_fn = reward_fn if algo.reward.function == "builtin" else None
        task_fn = task_fn or resolve_reward_fn("builtin", cfg.data.train)
    programs = build_rl_programs(
        cfg,
        layout,
        model_with_tokenizer_ids(cfg, layout.model, tokenizer),
        mesh,
        generate_mesh(cfg.placement, mesh),
        sampling_params(algo, tokenizer.eos_id, tokenizer.pad_id),
        reward_model=rm_cfg,
        critic_mesh=critic_mesh(cfg.placement, cfg.mesh),
        reference_mesh=reference_mesh(cfg.placement),
    )
    init_key, _, run_key = jax.random.split(jax.random.key(cfg.train.seed), 3)
    states = initial_states(cfg, programs, init_key)
    sampler_base = None
    if programs.sync is not None and programs.sync.mode == "adapters":
        sampler_base, stats = programs.sync.resident_base(states.policy_frozen)
        adapters, full = programs.sync.bytes_per_iteration()
        logger.info(
            "LoRA weight sync: the sampler keeps the base (%.1f MiB moved once) and receives "
            "the adapters each iteration: %.2f MiB moved, vs %.1f MiB for a full sync",
            stats.bytes_moved / 2**20,
            adapters / 2**20,
            full / 2**20,
        )
    rm_params = None
    if rm_cfg is not None:
        rm_params = reward_model_params(cfg, rm_cfg, programs.reward_shardings, rm_source)
    ref_params, apart_ref = states.reference, None
    if programs.reference_apart is not None:  # on the sampler's or its own devices only
        ref_params, apart_ref = None, states.reference
    return RLTrainer(
        cfg=cfg,
        programs=programs,
        tokenizer=tokenizer,
        prompts=BatchIterator(
            train_prompts,
            algo.rollout.started_prompts,
            cfg.data.max_prompt_length,
            seed=cfg.data.seed,
            shuffle=cfg.data.shuffle,
            batch_from=f"{cfg.algorithm}.rollout.prompts_per_step"
            + (" + oversample_groups" if algo.rollout.oversample_groups else ""),
        ),
        reward_fn=reward_fn,
        task_fn=task_fn,
        policy_state=states.policy,
        value_state=states.value,
        ref_params=ref_params,
        rm_params=rm_params,
        kl_state=kl_controller(algo),
        key=run_key,
        policy_frozen=states.policy_frozen,
        value_frozen=states.value_frozen,
        sampler_base=sampler_base,
        env_factory=env_factory,
        apart_ref_params=apart_ref,
    )
