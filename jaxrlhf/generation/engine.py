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
  each prompt prefilled once and its cache copied into its ``n`` samples' slots. The weights
  in decode layout (per-layer trees, fused kernels) are made once per call
  (:meth:`Engine.decode_weights_program`) and passed to every chunk.
* **Exactness.** A request's row ``r`` (prompt-major, as the static sampler numbers rows)
  samples step ``t`` with the random number ``draw_uniforms(key, R, T)[r, t]``, the static
  sampler's, whichever slot it lands in and whenever it starts; the logits come from the same
  prefill and the same decode layers. So the engine samples the same tokens with the same
  log-probs as the static sampler (to float32 rounding: the batches differ).

This module holds :class:`Engine`: its jitted programs (one per shape, cached) and
:meth:`Engine.generate`. The host loop between the chunks (admission, harvest, views, stop
strings, the token budget and over-sampling, multi-turn episodes, carried partial rollouts)
is ``engine_run.EngineRun``, one per call (``jaxrlhf.generation.engine_run``'s docstring);
the device-side steps are ``jaxrlhf.generation.slots``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.generation import decode as decode_lib
from jaxrlhf.generation.cache import cache_nbytes

# EngineOutput (what generate returns) is defined next to the run that builds it.
from jaxrlhf.generation.engine_run import EngineOutput, EngineRun
from jaxrlhf.generation.environment import Episodes
from jaxrlhf.generation.params import SamplingParams, SamplingStatics
from jaxrlhf.generation.partials import Partials
from jaxrlhf.generation.sampler import Sampler
from jaxrlhf.generation.slots import (
    Finished,
    SlotState,
    admit,
    admit_resumed,
    decode_chunk,
    empty_state,
    finish_slots,
    put_view,
    resume_slots,
    take_view,
)
from jaxrlhf.models import axes
from jaxrlhf.models.config import ModelConfig


def view_buckets(local: int, chunk: int, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """The view sizes an engine of ``local`` slots per shard and ``chunk`` steps per chunk
    compiles its chunks for, ascending: slots per shard (all, then halving down to an
    eighth) and generated cache slots (doubling from ``4 * chunk``, then all
    ``max_new_tokens``)."""
    rows = [local]
    while rows[-1] % 2 == 0 and rows[-1] // 2 >= max(1, local // 8):
        rows.append(rows[-1] // 2)
    widths = [max_new_tokens]
    while widths[-1] // 2 >= 4 * chunk:
        widths.append(widths[-1] // 2)
    return sorted(rows), sorted(widths)


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

    def _jit_admission(self, fn: Callable, prompt_len: int, max_new_tokens: int) -> Any:
        """``fn(params, state, *five host arrays)`` jitted with the params in the sampler's
        layout and the state in the slots' (donated)."""
        sh = self.state_shardings(prompt_len, max_new_tokens)
        if sh is None:
            return jax.jit(fn, donate_argnums=1)
        return jax.jit(
            fn,
            in_shardings=(self.sampler.param_shardings, sh, None, None, None, None, None),
            out_shardings=sh,
            donate_argnums=1,
        )

    def admit_program(self, n: int, batch: int, prompt_len: int, max_new_tokens: int) -> Any:
        """Jitted :func:`admit` for ``batch`` prompts of ``n`` samples; the state donated."""
        fn = functools.partial(admit, self.cfg, self.sampler.constrain, n)
        return self._program(
            "admit",
            (n, batch, prompt_len, max_new_tokens),
            lambda: self._jit_admission(fn, prompt_len, max_new_tokens),
        )

    def resume_carried_program(self, rows: int, prompt_len: int, max_new_tokens: int) -> Any:
        """Jitted :func:`admit_resumed` for ``rows`` carried samples; the state donated."""
        fn = functools.partial(admit_resumed, self.cfg, self.sampler.constrain)
        return self._program(
            "resume_carried",
            (rows, prompt_len, max_new_tokens),
            lambda: self._jit_admission(fn, prompt_len, max_new_tokens),
        )

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

    def resume_program(self, prompt_len: int, max_new_tokens: int) -> Any:
        """Jitted :func:`resume_slots` (an observation arrived on the host)."""

        def build():
            sh = self.state_shardings(prompt_len, max_new_tokens)
            if sh is None:
                return jax.jit(resume_slots, donate_argnums=0)
            return jax.jit(
                resume_slots,
                in_shardings=(sh, None, None, None),
                out_shardings=sh,
                donate_argnums=0,
            )

        return self._program("resume", (prompt_len, max_new_tokens), build)

    def decode_weights_program(self) -> Any:
        """Jitted ``decode.decode_weights`` in this engine's layout: ``params -> weights``,
        the weights as the decode chunks read them (per-layer trees, fused and blocked
        kernels). :meth:`generate` runs it once per call and passes its output to every
        chunk; the chunk programs take the weights in the sharding this program gives them."""

        def build():
            shards = decode_lib.fused_shards(self.cfg, self.sampler.param_shardings)
            fn = functools.partial(
                decode_lib.decode_weights,
                num_layers=self.cfg.num_layers,
                shards=shards,
                block=self.sampler.matmul_block,
            )
            if self.sampler.mesh is None:
                return jax.jit(fn)
            return jax.jit(fn, in_shardings=(self.sampler.param_shardings,))

        return self._program("weights", (), build)

    def _decode_chunk(self, statics: SamplingStatics) -> Any:
        """:func:`decode_chunk` with this engine's model and chunk length bound:
        ``(params, weights, state, arrays) -> state``."""
        return functools.partial(
            decode_chunk, self.cfg, self.sampler.constrain, statics, self.chunk
        )

    def chunk_program(self, statics: SamplingStatics, prompt_len: int) -> Any:
        """Jitted :func:`decode_chunk`: ``(params, weights, state, arrays) -> state``, the
        state donated (updated in place); ``weights`` from :meth:`decode_weights_program`."""

        def build():
            fn = self._decode_chunk(statics)
            sh = self.state_shardings(prompt_len, statics.max_new_tokens)
            if sh is None:
                return jax.jit(fn, donate_argnums=2)
            return jax.jit(  # the weights as decode_weights_program lays them out (None)
                fn,
                in_shardings=(self.sampler.param_shardings, None, sh, None),
                out_shardings=sh,
                donate_argnums=2,
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
            chunk = self._decode_chunk(statics)
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

            def run(params, weights, state, arrays, ids):
                view = chunk(params, weights, take(state, ids), arrays)
                return put(state, view, ids)

            if sh is None:
                return jax.jit(run, donate_argnums=2)
            ids_sharding = sh.done
            return jax.jit(
                run,
                in_shardings=(self.sampler.param_shardings, None, sh, None, ids_sharding),
                out_shardings=sh,
                donate_argnums=2,
            )

        return self._program("view", (statics, prompt_len, local_rows, width), build)

    def view_buckets(self, max_new_tokens: int) -> tuple[list[int], list[int]]:
        """The view sizes chunks are compiled for (:func:`view_buckets`)."""
        return view_buckets(self.slots // self.slot_shards, self.chunk, max_new_tokens)

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
        environments: Episodes | None = None,
        carry: Partials | None = None,
        keep_partials: bool = False,
        version: int = 0,
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
          environments: multi-turn episodes (``jaxrlhf.generation.environment``): each
            sample is an episode whose turns end on a stop or a turn budget; the turn goes
            to its environment on a host thread while the other slots decode, and the
            observation is fed into the slot's cache (one decode step per token, the same
            steps the other slots decode in: nothing is re-prefilled) before the next turn.
            A sample's budget is its episode's. Stop strings end turns.
          carry: partial rollouts: an earlier call's unfinished groups, resumed ahead of
            ``prompt_tokens`` (their rows and groups come first in the numbering;
            ``max_new_tokens`` and ``keep_groups`` count the call's own prompts and all
            groups). Not with ``environments``.
          keep_partials: hand the started groups that are not kept out as
            ``EngineOutput.partials`` instead of aborting them.
          version: the weights' version (the caller's numbering): each sampled token's entry
            in ``Finished.versions`` (tracked with ``carry`` or ``keep_partials``).

        Returns:
          The kept groups' samples (ordered by row) and the run's counts.
        """
        if (carry is not None or keep_partials) and environments is not None:
            raise ValueError("Engine: partial rollouts do not resume multi-turn episodes")
        run = EngineRun(self, params, prompt_tokens, prompt_mask, key, sampling, carry, version)
        run.keep_partials = keep_partials
        run.configure(max_new_tokens, keep_groups, token_budget, stop_strings, decode, on_finished)
        run.env = environments
        return run.run()
