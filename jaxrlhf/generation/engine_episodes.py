"""The rollout engine's multi-turn half: environment steps on host threads between decode
chunks, observations fed into the waiting slots, and the finished episodes' masks.

:class:`EpisodeSteps` is a mixin of the engine's host loop (``engine_run.EngineRun``): it reads the
run's fields (``env``, ``episodes``, ``waiting``, ``decoding``, ``engine``, ``width``,
``prompt_len``, ``sampling``, ``episode_info``). See ``jaxrlhf.generation.environment`` for
the protocol and ``Engine.generate`` for how a turn ends.
"""

from __future__ import annotations

import concurrent.futures
import time

import jax
import numpy as np

from jaxrlhf.generation.environment import call_in_thread, wait_for
from jaxrlhf.generation.slots import Finished, SlotState


class EpisodeSteps:
    """Multi-turn methods of the engine's host loop (module docstring)."""

    def _wait_env(self) -> None:
        """Blocks until an environment step finishes or the first deadline passes."""
        deadline = min(d for _, d in self.waiting.values())
        concurrent.futures.wait(
            [f for f, _ in self.waiting.values()],
            timeout=max(0.0, deadline - time.monotonic()) + 1e-3,
            return_when=concurrent.futures.FIRST_COMPLETED,
        )

    def _env_turns(self, state: SlotState, ended: np.ndarray) -> SlotState:
        """Hands the turns that just ended (``ended`` slots) to their environments on host
        threads, and feeds every observation that has arrived into its slot."""
        if len(ended):
            host = jax.device_get((state.tokens[ended], state.lengths[ended], state.stopped[ended]))
            deadline = time.monotonic() + self.env.cfg.timeout_s
            for slot, row, length, stopped in zip(
                ended, *(np.asarray(x) for x in host), strict=True
            ):
                episode = self.episodes[int(slot)]
                if episode.ended:  # its environment could not be built
                    continue
                turn = episode.end_turn(row, int(length), bool(stopped))
                self.waiting[int(slot)] = (call_in_thread(episode.step, turn), deadline)
        resumed = []
        for slot, (future, deadline) in list(self.waiting.items()):
            result = wait_for(future, deadline)
            if result is None:
                continue
            del self.waiting[slot]
            ids = self.episodes[slot].apply(result)
            if ids is not None:
                resumed.append((slot, ids))
        if not resumed:
            return state
        s = self.engine.slots
        slots = np.full(s, s, np.int32)  # padding: dropped
        forced = np.full((s, self.width), -1, np.int32)
        budget = np.ones(s, np.int32)
        for i, (slot, ids) in enumerate(resumed):
            episode = self.episodes[slot]
            slots[i] = slot
            forced[i, episode.start - len(ids) : episode.start] = ids
            budget[i] = episode.budget()
            self.decoding[slot] = True
        fn = self.engine.resume_program(self.prompt_len, self.width)
        return fn(state, slots, forced, budget)

    def _episodes_out(self, finished: Finished, slots: np.ndarray) -> Finished:
        """``finished`` (rows of ``slots``) with the episodes' masks, error tails, rewards
        and counts; their episodes are dropped."""
        tokens, lengths = finished.tokens.copy(), finished.lengths.copy()
        model = np.zeros(tokens.shape, bool)
        seq = np.zeros(tokens.shape, bool)
        counts = np.zeros((4, len(slots)), np.float32)
        turn_rewards = np.zeros(tokens.shape, np.float32)
        stopped = finished.stopped.copy()
        raw = jax.tree.map(np.copy, finished)
        for i, slot in enumerate(slots):
            episode = self.episodes.pop(int(slot))
            length = int(lengths[i])
            tail = episode.tail(length)
            tokens[i, length : length + len(tail)] = tail
            model[i], seq[i] = episode.masks(length)
            turn_rewards[i] = episode.turn_rewards()
            lengths[i] = length + len(tail)
            stopped[i] = episode.stopped
            counts[:, i] = (
                episode.reward,
                episode.turns,
                len(episode.observations),
                episode.errors,
            )
            self.episode_info[int(finished.rows[i])] = dict(episode.info)
        pad = self.sampling.pad_token_id
        return raw.replace(
            tokens=np.where(seq, tokens, pad),
            response_mask=model,
            sequence_mask=seq,
            logprobs=np.where(model, raw.logprobs, 0.0).astype(np.float32),
            model_logprobs=np.where(model, raw.model_logprobs, 0.0).astype(np.float32),
            lengths=lengths,
            stopped=stopped,
            rewards=counts[0],
            turns=counts[1].astype(np.int32),
            observations=counts[2].astype(np.int32),
            errors=counts[3].astype(np.int32),
            turn_rewards=turn_rewards,
        )
