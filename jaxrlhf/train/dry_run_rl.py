"""The dry run's RL phases (``algorithm: ppo | grpo``): the sampler (with a LoRA or Hydra
policy, the program that builds its weights), scoring and the update of the run's
``rl_programs.RLPrograms``, compiled on abstract values (see ``dry_run_phases``). Programs
that pack sequences (``rollout.pack_sequences``) compile at their largest packed size, the
most memory.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import math
import pkgutil
import sys
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.config import RunLayout, rl_section
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.lora import LoraParams, combine
from jaxrlhf.models.packing import RowPacking, bucket_sizes
from jaxrlhf.sharding import rules_for
from jaxrlhf.sharding.model_sharding import bytes_per_device, param_shardings
from jaxrlhf.sharding.reshard import bytes_received
from jaxrlhf.train.dry_run_phases import EngineLayout, Planner, RoleMemory, sds
from jaxrlhf.train.rl_config import GRPOConfig, PPOConfig
from jaxrlhf.train.rl_programs import RLPrograms, build_rl_programs, sampling_params
from jaxrlhf.train.rl_scoring import abstract_rows
from jaxrlhf.train.rl_stream import accelerator_blocker, streamed_batch_rows
from jaxrlhf.train.rl_types import LearnerBatch
from jaxrlhf.train.state import create_state, state_shardings

# ---- RL (ppo, grpo) ---------------------------------------------------------------------------


def _select(mask: Any, want: bool, *trees: Any) -> list[list[Any]]:
    """The leaves of each tree where ``mask``'s leaf is ``want``."""
    flags = jax.tree.leaves(mask)
    return [[x for x, f in zip(jax.tree.leaves(t), flags, strict=True) if f == want] for t in trees]


def _missing_host_modules(algo: PPOConfig | GRPOConfig, section: str) -> list[str]:
    """Notes for the reward function's and the environment's modules that this host cannot
    find (looked up, never imported: the run imports them where it starts)."""
    paths = {f"{section}.rollout.environment": algo.rollout.environment}
    if algo.reward.model_dir is None and algo.reward.function not in ("builtin", "environment"):
        paths[f"{section}.reward.function"] = algo.reward.function
    notes = []
    for field, path in paths.items():
        if path is None:
            continue
        module = path.rpartition(".")[0]
        try:
            found = module_exists(module)
        except Exception as e:  # a finder's own error: say so, the plan goes on
            notes.append(f"{field}: cannot look up module {module!r} here ({e})")
            continue
        if not found:
            notes.append(f"{field}: no module {module!r} on this host; a run here would stop")
    return notes


def module_exists(name: str) -> bool:
    """Whether the module ``name`` (dotted) can be found, without importing it or its parent
    packages (which would run their code): the top-level name by the import system's
    finders, each submodule in its parent's directories (an imported parent's ``__path__``),
    namespace packages included."""
    if sys.modules.get(name) is not None:
        return True
    parts = name.split(".")
    spec = importlib.util.find_spec(parts[0])  # a top-level name: nothing is imported
    for depth in range(2, len(parts) + 1):
        if spec is None:
            return False
        parent = sys.modules.get(".".join(parts[: depth - 1]))
        locations = getattr(parent, "__path__", None) or spec.submodule_search_locations
        if locations is None:  # a plain module has no submodules
            return False
        spec = _find_in(".".join(parts[:depth]), list(locations))
    return spec is not None


def _find_in(name: str, locations: list[str]) -> importlib.machinery.ModuleSpec | None:
    """The spec of the submodule ``name`` in the directories ``locations`` (each searched by
    its path entry finder, nothing imported): the first with a loader, else a namespace
    package of the portions found, else None."""
    portions = []
    for entry in locations:
        finder = pkgutil.get_importer(entry)
        spec = None if finder is None else finder.find_spec(name)
        if spec is None:
            continue
        if spec.loader is not None:
            return spec
        portions.extend(spec.submodule_search_locations or [])
    if not portions:
        return None
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = portions
    return spec


def _rl_programs(pl: Planner, layout: RunLayout) -> tuple[RLPrograms, ModelConfig | None, str]:
    """The run's RLPrograms on abstract shapes: the sampler compiled as on an accelerator
    (no CPU weight blocks), one stop id (the tokenizer's EOS, unread here)."""
    algo = rl_section(pl.cfg)
    rm_model, note = None, ""
    if algo.reward.model_dir is not None:
        rm_model, note = pl.arch(algo.reward.model_dir, f"{pl.cfg.algorithm}.reward.model_dir")
    else:
        pl.notes.append(f"reward: {algo.reward.function!r} runs on the host (not loaded here)")
    pl.notes.extend(_missing_host_modules(algo, pl.cfg.algorithm))
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
        critic_mesh=pl.critic_mesh,
        reference_mesh=pl.reference_mesh,
    )
    return programs, rm_model, note


def _generate_copy(pl: Planner, name: str, source: str, shardings: Any) -> Any:
    """Registers the generate-layout copy of the tree ``source`` as ``name`` (all of it),
    ``name.copy`` (the leaves whose layout changes) and ``name.shared`` (the others, which
    ``jax.device_put`` does not copy); returns the whole copy, abstract."""
    abstract, train_sh = pl.trees[source]
    whole = pl.add(name, abstract, shardings)
    pl.reshard_bytes = max(bytes_received(train_sh, shardings, abstract).values(), default=0)
    same = jax.tree.map(
        lambda a, s, t: s.is_equivalent_to(t, a.ndim), abstract, shardings, train_sh
    )
    pl.add(f"{name}.copy", *_select(same, False, abstract, shardings))
    pl.add(f"{name}.shared", *_select(same, True, abstract, train_sh))
    return whole


def _plan_lora_sync(pl: Planner, programs: RLPrograms, held: list[str]) -> tuple[Any, list, list]:
    """A LoRA policy's weights for the sampler (``weight_sync.AdapterSync``): the merge
    program and the bytes each iteration moves; ``(merged params, live, passed)`` for the
    sampler's programs. With ``sync: adapters`` the resident base copy joins ``held``."""
    sync, sampler = programs.sync, programs.sampler
    pl.sync_bytes = sync.bytes_per_iteration()
    adapters, full = pl.sync_bytes
    pl.notes.append(
        f"LoRA weight sync ({sync.mode}): {_mib(adapters)} moved per iteration with adapter "
        f"sync, {_mib(full)} with a full sync ({full / max(adapters, 1):.0f}x)"
    )
    merged_sh = sampler.param_shardings
    if sync.mode == "adapters":
        base = _generate_copy(pl, "policy.generate.base", "policy.base", merged_sh)
        held.append("policy.generate.base.copy")
        trainable, _ = pl.trees["policy.params"]
        adapters_gen = pl.add("policy.generate.adapters", trainable, sync.adapter_shardings)
        live = [*held, "policy.generate.adapters"]
        passed = ["policy.generate.base.copy", "policy.generate.base.shared"]
        passed.append("policy.generate.adapters")
        pl.compile(
            "generate", "merge", sync.merge_generate, (base, adapters_gen), live=live, passed=passed
        )
    else:
        frozen = jax.tree.map(lambda a, s: sds(a.shape, a.dtype, s), *pl.trees["policy.base"])
        trainable = jax.tree.map(lambda a, s: sds(a.shape, a.dtype, s), *pl.trees["policy.params"])
        pl.compile(
            "generate",
            "merge",
            sync.merge_train,
            (frozen, trainable),
            live=held,
            passed=["policy.base", "policy.params"],
        )
    abstract, _ = pl.trees["policy.base"]
    merged = pl.add("policy.generate", abstract, merged_sh)
    return merged, [*held, "policy.generate"], ["policy.generate"]


def _plain_generate(pl: Planner, programs: RLPrograms) -> tuple[Any, Any]:
    """The plain policy's abstract params and its shardings in the sampler's layout."""
    return model_lib.abstract_params(pl.model_cfg), programs.sampler.param_shardings


def _mib(n: int) -> str:
    if n < 2**20:
        return f"{n / 2**10:.1f} KiB"
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _plan_generate(pl: Planner, programs: RLPrograms, held: list[str]) -> None:
    """Prefill and decode, reading a generate-layout copy of the policy parameters (with
    LoRA, the merged weights: :func:`_plan_lora_sync`)."""
    sampler, cfg = programs.sampler, pl.cfg
    if pl.generate_mesh is not pl.mesh:
        pl.notes.append(
            f"sampler on its own mesh {dict(pl.generate_mesh.shape)} (placement.generate_mesh); "
            "its copy of the policy is counted on each of its devices, the training devices' "
            "included (an upper bound: jax.device_put may reuse a training buffer there)"
        )
    if programs.hydra is not None:
        trunk = pl.add("trunk", *pl.trees["trunk"])
        policy = pl.add("policy.params", *pl.trees["policy.params"])
        gen_params = pl.add("policy.generate", *_plain_generate(pl, programs))
        pl.compile(
            "generate",
            "merge",
            programs.sync.program,
            (trunk, policy),
            live=held,
            passed=["trunk", "policy.params"],
        )
        gen_live, gen_passed = [*held, "policy.generate"], ["policy.generate"]
        pl.reshard_bytes = pl.nbytes("policy.generate")  # the merged policy moves whole
    elif programs.sync is not None:
        gen_params, gen_live, gen_passed = _plan_lora_sync(pl, programs, held)
        moved = (
            "policy.generate.adapters" if programs.sync.mode == "adapters" else "policy.generate"
        )
        pl.reshard_bytes = pl.nbytes(moved)
    else:
        gen_params = _generate_copy(pl, "policy.generate", "policy.params", sampler.param_shardings)
        gen_live = [*held, "policy.generate.copy"]
        gen_passed = ["policy.generate.copy", "policy.generate.shared"]
    pl.roles[0] = dataclasses.replace(pl.roles[0], generate_bytes=pl.nbytes("policy.generate"))
    pl.generate_live = gen_live
    b, p_len = programs.algo.rollout.prompts_per_step, cfg.data.max_prompt_length
    statics = programs.sampling.static()
    arrays = jax.tree.map(lambda x: sds(x.shape, x.dtype), programs.sampling.arrays())
    if programs.engine is not None:
        _plan_engine(pl, programs, gen_params, arrays, gen_live, gen_passed)
        return
    prompts = (sds((b, p_len), jnp.int32), sds((b, p_len), bool))
    prefill_fn = sampler.prefill_program(statics, b, p_len)
    prefill_args = (gen_params, *prompts, pl.key)
    prefill = pl.compile(
        "generate", "prefill", prefill_fn, prefill_args, live=gen_live, passed=gen_passed
    )
    sampler_state = jax.tree.map(
        lambda a, s: sds(a.shape, a.dtype, s),
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
        runs=programs.algo.rollout.max_new_tokens,  # its scan body is one token
    )


VIEW_PREFIX = "decode view "


def _engine_program(name: str) -> bool:
    """Whether the dry run's program ``name`` is one the engine runs while it decodes (an
    admission or a decode chunk; not its decode weights, whose output stays live)."""
    return name in ("admit", "decode") or name.startswith(VIEW_PREFIX)


def view_program_name(rows: int, width: int) -> str:
    """The dry run's name for the engine's decode chunk on a view of ``rows`` slots per
    shard and ``width`` generated cache columns."""
    return f"{VIEW_PREFIX}{rows}x{width}"


def _plan_engine(pl, programs, gen_params, arrays, live, passed) -> None:
    """The rollout engine's admission and decode-chunk programs on its slot state; a note
    gives the slots' KV cache per device."""
    engine, cfg = programs.engine, pl.cfg
    r = programs.algo.rollout
    p_len, t = cfg.data.max_prompt_length, r.max_new_tokens
    sharding = engine.state_shardings(p_len, t)
    abstract = jax.eval_shape(engine.empty_program(p_len, t))
    state = pl.add("engine.state", abstract, sharding)  # alive while streamed scoring runs
    # The decode chunks read the weights in decode layout, made once per generate call
    # before the first admission: alive in every admission, passed to the chunks.
    weights_fn = engine.decode_weights_program()
    made = pl.compile(
        "generate", "decode weights", weights_fn, (gen_params,), live=live, passed=passed
    )
    weights = pl.add(
        "engine.decode_weights", jax.eval_shape(weights_fn, gen_params), made.output_shardings
    )
    live = [*live, "engine.decode_weights"]
    a, n = engine.slots // r.num_samples, r.num_samples
    admit_args = (
        gen_params,
        state,
        sds((a, p_len), jnp.int32),
        sds((a, p_len), bool),
        sds((a * n,), jnp.int32),
        sds((a * n, t), jnp.float32),
        sds((a * n,), jnp.int32),
    )
    admit = engine.admit_program(n, a, p_len, t)
    waves = -(-r.rows // engine.slots)  # every row max_new_tokens long: whole waves of slots
    admits = -(-r.prompts_per_step // a)
    pl.compile("generate", "admit", admit, admit_args, live=live, passed=passed, runs=admits)
    passed = [*passed, "engine.decode_weights"]
    chunk = engine.chunk_program(programs.sampling.static(), p_len)
    steps = waves * -(-t // engine.chunk) * engine.chunk  # its scan body is one step
    chunk_args = (gen_params, weights, state, arrays)
    pl.compile("generate", "decode", chunk, chunk_args, live=live, passed=passed, runs=steps)
    rows, widths = engine.view_buckets(t)
    local = rows[-1]  # slots per shard
    views = [(local, w) for w in widths[:-1]] + [(r, t) for r in rows[:-1]]
    views = views if engine.views else []
    compiled: tuple[tuple[int, int], ...] = ()
    if views:
        # The largest view's copy of the cache is the peak; the views with the fewest rows
        # (at full width) and the narrowest width (at all rows), and the whole state taken
        # as a view (what a view's copies add per chunk), give the planner a step's cost
        # on any view (jaxrlhf.plan.estimate.view_cost_model).
        largest = max(views, key=lambda v: v[0] * v[1])
        corners = [largest] + [v for v in ((rows[0], t), (local, widths[0])) if v in views]
        compiled = tuple(dict.fromkeys([*corners, (local, t)]))  # in order, without repeats
        ids_sharding = sharding.done if sharding is not None else None
        for view_rows, width in compiled:
            view = engine.view_chunk_program(programs.sampling.static(), p_len, view_rows, width)
            ids = sds((view_rows * engine.slot_shards,), jnp.int32, ids_sharding)
            view_args = (gen_params, weights, state, arrays, ids)
            pl.compile(  # runs only on a ragged tail (no full-length wave needs it)
                "generate",
                view_program_name(view_rows, width),
                view,
                view_args,
                live=live,
                passed=passed,
                runs=0,
            )
    per_device = max(bytes_per_device(sharding.cache, abstract.cache).values())
    pl.engine_layout = EngineLayout(
        local_slots=local,
        shards=engine.slot_shards,
        kv_bytes=per_device / local / (p_len + t),
        views=compiled,
    )
    size = (
        f"{per_device / 2**30:.2f} GiB" if per_device >= 2**30 else f"{per_device / 2**20:.2f} MiB"
    )
    pl.notes.append(
        f"rollout engine: {engine.slots} slots of {p_len} + {t} tokens, {engine.chunk} steps "
        f"per chunk; its KV cache holds {size} per device"
        + (f"; up to {len(views)} smaller decode views compile on first use" if views else "")
    )


def _learner_rows(programs: RLPrograms, rows: int, length: int, packed: bool) -> Any:
    """Abstract ``RolloutRows`` of ``rows x length`` placed as the learner's scoring reads
    them (``programs.rows``)."""
    return jax.tree.map(
        lambda x: sds(x.shape, x.dtype, programs.rows(x.ndim)),
        abstract_rows(rows, length, packed=packed),
    )


def _plan_score(pl, programs, held, models, rm_params):
    """The reward model (if any), then the policy / reference / value forwards (``models``:
    their abstract params as the score program takes them, and the trees they are); returns
    the abstract rollout rows and the scored arrays (in the score program's output
    shardings)."""
    (policy_params, ref_params, value_params), passed = models
    cfg, r = pl.cfg, programs.algo.rollout
    rows, length = r.rows, cfg.data.max_prompt_length + r.max_new_tokens
    packed = programs.planner.score_rows or None  # packed: the largest size, the most memory
    batch = _learner_rows(programs, rows, length, packed=packed is not None)
    if programs.reference_apart is not None:
        batch = batch.replace(ref_logprobs=sds((rows, length), jnp.float32, programs.rows(2)))
        _plan_reference_apart(pl, programs, held, rows, length)
    if rm_params is not None:
        args = (rm_params, batch.tokens, batch.mask, batch.packing, packed)
        micro = programs.layout.rl.score_micro
        pl.compile(
            "score",
            "reward",
            programs.reward,
            args,
            live=held,
            passed=["reward.params"],
            runs=micro,
        )
    score_args = (
        policy_params,
        ref_params,
        value_params,
        batch,
        sds((rows,), jnp.float32, programs.rows(1)),
        sds((), jnp.float32, pl.replicated),
        packed,
    )
    score = pl.compile(
        "score",
        "score",
        programs.score,
        score_args,
        live=held,
        passed=passed,
        runs=programs.layout.rl.score_micro,  # map_micro's scan body is one micro-batch
    )
    for size in _smaller_packed(pl, programs, packed):
        pl.compile(
            "score",
            packed_program_name("score", size),
            programs.score,
            (*score_args[:-1], size),
            live=held,
            passed=passed,
            runs=0,  # priced by the planner at the packed size the lengths give
        )
    scored = jax.tree.map(
        lambda a, s: sds(a.shape, a.dtype, s),
        jax.eval_shape(lambda *a: programs.score(*a, packed), *score_args[:-1]),
        score.output_shardings,
    )
    if pl.critic_mesh is not None:  # interleaved: the critic's values on its own group
        value = pl.critic_params  # as the score program would take them (LoRA: with its base)
        critic_batch = jax.tree.map(
            lambda x: sds(x.shape, x.dtype, programs.critic_rows(x.ndim)),
            batch.replace(turn_rewards=None, ref_logprobs=None),
        )
        pl.compile(
            "score",
            "values",
            programs.score_values,
            (value, critic_batch, packed),
            live=held,
            passed=[n for n in _critic_trees(held) if n != "value.opt"],
            runs=programs.layout.rl.score_micro,
            group="critic",
        )
        # The learner completes the advantages once the values are in (score_advantages).
        forwards = jax.eval_shape(
            lambda *a: programs.score_forwards(*a, packed), *score_args[:3], batch
        )
        values = jax.ShapeDtypeStruct((rows, length), jnp.float32)
        shape = jax.eval_shape(
            programs.score_advantages,
            forwards.replace(old_values=values),
            batch.response_mask,
            *score_args[4:6],
            batch.turn_rewards,
        )
        scored = jax.tree.map(
            lambda a: sds(a.shape, a.dtype, programs.rows(a.ndim) if a.ndim else pl.replicated),
            shape,
        )
    return batch, scored


def _plan_streamed_score(pl, programs, models, rm_params) -> None:
    """With the engine and ``stream_scoring``, the scoring forwards (and the reward model)
    of each finished micro-batch run between decode chunks, while the engine's slot state,
    its decode weights and the sampler's copy of the policy are alive, and the forwards of
    the micro-batches scored before it (whole micro-batches, all but the last) are held:
    compiled at the streamed micro-batch's rows, unpacked (its most memory), with all that
    counted on the devices it shares with them. Scored on a background thread
    (``rollout.stream_concurrent``, where an accelerator run would), it runs beside the
    engine, so the engine's own outputs and temporaries (its largest admission or chunk)
    are counted too where their devices meet. Memory only: their time is the scoring
    phase's already (``runs=0``). (An interleaved critic's values are scored on its group
    after the rollout: ``models`` has no value params then.)"""
    r = programs.algo.rollout
    if programs.engine is None or not r.stream_scoring or r.environment is not None:
        return
    beside = 0
    shared = set(pl.generate_mesh.devices.flat) & set(programs.mesh.devices.flat)
    # Planned as on accelerators (the run's own CPU pool does not decide it here).
    if (
        r.stream_concurrent
        and shared
        and accelerator_blocker(pl.generate_mesh, programs.mesh) is None
    ):
        beside = max(
            p.output_bytes - p.alias_bytes + p.temp_bytes
            for p in pl.programs
            if p.phase == "generate" and _engine_program(p.name)
        )
    (policy_params, ref_params, value_params), passed = models
    length = pl.cfg.data.max_prompt_length + r.max_new_tokens
    micro = streamed_batch_rows(programs.algo, programs.layout)
    live = [*pl.generate_live, "engine.decode_weights", "engine.state"]
    # Every micro-batch scored before the last is whole (the last is padded to the size),
    # and the one being scored is the program's own output.
    held = (math.ceil(r.rows / micro) - 1) * micro
    if held:
        one = jax.eval_shape(  # one streamed micro-batch's forwards, widened to the held rows
            lambda *a: programs.score_forwards(*a, None),
            policy_params,
            ref_params,
            value_params,
            _learner_rows(programs, micro, length, packed=False),
        )
        held_forwards = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((held, *a.shape[1:]), a.dtype), one
        )
        pl.add(
            "score.streamed",
            held_forwards,
            jax.tree.map(
                lambda a: programs.rows(a.ndim) if a.ndim else pl.replicated, held_forwards
            ),
        )
        live.append("score.streamed")
    batch = _learner_rows(programs, micro, length, packed=False)
    if rm_params is not None:
        pl.compile(
            "score",
            "reward (streamed)",
            programs.reward,
            (rm_params, batch.tokens, batch.mask, batch.packing, None),
            live=live,
            passed=["reward.params"],
            runs=0,
            beside_bytes=beside,
        )
    pl.compile(
        "score",
        "score (streamed)",
        programs.score_forwards,
        (policy_params, ref_params, value_params, batch, None),
        live=live,
        passed=passed,
        runs=0,
        beside_bytes=beside,
    )


def packed_program_name(name: str, rows: int) -> str:
    """The dry run's name for program ``name`` compiled at ``rows`` packed rows per shard
    (besides its largest size, which keeps the plain name)."""
    return f"{name}@{rows}"


def _smaller_packed(pl: Planner, programs: RLPrograms, packed: int | None) -> tuple[int, ...]:
    """The packed sizes below the largest, ``packed`` rows per shard, of a packed phase when
    the planner asked for them (each compiles once more); else none."""
    if not pl.packed_sizes or not packed:
        return ()
    return tuple(k for k in bucket_sizes(packed, programs.planner.buckets) if k < packed)


def _critic_trees(held: list[str]) -> list[str]:
    """The critic's trees among ``held`` (an interleaved critic's group holds them)."""
    return [n for n in held if n.startswith("value.")]


def _plan_reference_apart(pl, programs, held, rows: int, length: int) -> None:
    """``placement.reference: sampler | own``: the reference's forward on the sampler's mesh
    (a generate phase) or its own group's (a score phase), on the rollout's rows split over
    its data shards (packed at the largest size)."""
    packed = programs.reference_planner.score_rows or None
    batch = jax.tree.map(
        lambda x: sds(x.shape, x.dtype, programs.reference_rows(x.ndim)),
        abstract_rows(rows, length, packed=packed is not None),
    )
    abstract, shardings = pl.trees["reference.params"]
    ref = jax.tree.map(lambda a, s: sds(a.shape, a.dtype, s), abstract, shardings)
    own = pl.reference_mesh is not None
    # On the sampler's devices what generation holds is alive meanwhile (its copy of the
    # policy: the producer holds it); a group of its own holds the reference alone.
    copies = [] if own else [n for n in pl.generate_live if n not in held]
    pl.compile(
        "score" if own else "generate",
        "reference",
        programs.reference_apart,
        (ref, batch, packed),
        live=[*held, *copies],
        passed=["reference.params"],
        runs=programs.layout.reference_rl.score_micro,  # map_micro's scan body: a micro-batch
        group="reference_group" if own else "",
    )


def _rl_learners(pl: Planner, programs: RLPrograms) -> tuple[list, tuple, tuple, list]:
    """Registers the learners' trees (LoRA: adapters, optimizer and frozen bases; a critic
    from the policy shares the policy's base) and the reference (LoRA: the policy's base).
    Returns ``(held trees, states, frozen bases, [policy, reference, value] model params and
    the trees the score program reads)``."""
    if programs.hydra is not None:
        return _hydra_learners(pl, programs)
    policy_lora, value_lora = programs.policy_lora, programs.value_lora
    if policy_lora is None:
        policy = pl.trained("policy", "lm", programs.policy.optimizer, programs.policy_shardings)
        held = ["policy.params", "policy.opt", "reference.params"]
        if programs.reference_apart is None:
            ref = pl.frozen("reference", pl.model_cfg, "lm", programs.reference_shardings)
            models, passed = [policy.params, ref], ["policy.params", "reference.params"]
        else:  # placement.reference: sampler | own; the score program reads its log-probs
            where = "its own" if pl.reference_mesh is not None else "the sampler's"
            pl.frozen(
                "reference",
                pl.model_cfg,
                "lm",
                programs.reference_apart_shardings,
                f"on {where} devices",
            )
            models, passed = [policy.params, None], ["policy.params"]
        frozen = [None]
    else:
        policy, base = pl.lora(
            "policy", policy_lora, programs.policy.optimizer, programs.policy_shardings
        )
        pl.notes.append("the reference is the LoRA base (no copy)")
        held = ["policy.params", "policy.opt", "policy.base"]
        models = [LoraParams(base, policy.params, None), base]
        passed, frozen = ["policy.params", "policy.base"], [base]
    states = [policy]
    if programs.value is not None:
        if value_lora is None:
            value = pl.trained(
                "value", "scalar", programs.value.optimizer, programs.value_shardings
            )
            held += ["value.params", "value.opt"]
            models.append(value.params)
            frozen.append(None)
        else:
            value = pl.trained(
                "value",
                "scalar",
                programs.value.optimizer,
                programs.value_shardings,
                value_lora.trainable,
            )
            held += ["value.params", "value.opt"]
            if programs.algo.critic_init == "policy" and pl.critic_mesh is None:
                value_base = {"decoder": frozen[0]["decoder"]}  # the policy's base decoder
                pl.notes.append("the LoRA critic shares the policy's frozen base (no copy)")
            elif programs.algo.critic_init == "policy":  # interleaved: a copy on its devices
                value_base = pl.add(
                    "value.base",
                    {"decoder": value_lora.frozen["decoder"]},
                    {"decoder": value_lora.frozen_shardings["decoder"]},
                )
                pl.roles.append(
                    RoleMemory(
                        "base",
                        value_lora.head,
                        model_lib.param_count(value_base),
                        pl.nbytes("value.base"),
                        note="a copy of the policy's frozen base on the critic's devices",
                    )
                )
                held.append("value.base")
                passed.append("value.base")
            else:
                value_base = pl.frozen_tree("value.base", value_lora, "frozen critic weights")
                held.append("value.base")
                passed.append("value.base")
            models.append(LoraParams(value_base, value.params, None))
            frozen.append(value_base)
        passed.append("value.params")
        states.append(value)
        if pl.critic_mesh is not None:  # interleaved: its values are scored on its group
            pl.critic_params = models[-1]
            models[-1] = None
            passed = [n for n in passed if not n.startswith("value.")]
    else:
        models.append(None)
    return held, tuple(states), tuple(frozen), [tuple(models), passed]


def _hydra_learners(pl: Planner, programs: RLPrograms) -> tuple[list, tuple, tuple, list]:
    """:func:`_rl_learners` of a Hydra critic: the trunk (frozen, shared by both learners and
    the reference), both branches and the reference's branch; notes the critic's memory
    against a separate critic's."""
    hydra, mesh = programs.hydra, pl.mesh
    policy = pl.trained(
        "policy", "lm", programs.policy.optimizer, programs.policy_shardings, hydra.policy
    )
    value = pl.trained(
        "value", "scalar", programs.value.optimizer, programs.value_shardings, hydra.value
    )
    trunk = pl.add("trunk", hydra.trunk, hydra.trunk_shardings)
    pl.roles.append(
        RoleMemory(
            "trunk",
            "-",
            model_lib.param_count(trunk),
            pl.nbytes("trunk"),
            note=f"frozen, shared (layers below {hydra.branch_layer})",
        )
    )
    ref = pl.add("reference.params", hydra.policy, hydra.policy_shardings)
    pl.roles.append(
        RoleMemory("reference", "lm", model_lib.param_count(ref), pl.nbytes("reference.params"))
    )
    # What a separate critic (the whole model, its optimizer state) would hold instead.
    abstract = model_lib.abstract_params(pl.model_cfg, "scalar")
    sh = param_shardings(pl.model_cfg, mesh, rules_for("value", "train"), "scalar")
    state_sh = state_shardings(abstract, sh, programs.value.optimizer, mesh)
    state = jax.eval_shape(lambda p: create_state(p, programs.value.optimizer), abstract)
    pl.add("separate.critic", state, state_sh)  # as value.params + value.opt: all of it
    hydra_bytes, separate = pl.nbytes("value.params", "value.opt"), pl.nbytes("separate.critic")
    pl.critic_bytes = (hydra_bytes, separate)
    pl.notes.append(
        f"Hydra critic (branch from layer {hydra.branch_layer}): {_mib(hydra_bytes)} of "
        f"params and optimizer state per device; a separate critic: {_mib(separate)}"
    )
    held = ["policy.params", "policy.opt", "value.params", "value.opt", "trunk"]
    held.append("reference.params")
    models = (combine(trunk, policy.params), combine(trunk, ref), combine(trunk, value.params))
    passed = ["policy.params", "trunk", "reference.params", "value.params"]
    return held, (policy, value), (trunk, trunk), [models, passed]


def plan_rl(pl: Planner, layout: RunLayout) -> str:
    """Generate (prefill, decode; with LoRA the merge), score (reward, score) and the update
    of the run's ``RLPrograms``; the shapes line."""
    cfg = pl.cfg
    programs, rm_model, rm_note = _rl_programs(pl, layout)
    algo, rl = programs.algo, layout.rl
    held, states, frozen, models = _rl_learners(pl, programs)
    rm_params = None
    if programs.reward is not None:
        rm_params = pl.frozen("reward", rm_model, "scalar", programs.reward_shardings, rm_note)
        held.append("reward.params")
    _plan_generate(pl, programs, held)

    batch, scored = _plan_score(pl, programs, held, models, rm_params)
    _plan_streamed_score(pl, programs, models, rm_params)
    # -- train: epochs x minibatches x micro-batches of every learner ------------------------
    rows = batch.tokens.shape[0]
    kl_coef = sds((rows,), jnp.float32, pl.replicated)
    behaviour = None
    if algo.loss.rollout_correction.uses_behaviour:  # the sampler's log-probs, like the tokens
        behaviour = sds(batch.tokens.shape, jnp.float32, programs.rows(2))
    learner_batch = LearnerBatch.of(batch, scored, kl_coef, behaviour)
    packed = programs.planner.update_rows or None  # the largest packed size
    if packed is not None:
        plan = sds((rows, algo.loss.epochs), jnp.int32, programs.rows(2))
        learner_batch = learner_batch.replace(packing=RowPacking(plan, plan, plan))
    learners = [n for n in held if n.startswith(("policy.", "value.")) and ".generate" not in n]
    runs = algo.loss.epochs * algo.loss.num_minibatches * rl.num_micro  # nested scans' body
    if pl.critic_mesh is not None:  # interleaved: each learner's update on its own group
        on_critic = jax.tree.map(
            lambda x: sds(x.shape, x.dtype, programs.critic_rows(x.ndim)), learner_batch
        )
        critic_key = jax.ShapeDtypeStruct(
            pl.key.shape, pl.key.dtype, sharding=NamedSharding(pl.critic_mesh, P())
        )
        pl.compile(
            "train",
            "update.critic",
            programs.update_value,
            ((states[1],), on_critic, critic_key, (frozen[1],), packed),
            live=held,
            passed=_critic_trees(held),
            runs=runs,
            group="critic",
        )
        states, frozen = states[:1], frozen[:1]
        learners = [n for n in learners if n not in _critic_trees(held)]
    pl.compile(
        "train",
        "update",
        programs.update,
        (states, learner_batch, pl.key, frozen, packed),
        live=held,
        passed=learners,
        runs=runs,
    )
    for size in _smaller_packed(pl, programs, packed):
        pl.compile(
            "train",
            packed_program_name("update", size),
            programs.update,
            (states, learner_batch, pl.key, frozen, size),
            live=held,
            passed=learners,
            runs=0,  # priced by the planner at the packed size the lengths give
        )
    pl.packing = programs.planner
    loss, r = algo.loss, algo.rollout
    return (
        f"rollout {r.prompts_per_step} prompts x {r.num_samples} sample(s), "
        f"{cfg.data.max_prompt_length} prompt + {r.max_new_tokens} new tokens; update "
        f"{loss.epochs} epoch(s) x {loss.num_minibatches} minibatch(es) x {rl.num_micro} "
        f"micro-batch(es){_packing_line(programs)}"
    )


def _packing_line(programs: RLPrograms) -> str:
    """Which phases pack sequences, into which sizes (memory is planned at the largest)."""
    planner, parts = programs.planner, []
    for phase, b in (("scoring", planner.score_rows), ("update", planner.update_rows)):
        if b:
            sizes = "/".join(map(str, bucket_sizes(b, planner.buckets)))
            parts.append(f"{phase} {b} -> {sizes} rows per data shard")
    if not parts:
        return ""
    return f"; sequences packed ({', '.join(parts)}; planned at the largest)"
