"""The rollout engine's host loop: one :meth:`Engine.generate` call's scheduling between the
jitted chunks of decode steps (``jaxrlhf.generation.engine``).

:class:`EngineRun` keeps the engine's slots busy with no Python per token. Before each chunk
it admits queued prompts into free slots (in order, whole groups of ``n``, unless the token
budget is spent) and picks the smallest compiled view that holds the running slots; after
it, it harvests: reads which slots are done, frees them at once, and hands out every group
whose samples are all read (``on_finished``: the RL loop scores them while the tail
decodes). The programs it runs are
:class:`~jaxrlhf.generation.engine_programs.EnginePrograms`' (which the engine extends); its
multi-turn methods are the mixin ``engine_episodes.EpisodeSteps``; :class:`EngineOutput` is
what a run returns.

Stopping: stop token ids end a row on device; stop strings (decoded text) are checked by the
host between chunks, and a row that completed one is cut right after it (tokens it decoded
past the string in the same chunk are dropped). Per-request ``max_new_tokens`` is the slot's
budget. The run adds a total token budget and over-sampling with abort on the host.

Multi-turn episodes (``environments``; ``engine_episodes.py``): a slot whose turn ended waits
(``done``) while the others decode; its environment steps on a host thread; the observation
is written into the slot's ``forced`` tokens and fed through the following decode steps (one
token per step, appended to the slot's cache like sampled ones, nothing re-prefilled), then
the model samples its next turn. A multi-token append prefill would feed a long observation
in fewer steps; observations of tool results are short, and feeding them in the decode steps
keeps every program's shape and the per-row random numbers unchanged.

Partial rollouts (``keep_partials``, ``carry``; ``jaxrlhf.generation.partials``): the groups
still running when a call has kept enough are handed out instead of aborted, and the next
call resumes them first: each carried sample's prompt and tokens so far prefilled in one
pass into its slot (:func:`~jaxrlhf.generation.slots.admit_resumed`), then sampling on from
its own random numbers at the step where it stopped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import jax
import numpy as np

from jaxrlhf.generation.engine_episodes import EpisodeSteps
from jaxrlhf.generation.engine_programs import EnginePrograms
from jaxrlhf.generation.environment import Episode, Episodes
from jaxrlhf.generation.params import SamplingParams
from jaxrlhf.generation.partials import Partials
from jaxrlhf.generation.sampling import draw_uniforms
from jaxrlhf.generation.slots import Finished, SlotState


@dataclasses.dataclass(frozen=True)
class EngineOutput:
    """What :meth:`Engine.generate` returns.

    Attributes:
      finished: the kept samples, ordered by row.
      kept_groups: [M] the prompts whose groups were kept, in order.
      aborted_groups: prompts started (or queued) and cancelled (over-sampling, budget).
      generated_tokens: tokens decoded in all, aborted samples' included.
      chunks: decode chunks run.
      episode_info: each kept multi-turn row's summed ``Step.info`` counters.
      partials: ``keep_partials``: the started groups not kept (running, or finished beyond
        ``keep_groups``), for the next call's ``carry``; else None.
      carried_groups: C, the groups that came in ``carry``: rows and groups are numbered
        over the carried prompts first, then the call's own (``prompt * n + i``).
    """

    finished: Finished
    kept_groups: np.ndarray
    aborted_groups: int
    generated_tokens: int
    chunks: int
    episode_info: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    partials: Partials | None = None
    carried_groups: int = 0


class EngineRun(EpisodeSteps):
    """One :meth:`Engine.generate` call's host bookkeeping (no Python per token): the
    queue, which slot serves which sample, admission, harvest, views, stop strings and
    carried partial rollouts (module docstring). :meth:`Engine.generate` builds one per
    call, sets it up with :meth:`configure` and returns :meth:`run`'s output."""

    def __init__(
        self,
        engine: EnginePrograms,
        params: Any,
        prompt_tokens: np.ndarray,
        prompt_mask: np.ndarray,
        key: jax.Array,
        sampling: SamplingParams,
        carry: Partials | None = None,
        version: int = 0,
    ) -> None:
        self.engine, self.params, self.sampling = engine, params, sampling
        self.tokens = np.asarray(prompt_tokens, np.int32)
        self.mask = np.asarray(prompt_mask, bool)
        fresh, self.prompt_len = self.tokens.shape
        self.n, self.width = sampling.n, sampling.max_new_tokens
        if engine.slots % self.n:
            raise ValueError(f"Engine: {engine.slots} slots do not hold whole groups of {self.n}")
        if self.tokens.shape != self.mask.shape or not self.mask.any(-1).all():
            raise ValueError(
                "Engine: prompt_tokens and prompt_mask must be [B, P], a real token each"
            )
        sampling.check_vocab(engine.cfg.vocab_size)
        self.uniforms = draw_uniforms(key, fresh * self.n, self.width)
        self.carry, self.version, self.keep_partials = carry, version, False
        self.track = carry is not None  # token versions (set again by keep_partials)
        self.carried = 0 if carry is None else carry.groups
        if carry is not None:
            if carry.prompt_tokens.shape[1] != self.prompt_len or carry.tokens.shape != (
                carry.groups * self.n,
                self.width,
            ):
                raise ValueError(
                    f"Engine: carried partials of {carry.prompt_tokens.shape[1]} prompt and "
                    f"{carry.tokens.shape[1]} generated slots, groups of "
                    f"{carry.tokens.shape[0] // max(carry.groups, 1)}; this call has "
                    f"{self.prompt_len}, {self.width} and {self.n}"
                )
            self.tokens = np.concatenate([carry.prompt_tokens.astype(np.int32), self.tokens])
            self.mask = np.concatenate([carry.prompt_mask.astype(bool), self.mask])
            self.uniforms = np.concatenate([carry.uniforms, np.asarray(self.uniforms)])
        batch = self.carried + fresh
        self.batch, self.fresh = batch, fresh
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
        self.decoding = np.zeros(engine.slots, bool)  # admitted or resumed, not yet done
        self.env: Episodes | None = None
        self.episodes: dict[int, Episode] = {}  # slot -> its episode
        self.waiting: dict[int, tuple[Future, float]] = {}  # slot -> (its step, deadline)
        self.episode_info: dict[int, dict[str, float]] = {}
        # Each slot's step as the host last read it (at each hand-out): with ``decoding``, the
        # running slots a chunk's view must hold and the cache width they can reach.
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
        """Checks and sets the call's limits (``Engine.generate``'s arguments of the same
        names): per-sample budgets (``[fresh]`` per prompt or ``[fresh * n]`` per sample, each
        in ``[1, max_new_tokens]``; carried rows keep theirs), the groups to keep, the token
        budget, stop strings (which need ``decode``) and the finished-groups callback.

        Raises:
          ValueError: a budget, ``keep_groups`` or stop-string setting out of range.
        """
        batch, fresh = self.batch, self.fresh
        rows = fresh * self.n
        given = max_new_tokens is not None
        budgets = np.asarray(max_new_tokens) if given else np.full(rows, self.width)
        if budgets.shape == (fresh,):
            budgets = np.repeat(budgets, self.n)
        if budgets.shape != (rows,) or (budgets < 1).any() or (budgets > self.width).any():
            raise ValueError(
                f"Engine: max_new_tokens must be {fresh} or {rows} values in [1, {self.width}]"
            )
        if self.carry is not None:
            budgets = np.concatenate([self.carry.budgets, budgets])
        self.budgets = budgets.astype(np.int32)  # per sample row
        self.keep = batch if keep_groups is None else keep_groups
        if not 1 <= self.keep <= batch:
            raise ValueError(f"Engine: keep_groups={keep_groups} is not in [1, {batch}]")
        self.token_budget = token_budget
        # Latched: a stop string's cut lowers the next count of decoded tokens (_harvest).
        self.budget_spent = token_budget is not None and token_budget <= 0
        if stop_strings and decode is None:
            raise ValueError("Engine: stop_strings need a decode function")
        self.stop_strings, self.decode, self.on_finished = tuple(stop_strings), decode, on_finished

    def run(self) -> EngineOutput:
        """The call itself (``Engine.generate``'s loop): admits prompts into free slots,
        decodes chunk by chunk and harvests what finished, until ``keep_groups`` groups are
        done; returns the kept groups' samples (ordered by row) and the run's counts, with
        the unfinished groups as partials when ``keep_partials`` is set."""
        eng = self.engine
        self.track = self.track or self.keep_partials
        self.prefix: dict[int, int] = {}  # carried row -> tokens fed back before it samples
        if self.carry is not None:
            self._take_carry()
        state = eng.empty_program(self.prompt_len, self.width)()
        # Each view's weight layout (by its slots per shard); each layout made on first use.
        # Before each chunk, a layout no later chunk can use is dropped (before another is
        # made), so a tail that fits a blocked view holds one copy of the decode weights.
        blocks = {rows: eng.sampler.matmul_block_for(rows) for rows in self.row_buckets}
        weights: dict[int, Any] = {}  # matmul block -> the decode weights in that layout

        def weights_for(rows: int) -> Any:
            bound = self._rows_bound()
            for block in set(weights) - {blocks[b] for b in self.row_buckets if b <= bound}:
                del weights[block]
            if blocks[rows] not in weights:
                weights[blocks[rows]] = eng.decode_weights_program(blocks[rows])(self.params)
            return weights[blocks[rows]]

        chunk_fn = eng.chunk_program(self.statics, self.prompt_len)
        local = self.row_buckets[-1]  # every slot of a shard
        while len(self.kept) < self.keep:
            state = self._admit(state)
            if not (self.slot_group >= 0).any():  # nothing running, nothing admissible
                break
            if self.decoding.any():
                view = self._view() if self.engine.views else None
                if view is None:
                    state = chunk_fn(self.params, weights_for(local), state, self.arrays)
                else:
                    rows, width, ids = view
                    fn = self.engine.view_chunk_program(self.statics, self.prompt_len, rows, width)
                    state = fn(self.params, weights_for(rows), state, self.arrays, ids)
                self.chunks += 1
            else:  # every running slot waits for its environment
                self._wait_env()
            state = self._harvest(state)
        started = {int(g) for g in self.slot_group if g >= 0} | set(self.collected)
        aborted = len(self.queue) + len(started)
        aborted += max(0, len(self.kept) - self.keep)
        keep = sorted(self.kept[: self.keep])
        finished = _concat(self.finished, self.width, self.track)
        order = np.argsort(finished.rows, kind="stable")
        finished = jax.tree.map(lambda x: x[order], finished)
        chosen = np.isin(finished.rows // self.n, keep)
        partials = None
        if self.keep_partials:
            extra = jax.tree.map(lambda x: x[~chosen], finished)
            partials = self._partials(state, extra)
            aborted = sum(g >= self.carried for g in self.queue)  # the rest go on next call
        finished = jax.tree.map(lambda x: x[chosen], finished)
        info = {int(r): self.episode_info[int(r)] for r in finished.rows if self.env is not None}
        return EngineOutput(
            finished,
            np.asarray(keep),
            aborted,
            self.generated,
            self.chunks,
            info,
            partials,
            self.carried,
        )

    def _take_carry(self) -> None:
        """The carried groups: samples that had finished wait in ``collected`` (a group
        finished whole is handed out at once); the others are resumed when admitted."""
        c, n = self.carry, self.n
        for g in range(c.groups):
            rows = np.arange(g * n, (g + 1) * n)
            done = rows[c.finished[rows]]
            for r in rows[~c.finished[rows]]:
                self.prefix[int(r)] = int(c.lengths[r])
            if not len(done):
                continue
            length = c.lengths[done]
            mask = np.arange(self.width)[None, :] < length[:, None]
            self.collected[g] = [
                Finished(
                    rows=done[i : i + 1],
                    tokens=c.tokens[done[i : i + 1]],
                    response_mask=mask[i : i + 1],
                    logprobs=c.logprobs[done[i : i + 1]],
                    model_logprobs=c.model_logprobs[done[i : i + 1]],
                    lengths=length[i : i + 1].astype(np.int32),
                    stopped=c.stopped[done[i : i + 1]],
                    sequence_mask=mask[i : i + 1],
                    versions=c.versions[done[i : i + 1]],
                )
                for i in range(len(done))
            ]
            if len(done) == n:  # nothing left to run: handed out first
                self.queue.remove(g)
                self._ready([g])

    def _partials(self, state: SlotState, extra: Finished) -> Partials | None:
        """The started groups not kept, as :class:`Partials`: running samples read from
        their slots (the carried part of a resumed one spliced back), finished ones from
        ``collected`` and from ``extra`` (groups finished beyond ``keep_groups``)."""
        n, width = self.n, self.width
        running = np.flatnonzero(self.slot_group >= 0)
        groups = sorted(
            {int(g) for g in self.slot_group[running]}
            | set(self.collected)
            | {int(r) // n for r in extra.rows}
            | {g for g in self.queue if g < self.carried}  # carried, not admitted this time
        )
        if not groups:
            return None
        rows = (np.asarray(groups)[:, None] * n + np.arange(n)).reshape(-1)
        index = {int(r): i for i, r in enumerate(rows)}
        out = {
            "tokens": np.full((len(rows), width), self.sampling.pad_token_id, np.int32),
            "logprobs": np.zeros((len(rows), width), np.float32),
            "model_logprobs": np.zeros((len(rows), width), np.float32),
            "versions": np.full((len(rows), width), -1, np.int32),
            "lengths": np.zeros(len(rows), np.int32),
            "finished": np.zeros(len(rows), bool),
            "stopped": np.zeros(len(rows), bool),
        }
        for r, k in index.items():  # as carried, unless this call moved it on (below)
            if r < self.carried * n:
                for name, value in out.items():
                    value[k] = getattr(self.carry, name)[r]
        done = [part for g in groups for part in self.collected.get(g, [])] + [extra]
        for part in done:
            for i, r in enumerate(part.rows):
                k = index[int(r)]
                for name in ("tokens", "logprobs", "model_logprobs", "versions"):
                    out[name][k] = getattr(part, name)[i]
                out["lengths"][k], out["stopped"][k] = part.lengths[i], part.stopped[i]
                out["finished"][k] = True
        if len(running):
            read = self._read_slots(state, running)
            for i, slot in enumerate(running):
                k = index[int(self.slot_row[slot])]
                for name in ("tokens", "logprobs", "model_logprobs", "versions"):
                    out[name][k] = getattr(read, name)[i]
                out["lengths"][k] = read.lengths[i]
        return Partials(
            prompt_tokens=self.tokens[groups],
            prompt_mask=self.mask[groups],
            prompt_ids=np.asarray(groups),
            uniforms=np.asarray(self.uniforms)[rows],
            budgets=self.budgets[rows],
            **out,
        )

    def _view(self) -> tuple[int, int, np.ndarray] | None:
        """The smallest compiled view holding every running slot for the next chunk:
        ``(slots per shard, generated width, [shards * slots per shard] shard-local slot
        indices)``, or None for the whole state.

        The running slots are the ``decoding`` ones: admitted, or resumed with an observation
        to feed (a slot waiting for its environment is done on device and left out). Every
        token of a slot, sampled or fed, takes the next generated slot of its cache (column
        ``step``; RoPE positions are separate), so a chunk from step s writes columns up to
        ``s + chunk - 1`` and reads none past them: ``step + chunk`` bounds the width with
        observations too."""
        shards = self.engine.slot_shards
        local = self.engine.slots // shards
        active = self.decoding.reshape(shards, local)
        need_rows = int(active.sum(1).max())
        rows = min(b for b in self.row_buckets if b >= need_rows)
        reach = int(self.slot_step[self.decoding].max(initial=0)) + self.engine.chunk
        width = min((b for b in self.width_buckets if b >= reach), default=self.width)
        if rows == local and width == self.width:
            return None
        ids = [np.concatenate([np.flatnonzero(a), np.flatnonzero(~a)])[:rows] for a in active]
        return rows, width, np.concatenate(ids).astype(np.int32)

    def _rows_bound(self) -> int:
        """The most slots per shard any later chunk can decode: every slot of a shard while a
        queued prompt can still be admitted (or without views), else the smallest view
        holding the busiest shard's occupied slots, running or waiting for an environment
        (from then on a slot is only freed)."""
        local = self.row_buckets[-1]
        if not self.engine.views or (self.queue and not self.budget_spent):
            return local
        occupied = (self.slot_group >= 0).reshape(self.engine.slot_shards, local).sum(1).max()
        return min(b for b in self.row_buckets if b >= occupied)

    def _admit(self, state: SlotState) -> SlotState:
        """Starts queued prompts in free slots (in order, whole groups), unless the token
        budget is spent."""
        free = np.flatnonzero(self.slot_group < 0)
        groups = min(len(free) // self.n, len(self.queue))
        if self.budget_spent:
            groups = 0
        if groups == 0:
            return state
        prompts = [self.queue.pop(0) for _ in range(groups)]
        a = self.admit_batch
        index = np.array(prompts + [prompts[0]] * (a - groups))  # padding rows: dropped
        dest = np.full(a * self.n, self.engine.slots, np.int32)
        dest[: groups * self.n] = free[: groups * self.n]
        rows = (index[:, None] * self.n + np.arange(self.n)).reshape(-1)
        resumed = []  # (slot, row) of carried samples with tokens: prefilled on their own
        if self.carry is not None:  # a carried sample that finished takes no slot
            taken = np.isin(rows, list(self.prefix)) | (rows >= self.carried * self.n)
            dest[: groups * self.n][~taken[: groups * self.n]] = self.engine.slots
            for k in range(groups * self.n):
                if self.prefix.get(int(rows[k])):
                    resumed.append((int(dest[k]), int(rows[k])))
        for k in range(groups * self.n):
            if dest[k] < self.engine.slots:
                self.slot_group[dest[k]] = prompts[k // self.n]
                self.slot_row[dest[k]] = rows[k]
        budgets = self.budgets[rows].copy()
        if self.env is not None:  # the first turn's budget
            for k, slot in enumerate(dest[: groups * self.n]):
                episode = self.env.start(prompts[k // self.n], int(budgets[k]))
                self.episodes[int(slot)] = episode
                budgets[k] = episode.budget()
        used = dest[dest < self.engine.slots]
        self.decoding[used] = True
        self.slot_step[used] = 0
        fresh = dest.copy()
        fresh[np.isin(rows, [r for _, r in resumed])] = self.engine.slots
        fn = self.engine.admit_program(self.n, a, self.prompt_len, self.width)
        state = fn(
            self.params,
            state,
            self.tokens[index],
            self.mask[index],
            fresh,
            np.asarray(self.uniforms)[rows],
            budgets,
        )
        if resumed:
            state = self._resume_carried(state, resumed)
        return state

    def _resume_carried(self, state: SlotState, resumed: list[tuple[int, int]]) -> SlotState:
        """Carried samples with tokens: each slot's prompt and tokens so far prefilled in one
        pass (rows padded to a power of two, at most the slots: few compiles)."""
        count, width, p = len(resumed), self.width, self.prompt_len
        rows = min(self.engine.slots, 1 << (count - 1).bit_length())
        slots = np.full(rows, self.engine.slots, np.int32)
        ids = np.full(rows, resumed[0][1])  # padding rows repeat the first (dropped)
        for i, (slot, row) in enumerate(resumed):
            slots[i], ids[i] = slot, row
            self.slot_step[slot] = self.prefix[row]
        carried = self.carry.tokens[ids]
        fed = np.array([self.prefix[int(r)] for r in ids])
        region_mask = np.concatenate(
            [self.mask[ids // self.n], np.arange(width)[None, :] < fed[:, None]], axis=1
        )
        region = np.concatenate([self.tokens[ids // self.n], carried], axis=1)
        region = np.where(region_mask, region, self.sampling.pad_token_id).astype(np.int32)
        fn = self.engine.resume_carried_program(rows, p, width)
        return fn(
            self.params,
            state,
            region,
            region_mask,
            slots,
            np.asarray(self.uniforms)[ids],
            self.budgets[ids],
        )

    def _harvest(self, state: SlotState) -> SlotState:
        """Reads every finished sample out of its slot and frees the slot at once (its
        group's other samples may still run); hands out every group whose samples are all
        read."""
        done, step = jax.device_get((state.done, state.step))
        running = self.slot_group >= 0
        self.generated = int(step[running].sum()) + self.collected_tokens
        if self.token_budget is not None and self.generated >= self.token_budget:
            self.budget_spent = True  # no more admissions
        decoding = running & self.decoding
        if self.stop_strings:
            done, state = self._stop_strings(state, done, decoding)
        self.decoding &= ~done
        self.slot_step = np.array(step)
        if self.env is not None:  # a sample is finished when its episode ends
            state = self._env_turns(state, np.flatnonzero(decoding & done))
            done = np.array(
                [s in self.episodes and self.episodes[s].ended for s in range(len(done))]
            )
        slots = np.flatnonzero(running & done)
        if len(slots) == 0:
            return state
        samples = self._read_slots(state, slots)
        if self.env is not None:
            samples = self._episodes_out(samples, slots)
        self.collected_tokens += int(samples.lengths.sum())
        groups = self.slot_group[slots].copy()
        self.slot_group[slots] = -1
        self.slot_row[slots] = -1
        for i, group in enumerate(groups):
            self.collected.setdefault(int(group), []).append(
                jax.tree.map(lambda x, i=i: x[i : i + 1], samples)
            )
        self._ready(sorted(g for g in set(groups.tolist()) if len(self.collected[g]) == self.n))
        return state

    def _read_slots(self, state: SlotState, slots: np.ndarray) -> Finished:
        """The samples in ``slots`` as they stand (host), a resumed sample's carried tokens
        with their log-probs as first sampled; with ``track``, each token's version."""
        host = jax.device_get(
            (
                state.tokens[slots],
                state.logprobs[slots],
                state.model_logprobs[slots],
                state.lengths[slots],
                state.stopped[slots],
            )
        )
        tokens, logprobs, model_lp, lengths, stopped = (np.array(x) for x in host)
        mask = np.arange(self.width)[None, :] < lengths[:, None]
        pad = self.sampling.pad_token_id
        rows = self.slot_row[slots].copy()
        versions = None
        if self.track:
            versions = np.where(mask, self.version, -1).astype(np.int32)
            for i, r in enumerate(rows):
                fed = min(self.prefix.get(int(r), 0), int(lengths[i]))
                if fed:  # the carried tokens' own log-probs and versions
                    logprobs[i, :fed] = self.carry.logprobs[r, :fed]
                    model_lp[i, :fed] = self.carry.model_logprobs[r, :fed]
                    versions[i, :fed] = self.carry.versions[r, :fed]
        return Finished(
            rows=rows,
            tokens=np.where(mask, tokens, pad),
            response_mask=mask,
            logprobs=np.where(mask, logprobs, 0.0).astype(np.float32),
            model_logprobs=np.where(mask, model_lp, 0.0).astype(np.float32),
            lengths=lengths.astype(np.int32),
            stopped=stopped,
            sequence_mask=mask,
            versions=versions,
        )

    def _ready(self, ready: list[int]) -> None:
        """Hands out the groups in ``ready`` (every sample collected), in order."""
        if not ready:
            return
        parts = [part for g in ready for part in self.collected.pop(g)]
        finished = _concat(parts, self.width, self.track)
        order = np.argsort(finished.rows, kind="stable")  # groups in order, samples in order
        finished = jax.tree.map(lambda x: x[order], finished)
        self.finished.append(finished)
        self.kept.extend(ready)
        if self.on_finished is not None:
            self.on_finished(finished)

    def _stop_strings(
        self, state: SlotState, done: np.ndarray, running: np.ndarray
    ) -> tuple[np.ndarray, SlotState]:
        """Ends every running sample whose decoded response contains a stop string, cut
        right after the first token that completes one (tokens decoded past it are dropped);
        returns the updated done flags and state."""
        slots = np.flatnonzero(running)
        if not len(slots):
            return done, state
        tokens, lengths = jax.device_get((state.tokens[slots], state.lengths[slots]))
        cut_slots, cut_lengths = [], []
        for slot, row, length in zip(slots, np.asarray(tokens), np.asarray(lengths), strict=True):
            start = self.episodes[slot].start if slot in self.episodes else 0  # this turn's
            if not any(s in self.decode(row[start:length]) for s in self.stop_strings):
                continue
            end = next(
                k
                for k in range(start + 1, length + 1)
                if any(s in self.decode(row[start:k]) for s in self.stop_strings)
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


def _concat(parts: list[Finished], width: int, versions: bool = False) -> Finished:
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
            empty.astype(bool),
            versions=empty.astype(np.int32) if versions else None,
        )
    return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)
