"""ILQL's model (Snell et al. 2022, as trlX's ``AutoModelForCausalLMWithILQLHeads``): a causal
LM whose final hidden states also feed a value head and Q heads over the vocabulary.

Heads are trlX's ``make_head``: ``Linear(D, 2D) -> ReLU -> Linear(2D, out)``, with ``out = 1``
for ``V`` and ``out = V`` (the vocabulary) for each Q head. Their params are float32 whatever
the model's ``param_dtype``: a Polyak step of ``alpha = 0.001`` rounds away in bfloat16.
:data:`NUM_Q_HEADS` (trlX's ``two_qs``: 2) Q heads are trained; as many *target* Q heads
follow them by Polyak averaging (:func:`polyak_update`) and never receive gradients.

The param tree is the causal LM's (``decoder``, and ``lm_head`` unless tied: a Hugging Face
causal LM loads into it and exports from it unchanged) plus the heads ``v_head``,
``q_heads_0``, ``q_heads_1``, ``target_q_heads_0`` and ``target_q_heads_1``, each
``{"hidden_kernel", "hidden_bias", "out_kernel", "out_bias"}``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxrlhf.models import axes
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.lora import LoraSpec
from jaxrlhf.models.transformer import (
    Constrain,
    dense,
    dense_init,
    head_inputs,
    lm_logits,
    no_constraint,
)

NUM_Q_HEADS = 2


class ILQLOutputs(NamedTuple):
    """One forward of :class:`ILQLModel`, float32, at the positions the head ran on.

    Attributes:
      logits: ``[B, T, V]`` the language model's.
      q: ``[K, B, T, V]`` each trained Q head's values of every next token.
      target_q: ``[K, B, T, V]`` the target Q heads' (use them as constants).
      values: ``[B, T]`` the value head's ``V(s_t)``.
    """

    logits: Float[Array, "B T V"]
    q: Float[Array, "K B T V"]
    target_q: Float[Array, "K B T V"]
    values: Float[Array, "B T"]


def _param(module: nn.Module, name: str, shape: tuple[int, ...], names: tuple, init) -> jax.Array:
    """A float32 head parameter, in the compute dtype."""
    partitioned = nn.with_logical_partitioning(init, names)
    return module.param(name, partitioned, shape, jnp.float32).astype(module.cfg.compute_dtype)


def _head(module: nn.Module, hidden: jax.Array, out: int, out_name: str) -> jax.Array:
    cfg = module.cfg
    d, init, zeros = cfg.hidden_size, dense_init(cfg), nn.initializers.zeros
    w1 = _param(module, "hidden_kernel", (d, 2 * d), (axes.EMBED, axes.MLP), init)
    b1 = _param(module, "hidden_bias", (2 * d,), (axes.MLP,), zeros)
    w2 = _param(module, "out_kernel", (2 * d, out), (axes.MLP, out_name), init)
    b2 = _param(module, "out_bias", (out,), (out_name,), zeros)
    return (dense(jax.nn.relu(dense(hidden, w1) + b1), w2) + b2).astype(jnp.float32)


class Head(nn.Module):
    """One ``Linear(D, 2D) -> ReLU -> Linear(2D, out)`` head; ``out`` 1 (values, squeezed)
    or the vocabulary (Q values)."""

    cfg: ModelConfig
    vocab: bool
    constrain: Constrain = no_constraint

    @nn.compact
    def __call__(self, hidden: Float[Array, "B T D"]) -> jax.Array:
        if not self.vocab:
            return _head(self, hidden, 1, axes.SCALAR)[..., 0]
        q = _head(self, hidden, self.cfg.vocab_size, axes.VOCAB)
        return self.constrain(q, (axes.BATCH, axes.LENGTH, axes.ACT_VOCAB))


class ILQLModel(nn.Module):
    """Causal LM with ILQL's heads: returns ``(ILQLOutputs, cache)``. ``head_from`` and
    ``select`` as for :class:`~jaxrlhf.models.transformer.CausalLM`. LoRA is not supported
    (ILQL trains the whole model)."""

    cfg: ModelConfig
    constrain: Constrain = no_constraint
    lora: LoraSpec | None = None

    @nn.compact
    def __call__(
        self, tokens, positions, mask, cache=None, cache_index=None, *, head_from=0, select=None
    ):
        if self.lora is not None:
            raise ValueError("ILQL's model has no LoRA adapters")
        cfg = self.cfg
        decoder, hidden, new_cache = head_inputs(
            self, tokens, positions, mask, cache, cache_index, head_from, select
        )
        logits = lm_logits(self, decoder, hidden)

        def q_heads(name: str) -> jax.Array:
            return jnp.stack(
                [
                    Head(cfg, True, self.constrain, name=f"{name}_{k}")(hidden)
                    for k in range(NUM_Q_HEADS)
                ]
            )

        values = Head(cfg, False, self.constrain, name="v_head")(hidden)
        q, target_q = q_heads("q_heads"), q_heads("target_q_heads")
        return ILQLOutputs(logits, q, target_q, values), new_cache


def _pairs() -> list[tuple[str, str]]:
    return [(f"q_heads_{k}", f"target_q_heads_{k}") for k in range(NUM_Q_HEADS)]


def copy_q_to_target(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with each target Q head set to its Q head (trlX starts them equal)."""
    out = dict(params)
    for q, target in _pairs():
        out[target] = jax.tree.map(jnp.copy, params[q])
    return out


def polyak_update(params: dict[str, Any], alpha: float) -> dict[str, Any]:
    """``target <- alpha * q + (1 - alpha) * target`` for each Q head (trlX's
    ``sync_target_q_heads``); every other leaf unchanged."""
    out = dict(params)
    for q, target in _pairs():
        out[target] = jax.tree.map(
            lambda t, s: (
                alpha * s.astype(jnp.float32) + (1 - alpha) * t.astype(jnp.float32)
            ).astype(t.dtype),
            params[target],
            params[q],
        )
    return out


def trainable_mask(params: dict[str, Any]) -> dict[str, Any]:
    """True on the leaves the optimizer updates: all but the target Q heads."""
    targets = {target for _, target in _pairs()}
    return {k: jax.tree.map(lambda _, t=k in targets: not t, v) for k, v in params.items()}


def lm_params(params: dict[str, Any]) -> dict[str, Any]:
    """The causal LM's part of ``params`` (what a Hugging Face ``*ForCausalLM`` holds)."""
    return {k: v for k, v in params.items() if k in ("decoder", "lm_head")}


def head_param_names() -> tuple[str, ...]:
    """Top-level names of the ILQL heads in the param tree."""
    names = ["v_head"]
    for q, target in _pairs():
        names += [q, target]
    return tuple(names)


def head_params(params: dict[str, Any]) -> dict[str, Any]:
    """The value and Q heads' part of ``params`` (the targets included)."""
    return {k: v for k, v in params.items() if k in head_param_names()}
