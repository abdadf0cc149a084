"""Typed configs of the RL trainers (``algorithm: ppo`` and ``algorithm: grpo``)."""

from __future__ import annotations

import dataclasses

from jaxrlhf.losses import AGGREGATIONS, KL_ESTIMATORS

GRPO_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
KL_MODES = ("reward", "loss")
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

    def __post_init__(self) -> None:
        _positive(self, "prompts_per_step", "num_samples", "max_new_tokens")
        if self.score_micro_batch_size is not None:
            _positive(self, "score_micro_batch_size")
        if self.temperature <= 0:
            raise ValueError(f"temperature: must be > 0 for RL sampling, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")

    @property
    def rows(self) -> int:
        return self.prompts_per_step * self.num_samples


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
      function: dotted path ``module.attr`` of ``fn(prompts, completions) -> [B] scores``
        (lists of str in, floats out), or ``builtin`` for the built-in task's reward.
      model_dir: a Hugging Face reward model (``*ForSequenceClassification``, e.g. the RM
        trainer's export); used when ``function`` is null.
      normalize: whiten scores over each rollout batch (mean 0, std 1).
      clip: clip scores to ``[-clip, clip]`` after normalisation (None: off).
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
        if self.clip is not None and self.clip <= 0:
            raise ValueError(f"clip: must be > 0 or null, got {self.clip}")
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ValueError("overlong_buffer/overlong_penalty: must be >= 0")


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
    """

    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    loss: PolicyLossConfig = dataclasses.field(default_factory=PolicyLossConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
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
