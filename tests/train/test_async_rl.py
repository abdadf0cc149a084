"""Placement strategies and asynchronous RL on 8 CPU devices: the separated placement does the
colocated math, ``max_staleness: 0`` is the synchronous algorithm bit for bit, ``k >= 1``
trains on samples at most k versions old (read back from the logged versions), a resumed
asynchronous run repeats the uninterrupted one, and the timeline records both groups."""

from __future__ import annotations

import dataclasses
import json
import os
import signal

import jax
import numpy as np
import pytest

from jaxrlhf.config import ConfigError, validate
from jaxrlhf.sharding.mesh import MeshError
from jaxrlhf.train import loop
from jaxrlhf.train.metrics import read_history
from jaxrlhf.train.rl_trainer import build_rl_trainer
from jaxrlhf.train.timeline import TIMELINE_FILE
from tests.tiers import tiered
from tests.train.test_rl import _config

SEPARATED = ("placement.strategy=separated", "placement.sampler={devices: [0, 1, 2, 3]}")
# One sampler device: its programs run on the calling thread, so sampling and learning can
# be in flight at once on XLA:CPU's default pool (jaxrlhf.platform).
ASYNC = (
    "placement.strategy=separated",
    "placement.sampler={devices: [0]}",
    "placement.learner={devices: [4, 5, 6, 7]}",
    "logging.progress=none",
    "logging.plot=false",
)


# The reference-placement tests' runs: KL in GRPO's loss and in PPO's reward, 2 minibatches
# (so the learner runs an old-policy forward beside a reference scored apart).
GRPO_KL = ("grpo", ("grpo.loss.kl_coef=0.1", "grpo.loss.num_minibatches=2"))
PPO_KL_REWARD = (
    "ppo.loss.kl_mode=reward",
    "ppo.loss.kl_coef=0.1",
    "ppo.loss.num_minibatches=2",
    "ppo.rollout.num_samples=4",
)

# Partial rollouts: the engine over-samples 2 groups and carries the unfinished ones.
PARTIAL = (
    "grpo.rollout.engine=continuous",
    "grpo.rollout.stream_scoring=false",
    "grpo.rollout.oversample_groups=2",
    "grpo.rollout.partial_rollouts=true",
    "grpo.rollout.chunk_tokens=2",
)


@pytest.mark.slow
def test_separated_does_the_colocated_math(tmp_path):
    """The same rollout learned on all 8 devices and on the learner group (devices 4-7, the
    sampler on 0-3): the same update to 1e-5."""
    out = {}
    rollout = None
    for name, overrides in (("colocated", ()), ("separated", SEPARATED)):
        cfg, src = _config(_dir(tmp_path / name), "grpo", "grpo.loss.kl_coef=0.1", *overrides)
        trainer = build_rl_trainer(cfg, source=src)
        if name == "separated":
            assert [d.id for d in trainer.sampler.mesh.devices.flat] == [0, 1, 2, 3]
            assert [d.id for d in trainer.mesh.devices.flat] == [4, 5, 6, 7]
        else:
            assert trainer.mesh.size == 8 and trainer.sampler.mesh is trainer.mesh
        if rollout is None:
            rollout, _ = trainer.rollout(jax.random.key(1))
        metrics = trainer.learn(rollout, jax.random.key(2))
        out[name] = (jax.device_get(trainer.policy_state.params), metrics)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0),
        out["colocated"][0],
        out["separated"][0],
    )
    for key in ("loss/policy", "kl/seq_mean", "policy/clip_frac"):
        np.testing.assert_allclose(out["colocated"][1][key], out["separated"][1][key], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algo", "overrides"),
    [
        GRPO_KL,
        ("ppo", PPO_KL_REWARD),
    ],
    ids=["grpo-kl-loss", "ppo-kl-reward"],
)
def test_reference_on_the_sampler_does_the_colocated_math(tmp_path, algo, overrides):
    """``placement.reference: sampler``: the reference's log-probs scored on the sampler's
    devices (0-3) after sampling, the learner (4-7) holding no copy of it. Its log-probs equal
    the colocated scoring's (all 8 devices) on every response token and the same rollout
    gives the same update, to 1e-5 (the same forward on another sharding and packing:
    rounding differs in the last bits)."""
    sampler_ref = (*SEPARATED, "placement.reference=sampler")
    cfg, src = _config(_dir(tmp_path / "apart"), algo, *overrides, *sampler_ref)
    apart = build_rl_trainer(cfg, source=src)
    assert apart.ref_params is None
    devices = {d.id for x in jax.tree.leaves(apart.apart_ref_params) for d in x.devices()}
    assert devices == {0, 1, 2, 3}
    cfg, src = _config(_dir(tmp_path / "colocated"), algo, *overrides)
    colocated = build_rl_trainer(cfg, source=src)
    # Two iterations on the same rollouts: in the second the policy has moved from the
    # reference, so the KL (and its gradient) is not 0 and reads the reference's values.
    for step in range(2):
        rollout, timings = apart.rollout(jax.random.key(1 + step))
        assert rollout.ref_logprobs is not None and timings["time/reference_s"] > 0
        apart_metrics = apart.learn(rollout, jax.random.key(10 + step))
        used = jax.device_get(apart.last_scored.ref_logprobs)
        np.testing.assert_array_equal(used, rollout.ref_logprobs)  # read as carried
        metrics = colocated.learn(rollout.replace(ref_logprobs=None), jax.random.key(10 + step))
        scored = jax.device_get(colocated.last_scored.ref_logprobs)
        resp = rollout.response_mask  # past a response's end padded forwards are unread
        np.testing.assert_allclose(rollout.ref_logprobs * resp, scored * resp, atol=1e-5)
        assert np.abs(rollout.ref_logprobs * resp).min(where=resp, initial=np.inf) > 0
        params = [jax.device_get(t.policy_state.params) for t in (colocated, apart)]
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0), *params)
        for key in ("loss/policy", "kl/seq_mean", "policy/clip_frac"):
            np.testing.assert_allclose(metrics[key], apart_metrics[key], atol=1e-5)
    assert abs(metrics["kl/seq_mean"]) > 1e-4  # the second iteration's KL is not 0
    # A rollout that comes without them (built by hand) gets them scored on the sampler.
    bare = apart.learn(rollout.replace(ref_logprobs=None), jax.random.key(20))
    assert bare["time/reference_s"] > 0


def _staleness_1_run_with_the_reference_apart(tmp_path, *placement: str) -> dict:
    """A 3-iteration GRPO run at staleness 1 (KL 0.1) with ``placement``: every iteration
    trains at the staleness expected with the reference's log-probs scored apart and a
    finite KL. Returns its timeline.json."""
    cfg, src = _config(
        tmp_path,
        "grpo",
        *ASYNC,
        "train.steps=3",
        "grpo.loss.kl_coef=0.1",
        "grpo.rollout.max_staleness=1",
        *placement,
    )
    result = loop.run(cfg, source=src)
    rows = _history(result.run_dir)
    assert [int(r["rollout/staleness"]) for r in rows] == [0, 1, 1]
    assert all(r["time/reference_s"] > 0 and np.isfinite(r["kl/seq_mean"]) for r in rows)
    return json.load(open(os.path.join(result.run_dir, TIMELINE_FILE)))


@pytest.mark.slow
def test_asynchronous_run_scores_the_reference_on_the_sampler(tmp_path):
    """With staleness 1 the sampler's thread scores the reference after each batch: the
    timeline holds its phase on the sampler's device and a staleness-1 run trains."""
    timeline = _staleness_1_run_with_the_reference_apart(tmp_path, "placement.reference=sampler")
    phases = [p for p in timeline["phases"] if p["name"] == "reference"]
    assert len(phases) == 3 and all(p["devices"] == [0] for p in phases)
    assert timeline["summary"]["host/cpu_cores"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("minibatches", [2, 1])
def test_asynchronous_run_scores_the_reference_on_its_own_group(tmp_path, minibatches):
    """Staleness 1 with the reference on its own device (1): each iteration's reference
    forward is recorded there and the run trains with a finite KL. The timeline measures the
    learner-reference overlap from the learner's own phases. With 2 minibatches the
    learner's old-policy forward (as long as the reference's) runs beside the reference's:
    the overlap is not 0 (it is exactly 0 when the two run one after the other; measured on
    an idle 2-core VM: all of the reference's time). With 1 the update's forward stands in
    for it and the learner's scoring forward computes nothing, so how much of the reference
    it overlaps is only dispatch and scheduling (measured idle: 2%; a CI run under load
    measured over half): no bound is asserted on it, only the phases."""
    timeline = _staleness_1_run_with_the_reference_apart(
        tmp_path,
        "placement.strategy=interleaved",
        "placement.reference=own",
        "placement.reference_group={devices: [1]}",
        f"grpo.loss.num_minibatches={minibatches}",
    )
    phases = [p for p in timeline["phases"] if p["group"] == "reference"]
    assert [(p["name"], p["step"], p["devices"]) for p in phases] == [
        ("reference", step, [1]) for step in range(3)
    ]
    learner = [p for p in timeline["phases"] if p["group"] == "learner" and p["name"] == "score"]
    assert sorted({p["step"] for p in learner}) == [0, 1, 2]
    if minibatches == 2:
        assert timeline["summary"]["reference_overlap_frac"] > 0
    assert timeline["groups"]["reference"] == [1]


@pytest.mark.slow
@pytest.mark.parametrize("models", [(), ("lora.rank=4",)], ids=["full", "lora"])
def test_interleaved_does_the_colocated_math(tmp_path, models):
    """PPO with the critic on device 1 (its value forward and update there, the update from a
    host thread at the same time as the policy's on device 0) and the sampler on device 2:
    the same rollout gives the same policy and critic as everything on device 0, to 1e-5.
    With LoRA learners the critic's group holds its own copy of the frozen base."""
    out, rollout = {}, None
    interleaved = (
        "placement.strategy=interleaved",
        "placement.learner={devices: [0]}",
        "placement.critic={devices: [1]}",
        "placement.sampler={devices: [2]}",
    )
    for name, overrides in (("colocated", ("placement.train_devices=1",)), ("apart", interleaved)):
        cfg, src = _config(
            _dir(tmp_path / name), "ppo", "ppo.loss.num_minibatches=2", *models, *overrides
        )
        trainer = build_rl_trainer(cfg, source=src)
        if name == "apart":
            assert [d.id for d in trainer.programs.critic_mesh.devices.flat] == [1]
            critic_leaves = jax.tree.leaves((trainer.value_state.params, trainer.value_frozen))
            assert {d for x in critic_leaves for d in x.sharding.device_set} == {jax.devices()[1]}
        if rollout is None:
            rollout, _ = trainer.rollout(jax.random.key(1))
        metrics = trainer.learn(rollout, jax.random.key(2))
        params = jax.device_get((trainer.policy_state.params, trainer.value_state.params))
        out[name] = (params, metrics, trainer)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0),
        out["colocated"][0],
        out["apart"][0],
    )
    for key in ("loss/policy", "loss/value", "value/explained_var", "kl/seq_mean"):
        np.testing.assert_allclose(out["colocated"][1][key], out["apart"][1][key], atol=1e-5)
    groups = {(p.name, p.group) for p in out["apart"][2].timeline.phases}
    assert {("score", "critic"), ("update", "critic"), ("update", "learner")} <= groups


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algo", "overrides"),
    [
        GRPO_KL,
        ("ppo", (*PPO_KL_REWARD, "placement.critic={devices: [2]}")),
        (
            "ppo",
            (
                "ppo.loss.kl_mode=reward",
                "ppo.loss.kl_coef=0.1",
                "ppo.rollout.num_samples=4",
            ),
        ),
    ],
    ids=["grpo", "ppo-with-critic-group", "ppo-critic-with-the-learner"],
)
def test_reference_on_its_own_group_does_the_colocated_math(tmp_path, algo, overrides):
    """``interleaved`` with ``reference: own``: the reference's forward on device 1 (from a
    host thread, while the old-policy forward runs on the learner's device 0; PPO's critic
    on device 2 too, or with the policy), the sampler on device 3. Two iterations on the
    same rollouts (the second with a non-zero KL) give the same reference log-probs,
    parameters and metrics as everything on device 0, to 1e-5 (the same forwards at other
    micro-batch shapes and packing: rounding differs in the last bits)."""
    own = (
        "placement.strategy=interleaved",
        "placement.learner={devices: [0]}",
        "placement.reference=own",
        "placement.reference_group={devices: [1]}",
        "placement.sampler={devices: [3]}",
    )
    cfg, src = _config(_dir(tmp_path / "apart"), algo, *overrides, *own)
    apart = build_rl_trainer(cfg, source=src)
    assert apart.ref_params is None and apart.programs.reference_mesh.size == 1
    devices = {d.id for x in jax.tree.leaves(apart.apart_ref_params) for d in x.devices()}
    assert devices == {1}
    colocated_overrides = [o for o in overrides if not o.startswith("placement.")]
    cfg, src = _config(
        _dir(tmp_path / "colocated"), algo, *colocated_overrides, "placement.train_devices=1"
    )
    colocated = build_rl_trainer(cfg, source=src)
    for step in range(2):
        rollout, timings = apart.rollout(jax.random.key(1 + step))
        assert rollout.ref_logprobs is None and "time/reference_s" not in timings
        apart_metrics = apart.learn(rollout, jax.random.key(10 + step))
        assert apart_metrics["time/reference_s"] > 0
        metrics = colocated.learn(rollout, jax.random.key(10 + step))
        resp = rollout.response_mask
        ref = [jax.device_get(t.last_scored.ref_logprobs) * resp for t in (colocated, apart)]
        np.testing.assert_allclose(*ref, atol=1e-5)
        assert np.abs(ref[1]).min(where=resp, initial=np.inf) > 0
        params = [jax.device_get(t.policy_state.params) for t in (colocated, apart)]
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0), *params)
        for key in ("loss/policy", "kl/seq_mean", "policy/clip_frac"):
            np.testing.assert_allclose(metrics[key], apart_metrics[key], atol=1e-5, err_msg=key)
    assert abs(metrics["kl/seq_mean"]) > 1e-4  # the second iteration's KL is not 0
    phases = [p for p in apart.timeline.phases if p.group == "reference"]
    assert [(p.name, p.step, p.devices) for p in phases] == [
        ("reference", 0, (1,)),
        ("reference", 0, (1,)),
    ]


@pytest.mark.slow
def test_interleaved_with_streamed_engine_scoring_does_the_same_math(tmp_path):
    """PPO through the rollout engine with streamed scoring: interleaved (the reference and
    old-policy forwards streamed on the learner's device while the tail decodes, the critic's
    values scored after the rollout on its own device) against the critic beside the policy
    on device 0 (``separated``); the sampler on device 2 in both. One whole iteration each:
    the same samples, metrics and parameters to 1e-5 (forwards in other batch shapes round
    differently)."""
    engine = (
        "ppo.rollout.engine=continuous",
        "ppo.rollout.slots=4",
        "ppo.rollout.chunk_tokens=2",
        "ppo.rollout.num_samples=2",
        "train.micro_batch_size=2",
        "placement.sampler={devices: [2]}",
        "placement.learner={devices: [0]}",
    )
    out = {}
    for name, overrides in (
        ("together", ("placement.strategy=separated",)),
        ("apart", ("placement.strategy=interleaved", "placement.critic={devices: [1]}")),
    ):
        cfg, src = _config(
            _dir(tmp_path / name), "ppo", "ppo.loss.kl_coef=0.1", *engine, *overrides
        )
        trainer = build_rl_trainer(cfg, source=src)
        metrics = trainer.step().metrics
        assert metrics["time/score_streamed_s"] > 0
        params = jax.device_get((trainer.policy_state.params, trainer.value_state.params))
        out[name] = (params, metrics)
    for key in ("response/length_mean", "reward/mean"):
        assert out["together"][1][key] == out["apart"][1][key], key  # identical samples
    keys = ("loss/policy", "loss/value", "value/explained_var", "kl/seq_mean", "grad_norm")
    for key in keys:
        np.testing.assert_allclose(
            out["together"][1][key], out["apart"][1][key], atol=1e-5, rtol=1e-5, err_msg=key
        )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0),
        out["together"][0],
        out["apart"][0],
    )


def test_weights_reach_the_sampler_every_k_updates(tmp_path):
    """k = 2, weights synced every 2 updates: refreshed at versions 0, 2 and 4 only; rollouts
    0-2 use version 0, 3-4 version 2, 5 version 4 (each at most 2 versions old)."""
    cfg, src = _config(
        tmp_path,
        "grpo",
        *ASYNC,
        "train.steps=6",
        "placement.weight_sync_every=2",
        "grpo.rollout.max_staleness=2",
    )
    trainer = build_rl_trainer(cfg, source=src)
    rows = [trainer.step().metrics for _ in range(6)]
    assert [r["rollout/policy_version"] for r in rows] == [0, 0, 0, 2, 2, 4]
    synced = [p.step for p in trainer.timeline.phases if p.name == "sync"]
    assert synced == [0, 2, 4]
    assert all(r["reshard/bytes_moved"] > 0 for r in (rows[0], rows[3], rows[5]))
    assert all(r["reshard/bytes_moved"] == 0 for r in (rows[1], rows[2], rows[4]))


def test_two_multi_device_programs_in_flight_need_a_larger_cpu_pool(tmp_path, monkeypatch):
    """Sampling on 4 CPU devices while learning on 4 others would starve XLA:CPU's client
    pool (8 threads: the refusal reads NPROC, which tests/conftest.py raises to 16 for the
    suite itself; jaxrlhf.platform): refused with the fix, not serialised quietly;
    likewise three groups whose multi-device programs together need more threads."""
    monkeypatch.setenv("NPROC", "8")
    cfg, src = _config(tmp_path, "grpo", *SEPARATED, "grpo.rollout.max_staleness=1")
    message = "max_staleness: programs on 4 and 4 CPU devices at once need 16"
    with pytest.raises(MeshError, match=message):
        build_rl_trainer(cfg, source=src)
    # Three groups in flight: the learner on one device, the sampler's thread on 4 and the
    # reference's on 2: each beside the learner alone would fit, the three together do not.
    cfg, src = _config(
        tmp_path,
        "grpo",
        "placement.strategy=interleaved",
        "placement.sampler={devices: [0, 1, 2, 3]}",
        "placement.reference=own",
        "placement.reference_group={devices: [4, 5]}",
        "placement.learner={devices: [6]}",
        "grpo.rollout.max_staleness=1",
    )
    message = (
        "rollout.max_staleness, placement.reference_group: programs on 1 and 4 and 2 CPU "
        "devices at once need 12 XLA:CPU client threads, this process has 8"
    )
    with pytest.raises(MeshError, match=message):
        build_rl_trainer(cfg, source=src)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["placement.strategy=separated", "placement.sampler={devices: [0, 9]}"],
            "placement.sampler.devices: device 9 does not exist (8 devices)",
        ),
        (
            [
                "placement.strategy=separated",
                "placement.sampler={devices: [0, 1]}",
                "placement.learner={devices: [1, 2]}",
            ],
            "placement.learner.devices: device 1 is also in placement.sampler",
        ),
        (
            [
                "placement.strategy=separated",
                "placement.sampler={fraction: 0.5}",
                "placement.learner={fraction: 0.75}",
            ],
            "placement.learner.fraction: 0.75 of 8 devices needs 6, but only 4 are not taken",
        ),
        (
            ["placement.strategy=separated", "placement.sampler={fraction: 1.0}"],
            "placement.sampler.fraction: must be in (0, 1)",
        ),
        (["placement.sampler={fraction: 0.5}"], "device groups need strategy: separated"),
        (
            ["placement.strategy=interleaved", "placement.critic={devices: [0]}"],
            "placement.critic: grpo has no critic; interleave its reference instead",
        ),
        (
            ["placement.strategy=interleaved"],
            "placement.critic: strategy interleaved needs the critic's group, the reference's",
        ),
        (
            ["placement.strategy=separated", *SEPARATED[1:], "placement.reference=own"],
            "placement.reference: own runs the reference on a group of its own; it needs "
            "strategy: interleaved",
        ),
        (
            ["placement.strategy=interleaved", "placement.reference=own"],
            "placement.reference_group: set it exactly when reference: own",
        ),
        (
            [
                "placement.strategy=interleaved",
                "placement.reference=own",
                "placement.reference_group={devices: [0]}",
                "placement.learner={devices: [0, 1]}",
            ],
            "placement.reference_group.devices: device 0 is also in placement.learner",
        ),
        (
            [
                "placement.strategy=interleaved",
                "placement.reference=own",
                "placement.reference_group={devices: [0, 1, 2]}",
                "placement.learner={devices: [4]}",
            ],
            "placement.reference: own: grpo.rollout.prompts_per_step: the 16 rollout rows do "
            "not split over 3 data shard(s) (its group's data shards)",
        ),
        (
            ["placement.weight_sync_every=3"],
            "placement.weight_sync_every: 3 lets the sampler's weights fall 2 version(s) behind",
        ),
        (
            ["grpo.dynamic_sampling=true", "grpo.rollout.max_staleness=1"],
            "dynamic_sampling: refills sample on demand",
        ),
        (
            ["placement.reference=sampler"],
            "placement.reference: sampler runs the reference on the sampler's own devices; "
            "it needs strategy: separated",
        ),
        (["placement.reference=critic"], "placement.reference: expected one of"),
        (
            [
                *ASYNC[:3],
                "grpo.rollout.engine=continuous",
                "grpo.rollout.stream_scoring=false",
                "grpo.rollout.oversample_groups=2",
                "grpo.rollout.partial_rollouts=true",
                "grpo.rollout.max_staleness=2",
                "placement.weight_sync_every=3",
            ],
            "placement.weight_sync_every: 3 with partial rollouts lets carried tokens fall",
        ),
        (
            ["grpo.rollout.partial_rollouts=true"],
            "grpo.rollout.partial_rollouts: needs engine: continuous",
        ),
        (
            [*SEPARATED, "placement.reference=sampler", "lora.rank=4"],
            "placement.reference: sampler: a LoRA policy's reference is its frozen base",
        ),
        (
            [
                *SEPARATED,
                "placement.reference=sampler",
                "grpo.rollout.engine=continuous",
                "grpo.rollout.num_samples=2",
            ],
            "placement.reference: sampler: streamed scoring runs the reference on the learner",
        ),
        (
            [
                *SEPARATED,
                "placement.learner={devices: [4]}",
                "placement.reference=sampler",
                "grpo.rollout.score_micro_batch_size=8",
            ],
            "placement.reference: sampler: grpo.rollout.score_micro_batch_size",
        ),
    ],
)
def test_placement_errors_are_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as e:
        cfg, src = _config(tmp_path, "grpo", *overrides)
        validate(cfg, source=src)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_asynchronous_sampling_over_several_processes_is_a_config_error(tmp_path, monkeypatch):
    """Two threads would start cross-process programs in different orders on each process
    (a 2-process staleness-1 run hung in a collective); staleness 0 is allowed (tested in
    test_multihost.py with a separated placement)."""
    cfg, src = _config(tmp_path, "grpo", *SEPARATED, "grpo.rollout.max_staleness=1")
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ConfigError) as e:
        validate(cfg, 8, source=src)
    assert "grpo.rollout.max_staleness: 1 runs in one process for now" in str(e.value)
    assert "\n" not in str(e.value)


def test_fractions_split_the_devices(tmp_path):
    cfg, src = _config(
        tmp_path,
        "grpo",
        "placement.strategy=separated",
        "placement.sampler={fraction: 0.25}",
        "placement.learner={fraction: 0.5}",
    )
    layout = validate(cfg, source=src)
    assert layout.train_devices == 4 and layout.generate_shards == 2


def _dir(path):
    path.mkdir(parents=True, exist_ok=True)
    return path


def _history(run_dir):
    return [r for r in read_history(run_dir, 10**9) if "rollout/staleness" in r]


def test_max_staleness_zero_is_the_synchronous_iteration_bitwise(tmp_path):
    """``loop.run`` with k = 0 against the synchronous algorithm driven by hand: sample with
    the current weights, learn, repeat: the same samples and parameters, bit for bit."""
    cfg, src = _config(_dir(tmp_path / "a"), "grpo", *ASYNC, "train.steps=3")
    result = loop.run(cfg, source=src)
    assert [r["rollout/staleness"] for r in _history(result.run_dir)] == [0.0, 0.0, 0.0]

    cfg, src = _config(_dir(tmp_path / "b"), "grpo", *ASYNC, "train.steps=3")
    trainer = build_rl_trainer(cfg, source=src)
    for step in range(3):
        sample_key, learn_key = jax.random.split(jax.random.fold_in(trainer.key, step))
        rollout, _ = trainer.rollout(sample_key)
        trainer.learn(rollout, learn_key)
        trainer.steps_done += 1
        trainer.kl_state = result.trainer.kl_state  # a fixed coefficient either way
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.device_get(result.trainer.policy_state.params),
        jax.device_get(trainer.policy_state.params),
    )


@pytest.mark.parametrize("k", tiered([1, 2], [1]))
def test_samples_are_at_most_k_versions_old(tmp_path, k):
    cfg, src = _config(
        tmp_path,
        "grpo",
        *ASYNC,
        "train.steps=5",
        f"grpo.rollout.max_staleness={k}",
        "grpo.loss.rollout_correction={weights: truncate, cap: 2.0}",
    )
    result = loop.run(cfg, source=src)
    rows = _history(result.run_dir)
    versions = [int(r["rollout/policy_version"]) for r in rows]
    staleness = [int(r["rollout/staleness"]) for r in rows]
    assert len(rows) == 5
    assert all(0 <= s <= k for s in staleness)
    assert staleness == [min(i, k) for i in range(5)]  # version max(i - k, 0)
    assert versions == [max(i - k, 0) for i in range(5)]
    assert all("is/weight_mean" in r for r in rows)
    timeline = json.load(open(os.path.join(result.run_dir, TIMELINE_FILE)))
    summary = timeline["summary"]
    assert summary["overlap_frac"] > 0  # the sampler sampled while the learner trained
    names = {(p["name"], p["group"]) for p in timeline["phases"]}
    assert {("sample", "sampler"), ("score", "learner"), ("update", "learner")} <= names
    assert all(p["devices"] == [0] for p in timeline["phases"] if p["group"] == "sampler")
    assert 0 < summary["sampler/busy_frac"] <= 1 and 0 < summary["learner/busy_frac"] <= 1


@pytest.mark.slow
def test_partial_rollouts_carry_unfinished_groups_within_the_staleness_bound(tmp_path):
    """The engine over-samples 2 groups; with ``partial_rollouts`` the groups not kept go on
    in the next rollout under newer weights. With k = 2 rollouts are sampled 1 version
    behind and every trained token is at most 2 old (read back from the logged versions);
    carried rows are trained on."""
    cfg, src = _config(
        tmp_path,
        "grpo",
        *ASYNC,
        "train.steps=5",
        "grpo.rollout.max_staleness=2",
        *PARTIAL,
        "grpo.loss.rollout_correction={weights: truncate, cap: 2.0}",
    )
    result = loop.run(cfg, source=src)
    rows = _history(result.run_dir)
    assert len(rows) == 5
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1, 1, 1]  # launched at k - 1
    assert all(0 <= r["rollout/staleness_max"] <= 2 for r in rows)
    assert all(r["rollout/staleness_max"] >= r["rollout/staleness"] for r in rows)
    assert rows[0]["rollout/partial_rows"] == 0  # nothing to carry into the first
    assert sum(r["rollout/partial_rows"] for r in rows) > 0
    assert max(r["rollout/staleness_max"] for r in rows) == 2  # a carried token, 2 behind
    assert all(r["rollout/carried_groups"] <= 2 + 4 for r in rows)
    assert all(np.isfinite(r["loss/policy"]) and "is/weight_mean" in r for r in rows)


def test_partial_rollout_groups_keep_their_tokens_versions(tmp_path):
    """One trainer driven by hand: the groups the first rollout leaves are resumed first by
    the second under version 1, their carried tokens still version 0 and their behaviour
    log-probs as first sampled; a group older than the bound is dropped, not resumed."""
    cfg, src = _config(
        tmp_path,
        "grpo",
        *ASYNC,
        "grpo.rollout.max_staleness=1",
        *PARTIAL,
    )
    trainer = build_rl_trainer(cfg, source=src)
    params, _ = trainer.generate_params()
    prompts = next(trainer.prompts)
    first, timings, _ = trainer.sample(jax.random.key(1), prompts, params, version=0)
    carry = trainer.partials
    assert carry is not None and carry.groups >= 1
    assert set(carry.prompt_ids) <= set(prompts["index"])  # dataset indices
    calls = []
    engine = trainer.programs.engine

    class Recording:  # records what the engine is asked to sample
        def generate(self, params, tokens, mask, *args, **kwargs):
            calls.append((np.asarray(tokens), kwargs["carry"]))
            return engine.generate(params, tokens, mask, *args, **kwargs)

    trainer.programs = dataclasses.replace(trainer.programs, engine=Recording())
    drawn = next(trainer.prompts)
    second, timings, _ = trainer.sample(jax.random.key(2), drawn, params, version=1, oldest=0)
    fresh, passed = calls[-1]
    assert passed is not None and passed.groups == carry.groups
    # The carried groups take the place of as many new prompts, which come after them.
    np.testing.assert_array_equal(fresh, drawn["tokens"][: len(drawn["tokens"]) - carry.groups])
    assert second.rows == 16  # prompts_per_step x num_samples
    assert timings["rollout/partials_dropped"] == 0
    assert timings["rollout/oldest_version"] == 0 and timings["rollout/partial_rows"] > 0
    trainer.partials = carry
    _, timings, _ = trainer.sample(
        jax.random.key(2), next(trainer.prompts), params, version=2, oldest=1
    )
    assert timings["rollout/partials_dropped"] == carry.groups
    assert timings["rollout/oldest_version"] == 2


@pytest.mark.slow
def test_async_resume_repeats_the_uninterrupted_run(tmp_path):
    """k = 1, checkpoints every 2 iterations: 4 iterations in one go, and 2 then a resume to
    4, give the same parameters and the same policy versions (the checkpoint at 2 is a drain
    point: nothing is in flight, and no rollout after it uses older weights)."""
    common = (*ASYNC, "grpo.rollout.max_staleness=1", "checkpoint.every=2")
    cfg, src = _config(_dir(tmp_path / "whole"), "grpo", *common, "train.steps=4")
    whole = loop.run(cfg, source=src)
    cfg, src = _config(_dir(tmp_path / "split"), "grpo", *common, "train.steps=2")
    loop.run(cfg, source=src)
    cfg, src = _config(_dir(tmp_path / "split"), "grpo", *common, "train.steps=4")
    resumed = loop.run(cfg, source=src)
    versions = [r["rollout/policy_version"] for r in _history(whole.run_dir)]
    assert versions == [0, 0, 2, 2]  # the drain at 2: rollout 2 waits for version 2
    assert [r["rollout/policy_version"] for r in _history(resumed.run_dir)] == versions
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.device_get(whole.trainer.policy_state.params),
        jax.device_get(resumed.trainer.policy_state.params),
    )


@pytest.mark.slow
def test_async_run_killed_then_resumed_equals_uninterrupted(tmp_path):
    """kill -9 of an asynchronous run (k = 1, checkpoints every 2 iterations), then a resume:
    the logged rows (versions, importance weights, losses) and the final parameters equal
    the uninterrupted run's, bit for bit."""
    from tests.train.test_checkpointing import _cli, _committed_steps, _untimed, _wait_for

    common = (
        *ASYNC,
        "grpo.rollout.max_staleness=1",
        "grpo.loss.rollout_correction={weights: truncate, cap: 2.0}",
        "checkpoint.every=2",
        "train.steps=6",
    )
    cfg, src = _config(_dir(tmp_path / "ref"), "grpo", *common)
    ref = loop.run(cfg, source=src)

    cfg, src = _config(_dir(tmp_path / "killed"), "grpo", *common)
    proc = _cli(src, *common)
    ckpt_dir = os.path.join(cfg.output_dir, "checkpoints")
    _wait_for(lambda: _committed_steps(ckpt_dir), proc, "the first checkpoint")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = _committed_steps(ckpt_dir)[-1]
    assert 0 < killed_at < 6, killed_at

    resumed = loop.run(cfg, source=src)
    assert _untimed(resumed.history) == _untimed(ref.history)
    assert [r["rollout/policy_version"] for r in _history(resumed.run_dir)] == [0, 0, 2, 2, 4, 4]
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.device_get(resumed.trainer.policy_state.params),
        jax.device_get(ref.trainer.policy_state.params),
    )


@pytest.mark.slow
def test_colocated_async_keeps_its_own_copy_of_the_weights(tmp_path):
    """k = 1 with the sampler on the training device: the sampler's weights are a copy, so
    the update (which donates the training state) cannot delete them under the producer."""
    cfg, src = _config(
        tmp_path,
        "grpo",
        "placement.train_devices=1",
        "grpo.rollout.max_staleness=1",
        "train.steps=3",
    )
    trainer = build_rl_trainer(cfg, source=src)
    assert trainer.producer.shared_devices
    rows = [trainer.step().metrics for _ in range(3)]
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1]
    assert all(np.isfinite(r["loss/policy"]) for r in rows)
