"""The planner's cost model, part by part, against hand-computed values: rooflines, collective
bytes parsed from HLO, reshard bytes between layouts, the list scheduler's makespans, memory
rejection, cluster specs, the calibration fit and the config overlay."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.plan import candidates
from jaxrlhf.plan.calibration import Measurement, fit, from_timeline
from jaxrlhf.plan.estimate import CostModel, PlanEstimate, ScheduleShape
from jaxrlhf.plan.hardware import DEVICE_SPECS, DeviceSpec, cluster_size, parse_cluster
from jaxrlhf.plan.simulator import Task, iteration_tasks, simulate
from jaxrlhf.sharding.reshard import bytes_received
from jaxrlhf.train.config import LoraConfig
from jaxrlhf.train.program_cost import ProgramCost, collective_bytes, program_cost, roofline_seconds

# ---- roofline --------------------------------------------------------------------------------


def test_roofline_is_the_slower_of_compute_and_memory_plus_collectives():
    # 2e12 FLOPs at 1e12 FLOP/s = 2 s; 1e12 bytes at 1e12 B/s = 1 s -> compute-bound 2 s;
    # plus 5e9 collective bytes at 1e10 B/s = 0.5 s.
    cost = ProgramCost(flops=2e12, bytes_accessed=1e12, collectives=((8, 5e9),))
    assert roofline_seconds(cost, 1e12, 1e12, 1e10) == pytest.approx(2.5)
    # Each group size over its own link: 4e9 bytes in groups of 8 inside a node at 4e11 B/s
    # (0.01 s), 1e9 in groups of 64 across nodes at 5e10 B/s (0.02 s).
    h100 = DEVICE_SPECS["h100"]
    mixed = ProgramCost(flops=0, bytes_accessed=0, collectives=((8, 4.5e9), (64, 1e9)))
    assert roofline_seconds(mixed, 1.0, 1.0, h100.link_for) == pytest.approx(0.01 + 0.02)
    # Memory-bound: 4e12 bytes / 1e12 = 4 s > 2 s of compute.
    cost = ProgramCost(flops=2e12, bytes_accessed=4e12)
    assert roofline_seconds(cost, 1e12, 1e12, 1e10) == pytest.approx(4.0)


def test_h100_decode_step_by_hand():
    # An 8B model's decode step at batch 1 reads its 16 GB of bf16 weights once: 16e9 /
    # 3.35e12 B/s = 4.78 ms, far above its 16e9 FLOPs / 989e12 = 16 us.
    h100 = DEVICE_SPECS["h100"]
    cost = ProgramCost(flops=16e9, bytes_accessed=16e9)
    seconds = roofline_seconds(cost, h100.peak_flops, h100.memory_bandwidth, h100.link_bandwidth)
    assert seconds == pytest.approx(16e9 / 3.35e12)


def test_cost_scale_add_and_depth_extrapolation():
    one = ProgramCost(10, 100, ((2, 4.0),), devices=2)
    two = ProgramCost(16, 130, ((2, 6.0), (4, 1.0)), devices=2)
    # affine in depth: 10 + 31 x 6 = 196 FLOPs at 32 layers, 100 + 31 x 30 = 1030 bytes;
    # collectives per group size: 4 + 31 x 2 = 66 over pairs, 0 + 31 x 1 over groups of 4
    assert one.extrapolate(two, 32) == ProgramCost(196, 1030, ((2, 66.0), (4, 31.0)), 2)
    assert one.scale(3) == ProgramCost(30, 300, ((2, 12.0),), devices=2)
    assert one + two == ProgramCost(26, 230, ((2, 10.0), (4, 1.0)), devices=2)
    assert two.collective_bytes == 7.0


def test_program_cost_counts_a_matmul_and_a_loop_body_once():
    x = jnp.ones((64, 32), jnp.float32)
    w = jnp.ones((32, 16), jnp.float32)
    compiled = jax.jit(lambda x, w: x @ w).lower(x, w).compile()
    cost = program_cost(compiled, 1)
    assert cost.flops == pytest.approx(2 * 64 * 32 * 16, rel=0.01)
    # bytes accessed: read x and w, write the result (float32)
    assert cost.bytes_accessed == pytest.approx(4 * (64 * 32 + 32 * 16 + 64 * 16), rel=0.01)
    assert cost.collective_bytes == 0

    def ten(x, w):  # a scan of 10 matmuls: XLA's cost analysis counts its body once
        y, _ = jax.lax.scan(lambda c, _: (c @ w[:, :32], None), x, None, length=10)
        return y

    w2 = jnp.ones((32, 32), jnp.float32)
    looped = program_cost(jax.jit(ten).lower(x, w2).compile(), 1)
    assert looped.flops == pytest.approx(2 * 64 * 32 * 32, rel=0.05)


HLO = """
  %all-reduce = f32[512]{0} all-reduce(%x), channel_id=1, replica_groups=mesh['a'=4,'b'=2] {'a'}
  %ag = bf16[8,128]{1,0} all-gather(%y), replica_groups={{0,1},{2,3}}, dimensions={0}
  %rs = (f32[4]{0}, f32[2,2]{1,0}) reduce-scatter(%p, %q), replica_groups=[2,4]<=[8]
  %cp = s32[10]{0} collective-permute(%z), source_target_pairs={{0,1},{1,0}}
  %ars = f32[256]{0} all-reduce-start(%w), replica_groups={{0,1,2,3,4,5,6,7}}
  %ard = f32[256]{0} all-reduce-done(%ars)
  %ags = (f32[8]{0}, f32[64]{0}) all-gather-start(%v), replica_groups=[1,8]<=[8], dimensions={0}
  %agd = f32[64]{0} all-gather-done(%ags)
  %add = f32[512]{0} add(%all-reduce, %all-reduce)
"""


def test_collective_bytes_by_hand():
    expected = {
        4: 2 * 3 / 4 * 512 * 4  # all-reduce of 2 KiB over the 4 devices of axis a
        + 3 * (4 + 4) * 4,  # reduce-scatter, groups of 4, 32 bytes of result
        2: 1 / 2 * 8 * 128 * 2  # all-gather of 2 KiB (bf16) over groups of 2
        + 10 * 4,  # collective-permute sends its 40 bytes
        8: 2 * 7 / 8 * 256 * 4  # async all-reduce counted at its start, not its done
        + 7 / 8 * 64 * 4,  # async all-gather: its result (the tuple's second half)
    }
    got = dict(collective_bytes(HLO, 8))
    assert got.keys() == expected.keys()
    for n, b in expected.items():
        assert got[n] == pytest.approx(b), n


def test_collective_bytes_of_a_sharded_program(cpu_devices):
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
    x = jax.ShapeDtypeStruct((256, 512), jnp.float32, sharding=NamedSharding(mesh, P("d")))
    f = jax.jit(lambda x: x.sum(0), out_shardings=NamedSharding(mesh, P()))
    cost = program_cost(f.lower(x).compile(), 4)
    # per device: a [64, 512] shard summed -> 512 floats all-reduced over 4 devices
    assert cost.collective_bytes == pytest.approx(2 * 3 / 4 * 512 * 4)
    assert cost.devices == 4


# ---- reshard bytes --------------------------------------------------------------------------


def test_reshard_bytes_by_hand(cpu_devices):
    devices = jax.devices()[:4]
    mesh = jax.make_mesh((4,), ("d",), devices=devices)
    leaf = jax.ShapeDtypeStruct((8, 16), jnp.float32)  # 512 bytes
    rows = NamedSharding(mesh, P("d", None))  # each device holds 2 rows (128 bytes)
    cols = NamedSharding(mesh, P(None, "d"))  # each device holds 4 columns (128 bytes)
    replicated = NamedSharding(mesh, P())
    # rows -> columns: each device keeps the 2 x 4 block where its rows and columns meet
    # (32 bytes) and receives 96.
    moved = bytes_received(rows, cols, leaf)
    assert set(moved) == set(devices) and all(v == 96 for v in moved.values())
    # rows -> replicated: each device receives the 384 bytes it lacks.
    assert set(bytes_received(rows, replicated, leaf).values()) == {384}
    # replicated -> rows: nothing moves.
    assert set(bytes_received(replicated, rows, leaf).values()) == {0}
    # to other devices (a separated sampler): everything moves, 256 bytes per half.
    other = jax.make_mesh((2,), ("d",), devices=jax.devices()[4:6])
    moved = bytes_received(rows, NamedSharding(other, P("d", None)), leaf)
    assert set(moved) == set(jax.devices()[4:6]) and set(moved.values()) == {256}


# ---- the simulator --------------------------------------------------------------------------


def test_simulator_makespan_on_a_hand_built_graph():
    # a (3 s on X) -> c (2 s on X, Y); b (4 s on Y) independent; d (1 s on X) after b.
    tasks = [
        Task("a", ("X",), 3.0),
        Task("c", ("X", "Y"), 2.0, ("a",)),
        Task("b", ("Y",), 4.0),
        Task("d", ("X",), 1.0, ("b",)),
    ]
    s = simulate(tasks)
    # a 0-3 on X, b 0-4 on Y; c needs X and Y: 4-6; d needs b (4) and X: starts 4 before c
    # (both ready at 4; the earlier-listed c wins the tie), so d 6-7.
    assert (s.start["a"], s.start["b"], s.start["c"], s.start["d"]) == (0, 0, 4, 6)
    assert s.makespan == 7
    assert s.busy("X") == 3 + 2 + 1 and s.busy("Y") == 4 + 2


def test_simulator_backfills_a_task_ready_earlier():
    # Listed after a task that must wait, an independent task still starts at 0.
    tasks = [Task("a", ("X",), 5.0), Task("wait", ("Y",), 1.0, ("a",)), Task("free", ("Y",), 2.0)]
    s = simulate(tasks)
    assert s.start["free"] == 0 and s.start["wait"] == 5 and s.makespan == 6


def test_shared_host_simulator_shares_the_cores():
    # X (2 s alone) and Y (4 s alone) at once on one host: each at half speed until X ends
    # at 4 s (2 s of work), then Y's last 2 s alone: 6 s, the sum of the work.
    s = simulate([Task("x", ("X",), 2.0), Task("y", ("Y",), 4.0)], shared_host=True)
    assert (s.end["x"], s.end["y"], s.makespan) == (4.0, 6.0, 6.0)
    # A dependency chain runs alone: 2 + 4 s.
    chain = [Task("x", ("X",), 2.0), Task("y", ("Y",), 4.0, ("x",))]
    assert simulate(chain, shared_host=True).makespan == 6.0
    # Groups still run one task at a time: z waits for x on X, then shares with y.
    tasks = [Task("x", ("X",), 2.0), Task("z", ("X",), 1.0), Task("y", ("Y",), 4.0)]
    s = simulate(tasks, shared_host=True)
    assert s.start["z"] == 4.0 and s.end["z"] == 6.0 and s.end["y"] == 7.0


def test_simulator_rejects_bad_graphs():
    with pytest.raises(ValueError, match="appears twice"):
        simulate([Task("a", ("X",), 1.0), Task("a", ("X",), 1.0)])
    with pytest.raises(ValueError, match="never runs"):
        simulate([Task("a", ("X",), 1.0, ("ghost",))])


PHASES = {"generate": 6.0, "score": 1.0, "train": 3.0, "sync": 0.5}


def _period(tasks, n):
    s = simulate(tasks)
    return (s.end[f"train{n - 1}"] - s.end["train1"]) / (n - 2)


def test_colocated_iteration_is_the_sum_of_phases():
    n = 6
    assert _period(iteration_tasks(PHASES, separated=False, iterations=n), n) == 10.5


def test_separated_iteration_by_staleness():
    n = 10
    # staleness 0: generate waits for the previous update's weights: 6 + 1 + 3 + 0.5.
    sync = iteration_tasks(PHASES, separated=True, iterations=n, max_staleness=0)
    assert _period(sync, n) == pytest.approx(10.5)
    # staleness 1: the sampler never waits; its 6 s + the 0.5 s copy of new weights per
    # iteration set the pace (the learner's 4 s fits inside).
    stale = iteration_tasks(PHASES, separated=True, iterations=n, max_staleness=1)
    assert _period(stale, n) == pytest.approx(6.5)
    # Syncing every 2nd update halves the copies, if the bound lets the sampler run ahead:
    # staleness 2: 6 + 0.25 per iteration.
    every2 = iteration_tasks(
        PHASES, separated=True, iterations=n, max_staleness=2, weight_sync_every=2
    )
    assert _period(every2, n) == pytest.approx(6.25)
    # At staleness 1, rollout 2j needs update 2j - 1's weights (update 2j - 2's are never
    # sent): after generate 2j - 1 the sampler waits for its score + update (4 s) and the
    # copy (0.5 s), then generates twice: (4 + 0.5 + 6 + 6) / 2 = 8.25 s per iteration.
    tight = iteration_tasks(
        PHASES, separated=True, iterations=n, max_staleness=1, weight_sync_every=2
    )
    assert _period(tight, n) == pytest.approx(8.25)
    # A learner slower than the sampler sets the pace instead: 2 + 9 = 11 s per iteration.
    slow = {"generate": 6.0, "score": 2.0, "train": 9.0, "sync": 0.5}
    tasks = iteration_tasks(slow, separated=True, iterations=n, max_staleness=1)
    assert _period(tasks, n) == pytest.approx(11.0)


def test_interleaved_iteration_by_hand():
    """An interleaved plan's critic group scores each rollout beside the learner's scoring
    forwards and updates beside the policy's update, both once every forward is in (the
    advantages need them); the next iteration waits for both updates: 2 + max(1, 2) +
    max(3, 5) = 9 s per iteration. On one host's cores shared as a fluid (contention 1) the
    overlap buys nothing: the sum of all the work, 13 s; with independent devices
    (contention 0) 9 s again. A reference group (a forward, no update): 2 + 4 + 3."""
    phases = {"generate": 2.0, "score": 1.0, "train": 3.0, "sync": 0.0}
    critic = {**phases, "score:critic": 2.0, "train:critic": 5.0}
    n = 6
    tasks = iteration_tasks(critic, separated=False, iterations=n)
    assert {t.groups for t in tasks} == {("learner",), ("critic",)}
    assert _period(tasks, n) == pytest.approx(9.0)
    shared = ScheduleShape(separated=False, staleness=0, sync_every=1, shared_host=True)
    assert shared.period(critic, 1.0) == pytest.approx(13.0)
    assert shared.period(critic, 0.0) == pytest.approx(9.0)
    reference = {**phases, "score:reference": 4.0}
    tasks = iteration_tasks(reference, separated=False, iterations=n)
    assert _period(tasks, n) == pytest.approx(9.0)
    # With a sampler group of its own at staleness 1 the sampler's 1 s + 0.1 s copy is not
    # the pace: the learner's iteration is, the slower side of each stage one after the
    # other, max(4, 1) + max(1, 4) = 8 s (the learner's next forward waits for the critic's
    # update: the trainer learns one iteration at a time).
    crossed = {"generate": 1.0, "score": 4.0, "train": 1.0, "sync": 0.1}
    crossed.update({"score:critic": 1.0, "train:critic": 4.0})
    stale = iteration_tasks(crossed, separated=True, iterations=10, max_staleness=1)
    assert _period(stale, 10) == pytest.approx(8.0)


# ---- clusters, memory, calibration, overlays ------------------------------------------------


def test_cluster_specs():
    assert cluster_size("h100x8") == ("h100", 8)
    assert cluster_size("8xh100") == ("h100", 8)
    assert cluster_size("tpu-v5e-64") == ("tpu-v5e", 64)
    assert cluster_size("cpu") == ("cpu", 1)
    with pytest.raises(ValueError, match="unknown device kind 'v100'"):
        cluster_size("v100x8")
    with pytest.raises(ValueError, match="count must be >= 1"):
        cluster_size("h100x0")
    host = DeviceSpec("cpu", 100e9, 20e9, 20e9, 20e9, 16 * 2**30, 1 << 16)
    c = parse_cluster("cpu-2", cpu=host)  # each device: the host's cores, half its memory
    assert c.count == 2 and c.spec.peak_flops == 100e9 and c.spec.memory_bytes == 8 * 2**30
    assert c.shared_host and not parse_cluster("h100x8").shared_host
    h100 = DEVICE_SPECS["h100"]
    assert h100.link_for(8) == h100.link_bandwidth and h100.link_for(16) == h100.network_bandwidth
    tpu = DEVICE_SPECS["tpu-v5e"]
    assert tpu.link_for(256) == tpu.link_bandwidth  # one slice's ICI


def _estimate(phases, shape=None):
    shape = shape or ScheduleShape(separated=False, staleness=0, sync_every=1, shared_host=False)
    return PlanEstimate(
        label="p",
        overlay={},
        phases=phases,
        iteration_s=sum(phases.values()),
        idle_fraction=0.0,
        programs=(),
        reshard_bytes=0,
        peak_bytes=0,
        groups={"all": 1},
        schedule=shape,
        phase_devices=dict.fromkeys(phases, 1),
    )


def test_fit_recovers_efficiencies_and_host_time():
    # Roofline 1 s generate, 2 s score, 4 s train; measured 2 s, 2.5 s, 8 s: efficiencies
    # 0.5, 0.8, 0.5; a period 1 s longer than the phases' sum is host time.
    predicted = _estimate({"generate": 1.0, "score": 2.0, "train": 4.0, "sync": 0.0})
    measured = Measurement("p", {"generate": 2.0, "score": 2.5, "train": 8.0, "sync": 0.0}, 13.5)
    model = fit([(predicted, measured)], "p")
    assert model.efficiency["generate"] == pytest.approx(0.5)
    assert model.efficiency["score"] == pytest.approx(0.8)
    assert model.efficiency["train"] == pytest.approx(0.5)
    assert model.host_seconds == {"score": pytest.approx(1.0)}
    again = CostModel.from_json(model.to_json(), "m.json")
    assert again == model


def test_fit_recovers_the_contention_of_a_shared_host():
    """Synthetic runs on a 2-device CPU host: separated at staleness 1 with phases of 1 s
    (generate), 0.5 s (score) and 1.5 s (train) alone and a true contention of 0.4, plus the
    same plan at staleness 0. The fit sees only wall times and overlaps, as a timeline gives
    them, and recovers efficiency 1 and contention 0.4."""
    unit = {"generate": 1.0, "score": 0.5, "train": 1.5, "sync": 0.0}
    pairs = []
    for staleness in (0, 1):
        shape = ScheduleShape(separated=True, staleness=staleness, sync_every=1, shared_host=True)
        tasks = iteration_tasks(unit, separated=True, iterations=12, max_staleness=staleness)
        sched = simulate(tasks, shared_host=True, contention=0.4)
        steps = range(3, 8)
        walls, overlaps = dict.fromkeys(unit, 0.0), dict.fromkeys(unit, 0.0)
        for t in tasks:
            phase = t.name.rstrip("0123456789")
            i = int(t.name[len(phase) :])
            if i not in steps:
                continue
            a, b = sched.start[t.name], sched.end[t.name]
            walls[phase] += b - a
            others = [u for u in tasks if not set(u.groups) & set(t.groups)]
            overlaps[phase] += sum(
                max(0.0, min(b, sched.end[u.name]) - max(a, sched.start[u.name])) for u in others
            )
        k = len(steps)
        measured = Measurement(
            f"s{staleness}",
            {p: w / k for p, w in walls.items()},
            (sched.end["train7"] - sched.end["train3"]) / 4,
            {p: overlaps[p] / walls[p] if walls[p] else 0.0 for p in unit},
        )
        pairs.append((_estimate(unit, shape), measured))
    model = fit(pairs, "synthetic")
    assert model.contention == pytest.approx(0.4)
    for phase in ("generate", "score", "train"):
        assert model.efficiency[phase] == pytest.approx(1.0, rel=1e-6)


def test_cost_model_file_errors():
    from jaxrlhf.config import ConfigError

    with pytest.raises(ConfigError, match="m.json: not a cost model"):
        CostModel.from_json("[1, 2]", "m.json")
    with pytest.raises(ConfigError, match="m.json: efficiency 'train'"):
        CostModel.from_json('{"efficiency": {"train": 0}}', "m.json")


def test_timeline_measurement():
    phases = []
    for step in range(4):  # each iteration 10 s: sample 5, score 1, update 3 (1 s gap)
        t = 10.0 * step
        phases += [
            {"name": "sample", "step": step, "start": t, "end": t + 5},
            {"name": "score", "step": step, "start": t + 5, "end": t + 6},
            {"name": "update", "step": step, "start": t + 6, "end": t + 9},
        ]
    m = from_timeline({"phases": phases}, "x", skip=1)
    assert m.iteration_s == pytest.approx(10.0)
    assert m.phases == {"generate": 5.0, "score": 1.0, "train": 3.0, "sync": 0.0}
    with pytest.raises(ValueError, match="fewer than 2 iterations"):
        from_timeline({"phases": phases}, "x", skip=3)


def test_timeline_measurement_of_an_interleaved_run():
    """The critic's and the reference's groups are measured apart, keyed as the planner
    keys them, with the share of their time another group was busy too."""
    phases = []
    for step in range(4):  # each iteration 10 s
        t = 10.0 * step
        phases += [
            {"name": "sample", "step": step, "start": t, "end": t + 4},
            {"name": "score", "step": step, "start": t + 4, "end": t + 5},
            {"name": "score", "group": "critic", "step": step, "start": t + 4, "end": t + 6},
            {"name": "reference", "group": "reference", "step": step, "start": t + 4, "end": t + 7},
            {"name": "update", "step": step, "start": t + 7, "end": t + 9},
            {"name": "update", "group": "critic", "step": step, "start": t + 7, "end": t + 10},
        ]
    m = from_timeline({"phases": phases}, "x", skip=1)
    assert m.iteration_s == pytest.approx(10.0)
    assert m.phases == {
        "generate": 4.0,
        "score": 1.0,
        "train": 2.0,
        "sync": 0.0,
        "score:critic": 2.0,
        "score:reference": 3.0,
        "train:critic": 3.0,
    }
    # The critic's values (4-6) overlap the others for 2 s; its update (7-10) for 2 of 3.
    assert m.overlap["score:critic"] == pytest.approx(1.0)
    assert m.overlap["train:critic"] == pytest.approx(2 / 3)


def test_fit_takes_the_side_groups_phases_as_their_phase():
    """A critic group's forward and update are scoring and training programs: their
    predicted over measured seconds join those phases' efficiencies; an interleaved run gives
    no host time (its phases overlap)."""
    shape = ScheduleShape(separated=False, staleness=0, sync_every=1, shared_host=False)
    predicted = _estimate(
        {
            "generate": 1.0,
            "score": 1.0,
            "train": 1.0,
            "sync": 0.0,
            "score:critic": 1.0,
            "train:critic": 3.0,
        },  # fmt: skip
        shape,
    )
    measured = Measurement(
        "p",
        {
            "generate": 2.0,
            "score": 1.0,
            "train": 2.0,
            "sync": 0.0,
            "score:critic": 3.0,
            "train:critic": 6.0,
        },  # fmt: skip
        11.0,
    )
    model = fit([(predicted, measured)], "p")
    assert model.efficiency["generate"] == pytest.approx(0.5)
    assert model.efficiency["score"] == pytest.approx(2.0 / 4.0)
    assert model.efficiency["train"] == pytest.approx(4.0 / 8.0)
    assert model.host_seconds == {}


def test_plan_description():
    sep = {
        "placement": {
            "strategy": "separated",
            "sampler": {"devices": [0, 1], "mesh": {"data": 2, "fsdp": 1, "tensor": 1}},
            "learner": {"devices": [2, 3], "mesh": {"data": 1, "fsdp": 2, "tensor": 1}},
        },
        "grpo": {"rollout": {"max_staleness": 1}},
        "model": {"remat": "full"},
    }
    assert candidates.describe(sep, "grpo") == (
        "separated sampler 2:d2 learner 2:f2, staleness 1, remat full"
    )
    inter = {
        "placement": {
            "strategy": "interleaved",
            "critic": {"devices": [0], "mesh": {"data": 1, "fsdp": 1, "tensor": 1}},
            "learner": {"devices": [1, 2], "mesh": {"data": 1, "fsdp": 1, "tensor": 2}},
        },
    }
    assert candidates.describe(inter, "ppo") == "interleaved learner 2:t2 critic 1:d1"


def test_memory_rejection_names_the_program():
    """A plan whose peak exceeds 90% of the device is rejected with the program and sizes."""
    from jaxrlhf.plan.estimate import estimate
    from jaxrlhf.plan.hardware import Cluster

    tiny = DeviceSpec("tiny", 1e12, 1e12, 1e11, 1e10, 100 * 2**20)  # 100 MiB
    programs = (
        ("generate", "decode", 64.0, ProgramCost(1e9, 1e8), 50 * 2**20),
        ("train", "update", 1.0, ProgramCost(1e10, 1e9), 95 * 2**20),
    )
    from jaxrlhf.plan.estimate import CompiledPlan

    cfg = _grpo_config()
    e = estimate(cfg, Cluster(tiny, 1), CostModel(), compiled=CompiledPlan(programs, 0, "x"))
    assert not e.fits
    assert e.rejected == (
        "train/update needs 0.1 GiB per device, over the 0.1 GiB usable of a tiny (90%)"
    )
    # Times: decode 64 x max(1e9 / 1e12, 1e8 / 1e12) / 0.5 = 0.128 s; update 1e10 / 1e12 /
    # 0.4 = 0.025 s; colocated, so the period is their sum.
    assert e.phases["generate"] == pytest.approx(0.128)
    assert e.phases["train"] == pytest.approx(0.025)
    assert e.iteration_s == pytest.approx(0.153)
    assert math.isclose(e.idle_fraction, 0.0, abs_tol=1e-9)


def _grpo_config():
    from jaxrlhf.config import from_dict

    return from_dict({"algorithm": "grpo", "model": {"preset": "tiny"}})


@pytest.fixture
def cpu_devices():
    if len(jax.devices()) < 6:
        pytest.skip("needs 6+ CPU devices (conftest sets 8)")
    return np.arange(len(jax.devices()))


def test_layouts_and_memory_variants_of_the_8b_recipe():
    """Layouts of 8 devices for Llama-3-8B (32 heads, 8 KV heads): 46 colocated and 18
    separated, each of those twice (the reference with the learner or on the sampler's
    devices); the recipe's own (fsdp 4 x tensor 2, the sampler on the training mesh) among
    them. Separated splits are 4 + 4 only: a 2-device sampler leaves 6 learner devices,
    whose 6 or 3 data shards do not split a 16-row minibatch, and a 6-device sampler's 6 or
    3 data shards do not split 64 prompts. Its micro-batch is already one row and it already
    uses full remat: no memory variant is left to try."""
    from jaxrlhf.config import load_config

    cfg = load_config("configs/recipes/llama3_8b_ppo_8xh100.yaml")
    layouts = list(candidates.layouts(cfg, 8, cpu=False))
    moved = [o for o in layouts if o["placement"]["reference"] == "sampler"]
    separated = [o for o in layouts if o["placement"]["strategy"] == "separated"]
    interleaved = [o for o in layouts if o["placement"]["strategy"] == "interleaved"]
    assert len(layouts) - len(separated) - len(interleaved) == 46
    assert len(moved) == 18 and len(separated) == 36
    assert all(o["placement"]["strategy"] == "separated" for o in moved)
    # Interleaved: the critic or the reference on 4 devices, the learner on the other 4
    # (each of its 6 meshes); on 2 the learner's 6 or 3 data shards split no 16-row
    # minibatch. The critic's mesh has the learner's data shards, tensor on the rest.
    critic = [o["placement"] for o in interleaved if o["placement"]["critic"]]
    own = [o["placement"] for o in interleaved if o["placement"]["reference"] == "own"]
    assert len(critic) == 6 and len(own) == 6
    for p in critic:
        lm, cm = p["learner"]["mesh"], p["critic"]["mesh"]
        assert (cm["data"], cm["fsdp"]) == (lm["data"], lm["fsdp"])
        assert cm["data"] * cm["fsdp"] * cm["tensor"] == len(p["critic"]["devices"]) == 4
        assert sorted(p["critic"]["devices"] + p["learner"]["devices"]) == list(range(8))
    lora = cfg.replace(lora=LoraConfig(rank=4))
    assert not candidates.reference_may_move(lora)
    assert len(list(candidates.layouts(lora, 8, cpu=False))) == 46 + 18
    own = layouts[candidates.configured(cfg, layouts, 8)]
    assert own["mesh"] == {"data": 1, "fsdp": 4, "tensor": 2}
    assert own["placement"]["generate_mesh"] is None
    assert {len(o["placement"]["sampler"]["devices"]) for o in separated} == {4}
    # With 48 prompts (12-row minibatches, which 6 learner shards split; 48 prompts, which
    # 6 sampler shards split) the 2 + 6 and 6 + 2 splits come back.
    wider = cfg.replace(
        ppo=dataclasses.replace(
            cfg.ppo, rollout=dataclasses.replace(cfg.ppo.rollout, prompts_per_step=48)
        )
    )
    split = {
        len(o["placement"]["sampler"]["devices"])
        for o in candidates.layouts(wider, 8, False)
        if o["placement"]["strategy"] == "separated"
    }
    assert split == {2, 4, 6}
    for o in separated:  # disjoint groups covering every device
        p = o["placement"]
        assert sorted(p["sampler"]["devices"] + p["learner"]["devices"]) == list(range(8))
    assert candidates.memory_variants(cfg) == [{}]  # micro 1 and remat full already
    flat = candidates.flat(cfg, 8, cpu=False)
    assert flat["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}


def test_memory_variants_halve_the_micro_batch_then_remat():
    cfg = _grpo_config()  # 16 prompts x 4 samples = 64 rows, no micro-batching, no remat
    variants = candidates.memory_variants(cfg)
    micro = [v["train"]["micro_batch_size"] for v in variants if "model" not in v and v]
    assert micro == [32, 16, 8, 4, 2, 1]
    assert variants[len(micro) + 1] == {"model": {"remat": "full"}}
    assert len(variants) == 2 * (len(micro) + 1)


def test_layouts_whose_states_cannot_fit_are_rejected_without_compiling(monkeypatch):
    """Llama-3-8B PPO (policy + critic trained, reference + reward model frozen, all bf16:
    the recipe's weights overridden to bf16 with stochastic rounding, the layout these
    figures price) on 8 x H100 data-parallel only: each device would hold 3 x 16.1 GB of
    policy state, 3 x 15.0 GB of critic state and 31.1 GB of frozen weights, 115.7 GiB over
    the 72 GiB usable: rejected before any compile."""
    from jaxrlhf.config import read_configs
    from jaxrlhf.plan import search
    from jaxrlhf.plan.estimate import state_floor

    bf16 = ["model.param_dtype=bfloat16", "optimizer.stochastic_rounding=true"]
    data, _ = read_configs(["configs/recipes/llama3_8b_ppo_8xh100.yaml"], bf16)
    searcher = search.Searcher(data, parse_cluster("h100x8"), "recipe", log=lambda s: None)

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled")

    monkeypatch.setattr(search, "compile_plan", no_compile)
    dp = {"placement": {"strategy": "colocated"}, "mesh": {"data": 8, "fsdp": 1, "tensor": 1}}
    assert searcher.layout(dp, CostModel()) == math.inf
    (rejected,) = searcher.evaluated
    assert "states alone need over 115.7 GiB per device" in rejected.error
    # fsdp 4 x tensor 2: an eighth of the states, plus the sampler's copy of the policy
    # (16.06 GB, whole over fsdp, halved by tensor: 7.48 GiB).
    fsdp = searcher.config({"mesh": {"data": 1, "fsdp": 4, "tensor": 2}})
    assert state_floor(fsdp) == pytest.approx((115.75 / 8 + 7.48) * 2**30, rel=1e-3)


def test_annealing_walk_stays_within_its_time_limit_and_sees_both_strategies():
    """Annealing over 40 fake layouts (cost = its index + 1; each evaluation takes 1 s of a
    fake clock) with a 12 s limit: it stops after the limit, starts where told, and reaches
    separated layouts although they share no feature with the colocated start."""
    from jaxrlhf.plan.search import search

    layouts = [
        {"placement": {"strategy": "colocated", "generate_mesh": None}, "mesh": {"fsdp": i}}
        for i in range(20)
    ] + [
        {
            "placement": {
                "strategy": "separated",
                "sampler": {"devices": [0], "mesh": {"data": i}},
                "learner": {"devices": [1], "mesh": {"fsdp": i}},
            }
        }
        for i in range(20)
    ]
    now = [0.0]
    visited = []

    class FakeSearcher:
        def layout(self, overlay, model):
            now[0] += 1.0
            visited.append(layouts.index(overlay))
            return float(visited[-1] + 1)

    how = search(
        FakeSearcher(), layouts, CostModel(), time_limit_s=12, first=5, clock=lambda: now[0]
    )
    assert visited[0] == 5 and 12 <= len(visited) <= 14
    assert how.startswith(f"annealing, {len(visited)} of 40 layouts")
    assert any(i >= 20 for i in visited) and len(set(visited)) == len(visited)


def test_state_floor_counts_each_parameter_dtypes_bytes():
    """GRPO on one device: the trained policy's parameters and two Adam moments plus the
    frozen reference, 4 copies of the tiny model's parameters at 4 bytes each in float32,
    2 in bfloat16 (trained with stochastic rounding)."""
    from jaxrlhf.config import load_config
    from jaxrlhf.models import model as model_lib
    from jaxrlhf.plan.estimate import state_floor

    one = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]
    f32 = load_config("configs/tiny_grpo.yaml", one)
    lm = model_lib.param_count(model_lib.abstract_params(f32.model.resolve()))
    assert state_floor(f32) == 4 * lm * 4
    bf16 = ["model.param_dtype=bfloat16", "optimizer.stochastic_rounding=true"]
    assert state_floor(load_config("configs/tiny_grpo.yaml", [*one, *bf16])) == 4 * lm * 2
