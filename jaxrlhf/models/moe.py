"""Mixture-of-experts pieces: top-k routing, the experts' grouped matmuls, the router's
load-balancing loss and statistics, and how a training loss reads the router logits.

Routing is *dropless*: every token reaches all of its top-k experts, whatever the batch.
Capacity routing (GShard, Switch) drops the tokens that overflow an expert's fixed buffer,
which makes a token's output depend on the other tokens in the batch. RL needs the sampler's
log-probs (one new token per row per step) to equal the trainer's (whole sequences): with
dropping they would not, and a checkpoint's logits would not equal transformers' either.
So the (token, expert) pairs are sorted by expert and each expert multiplies its contiguous
rows with a grouped matmul (:func:`grouped_matmul`): ``jax.lax.ragged_dot``, one XLA
ragged-dot instruction on TPU and GPU. No compute or memory is reserved for capacity: the
rows are exactly ``tokens * k``. XLA:CPU has no ragged dot (jax expands it there into one
dense matmul over a copy of the rows per expert: E times the rows' memory), so on CPU every
expert multiplies every row of a bounded chunk and a mask keeps its own (:func:`_masked_dense`):
E times the compute, which the tiny CPU models do not notice, and memory near the output's,
so that the dry run's XLA:CPU plans of MoE models (jaxrlhf/train/dry_run.py compiles on CPU
devices) stay close to the accelerator program.

Expert parallelism: expert kernels carry the ``expert`` logical axis
(``jaxrlhf.models.axes.EXPERT``), which the rule sets map to a mesh axis. Under that
sharding XLA partitions the grouped matmul by expert: each device gathers the tokens of its
expert group, multiplies the rows of its own experts and the partial outputs are summed
across the group (the all-gather / reduce-scatter form of expert parallelism, not an
all-to-all).

The router logits of every layer are also *sown* (flax ``intermediates``); a training loss
that wants them runs its forward inside :func:`capture_router_logits` and hands what was
captured to :func:`add_router_loss` (the load-balancing loss of transformers'
``load_balancing_loss_func`` and per-expert load metrics).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.models.config import ModelConfig


def route(
    router_logits: Float[Array, "M E"], top_k: int, normalize: bool
) -> tuple[Float[Array, "M k"], Int[Array, "M k"]]:
    """Top-k routing: softmax over all experts (float32), keep the k largest.

    Args:
      router_logits: [M, E] router scores of M tokens.
      top_k: k experts per token.
      normalize: renormalise the k kept probabilities to sum to 1 (Mixtral always;
        Qwen3-MoE where ``norm_topk_prob``).

    Returns:
      ``(weights, experts)``: [M, k] float32 mixing weights and int32 expert ids, largest
      first.
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, experts


def grouped_matmul(
    x: Float[Array, "M K"], w: Float[Array, "E K N"], sizes: Int[Array, " E"]
) -> Float[Array, "M N"]:
    """Row ``r`` of ``x`` times ``w[e]``, where rows are grouped by ``e`` in order: group
    ``e`` is the next ``sizes[e]`` rows (rows past ``sum(sizes)`` give 0). The same as
    ``jax.lax.ragged_dot(x, w, sizes)``, which runs it everywhere but on CPU (module
    docstring)."""
    return jax.lax.platform_dependent(x, w, sizes, cpu=_masked_dense, default=jax.lax.ragged_dot)


# CPU form: elements of one chunk's [E, rows, N] product (2**26: 256 MiB in float32).
_CPU_CHUNK_ELEMENTS = 2**26


def _chunks(x: jax.Array, num_experts: int, n: int) -> tuple[jax.Array, jax.Array]:
    """``x`` [M, K] as row chunks [C, chunk, K] (zero-padded) and their row ids."""
    num_rows = x.shape[0]
    chunk = int(min(num_rows, max(16, _CPU_CHUNK_ELEMENTS // (num_experts * n))))
    count = -(-num_rows // chunk)
    padded = jnp.pad(x, ((0, count * chunk - num_rows), (0, 0)))
    return padded.reshape(count, chunk, -1), jnp.arange(count * chunk).reshape(count, chunk)


def _owned(sizes: jax.Array, ids: jax.Array) -> jax.Array:
    """[E, chunk] bool: which expert's group each row id belongs to."""
    ends = jnp.cumsum(sizes)[:, None]
    return (ids[None] >= ends - sizes[:, None]) & (ids[None] < ends)


@jax.custom_vjp
def _masked_dense(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """:func:`grouped_matmul` on CPU: every expert multiplies every row of a chunk and a mask
    keeps its own rows; a scan over row chunks bounds the [E, rows, N] product. An einsum
    over the expert axis, so that with experts split over devices each device multiplies by
    its own experts and the sum over experts is one reduction (as the accelerators' ragged
    dot is partitioned), instead of gathering every expert's weights. Its VJP recomputes the
    masks per chunk rather than keeping them (autodiff kept a [E, rows, N] mask per chunk)."""
    chunks, ids = _chunks(x, w.shape[0], w.shape[-1])

    def one_chunk(_, inputs):
        rows, row_ids = inputs
        product = jnp.einsum("ck,ekn->ecn", rows, w)
        return None, jnp.where(_owned(sizes, row_ids)[..., None], product, 0).sum(0)

    _, out = jax.lax.scan(one_chunk, None, (chunks, ids))
    return out.reshape(-1, w.shape[-1])[: x.shape[0]].astype(jnp.result_type(x, w))


def _masked_dense_fwd(x, w, sizes):
    return _masked_dense(x, w, sizes), (x, w, sizes)


def _masked_dense_bwd(residuals, grad):
    x, w, sizes = residuals
    chunks, ids = _chunks(x, w.shape[0], w.shape[-1])
    grads = jnp.pad(grad, ((0, chunks.shape[0] * chunks.shape[1] - x.shape[0]), (0, 0)))
    grads = grads.reshape(chunks.shape[0], chunks.shape[1], -1)

    def one_chunk(dw, inputs):
        rows, g, row_ids = inputs
        routed = jnp.where(_owned(sizes, row_ids)[..., None], g[None], 0)  # [E, chunk, N]
        dw = dw + jnp.einsum("ck,ecn->ekn", rows, routed, preferred_element_type=jnp.float32)
        return dw, jnp.einsum("ecn,ekn->ck", routed, w)

    dw, dx = jax.lax.scan(one_chunk, jnp.zeros(w.shape, jnp.float32), (chunks, grads, ids))
    dx = dx.reshape(-1, x.shape[-1])[: x.shape[0]].astype(x.dtype)
    return dx, dw.astype(w.dtype), np.zeros(sizes.shape, jax.dtypes.float0)


_masked_dense.defvjp(_masked_dense_fwd, _masked_dense_bwd)


def expert_mlp(
    x: Float[Array, "M D"],
    weights: Float[Array, "M k"],
    experts: Int[Array, "M k"],
    gate_kernel: Float[Array, "E D F"],
    up_kernel: Float[Array, "E D F"],
    down_kernel: Float[Array, "E F D"],
    activation: Callable[[jax.Array], jax.Array],
) -> Float[Array, "M D"]:
    """``sum_j weights[m, j] * FFN_{experts[m, j]}(x[m])`` with gated experts
    ``FFN_e(x) = (act(x W_gate[e]) * (x W_up[e])) W_down[e]``, dropless (module docstring).

    The M * k (token, expert) pairs are sorted by expert (stable, so each expert's rows keep
    token order), multiplied by :func:`grouped_matmul` with per-expert group sizes and put
    back in pair order.
    """
    num_tokens, k = experts.shape
    num_experts = gate_kernel.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pair index, grouped by expert
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    rows = x[order // k]  # [M*k, D]
    gate = grouped_matmul(rows, gate_kernel, sizes)
    up = grouped_matmul(rows, up_kernel, sizes)
    out = grouped_matmul(activation(gate) * up, down_kernel, sizes)  # [M*k, D]
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    out = out[inverse].reshape(num_tokens, k, -1)
    return (out * weights[..., None].astype(out.dtype)).sum(axis=1)


@flax.struct.dataclass
class RouterLogits:
    """The router logits of one forward pass.

    Attributes:
      logits: [L, B, T, E] float32 router scores of every layer.
      token_mask: [B, T] True at real tokens (padding does not count in the statistics).
    """

    logits: Float[Array, "L B T E"]
    token_mask: Bool[Array, "B T"]


_SINK: contextvars.ContextVar[list[RouterLogits] | None] = contextvars.ContextVar(
    "jaxrlhf_router_logits", default=None
)


@contextlib.contextmanager
def capture_router_logits() -> Iterator[list[RouterLogits]]:
    """Within the block, ``models.model.forward`` / ``forward_packed`` of an MoE model
    append their :class:`RouterLogits` to the yielded list (dense models append nothing).

    Use it around the forward of a loss function, inside the traced function: the arrays are
    that trace's values, to be consumed (:func:`add_router_loss`) before it returns.
    """
    captured: list[RouterLogits] = []
    token = _SINK.set(captured)
    try:
        yield captured
    finally:
        _SINK.reset(token)


def router_sink() -> list[RouterLogits] | None:
    """The list of the innermost :func:`capture_router_logits` block, or None outside one."""
    return _SINK.get()


def _assignment_stats(
    router: RouterLogits, top_k: int
) -> tuple[Float[Array, " E"], Float[Array, " E"], Float[Array, ""]]:
    """Masked sums over layers and real tokens: top-k assignments per expert, router
    probability per expert, and the number of (layer, token) rows."""
    probs = jax.nn.softmax(router.logits.astype(jnp.float32), axis=-1)  # [L, B, T, E]
    _, chosen = jax.lax.top_k(probs, top_k)
    num_experts = probs.shape[-1]
    weight = router.token_mask.astype(jnp.float32)[None, :, :, None]  # [1, B, T, 1]
    counts = jax.nn.one_hot(chosen, num_experts, dtype=jnp.float32).sum(-2)  # [L, B, T, E]
    rows = router.token_mask.astype(jnp.float32).sum() * probs.shape[0]
    return (counts * weight).sum((0, 1, 2)), (probs * weight).sum((0, 1, 2)), rows


def load_balancing_loss(router: RouterLogits, top_k: int) -> Float[Array, ""]:
    """The Switch-Transformer auxiliary loss as transformers computes it
    (``load_balancing_loss_func`` with an attention mask)::

        f_e = (# top-k assignments to expert e) / N      N: real tokens x layers
        P_e = (sum of router probabilities of e) / N
        loss = E * sum_e f_e * P_e

    Its minimum, ``top_k``, is reached by a uniform router; gradients flow through ``P``
    only (the assignments are discrete).
    """
    counts, probs, rows = _assignment_stats(router, top_k)
    rows = jnp.maximum(rows, 1.0)
    return counts.shape[0] * jnp.sum((counts / rows) * (probs / rows))


def router_metrics(router: RouterLogits, top_k: int) -> dict[str, jax.Array]:
    """Flat scalar metrics of one forward's routing, over layers and real tokens.

    ``moe/load/e{j}``: the share of top-k assignments that went to expert j (sums to 1;
    1/E each when balanced); ``moe/load_max``: the largest share times E (1 = balanced,
    E = all tokens on one expert); ``moe/router_entropy``: mean entropy (nats) of the
    router's distribution over experts.
    """
    counts, _, _ = _assignment_stats(router, top_k)
    load = counts / jnp.maximum(counts.sum(), 1.0)
    num_experts = load.shape[0]
    logp = jax.nn.log_softmax(router.logits.astype(jnp.float32), axis=-1)
    entropy = -(jnp.exp(logp) * logp).sum(-1)  # [L, B, T]
    mask = jnp.broadcast_to(router.token_mask[None], entropy.shape).astype(jnp.float32)
    metrics = {f"moe/load/e{j}": load[j] for j in range(num_experts)}
    metrics["moe/load_max"] = load.max() * num_experts
    metrics["moe/router_entropy"] = (entropy * mask).sum() / jnp.maximum(mask.sum(), 1.0)
    return metrics


def add_router_loss(
    cfg: ModelConfig,
    loss: Float[Array, ""],
    metrics: dict[str, Any],
    captured: list[RouterLogits],
) -> tuple[Float[Array, ""], dict[str, Any]]:
    """A training loss's MoE hook: ``loss + router_aux_loss_coef * aux`` (aux: the mean of
    :func:`load_balancing_loss` over the captured forwards) and the router metrics
    (``moe/aux_loss`` and :func:`router_metrics`, averaged over the forwards).

    Returns ``(loss, metrics)`` unchanged when nothing was captured (a dense model).
    """
    if not captured:
        return loss, metrics
    k = cfg.num_experts_per_tok
    aux = sum(load_balancing_loss(r, k) for r in captured) / len(captured)
    per_forward = [router_metrics(r, k) for r in captured]
    metrics = dict(metrics)
    for name in per_forward[0]:
        metrics[name] = sum(m[name] for m in per_forward) / len(per_forward)
    metrics["moe/aux_loss"] = aux
    if cfg.router_aux_loss_coef:
        loss = loss + cfg.router_aux_loss_coef * aux
    return loss, metrics
