"""Typed configs of training: the loop (steps and batch sizes, logging, checkpoints and
exports), the optimizer, LoRA, and the supervised algorithms (SFT, reward model, DPO).

Plain dataclasses only: importing this module loads no JAX, Flax or optax (``jaxrlhf.config``
composes these sections and must stay light). The code each section configures lives in
``optim.py``, ``sft.py``, ``reward_model.py`` and ``dpo.py`` beside it; the RL algorithms'
sections are in ``rl_config.py``.
"""

from __future__ import annotations

import dataclasses
import math

from jaxrlhf.losses import F_DIVERGENCES

SCHEDULES = ("cosine", "linear", "constant")
# TRL's other paired DPO loss types (train/dpo.py maps each to its loss function).
DPO_VARIANT_LOSSES = (
    "robust",
    "bco_pair",
    "nca_pair",
    "apo_zero",
    "apo_down",
    "exo_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
)
DPO_LOSS_CHOICES = ("sigmoid", "ipo", "hinge", "simpo", "orpo", *DPO_VARIANT_LOSSES)
REFERENCE_FREE_LOSSES = ("simpo", "orpo")
DPO_SMOOTHED_LOSSES = ("sigmoid", "simpo", "robust", "exo_pair", "aot", "aot_unpaired")
DPO_F_DIVERGENCE_LOSSES = (
    "sigmoid",
    "hinge",
    "robust",
    "bco_pair",
    "nca_pair",
    "exo_pair",
    "sppo_hard",
)
SFT_AGGREGATIONS = ("token_mean", "seq_mean_token_mean")
PROGRESS_MODES = ("auto", "rich", "tqdm", "plain", "none")
EXPORT_DTYPES = (None, "float32", "bfloat16", "float16")
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # models/lora.py's TARGETS
LORA_SYNCS = ("adapters", "full")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Steps, batch sizes and intervals.

    Attributes:
      steps: optimizer updates.
      batch_size: global rows (sequences or pairs) per update.
      micro_batch_size: rows per data shard per accumulation step; the update accumulates
        ``batch_size / (micro_batch_size x data shards)`` micro-batches. None: no
        accumulation (``batch_size / data shards``). Data shards = mesh data x fsdp.
      eval_batch_size: rows per evaluation batch (None: ``batch_size``).
      eval_every: evaluate on the held-out split every this many steps (0: only at the
        end).
      log_every: log metrics (averaged over the interval) every this many steps.
      seed: parameter initialisation seed (the data has its own).
      max_consecutive_skips: an update whose loss or gradient is not finite is skipped
        (parameters and optimizer state unchanged, counted in the ``skipped`` metric); this many
        skips in a row stop the run with an error (no checkpoint is written from it).
    """

    steps: int = 100
    batch_size: int = 32
    micro_batch_size: int | None = None
    eval_batch_size: int | None = None
    eval_every: int = 0
    log_every: int = 10
    seed: int = 0
    max_consecutive_skips: int = 5

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "log_every", "max_consecutive_skips"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("micro_batch_size", "eval_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1 or null, got {value}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every: must be >= 0, got {self.eval_every}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Where metrics go. ``metrics.jsonl`` in the run directory is always written.

    Attributes:
      progress: ``"auto"`` (a rich or tqdm bar on a terminal, plain lines otherwise),
        ``"rich"``, ``"tqdm"``, ``"plain"`` or ``"none"``.
      tensorboard: also write TensorBoard events to ``<output_dir>/tensorboard`` (needs
        tensorboardX or torch's tensorboard support; skipped with a note if missing).
      wandb: also log to Weights & Biases (needs wandb; skipped with a note if missing).
      wandb_project: the W&B project.
      plot: write ``metrics.png`` with the main curves at the end (needs matplotlib;
        skipped with a note if missing).
    """

    progress: str = "auto"
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "jaxrlhf"
    plot: bool = True

    def __post_init__(self) -> None:
        if self.progress not in PROGRESS_MODES:
            raise ValueError(
                f"progress: expected one of {list(PROGRESS_MODES)}, got {self.progress!r}"
            )


RESUME_MODES = ("auto", "always", "never")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Orbax checkpoints of the whole run state, resume, and the final exports.

    A checkpoint holds every trained role's parameters and optimizer state, the step
    counter, PRNG keys, the KL controller, the data position, running metric sums and the
    resolved config. It is written atomically (a crash mid-save leaves the previous one
    usable), in the background where Orbax allows, every ``every`` steps (RL: iterations),
    at the end, and when the run is preempted (SIGTERM/SIGINT).

    Attributes:
      every: save every this many steps (0: only at the end and on preemption).
      keep: checkpoints kept (the oldest are deleted).
      directory: where checkpoints go (null: ``<output_dir>/checkpoints``).
      async_save: write in a background thread while training continues.
      resume: ``"auto"``: continue from the newest checkpoint in ``directory`` if there is
        one; ``"always"``: the same, but a missing checkpoint is an error (the CLI's
        ``--resume``); ``"never"``: start fresh, and refuse to run if ``directory`` already
        holds checkpoints (never overwrite work).
      export_hf: write the final model (and tokenizer) in Hugging Face format to
        ``<output_dir>/hf``: ``*ForCausalLM``, or ``*ForSequenceClassification`` for a
        reward model.
      export_dtype: dtype of the exported tensors (null: the model's param dtype).
    """

    every: int = 100
    keep: int = 2
    directory: str | None = None
    async_save: bool = True
    resume: str = "auto"
    export_hf: bool = True
    export_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.export_dtype not in EXPORT_DTYPES:
            raise ValueError(
                "export_dtype: expected null, float32, bfloat16 or float16, "
                f"got {self.export_dtype!r}"
            )
        if self.every < 0:
            raise ValueError(f"every: must be >= 0, got {self.every}")
        if self.keep < 1:
            raise ValueError(f"keep: must be >= 1, got {self.keep}")
        if self.resume not in RESUME_MODES:
            raise ValueError(f"resume: expected one of {list(RESUME_MODES)}, got {self.resume!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW and its learning-rate schedule.

    Attributes:
      lr: peak learning rate.
      schedule: after warmup, ``"cosine"`` or ``"linear"`` decay to ``lr * min_lr_ratio`` at
        the last step, or ``"constant"``.
      warmup_steps: linear warmup from 0 over this many steps.
      min_lr_ratio: final learning rate as a fraction of ``lr``.
      weight_decay: decoupled weight decay on matrices and embeddings.
      b1, b2, eps: Adam moments.
      max_grad_norm: clip the global gradient norm to this; 0 disables clipping.
      mu_dtype: dtype of the first moment (e.g. ``"bfloat16"`` to halve its memory); None
        keeps the param dtype.
      stochastic_rounding: train weights stored in bfloat16 (``model.param_dtype:
        bfloat16``): Adam runs in float32 and each update is rounded into the bfloat16
        weights stochastically (unbiased), where rounding to nearest drops every update
        under half a bfloat16 spacing (0.2-0.4% of the weight: all of them at lr 1e-6). Saves
        the float32 master copy (2 bytes per parameter) at the price of rounding noise; the
        recommended layout is float32 params with bfloat16 compute (``model.dtype``), and
        without this flag trained bfloat16 params are refused. No effect on float32 params.
    """

    lr: float = 1e-4
    schedule: str = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    mu_dtype: str | None = None
    stochastic_rounding: bool = False

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {list(SCHEDULES)}, got {self.schedule!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay: must be >= 0, got {self.weight_decay}")
        for name in ("b1", "b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}: must be in [0, 1), got {getattr(self, name)}")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm: must be >= 0 (0 disables), got {self.max_grad_norm}")
        if self.mu_dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(
                f"mu_dtype: expected null, float32, bfloat16 or float16, got {self.mu_dtype!r}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """Attributes:
    aggregation: ``"token_mean"`` (every response token weighs the same) or
      ``"seq_mean_token_mean"`` (every response weighs the same).
    """

    aggregation: str = "token_mean"

    def __post_init__(self) -> None:
        if self.aggregation not in SFT_AGGREGATIONS:
            raise ValueError(
                f"aggregation: expected one of {list(SFT_AGGREGATIONS)}, got {self.aggregation!r}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ILQLConfig:
    """Implicit language Q-learning (``algorithm: ilql``) on offline ``(prompt, response,
    reward)`` records; the defaults are trlX's ``default_ilql_config`` (but
    ``max_new_tokens``: trlX's 56).

    Attributes:
    normalize_rewards: standardise the records' rewards with the training set's mean and
      std before they enter the Q targets, as trlX does (``decode_beta`` and ``awac_beta``
      act on that scale); off: the rewards as recorded.
    gamma: discount of the Q target ``r_t + gamma V(s_{t+1})``.
    tau: expectile of the value loss (> 0.5 pushes V towards the best actions' Q).
    cql_scale: weight of the conservative (CQL) term.
    awac_scale: weight of the advantage-weighted behaviour cloning term.
    awac_beta: its advantage temperature (0: plain behaviour cloning, as trlX).
    alpha: Polyak rate of the target Q heads: ``target <- alpha q + (1 - alpha) target``.
    target_sync_every: updates between Polyak steps of the target heads.
    decode_beta: advantage weight of ILQL's decoding, ``log pi + decode_beta (Q - V)``
      (0: sample the behaviour-cloned model).
    top_k: tokens kept at each decoding step (0: all).
    temperature: of the decoding's softmax (0: argmax).
    max_new_tokens: tokens the evaluation generates per held-out prompt.
    eval_reward: scores the evaluation's samples: a reward function (``builtin`` for a
      ``builtin:`` task, or ``module.function``, as ``ppo.reward.function``); with it every
      evaluation also generates from the held-out prompts and logs ``eval/reward`` beside
      the held-out records' own mean ``eval/behaviour_reward``. None: losses only.
    """

    gamma: float = 0.99
    tau: float = 0.7
    cql_scale: float = 0.1
    awac_scale: float = 1.0
    awac_beta: float = 0.0
    alpha: float = 0.001
    target_sync_every: int = 5
    decode_beta: float = 1.0
    top_k: int = 20
    temperature: float = 1.0
    max_new_tokens: int = 32
    eval_reward: str | None = None
    normalize_rewards: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma: must be in [0, 1], got {self.gamma}")
        if not 0.0 < self.tau < 1.0:
            raise ValueError(f"tau: must be in (0, 1), got {self.tau}")
        for name in ("cql_scale", "awac_scale", "awac_beta", "decode_beta", "temperature"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: must be a finite number >= 0, got {value}")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha: must be in (0, 1], got {self.alpha}")
        if self.target_sync_every < 1:
            raise ValueError(f"target_sync_every: must be >= 1, got {self.target_sync_every}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardModelConfig:
    """Attributes:
    center_coef: weight of ``mean((r_c + r_r)^2)``, which keeps rewards centred on 0
      (Eisenstein et al. 2023; TRL's ``center_rewards_coefficient``); 0 disables.
    """

    center_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.center_coef < 0:
            raise ValueError(f"center_coef: must be >= 0, got {self.center_coef}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOConfig:
    """Attributes:
    beta: inverse temperature or reward scale (sigmoid, hinge, simpo and TRL's variants),
      regularisation (ipo) or odds-ratio weight (orpo).
    loss_type: one of ``DPO_LOSS_CHOICES``.
    label_smoothing: label-flip probability of cDPO (sigmoid), SimPO, robust and AOT; EXO's
      epsilon (exo_pair needs it > 0; the paper uses 1e-3).
    f_divergence: f-DPO's divergence, one of ``F_DIVERGENCES``; other than reverse_kl only
      with loss_type sigmoid, hinge, robust, bco_pair, nca_pair, exo_pair or sppo_hard.
    f_alpha: the alpha of ``alpha_divergence`` (0: reverse KL, 1: forward KL).
    simpo_gamma: SimPO's target margin.
    reference_hf_dir: the reference model's checkpoint; null = frozen copy of the initial
      policy.
    precompute_reference: score all data with the reference before training, then free it.
    """

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    f_divergence: str = "reverse_kl"
    f_alpha: float = 0.5
    simpo_gamma: float = 0.5
    reference_hf_dir: str | None = None
    precompute_reference: bool = False

    def __post_init__(self) -> None:
        if self.loss_type not in DPO_LOSS_CHOICES:
            raise ValueError(
                f"loss_type: expected one of {list(DPO_LOSS_CHOICES)}, got {self.loss_type!r}"
            )
        if not self.beta > 0:
            raise ValueError(f"beta: must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing: must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss_type not in DPO_SMOOTHED_LOSSES:
            raise ValueError(
                f"label_smoothing: only applies to loss_type {', '.join(DPO_SMOOTHED_LOSSES)}, "
                f"not {self.loss_type!r}"
            )
        if self.loss_type == "exo_pair" and not self.label_smoothing > 0:
            raise ValueError("label_smoothing: exo_pair needs it > 0 (the EXO paper uses 1e-3)")
        if self.f_divergence not in F_DIVERGENCES:
            raise ValueError(
                f"f_divergence: expected one of {list(F_DIVERGENCES)}, got {self.f_divergence!r}"
            )
        if self.f_divergence != "reverse_kl" and self.loss_type not in DPO_F_DIVERGENCE_LOSSES:
            raise ValueError(
                "f_divergence: only applies to loss_type "
                f"{', '.join(DPO_F_DIVERGENCE_LOSSES)}, not {self.loss_type!r}"
            )

    @property
    def needs_reference(self) -> bool:
        return self.loss_type not in REFERENCE_FREE_LOSSES

    @property
    def average_logps(self) -> bool:
        return self.loss_type in ("ipo", "simpo", "orpo")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """LoRA adapters on the trained model (``models/lora.py``), for every algorithm.

    The pretrained weights stay frozen and are held once: the trained model, a DPO or RL
    reference (the base without adapters) and a LoRA critic (PPO) share them. Only the
    adapters (and a scalar model's ``score`` head) are trained, have optimizer state and are
    checkpointed. The final export writes the merged model to ``hf/`` and the adapter alone
    in PEFT's format to ``adapter/``.

    Attributes:
      rank: r, the adapters' inner dimension.
      alpha: scale numerator (the update is ``alpha / rank * x A B``).
      dropout: dropout on each adapter's input during training updates.
      targets: the adapted projections: ``q``, ``k``, ``v``, ``o`` (attention), ``gate``,
        ``up``, ``down`` (a dense MLP; mixture-of-experts layers are not adapted).
      sync: how an RL run's sampler gets the policy each iteration: ``adapters`` (it keeps
        the base weights in its own layout and receives only the adapters, merging them on
        its side) or ``full`` (the merged weights are resharded, as without LoRA).
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "k", "v", "o")
    sync: str = "adapters"

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank: must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"alpha: must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: must be in [0, 1), got {self.dropout}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets:
            raise ValueError(
                f"targets: expected a non-empty list from {list(LORA_TARGETS)}, "
                f"got {list(self.targets)}"
            )
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"targets: {list(self.targets)} names a projection twice")
        if self.sync not in LORA_SYNCS:
            raise ValueError(f"sync: expected one of {list(LORA_SYNCS)}, got {self.sync!r}")
