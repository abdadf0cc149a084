"""ModelConfig: one frozen description of a decoder-only transformer.

A single config covers the Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, Gemma 1/2/3 (text), Phi-3
and GPT-2 families and the Mixtral and Qwen3-MoE mixtures of experts; the family-specific
choices are plain fields (norm type and placement, activation, biases, q/k norms, soft-caps,
per-layer attention windows and RoPE bases, experts, tying). Presets build the standard
shapes; ``tiny()`` is for tests.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3",
    "phi3",
    "gpt2",
    "mixtral",
    "qwen3_moe",
)
LAYER_TYPES = ("full_attention", "sliding_attention")
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
        base.update(_FAMILY_TRAITS[family])
        base.update(_TINY_SHAPES.get(family, {}))
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
                **_FAMILY_TRAITS["gemma"],
                bos_token_id=2,
                eos_token_id=1,
                pad_token_id=0,
            )
            | overrides  # a preset's own fields may be overridden too
        )

    @classmethod
    def llama3_2_1b(cls, **overrides: Any) -> ModelConfig:
        """Llama-3.2-1B (meta-llama/Llama-3.2-1B config.json; tied embeddings)."""
        return cls.llama3_8b(
            **_LLAMA3_2
            | dict(
                hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, head_dim=64
            )
            | overrides
        )

    @classmethod
    def llama3_2_3b(cls, **overrides: Any) -> ModelConfig:
        """Llama-3.2-3B (meta-llama/Llama-3.2-3B config.json; tied embeddings)."""
        return cls.llama3_8b(
            **_LLAMA3_2
            | dict(
                hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24, head_dim=128
            )
            | overrides
        )

    @classmethod
    def qwen3_0_6b(cls, **overrides: Any) -> ModelConfig:
        """Qwen3-0.6B (Qwen/Qwen3-0.6B config.json; tied embeddings)."""
        return cls(
            **_QWEN3
            | dict(
                hidden_size=1024,
                intermediate_size=3072,
                num_layers=28,
                num_heads=16,
                tie_embeddings=True,
            )
            | overrides
        )

    @classmethod
    def qwen3_1_7b(cls, **overrides: Any) -> ModelConfig:
        """Qwen3-1.7B (Qwen/Qwen3-1.7B config.json; tied embeddings)."""
        return cls(
            **_QWEN3
            | dict(
                hidden_size=2048,
                intermediate_size=6144,
                num_layers=28,
                num_heads=16,
                tie_embeddings=True,
            )
            | overrides
        )

    @classmethod
    def qwen3_4b(cls, **overrides: Any) -> ModelConfig:
        """Qwen3-4B (Qwen/Qwen3-4B config.json; tied embeddings)."""
        return cls(
            **_QWEN3
            | dict(
                hidden_size=2560,
                intermediate_size=9728,
                num_layers=36,
                num_heads=32,
                tie_embeddings=True,
            )
            | overrides
        )

    @classmethod
    def qwen3_8b(cls, **overrides: Any) -> ModelConfig:
        """Qwen3-8B (Qwen/Qwen3-8B config.json)."""
        return cls(
            **_QWEN3
            | dict(
                hidden_size=4096,
                intermediate_size=12288,
                num_layers=36,
                num_heads=32,
            )
            | overrides
        )

    @classmethod
    def qwen3_30b_a3b(cls, **overrides: Any) -> ModelConfig:
        """Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 48 layers of 128 experts, 8 per
        token, top-k probabilities renormalised; 30.5B parameters, 3.3B active per token."""
        return cls(
            **_QWEN3
            | dict(
                family="qwen3_moe",
                hidden_size=2048,
                intermediate_size=6144,
                num_layers=48,
                num_heads=32,
                num_kv_heads=4,
                num_experts=128,
                num_experts_per_tok=8,
                moe_intermediate_size=768,
                norm_topk_prob=True,
            )
            | overrides
        )

    @classmethod
    def mixtral_8x7b(cls, **overrides: Any) -> ModelConfig:
        """Mixtral-8x7B-v0.1 (mistralai/Mixtral-8x7B-v0.1 config.json): 8 experts, 2 per
        token; 46.7B parameters, 12.9B active per token."""
        return cls(
            **dict(
                family="mixtral",
                vocab_size=32000,
                hidden_size=4096,
                intermediate_size=14336,
                num_layers=32,
                num_heads=32,
                num_kv_heads=8,
                max_position_embeddings=32768,
                rope_theta=1000000.0,
                norm_eps=1e-5,
                num_experts=8,
                num_experts_per_tok=2,
                bos_token_id=1,
                eos_token_id=2,
            )
            | overrides
        )

    @classmethod
    def _gemma(cls, fields: dict[str, Any], every: int) -> ModelConfig:
        """A Gemma 2/3 preset whose layer pattern (every ``every``-th layer full) follows its
        ``num_layers`` unless ``layer_types`` is given."""
        fields.setdefault("layer_types", alternating_layers(fields["num_layers"], every))
        return cls(**fields)

    @classmethod
    def gemma2_2b(cls, **overrides: Any) -> ModelConfig:
        """Gemma-2-2B (google/gemma-2-2b config.json)."""
        return cls._gemma(
            _GEMMA2
            | dict(
                hidden_size=2304,
                intermediate_size=9216,
                num_layers=26,
                num_heads=8,
                num_kv_heads=4,
            )
            | overrides,
            every=2,
        )

    @classmethod
    def gemma2_9b(cls, **overrides: Any) -> ModelConfig:
        """Gemma-2-9B (google/gemma-2-9b config.json)."""
        return cls._gemma(
            _GEMMA2
            | dict(
                hidden_size=3584,
                intermediate_size=14336,
                num_layers=42,
                num_heads=16,
                num_kv_heads=8,
            )
            | overrides,
            every=2,
        )

    @classmethod
    def gemma3_1b(cls, **overrides: Any) -> ModelConfig:
        """Gemma-3-1B (google/gemma-3-1b-pt config.json, text only): 5 sliding layers of
        512 tokens (RoPE base 10k) per full layer (RoPE base 1M)."""
        return cls._gemma(
            _GEMMA3
            | dict(
                vocab_size=262144,
                hidden_size=1152,
                intermediate_size=6912,
                num_layers=26,
                num_heads=4,
                num_kv_heads=1,
                max_position_embeddings=32768,
                sliding_window=512,
            )
            | overrides,
            every=6,
        )

    @classmethod
    def gemma3_4b(cls, **overrides: Any) -> ModelConfig:
        """The language model of Gemma-3-4B (google/gemma-3-4b-pt ``text_config``): as
        gemma3_1b with 1024-token windows and the full layers' RoPE scaled linearly by 8."""
        return cls._gemma(
            _GEMMA3
            | dict(
                vocab_size=262208,
                hidden_size=2560,
                intermediate_size=10240,
                num_layers=34,
                num_heads=8,
                num_kv_heads=4,
                max_position_embeddings=131072,
                sliding_window=1024,
                rope_scaling=RopeScaling(type="linear", factor=8.0),
            )
            | overrides,
            every=6,
        )

    @classmethod
    def phi3_mini_4k(cls, **overrides: Any) -> ModelConfig:
        """Phi-3-mini-4k-instruct (microsoft/Phi-3-mini-4k-instruct config.json)."""
        return cls(
            **dict(
                family="phi3",
                vocab_size=32064,
                hidden_size=3072,
                intermediate_size=8192,
                num_layers=32,
                num_heads=32,
                max_position_embeddings=4096,
                norm_eps=1e-5,
                sliding_window=2047,
                bos_token_id=1,
                eos_token_id=32000,
                pad_token_id=32000,
            )
            | overrides
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
                **_FAMILY_TRAITS["gpt2"],
                bos_token_id=50256,
                eos_token_id=50256,
            )
            | overrides  # a preset's own fields may be overridden too
        )


_LLAMA3_2: dict[str, Any] = dict(
    rope_scaling=RopeScaling(
        type="llama3",
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    tie_embeddings=True,
)
_QWEN3: dict[str, Any] = dict(
    family="qwen3",
    vocab_size=151936,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    qk_norm=True,
    bos_token_id=151643,
    eos_token_id=151645,
)


def alternating_layers(num_layers: int, every: int) -> tuple[str, ...]:
    """Gemma's layer pattern: every ``every``-th layer full attention, the others sliding
    (Gemma 2: every 2nd; Gemma 3: every 6th)."""
    return tuple(
        "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(num_layers)
    )


_GEMMA = dict(
    norm_unit_offset=True, activation="gelu_tanh", scale_embeddings=True, tie_embeddings=True
)
# Architectural traits that distinguish the families (everything else is a size).
_FAMILY_TRAITS: dict[str, dict[str, Any]] = {
    "llama": dict(),
    "mistral": dict(),
    "qwen2": dict(qkv_bias=True),
    "qwen3": dict(qk_norm=True),
    "gemma": _GEMMA,
    "gemma2": _GEMMA | dict(post_norms=True),
    "gemma3": _GEMMA | dict(post_norms=True, qk_norm=True),
    "phi3": dict(),
    "mixtral": dict(),
    "qwen3_moe": dict(qk_norm=True),
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

# tiny(): shapes and options that make each family's own features matter at width 32: a head
# width apart from hidden_size // num_heads, windows shorter than the test sequences, one
# sliding and one full layer, soft-caps that the logits reach, experts.
_TINY_SHAPES: dict[str, dict[str, Any]] = {
    "gpt2": dict(num_kv_heads=None),
    "gemma": dict(head_dim=16),
    "qwen3": dict(head_dim=16),
    "gemma2": dict(
        head_dim=16,
        sliding_window=4,
        layer_types=("sliding_attention", "full_attention"),
        query_pre_attn_scalar=24.0,
        attn_logit_softcap=5.0,
        final_logit_softcap=8.0,
    ),
    "gemma3": dict(
        head_dim=16,
        sliding_window=4,
        layer_types=("sliding_attention", "full_attention"),
        query_pre_attn_scalar=24.0,
        rope_theta=1000000.0,
        local_rope_theta=10000.0,
    ),
    "mixtral": dict(num_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=False,
    ),
}

_GEMMA2: dict[str, Any] = dict(
    family="gemma2",
    vocab_size=256000,
    head_dim=256,
    max_position_embeddings=8192,
    sliding_window=4096,
    query_pre_attn_scalar=256.0,
    attn_logit_softcap=50.0,
    final_logit_softcap=30.0,
    **_FAMILY_TRAITS["gemma2"],
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
)
_GEMMA3: dict[str, Any] = dict(
    family="gemma3",
    head_dim=256,
    query_pre_attn_scalar=256.0,
    rope_theta=1000000.0,
    local_rope_theta=10000.0,
    **_FAMILY_TRAITS["gemma3"],
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
)
