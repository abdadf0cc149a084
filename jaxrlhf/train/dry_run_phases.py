"""The programs of each trainer's phases, built on abstract values and compiled for memory.

Used by :mod:`jaxrlhf.train.dry_run`. Every program is the trainers' own: the dry run builds
``supervised.SupervisedPrograms`` or ``rl_programs.RLPrograms`` exactly as the trainers do
(same functions, shardings and donation) and lowers their programs on
``jax.ShapeDtypeStruct`` arguments: no parameter, batch or cache is ever allocated.

Accounting: a :class:`Planner` names every tree that lives on the devices between
programs (``policy.params``, ``policy.opt``, ``reference.params``, ...). A program's
``resident`` bytes are the live trees it does not take as arguments; its ``state`` bytes
all the live trees (parameters and optimizer states only, analytic).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.config import ConfigError, RunConfig, RunLayout, rl_section
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.hf_config import load_hf_config
from jaxrlhf.models.safetensors_io import CheckpointError
from jaxrlhf.sharding import MeshError, ShardingRuleError
from jaxrlhf.sharding.model_sharding import bytes_per_device
from jaxrlhf.train.rl_programs import RLPrograms, build_rl_programs, sampling_params
from jaxrlhf.train.rl_types import LearnerBatch, RolloutRows
from jaxrlhf.train.state import TrainState, create_state
from jaxrlhf.train.supervised import batch_layout, build_supervised_programs, objective_for

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

    def trained(self, role: str, head: str, optimizer: Any, sh: TrainState) -> Any:
        """Registers ``role.params`` and ``role.opt`` (in the program's state shardings
        ``sh``); returns the abstract TrainState with its shardings."""
        abstract = model_lib.abstract_params(self.model_cfg, head)
        param_sh = sh.params
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
        return jax.tree.map(lambda a, s: _sds(a.shape, a.dtype, s), state, sh)

    def frozen(self, role: str, cfg: ModelConfig, head: str, sh: Any, note: str = "") -> Any:
        """Registers ``role.params`` (in the program's parameter shardings ``sh``); returns
        them abstract."""
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


def plan_supervised(pl: Planner, layout: RunLayout) -> str:
    """Reference scoring (DPO) and the train step of ``supervised.SupervisedPrograms``;
    returns the shapes line."""
    cfg, mesh = pl.cfg, pl.mesh
    objective = objective_for(cfg)
    ref_model, note = None, ""
    if objective.reference is not None:
        ref_model, note = pl.arch(objective.reference.hf_dir, "dpo.reference_hf_dir")
    programs = build_supervised_programs(cfg, layout, pl.model_cfg, mesh, reference_model=ref_model)
    role = objective.role
    state = pl.trained(role, objective.head, programs.learner.optimizer, programs.state_shardings)
    live = [f"{role}.params", f"{role}.opt"]
    batch = {
        k: _sds(shape, dtype, programs.batch_shardings[k])
        for k, (shape, dtype) in batch_layout(cfg, objective).items()
    }
    if programs.reference is not None:
        ref_params = pl.frozen("reference", ref_model, "lm", programs.reference_shardings, note)
        ref_batch = {k: v for k, v in batch.items() if k != "reference_logps"}
        pl.compile(
            "score",
            "reference",
            programs.reference,
            (ref_params, ref_batch),
            live=[*live, "reference.params"],
            passed=["reference.params"],
        )
        if objective.reference.precompute:
            pl.notes.append("reference log-probs are precomputed, then the reference is freed")
        else:
            live.append("reference.params")
    args = (state, batch, pl.key)
    passed = [f"{role}.params", f"{role}.opt"]
    pl.compile("train", "train_step", programs.train_step, args, live=live, passed=passed)
    changed = [
        f"{jax.tree_util.keystr(path)} {a.dtype} -> {b.dtype}"
        for (path, a), b in zip(
            jax.tree_util.tree_leaves_with_path(state),
            jax.tree.leaves(jax.eval_shape(programs.train_step, *args)[0]),
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
        f"{layout.num_micro} micro-batch(es) per update"
    )


# ---- RL (ppo, grpo) ---------------------------------------------------------------------------


def _select(mask: Any, want: bool, *trees: Any) -> list[list[Any]]:
    """The leaves of each tree where ``mask``'s leaf is ``want``."""
    flags = jax.tree.leaves(mask)
    return [[x for x, f in zip(jax.tree.leaves(t), flags, strict=True) if f == want] for t in trees]


def _rl_programs(pl: Planner, layout: RunLayout) -> tuple[RLPrograms, ModelConfig | None, str]:
    """The run's RLPrograms on abstract shapes: the sampler compiled as on an accelerator
    (no CPU weight blocks), one stop id (the tokenizer's EOS, unread here)."""
    algo = rl_section(pl.cfg)
    rm_model, note = None, ""
    if algo.reward.model_dir is not None:
        rm_model, note = pl.arch(algo.reward.model_dir, f"{pl.cfg.algorithm}.reward.model_dir")
    else:
        pl.notes.append(f"reward: {algo.reward.function!r} runs on the host (not loaded here)")
    sampling = sampling_params(algo)  # shapes only: a stop id is always one entry
    programs = build_rl_programs(
        pl.cfg,
        layout,
        pl.model_cfg,
        pl.mesh,
        pl.generate_mesh,
        sampling,
        reward_model=rm_model,
        matmul_block=0,
    )
    return programs, rm_model, note


def _plan_generate(pl: Planner, programs: RLPrograms, held: list[str]) -> None:
    """Prefill and decode, reading a generate-layout copy of the policy parameters."""
    sampler, cfg = programs.sampler, pl.cfg
    if pl.generate_mesh is not pl.mesh:
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
    b, p_len = programs.algo.rollout.prompts_per_step, cfg.data.max_prompt_length
    statics = programs.sampling.static()
    gen_live = [*held, "policy.generate.copy"]
    gen_passed = ["policy.generate.copy", "policy.generate.shared"]
    arrays = jax.tree.map(lambda x: _sds(x.shape, x.dtype), programs.sampling.arrays())
    if programs.engine is not None:
        _plan_engine(pl, programs, gen_params, arrays, gen_live, gen_passed)
        return
    prompts = (_sds((b, p_len), jnp.int32), _sds((b, p_len), bool))
    prefill_fn = sampler.prefill_program(statics, b, p_len)
    prefill_args = (gen_params, *prompts, pl.key)
    prefill = pl.compile(
        "generate", "prefill", prefill_fn, prefill_args, live=gen_live, passed=gen_passed
    )
    sampler_state = jax.tree.map(
        lambda a, s: _sds(a.shape, a.dtype, s),
        jax.eval_shape(prefill_fn, *prefill_args),
        prefill.output_shardings,
    )
    pl.compile(
        "generate",
        "decode",
        sampler.decode_program(statics, "scan", b, p_len),
        (gen_params, sampler_state, arrays),
        live=gen_live,
        passed=gen_passed,
    )


def _plan_engine(pl, programs, gen_params, arrays, live, passed) -> None:
    """The rollout engine's admission and decode-chunk programs on its slot state; a note
    gives the slots' KV cache per device."""
    engine, cfg = programs.engine, pl.cfg
    r = programs.algo.rollout
    p_len, t = cfg.data.max_prompt_length, r.max_new_tokens
    sharding = engine.state_shardings(p_len, t)
    abstract = jax.eval_shape(engine.empty_program(p_len, t))
    state = jax.tree.map(lambda a, s: _sds(a.shape, a.dtype, s), abstract, sharding)
    a, n = engine.slots // r.num_samples, r.num_samples
    admit_args = (
        gen_params,
        state,
        _sds((a, p_len), jnp.int32),
        _sds((a, p_len), bool),
        _sds((a * n,), jnp.int32),
        _sds((a * n, t), jnp.float32),
        _sds((a * n,), jnp.int32),
    )
    admit = engine.admit_program(n, a, p_len, t)
    pl.compile("generate", "admit", admit, admit_args, live=live, passed=passed)
    chunk = engine.chunk_program(programs.sampling.static(), p_len)
    pl.compile("generate", "decode", chunk, (gen_params, state, arrays), live=live, passed=passed)
    per_device = max(bytes_per_device(sharding.cache, abstract.cache).values())
    size = (
        f"{per_device / 2**30:.2f} GiB" if per_device >= 2**30 else f"{per_device / 2**20:.2f} MiB"
    )
    pl.notes.append(
        f"rollout engine: {engine.slots} slots of {p_len} + {t} tokens, {engine.chunk} steps "
        f"per chunk; its KV cache holds {size} per device"
    )


def _plan_score(pl, programs, held, policy_state, ref_params, value_state, rm_params):
    """The reward model (if any), then the policy / reference / value forwards; returns the
    abstract rollout rows and the scored arrays (in the score program's output shardings)."""
    cfg, r = pl.cfg, programs.algo.rollout
    rows, length = r.rows, cfg.data.max_prompt_length + r.max_new_tokens
    row2, row1 = programs.rows(2), programs.rows(1)
    batch = RolloutRows(
        tokens=_sds((rows, length), jnp.int32, row2),
        mask=_sds((rows, length), bool, row2),
        response_mask=_sds((rows, length), bool, row2),
    )
    if rm_params is not None:
        args = (rm_params, batch.tokens, batch.mask)
        pl.compile("score", "reward", programs.reward, args, live=held, passed=["reward.params"])
    score_args = (
        policy_state.params,
        ref_params,
        None if value_state is None else value_state.params,
        batch,
        _sds((rows,), jnp.float32, row1),
        _sds((), jnp.float32, pl.replicated),
    )
    passed = ["policy.params", "reference.params"] + ["value.params"] * (value_state is not None)
    score = pl.compile("score", "score", programs.score, score_args, live=held, passed=passed)
    scored = jax.tree.map(
        lambda a, s: _sds(a.shape, a.dtype, s),
        jax.eval_shape(programs.score, *score_args),
        score.output_shardings,
    )
    return batch, scored


def plan_rl(pl: Planner, layout: RunLayout) -> str:
    """Generate (prefill, decode), score (reward, score) and the update of the run's
    ``RLPrograms``; the shapes line."""
    cfg = pl.cfg
    programs, rm_model, rm_note = _rl_programs(pl, layout)
    algo, rl = programs.algo, layout.rl
    policy_state = pl.trained("policy", "lm", programs.policy.optimizer, programs.policy_shardings)
    ref_params = pl.frozen("reference", pl.model_cfg, "lm", programs.reference_shardings)
    held = ["policy.params", "policy.opt", "reference.params"]
    value_state = None
    if programs.value is not None:
        value_state = pl.trained(
            "value", "scalar", programs.value.optimizer, programs.value_shardings
        )
        held += ["value.params", "value.opt"]
    rm_params = None
    if programs.reward is not None:
        rm_params = pl.frozen("reward", rm_model, "scalar", programs.reward_shardings, rm_note)
        held.append("reward.params")
    _plan_generate(pl, programs, held)

    batch, scored = _plan_score(
        pl, programs, held, policy_state, ref_params, value_state, rm_params
    )
    # -- train: epochs x minibatches x micro-batches of every learner ------------------------
    kl_coef = _sds((batch.tokens.shape[0],), jnp.float32, pl.replicated)
    behaviour = None
    if algo.loss.rollout_correction.uses_behaviour:  # the sampler's log-probs, like the tokens
        behaviour = _sds(batch.tokens.shape, jnp.float32, batch.tokens.sharding)
    learner_batch = LearnerBatch.of(batch, scored, kl_coef, behaviour)
    states = (policy_state,) + (() if value_state is None else (value_state,))
    learners = [n for n in held if n.startswith(("policy.", "value."))]
    pl.compile(
        "train",
        "update",
        programs.update,
        (states, learner_batch, pl.key),
        live=held,
        passed=learners,
    )
    loss, r = algo.loss, algo.rollout
    return (
        f"rollout {r.prompts_per_step} prompts x {r.num_samples} sample(s), "
        f"{cfg.data.max_prompt_length} prompt + {r.max_new_tokens} new tokens; update "
        f"{loss.epochs} epoch(s) x {loss.num_minibatches} minibatch(es) x {rl.num_micro} "
        "micro-batch(es)"
    )
