"""The continuous-batching engine against the static sampler, slot by slot.

Reference: ``Sampler.generate`` with the same key samples the same rows (randomness keyed by
row and step). The engine prefills other batches and decodes each slot at its own step, so
its float32 sums differ in order: log-probs agree to 1e-5 (measured ~5e-7) and, with no
random number within that distance of a CDF boundary, the tokens are identical.
"""

from __future__ import annotations

import gc
import weakref

import jax
import numpy as np
import pytest

from jaxrlhf import platform
from jaxrlhf.generation import Sampler, SamplingParams
from jaxrlhf.generation.engine import Engine
from jaxrlhf.kernels import block_matmul as kernel_lib
from jaxrlhf.models import model as M
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.sharding import MeshConfig, make_mesh

B, P, T = 6, 8, 12
STOP = tuple(range(40, 56))  # 1/8 of the vocabulary: rows stop at many lengths


@pytest.fixture(scope="module")
def setup():
    cfg = ModelConfig.tiny()
    params = M.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(60, cfg.vocab_size, (B, P)).astype(np.int32)
    mask = np.arange(P)[None] >= rng.integers(0, P - 1, B)[:, None]  # mixed prompt lengths
    return cfg, params, tokens, mask


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=T, n=2, pad_token_id=0)  # no stops


def _sampling(n=2, **kw):
    return SamplingParams(max_new_tokens=T, n=n, stop_token_ids=STOP, pad_token_id=0, **kw)


def _same(finished, ref, rows):
    np.testing.assert_array_equal(finished.rows, rows)
    np.testing.assert_array_equal(finished.tokens, np.asarray(ref.tokens)[rows])
    np.testing.assert_array_equal(finished.lengths, np.asarray(ref.lengths)[rows])
    np.testing.assert_array_equal(finished.stopped, np.asarray(ref.stopped)[rows])
    for name in ("logprobs", "model_logprobs"):
        np.testing.assert_allclose(
            getattr(finished, name), np.asarray(getattr(ref, name))[rows], atol=1e-5
        )


@pytest.mark.parametrize("slots, chunk, n", [(4, 3, 2), (2, 5, 1), (12, 4, 2)])
def test_engine_samples_what_the_static_sampler_samples(setup, slots, chunk, n):
    """Mixed prompt lengths and early stops; fewer slots than rows (requests wait and reuse
    freed slots), or as many."""
    cfg, params, tokens, mask = setup
    sampler, key = Sampler(cfg), jax.random.key(1)
    ref = jax.device_get(sampler.generate(params, tokens, mask, key, _sampling(n)))
    assert (np.asarray(ref.lengths) < T).any()  # some rows stopped early
    out = Engine(sampler, slots=slots, chunk=chunk).generate(
        params, tokens, mask, key, _sampling(n)
    )
    _same(out.finished, ref, np.arange(B * n))
    assert out.aborted_groups == 0 and list(out.kept_groups) == list(range(B))
    assert out.generated_tokens == int(np.asarray(ref.lengths).sum())


def test_few_slot_views_decode_with_weight_blocks(setup, monkeypatch):
    """On CPU without the block-matmul kernel, views of at most ``platform.FEW_DECODE_ROWS``
    slots per shard (the long tail) multiply by weight blocks, and wider ones keep the
    sampler's plain kernels: one run uses both layouts and still samples what the static
    sampler samples (log-probs to 1e-5: the blocked matmul sums in another order). With
    nothing left to admit, the plain layout is released before the blocks are made (one copy
    at a time). A sampler given ``matmul_block`` keeps it in every view."""
    cfg, params, tokens, mask = setup
    monkeypatch.setattr(platform, "usable_cores", lambda: 2)  # one device, a spare core
    monkeypatch.setattr(kernel_lib, "available", lambda: False)  # XLA's layout rule
    sampler, key = Sampler(cfg), jax.random.key(6)
    engine = Engine(sampler, slots=12, chunk=4)  # views of 12, 6 and 3 slots
    assert sampler.matmul_block == 0
    assert [sampler.matmul_block_for(rows) for rows in (12, 6, 3)] == [0, 0, 64]
    built, plain = [], []  # layouts made; weak references to the plain layout's arrays
    program = engine.decode_weights_program

    def make(block=None):
        def weights(params):
            if block:  # the plain copy is dropped before the blocked one is made
                gc.collect()
                assert plain and all(ref() is None for ref in plain)
            out = program(block)(params)
            if not block:
                plain.extend(weakref.ref(x) for x in jax.tree.leaves(out))
            return out

        built.append(block)
        return weights

    monkeypatch.setattr(engine, "decode_weights_program", make)
    budgets = np.array([12, 2, 3, 2, 2, 4])  # after one chunk, 2 rows left: 3-slot views
    ref = jax.device_get(sampler.generate(params, tokens, mask, key, GREEDY))
    out = engine.generate(params, tokens, mask, key, GREEDY, max_new_tokens=budgets)
    want = np.repeat(budgets, 2)
    np.testing.assert_array_equal(out.finished.lengths, want)
    for r in range(B * 2):
        np.testing.assert_array_equal(out.finished.tokens[r, : want[r]], ref.tokens[r, : want[r]])
        np.testing.assert_allclose(
            out.finished.model_logprobs[r, : want[r]], ref.model_logprobs[r, : want[r]], atol=1e-5
        )
    assert sorted(built) == [0, 64]  # each layout made once in the call
    fixed = Sampler(cfg, matmul_block=0)
    assert [fixed.matmul_block_for(rows) for rows in (12, 6, 3)] == [0, 0, 0]


def test_a_freed_slot_serves_the_next_prompt_as_if_alone(setup):
    """One slot, three prompts in turn: each output equals sampling that prompt alone in row
    0 with the key of its row (the static sampler's numbering: row r uses uniforms[r])."""
    cfg, params, tokens, mask = setup
    sampler, key = Sampler(cfg), jax.random.key(2)
    out = Engine(sampler, slots=1, chunk=4).generate(
        params, tokens[:3], mask[:3], key, _sampling(1)
    )
    batch = jax.device_get(sampler.generate(params, tokens[:3], mask[:3], key, _sampling(1)))
    _same(out.finished, batch, np.arange(3))
    alone = jax.device_get(sampler.generate(params, tokens[:1], mask[:1], key, _sampling(1)))
    np.testing.assert_array_equal(out.finished.tokens[0], np.asarray(alone.tokens)[0])


def test_per_request_budgets(setup):
    cfg, params, tokens, mask = setup
    sampler, key = Sampler(cfg), jax.random.key(3)
    budgets = np.array([1, 3, 12, 7, 2, 5])
    out = Engine(sampler, slots=4, chunk=2).generate(
        params, tokens, mask, key, _sampling(2), max_new_tokens=budgets
    )
    ref = jax.device_get(sampler.generate(params, tokens, mask, key, _sampling(2)))
    f = out.finished
    want = np.minimum(np.asarray(ref.lengths), np.repeat(budgets, 2))  # same prefix, cut
    np.testing.assert_array_equal(f.lengths, want)
    for r in range(B * 2):
        np.testing.assert_array_equal(f.tokens[r, : want[r]], np.asarray(ref.tokens)[r, : want[r]])
        assert (f.tokens[r, want[r] :] == 0).all() and not f.response_mask[r, want[r] :].any()


def test_oversampling_keeps_the_first_groups_to_finish_and_aborts_the_rest(setup):
    cfg, params, tokens, mask = setup
    sampler, key = Sampler(cfg), jax.random.key(4)
    budgets = np.array([12, 2, 12, 3, 12, 12])  # prompts 1 and 3 finish first
    seen = []
    out = Engine(sampler, slots=12, chunk=2).generate(
        params,
        tokens,
        mask,
        key,
        GREEDY,  # no stop tokens: the budgets decide who finishes first
        max_new_tokens=budgets,
        keep_groups=2,
        on_finished=lambda f: seen.append(sorted(set((f.rows // 2).tolist()))),
    )
    assert list(out.kept_groups) == [1, 3] and out.aborted_groups == 4
    assert seen == [[1], [3]]  # handed out as they finished, chunk by chunk
    np.testing.assert_array_equal(out.finished.rows, [2, 3, 6, 7])
    np.testing.assert_array_equal(out.finished.lengths, [2, 2, 3, 3])


def test_token_budget_stops_admitting(setup):
    """Two slots (one group of 2 at a time), budget 20 tokens: greedy groups of 2 x 12 tokens
    each use 24, so after the first group no other is admitted."""
    cfg, params, tokens, mask = setup
    out = Engine(Sampler(cfg), slots=2, chunk=4).generate(
        params, tokens, mask, jax.random.key(5), GREEDY, token_budget=20
    )
    assert list(out.kept_groups) == [0] and out.aborted_groups == B - 1
    assert out.generated_tokens == 24


def test_token_budget_is_latched_when_stop_strings_cut(setup):
    """The budget counts tokens as decoded, before a stop string cuts them: two slots decode
    4 tokens each in the first chunk (8 = the budget), then the stop string 'xx' cuts both
    rows to 2 tokens (4 kept). Admission stays closed although the kept tokens are under the
    budget, so only the first two prompts run."""
    cfg, params, tokens, mask = setup
    sampling = SamplingParams(temperature=0.0, max_new_tokens=T, n=1, pad_token_id=0)
    out = Engine(Sampler(cfg), slots=2, chunk=4).generate(
        params,
        tokens,
        mask,
        jax.random.key(5),
        sampling,
        token_budget=8,
        stop_strings=("xx",),
        decode=lambda ids: "x" * len(ids),
    )
    assert list(out.kept_groups) == [0, 1] and out.aborted_groups == B - 2
    np.testing.assert_array_equal(out.finished.lengths, [2, 2])
    assert out.finished.stopped.all()
    assert out.generated_tokens == 8 and out.chunks == 1


def test_stop_strings_cut_the_response(setup):
    """A stop 'string' made of the decoded ids: the response ends right after the token that
    completes it, as a stopped row."""
    cfg, params, tokens, mask = setup
    sampler, key = Sampler(cfg), jax.random.key(6)
    sampling = _sampling(1, temperature=0.0)
    ref = jax.device_get(sampler.generate(params, tokens, mask, key, sampling))

    def decode(ids):
        return " ".join(str(int(t)) for t in ids) + " "

    row = int(np.argmax(np.asarray(ref.lengths)))
    target = f"{int(ref.tokens[row][2])} {int(ref.tokens[row][3])} "  # tokens 2-3 of that row
    out = Engine(sampler, slots=3, chunk=5).generate(
        params, tokens, mask, key, sampling, stop_strings=(target,), decode=decode
    )
    f = out.finished
    for r in range(B):
        text = [decode(np.asarray(ref.tokens)[r, :k]) for k in range(1, T + 1)]
        first = next((k + 1 for k, t in enumerate(text) if target in t), None)
        want = int(ref.lengths[r]) if first is None else min(first, int(ref.lengths[r]))
        assert f.lengths[r] == want, (r, f.lengths[r], want)
        assert f.stopped[r] == (first is not None or bool(ref.stopped[r]))
    assert f.lengths[row] <= 4


@pytest.mark.slow
def test_sharded_engine_equals_one_device(setup):
    """8 CPU devices (data 4 x tensor 2), slots split over the data shards."""
    cfg, params, tokens, mask = setup
    key = jax.random.key(7)
    one = Engine(Sampler(cfg), slots=8, chunk=3).generate(params, tokens, mask, key, _sampling(2))
    sampler = Sampler(cfg, make_mesh(MeshConfig(data=4, fsdp=1, tensor=2)), matmul_block=64)
    gen_params, _ = sampler.to_generate_layout(params)
    eight = Engine(sampler, slots=8, chunk=3).generate(gen_params, tokens, mask, key, _sampling(2))
    np.testing.assert_array_equal(eight.finished.tokens, one.finished.tokens)
    np.testing.assert_allclose(
        eight.finished.model_logprobs, one.finished.model_logprobs, atol=1e-5
    )


def _views_used(engine: Engine, width: int) -> set[tuple[int, int]]:
    """The (slots per shard, generated width) views the engine compiled chunks for."""
    return {(k[-2], k[-1]) for k in engine._jitted if k[0] == "view"} - {(None, width)}


@pytest.mark.parametrize("data, fsdp, tensor", [(1, 1, 1), (2, 2, 2)])
def test_views_decode_what_the_whole_state_decodes(setup, data, fsdp, tensor):
    """Chunks on views (running slots only, the cache cut to the reachable width) sample the
    same tokens as chunks over every slot and the whole cache, and as the static sampler;
    with a mesh the views are cut shard by shard (8 devices: 4 slot shards x 2 tensor)."""
    cfg, params, tokens, mask = setup
    width, key = 40, jax.random.key(3)
    sampling = SamplingParams(max_new_tokens=width, n=2, stop_token_ids=STOP[:4], pad_token_id=0)
    budgets = np.array([40, 3, 9, 25, 2, 17])  # long and short requests share the slots
    shards = data * fsdp  # fsdp is a second data axis for generation
    slots = 4 * shards  # 12 rows: queued (1 shard) or all in at once (4), then a tail
    mesh = make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor)) if shards > 1 else None
    sampler = Sampler(cfg, mesh, matmul_block=64)
    gen_params = sampler.to_generate_layout(params)[0] if mesh is not None else params
    outs = {}
    for views in (True, False):
        engine = Engine(sampler, slots=slots, chunk=2, views=views)
        outs[views] = engine.generate(
            gen_params, tokens, mask, key, sampling, max_new_tokens=budgets
        )
        if views:
            used = _views_used(engine, width)
            assert any(w < width for _, w in used) and any(r < slots // shards for r, _ in used), (
                used
            )  # both cuts ran
    ref = jax.device_get(Sampler(cfg).generate(params, tokens, mask, key, sampling))
    rows = np.arange(B * 2)
    cut = np.arange(width)[None] < np.repeat(budgets, 2)[:, None]
    lengths = np.minimum(np.asarray(ref.lengths), np.repeat(budgets, 2))
    for out in outs.values():
        np.testing.assert_array_equal(out.finished.rows, rows)
        np.testing.assert_array_equal(out.finished.lengths, lengths)
        np.testing.assert_array_equal(out.finished.tokens, np.where(cut, np.asarray(ref.tokens), 0))
        np.testing.assert_allclose(
            out.finished.model_logprobs,
            np.where(cut, np.asarray(ref.model_logprobs), 0.0),
            atol=1e-5,
        )
    np.testing.assert_allclose(
        outs[True].finished.logprobs, outs[False].finished.logprobs, atol=1e-6
    )


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_attention_kernel_in_the_engine_and_the_sampler(family, monkeypatch):
    """Head size 16 takes the CPU decode-attention kernel (gemma3: sliding-window layers
    too) wherever a row has its own cache: the static sampler with one sample per prompt
    (8 + 21 slots, a partial last chunk) and the engine's views (widths cut to the reachable
    slots). With two samples per prompt the static sampler attends with XLA's einsums over
    its shared-prompt cache, and the engine samples what it samples. Each path samples what
    it samples with XLA's attention everywhere: tokens equal, log-probs within 1e-5 (float32
    sums in another order)."""
    from jaxrlhf.kernels import decode_attention as da

    if not da.available():
        pytest.skip(f"kernel unavailable: {da.unavailable_reason()}")
    cfg = ModelConfig.tiny(family)
    assert cfg.dim_per_head == 16 and cfg.attn_logit_softcap is None
    params = M.init_params(cfg, jax.random.key(4))
    rng = np.random.default_rng(4)
    tokens = rng.integers(60, cfg.vocab_size, (B, P)).astype(np.int32)
    mask = np.arange(P)[None] >= rng.integers(0, P - 1, B)[:, None]
    stops = dict(max_new_tokens=21, stop_token_ids=STOP[:4], pad_token_id=0)
    alone, pairs = SamplingParams(n=1, **stops), SamplingParams(n=2, **stops)
    key = jax.random.key(5)
    widths = []  # the cache widths the kernel (which writes the step's slot too) was traced for
    kernel = da._write_partitioned

    def counted(*args):
        widths.append(args[1].shape[3])
        return kernel(*args)

    def run(make, sampling):
        widths.clear()
        return make().generate(params, tokens, mask, key, sampling)

    monkeypatch.setattr(da, "_write_partitioned", counted)
    sampler_one = jax.device_get(run(lambda: Sampler(cfg), alone))
    assert widths and set(widths) == {P + 21}
    sampler_two = jax.device_get(run(lambda: Sampler(cfg), pairs))
    assert not widths  # the shared-prompt cache
    engine = run(lambda: Engine(Sampler(cfg), slots=4, chunk=3), pairs)
    assert widths and any(w % 16 for w in widths)
    _same(engine.finished, sampler_two, np.arange(B * 2))

    monkeypatch.setattr(da, "available", lambda: False)
    xla_one = jax.device_get(run(lambda: Sampler(cfg), alone))
    xla_engine = run(lambda: Engine(Sampler(cfg), slots=4, chunk=3), pairs)
    assert not widths
    np.testing.assert_array_equal(xla_one.tokens, sampler_one.tokens)
    np.testing.assert_allclose(xla_one.model_logprobs, sampler_one.model_logprobs, atol=1e-5)
    np.testing.assert_array_equal(xla_engine.finished.tokens, engine.finished.tokens)
    np.testing.assert_allclose(
        xla_engine.finished.model_logprobs, engine.finished.model_logprobs, atol=1e-5
    )
