"""LoRA (Hu et al. 2021): low-rank adapters on the attention and MLP projections.

A targeted projection ``y = x W`` becomes ``y = x W + (alpha / r) * dropout(x) A B`` with
``A [in, r]`` and ``B [r, out]``; ``B`` starts at zero, so the adapted model starts equal to
its base (PEFT's default initialisation: ``A`` uniform in ``+-1/sqrt(in)``). The adapters are
params of the same Linen modules, created beside the kernel they adapt when the model is
built with a :class:`LoraSpec` (``models.model.build(cfg, head, lora=spec)``)::

    decoder/layers/attn/q_lora_a   [L, D, r]      (layers, embed, lora_rank)
    decoder/layers/attn/q_lora_b   [L, r, N, H]   (layers, lora_rank, heads, head_dim)
    decoder/layers/attn/o_lora_a   [L, N, H, r]   o_lora_b [L, r, D]
    decoder/layers/mlp/up_lora_a   [L, D, r]      up_lora_b [L, r, F]   (gate alike)
    decoder/layers/mlp/down_lora_a [L, F, r]      down_lora_b [L, r, D]

so they carry the logical axis names of the kernel's in and out dims and follow every rule
set (FSDP shards ``A`` like the kernel's input, tensor parallelism ``B`` like its output).

Why a wrapper of our own model rather than a library (qwix, which Tunix uses): qwix adapts a
model by intercepting its ``dot_general`` calls, so its adapters are shaped like the 2-D
matmuls it sees, not like our stacked ``[L, D, N, H]`` kernels with their logical names; our
sampler's decode reads the kernels directly (fused, blocked) and would bypass the
interception; and the PEFT export needs the adapters per named projection. Adding two params
next to each targeted kernel keeps the param tree, the rule sets and the HF name tables as
they are.

Training splits the tree (:func:`split_params`): the *trainable* part holds the adapters
(and a scalar model's new ``score`` head, PEFT's ``modules_to_save``), the *base* the frozen
pretrained weights, passed to the jitted steps as a separate argument that is never donated
or checkpointed, and shared with the reference (which is the base without adapters). The
loss sees both as a :class:`LoraParams`. The sampler gets merged weights
(:func:`merge`): ``W + (alpha / r) A B``.

The adapters are stored in float32 whatever the base's ``param_dtype`` (they are trained:
small updates to bfloat16 weights round away, see ``train/rounding.py``) and cast to the
compute dtype at use, so a frozen base may stay bfloat16.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from jaxrlhf.models import axes

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
ATTENTION_TARGETS = ("q", "k", "v", "o")
MLP_TARGETS = ("gate", "up", "down")
_SUFFIXES = ("_lora_a", "_lora_b")
# Where each target's kernel sits in the param tree (under decoder/layers/).
TARGET_MODULES = {t: "attn" for t in ATTENTION_TARGETS} | {t: "mlp" for t in MLP_TARGETS}


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """The adapters of a model (static: part of the module, hashable).

    Attributes:
      rank: r, the inner dimension of each adapter.
      alpha: the scale numerator: the update is ``(alpha / rank) * x A B``.
      dropout: dropout on the adapter's input while training (0: none). Applied only when
        the forward gets a dropout key (:class:`LoraParams`); evaluation, scoring and
        sampling are deterministic.
      targets: the projections adapted, from ``TARGETS``.
    """

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = ATTENTION_TARGETS

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank: must be >= 1, got {self.rank}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"targets: expected a non-empty subset of {list(TARGETS)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def lora_delta(
    module: nn.Module,
    spec: LoraSpec,
    name: str,
    x: jax.Array,
    in_dims: tuple[int, ...],
    out_dims: tuple[int, ...],
    in_names: tuple[str, ...],
    out_names: tuple[str, ...],
) -> jax.Array:
    """``(alpha / r) * dropout(x) A B`` for the projection ``name`` of ``module``, shaped
    ``[*x.shape[:-len(in_dims)], *out_dims]``; creates ``{name}_lora_a [*in_dims, r]`` and
    ``{name}_lora_b [r, *out_dims]``.

    Args:
      module: the Linen module that owns the kernel (its ``cfg`` gives the compute dtype;
        the adapters are stored in float32).
      spec: the adapters' settings.
      name: the kernel's name without ``_kernel`` (``q``, ``down``, ...).
      x: the projection's input ``[..., *in_dims]``.
      in_dims, out_dims: the kernel's input and output dims.
      in_names, out_names: their logical axis names.
    """
    cfg = module.cfg
    fan_in, fan_out, r = math.prod(in_dims), math.prod(out_dims), spec.rank
    bound = 1.0 / math.sqrt(fan_in)

    def a_init(key, shape, dtype):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    a = module.param(
        f"{name}_lora_a",
        nn.with_logical_partitioning(a_init, (*in_names, axes.LORA_RANK)),
        (*in_dims, r),
        jnp.float32,
    ).astype(cfg.compute_dtype)
    b = module.param(
        f"{name}_lora_b",
        nn.with_logical_partitioning(nn.initializers.zeros, (axes.LORA_RANK, *out_names)),
        (r, *out_dims),
        jnp.float32,
    ).astype(cfg.compute_dtype)
    batch = x.shape[: x.ndim - len(in_dims)]
    x2 = x.reshape(-1, fan_in)
    if spec.dropout > 0 and module.has_rng("dropout"):
        keep = jax.random.bernoulli(module.make_rng("dropout"), 1.0 - spec.dropout, x2.shape)
        x2 = jnp.where(keep, x2 / (1.0 - spec.dropout), 0).astype(x2.dtype)
    hidden = jnp.dot(x2, a.reshape(fan_in, r))
    out = jnp.dot(hidden, b.reshape(r, fan_out)) * jnp.asarray(spec.scale, cfg.compute_dtype)
    return out.reshape(*batch, *out_dims)


# ---- the param tree ------------------------------------------------------------------------


@flax.struct.dataclass
class LoraParams:
    """The params a LoRA model's loss sees: frozen base and trainable part, kept apart so
    gradients (and optimizer state) exist for the trainable part only.

    Attributes:
      base: the frozen weights (the plain model's tree, a scalar model's ``score`` excepted).
      trainable: the adapters, plus a scalar model's ``score`` head.
      dropout_key: the adapters' dropout key (None: no dropout).
    """

    base: Any
    trainable: Any
    dropout_key: jax.Array | None = None

    def tree(self) -> Any:
        """The whole param tree the LoRA module applies (base and trainable combined)."""
        return combine(self.base, self.trainable)


def combine_fn(spec: LoraSpec):
    """The ``Learner.combine`` of a LoRA learner: ``(frozen, trainable, key) ->
    LoraParams``, keeping the dropout key only when ``spec`` has dropout."""

    def combine_params(frozen: Any, trainable: Any, key: jax.Array | None) -> LoraParams:
        return LoraParams(frozen, trainable, key if spec.dropout > 0 else None)

    return combine_params


def is_adapter(name: str) -> bool:
    """Whether a param leaf named ``name`` is a LoRA adapter matrix."""
    return name.endswith(_SUFFIXES)


def _trainable_leaf(path: tuple[str, ...]) -> bool:
    return is_adapter(path[-1]) or path == ("score",)


def split_params(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(base, trainable)`` of a LoRA model's tree (any leaves: arrays, shardings, specs):
    the adapters and a top-level ``score`` head are trainable, the rest frozen."""

    def walk(node: Mapping[str, Any], path: tuple[str, ...]) -> tuple[dict, dict]:
        base, trainable = {}, {}
        for key, value in node.items():
            sub = (*path, key)
            if isinstance(value, Mapping):
                b, t = walk(value, sub)
                if b:
                    base[key] = b
                if t:
                    trainable[key] = t
            elif _trainable_leaf(sub):
                trainable[key] = value
            else:
                base[key] = value
        return base, trainable

    return walk(params, ())


def combine(base: Mapping[str, Any], trainable: Mapping[str, Any]) -> dict[str, Any]:
    """The nested-dict union of ``base`` and ``trainable`` (inverse of :func:`split_params`)."""
    out = dict(base)
    for key, value in trainable.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = combine(out[key], value)
        else:
            out[key] = value
    return out


def adapters_only(trainable: Mapping[str, Any]) -> dict[str, Any]:
    """The adapter matrices of a trainable tree (a scalar model's ``score`` dropped)."""
    return {k: v for k, v in trainable.items() if k != "score"}


def merge(base: Mapping[str, Any], trainable: Mapping[str, Any], spec: LoraSpec) -> dict[str, Any]:
    """The plain model's params with every adapter folded in: ``W + (alpha / r) A B``
    (computed in float32, cast to ``W``'s dtype); a scalar model's ``score`` is taken from
    ``trainable``. Pure: jit it with the shardings of the layout it should run in."""
    layers = base["decoder"]["layers"]
    adapted = trainable.get("decoder", {}).get("layers", {})
    new_layers = dict(layers)
    for module_name, module in adapted.items():
        merged = dict(layers[module_name])
        for target in {k[: -len("_lora_a")] for k in module if k.endswith("_lora_a")}:
            kernel = merged[f"{target}_kernel"]
            a, b = module[f"{target}_lora_a"], module[f"{target}_lora_b"]
            merged[f"{target}_kernel"] = fold(kernel, a, b, spec.scale)
        new_layers[module_name] = merged
    out = dict(base, decoder=dict(base["decoder"], layers=new_layers))
    if "score" in trainable:
        out["score"] = trainable["score"]
    return out


def fold(kernel: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """``kernel + scale * a @ b`` for stacked ``kernel [L, *in, *out]``, ``a [L, *in, r]``,
    ``b [L, r, *out]``, in float32, cast back to ``kernel``'s dtype."""
    layers, r = a.shape[0], a.shape[-1]
    fan_in = math.prod(a.shape[1:-1])
    delta = jnp.matmul(
        a.reshape(layers, fan_in, r).astype(jnp.float32),
        b.reshape(layers, r, -1).astype(jnp.float32),
    )
    out = kernel.astype(jnp.float32) + scale * delta.reshape(kernel.shape)
    return out.astype(kernel.dtype)
