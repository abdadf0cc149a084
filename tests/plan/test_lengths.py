"""jaxrlhf.plan.lengths: the length distributions and the engine's chunks under them. The
replayed admission policy is checked against the engine itself: per-row budgets with no stop
tokens fix every sample's length, and the engine reports the chunks it ran."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrlhf.generation import Sampler, SamplingParams
from jaxrlhf.generation.engine import Engine
from jaxrlhf.models import model as M
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.plan.lengths import LengthModel, engine_chunks, engine_replay, parse_lengths
from jaxrlhf.sharding import MeshConfig, make_mesh
from tests.tiers import tiered


def test_engine_chunks_by_hand():
    """4 slots, chunks of 2 steps, groups of 2. Lengths 5,5 | 3,1 | 2,2: groups 0 and 1 are
    admitted first; after chunk 1 (5, 5, 3 -> 3, 3, 1; the 1 done) one slot is free, too few
    for group 2; after chunk 2 (-> 1, 1) two are, and chunk 3 ends every sample: 3 chunks,
    2 admissions."""
    assert engine_chunks(np.array([5, 5, 3, 1, 2, 2]), slots=4, chunk=2, n=2) == (3, 2)
    # One slot, one step per chunk: the lengths' sum.
    assert engine_chunks(np.array([3, 4, 1]), slots=1, chunk=1, n=1) == (8, 3)
    # Every row to the budget in whole waves (2 waves of ceil(9 / 4) chunks): what the dry
    # run assumes.
    assert engine_chunks(np.full(8, 9), slots=4, chunk=4, n=2) == (2 * 3, 2)


@pytest.mark.parametrize(("slots", "chunk"), tiered([(4, 2), (6, 3), (2, 1)], [(6, 3)]))
def test_engine_chunks_equal_the_engines_own_count(slots, chunk):
    """12 samples (6 prompts x 2) of lengths 1-12 through the engine: the replay counts the
    chunks it ran, exactly."""
    cfg = ModelConfig.tiny()
    params = M.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(1)
    prompts, n, budget = 6, 2, 12
    tokens = rng.integers(60, cfg.vocab_size, (prompts, 8)).astype(np.int32)
    mask = np.ones_like(tokens, bool)
    lengths = rng.integers(1, budget + 1, prompts * n)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=budget, n=n, pad_token_id=0)
    out = Engine(Sampler(cfg), slots=slots, chunk=chunk).generate(
        params, tokens, mask, jax.random.key(2), sampling, max_new_tokens=lengths
    )
    np.testing.assert_array_equal(out.finished.lengths, lengths)
    assert engine_chunks(lengths, slots, chunk, n)[0] == out.chunks


@pytest.mark.parametrize(
    "shards, keep, token_budget",
    tiered(
        [(1, None, None), (2, None, None), (1, 8, None), (1, 8, 20)],
        [(1, None, None), (1, 8, 20)],
    ),
    ids=["one_shard", "two_shards", "keep_8", "keep_8_token_budget"],
)
def test_engine_replay_picks_the_engines_views(monkeypatch, shards, keep, token_budget):
    """The replay's view per chunk (rows bucket, width bucket; None: the whole state) equals
    the views the engine compiled its chunks for, in order: 16 slots, 4 steps per chunk, a
    32-token budget (widths 16 and 32), lengths with a long tail; on one data shard, on two
    (groups fill the lowest free slots, so the shards' loads differ), with over-sampling
    (the call ends when 8 of the 12 groups have finished), and with a total token budget
    that stops admission before the 8 groups are in (the call ends when nothing runs)."""
    cfg = ModelConfig.tiny()
    params = M.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(2)
    prompts, n, budget, slots, chunk = 12, 2, 32, 16, 4
    tokens = rng.integers(60, cfg.vocab_size, (prompts, 8)).astype(np.int32)
    lengths = np.minimum(rng.geometric(0.12, prompts * n), budget)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=budget, n=n, pad_token_id=0)
    two = jax.devices()[:shards]
    mesh = make_mesh(MeshConfig(data=shards, fsdp=1, tensor=1), two) if shards > 1 else None
    sampler = Sampler(cfg, mesh)
    if mesh is not None:
        params = sampler.to_generate_layout(params)[0]
    engine = Engine(sampler, slots=slots, chunk=chunk)
    assert engine.slot_shards == shards
    used = []
    real_view, real_chunk = engine.view_chunk_program, engine.chunk_program

    def view_program(statics, prompt_len, rows, width):
        fn = real_view(statics, prompt_len, rows, width)
        return lambda *a: (used.append((rows, width)), fn(*a))[1]

    def chunk_program(statics, prompt_len):
        fn = real_chunk(statics, prompt_len)
        return lambda *a: (used.append(None), fn(*a))[1]

    monkeypatch.setattr(engine, "view_chunk_program", view_program)
    monkeypatch.setattr(engine, "chunk_program", chunk_program)
    out = engine.generate(
        params,
        tokens,
        np.ones_like(tokens, bool),
        jax.random.key(2),
        sampling,
        max_new_tokens=lengths,
        keep_groups=keep,
        token_budget=token_budget,
    )
    replay = engine_replay(
        lengths,
        slots,
        chunk,
        n,
        shards=shards,
        max_new_tokens=budget,
        keep_groups=keep,
        token_budget=token_budget,
    )
    assert list(replay.views) == used and any(v is not None for v in used)
    # The groups it keeps (the planner packs their rows): the engine's, in any order.
    assert sorted(replay.kept) == sorted(out.kept_groups.tolist())
    if token_budget is not None:  # the budget binds: fewer admissions than without it
        unbounded = engine_replay(
            lengths, slots, chunk, n, shards=shards, max_new_tokens=budget, keep_groups=keep
        )
        assert replay.admits < unbounded.admits


def test_lognormal_quantiles():
    """Rows at the quantiles (i + 0.5) / rows: the median row is the median, the cap holds,
    the order is shuffled but fixed."""
    model = parse_lengths("lognormal:48,1.439")
    lengths = model.lengths(129, 512)
    assert sorted(lengths)[64] == 48
    assert lengths.max() == 512 and lengths.min() >= 1
    # P(X > 512) = 1 - Phi(ln(512 / 48) / 1.439) = 5.0%: 6 or 7 of 129 rows at the cap.
    assert 6 <= (lengths == 512).sum() <= 7
    np.testing.assert_array_equal(lengths, model.lengths(129, 512))
    assert not np.all(np.diff(lengths) >= 0)
    np.testing.assert_array_equal(LengthModel().lengths(3, 7), [7, 7, 7])


@pytest.mark.parametrize("spec", ["lognormal:48", "lognormal:0.5,1", "uniform", "budget:3"])
def test_bad_specs_are_one_line(spec):
    with pytest.raises(ValueError, match="--lengths: expected 'budget' or 'lognormal:"):
        parse_lengths(spec)
