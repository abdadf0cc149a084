"""ILQL: offline data, the loss's layout against trlX's indexing, Polyak targets, advantage-
weighted decoding, learning on the built-in task, export and exact resume."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import losses
from jaxrlhf.config import ConfigError, validate
from jaxrlhf.data import load_datasets, load_tokenizer
from jaxrlhf.data.tasks import builtin_records, grade
from jaxrlhf.generation import ilql_sampling
from jaxrlhf.models import ilql as ilql_model
from jaxrlhf.models import model as model_lib
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.hf_checkpoint import load_params, save_hf
from jaxrlhf.models.hf_config import load_hf_config
from jaxrlhf.train import ilql, loop
from jaxrlhf.train.config import ILQLConfig
from tests.train.helpers import config, mesh

SHORT = (
    "train.steps=4",
    "optimizer.warmup_steps=0",
    "train.eval_every=0",
    "train.log_every=1",
    "data.builtin_size=256",
)


def _model() -> tuple[ModelConfig, object, dict]:
    cfg = ModelConfig.tiny(initializer_range=0.2)
    params = ilql_model.copy_q_to_target(model_lib.init_params(cfg, jax.random.key(0), "ilql"))
    return cfg, model_lib.build(cfg, "ilql"), params


# ---- data ------------------------------------------------------------------------------


def test_builtin_offline_records_carry_their_graded_reward():
    records = builtin_records("sort", "offline", 200, seed=3)
    for r in records:
        assert r["reward"] == grade("sort", r["answer"], r["response"])
    rewards = np.array([r["reward"] for r in records])
    assert 0.3 < np.mean(rewards == 1.0) < 0.5  # the right answer 40% of the time
    assert rewards.min() < 1.0


def test_offline_batches_hold_each_rows_reward(tmp_path):
    cfg = config("tiny_ilql", tmp_path, *SHORT, "ilql.normalize_rewards=false")
    trainer = loop.build_trainer(cfg)
    data = trainer.train_data
    batch = data.batch(np.array([2, -1, 0]), cfg.data.max_length)
    expected = [data.records[2]["reward"], 0.0, data.records[0]["reward"]]
    np.testing.assert_array_equal(batch["reward"], np.float32(expected))
    assert batch["tokens"].shape == (3, cfg.data.max_length)
    assert not batch["mask"][1].any()


def test_offline_records_without_a_finite_reward_are_dropped(tmp_path):
    path = tmp_path / "offline.jsonl"
    rows = [
        '{"prompt": "sort 21:", "response": "12", "reward": 1.0}',
        '{"prompt": "sort 31:", "response": "13", "reward": 1}',
        '{"prompt": "sort 41:", "response": "14"}',
        '{"prompt": "sort 51:", "response": "15", "reward": "high"}',
        '{"prompt": "sort 61:", "response": "16", "reward": NaN}',
    ]
    path.write_text("\n".join(rows) + "\n")
    cfg = config(
        "tiny_ilql",
        tmp_path,
        f"data.train={path}",
        "data.eval_size=0",
        "ilql.eval_reward=null",
        "data.drop_error_fraction=1.0",
        "data.drop_warn_fraction=1.0",
        device_count=None,
    )
    train, _ = load_datasets("offline", cfg.data, load_tokenizer(cfg.tokenizer), cfg.tokenizer)
    assert train.report.kept == 2
    assert train.report.bad == {
        "missing field 'reward'": 1,
        "field 'reward' is not a number": 1,
        "field 'reward' is not finite": 1,
    }
    np.testing.assert_array_equal(train.extras["reward"], [1.0, 1.0])


# ---- the loss --------------------------------------------------------------------------


def test_targets_lay_out_actions_rewards_and_dones_as_trlx():
    """Row 0: prompt 2 tokens, response 3 (positions 2-4) in T = 6; row 1: padding."""
    tokens = jnp.array([[5, 6, 7, 8, 9, 0], [0] * 6])
    response = jnp.array([[0, 0, 1, 1, 1, 0], [0] * 6], bool)
    batch = {"tokens": tokens, "response_mask": response, "reward": jnp.array([0.5, 3.0])}
    t = ilql.ilql_targets(batch)
    np.testing.assert_array_equal(t.actions, tokens[:, 1:])
    # actions 1, 2, 3 are the response tokens 7, 8, 9; the reward is paid on action 3
    np.testing.assert_array_equal(t.rewards, [[0, 0, 0, 0.5, 0], [0] * 5])
    # states 1, 2, 3 precede real actions; state 4 (after token 9) is terminal
    np.testing.assert_array_equal(t.nonterminal, [[0, 1, 1, 1, 0, 0], [0] * 6])


@pytest.mark.slow
def test_objective_loss_equals_ilql_loss_on_trlx_indexed_arrays():
    """Reference: trlX's layout built row by row in NumPy (actions_ixs = the positions
    before each response token, states_ixs = those plus the last token, dones = 1 but the
    last), gathered from the same forward's outputs, through ``losses.ilql_loss``. Tolerance
    1e-6: the same float32 values summed in a different order."""
    cfg, module, params = _model()
    hyper = ILQLConfig(awac_beta=0.5, cql_scale=0.3)
    rng = np.random.default_rng(0)
    prompt_lens, response_lens, t_len = [3, 2, 4], [4, 5, 2], 10
    tokens = np.zeros((3, t_len), np.int32)
    mask = np.zeros((3, t_len), bool)
    response = np.zeros((3, t_len), bool)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        tokens[i, : p + r] = rng.integers(1, cfg.vocab_size, p + r)
        mask[i, : p + r] = True
        response[i, p : p + r] = True
    reward = np.float32([0.3, -1.2, 2.0])
    batch = {"tokens": tokens, "mask": mask, "response_mask": response, "reward": reward}
    loss, aux = ilql.loss_fn(hyper, module, params, batch)

    out = jax.device_get(model_lib.forward(module, params, jnp.asarray(tokens), jnp.asarray(mask)))
    n = max(response_lens)
    logits = np.zeros((3, n, cfg.vocab_size), np.float32)
    qs = np.zeros((2, 3, n, cfg.vocab_size), np.float32)
    tqs = np.zeros_like(qs)
    values = np.zeros((3, n + 1), np.float32)
    actions = np.zeros((3, n), np.int32)
    rewards = np.zeros((3, n), np.float32)
    dones = np.zeros((3, n + 1), bool)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        actions_ixs = np.arange(p - 1, p + r - 1)
        states_ixs = np.append(actions_ixs, p + r - 1)
        logits[i, :r] = out.logits[i, actions_ixs]
        qs[:, i, :r] = out.q[:, i, actions_ixs]
        tqs[:, i, :r] = out.target_q[:, i, actions_ixs]
        values[i, : r + 1] = out.values[i, states_ixs]
        actions[i, :r] = tokens[i, actions_ixs + 1]
        rewards[i, r - 1] = reward[i]
        dones[i, :r] = True
    ref, ref_metrics = losses.ilql_loss(
        logits, list(qs), list(tqs), values, actions, rewards, dones,
        gamma=hyper.gamma, tau=hyper.tau, cql_scale=0.3, awac_scale=1.0, beta=0.5,
    )  # fmt: skip
    np.testing.assert_allclose(loss, ref, rtol=1e-6, atol=1e-6)
    for key, value in ref_metrics.items():
        np.testing.assert_allclose(aux.metrics[key], value, rtol=1e-6, atol=1e-6)
    assert float(ilql.weight_fn(batch)) == sum(response_lens)


@pytest.mark.slow
def test_polyak_targets_and_no_optimizer_state_for_them(tmp_path):
    """alpha 0.3 every 2 updates: after update 1 the targets are their initial values (the
    optimizer, weight decay included, never touches them); after update 2 they are
    0.3 * q + 0.7 * initial, exactly as computed here from the heads' values."""
    cfg = config("tiny_ilql", tmp_path, *SHORT, "ilql.alpha=0.3", "ilql.target_sync_every=2")
    trainer = loop.build_trainer(cfg)
    init = jax.device_get(trainer.state.params)
    for k in range(ilql_model.NUM_Q_HEADS):
        jax.tree.map(
            np.testing.assert_array_equal, init[f"target_q_heads_{k}"], init[f"q_heads_{k}"]
        )
    trainer.step()
    first = jax.device_get(trainer.state.params)
    trainer.step()
    second = jax.device_get(trainer.state.params)
    for k in range(ilql_model.NUM_Q_HEADS):
        q, target = f"q_heads_{k}", f"target_q_heads_{k}"
        jax.tree.map(np.testing.assert_array_equal, first[target], init[target])
        assert not np.allclose(first[q]["out_kernel"], init[q]["out_kernel"])  # trained
        expected = jax.tree.map(lambda t, s: 0.3 * s + 0.7 * t, first[target], second[q])
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
            second[target],
            expected,
        )
    opt_leaves = jax.tree.leaves(trainer.state.opt_state)
    trainable = sum(
        x.size for name, x in init.items() if not name.startswith("target") for x in
        jax.tree.leaves(x)
    )  # fmt: skip
    # Adam's two moments (and counters) for the trained leaves only
    assert sum(x.size for x in opt_leaves) < 2 * trainable + 16


# ---- decoding --------------------------------------------------------------------------


def test_advantage_weighted_scores_against_numpy():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 7)).astype(np.float32)
    tq = rng.normal(size=(2, 2, 7)).astype(np.float32)
    v = rng.normal(size=(2,)).astype(np.float32)
    got = np.asarray(ilql_sampling.advantage_weighted_scores(logits, tq, v, beta=2.5, top_k=3))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = logp + 2.5 * (np.minimum(tq[0], tq[1]) - v[:, None])
    for row in range(2):
        keep = np.argsort(-want[row])[:3]
        np.testing.assert_allclose(got[row, keep], want[row, keep], rtol=1e-6, atol=1e-6)
        assert np.isneginf(np.delete(got[row], keep)).all()
    full = ilql_sampling.advantage_weighted_scores(logits, tq, v, beta=2.5, top_k=0)
    np.testing.assert_allclose(full, want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_cached_decoding_equals_recomputing_every_prefix():
    """Greedy advantage-weighted decoding with the KV cache == re-running the whole prefix
    at every step (tokens exact); rows of different prompt lengths, left-padded."""
    cfg, module, params = _model()
    tokens = jnp.array([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]], jnp.int32)
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], bool)
    new, alive = ilql_sampling.generate(
        module, params, tokens, mask, jax.random.key(0),
        max_new_tokens=6, beta=1.5, top_k=4, temperature=0.0,
    )  # fmt: skip
    assert bool(alive.all())
    for row in range(2):
        seq = [int(t) for t, m in zip(tokens[row], mask[row], strict=True) if m]
        for _ in range(6):
            t = jnp.asarray([seq])
            o = model_lib.forward(module, params, t, jnp.ones_like(t, bool))
            s = ilql_sampling.advantage_weighted_scores(
                o.logits[:, -1], o.target_q[:, :, -1], o.values[:, -1], beta=1.5, top_k=4
            )
            seq.append(int(jnp.argmax(s[0])))
        assert [int(x) for x in new[row]] == seq[-6:]


@pytest.mark.slow
def test_decoding_stops_rows_at_eos():
    cfg, module, params = _model()
    tokens = jnp.array([[3, 4], [5, 6]], jnp.int32)
    mask = jnp.ones((2, 2), bool)
    free, _ = ilql_sampling.generate(
        module, params, tokens, mask, jax.random.key(0),
        max_new_tokens=5, beta=0.0, temperature=0.0,
    )  # fmt: skip
    eos = int(free[0, 1])  # row 0's second token becomes the stop token
    new, alive = ilql_sampling.generate(
        module, params, tokens, mask, jax.random.key(0),
        max_new_tokens=5, beta=0.0, temperature=0.0, stop_ids=(eos, 127), pad_id=0,
    )  # fmt: skip
    np.testing.assert_array_equal(alive[0], [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(new[0, :2], free[0, :2])
    assert (np.asarray(new[0, 2:]) == 0).all()
    first_eos = [i for i, t in enumerate(free[1]) if int(t) == eos]
    stop = first_eos[0] + 1 if first_eos else 5
    assert int(alive[1].sum()) == stop


# ---- runs ------------------------------------------------------------------------------


@pytest.mark.slow
def test_ilql_beats_the_behaviour_data_on_held_out_prompts(tmp_path):
    """configs/tiny_ilql.yaml (800 updates). At temperature 1, sampling the behaviour-cloned
    model (decode_beta 0) scores about the behaviour data's mean (~0.74 on the held-out
    records); ILQL's advantage-weighted decoding (decode_beta 8) must beat that mean and
    the decode_beta-0 samples by 0.05 each (measured: ~0.93 vs 0.74 and ~0.66; the sampling
    noise of a 128-prompt mean is ~0.02). The export: the language model, loadable as a
    causal LM, and the heads beside it, which restore the ILQL model exactly."""
    cfg = config(
        "tiny_ilql",
        tmp_path,
        "train.eval_every=0",
        "checkpoint.every=0",
        "mesh.fsdp=1",
        device_count=1,
    )
    # One device, as the config runs on a 1-device CPU: its `fsdp: -1` would take the
    # suite's 8 fake devices; sharded ILQL is the resume test's and test_multihost's.
    result = loop.run(cfg, mesh=mesh(1, 1, 1))
    final = result.history[-1]
    assert final["eval/reward"] > final["eval/behaviour_reward"] + 0.05, final
    trainer = result.trainer
    cloned = ilql.sample_evaluation(
        cfg.replace(ilql=ILQLConfig(**{**vars(cfg.ilql), "decode_beta": 0.0})),
        trainer.programs.learner.module,
        trainer.eval_data,
        trainer.tokenizer,
        trainer.programs.batch_shardings["tokens"],
    )(trainer.model_params)
    assert final["eval/reward"] > cloned["eval/reward"] + 0.05, (final, cloned)

    # the export is the language model alone, loadable as a causal LM with the same logits
    hf_dir = os.path.join(cfg.output_dir, "hf")
    lm_cfg = load_hf_config(hf_dir)
    lm = load_params(hf_dir, lm_cfg, head="lm")
    tokens = jnp.asarray(trainer.eval_data.batch(np.arange(4), 32)["tokens"])
    mask = tokens != trainer.eval_data.pad_id
    params = jax.device_get(trainer.model_params)
    want = model_lib.forward(model_lib.build(trainer.model_cfg, "ilql"), params, tokens, mask)
    got = model_lib.forward(model_lib.build(lm_cfg), lm, tokens, mask)
    # two programs (LM alone, LM + heads) whose float32 matmuls XLA may fuse differently
    np.testing.assert_allclose(got, want.logits, rtol=1e-5, atol=1e-5)
    restored = {**lm, **ilql.load_heads(os.path.join(hf_dir, ilql.HEADS_DIR))}
    jax.tree.map(np.testing.assert_array_equal, restored, params)


@pytest.mark.slow
def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(tmp_path):
    """6 updates with checkpoints every 3; a run directory holding only the step-3
    checkpoint resumes and ends bitwise equal (params, target heads, optimizer state)."""
    args = (*SHORT, "train.steps=6", "checkpoint.every=3", "ilql.target_sync_every=2")
    ref = loop.run(config("tiny_ilql", tmp_path / "ref", *args))
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "ref" / "checkpoints", resumed_dir / "checkpoints")
    shutil.rmtree(resumed_dir / "checkpoints" / "6")
    resumed = loop.run(config("tiny_ilql", resumed_dir, *args))
    assert resumed.trainer.steps_done == 6
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
        resumed.trainer.state,
        ref.trainer.state,
    )


@pytest.mark.slow
def test_a_causal_lm_checkpoint_starts_ilql_with_fresh_heads(tmp_path):
    """From a Hugging Face causal LM: the LM's params are the checkpoint's, the heads random
    and the target Q heads equal to the Q heads."""
    lm_cfg = ModelConfig.tiny(hidden_size=64, intermediate_size=128, vocab_size=128)
    lm = model_lib.init_params(lm_cfg, jax.random.key(5))
    hf_dir = str(tmp_path / "lm")
    save_hf(hf_dir, lm_cfg, lm)
    cfg = config(
        "tiny_ilql", tmp_path / "run", *SHORT, f"model.hf_dir={hf_dir}", "model.preset=null"
    )
    params = jax.device_get(loop.build_trainer(cfg).state.params)
    jax.tree.map(np.testing.assert_array_equal, ilql_model.lm_params(params), lm)
    for k in range(ilql_model.NUM_Q_HEADS):
        q, target = params[f"q_heads_{k}"], params[f"target_q_heads_{k}"]
        jax.tree.map(np.testing.assert_array_equal, q, target)
        assert np.abs(q["out_kernel"]).max() > 0
    assert np.abs(params["v_head"]["hidden_kernel"]).max() > 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("lora.rank=8",), "lora: ILQL trains the whole model"),
        (("data.train=data.jsonl",), "ilql.eval_reward: 'builtin' needs a built-in dataset"),
        (("ilql.max_new_tokens=200",), "ilql.max_new_tokens: data.max_prompt_length + "),
        (("ilql.tau=1.5",), "tau: must be in (0, 1)"),
        (("ilql.decode_beta=.nan",), "decode_beta: must be a finite number >= 0"),
        (("data.eval_size=0",), "ilql.eval_reward: the sampled evaluation needs held-out"),
    ],
)
def test_bad_ilql_configs_are_one_line_errors(tmp_path, overrides, message):
    with pytest.raises((ConfigError, ValueError)) as e:
        cfg = config("tiny_ilql", tmp_path, *overrides, device_count=None)
        validate(cfg, 1)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_a_reward_function_that_does_not_import_is_a_config_error(tmp_path):
    cfg = config("tiny_ilql", tmp_path, *SHORT, "ilql.eval_reward=nowhere.reward")
    with pytest.raises(ConfigError, match=r"^ilql.eval_reward: cannot import 'nowhere.reward'"):
        loop.build_trainer(cfg)


@pytest.mark.slow
def test_rewards_are_standardised_with_the_training_sets_statistics(tmp_path):
    """As trlX: (r - mean) / std over the training records, the held-out ones by the same
    transform; the evaluation's behaviour reward stays the recorded mean."""
    cfg = config("tiny_ilql", tmp_path, *SHORT)
    trainer = loop.build_trainer(cfg)
    raw = np.array([r["reward"] for r in trainer.train_data.records], np.float32)
    want = (raw - raw.mean()) / raw.std()
    np.testing.assert_allclose(trainer.train_data.extras["reward"], want, rtol=1e-5, atol=1e-6)
    held = np.array([r["reward"] for r in trainer.eval_data.records], np.float32)
    np.testing.assert_allclose(
        trainer.eval_data.extras["reward"], (held - raw.mean()) / raw.std(), rtol=1e-5, atol=1e-6
    )
    assert trainer.sample_eval.behaviour == pytest.approx(float(held.mean()))
    off = loop.build_trainer(config("tiny_ilql", tmp_path / "off", *SHORT,
                                    "ilql.normalize_rewards=false"))  # fmt: skip
    np.testing.assert_array_equal(off.train_data.extras["reward"], raw)


@pytest.mark.slow
def test_heads_are_float32_in_a_bfloat16_model():
    """A Polyak step of 0.001 must not round away: the heads keep float32 params."""
    cfg = ModelConfig.tiny(param_dtype="bfloat16", dtype="bfloat16")
    params = model_lib.init_params(cfg, jax.random.key(0), "ilql")
    heads = ilql_model.head_params(params)
    assert {x.dtype for x in jax.tree.leaves(heads)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(params["decoder"])} == {jnp.dtype(jnp.bfloat16)}
    q = jax.tree.map(lambda x: x + 1.0, params["q_heads_0"])
    nudged = ilql_model.polyak_update({**params, "q_heads_0": q}, 0.001)
    delta = nudged["target_q_heads_0"]["out_bias"] - params["target_q_heads_0"]["out_bias"]
    np.testing.assert_allclose(delta, 0.001, rtol=1e-3)


def test_the_export_is_declared_a_causal_lm(tmp_path):
    """A pipeline stage reading ILQL's export (e.g. as a reward model's start) plans for a
    ``*ForCausalLM``: the run's exported head is the LM's, not the training head."""
    cfg = config("tiny_ilql", tmp_path, *SHORT)
    assert loop.exported_model(cfg) == (os.path.join(cfg.output_dir, "hf"), "lm")
