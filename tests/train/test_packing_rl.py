"""Sequence-packed RL iterations (``rollout.pack_sequences``) against unpacked ones.

Each test samples one rollout, cuts its responses to very uneven lengths (empty ones, one
at the budget, short ones), and learns it with and without packing from the same initial
state. Packing is the same math in another summation order (tests/models/test_packing.py),
and the update's micro-batches keep the same rows, so the scored per-token arrays, every
metric and the parameters after the updates agree to float32 rounding: 1e-5, as for packed
prompt groups in tests/train/test_rl.py (Adam with eps = 1 keeps each step smooth in the
gradient, lr 0.05). Measured: scored arrays <= 5e-6 (whitened advantages), metrics <= 3e-6,
parameters <= 2e-7.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import yaml

from jaxrlhf.config import ConfigError, load_config, validate
from jaxrlhf.sharding import MeshConfig, make_mesh
from jaxrlhf.train import rl_metrics, rl_packing
from jaxrlhf.train.rl_trainer import build_rl_trainer

R, PROMPT = 16, 16  # response budget and prompt slots: rows of T = 32
# Response lengths, cycled over the rows (capped at what was sampled): empty, short and
# two at the budget per 8 rows.
LENGTHS = np.array([R, 0, 3, 1, 0, 2, R, 0])
SCORED = ("old_logprobs", "ref_logprobs", "old_values", "returns", "advantages")


def _config(tmp_path, algorithm, *overrides, prompts=16):
    raw = {
        "algorithm": algorithm,
        "output_dir": str(tmp_path / "run"),
        "model": {"preset": "tiny", "initializer_range": 0.1},
        "data": {
            "train": "builtin:sort",
            "max_length": PROMPT + R,
            "max_prompt_length": PROMPT,
            "builtin_size": 256,
            "eval_size": 0,
        },
        "optimizer": {
            "lr": 0.05,
            "eps": 1.0,
            "schedule": "constant",
            "max_grad_norm": 0.0,
            "weight_decay": 0.0,
        },
        "train": {"steps": 1, "seed": 0},
        algorithm: {
            "rollout": {"prompts_per_step": prompts, "max_new_tokens": R},
            "loss": {"kl_coef": 0.1},
        },
    }
    path = tmp_path / f"{algorithm}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(str(path), list(overrides)), str(path)


def _mesh(data=1, fsdp=1, tensor=1):
    n = data * fsdp * tensor
    return make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor), devices=jax.devices()[:n])


def _uneven(rollout):
    """``rollout`` with its responses cut to :data:`LENGTHS`."""
    lengths = np.minimum(np.resize(LENGTHS, rollout.rows), rollout.lengths)
    keep = np.arange(rollout.tokens.shape[1]) < PROMPT + lengths[:, None]
    response = rollout.response_mask & keep
    return rollout.replace(
        tokens=np.where(keep, rollout.tokens, 0),
        mask=rollout.mask & keep,
        response_mask=response,
        lengths=lengths.astype(np.int32),
        stopped=lengths < R,
        sampler_logprobs=np.where(response, rollout.sampler_logprobs, 0.0),
    )


def _learn_each(tmp_path, algorithm, variants, *, prompts=16, edit=None):
    """One trainer per ``{name: (mesh, overrides)}``, from the same seed; the first samples
    a rollout (made uneven, then passed through ``edit`` if given) that every one learns
    once, its reference perturbed so the KL is not 0. Returns the rollout and ``{name:
    (trainer, scored, params, metrics)}``."""
    out, rollout = {}, None
    for name, (mesh, overrides) in variants.items():
        cfg, src = _config(tmp_path, algorithm, *overrides, prompts=prompts)
        trainer = build_rl_trainer(cfg, mesh=mesh, source=src)
        trainer.ref_params = jax.tree.map(lambda x: x * 1.05, trainer.ref_params)
        if rollout is None:
            rollout = _uneven(trainer.rollout(jax.random.key(3))[0])
            rollout = rollout if edit is None else edit(rollout)
        metrics = trainer.learn(rollout, jax.random.key(4))
        states = (trainer.policy_state, trainer.value_state)
        params = jax.device_get([s.params for s in states if s is not None])
        out[name] = (trainer, jax.device_get(trainer.last_scored), params, metrics)
    assert (rollout.lengths == 0).any() and (rollout.lengths == R).any()
    return rollout, out


# PPO, 2 epochs x 2 shuffled minibatches of 2 micro-batches (4 rows each).
PPO_MINIBATCHES = ("ppo.loss.epochs=2", "ppo.loss.num_minibatches=2", "train.micro_batch_size=4")


def _learn_ppo_packed_and_padded(tmp_path, *overrides, edit=None):
    """:func:`_learn_each` of PPO with :data:`PPO_MINIBATCHES` and ``overrides``, sequences
    packed (``True``) and padded (``False``)."""
    common = [*PPO_MINIBATCHES, *overrides]
    return _learn_each(
        tmp_path,
        "ppo",
        {p: (_mesh(), [*common, f"ppo.rollout.pack_sequences={p}"]) for p in (True, False)},
        edit=edit,
    )


def _assert_same_iteration(a, b, rollout):
    """Scored per-token arrays on response tokens, every update and scoring metric, and the
    parameters within 1e-5."""
    resp = rollout.response_mask
    for key in SCORED:
        x, y = getattr(a[1], key), getattr(b[1], key)
        if x is not None or y is not None:
            np.testing.assert_allclose(x[resp], y[resp], atol=1e-5, err_msg=key)
    shared = {k for k in a[3].keys() & b[3].keys() if not k.startswith(("time/", "packing/"))}
    assert len(shared) > 15
    for key in sorted(shared):
        np.testing.assert_allclose(a[3][key], b[3][key], atol=1e-5, rtol=1e-5, err_msg=key)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-5, rtol=0), a[2], b[2])


@pytest.mark.slow
def test_packed_ppo_iteration_equals_unpacked(tmp_path):
    """PPO with a critic, KL in the reward (old log-probs scored), 2 epochs x 2 shuffled
    minibatches of 2 micro-batches (4 rows each): packed scoring and update vs padded rows.
    Also the FLOPs: throughput counts the packed slots each phase ran."""
    rollout, out = _learn_ppo_packed_and_padded(tmp_path)
    trainer, _, _, m = out[True]
    assert trainer.layout.rl.num_micro == 2
    assert trainer.layout.rl.packing.score == 16 and trainer.layout.rl.packing.update == 4
    assert m["packing/score_rows"] < 16 and m["packing/update_rows"] < 4  # fewer rows ran
    assert "packing/score_rows" not in out[False][3]
    _assert_same_iteration(out[True], out[False], rollout)

    # Model FLOPs: generation runs every slot once; scoring the reference, old policy and
    # critic over the packed slots; 2 epochs of the policy and critic updates (forward +
    # backward = 3 forwards) over the packed slots per epoch.
    fpt = rl_metrics.flops_per_token(trainer.model_cfg)
    assert m["packing/score_slots"] == m["packing/score_rows"] * (PROMPT + R)
    assert m["packing/update_slots"] == 2 * 2 * m["packing/update_rows"] * (PROMPT + R)
    got = rl_metrics.throughput_metrics(trainer.programs, rollout, {**m, "time/iteration_s": 1.0})[
        "throughput/model_tflops"
    ]
    want = fpt * (
        16 * (PROMPT + R) + 3 * m["packing/score_slots"] + 3 * 2 * 2 * m["packing/update_slots"]
    )
    np.testing.assert_allclose(got * 1e12, want, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "models", [("lora.rank=4",), ("ppo.value.branch_layer=1",)], ids=["lora", "hydra_critic"]
)
def test_packed_lora_and_hydra_ppo_iterations_equal_unpacked(tmp_path, models):
    """The PPO iteration above with LoRA learners (adapters trained over a frozen base) or a
    Hydra critic (both branches over a frozen trunk; one joint scoring forward): their
    scoring and update forwards pack sequences as the plain models' do, to the same 1e-5."""
    rollout, out = _learn_ppo_packed_and_padded(tmp_path, *models)
    trainer, _, _, m = out[True]
    assert (trainer.programs.policy_lora is None) != (trainer.programs.hydra is None)
    assert m["packing/score_rows"] < 16 and m["packing/update_rows"] < 4  # fewer rows ran
    assert "packing/score_rows" not in out[False][3]
    _assert_same_iteration(out[True], out[False], rollout)


@pytest.mark.slow
@pytest.mark.parametrize(
    "correction",
    [("truncate", "token", "0"), ("mask", "sequence", "0.5")],
    ids=["truncate_token", "mask_sequence"],
)
def test_packed_iteration_with_rollout_correction_equals_unpacked(tmp_path, correction):
    """Rollout correction packs like the rest of the update: the sampler's per-token
    log-probs (skewed by up to +-0.7 nats so the weights are truncated or masked) travel with
    the packed rows, and the PPO iteration, its is/* metrics included, equals the padded one
    to 1e-5."""
    weights, level, floor = correction

    def skew(rollout):
        noise = np.random.default_rng(0).uniform(-0.7, 0.7, rollout.sampler_logprobs.shape)
        behaviour = rollout.sampler_logprobs + noise.astype(np.float32)
        return rollout.replace(sampler_logprobs=np.where(rollout.response_mask, behaviour, 0.0))

    rollout, out = _learn_ppo_packed_and_padded(
        tmp_path,
        f"ppo.loss.rollout_correction.weights={weights}",
        f"ppo.loss.rollout_correction.level={level}",
        "ppo.loss.rollout_correction.cap=1.5",
        f"ppo.loss.rollout_correction.floor={floor}",
        edit=skew,
    )
    m = out[True][3]
    assert m["packing/update_rows"] < 4
    assert 0 < m["is/clip_frac"] < 1 and m["is/mismatch_kl"] > 0.01  # the weights bite
    _assert_same_iteration(out[True], out[False], rollout)


@pytest.mark.slow
def test_packed_grpo_iteration_equals_prompt_groups(tmp_path):
    """GRPO, 4 prompts x 4 samples, one update on one micro-batch (its forward gives the old
    log-probs): sequences packed, each group's prompt shared where its responses fit, vs
    packed prompt groups (``pack_sequences: false``)."""
    rollout, out = _learn_each(
        tmp_path,
        "grpo",
        {pack: (_mesh(), [f"grpo.rollout.pack_sequences={pack}"]) for pack in (True, False)},
        prompts=4,
    )
    trainer, _, _, m = out[True]
    assert trainer.layout.rl.reuse_policy_forward
    assert out[False][0].layout.rl.groups.update == 4
    assert m["packing/update_rows"] < 16
    _assert_same_iteration(out[True], out[False], rollout)


@pytest.mark.slow
def test_packed_iteration_on_8_devices_equals_one(tmp_path):
    """GRPO packed on a data 2 x fsdp 2 x tensor 2 mesh (each of 4 data shards packs its own
    4 rows) vs one device (16 rows into one block)."""
    rollout, out = _learn_each(
        tmp_path,
        "grpo",
        {"one": (_mesh(), []), "eight": (_mesh(data=2, fsdp=2, tensor=2), [])},
        prompts=4,
    )
    assert out["eight"][0].layout.rl.packing.update == 4
    assert out["eight"][3]["packing/update_rows"] < 4
    assert out["one"][3]["packing/update_rows"] < 16
    _assert_same_iteration(out["one"], out["eight"], rollout)


def test_pack_settings_errors_and_notes(tmp_path, caplog):
    cfg_path = tmp_path / "x"
    cfg_path.mkdir()
    with pytest.raises(ConfigError, match=r"grpo\.rollout\.pack_buckets: must be > 0, got 0"):
        _config(cfg_path, "grpo", "grpo.rollout.pack_buckets=0")
    cfg, src = _config(tmp_path, "grpo", "train.micro_batch_size=1", prompts=4)
    with caplog.at_level("WARNING"):
        layout = validate(cfg, 8, source=src)
    assert layout.rl.packing.score == 2 and layout.rl.packing.update == 0
    assert "pack_sequences is off in the update: its micro-batches hold 1 row per data" in (
        caplog.text
    )


def _scoring_planner(
    *, shards: int, share_prompts: bool, score_rows: int, group: int, bound: int | None = None
) -> rl_packing.PackingPlanner:
    """A planner of scoring only (P = 2, 4 buckets; the update unpacked)."""
    return rl_packing.PackingPlanner(
        prompt_len=2,
        shards=shards,
        buckets=4,
        share_prompts=share_prompts,
        score_rows=score_rows,
        score_micro_rows=bound,
        score_group=group,
        update_rows=0,
        epochs=1,
        num_minibatches=1,
        num_micro=1,
        update_group=1,
    )


def test_streamed_batches_plan_on_their_own_rows():
    """Streamed scoring (rl_stream) plans each batch of finished groups alone: 4 rows of
    T = 6 (P = 2), each 1 prompt + 1 response token, with 16 rows per shard in the whole
    rollout's micro-batches. Sizes are quarters of the batch's 4 rows (1, 2, 3, 4), not of
    16: 3 sequences of 2 fit a packed row, so 2 rows, 12 slots against 24 unpacked. Two
    batches, one packed and one not: 12 + 24 slots, 8 + 8 real tokens."""
    planner = _scoring_planner(shards=1, share_prompts=False, score_rows=16, group=1)
    mask = np.zeros((4, 6), bool)
    mask[:, 1:3] = True
    tokens = np.where(mask, 7, 0).astype(np.int32)
    plan = planner.score(tokens, mask)
    assert (plan.rows, plan.slots, plan.tokens) == (2, 12, 8.0)
    assert planner.unpacked_score_pass(mask) == (24.0, 8.0)
    assert planner.score(tokens[:1], mask[:1]) is None  # one row per shard: nothing to pack
    metrics = rl_packing.streamed_score_metrics([plan, None], [(24.0, 8.0)] * 2)
    assert metrics == {
        "packing/score_rows": 2.0,
        "packing/score_slots": 36.0,
        "packing/score_fill": 16 / 36,
    }
    assert rl_packing.streamed_score_metrics([None], [(24.0, 8.0)]) == {}


def test_a_streamed_batch_above_the_scoring_bound_plans_each_forward():
    """8 rows of T = 6 (P = 2) in groups of 2 (one prompt token each, shared), a bound of
    4 rows per scoring forward over 2 data shards: 2 forwards, group g in forward g % 2,
    each shard's block one group. A block needs 1 prompt + 2 response tokens, so 1 packed
    row: 2 forwards x 2 shards x 1 row x 6 = 24 slots, and the rows of a group share their
    prompt's slot."""
    planner = _scoring_planner(shards=2, share_prompts=True, score_rows=4, group=2, bound=4)
    mask = np.zeros((8, 6), bool)
    mask[:, 1:3] = True
    tokens = np.where(mask, 7, 0).astype(np.int32)
    tokens[:, 1] = np.repeat(np.arange(4), 2) + 10  # each group's own prompt
    plan = planner.score(tokens, mask)
    assert (plan.rows, plan.slots, plan.tokens) == (1, 24, 12.0)
    np.testing.assert_array_equal(plan.packing.row, np.zeros(8))
    prompt = np.asarray(plan.packing.prompt_slot).reshape(4, 2)
    np.testing.assert_array_equal(prompt[:, 0], prompt[:, 1])  # shared within each group
