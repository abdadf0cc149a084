"""Partial rollouts: the unfinished groups one rollout engine call hands to the next.

With over-sampling (``keep_groups`` below the prompts started) an engine call stops once
enough groups have finished; the groups still running would be aborted. A call with
``keep_partials`` hands them out instead as :class:`Partials`: each group's prompt, its
samples' random numbers and budgets, the tokens each sample has so far with their
log-probs as sampled, and the version of the weights that sampled each token (an integer
the caller names its weights by). The next call takes them back (``carry``) ahead of its
own prompts: a carried sample's prompt and tokens so far are prefilled in one pass under
the new weights (``slots.admit_resumed``: the slot's whole ``[prompt | tokens]`` region, so
the cache holds them where decoding put them), then it samples on from its own random
numbers at the step where it stopped. Its finished row keeps the carried tokens' log-probs
and versions, so the behaviour log-probs stay per token (AReaL's partial rollouts; the
importance weights in ``jaxrlhf.losses.correction`` correct for the mix). Under unchanged
weights a carried sample ends as it would have without the interruption: the same tokens,
log-probs to float32 rounding (the prefill computes the carried tokens' keys and values in
one batch where decoding computed them one at a time).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Partials:
    """Unfinished groups of ``n`` samples (host numpy; ``G`` groups, ``T`` generated slots).

    Attributes:
      prompt_tokens, prompt_mask: [G, P] each group's prompt.
      prompt_ids: [G] each group's number in the call that handed it out (its carried groups
        first, then its own prompts): the caller maps them to its own ids.
      uniforms: [G * n, T] each sample's random numbers (its row of the first call's draw).
      budgets: [G * n] each sample's ``max_new_tokens``.
      tokens: [G * n, T] int32 the tokens so far (a finished sample's whole response), pad
        after ``lengths``.
      logprobs, model_logprobs: [G * n, T] float32 as sampled (0 after ``lengths``).
      versions: [G * n, T] int32 the weights' version that sampled each token (-1 after).
      lengths: [G * n] tokens so far.
      finished: [G * n] the sample ended already (only its group's others still run).
      stopped: [G * n] a finished sample ended on a stop token or string.
    """

    prompt_tokens: np.ndarray
    prompt_mask: np.ndarray
    prompt_ids: np.ndarray
    uniforms: np.ndarray
    budgets: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    model_logprobs: np.ndarray
    versions: np.ndarray
    lengths: np.ndarray
    finished: np.ndarray
    stopped: np.ndarray

    @property
    def groups(self) -> int:
        return int(self.prompt_tokens.shape[0])

    def oldest(self) -> np.ndarray:
        """[G] the oldest version among each group's tokens; -1 for a group with none yet
        (it holds no work, and no bound keeps it: a checkpoint boundary drops every group)."""
        n = self.tokens.shape[0] // max(self.groups, 1)
        held = np.where(self.versions >= 0, self.versions, np.iinfo(np.int32).max)
        oldest = held.reshape(self.groups, n * held.shape[1]).min(-1)
        return np.where(oldest == np.iinfo(np.int32).max, -1, oldest)

    def select(self, groups: np.ndarray) -> Partials:
        """These groups (indices into the G), in that order."""
        groups = np.asarray(groups, np.int64)
        n = self.tokens.shape[0] // max(self.groups, 1)
        rows = (groups[:, None] * n + np.arange(n)).reshape(-1)
        per_group = ("prompt_tokens", "prompt_mask", "prompt_ids")
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name)[groups if f.name in per_group else rows]
                for f in dataclasses.fields(self)
            },
        )


def concat_partials(parts: list[Partials]) -> Partials | None:
    """The groups of ``parts`` in order (None when there are none)."""
    parts = [p for p in parts if p is not None and p.groups]
    if not parts:
        return None
    return Partials(
        **{
            f.name: np.concatenate([getattr(p, f.name) for p in parts])
            for f in dataclasses.fields(Partials)
        }
    )
