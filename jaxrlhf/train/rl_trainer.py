"""The RL loop (``algorithm: ppo`` and ``algorithm: grpo``): the four-model iteration.

One iteration, each arrow a jitted pure function with its own shardings::

    policy params --reshard (train -> generate rules)--> sampler --> responses
        --> rewards (programmatic on host, or the reward model under score rules)
        --> old log-probs (policy), reference log-probs, values (critic) under score rules
        --> advantages (GAE, or group-relative)
        --> epochs x minibatches of policy (and critic) updates under train rules

Every phase is timed (after ``block_until_ready``) and reshards report the bytes they move.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf import losses
from jaxrlhf.config import ConfigError, RunConfig, validate
from jaxrlhf.data import BatchIterator, load_datasets, load_tokenizer
from jaxrlhf.data.sources import BUILTIN_PREFIX
from jaxrlhf.data.tokenizer import Tokenizer
from jaxrlhf.generation import Sampler, SamplingParams
from jaxrlhf.models import model as model_lib
from jaxrlhf.models import shared_prefix
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.hf_checkpoint import load_params
from jaxrlhf.models.hf_config import load_hf_config
from jaxrlhf.sharding import rules_for
from jaxrlhf.sharding.distributed import to_host
from jaxrlhf.sharding.model_sharding import build_sharded, param_shardings
from jaxrlhf.sharding.placement import generate_mesh, given_mesh, train_mesh
from jaxrlhf.train import rl_steps, steps
from jaxrlhf.train.loop import _init_params, _model_config, _put
from jaxrlhf.train.optim import OptimizerConfig, make_optimizer
from jaxrlhf.train.rewards import call_reward_fn, overlong_penalty, resolve_reward_fn
from jaxrlhf.train.rl_config import GRPOConfig, PPOConfig
from jaxrlhf.train.state import TrainState, init_state, state_shardings

logger = logging.getLogger(__name__)

# Peak dense bf16 FLOP/s per device, for the MFU estimate where the device is known.
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100": 312e12,
}


def device_peak_flops(device: jax.Device) -> float | None:
    """Peak FLOP/s of ``device`` if its kind is in :data:`PEAK_FLOPS` (None for CPUs)."""
    kind = getattr(device, "device_kind", "")
    return next((v for k, v in PEAK_FLOPS.items() if kind.startswith(k)), None)


def _flops_per_token(cfg: ModelConfig) -> float:
    """Forward FLOPs per token: 2 x the matmul parameters (embedding lookups are free)."""
    d, f, n, k, h = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.kv_heads,
        cfg.dim_per_head,
    )
    per_layer = d * h * (2 * n + 2 * k) + d * f * (3 if cfg.gated_mlp else 2)
    return 2.0 * (cfg.num_layers * per_layer + d * cfg.vocab_size)


@dataclasses.dataclass
class Learned:
    """A trained model: its state, shardings, module and jitted scoring function."""

    state: TrainState
    shardings: TrainState
    module: Any
    learner: rl_steps.Learner


@dataclasses.dataclass
class RLTrainer:
    """Everything an RL run holds between iterations (``policy``/``value`` are replaced)."""

    cfg: RunConfig
    algo: PPOConfig | GRPOConfig
    model_cfg: ModelConfig
    mesh: Mesh
    tokenizer: Tokenizer
    prompts: BatchIterator
    sampler: Sampler
    sampling: SamplingParams
    policy: Learned
    value: Learned | None
    ref_params: Any
    rm_params: Any | None
    reward_fn: Any | None
    task_fn: Any | None
    fns: dict[str, Any]
    kl_state: losses.AdaptiveKLState | losses.FixedKL
    key: jax.Array
    num_micro: int
    iteration: int = 0
    last_scored: dict[str, jax.Array] | None = None

    # ---- one iteration ---------------------------------------------------------------
    def rollout(self, key: jax.Array) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """Reshard, sample one batch of prompts and score it: host arrays + timings."""
        timings: dict[str, float] = {}
        host_prompts = next(self.prompts)
        start = time.perf_counter()
        gen_params, stats = self.sampler.to_generate_layout(self.policy.state.params)
        timings["time/reshard_s"] = time.perf_counter() - start
        timings["reshard/bytes_moved"] = float(stats.bytes_moved)
        start = time.perf_counter()
        out = self.sampler.generate(
            gen_params, host_prompts["tokens"], host_prompts["mask"], key, self.sampling
        )
        out = to_host(out)  # the whole rollout on every process (reward functions read it)
        del gen_params
        timings["time/generate_s"] = time.perf_counter() - start
        tokens = np.concatenate([out.prompt_tokens, out.tokens], axis=1).astype(np.int32)
        response_mask = np.concatenate([np.zeros_like(out.prompt_mask), out.response_mask], axis=1)
        rollout = {
            "tokens": tokens,
            "mask": np.concatenate([out.prompt_mask, out.response_mask], axis=1),
            "response_mask": response_mask,
            "lengths": np.asarray(out.lengths),
            "stopped": np.asarray(out.stopped),
            "sampler_logprobs": np.concatenate(
                [np.zeros(out.prompt_mask.shape, np.float32), out.model_logprobs], axis=1
            ),
        }
        start = time.perf_counter()
        rollout["scores_raw"] = self._scores(rollout, out)
        timings["time/reward_s"] = time.perf_counter() - start
        return rollout, timings

    def _scores(self, rollout: dict[str, np.ndarray], out: Any) -> np.ndarray:
        reward_cfg = self.algo.reward
        prompts = [
            self.tokenizer.decode(t[m])
            for t, m in zip(out.prompt_tokens, out.prompt_mask, strict=True)
        ]
        completions = [
            self.tokenizer.decode(t[m]) for t, m in zip(out.tokens, out.response_mask, strict=True)
        ]
        if self.task_fn is not None:  # the built-in task's own reward, logged whatever drives RL
            rollout["task_scores"] = call_reward_fn(self.task_fn, prompts, completions)
        if self.reward_fn is not None:
            scores = call_reward_fn(self.reward_fn, prompts, completions)
        else:
            batch = self._put({k: rollout[k] for k in ("tokens", "mask")})
            scores = to_host(self.fns["reward"](self.rm_params, batch))
        scores = scores - overlong_penalty(
            rollout["lengths"],
            rollout["stopped"],
            self.sampling.max_new_tokens,
            reward_cfg.overlong_buffer,
            reward_cfg.overlong_penalty,
        )
        return scores.astype(np.float32)

    def _put(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return _put(batch, {k: self.fns["row_sharding"](np.ndim(v)) for k, v in batch.items()})

    def _dynamic_sampling(self, key: jax.Array):
        """GRPO/DAPO dynamic sampling: keep groups whose scores differ; refill."""
        n = self.algo.rollout.num_samples
        want = self.algo.rollout.prompts_per_step
        kept, flat, timings = [], [], {}
        for attempt in range(1 + self.algo.max_refills):
            rollout, t = self.rollout(jax.random.fold_in(key, attempt))
            for k, v in t.items():
                timings[k] = timings.get(k, 0.0) + v
            groups = rollout["scores_raw"].reshape(-1, n)
            informative = groups.std(-1) > 0
            for g, ok in enumerate(informative):
                rows = {k: v[g * n : (g + 1) * n] for k, v in rollout.items()}
                (kept if ok else flat).append(rows)
            if len(kept) >= want:
                break
        timings["dynamic/rollouts"] = float(attempt + 1)
        timings["dynamic/informative_frac"] = len(kept) / ((attempt + 1) * want)
        chosen = (kept + flat)[:want]  # short of informative groups: flat ones add 0 signal
        return {k: np.concatenate([g[k] for g in chosen]) for k in chosen[0]}, timings

    def step(self) -> dict[str, float]:
        """One full RL iteration; returns host metrics (rewards, KL, losses, timings)."""
        key = jax.random.fold_in(self.key, self.iteration)
        sample_key, update_key = jax.random.split(key)
        iter_start = time.perf_counter()
        if isinstance(self.algo, GRPOConfig) and self.algo.dynamic_sampling:
            rollout, timings = self._dynamic_sampling(sample_key)
        else:
            rollout, timings = self.rollout(sample_key)
        metrics = self.learn(rollout, update_key, timings)
        metrics["time/iteration_s"] = time.perf_counter() - iter_start
        metrics.update(self._rollout_metrics(rollout, metrics))
        metrics["kl/coef"] = float(self.kl_state.kl_coef)
        self.kl_state = losses.kl_controller_update(
            self.kl_state, metrics["kl/seq_mean"], rollout["tokens"].shape[0]
        )
        self.iteration += 1
        return metrics

    def shaped_scores(self, rollout: dict[str, np.ndarray]) -> np.ndarray:
        """The rollout's scores after the configured normalisation and clipping."""
        scores = rollout["scores_raw"]
        if self.algo.reward.normalize:
            scores = (scores - scores.mean()) / (scores.std() + 1e-6)
        if self.algo.reward.clip is not None:
            scores = np.clip(scores, -self.algo.reward.clip, self.algo.reward.clip)
        return scores.astype(np.float32)

    def learn(
        self,
        rollout: dict[str, np.ndarray],
        key: jax.Array,
        timings: dict[str, float] | None = None,
    ) -> dict[str, float]:
        """Scores ``rollout`` (old/reference log-probs, values, advantages) and runs the
        update; replaces the policy (and critic) state. Returns host metrics."""
        timings = dict(timings or {})
        self._check_groups(rollout)
        start = time.perf_counter()
        batch = self._put({k: rollout[k] for k in ("tokens", "mask", "response_mask")})
        kl_coef = jnp.asarray(self.kl_state.kl_coef, jnp.float32)
        scored = self.fns["score"](
            self.policy.state.params,
            self.ref_params,
            None if self.value is None else self.value.state.params,
            batch,
            self._put({"scores": self.shaped_scores(rollout)}),
            kl_coef,
        )
        jax.block_until_ready(scored)
        timings["time/score_s"] = time.perf_counter() - start

        start = time.perf_counter()
        n_rows = rollout["tokens"].shape[0]
        train_batch = dict(
            batch,
            **{k: v for k, v in scored.items() if not k.startswith("m/")},
            kl_coef=jnp.full((n_rows,), kl_coef),
        )
        states = (self.policy.state,) + (() if self.value is None else (self.value.state,))
        # per_token: the old log-probs when the update's forward stood in for them.
        states, update_metrics, per_token = self.fns["update"](states, train_batch, key)
        self.policy.state = states[0]
        if self.value is not None:
            self.value.state = states[1]
        update_metrics = to_host(update_metrics)
        timings["time/train_s"] = time.perf_counter() - start
        self.last_scored = {**scored, **per_token}  # for inspection (tests, notebooks)
        metrics = {k: float(v) for k, v in update_metrics.items()}
        scored_m = to_host({k[2:]: v for k, v in scored.items() if k.startswith("m/")})
        metrics.update({k: float(v) for k, v in scored_m.items()})
        metrics.update(timings)
        return metrics

    def _check_groups(self, rollout: dict[str, np.ndarray]) -> None:
        """Packed prompt groups need each group's rows to carry one prompt (the sampler's
        groups do; a hand-built rollout might not)."""
        n = max(self.fns["groups"].score, self.fns["groups"].update)
        if n == 1:
            return
        prompt_len = rollout["tokens"].shape[1] - self.sampling.max_new_tokens
        same = shared_prefix.prompts_match(rollout["tokens"], rollout["mask"], prompt_len, n)
        if not same.all():
            raise ValueError(
                f"rollout group {int(np.argmin(same))} (rows of {n}) does not share one prompt; "
                f"{self.cfg.algorithm}.rollout.shared_prefix needs each group's rows to carry "
                "the same prompt tokens and mask (set it to false otherwise)"
            )

    def _rollout_metrics(self, rollout: dict[str, np.ndarray], timings: dict[str, float]):
        n_rows, total_len = rollout["tokens"].shape
        generated = float(rollout["lengths"].sum())
        m = {
            "reward/mean": float(rollout["scores_raw"].mean()),
            "reward/std": float(rollout["scores_raw"].std()),
            **(
                {"reward/task_mean": float(rollout["task_scores"].mean())}
                if "task_scores" in rollout
                else {}
            ),
            "response/length_mean": float(rollout["lengths"].mean()),
            "response/stopped_frac": float(rollout["stopped"].mean()),
            "throughput/generate_tok_s": generated / max(timings["time/generate_s"], 1e-9),
        }
        # Model FLOPs (forward 2N per token, backward 4N): generation (prefill + decode),
        # scoring (one forward per scored model), and the update (policy and critic).
        fpt = _flops_per_token(self.model_cfg)
        seq_tokens = n_rows * total_len
        # Packed prompt groups run (P + nR) of every n(P + R) tokens (rollout.shared_prefix).
        new = self.sampling.max_new_tokens
        groups = self.fns["groups"]
        score_tokens = seq_tokens * shared_prefix.flops_fraction(total_len - new, new, groups.score)
        update_tokens = seq_tokens * shared_prefix.flops_fraction(
            total_len - new, new, groups.update
        )
        scored_models = (
            1  # the reference; policy and critic unless their update forwards stand in
            + (not self.fns["reuse_forward"])
            + (self.value is not None and not self.fns["reuse_value_forward"])
            + (self.rm_params is not None)
        )
        epochs = self.algo.loss.epochs
        n = self.sampling.n  # the sampler prefills each prompt once per group
        flops = (
            fpt * seq_tokens * shared_prefix.flops_fraction(total_len - new, new, n)
            + fpt * score_tokens * scored_models
            + 3 * fpt * update_tokens * epochs * (1 + (self.value is not None))
        )
        m["throughput/model_tflops"] = flops / timings["time/iteration_s"] / 1e12
        peak = device_peak_flops(self.mesh.devices.flat[0])
        if peak:  # over every device the phases use (the sampler may have a mesh of its own)
            devices = {*self.mesh.devices.flat, *self.sampler.mesh.devices.flat}
            m["throughput/mfu"] = flops / timings["time/iteration_s"] / (peak * len(devices))
        return m


# ---- building ----------------------------------------------------------------------------


def _algo(cfg: RunConfig) -> PPOConfig | GRPOConfig:
    return cfg.ppo if cfg.algorithm == "ppo" else cfg.grpo


def _check_sizes(cfg: RunConfig, algo: PPOConfig | GRPOConfig, mesh: Mesh, source: str) -> int:
    rows = algo.rollout.rows
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    mb = algo.loss.num_minibatches
    section = cfg.algorithm
    if rows % mb:
        raise ConfigError(
            f"{source}: {section}.loss.num_minibatches: {mb} does not divide the "
            f"{rows} rollout rows (prompts_per_step x num_samples)"
        )
    rows_mb = rows // mb
    micro = cfg.train.micro_batch_size
    num_micro = 1 if micro is None else max(1, rows_mb // (micro * shards))
    if rows_mb % (num_micro * shards):
        raise ConfigError(
            f"{source}: {section}: minibatches of {rows_mb} rows do not split into {num_micro} "
            f"micro-batch(es) over {shards} data shard(s)"
        )
    total = cfg.data.max_prompt_length + algo.rollout.max_new_tokens
    model_cfg = cfg.model.resolve()
    if total > model_cfg.max_position_embeddings:
        raise ConfigError(
            f"{source}: data.max_prompt_length + {section}.rollout.max_new_tokens = {total} "
            f"exceeds the model's {model_cfg.max_position_embeddings} positions"
        )
    return num_micro


def score_micro_batches(
    cfg: RunConfig, algo: PPOConfig | GRPOConfig, mesh: Mesh, source: str
) -> int:
    """How many scoring forwards split the rollout (``rollout.score_micro_batch_size``)."""
    micro = algo.rollout.score_micro_batch_size
    if micro is None:
        return 1
    rows, shards = algo.rollout.rows, mesh.shape["data"] * mesh.shape["fsdp"]
    if rows % (micro * shards):
        raise ConfigError(
            f"{source}: {cfg.algorithm}.rollout.score_micro_batch_size: {micro} rows per data "
            f"shard do not divide the {rows} rollout rows over {shards} data shard(s)"
        )
    return rows // (micro * shards)


@dataclasses.dataclass(frozen=True)
class GroupSizes:
    """Rows per packed prompt group (1: unpacked) in each phase, see ``rollout.shared_prefix``.

    Attributes:
      score: in the scoring forwards (reference, old policy, critic, reward model), which run
        over the whole rollout: packed when every data shard holds whole groups.
      update: in the update, whose minibatches and micro-batches then take whole groups: packed
        when each data shard of every micro-batch holds whole groups.
    """

    score: int
    update: int


def shared_group_sizes(
    cfg: RunConfig,
    algo: PPOConfig | GRPOConfig,
    mesh: Mesh,
    num_micro: int,
    source: str,
    score_micro: int = 1,
) -> GroupSizes:
    """Where ``rollout.shared_prefix`` packs prompt groups; logs each phase it cannot.

    ``num_micro`` and ``score_micro``: micro-batches per minibatch of the update, and scoring
    forwards per rollout."""
    n = algo.rollout.num_samples
    if not algo.rollout.shared_prefix or n == 1:
        return GroupSizes(1, 1)
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    groups = algo.rollout.prompts_per_step
    score = n if groups % (score_micro * shards) == 0 else 1
    rows_mb = algo.rollout.rows // algo.loss.num_minibatches
    groups_mb, rest = divmod(rows_mb, n)
    update = n if not rest and groups_mb % (num_micro * shards) == 0 else 1
    option = f"{source}: {cfg.algorithm}.rollout.shared_prefix"
    if score == 1 and update == 1 and score_micro == 1:
        logger.warning(
            "%s is off: %d prompt groups do not split over %d data shard(s)",
            option,
            groups,
            shards,
        )
        return GroupSizes(score, update)
    if score == 1:
        logger.warning(
            "%s is off in scoring: %d prompt groups do not split into %d scoring "
            "micro-batch(es) x %d data shard(s)",
            option,
            groups,
            score_micro,
            shards,
        )
    if update == 1:
        logger.warning(
            "%s is off in the update: %d rows per minibatch do not split into whole groups of "
            "%d for %d micro-batch(es) x %d data shard(s)",
            option,
            rows_mb,
            n,
            num_micro,
            shards,
        )
    return GroupSizes(score, update)


def _gae(algo: PPOConfig) -> rl_steps.GaeConfig:
    return rl_steps.GaeConfig(gamma=algo.gamma, lam=algo.lam, whiten=algo.whiten_advantages)


def _learned(
    model_cfg: ModelConfig,
    mesh: Mesh,
    role: str,
    head: str,
    params: Any,
    optimizer_cfg: OptimizerConfig,
    steps_total: int,
    objective: steps.Objective,
):
    rules = rules_for(role, "train")
    param_sh = param_shardings(model_cfg, mesh, rules, head)
    optimizer, lr_fn = make_optimizer(optimizer_cfg, steps_total)
    shardings = state_shardings(
        model_lib.abstract_params(model_cfg, head), param_sh, optimizer, mesh
    )
    module = build_sharded(model_cfg, mesh, rules, head)
    learner = rl_steps.Learner(objective, module, optimizer, lr_fn, rules, param_sh)
    return Learned(init_state(params, optimizer, shardings), shardings, module, learner)


def build_rl_trainer(
    cfg: RunConfig, *, mesh: Mesh | None = None, source: str = "<config>"
) -> RLTrainer:
    """Validates ``cfg``, loads prompts, models and reward, and jits every phase.

    Raises:
      ConfigError, DataError, CheckpointError, MeshError, RewardError: one-line user errors.
    """
    algo = _algo(cfg)
    model_cfg = validate(cfg, source=source, device_count=None if mesh is None else mesh.size)
    if mesh is None:
        mesh = train_mesh(cfg.mesh, cfg.placement)
    else:
        given_mesh(cfg, mesh, source)
    num_micro = _check_sizes(cfg, algo, mesh, source)
    score_micro = score_micro_batches(cfg, algo, mesh, source)
    groups = shared_group_sizes(cfg, algo, mesh, num_micro, source, score_micro)
    tokenizer = load_tokenizer(cfg.tokenizer)
    model_cfg = _model_config(cfg, model_cfg, tokenizer)
    train_prompts, _ = load_datasets("prompt", cfg.data, tokenizer, cfg.tokenizer)
    prompts = BatchIterator(
        train_prompts,
        algo.rollout.prompts_per_step,
        cfg.data.max_prompt_length,
        seed=cfg.data.seed,
        shuffle=cfg.data.shuffle,
    )
    iterations = cfg.train.steps
    updates = iterations * algo.loss.epochs * algo.loss.num_minibatches
    init_key, value_key, run_key = jax.random.split(jax.random.key(cfg.train.seed), 3)

    policy_params = _init_params(
        cfg,
        model_cfg,
        "lm",
        param_shardings(model_cfg, mesh, rules_for("policy", "train")),
        init_key,
    )
    ref_rules = rules_for("reference", "score")
    ref_params = jax.jit(lambda p: p, out_shardings=param_shardings(model_cfg, mesh, ref_rules))(
        jax.tree.map(jnp.copy, policy_params)
    )
    policy = _learned(
        model_cfg,
        mesh,
        "policy",
        "lm",
        policy_params,
        cfg.optimizer,
        updates,
        rl_steps.policy_objective(algo.loss, algo.rollout.max_new_tokens, groups.update),
    )

    rm_cfg = rm_params = reward_fn = None
    if algo.reward.model_dir is not None:
        rm_cfg = load_hf_config(algo.reward.model_dir)
        rm_params = load_params(
            algo.reward.model_dir,
            rm_cfg,
            head="scalar",
            shardings=param_shardings(rm_cfg, mesh, rules_for("reward", "score"), "scalar"),
        )
    else:
        reward_fn = resolve_reward_fn(algo.reward.function, cfg.data.train)

    task_fn = None
    if cfg.data.train.startswith(BUILTIN_PREFIX):
        task_fn = resolve_reward_fn("builtin", cfg.data.train)

    value = None
    if isinstance(algo, PPOConfig):
        value_sh = param_shardings(model_cfg, mesh, rules_for("value", "train"), "scalar")
        if algo.critic_init == "reward_model":
            value_params = load_params(
                algo.reward.model_dir, model_cfg, head="scalar", shardings=value_sh
            )
            value_params["score"] = jnp.zeros_like(value_params["score"])
        else:  # the policy's decoder with a zero value head
            value_params = {
                "decoder": jax.tree.map(jnp.copy, policy.state.params["decoder"]),
                "score": jnp.zeros((model_cfg.hidden_size, 1), model_cfg.weight_dtype),
            }
            value_params = jax.device_put(value_params, value_sh)
        critic_opt = (
            cfg.optimizer
            if algo.critic_lr is None
            else dataclasses.replace(cfg.optimizer, lr=algo.critic_lr)
        )
        value = _learned(
            model_cfg,
            mesh,
            "value",
            "scalar",
            value_params,
            critic_opt,
            updates,
            rl_steps.value_objective(
                algo.value_clip,
                algo.loss.aggregation,
                algo.rollout.max_new_tokens,
                groups.update,
                _gae(algo),
            ),
        )
    del value_key

    sampler = Sampler(model_cfg, generate_mesh(cfg.placement, mesh))
    stop = (tokenizer.eos_id,) if algo.rollout.stop_at_eos and tokenizer.eos_id is not None else ()
    sampling = SamplingParams(
        temperature=algo.rollout.temperature,
        top_k=algo.rollout.top_k,
        top_p=algo.rollout.top_p,
        max_new_tokens=algo.rollout.max_new_tokens,
        stop_token_ids=stop,
        n=algo.rollout.num_samples,
        pad_token_id=tokenizer.pad_id,
        return_model_logprobs=True,
    )
    fns = _jit_functions(
        cfg, algo, model_cfg, rm_cfg, mesh, policy, value, ref_rules, num_micro, groups, score_micro
    )
    if algo.loss.kl_target is not None:
        kl_state = losses.AdaptiveKLState(
            algo.loss.kl_coef, algo.loss.kl_target, algo.loss.kl_horizon
        )
    else:
        kl_state = losses.FixedKL(algo.loss.kl_coef)
    return RLTrainer(
        cfg=cfg,
        algo=algo,
        model_cfg=model_cfg,
        mesh=mesh,
        tokenizer=tokenizer,
        prompts=prompts,
        sampler=sampler,
        sampling=sampling,
        policy=policy,
        value=value,
        ref_params=ref_params,
        rm_params=rm_params,
        reward_fn=reward_fn,
        task_fn=task_fn,
        fns=fns,
        kl_state=kl_state,
        key=run_key,
        num_micro=num_micro,
    )


def _jit_functions(
    cfg, algo, model_cfg, rm_cfg, mesh, policy, value, ref_rules, num_micro, groups, score_micro=1
):
    score_rules = rules_for("policy", "score")
    replicated = NamedSharding(mesh, P())

    def row_sharding(ndim: int) -> NamedSharding:
        return steps.batch_sharding(mesh, score_rules, ndim)

    ref_module = build_sharded(model_cfg, mesh, ref_rules, "lm")
    # One update on one micro-batch with the KL as a loss term: the update's forward gives
    # the old log-probs, so scoring skips the policy forward (rl_steps.reuses_policy_forward).
    reuse_forward = rl_steps.reuses_policy_forward(algo.loss, num_micro)
    # Likewise the critic's update forward gives the old values, and GAE runs in its loss.
    reuse_value = value is not None and rl_steps.reuses_value_forward(algo.loss, num_micro)

    def score_micro_batched(forwards, batch):
        """``forwards`` over ``rollout.score_micro_batch_size`` rows per data shard at a time."""
        rows = {k: batch[k] for k in ("tokens", "mask")}
        return steps.map_micro(forwards, rows, score_micro, mesh, score_rules, groups.score)

    def score(policy_params, ref_params, value_params, batch, scores, kl_coef):
        resp = batch["response_mask"]
        start = rl_steps.response_start(batch["tokens"], algo.rollout.max_new_tokens)
        group_size = groups.score

        def forwards(rows):
            tokens, mask = rows["tokens"], rows["mask"]
            out = {
                "ref_logprobs": rl_steps.aligned_logprobs(
                    ref_module, ref_params, tokens, mask, start, group_size
                )[0]
            }
            if not reuse_forward:
                out["old_logprobs"] = rl_steps.aligned_logprobs(
                    policy.module, policy_params, tokens, mask, start, group_size
                )[0]
            if value is not None and not reuse_value:
                out["old_values"] = rl_steps.aligned_values(
                    value.module, value_params, tokens, mask, start, group_size
                )
            return out

        forward_out = score_micro_batched(forwards, batch)
        ref = forward_out["ref_logprobs"]
        old = forward_out.get("old_logprobs")
        out = {k: v for k, v in forward_out.items() if k != "old_values"}
        s = scores["scores"]
        if reuse_value:  # the critic's update computes values and GAE from these rewards
            rewards, m = rl_steps.ppo_token_rewards(s, old, ref, resp, kl_coef, loss_cfg=algo.loss)
            out["token_rewards"] = rewards
        elif value is not None:
            values = forward_out["old_values"]
            adv, ret, m = rl_steps.ppo_advantages(
                s,
                old,
                ref,
                values,
                resp,
                kl_coef,
                loss_cfg=algo.loss,
                gamma=algo.gamma,
                lam=algo.lam,
                whiten=algo.whiten_advantages,
            )
            out.update(old_values=values, returns=ret, advantages=adv)
            m.update(rl_steps.value_metrics(adv, ret, values, resp))
        else:
            adv, m = rl_steps.grpo_advantages(
                s,
                old,
                ref,
                resp,
                kl_coef,
                loss_cfg=algo.loss,
                advantage=algo.advantage,
                group_size=algo.rollout.num_samples,
            )
            out["advantages"] = adv
            m["advantages/abs_mean"] = losses.masked_mean(jnp.abs(adv), resp)
        out.update({f"m/{k}": v for k, v in m.items()})
        return out

    fns: dict[str, Any] = {
        "row_sharding": row_sharding,
        "reuse_forward": reuse_forward,
        "reuse_value_forward": reuse_value,
        "groups": groups,
    }
    fns["score"] = jax.jit(score)
    learners = (policy.learner,) + (() if value is None else (value.learner,))
    state_sh = (policy.shardings,) + (() if value is None else (value.shardings,))
    update = functools.partial(
        rl_steps.rl_update,
        learners=learners,
        epochs=algo.loss.epochs,
        num_minibatches=algo.loss.num_minibatches,
        num_micro=num_micro,
        mesh=mesh,
        group_size=groups.update,
    )
    fns["update"] = jax.jit(
        update,
        in_shardings=(state_sh, None, replicated),
        out_shardings=(
            state_sh,
            replicated,
            {
                k: row_sharding(2)
                for k in ("old_logprobs",) * reuse_forward
                + ("old_values", "returns", "advantages") * reuse_value
            },
        ),
        donate_argnums=0,
    )
    if rm_cfg is not None:
        rm_module = build_sharded(rm_cfg, mesh, rules_for("reward", "score"), "scalar")

        def reward(rm_params, batch):
            start = rl_steps.response_start(batch["tokens"], algo.rollout.max_new_tokens)
            return score_micro_batched(
                lambda rows: rl_steps.sequence_scores(
                    rm_module, rm_params, rows["tokens"], rows["mask"], start, groups.score
                ),
                batch,
            )

        fns["reward"] = jax.jit(reward)
    return fns
