"""Tiny random Hugging Face models built in-process (nothing is downloaded)."""

from __future__ import annotations

import numpy as np

_BASE = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
FAMILY_CASES = {
    "llama": dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    ),
    # Llama 3.x RoPE scaling, with an original context short enough that all three frequency
    # bands (kept, ramped, divided) occur at head_dim 8.
    "llama3": dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=128,
        rope_theta=500.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # A window shorter than the test sequences, so the sliding-window mask matters.
    "mistral": dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        sliding_window=4,
    ),
    "qwen2": dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    ),
    "gemma": dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=128,
    ),
    "gpt2": dict(
        vocab_size=128,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=128,
        bos_token_id=0,
        eos_token_id=0,
    ),
    # Llama 3.2: Llama 3.x RoPE scaling, tied embeddings, head_dim apart from D / N.
    "llama3_2": _BASE
    | dict(
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
        rope_theta=500.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # Qwen2 with use_sliding_window: layer 0 full, layer 1 sliding (max_window_layers=1).
    "qwen2_sliding": _BASE | dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "qwen3": _BASE | dict(head_dim=16),
    "qwen3_tied": _BASE | dict(head_dim=16, tie_word_embeddings=True, attention_bias=True),
    # Gemma 2: soft-caps the random logits reach, query scale apart from head_dim, a window
    # shorter than the test sequences on the first (sliding) of two layers.
    "gemma2": _BASE
    | dict(
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=4,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=8.0,
    ),
    # Gemma 3: q/k norms, a sliding layer with its own RoPE base, then a full layer with
    # linear RoPE scaling.
    "gemma3": _BASE
    | dict(
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    # Phi-3: fused qkv_proj and gate_up_proj; a window; half the head dims rotated.
    "phi3": _BASE
    | dict(sliding_window=4, partial_rotary_factor=0.5, pad_token_id=0, eos_token_id=2),
    "mixtral": _BASE | dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": _BASE
    | dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "qwen3_moe_norm": _BASE
    | dict(
        head_dim=16,
        num_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=24,
        norm_topk_prob=True,
    ),
}
# The transformers family of each case.
CASE_FAMILY = {
    "llama3": "llama",
    "llama3_2": "llama",
    "qwen2_sliding": "qwen2",
    "qwen3_tied": "qwen3",
    "qwen3_moe_norm": "qwen3_moe",
}
NEW_FAMILY_CASES = (
    "llama3_2",
    "qwen2_sliding",
    "qwen3",
    "qwen3_tied",
    "gemma2",
    "gemma3",
    "phi3",
    "mixtral",
    "qwen3_moe",
    "qwen3_moe_norm",
)


def hf_classes(case: str, head: str = "lm"):
    import transformers as tf

    family = CASE_FAMILY.get(case, case)
    names = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", "LlamaForSequenceClassification"),
        "mistral": ("MistralConfig", "MistralForCausalLM", "MistralForSequenceClassification"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "Qwen2ForSequenceClassification"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "Qwen3ForSequenceClassification"),
        "gemma": ("GemmaConfig", "GemmaForCausalLM", "GemmaForSequenceClassification"),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "Gemma2ForSequenceClassification"),
        "gemma3": (
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            "Gemma3TextForSequenceClassification",
        ),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", "Phi3ForSequenceClassification"),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", "MixtralForSequenceClassification"),
        "qwen3_moe": (
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            "Qwen3MoeForSequenceClassification",
        ),
        "gpt2": ("GPT2Config", "GPT2LMHeadModel", "GPT2ForSequenceClassification"),
    }[family]
    return getattr(tf, names[0]), getattr(tf, names[1 if head == "lm" else 2])


def make_hf_model(case: str, head: str = "lm", seed: int = 0):
    """A random HF model whose weights are large enough (std 0.1-0.3, norms around 1) that
    layout or numerics bugs show in the logits, unlike the default 0.02 init."""
    import torch

    config_cls, model_cls = hf_classes(case, head)
    kwargs = dict(FAMILY_CASES[case])
    if head == "scalar":
        kwargs.update(num_labels=1, pad_token_id=0)
    if case == "gpt2":
        kwargs.update(attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def padded_batch(vocab: int, seed: int = 0, lengths=(12, 9, 5), total: int = 12, left=True):
    """Tokens [B, T] and a bool mask with rows of the given lengths, padded left or right."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, size=(len(lengths), total)).astype(np.int32)
    mask = np.zeros((len(lengths), total), bool)
    for b, n in enumerate(lengths):
        if left:
            mask[b, total - n :] = True
        else:
            mask[b, :n] = True
    tokens = np.where(mask, tokens, 0).astype(np.int32)
    return tokens, mask


def hf_outputs(model, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """HF logits [B, T, V] (or per-token scores [B, T]) with explicit position ids."""
    import torch

    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        if hasattr(model, "score"):  # sequence classifier: read the per-token scores
            base = model.base_model_prefix
            hidden = getattr(model, base)(
                input_ids=torch.tensor(tokens, dtype=torch.long),
                attention_mask=torch.tensor(mask, dtype=torch.long),
                position_ids=torch.tensor(positions, dtype=torch.long),
            ).last_hidden_state
            return model.score(hidden)[..., 0].numpy()
        out = model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(positions, dtype=torch.long),
        )
    return out.logits.numpy()
