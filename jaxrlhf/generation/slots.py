"""The rollout engine's device side: the slots' state and the jitted steps on it.

:class:`SlotState` is everything the decode chunks carry for ``S`` slots; :func:`admit`
prefills prompts into free slots, :func:`decode_chunk` runs decode steps for every slot,
:func:`take_view` / :func:`put_view` cut out and write back the running slots with the cache
cut to the width they can reach, and :func:`finish_slots` / :func:`resume_slots` apply the
host's decisions (stop strings, multi-turn observations). The scheduling around them is
``jaxrlhf.generation.engine_programs`` (the programs), ``jaxrlhf.generation.engine_run``
(the host loop) and ``jaxrlhf.generation.engine`` (the engine's ``generate``).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.generation import decode as decode_lib
from jaxrlhf.generation.cache import DecodeCache
from jaxrlhf.generation.params import SamplingStatics
from jaxrlhf.generation.sampling import next_tokens
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
      forced: [S, T] int32 tokens fed instead of sampled at those steps (an environment's
        observation; log-prob 0, never a stop), -1 where the model samples.
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
    forced: jax.Array

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
            forced=rows_t,
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
        forced=jnp.full((s, t), -1, jnp.int32),
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
    repeat = functools.partial(jnp.repeat, repeats=n, axis=0)
    return _start_requests(
        state.replace(cache=new_cache),
        dest,
        logits=repeat(logits),
        tokens=jnp.zeros(uniforms.shape, jnp.int32),
        step=jnp.zeros(dest.shape, jnp.int32),
        positions=repeat(prompt_mask.sum(-1, dtype=jnp.int32)),
        prefix_mask=repeat(prompt_mask),
        prefix_positions=repeat(positions),
        budget=budget,
        uniforms=uniforms,
    )


def _start_requests(
    state: SlotState,
    dest: Int[Array, " R"],
    *,
    logits: Float[Array, "R V"],
    tokens: Int[Array, "R T"],
    step: Int[Array, " R"],
    positions: Int[Array, " R"],
    prefix_mask: Bool[Array, "R P"],
    prefix_positions: Int[Array, "R P"],
    budget: Int[Array, " R"],
    uniforms: Float[Array, "R T"],
) -> SlotState:
    """Slots ``dest`` (an index >= S: dropped) start a request each from these rows: its
    next logits, its ``step`` tokens so far (their log-probs 0: the host holds any carried
    ones), positions, prompt mask and positions, budget and random numbers; running, nothing
    forced. The caches are the caller's."""

    def put(x, value):
        return x.at[dest].set(value.astype(x.dtype), mode="drop")

    zeros = jnp.zeros(uniforms.shape, jnp.float32)
    return state.replace(
        logits=put(state.logits, logits),
        tokens=put(state.tokens, tokens),
        logprobs=put(state.logprobs, zeros),
        model_logprobs=put(state.model_logprobs, zeros),
        step=put(state.step, step),
        positions=put(state.positions, positions),
        prefix_mask=put(state.prefix_mask, prefix_mask),
        prefix_positions=put(state.prefix_positions, prefix_positions),
        lengths=put(state.lengths, step),
        done=put(state.done, jnp.zeros(dest.shape, bool)),
        stopped=put(state.stopped, jnp.zeros(dest.shape, bool)),
        budget=put(state.budget, budget),
        uniforms=put(state.uniforms, uniforms),
        forced=put(state.forced, jnp.full(uniforms.shape, -1, jnp.int32)),
    )


def admit_resumed(
    cfg: ModelConfig,
    constrain: Constrain,
    params: Any,
    state: SlotState,
    tokens: Int[Array, "A PT"],
    mask: Bool[Array, "A PT"],
    dest: Int[Array, " A"],
    uniforms: Float[Array, "A T"],
    budget: Int[Array, " A"],
) -> SlotState:
    """Resumes ``A`` carried samples (partial rollouts) in slots ``dest``: each row is the
    slot's whole region ``[prompt (P) | tokens so far (T)]``, prefilled in one pass, so the
    cache holds the prompt and the carried tokens where decoding would have put them and the
    slot samples on at step ``g`` (its carried tokens, ``mask[:, P:]``'s count) from its own
    random numbers. ``dest`` >= S drops a row (padding)."""
    prompt_len = state.prefix_mask.shape[1]
    logits, cache, positions = decode_lib.prefill(cfg, constrain, params, tokens, mask)
    carried = mask[:, prompt_len:].sum(-1, dtype=jnp.int32)

    def put(x, value):
        return x.at[dest].set(value.astype(x.dtype), mode="drop")

    cache = state.cache.replace(
        k=tuple(put(f, k) for f, k in zip(state.cache.k, cache.prefix_k, strict=True)),
        v=tuple(put(f, v) for f, v in zip(state.cache.v, cache.prefix_v, strict=True)),
    )
    return _start_requests(
        state.replace(cache=cache),
        dest,
        logits=logits,
        tokens=tokens[:, prompt_len:],
        step=carried,
        positions=mask.sum(-1, dtype=jnp.int32),
        prefix_mask=mask[:, :prompt_len],
        prefix_positions=positions[:, :prompt_len],
        budget=budget,
        uniforms=uniforms,
    )


def finish_slots(state: SlotState, slots: Int[Array, " F"], lengths: Int[Array, " F"]) -> SlotState:
    """Ends the requests in ``slots`` at ``lengths`` tokens, as stopped (a stop string).

    Every sampled token was fed (``positions`` counts them), so the positions step back by
    the tokens dropped: a multi-turn slot resumes right after the cut (the cache columns
    past it are overwritten before any query sees them)."""
    return state.replace(
        positions=state.positions.at[slots].add(lengths - state.step[slots]),
        lengths=state.lengths.at[slots].set(lengths),
        step=state.step.at[slots].set(lengths),
        done=state.done.at[slots].set(True),
        stopped=state.stopped.at[slots].set(True),
    )


def resume_slots(
    state: SlotState,
    slots: Int[Array, " S"],
    forced: Int[Array, "S T"],
    budget: Int[Array, " S"],
) -> SlotState:
    """Restarts the (done) multi-turn requests in ``slots`` (an index >= S: padding, dropped)
    with their forced tokens (the observation after the turn) and their next budget; the
    cache, step and positions carry on where the turn ended."""

    def put(x, value):
        return x.at[slots].set(value.astype(x.dtype), mode="drop")

    return state.replace(
        forced=put(state.forced, forced),
        budget=put(state.budget, budget),
        done=put(state.done, jnp.zeros(slots.shape, bool)),
        stopped=put(state.stopped, jnp.zeros(slots.shape, bool)),
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
    forced = jnp.take_along_axis(state.forced, state.step[:, None], axis=1, mode="clip")[:, 0]
    is_forced = forced >= 0
    tokens = jnp.where(active, jnp.where(is_forced, forced, tokens), arrays["pad_id"])
    logprobs = jnp.where(is_forced, 0.0, logprobs)
    if model_lp is not None:
        model_lp = jnp.where(is_forced, 0.0, model_lp)
    is_stop = active & ~is_forced & (tokens[:, None] == arrays["stop_ids"][None, :]).any(-1)
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
    ropes: decode_lib.RopeTables,
    state: SlotState,
    prev_done: Bool[Array, " S"],
) -> SlotState:
    """Feeds each slot's last sampled token (written at generated slot ``step - 1``) and
    stores its next logits. Slots that were not running before this step's sample keep their
    state: their cache write goes to a column past the end (dropped), so a multi-turn slot
    waiting for its observation keeps its last token's keys and values."""
    moved = ~prev_done
    last = jnp.maximum(state.step - 1, 0)
    tokens = jnp.take_along_axis(state.tokens, last[:, None], axis=1)[:, 0]
    logits, cache = decode_lib.decode_step(
        cfg,
        constrain,
        params,
        weights,
        ropes,
        tokens,
        state.positions,
        state.cache,
        jnp.where(moved, last, state.tokens.shape[1]),
        state.prefix_mask,
        state.prefix_positions,
    )
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
    params: Any,
    weights: Any,
    state: SlotState,
    arrays: dict[str, jax.Array],
) -> SlotState:
    """``chunk`` steps of every slot: sample, then feed the sampled token.

    ``weights`` is ``decode.decode_weights(params, ...)``, made once per engine call and
    layout (``Engine.decode_weights_program``) and passed to every chunk: built inside the
    chunk, its per-layer slices and fused kernels would copy all the weights on every
    chunk. The RoPE tables cover a slot's whole region (prompt plus generated slots), also
    in a view."""
    ropes = decode_lib.rope_tables(cfg, state.prefix_mask.shape[1] + state.tokens.shape[1])

    def body(s: SlotState, _) -> tuple[SlotState, None]:
        sampled = sample_slots(s, arrays, statics)
        return forward_slots(cfg, constrain, params, weights, ropes, sampled, s.done), None

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
      sequence_mask: [F, T] every real token of the response: the model's and, in
        multi-turn episodes, the environment's observations (``response_mask`` holds the
        model's alone: the loss mask).
      rewards, turns, observations, errors: [F] multi-turn episodes' summed rewards, model
        turns, observations and environment errors (None without an environment).
      turn_rewards: [F, W] each episode's rewards at the last model token of the turns they
        answered (``Episode.turn_rewards``; rows sum to ``rewards``), or None.
      versions: [F, T] int32 the weights' version that sampled each token (-1 outside the
        response) when the engine tracks them (partial rollouts), else None.
    """

    rows: np.ndarray
    tokens: np.ndarray
    response_mask: np.ndarray
    logprobs: np.ndarray
    model_logprobs: np.ndarray
    lengths: np.ndarray
    stopped: np.ndarray
    sequence_mask: np.ndarray
    rewards: np.ndarray | None = None
    turns: np.ndarray | None = None
    observations: np.ndarray | None = None
    errors: np.ndarray | None = None
    turn_rewards: np.ndarray | None = None
    versions: np.ndarray | None = None
