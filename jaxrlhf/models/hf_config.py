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

from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.families import FAMILY_TRAITS, LAYER_TYPES, RopeScaling, alternating_layers
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
    "num_labels",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",  # read by _rope_fields
    "auto_map",  # where remote code lives
    "cache_implementation",  # HF generate's cache class
    "output_router_logits",  # whether HF returns router logits
    "router_aux_loss_coef",  # a training choice: ModelConfig.router_aux_loss_coef, default off
    "router_jitter_noise",  # train-time noise on the router input
    # Layer windows are read by _windows.
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "sliding_window_pattern",
    "_sliding_window_pattern",  # Gemma 3's name for it in transformers 5
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
# HF model_type -> our family (where the names differ).
_FAMILY_OF = {"gemma3_text": "gemma3"}
MODEL_TYPES = {family: model_type for model_type, family in _FAMILY_OF.items()}
# attribute -> the only value we implement (None means "must be absent or null").
_CHECKED: dict[str, dict[str, Any]] = {
    "llama": {"hidden_act": "silu"},
    "mistral": {"hidden_act": "silu"},
    "qwen2": {"hidden_act": "silu"},
    "qwen3": {"hidden_act": "silu"},
    "gemma": {"attention_bias": False},
    "gemma2": {"attention_bias": False},
    "gemma3": {"attention_bias": False},
    "phi3": {"hidden_act": "silu", "attention_bias": False},
    "mixtral": {"hidden_act": "silu"},
    "qwen3_moe": {"hidden_act": "silu", "decoder_sparse_step": 1},
    "gpt2": {
        "activation_function": "gelu_new",
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "n_ctx": None,
    },
}
_GEMMA_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}
_GEMMA_EXTRA = {"hidden_act", "hidden_activation", "use_bidirectional_attention"}
_GEMMA2_EXTRA = _GEMMA_EXTRA | {
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "sliding_window_size",  # early Gemma 2 configs: the same as sliding_window
}
_EXTRA_HANDLED = {
    "llama": {"attention_bias", "mlp_bias"},
    "mistral": set(),
    "qwen2": set(),
    "qwen3": {"attention_bias"},
    "gemma": _GEMMA_EXTRA,
    "gemma2": _GEMMA2_EXTRA,
    "gemma3": _GEMMA2_EXTRA | {"rope_local_base_freq"},
    "phi3": {"original_max_position_embeddings"},
    "mixtral": {"num_local_experts", "num_experts_per_tok"},
    "qwen3_moe": {
        "attention_bias",
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "mlp_only_layers",
    },
    "gpt2": set(),
}
_SLIDING_FAMILIES = (
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3",
    "mixtral",
    "qwen3_moe",
)


def _rope(
    params: dict[str, Any], default_theta: float, source: str
) -> tuple[float, RopeScaling | None]:
    """``(theta, scaling)`` of one transformers rope-parameters dict."""
    params = dict(params)
    theta = params.pop("rope_theta", default_theta)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind not in ("linear", "llama3"):
        raise UnsupportedConfigError(
            f"{source}: rope type {kind!r} is not supported (supported: default, linear, llama3)"
        )
    extra = {
        k: params[k]
        for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if k in params
    }
    return float(theta), RopeScaling(type=kind, factor=float(params["factor"]), **extra)


def _rope_fields(hf: dict[str, Any], family: str, source: str) -> dict[str, Any]:
    """rope_theta, rope_scaling, partial_rotary_factor and (Gemma 3) local_rope_theta, from
    transformers 5's ``rope_parameters`` or the legacy ``rope_theta`` / ``rope_scaling``."""
    params = hf.get("rope_parameters") or {}
    default_theta = 1000000.0 if family == "gemma3" else 10000.0
    out: dict[str, Any] = {}
    if family == "gemma3" and "full_attention" in params:  # one dict per layer type
        local_theta, local_scaling = _rope(params.get("sliding_attention") or {}, 10000.0, source)
        if local_scaling is not None:
            raise UnsupportedConfigError(
                f"{source}: RoPE scaling on gemma3 sliding layers is not supported"
            )
        out["local_rope_theta"] = local_theta
        params = params["full_attention"]
    elif family == "gemma3":
        out["local_rope_theta"] = float(hf.get("rope_local_base_freq", 10000.0))
    legacy = dict(hf.get("rope_scaling") or {})
    if not params or set(params) <= {"rope_theta", "partial_rotary_factor"}:
        params = {**legacy, **params}  # rope_type / factor from the legacy rope_scaling
    params.setdefault("rope_theta", hf.get("rope_theta", default_theta))
    out["rope_theta"], out["rope_scaling"] = _rope(
        {k: v for k, v in params.items() if k != "partial_rotary_factor"}, default_theta, source
    )
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    out["partial_rotary_factor"] = float(factor if factor is not None else 1.0)
    return out


def _windows(hf: dict[str, Any], family: str, num_layers: int, source: str) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` as transformers 5 derives them per family
    (Qwen: windows only with use_sliding_window, from layer max_window_layers on; Gemma 2:
    every other layer; Gemma 3: 5 of every 6; Mistral, Mixtral, Phi-3: every layer)."""
    window = hf.get("sliding_window")
    if family in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
        window = None
    types = hf.get("layer_types")
    if types is None and window is not None:
        if family in ("qwen2", "qwen3", "qwen3_moe"):
            first = hf.get("max_window_layers", 28)
            types = [
                "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
            ]
        elif family in ("gemma2", "gemma3"):
            pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern")
            every = 2 if family == "gemma2" else pattern or 6
            types = list(alternating_layers(num_layers, every))
    if types is not None:
        bad = sorted(set(types) - set(LAYER_TYPES))
        if len(types) != num_layers or bad:
            raise UnsupportedConfigError(
                f"{source}: layer_types must list {num_layers} of {list(LAYER_TYPES)}, got "
                f"{len(types)} entries" + (f" with {bad}" if bad else "")
            )
    if window is None or family not in _SLIDING_FAMILIES:
        if window is not None or "sliding_attention" in (types or ()):
            raise UnsupportedConfigError(f"{source}: {family} has no sliding-window attention")
        return {}
    if types is None or set(types) == {"sliding_attention"}:
        return {"sliding_window": int(window)}
    if set(types) == {"full_attention"}:
        return {}
    return {"sliding_window": int(window), "layer_types": tuple(types)}


def _family_fields(hf: dict[str, Any], family: str, source: str) -> dict[str, Any]:
    """The traits a family reads from its own attributes (biases, activations, soft-caps,
    experts)."""
    out: dict[str, Any] = {}
    if family == "llama":
        bias = bool(hf.get("attention_bias", False))
        out.update(qkv_bias=bias, out_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)))
    if family in ("qwen3", "qwen3_moe"):
        bias = bool(hf.get("attention_bias", False))
        out.update(qkv_bias=bias, out_bias=bias)
    if family in ("gemma", "gemma2", "gemma3"):
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _GEMMA_ACTIVATIONS:
            raise UnsupportedConfigError(
                f"{source}: {family} activation {act!r} is not one of {sorted(_GEMMA_ACTIVATIONS)}"
            )
        out["activation"] = _GEMMA_ACTIVATIONS[act]
        if hf.get("use_bidirectional_attention"):
            raise UnsupportedConfigError(
                f"{source}: use_bidirectional_attention=true (an encoder) is not supported"
            )
    if hf.get("sliding_window_size") not in (None, hf.get("sliding_window")):
        raise UnsupportedConfigError(
            f"{source}: sliding_window_size={hf['sliding_window_size']} differs from "
            f"sliding_window={hf.get('sliding_window')}"
        )
    if family in ("gemma2", "gemma3"):
        out["query_pre_attn_scalar"] = float(hf.get("query_pre_attn_scalar", 256))
        for ours, theirs in (
            ("attn_logit_softcap", "attn_logit_softcapping"),
            ("final_logit_softcap", "final_logit_softcapping"),
        ):
            default = {"gemma2": {"attn_logit_softcap": 50.0, "final_logit_softcap": 30.0}}
            value = hf.get(theirs, default.get(family, {}).get(ours))
            out[ours] = None if value is None else float(value)
    if family == "mixtral":
        out.update(
            num_experts=int(hf.get("num_local_experts", 8)),
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
            norm_topk_prob=True,
        )
    if family == "qwen3_moe":
        if hf.get("mlp_only_layers"):
            raise UnsupportedConfigError(
                f"{source}: qwen3_moe with dense layers (mlp_only_layers="
                f"{hf['mlp_only_layers']}) is not supported; every layer must be sparse"
            )
        out.update(
            num_experts=int(hf.get("num_experts", hf.get("num_local_experts", 128))),
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
            moe_intermediate_size=int(hf.get("moe_intermediate_size", 768)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        )
    return out


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
    model_type = hf.get("model_type")
    family = _FAMILY_OF.get(model_type, model_type)
    if family not in _CHECKED or model_type in MODEL_TYPES:
        supported = sorted(MODEL_TYPES.get(f, f) for f in _CHECKED)
        raise UnsupportedConfigError(
            f"{source}: model_type {model_type!r} is not supported (supported: {supported})"
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
    fields.setdefault("tie_embeddings", family in ("gemma", "gemma2", "gemma3", "gpt2"))
    traits = dict(FAMILY_TRAITS[family])
    if family == "gpt2":
        fields.setdefault("intermediate_size", 4 * fields["hidden_size"])
    else:
        fields.update(_rope_fields(hf, family, source))
    fields.update(_windows(hf, family, fields["num_layers"], source))
    traits.update(_family_fields(hf, family, source))
    traits.pop("tie_embeddings", None)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = hf.get(key)
        fields[key] = tuple(value) if isinstance(value, list) else value
    fields.update(traits)
    fields.update(overrides)
    try:
        return ModelConfig(family=family, **fields)
    except ValueError as e:  # e.g. a layer_types list that does not match num_layers
        raise UnsupportedConfigError(f"{source}: {e}") from None


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
    "qwen3": ("Qwen3ForCausalLM", "Qwen3ForSequenceClassification"),
    "gemma": ("GemmaForCausalLM", "GemmaForSequenceClassification"),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2ForSequenceClassification"),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextForSequenceClassification"),
    "phi3": ("Phi3ForCausalLM", "Phi3ForSequenceClassification"),
    "mixtral": ("MixtralForCausalLM", "MixtralForSequenceClassification"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeForSequenceClassification"),
    "gpt2": ("GPT2LMHeadModel", "GPT2ForSequenceClassification"),
}


_HF_ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}


def _rope_dict(theta: float, scaling: RopeScaling | None, partial: float) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        rope = {"rope_type": scaling.type, "rope_theta": theta, "factor": scaling.factor}
        if scaling.type == "llama3":
            rope.update(
                low_freq_factor=scaling.low_freq_factor,
                high_freq_factor=scaling.high_freq_factor,
                original_max_position_embeddings=scaling.original_max_position_embeddings,
            )
    if partial != 1.0:
        rope["partial_rotary_factor"] = partial
    return rope


def _rope_export(cfg: ModelConfig) -> dict[str, Any]:
    """RoPE attributes in both spellings: transformers 5 reads rope_parameters, 4.x reads
    rope_theta / rope_scaling (and Gemma 3's rope_local_base_freq)."""
    rope = _rope_dict(cfg.rope_theta, cfg.rope_scaling, cfg.partial_rotary_factor)
    out: dict[str, Any] = {
        "rope_parameters": rope,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling is None else rope,
    }
    if cfg.partial_rotary_factor != 1.0:
        out["partial_rotary_factor"] = cfg.partial_rotary_factor
    if cfg.family == "gemma3":
        local = _rope_dict(cfg.local_rope_theta or 10000.0, None, cfg.partial_rotary_factor)
        out["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
        out["rope_local_base_freq"] = local["rope_theta"]
    return out


def _windows_export(cfg: ModelConfig) -> dict[str, Any]:
    """sliding_window and layer_types (plus Qwen's use_sliding_window / max_window_layers)."""
    if cfg.family not in _SLIDING_FAMILIES:
        if cfg.sliding_window is not None:
            raise UnsupportedConfigError(
                f"a {cfg.family} checkpoint cannot express sliding_window={cfg.sliding_window}"
            )
        return {}
    sliding = cfg.sliding_layers
    types = ["sliding_attention" if s else "full_attention" for s in sliding]
    out: dict[str, Any] = {"sliding_window": cfg.sliding_window}
    if cfg.family in ("qwen2", "qwen3", "qwen3_moe"):
        first = next((i for i, s in enumerate(sliding) if s), cfg.num_layers)
        if any(not s for s in sliding[first:]):
            raise UnsupportedConfigError(
                f"{cfg.family} slides on every layer from max_window_layers on; layer_types "
                f"{types} cannot be exported"
            )
        out.update(use_sliding_window=cfg.sliding_window is not None, max_window_layers=first)
        if cfg.sliding_window is None:
            out["sliding_window"] = 4096  # transformers' default, unused without the flag
    if cfg.family in ("mistral", "mixtral", "phi3") and not all(sliding) and any(sliding):
        raise UnsupportedConfigError(f"{cfg.family} cannot mix sliding and full layers")
    if cfg.family not in ("mistral", "mixtral", "phi3"):
        out["layer_types"] = types
    return out


def _family_export(cfg: ModelConfig) -> dict[str, Any]:
    """The attributes that only some families have."""
    out: dict[str, Any] = {}
    if cfg.family == "llama":
        out |= {"attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias}
    if cfg.family in ("qwen3", "qwen3_moe"):
        out["attention_bias"] = cfg.qkv_bias
    if cfg.family in ("gemma", "gemma2", "gemma3"):
        out["hidden_activation"] = _HF_ACTIVATIONS[cfg.activation]
        out["attention_bias"] = False
    if cfg.family in ("gemma2", "gemma3"):
        scalar = cfg.query_pre_attn_scalar or cfg.dim_per_head
        out |= {  # transformers insists on an int query_pre_attn_scalar
            "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
            "attn_logit_softcapping": cfg.attn_logit_softcap,
            "final_logit_softcapping": cfg.final_logit_softcap,
            "use_bidirectional_attention": False,
        }
    if cfg.family == "phi3":
        out |= {
            "original_max_position_embeddings": cfg.max_position_embeddings,
            "attention_bias": False,
        }
    if cfg.family == "mixtral":
        out |= {
            "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "router_aux_loss_coef": cfg.router_aux_loss_coef,
        }
    if cfg.family == "qwen3_moe":
        out |= {
            "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.expert_size,
            "norm_topk_prob": cfg.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "router_aux_loss_coef": cfg.router_aux_loss_coef,
        }
    return out


def to_hf_config(cfg: ModelConfig, head: str = "lm") -> dict[str, Any]:
    """The config.json dict for ``cfg`` (head "lm" -> *ForCausalLM, "scalar" -> a 1-label
    *ForSequenceClassification).

    Raises:
      UnsupportedConfigError: ``cfg`` has a feature its family's transformers class lacks
        (e.g. a sliding window on Llama).
    """
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
        "model_type": MODEL_TYPES.get(cfg.family, cfg.family),
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
        "hidden_act": _HF_ACTIVATIONS[cfg.activation],
    }
    return out | _rope_export(cfg) | _windows_export(cfg) | _family_export(cfg)
