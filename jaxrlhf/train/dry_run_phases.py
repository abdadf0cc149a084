"""The programs of each trainer's phases, built on abstract values and compiled for memory.

Used by :mod:`jaxrlhf.train.dry_run`. Every program is the trainer's own jitted function
(``steps.train_step``, the sampler's prefill and decode, ``rl_trainer._jit_functions``'s
score, reward and update), with the trainer's shardings and donation, lowered on
``jax.ShapeDtypeStruct`` arguments: no parameter, batch or cache is ever allocated.

Accounting: a :class:`Planner` names every tree that lives on the devices between
programs (``policy.params``, ``policy.opt``, ``reference.params``, ...). A program's
``resident`` bytes are the live trees it does not take as arguments; its ``state`` bytes
all the live trees (parameters and optimizer states only, analytic).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.config import ConfigError, RunConfig, num_micro_batches
from jaxrlhf.data.dataset import TokenizedDataset
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.hf_config import load_hf_config
from jaxrlhf.models.safetensors_io import CheckpointError
from jaxrlhf.sharding import MeshError, ShardingRuleError, rules_for
from jaxrlhf.sharding.model_sharding import build_sharded, bytes_per_device, param_shardings
from jaxrlhf.train import steps
from jaxrlhf.train.optim import make_optimizer
from jaxrlhf.train.state import create_state, state_shardings

# The programs are compiled, never run: skipping LLVM's optimisations roughly halves the
# compile time and leaves XLA's buffer assignment (the memory analysis) unchanged.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


class DryRunError(RuntimeError):
    """A phase's program does not trace or compile (the message is one line)."""


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """One compiled program: XLA's memory analysis per device, and what else is on the device.

    Attributes:
      phase: ``generate``, ``score`` or ``train``.
      name: the program (``prefill``, ``decode``, ``reward``, ``score``, ``update``,
        ``reference``, ``train_step``).
      argument_bytes, output_bytes, alias_bytes, temp_bytes: ``compiled.memory_analysis()``;
        aliased bytes are outputs written into donated arguments (counted once).
      resident_bytes: trees on the device while it runs that are not its arguments.
      state_bytes: parameters and optimizer states on the device while it runs (analytic).
      compile_s: seconds to lower and compile.
    """

    phase: str
    name: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    resident_bytes: int
    state_bytes: int
    compile_s: float

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs - aliased + temporaries + resident."""
        return (
            self.argument_bytes
            + self.output_bytes
            - self.alias_bytes
            + self.temp_bytes
            + self.resident_bytes
        )


@dataclasses.dataclass(frozen=True)
class RoleMemory:
    """One model of the run (bytes per device).

    Attributes:
      role: ``policy``, ``reference``, ``value`` or ``reward``.
      head: ``lm`` or ``scalar``.
      params: parameter count.
      param_bytes: its parameters in the train/score layout.
      generate_bytes: its parameters in the sampler's layout (an RL policy), else None.
      optimizer_bytes: optimizer state and step counter (0 for frozen roles).
      note: e.g. that its architecture was assumed.
    """

    role: str
    head: str
    params: int
    param_bytes: int
    generate_bytes: int | None = None
    optimizer_bytes: int = 0
    note: str = ""


def _sds(shape: Sequence[int], dtype: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:  # "... they differ:" then the first detail
        text += " " + lines[1].lstrip("* ")
    return f"{type(e).__name__}: {text}"


class Planner:
    """Named abstract trees on the mesh, the roles, and the compiled programs."""

    def __init__(
        self, cfg: RunConfig, model_cfg: ModelConfig, mesh: Mesh, generate_mesh: Mesh | None = None
    ) -> None:
        self.cfg, self.model_cfg, self.mesh = cfg, model_cfg, mesh
        self.generate_mesh = mesh if generate_mesh is None else generate_mesh
        self.trees: dict[str, tuple[Any, Any]] = {}  # name -> (abstract, shardings)
        self.roles: list[RoleMemory] = []
        self.programs: list[ProgramMemory] = []
        self.notes: list[str] = []
        self.replicated = NamedSharding(mesh, P())
        self.key = jax.eval_shape(lambda: jax.random.key(0))

    def add(self, name: str, abstract: Any, shardings: Any) -> Any:
        """Registers a tree; returns it as ShapeDtypeStructs carrying their shardings."""
        self.trees[name] = (abstract, shardings)
        return jax.tree.map(lambda a, s: _sds(a.shape, a.dtype, s), abstract, shardings)

    def nbytes(self, *names: str) -> int:
        """Max over devices of the summed bytes of the named trees."""
        totals: dict[Any, int] = {}
        for name in names:
            abstract, shardings = self.trees[name]
            for device, n in bytes_per_device(shardings, abstract).items():
                totals[device] = totals.get(device, 0) + n
        return max(totals.values(), default=0)

    def arch(self, hf_dir: str | None, what: str) -> tuple[ModelConfig, str]:
        """The ModelConfig of ``hf_dir``; the policy's when its config.json is absent."""
        if hf_dir is None:
            return self.model_cfg, ""
        try:
            return load_hf_config(hf_dir), ""
        except CheckpointError as e:
            self.notes.append(f"{what}: {e}; planned with the policy's architecture")
            return self.model_cfg, "policy architecture assumed"

    def trained(self, role: str, head: str, optimizer: Any) -> tuple[Any, Any]:
        """Registers ``role.params`` and ``role.opt`` (train rules); returns the abstract
        TrainState with shardings and the state's sharding tree."""
        mesh = self.mesh
        abstract = model_lib.abstract_params(self.model_cfg, head)
        param_sh = param_shardings(self.model_cfg, mesh, rules_for(role, "train"), head)
        sh = state_shardings(abstract, param_sh, optimizer, mesh)
        state = jax.eval_shape(lambda p: create_state(p, optimizer), abstract)
        self.add(f"{role}.params", abstract, param_sh)
        self.add(f"{role}.opt", (state.step, state.opt_state), (sh.step, sh.opt_state))
        self.roles.append(
            RoleMemory(
                role,
                head,
                model_lib.param_count(abstract),
                self.nbytes(f"{role}.params"),
                optimizer_bytes=self.nbytes(f"{role}.opt"),
            )
        )
        return jax.tree.map(lambda a, s: _sds(a.shape, a.dtype, s), state, sh), sh

    def frozen(self, role: str, cfg: ModelConfig, head: str, note: str = "") -> Any:
        """Registers ``role.params`` under the role's score rules; returns them abstract."""
        sh = param_shardings(cfg, self.mesh, rules_for(role, "score"), head)
        params = self.add(f"{role}.params", model_lib.abstract_params(cfg, head), sh)
        n = model_lib.param_count(params)
        self.roles.append(RoleMemory(role, head, n, self.nbytes(f"{role}.params"), note=note))
        return params

    def compile(
        self,
        phase: str,
        name: str,
        jitted: Any,
        args: Sequence[Any],
        *,
        live: Sequence[str],
        passed: Sequence[str],
    ) -> Any:
        """Lowers and compiles ``jitted(*args)``; records its memory; returns the executable.

        ``live``: the trees on the devices meanwhile; ``passed``: those among ``args``.
        """
        start = time.perf_counter()
        try:
            compiled = jitted.lower(*args).compile(compiler_options=COMPILER_OPTIONS)
        except (ConfigError, MeshError, ShardingRuleError):
            raise
        except Exception as e:  # noqa: BLE001  a trainer bug or an XLA limit, told in one line
            raise DryRunError(f"{phase}/{name} does not compile: {_one_line(e)}") from e
        m = compiled.memory_analysis()
        state = self.nbytes(*live)
        self.programs.append(
            ProgramMemory(
                phase=phase,
                name=name,
                argument_bytes=int(m.argument_size_in_bytes),
                output_bytes=int(m.output_size_in_bytes),
                alias_bytes=int(m.alias_size_in_bytes),
                temp_bytes=int(m.temp_size_in_bytes),
                resident_bytes=max(0, state - self.nbytes(*passed)),
                state_bytes=state,
                compile_s=time.perf_counter() - start,
            )
        )
        return compiled


# ---- supervised algorithms (sft, reward_model, dpo) -------------------------------------------


def plan_supervised(pl: Planner) -> str:
    """Reference scoring (DPO) and the train step; returns the shapes line."""
    from jaxrlhf.train.loop import TRAINERS

    cfg, mesh = pl.cfg, pl.mesh
    objective = TRAINERS[cfg.algorithm](getattr(cfg, cfg.algorithm))
    role, rules = objective.role, rules_for(objective.role, "train")
    num_micro = num_micro_batches(cfg, mesh.shape["data"] * mesh.shape["fsdp"])
    optimizer, lr_fn = make_optimizer(cfg.optimizer, cfg.train.steps)
    state, state_sh = pl.trained(role, objective.head, optimizer)
    live = [f"{role}.params", f"{role}.opt"]

    # The batch layout comes from the dataset code itself (padding rows need no data).
    empty = TokenizedDataset(objective.data_kind, [], [], [], report=None)
    sample = empty.batch(np.full(1, -1), cfg.data.max_length)
    batch = {k: _sds((cfg.train.batch_size, *v.shape[1:]), v.dtype) for k, v in sample.items()}
    ref = objective.reference
    if ref is not None:
        ref_cfg, note = pl.arch(ref.hf_dir, "dpo.reference_hf_dir")
        ref_params = pl.frozen("reference", ref_cfg, "lm", note)
        ref_rules = rules_for("reference", "score")
        batch_sh = {k: steps.batch_sharding(mesh, rules, v.ndim) for k, v in batch.items()}
        score = jax.jit(  # as loop._reference jits it
            functools.partial(ref.logps_fn, build_sharded(ref_cfg, mesh, ref_rules, "lm")),
            in_shardings=(pl.trees["reference.params"][1], batch_sh),
            out_shardings=steps.batch_sharding(mesh, ref_rules, 2),
        )
        pl.compile(
            "score",
            "reference",
            score,
            (ref_params, batch),
            live=[*live, "reference.params"],
            passed=["reference.params"],
        )
        batch["reference_logps"] = _sds((cfg.train.batch_size, 2), jnp.float32)
        if ref.precompute:
            pl.notes.append("reference log-probs are precomputed, then the reference is freed")
        else:
            live.append("reference.params")

    batch_sh = {k: steps.batch_sharding(mesh, rules, v.ndim) for k, v in batch.items()}
    step = functools.partial(
        steps.train_step,
        objective=objective,
        module=build_sharded(pl.model_cfg, mesh, rules, objective.head),
        optimizer=optimizer,
        lr_fn=lr_fn,
        num_micro=num_micro,
        mesh=mesh,
        rules=rules,
        grad_shardings=state_sh.params,
    )
    step_fn = jax.jit(  # as loop.build_trainer jits it
        step,
        in_shardings=(state_sh, batch_sh, pl.replicated),
        out_shardings=(state_sh, pl.replicated),
        donate_argnums=0,
    )
    args = (state, batch, pl.key)
    passed = [f"{role}.params", f"{role}.opt"]
    pl.compile("train", "train_step", step_fn, args, live=live, passed=passed)
    changed = [
        f"{jax.tree_util.keystr(path)} {a.dtype} -> {b.dtype}"
        for (path, a), b in zip(
            jax.tree_util.tree_leaves_with_path(state),
            jax.tree.leaves(jax.eval_shape(step_fn, *args)[0]),
            strict=True,
        )
        if a.dtype != b.dtype
    ]
    if changed:  # e.g. bf16 params + float32 accumulated gradients without mu_dtype
        pl.notes.append(
            f"train/train_step returns a state of other dtypes ({changed[0]}, {len(changed)} "
            "leaves): the second step recompiles with it (optimizer.mu_dtype fixes Adam's)"
        )
    return (
        f"batch {cfg.train.batch_size} x {cfg.data.max_length} tokens, "
        f"{num_micro} micro-batch(es) per update"
    )


# ---- RL (ppo, grpo) ---------------------------------------------------------------------------


def _select(mask: Any, want: bool, *trees: Any) -> list[list[Any]]:
    """The leaves of each tree where ``mask``'s leaf is ``want``."""
    flags = jax.tree.leaves(mask)
    return [[x for x, f in zip(jax.tree.leaves(t), flags, strict=True) if f == want] for t in trees]


def plan_rl(pl: Planner, source: str) -> str:
    """Generate (prefill, decode), score (reward, score) and the update; the shapes line."""
    from jaxrlhf.generation import Sampler, SamplingParams
    from jaxrlhf.train import rl_steps
    from jaxrlhf.train.rl_config import PPOConfig
    from jaxrlhf.train.rl_trainer import (
        Learned,
        _algo,
        _check_sizes,
        _gae,
        _jit_functions,
        score_micro_batches,
        shared_group_sizes,
    )

    cfg, model_cfg, mesh = pl.cfg, pl.model_cfg, pl.mesh
    algo = _algo(cfg)
    num_micro = _check_sizes(cfg, algo, mesh, source)
    score_micro = score_micro_batches(cfg, algo, mesh, source)
    groups = shared_group_sizes(cfg, algo, mesh, num_micro, source, score_micro)
    updates = cfg.train.steps * algo.loss.epochs * algo.loss.num_minibatches

    def learned(role: str, head: str, optimizer_cfg, objective) -> tuple[Learned, Any]:
        # rl_trainer._learned without parameters: the same rules, optimizer and module.
        optimizer, lr_fn = make_optimizer(optimizer_cfg, updates)
        state, sh = pl.trained(role, head, optimizer)
        rules = rules_for(role, "train")
        module = build_sharded(model_cfg, mesh, rules, head)
        learner = rl_steps.Learner(objective, module, optimizer, lr_fn, rules, sh.params)
        return Learned(None, sh, module, learner), state

    loss = algo.loss
    policy, policy_state = learned(
        "policy",
        "lm",
        cfg.optimizer,
        rl_steps.policy_objective(loss, algo.rollout.max_new_tokens, groups.update),
    )
    ref_params = pl.frozen("reference", model_cfg, "lm")
    held = ["policy.params", "policy.opt", "reference.params"]
    value = value_state = None
    if isinstance(algo, PPOConfig):
        critic_opt = cfg.optimizer
        if algo.critic_lr is not None:
            critic_opt = dataclasses.replace(cfg.optimizer, lr=algo.critic_lr)
        value_objective = rl_steps.value_objective(
            algo.value_clip,
            loss.aggregation,
            algo.rollout.max_new_tokens,
            groups.update,
            _gae(algo),
        )
        value, value_state = learned("value", "scalar", critic_opt, value_objective)
        held += ["value.params", "value.opt"]
    rm_cfg = rm_params = None
    if algo.reward.model_dir is not None:
        rm_cfg, note = pl.arch(algo.reward.model_dir, f"{cfg.algorithm}.reward.model_dir")
        rm_params = pl.frozen("reward", rm_cfg, "scalar", note)
        held.append("reward.params")
    else:
        pl.notes.append(f"reward: {algo.reward.function!r} runs on the host (not loaded here)")
    ref_rules = rules_for("reference", "score")
    fns = _jit_functions(
        cfg, algo, model_cfg, rm_cfg, mesh, policy, value, ref_rules, num_micro, groups, score_micro
    )

    # -- generate: the sampler reads a generate-layout copy of the policy parameters ---------
    # The accelerator's program: no CPU weight blocks (Sampler's default on CPU devices).
    sampler = Sampler(model_cfg, pl.generate_mesh, matmul_block=0)
    if pl.generate_mesh is not mesh:
        pl.notes.append(
            f"sampler on its own mesh {dict(pl.generate_mesh.shape)} (placement.generate_mesh); "
            "its copy of the policy is counted on each of its devices, the training devices' "
            "included (an upper bound: jax.device_put may reuse a training buffer there)"
        )
    abstract, train_sh = pl.trees["policy.params"]
    gen_params = pl.add("policy.generate", abstract, sampler.param_shardings)
    # Leaves whose layout does not change are shared (jax.device_put makes no copy).
    same = jax.tree.map(
        lambda a, s, t: s.is_equivalent_to(t, a.ndim), abstract, sampler.param_shardings, train_sh
    )
    pl.add("policy.generate.copy", *_select(same, False, abstract, sampler.param_shardings))
    pl.add("policy.generate.shared", *_select(same, True, abstract, train_sh))
    pl.roles[0] = dataclasses.replace(pl.roles[0], generate_bytes=pl.nbytes("policy.generate"))

    r = algo.rollout
    b, p_len = r.prompts_per_step, cfg.data.max_prompt_length
    sampling = SamplingParams(  # shapes only: a stop id is always one entry (EOS or -1)
        temperature=r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        n=r.num_samples,
        return_model_logprobs=True,
    )
    statics = sampling.static()
    gen_live = [*held, "policy.generate.copy"]
    gen_passed = ["policy.generate.copy", "policy.generate.shared"]
    prompts = (_sds((b, p_len), jnp.int32), _sds((b, p_len), bool))
    prefill_fn = sampler._prefill_fn(statics, b, p_len)
    prefill_args = (gen_params, *prompts, pl.key)
    prefill = pl.compile(
        "generate", "prefill", prefill_fn, prefill_args, live=gen_live, passed=gen_passed
    )
    sampler_state = jax.tree.map(
        lambda a, s: _sds(a.shape, a.dtype, s),
        jax.eval_shape(prefill_fn, *prefill_args),
        prefill.output_shardings,
    )
    arrays = jax.tree.map(lambda x: _sds(x.shape, x.dtype), sampling.arrays())
    pl.compile(
        "generate",
        "decode",
        sampler._decode_fn(statics, "scan", b, p_len),
        (gen_params, sampler_state, arrays),
        live=gen_live,
        passed=gen_passed,
    )

    # -- score: the reward model (if any), then policy / reference / value forwards ----------
    rows, length = r.rows, p_len + r.max_new_tokens
    row = fns["row_sharding"]
    batch = {
        "tokens": _sds((rows, length), jnp.int32, row(2)),
        "mask": _sds((rows, length), bool, row(2)),
        "response_mask": _sds((rows, length), bool, row(2)),
    }
    if rm_params is not None:
        rm_batch = {k: batch[k] for k in ("tokens", "mask")}
        pl.compile(
            "score",
            "reward",
            fns["reward"],
            (rm_params, rm_batch),
            live=held,
            passed=["reward.params"],
        )
    score_args = (
        policy_state.params,
        ref_params,
        None if value_state is None else value_state.params,
        batch,
        {"scores": _sds((rows,), jnp.float32, row(1))},
        _sds((), jnp.float32, pl.replicated),
    )
    passed = ["policy.params", "reference.params"] + ["value.params"] * (value is not None)
    score = pl.compile("score", "score", fns["score"], score_args, live=held, passed=passed)

    # -- train: epochs x minibatches x micro-batches of every learner ------------------------
    scored = jax.tree.map(
        lambda a, s: _sds(a.shape, a.dtype, s),
        jax.eval_shape(fns["score"], *score_args),
        score.output_shardings,
    )
    train_batch = dict(
        batch,
        **{k: v for k, v in scored.items() if not k.startswith("m/")},
        kl_coef=_sds((rows,), jnp.float32, pl.replicated),
    )
    states = (policy_state,) + (() if value_state is None else (value_state,))
    learners = [n for n in held if n.startswith(("policy.", "value."))]
    pl.compile(
        "train", "update", fns["update"], (states, train_batch, pl.key), live=held, passed=learners
    )
    return (
        f"rollout {r.prompts_per_step} prompts x {r.num_samples} sample(s), {p_len} prompt + "
        f"{r.max_new_tokens} new tokens; update {loss.epochs} epoch(s) x "
        f"{loss.num_minibatches} minibatch(es) x {num_micro} micro-batch(es)"
    )
