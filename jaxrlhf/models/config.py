"""ModelConfig: one frozen description of a decoder-only transformer.

A single config covers the Llama 2/3, Mistral, Qwen2, Gemma (first generation) and GPT-2
families; the family-specific choices are plain fields (norm type, activation, biases, how
positions enter, tying). Presets build the standard shapes; ``tiny()`` is for tests.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

FAMILIES = ("llama", "mistral", "qwen2", "gemma", "gpt2")
NORM_TYPES = ("rms", "layer")
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
POSITION_TYPES = ("rope", "learned")
ROPE_SCALING_TYPES = ("linear", "llama3")
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "offload_dots")
ATTENTION_IMPLS = ("auto", "xla", "cudnn")


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"ModelConfig.{name}={value!r} is not one of {list(choices)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling.

    ``linear`` divides every inverse frequency by ``factor`` (Llama 2 long-context style);
    ``llama3`` rescales only the low frequencies with a smooth ramp between
    ``low_freq_factor`` and ``high_freq_factor`` (Llama 3.1+).
    """

    type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.type not in ROPE_SCALING_TYPES:
            raise ValueError(
                f"RopeScaling.type={self.type!r} is not one of {list(ROPE_SCALING_TYPES)}"
            )
        if self.factor <= 0:
            raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture and numerics of a decoder-only transformer.

    Shapes use the letters of STYLE.md: D = hidden_size, F = intermediate_size,
    N = num_heads, K = num_kv_heads, H = head_dim, V = vocab_size, L = num_layers.
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
    sliding_window: int | None = None  # Mistral: keys at most this many positions back

    dtype: str = "float32"  # compute dtype of activations and matmuls
    param_dtype: str = "float32"
    remat: str = "none"
    attention_impl: str = "auto"
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

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

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
        if family == "gpt2":
            base["num_kv_heads"] = None
        if family == "gemma":
            base["head_dim"] = 16  # separate from hidden_size // num_heads = 8
        base.update(overrides)
        return cls(family=family, **base)

    @classmethod
    def bench_s(cls, **overrides: Any) -> ModelConfig:
        """bench-S of shared/bench/WORKLOADS.md (Llama architecture, 3.5M matmul params)."""
        return cls(
            **dict(
                family="llama",
                vocab_size=2048,
                hidden_size=256,
                intermediate_size=704,
                num_layers=4,
                num_heads=8,
                num_kv_heads=4,
                max_position_embeddings=512,
                rope_theta=10000.0,
                norm_eps=1e-5,
            )
            | overrides  # a preset's own fields may be overridden too
        )

    @classmethod
    def bench_m(cls, **overrides: Any) -> ModelConfig:
        """bench-M of shared/bench/WORKLOADS.md (Llama architecture, ~100M params)."""
        return cls(
            **dict(
                family="llama",
                vocab_size=8192,
                hidden_size=768,
                intermediate_size=2048,
                num_layers=12,
                num_heads=12,
                num_kv_heads=4,
                max_position_embeddings=1024,
                rope_theta=10000.0,
                norm_eps=1e-5,
            )
            | overrides  # a preset's own fields may be overridden too
        )

    @classmethod
    def llama3_8b(cls, **overrides: Any) -> ModelConfig:
        return cls(
            **dict(
                family="llama",
                vocab_size=128256,
                hidden_size=4096,
                intermediate_size=14336,
                num_layers=32,
                num_heads=32,
                num_kv_heads=8,
                max_position_embeddings=131072,
                rope_theta=500000.0,
                norm_eps=1e-5,
                rope_scaling=RopeScaling(
                    type="llama3",
                    factor=8.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=8192,
                ),
                bos_token_id=128000,
                eos_token_id=128001,
            )
            | overrides  # a preset's own fields may be overridden too
        )

    @classmethod
    def llama2_7b(cls, **overrides: Any) -> ModelConfig:
        return cls(
            **dict(
                family="llama",
                vocab_size=32000,
                hidden_size=4096,
                intermediate_size=11008,
                num_layers=32,
                num_heads=32,
                max_position_embeddings=4096,
                norm_eps=1e-5,
                bos_token_id=1,
                eos_token_id=2,
            )
            | overrides  # a preset's own fields may be overridden too
        )

    @classmethod
    def mistral_7b(cls, **overrides: Any) -> ModelConfig:
        return cls(
            **dict(
                family="mistral",
                vocab_size=32000,
                hidden_size=4096,
                intermediate_size=14336,
                num_layers=32,
                num_heads=32,
                num_kv_heads=8,
                max_position_embeddings=32768,
                norm_eps=1e-5,
                sliding_window=4096,
                bos_token_id=1,
                eos_token_id=2,
            )
            | overrides  # a preset's own fields may be overridden too
        )

    @classmethod
    def qwen2_7b(cls, **overrides: Any) -> ModelConfig:
        return cls(
            **dict(
                family="qwen2",
                vocab_size=152064,
                hidden_size=3584,
                intermediate_size=18944,
                num_layers=28,
                num_heads=28,
                num_kv_heads=4,
                max_position_embeddings=32768,
                rope_theta=1000000.0,
                qkv_bias=True,
                eos_token_id=151643,
            )
            | overrides  # a preset's own fields may be overridden too
        )

    @classmethod
    def qwen2_5_1_5b(cls, **overrides: Any) -> ModelConfig:
        """Qwen2.5-1.5B (Qwen/Qwen2.5-1.5B config.json; 1.54B params, tied embeddings).

        The -Instruct variant differs only in ``eos_token_id`` (151645, ``<|im_end|>``) and
        ``max_position_embeddings`` (32768). Any field may be overridden.
        """
        base: dict[str, Any] = dict(
            family="qwen2",
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_layers=28,
            num_heads=12,
            num_kv_heads=2,
            max_position_embeddings=131072,
            rope_theta=1000000.0,
            qkv_bias=True,
            tie_embeddings=True,
            bos_token_id=151643,
            eos_token_id=151643,
        )
        return cls(**{**base, **overrides})

    @classmethod
    def gemma_2b(cls, **overrides: Any) -> ModelConfig:
        return cls(
            **dict(
                family="gemma",
                vocab_size=256000,
                hidden_size=2048,
                intermediate_size=16384,
                num_layers=18,
                num_heads=8,
                num_kv_heads=1,
                head_dim=256,
                max_position_embeddings=8192,
                **FAMILY_TRAITS["gemma"],
                bos_token_id=2,
                eos_token_id=1,
                pad_token_id=0,
            )
            | overrides  # a preset's own fields may be overridden too
        )

    @classmethod
    def gpt2(cls, **overrides: Any) -> ModelConfig:
        return cls(
            **dict(
                family="gpt2",
                vocab_size=50257,
                hidden_size=768,
                intermediate_size=3072,
                num_layers=12,
                num_heads=12,
                max_position_embeddings=1024,
                **FAMILY_TRAITS["gpt2"],
                bos_token_id=50256,
                eos_token_id=50256,
            )
            | overrides  # a preset's own fields may be overridden too
        )


# Architectural traits that distinguish the families (everything else is a size).
FAMILY_TRAITS: dict[str, dict[str, Any]] = {
    "llama": dict(),
    "mistral": dict(),
    "qwen2": dict(qkv_bias=True),
    "gemma": dict(
        norm_unit_offset=True, activation="gelu_tanh", scale_embeddings=True, tie_embeddings=True
    ),
    "gpt2": dict(
        norm_type="layer",
        norm_eps=1e-5,
        activation="gelu_tanh",
        gated_mlp=False,
        position_embedding="learned",
        qkv_bias=True,
        out_bias=True,
        mlp_bias=True,
        tie_embeddings=True,
    ),
}
