"""Hugging Face ``config.json`` <-> :class:`ModelConfig`.

Every attribute of a supported family is either *handled* (mapped to a ModelConfig field),
*ignored* because it cannot change the forward pass (listed below), or *checked* against the
one value we support. Anything else raises :class:`UnsupportedConfigError` naming the
attributes, so a checkpoint that needs a feature we lack is refused instead of silently
giving different logits.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from jaxrlhf.models.config import ModelConfig, RopeScaling
from jaxrlhf.models.safetensors_io import CheckpointError

log = logging.getLogger(__name__)


class UnsupportedConfigError(CheckpointError):
    """The Hugging Face config uses an architecture or option jaxrlhf does not implement."""


# Attributes that never change the forward pass of a model in eval mode.
_IGNORED = {
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "initializer_range",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "id2label",
    "label2id",
    "problem_type",
    "_name_or_path",
    "tokenizer_class",
    "generation_config",
    "task_specific_params",
    "chunk_size_feed_forward",
    "is_decoder",
    "is_encoder_decoder",
    "add_cross_attention",
    "tie_encoder_decoder",
    "prefix",
    "finetuning_task",
    "pretraining_tp",  # only splits matmuls in HF's own implementation
    "attention_dropout",
    "attn_pdrop",
    "embd_pdrop",
    "resid_pdrop",  # dropout: train-time only
    "summary_activation",
    "summary_first_dropout",
    "summary_proj_to_labels",
    "summary_type",
    "summary_use_proj",  # GPT-2 double-heads model only
    "max_window_layers",
    "layer_types",
    "use_bidirectional_attention",
    "num_labels",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",
}

_COMMON = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "max_position_embeddings": "max_position_embeddings",
    "rms_norm_eps": "norm_eps",
    "tie_word_embeddings": "tie_embeddings",
}
_GPT2 = {
    "vocab_size": "vocab_size",
    "n_embd": "hidden_size",
    "n_inner": "intermediate_size",
    "n_layer": "num_layers",
    "n_head": "num_heads",
    "n_positions": "max_position_embeddings",
    "layer_norm_epsilon": "norm_eps",
    "tie_word_embeddings": "tie_embeddings",
}
_OPTIONAL = {
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "n_inner",
    "layer_norm_epsilon",
    "n_positions",
}
# attribute -> the only value we implement (None means "must be absent or null").
_CHECKED: dict[str, dict[str, Any]] = {
    "llama": {"hidden_act": "silu"},
    "mistral": {"hidden_act": "silu"},
    "qwen2": {"hidden_act": "silu", "use_sliding_window": False},
    "gemma": {"attention_bias": False},
    "gpt2": {
        "activation_function": "gelu_new",
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "n_ctx": None,
    },
}
_GEMMA_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}
_EXTRA_HANDLED = {
    "llama": {"attention_bias", "mlp_bias"},
    "mistral": {"sliding_window"},
    "qwen2": {"sliding_window"},
    "gemma": {"hidden_act", "hidden_activation"},
    "gpt2": set(),
}


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    params = params or dict(legacy)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind not in ("linear", "llama3"):
        raise UnsupportedConfigError(
            f"rope type {kind!r} is not supported (supported: default, linear, llama3)"
        )
    extra = {
        k: params[k]
        for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if k in params
    }
    return float(theta), RopeScaling(type=kind, factor=float(params["factor"]), **extra)


def from_hf_config(
    hf: dict[str, Any], source: str = "config.json", **overrides: Any
) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config dict.

    Args:
      hf: the parsed config.json.
      source: where it came from, for error messages.
      overrides: ModelConfig fields to set on top (e.g. dtype, remat).

    Raises:
      UnsupportedConfigError: unknown family, unknown attributes, or unsupported values.
    """
    family = hf.get("model_type")
    if family not in _CHECKED:
        raise UnsupportedConfigError(
            f"{source}: model_type {family!r} is not supported (supported: {sorted(_CHECKED)})"
        )
    mapping = _GPT2 if family == "gpt2" else _COMMON
    checked = _CHECKED[family]
    known = set(mapping) | _IGNORED | set(checked) | _EXTRA_HANDLED[family]
    unknown = sorted(k for k in hf if k not in known)
    if unknown:
        raise UnsupportedConfigError(f"{source}: unsupported {family} config attributes {unknown}")
    bad = {
        k: hf[k]
        for k, want in checked.items()
        if k in hf and hf[k] != want and not (want is None and hf[k] is None)
    }
    if family == "gpt2" and hf.get("n_ctx") not in (None, hf.get("n_positions")):
        bad["n_ctx"] = hf["n_ctx"]
    else:
        bad.pop("n_ctx", None)
    if bad:
        raise UnsupportedConfigError(
            f"{source}: unsupported {family} values {bad} (supported: "
            f"{ {k: checked[k] for k in bad} })"
        )
    for key in ("attention_dropout", "attn_pdrop", "embd_pdrop", "resid_pdrop"):
        if hf.get(key):
            log.info("%s: %s=%s ignored (jaxrlhf models run without dropout)", source, key, hf[key])
    if hf.get("num_labels", 1) != 1 or len(hf.get("id2label") or {0: 0}) != 1:
        raise UnsupportedConfigError(f"{source}: only single-label (scalar) heads are supported")

    required = [k for k in mapping if k not in _OPTIONAL and hf.get(k) is None]
    if required:
        raise UnsupportedConfigError(f"{source}: missing required {family} attributes {required}")
    fields: dict[str, Any] = {
        ours: hf[theirs] for theirs, ours in mapping.items() if hf.get(theirs) is not None
    }
    fields.setdefault("tie_embeddings", family in ("gemma", "gpt2"))
    from jaxrlhf.models.config import FAMILY_TRAITS

    traits = dict(FAMILY_TRAITS[family])
    if family == "gpt2":
        fields.setdefault("intermediate_size", 4 * fields["hidden_size"])
    else:
        fields["rope_theta"], fields["rope_scaling"] = _rope(hf)
    if family == "llama":
        bias = bool(hf.get("attention_bias", False))
        traits.update(qkv_bias=bias, out_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)))
    if family == "gemma":
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _GEMMA_ACTIVATIONS:
            raise UnsupportedConfigError(
                f"{source}: gemma activation {act!r} is not one of {sorted(_GEMMA_ACTIVATIONS)}"
            )
        traits["activation"] = _GEMMA_ACTIVATIONS[act]
    if family == "mistral" and hf.get("sliding_window") is not None:
        fields["sliding_window"] = int(hf["sliding_window"])
    traits.pop("tie_embeddings", None)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = hf.get(key)
        fields[key] = tuple(value) if isinstance(value, list) else value
    fields.update(traits)
    fields.update(overrides)
    return ModelConfig(family=family, **fields)


def load_hf_config(directory: str, **overrides: Any) -> ModelConfig:
    """Read ``directory/config.json`` into a ModelConfig (see :func:`from_hf_config`)."""
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"no config.json in {directory}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None
    return from_hf_config(hf, source=path, **overrides)


def checkpoint_head(directory: str) -> str | None:
    """``"lm"`` for a ``*ForCausalLM`` (or GPT-2's ``LMHeadModel``) checkpoint, ``"scalar"``
    for a ``*ForSequenceClassification`` one, from ``config.json``'s ``architectures``; None
    when it names neither (or there is no readable config.json)."""
    try:
        with open(os.path.join(directory, "config.json")) as f:
            architectures = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    for arch in architectures:
        if arch.endswith(("ForCausalLM", "LMHeadModel")):
            return "lm"
        if arch.endswith("ForSequenceClassification"):
            return "scalar"
    return None


_ARCH = {
    "llama": ("LlamaForCausalLM", "LlamaForSequenceClassification"),
    "mistral": ("MistralForCausalLM", "MistralForSequenceClassification"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2ForSequenceClassification"),
    "gemma": ("GemmaForCausalLM", "GemmaForSequenceClassification"),
    "gpt2": ("GPT2LMHeadModel", "GPT2ForSequenceClassification"),
}


_HF_ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}


def to_hf_config(cfg: ModelConfig, head: str = "lm") -> dict[str, Any]:
    """The config.json dict for ``cfg`` (head "lm" -> *ForCausalLM, "scalar" -> a 1-label
    *ForSequenceClassification)."""
    arch = _ARCH[cfg.family][0 if head == "lm" else 1]
    ids = {
        k: (list(v) if isinstance(v, tuple) else v)
        for k, v in (
            ("bos_token_id", cfg.bos_token_id),
            ("eos_token_id", cfg.eos_token_id),
            ("pad_token_id", cfg.pad_token_id),
        )
    }
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": cfg.family,
        "dtype": cfg.param_dtype,
        **ids,
    }
    if head != "lm":
        out.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    if cfg.family == "gpt2":
        return out | {
            "vocab_size": cfg.vocab_size,
            "n_embd": cfg.hidden_size,
            "n_inner": cfg.intermediate_size,
            "n_layer": cfg.num_layers,
            "n_head": cfg.num_heads,
            "n_positions": cfg.max_position_embeddings,
            "layer_norm_epsilon": cfg.norm_eps,
            "activation_function": "gelu_new",
            "tie_word_embeddings": cfg.tie_embeddings,
            "attn_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "resid_pdrop": 0.0,
        }
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope = {"rope_type": s.type, "rope_theta": cfg.rope_theta, "factor": s.factor}
        if s.type == "llama3":
            rope.update(
                low_freq_factor=s.low_freq_factor,
                high_freq_factor=s.high_freq_factor,
                original_max_position_embeddings=s.original_max_position_embeddings,
            )
    out |= {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.dim_per_head,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        # Both spellings: transformers 5 reads rope_parameters, 4.x reads the other two.
        "rope_parameters": rope,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling is None else rope,
        "hidden_act": _HF_ACTIVATIONS[cfg.activation],
    }
    if cfg.family == "llama":
        out |= {"attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias}
    if cfg.family in ("mistral", "qwen2"):
        out["sliding_window"] = cfg.sliding_window
    if cfg.family == "qwen2":
        out["use_sliding_window"] = False
    if cfg.family == "gemma":
        out["hidden_activation"] = _HF_ACTIVATIONS[cfg.activation]
    return out
