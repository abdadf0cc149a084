"""The RL benchmark scripts drive the trainer through its pieces (a random prompt source,
forced response lengths), so a trainer change can break them without breaking any run a user
makes. Each runs here for one iteration on bench-S; what the iteration did is checked, never
how long it took (benchmarks are not timed asserts). They run with placement "one" (every
phase on device 0, through the trainer's sub-mesh path): on a 1-device CPU the scripts' "all"
does the same work, while here it would spread bench-S over the suite's 8 fake devices on 2
cores."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import rl_long, rl_step


def test_random_prompts_resume_where_they_stood():
    """The rollout producer keeps the prompt source's state with each rollout it launches;
    restoring it repeats the batches that followed."""
    prompts = rl_step.RandomPrompts(vocab=100, seed=3)
    next(prompts)
    state = prompts.state()
    want = [next(prompts)["tokens"] for _ in range(2)]
    prompts.restore(state)
    got = [next(prompts)["tokens"] for _ in range(2)]
    assert state == {"batches": 1} and prompts.state() == {"batches": 3}
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_rl_step_runs_an_r1_iteration(tmp_path):
    out = rl_step.run("R1", "bench-s", 1, str(tmp_path), pytorch=False, placement="one")
    assert set(rl_step.PHASES) <= set(out) and out["step_s"] > 0 and out["generate_tok_s"] > 0


@pytest.mark.slow
def test_rl_long_forces_the_quantile_lengths(tmp_path):
    """The engine run of R1-long stops each row at its drawn length: the iteration's mean
    response length is the lengths' mean."""
    lengths = rl_long.quantile_lengths()
    assert lengths.max() == rl_long.CAP and np.median(lengths) == pytest.approx(48, abs=2)
    trainer = rl_long._trainer("bench-s", "engine+stream", "one", str(tmp_path), 16)
    rl_long.force_lengths(trainer, lengths)
    metrics = trainer.step().metrics
    assert metrics["response/length_mean"] == pytest.approx(lengths.mean(), rel=1e-6)
    # The update packed the long tail: fewer rows per data shard than it holds unpacked.
    assert metrics["packing/update_rows"] < rl_long.ROWS // trainer.layout.data_shards


@pytest.mark.slow
def test_rl_long_unpacked_baseline_runs_padded_rows(tmp_path):
    """R1-long's baseline from before the rollout engine: the static sampler's rows cut at the
    drawn lengths, then scored and trained padded (no sequence packing)."""
    lengths = rl_long.quantile_lengths()
    trainer = rl_long._trainer("bench-s", "static unpacked", "one", str(tmp_path), 4)
    rl_long.force_lengths(trainer, lengths)
    metrics = trainer.step().metrics
    assert metrics["response/length_mean"] == pytest.approx(lengths.mean(), rel=1e-6)
    assert not [k for k in metrics if k.startswith("packing/")]
