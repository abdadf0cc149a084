"""KV-cached sampler: one prefill pass over the prompts, then a jitted decode loop.

Typical use::

    sampler = Sampler(cfg, mesh)                       # generation rules by default
    gen_params, stats = sampler.to_generate_layout(train_params)
    out = sampler.generate(gen_params, prompt_tokens, prompt_mask, key,
                           SamplingParams(temperature=1.0, max_new_tokens=128, n=4))
    out.tokens, out.response_mask, out.logprobs, out.model_logprobs

Two jitted functions per static configuration (``SamplingParams.static()``): ``prefill``
(prompt forward, cache allocation) and ``decode`` (the whole token loop inside one
program: no Python per token). Prefill and decode are separate jits so that the cache
returned by prefill can be *donated* to decode: decode updates it in place, and without
donation XLA would first copy the whole KV cache (and hold two of them, which is what runs
out of memory on large batches).

Scan or while_loop (``loop=``):

* ``"scan"``: ``lax.scan`` over exactly ``max_new_tokens`` steps. A fixed trip count, so
  the cost of a call is known in advance and the same on every call; rows that have
  stopped keep being computed (their outputs are masked). This is the default: RL batches
  are fixed-shape anyway, and on a sharded mesh it needs no per-step cross-device
  agreement on whether to continue.
* ``"while"``: ``lax.while_loop`` bounded by ``max_new_tokens`` that exits as soon as every
  row has produced a stop token. Saves the remaining steps when all rows stop early
  (evaluation, short answers), at the price of one all-reduce of the ``done`` flags per
  step on a multi-device mesh, and a call time that depends on the data. Outputs have the
  same fixed shapes ``[R, max_new_tokens]``; columns never reached hold padding.

Rows: R = B * n sample rows, prompt-major (prompt b's samples are rows b*n .. b*n+n-1).
Each prompt is prefilled once; its n samples share its prompt cache (see cache.py).

Randomness: one uniform number per row and step, all drawn from the key before the loop
(``sampling.draw_uniforms``): the same key gives the same tokens, and row r's number at step
t depends only on (key, r, t), so sampling n per prompt equals sampling the prompts repeated
n times, and a prompt alone equals the same prompt in row 0 of a batch.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Int

from jaxrlhf import platform
from jaxrlhf.generation import decode as decode_lib
from jaxrlhf.generation.cache import (
    DecodeCache,
    abstract_cache,
    cache_nbytes,
    generated_view,
    with_generated_slots,
    write_generated,
)
from jaxrlhf.generation.params import SamplingParams, SamplingStatics
from jaxrlhf.generation.sampling import draw_uniforms, next_tokens
from jaxrlhf.kernels import block_matmul
from jaxrlhf.models import axes
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.precision import compute_dtype_params, needs_cast
from jaxrlhf.models.transformer import Constrain, no_constraint
from jaxrlhf.sharding import GENERATE, ReshardStats, Rules, activation_sharding, reshard
from jaxrlhf.sharding.model_sharding import (
    activation_constraint,
    bytes_per_device,
    param_shardings,
)

logger = logging.getLogger(__name__)

LOOPS = ("scan", "while")


@flax.struct.dataclass
class SamplerState:
    """Everything the decode loop carries (R = B * n sample rows, T = max_new_tokens).

    Attributes:
      step: [] int32, tokens sampled so far (the next output column).
      logits: [R, V] float32 logits of the next token.
      cache: the KV cache (prompt prefix [B, ...], generated tokens [R, ...]).
      positions: [R] int32 position id of the next token fed to the model.
      prefix_mask: [B, P] bool, real prompt tokens.
      prefix_positions: [B, P] int32 prompt position ids.
      tokens: [R, T] int32 sampled tokens, ``pad_id`` after a row ended.
      logprobs: [R, T] float32 under the sampling distribution (0 after the end).
      model_logprobs: [R, T] float32 under the model distribution, or None.
      lengths: [R] int32 response length (tokens up to and including a stop token).
      done: [R] bool, the row has ended (stop token or budget).
      stopped: [R] bool, the row ended on a stop token.
      uniforms: [R, T] float32 in (0, 1], the random number of each row and step.
    """

    step: jax.Array
    logits: jax.Array
    cache: DecodeCache
    positions: jax.Array
    prefix_mask: jax.Array
    prefix_positions: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    model_logprobs: jax.Array | None
    lengths: jax.Array
    done: jax.Array
    stopped: jax.Array
    uniforms: jax.Array

    @staticmethod
    def logical_axes(num_layers: int, model_logprobs: bool, shared_prefix: bool) -> SamplerState:
        """A SamplerState whose leaves are each field's logical axis names."""
        rows_t = (axes.BATCH, axes.LENGTH)
        return SamplerState(
            step=(),
            logits=(axes.BATCH, None),  # vocab kept whole: sampling sorts/scans over it
            cache=DecodeCache.logical_axes(num_layers, shared_prefix),
            positions=(axes.BATCH,),
            prefix_mask=rows_t,
            prefix_positions=rows_t,
            tokens=rows_t,
            logprobs=rows_t,
            model_logprobs=rows_t if model_logprobs else None,
            lengths=(axes.BATCH,),
            done=(axes.BATCH,),
            stopped=(axes.BATCH,),
            uniforms=rows_t,
        )


@flax.struct.dataclass
class SampleOutput:
    """Sampled continuations (R = B * n rows, prompt-major; T = max_new_tokens).

    Attributes:
      tokens: [R, T] int32; ``pad_token_id`` where ``response_mask`` is False.
      response_mask: [R, T] bool, True for the response tokens (the stop token included).
      lengths: [R] int32, ``response_mask.sum(-1)``.
      stopped: [R] bool, the response ended with a stop token (else it hit the budget).
      logprobs: [R, T] float32 log-prob of each token under the distribution it was sampled
        from (temperature, top-k, top-p applied); 0 for greedy and outside the mask.
      model_logprobs: [R, T] float32 under the model's own distribution (temperature 1, no
        truncation), 0 outside the mask; None unless requested.
      prompt_tokens: [R, P] the prompts, each repeated n times.
      prompt_mask: [R, P] their masks.
    """

    tokens: jax.Array
    response_mask: jax.Array
    lengths: jax.Array
    stopped: jax.Array
    logprobs: jax.Array
    model_logprobs: jax.Array | None
    prompt_tokens: jax.Array
    prompt_mask: jax.Array

    @staticmethod
    def logical_axes(model_logprobs: bool) -> SampleOutput:
        rows_t = (axes.BATCH, axes.LENGTH)
        return SampleOutput(
            tokens=rows_t,
            response_mask=rows_t,
            lengths=(axes.BATCH,),
            stopped=(axes.BATCH,),
            logprobs=rows_t,
            model_logprobs=rows_t if model_logprobs else None,
            prompt_tokens=rows_t,
            prompt_mask=rows_t,
        )


# ---- pure functions (jitted by Sampler) ------------------------------------------------


def init_state(
    cfg: ModelConfig,
    constrain: Constrain,
    statics: SamplingStatics,
    params: Any,
    prompt_tokens: Int[Array, "B P"],
    prompt_mask: Bool[Array, "B P"],
    key: jax.Array,
) -> SamplerState:
    """Prefills the prompts and allocates the decode state for ``statics.n`` samples each."""
    n, t = statics.n, statics.max_new_tokens
    logits, cache, positions = decode_lib.prefill(
        cfg, constrain, params, prompt_tokens, prompt_mask
    )
    rows = prompt_tokens.shape[0] * n
    zeros_rt = jnp.zeros((rows, t), jnp.float32)
    return SamplerState(
        step=jnp.zeros((), jnp.int32),
        logits=jnp.repeat(logits, n, axis=0),
        cache=with_generated_slots(cache, n, t),
        positions=jnp.repeat(prompt_mask.sum(-1, dtype=jnp.int32), n),
        prefix_mask=prompt_mask,
        prefix_positions=positions,
        tokens=jnp.zeros((rows, t), jnp.int32),
        logprobs=zeros_rt,
        model_logprobs=zeros_rt if statics.return_model_logprobs else None,
        lengths=jnp.zeros((rows,), jnp.int32),
        done=jnp.zeros((rows,), bool),
        stopped=jnp.zeros((rows,), bool),
        uniforms=draw_uniforms(key, rows, t),
    )


def _write_column(buffer: jax.Array, column: jax.Array, step: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice(buffer, column[:, None].astype(buffer.dtype), (0, step))


def sample_step(
    state: SamplerState, arrays: dict[str, jax.Array], statics: SamplingStatics
) -> SamplerState:
    """Samples token ``state.step`` of every row from ``state.logits`` and records it."""
    step = state.step
    uniform = jax.lax.dynamic_index_in_dim(state.uniforms, step, axis=1, keepdims=False)
    tokens, logprobs, model_lp = next_tokens(state.logits, uniform, arrays, statics)
    active = ~state.done
    tokens = jnp.where(active, tokens, arrays["pad_id"])
    is_stop = active & (tokens[:, None] == arrays["stop_ids"][None, :]).any(-1)
    stopped = state.stopped | is_stop
    new = state.replace(
        step=step + 1,
        tokens=_write_column(state.tokens, tokens, step),
        logprobs=_write_column(state.logprobs, jnp.where(active, logprobs, 0.0), step),
        lengths=state.lengths + active,
        stopped=stopped,
        done=stopped | (step + 1 >= statics.max_new_tokens),
    )
    if model_lp is not None:
        new = new.replace(
            model_logprobs=_write_column(
                state.model_logprobs, jnp.where(active, model_lp, 0.0), step
            )
        )
    return new


def forward_step(
    cfg: ModelConfig,
    constrain: Constrain,
    params: Any,
    weights: Any,
    ropes: decode_lib.RopeTables,
    state: SamplerState,
) -> SamplerState:
    """Feeds the token sampled last (column ``step - 1``) and stores the next logits
    (``weights`` and ``ropes``: ``decode.decode_weights`` and ``decode.rope_tables``)."""
    slot = state.step - 1
    tokens = jax.lax.dynamic_index_in_dim(state.tokens, slot, axis=1, keepdims=False)
    logits, cache = decode_lib.decode_step(
        cfg,
        constrain,
        params,
        weights,
        ropes,
        tokens,
        state.positions,
        state.cache,
        slot,
        state.prefix_mask,
        state.prefix_positions,
    )
    return state.replace(logits=logits, cache=cache, positions=state.positions + 1)


def phase_sizes(max_new_tokens: int, max_phases: int, min_phase_tokens: int) -> tuple[int, ...]:
    """Generated-slot counts of the decode phases (the last is ``max_new_tokens``).

    The T - 1 forwards are split into up to ``max_phases`` equal phases of about
    ``min_phase_tokens`` tokens or more (T // min_phase_tokens phases); phase c attends over
    (and reads) only the cache slots the forwards up to its end can have written. For
    example T = 128: slot counts (32, 64, 96, 128).
    """
    forwards = max_new_tokens - 1
    phases = max(1, min(max_phases, max_new_tokens // max(min_phase_tokens, 1)))
    sizes = [-(-forwards * (c + 1) // phases) for c in range(phases - 1)]
    return (*sizes, max_new_tokens)


def decode_loop(
    cfg: ModelConfig,
    constrain: Constrain,
    statics: SamplingStatics,
    loop: str,
    phases: tuple[int, ...],
    fuse_shards: dict[str, int | None],
    matmul_block: int,
    params: Any,
    state: SamplerState,
    arrays: dict[str, jax.Array],
) -> SamplerState:
    """Samples all ``max_new_tokens`` tokens (``loop`` in ``LOOPS``, see module docstring).

    ``phases`` (from :func:`phase_sizes`) are the cache sizes of consecutive loops: a
    forward at generated slot j attends over every cache slot, masked or not, so early
    tokens read a copy of the cache cut to the first ``phases[c]`` generated slots, which
    is written back when the phase ends. On CPU this cuts the attention's memory traffic
    by about a quarter with four phases; the price is one loop body per phase to compile.
    ``fuse_shards`` and ``matmul_block`` are ``decode.decode_weights``' ``shards``
    (``decode.fused_shards``) and ``block``.
    """
    if loop not in LOOPS:
        raise ValueError(f"loop={loop!r} is not one of {list(LOOPS)}")
    weights = decode_lib.decode_weights(params, cfg.num_layers, fuse_shards, matmul_block)
    prompt_len = state.prefix_mask.shape[1]
    ropes = decode_lib.rope_tables(cfg, prompt_len + statics.max_new_tokens)

    def body(s: SamplerState) -> SamplerState:
        sampled = sample_step(s, arrays, statics)
        return forward_step(cfg, constrain, params, weights, ropes, sampled)

    # T tokens need T - 1 forwards: the last sampled token is never fed back. On entry to
    # `body`, state.step is the generated slot its forward writes.
    forwards, start = statics.max_new_tokens - 1, 0
    for size in phases:
        end = min(size, forwards)
        if end <= start:
            continue
        full = state.cache
        if size < full.k[0].shape[-1] - (0 if full.shared_prefix else prompt_len):
            state = state.replace(cache=generated_view(full, prompt_len, size))
        if loop == "scan":
            state, _ = jax.lax.scan(lambda s, _: (body(s), None), state, length=end - start)
        else:
            state = jax.lax.while_loop(
                lambda s, stop=end: (s.step < stop) & ~s.done.all(), body, state
            )
        if state.cache.k[0].shape != full.k[0].shape:
            state = state.replace(cache=write_generated(full, state.cache))
        start = end
    return sample_step(state, arrays, statics)


def finalize(state: SamplerState, arrays: dict[str, jax.Array]) -> SampleOutput:
    """The SampleOutput of a finished state (prompt fields left empty; filled by Sampler)."""
    t = state.tokens.shape[1]
    mask = jnp.arange(t)[None, :] < state.lengths[:, None]
    zero = jnp.zeros((), jnp.float32)
    return SampleOutput(
        tokens=jnp.where(mask, state.tokens, arrays["pad_id"]),
        response_mask=mask,
        lengths=state.lengths,
        stopped=state.stopped,
        logprobs=jnp.where(mask, state.logprobs, zero),
        model_logprobs=None
        if state.model_logprobs is None
        else jnp.where(mask, state.model_logprobs, zero),
        prompt_tokens=None,
        prompt_mask=None,
    )


def default_matmul_block(
    devices: Any, rows: int | None = None, compute_dtype: Any = jnp.float32
) -> int:
    """``Sampler``'s default ``matmul_block`` for ``devices`` (a mesh or a list of devices),
    or, given ``rows``, for a decode of that many rows per device (an engine view, a static
    decode): ``decode.CPU_MATMUL_BLOCK`` where :func:`jaxrlhf.platform.decode_weight_blocks`
    says weight blocks pay off there, else 0 (the kernels' own layout). The block-matmul
    kernel counts only for a float32 ``compute_dtype`` (the one it multiplies)."""

    def kernel() -> bool:
        return jnp.dtype(compute_dtype) == jnp.float32 and block_matmul.available()

    blocks = platform.decode_weight_blocks(devices, rows, kernel)
    return decode_lib.CPU_MATMUL_BLOCK if blocks else 0


# ---- the sampler object (outside jit) ---------------------------------------------------


class Sampler:
    """Compiles and runs prefill/decode for one model on one mesh under one rule set.

    Args:
      cfg: the model config (an LM head is assumed).
      mesh: the device mesh, or None for the default device (no sharding annotations).
      rules: logical-axis rules; ``jaxrlhf.sharding.GENERATE`` by default.
      decode_phases: at most this many decode loops with growing cache views (see
        ``decode_loop``); 1 disables them.
      min_phase_tokens: each phase covers at least this many tokens (so short generations
        compile a single loop).
      matmul_block: columns per weight block of the decode matmuls
        (``decode.decode_weights``); 0 keeps the kernels' ``[in, out]`` layout. None:
        :func:`default_matmul_block` of the sampler's devices, refined per decode by its
        rows per device (:meth:`matmul_block_for`: the rollout engine's views, and a static
        decode of a few rows).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        mesh: Mesh | None = None,
        rules: Rules = GENERATE,
        *,
        decode_phases: int = 4,
        min_phase_tokens: int = 32,
        matmul_block: int | None = None,
    ):
        self.cfg = cfg
        self.mesh = mesh
        self.rules = rules
        self.decode_phases = decode_phases
        self.min_phase_tokens = min_phase_tokens
        self._blocks_by_rows = matmul_block is None  # the platform's choice, per decode
        if matmul_block is None:
            matmul_block = default_matmul_block(self.devices, None, cfg.compute_dtype)
        if matmul_block < 0:
            raise ValueError(f"matmul_block={matmul_block} must be >= 0")
        self.matmul_block = matmul_block
        self.constrain: Constrain = (
            activation_constraint(mesh, rules) if mesh is not None else no_constraint
        )
        self.param_shardings = param_shardings(cfg, mesh, rules) if mesh is not None else None
        # One elementwise program: its outputs keep their inputs' shardings.
        self._cast = jax.jit(functools.partial(compute_dtype_params, cfg=cfg))
        self._jitted: dict[tuple, Any] = {}

    @property
    def devices(self) -> Any:
        """The sampler's devices: its mesh, or the default device in a list."""
        return [jax.devices()[0]] if self.mesh is None else self.mesh

    def rows_per_device(self, batch: int) -> int:
        """How many of ``batch`` rows (prompts, or sample rows: prompts x n) split over the
        batch axis each device holds."""
        if self.mesh is None:
            return batch
        return self._sharding((axes.BATCH,), (batch,)).shard_shape((batch,))[0]

    def matmul_block_for(self, rows: int) -> int:
        """``matmul_block`` for a decode of ``rows`` rows per device (a rollout engine view):
        the sampler's own where it was given, else :func:`default_matmul_block` for
        that many rows (CPU weight blocks for a few rows). The static decode uses it too, for
        its sample rows (prompts x ``n``) per device."""
        if not self._blocks_by_rows:
            return self.matmul_block
        return default_matmul_block(self.devices, rows, self.cfg.compute_dtype)

    # -- layouts and memory --------------------------------------------------------------

    def to_generate_layout(self, params: Any, *, donate: bool = False) -> tuple[Any, ReshardStats]:
        """``params`` (e.g. float32 masters in the training layout) in this sampler's layout
        and compute dtype, and what the reshard moved.

        The weights the model casts at every use are cast to ``cfg.dtype`` once, here, in
        their source layout, and resharded in that dtype
        (:func:`jaxrlhf.models.precision.compute_dtype_params`): a bfloat16 sampler of
        float32 masters holds, and the sync moves, half the bytes, and the decode's matmuls
        read them without a cast. Params already in the compute dtype (a frozen bfloat16
        role) are resharded as they are. ``donate=True`` frees the source buffers, so both
        layouts never coexist (the cast copy is always freed by the reshard).
        """
        if self.mesh is None:
            raise ValueError("Sampler has no mesh; params are used where they are")
        if needs_cast(params, self.cfg):
            start = time.perf_counter()
            cast = self._cast(params)
            if donate:  # the cast read them: free them once it is done
                jax.block_until_ready(cast)
                jax.tree.map(lambda x: x.delete(), params)
            moved, stats = reshard(cast, self.param_shardings, donate=True)
            seconds = time.perf_counter() - start
            return moved, ReshardStats(stats.bytes_moved, stats.bytes_total, seconds)
        return reshard(params, self.param_shardings, donate=donate)

    def _sharding(self, names: tuple, shape: tuple[int, ...]) -> NamedSharding:
        if not names:
            return NamedSharding(self.mesh, P())
        return activation_sharding(self.mesh, self.rules, names, shape=shape)

    def _shardings_like(self, abstract: Any, logical: Any) -> Any:
        return jax.tree.map(lambda sds, names: self._sharding(names, sds.shape), abstract, logical)

    def cache_bytes_per_device(
        self, batch: int, prompt_len: int, sampling: SamplingParams
    ) -> dict[Any, int]:
        """KV-cache bytes held by each device for ``batch`` prompts of ``prompt_len``."""
        abstract = abstract_cache(self.cfg, batch, prompt_len, sampling.max_new_tokens, sampling.n)
        if self.mesh is None:
            return {jax.devices()[0]: cache_nbytes(abstract)}
        logical = DecodeCache.logical_axes(self.cfg.num_layers, sampling.n > 1)
        return bytes_per_device(self._shardings_like(abstract, logical), abstract)

    # -- compiled functions --------------------------------------------------------------

    def prefill_program(self, statics: SamplingStatics, batch: int, prompt_len: int) -> Any:
        """Jitted ``init_state``; one per (n, max_new_tokens, model log-probs, shape)."""
        # Prefill does not depend on how tokens are chosen: one program for all of them.
        statics = dataclasses.replace(statics, greedy=False, use_top_k=False, use_top_p=False)
        key = ("prefill", statics, batch, prompt_len)
        if key not in self._jitted:
            fn = functools.partial(init_state, self.cfg, self.constrain, statics)
            if self.mesh is None:
                self._jitted[key] = jax.jit(fn)
            else:
                prompt_sh = self._sharding((axes.BATCH, axes.LENGTH), (batch, prompt_len))
                self._jitted[key] = jax.jit(
                    fn,
                    in_shardings=(self.param_shardings, prompt_sh, prompt_sh, self._replicated()),
                    out_shardings=self._state_shardings(statics, batch, prompt_len),
                )
        return self._jitted[key]

    def decode_program(
        self, statics: SamplingStatics, loop: str, batch: int, prompt_len: int
    ) -> Any:
        """Jitted ``decode_loop`` + ``finalize``; one per (statics, loop, shape)."""
        if loop not in LOOPS:
            raise ValueError(f"loop={loop!r} is not one of {list(LOOPS)}")
        key = ("decode", statics, loop, batch, prompt_len)
        if key in self._jitted:
            return self._jitted[key]
        cache_bytes = self.cache_bytes_per_device(
            batch, prompt_len, SamplingParams(max_new_tokens=statics.max_new_tokens, n=statics.n)
        )
        logger.info(
            "sampler: %d prompts x %d tokens, n=%d, %d new tokens: KV cache %.2f MiB per device",
            batch,
            prompt_len,
            statics.n,
            statics.max_new_tokens,
            max(cache_bytes.values()) / 2**20,
        )
        phases = phase_sizes(statics.max_new_tokens, self.decode_phases, self.min_phase_tokens)
        shards = decode_lib.fused_shards(self.cfg, self.param_shardings)
        block = self.matmul_block_for(self.rows_per_device(batch * statics.n))
        loop_fn = functools.partial(
            decode_loop,
            self.cfg,
            self.constrain,
            statics,
            loop,
            phases,
            shards,
            block,
        )

        def decode_fn(params, state, arrays):
            state = loop_fn(params, state, arrays)
            return state, finalize(state, arrays)

        # The state (above all its KV cache) is donated to decode, which then updates it in
        # place; without donation XLA first copies the whole cache, and two caches coexist
        # (the usual out-of-memory of large sampling batches).
        if self.mesh is None:
            fn = jax.jit(decode_fn, donate_argnums=1)
        else:
            rows, new = batch * statics.n, statics.max_new_tokens
            out_logical = SampleOutput.logical_axes(statics.return_model_logprobs)
            out_sh = jax.tree.map(
                lambda names: self._sharding(names, (rows, new)[: len(names)]),
                out_logical.replace(prompt_tokens=None, prompt_mask=None),
                is_leaf=lambda x: isinstance(x, tuple),
            )
            state_sh = self._state_shardings(statics, batch, prompt_len)
            fn = jax.jit(
                decode_fn,
                in_shardings=(self.param_shardings, state_sh, self._replicated()),
                out_shardings=(state_sh, out_sh),
                donate_argnums=1,
            )
        self._jitted[key] = fn
        return fn

    def _replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def _state_shardings(self, statics: SamplingStatics, batch: int, prompt_len: int) -> Any:
        """NamedShardings of the SamplerState of ``batch`` prompts, from its logical axes."""
        abstract = jax.eval_shape(
            functools.partial(init_state, self.cfg, self.constrain, statics),
            model_lib.abstract_params(self.cfg),
            jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32),
            jax.ShapeDtypeStruct((batch, prompt_len), bool),
            jax.eval_shape(lambda: jax.random.key(0)),
        )
        logical = SamplerState.logical_axes(
            self.cfg.num_layers, statics.return_model_logprobs, statics.n > 1
        )
        return self._shardings_like(abstract, logical)

    # -- entry points ---------------------------------------------------------------------

    def generate(
        self,
        params: Any,
        prompt_tokens: Int[Array, "B P"],
        prompt_mask: Bool[Array, "B P"],
        key: jax.Array,
        sampling: SamplingParams,
        *,
        loop: str = "scan",
    ) -> SampleOutput:
        """Samples ``sampling.n`` continuations of each prompt.

        Args:
          params: LM params in this sampler's layout (see ``to_generate_layout``).
          prompt_tokens: [B, P] int32 prompt ids (left padding is usual; any side works).
            Host arrays hold the whole batch: with several processes every process
            passes the same values, and each places its devices' rows from them.
          prompt_mask: [B, P] bool, True at real tokens; every row needs one.
          key: a PRNG key (``jax.random.key``); the same key gives the same output.
          sampling: the sampling parameters.
          loop: ``"scan"`` (fixed trip count) or ``"while"`` (stops when all rows are done).

        Returns:
          A SampleOutput with ``B * sampling.n`` rows. With several processes its arrays
          are global (sharded over every process's devices); fetch them with
          ``jaxrlhf.sharding.distributed.to_host``, not ``jax.device_get``.
        """
        if loop not in LOOPS:
            raise ValueError(f"loop={loop!r} is not one of {list(LOOPS)}")
        state = self.prefill(params, prompt_tokens, prompt_mask, key, sampling)
        _, out = self.decode(params, state, sampling, loop=loop)
        n = sampling.n
        return out.replace(
            prompt_tokens=jnp.repeat(jnp.asarray(prompt_tokens, jnp.int32), n, axis=0),
            prompt_mask=jnp.repeat(jnp.asarray(prompt_mask, bool), n, axis=0),
        )

    def prefill(
        self,
        params: Any,
        prompt_tokens: Int[Array, "B P"],
        prompt_mask: Bool[Array, "B P"],
        key: jax.Array,
        sampling: SamplingParams,
    ) -> SamplerState:
        """Runs the prompt forward pass and allocates the decode state; see ``generate``."""
        sampling.check_vocab(self.cfg.vocab_size)
        prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
        prompt_mask = jnp.asarray(prompt_mask, bool)
        _check_prompts(prompt_tokens, prompt_mask)
        prefill_fn = self.prefill_program(sampling.static(), *prompt_tokens.shape)
        return prefill_fn(params, prompt_tokens, prompt_mask, key)

    def decode(
        self, params: Any, state: SamplerState, sampling: SamplingParams, *, loop: str = "scan"
    ) -> tuple[SamplerState, SampleOutput]:
        """Runs the decode loop on a prefilled ``state``, which is donated (do not reuse it).

        Returns:
          ``(final_state, output)``; the output's prompt fields are None (``generate``
          fills them).
        """
        decode_fn = self.decode_program(sampling.static(), loop, *state.prefix_mask.shape)
        return decode_fn(params, state, sampling.arrays())


def _check_prompts(tokens: jax.Array, mask: jax.Array) -> None:
    if tokens.ndim != 2 or tokens.shape != mask.shape:
        raise ValueError(
            f"prompt_tokens {tokens.shape} and prompt_mask {mask.shape} must both be [B, P]"
        )
    if mask.is_fully_addressable and not bool(np.asarray(mask).any(-1).all()):
        raise ValueError("every prompt needs at least one real token (a True in prompt_mask)")
