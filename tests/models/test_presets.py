"""The new families' presets: their parameter counts against an independent formula and the
model cards' published sizes, and their Hugging Face config.json round trip.

Nothing is compiled: ``abstract_params`` is an ``eval_shape``.
"""

from __future__ import annotations

import pytest

from jaxrlhf.config import PRESETS
from jaxrlhf.models import model as M
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.hf_config import from_hf_config, to_hf_config

# Preset -> (published total parameters, one unit of the card's last digit). Cards:
# meta-llama/Llama-3.2-{1B,3B}, Meta-Llama-3-70B (70.6B), Qwen/Qwen3-*,
# mistralai/Mixtral-8x7B-v0.1, google/gemma-2-* (2.61B, 9.24B), google/gemma-3-1b-pt (1B),
# microsoft/Phi-3-mini-4k-instruct (3.8B); Gemma 3 4B's 4.3B includes its 0.4B vision
# tower, so its language model is checked at 3.9B.
PUBLISHED = {
    "llama3_2_1b": (1.23e9, 0.01e9),
    "llama3_2_3b": (3.21e9, 0.01e9),
    "llama3_70b": (70.6e9, 0.1e9),
    "qwen3_0_6b": (0.6e9, 0.1e9),
    "qwen3_1_7b": (1.7e9, 0.1e9),
    "qwen3_4b": (4.0e9, 0.1e9),
    "qwen3_8b": (8.2e9, 0.1e9),
    "qwen3_30b_a3b": (30.5e9, 0.1e9),
    "mixtral_8x7b": (46.7e9, 0.1e9),
    "gemma2_2b": (2.61e9, 0.01e9),
    "gemma2_9b": (9.24e9, 0.01e9),
    "gemma3_1b": (1.0e9, 0.1e9),
    "gemma3_4b": (3.9e9, 0.1e9),
    "phi3_mini_4k": (3.8e9, 0.1e9),
}


def _formula(cfg: ModelConfig) -> int:
    """Parameters from the architecture: embeddings, per-layer attention, norms and MLP or
    experts (router D x E plus E gated experts of width F_e), final norm, untied head."""
    d, h, n, k = cfg.hidden_size, cfg.dim_per_head, cfg.num_heads, cfg.kv_heads
    attention = d * n * h + 2 * d * k * h + n * h * d + (2 * h if cfg.qk_norm else 0)
    norms = (4 if cfg.post_norms else 2) * d
    if cfg.num_experts:
        mlp = d * cfg.num_experts + cfg.num_experts * 3 * d * cfg.expert_size
    else:
        mlp = 3 * d * cfg.intermediate_size
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    return cfg.vocab_size * d + cfg.num_layers * (attention + norms + mlp) + d + head


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_sizes(name):
    assert name in PRESETS  # selectable as model.preset
    cfg = getattr(ModelConfig, name)()
    count = M.param_count(M.abstract_params(cfg))
    assert count == _formula(cfg)
    published, precision = PUBLISHED[name]
    assert abs(count - published) <= precision, (count, published)


def test_qwen3_30b_a3b_active_parameters():
    """3.3B activated (the model card, to 0.1B): all but 120 experts of every layer."""
    cfg = ModelConfig.qwen3_30b_a3b()
    unused = (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.expert_size
    active = M.param_count(M.abstract_params(cfg)) - cfg.num_layers * unused
    assert abs(active - 3.3e9) <= 0.1e9, active


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_config_json_round_trip(name):
    """to_hf_config then from_hf_config gives the preset back, field for field (head_dim and
    num_kv_heads spelled out: config.json always names them)."""
    cfg = getattr(ModelConfig, name)()
    explicit = cfg.replace(head_dim=cfg.dim_per_head, num_kv_heads=cfg.kv_heads)
    assert from_hf_config(to_hf_config(cfg)) == explicit
