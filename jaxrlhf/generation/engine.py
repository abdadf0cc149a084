"""Continuous batching: a fixed number of decode slots that finished samples leave and
queued prompts enter between jitted chunks of decode steps.

RL responses have long-tailed lengths: most end early, a few run to the budget. The static
sampler (:mod:`jaxrlhf.generation.sampler`) decodes every row for ``max_new_tokens`` steps;
the engine instead keeps ``slots`` rows busy:

* **Slots.** Each slot has its own contiguous KV-cache region ``[P + T]`` (prompt, then
  generated tokens; ``cache.DecodeCache``'s joint form) and its own step counter, position,
  budget and random numbers (:class:`SlotState`). Contiguous regions, not pages: a slot's
  region is reused in place by the next request, every shape is static, and the attention
  reads one array per layer; pages would save memory only where prompts of very different
  lengths share a batch, which RL's fixed prompt budget rules out.
* **Chunks.** :func:`decode_chunk` runs ``chunk`` decode steps for every slot in one jitted
  program (a ``lax.scan``, no Python per token). Between chunks the host reads which slots
  are done, hands their samples out (the RL loop scores them while the tail decodes) and
  admits queued prompts into free slots with :func:`admit`: one batched prefill per call,
  each prompt prefilled once and its cache copied into its ``n`` samples' slots.
* **Exactness.** A request's row ``r`` (prompt-major, as the static sampler numbers rows)
  samples step ``t`` with the random number ``draw_uniforms(key, R, T)[r, t]``, the static
  sampler's, whichever slot it lands in and whenever it starts; the logits come from the same
  prefill and the same decode layers. So the engine samples the same tokens with the same
  log-probs as the static sampler (to float32 rounding: the batches differ).

Stopping: stop token ids end a row on device; stop strings (decoded text) are checked by the
host between chunks, and a row that completed one is cut right after it (tokens it decoded
past the string in the same chunk are dropped). Per-request ``max_new_tokens`` is the slot's
budget. :class:`Engine` adds a total token budget and over-sampling with abort on the host.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.generation import decode as decode_lib
from jaxrlhf.generation.cache import DecodeCache, cache_nbytes
from jaxrlhf.generation.params import SamplingParams, SamplingStatics
from jaxrlhf.generation.sampler import Sampler
from jaxrlhf.generation.sampling import draw_uniforms, next_tokens
from jaxrlhf.models import axes
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.transformer import Constrain


@flax.struct.dataclass
class SlotState:
    """Everything the decode chunks carry (S slots, P prompt slots, T generated slots).

    Attributes:
      cache: the joint KV cache, L x [S, K, H, P + T] keys and L x [S, K, P + T, H] values.
      logits: [S, V] float32 logits of each slot's next token.
      tokens: [S, T] int32 sampled tokens (pad after the slot's row ended).
      logprobs, model_logprobs: [S, T] float32, as the static sampler's.
      step: [S] int32 tokens sampled so far by the slot's request.
      positions: [S] int32 position id of the next token fed to the model.
      prefix_mask: [S, P] bool, the request's real prompt tokens.
      prefix_positions: [S, P] int32 their position ids.
      lengths: [S] int32 response length so far.
      done: [S] bool: the slot holds no running request (ended, or never admitted).
      stopped: [S] bool: the request ended on a stop token.
      budget: [S] int32 the request's ``max_new_tokens``.
      uniforms: [S, T] float32 the request's random numbers (its row of ``draw_uniforms``).
    """

    cache: DecodeCache
    logits: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    model_logprobs: jax.Array
    step: jax.Array
    positions: jax.Array
    prefix_mask: jax.Array
    prefix_positions: jax.Array
    lengths: jax.Array
    done: jax.Array
    stopped: jax.Array
    budget: jax.Array
    uniforms: jax.Array

    @staticmethod
    def logical_axes(num_layers: int) -> SlotState:
        rows_t, rows = (axes.BATCH, axes.LENGTH), (axes.BATCH,)
        return SlotState(
            cache=DecodeCache.logical_axes(num_layers, shared_prefix=False),
            logits=(axes.BATCH, None),
            tokens=rows_t,
            logprobs=rows_t,
            model_logprobs=rows_t,
            step=rows,
            positions=rows,
            prefix_mask=rows_t,
            prefix_positions=rows_t,
            lengths=rows,
            done=rows,
            stopped=rows,
            budget=rows,
            uniforms=rows_t,
        )


def empty_state(cfg: ModelConfig, slots: int, prompt_len: int, max_new_tokens: int) -> SlotState:
    """All slots free (``done``), caches zero."""
    s, p, t = slots, prompt_len, max_new_tokens
    shape_k = (s, cfg.kv_heads, cfg.dim_per_head, p + t)
    shape_v = (s, cfg.kv_heads, p + t, cfg.dim_per_head)
    dtype = cfg.compute_dtype
    layers = range(cfg.num_layers)
    zeros_st = jnp.zeros((s, t), jnp.float32)
    return SlotState(
        cache=DecodeCache(
            prefix_k=(),
            prefix_v=(),
            k=tuple(jnp.zeros(shape_k, dtype) for _ in layers),
            v=tuple(jnp.zeros(shape_v, dtype) for _ in layers),
        ),
        logits=jnp.zeros((s, cfg.vocab_size), jnp.float32),
        tokens=jnp.zeros((s, t), jnp.int32),
        logprobs=zeros_st,
        model_logprobs=zeros_st,
        step=jnp.zeros((s,), jnp.int32),
        positions=jnp.zeros((s,), jnp.int32),
        prefix_mask=jnp.zeros((s, p), bool),
        prefix_positions=jnp.zeros((s, p), jnp.int32),
        lengths=jnp.zeros((s,), jnp.int32),
        done=jnp.ones((s,), bool),
        stopped=jnp.zeros((s,), bool),
        budget=jnp.ones((s,), jnp.int32),
        uniforms=jnp.ones((s, t), jnp.float32),
    )


def admit(
    cfg: ModelConfig,
    constrain: Constrain,
    n: int,
    params: Any,
    state: SlotState,
    prompt_tokens: Int[Array, "A P"],
    prompt_mask: Bool[Array, "A P"],
    dest: Int[Array, " An"],
    uniforms: Float[Array, "An T"],
    budget: Int[Array, " An"],
) -> SlotState:
    """Prefills ``A`` prompts once and starts their ``n`` samples each in slots ``dest``.

    Args:
      prompt_tokens, prompt_mask: [A, P] the prompts (padding rows, whose ``dest`` are out
        of range, need one real token like any other).
      dest: [A * n] the slot of each sample (prompt-major); an index >= S drops the sample
        (padding of a partly used admission batch).
      uniforms: [A * n, T] each sample's random numbers; budget: [A * n] its max_new_tokens.
    """
    logits, cache, positions = decode_lib.prefill(
        cfg, constrain, params, prompt_tokens, prompt_mask
    )
    prompt_len = prompt_tokens.shape[1]

    def put(x, new):
        return x.at[dest].set(jnp.repeat(new, n, axis=0).astype(x.dtype), mode="drop")

    def put_prefix(full, prefix, axis):
        region = jnp.repeat(prefix, n, axis=0).astype(full.dtype)
        index = (dest, slice(None), slice(None), slice(0, prompt_len))
        if axis == 2:
            index = (dest, slice(None), slice(0, prompt_len), slice(None))
        return full.at[index].set(region, mode="drop")

    new_cache = state.cache.replace(
        k=tuple(put_prefix(f, p, 3) for f, p in zip(state.cache.k, cache.prefix_k, strict=True)),
        v=tuple(put_prefix(f, p, 2) for f, p in zip(state.cache.v, cache.prefix_v, strict=True)),
    )
    zeros = jnp.zeros((dest.shape[0], state.tokens.shape[1]), jnp.float32)

    def set_rows(x, value):
        return x.at[dest].set(value.astype(x.dtype), mode="drop")

    return state.replace(
        cache=new_cache,
        logits=put(state.logits, logits),
        tokens=set_rows(state.tokens, zeros.astype(jnp.int32)),
        logprobs=set_rows(state.logprobs, zeros),
        model_logprobs=set_rows(state.model_logprobs, zeros),
        step=set_rows(state.step, jnp.zeros(dest.shape, jnp.int32)),
        positions=put(state.positions, prompt_mask.sum(-1, dtype=jnp.int32)),
        prefix_mask=put(state.prefix_mask, prompt_mask),
        prefix_positions=put(state.prefix_positions, positions),
        lengths=set_rows(state.lengths, jnp.zeros(dest.shape, jnp.int32)),
        done=set_rows(state.done, jnp.zeros(dest.shape, bool)),
        stopped=set_rows(state.stopped, jnp.zeros(dest.shape, bool)),
        budget=set_rows(state.budget, budget),
        uniforms=set_rows(state.uniforms, uniforms),
    )


def finish_slots(state: SlotState, slots: Int[Array, " F"], lengths: Int[Array, " F"]) -> SlotState:
    """Ends the requests in ``slots`` at ``lengths`` tokens, as stopped (a stop string)."""
    return state.replace(
        lengths=state.lengths.at[slots].set(lengths),
        step=state.step.at[slots].set(lengths),
        done=state.done.at[slots].set(True),
        stopped=state.stopped.at[slots].set(True),
    )


def _column(buffer: jax.Array, rows: jax.Array, column: jax.Array, value: jax.Array) -> jax.Array:
    """``buffer[r, column[r]] = value[r]`` for every row (out-of-range columns dropped)."""
    return buffer.at[rows, column].set(value.astype(buffer.dtype), mode="drop")


def sample_slots(
    state: SlotState, arrays: dict[str, jax.Array], statics: SamplingStatics
) -> SlotState:
    """Samples each running slot's token at its own step from its logits."""
    rows = jnp.arange(state.step.shape[0])
    uniform = jnp.take_along_axis(state.uniforms, state.step[:, None], axis=1, mode="clip")[:, 0]
    tokens, logprobs, model_lp = next_tokens(state.logits, uniform, arrays, statics)
    active = ~state.done
    tokens = jnp.where(active, tokens, arrays["pad_id"])
    is_stop = active & (tokens[:, None] == arrays["stop_ids"][None, :]).any(-1)
    column = jnp.where(active, state.step, state.tokens.shape[1])  # inactive: dropped
    step = state.step + active
    return state.replace(
        tokens=_column(state.tokens, rows, column, tokens),
        logprobs=_column(state.logprobs, rows, column, logprobs),
        model_logprobs=_column(state.model_logprobs, rows, column, model_lp),
        step=step,
        lengths=state.lengths + active,
        stopped=state.stopped | is_stop,
        done=state.done | is_stop | (active & (step >= state.budget)),
    )


def forward_slots(
    cfg: ModelConfig,
    constrain: Constrain,
    params: Any,
    weights: Any,
    state: SlotState,
    prev_done: Bool[Array, " S"],
) -> SlotState:
    """Feeds each slot's last sampled token (written at generated slot ``step - 1``) and
    stores its next logits. Slots that were not running before this step's sample keep their
    state (their cache column and logits are rewritten with values nobody reads)."""
    last = jnp.maximum(state.step - 1, 0)
    tokens = jnp.take_along_axis(state.tokens, last[:, None], axis=1)[:, 0]
    logits, cache = decode_lib.decode_step(
        cfg,
        constrain,
        params,
        weights,
        tokens,
        state.positions,
        state.cache,
        last,
        state.prefix_mask,
        state.prefix_positions,
    )
    moved = ~prev_done
    return state.replace(
        logits=jnp.where(moved[:, None], logits, state.logits),
        cache=cache,
        positions=state.positions + moved,
    )


def decode_chunk(
    cfg: ModelConfig,
    constrain: Constrain,
    statics: SamplingStatics,
    chunk: int,
    fuse_shards: dict[str, int | None],
    matmul_block: int,
    params: Any,
    state: SlotState,
    arrays: dict[str, jax.Array],
) -> SlotState:
    """``chunk`` steps of every slot: sample, then feed the sampled token."""
    weights = decode_lib.decode_weights(params, cfg.num_layers, fuse_shards, matmul_block)

    def body(s: SlotState, _) -> tuple[SlotState, None]:
        sampled = sample_slots(s, arrays, statics)
        return forward_slots(cfg, constrain, params, weights, sampled, s.done), None

    state, _ = jax.lax.scan(body, state, length=chunk)
    return state


def take_view(state: SlotState, ids: Int[Array, " r"], width: int) -> SlotState:
    """Slots ``ids`` of the state (a view of r slots), their caches cut to the prompt and the
    first ``width`` generated slots: a chunk whose running requests are at most
    ``width - chunk`` steps in reads no more of the cache than they fill."""
    prompt_len = state.prefix_mask.shape[1]
    cut = prompt_len + width

    def rows(x: jax.Array) -> jax.Array:
        return jnp.take(x, ids, axis=0)

    cache = state.cache.replace(
        k=tuple(rows(k[..., :cut]) for k in state.cache.k),
        v=tuple(rows(v[:, :, :cut]) for v in state.cache.v),
    )
    return jax.tree.map(rows, state.replace(cache=None)).replace(cache=cache)


def put_view(state: SlotState, view: SlotState, ids: Int[Array, " r"]) -> SlotState:
    """Writes a :func:`take_view` view back into slots ``ids`` (distinct) of the state."""
    cut = view.cache.k[0].shape[-1] if view.cache.k else 0

    def rows(full: jax.Array, part: jax.Array) -> jax.Array:
        return full.at[ids].set(part)

    cache = state.cache.replace(
        k=tuple(
            f.at[ids, :, :, :cut].set(k) for f, k in zip(state.cache.k, view.cache.k, strict=True)
        ),
        v=tuple(
            f.at[ids, :, :cut].set(v) for f, v in zip(state.cache.v, view.cache.v, strict=True)
        ),
    )
    rest = jax.tree.map(rows, state.replace(cache=None), view.replace(cache=None))
    return rest.replace(cache=cache)


@flax.struct.dataclass
class Finished:
    """Samples the engine handed out (host numpy; rows of whole requests).

    Attributes:
      rows: [F] each sample's row in the static numbering (prompt-major, ``prompt * n + i``).
      tokens: [F, T] sampled tokens, pad after the response.
      response_mask: [F, T] the response tokens (the stop token included).
      logprobs, model_logprobs: [F, T] float32, 0 outside the response.
      lengths: [F] response lengths; stopped: [F] ended on a stop token or string.
    """

    rows: np.ndarray
    tokens: np.ndarray
    response_mask: np.ndarray
    logprobs: np.ndarray
    model_logprobs: np.ndarray
    lengths: np.ndarray
    stopped: np.ndarray


@dataclasses.dataclass(frozen=True)
class EngineOutput:
    """What :meth:`Engine.generate` returns.

    Attributes:
      finished: the kept samples, ordered by row.
      kept_groups: [M] the prompts whose groups were kept, in order.
      aborted_groups: prompts started (or queued) and cancelled (over-sampling, budget).
      generated_tokens: tokens decoded in all, aborted samples' included.
      chunks: decode chunks run.
    """

    finished: Finished
    kept_groups: np.ndarray
    aborted_groups: int
    generated_tokens: int
    chunks: int


class Engine:
    """Runs continuous batching for one sampler (its model, mesh, rules and weight layout).

    Args:
      sampler: the static sampler whose parameters layout and sharding the engine shares.
      slots: decode slots; a multiple of the sampler mesh's data shards and of ``n``.
      chunk: decode steps per jitted chunk (the admission and hand-out granularity).
      views: decode each chunk on a view of the running slots only, with the cache cut to
        the generated slots they can reach in the chunk (:meth:`view_buckets` sizes, one
        program each); False decodes every slot over the whole cache every chunk.
    """

    def __init__(
        self, sampler: Sampler, *, slots: int, chunk: int = 16, views: bool = True
    ) -> None:
        if slots < 1 or chunk < 1:
            raise ValueError(f"Engine: slots={slots} and chunk={chunk} must be >= 1")
        self.sampler, self.slots, self.chunk, self.views = sampler, slots, chunk, views
        self.cfg: ModelConfig = sampler.cfg
        self._jitted: dict[tuple, Any] = {}

    # -- programs ---------------------------------------------------------------------------

    def _sharding(self, names: tuple, shape: tuple[int, ...]) -> Any:
        mesh = self.sampler.mesh
        if mesh is None:
            return None
        if not names:
            return NamedSharding(mesh, P())
        from jaxrlhf.sharding import activation_sharding

        return activation_sharding(mesh, self.sampler.rules, names, shape=shape)

    def state_shardings(self, prompt_len: int, max_new_tokens: int) -> Any:
        """The SlotState's shardings: slots split over the data shards (None: no mesh)."""
        if self.sampler.mesh is None:
            return None
        abstract = jax.eval_shape(
            functools.partial(empty_state, self.cfg, self.slots, prompt_len, max_new_tokens)
        )
        logical = SlotState.logical_axes(self.cfg.num_layers)
        # Each leaf of ``abstract`` meets its tuple of names in ``logical`` (a subtree there).
        return jax.tree.map(lambda sds, names: self._sharding(names, sds.shape), abstract, logical)

    def kv_bytes(self, prompt_len: int, max_new_tokens: int) -> int:
        """Bytes of the slots' KV cache, all devices together."""
        state = jax.eval_shape(
            functools.partial(empty_state, self.cfg, self.slots, prompt_len, max_new_tokens)
        )
        return cache_nbytes(state.cache)

    def _program(self, name: str, key: tuple, build: Callable[[], Any]) -> Any:
        full = (name, *key)
        if full not in self._jitted:
            self._jitted[full] = build()
        return self._jitted[full]

    def empty_program(self, prompt_len: int, max_new_tokens: int) -> Any:
        sh = self.state_shardings(prompt_len, max_new_tokens)
        fn = functools.partial(empty_state, self.cfg, self.slots, prompt_len, max_new_tokens)
        return self._program(
            "empty", (prompt_len, max_new_tokens), lambda: jax.jit(fn, out_shardings=sh)
        )

    def admit_program(self, n: int, batch: int, prompt_len: int, max_new_tokens: int) -> Any:
        """Jitted :func:`admit` for ``batch`` prompts of ``n`` samples; the state donated."""

        def build():
            fn = functools.partial(admit, self.cfg, self.sampler.constrain, n)
            sh = self.state_shardings(prompt_len, max_new_tokens)
            if sh is None:
                return jax.jit(fn, donate_argnums=1)
            return jax.jit(
                fn,
                in_shardings=(self.sampler.param_shardings, sh, None, None, None, None, None),
                out_shardings=sh,
                donate_argnums=1,
            )

        return self._program("admit", (n, batch, prompt_len, max_new_tokens), build)

    def finish_program(self, prompt_len: int, max_new_tokens: int) -> Any:
        """Jitted :func:`finish_slots` (a stop string ended them on the host)."""

        def build():
            sh = self.state_shardings(prompt_len, max_new_tokens)
            if sh is None:
                return jax.jit(finish_slots, donate_argnums=0)
            return jax.jit(
                finish_slots, in_shardings=(sh, None, None), out_shardings=sh, donate_argnums=0
            )

        return self._program("finish", (prompt_len, max_new_tokens), build)

    def chunk_program(self, statics: SamplingStatics, prompt_len: int) -> Any:
        """Jitted :func:`decode_chunk`; the state donated (updated in place)."""

        def build():
            shards = decode_lib.fused_shards(self.cfg, self.sampler.param_shardings)
            fn = functools.partial(
                decode_chunk,
                self.cfg,
                self.sampler.constrain,
                statics,
                self.chunk,
                shards,
                self.sampler.matmul_block,
            )
            sh = self.state_shardings(prompt_len, statics.max_new_tokens)
            if sh is None:
                return jax.jit(fn, donate_argnums=1)
            return jax.jit(
                fn,
                in_shardings=(self.sampler.param_shardings, sh, None),
                out_shardings=sh,
                donate_argnums=1,
            )

        return self._program("chunk", (statics, prompt_len), build)

    @functools.cached_property
    def slot_shards(self) -> int:
        """How many data shards split the slots (1 without a mesh)."""
        sharding = self._sharding((axes.BATCH,), (self.slots,))
        if sharding is None:
            return 1
        return self.slots // sharding.shard_shape((self.slots,))[0]

    def view_chunk_program(
        self, statics: SamplingStatics, prompt_len: int, local_rows: int, width: int
    ) -> Any:
        """Jitted chunk over a view: ``local_rows`` slots of each data shard (given by their
        shard-local indices, [shards * local_rows], shard-major) and ``width`` generated
        cache slots; the view is cut out, decoded and written back in one program."""

        def build():
            shards = decode_lib.fused_shards(self.cfg, self.sampler.param_shardings)
            chunk = functools.partial(
                decode_chunk,
                self.cfg,
                self.sampler.constrain,
                statics,
                self.chunk,
                shards,
                self.sampler.matmul_block,
            )
            take = functools.partial(take_view, width=width)
            sh = self.state_shardings(prompt_len, statics.max_new_tokens)
            if sh is not None:  # cut and write back shard-locally: no slot crosses devices
                mesh = self.sampler.mesh
                specs = jax.tree.map(lambda s: s.spec, sh)
                ids_spec = specs.done
                take = jax.shard_map(take, mesh=mesh, in_specs=(specs, ids_spec), out_specs=specs)
                put = jax.shard_map(
                    put_view, mesh=mesh, in_specs=(specs, specs, ids_spec), out_specs=specs
                )
            else:
                put = put_view

            def run(params, state, arrays, ids):
                view = chunk(params, take(state, ids), arrays)
                return put(state, view, ids)

            if sh is None:
                return jax.jit(run, donate_argnums=1)
            ids_sharding = sh.done
            return jax.jit(
                run,
                in_shardings=(self.sampler.param_shardings, sh, None, ids_sharding),
                out_shardings=sh,
                donate_argnums=1,
            )

        return self._program("view", (statics, prompt_len, local_rows, width), build)

    def view_buckets(self, max_new_tokens: int) -> tuple[list[int], list[int]]:
        """The view sizes chunks are compiled for: slots per shard (all, then halving) and
        generated cache slots (doubling from ``4 * chunk``, then all ``max_new_tokens``)."""
        local = self.slots // self.slot_shards
        rows = [local]
        while rows[-1] % 2 == 0 and rows[-1] // 2 >= max(1, local // 8):
            rows.append(rows[-1] // 2)
        widths = [max_new_tokens]
        while widths[-1] // 2 >= 4 * self.chunk:
            widths.append(widths[-1] // 2)
        return sorted(rows), sorted(widths)

    # -- the host loop ---------------------------------------------------------------------

    def generate(
        self,
        params: Any,
        prompt_tokens: np.ndarray,
        prompt_mask: np.ndarray,
        key: jax.Array,
        sampling: SamplingParams,
        *,
        max_new_tokens: Sequence[int] | None = None,
        keep_groups: int | None = None,
        token_budget: int | None = None,
        stop_strings: Sequence[str] = (),
        decode: Callable[[np.ndarray], str] | None = None,
        on_finished: Callable[[Finished], None] | None = None,
    ) -> EngineOutput:
        """Samples ``sampling.n`` continuations of prompts, admitting them in order.

        Args:
          params: LM params in the sampler's layout.
          prompt_tokens, prompt_mask: [B, P] host arrays (every row one real token).
          key: the PRNG key; with the same key the static sampler samples the same rows.
          sampling: the sampling parameters (``max_new_tokens`` is T, the slots' width).
          max_new_tokens: budgets <= T, per prompt [B] or per sample row [B * n] (None: T
            for every row).
          keep_groups: over-sampling: stop once this many prompts' groups have finished,
            cancelling the rest (None: all B).
          token_budget: stop admitting prompts once this many tokens have been decoded
            (finished and running samples' included); running groups still finish.
          stop_strings: end a sample when its decoded response contains one (needs
            ``decode``: token ids -> text).
          on_finished: called with each batch of newly finished whole groups, between
            chunks (the RL loop scores them there while the tail decodes).

        Returns:
          The kept groups' samples (ordered by row) and the run's counts.
        """
        run = _Run(self, params, prompt_tokens, prompt_mask, key, sampling)
        run.configure(max_new_tokens, keep_groups, token_budget, stop_strings, decode, on_finished)
        return run.run()


class _Run:
    """One :meth:`Engine.generate` call's host bookkeeping (no Python per token)."""

    def __init__(
        self,
        engine: Engine,
        params: Any,
        prompt_tokens: np.ndarray,
        prompt_mask: np.ndarray,
        key: jax.Array,
        sampling: SamplingParams,
    ) -> None:
        self.engine, self.params, self.sampling = engine, params, sampling
        self.tokens = np.asarray(prompt_tokens, np.int32)
        self.mask = np.asarray(prompt_mask, bool)
        batch, self.prompt_len = self.tokens.shape
        self.batch = batch
        self.n, self.width = sampling.n, sampling.max_new_tokens
        if engine.slots % self.n:
            raise ValueError(f"Engine: {engine.slots} slots do not hold whole groups of {self.n}")
        if self.tokens.shape != self.mask.shape or not self.mask.any(-1).all():
            raise ValueError(
                "Engine: prompt_tokens and prompt_mask must be [B, P], a real token each"
            )
        sampling.check_vocab(engine.cfg.vocab_size)
        self.uniforms = draw_uniforms(key, batch * self.n, self.width)
        self.statics = sampling.static()
        self.arrays = sampling.arrays()
        self.admit_batch = engine.slots // self.n  # groups per admission (a static shape)
        self.queue = list(range(batch))
        self.slot_group = np.full(engine.slots, -1)  # the prompt each slot serves
        self.slot_row = np.full(engine.slots, -1)  # and its sample's row
        self.collected: dict[int, list[Finished]] = {}  # finished samples of running groups
        self.collected_tokens = 0
        self.finished: list[Finished] = []
        self.kept: list[int] = []
        self.generated = 0
        self.chunks = 0
        # What the host knows of each slot between chunks (read back at each hand-out).
        self.slot_done = np.ones(engine.slots, bool)
        self.slot_step = np.zeros(engine.slots, np.int64)
        self.row_buckets, self.width_buckets = engine.view_buckets(self.width)

    def configure(
        self,
        max_new_tokens: Sequence[int] | None,
        keep_groups: int | None,
        token_budget: int | None,
        stop_strings: Sequence[str],
        decode: Callable[[np.ndarray], str] | None,
        on_finished: Callable[[Finished], None] | None,
    ) -> None:
        batch = self.batch
        rows = batch * self.n
        given = max_new_tokens is not None
        budgets = np.asarray(max_new_tokens) if given else np.full(rows, self.width)
        if budgets.shape == (batch,):
            budgets = np.repeat(budgets, self.n)
        if budgets.shape != (rows,) or (budgets < 1).any() or (budgets > self.width).any():
            raise ValueError(
                f"Engine: max_new_tokens must be {batch} or {rows} values in [1, {self.width}]"
            )
        self.budgets = budgets.astype(np.int32)  # per sample row
        self.keep = batch if keep_groups is None else keep_groups
        if not 1 <= self.keep <= batch:
            raise ValueError(f"Engine: keep_groups={keep_groups} is not in [1, {batch}]")
        self.token_budget = token_budget
        if stop_strings and decode is None:
            raise ValueError("Engine: stop_strings need a decode function")
        self.stop_strings, self.decode, self.on_finished = tuple(stop_strings), decode, on_finished

    def run(self) -> EngineOutput:
        eng = self.engine
        state = eng.empty_program(self.prompt_len, self.width)()
        chunk_fn = eng.chunk_program(self.statics, self.prompt_len)
        while len(self.kept) < self.keep:
            state = self._admit(state)
            if not (self.slot_group >= 0).any():  # nothing running, nothing admissible
                break
            view = self._view() if self.engine.views else None
            if view is None:
                state = chunk_fn(self.params, state, self.arrays)
            else:
                rows, width, ids = view
                fn = self.engine.view_chunk_program(self.statics, self.prompt_len, rows, width)
                state = fn(self.params, state, self.arrays, ids)
            self.chunks += 1
            state = self._harvest(state)
        started = {int(g) for g in self.slot_group if g >= 0} | set(self.collected)
        aborted = len(self.queue) + len(started)
        aborted += max(0, len(self.kept) - self.keep)
        keep = sorted(self.kept[: self.keep])
        finished = _concat(self.finished, self.width)
        order = np.argsort(finished.rows, kind="stable")
        finished = jax.tree.map(lambda x: x[order], finished)
        chosen = np.isin(finished.rows // self.n, keep)
        finished = jax.tree.map(lambda x: x[chosen], finished)
        return EngineOutput(finished, np.asarray(keep), aborted, self.generated, self.chunks)

    def _view(self) -> tuple[int, int, np.ndarray] | None:
        """The smallest compiled view holding every running slot for the next chunk:
        ``(slots per shard, generated width, [shards * slots per shard] shard-local slot
        indices)``, or None for the whole state."""
        shards = self.engine.slot_shards
        local = self.engine.slots // shards
        active = (~self.slot_done).reshape(shards, local)
        need_rows = int(active.sum(1).max())
        rows = min(b for b in self.row_buckets if b >= need_rows)
        reach = int(self.slot_step[~self.slot_done].max(initial=0)) + self.engine.chunk
        width = min((b for b in self.width_buckets if b >= reach), default=self.width)
        if rows == local and width == self.width:
            return None
        ids = [np.concatenate([np.flatnonzero(a), np.flatnonzero(~a)])[:rows] for a in active]
        return rows, width, np.concatenate(ids).astype(np.int32)

    def _admit(self, state: SlotState) -> SlotState:
        """Starts queued prompts in free slots (in order, whole groups), unless the token
        budget is spent."""
        free = np.flatnonzero(self.slot_group < 0)
        groups = min(len(free) // self.n, len(self.queue))
        if self.token_budget is not None and self.generated >= self.token_budget:
            groups = 0
        if groups == 0:
            return state
        prompts = [self.queue.pop(0) for _ in range(groups)]
        a = self.admit_batch
        index = np.array(prompts + [prompts[0]] * (a - groups))  # padding rows: dropped
        dest = np.full(a * self.n, self.engine.slots, np.int32)
        dest[: groups * self.n] = free[: groups * self.n]
        rows = (index[:, None] * self.n + np.arange(self.n)).reshape(-1)
        for g, p in enumerate(prompts):
            self.slot_group[free[g * self.n : (g + 1) * self.n]] = p
            self.slot_row[free[g * self.n : (g + 1) * self.n]] = p * self.n + np.arange(self.n)
        self.slot_done[free[: groups * self.n]] = False
        self.slot_step[free[: groups * self.n]] = 0
        fn = self.engine.admit_program(self.n, a, self.prompt_len, self.width)
        return fn(
            self.params,
            state,
            self.tokens[index],
            self.mask[index],
            dest,
            self.uniforms[rows],
            self.budgets[rows],
        )

    def _harvest(self, state: SlotState) -> SlotState:
        """Reads every finished sample out of its slot and frees the slot at once (its
        group's other samples may still run); hands out every group whose samples are all
        read."""
        done, step = jax.device_get((state.done, state.step))
        running = self.slot_group >= 0
        if self.stop_strings:
            done, state = self._stop_strings(state, done, running)
        self.slot_done, self.slot_step = np.array(done), np.array(step)
        self.generated = int(step[running].sum()) + self.collected_tokens
        slots = np.flatnonzero(running & self.slot_done)
        if len(slots) == 0:
            return state
        host = jax.device_get(
            (
                state.tokens[slots],
                state.logprobs[slots],
                state.model_logprobs[slots],
                state.lengths[slots],
                state.stopped[slots],
            )
        )
        tokens, logprobs, model_lp, lengths, stopped = (np.asarray(x) for x in host)
        mask = np.arange(self.width)[None, :] < lengths[:, None]
        pad = self.sampling.pad_token_id
        samples = Finished(
            rows=self.slot_row[slots].copy(),
            tokens=np.where(mask, tokens, pad),
            response_mask=mask,
            logprobs=np.where(mask, logprobs, 0.0).astype(np.float32),
            model_logprobs=np.where(mask, model_lp, 0.0).astype(np.float32),
            lengths=lengths.astype(np.int32),
            stopped=stopped,
        )
        self.collected_tokens += int(samples.lengths.sum())
        groups = self.slot_group[slots].copy()
        self.slot_group[slots] = -1
        self.slot_row[slots] = -1
        for i, group in enumerate(groups):
            self.collected.setdefault(int(group), []).append(
                jax.tree.map(lambda x, i=i: x[i : i + 1], samples)
            )
        ready = sorted(g for g in set(groups.tolist()) if len(self.collected[g]) == self.n)
        if not ready:
            return state
        finished = _concat([part for g in ready for part in self.collected.pop(g)], self.width)
        order = np.argsort(finished.rows, kind="stable")  # groups in order, samples in order
        finished = jax.tree.map(lambda x: x[order], finished)
        self.finished.append(finished)
        self.kept.extend(ready)
        if self.on_finished is not None:
            self.on_finished(finished)
        return state

    def _stop_strings(
        self, state: SlotState, done: np.ndarray, running: np.ndarray
    ) -> tuple[np.ndarray, SlotState]:
        """Ends every running sample whose decoded response contains a stop string, cut
        right after the first token that completes one (tokens decoded past it are dropped);
        returns the updated done flags and state."""
        slots = np.flatnonzero(running)
        tokens, lengths = jax.device_get((state.tokens[slots], state.lengths[slots]))
        cut_slots, cut_lengths = [], []
        for slot, row, length in zip(slots, np.asarray(tokens), np.asarray(lengths), strict=True):
            if not any(s in self.decode(row[:length]) for s in self.stop_strings):
                continue
            end = next(
                k
                for k in range(1, length + 1)
                if any(s in self.decode(row[:k]) for s in self.stop_strings)
            )
            cut_slots.append(slot)
            cut_lengths.append(end)
        if not cut_slots:
            return done, state
        fn = self.engine.finish_program(self.prompt_len, self.width)
        state = fn(state, np.asarray(cut_slots, np.int32), np.asarray(cut_lengths, np.int32))
        done = done.copy()
        done[cut_slots] = True
        return done, state


def _concat(parts: list[Finished], width: int) -> Finished:
    if not parts:
        empty = np.zeros((0, width))
        return Finished(
            np.zeros(0, int),
            empty.astype(np.int32),
            empty.astype(bool),
            empty.astype(np.float32),
            empty.astype(np.float32),
            np.zeros(0, np.int32),
            np.zeros(0, bool),
        )
    return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)
