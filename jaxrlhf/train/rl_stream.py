"""Scoring finished samples while the rollout engine's long tail still decodes (RLHFuse's
inter-stage fusion).

The engine (``jaxrlhf.generation.engine``) hands out whole groups as they finish, between
decode chunks. :class:`StreamedScoring` collects them into micro-batches of a fixed number
of rows and, as each fills, computes their rewards (the reward function on the host, or the
reward model) and the scoring forwards (reference, old policy, critic:
``RLPrograms.score_forwards``); what is left when the last sample finishes is scored then.
:meth:`StreamedScoring.result` puts the pieces back in row order. The advantages need the
whole rollout, so they run after the last piece (``RLPrograms.score_advantages``), exactly as
the unstreamed ``score`` program runs them: the update sees the same arrays either way, up
to float32 rounding of forwards computed in other batch shapes.

Sequence packing (``rollout.pack_sequences``) applies here too: each micro-batch's rows are
finished, so their real lengths are known when it is scored; the planner packs it as it
would the whole rollout (``PackingPlanner.score``, its sizes in steps of this micro-batch's
rows), or leaves it unpacked where packing would run more slots.
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.generation.sampler import SampleOutput
from jaxrlhf.generation.slots import Finished
from jaxrlhf.train.rl_packing import PhasePlan, streamed_score_metrics
from jaxrlhf.train.rl_types import RolloutRows, Scored


def with_prompts(finished: Finished, prompts: dict[str, np.ndarray], n: int) -> SampleOutput:
    """The engine's finished samples with their prompts (row r's is prompt r // n), as the
    static sampler's output."""
    prompt = finished.rows // n
    return SampleOutput(
        tokens=finished.tokens,
        response_mask=finished.response_mask,
        lengths=finished.lengths,
        stopped=finished.stopped,
        logprobs=finished.logprobs,
        model_logprobs=finished.model_logprobs,
        prompt_tokens=prompts["tokens"][prompt],
        prompt_mask=prompts["mask"][prompt],
    )


def stream_rows(rows: int, group: int, shards: int) -> int:
    """Rows per streamed micro-batch: whole groups over whole data shards, about a quarter of
    the rollout (so scoring starts once a quarter has finished)."""
    unit = math.lcm(group, shards)
    return min(rows, unit * max(1, math.ceil(rows / (4 * unit))))


class StreamedScoring:
    """Rewards and scoring forwards of finished groups, micro-batch by micro-batch.

    Args:
      trainer: the ``rl_trainer.RLTrainer`` (its programs, parameters and ``row_scores``).
      prompts: the iteration's prompt batch (``tokens``/``mask`` [B, P], record ``index``).
      micro_rows: rows per micro-batch (:func:`stream_rows`).
    """

    def __init__(self, trainer: Any, prompts: dict[str, np.ndarray], micro_rows: int):
        self.trainer, self.prompts, self.micro_rows = trainer, prompts, micro_rows
        self.n = trainer.algo.rollout.num_samples
        self.waiting: list[Finished] = []
        self.rows: list[np.ndarray] = []  # each scored micro-batch's rows (padding: -1)
        self.forwards: list[Scored] = []
        self.scores: dict[int, tuple[float, float | None]] = {}  # row -> (raw, task)
        self.plans: list[PhasePlan | None] = []  # each micro-batch's packing (None: unpacked)
        self.unpacked: list[tuple[float, float]] = []  # its (slots, tokens) unpacked
        self.seconds = 0.0

    def add(self, finished: Finished) -> None:
        """Takes newly finished groups; scores every full micro-batch now."""
        self.waiting.append(finished)
        while sum(len(f.rows) for f in self.waiting) >= self.micro_rows:
            self._score_next()

    def close(self) -> None:
        """Scores what is left (a last, padded micro-batch)."""
        while self.waiting:
            self._score_next()

    def _score_next(self) -> None:
        start = time.perf_counter()
        merged = jax.tree.map(lambda *xs: np.concatenate(xs), *self.waiting)
        take, rest = merged.rows[: self.micro_rows], len(merged.rows) - self.micro_rows
        batch = jax.tree.map(lambda x: x[: self.micro_rows], merged)
        self.waiting = [jax.tree.map(lambda x: x[self.micro_rows :], merged)] if rest > 0 else []
        pad = self.micro_rows - len(take)
        if pad:  # repeat its rows (whole groups) to the full size: their outputs are dropped
            fill = np.arange(pad) % len(take)
            batch = jax.tree.map(lambda x: np.concatenate([x, x[fill]]), batch)
        out = with_prompts(batch, self.prompts, self.n)
        rows = batch.rows.copy()
        rows[len(take) :] = -1
        trainer = self.trainer
        tokens = np.concatenate([out.prompt_tokens, out.tokens], axis=1).astype(np.int32)
        mask = np.concatenate([out.prompt_mask, out.response_mask], axis=1)
        index = self.prompts["index"][batch.rows // self.n]
        task, raw = trainer.row_scores(out, tokens, mask, index)
        for i, row in enumerate(rows[rows >= 0]):
            self.scores[int(row)] = (float(raw[i]), None if task is None else float(task[i]))
        response = np.concatenate([np.zeros_like(out.prompt_mask), out.response_mask], axis=1)
        programs = trainer.programs
        plan = programs.planner.score(tokens, mask)
        self.plans.append(plan)
        self.unpacked.append(programs.planner.unpacked_score_pass(mask))
        device_rows = RolloutRows(
            tokens=tokens, mask=mask, response_mask=response, packing=plan and plan.packing
        )
        self.forwards.append(
            programs.score_forwards(
                trainer.policy_params,
                trainer.ref_params,
                # interleaved: the critic's values are scored on its mesh after the rollout
                None if programs.critic_mesh is not None else trainer.value_params,
                programs.put_rows(device_rows),
                plan and plan.rows,
            )
        )
        self.rows.append(rows)
        self.seconds += time.perf_counter() - start

    def packing_metrics(self) -> dict[str, float]:
        """``packing/score_*`` of the streamed micro-batches (empty when none packed)."""
        return streamed_score_metrics(self.plans, self.unpacked)

    def result(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, Scored]:
        """``(raw scores [N], task scores [N] or None, forwards [N, T])`` of ``rows`` (the
        kept rows, in the rollout's order)."""
        raw = np.asarray([self.scores[int(r)][0] for r in rows], np.float32)
        task = [self.scores[int(r)][1] for r in rows]
        task = None if task[0] is None else np.asarray(task, np.float32)
        where = {int(r): i for i, r in enumerate(np.concatenate(self.rows)) if r >= 0}
        order = jnp.asarray([where[int(r)] for r in rows])
        forwards = jax.tree.map(lambda *xs: jnp.concatenate(xs)[order], *self.forwards)
        placed = jax.tree.map(lambda _: self.trainer.programs.rows(2), forwards)
        return raw, task, jax.device_put(forwards, placed)
