"""Mixture of experts: routing, the dropless expert MLP, the router's load-balancing loss and
statistics, against NumPy, hand-computed cases and transformers.

Tolerances: 1e-6 on float32 softmax weights (simple functions of O(1) values); 1e-5 on
expert outputs and losses of size ~1-10 (float32 sums of 32-64 products, reference in
float64); 1e-5 on router logits and the aux loss against transformers' PyTorch model (the
logits of the second layer pass through the first: model-level rounding, observed ~1e-6).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models import model as M
from jaxrlhf.models import moe
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.transformer import ACTIVATIONS


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("normalize", [True, False])
def test_route_equals_numpy(normalize):
    logits = np.random.default_rng(0).standard_normal((9, 6)).astype(np.float32)
    weights, experts = moe.route(jnp.asarray(logits), 2, normalize)
    probs = _softmax(logits.astype(np.float64))
    order = np.argsort(-probs, axis=-1)[:, :2]
    expected = np.take_along_axis(probs, order, -1)
    if normalize:
        expected = expected / expected.sum(-1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(experts), order)
    np.testing.assert_allclose(np.asarray(weights), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("chunk_elements", [2**26, 1000])
def test_grouped_matmul_and_its_gradient_equal_ragged_dot(chunk_elements, monkeypatch):
    """The CPU form (chunked masked einsum, its own VJP) against jax.lax.ragged_dot's own
    implementation, value and gradients, with an empty group and rows past the groups (zero
    output); 1000 elements per chunk makes 16-row chunks (the last one padded)."""
    monkeypatch.setattr(moe, "_CPU_CHUNK_ELEMENTS", chunk_elements)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((70, 12)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((5, 12, 9)), jnp.float32)
    sizes = jnp.asarray([20, 0, 31, 11, 5], jnp.int32)  # 67 of 70 rows
    cotangent = jnp.asarray(rng.standard_normal((70, 9)), jnp.float32)

    def loss(fn, x, w):
        return (fn(x, w, sizes) * cotangent).sum()

    got = moe.grouped_matmul(x, w, sizes)
    want = jax.lax.ragged_dot(x, w, sizes)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert not np.asarray(got[67:]).any()
    got_grads = jax.grad(functools.partial(loss, moe.grouped_matmul), argnums=(0, 1))(x, w)
    want_grads = jax.grad(functools.partial(loss, jax.lax.ragged_dot), argnums=(0, 1))(x, w)
    for a, b in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_expert_mlp_equals_a_loop_over_tokens():
    """Dropless: every token gets all k of its experts, including an expert that receives
    most tokens (expert 0 is forced on 10 of 12 tokens) and one that receives none."""
    rng = np.random.default_rng(1)
    m, d, f, e, k = 12, 8, 16, 5, 2
    x = rng.standard_normal((m, d)).astype(np.float32)
    gate, up = (0.3 * rng.standard_normal((e, d, f)).astype(np.float32) for _ in range(2))
    down = 0.3 * rng.standard_normal((e, f, d)).astype(np.float32)
    experts = rng.integers(1, e - 1, (m, k)).astype(np.int32)  # expert e-1 gets no token
    experts[:10, 0] = 0
    experts[:, 1] = np.where(experts[:, 1] == experts[:, 0], 3, experts[:, 1])
    weights = rng.uniform(0.1, 1.0, (m, k)).astype(np.float32)
    got = moe.expert_mlp(
        jnp.asarray(x),
        jnp.asarray(weights),
        jnp.asarray(experts),
        *map(jnp.asarray, (gate, up, down)),
        ACTIVATIONS["silu"],
    )

    def silu(z):
        return z / (1 + np.exp(-z))

    expected = np.zeros((m, d))
    x64 = x.astype(np.float64)
    for t in range(m):
        for j in range(k):
            ex = experts[t, j]
            h = silu(x64[t] @ gate[ex]) * (x64[t] @ up[ex])
            expected[t] += weights[t, j] * (h @ down[ex])
    np.testing.assert_allclose(np.asarray(got), expected, atol=1e-5, rtol=0)
    assert np.abs(expected).max() > 0.5


def test_router_metrics_and_loss_hand_computed():
    """One layer, E = 3, k = 1, four tokens of which the last is padding.

    Logits put token 0 and 1 on expert 0, token 2 on expert 1, and the padding on expert 2:
    loads over the three real tokens are (2/3, 1/3, 0), so load_max = 3 * 2/3 = 2. With
    logits (L, 0, 0) the router's probabilities are p = e^L / (e^L + 2) on the chosen expert
    and q = 1 / (e^L + 2) elsewhere; at L = ln 2 that is p = 1/2, q = 1/4. Per expert:
    P_0 = (1/2 + 1/2 + 1/4) / 3 = 5/12, P_1 = (1/4 + 1/4 + 1/2) / 3 = 1/3,
    P_2 = (1/4 + 1/4 + 1/4) / 3 = 1/4; the loss is
    E * sum f_e P_e = 3 * (2/3 * 5/12 + 1/3 * 1/3 + 0) = 3 * (5/18 + 2/18) = 7/6.
    """
    big = np.log(2.0)
    logits = np.array([[[[big, 0, 0], [big, 0, 0], [0, big, 0], [0, 0, 9.0]]]], np.float32)
    router = moe.RouterLogits(
        logits=jnp.asarray(logits), token_mask=jnp.asarray([[True, True, True, False]])
    )
    metrics = moe.router_metrics(router, top_k=1)
    np.testing.assert_allclose(
        [metrics[f"moe/load/e{j}"] for j in range(3)], [2 / 3, 1 / 3, 0.0], atol=1e-6
    )
    np.testing.assert_allclose(metrics["moe/load_max"], 2.0, atol=1e-6)
    np.testing.assert_allclose(moe.load_balancing_loss(router, top_k=1), 7 / 6, atol=1e-6)
    # Entropy of (1/2, 1/4, 1/4) for every real token: 1.5 ln 2.
    np.testing.assert_allclose(metrics["moe/router_entropy"], 1.5 * np.log(2), atol=1e-6)


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe"])
def test_router_logits_and_aux_loss_equal_transformers(case, tmp_path):
    """The captured router logits of every layer equal transformers' ``router_logits``, and
    the load-balancing loss equals its ``aux_loss`` (with the attention mask), on a
    left-padded batch."""
    torch = pytest.importorskip("torch")
    from jaxrlhf.models.hf_checkpoint import load_hf
    from tests.models.hf_fixtures import make_hf_model, padded_batch

    hf_model = make_hf_model(case, seed=5)
    hf_model.save_pretrained(tmp_path)
    tokens, mask = padded_batch(hf_model.config.vocab_size, seed=5)
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    with torch.no_grad():
        out = hf_model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(positions, dtype=torch.long),
            output_router_logits=True,
        )
    hf_logits = np.stack([x.numpy() for x in out.router_logits])  # [L, B*T, E]

    cfg, params = load_hf(str(tmp_path))
    with moe.capture_router_logits() as captured:
        M.forward(M.build(cfg), params, tokens, mask)
    (router,) = captured
    ours = np.asarray(router.logits).reshape(hf_logits.shape)
    real = mask.reshape(-1)
    np.testing.assert_allclose(ours[:, real], hf_logits[:, real], atol=1e-5, rtol=0)
    aux = moe.load_balancing_loss(router, cfg.num_experts_per_tok)
    np.testing.assert_allclose(float(aux), float(out.aux_loss), atol=1e-5, rtol=0)
    assert float(aux) > 1.0  # k for a uniform router: the comparison is not of zeros


@pytest.mark.slow
def test_add_router_loss_and_a_dense_model():
    """The hook adds coef * aux to the loss and the router metrics; coef 0 logs without
    changing the loss; a dense model's forward captures nothing."""
    cfg = ModelConfig.tiny("mixtral", initializer_range=0.3)
    params = M.init_params(cfg, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 128, (2, 6)), jnp.int32)
    mask = jnp.ones((2, 6), bool)
    with moe.capture_router_logits() as captured:
        M.forward(M.build(cfg), params, tokens, mask)
    aux = moe.load_balancing_loss(captured[0], cfg.num_experts_per_tok)
    loss, metrics = moe.add_router_loss(cfg, jnp.float32(1.0), {"a": 1}, captured)
    assert float(loss) == 1.0 and metrics["a"] == 1
    np.testing.assert_allclose(metrics["moe/aux_loss"], aux, rtol=1e-6)
    assert len([k for k in metrics if k.startswith("moe/load/")]) == cfg.num_experts
    with_coef = cfg.replace(router_aux_loss_coef=0.5)
    loss, _ = moe.add_router_loss(with_coef, jnp.float32(1.0), {}, captured)
    np.testing.assert_allclose(loss, 1.0 + 0.5 * aux, rtol=1e-6)

    dense = ModelConfig.tiny("llama")
    with moe.capture_router_logits() as captured:
        M.forward(M.build(dense), M.init_params(dense, jax.random.key(0)), tokens, mask)
    assert captured == []
    assert moe.router_sink() is None  # the context is gone after the block


@pytest.mark.slow
def test_aux_loss_gradient_reaches_the_router_only_through_probabilities():
    """d(aux)/d(router kernel) is nonzero; the last layer's experts get none (their output
    feeds no router); with remat the captured logits are the same."""
    cfg = ModelConfig.tiny("qwen3_moe", initializer_range=0.3)
    params = M.init_params(cfg, jax.random.key(1))
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, 128, (2, 5)), jnp.int32)
    mask = jnp.ones((2, 5), bool)

    def aux(p, c):
        with moe.capture_router_logits() as captured:
            M.forward(M.build(c), p, tokens, mask)
        return moe.load_balancing_loss(captured[0], c.num_experts_per_tok)

    value, grads = jax.value_and_grad(aux)(params, cfg)
    router_grad = grads["decoder"]["layers"]["moe"]["router_kernel"]
    assert float(jnp.abs(router_grad).max()) > 1e-4
    assert float(jnp.abs(grads["decoder"]["layers"]["moe"]["down_kernel"][-1]).max()) == 0.0
    np.testing.assert_allclose(aux(params, cfg.replace(remat="full")), value, rtol=1e-6)
