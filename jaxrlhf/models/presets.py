"""Published model sizes as ``ModelConfig`` classmethods (``ModelConfig.qwen3_8b()``, ...).

:class:`NamedPresets` is a base of :class:`~jaxrlhf.models.config.ModelConfig`; each preset
builds the config of one released checkpoint's ``config.json`` (any field may be
overridden: ``ModelConfig.qwen3_8b(num_layers=2)``), and ``model.preset`` in a run config
names one of them (``jaxrlhf.config.PRESETS``).
"""

from __future__ import annotations

from typing import Any, TypeVar

from jaxrlhf.models.families import FAMILY_TRAITS, RopeScaling, alternating_layers

# The class the presets build (ModelConfig, which derives from NamedPresets).
Config = TypeVar("Config", bound="NamedPresets")

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


_GEMMA2: dict[str, Any] = dict(
    family="gemma2",
    vocab_size=256000,
    head_dim=256,
    max_position_embeddings=8192,
    sliding_window=4096,
    query_pre_attn_scalar=256.0,
    attn_logit_softcap=50.0,
    final_logit_softcap=30.0,
    **FAMILY_TRAITS["gemma2"],
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
    **FAMILY_TRAITS["gemma3"],
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
)


class NamedPresets:
    """The named presets of :class:`~jaxrlhf.models.config.ModelConfig` (a mixin of
    classmethods; ``cls`` is ModelConfig)."""

    @classmethod
    def bench_s(cls: type[Config], **overrides: Any) -> Config:
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
    def bench_m(cls: type[Config], **overrides: Any) -> Config:
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
    def llama3_8b(cls: type[Config], **overrides: Any) -> Config:
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
    def llama3_70b(cls: type[Config], **overrides: Any) -> Config:
        """Meta-Llama-3-70B's architecture (Llama-3-8B's, wider and deeper)."""
        return cls.llama3_8b(
            **dict(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64)
            | overrides
        )

    @classmethod
    def llama2_7b(cls: type[Config], **overrides: Any) -> Config:
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
    def mistral_7b(cls: type[Config], **overrides: Any) -> Config:
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
    def qwen2_7b(cls: type[Config], **overrides: Any) -> Config:
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
    def qwen2_5_1_5b(cls: type[Config], **overrides: Any) -> Config:
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
    def gemma_2b(cls: type[Config], **overrides: Any) -> Config:
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
    def llama3_2_1b(cls: type[Config], **overrides: Any) -> Config:
        """Llama-3.2-1B (meta-llama/Llama-3.2-1B config.json; tied embeddings)."""
        return cls.llama3_8b(
            **_LLAMA3_2
            | dict(
                hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, head_dim=64
            )
            | overrides
        )

    @classmethod
    def llama3_2_3b(cls: type[Config], **overrides: Any) -> Config:
        """Llama-3.2-3B (meta-llama/Llama-3.2-3B config.json; tied embeddings)."""
        return cls.llama3_8b(
            **_LLAMA3_2
            | dict(
                hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24, head_dim=128
            )
            | overrides
        )

    @classmethod
    def qwen3_0_6b(cls: type[Config], **overrides: Any) -> Config:
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
    def qwen3_1_7b(cls: type[Config], **overrides: Any) -> Config:
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
    def qwen3_4b(cls: type[Config], **overrides: Any) -> Config:
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
    def qwen3_8b(cls: type[Config], **overrides: Any) -> Config:
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
    def qwen3_30b_a3b(cls: type[Config], **overrides: Any) -> Config:
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
    def mixtral_8x7b(cls: type[Config], **overrides: Any) -> Config:
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
    def _gemma(cls: type[Config], fields: dict[str, Any], every: int) -> Config:
        """A Gemma 2/3 preset whose layer pattern (every ``every``-th layer full) follows its
        ``num_layers`` unless ``layer_types`` is given."""
        fields.setdefault("layer_types", alternating_layers(fields["num_layers"], every))
        return cls(**fields)

    @classmethod
    def gemma2_2b(cls: type[Config], **overrides: Any) -> Config:
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
    def gemma2_9b(cls: type[Config], **overrides: Any) -> Config:
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
    def gemma3_1b(cls: type[Config], **overrides: Any) -> Config:
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
    def gemma3_4b(cls: type[Config], **overrides: Any) -> Config:
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
    def phi3_mini_4k(cls: type[Config], **overrides: Any) -> Config:
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
    def gpt2(cls: type[Config], **overrides: Any) -> Config:
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
