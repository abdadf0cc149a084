"""The rollout engine's jitted programs, one per shape and cached (:class:`EnginePrograms`):
the empty slot state, the admissions (fresh prompts and carried rows), the finish, the
decode weights and the decode chunks with their views; and the view sizes
(:func:`view_buckets`).

:class:`jaxrlhf.generation.engine.Engine` adds :meth:`~jaxrlhf.generation.engine.Engine.generate`
to them, and ``jaxrlhf.generation.engine_run.EngineRun`` runs them between chunks (the host
loop), so that loop can name the programs' type without importing the engine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.generation import decode as decode_lib
from jaxrlhf.generation.cache import cache_nbytes
from jaxrlhf.generation.params import SamplingStatics
from jaxrlhf.generation.sampler import Sampler
from jaxrlhf.generation.slots import (
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


class EnginePrograms:
    """The rollout engine's programs for one sampler (its model, mesh, rules and weight
    layout), built and compiled on first use.

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

    def _jit_on_state(self, fn: Callable, extra: int, prompt_len: int, max_new_tokens: int) -> Any:
        """Jitted ``fn(state, *extra host arrays) -> state``: the state donated and kept in
        the slots' sharding."""
        sh = self.state_shardings(prompt_len, max_new_tokens)
        if sh is None:
            return jax.jit(fn, donate_argnums=0)
        in_shardings = (sh, *(None,) * extra)
        return jax.jit(fn, in_shardings=in_shardings, out_shardings=sh, donate_argnums=0)

    def finish_program(self, prompt_len: int, max_new_tokens: int) -> Any:
        """Jitted :func:`finish_slots` (a stop string ended them on the host)."""
        return self._program(
            "finish",
            (prompt_len, max_new_tokens),
            lambda: self._jit_on_state(finish_slots, 2, prompt_len, max_new_tokens),
        )

    def resume_program(self, prompt_len: int, max_new_tokens: int) -> Any:
        """Jitted :func:`resume_slots` (an observation arrived on the host)."""
        return self._program(
            "resume",
            (prompt_len, max_new_tokens),
            lambda: self._jit_on_state(resume_slots, 3, prompt_len, max_new_tokens),
        )

    def decode_weights_program(self, block: int | None = None) -> Any:
        """Jitted ``decode.decode_weights`` in this engine's layout: ``params -> weights``,
        the weights as the decode chunks read them (per-layer trees, fused kernels, blocked
        by ``block`` columns: None is the sampler's ``matmul_block``). :meth:`generate` runs it
        once per call and layout and passes its output to every chunk; each view takes the
        layout ``Sampler.matmul_block_for`` gives its slots per shard (on CPU every view
        multiplies by weight blocks where the block-matmul kernel runs, else only the
        few-slot views of the long tail; views stop at an eighth of the slots per shard).
        The chunk programs take the weights in the sharding this program gives them."""
        block = self.sampler.matmul_block if block is None else block

        def build():
            shards = decode_lib.fused_shards(self.cfg, self.sampler.param_shardings)
            fn = functools.partial(
                decode_lib.decode_weights,
                num_layers=self.cfg.num_layers,
                shards=shards,
                block=block,
            )
            if self.sampler.mesh is None:
                return jax.jit(fn)
            return jax.jit(fn, in_shardings=(self.sampler.param_shardings,))

        return self._program("weights", (block,), build)

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
        return self.slots // self.sampler.rows_per_device(self.slots)

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
