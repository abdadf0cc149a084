"""The model families jaxrlhf implements: their names, the traits that tell them apart, the
RoPE scaling they use and the small shapes ``ModelConfig.tiny`` gives each.

Everything here is data read by :mod:`jaxrlhf.models.config` (the config and its checks),
:mod:`jaxrlhf.models.presets` (the published sizes) and :mod:`jaxrlhf.models.hf_config`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

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
ROPE_SCALING_TYPES = ("linear", "llama3")


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
FAMILY_TRAITS: dict[str, dict[str, Any]] = {
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
TINY_SHAPES: dict[str, dict[str, Any]] = {
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
