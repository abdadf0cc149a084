"""The supervised and offline trainers (``algorithm: sft | reward_model | dpo | ilql``): their
jitted programs and the trainer that runs them.

:class:`SupervisedPrograms` is built from the config, the mesh and abstract shapes only (the
dry run compiles the same objects); :class:`SupervisedTrainer` holds the data, the state and
the programs, and implements the host loop's protocol (``jaxrlhf.train.trainable``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf import platform
from jaxrlhf.config import RunConfig, RunLayout, validate
from jaxrlhf.data import (
    BatchIterator,
    TokenizedDataset,
    eval_batches,
    load_datasets,
    load_tokenizer,
)
from jaxrlhf.data.tokenizer import Tokenizer
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.hf_checkpoint import load_params, save_hf
from jaxrlhf.models.hf_config import load_hf_config
from jaxrlhf.models.lora import LoraParams, combine_fn
from jaxrlhf.models.precision import frozen_copy
from jaxrlhf.sharding import rules_for
from jaxrlhf.sharding.distributed import put_global
from jaxrlhf.sharding.model_sharding import build_sharded, param_shardings
from jaxrlhf.sharding.placement import given_mesh, train_mesh
from jaxrlhf.train import dpo, ilql, reward_model, sft, steps
from jaxrlhf.train.adapters import (
    LoraLayout,
    export_lora,
    initial_lora_params,
    lora_layout,
    lora_spec,
)
from jaxrlhf.train.checkpointing import key_data, wrap_key
from jaxrlhf.train.model_setup import init_params, model_with_tokenizer_ids
from jaxrlhf.train.optim import make_optimizer
from jaxrlhf.train.state import TrainState, init_state, state_shardings
from jaxrlhf.train.trainable import StepOutput

logger = logging.getLogger(__name__)

# algorithm -> objective factory, called with the algorithm's own config section.
OBJECTIVES: dict[str, Callable[[Any], steps.Objective]] = {
    "sft": sft.objective,
    "reward_model": reward_model.objective,
    "dpo": dpo.objective,
    "ilql": ilql.objective,
}


def objective_for(cfg: RunConfig) -> steps.Objective:
    """The objective of a supervised run's algorithm."""
    return OBJECTIVES[cfg.algorithm](getattr(cfg, cfg.algorithm))


def batch_layout(cfg: RunConfig, objective: steps.Objective) -> dict[str, tuple[tuple, Any]]:
    """``{key: (shape, dtype)}`` of a training batch (from the dataset code itself: padding
    rows need no data), plus the reference log-probs a reference adds."""
    empty = TokenizedDataset(objective.data_kind, [], [], [], report=None)
    sample = empty.batch(np.full(1, -1), cfg.data.max_length)
    layout = {k: ((cfg.train.batch_size, *v.shape[1:]), v.dtype) for k, v in sample.items()}
    if objective.reference is not None:
        layout["reference_logps"] = ((cfg.train.batch_size, 2), np.dtype(np.float32))
    return layout


@dataclasses.dataclass(frozen=True)
class SupervisedPrograms:
    """The jitted programs of a supervised run and their shardings.

    Attributes:
      objective: what is optimised (the algorithm's loss and weight).
      model: the trained model's ModelConfig.
      mesh: the mesh.
      learner: the trained model as the step sees it (module, optimizer, rules).
      state_shardings: the TrainState's shardings.
      batch_shardings: each batch key's sharding (rows over the data shards).
      train_step: ``(state, batch, key) -> (state, metrics)``, the state donated.
      eval_step: ``(params, batch) -> (metrics * weight, weight)``.
      reference: ``(ref_params, batch) -> [B, 2]`` reference log-probs, or None.
      reference_model: the reference's ModelConfig, or None.
      reference_shardings: its parameter shardings (reference score rules), or None.
      lora: the frozen/trainable split of a LoRA model (``lora:``), else None; the
        TrainState then holds the trainable part, and ``train_step`` takes the frozen base
        as a fourth argument.
    """

    objective: steps.Objective
    model: ModelConfig
    mesh: Mesh
    learner: steps.Learner
    state_shardings: TrainState
    batch_shardings: dict[str, NamedSharding]
    train_step: Callable[..., tuple[TrainState, steps.Metrics]]
    eval_step: Callable[..., tuple[steps.Metrics, jax.Array]]
    reference: Callable[..., jax.Array] | None = None
    reference_model: ModelConfig | None = None
    reference_shardings: Any = None
    lora: LoraLayout | None = None

    @property
    def model_shardings(self) -> Any:
        """Shardings of what the eval step applies: the params, or a LoRA model's
        ``LoraParams`` (frozen base and trainable part)."""
        if self.lora is None:
            return self.state_shardings.params
        return LoraParams(self.lora.frozen_shardings, self.lora.trainable_shardings, None)


def _step(state, batch, key, frozen, *, learner: steps.Learner, num_micro: int, mesh: Mesh):
    new_state, metrics, _ = steps.train_step(
        state, batch, key, learner=learner, num_micro=num_micro, mesh=mesh, frozen=frozen
    )
    return new_state, metrics


def build_supervised_programs(
    cfg: RunConfig,
    layout: RunLayout,
    model: ModelConfig,
    mesh: Mesh,
    *,
    reference_model: ModelConfig | None = None,
) -> SupervisedPrograms:
    """Jits the train step, the eval step and (DPO) the reference scoring.

    Args:
      cfg, layout: the run config and ``config.validate``'s result.
      model: the trained model's config; ``reference_model``: the reference's (DPO with a
        ``reference_hf_dir``; None: the policy's architecture).
    """
    objective = objective_for(cfg)
    rules = rules_for(objective.role, "train")
    spec = lora_spec(cfg)
    module = build_sharded(model, mesh, rules, objective.head, spec)
    optimizer, lr_fn = make_optimizer(cfg.optimizer, cfg.train.steps)
    lora = combine = frozen_sh = None
    if spec is None:
        param_sh = param_shardings(model, mesh, rules, objective.head)
        abstract = model_lib.abstract_params(model, objective.head)
    else:  # the state trains the adapters; the frozen base is the step's 4th argument
        lora = lora_layout(model, mesh, rules, objective.head, spec)
        param_sh, abstract = lora.trainable_shardings, lora.trainable
        frozen_sh, combine = lora.frozen_shardings, combine_fn(spec)
    trainable = None
    if objective.trainable is not None:  # the other leaves: no update, no state
        trainable = objective.trainable(abstract)
        labels = jax.tree.map(lambda t: "train" if t else "frozen", trainable)
        optimizer = optax.multi_transform(
            {"train": optimizer, "frozen": optax.set_to_zero()}, labels
        )
    state_sh = state_shardings(abstract, param_sh, optimizer, mesh, trainable)
    learner = steps.Learner(objective, module, optimizer, lr_fn, rules, param_sh, combine)
    batch_sh = {
        k: steps.batch_sharding(mesh, rules, len(shape))
        for k, (shape, _) in batch_layout(cfg, objective).items()
    }
    replicated = NamedSharding(mesh, P())
    train_step = jax.jit(
        functools.partial(_step, learner=learner, num_micro=layout.num_micro, mesh=mesh),
        in_shardings=(state_sh, batch_sh, replicated, frozen_sh),
        out_shardings=(state_sh, replicated),
        donate_argnums=0,  # the old state's buffers are reused for the new one
    )
    model_sh = param_sh if lora is None else LoraParams(frozen_sh, param_sh, None)
    eval_step = jax.jit(
        functools.partial(steps.eval_step, objective=objective, module=module),
        in_shardings=(model_sh, batch_sh),
        out_shardings=replicated,
    )
    reference = ref_model = ref_sh = None
    if objective.reference is not None:
        ref_rules = rules_for("reference", "score")
        ref_model = reference_model or model
        ref_sh = param_shardings(ref_model, mesh, ref_rules)
        reference = jax.jit(
            functools.partial(
                objective.reference.logps_fn, build_sharded(ref_model, mesh, ref_rules, "lm")
            ),
            in_shardings=(ref_sh, {k: v for k, v in batch_sh.items() if k != "reference_logps"}),
            out_shardings=steps.batch_sharding(mesh, ref_rules, 2),
        )
    return SupervisedPrograms(
        objective=objective,
        model=model,
        mesh=mesh,
        learner=learner,
        state_shardings=state_sh,
        batch_shardings=batch_sh,
        train_step=train_step,
        eval_step=eval_step,
        reference=reference,
        reference_model=ref_model,
        reference_shardings=ref_sh,
        lora=lora,
    )


@dataclasses.dataclass
class SupervisedTrainer:
    """Everything a supervised run holds between steps; ``state`` is replaced by each step.

    Attributes:
      cfg, layout: the config and what validation derived from it.
      programs: the jitted programs and their shardings.
      tokenizer: exported with the model.
      train_data, eval_data: the datasets (eval None without a held-out split).
      batches: the training batches (resumable).
      state: the TrainState.
      key: the run's PRNG key (each step folds in ``steps_done``).
      ref_params: the frozen reference's parameters (DPO scoring per batch), or None; with
        LoRA and no ``dpo.reference_hf_dir``, the base (the same arrays as ``frozen``).
      frozen: a LoRA model's frozen base (``programs.lora``), else None.
      sample_eval: ``params -> metrics`` that :meth:`evaluate` adds (ILQL's decoding of the
        held-out prompts, ``jaxrlhf.train.ilql``), or None.
      steps_done: updates run through :meth:`step`.
    """

    cfg: RunConfig
    layout: RunLayout
    programs: SupervisedPrograms
    tokenizer: Tokenizer
    train_data: TokenizedDataset
    eval_data: TokenizedDataset | None
    batches: BatchIterator
    state: TrainState
    key: jax.Array
    ref_params: Any = None
    frozen: Any = None
    sample_eval: Callable[[Any], dict[str, float]] | None = None
    steps_done: int = 0

    @property
    def model_params(self) -> Any:
        """The trained model's params as the eval step and the exports read them: the
        state's, or a LoRA model's ``LoraParams`` (frozen base, trained adapters)."""
        if self.frozen is None:
            return self.state.params
        return LoraParams(self.frozen, self.state.params)

    @property
    def objective(self) -> steps.Objective:
        return self.programs.objective

    @property
    def mesh(self) -> Mesh:
        return self.programs.mesh

    @property
    def model_cfg(self) -> ModelConfig:
        return self.programs.model

    @property
    def num_micro(self) -> int:
        return self.layout.num_micro

    @property
    def log_window(self) -> int:
        return self.cfg.train.log_every

    @property
    def summary_keys(self) -> tuple[str, ...]:
        return (*self.objective.summary, "lr", "grad_norm")

    plot_keys = summary_keys

    def describe(self) -> str:
        trained = model_lib.param_count(self.state.params)
        size = f"{trained:,} parameters"
        if self.frozen is not None:
            total = trained + model_lib.param_count(self.frozen)
            size = f"{trained:,} trained (LoRA) of {total:,} parameters"
        return (
            f"{self.cfg.algorithm}: {size}, "
            f"mesh {dict(self.mesh.shape)}, {len(self.train_data)} train / "
            f"{0 if self.eval_data is None else len(self.eval_data)} eval examples, "
            f"{self.num_micro} micro-batch(es) per update"
        )

    def put(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """A host batch as global arrays in the step's batch shardings, with the reference
        log-probs added where the objective scores a reference per batch."""
        shardings = self.programs.batch_shardings
        batch = put_global(batch, {k: shardings[k] for k in batch})
        if self.ref_params is not None and "reference_logps" not in batch:
            logps = self.programs.reference(self.ref_params, batch)
            batch["reference_logps"] = platform.serialize_programs(self.mesh, logps)
        return batch

    def next_batch(self) -> dict[str, jax.Array]:
        return self.put(next(self.batches))

    def step(self, batch: dict[str, jax.Array] | None = None) -> StepOutput:
        """One update (on ``batch`` or the next training batch); device metrics. A step that
        raises leaves the data position where it was (its batch is drawn again) and the
        state it started from (deleted where the update donated it, which a checkpoint then
        refuses)."""
        if batch is not None:
            return self._update(batch)
        before = self.batches.state()
        try:
            return self._update(self.next_batch())
        except Exception:
            self.batches.restore(before)
            raise

    def _update(self, batch: dict[str, jax.Array]) -> StepOutput:
        key = jax.random.fold_in(self.key, self.steps_done)
        state, metrics = self.programs.train_step(self.state, batch, key, self.frozen)
        platform.serialize_programs(self.mesh, state)
        self.state = state  # (only once it ran: an error above leaves the old one)
        self.steps_done += 1
        return StepOutput(metrics=metrics, skipped=metrics["skipped"])

    def status(self) -> dict[str, float]:
        last_update = max(int(self.state.step) - 1, 0)  # skipped updates do not count
        return {
            "epoch": self.batches.state()["epoch"],
            "lr": float(self.programs.learner.lr_fn(last_update)),
        }

    def evaluate(self) -> dict[str, float]:
        """Weighted means of the metrics over the whole held-out set (``eval/`` keys)."""
        if self.eval_data is None:
            return {}
        size = self.cfg.train.eval_batch_size or self.cfg.train.batch_size
        totals, weight = None, 0.0
        for host_batch in eval_batches(self.eval_data, size, self.cfg.data.max_length):
            sums, w = self.programs.eval_step(self.model_params, self.put(host_batch))
            platform.serialize_programs(self.mesh, sums)
            totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
            weight = weight + w
        totals, weight = jax.device_get((totals, weight))
        out = {f"eval/{k}": float(v) / max(float(weight), 1.0) for k, v in totals.items()}
        if self.sample_eval is not None:
            out.update(self.sample_eval(self.model_params))
        return out

    def snapshot(self) -> tuple[dict[str, Any], dict[str, Any]]:
        arrays = {"train": self.state, "key": key_data(self.key, self.mesh)}
        return arrays, {"step": self.steps_done, "data": self.batches.state()}

    def restore(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        self.state = arrays["train"]
        self.key = wrap_key(arrays["key"], self.key)
        self.steps_done = int(meta["step"])
        self.batches.restore(meta["data"])

    def export(self, hf_dir: str) -> None:
        """The trained model (``*ForCausalLM``, or ``*ForSequenceClassification`` for a reward
        model) with the tokenizer; with LoRA the merged model, and the adapters alone in
        PEFT's format beside it (``adapters.export_lora``); ILQL's language model, with its
        value and Q heads beside it (``Objective.export_extras``)."""
        head = self.objective.head
        if self.objective.export_lm is not None:
            save_hf(
                hf_dir,
                self.model_cfg,
                self.objective.export_lm(self.state.params),
                head="lm",
                dtype=self.cfg.checkpoint.export_dtype,
            )
            if self.objective.export_extras is not None:
                self.objective.export_extras(hf_dir, self.state.params)
        elif self.programs.lora is not None:
            spec = self.programs.lora.spec
            export_lora(
                hf_dir, self.cfg, self.model_cfg, spec, head, self.frozen, self.state.params
            )
        else:
            save_hf(
                hf_dir,
                self.model_cfg,
                self.state.params,
                head=head,
                dtype=self.cfg.checkpoint.export_dtype,
            )
        if jax.process_index() == 0:
            self.tokenizer.save_pretrained(hf_dir)

    def summary(self, history: list[dict[str, Any]]) -> dict[str, float]:
        return {}

    def format_summary(self, summary: dict[str, float]) -> str:
        return ""


def _precompute_reference(trainer: SupervisedTrainer) -> None:
    """Scores every example with the reference once, then frees it (``precompute``)."""
    cfg, programs = trainer.cfg, trainer.programs
    size = cfg.train.eval_batch_size or cfg.train.batch_size
    ref_batch_sh = {k: v for k, v in programs.batch_shardings.items() if k != "reference_logps"}
    for ds in (trainer.train_data, trainer.eval_data):
        if ds is None:
            continue
        chunks = []
        for b in eval_batches(ds, size, cfg.data.max_length):
            b = {k: v for k, v in b.items() if k in ref_batch_sh}
            rows = put_global(b, {k: ref_batch_sh[k] for k in b})
            chunks.append(np.asarray(jax.device_get(programs.reference(trainer.ref_params, rows))))
        ds.extras["reference_logps"] = np.concatenate(chunks)[: len(ds)]
    trainer.ref_params = None
    logger.info("reference log-probs precomputed; reference model freed")


def build_supervised_trainer(
    cfg: RunConfig,
    *,
    mesh: Mesh | None = None,
    source: str = "<config>",
    override_paths: Sequence[str] | Mapping[str, str] = (),
    layout: RunLayout | None = None,
) -> SupervisedTrainer:
    """Validates ``cfg`` (unless its ``layout`` is given), loads data and model, and builds
    the programs.

    Args:
      cfg: the run config (``algorithm: sft | reward_model | dpo``).
      mesh: the device mesh (default: ``cfg.mesh`` over all devices, or over the first
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
    tokenizer = load_tokenizer(cfg.tokenizer)
    model = model_with_tokenizer_ids(cfg, layout.model, tokenizer)
    objective = objective_for(cfg)
    train_data, eval_data = load_datasets(objective.data_kind, cfg.data, tokenizer, cfg.tokenizer)
    if mesh is None:
        mesh = train_mesh(cfg.mesh, cfg.placement)
    else:
        given_mesh(cfg.placement, mesh, source)
    ref = objective.reference
    ref_model = None if ref is None or ref.hf_dir is None else load_hf_config(ref.hf_dir)
    programs = build_supervised_programs(cfg, layout, model, mesh, reference_model=ref_model)
    init_key, step_key = jax.random.split(jax.random.key(cfg.train.seed))
    frozen = None
    if programs.lora is not None:
        frozen, params = initial_lora_params(cfg, model, programs.lora, init_key)
    else:
        params = init_params(cfg, model, objective.head, programs.state_shardings.params, init_key)
    ref_params = None
    if ref is not None and ref.hf_dir is None and frozen is not None:
        ref_params = frozen  # the reference is the base without adapters: no copy
    elif ref is not None and ref.hf_dir is None:
        # A frozen copy of the initial policy (the policy's own buffers are donated to steps),
        # in the compute dtype its forward reads (half the bytes of float32 masters for bf16).
        ref_params = frozen_copy(params, model)
    elif ref is not None:
        ref_params = load_params(
            ref.hf_dir, ref_model, head="lm", shardings=programs.reference_shardings
        )
    trainer = SupervisedTrainer(
        cfg=cfg,
        layout=layout,
        programs=programs,
        tokenizer=tokenizer,
        train_data=train_data,
        eval_data=eval_data,
        batches=BatchIterator(
            train_data,
            cfg.train.batch_size,
            cfg.data.max_length,
            seed=cfg.data.seed,
            shuffle=cfg.data.shuffle,
            batch_from="train.batch_size",
        ),
        state=init_state(params, programs.learner.optimizer, programs.state_shardings),
        key=step_key,
        ref_params=ref_params,
        frozen=frozen,
    )
    if cfg.algorithm == "ilql":
        ilql.standardize_rewards(cfg.ilql, train_data, eval_data)
        trainer.sample_eval = ilql.sample_evaluation(
            cfg, programs.learner.module, eval_data, tokenizer, programs.batch_shardings["tokens"]
        )
    if ref is not None and ref.precompute:
        _precompute_reference(trainer)
    return trainer
