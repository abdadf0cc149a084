"""The timeline's arithmetic: busy fractions and overlap by hand, and the host's CPU cores
from the process's CPU-time samples."""

from __future__ import annotations

import time

import pytest

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


def _spin_cpu(seconds: float) -> None:
    """Spins until this process has used ``seconds`` more CPU time (however long that takes
    on a loaded machine)."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_timeline_samples_process_cpu():
    """The samples hold the process's CPU time: 0.3 CPU seconds spun between two phase ends
    are there (plus at most 0.1 s of the interpreter's and XLA's own threads), and a 0.3 s
    sleep adds almost none. CPU time, not wall time, so a loaded machine that deschedules the
    spin changes nothing."""
    timeline = Timeline({"sampler": (0,), "learner": (1,)})
    timeline.record("sample", "sampler", 0, 0.0, timeline.now())
    _spin_cpu(0.3)
    timeline.record("update", "learner", 0, 0.0, timeline.now())
    spun = timeline.cpu[1].cpu - timeline.cpu[0].cpu
    assert 0.3 <= spun < 0.4
    time.sleep(0.3)
    timeline.record("update", "learner", 1, 0.0, timeline.now())
    assert timeline.cpu[2].cpu - timeline.cpu[1].cpu < 0.05
    assert timeline.cpu[2].wall - timeline.cpu[1].wall >= 0.3
    assert timeline.to_json()["summary"]["host/cpu_cores"] == pytest.approx(
        host_cores(timeline.cpu)
    )
