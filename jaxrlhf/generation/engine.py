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
  in decode layout (per-layer trees, fused kernels) are made once per call and layout
  (:meth:`Engine.decode_weights_program`; on CPU the few-slot views use weight blocks) and
  passed to every chunk.
* **Exactness.** A request's row ``r`` (prompt-major, as the static sampler numbers rows)
  samples step ``t`` with the random number ``draw_uniforms(key, R, T)[r, t]``, the static
  sampler's, whichever slot it lands in and whenever it starts; the logits come from the same
  prefill and the same decode layers. So the engine samples the same tokens with the same
  log-probs as the static sampler (to float32 rounding: the batches differ).

This module holds :class:`Engine` and its :meth:`Engine.generate`. Its jitted programs (one
per shape, cached) are :class:`~jaxrlhf.generation.engine_programs.EnginePrograms`', which it
extends; the host loop between the chunks (admission, harvest, views, stop strings, the token
budget and over-sampling, multi-turn episodes, carried partial rollouts) is
``engine_run.EngineRun``, one per call (``jaxrlhf.generation.engine_run``'s docstring); the
device-side steps are ``jaxrlhf.generation.slots``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxrlhf.generation.engine_programs import EnginePrograms

# EngineOutput (what generate returns) is defined next to the run that builds it.
from jaxrlhf.generation.engine_run import EngineOutput, EngineRun
from jaxrlhf.generation.environment import Episodes
from jaxrlhf.generation.params import SamplingParams
from jaxrlhf.generation.partials import Partials
from jaxrlhf.generation.slots import Finished

__all__ = ["Engine", "EngineOutput"]


class Engine(EnginePrograms):
    """Runs continuous batching for one sampler: :class:`EnginePrograms`' programs (the same
    constructor: the sampler, ``slots``, ``chunk``, ``views``) and :meth:`generate`, the call
    that runs them."""

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
