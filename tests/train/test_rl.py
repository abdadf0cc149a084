"""PPO and GRPO iterations against an independent reference, on the same rollout.

The reference recomputes everything from the rollout with plain NumPy (log-softmax, group
advantages, GAE loops) and unjitted ``jax.grad`` of the textbook losses written out here, then
applies Adam's first step by hand. The optimizer uses eps = 1 so that the first Adam step,
-lr * g / (|g| + eps), is smooth in g (with eps = 1e-8 it is lr * sign(g), which amplifies
float noise in near-zero gradients). Tolerances: float32 forward/backward in different
program shapes agree to ~1e-6 relative; we use 2e-5 absolute on log-probs and advantages and
1e-6 on parameter updates of size up to lr * 0.5.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from jaxrlhf.config import ConfigError, load_config, override_paths
from jaxrlhf.models import model as M
from jaxrlhf.sharding import MeshConfig, make_mesh
from jaxrlhf.train.rl_config import GroupSizes
from jaxrlhf.train.rl_metrics import flops_per_token
from jaxrlhf.train.rl_trainer import build_rl_trainer
from tests.tiers import tiered

LR, EPS = 0.05, 1.0


def _config(tmp_path, algorithm, *overrides, **sections):
    raw = {
        "algorithm": algorithm,
        "output_dir": str(tmp_path / "run"),
        "model": {"preset": "tiny", "initializer_range": 0.1},
        "data": {
            "train": "builtin:sort",
            "max_length": 32,
            "max_prompt_length": 16,
            "builtin_size": 256,
            "eval_size": 0,
        },
        "optimizer": {
            "lr": LR,
            "eps": EPS,
            "schedule": "constant",
            "max_grad_norm": 0.0,
            "weight_decay": 0.0,
        },
        "train": {"steps": 1, "seed": 0},
        algorithm: {"rollout": {"prompts_per_step": 4, "max_new_tokens": 6}, **sections},
    }
    path = tmp_path / f"{algorithm}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(str(path), list(overrides)), str(path)


def _one_device_mesh():
    return make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])


def _np_aligned_logprobs(logits, tokens):
    logits = logits.astype(np.float64)[:, :-1]
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    picked = np.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0]
    return np.pad(picked - logz, ((0, 0), (1, 0)))


def _adam_first_step(params, grads):
    return jax.tree.map(lambda p, g: p - LR * g / (jnp.abs(g) + EPS), params, grads)


def _policy_grads(cfg, params, rollout, old, adv):
    """Unjitted gradient of the token-mean clipped surrogate (ratio = 1 at params = old)."""
    module = M.build(cfg)
    tokens, mask = jnp.asarray(rollout.tokens), jnp.asarray(rollout.mask)
    resp = jnp.asarray(rollout.response_mask)

    def loss(p):
        logits = M.forward(module, p, tokens, mask)[:, :-1]
        logp = jax.nn.log_softmax(logits)
        logp = jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
        logp = jnp.pad(logp, ((0, 0), (1, 0)))
        ratio = jnp.exp(logp - old)
        surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.2) * adv)
        return -(surrogate * resp).sum() / resp.sum()

    return jax.grad(loss)(params)


@pytest.fixture(scope="module")
def grpo(tmp_path_factory):
    cfg, src = _config(tmp_path_factory.mktemp("grpo"), "grpo", "grpo.loss.kl_coef=0.1")
    trainer = build_rl_trainer(cfg, source=src)  # 8-device mesh (fsdp = 8)
    params0 = jax.device_get(trainer.policy_state.params)
    rollout, _ = trainer.rollout(jax.random.key(1))
    metrics = trainer.learn(rollout, jax.random.key(2))
    return trainer, params0, rollout, metrics


def test_grpo_iteration_matches_reference(grpo):
    trainer, params0, rollout, metrics = grpo
    cfg = trainer.model_cfg
    logits = np.asarray(M.forward(M.build(cfg), params0, rollout.tokens, rollout.mask))
    old = _np_aligned_logprobs(logits, rollout.tokens)
    resp = rollout.response_mask
    scored = jax.device_get(trainer.last_scored)
    np.testing.assert_allclose(scored.old_logprobs[resp], old[resp], atol=2e-5)
    np.testing.assert_allclose(scored.ref_logprobs[resp], old[resp], atol=2e-5)

    # Group-relative advantages: (s - mean_g) / (std_g + 1e-6), unbiased std, per prompt.
    s = rollout.scores.astype(np.float64).reshape(-1, 4)
    adv_seq = ((s - s.mean(1, keepdims=True)) / (s.std(1, ddof=1, keepdims=True) + 1e-6)).ravel()
    adv = np.where(resp, adv_seq[:, None], 0.0)
    np.testing.assert_allclose(scored.advantages, adv, atol=2e-5)

    # The KL term (k3, beta 0.1) is 0 with zero gradient at params = reference, so the
    # update is the surrogate's alone.
    grads = _policy_grads(
        cfg, params0, rollout, jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32)
    )
    expected = _adam_first_step(params0, grads)
    got = jax.device_get(trainer.policy_state.params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=0), got, expected)
    # On 8 devices the scoring forward and the value-and-grad forward are different sharded
    # programs, so the first ratio is 1 to float32 rounding; bit-exact on one device below.
    assert abs(metrics["first/policy/ratio_mean"] - 1.0) < 1e-6
    assert abs(metrics["first/policy/ratio_max"] - 1.0) < 1e-6
    assert abs(rollout.scores.std()) > 0  # the rollout carried some learning signal


def test_sampler_and_trainer_logprobs_agree(grpo):
    """The sampler's model log-probs (decode with a KV cache) equal the trainer's (one full
    forward): same weights, same float32 math, different summation shapes -> ~1e-6."""
    trainer, _, rollout, _ = grpo
    resp = rollout.response_mask
    old = np.asarray(jax.device_get(trainer.last_scored.old_logprobs))
    np.testing.assert_allclose(rollout.sampler_logprobs[resp], old[resp], atol=1e-4)


def test_ppo_iteration_matches_reference(tmp_path):
    cfg, src = _config(tmp_path, "ppo", "ppo.loss.kl_coef=0.1", "ppo.value_clip=null")
    trainer = build_rl_trainer(cfg, mesh=_one_device_mesh(), source=src)
    model_cfg = trainer.model_cfg
    params0 = jax.device_get(trainer.policy_state.params)
    value0 = jax.device_get(trainer.value_state.params)
    rollout, _ = trainer.rollout(jax.random.key(3))
    metrics = trainer.learn(rollout, jax.random.key(4))

    tokens, mask, resp = rollout.tokens, rollout.mask, rollout.response_mask
    old = _np_aligned_logprobs(
        np.asarray(M.forward(M.build(model_cfg), params0, tokens, mask)), tokens
    )
    values = np.asarray(M.forward(M.build(model_cfg, "scalar"), value0, tokens, mask))
    values = np.pad(values[:, :-1], ((0, 0), (1, 0)))
    # Per-token rewards: -beta * (old - ref) = 0 here (reference = initial policy), plus the
    # score on the last response token; GAE(gamma=1, lam=0.95) by a backward loop.
    scores = rollout.scores.astype(np.float64)
    adv = np.zeros_like(values, dtype=np.float64)
    for b in range(tokens.shape[0]):
        idx = np.flatnonzero(resp[b])
        gae, next_value = 0.0, 0.0
        for j, t in enumerate(idx[::-1]):
            reward = scores[b] if j == 0 else 0.0
            delta = reward + 1.0 * next_value - values[b, t]
            gae = delta + 1.0 * 0.95 * gae
            adv[b, t] = gae
            next_value = values[b, t]
    returns = adv + values
    mean = adv[resp].mean()
    std = np.sqrt(adv[resp].var() + 1e-8)
    whitened = np.where(resp, (adv - mean) / std, 0.0)
    scored = jax.device_get(trainer.last_scored)
    np.testing.assert_allclose(scored.returns[resp], returns[resp], atol=2e-5)
    np.testing.assert_allclose(scored.advantages[resp], whitened[resp], atol=2e-5)

    grads = _policy_grads(
        model_cfg,
        params0,
        rollout,
        jnp.asarray(old, jnp.float32),
        jnp.asarray(whitened, jnp.float32),
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=0),
        jax.device_get(trainer.policy_state.params),
        _adam_first_step(params0, grads),
    )

    def value_loss(p):  # 0.5 * token-mean squared error against the returns (no clipping)
        v = M.forward(M.build(model_cfg, "scalar"), p, jnp.asarray(tokens), jnp.asarray(mask))
        v = jnp.pad(v[:, :-1], ((0, 0), (1, 0)))
        return 0.5 * (((v - returns) ** 2) * resp).sum() / resp.sum()

    expected_value = _adam_first_step(value0, jax.grad(value_loss)(value0))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=0),
        jax.device_get(trainer.value_state.params),
        expected_value,
    )
    assert metrics["first/policy/ratio_mean"] == 1.0


@pytest.mark.slow
def test_first_minibatch_ratio_is_exactly_one_with_shuffled_minibatches(tmp_path):
    cfg, src = _config(
        tmp_path,
        "ppo",
        "ppo.loss.num_minibatches=2",
        "ppo.loss.epochs=2",
        "ppo.rollout.prompts_per_step=16",
    )
    trainer = build_rl_trainer(cfg, mesh=_one_device_mesh(), source=src)
    for _ in range(2):
        m = trainer.step().metrics
        assert m["first/policy/ratio_mean"] == 1.0
        assert m["first/policy/ratio_max"] == 1.0
        assert m["first/policy/approx_kl"] == 0.0
    assert m["policy/ratio_max"] != 1.0  # later minibatches see updated params


@pytest.mark.slow
def test_sharded_iteration_equals_single_device(tmp_path):
    out = {}
    for name, mesh in (
        ("one", _one_device_mesh()),
        ("eight", make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))),
    ):
        cfg, src = _config(tmp_path, "grpo", "grpo.loss.kl_coef=0.1")
        trainer = build_rl_trainer(cfg, mesh=mesh, source=src)
        rollouts = []
        for _ in range(2):
            key = jax.random.fold_in(trainer.key, trainer.steps_done)
            rollouts.append(trainer.rollout(jax.random.split(key)[0])[0])
            trainer.step()
        out[name] = (rollouts, jax.device_get(trainer.policy_state.params))
    for a, b in zip(out["one"][0], out["eight"][0], strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)  # same samples
    # Two updates on 1 vs 8 devices: fp32 reduction order only (and Adam with eps = 1).
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0),
        out["one"][1],
        out["eight"][1],
    )


@pytest.mark.slow
def test_sampler_on_its_own_mesh_equals_one_mesh(tmp_path):
    """placement: train on device 0, sample on all 8 devices (4-way data x 2-way tensor); the
    same samples and the same updates as everything on device 0 (the update is the same
    program on the same device, so exactly equal; the sampler's log-probs differ by float
    reduction order across the tensor split only, 1e-5)."""
    out = {}
    for name, overrides in (
        ("one", []),
        (
            "placed",
            ["placement.train_devices=1", "placement.generate_mesh={data: 4, fsdp: 1, tensor: 2}"],
        ),
    ):
        cfg, src = _config(tmp_path, "grpo", "grpo.loss.kl_coef=0.1", *overrides)
        mesh = _one_device_mesh() if name == "one" else None  # placed: from the config
        trainer = build_rl_trainer(cfg, mesh=mesh, source=src)
        assert trainer.mesh.devices.flat[0] == jax.devices()[0] and trainer.mesh.size == 1
        assert trainer.sampler.mesh.size == (8 if name == "placed" else 1)
        rollouts, metrics = [], []
        for _ in range(2):
            key = jax.random.fold_in(trainer.key, trainer.steps_done)
            rollouts.append(trainer.rollout(jax.random.split(key)[0])[0])
            metrics.append(trainer.step().metrics)
        out[name] = (rollouts, metrics, jax.device_get(trainer.policy_state.params))
    for a, b in zip(out["one"][0], out["placed"][0], strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.sampler_logprobs, b.sampler_logprobs, atol=1e-5)
    for a, b in zip(out["one"][1], out["placed"][1], strict=True):
        assert a["reshard/bytes_moved"] == 0  # the sampler reads the training layout
        assert b["reshard/bytes_moved"] > 0  # device 0's params copied to the sampler's mesh
        assert a["kl/seq_mean"] == b["kl/seq_mean"] and a["reward/mean"] == b["reward/mean"]
    jax.tree.map(np.testing.assert_array_equal, out["one"][2], out["placed"][2])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["placement.train_devices=9"], "placement.train_devices: 9 exceeds the 8 device(s)"),
        (["placement.generate_mesh={data: 3, fsdp: 1}"], "placement.generate_mesh: mesh data=3"),
        (
            ["placement.generate_mesh={data: 8, fsdp: 1}"],
            "its 8 data shard(s) (data x fsdp) do not divide grpo.rollout.prompts_per_step = 4",
        ),
        (["placement.cpu_devices=2"], "placement.cpu_devices: 2 asked, but JAX started with 8"),
        (["placement.generate_mesh={data: -1}"], "placement.generate_mesh: at most one mesh axis"),
        (
            ["placement.generate_mesh={data: 4, fsdp: 1, axis_type: explicit}"],
            "placement.generate_mesh.axis_type: the sampler's sharding rules need 'auto' axes",
        ),
        (
            ["placement.train_devices=3", "mesh.fsdp=2"],
            "needs 2 devices but 3 are available (placement.train_devices = 3)",
        ),
    ],
)
def test_placement_errors_name_the_field(tmp_path, overrides, message):
    from jaxrlhf.sharding import MeshError

    with pytest.raises((ConfigError, MeshError)) as e:
        cfg, src = _config(tmp_path, "grpo", *overrides)
        build_rl_trainer(cfg, source=src)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_grpo_short_run_improves_task_reward(tmp_path):
    """From random weights, GRPO learns to answer with digits: the mean reward of the last 10
    iterations clearly exceeds the first 10 (seed-fixed; measured 0.02 -> ~0.2)."""
    cfg, src = _config(
        tmp_path,
        "grpo",
        "optimizer.lr=3e-3",
        "optimizer.eps=1e-8",
        "optimizer.max_grad_norm=1.0",
        "grpo.rollout.prompts_per_step=8",
        "grpo.rollout.max_new_tokens=8",
        "model.hidden_size=64",
        "model.intermediate_size=128",
    )
    trainer = build_rl_trainer(cfg, mesh=_one_device_mesh(), source=src)
    rewards = [trainer.step().metrics["reward/mean"] for _ in range(60)]
    first, last = np.mean(rewards[:10]), np.mean(rewards[-10:])
    assert last > first + 0.05, (first, last)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["ppo.loss.num_minibatches=3"], "ppo.loss.num_minibatches: 3 does not divide the 4"),
        (["mesh.fsdp=8"], "needs 8 devices but 1 are available"),
        (["ppo.rollout.max_new_tokens=200"], "exceeds the model's 128 positions"),
        (["ppo.rollout.temperature=0"], "temperature: must be > 0"),
        (["ppo.critic_init=reward_model"], "critic_init: 'reward_model' needs reward.model_dir"),
        (
            ["ppo.rollout.score_micro_batch_size=3"],
            "ppo.rollout.score_micro_batch_size: 3 rows per data shard do not divide the 4",
        ),
        (["ppo.rollout.score_micro_batch_size=0"], "score_micro_batch_size: must be > 0"),
    ],
)
def test_rl_config_errors_are_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as e:
        cfg, src = _config(tmp_path, "ppo", *overrides)
        build_rl_trainer(cfg, mesh=_one_device_mesh(), source=src)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_grpo_needs_groups(tmp_path):
    with pytest.raises(ConfigError, match="GRPO needs groups of >= 2"):
        _config(tmp_path, "grpo", "grpo.rollout.num_samples=1")


def test_reward_function_errors(tmp_path):
    """A reward function that does not resolve is a config error naming the field and
    where it was set (here the command line)."""
    overrides = ["grpo.reward.function=no_such_module.score"]
    cfg, src = _config(tmp_path, "grpo", *overrides)
    with pytest.raises(
        ConfigError,
        match=r"^command line: grpo.reward.function: cannot import 'no_such_module.score'",
    ):
        build_rl_trainer(cfg, source=src, override_paths=override_paths(overrides))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "sort 312:"}\n{"prompt": "sort 97:"}\n' * 4)
    cfg, src = _config(tmp_path, "grpo", f"data.train={prompts}")
    with pytest.raises(ConfigError, match="grpo.reward.function: 'builtin' needs a built-in"):
        build_rl_trainer(cfg, mesh=_one_device_mesh(), source=src)


def test_overlong_penalty_hand_checked():
    from jaxrlhf.rewards import overlong_penalty

    # Budget 10, buffer 4: lengths up to 6 are free, 8 pays 2/4 of the penalty, a response cut
    # at the budget (not stopped) pays all of it whatever its length.
    got = overlong_penalty(np.array([5, 6, 8, 10, 10]), np.array([1, 1, 1, 1, 0], bool), 10, 4, 0.5)
    np.testing.assert_allclose(got, [0.0, 0.0, 0.25, 0.5, 0.5])
    assert not overlong_penalty(np.array([10]), np.array([False]), 10, 0, 1.0).any()


def test_grpo_dynamic_sampling_keeps_informative_groups(tmp_path):
    cfg, src = _config(tmp_path, "grpo", "grpo.dynamic_sampling=true", "grpo.max_refills=2")
    trainer = build_rl_trainer(cfg, mesh=_one_device_mesh(), source=src)
    rollout, timings = trainer.dynamic_rollout(jax.random.key(5))
    groups = rollout.scores.reshape(-1, 4)
    informative = groups.std(-1) > 0
    assert rollout.tokens.shape[0] == 16 and 1 <= timings["dynamic/rollouts"] <= 3
    # Informative groups come first; flat ones only fill what the refills could not.
    assert not (~informative[:-1] & informative[1:]).any()
    if timings["dynamic/rollouts"] < 3:
        assert informative.all()
    metrics = trainer.step().metrics
    assert "dynamic/informative_frac" in metrics


def _ppo_on_one_rollout(tmp_path, variants, rollout_key, learn_key, prepare=None):
    """One one-device PPO trainer per ``{name: overrides}``; the first samples a rollout and
    every one learns it once. Returns the rollout and ``{name: (trainer, scored, params,
    metrics)}`` (``prepare(trainer)`` runs before learning)."""
    out, rollout = {}, None
    for name, overrides in variants.items():
        cfg, src = _config(tmp_path, "ppo", *overrides)
        trainer = build_rl_trainer(cfg, mesh=_one_device_mesh(), source=src)
        if prepare is not None:
            prepare(trainer)
        if rollout is None:
            rollout, _ = trainer.rollout(rollout_key)
        metrics = trainer.learn(rollout, learn_key)
        params = jax.device_get((trainer.policy_state.params, trainer.value_state.params))
        out[name] = (trainer, jax.device_get(trainer.last_scored), params, metrics)
    return rollout, out


def _assert_same_iteration(a, b, rollout, keys):
    """Scored per-token ``keys`` on response tokens and policy + critic params within 1e-5."""
    resp = rollout.response_mask
    for key in keys:
        np.testing.assert_allclose(getattr(a[1], key)[resp], getattr(b[1], key)[resp], atol=1e-5)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-5, rtol=0), a[2], b[2])


@pytest.mark.slow
def test_shared_prefix_iteration_equals_unpacked(tmp_path):
    """PPO with groups of 4 and a critic, KL in the reward (so old log-probs are scored), two
    epochs in two micro-batches: packed prompt groups vs the plain layout on the same rollout.
    Same math in another summation order: 1e-5 on scored arrays and on params after two
    Adam steps of lr 0.05 (eps = 1 keeps the steps smooth in the gradient)."""
    common = [
        "ppo.rollout.num_samples=4",
        "ppo.loss.epochs=2",
        "train.micro_batch_size=8",
        "ppo.loss.kl_coef=0.1",
        "ppo.rollout.pack_sequences=false",  # prompt groups only
    ]
    rollout, out = _ppo_on_one_rollout(
        tmp_path,
        {s: [*common, f"ppo.rollout.shared_prefix={str(s).lower()}"] for s in (True, False)},
        jax.random.key(7),
        jax.random.key(8),
    )
    for shared, (trainer, *_) in out.items():
        assert (
            trainer.layout.rl.groups.update == (4 if shared else 1)
            and trainer.layout.rl.num_micro == 2
        )
    keys = ("old_logprobs", "ref_logprobs", "old_values", "returns", "advantages")
    _assert_same_iteration(out[True], out[False], rollout, keys)
    # The scoring forward (4 groups) and the update's value-and-grad (2 groups per micro-batch)
    # are different XLA programs: the first ratio is 1 to float32 rounding, as on 8 devices.
    assert abs(out[True][3]["first/policy/ratio_max"] - 1.0) < 1e-5


@pytest.mark.slow
def test_shared_prefix_minibatches_take_whole_groups(tmp_path):
    from jaxrlhf.sharding import rules_for
    from jaxrlhf.sharding.micro_batches import merge_micro, split_micro

    mesh = _one_device_mesh()
    rows = {"x": jnp.arange(8)}
    got = split_micro(rows, 2, mesh, rules_for("policy", "train"), group_size=2)["x"]
    np.testing.assert_array_equal(got, [[0, 1, 4, 5], [2, 3, 6, 7]])  # group g -> micro g % 2
    np.testing.assert_array_equal(merge_micro(got, group_size=2), rows["x"])

    cfg, src = _config(
        tmp_path,
        "grpo",
        "grpo.loss.num_minibatches=2",
        "grpo.loss.epochs=2",
        "optimizer.eps=1e-8",
        "grpo.rollout.pack_sequences=false",  # prompt groups only
    )
    trainer = build_rl_trainer(cfg, mesh=mesh, source=src)
    assert trainer.layout.rl.groups.update == 4
    m = trainer.step().metrics  # shuffled minibatches of 2 whole groups each
    assert abs(m["first/policy/ratio_max"] - 1.0) < 1e-5  # float32 rounding, as above
    assert m["policy/ratio_max"] > 1.0 + 1e-3  # later minibatches see updated params
    # Model FLOPs count packed tokens: 4 groups of 16 prompt + 4 x 6 response slots = 160 of
    # the 16 x 22 rollout tokens, in generation (1 forward), scoring (reference and old
    # policy) and 2 epochs of the policy update (forward + backward = 3 forwards each).
    fpt = flops_per_token(trainer.model_cfg)
    flops = m["throughput/model_tflops"] * 1e12 * m["time/iteration_s"]
    np.testing.assert_allclose(flops, fpt * 160 * (1 + 2 + 3 * 2), rtol=1e-6)


@pytest.mark.slow
def test_shared_prefix_refuses_mixed_groups_and_logs_when_off(tmp_path, caplog):
    cfg, src = _config(tmp_path, "grpo", "grpo.rollout.pack_sequences=false")
    trainer = build_rl_trainer(cfg, mesh=_one_device_mesh(), source=src)
    rollout, _ = trainer.rollout(jax.random.key(1))
    rollout.tokens[5, -7] += 1  # row 5 (group 1) now has another prompt token
    with pytest.raises(ValueError, match="rollout group 1 .* does not share one prompt"):
        trainer.learn(rollout, jax.random.key(2))

    with caplog.at_level("WARNING"):
        trainer = build_rl_trainer(cfg, source=src)  # 4 groups over 8 fsdp shards
    assert trainer.layout.rl.groups == GroupSizes(score=1, update=1)
    assert "shared_prefix is off: 4 prompt groups do not split over 8 data shard(s)" in caplog.text

    # Micro-batches of 2 rows split groups of 4: scoring packs, the update does not.
    cfg, src = _config(
        tmp_path,
        "grpo",
        "train.micro_batch_size=2",
        "grpo.loss.epochs=2",
        "grpo.rollout.pack_sequences=false",
    )
    with caplog.at_level("WARNING"):
        trainer = build_rl_trainer(cfg, mesh=_one_device_mesh(), source=src)
    assert trainer.layout.rl.groups == GroupSizes(score=4, update=1)
    assert "is off in the update: 16 rows per minibatch" in caplog.text
    m = trainer.step().metrics
    assert abs(m["first/policy/ratio_max"] - 1.0) < 1e-5  # packed scoring, unpacked update


@pytest.mark.slow
@pytest.mark.parametrize("kl_mode", ["reward", "loss"])
def test_update_forwards_stand_in_for_the_scoring_forwards(tmp_path, kl_mode):
    """One epoch, one minibatch, one micro-batch: the critic's update computes the values,
    GAE and returns from its own forward, and with ``kl_mode: loss`` the policy's update
    forward gives the old log-probs (no scoring forward of either). Against the same
    iteration in 2 micro-batches, which scores both separately: same arrays, params and
    metrics to float32 summation order (1e-5). The reference is perturbed so the KL (in the
    reward or in the loss) is not 0."""
    common = ["ppo.loss.kl_coef=0.1", f"ppo.loss.kl_mode={kl_mode}"]

    def perturb_reference(trainer):
        trainer.ref_params = jax.tree.map(lambda x: x * 1.05, trainer.ref_params)

    rollout, out = _ppo_on_one_rollout(
        tmp_path,
        {m: [*common, f"train.micro_batch_size={m or 'null'}"] for m in (None, 2)},
        jax.random.key(11),
        jax.random.key(12),
        prepare=perturb_reference,
    )
    for micro, (trainer, *_) in out.items():
        assert trainer.layout.rl.reuse_value_forward == (micro is None)
        assert trainer.layout.rl.reuse_policy_forward == (micro is None and kl_mode == "loss")
        assert trainer.layout.rl.num_micro == (micro and 2 or 1)
    keys = ("old_logprobs", "old_values", "returns", "advantages")
    _assert_same_iteration(out[None], out[2], rollout, keys)
    assert out[None][3]["kl/seq_mean"] > 1e-3  # the perturbed reference: a real KL
    for key in ("value/explained_var", "advantages/abs_mean", "loss/value", "kl/seq_mean"):
        np.testing.assert_allclose(out[None][3][key], out[2][3][key], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_score_micro_batches_equal_one_scoring_forward(tmp_path, caplog):
    """PPO with a critic and a reward model, groups of 4, two update micro-batches (so the
    policy and critic scoring forwards run): the rollout scored at once, in 4 scoring
    micro-batches of one packed group, and in 8 of 2 rows (which split the groups: scoring
    unpacks, the update still packs). Same rows through the same forwards in other program
    shapes: scored arrays, reward-model scores and params within 1e-5 (measured: log-probs
    1e-6, params 1e-7, scores 3e-8)."""
    from jaxrlhf.models.config import ModelConfig
    from jaxrlhf.models.hf_checkpoint import save_hf

    rm_dir = str(tmp_path / "rm")
    tiny = ModelConfig.tiny()
    save_hf(rm_dir, tiny, M.init_params(tiny, jax.random.key(3), head="scalar"), head="scalar")
    common = [
        "ppo.rollout.num_samples=4",
        "train.micro_batch_size=8",
        "ppo.loss.kl_coef=0.1",
        "ppo.reward.function=null",
        f"ppo.reward.model_dir={rm_dir}",
    ]
    option = "ppo.rollout.score_micro_batch_size"
    variants = {m: [*common, f"{option}={m or 'null'}"] for m in (None, 4, 2)}
    with caplog.at_level("WARNING"):
        rollout, out = _ppo_on_one_rollout(
            tmp_path,
            variants,
            jax.random.key(5),
            jax.random.key(6),
        )
    assert "is off in scoring: 4 prompt groups do not split into 8 scoring" in caplog.text
    assert [t.layout.rl.groups for t, *_ in out.values()] == [
        GroupSizes(4, 4),
        GroupSizes(4, 4),
        GroupSizes(1, 4),
    ]
    keys = ("old_logprobs", "ref_logprobs", "old_values", "returns", "advantages")
    rm_scores = {
        m: t.programs.reward_scores(t.rm_params, rollout.tokens, rollout.mask)
        for m, (t, *_) in out.items()
    }
    assert np.ptp(rm_scores[None]) > 1e-3  # a real reward model: rows score differently
    for m in (4, 2):
        _assert_same_iteration(out[None], out[m], rollout, keys)
        np.testing.assert_allclose(rm_scores[m], rm_scores[None], atol=1e-5)


SEEN = []


def recording_reward(prompts, completions, *, answer, prompt_ids, completion_ids, **columns):
    """Records what it was given; scores by the built-in grade so the run learns as usual."""
    SEEN.append((list(prompts), list(completions), list(answer), prompt_ids, completion_ids))
    return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]


@pytest.mark.parametrize("dynamic", tiered([False, True], [True]))
def test_reward_function_gets_each_rows_own_record(tmp_path, dynamic):
    """Shuffled prompts, 4 samples each (and dynamic sampling's refills): every row's
    ``answer`` is its own prompt's, and the ids decode to the texts it was given."""
    from jaxrlhf.data.tasks import sort_answer

    SEEN.clear()
    cfg, src = _config(
        tmp_path,
        "grpo",
        f"grpo.reward.function={__name__}.recording_reward",
        f"grpo.dynamic_sampling={str(dynamic).lower()}",
        "grpo.max_refills=1",
    )
    trainer = build_rl_trainer(cfg, mesh=_one_device_mesh(), source=src)
    for _ in range(2):
        trainer.step()
    assert len(SEEN) >= 2
    tok = trainer.tokenizer
    for prompts, completions, answers, prompt_ids, completion_ids in SEEN:
        assert len(prompts) == 16 and [sort_answer(p) for p in prompts] == answers
        assert [tok.decode(i) for i in prompt_ids] == prompts
        assert [tok.decode(i) for i in completion_ids] == completions
        assert all(prompts[i] == prompts[i - i % 4] for i in range(16))  # groups of 4


@pytest.mark.slow
def test_progress_lines_follow_log_every_while_every_iteration_is_logged(tmp_path, capsys):
    from jaxrlhf.train import loop

    cfg, src = _config(
        tmp_path,
        "grpo",
        "train.steps=4",
        "train.log_every=2",
        "logging.progress=plain",
        "logging.plot=false",
        "checkpoint.export_hf=false",
    )
    result = loop.run(cfg, mesh=_one_device_mesh(), source=src)
    assert [r["step"] for r in result.history] == [1, 2, 3, 4]  # metrics.jsonl: every one
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "reward/mean" in ln]
    assert len(lines) == 2, lines  # progress: steps 2 and 4


def test_a_checkpoint_without_a_metric_window_resumes():
    """RL checkpoints of the previous layout saved only ``skip_run``: an empty window."""
    from jaxrlhf.train.loop import _Window

    window = _Window.from_meta({"step": 3, "skip_run": 1})
    assert (window.running, window.count, window.skip_run) == (None, 0, 1)
