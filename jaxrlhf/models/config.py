"""ModelConfig: one frozen description of a decoder-only transformer.

A single config covers the Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, Gemma 1/2/3 (text), Phi-3
and GPT-2 families and the Mixtral and Qwen3-MoE mixtures of experts; the family-specific
choices are plain fields (norm type and placement, activation, biases, q/k norms, soft-caps,
per-layer attention windows and RoPE bases, experts, tying). Presets build the standard
shapes (models/presets.py); ``tiny()`` is for tests.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jaxrlhf.models.families import (
    FAMILIES,
    FAMILY_TRAITS,
    LAYER_TYPES,
    ROPE_SCALING_TYPES,
    TINY_SHAPES,
    RopeScaling,
    alternating_layers,
)
from jaxrlhf.models.presets import NamedPresets

NORM_TYPES = ("rms", "layer")
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
POSITION_TYPES = ("rope", "learned")
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "offload_dots")
ATTENTION_IMPLS = ("auto", "xla", "cudnn")
LAYER_LOOPS = ("auto", "scan", "unroll")


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"ModelConfig.{name}={value!r} is not one of {list(choices)}")


# The family vocabulary (models/families.py) is importable from here too.
__all__ = [
    "FAMILIES",
    "LAYER_TYPES",
    "ROPE_SCALING_TYPES",
    "ModelConfig",
    "RopeScaling",
    "alternating_layers",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig(NamedPresets):
    """Architecture and numerics of a decoder-only transformer.

    Shapes use the letters of STYLE.md: D = hidden_size, F = intermediate_size,
    N = num_heads, K = num_kv_heads, H = head_dim, V = vocab_size, L = num_layers.

    Mixed precision: weights are stored in ``param_dtype`` and cast to ``dtype`` (the
    compute dtype of activations and matmuls) at every use; norms, softmax and log-probs run
    in float32. Trained weights are float32 masters with bfloat16 compute
    (``param_dtype: float32, dtype: bfloat16``, the recommended layout): a bfloat16 weight of
    magnitude 0.02 lies on a grid of spacing ~1.2e-4, where AdamW steps of ~lr = 1e-6 round
    away. A run refuses trained bfloat16 params (``jaxrlhf.config.validate``) unless
    ``optimizer.stochastic_rounding`` rounds each update stochastically
    (``train/rounding.py``). Copies that are only read are cast to ``dtype`` once
    (``models/precision.py``): the sampler's weights at each sync and the frozen reference;
    a reward model loads in the compute dtype. LoRA adapters and the scalar ``score`` head
    are float32 whatever ``param_dtype``, so a LoRA run's frozen base may be bfloat16.
    """

    family: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None  # None: multi-head attention (K = N)
    head_dim: int | None = None  # None: hidden_size // num_heads
    max_position_embeddings: int = 2048

    norm_type: str = "rms"
    norm_eps: float = 1e-6
    norm_unit_offset: bool = False  # Gemma: scale by (1 + w), w initialised to 0
    activation: str = "silu"
    gated_mlp: bool = True  # SwiGLU/GeGLU: act(x W_gate) * (x W_up)
    position_embedding: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    out_bias: bool = False  # bias on the attention output projection
    mlp_bias: bool = False
    tie_embeddings: bool = False
    scale_embeddings: bool = False  # Gemma: multiply embeddings by sqrt(D)
    sliding_window: int | None = None  # keys at most this many positions back (sliding layers)
    # Gemma 2/3 alternate sliding and full layers; Qwen2/3 slide from max_window_layers on.
    layer_types: tuple[str, ...] | None = None  # per layer, a LAYER_TYPES; None: all alike
    qk_norm: bool = False  # Qwen3, Gemma 3: a norm over head_dim on queries and keys
    post_norms: bool = False  # Gemma 2/3: norms on the attention and MLP outputs as well
    query_pre_attn_scalar: float | None = None  # scores scaled by this**-0.5 (None: head_dim)
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the LM logits
    local_rope_theta: float | None = None  # Gemma 3: RoPE base of sliding layers (no scaling)
    partial_rotary_factor: float = 1.0  # RoPE rotates this fraction of each head's dims

    num_experts: int = 0  # experts replacing every layer's MLP (models/moe.py); 0: dense
    num_experts_per_tok: int = 2  # k of the top-k router
    moe_intermediate_size: int | None = None  # each expert's F (None: intermediate_size)
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum to 1
    router_aux_loss_coef: float = 0.0  # training: weight of the load-balancing loss (0: off)

    dtype: str = "float32"  # compute dtype of activations and matmuls (bfloat16 on accelerators)
    param_dtype: str = "float32"
    remat: str = "none"
    attention_impl: str = "auto"
    layer_loop: str = "auto"  # the layer stack: unrolled up to 16 layers (auto), scan, unroll
    initializer_range: float = 0.02

    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        _check_choice("family", self.family, FAMILIES)
        _check_choice("norm_type", self.norm_type, NORM_TYPES)
        _check_choice("activation", self.activation, ACTIVATIONS)
        _check_choice("position_embedding", self.position_embedding, POSITION_TYPES)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("param_dtype", self.param_dtype, DTYPES)
        _check_choice("remat", self.remat, REMAT_POLICIES)
        _check_choice("attention_impl", self.attention_impl, ATTENTION_IMPLS)
        _check_choice("layer_loop", self.layer_loop, LAYER_LOOPS)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.kv_heads}"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"ModelConfig.hidden_size={self.hidden_size} is not divisible by "
                f"num_heads={self.num_heads}; set head_dim explicitly"
            )
        if self.position_embedding == "rope" and self.dim_per_head % 2:
            raise ValueError(f"ModelConfig.head_dim={self.dim_per_head} must be even for RoPE")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"ModelConfig.sliding_window must be >= 1, got {self.sliding_window}")
        self._check_layers()
        self._check_experts()

    def _check_layers(self) -> None:
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"ModelConfig.layer_types has {len(self.layer_types)} entries for "
                    f"num_layers={self.num_layers}"
                )
            for kind in self.layer_types:
                _check_choice("layer_types[]", kind, LAYER_TYPES)
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("ModelConfig.layer_types has sliding layers but no sliding_window")
        for name in (
            "query_pre_attn_scalar",
            "attn_logit_softcap",
            "final_logit_softcap",
            "local_rope_theta",
        ):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"ModelConfig.{name} must be > 0 or None, got {value!r}")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(
                f"ModelConfig.partial_rotary_factor must be in (0, 1], got "
                f"{self.partial_rotary_factor}"
            )
        if self.position_embedding == "rope" and self.rotary_dim % 2:
            raise ValueError(
                f"ModelConfig.partial_rotary_factor={self.partial_rotary_factor} rotates "
                f"{self.rotary_dim} of {self.dim_per_head} head dims; RoPE needs an even number"
            )

    def _check_experts(self) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(
                f"ModelConfig.num_experts must be an int >= 0, got {self.num_experts!r}"
            )
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok} must be in "
                f"[1, num_experts={self.num_experts}]"
            )
        if self.moe_intermediate_size is not None and self.moe_intermediate_size < 1:
            raise ValueError(
                f"ModelConfig.moe_intermediate_size must be >= 1, got {self.moe_intermediate_size}"
            )
        if self.router_aux_loss_coef < 0:
            raise ValueError(
                f"ModelConfig.router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}"
            )
        if self.num_experts and not self.gated_mlp:
            raise ValueError("ModelConfig.num_experts > 0 needs gated_mlp=True (gated experts)")

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        """Head dims that RoPE rotates (the first ones; transformers' ``int(H * factor)``)."""
        return int(self.dim_per_head * self.partial_rotary_factor)

    @property
    def attn_scale(self) -> float:
        """Multiplier on q·k: ``query_pre_attn_scalar**-0.5``, by default ``head_dim**-0.5``."""
        return (self.query_pre_attn_scalar or self.dim_per_head) ** -0.5

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer, whether its attention is windowed by ``sliding_window``."""
        if self.sliding_window is None:
            return (False,) * self.num_layers
        if self.layer_types is None:
            return (True,) * self.num_layers
        return tuple(kind == "sliding_attention" for kind in self.layer_types)

    @property
    def expert_size(self) -> int:
        """Each expert's hidden width F (MoE models)."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- presets -------------------------------------------------------------------------
    @classmethod
    def tiny(cls, family: str = "llama", **overrides: Any) -> ModelConfig:
        """A 2-layer, width-32, vocab-128 model of the given family, for tests."""
        base = dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            max_position_embeddings=128,
        )
        base.update(FAMILY_TRAITS[family])
        base.update(TINY_SHAPES.get(family, {}))
        base.update(overrides)
        return cls(family=family, **base)
