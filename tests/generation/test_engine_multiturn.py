"""Multi-turn episodes in the rollout engine.

Reference: each turn run as a fresh prompt with the whole history. The reference policy
samples every token from a full forward (no KV cache) of the prompt and everything after it
(earlier turns and observations), with the engine's random number for that row and column,
and the same scripted environment answers its turns (:func:`run_episode`). The engine
instead feeds observations into the slot's cache and decodes on; float32 sums differ in
order, so log-probs agree to 1e-5 and the tokens are identical.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import platform
from jaxrlhf.data.tokenizer import CharTokenizer
from jaxrlhf.generation import Sampler, SamplingParams
from jaxrlhf.generation.engine import Engine
from jaxrlhf.generation.environment import Episode, EpisodeConfig, Episodes, Step, run_episode
from jaxrlhf.generation.sampling import draw_uniforms, next_tokens
from jaxrlhf.kernels import block_matmul as kernel_lib
from jaxrlhf.models import model as M
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.sharding import MeshConfig, make_mesh

B, P, T, N = 3, 6, 30, 2
STOP = tuple(range(40, 56))
TOK = CharTokenizer()
CFG = EpisodeConfig(max_turns=3, turn_tokens=6, timeout_s=30.0)


class Counter:
    """Answers each turn with ``<k>`` (k: the turn's length) until the third turn; its reward
    is the turns' total length."""

    def __init__(self, record):
        self.total = record["bonus"]

    def step(self, turn):
        self.total += len(turn.token_ids)
        if turn.index == 2:
            return Step(reward=float(self.total))
        return Step(observation=f"<{len(turn.token_ids)}>", reward=0.5, info={"obs": 1.0})


def _episodes(make=Counter):
    records = [{"bonus": float(i)} for i in range(B)]
    return Episodes(make, records, CFG, TOK.encode, TOK.decode)


@pytest.fixture(scope="module")
def setup():
    cfg = ModelConfig.tiny()
    params = M.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(60, 100, (B, P)).astype(np.int32)
    mask = np.arange(P)[None] >= rng.integers(0, P - 1, B)[:, None]
    return cfg, params, tokens, mask


def _sampling():
    return SamplingParams(
        max_new_tokens=T,
        n=N,
        stop_token_ids=STOP,
        pad_token_id=0,
        return_model_logprobs=True,
        temperature=0.9,
    )


def _reference(cfg, params, tokens, mask, key, sampling):
    """Each row's episode with every token sampled from a fresh full forward of the whole
    history: ``(rows' response ids, model masks, sequence masks, logprobs, rewards)``."""
    module = M.build(cfg)
    forward = jax.jit(lambda p, t, m: M.forward(module, p, t, m))
    uniforms = np.asarray(draw_uniforms(key, B * N, T))
    statics, arrays = sampling.static(), sampling.arrays()
    out = []
    for r in range(B * N):
        prompt = tokens[r // N][mask[r // N]].tolist()
        logprobs = np.zeros(T, np.float32)

        def policy(history, budget, prompt=prompt, logprobs=logprobs, r=r):
            turn = []
            while len(turn) < budget:
                ids = history + turn
                seq = np.zeros((1, P + T), np.int32)
                seq[0, : len(ids)] = ids
                logits = forward(params, jnp.asarray(seq), jnp.arange(P + T)[None] < len(ids))
                column = len(ids) - len(prompt)
                tok, _, model_lp = next_tokens(
                    logits[:, len(ids) - 1], jnp.asarray(uniforms[r, column])[None], arrays, statics
                )
                turn.append(int(tok[0]))
                logprobs[column] = float(model_lp[0])
                if int(tok[0]) in STOP:
                    break
            return turn

        episode = Episode(Counter({"bonus": float(r // N)}), T, CFG, TOK.encode, TOK.decode)
        row, model, seq = run_episode(episode, prompt, policy)
        out.append((row, model, seq, logprobs, episode.reward))
    return out


def _engine_out(
    sampler, params, tokens, mask, key, environments=None, slots=4, chunk=4, views=True
):
    return Engine(sampler, slots=slots, chunk=chunk, views=views).generate(
        params, tokens, mask, key, _sampling(), environments=environments or _episodes()
    )


def test_multiturn_equals_fresh_prompts_with_the_whole_history(setup):
    cfg, params, tokens, mask = setup
    key = jax.random.key(7)
    out = _engine_out(Sampler(cfg), params, tokens, mask, key)
    f = out.finished
    np.testing.assert_array_equal(f.rows, np.arange(B * N))
    ref = _reference(cfg, params, tokens, mask, key, _sampling())
    multi = 0
    for r, (row, model, seq, logprobs, reward) in enumerate(ref):
        length = len(row)
        assert f.lengths[r] == length
        np.testing.assert_array_equal(f.tokens[r, :length], row)
        np.testing.assert_array_equal(f.response_mask[r], model)
        np.testing.assert_array_equal(f.sequence_mask[r], seq)
        np.testing.assert_allclose(f.model_logprobs[r], np.where(model, logprobs, 0), atol=1e-5)
        assert f.rewards[r] == pytest.approx(reward)
        multi += int(f.observations[r] > 0)
    assert multi >= 4  # most rows had more than one turn
    assert (f.turns >= 1).all() and (f.errors == 0).all()
    assert out.episode_info[0]["obs"] == f.observations[0]
    assert not f.response_mask[~f.sequence_mask].any()  # the loss mask is inside the sequence


@pytest.mark.parametrize("data,tensor", [(1, 1), (4, 2)])
def test_multiturn_views_decode_what_the_whole_state_decodes(setup, data, tensor):
    """Chunks on views (the decoding slots: admitted or fed an observation; waiting slots
    left out; the cache cut to ``step + chunk``) give the whole-state chunks' episodes. With
    chunk 2 the widths are 15 and 30, so early chunks run on a cut cache."""
    cfg, params, tokens, mask = setup
    key = jax.random.key(9)
    sampler, placed, slots = Sampler(cfg), params, 4
    if data > 1:
        sampler = Sampler(cfg, make_mesh(MeshConfig(data=data, fsdp=1, tensor=tensor)))
        placed, slots = jax.device_put(params, sampler.param_shardings), 8
    outs, used = {}, set()
    for views in (True, False):
        engine = Engine(sampler, slots=slots, chunk=2, views=views)
        outs[views] = engine.generate(
            placed, tokens, mask, key, _sampling(), environments=_episodes()
        ).finished
        if views:
            used = {(k[-2], k[-1]) for k in engine._jitted if k[0] == "view"}
    assert any(width < T for _, width in used)  # some chunks ran on a cut cache
    assert any(rows < slots // data for rows, _ in used)  # and on fewer slots
    a, b = outs[True], outs[False]
    assert (a.observations > 0).sum() >= 4
    np.testing.assert_array_equal(a.rows, b.rows)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.response_mask, b.response_mask)
    np.testing.assert_array_equal(a.sequence_mask, b.sequence_mask)
    np.testing.assert_allclose(a.model_logprobs, b.model_logprobs, atol=1e-5)
    np.testing.assert_array_equal(a.rewards, b.rewards)


def test_waiting_slots_keep_the_wide_views_weights(setup, monkeypatch):
    """On a CPU device of two cores, few-slot views decode with weight blocks and wider ones
    with the plain kernels. Slots waiting for their environment will decode again in a wide
    view, so the plain layout is kept while they wait: no layout is made twice in the call,
    and the episodes equal a whole-state run's (plain kernels throughout; log-probs to 1e-5,
    the blocked matmul sums in another order)."""
    cfg, params, tokens, mask = setup
    key = jax.random.key(9)
    monkeypatch.setattr(platform, "usable_cores", lambda: 2)  # one device, a spare core
    monkeypatch.setattr(kernel_lib, "available", lambda: False)  # XLA's layout rule
    sampler = Sampler(cfg)
    assert [sampler.matmul_block_for(rows) for rows in (12, 6, 3)] == [0, 0, 64]
    engine = Engine(sampler, slots=12, chunk=2)  # 6 rows: views of 6 and 3 slots
    built, views = [], []
    program, view_program = engine.decode_weights_program, engine.view_chunk_program
    monkeypatch.setattr(
        engine, "decode_weights_program", lambda block=None: built.append(block) or program(block)
    )

    def view(statics, prompt_len, rows, width):
        views.append(rows)
        return view_program(statics, prompt_len, rows, width)

    monkeypatch.setattr(engine, "view_chunk_program", view)
    first_done = threading.Event()

    class AfterTheFirst(Counter):
        """Prompt 0's episodes run freely; the others' steps wait until one of them ends,
        so their rows wait while prompt 0's decode alone, then resume together."""

        def __init__(self, record):
            super().__init__(record)
            self.first = record["bonus"] == 0.0

        def step(self, turn):
            if not self.first:
                first_done.wait(timeout=20.0)  # within CFG.timeout_s
            out = super().step(turn)
            if self.first and out.observation is None:
                first_done.set()
            return out

    out = engine.generate(
        params, tokens, mask, key, _sampling(), environments=_episodes(AfterTheFirst)
    )
    ref = _engine_out(sampler, params, tokens, mask, key, slots=12, chunk=2, views=False)
    # Some chunk decoded prompt 0's rows in a 3-slot view while the others' rows waited,
    # and a 6-slot one came after it (the waiting slots resumed).
    assert any(a == 3 and 6 in views[i + 1 :] for i, a in enumerate(views))
    assert sorted(built) == [0, 64]
    a, b = out.finished, ref.finished
    assert (a.observations > 0).sum() >= 4
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.response_mask, b.response_mask)
    np.testing.assert_allclose(a.model_logprobs, b.model_logprobs, atol=1e-5)
    np.testing.assert_array_equal(a.rewards, b.rewards)


@pytest.mark.slow
def test_sharded_multiturn_equals_one_device(setup):
    cfg, params, tokens, mask = setup
    key = jax.random.key(8)
    one = _engine_out(Sampler(cfg), params, tokens, mask, key).finished
    sampler = Sampler(cfg, make_mesh(MeshConfig(data=4, fsdp=1, tensor=2)), matmul_block=64)
    assert len(jax.devices()) == 8
    placed = jax.device_put(params, sampler.param_shardings)
    eight = _engine_out(sampler, placed, tokens, mask, key, slots=8).finished
    np.testing.assert_array_equal(eight.rows, one.rows)
    np.testing.assert_array_equal(eight.tokens, one.tokens)
    np.testing.assert_array_equal(eight.response_mask, one.response_mask)
    np.testing.assert_allclose(eight.model_logprobs, one.model_logprobs, atol=1e-5)
    np.testing.assert_array_equal(eight.rewards, one.rewards)


_RELEASE = threading.Event()  # set when the test is done: a hung step then returns


class HangsOnFirstPrompt(Counter):
    """The first prompt's environment hangs in ``step`` until the test releases it (at
    most 10 minutes), far beyond the episode's 0.5 s timeout."""

    def __init__(self, record):
        super().__init__(record)
        self.hang = record["bonus"] == 0.0

    def step(self, turn):
        if self.hang:
            _RELEASE.wait(timeout=600)
        return super().step(turn)


class BadConstructor:
    def __init__(self, record):
        raise KeyError("no such column")


def test_a_hanging_environment_ends_its_episode_and_the_others_go_on(setup):
    cfg, params, tokens, mask = setup
    key = jax.random.key(7)
    envs = Episodes(
        HangsOnFirstPrompt,
        [{"bonus": float(i)} for i in range(B)],
        EpisodeConfig(max_turns=3, turn_tokens=6, timeout_s=0.5),
        TOK.encode,
        TOK.decode,
    )
    sampler = Sampler(cfg)
    good = _engine_out(sampler, params, tokens, mask, key).finished  # compiles the programs
    # The hung steps return only once released, after the run: that the run returns at all
    # shows nobody waited for them (no timing bound needed).
    _RELEASE.clear()
    try:
        f = _engine_out(sampler, params, tokens, mask, key, environments=envs).finished
    finally:
        _RELEASE.set()
    hung = f.rows // N == 0
    assert (f.errors[hung] == 1).all() and (f.rewards[hung] == 0).all()
    assert (f.errors[~hung] == 0).all()
    for r in np.flatnonzero(hung):
        text = TOK.decode(f.tokens[r][f.sequence_mask[r] & ~f.response_mask[r]])
        assert text == "environment error: TimeoutError: environment step timed out"[: len(text)]
    # The others match the run with a well-behaved environment.
    np.testing.assert_array_equal(f.tokens[~hung], good.tokens[~hung])
    bad = Episodes(BadConstructor, [{}] * B, CFG, TOK.encode, TOK.decode)
    f = _engine_out(Sampler(cfg), params, tokens, mask, key, environments=bad).finished
    assert (f.errors == 1).all() and (f.turns == 0).all() and (f.rewards == 0).all()
