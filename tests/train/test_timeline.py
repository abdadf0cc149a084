"""The timeline's arithmetic: busy fractions and overlap by hand, and the host's CPU cores
from the process's CPU-time samples."""

from __future__ import annotations

import types

from jaxrlhf.train.timeline import CpuSample, Phase, Timeline, host_cores, summarize


def test_summarize_by_hand():
    groups = {"sampler": (0,), "learner": (1,)}
    phases = [
        Phase("sample", "sampler", 0, 0.0, 1.0, (0,)),
        Phase("score", "learner", 0, 0.5, 2.0, (1,)),
        Phase("update", "learner", 0, 2.0, 4.0, (1,)),
    ]
    out = summarize(phases, groups)
    assert out["span_s"] == 4.0
    assert out["device0/busy_frac"] == 0.25 and out["device1/busy_frac"] == 0.875
    assert out["sampler/idle_frac"] == 0.75
    assert out["overlap_frac"] == 0.125  # 0.5 s of 4 with both busy


def test_host_cores_by_hand():
    samples = [CpuSample(1.0, 10.0, 0), CpuSample(3.0, 13.0, 1), CpuSample(5.0, 16.0, 2)]
    assert host_cores(samples) == 1.5  # 6 CPU seconds in 4 wall seconds
    assert host_cores(samples[::-1]) == 1.5  # threads may record out of order


def test_timeline_samples_process_cpu(monkeypatch):
    """Each recorded phase end samples the process's CPU time (``time.process_time``) and
    the wall clock: with both clocks scripted, the samples hold exactly their readings, and
    the summary's host cores are the CPU seconds over the wall seconds between them."""
    from jaxrlhf.train import timeline as timeline_lib

    wall = iter([100.0, 101.0, 103.0, 107.0])  # origin, then one reading per record
    cpu = iter([5.0, 6.5, 6.5])
    clocks = types.SimpleNamespace(perf_counter=lambda: next(wall), process_time=lambda: next(cpu))
    monkeypatch.setattr(timeline_lib, "time", clocks)  # this module's clocks only
    timeline = Timeline({"sampler": (0,), "learner": (1,)})
    timeline.record("sample", "sampler", 0, 0.0, 0.5)
    timeline.record("update", "learner", 0, 0.5, 2.0)
    timeline.record("update", "learner", 1, 2.0, 6.0)
    assert [(s.wall, s.cpu, s.step) for s in timeline.cpu] == [
        (1.0, 5.0, 0),
        (3.0, 6.5, 0),
        (7.0, 6.5, 1),
    ]
    # 1.5 CPU seconds in the 6 wall seconds from the first sample to the last.
    assert host_cores(timeline.cpu) == 0.25
    assert timeline.to_json()["summary"]["host/cpu_cores"] == 0.25
