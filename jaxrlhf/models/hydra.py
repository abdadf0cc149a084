"""A Hydra model (trlX's ``AutoModelForCausalLMWithHydraValueHead``): one frozen trunk, two
heads on branches of their own.

The trunk is the embeddings and the layers below ``branch_layer``; the *policy* branch is the
layers from ``branch_layer`` up, the final norm and the LM head (tied models read the trunk's
embedding); the *value* branch is its own copy of those layers and final norm with a scalar
``score`` head. One forward runs the trunk once and gives logits and values::

    trunk/embed/embedding        [V, D]       trunk/pos_embed/embedding (GPT-2)
    trunk/layers/...             [B, ...]     layers 0 .. B-1 (B = branch_layer)
    policy/layers/...            [L-B, ...]   layers B .. L-1
    policy/final_norm/scale      [D]          policy/lm_head [D, V] (untied models)
    value/layers/...             [L-B, ...]   value/final_norm/scale, value/score [D, 1]

The layers keep their index in the whole model (per-layer windows and RoPE bases), so
:func:`from_plain` / :func:`to_plain` convert to and from the plain model's tree exactly and
a Hydra model built from a plain LM equals it, its value branch a critic initialised from
the same weights (``critic_init: policy``).

``heads`` selects what is built and returned: ``("lm",)`` (the policy's params only:
``trunk`` and ``policy``), ``("scalar",)`` (``trunk`` and ``value``) or both.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrlhf.models import axes
from jaxrlhf.models.attention import causal_mask, rope_angles, softcap
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.transformer import (
    Constrain,
    Norm,
    dense,
    embed_inputs,
    embeddings,
    layer_stack,
    no_constraint,
)

BRANCHES = {"lm": "policy", "scalar": "value"}


class Trunk(nn.Module):
    """Embeddings and layers ``0 .. count - 1``: tokens -> the branches' input."""

    cfg: ModelConfig
    count: int
    constrain: Constrain = no_constraint

    def setup(self) -> None:
        self.embed, pos_embed = embeddings(self.cfg)
        if pos_embed is not None:
            self.pos_embed = pos_embed
        if self.count:
            self.layers = layer_stack(self.cfg, self.constrain, None, self.count)

    def __call__(self, tokens, positions, mask):
        cfg = self.cfg
        pos_embed = self.pos_embed if cfg.position_embedding == "learned" else None
        x = embed_inputs(cfg, self.constrain, self.embed, pos_embed, tokens, positions)
        if self.count:
            ids = jnp.arange(self.count)
            x, _ = self.layers(x, rope_angles(cfg, positions), mask, None, None, ids)
        return x

    def attend(self, hidden):
        return self.embed.attend(hidden)


class Branch(nn.Module):
    """Layers ``first .. L - 1``, the final norm and (``head``: ``lm`` untied, ``scalar``)
    the head; a tied LM branch returns the final hidden states."""

    cfg: ModelConfig
    first: int
    head: str
    constrain: Constrain = no_constraint

    def setup(self) -> None:
        cfg = self.cfg
        self.layers = layer_stack(cfg, self.constrain, None, cfg.num_layers - self.first)
        self.final_norm = Norm(cfg)
        init = nn.initializers.normal(stddev=cfg.initializer_range)
        if self.head == "scalar":
            names, shape = (axes.EMBED, axes.SCALAR), (cfg.hidden_size, 1)
            self.kernel = self.param(
                "score", nn.with_logical_partitioning(init, names), shape, cfg.weight_dtype
            )
        elif not cfg.tie_embeddings:
            names, shape = (axes.EMBED, axes.VOCAB), (cfg.hidden_size, cfg.vocab_size)
            self.kernel = self.param(
                "lm_head", nn.with_logical_partitioning(init, names), shape, cfg.weight_dtype
            )

    def __call__(self, x, positions, mask, head_from, select):
        cfg = self.cfg
        ids = jnp.arange(self.first, cfg.num_layers)
        x, _ = self.layers(x, rope_angles(cfg, positions), mask, None, None, ids)
        hidden = self.final_norm(x)
        hidden = hidden[:, head_from:] if select is None else select(hidden)
        if self.head == "lm" and cfg.tie_embeddings:
            return hidden
        out = dense(hidden, self.kernel.astype(cfg.compute_dtype))
        if self.head == "scalar":
            return out[..., 0].astype(jnp.float32)
        out = self.constrain(out, (axes.BATCH, axes.LENGTH, axes.ACT_VOCAB))
        return softcap(out.astype(jnp.float32), cfg.final_logit_softcap)


class HydraModel(nn.Module):
    """Trunk + policy and/or value branches (module docstring). Called like
    :class:`~jaxrlhf.models.transformer.CausalLM` (no KV cache); returns ``(out, None)`` with
    ``out`` the logits, the values, or ``(logits, values)`` for both heads."""

    cfg: ModelConfig
    branch_layer: int
    heads: tuple[str, ...] = ("lm", "scalar")
    constrain: Constrain = no_constraint

    @nn.compact
    def __call__(
        self, tokens, positions, mask, cache=None, cache_index=None, *, head_from=0, select=None
    ):
        if cache is not None:
            raise ValueError("a Hydra model does not decode with a KV cache (merge it first)")
        cfg, b = self.cfg, self.branch_layer
        trunk = Trunk(cfg, b, self.constrain, name="trunk")
        x = trunk(tokens, positions, mask)
        outs = []
        for head in self.heads:
            branch = Branch(cfg, b, head, self.constrain, name=BRANCHES[head])
            out = branch(x, positions, mask, head_from, select)
            if head == "lm" and cfg.tie_embeddings:
                out = trunk.attend(out)
                out = self.constrain(out, (axes.BATCH, axes.LENGTH, axes.ACT_VOCAB))
                out = softcap(out.astype(jnp.float32), cfg.final_logit_softcap)
            outs.append(out)
        return (outs[0] if len(outs) == 1 else tuple(outs)), None


# ---- trees ---------------------------------------------------------------------------------


def _layers(tree: Any, part: slice) -> Any:
    return jax.tree.map(lambda x: x[part], tree)


def from_plain(params: Any, branch_layer: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(trunk, policy branch)`` of a plain LM's params (``models.model`` tree)."""
    decoder = params["decoder"]
    trunk = {k: v for k, v in decoder.items() if k in ("embed", "pos_embed")}
    if branch_layer:
        trunk["layers"] = _layers(decoder["layers"], slice(None, branch_layer))
    policy = {
        "layers": _layers(decoder["layers"], slice(branch_layer, None)),
        "final_norm": decoder["final_norm"],
    }
    if "lm_head" in params:
        policy["lm_head"] = params["lm_head"]
    return trunk, policy


def value_from_plain(params: Any, branch_layer: int, score: jax.Array) -> dict[str, Any]:
    """A value branch from a plain model's decoder (copies of its top layers and final norm)
    with the head ``score [D, 1]``."""
    _, policy = from_plain(params, branch_layer)
    return {
        "layers": jax.tree.map(jnp.copy, policy["layers"]),
        "final_norm": jax.tree.map(jnp.copy, policy["final_norm"]),
        "score": score,
    }


def to_plain(trunk: Any, policy: Any) -> dict[str, Any]:
    """The plain LM's params of a trunk and a policy branch (inverse of :func:`from_plain`)."""
    layers = policy["layers"]
    if "layers" in trunk:
        layers = jax.tree.map(
            lambda a, b: jnp.concatenate([a, b], axis=0), trunk["layers"], policy["layers"]
        )
    decoder = {k: v for k, v in trunk.items() if k != "layers"}
    decoder.update(layers=layers, final_norm=policy["final_norm"])
    out = {"decoder": decoder}
    if "lm_head" in policy:
        out["lm_head"] = policy["lm_head"]
    return out


def to_plain_critic(trunk: Any, value: Any) -> dict[str, Any]:
    """The plain scalar model's params of a trunk and a value branch (a separate critic)."""
    plain = to_plain(trunk, {k: v for k, v in value.items() if k != "score"})
    return dict(plain, score=value["score"])


def _init_fn(module: nn.Module, key: jax.Array) -> Any:
    tokens = jnp.zeros((1, 1), jnp.int32)
    mask = causal_mask(jnp.ones((1, 1), bool), 1)
    return module.init(key, tokens, jnp.zeros((1, 1), jnp.int32), mask)["params"]


def abstract_params(cfg: ModelConfig, branch_layer: int, heads: tuple[str, ...]) -> Any:
    """ShapeDtypeStructs of a Hydra model's (unboxed) params; no memory used."""
    module = HydraModel(cfg, branch_layer, heads)
    return nn.unbox(jax.eval_shape(lambda k: _init_fn(module, k), jax.random.key(0)))


def logical_specs(cfg: ModelConfig, branch_layer: int, heads: tuple[str, ...]) -> Any:
    """PartitionSpecs of logical axis names matching :func:`abstract_params`."""
    module = HydraModel(cfg, branch_layer, heads)
    boxed = jax.eval_shape(lambda k: _init_fn(module, k), jax.random.key(0))
    return nn.get_partition_spec(boxed)
