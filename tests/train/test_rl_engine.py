"""RL iterations with the rollout engine: the same samples and the same update as the static
sampler, scoring streamed between decode chunks or not.

Tolerances: the engine's log-probs equal the static sampler's to float32 rounding (~5e-7);
streamed scoring runs the same forwards on micro-batches of other shapes, so scored arrays,
metrics and parameters after one Adam step (eps = 1, lr 0.05) agree to 1e-5.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrlhf.config import ConfigError
from jaxrlhf.train.rl_scoring import abstract_rows
from jaxrlhf.train.rl_trainer import build_rl_trainer
from tests.tiers import tiered
from tests.train.test_rl import _config, _one_device_mesh

ENGINE = ("grpo.rollout.engine=continuous", "grpo.rollout.slots=8", "grpo.rollout.chunk_tokens=2")


def _iteration(tmp_path, *overrides, algorithm="grpo"):
    """``(trainer, metrics, policy params, the rollout it learned)`` after one step."""
    cfg, src = _config(tmp_path, algorithm, f"{algorithm}.loss.kl_coef=0.1", *overrides)
    trainer = build_rl_trainer(cfg, mesh=_one_device_mesh(), source=src)
    learned, learn = [], trainer.learn

    def recording_learn(rollout, *args, **kwargs):
        learned.append(rollout)
        return learn(rollout, *args, **kwargs)

    trainer.learn = recording_learn
    metrics = trainer.step().metrics
    return trainer, metrics, jax.device_get(trainer.policy_state.params), learned[0]


def _assert_close(a, b, keys):
    for key in keys:
        np.testing.assert_allclose(a[1][key], b[1][key], atol=1e-5, rtol=1e-5, err_msg=key)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-5, rtol=0), a[2], b[2])


METRICS = ("reward/mean", "kl/seq_mean", "loss/policy", "advantages/abs_mean", "grad_norm")


@pytest.fixture(scope="module")
def static_iteration(tmp_path_factory):
    """``_iteration`` on the static sampler (what the engine's iterations must equal)."""
    return _iteration(tmp_path_factory.mktemp("static"))


@pytest.mark.parametrize("stream", tiered([True, False], [False]))
def test_engine_iteration_equals_the_static_one(tmp_path, stream, static_iteration):
    """16 rows through 8 slots (rows wait and reuse slots), stop at EOS: the same samples,
    scores and update as the static sampler's iteration."""
    static = static_iteration
    engine = _iteration(tmp_path, *ENGINE, f"grpo.rollout.stream_scoring={str(stream).lower()}")
    assert engine[1]["rollout/decode_chunks"] > 1 and engine[1]["rollout/aborted_groups"] == 0
    for name in ("response/length_mean", "reward/mean"):
        assert engine[1][name] == static[1][name], name  # identical samples
    _assert_close(engine, static, METRICS)
    if stream:
        assert engine[1]["time/score_streamed_s"] > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "models",
    [(), ("ppo.value.branch_layer=1",), ("lora.rank=4",)],
    ids=["separate_critic", "hydra_critic", "lora"],
)
def test_streamed_ppo_scoring_equals_unstreamed(tmp_path, models):
    """PPO with a critic and groups of 2 (packed), two update micro-batches so the critic's
    values and the old log-probs are scoring forwards: streamed (its batches packed by
    real lengths) against after-the-fact; the critic separate or a Hydra branch (one joint
    forward), or both models LoRA."""
    common = (
        "ppo.rollout.engine=continuous",
        "ppo.rollout.slots=4",
        "ppo.rollout.chunk_tokens=2",
        "ppo.rollout.num_samples=2",
        "train.micro_batch_size=2",
        *models,
    )
    streamed = _iteration(tmp_path, *common, algorithm="ppo")
    after = _iteration(tmp_path, *common, "ppo.rollout.stream_scoring=false", algorithm="ppo")
    assert streamed[1]["packing/score_slots"] > 0  # the streamed batches packed sequences
    keys = (*METRICS, "loss/value", "value/explained_var")
    _assert_close(streamed, after, keys)
    scored = [jax.device_get(t.last_scored) for t, *_ in (streamed, after)]
    # On the response tokens (all the update reads): a forward that packs sequences leaves
    # 0 at padding, and each streamed batch packs on its own (the whole rollout may not).
    resp = streamed[3].response_mask
    np.testing.assert_array_equal(resp, after[3].response_mask)
    for name in ("old_logprobs", "ref_logprobs", "old_values", "returns", "advantages"):
        np.testing.assert_allclose(
            getattr(scored[0], name)[resp], getattr(scored[1], name)[resp], atol=1e-5, err_msg=name
        )


@pytest.mark.slow
@pytest.mark.parametrize("micro", [8, 2])
def test_streamed_scoring_keeps_the_score_micro_batch_size(tmp_path, micro):
    """PPO with a critic and a reward model, 4 prompts x 4 samples and
    ``score_micro_batch_size``: the rollout scores in micro-batches of ``micro`` rows, a
    streamed batch (4 rows, a quarter) in one forward (8: it fits) or in 2 of 2 rows. Both
    equal the unstreamed iteration with the same setting (1e-5, as above); before, the
    streamed batch was split like the whole rollout and did not reshape."""
    from jaxrlhf.models import model as M
    from jaxrlhf.models.config import ModelConfig
    from jaxrlhf.models.hf_checkpoint import save_hf

    rm_dir = str(tmp_path / "rm")
    tiny = ModelConfig.tiny()
    save_hf(rm_dir, tiny, M.init_params(tiny, jax.random.key(3), head="scalar"), head="scalar")
    common = (
        "ppo.rollout.engine=continuous",
        "ppo.rollout.slots=8",
        "ppo.rollout.chunk_tokens=2",
        "ppo.rollout.num_samples=4",
        "train.micro_batch_size=8",
        "ppo.reward.function=null",
        f"ppo.reward.model_dir={rm_dir}",
        f"ppo.rollout.score_micro_batch_size={micro}",
    )
    streamed = _iteration(tmp_path, *common, algorithm="ppo")
    after = _iteration(tmp_path, *common, "ppo.rollout.stream_scoring=false", algorithm="ppo")
    assert streamed[1]["time/score_streamed_s"] > 0
    assert streamed[0].layout.rl.score_micro == 16 // micro
    assert np.ptp(streamed[3].scores) > 1e-3  # the reward model scores rows differently
    np.testing.assert_allclose(streamed[3].scores, after[3].scores, atol=1e-5)
    _assert_close(streamed, after, (*METRICS, "loss/value", "value/explained_var"))


@pytest.mark.slow
def test_oversampling_keeps_prompts_per_step_groups(tmp_path):
    trainer, metrics, *_ = _iteration(tmp_path, *ENGINE, "grpo.rollout.oversample_groups=2")
    assert metrics["rollout/aborted_groups"] == 2
    rollout, _ = trainer.rollout(jax.random.key(3))
    assert rollout.rows == 16  # prompts_per_step (4) x num_samples (4) kept


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["grpo.rollout.slots=8"], "grpo.rollout.slots: needs engine: continuous"),
        (["grpo.rollout.oversample_groups=1"], "oversample_groups: needs engine: continuous"),
        (ENGINE[:1] + ("grpo.rollout.slots=6",), "slots: 6 do not hold whole groups of"),
        (ENGINE[:1] + ("grpo.rollout.token_budget=10",), "token_budget: 10 is less than"),
        (["grpo.rollout.engine=paged"], "engine: expected one of ['static', 'continuous']"),
        (
            ENGINE[:1] + ("grpo.rollout.slots=32",),
            "grpo.rollout.slots: 32 exceed the 16 rows an iteration starts",
        ),
        (
            ENGINE[:1] + ("grpo.rollout.environment=a.Env", "grpo.rollout.turn_tokens=7"),
            "grpo.rollout.turn_tokens: 7 exceeds max_new_tokens = 6",
        ),
        (
            ENGINE[:1] + ("grpo.rollout.turn_tokens=3",),
            "grpo.rollout.turn_tokens: applies to multi-turn episodes; set environment",
        ),
        (
            ["grpo.rollout.max_turns=2"],
            "grpo.rollout.max_turns: applies to multi-turn episodes; set environment",
        ),
        (
            ENGINE[:1] + ("grpo.rollout.environment=Env",),
            "grpo.rollout.environment: 'Env' is not a dotted path module.attr",
        ),
        (
            ["grpo.reward.function=score"],
            "grpo.reward.function: 'score' is not a dotted path module.attr",
        ),
        (["rollout.slots=4"], "rollout: unknown key (did you mean ppo.rollout or grpo.rollout?"),
    ],
)
def test_engine_settings_errors_are_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as e:
        _config(tmp_path, "grpo", *overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_unset_slots_that_do_not_split_blame_what_sets_them(tmp_path):
    """Slots unset: one per started row, (4 + 5) x 4 = 36, which 8 data shards do not
    split; the error names oversample_groups and says to set slots."""
    from jaxrlhf.config import validate

    overrides = (*ENGINE[:1], "grpo.rollout.oversample_groups=5", "mesh.data=8")
    cfg, src = _config(tmp_path, "grpo", *overrides)
    with pytest.raises(ConfigError) as e:
        validate(cfg, 8, source=src)
    assert "grpo.rollout.oversample_groups: the engine's slots (unset: one per started row" in (
        str(e.value)
    )
    assert "= 36) do not split over the sampler's 8 data shard(s); set grpo.rollout.slots" in (
        str(e.value)
    )


@pytest.mark.slow
def test_engine_chunks_run_at_most_max_new_tokens_steps(tmp_path):
    """chunk_tokens above max_new_tokens (6): each chunk runs 6 steps (a row admitted before
    a chunk ends within it); the dry run's note says so."""
    from jaxrlhf.train import dry_run

    cfg, src = _config(tmp_path, "grpo", *ENGINE[:2], "grpo.rollout.chunk_tokens=100")
    assert cfg.grpo.rollout.chunk_steps == 6
    report = dry_run.plan(cfg, mesh=_one_device_mesh(), source=src)
    (note,) = [n for n in report.notes if n.startswith("rollout engine")]
    assert "6 steps per chunk" in note


@pytest.mark.slow
def test_dry_run_plans_the_engine(tmp_path):
    """The engine's decode-weights, admission and decode-chunk programs (the whole state,
    and the largest view) replace the static sampler's; the note gives its KV cache:
    8 slots x (16 + 6) positions x 2 layers x K=2 heads x H=8 x (key + value) x 4 bytes =
    45,056 B = 0.04 MiB on one device."""
    from jaxrlhf.train import dry_run

    cfg, src = _config(tmp_path, "grpo", *ENGINE)
    report = dry_run.plan(cfg, mesh=_one_device_mesh(), source=src)
    names = [p.name for p in report.programs]
    views = ["decode view 4x6", "decode view 1x6", "decode view 8x6"]  # largest, corners
    streamed = ["score (streamed)"]  # stream_scoring is on by default
    assert names == ["decode weights", "admit", "decode", *views, "score", *streamed, "update"]
    (note,) = [n for n in report.notes if n.startswith("rollout engine")]
    assert "8 slots of 16 + 6 tokens" in note and "0.04 MiB per device" in note
    # What the planner prices views with: K and V of 2 layers x 2 KV heads x 8 dims, fp32.
    kv = 2 * 2 * 2 * 8 * 4
    assert report.engine_layout == dry_run.EngineLayout(8, 1, kv, ((4, 6), (1, 6), (8, 6)))
    assert "up to 3 smaller decode views" in note  # 4, 2 or 1 of the 8 slots
    # The decode-layout weights are made before the first admission and live until the last
    # chunk: held beside the admission, passed to the chunks.
    made, admit, decode = report.programs[:3]
    assert admit.state_bytes == decode.state_bytes
    # XLA's output size also counts the output tuple's table of buffer pointers (8 B each).
    table = made.output_bytes - (admit.resident_bytes - decode.resident_bytes)
    assert made.output_bytes > 50_000 and 0 <= table <= 8 * 64
    # Streamed scoring runs between chunks: beside what the chunks hold it counts the slot
    # state (the chunk's argument, not held there) and the forwards scored before it (at
    # most 12 rows: all but its own micro-batch, a quarter of the 16 rows in whole groups).
    state, forwards = _streamed_trees(
        build_rl_trainer(cfg, mesh=_one_device_mesh(), source=src), 12
    )
    extra = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((state, forwards)))
    assert extra > 45_056  # the KV cache alone is 45,056 B
    (score_streamed,) = [p for p in report.programs if p.name == "score (streamed)"]
    assert score_streamed.state_bytes == decode.state_bytes + extra
    (score,) = [p for p in report.programs if p.name == "score"]
    assert 0 < score_streamed.argument_bytes < score.argument_bytes  # 4 of its 16 rows


def _streamed_trees(trainer, rows: int) -> tuple:
    """The abstract trees streamed scoring holds beside its programs in the runs above
    (16-token prompts, 6 new tokens): the engine's slot state and ``rows`` rows' scoring
    forwards."""
    programs = trainer.programs
    state = jax.eval_shape(programs.engine.empty_program(16, 6))
    forwards = jax.eval_shape(
        lambda *a: programs.score_forwards(*a, None),
        trainer.policy_params,
        trainer.ref_params,
        trainer.value_params,
        abstract_rows(rows, 22, packed=False),
    )
    return state, forwards


@pytest.mark.slow
def test_dry_run_holds_whole_streamed_micro_batches(tmp_path):
    """5 prompts x 4 samples = 20 rows stream in micro-batches of 8 (whole groups, about a
    quarter, rounded up to 2 groups); the last is padded to 8 rows, so while it is scored
    the two before it (16 rows) are held, not 20 - 8 = 12."""
    from jaxrlhf.train import dry_run

    cfg, src = _config(tmp_path, "grpo", *ENGINE, "grpo.rollout.prompts_per_step=5")
    report = dry_run.plan(cfg, mesh=_one_device_mesh(), source=src)
    by_name = {p.name: p for p in report.programs}
    state, forwards = _streamed_trees(
        build_rl_trainer(cfg, mesh=_one_device_mesh(), source=src), 16
    )
    extra = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((state, forwards)))
    assert by_name["score (streamed)"].state_bytes == by_name["decode"].state_bytes + extra


@pytest.mark.slow
@pytest.mark.parametrize("micro", [2, 8])
def test_dry_run_plans_streamed_scoring_under_a_score_micro_batch_size(tmp_path, micro):
    """16 rows scored in micro-batches of 2 or 8: a streamed batch (4 rows) runs 2 forwards
    of 2 rows, or one; the dry run compiles it at its own rows (it used to split them like
    the rollout's and fail) and holds the 12 rows scored before the last."""
    from jaxrlhf.train import dry_run

    overrides = (*ENGINE, f"grpo.rollout.score_micro_batch_size={micro}")
    cfg, src = _config(tmp_path, "grpo", *overrides)
    report = dry_run.plan(cfg, mesh=_one_device_mesh(), source=src)
    by_name = {p.name: p for p in report.programs}
    streamed, score = by_name["score (streamed)"], by_name["score"]
    assert 0 < streamed.argument_bytes < score.argument_bytes
    unbounded, _ = _config(tmp_path, "grpo", *ENGINE)  # the same trees, no bound
    state, forwards = _streamed_trees(
        build_rl_trainer(unbounded, mesh=_one_device_mesh(), source=src), 12
    )
    extra = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((state, forwards)))
    assert streamed.state_bytes == by_name["decode"].state_bytes + extra


@pytest.mark.slow
def test_dry_run_notes_host_modules_it_cannot_find(tmp_path, monkeypatch):
    """The reward function's and the environment's modules are looked up, not imported: a
    package whose import would fail is found (and a namespace package inside it), a missing
    one is noted (the plan goes on)."""
    import sys

    from jaxrlhf.train import dry_run
    from jaxrlhf.train.dry_run_rl import module_exists

    package = tmp_path / "trapped"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (package / "env.py").write_text("")
    (package / "portion").mkdir()  # a namespace package inside it
    (package / "portion" / "mod.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert module_exists("trapped.env") and module_exists("json.decoder")
    assert module_exists("trapped.portion.mod") and not module_exists("trapped.portion.nope")
    assert not module_exists("trapped.nope") and not module_exists("nowhere.env")
    assert "trapped" not in sys.modules

    overrides = ("grpo.rollout.environment=trapped.env.Env", "grpo.reward.function=nowhere.f")
    cfg, src = _config(tmp_path, "grpo", *ENGINE, *overrides)
    report = dry_run.plan(cfg, mesh=_one_device_mesh(), source=src)
    assert not [n for n in report.notes if "rollout.environment" in n]
    assert "grpo.reward.function: no module 'nowhere' on this host; a run here would stop" in (
        report.notes
    )
    assert "trapped" not in sys.modules


@pytest.mark.slow
def test_dry_run_counts_streamed_scoring_where_it_runs(tmp_path):
    """With the sampler on devices 0-3 and the learner on 4-7, streamed scoring runs on the
    learner's devices: the engine's slots and decode weights and the sampler's policy copy
    live elsewhere and are not counted there; only the forwards it holds are added to what
    scoring holds (12 rows of 22 split over 4 devices, float32, one array per forward it
    returns)."""
    from jaxrlhf.train import dry_run

    separated = ("placement.strategy=separated", "placement.sampler={devices: [0, 1, 2, 3]}")
    cfg, src = _config(tmp_path, "grpo", *ENGINE, *separated)
    report = dry_run.plan(cfg, source=src)
    by_name = {p.name: p for p in report.programs}
    score, streamed = by_name["score"], by_name["score (streamed)"]
    _, forwards = _streamed_trees(build_rl_trainer(cfg, source=src), 12)
    arrays = [x for x in jax.tree.leaves(forwards) if x.ndim]
    assert arrays and all(x.shape[0] == 12 and x.dtype == np.float32 for x in arrays)
    per_device = sum(x.size * 4 for x in arrays) // 4
    assert streamed.state_bytes == score.state_bytes + per_device
