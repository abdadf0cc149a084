"""Response lengths for pricing generation: a distribution, and the rollout engine's decode
chunks under it.

The static sampler decodes every row for ``max_new_tokens`` steps (a fixed-trip scan), so its
time does not depend on the lengths. The rollout engine (``rollout.engine: continuous``)
frees a slot as soon as its sample ends and admits the next queued prompt group into free
slots between chunks: its decode steps depend on how the lengths fall into its slots.
:func:`engine_chunks` replays the engine's admission policy (``generation.engine_run``: queued
groups in order, a group only when ``n`` slots are free, admitted before each chunk; a
finished sample frees its slot after the chunk it ended in) on given lengths and counts the
chunks and admission calls; with a total token budget (``rollout.token_budget``) it admits
no group once the samples started have decoded that many tokens.

A distribution (``--lengths`` of ``python -m jaxrlhf.plan``):

* ``budget``: every sample runs to ``max_new_tokens`` (the default; the worst case).
* ``lognormal:MEDIAN,SIGMA``: lengths in tokens from a lognormal of that median and shape,
  capped at ``max_new_tokens`` and at least 1 (G2's long tail is ``lognormal:48,1.439``:
  5% of samples reach a 512-token budget). An iteration's rows take the distribution's
  quantiles at ``(i + 0.5) / rows``, in a fixed shuffled order (rows of one prompt are not
  alike), so a plan's price is deterministic.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import numpy as np
from jaxtyping import Int

from jaxrlhf.generation.engine_programs import view_buckets

__all__ = [
    "BUDGET",
    "EngineReplay",
    "LengthModel",
    "engine_chunks",
    "engine_replay",
    "parse_lengths",
]


@dataclasses.dataclass(frozen=True)
class LengthModel:
    """A response-length distribution (module docstring).

    Attributes:
      kind: ``budget`` or ``lognormal``.
      median: the lognormal's median, in tokens.
      sigma: the lognormal's shape (the standard deviation of log length).
    """

    kind: str = "budget"
    median: float = 0.0
    sigma: float = 0.0

    def lengths(self, rows: int, budget: int) -> Int[np.ndarray, " rows"]:
        """[rows] response lengths in ``[1, budget]`` tokens (module docstring)."""
        if self.kind == "budget":
            return np.full(rows, budget, np.int64)
        normal = statistics.NormalDist()
        z = np.array([normal.inv_cdf((i + 0.5) / rows) for i in range(rows)])
        raw = np.exp(math.log(self.median) + self.sigma * z)
        lengths = np.clip(np.round(raw), 1, budget).astype(np.int64)
        return lengths[np.random.default_rng(0).permutation(rows)]

    def describe(self) -> str:
        if self.kind == "budget":
            return "every sample generates max_new_tokens tokens"
        return (
            f"response lengths lognormal (median {self.median:g} tokens, sigma {self.sigma:g}), "
            "capped at max_new_tokens"
        )


BUDGET = LengthModel()  # every sample to max_new_tokens


def parse_lengths(spec: str) -> LengthModel:
    """``budget`` or ``lognormal:MEDIAN,SIGMA`` as a :class:`LengthModel`.

    Raises:
      ValueError: anything else (one line, with the forms accepted).
    """
    kind, _, args = spec.partition(":")
    if kind == "budget" and not args:
        return LengthModel()
    if kind == "lognormal":
        try:
            median, sigma = (float(x) for x in args.split(","))
        except ValueError:
            median = sigma = -1.0
        if median >= 1 and sigma >= 0:
            return LengthModel("lognormal", median, sigma)
    raise ValueError(
        f"--lengths: expected 'budget' or 'lognormal:MEDIAN,SIGMA' (median >= 1 token, "
        f"sigma >= 0), got {spec!r}"
    )


@dataclasses.dataclass(frozen=True)
class EngineReplay:
    """What one engine call does on given lengths (:func:`engine_replay`).

    Attributes:
      chunks: decode chunks run.
      admits: admission calls.
      views: per chunk, the ``(slots per shard, generated width)`` view it decodes on (the
        engine's rule: the smallest bucket holding the busiest shard's running slots, and
        the columns they reach in the chunk), or None for the whole state.
      kept: the groups that finished, in the order they did (indices into the call's
        groups), at most ``keep_groups``: with over-sampling, the ones the call keeps.
    """

    chunks: int
    admits: int
    views: tuple[tuple[int, int] | None, ...]
    kept: tuple[int, ...] = ()


def engine_replay(
    lengths: Int[np.ndarray, " rows"],
    slots: int,
    chunk: int,
    n: int,
    *,
    shards: int = 1,
    max_new_tokens: int | None = None,
    views: bool = True,
    keep_groups: int | None = None,
    token_budget: int | None = None,
) -> EngineReplay:
    """Replays the rollout engine on one call whose rows (prompt ``g``'s samples at
    ``g * n ... g * n + n - 1``) generate ``lengths`` tokens each, on ``slots`` slots over
    ``shards`` data shards decoding ``chunk`` steps per chunk; ``max_new_tokens`` (default:
    the longest length) is the cache's generated width; ``keep_groups``: over-sampling, the
    call ends once that many groups have finished (None: all); ``token_budget``: no group is
    admitted once the started samples have decoded that many tokens in all (None: no limit),
    and the call ends when nothing runs.

    As the engine does: a sample decodes ``length`` steps (its admission's prefill only
    fills the cache); one that ends within a chunk frees its slot after that chunk; whole
    groups are admitted into the lowest free slots (slot ``s`` on shard ``s // (slots /
    shards)``), and a chunk's view holds the busiest shard's running slots.
    """
    if len(lengths) % n or slots < n or slots % shards:
        raise ValueError(
            f"engine_replay: {len(lengths)} rows in groups of {n}, {slots} slots over "
            f"{shards} shard(s)"
        )
    width = int(max_new_tokens or max(lengths))
    local = slots // shards
    row_buckets, width_buckets = view_buckets(local, chunk, width)
    queue = list(np.asarray(lengths).reshape(-1, n))
    keep = len(queue) if keep_groups is None else keep_groups
    left = np.zeros(slots, np.int64)  # steps each slot's sample has left (0: free)
    done = np.zeros(slots, np.int64)  # steps it has decoded
    group = np.full(slots, -1)  # its group
    started = finished = chunks = admits = generated = 0
    picked: list[tuple[int, int] | None] = []
    kept: list[int] = []
    while finished < keep:
        free = np.flatnonzero(left == 0)
        groups = min(len(free) // n, len(queue))
        if token_budget is not None and generated >= token_budget:
            groups = 0
        if groups:
            admits += 1
            dest = free[: groups * n]
            left[dest] = np.concatenate([queue.pop(0) for _ in range(groups)])
            done[dest] = 0
            group[dest] = np.repeat(np.arange(started, started + groups), n)
            started += groups
        running = left > 0
        if not running.any():  # nothing running, nothing admissible
            break
        need = int(running.reshape(shards, local).sum(1).max())
        reach = int(done[running].max()) + chunk
        rows = min(b for b in row_buckets if b >= need)
        cols = min((b for b in width_buckets if b >= reach), default=width)
        full = not views or (rows == local and cols == width)
        picked.append(None if full else (rows, cols))
        chunks += 1
        ending = running & (left <= chunk)
        generated += int(np.minimum(left[running], chunk).sum())
        left[running] = np.maximum(left[running] - chunk, 0)
        done[running] += chunk
        for g in np.unique(group[ending]):  # a group is finished when its last sample is
            if not (left[group == g] > 0).any():
                finished += 1
                if len(kept) < keep:
                    kept.append(int(g))
                group[group == g] = -1
    return EngineReplay(chunks, admits, tuple(picked), tuple(kept))


def engine_chunks(
    lengths: Int[np.ndarray, " rows"], slots: int, chunk: int, n: int
) -> tuple[int, int]:
    """The rollout engine's decode chunks and admission calls for one call on ``lengths``
    (:func:`engine_replay`)."""
    replay = engine_replay(lengths, slots, chunk, n)
    return replay.chunks, replay.admits
