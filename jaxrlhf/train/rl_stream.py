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

import dataclasses
import logging
import math
import time
from concurrent import futures
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrlhf import platform
from jaxrlhf.config import RunLayout
from jaxrlhf.generation.sampler import SampleOutput
from jaxrlhf.generation.slots import Finished
from jaxrlhf.train.rl_config import GRPOConfig, PPOConfig
from jaxrlhf.train.rl_packing import PhasePlan, streamed_score_metrics
from jaxrlhf.train.rl_types import RolloutRows, Scored

logger = logging.getLogger(__name__)


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


def concurrency_blocker(engine_mesh: Mesh, scoring_mesh: Mesh) -> str | None:
    """Why streamed micro-batches cannot be scored on a background thread beside the engine
    whose programs run on ``engine_mesh`` (scoring's on ``scoring_mesh``), in a few words;
    None when they can.

    Processes launch multi-process programs in one order, which two threads would not keep.
    On CPU devices two programs in flight at once must fit the XLA:CPU client's pool
    (``jaxrlhf.platform.concurrent_programs_fit``); on accelerators see
    :func:`accelerator_blocker`.
    """
    if jax.process_count() > 1:
        return f"{jax.process_count()} processes must launch their programs in one order"
    sizes = (engine_mesh.size, scoring_mesh.size)
    if engine_mesh.devices.flat[0].platform != "cpu":
        return accelerator_blocker(engine_mesh, scoring_mesh)
    if platform.concurrent_programs_fit(*sizes):
        return None
    need = platform.client_threads_needed(*sizes)
    return (
        f"programs on {sizes[0]} and {sizes[1]} CPU devices at once need {need} XLA:CPU "
        f"client threads, this process has {platform.cpu_client_threads()} (set "
        f"{platform.CLIENT_THREADS_ENV}={need} before JAX starts)"
    )


def accelerator_blocker(engine_mesh: Mesh, scoring_mesh: Mesh) -> str | None:
    """On accelerators: why the engine's and the scoring's programs may not be launched from
    two threads at once, or None. A program is launched one device at a time; two
    multi-device programs on shared devices, launched from two threads, could reach the
    devices in different orders and wait on each other's collectives. Disjoint meshes, or a
    one-device program beside the other, cannot."""
    engine = set(engine_mesh.devices.flat)
    disjoint = not engine & set(scoring_mesh.devices.flat)
    if disjoint or min(engine_mesh.size, scoring_mesh.size) == 1:
        return None
    return (
        f"two programs over {engine_mesh.size} and {scoring_mesh.size} shared devices, "
        "launched from two threads, could reach the devices in different orders"
    )


def stream_rows(rows: int, group: int, shards: int, micro_rows: int | None = None) -> int:
    """Rows per streamed micro-batch: whole groups over whole data shards, about a quarter of
    the rollout (so scoring starts once a quarter has finished).

    With a bound of ``micro_rows`` rows per scoring forward (``RLLayout.score_micro_rows``;
    ``rows`` is a whole number of them, the config checks it), a batch above the bound is
    cut to whole forwards of whole groups and shards: the most within the quarter, else the
    fewest if they are at most half the rollout, else the largest batch of whole groups and
    shards in one forward, else (a group larger than a forward) the fewest whole forwards.
    """
    unit = math.lcm(group, shards)
    size = min(rows, unit * max(1, math.ceil(rows / (4 * unit))))
    if micro_rows is None or size <= micro_rows:
        return size
    whole = math.lcm(unit, micro_rows)  # divides rows
    if whole <= size:
        return size // whole * whole
    if whole <= rows // 2 or unit > micro_rows:
        return whole
    return micro_rows // unit * unit


def streamed_batch_rows(algo: PPOConfig | GRPOConfig, layout: RunLayout) -> int:
    """Rows per streamed micro-batch of a run: :func:`stream_rows` of its rollout over the
    training mesh's data shards, under its scoring bound."""
    r = algo.rollout
    return stream_rows(r.rows, r.num_samples, layout.data_shards, layout.rl.score_micro_rows)


@dataclasses.dataclass(frozen=True)
class ScoredPiece:
    """One streamed micro-batch, scored: its rollout rows (padding: -1), each kept row's
    ``(raw, task)`` score, its scoring forwards, its packing (None: unpacked) and its
    ``(slots, tokens)`` unpacked."""

    rows: np.ndarray
    scores: dict[int, tuple[float, float | None]]
    forwards: Scored
    plan: PhasePlan | None
    unpacked: tuple[float, float]


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """A streamed micro-batch, its host part done: the samples with their prompts, padded
    to the micro-batch's rows by repeating whole groups, its rollout rows (padding: -1),
    token ids and mask ``[R, P + T]``, and the reward and task functions' scores of its
    rows (``raw`` None: the reward model scores them)."""

    out: SampleOutput
    rows: np.ndarray
    tokens: np.ndarray
    mask: np.ndarray
    task: np.ndarray | None
    raw: np.ndarray | None


class StreamedScoring:
    """Rewards and scoring forwards of finished groups, micro-batch by micro-batch.

    As a micro-batch fills, its reward and task functions run on the calling thread (the
    engine's, between decode chunks, as a reward that uses signals needs); its device work
    (the reward model and the scoring forwards) runs on a background thread
    (``concurrent``), so the engine goes on decoding meanwhile, or else on the calling
    thread too. One background thread scores the micro-batches one after another, in the
    order they filled; an error it raises is raised by the next :meth:`add` or by
    :meth:`close`.

    Args:
      trainer: the ``rl_trainer.RLTrainer`` (its programs, parameters, ``function_scores``).
      prompts: the iteration's prompt batch (``tokens``/``mask`` [B, P], record ``index``).
      micro_rows: rows per micro-batch (:func:`stream_rows`).
      concurrent: run the device work on a background thread (the caller has checked that
        the scoring's and the engine's programs may be in flight together).

    Attributes:
      host_seconds: time the calling thread spent in the reward and task functions.
      device_seconds: time spent in the device work, on whichever thread.
      wait_seconds: time the calling thread spent scoring or waiting for the background
        thread (``host_seconds + device_seconds`` when not concurrent).
    """

    def __init__(
        self,
        trainer: Any,
        prompts: dict[str, np.ndarray],
        micro_rows: int,
        concurrent: bool = False,
    ):
        self.trainer, self.prompts, self.micro_rows = trainer, prompts, micro_rows
        self.n = trainer.algo.rollout.num_samples
        self.waiting: list[Finished] = []
        self.pieces: list[ScoredPiece] = []
        self.pending: list[futures.Future] = []  # the background thread's, in order
        self.executor = (
            futures.ThreadPoolExecutor(1, thread_name_prefix="jaxrlhf-stream-score")
            if concurrent
            else None
        )
        self.host_seconds = 0.0
        self.device_seconds = 0.0  # written by the thread that runs the device work only
        self.wait_seconds = 0.0

    @property
    def concurrent(self) -> bool:
        return self.executor is not None

    @property
    def seconds(self) -> float:
        """Time spent scoring, host and device work, on whichever thread."""
        return self.host_seconds + self.device_seconds

    def add(self, finished: Finished) -> None:
        """Takes newly finished groups; starts scoring every full micro-batch."""
        self._raise_failed()
        self.waiting.append(finished)
        while sum(len(f.rows) for f in self.waiting) >= self.micro_rows:
            self._submit(self._take())

    def close(self) -> None:
        """Scores what is left (a last, padded micro-batch) and waits for every piece."""
        try:
            while self.waiting:
                self._submit(self._take())
            start = time.perf_counter()
            while self.pending:
                self.pieces.append(self.pending.pop(0).result())
            self.wait_seconds += time.perf_counter() - start
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Drops the micro-batches not started and waits for the one running, so that no
        thread touches the trainer after this returns; logs an error the background thread
        raised that nobody has seen (the rollout failed for another reason). Idempotent."""
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
        for future in self.pending:
            if not future.cancelled() and future.exception() is not None:
                logger.warning("streamed scoring failed too: %s", future.exception())
        self.pending = []

    def _raise_failed(self) -> None:
        for i, future in enumerate(self.pending):
            if future.done() and not future.cancelled() and future.exception() is not None:
                del self.pending[i]
                future.result()

    def _take(self) -> MicroBatch:
        """The next micro-batch off the waiting groups, padded to ``micro_rows`` rows by
        repeating its rows (whole groups: their outputs are dropped), with its reward and
        task functions' scores (run here, on the calling thread)."""
        start = time.perf_counter()
        merged = jax.tree.map(lambda *xs: np.concatenate(xs), *self.waiting)
        take = min(self.micro_rows, len(merged.rows))
        batch = jax.tree.map(lambda x: x[: self.micro_rows], merged)
        rest = len(merged.rows) - take
        self.waiting = [jax.tree.map(lambda x: x[self.micro_rows :], merged)] if rest > 0 else []
        pad = self.micro_rows - take
        if pad:
            fill = np.arange(pad) % take
            batch = jax.tree.map(lambda x: np.concatenate([x, x[fill]]), batch)
        out = with_prompts(batch, self.prompts, self.n)
        rows = batch.rows.copy()
        rows[take:] = -1
        index = self.prompts["index"][batch.rows // self.n]
        task, raw = self.trainer.function_scores(out, index)
        work = MicroBatch(
            out=out,
            rows=rows,
            tokens=np.concatenate([out.prompt_tokens, out.tokens], axis=1).astype(np.int32),
            mask=np.concatenate([out.prompt_mask, out.response_mask], axis=1),
            task=task,
            raw=raw,
        )
        elapsed = time.perf_counter() - start
        self.host_seconds += elapsed
        self.wait_seconds += elapsed
        return work

    def _submit(self, work: MicroBatch) -> None:
        if self.executor is not None:
            self.pending.append(self.executor.submit(self._score, work))
            return
        start = time.perf_counter()
        self.pieces.append(self._score(work))
        self.wait_seconds += time.perf_counter() - start

    def _score(self, work: MicroBatch) -> ScoredPiece:
        """The device work of a micro-batch: the reward model (when it scores) and the
        scoring forwards."""
        start, t_start = time.perf_counter(), self.trainer.timeline.now()
        trainer, programs = self.trainer, self.trainer.programs
        tokens, mask, rows = work.tokens, work.mask, work.rows
        raw = work.raw
        if raw is None:
            raw = programs.reward_scores(trainer.rm_params, tokens, mask)
        real = rows[rows >= 0]
        scores = {
            int(row): (float(raw[i]), None if work.task is None else float(work.task[i]))
            for i, row in enumerate(real)
        }
        out = work.out
        response = np.concatenate([np.zeros_like(out.prompt_mask), out.response_mask], axis=1)
        plan = programs.planner.score(tokens, mask)
        device_rows = RolloutRows(
            tokens=tokens, mask=mask, response_mask=response, packing=plan and plan.packing
        )
        forwards = programs.score_forwards(
            trainer.policy_params,
            trainer.ref_params,
            # interleaved: the critic's values are scored on its mesh after the rollout
            None if programs.critic_mesh is not None else trainer.value_params,
            programs.put_rows(device_rows),
            plan and plan.rows,
        )
        if self.concurrent:  # its time is this thread's: wait here, not in the engine's thread
            forwards = jax.block_until_ready(forwards)
        self.device_seconds += time.perf_counter() - start
        trainer.timeline.record(
            "score", "learner", trainer.steps_done, t_start, trainer.timeline.now()
        )
        return ScoredPiece(
            rows=rows,
            scores=scores,
            forwards=forwards,
            plan=plan,
            unpacked=programs.planner.unpacked_score_pass(mask),
        )

    def packing_metrics(self) -> dict[str, float]:
        """``packing/score_*`` of the streamed micro-batches (empty when none packed)."""
        return streamed_score_metrics(
            [p.plan for p in self.pieces], [p.unpacked for p in self.pieces]
        )

    def result(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, Scored]:
        """``(raw scores [N], task scores [N] or None, forwards [N, T])`` of ``rows`` (the
        kept rows, in the rollout's order), after :meth:`close`."""
        scores = {r: s for p in self.pieces for r, s in p.scores.items()}
        raw = np.asarray([scores[int(r)][0] for r in rows], np.float32)
        task = [scores[int(r)][1] for r in rows]
        task = None if task[0] is None else np.asarray(task, np.float32)
        scored = np.concatenate([p.rows for p in self.pieces])
        where = {int(r): i for i, r in enumerate(scored) if r >= 0}
        order = jnp.asarray([where[int(r)] for r in rows])
        forwards = jax.tree.map(
            lambda *xs: jnp.concatenate(xs)[order], *(p.forwards for p in self.pieces)
        )
        placed = jax.tree.map(lambda _: self.trainer.programs.rows(2), forwards)
        return raw, task, jax.device_put(forwards, placed)
