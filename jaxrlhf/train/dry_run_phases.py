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

from jaxrlhf.config import ConfigError, RunConfig, RunLayout
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.hf_config import load_hf_config
from jaxrlhf.models.safetensors_io import CheckpointError
from jaxrlhf.sharding import MeshError, ShardingRuleError
from jaxrlhf.sharding.model_sharding import bytes_per_device
from jaxrlhf.train.program_cost import ProgramCost, program_cost
from jaxrlhf.train.state import TrainState, create_state
from jaxrlhf.train.supervised import batch_layout, build_supervised_programs, objective_for

# The programs are compiled, never run: skipping LLVM's optimisations roughly halves the
# compile time and leaves XLA's buffer assignment (the memory analysis) unchanged. For XLA:CPU
# only: another compiler (XLA:TPU for a topology) compiles with its defaults, as a run does.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def compiler_options(mesh: Mesh) -> dict[str, Any] | None:
    """The options the dry run compiles with on ``mesh``'s devices: :data:`COMPILER_OPTIONS`
    on CPU, else None (the compiler's defaults)."""
    return COMPILER_OPTIONS if mesh.devices.flat[0].platform == "cpu" else None


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
      state_bytes: parameters and optimizer states on the device while it runs (analytic);
        for streamed scoring also the rollout engine's slot state and decode weights and
        the forwards scored before it.
      compile_s: seconds to lower and compile.
      code_bytes: the compiled program's code (``generated_code_size_in_bytes``; on a TPU
        it is loaded into device memory too, not counted in the peak).
      compiler_peak_bytes: the compiler's own peak figure (``peak_memory_in_bytes``: on
        XLA:TPU it also counts buffers in on-chip memory spaces), 0 where it gives none.
      cost: XLA's cost analysis per device, loop bodies counted once (the planner's input).
      runs: how many times per iteration that loop body runs when every sample generates
        ``max_new_tokens`` (decode steps, micro-batches x minibatches x epochs, ...).
      group: the placement's device group it runs on when that is a side group of an
        ``interleaved`` placement (``critic``, ``reference_group``); "" for the phase's own
        group (the sampler's for generate, else the learner's).
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
    cost: ProgramCost | None = None
    code_bytes: int = 0
    compiler_peak_bytes: int = 0
    runs: float = 1.0
    group: str = ""

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
class EngineLayout:
    """The rollout engine's slots as the dry run planned them (the planner prices its
    views from these).

    Attributes:
      local_slots: decode slots per data shard of the sampler's mesh.
      shards: the data shards the slots are split over.
      kv_bytes: KV-cache bytes one slot holds per cache position on one device (its K and
        V over every layer, the heads this device keeps).
      views: the ``(slots per shard, generated width)`` views whose decode chunks were
        compiled (``dry_run_rl.view_program_name``); empty with ``views=False``.
    """

    local_slots: int
    shards: int
    kv_bytes: float
    views: tuple[tuple[int, int], ...] = ()


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


def sds(shape: Sequence[int], dtype: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
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
        self,
        cfg: RunConfig,
        model_cfg: ModelConfig,
        mesh: Mesh,
        generate_mesh: Mesh | None = None,
        reference_mesh: Mesh | None = None,
        critic_mesh: Mesh | None = None,
        packed_sizes: bool = False,
    ) -> None:
        self.cfg, self.model_cfg, self.mesh = cfg, model_cfg, mesh
        self.generate_mesh = mesh if generate_mesh is None else generate_mesh
        self.reference_mesh = reference_mesh  # placement.reference: own; else None
        self.critic_mesh = critic_mesh  # interleaved with a critic group; else None
        self.critic_params: Any = None  # its params as its value forward takes them
        self.packed_sizes = packed_sizes  # also compile packed programs at smaller sizes
        self.packing: Any = None  # RL: the run's rl_packing.PackingPlanner
        self.trees: dict[str, tuple[Any, Any]] = {}  # name -> (abstract, shardings)
        self.roles: list[RoleMemory] = []
        self.programs: list[ProgramMemory] = []
        self.notes: list[str] = []
        self.sync_bytes: tuple[int, int] | None = None  # LoRA: (adapters, full) per iteration
        self.critic_bytes: tuple[int, int] | None = None  # Hydra: (its critic, a separate one)
        self.reshard_bytes = 0  # bytes a device receives moving the policy to the sampler
        self.engine_layout: EngineLayout | None = None  # the rollout engine's slots, if any
        self.generate_live: list[str] = []  # the trees alive while the sampler generates
        self.replicated = NamedSharding(mesh, P())
        self.key = jax.eval_shape(lambda: jax.random.key(0))

    def add(self, name: str, abstract: Any, shardings: Any) -> Any:
        """Registers a tree; returns it as ShapeDtypeStructs carrying their shardings."""
        self.trees[name] = (abstract, shardings)
        return jax.tree.map(lambda a, s: sds(a.shape, a.dtype, s), abstract, shardings)

    def nbytes(self, *names: str, on: set[Any] | None = None) -> int:
        """Max over devices (those in ``on``; None: any) of the summed bytes of the named
        trees."""
        totals: dict[Any, int] = {}
        for name in names:
            abstract, shardings = self.trees[name]
            for device, n in bytes_per_device(shardings, abstract).items():
                if on is None or device in on:
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

    def trained(
        self, role: str, head: str, optimizer: Any, sh: TrainState, abstract: Any = None
    ) -> Any:
        """Registers ``role.params`` and ``role.opt`` (in the program's state shardings
        ``sh``; ``abstract``: the trained params, default the whole model); returns the
        abstract TrainState with its shardings."""
        if abstract is None:
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
        return jax.tree.map(lambda a, s: sds(a.shape, a.dtype, s), state, sh)

    def lora(self, role: str, lora: Any, optimizer: Any, sh: TrainState) -> tuple[Any, Any]:
        """A LoRA learner: its adapters as ``role.params`` / ``role.opt`` (:meth:`trained`)
        and its frozen base as ``role.base``; returns ``(abstract state, abstract base)``."""
        state = self.trained(role, lora.head, optimizer, sh, lora.trainable)
        self.roles[-1] = dataclasses.replace(self.roles[-1], note="LoRA adapters")
        return state, self.frozen_tree(f"{role}.base", lora, f"frozen {role} weights")

    def frozen_tree(self, name: str, lora: Any, note: str) -> Any:
        """Registers a LoRA learner's frozen base as ``name`` (a ``base`` role); returns it
        abstract."""
        base = self.add(name, lora.frozen, lora.frozen_shardings)
        n = model_lib.param_count(base)
        self.roles.append(RoleMemory("base", lora.head, n, self.nbytes(name), note=note))
        return base

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
        runs: float = 1.0,
        group: str = "",
        beside_bytes: int = 0,
    ) -> Any:
        """Lowers and compiles ``jitted(*args)``; records its memory; returns the executable.

        ``live``: the trees alive meanwhile, counted on the devices the program spans only
        (a placement's other groups hold theirs elsewhere); ``passed``: those among
        ``args``; ``runs``, ``group``: :attr:`ProgramMemory.runs`, :attr:`ProgramMemory.group`;
        ``beside_bytes``: per device, what another program in flight at once allocates for
        itself there (its outputs and temporaries), counted as resident.
        """
        start = time.perf_counter()
        try:
            options = compiler_options(self.mesh)  # every mesh of a plan: one platform
            compiled = jitted.lower(*args).compile(compiler_options=options)
        except (ConfigError, MeshError, ShardingRuleError):
            raise
        except Exception as e:  # noqa: BLE001  a trainer bug or an XLA limit, told in one line
            raise DryRunError(f"{phase}/{name} does not compile: {_one_line(e)}") from e
        m = compiled.memory_analysis()
        on = argument_devices(args)
        state = self.nbytes(*live, on=on)
        self.programs.append(
            ProgramMemory(
                phase=phase,
                name=name,
                argument_bytes=int(m.argument_size_in_bytes),
                output_bytes=int(m.output_size_in_bytes),
                alias_bytes=int(m.alias_size_in_bytes),
                temp_bytes=int(m.temp_size_in_bytes),
                resident_bytes=max(0, state - self.nbytes(*passed, on=on)) + beside_bytes,
                state_bytes=state,
                compile_s=time.perf_counter() - start,
                cost=program_cost(compiled, max(1, len(on))),
                code_bytes=int(getattr(m, "generated_code_size_in_bytes", 0) or 0),
                compiler_peak_bytes=int(getattr(m, "peak_memory_in_bytes", 0) or 0),
                runs=runs,
                group=group,
            )
        )
        return compiled


def argument_devices(args: Sequence[Any]) -> set[Any]:
    """The devices a program's arguments span (its SPMD partitions)."""
    devices: set[Any] = set()
    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            devices |= set(sharding.device_set)
    return devices


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
    role, optimizer, lora = objective.role, programs.learner.optimizer, programs.lora
    frozen = None
    if lora is None:
        state = pl.trained(role, objective.head, optimizer, programs.state_shardings)
        live = [f"{role}.params", f"{role}.opt"]
    else:
        state, frozen = pl.lora(role, lora, optimizer, programs.state_shardings)
        live = [f"{role}.params", f"{role}.opt", f"{role}.base"]
    batch = {
        k: sds(shape, dtype, programs.batch_shardings[k])
        for k, (shape, dtype) in batch_layout(cfg, objective).items()
    }
    if programs.reference is not None:
        ref_batch = {k: v for k, v in batch.items() if k != "reference_logps"}
        if frozen is not None and objective.reference.hf_dir is None:  # the base itself
            pl.notes.append("the reference is the LoRA base (no copy)")
            args, ref_live, ref_passed = (frozen, ref_batch), live, [f"{role}.base"]
        else:
            ref_params = pl.frozen("reference", ref_model, "lm", programs.reference_shardings, note)
            args, ref_live = (ref_params, ref_batch), [*live, "reference.params"]
            ref_passed = ["reference.params"]
        pl.compile("score", "reference", programs.reference, args, live=ref_live, passed=ref_passed)
        if objective.reference.precompute:
            pl.notes.append("reference log-probs are precomputed, then the reference is freed")
        elif ref_passed == ["reference.params"]:
            live.append("reference.params")
    args = (state, batch, pl.key, frozen)
    passed = [f"{role}.params", f"{role}.opt"] + [f"{role}.base"] * (frozen is not None)
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
