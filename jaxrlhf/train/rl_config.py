"""Typed configs of the RL trainers (``algorithm: ppo`` and ``algorithm: grpo``)."""

from __future__ import annotations

import dataclasses

from jaxrlhf.losses import AGGREGATIONS, IS_LEVELS, IS_MODES, KL_ESTIMATORS
from jaxrlhf.sharding.micro_batches import micro_batches_for

GRPO_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
ENGINES = ("static", "continuous")
KL_MODES = ("reward", "loss")
IS_WEIGHTS = ("none", *IS_MODES)
PROXIMALS = ("learner", "behaviour")
CRITIC_INITS = ("policy", "reward_model")


def _positive(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if not value > 0:
            raise ValueError(f"{name}: must be > 0, got {value}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """How each iteration samples.

    Attributes:
      prompts_per_step: prompts drawn per iteration (``train.batch_size`` is not used by RL).
      num_samples: completions per prompt (the GRPO group size; 1 is usual for PPO).
      max_new_tokens: response budget.
      temperature, top_k, top_p: sampling (top_k 0 and top_p 1.0 switch those off).
      stop_at_eos: end a response at the tokenizer's EOS token.
      shared_prefix: with ``num_samples > 1``, score and train each prompt once for its
        whole group (the prompt, then its n responses, in one packed row; same math, fewer
        FLOPs: see ``jaxrlhf.models.shared_prefix``). Used when each data shard of every
        micro-batch holds whole groups; otherwise the run logs why it is off. Packed
        attention is plain XLA (``model.attention_impl: cudnn`` is not used for it).
      score_micro_batch_size: rows per data shard in each scoring forward (reference, old
        policy, critic, reward model), run one after another; None scores the whole rollout
        at once. Bounds scoring's activation memory (the float32 logits of every scored row
        are the peak for large vocabularies) at no change in results. Must divide the rows
        each data shard holds; packing needs whole prompt groups in each scoring micro-batch.
        A streamed batch (``stream_scoring``) runs as many such forwards as it holds, or one
        if it holds fewer rows.
      pack_sequences: score and train on the samples' real lengths: each data shard packs
        the rows of a micro-batch (their real tokens only) into fewer rows of ``P + R``
        slots, several sequences per row with block-diagonal attention and reset positions
        (``jaxrlhf.models.packing``); with ``shared_prefix``, rows with the same prompt share
        one copy of it where their responses fit beside it. Same math as the padded rows.
        Considered in each phase whose micro-batches hold 2 or more rows per data shard
        (otherwise the run logs why it is off there) and used in an iteration where it runs
        no more slots than the rows unpacked (or in prompt groups, ``shared_prefix``). On
        by default: RL responses mostly stop well short of ``max_new_tokens``, and by that
        rule it never runs more model work than the unpacked path.
      pack_buckets: packed micro-batches take one of this many sizes, geometric steps from
        1/``pack_buckets`` of the rows each data shard holds to all of them
        (``models.packing.bucket_sizes``), so each program compiles at most this many times
        whatever the lengths; more sizes pack tighter and compile more.
      engine: ``"static"``: the sampler decodes every row for ``max_new_tokens`` steps;
        ``"continuous"``: the rollout engine (``jaxrlhf.generation.engine``) keeps ``slots``
        rows busy, a finished sample's slot taken by the next queued prompt, and hands
        finished groups to scoring while the tail decodes. The same samples either way
        (same key, same rows). The default is static: it needs no host round trip per
        ``chunk_tokens`` and wins on short budgets; continuous wins when response lengths
        are long-tailed and the budget long (benchmarks/RESULTS.md, G2).
      slots: the engine's decode slots (None: every row of the iteration at once); a
        multiple of ``num_samples`` and of the sampler's data shards, at most the rows the
        iteration starts.
      chunk_tokens: the engine's decode steps between two hand-outs / admissions (at most
        ``max_new_tokens`` run: a longer chunk would decode nothing after them).
      oversample_groups: the engine starts this many extra prompts and keeps the first
        ``prompts_per_step`` groups to finish, cancelling the rest (the long tail's cut);
        the count cut is logged.
      token_budget: the engine admits no prompt once this many tokens are decoded in the
        iteration (None: no budget); at least ``rows x max_new_tokens``, so the kept groups
        always finish.
      stop_strings: end a response once its decoded text contains one (engine only).
      stream_scoring: with the engine, score finished groups (reference, old policy, critic)
        between decode chunks instead of after the last one: the same arrays, earlier. Each
        streamed batch is sequence-packed like the whole rollout (``pack_sequences``).
      stream_concurrent: with ``stream_scoring``, run each streamed batch's device work (the
        reward model and the scoring forwards) on a background thread while the engine's
        thread goes on decoding: the same arrays, and scoring overlaps the tail's decode.
        The reward and task functions still run on the engine's thread, between chunks.
        Only where the programs may be in flight together: one process; on CPU devices
        where both fit the XLA:CPU client's pool (``jaxrlhf.platform``); on accelerators
        where the sampler's and learner's devices are disjoint or one program spans one
        device (docs/rollout.md). Elsewhere the batches are scored between decode chunks,
        with a warning. False: always between decode chunks. Logged:
        ``rollout/stream_concurrent``.
      environment: multi-turn episodes (engine only): dotted path ``module.attr`` of an
        environment class or function (``jaxrlhf.generation.environment``; the built-in tool
        task's is ``jaxrlhf.data.tool_task.CalculatorEnv``). Each model turn goes to it; its
        observations are appended to the sequence, out of the loss and the KL. None:
        single-turn. ``max_new_tokens`` is then the episode's budget (model and observation
        tokens together). Streamed scoring is off with an environment.
      max_turns: model turns per episode at most (with ``environment`` only, as are the
        next two).
      turn_tokens: a model turn's token budget, at most ``max_new_tokens`` (None: the
        episode's).
      env_timeout_s: an environment step that takes longer ends its episode with an error
        observation and reward 0.
      max_staleness: asynchronous RL: the sampler produces the next batches with weights up
        to this many policy versions old while the learner trains (0: synchronous, each batch
        sampled by the policy it updates). Each sample's policy version is logged
        (``rollout/policy_version``, ``rollout/staleness``); ``loss.rollout_correction``
        corrects for the difference. Checkpoints drain: the sampler takes no weights older
        than the last ``checkpoint.every`` boundary, so nothing is in flight when one is
        saved and a resumed run repeats the uninterrupted one (docs/sharding.md).
      partial_rollouts: asynchronous RL with the engine and ``oversample_groups``: the groups
        still decoding when ``prompts_per_step`` have finished are not cancelled but carried
        into the next rollout, which resumes them first under its newer weights (AReaL's
        partial rollouts; ``jaxrlhf.generation.partials``). Carried tokens are a version
        older than their rollout's, so rollouts are sampled at most ``max_staleness - 1``
        versions behind and a carried group with a token more than ``max_staleness``
        behind is dropped (at a checkpoint boundary every carried group is); each token
        keeps the behaviour log-prob it was sampled with.
        Logged: ``rollout/partial_rows``, ``rollout/staleness_max`` (the oldest token's).
    """

    prompts_per_step: int = 16
    num_samples: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_at_eos: bool = True
    shared_prefix: bool = True
    score_micro_batch_size: int | None = None
    pack_sequences: bool = True
    pack_buckets: int = 4
    engine: str = "static"
    slots: int | None = None
    chunk_tokens: int = 16
    oversample_groups: int = 0
    token_budget: int | None = None
    stop_strings: tuple[str, ...] = ()
    stream_scoring: bool = True
    stream_concurrent: bool = True
    environment: str | None = None
    max_turns: int = 4
    turn_tokens: int | None = None
    env_timeout_s: float = 30.0
    max_staleness: int = 0
    partial_rollouts: bool = False

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {self.max_staleness}")
        if self.partial_rollouts:
            needs = [
                (self.engine == "continuous", "engine: continuous"),
                (self.max_staleness >= 1, "max_staleness >= 1 (carried tokens are older)"),
                (self.oversample_groups > 0, "oversample_groups > 0 (else every group ends)"),
                (self.environment is None, "no environment (episodes are not resumed)"),
            ]
            missing = [what for ok, what in needs if not ok]
            if missing:
                raise ValueError(f"partial_rollouts: needs {missing[0]}")
        if (
            self.max_staleness
            and self.engine == "continuous"
            and self.stream_scoring
            and self.environment is None  # (multi-turn episodes are never streamed)
        ):
            raise ValueError(
                "max_staleness: streamed scoring runs the learner's forwards while the engine "
                "decodes; set stream_scoring: false for asynchronous RL"
            )
        _positive(
            self,
            "prompts_per_step",
            "num_samples",
            "max_new_tokens",
            "chunk_tokens",
            "pack_buckets",
            "max_turns",
            "env_timeout_s",
        )
        for name in ("score_micro_batch_size", "slots", "token_budget", "turn_tokens"):
            if getattr(self, name) is not None:
                _positive(self, name)
        if self.engine not in ENGINES:
            raise ValueError(f"engine: expected one of {list(ENGINES)}, got {self.engine!r}")
        if self.engine == "static":
            used = [
                name
                for name, on in (
                    ("oversample_groups", self.oversample_groups),
                    ("token_budget", self.token_budget is not None),
                    ("stop_strings", self.stop_strings),
                    ("slots", self.slots is not None),
                    ("environment", self.environment is not None),
                )
                if on
            ]
            if used:
                raise ValueError(
                    f"{used[0]}: needs engine: continuous (the static sampler has none)"
                )
        if self.oversample_groups < 0:
            raise ValueError(f"oversample_groups: must be >= 0, got {self.oversample_groups}")
        started = self.started_prompts * self.num_samples
        if self.slots is not None and self.slots > started:
            raise ValueError(
                f"slots: {self.slots} exceed the {started} rows an iteration starts "
                f"((prompts_per_step + oversample_groups) x num_samples); the other slots' KV "
                "cache would never be used"
            )
        if self.environment is not None:
            _check_dotted_path(self, "environment")
        else:
            for name in ("max_turns", "turn_tokens", "env_timeout_s"):
                if getattr(self, name) != _ROLLOUT_DEFAULTS[name]:
                    raise ValueError(f"{name}: applies to multi-turn episodes; set environment")
        if self.turn_tokens is not None and self.turn_tokens > self.max_new_tokens:
            raise ValueError(
                f"turn_tokens: {self.turn_tokens} exceeds max_new_tokens = "
                f"{self.max_new_tokens}, the whole episode's budget"
            )
        if self.slots is not None and self.slots % self.num_samples:
            raise ValueError(
                f"slots: {self.slots} do not hold whole groups of num_samples={self.num_samples}"
            )
        if self.token_budget is not None and self.token_budget < self.rows * self.max_new_tokens:
            raise ValueError(
                f"token_budget: {self.token_budget} is less than rows x max_new_tokens = "
                f"{self.rows * self.max_new_tokens}, which the kept groups may need"
            )
        if any(not s for s in self.stop_strings):
            raise ValueError("stop_strings: an empty string would end every response at once")
        if self.temperature <= 0:
            raise ValueError(f"temperature: must be > 0 for RL sampling, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")

    @property
    def rows(self) -> int:
        return self.prompts_per_step * self.num_samples

    @property
    def started_prompts(self) -> int:
        """Prompts drawn per iteration: ``prompts_per_step`` plus the over-sampled ones."""
        return self.prompts_per_step + self.oversample_groups

    @property
    def engine_slots(self) -> int:
        """The engine's decode slots: ``slots``, or every row the iteration starts."""
        return self.slots or self.started_prompts * self.num_samples

    @property
    def chunk_steps(self) -> int:
        """Decode steps in one engine chunk: ``chunk_tokens``, at most ``max_new_tokens``
        (a row admitted before a chunk ends within it; later steps would decode nothing)."""
        return min(self.chunk_tokens, self.max_new_tokens)


def _check_dotted_path(cfg: object, name: str) -> None:
    """``cfg.name`` is a dotted path ``module.attr`` (imported where the run starts)."""
    path = getattr(cfg, name)
    if "." not in path or not all(path.split(".")):
        raise ValueError(f"{name}: {path!r} is not a dotted path module.attr")


_ROLLOUT_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RolloutConfig)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutCorrectionConfig:
    """Off-policy correction between the sampler's policy and the learner's
    (``jaxrlhf.losses.correction``, docs/losses.md): the sampler computes the same model in
    another layout, and with ``rollout.max_staleness >= 1`` samples with older weights.

    Attributes:
      weights: ``"none"``; ``"truncate"`` (TIS: ``min(rho, cap)``) or ``"mask"`` (MIS: ``rho``
        inside ``[floor, cap]``, else 0), ``rho = pi_prox / mu`` from the behaviour log-probs
        the sampler kept per token. With ``proximal: learner`` this is decoupled PPO.
      level: ``"token"`` (a ratio per token) or ``"sequence"`` (the row's product of ratios).
      cap, floor: the bounds (``floor`` only with ``mask``; 0: none).
      proximal: what the clipped ratio is taken against: ``"learner"``, the policy's
        log-probs recomputed by the learner at the parameters the update starts from (the
        rollout's ``old_logprobs``, as in every synchronous run); ``"behaviour"``, the
        sampler's own log-probs (classic off-policy PPO; needs ``weights: none``).
    """

    weights: str = "none"
    level: str = "token"
    cap: float = 2.0
    floor: float = 0.0
    proximal: str = "learner"

    def __post_init__(self) -> None:
        for name, choices in (
            ("weights", IS_WEIGHTS),
            ("level", IS_LEVELS),
            ("proximal", PROXIMALS),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"{name}: expected one of {list(choices)}, got {getattr(self, name)!r}"
                )
        if not self.cap > 0:
            raise ValueError(f"cap: must be > 0, got {self.cap}")
        if not 0 <= self.floor < self.cap:
            raise ValueError(f"floor: must be in [0, cap), got {self.floor}")
        if self.floor and self.weights != "mask":
            raise ValueError("floor: only weights: mask uses a lower bound")
        if self.proximal == "behaviour" and self.weights != "none":
            raise ValueError(
                "proximal: 'behaviour' clips against the sampler's policy itself; the "
                "importance weights need proximal: learner"
            )

    @property
    def uses_behaviour(self) -> bool:
        """Whether the loss reads the sampler's per-token log-probs."""
        return self.weights != "none" or self.proximal == "behaviour"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """The clipped policy objective shared by PPO and the GRPO family.

    Attributes:
      epochs: passes over each rollout.
      num_minibatches: optimizer updates per epoch (the rollout split evenly).
      clip_low, clip_high: ratio clip range ``[1 - clip_low, 1 + clip_high]`` (clip-higher
        when ``clip_high > clip_low``).
      dual_clip: lower bound ``c`` on the surrogate for negative advantages (None: off).
      entropy_coef: weight of the entropy bonus.
      aggregation: loss reduction (see ``jaxrlhf.losses.aggregate_loss``);
        ``token_sum_norm`` divides by rows x ``max_new_tokens`` (Dr.GRPO).
      kl_coef: initial KL coefficient ``beta``.
      kl_mode: ``"reward"`` (per-token penalty in the reward) or ``"loss"`` (a loss term).
      kl_estimator: ``k1``/``k2``/``k3`` for the KL term.
      kl_target: with ``kl_mode: reward``, adapt ``beta`` toward this KL per sequence
        (Ziegler et al.); None keeps it fixed.
      kl_horizon: the adaptive controller's horizon in rollout rows.
      rollout_correction: importance weights between the sampler's and the learner's
        policies, and what the ratio is clipped against (:class:`RolloutCorrectionConfig`).
    """

    epochs: int = 1
    num_minibatches: int = 1
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    entropy_coef: float = 0.0
    aggregation: str = "token_mean"
    kl_coef: float = 0.05
    kl_mode: str = "reward"
    kl_estimator: str = "k1"
    kl_target: float | None = None
    kl_horizon: int = 10000
    rollout_correction: RolloutCorrectionConfig = dataclasses.field(
        default_factory=RolloutCorrectionConfig
    )

    def __post_init__(self) -> None:
        _positive(self, "epochs", "num_minibatches", "kl_horizon")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError("clip_low/clip_high: must be >= 0")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip: must be > 1 or null, got {self.dual_clip}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"aggregation: expected one of {list(AGGREGATIONS)}, got {self.aggregation!r}"
            )
        if self.kl_mode not in KL_MODES:
            raise ValueError(f"kl_mode: expected one of {list(KL_MODES)}, got {self.kl_mode!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"kl_estimator: expected one of {list(KL_ESTIMATORS)}, got {self.kl_estimator!r}"
            )
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef: must be >= 0, got {self.kl_coef}")
        if self.kl_target is not None and self.kl_mode != "reward":
            raise ValueError("kl_target: the adaptive controller needs kl_mode: reward")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """Where scores come from: a programmatic function or a trained reward model.

    Attributes:
      function: dotted path ``module.attr`` of a reward function, ``builtin`` for the
        built-in task's reward, or ``environment`` for the episodes' rewards (the sum of
        what ``rollout.environment`` returned; PPO pays each where its turn ended, unless
        ``normalize``). A function is called as ``fn(prompts,
        completions, **kwargs) -> [N] scores`` (decoded text, one entry per rollout row)
        with, as keyword arguments it accepts, ``prompt_ids``, ``completion_ids`` and every
        other column of the prompt's dataset record (e.g. ``answer``); see
        ``jaxrlhf.rewards.functions``.
      model_dir: a Hugging Face reward model (``*ForSequenceClassification``, e.g. the RM
        trainer's export); used when ``function`` is null.
      normalize: whiten scores over each rollout batch (mean 0, std 1). It scales the rows'
        totals only: PPO then pays an episode's whole shaped reward on its last token
        (per-turn environment rewards are not placed at their turns).
      clip: clip scores to ``[-clip, clip]`` after normalisation (None: off); a row's total,
        so with per-turn rewards (PPO) the last token carries the difference.
      overlong_buffer: GRPO/DAPO overlong shaping: the last this many tokens of the budget
        cost up to ``overlong_penalty`` linearly; responses cut at the budget cost it in full.
      overlong_penalty: the penalty's maximum.
    """

    function: str | None = "builtin"
    model_dir: str | None = None
    normalize: bool = False
    clip: float | None = None
    overlong_buffer: int = 0
    overlong_penalty: float = 0.0

    def __post_init__(self) -> None:
        if (self.function is None) == (self.model_dir is None):
            raise ValueError("set exactly one of reward.function and reward.model_dir")
        if self.function not in (None, "builtin", "environment"):
            _check_dotted_path(self, "function")
        if self.clip is not None and self.clip <= 0:
            raise ValueError(f"clip: must be > 0 or null, got {self.clip}")
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ValueError("overlong_buffer/overlong_penalty: must be >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ValueConfig:
    """The PPO critic's architecture.

    Attributes:
      branch_layer: null: a separate critic, its own copy of the whole model. An index ``B``
        (``0 <= B < num_layers``): a Hydra critic (trlX's hydra value head with
        ``num_layers_unfrozen = num_layers - B``): the embeddings and layers below ``B`` are
        a frozen trunk shared by the policy and the critic, the policy trains layers ``B``
        and up with its final norm and LM head, the critic its own copy of them with a value
        head, and scoring runs the trunk once for the old log-probs and values. The reference
        is the trunk plus a frozen copy of the policy's initial branch.
    """

    branch_layer: int | None = None

    def __post_init__(self) -> None:
        if self.branch_layer is not None and self.branch_layer < 0:
            raise ValueError(f"branch_layer: must be >= 0 or null, got {self.branch_layer}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOConfig:
    """``algorithm: ppo``: actor, critic, frozen reference, and a reward source.

    Attributes:
      rollout, loss, reward: see those classes.
      gamma, lam: GAE discount and trace decay.
      value_clip: PPO value clipping range (None: off).
      critic_init: initialise the critic from the ``policy`` weights or from the
        ``reward_model`` (``reward.model_dir``); the value head starts at zero either way.
      critic_lr: the critic's learning rate (None: ``optimizer.lr``).
      whiten_advantages: normalise advantages over each rollout's response tokens.
      value: the critic's architecture (a separate model, or a Hydra branch).
    """

    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    loss: PolicyLossConfig = dataclasses.field(default_factory=PolicyLossConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    value: ValueConfig = dataclasses.field(default_factory=ValueConfig)
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float | None = 0.2
    critic_init: str = "policy"
    critic_lr: float | None = None
    whiten_advantages: bool = True

    def __post_init__(self) -> None:
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError("gamma/lam: must be in [0, 1]")
        if self.critic_init not in CRITIC_INITS:
            raise ValueError(
                f"critic_init: expected one of {list(CRITIC_INITS)}, got {self.critic_init!r}"
            )
        if self.critic_init == "reward_model" and self.reward.model_dir is None:
            raise ValueError("critic_init: 'reward_model' needs reward.model_dir")
        if self.critic_init == "reward_model" and self.value.branch_layer is not None:
            raise ValueError(
                "critic_init: a Hydra critic (value.branch_layer) shares the policy's trunk; "
                "it starts from the policy, not from the reward model"
            )
        _check_environment_reward(self.rollout, self.reward)

    @property
    def hydra(self) -> bool:
        """Whether the critic is a Hydra branch of the policy (``value.branch_layer``)."""
        return self.value.branch_layer is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOLossConfig(PolicyLossConfig):
    """GRPO's defaults: KL as a k3 loss term with ``beta = 0.04`` (Shao et al. 2024)."""

    kl_coef: float = 0.04
    kl_mode: str = "loss"
    kl_estimator: str = "k3"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPORolloutConfig(RolloutConfig):
    """GRPO's default group size of 4 samples per prompt."""

    num_samples: int = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    """``algorithm: grpo``: no critic; advantages relative to each prompt's group.

    Attributes:
      rollout: ``num_samples`` is the group size (>= 2).
      loss: defaults to KL as a k3 loss term with ``beta = 0.04`` (GRPO paper).
      reward: scores (normally a programmatic function).
      advantage: ``grpo`` (group mean/std), ``dr_grpo`` (mean only, token-sum normalised
        loss), ``rloo`` (leave-one-out mean) or ``reinforce_pp`` (global batch whitening).
      dynamic_sampling: drop groups whose scores are all equal (no signal) and refill the
        batch with fresh prompts, up to ``max_refills`` extra rollouts (DAPO).
      max_refills: cap on extra rollouts per iteration for dynamic sampling.
    """

    rollout: GRPORolloutConfig = dataclasses.field(default_factory=GRPORolloutConfig)
    loss: GRPOLossConfig = dataclasses.field(default_factory=GRPOLossConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    advantage: str = "grpo"
    dynamic_sampling: bool = False
    max_refills: int = 3

    def __post_init__(self) -> None:
        if self.advantage not in GRPO_ADVANTAGES:
            raise ValueError(
                f"advantage: expected one of {list(GRPO_ADVANTAGES)}, got {self.advantage!r}"
            )
        if self.rollout.num_samples < 2:
            raise ValueError(
                f"rollout.num_samples: GRPO needs groups of >= 2, got {self.rollout.num_samples}"
            )
        if self.max_refills < 0:
            raise ValueError(f"max_refills: must be >= 0, got {self.max_refills}")
        if self.dynamic_sampling and self.rollout.max_staleness:
            raise ValueError(
                "dynamic_sampling: refills sample on demand; it needs rollout.max_staleness: 0"
            )
        _check_environment_reward(self.rollout, self.reward)


def _check_environment_reward(rollout: RolloutConfig, reward: RewardConfig) -> None:
    if reward.function == "environment" and rollout.environment is None:
        raise ValueError("reward.function: 'environment' needs rollout.environment")


# ---- sizes an RL run derives from its config and mesh (pure Python; see config.validate) ---


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


@dataclasses.dataclass(frozen=True)
class PackSizes:
    """Sequence packing per phase (``rollout.pack_sequences``): the rows each data shard holds
    in one micro-batch, which packing fits into fewer rows; 0 where the phase runs its rows
    padded.

    Attributes:
      score: in the scoring forwards (reference, old policy, critic, reward model).
      update: in the update's micro-batches.
    """

    score: int = 0
    update: int = 0


@dataclasses.dataclass(frozen=True)
class RLLayout:
    """What an RL run derives from its config and training mesh (``config.validate``).

    Attributes:
      num_micro: gradient-accumulation micro-batches per minibatch of the update.
      score_micro: scoring forwards per rollout (``rollout.score_micro_batch_size``).
      score_micro_rows: rows (over every data shard) in one scoring forward; None: each
        scoring call (the whole rollout, or a streamed batch) is one forward.
      groups: where prompt groups are packed (:class:`GroupSizes`); with sequence packing in
        a phase, its micro-batches still take whole groups (so rows with one prompt can
        share it) but the forward packs sequences instead.
      packing: where sequences are packed by their real lengths (:class:`PackSizes`).
      reuse_policy_forward: the policy's update forward stands in for the old-log-prob
        scoring forward (:func:`reuses_policy_forward`).
      reuse_value_forward: the critic's update forward stands in for the value scoring
        forward and computes GAE (:func:`reuses_value_forward`; PPO only).
      updates: optimizer updates of each learner over the run (the schedules' length).
      notes: why packing is off where it is (logged once by the trainer).
    """

    num_micro: int
    score_micro: int
    score_micro_rows: int | None
    groups: GroupSizes
    reuse_policy_forward: bool
    reuse_value_forward: bool
    updates: int
    packing: PackSizes = PackSizes()
    notes: tuple[str, ...] = ()

    def score_micro_of(self, rows: int) -> int:
        """Scoring forwards over ``rows`` rows, each at most ``score_micro_rows``:
        ``score_micro`` for the whole rollout; a streamed batch's share
        (``rl_stream.stream_rows`` sizes a batch above ``score_micro_rows`` in whole
        micro-batches)."""
        return micro_batches_for(rows, self.score_micro_rows)


def score_layout(algo: PPOConfig | GRPOConfig, section: str, shards: int) -> RLLayout:
    """The scoring part of :func:`rl_layout` on a mesh of ``shards`` data shards (the
    reference's forward on the sampler's group or its own, ``placement.reference: sampler |
    own``): scoring
    micro-batches, prompt groups and packed rows; no update.

    Raises:
      ValueError: ``"field.path: problem"`` when the rollout does not split into the scoring
        micro-batches over the shards.
    """
    if algo.rollout.rows % shards:
        raise ValueError(
            f"{section}.rollout.prompts_per_step: the {algo.rollout.rows} rollout rows do not "
            f"split over {shards} data shard(s)"
        )
    score_micro = _score_micro_batches(algo, section, shards)
    groups, _ = _group_sizes(algo, section, shards, 1, score_micro)
    packing, _ = _pack_sizes(algo, section, shards, 1, score_micro)
    return RLLayout(
        num_micro=1,
        score_micro=score_micro,
        groups=GroupSizes(groups.score, 1),
        reuse_policy_forward=False,
        reuse_value_forward=False,
        updates=0,
        packing=PackSizes(score=packing.score),
        score_micro_rows=_score_micro_rows(algo, shards),
    )


def reuses_policy_forward(cfg: PolicyLossConfig, num_micro: int) -> bool:
    """Whether the update's forward can stand in for the separate old-log-prob forward.

    True with one epoch of one minibatch in one micro-batch and the KL as a loss term: the
    update's only forward then runs at the params that sampled the rollout, so its log-probs
    equal the old log-probs, and the loss uses ``stop_gradient(logprobs)`` for them (the ratio
    is exactly 1 by construction; verl skips the recompute in the same case). Not with
    ``kl_mode: reward``, whose per-token rewards (hence GAE or the group advantages) need the
    old log-probs before the update, nor with several updates per rollout. Not with gradient
    accumulation either: its per-micro-batch means cannot carry the per-token log-probs (kept
    for inspection) or the exact KL metrics out of the update.
    """
    return cfg.epochs == 1 and cfg.num_minibatches == 1 and num_micro == 1 and cfg.kl_mode == "loss"


def reuses_value_forward(cfg: PolicyLossConfig, num_micro: int) -> bool:
    """Whether the critic's update forward can stand in for the separate value forward.

    True with one epoch of one minibatch in one micro-batch (any ``kl_mode``): the critic's
    only update forward then runs at the params that scored the rollout, so it computes the
    old values; the value loss runs GAE on their ``stop_gradient`` (the returns are its
    regression targets) and hands the advantages to the policy, whose update runs after the
    critic's in the same step. The per-token rewards (score and KL penalty) come from scoring.
    """
    return cfg.epochs == 1 and cfg.num_minibatches == 1 and num_micro == 1


def _update_micro_batches(
    algo: PPOConfig | GRPOConfig, section: str, shards: int, micro_batch_size: int | None
) -> int:
    rows, mb = algo.rollout.rows, algo.loss.num_minibatches
    if rows % mb:
        raise ValueError(
            f"{section}.loss.num_minibatches: {mb} does not divide the {rows} rollout rows "
            "(prompts_per_step x num_samples)"
        )
    rows_mb = rows // mb
    num_micro = 1 if micro_batch_size is None else max(1, rows_mb // (micro_batch_size * shards))
    if rows_mb % (num_micro * shards):
        raise ValueError(
            f"{section}: minibatches of {rows_mb} rows do not split into {num_micro} "
            f"micro-batch(es) over {shards} data shard(s)"
        )
    return num_micro


def _score_micro_batches(algo: PPOConfig | GRPOConfig, section: str, shards: int) -> int:
    micro = algo.rollout.score_micro_batch_size
    if micro is None:
        return 1
    rows = algo.rollout.rows
    if rows % (micro * shards):
        raise ValueError(
            f"{section}.rollout.score_micro_batch_size: {micro} rows per data shard do not "
            f"divide the {rows} rollout rows over {shards} data shard(s)"
        )
    return rows // (micro * shards)


def _score_micro_rows(algo: PPOConfig | GRPOConfig, shards: int) -> int | None:
    micro = algo.rollout.score_micro_batch_size
    return None if micro is None else micro * shards


def _group_sizes(
    algo: PPOConfig | GRPOConfig, section: str, shards: int, num_micro: int, score_micro: int
) -> tuple[GroupSizes, tuple[str, ...]]:
    n = algo.rollout.num_samples
    if not algo.rollout.shared_prefix or n == 1:
        return GroupSizes(1, 1), ()
    groups = algo.rollout.prompts_per_step
    score = n if groups % (score_micro * shards) == 0 else 1
    rows_mb = algo.rollout.rows // algo.loss.num_minibatches
    groups_mb, rest = divmod(rows_mb, n)
    update = n if not rest and groups_mb % (num_micro * shards) == 0 else 1
    option = f"{section}.rollout.shared_prefix"
    if score == 1 and update == 1 and score_micro == 1:
        return GroupSizes(1, 1), (
            f"{option} is off: {groups} prompt groups do not split over {shards} data shard(s)",
        )
    notes = []
    if score == 1:
        notes.append(
            f"{option} is off in scoring: {groups} prompt groups do not split into "
            f"{score_micro} scoring micro-batch(es) x {shards} data shard(s)"
        )
    if update == 1:
        notes.append(
            f"{option} is off in the update: {rows_mb} rows per minibatch do not split into "
            f"whole groups of {n} for {num_micro} micro-batch(es) x {shards} data shard(s)"
        )
    return GroupSizes(score, update), tuple(notes)


def _pack_sizes(
    algo: PPOConfig | GRPOConfig, section: str, shards: int, num_micro: int, score_micro: int
) -> tuple[PackSizes, tuple[str, ...]]:
    if not algo.rollout.pack_sequences:
        return PackSizes(), ()
    rows = algo.rollout.rows
    score = rows // (score_micro * shards)
    update = rows // algo.loss.num_minibatches // (num_micro * shards)
    option, notes = f"{section}.rollout.pack_sequences", []
    for phase, b in (("scoring", score), ("the update", update)):
        if b < 2:
            notes.append(
                f"{option} is off in {phase}: its micro-batches hold {b} row per data shard "
                "(nothing to pack beside it)"
            )
    return PackSizes(score if score > 1 else 0, update if update > 1 else 0), tuple(notes)


def rl_layout(
    algo: PPOConfig | GRPOConfig,
    *,
    section: str,
    shards: int,
    micro_batch_size: int | None,
    iterations: int,
) -> RLLayout:
    """The :class:`RLLayout` of ``algo`` (the ``section`` of the config) on a training mesh
    of ``shards`` data shards (data x fsdp).

    Raises:
      ValueError: ``"field.path: problem"`` when the rollout does not split into the
        minibatches, micro-batches or scoring micro-batches over the shards.
    """
    num_micro = _update_micro_batches(algo, section, shards, micro_batch_size)
    score_micro = _score_micro_batches(algo, section, shards)
    groups, notes = _group_sizes(algo, section, shards, num_micro, score_micro)
    packing, pack_notes = _pack_sizes(algo, section, shards, num_micro, score_micro)
    return RLLayout(
        num_micro=num_micro,
        score_micro=score_micro,
        groups=groups,
        reuse_policy_forward=reuses_policy_forward(algo.loss, num_micro),
        reuse_value_forward=isinstance(algo, PPOConfig)
        and reuses_value_forward(algo.loss, num_micro),
        updates=iterations * algo.loss.epochs * algo.loss.num_minibatches,
        packing=packing,
        notes=notes + pack_notes,
        score_micro_rows=_score_micro_rows(algo, shards),
    )
