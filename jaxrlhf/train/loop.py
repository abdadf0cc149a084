"""The host loop: build everything a run needs, then step, log, evaluate and export.

``run(cfg)`` is what ``python -m jaxrlhf.train`` calls. ``build_trainer(cfg)`` returns the
pieces (jitted step, state, batches) for notebooks and tests that drive steps themselves.
The loop only moves pytrees between jitted pure functions; metrics are summed on device
and fetched (``jax.device_get``) on logging steps only.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.config import ConfigError, RunConfig, dump_config, num_micro_batches, to_dict, validate
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
from jaxrlhf.sharding import rules_for
from jaxrlhf.sharding.model_sharding import build_sharded, param_shardings
from jaxrlhf.sharding.placement import given_mesh, train_mesh
from jaxrlhf.train import dpo, reward_model, sft, steps
from jaxrlhf.train.checkpointing import (
    RunCheckpointer,
    key_data,
    open_checkpointer,
    wrap_key,
)
from jaxrlhf.train.metrics import (
    PLOT_FILE,
    MetricsLogger,
    Progress,
    format_metrics,
    plot_history,
    read_history,
)
from jaxrlhf.train.optim import make_optimizer
from jaxrlhf.train.preemption import StopSignals, check_skips
from jaxrlhf.train.state import TrainState, init_state, state_shardings

logger = logging.getLogger(__name__)

# algorithm -> objective factory, called with the algorithm's own config section.
TRAINERS: dict[str, Callable[[Any], steps.Objective]] = {
    "sft": sft.objective,
    "reward_model": reward_model.objective,
    "dpo": dpo.objective,
}

CONFIG_FILE = "config.yaml"
HF_DIR = "hf"


def run_directory(cfg: RunConfig) -> str:
    """Where a run writes its files: ``output_dir``, default ``runs/<algorithm>``."""
    return cfg.output_dir or os.path.join("runs", cfg.algorithm)


def exported_model(cfg: RunConfig) -> tuple[str, str]:
    """``(directory, head)`` of the Hugging Face model a run exports at its end (when
    ``checkpoint.export_hf``): the trained model, or the policy of an RL run."""
    head = "lm"
    if cfg.algorithm in TRAINERS:
        head = TRAINERS[cfg.algorithm](getattr(cfg, cfg.algorithm)).head
    return os.path.join(run_directory(cfg), HF_DIR), head


@dataclasses.dataclass
class Trainer:
    """Everything built before the first step. ``state`` is replaced by each step."""

    cfg: RunConfig
    model_cfg: ModelConfig
    objective: steps.Objective
    mesh: Mesh
    tokenizer: Tokenizer
    train_data: TokenizedDataset
    eval_data: TokenizedDataset | None
    batches: BatchIterator
    state: TrainState
    shardings: TrainState
    batch_shardings: dict[str, NamedSharding]
    step_fn: Callable[[TrainState, dict, jax.Array], tuple[TrainState, dict]]
    eval_fn: Callable[[Any, dict], tuple[dict, jax.Array]]
    num_micro: int
    key: jax.Array
    prepare: Callable[[dict], dict] = lambda batch: batch
    batches_done: int = 0  # updates run through ``step`` (the per-step key folds it in)

    def put(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """A host batch as global arrays in the step's batch shardings."""
        return _put(batch, self.batch_shardings)

    def next_batch(self) -> dict[str, jax.Array]:
        return self.prepare(self.put(next(self.batches)))

    def step(self, batch: dict[str, jax.Array] | None = None) -> dict[str, jax.Array]:
        """One update (on ``batch`` or the next training batch); returns device metrics."""
        batch = self.next_batch() if batch is None else batch
        key = jax.random.fold_in(self.key, self.batches_done)
        self.state, metrics = self.step_fn(self.state, batch, key)
        _serialize_on_cpu(self.mesh, self.state)
        self.batches_done += 1
        return metrics

    def evaluate(self) -> dict[str, float]:
        """Weighted means of the metrics over the whole held-out set (``eval/`` keys)."""
        if self.eval_data is None:
            return {}
        size = self.cfg.train.eval_batch_size or self.cfg.train.batch_size
        totals, weight = None, 0.0
        for host_batch in eval_batches(self.eval_data, size, self.cfg.data.max_length):
            sums, w = self.eval_fn(self.state.params, self.prepare(self.put(host_batch)))
            _serialize_on_cpu(self.mesh, sums)
            totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
            weight = weight + w
        totals, weight = jax.device_get((totals, weight))
        return {f"eval/{k}": float(v) / max(float(weight), 1.0) for k, v in totals.items()}


def _serialize_on_cpu(mesh: Mesh, tree: Any) -> Any:
    """Waits for ``tree`` when the mesh is on CPU devices; a no-op elsewhere.

    XLA:CPU runs each device's part of a program on a shared thread pool, and two
    *different* multi-device programs in flight at once can deadlock in their collectives
    (each holds threads in a rendezvous the other needs; the process aborts after 40 s:
    seen with DPO's reference scoring overlapping the train step on 8 fake devices). On
    CPU we therefore keep one program in flight: each step, scoring and eval batch is
    awaited before the next is dispatched, which costs little there (host and "devices"
    share the same cores). GPUs and TPUs order programs on streams and keep the
    asynchronous dispatch.
    """
    if mesh.devices.flat[0].platform == "cpu":
        jax.block_until_ready(tree)
    return tree


def _put(batch: dict[str, np.ndarray], shardings: dict[str, NamedSharding]) -> dict:
    if jax.process_count() == 1:
        return {k: jax.device_put(v, shardings[k]) for k, v in batch.items()}
    from jaxrlhf.sharding import global_batch_from_local, process_local_slice

    out = {}
    for k, v in batch.items():
        spec = shardings[k].spec
        local = v[process_local_slice(shardings[k].mesh, spec, v.shape)]
        out[k] = global_batch_from_local(local, shardings[k].mesh, spec)
    return out


def _model_config(cfg: RunConfig, model_cfg: ModelConfig, tok: Tokenizer) -> ModelConfig:
    if tok.vocab_size > model_cfg.vocab_size:
        raise ConfigError(
            f"tokenizer.path: the tokenizer has {tok.vocab_size} ids but the model's "
            f"vocab_size is {model_cfg.vocab_size}"
        )
    if cfg.model.hf_dir is None:  # a fresh model takes its special ids from the tokenizer
        model_cfg = model_cfg.replace(
            bos_token_id=model_cfg.bos_token_id
            if model_cfg.bos_token_id is not None
            else tok.bos_id,
            eos_token_id=model_cfg.eos_token_id
            if model_cfg.eos_token_id is not None
            else tok.eos_id,
            pad_token_id=model_cfg.pad_token_id
            if model_cfg.pad_token_id is not None
            else tok.pad_id,
        )
    return model_cfg


def _init_params(cfg: RunConfig, model_cfg: ModelConfig, head: str, shardings: Any, key) -> Any:
    if cfg.model.hf_dir is None:
        return model_lib.init_params(model_cfg, key, head=head, shardings=shardings)
    # A causal LM checkpoint may start a reward model: its scalar head is then zeros.
    return load_params(
        cfg.model.hf_dir,
        model_cfg,
        head=head,
        shardings=shardings,
        init_missing_head=head == "scalar",
    )


def _reference(
    trainer_parts: dict[str, Any], reference: steps.Reference, policy_params: Any
) -> Callable[[dict], dict]:
    """Sets up reference scoring; returns the ``prepare`` that adds ``reference_logps``."""
    mesh, cfg = trainer_parts["mesh"], trainer_parts["cfg"]
    rules = rules_for("reference", "score")
    if reference.hf_dir is None:
        ref_cfg = trainer_parts["model_cfg"]
        # A frozen copy of the initial policy (the policy's own buffers are donated to steps).
        ref_params = jax.tree.map(jnp.copy, policy_params)
    else:
        ref_cfg = load_hf_config(reference.hf_dir)
        ref_params = load_params(
            reference.hf_dir, ref_cfg, head="lm", shardings=param_shardings(ref_cfg, mesh, rules)
        )
    module = build_sharded(ref_cfg, mesh, rules, "lm")
    batch_sh = {k: v for k, v in trainer_parts["batch_shardings"].items() if k != "reference_logps"}
    score = jax.jit(
        functools.partial(reference.logps_fn, module),
        in_shardings=(param_shardings(ref_cfg, mesh, rules), batch_sh),
        out_shardings=steps.batch_sharding(mesh, rules, 2),
    )
    if not reference.precompute:
        return lambda batch: dict(
            batch, reference_logps=_serialize_on_cpu(mesh, score(ref_params, batch))
        )
    size = cfg.train.eval_batch_size or cfg.train.batch_size
    for ds in (trainer_parts["train_data"], trainer_parts["eval_data"]):
        if ds is None:
            continue
        chunks = [
            np.asarray(jax.device_get(score(ref_params, _put(b, batch_sh))))
            for b in eval_batches(ds, size, cfg.data.max_length)
        ]
        ds.extras["reference_logps"] = np.concatenate(chunks)[: len(ds)]
    logger.info("reference log-probs precomputed; reference model freed")
    return lambda batch: batch


def build_trainer(cfg: RunConfig, *, mesh: Mesh | None = None, source: str = "<config>") -> Trainer:
    """Validates ``cfg``, loads data and model, and jits the steps.

    Args:
      cfg: the run config.
      mesh: the device mesh (default: ``cfg.mesh`` over all devices, or over the first
        ``placement.train_devices``).
      source: the config's file name, for error messages.

    Raises:
      ConfigError, DataError, CheckpointError, MeshError: one-line user errors.
    """
    model_cfg = validate(cfg, source=source, device_count=None if mesh is None else mesh.size)
    tokenizer = load_tokenizer(cfg.tokenizer)
    model_cfg = _model_config(cfg, model_cfg, tokenizer)
    objective = TRAINERS[cfg.algorithm](getattr(cfg, cfg.algorithm))
    train_data, eval_data = load_datasets(objective.data_kind, cfg.data, tokenizer, cfg.tokenizer)
    if mesh is None:
        mesh = train_mesh(cfg.mesh, cfg.placement)
    else:
        given_mesh(cfg, mesh, source)
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    num_micro = num_micro_batches(cfg, shards)
    rules = rules_for(objective.role, "train")
    param_sh = param_shardings(model_cfg, mesh, rules, objective.head)
    module = build_sharded(model_cfg, mesh, rules, objective.head)
    init_key, step_key = jax.random.split(jax.random.key(cfg.train.seed))
    params = _init_params(cfg, model_cfg, objective.head, param_sh, init_key)
    optimizer, lr_fn = make_optimizer(cfg.optimizer, cfg.train.steps)
    abstract = model_lib.abstract_params(model_cfg, objective.head)
    shardings = state_shardings(abstract, param_sh, optimizer, mesh)

    sample = train_data.batch(np.full(1, -1), cfg.data.max_length)
    ndims = {k: v.ndim for k, v in sample.items()}
    if objective.reference is not None:
        ndims["reference_logps"] = 2
    batch_sh = {k: steps.batch_sharding(mesh, rules, n) for k, n in ndims.items()}
    replicated = NamedSharding(mesh, P())
    parts = dict(
        cfg=cfg,
        mesh=mesh,
        model_cfg=model_cfg,
        batch_shardings=batch_sh,
        train_data=train_data,
        eval_data=eval_data,
    )
    prepare = lambda batch: batch  # noqa: E731
    if objective.reference is not None:
        prepare = _reference(parts, objective.reference, params)
    state = init_state(params, optimizer, shardings)
    step = functools.partial(
        steps.train_step,
        objective=objective,
        module=module,
        optimizer=optimizer,
        lr_fn=lr_fn,
        num_micro=num_micro,
        mesh=mesh,
        rules=rules,
        grad_shardings=param_sh,
    )
    step_fn = jax.jit(
        step,
        in_shardings=(shardings, batch_sh, replicated),
        out_shardings=(shardings, replicated),
        donate_argnums=0,  # the old state's buffers are reused for the new one
    )
    eval_fn = jax.jit(
        functools.partial(steps.eval_step, objective=objective, module=module),
        in_shardings=(param_sh, batch_sh),
        out_shardings=replicated,
    )
    batches = BatchIterator(
        train_data,
        cfg.train.batch_size,
        cfg.data.max_length,
        seed=cfg.data.seed,
        shuffle=cfg.data.shuffle,
    )
    return Trainer(
        cfg=cfg,
        model_cfg=model_cfg,
        objective=objective,
        mesh=mesh,
        tokenizer=tokenizer,
        train_data=train_data,
        eval_data=eval_data,
        batches=batches,
        state=state,
        shardings=shardings,
        batch_shardings=batch_sh,
        step_fn=step_fn,
        eval_fn=eval_fn,
        num_micro=num_micro,
        key=step_key,
        prepare=prepare,
    )


@dataclasses.dataclass
class RunResult:
    """What ``run`` leaves behind: the run directory, the logged rows and the trainer."""

    run_dir: str
    history: list[dict[str, Any]]
    trainer: Trainer

    def rows(self, key: str) -> list[tuple[int, float]]:
        """``(step, value)`` of every logged row that has ``key``."""
        return [(r["step"], r[key]) for r in self.history if key in r]


def _snapshot(
    trainer: Trainer, running: dict | None, count: int, skip_run: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The arrays and JSON metadata of a supervised run's checkpoint."""
    arrays = {"train": trainer.state, "key": key_data(trainer.key, trainer.mesh)}
    host = {} if running is None else jax.device_get(running)
    meta = {
        "step": trainer.batches_done,
        "data": trainer.batches.state(),
        "running": {k: [float(v), str(np.asarray(v).dtype)] for k, v in host.items()},
        "running_count": count,
        "skip_run": skip_run,
        "config": to_dict(trainer.cfg),
    }
    return arrays, meta


def _restore(trainer: Trainer, ckpt: RunCheckpointer, step: int) -> tuple[dict | None, int, int]:
    """Puts checkpoint ``step`` into ``trainer``; returns the running metric sums, their
    count and the consecutive-skip count saved with it."""
    target = {"train": trainer.state, "key": key_data(trainer.key, trainer.mesh)}
    arrays, meta = ckpt.restore(step, target, to_dict(trainer.cfg))
    trainer.state = arrays["train"]
    trainer.key = wrap_key(arrays["key"], trainer.key)
    trainer.batches_done = int(meta["step"])
    trainer.batches.restore(meta["data"])
    running = {k: jnp.asarray(v, dtype) for k, (v, dtype) in meta["running"].items()} or None
    return running, int(meta["running_count"]), int(meta["skip_run"])


def run(cfg: RunConfig, *, mesh: Mesh | None = None, source: str = "<config>") -> RunResult:
    """Trains as configured; writes config.yaml, metrics.jsonl, checkpoints/, metrics.png
    and hf/.

    Evaluates on the held-out split before the first step, every ``train.eval_every`` steps
    and after the last one. Resumes from the newest checkpoint as ``checkpoint.resume``
    says; saves every ``checkpoint.every`` steps, at the end and on SIGTERM/SIGINT.

    Raises:
      Preempted: a signal stopped the run (after saving a checkpoint).
      TrainingDiverged: ``train.max_consecutive_skips`` non-finite updates in a row.
    """
    if cfg.algorithm in ("ppo", "grpo"):
        from jaxrlhf.train.rl_loop import run_rl

        return run_rl(cfg, mesh=mesh, source=source)
    main = jax.process_index() == 0
    run_dir = run_directory(cfg)
    ckpt, resume_step = open_checkpointer(cfg.checkpoint, run_dir)
    trainer = build_trainer(cfg, mesh=mesh, source=source)
    history: list[dict[str, Any]] = []
    running, count, skip_run = None, 0, 0
    if resume_step is not None:
        running, count, skip_run = _restore(trainer, ckpt, resume_step)
        history = read_history(run_dir, resume_step)
        logger.info("resumed from %s/%d", ckpt.directory, resume_step)
    if main:
        os.makedirs(run_dir, exist_ok=True)
        dump_config(cfg, os.path.join(run_dir, CONFIG_FILE), header=f"resolved from {source}")
    log = MetricsLogger(run_dir, cfg.logging, to_dict(cfg), enabled=main, history=history)
    t = cfg.train
    obj = trainer.objective
    first = trainer.batches_done
    logger.info(
        "%s: %s parameters, mesh %s, %d train / %d eval examples, %d micro-batch(es) per update",
        cfg.algorithm,
        f"{model_lib.param_count(trainer.state.params):,}",
        dict(trainer.mesh.shape),
        len(trainer.train_data),
        0 if trainer.eval_data is None else len(trainer.eval_data),
        trainer.num_micro,
    )
    if first >= t.steps:
        logger.info("the run is complete (step %d of %d); nothing to train", first, t.steps)
    progress = Progress(cfg.logging.progress, t.steps, cfg.algorithm, enabled=main)
    keys = (*obj.summary, "lr", "grad_norm")
    eval_keys = tuple(f"eval/{k}" for k in obj.summary)

    def evaluate(step: int) -> None:
        metrics = trainer.evaluate()
        if metrics:
            row = log.log(step, metrics)
            progress.write(f"eval step {step} | {format_metrics(row, eval_keys)}")

    try:
        with StopSignals() as signals:
            if first == 0:
                evaluate(0)
            start = time.perf_counter()
            # Device-side counts of consecutive skipped updates (the longest run since the
            # last log), so checking them needs no per-step host sync.
            skips, worst = jnp.int32(skip_run), jnp.int32(skip_run)
            for i in range(first, t.steps):
                metrics = trainer.step()
                skips = jnp.where(metrics["skipped"] > 0, skips + 1, 0)
                worst = jnp.maximum(worst, skips)
                running = metrics if running is None else jax.tree.map(jnp.add, running, metrics)
                count += 1
                done = i + 1
                if done % t.log_every == 0 or done == t.steps:
                    host = jax.device_get(running)
                    row = {k: float(v) / count for k, v in host.items()}
                    row["time/step_s"] = (time.perf_counter() - start) / count
                    row["epoch"] = trainer.batches.state()["epoch"]
                    progress.update(done, log.log(done, row), keys)
                    running, count, start = None, 0, time.perf_counter()
                else:
                    progress.update(done)
                if done % t.log_every == 0 or ckpt.due(done) or done == t.steps:
                    check_skips(int(worst), done, t.max_consecutive_skips, ckpt)
                    skip_run, worst = int(skips), skips
                if t.eval_every and done % t.eval_every == 0 and done != t.steps:
                    evaluate(done)
                ckpt.after_step(
                    done,
                    t.steps,
                    functools.partial(_snapshot, trainer, running, count, skip_run),
                    signals.requested(),
                )
            if first < t.steps:
                evaluate(t.steps)
            ckpt.save(t.steps, *_snapshot(trainer, running, count, skip_run), wait=True)
    finally:
        ckpt.close()
        progress.close()
        log.close()
    if cfg.checkpoint.export_hf:
        hf_dir, head = exported_model(cfg)
        save_hf(
            hf_dir,
            trainer.model_cfg,
            trainer.state.params,
            head=head,
            dtype=cfg.checkpoint.export_dtype,
        )
        if main:
            trainer.tokenizer.save_pretrained(hf_dir)
            logger.info("exported Hugging Face model to %s", hf_dir)
    if main and cfg.logging.plot:
        plot_keys = (*obj.summary, "lr", "grad_norm")
        path = plot_history(log.history, plot_keys, os.path.join(run_dir, PLOT_FILE))
        if path:
            logger.info("wrote %s", path)
    return RunResult(run_dir=run_dir, history=log.history, trainer=trainer)
