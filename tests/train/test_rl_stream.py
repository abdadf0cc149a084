"""Streamed scoring on a background thread (``rollout.stream_concurrent``): it overlaps the
engine's decode, gives the same iteration as scoring between chunks, surfaces a scoring
error, and leaves no thread behind; where two programs cannot be in flight at once it
scores between chunks and says why.

Tolerance: the same programs on the same micro-batches in the same order, on another host
thread, so metrics and parameters are compared bitwise (0) against the serial path.
"""

from __future__ import annotations

import logging
import threading
import time

import jax
import numpy as np
import pytest

from jaxrlhf.sharding.mesh import MeshConfig, make_mesh
from jaxrlhf.train import rl_stream
from tests.train.test_rl_engine import ENGINE, METRICS, _iteration

THREAD = "jaxrlhf-stream-score"


def _stream_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD)]


@pytest.mark.slow
def test_background_scoring_equals_scoring_between_chunks(tmp_path):
    concurrent = _iteration(tmp_path, *ENGINE)  # stream_scoring and stream_concurrent default on
    serial = _iteration(tmp_path, *ENGINE, "grpo.rollout.stream_concurrent=false")
    assert concurrent[1]["rollout/stream_concurrent"] == 1.0
    assert serial[1]["rollout/stream_concurrent"] == 0.0
    for key in (*METRICS, "response/length_mean"):
        assert concurrent[1][key] == serial[1][key], key
    jax.tree.map(np.testing.assert_array_equal, concurrent[2], serial[2])
    assert concurrent[1]["time/score_streamed_s"] > 0
    # Between chunks the engine's thread does all of the scoring itself.
    assert serial[1]["time/score_streamed_wait_s"] >= serial[1]["time/score_streamed_s"]
    assert not _stream_threads()


def _on_worker() -> bool:
    return threading.current_thread().name.startswith(THREAD)


def test_scoring_runs_while_the_engine_decodes(tmp_path, monkeypatch):
    """The first micro-batch's device work waits until the engine has handed out more
    finished groups: it can only go on if the engine went on decoding meanwhile (16 rows
    through 8 slots, so groups finish after the first). Between chunks the same wait would
    never end, hence the bound (a guard, not a timing). The reward function runs on the
    engine's thread (a reward that uses signals needs the main thread)."""
    from jaxrlhf.train import rl_programs, rl_trainer

    handed_out = []
    add = rl_stream.StreamedScoring.add

    def counting_add(self, finished):
        handed_out.append(len(finished.rows))
        return add(self, finished)

    seen = {"reward threads": set()}
    put_rows = rl_programs.RLPrograms.put_rows

    def waiting_put_rows(self, tree):
        if _on_worker() and "more" not in seen:
            before, deadline = len(handed_out), time.monotonic() + 120
            while len(handed_out) == before and time.monotonic() < deadline:
                time.sleep(0.01)
            seen["more"] = len(handed_out) - before
        return put_rows(self, tree)

    function_scores = rl_trainer.RLTrainer.function_scores

    def recording_function_scores(self, *args, **kwargs):
        seen["reward threads"].add(threading.current_thread().name)
        return function_scores(self, *args, **kwargs)

    monkeypatch.setattr(rl_stream.StreamedScoring, "add", counting_add)
    monkeypatch.setattr(rl_programs.RLPrograms, "put_rows", waiting_put_rows)
    monkeypatch.setattr(rl_trainer.RLTrainer, "function_scores", recording_function_scores)
    _, metrics, *_ = _iteration(tmp_path, *ENGINE)
    assert metrics["rollout/stream_concurrent"] == 1.0
    assert seen["more"] > 0  # groups finished while the first batch's forwards ran
    assert seen["reward threads"] == {threading.current_thread().name}


def test_a_scoring_error_stops_the_rollout_and_no_thread_is_left(tmp_path, monkeypatch):
    from jaxrlhf.train import rl_programs

    put_rows, failed_on = rl_programs.RLPrograms.put_rows, []

    def failing_put_rows(self, tree):
        if _on_worker():
            failed_on.append(threading.current_thread().name)
            raise RuntimeError("device lost")
        return put_rows(self, tree)

    monkeypatch.setattr(rl_programs.RLPrograms, "put_rows", failing_put_rows)
    with pytest.raises(RuntimeError, match="device lost"):
        _iteration(tmp_path, *ENGINE)
    assert failed_on  # it failed on the background thread, and was raised on this one
    assert not _stream_threads()


def test_programs_that_cannot_run_at_once_are_scored_between_chunks(monkeypatch):
    """Two programs over 4 CPU devices each need 16 client threads (jaxrlhf.platform); a
    one-device engine never waits for another program's shares."""
    monkeypatch.setenv("NPROC", "8")
    devices = jax.devices()
    four, other_four = (
        make_mesh(MeshConfig(data=4, fsdp=1, tensor=1), devices=d)
        for d in (devices[:4], devices[4:])
    )
    one = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), devices=devices[:1])
    blocker = rl_stream.concurrency_blocker(four, other_four)
    assert blocker == (
        "programs on 4 and 4 CPU devices at once need 16 XLA:CPU client threads, this "
        "process has 8 (set NPROC=16 before JAX starts)"
    )
    assert rl_stream.concurrency_blocker(one, four) is None
    monkeypatch.setenv("NPROC", "16")
    assert rl_stream.concurrency_blocker(four, four) is None
    # On accelerators: two multi-device programs on shared devices are never launched from
    # two threads; disjoint groups, or a one-device program beside the other, are.
    assert rl_stream.accelerator_blocker(four, four) == (
        "two programs over 4 and 4 shared devices, launched from two threads, could reach "
        "the devices in different orders"
    )
    assert rl_stream.accelerator_blocker(four, other_four) is None
    assert rl_stream.accelerator_blocker(one, four) is None


@pytest.mark.slow
def test_a_trainer_whose_programs_cannot_overlap_warns_and_scores_between_chunks(
    tmp_path, monkeypatch, caplog
):
    from jaxrlhf.train.rl_trainer import build_rl_trainer
    from tests.train.test_rl import _config

    monkeypatch.setenv("NPROC", "8")  # 8 threads: two programs on 4 devices need 16
    cfg, src = _config(tmp_path, "grpo", *ENGINE)
    mesh = make_mesh(MeshConfig(data=4, fsdp=1, tensor=1), devices=jax.devices()[:4])
    with caplog.at_level(logging.WARNING, logger="jaxrlhf.train.rl_trainer"):
        trainer = build_rl_trainer(cfg, mesh=mesh, source=src)
    assert trainer.stream_blocker.startswith("programs on 4 and 4 CPU devices at once need 16")
    (record,) = [r for r in caplog.records if "stream_concurrent" in r.getMessage()]
    assert "scored between decode chunks" in record.getMessage()
    metrics = trainer.step().metrics
    assert metrics["rollout/stream_concurrent"] == 0.0 and metrics["time/score_streamed_s"] > 0


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_dry_run_counts_the_engine_beside_background_scoring(tmp_path, lora):
    """Scored on the background thread, a streamed batch's forwards run beside the engine's
    programs: the dry run adds the largest one's own outputs and temporaries (not its
    arguments, held already, nor the decode weights' output, which stays live)."""
    from jaxrlhf.train import dry_run
    from tests.train.test_rl import _config, _one_device_mesh

    reports = {}
    for concurrent in (True, False):
        flag = f"grpo.rollout.stream_concurrent={str(concurrent).lower()}"
        lora_rank = ["lora.rank=4"] if lora else []  # (its merge program is not the engine's)
        cfg, src = _config(tmp_path, "grpo", *ENGINE, flag, *lora_rank)
        reports[concurrent] = dry_run.plan(cfg, mesh=_one_device_mesh(), source=src)
    on, off = ({p.name: p for p in reports[c].programs} for c in (True, False))
    engine = [
        p
        for p in reports[True].programs
        if p.name in ("admit", "decode") or p.name.startswith("decode view ")
    ]
    assert len(engine) >= 3
    own = max(p.output_bytes - p.alias_bytes + p.temp_bytes for p in engine)
    assert own > 0
    streamed = on["score (streamed)"]
    assert streamed.resident_bytes == off["score (streamed)"].resident_bytes + own
    assert streamed.state_bytes == off["score (streamed)"].state_bytes
    assert on["score"].resident_bytes == off["score"].resident_bytes  # after the rollout


@pytest.mark.parametrize(
    "rows, group, shards, micro_rows, expected",
    [
        (16, 4, 1, None, 4),  # a quarter, whole groups
        (20, 4, 1, None, 8),  # a quarter (5) rounded up to whole groups
        (16, 4, 2, None, 4),  # one group of 4 over 2 shards: lcm(4, 2) = 4
        (16, 4, 1, 8, 4),  # fits one scoring forward of 8 rows
        (16, 4, 1, 2, 4),  # 2 forwards of 2 rows
        (24, 2, 1, 4, 4),  # a quarter (6) is not whole forwards of 4: one forward
        (64, 4, 1, 4, 16),  # a quarter: 4 forwards of 4
        (40, 5, 1, 8, 5),  # 2 groups of 5 exceed 8, lcm(5, 8) = 40 is all: one group
        (168, 7, 1, 8, 56),  # a quarter (42) exceeds 8; lcm(7, 8) = 56 is at most half
        (12, 3, 1, 2, 6),  # a group (3) exceeds a forward (2): lcm(3, 2) = 6, 3 forwards
        (12, 2, 2, 6, 4),  # a quarter (3) rounded up to lcm(2, 2) = 2: 4 rows fit one of 6
        (8, 2, 1, 8, 2),  # the rollout in one forward: the batch stays a quarter
    ],
)
def test_stream_rows_are_whole_groups_and_whole_scoring_forwards(
    rows, group, shards, micro_rows, expected
):
    size = rl_stream.stream_rows(rows, group, shards, micro_rows)
    assert size == expected
    assert size % group == 0 and size % shards == 0
    if micro_rows is not None and size > micro_rows:
        assert size % micro_rows == 0


def test_micro_batches_for_splits_only_above_the_bound():
    from jaxrlhf.sharding.micro_batches import micro_batches_for

    assert [micro_batches_for(r, 4) for r in (2, 4, 8, 16)] == [1, 1, 2, 4]
    assert micro_batches_for(16, None) == 1
    with pytest.raises(ValueError, match="6 rows do not split into micro-batches of 4 rows"):
        micro_batches_for(6, 4)
