"""Typed configs of the training loop: steps and batch sizes, logging, exports."""

from __future__ import annotations

import dataclasses

PROGRESS_MODES = ("auto", "rich", "tqdm", "plain", "none")
EXPORT_DTYPES = (None, "float32", "bfloat16", "float16")


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
